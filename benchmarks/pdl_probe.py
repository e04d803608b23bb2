"""Programmatic dependent launch (PDL) on this GPU: does this Triton launch with it, inside CUDA
graphs, and what does it save per kernel boundary in a chain of dependent row-LayerNorm kernels
(1600 x 512 rows, the batch-16 staged body's LN stage shape)?

    python benchmarks/pdl_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from code2wav_bench import timed  # noqa: E402

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def _ln_rows(X, OUT, C: tl.constexpr, eps, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    n = tl.program_id(0)
    offs = tl.arange(0, C)
    x = tl.load(X + n * C + offs)
    mean = tl.sum(x, 0) / C
    d = x - mean
    var = tl.sum(d * d, 0) / C
    tl.store(OUT + n * C + offs, d / tl.sqrt(var + eps) + 1.0)


def chain(bufs, n, pdl):
    kw = {"launch_pdl": True} if pdl else {}
    for i in range(n):
        a, b = bufs[i % 2], bufs[(i + 1) % 2]
        _ln_rows[(a.shape[0],)](a, b, C=a.shape[1], eps=1e-6, PDL=pdl, num_warps=4, **kw)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kernels", type=int, default=800)
    args = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
           "kernels": args.kernels}
    for rows in (1600, 800):
        plain = None    # the stream-order chain's output, which the PDL chain must reproduce
        for pdl in (False, True):
            torch.manual_seed(0)
            x0 = torch.randn(rows, 512, device="cuda")
            bufs = [x0.clone(), torch.empty_like(x0)]
            chain(bufs, 4, pdl)
            torch.cuda.synchronize()
            bufs[0].copy_(x0)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain(bufs, args.kernels, pdl)
            bufs[0].copy_(x0)
            g.replay()
            torch.cuda.synchronize()
            out = bufs[args.kernels % 2].clone()
            ms = statistics.median(timed(g.replay, min_reps=30, max_reps=30))
            key = f"rows{rows}_{'pdl' if pdl else 'plain'}"
            res[key] = {"median_ms": ms, "us_per_kernel": ms * 1e3 / args.kernels}
            if pdl:
                res[key]["same_output_as_stream_order"] = bool(torch.equal(out, plain))
            plain = out
            print(key, res[key], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pdl_probe.json").write_text(json.dumps(res, indent=1))
    (args.out / "pdl_probe.md").write_text(markdown(res))
    return 0


def markdown(res: dict) -> str:
    out = [f"# Programmatic dependent launch, chain of {res.get('kernels', 800)} dependent LN kernels in one CUDA graph "
           f"({res['gpu']})", "", f"torch {res['torch']}, triton {res['triton']}; medians of 30 replays.", "",
           "| rows | launch | ms per replay | us per kernel |", "|---:|---|---:|---:|"]
    for rows in (1600, 800):
        for tag, name in (("plain", "stream order"), ("pdl", "PDL (gdc_wait + launch_dependents first)")):
            r = res[f"rows{rows}_{tag}"]
            out.append(f"| {rows} | {name} | {r['median_ms']:.3f} | {r['us_per_kernel']:.2f} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
