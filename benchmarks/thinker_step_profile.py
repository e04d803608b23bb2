"""Where one Thinker decode step's time goes: the static decoder's step (Triton kernels, one CUDA graph) at
B rows, against what its weights' bytes cost at the GPU's memory bandwidth.

    python benchmarks/thinker_step_profile.py OUT [--rows 1,16] [--context 300] [--blas default,cublaslt]
    python benchmarks/thinker_step_profile.py OUT --tiny --device cpu      # a check of the script

Per row count and BLAS backend it reports:
- ``step ms``: one replay of the decode graph (embedding -> 36 layers -> LM head -> float logits), median of
  CUDA-event timings, every row at position ``--context`` (the attention reads that many keys per row);
- ``GB/s``: the weights one step reads (packed QKV, o_proj, packed gate/up, down_proj, LM head; the KV read is
  added) over that time; the H200's HBM3e peak is 4.8 TB/s;
- each GEMM shape alone: the 36 layers' weights (or the LM head) through ``F.linear`` at M = B rows, one graph
  per shape, so each call streams its weights from HBM as in the step (36 layers' weights do not fit in L2);
- a kernel table of one step (torch.profiler, the eager step: the replay's kernels): time per kernel name, grouped as GEMM / Triton / other;
- the logits pipeline of ``draw_many`` on B rows (greedy: argmax; sampling: upstream's top-k/top-p and draw).

Weights are random (timings do not depend on values). Writes thinker_step_profile.{json,md} into OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import reference_config, tiny_config
from minicpmo_rt.thinker.decode import StaticDecoder
from minicpmo_rt.thinker.generate import SamplingConfig, exponential_noise, process_logits_rows
from minicpmo_rt.thinker.model import Thinker

from code2wav_bench import timed
from features_bench import randomize_on_device_

HBM_PEAK_GBS = 4800.0      # H200 data sheet (HBM3e); the table says which GPU ran


@contextlib.contextmanager
def blas(name: str):
    """torch's preferred BLAS library for the block ("default" leaves it), restored afterwards."""
    if name == "default" or not torch.cuda.is_available():
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def med_ms(fn, dev: torch.device, reps: int) -> float:
    """Median milliseconds per call: ``code2wav_bench.timed``'s CUDA events on a GPU, wall time on the CPU
    (a smoke run), after warm-up calls."""
    if dev.type == "cuda":
        return statistics.median(timed(fn, budget_s=0.0, max_reps=reps, min_reps=reps))
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def graphed(fn, dev: torch.device):
    """``fn`` as one CUDA graph's replay on a GPU (captured after a warm-up on a side stream), else itself."""
    if dev.type != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def kind_of(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk", "sm90_")):
        return "GEMM"
    if name.startswith("_") or "triton" in n:
        return "Triton"
    return "other"


def kernel_table(fn, dev: torch.device, calls: int = 5) -> list[dict]:
    """Kernels of ``calls`` calls of ``fn`` (torch.profiler), per name: count and microseconds per call."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if dev.type == "cuda":
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = ev.device_time
        else:   # the CPU's aten ops stand in for kernels in a smoke run
            if not ev.name.startswith("aten::"):
                continue
            us = ev.self_cpu_time_total
        per[ev.name][0] += 1
        per[ev.name][1] += us
    rows = [{"kernel": k, "kind": kind_of(k), "count_per_call": c / calls, "us_per_call": t / calls}
            for k, (c, t) in per.items()]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", default="1,16", help="decode rows (comma-separated)")
    ap.add_argument("--context", type=int, default=300, help="keys each row attends to")
    ap.add_argument("--blas", default="default,cublaslt", help="torch BLAS backends to compare (CUDA)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="the tiny config (a smoke run, not a measurement)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    rows_list = [int(x) for x in args.rows.split(",") if x]
    blases = [b for b in args.blas.split(",") if b] if dev.type == "cuda" else ["default"]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    args.out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    cfg = MiniCPMOConfig.from_dict(tiny_config() if args.tiny else reference_config())
    with torch.device("meta"):
        thinker = Thinker(cfg)
    llm = thinker.llm.to(dtype).to_empty(device=dev).eval()
    randomize_on_device_(llm)
    lcfg = llm.config
    V, Hd = llm.lm_head.weight.shape
    label = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{dev.type} (smoke run)"
    print(f"{label}: {lcfg.num_hidden_layers} layers, hidden {Hd}, vocab {V}, {dtype}", flush=True)

    result = {"device": label, "dtype": str(dtype), "torch": torch.__version__, "context": args.context,
              "layers": lcfg.num_hidden_layers, "hidden": Hd, "vocab": V, "rows": []}
    max_len = args.context + 2
    base = None
    for B in rows_list:
        for bl in blases:
            with blas(bl), torch.no_grad():
                dec = StaticDecoder(llm, max_len, batch=B, share_weights=base)
                base = base or dec
                shapes = {"qkv": dec.wqkv, "o_proj": [l.self_attn.o_proj.weight for l in dec.layers],
                          "gate_up": dec.w13, "down": [l.mlp.down_proj.weight for l in dec.layers],
                          "lm_head": [llm.lm_head.weight]}
                weight_bytes = sum(w.numel() * w.element_size() for ws in shapes.values() for w in ws)
                kv_bytes = 2 * len(dec.layers) * B * dec.n_kv * args.context * dec.head_dim * dec.k_cache.element_size()
                tokens = torch.randint(0, V, (B,), device=dev)
                pos = torch.full((B,), args.context, dtype=torch.long, device=dev)
                if dev.type == "cuda" and dec.kernels == "triton":
                    dec.decode_graph(tokens, pos)
                    replay = dec._graphs[None][0].replay
                else:
                    replay = lambda: dec.decode(tokens, pos, max_len)     # noqa: E731
                step = med_ms(replay, dev, args.reps)
                gemms = {}
                for name, ws in shapes.items():
                    x = torch.randn(B, ws[0].shape[1], device=dev, dtype=dtype)

                    def calls(ws=ws, x=x):
                        for w in ws:
                            F.linear(x, w)
                    t = med_ms(graphed(calls, dev), dev, max(5, args.reps // 5)) / len(ws)
                    nbytes = ws[0].numel() * ws[0].element_size()
                    gemms[name] = {"shape": list(ws[0].shape), "calls_per_step": len(ws), "us_per_call": t * 1e3,
                                   "GB_per_s": nbytes / (t * 1e-3) / 1e9, "ms_per_step": t * len(ws)}
                # the eager step launches the replay's kernels; profiled eagerly, so no profiler has to see into
                # a graph
                kernels = kernel_table(lambda: dec.decode(tokens, pos, max_len), dev)
                by_kind = defaultdict(float)
                for k in kernels:
                    by_kind[k["kind"]] += k["us_per_call"]
                logits = torch.randn(B, V, device=dev)
                hist = [list(range(i, i + 20)) for i in range(B)]
                term = torch.tensor([151645, 151704], device=dev) % V
                pipes = {}
                for mode, sc in (("greedy", SamplingConfig(greedy=True)), ("sampling", SamplingConfig())):
                    gens = [torch.Generator(device=dev).manual_seed(i) for i in range(B)]

                    def pipe(sc=sc, gens=gens):
                        lg = process_logits_rows(logits.clone(), hist, sc, term, None)
                        if not sc.greedy:
                            p = F.softmax(lg, dim=-1)
                            lg = p / exponential_noise(p, gens)
                        return torch.argmax(lg, dim=-1).tolist()
                    pipes[mode] = med_ms(pipe, dev, max(5, args.reps // 5))
                row = {"rows": B, "blas": bl, "step_ms": step, "weight_GB": weight_bytes / 1e9, "kv_GB": kv_bytes / 1e9,
                       "GB_per_s": (weight_bytes + kv_bytes) / (step * 1e-3) / 1e9, "gemms": gemms,
                       "gemm_ms_sum": sum(g["ms_per_step"] for g in gemms.values()),
                       "profile_us_by_kind": dict(by_kind), "kernels": kernels[:25],
                       "logits_pipeline_ms": pipes}
                result["rows"].append(row)
                print(f"B={B} {bl}: step {step:.3f} ms, {row['GB_per_s']:.0f} GB/s, GEMMs alone "
                      f"{row['gemm_ms_sum']:.3f} ms, by kind {dict((k, round(v)) for k, v in by_kind.items())} us, "
                      f"logits pipeline {pipes}", flush=True)
                if dec is not base:
                    del dec
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    (args.out / "thinker_step_profile.json").write_text(json.dumps(result, indent=1))
    (args.out / "thinker_step_profile.md").write_text(table(result))
    print(table(result))


def table(r: dict) -> str:
    lines = [f"# Thinker decode step ({r['device']}, {r['dtype']}, torch {r['torch']}, full-size random weights)", "",
             f"One replay of the static decoder's step graph (Triton kernels), every row at position {r['context']}; "
             f"medians of CUDA-event timings. GB/s: weights + KV read per step over the step's time (HBM peak "
             f"{HBM_PEAK_GBS:.0f} GB/s on the H200). GEMMs alone: each shape's calls of one step through F.linear, "
             "summed.", "",
             "| rows | BLAS | step ms | GB/s | % of HBM peak | GEMMs alone ms | profile GEMM / Triton / other us | "
             "logits greedy / sampling ms |", "|---:|---|---:|---:|---:|---:|---|---|"]
    for x in r["rows"]:
        k = x["profile_us_by_kind"]
        lines.append(f"| {x['rows']} | {x['blas']} | {x['step_ms']:.3f} | {x['GB_per_s']:.0f} | "
                     f"{100 * x['GB_per_s'] / HBM_PEAK_GBS:.0f} | {x['gemm_ms_sum']:.3f} | "
                     f"{k.get('GEMM', 0):.0f} / {k.get('Triton', 0):.0f} / {k.get('other', 0):.0f} | "
                     f"{x['logits_pipeline_ms']['greedy']:.3f} / {x['logits_pipeline_ms']['sampling']:.3f} |")
    lines += ["", "GEMM shapes alone (us per call, GB/s of weights):", "",
              "| rows | BLAS | " + " | ".join(r["rows"][0]["gemms"]) + " |",
              "|---:|---|" + "---:|" * len(r["rows"][0]["gemms"])]
    for x in r["rows"]:
        lines.append(f"| {x['rows']} | {x['blas']} | " + " | ".join(
            f"{g['us_per_call']:.1f} ({g['GB_per_s']:.0f})" for g in x["gemms"].values()) + " |")
    for x in r["rows"]:
        lines += ["", f"Kernels of one step (eager, the graph's kernels), {x['rows']} rows, {x['blas']} (top 12):", "",
                  "| kernel | kind | per step | us per step |", "|---|---|---:|---:|"]
        for k in x["kernels"][:12]:
            lines.append(f"| `{k['kernel'][:80]}` | {k['kind']} | {k['count_per_call']:.0f} | {k['us_per_call']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
