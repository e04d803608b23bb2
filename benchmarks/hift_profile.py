"""Where a steady HiFT chunk's time goes on the GPU (both HiFT variants, batch 1).

Original HiFT: the F0 graph, the eager excitation and the decode graph of one steady 1-s
chunk (8 cached + 50 new mel frames, 3840 cached excitation samples), each timed alone with
CUDA events, plus the kernels of one decode replay. Causal HiFT: one steady 1-s chunk through
``BoundedStream`` with ``GraphedHiFT`` as its runner (``--causal-blocks``: its block sizes; 16 is
upstream's and the Vocoder's default). Writes OUT/hift_profile.{json,md}.

``--configs`` picks fast-path stages to compare (each on a freshly built model, same weights):

* ``plain``   the graphs only: weight norm per replay, torch element-wise ops, NCHW convs
* ``frozen``  + weight norm frozen once (``freeze_weight_norm(channels_last=False)``)
* ``kernels`` + fused Snake / LeakyReLU / bias / residual / padding kernels (Triton)
* ``fast``    + time-major (NHWC) convs: no cuDNN layout conversions (GraphedHiFT's default)

The causal HiFT's float64 F0 convs run as DGEMMs in every config. Each config also reports the
decode's relative error against the plain eager torch path (IEEE). cuDNN's TF32 flag is the
process default (PyTorch: on) unless ``--ieee-cudnn`` turns it off for the run; the runtime itself
never touches it.

    python benchmarks/hift_profile.py OUT [--configs plain,fast] [--ieee-cudnn]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from code2wav_bench import randomize_, timed  # noqa: E402

CONFIGS = ("plain", "frozen", "kernels", "fast")


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def kernel_table(fn, top: int = 25) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or 0
        if t > 0 and "cuda" in str(getattr(e, "device_type", "")).lower():
            rows.append({"kernel": e.key[:100], "count": e.count, "us": round(t, 1)})
    rows.sort(key=lambda r: -r["us"])
    return rows[:top] + [{"kernel": "TOTAL", "count": sum(r["count"] for r in rows), "us": round(sum(r["us"] for r in rows), 1)}]


def fused_mode(config: str):
    return None if config in ("kernels", "fast") else False


def configure(config: str, model):
    """A GraphedHiFT for ``model`` in the given fast-path configuration (run it inside
    ``hift.fused_kernels(fused_mode(config))``)."""
    from minicpmo_rt.code2wav.hift_graph import GraphedHiFT

    g = GraphedHiFT(model, channels_last=config == "fast")
    if config == "plain":
        model.unfreeze_weight_norm()
    return g


def plain_eager(fn):
    """``fn()`` on the reference path: torch ops, per-call weight norm, NCHW convs."""
    from minicpmo_rt.code2wav import hift
    with hift.fused_kernels(False):
        return fn()


def original_rows(config: str, args, tables: bool) -> dict:
    from minicpmo_rt.code2wav.hift import FULL_SIZE as HIFT_FULL, HiFTGenerator
    from minicpmo_rt.code2wav.precision import ieee_fp32

    out: dict = {}
    model = HiFTGenerator(HIFT_FULL)
    randomize_(model, 3)
    model = model.cuda().eval()
    mel = torch.randn(1, 80, 58, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    src = 0.01 * torch.randn(1, 1, 3840, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode(), ieee_fp32():
        f0 = model.f0_predictor(mel)
        source = model.excitation(f0, gen)
        source[:, :, :3840] = src
        want = plain_eager(lambda: model.decode(mel, source))
        g = configure(config, model)
        for _ in range(3):
            g(mel, src, generator=gen, copy_out=False)
        out["decode rel err vs plain eager"] = rel(g.decode(mel, source), want)
        parts = {
            "whole call": lambda: g(mel, src, generator=gen, copy_out=False),
            "f0 replay": lambda: g.f0(mel),
            "excitation (eager)": lambda: model.excitation(f0, gen),
            "decode replay": lambda: g.decode(mel, source),
        }
        for name, fn in parts.items():
            out[name] = round(med(timed(fn, args.budget)), 3)
            print(f"[{config}] original HiFT {name}: {out[name]:.3f} ms", flush=True)
        out["graphs"] = g.describe()
        if tables:
            out["decode kernels"] = kernel_table(lambda: g.decode(mel, source))
            out["f0 kernels"] = kernel_table(lambda: g.f0(mel))
            if config == args.configs[-1]:
                out["excitation kernels"] = kernel_table(lambda: model.excitation(f0, gen))
    return out


def causal_rows(config: str, args, tables: bool) -> dict:
    from minicpmo_rt.code2wav.hift import FULL_SIZE as HIFT_FULL
    from minicpmo_rt.code2wav.hift_causal import BoundedStream, CausalHiFTGenerator

    out: dict = {}
    cm = CausalHiFTGenerator(HIFT_FULL)
    randomize_(cm, 4)
    cm = cm.cuda().eval()
    g = torch.Generator(device="cuda").manual_seed(5)
    chunks = [torch.randn(1, 80, 50, device="cuda", generator=g) for _ in range(8)]
    # one look-ahead decode of 49 frames, for the accuracy of the configured path
    mel = torch.cat(chunks[:2], dim=2)[:, :, :49].contiguous()
    source = 0.01 * torch.randn(1, 1, 49 * 480, device="cuda", generator=g)
    with torch.inference_mode():
        want = plain_eager(lambda: cm.run_decode(mel, source, finalize=False))
    cg = configure(config, cm)
    with torch.inference_mode():
        for block in args.causal_blocks:
            stream = BoundedStream(cm, block_frames=block, runner=cg)
            for c in chunks[:4]:
                stream.push(c)
            it = iter(chunks[4:] * 100)
            key = f"steady push (50 mel, blocks of {block})"
            out[key] = round(med(timed(lambda: stream.push(next(it)), args.budget)), 3)
            print(f"[{config}] causal HiFT {key}: {out[key]:.3f} ms ({cg.describe()})", flush=True)
            if tables:
                out[f"push kernels (blocks of {block})"] = kernel_table(lambda: stream.push(next(it)))
        out["decode rel err vs plain eager"] = rel(cg.run_decode(mel, source, finalize=False), want)
        out["graphs"] = cg.describe()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget", type=float, default=0.3)
    ap.add_argument("--configs", default="fast", help=f"comma list of {', '.join(CONFIGS)} (default: fast)")
    ap.add_argument("--causal-blocks", default="16,50", help="BoundedStream block sizes (default 16,50)")
    ap.add_argument("--ieee-cudnn", action="store_true", help="cudnn.allow_tf32 = False for this run")
    ap.add_argument("--tables", default="last", choices=("all", "last", "none"),
                    help="kernel tables for every config, the last one (default) or none")
    args = ap.parse_args()
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configs {bad}; choose from {CONFIGS}")
    args.causal_blocks = [int(b) for b in args.causal_blocks.split(",") if b.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ieee_cudnn:
        torch.backends.cudnn.allow_tf32 = False
    from minicpmo_rt.code2wav import hift
    from minicpmo_rt.code2wav.kernels import AVAILABLE as TRITON

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": TRITON,
                 "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32, "configs": {}}
    print(f"cudnn.allow_tf32 = {torch.backends.cudnn.allow_tf32}; triton available: {TRITON}", flush=True)
    for config in args.configs:
        tables = args.tables == "all" or (args.tables == "last" and config == args.configs[-1])
        row: dict = {}
        for variant, fn in (("original", original_rows), ("causal", causal_rows)):
            try:
                with hift.fused_kernels(fused_mode(config)):
                    row[variant] = fn(config, args, tables)
            except Exception as exc:  # noqa: BLE001
                row[variant] = {"error": repr(exc)}
                print(f"[{config}] {variant} HiFT failed: {exc!r}", flush=True)
        res["configs"][config] = row
    (args.out / "hift_profile.json").write_text(json.dumps(res, indent=2))
    lines = [f"# HiFT steady chunk on {res['device']} (torch {res['torch']}), batch 1",
             "", f"cudnn.allow_tf32 = {res['cudnn.allow_tf32']}; Triton: {res['triton']}", ""]
    for config, row in res["configs"].items():
        for variant in ("original", "causal"):
            lines.append(f"## {config}: {variant}")
            lines.append("")
            for k, v in row[variant].items():
                if not isinstance(v, list):
                    lines.append(f"- {k}: {v}")
            for k, v in row[variant].items():
                if isinstance(v, list):
                    lines += ["", f"{config} {variant} {k}:", "", "| kernel | count | us |", "|---|---:|---:|"]
                    lines += [f"| `{r['kernel']}` | {r['count']} | {r['us']} |" for r in v]
            lines.append("")
    (args.out / "hift_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
