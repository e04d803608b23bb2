"""CPU real-time factor of the Code2Wav reference path: one steady streamed 1-s chunk
(28 codes = 3 context + 25, 10 Euler steps, CFG, cache at prompt 300 + 100 frames), flow +
HiFT, at tiny and at real size (random weights). Writes JSON + Markdown to --out.

    python benchmarks/code2wav_cpu_rtf.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from minicpmo_rt.checkpoint.tiny import randomize_
from minicpmo_rt.code2wav import flow_config, hift
from minicpmo_rt.code2wav.flow import Flow
from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder, build_generator


def measure(name: str, fcfg, hcfg, steps: int, reps: int) -> dict:
    torch.manual_seed(0)
    flow = Flow(fcfg).eval()
    randomize_(flow, seed=1)
    gen = build_generator(CAUSAL, hcfg).eval()
    randomize_(gen, seed=2)
    voc = Vocoder(gen, CAUSAL)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 6561, (1, 150 + 3), generator=g)
    mel = torch.randn(1, 300, 80, generator=g)
    spk = torch.randn(1, 192, generator=g)
    cache = flow.setup_cache(prompt, mel, spk, n_timesteps=steps)
    stream = voc.open_stream()
    # Warm up to the steady cache length (prompt + 100 frames) with two chunks.
    for _ in range(2):
        _, cache = flow.inference_chunk(torch.randint(0, 6561, (1, 28), generator=g), spk, cache, n_timesteps=steps)
    flow_ms, hift_ms = [], []
    for _ in range(reps):
        tok = torch.randint(0, 6561, (1, 28), generator=g)
        t = time.perf_counter()
        m, new = flow.inference_chunk(tok, spk, cache, n_timesteps=steps)
        t1 = time.perf_counter()
        wav = stream.push(m)
        t2 = time.perf_counter()
        flow_ms.append((t1 - t) * 1e3)
        hift_ms.append((t2 - t1) * 1e3)
        cache = new
    total = statistics.median([a + b for a, b in zip(flow_ms, hift_ms)])
    return {"model": name, "flow_ms": statistics.median(flow_ms), "hift_ms": statistics.median(hift_ms),
            "chunk_ms": total, "rtf": total / 1000.0, "estimator_cache_frames": int(cache.estimator_frames),
            "n_timesteps": steps, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rows = [measure("tiny", flow_config.TINY, hift.TINY, 10, args.reps),
            measure("real size (random weights)", flow_config.FULL_SIZE, hift.FULL_SIZE, 10, args.reps)]
    cpu = platform.processor() or platform.machine()
    res = {"cpu": cpu, "cores": __import__("os").cpu_count(), "torch": torch.__version__, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "code2wav_cpu_rtf.json").write_text(json.dumps(res, indent=2))
    lines = [f"# Code2Wav reference path on CPU ({res['cores']} cores, {cpu}, torch {torch.__version__})", "",
             "One steady streamed 1-s chunk: 28 codes (3 context + 25), 10 Euler steps with CFG, "
             "estimator cache at prompt 300 + 100 frames, causal HiFT. RTF = seconds of compute per second of audio.",
             "", "| model | flow (ms) | HiFT (ms) | chunk (ms) | RTF |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['flow_ms']:.0f} | {r['hift_ms']:.0f} | {r['chunk_ms']:.0f} | {r['rtf']:.2f} |"
              for r in rows]
    (args.out / "code2wav_cpu_rtf.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
