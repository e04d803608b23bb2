"""A fresh Code2Wav's first stream: time to open it and each of its first chunks, precapture off vs on.

Full-size random weights, fp32 on CUDA, the knobs' default fast path (fused CFM body, Whole-Euler graphs,
TF32 scoped to the DiT; encoder and causal HiFT from per-shape graphs), a 6-s voice prompt. Each run builds a
new ``Code2Wav`` (new CFM solver, encoder graphs and ``GraphedHiFT``, so no graph survives from an earlier
run) on the same weights, opens one stream and pushes six 1-s payloads (3 context + 25 codes), timing
``open_stream`` and each ``push`` on the host with a device synchronisation (a stream's latency, not GPU
time). With ``cfm_graph_precapture: false`` graphs are captured lazily: the CFM's at a shape's first solve,
the encoder's and HiFT's at a shape's second call (the first runs eagerly). With it on (the default),
the first ``open_stream`` precaptures the CFM graphs and runs the warm-up stream (``Code2Wav.prepare``); the
third variant calls ``Code2Wav.prepare(voice)`` before the stream opens, as a server does at start-up (timed
apart: "prepare (load)"). The prompt's solve falls in ``open_stream`` except where ``prepare`` did it.

Run order: one discarded run (Triton's JIT and cuDNN's autotuning happen there, once per process), then
the variants alternating, ``--runs`` each; the table gives each column's median. Writes JSON + Markdown to
--out. ``--tiny --device cpu`` is a smoke run of the script (no graphs there).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from code2wav_pipeline_bench import bench_models, device_label
from minicpmo_rt.code2wav.pipeline import Code2Wav
from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder, VocoderSet

CHUNKS = 6
# (label, cfm_graph_precapture, Code2Wav.prepare before the stream opens)
VARIANTS = (("precapture off (lazy graphs)", False, False), ("precapture on (default): at the first open_stream", True,
            False), ("precapture on, Code2Wav.prepare(voice) at load", True, True))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def stream_payloads(g: torch.Generator, chunks: int = CHUNKS) -> list[list[int]]:
    """``chunks`` steady 1-s payloads of random codes drawn from ``g``: 3 context codes (silence first, then the
    previous payload's last 3) + 25 new ones."""
    codes = torch.randint(0, 6561, (25 * chunks,), generator=g).tolist()
    return [[4218] * 3 + codes[:25]] + [codes[i - 3:i + 25] for i in range(25, 25 * chunks, 25)]


def fresh_code2wav(flow, gen, extra: dict) -> Code2Wav:
    """A new ``Code2Wav`` (its own CFM solver, encoder graphs and ``GraphedHiFT``, so no graph carries over)
    on the shared flow and causal HiFT weights, its fast path configured from the knobs ``extra``."""
    voc = Vocoder(gen, CAUSAL)
    c2w = Code2Wav(flow, VocoderSet(voc, voc), frontend=None, n_timesteps=10)
    c2w.configure_fast_path(extra)
    return c2w


def release(dev: torch.device) -> None:
    """Free what a dropped instance held (its graphs' memory pools) before the next run builds its own."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def one_run(flow, gen, feats, dev, precapture: bool, prepare: bool, payloads) -> dict:
    c2w = fresh_code2wav(flow, gen, {"cfm_graph_precapture": precapture})
    _sync(dev)
    t = time.perf_counter()
    if prepare:
        c2w.prepare(feats)
        _sync(dev)
    prepare_ms = 1000 * (time.perf_counter() - t)
    t = time.perf_counter()
    stream = c2w.open_stream(feats)
    _sync(dev)
    open_ms = 1000 * (time.perf_counter() - t)
    chunks = []
    for p in payloads:
        t = time.perf_counter()
        stream.push(p)
        _sync(dev)
        chunks.append(1000 * (time.perf_counter() - t))
    stream.close()
    sets = c2w.stream_graph_sets()
    solver = c2w.flow.chunk_solver
    graphs = {k: len(g.graphs) for k, g in sets.items()}
    graphs["CFM"] = len(solver.graphs()) if solver is not None and hasattr(solver, "graphs") else 0
    out = {"prepare_ms": prepare_ms, "open_ms": open_ms, "chunk_ms": chunks, "graphs": graphs,
           "choice": c2w.choice.describe()}
    del c2w, stream
    release(dev)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=2, help="runs per variant (after one discarded run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny flow/HiFT sizes (smoke run of the script)")
    args = ap.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("minicpmo_rt.code2wav.pipeline").setLevel(logging.INFO)   # precapture / warm-up times
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    dev = torch.device(args.device)
    flow, gen, feats, g = bench_models(args.tiny, dev)
    payloads = stream_payloads(g)

    gpu = device_label(dev)
    res = {"gpu": gpu, "torch": torch.__version__, "chunks": CHUNKS, "runs": {v[0]: [] for v in VARIANTS}}
    res["discarded_run"] = one_run(flow, gen, feats, dev, True, False, payloads)   # JIT compiles land here
    print("discarded run (JIT, autotuning)", res["discarded_run"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_chunk_bench.json").write_text(json.dumps(res, indent=2))
    order = [v for _ in range(args.runs) for v in VARIANTS]
    for label, pre, prep in order:
        r = one_run(flow, gen, feats, dev, pre, prep, payloads)
        res["runs"][label].append(r)
        print(label, r, flush=True)
        args.out.mkdir(parents=True, exist_ok=True)   # after every run, so a cut-off run keeps its numbers
        (args.out / "first_chunk_bench.json").write_text(json.dumps(res, indent=2))

    med = {}
    for label, *_ in VARIANTS:
        runs = res["runs"][label]
        med[label] = {"prepare_ms": statistics.median(r["prepare_ms"] for r in runs),
                      "open_ms": statistics.median(r["open_ms"] for r in runs),
                      "chunk_ms": [statistics.median(r["chunk_ms"][k] for r in runs) for k in range(CHUNKS)]}
    res["medians"] = med
    (args.out / "first_chunk_bench.json").write_text(json.dumps(res, indent=2))
    lines = [f"# A fresh Code2Wav's first stream ({gpu}, torch {res['torch']})", "",
             "Host time with a device synchronisation, ms, median of "
             f"{args.runs} run(s) per variant after one discarded run; full-size random weights, 6-s prompt, "
             "payloads of 3 context + 25 codes (1 s of audio each). Chunk 1 has no vocoder cache; chunks 2-3 "
             "grow the flow cache; from chunk 3 the stream is steady (cache prompt + 100 frames).", "",
             "| variant | prepare (load) | open_stream | " + " | ".join(f"chunk {k + 1}" for k in range(CHUNKS))
             + " | open + first chunk | graphs held after the stream |",
             "|---|---:|---:|" + "---:|" * CHUNKS + "---:|---|"]
    for label, *_ in VARIANTS:
        m = med[label]
        held = ", ".join(f"{k} {v}" for k, v in res["runs"][label][-1]["graphs"].items())
        chunks = " | ".join(f"{x:.1f}" for x in m["chunk_ms"])
        lines.append(f"| {label} | {m['prepare_ms']:.1f} | {m['open_ms']:.1f} | {chunks} | "
                     f"{m['open_ms'] + m['chunk_ms'][0]:.1f} | {held} |")
    (args.out / "first_chunk_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
