"""Where one steady 1-s Code2Wav chunk's GPU time goes, per kernel class, for the solve as the flow calls
it (trimmed: the direct path from batch 4), the untrimmed arena solve and the opt-in slot pool (and the TMA
attention), side by side in one run.

For each batch and variant: the graph replay's median (CUDA events), then one replay under
``torch.profiler`` with every kernel's device time summed by class:

  gemm        cuBLAS / cuBLASLt kernels (nvjet, sm90 xmma, cutlass, split-K reduce) and the Triton
              tile GEMMs (``_wide_gemm``, ``_wide_qkv``)
  attention   the Triton tiled attention (``_attn_fwd``, ``_attn_combine``, the direct ``_attn_direct``)
  block       the persistent block kernel (``_dit_block``: GEMMs, attention and LN in one launch)
  fused       the staged body's Triton stages (residual + LN, q/k head LN, tap sum + LN + Mish)
  step        the Euler-step kernels (``euler_junction``, ``cnn_roll``)
  other       everything else (torch element-wise ops, index_select/copy of the pool's CNN caches)

``gap`` = replay median - the kernels' summed time: what the graph spends between kernels
(launch latency, tails), since a solve's kernels run one after another on one stream. If the
profiler sees no kernels inside a replay (older CUPTI), the same program is profiled eagerly
(``source`` says which); kernel durations are the same, only the gaps differ.

    PYTHONPATH=src python benchmarks/code2wav_replay_profile.py --out DIR [--batches 1,16] [--variants 'FP16|...']

Writes replay_profile.json / replay_profile.md into --out (CUDA only).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from code2wav_bench import L, S, T, _slot_solver, _stream, chunk_inputs, randomize_, timed  # noqa: E402

from minicpmo_rt.code2wav.euler_graph import GraphConfig, WholeEulerSolver  # noqa: E402
from minicpmo_rt.code2wav.flow import Flow  # noqa: E402
from minicpmo_rt.code2wav.flow_config import FULL_SIZE  # noqa: E402
from minicpmo_rt.code2wav.precision import matmul_tf32  # noqa: E402

CLASSES = ("gemm", "attention", "block", "fused", "step", "other")


def kernel_class(name: str) -> str:
    n = name.lower()
    if "_attn_fwd" in n or "_attn_combine" in n or "_attn_direct" in n:
        return "attention"
    if "_dit_block" in n:
        return "block"
    if "euler_junction" in n or "cnn_roll" in n:
        return "step"
    if any(w in n for w in ("residual_mod_ln", "qkv_head_ln", "taps_ln_mish")):
        return "fused"
    if any(w in n for w in ("gemm", "wide_qkv", "nvjet", "xmma", "cutlass", "splitk", "sgemm", "cublas")):
        return "gemm"
    return "other"


def profile_kernels(fn, classify=kernel_class, classes=CLASSES) -> tuple[dict, list[dict]]:
    """(per-class {us, count}, top kernels) of one call of ``fn`` (after one unprofiled call); ``classify``
    maps a kernel's name to one of ``classes`` (other benchmarks pass their own)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_class = {c: {"us": 0.0, "count": 0} for c in classes}
    by_name: dict[str, list] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        c = by_class[classify(e.name)]
        c["us"] += us
        c["count"] += 1
        a = by_name.setdefault(e.name[:100], [0, 0.0])
        a[0] += 1
        a[1] += us
    top = sorted(({"kernel": k, "count": v[0], "us": v[1]} for k, v in by_name.items()), key=lambda r: -r["us"])
    return by_class, top[:12]


def main(argv=None) -> int:
    import triton
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--variants", default="", help="'|'-separated substrings of variant names (default: all)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs CUDA")
    batches = [int(b) for b in args.batches.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    flow = Flow(FULL_SIZE)
    randomize_(flow, 0)
    cfm = flow.to("cuda").eval().decoder
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "query": T, "steps": S, "cache": L, "rows": []}

    def save():
        (args.out / "replay_profile.json").write_text(json.dumps(res, indent=1))
        (args.out / "replay_profile.md").write_text(markdown(res))

    # "the flow's path": the solve as the flow calls it, trimmed (prompt + 100 kept), so from batch 4 the
    # direct attention reads each row's old frames in place and writes its successor (no arena)
    variants = [("the flow's path (trimmed)", "trim"),
                ("the flow's path (trimmed), FP16 operands", "trim16"),
                ("default (arena)", dict()),
                ("pointer-load attention", dict(attn_tma=False)),
                ("cuBLAS GEMMs", dict(wide_gemm=False)),
                ("slot pool", None), ("slot pool, pointer loads", False), ("slot pool, FP16 operands", "slot16")]
    variants = [v for v in variants if not args.variants or any(w in v[0] for w in args.variants.split("|"))]
    for B in batches:
        cnn, att, mu, spk, cond = chunk_inputs(B)
        cfg = GraphConfig(batch_buckets=(B,), query_buckets=(T,), offset_bucket=50, offset_anchor=L, max_graphs=4)
        for name, kw in variants:
            keep = None     # a direct replay writes into the successors its solve bound: they stay alive
            with torch.inference_mode():
                if kw in ("trim", "trim16"):
                    solver = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S,
                                              config=cfg, gemm_operands="fp16" if kw == "trim16" else "fp32")
                    keep = [solver.solve(mu, spk, cond, cnn, att, copy_out=False, trim=(L - 100, 100))]
                elif not isinstance(kw, dict):     # slot pool; kw: its attn_tma (or "slot16": FP16 operands)
                    solver = _slot_solver(cfm, cfg, S, B, L - 100, 100, T, mu.device, "triton-tf32", True,
                                          attn_tma=None if kw == "slot16" else kw,
                                          gemm_operands="fp16" if kw == "slot16" else "fp32")
                    hs = [solver.pool.admit(_stream(cnn, i, B), _stream(att, i, B), L - 100) for i in range(B)]
                    solver.solve_slots(hs, mu, spk, cond)
                else:
                    solver = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S,
                                              config=cfg, **kw)
                    solver.solve(mu, spk, cond, cnn, att, copy_out=False)
                st = next(iter(solver._statics.values()))
                rep = statistics.median(timed(st.graph.replay, args.budget))
                by_class, top = profile_kernels(st.graph.replay)
                source = "replay"
                if sum(c["count"] for c in by_class.values()) == 0:
                    with matmul_tf32(True):
                        by_class, top = profile_kernels(lambda: solver._program(st))
                    source = "eager"
            total = sum(c["us"] for c in by_class.values()) / 1e3
            r = {"batch": B, "variant": name, "replay_ms": rep, "kernels_ms": total, "gap_ms": rep - total,
                 "source": source, "classes": {k: {"ms": v["us"] / 1e3, "count": v["count"]} for k, v in by_class.items()},
                 "top": top}
            res["rows"].append(r)
            print(f"B={B:2d} {name:24s} replay {rep:7.2f} ms, kernels {total:7.2f} ms ({source}): " +
                  ", ".join(f"{k} {v['ms']:.2f}/{v['count']}" for k, v in r["classes"].items() if v["count"]), flush=True)
            for t in top[:8]:
                print(f"      {t['count']:5d} {t['us'] / 1e3:8.3f} ms  {t['kernel']}", flush=True)
            save()
            del solver, st, keep
            gc.collect()
            torch.cuda.empty_cache()
        del cnn, att
        gc.collect()
        torch.cuda.empty_cache()
    print(markdown(res))
    return 0


def markdown(res: dict) -> str:
    lines = [f"# Code2Wav chunk replay, GPU time by kernel class ({res['gpu']})", "",
             f"torch {res['torch']}, triton {res['triton']}; one steady 1-s chunk (query {res['query']}, "
             f"{res['steps']} Euler steps, CFG, cache {res['cache']}), TF32. ms per chunk (kernel count in brackets).",
             "", "| B | variant | replay | kernels | gap | " + " | ".join(CLASSES) + " |",
             "|---|---|---:|---:|---:|" + "---:|" * len(CLASSES)]
    for r in res["rows"]:
        cells = [f"{r['classes'][c]['ms']:.2f} ({r['classes'][c]['count']})" if r["classes"][c]["count"] else "—"
                 for c in CLASSES]
        lines.append(f"| {r['batch']} | {r['variant']} | {r['replay_ms']:.2f} | {r['kernels_ms']:.2f} | "
                     f"{r['gap_ms']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
