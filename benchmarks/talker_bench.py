"""Talker decode-step latency on the GPU: full-size random weights, bf16, batch 1/8/16,
eager vs CUDA-graph replay. Writes JSON + Markdown to --out.

    python benchmarks/talker_bench.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, reference_config, tiny_config
from minicpmo_rt.talker.engine import TalkerEngine, TalkerRequest
from minicpmo_rt.talker.model import MiniCPMTTS, rebuild_rotary_
from minicpmo_rt.talker.sampler import SamplingParams


def time_steps(fn, iters: int, device) -> list[float]:
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter(); fn(); out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU (smoke test of the script)")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--kv-len", type=int, default=512, help="attention span of the captured step")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = MiniCPMOConfig.from_dict(tiny_config() if args.tiny else reference_config())
    with torch.device("meta"):
        tts = MiniCPMTTS(cfg.tts)
    tts = tts.to_empty(device=device)
    randomize_(tts, seed=0, prefix="tts.")
    tts = tts.to(dtype).eval()
    rebuild_rotary_(tts)  # non-persistent inv_freq is garbage after to_empty
    params = SamplingParams(min_codes=10**6, max_codes=3000)
    rows = []
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    for B in [int(b) for b in args.batches.split(",")]:
        budget = (4 << 30) if B > 8 else (2 << 30)
        for mode in (["eager", "graph"] if device.type == "cuda" else ["eager"]):
            eng = TalkerEngine(tts, capacity=B, kv_budget_bytes=budget, params=params)
            if mode == "graph":
                eng.capture_cuda_graph(kv_len=args.kv_len)
                step = eng._graph.replay
            else:
                step = lambda: eng.decode_step(args.kv_len)  # noqa: E731
            for i in range(B):
                eng.submit(TalkerRequest(f"r{i}", torch.randint(0, 150000, (80,)),
                                         torch.randn(80, cfg.tts.llm_dim), seed=i, max_codes=400))
            eng._admit()
            for _ in range(10):
                step()
            iters = args.iters if device.type == "cuda" else 5
            ms = time_steps(step, iters, device)
            med = statistics.median(ms)
            rows.append({"batch": B, "mode": mode, "kv_len": args.kv_len, "step_ms_median": med,
                         "step_ms_p90": sorted(ms)[int(0.9 * len(ms)) - 1],
                         "codes_per_s_per_slot": 1000.0 / med, "x_realtime_per_slot": 1000.0 / med / 25.0})
            print(f"B={B:2d} {mode:5s} step {med:7.3f} ms  {1000/med:8.1f} codes/s/slot  "
                  f"{1000/med/25:6.1f}x real time")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": gpu, "dtype": str(dtype), "torch": torch.__version__, "tiny": args.tiny, "rows": rows}
    stem = "talker_decode" + ("_tiny_cpu" if args.tiny else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Talker decode step ({gpu}, {dtype}, attention span {args.kv_len})", "",
             "| batch | mode | step median (ms) | p90 (ms) | codes/s per slot | x real time per slot |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['mode']} | {r['step_ms_median']:.3f} | {r['step_ms_p90']:.3f} | "
                     f"{r['codes_per_s_per_slot']:.1f} | {r['x_realtime_per_slot']:.1f} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
