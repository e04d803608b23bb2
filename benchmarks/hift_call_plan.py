"""The stream vocoder's HiFT stage calls over the churn benchmark's schedule, planned as on the GPU: exact-shape
groups only, with a call's padding rows filled by shorter look-ahead calls, or also with calls of fewer than
``GraphedHiFT.GROW_ROWS`` rows grown past their bucket to take shorter calls along (``hift._plan_calls``).

The plan depends only on the calls' shapes and the graph runner's batch buckets, not on the device or the
weights, so this runs on the CPU: tiny random weights, the graph runner (``GraphedHiFT``, eager off CUDA, with
its buckets) and its decode blocks of 50 frames, the schedule of ``stream_churn_bench.py`` (16 request slots,
60 rounds, seed 0). Counts every stage call (a batched call once) by op, bucket and final flag. Writes JSON +
Markdown to ``--out``.

    python benchmarks/hift_call_plan.py --out DIR
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path

import numpy as np
import torch

from stream_churn_bench import VARIANTS, _write, build, push_round, schedule
from code2wav_pipeline_bench import bench_models
from minicpmo_rt.code2wav import hift
from minicpmo_rt.code2wav.hift_graph import ROW_BUCKETS, GraphedHiFT

PLANS = ("exact shapes only", "padding rows filled", "padding rows filled, small calls grown")


class Grown(GraphedHiFT):
    """The graph runner planning as on CUDA (``grow_rows`` is 0 off CUDA, where its calls are eager)."""
    grow_rows = GraphedHiFT.GROW_ROWS


def bucket(rows: int) -> int:
    return next((b for b in ROW_BUCKETS if b >= rows), rows)


def run(plan_name: str, flow, gen, feats, slots: int, rounds: int, seed: int) -> list[list[tuple]]:
    """Per round, the stage calls as (op, rows, finalize)."""
    c2w = build(flow, gen, next(v for v in VARIANTS if "(default)" in v.label), slots)
    voc = c2w.vocoders.stream
    voc.stream_block_frames = 50
    voc.runner = (Grown if plan_name == PLANS[2] else GraphedHiFT)(voc.model, 32, capture_after=2)
    if plan_name == PLANS[0]:
        voc.runner.row_bucket = None        # drive_many then groups exact shapes only
    log: list[tuple] = []
    inner = hift.run_stage

    def counted(runner, calls):
        log.append((calls[0].op, len(calls), calls[0].finalize))
        return inner(runner, calls)
    hift.run_stage = counted
    try:
        g = np.random.default_rng(seed)
        streams: dict[int, object] = {}
        per_round = []
        for active in schedule(slots, rounds, seed):
            log.clear()
            push_round(c2w, feats, streams, active, g)
            per_round.append(list(log))
    finally:
        hift.run_stage = inner
    return per_round


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name in ("slots", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    flow, gen, feats, _ = bench_models(True, torch.device("cpu"))
    res = {"slots": args.slots, "rounds": args.rounds, "seed": args.seed, "buckets": list(ROW_BUCKETS), "plans": {}}
    lines = ["# HiFT stage calls of a serving round, as the graph runner plans them", "",
             f"`stream_churn_bench.py`'s schedule ({args.slots} request slots, {args.rounds} rounds, seed {args.seed}), "
             "planned on the CPU through the graph runner's batch buckets "
             f"{'/'.join(map(str, ROW_BUCKETS))} and decode blocks of 50 frames. A batched call counts once.", "",
             "| plan | stage calls | median per round | F0 | excitation | decode | of them final calls | "
             "look-ahead decode calls at batch 1 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in PLANS:
        per_round = run(name, flow, gen, feats, args.slots, args.rounds, args.seed)
        calls = [c for rnd in per_round for c in rnd]
        by = collections.Counter(f"{op} batch {bucket(rows)}{' final' if fin else ''}" for op, rows, fin in calls)
        ops = collections.Counter(op for op, _, _ in calls)
        res["plans"][name] = {"calls": len(calls), "per_round": [len(r) for r in per_round], "by": dict(by)}
        lines.append(f"| {name} | {len(calls)} | {statistics.median(len(r) for r in per_round):g} | {ops['f0']} | "
                     f"{ops['excite']} | {ops['decode']} | {sum(1 for op, _, fin in calls if fin)} | "
                     f"{sum(1 for op, rows, fin in calls if op == 'decode' and fin is False and bucket(rows) == 1)} |")
        print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    _write(args.out / "hift_call_plan.json", json.dumps(res, indent=2))
    _write(args.out / "hift_call_plan.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
