"""Steady stream-vocoder rounds, bounded against carried decoding (``Vocoder.stream_carry``, ``hift_carry``).

The full-size causal HiFT as ``load_vocoder`` serves it (random weights, weight norm fused; on CUDA the default
graph runner), decode blocks of 50 frames. Per batch B: B streams push one 50-frame chunk per round through
``push_many``. After 3 warm-up rounds (first chunk, growth, graph captures), ``--rounds`` steady rounds are timed
per side, the sides alternating round by round; ms per round, device synchronised around each. Also the
relative difference of the two sides' audio (they compute the same samples in another order). Writes JSON +
Markdown to ``--out``.

    python benchmarks/hift_carry_bench.py --out DIR [--batches 1,16] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from code2wav_pipeline_bench import bench_device, bench_models, device_label, parse_batches
from first_chunk_bench import _sync
from minicpmo_rt.atomic import atomic_write
from minicpmo_rt.code2wav.hift import fuse_weight_norm
from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder

WARM = 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=10, help="timed steady rounds per side")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny HiFT (smoke run of the script)")
    args = ap.parse_args()
    batches = parse_batches(ap, args.batches)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    dev = bench_device("hift_carry_bench", args.device)
    _, gen, _, _ = bench_models(args.tiny, dev)
    gen = fuse_weight_norm(gen)
    # a CPU run here is a measurement too (eager convs), not only a smoke run
    res = {"gpu": device_label(dev) if dev.type == "cuda" else "CPU", "torch": torch.__version__, "rounds": args.rounds, "rows": []}
    g = torch.Generator().manual_seed(0)
    for b in batches:
        sides = {name: Vocoder(gen, CAUSAL, stream_block_frames=50, stream_carry=carry)
                 for name, carry in (("bounded", False), ("carried", True))}
        streams = {name: [v.open_stream() for _ in range(b)] for name, v in sides.items()}
        times: dict[str, list[float]] = {name: [] for name in sides}
        worst = 0.0
        with torch.inference_mode():
            for r in range(WARM + args.rounds):
                chunk = [(torch.randn(1, 80, 50, generator=g) - 5).to(dev) for _ in range(b)]
                outs = {}
                for name, v in sides.items():
                    _sync(dev)
                    t = time.perf_counter()
                    outs[name] = v.push_many([(s, c, False) for s, c in zip(streams[name], chunk)])
                    _sync(dev)
                    if r >= WARM:
                        times[name].append((time.perf_counter() - t) * 1e3)
                for x, y in zip(outs["carried"], outs["bounded"]):
                    worst = max(worst, float((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)))
        row = {"batch": b, "bounded_ms": statistics.median(times["bounded"]),
               "carried_ms": statistics.median(times["carried"]), "rel_diff": worst,
               "path": sides["carried"].describe_stream_path()}
        row["ratio"] = row["bounded_ms"] / row["carried_ms"]
        res["rows"].append(row)
        print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out / "hift_carry_bench.json", lambda f: f.write(json.dumps(res, indent=2).encode()))
    lines = [f"# Steady stream-vocoder rounds, bounded vs carried decoding ({res['gpu']}, torch {res['torch']})", "",
             f"B streams push a 50-frame chunk per round (`push_many`, decode blocks of 50 frames); medians of "
             f"{args.rounds} steady rounds per side, sides alternating, ms per round.", "",
             "| B | bounded | carried | bounded / carried | audio rel diff |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['bounded_ms']:.2f} | {r['carried_ms']:.2f} | {r['ratio']:.2f}x | "
              f"{r['rel_diff']:.1e} |" for r in res["rows"]]
    lines += ["", f"Carried path: {res['rows'][-1]['path']}." if res["rows"] else ""]
    text = "\n".join(lines) + "\n"
    atomic_write(args.out / "hift_carry_bench.md", lambda f: f.write(text.encode()))
    print(text)


if __name__ == "__main__":
    main()
