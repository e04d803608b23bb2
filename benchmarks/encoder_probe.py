"""Where the flow's encoder half of a streamed chunk spends its time (the churn benchmark's ``--breakdown`` puts
~12 ms of a 16-stream round there, in ~4 calls).

Full-size random weights (``code2wav_pipeline_bench.bench_models``), the knobs' default fast path on CUDA. For
each batch: ``b`` streams of one voice pushed through 3 steady chunks (their caches at the trimmed steady
length), then a steady chunk's encoder half timed, medians of ``--reps`` calls, ms:

  * ``as called``: ``Flow.encode_chunk`` on the streams' stacked encoder caches (CUDA graph replay), host time
    with a device synchronisation before and after;
  * ``stack + split + trim``: the cache copies around it in ``inference_chunk_many`` (stack the streams'
    caches, trim the new one, split it per stream);
  * ``replay (events)``: the same call's device time between CUDA events;
  * ``half, stacked``: the whole encoder half as ``inference_chunk_many`` ran it before session 27 (stack the
    caches, ``encode_chunk`` copying its outputs out, trim the batch, split it per stream), and ``half, cut
    out``: ``Flow.encode_streams`` (each stream's trimmed cache copied straight out of the graph's output),
    where the tree has it;
  * ``eager``: ``Flow._encode`` without graphs (host time with synchronisation).

Then a ``torch.profiler`` table of one eager call at the largest batch: device time by kernel name (top
``--top``), with the kernel count. Writes JSON + Markdown to ``--out``. ``--tiny --device cpu`` is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from code2wav_bench import timed
from code2wav_pipeline_bench import bench_device, bench_models, device_label
from first_chunk_bench import _sync
from minicpmo_rt.atomic import atomic_write
from minicpmo_rt.code2wav.flow import split_encoder_cache, stack_encoder_caches
from minicpmo_rt.code2wav.pipeline import Code2Wav
from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder, VocoderSet

SILENCE = 4218


def _host_ms(fn, dev, reps: int) -> float:
    out = []
    for _ in range(reps):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        out.append(1000 * (time.perf_counter() - t))
    return statistics.median(out)


def _event_ms(fn, dev, reps: int) -> float:
    """Median CUDA-event time of ``reps`` calls (``code2wav_bench.timed``); NaN off CUDA."""
    if dev.type != "cuda":
        return float("nan")
    return statistics.median(timed(fn, budget_s=float("inf"), max_reps=reps, min_reps=reps))


def probe(c2w: Code2Wav, feats, dev, b: int, reps: int, g: torch.Generator) -> tuple[dict, tuple]:
    streams = [c2w.open_stream(feats) for _ in range(b)]
    payload = lambda: [SILENCE] * 3 + torch.randint(0, 6561, (25,), generator=g).tolist()  # noqa: E731
    for _ in range(3):
        c2w.push_many([(s, payload(), False) for s in streams])
    flow = c2w.flow
    token = torch.randint(0, 6561, (b, 28), generator=g).to(dev)
    spk = torch.cat([s.spk for s in streams])
    encs = [s.cache.encoder for s in streams]
    enc = stack_encoder_caches(encs) if b > 1 else encs[0]
    p = streams[0].prompt_frames
    call = lambda: flow.encode_chunk(token, spk, enc, False)  # noqa: E731
    with torch.inference_mode():
        for _ in range(3):
            call()
        _, _, new = call()
        row = {"batch": b, "token_frames": int(enc.att.shape[3] // 2) if enc.att.dim() > 3 else None,
               "as_called_ms": _host_ms(call, dev, reps),
               "stack_split_trim_ms": _host_ms(lambda: split_encoder_cache(
                   flow.trim_encoder_cache(new, p), [1] * b) if b > 1 else flow.trim_encoder_cache(new, p), dev, reps)
               + (_host_ms(lambda: stack_encoder_caches(encs), dev, reps) if b > 1 else 0.0),
               "replay_event_ms": _event_ms(call, dev, reps)}

        def stacked():
            e = stack_encoder_caches(encs) if b > 1 else encs[0]
            _, _, nxt = flow.encode_chunk(token, spk, e, False)
            t = flow.trim_encoder_cache(nxt, p)
            return split_encoder_cache(t, [1] * b) if b > 1 else t

        row["half_stacked_ms"] = _host_ms(stacked, dev, reps)
        if hasattr(flow, "encode_streams"):
            row["half_cut_ms"] = _host_ms(lambda: flow.encode_streams(token, spk, encs, False, [p] * b), dev, reps)
        graphs, flow.encoder_graphs = flow.encoder_graphs, None
        try:
            eager = lambda: flow.encode_chunk(token, spk, enc, False)  # noqa: E731
            eager()
            row["eager_ms"] = _host_ms(eager, dev, reps)
        finally:
            flow.encoder_graphs = graphs
    for s in streams:
        s.close()
    return row, (token, spk, enc)


def kernel_table(flow, args, dev, top: int) -> list[dict]:
    token, spk, enc = args
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    graphs, flow.encoder_graphs = flow.encoder_graphs, None
    try:
        with torch.inference_mode(), torch.profiler.profile(activities=acts) as prof:
            flow.encode_chunk(token, spk, enc, False)
            _sync(dev)
    finally:
        flow.encoder_graphs = graphs
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0
        if dev.type == "cuda" and t and not e.key.startswith(("aten::", "cuda", "Memcpy", "Memset")) or (
                dev.type == "cuda" and e.key.startswith(("Memcpy", "Memset"))):
            rows.append({"kernel": e.key[:90], "count": e.count, "device_us": t})
        elif dev.type != "cuda" and e.key.startswith("aten::"):
            rows.append({"kernel": e.key, "count": e.count, "device_us": e.self_cpu_time_total})
    rows.sort(key=lambda r: -r["device_us"])
    total = {"kernel": "(all)", "count": sum(r["count"] for r in rows), "device_us": sum(r["device_us"] for r in rows)}
    return [total] + rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny flow/HiFT sizes (smoke run of the script)")
    args = ap.parse_args()
    try:
        batches = [int(x) for x in args.batches.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--batches {args.batches!r}: expected comma-separated integers, e.g. 1,4,16")
    if not batches or min(batches) < 1 or args.reps < 1:
        ap.error("--batches needs sizes >= 1 and --reps >= 1")
    dev = bench_device("encoder_probe", args.device)
    flow, gen, feats, g = bench_models(args.tiny, dev)
    voc = Vocoder(gen, CAUSAL)
    c2w = Code2Wav(flow, VocoderSet(voc, voc), frontend=None, n_timesteps=10)
    c2w.configure_fast_path({})
    gpu = device_label(dev)
    res = {"gpu": gpu, "torch": torch.__version__, "rows": [], "kernels": []}
    last = None
    for b in batches:
        row, last = probe(c2w, feats, dev, b, args.reps, g)
        res["rows"].append(row)
        print(row, flush=True)
    res["kernels"] = kernel_table(flow, last, dev, args.top)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out / "encoder_probe.json", lambda f: f.write(json.dumps(res, indent=2).encode()))
    lines = [f"# The flow's encoder half of a steady chunk ({gpu}, torch {res['torch']})", "",
             "Full-size random weights, default fast path; the streams' caches at the trimmed steady length. "
             f"Medians of {args.reps} calls, ms.", "",
             "| batch | as called (graph) | replay (events) | stack + split + trim copies | eager | "
             "half, stacked | half, cut out |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['batch']} | {r['as_called_ms']:.3f} | {r['replay_event_ms']:.3f} | "
                     f"{r['stack_split_trim_ms']:.3f} | {r['eager_ms']:.3f} | {r['half_stacked_ms']:.3f} | "
                     f"{r.get('half_cut_ms', float('nan')):.3f} |")
    lines += ["", f"One eager call at batch {batches[-1]}, device time by kernel (top {args.top}):", "",
              "| kernel | count | us |", "|---|---:|---:|"]
    lines += [f"| {k['kernel']} | {k['count']} | {k['device_us']:.0f} |" for k in res["kernels"]]
    atomic_write(args.out / "encoder_probe.md", lambda f: f.write(("\n".join(lines) + "\n").encode()))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
