"""The CFM solves of the churn benchmark's rounds, grouped as ``Code2Wav.push_many`` groups them: by cache length
(the default: a stream's first chunk, its second and the steady ones each solve apart, their final chunks joining
their length's solve) or with ``cfm_join_starts`` (every length in one solve, where the solver reads each
stream's cache in place), and the CFM time per round that those solves would take on the H200.

This is a model, not a measurement: the schedule is ``stream_churn_bench.schedule`` (request slots, 60 rounds,
seed 0), every solve is priced at its batch bucket's steady direct solve as called (the issue table's "fused +
graph TF32 on, trimmed, direct" rows of ``results/code2wav_bench_session22_h200.json``, batch 2 from
``results/successor_probe_session22_run2_direct12_h200.json``), whatever its rows' cache lengths (a first chunk's
solve reads 300 old frames instead of 400; the attention is a small part of a solve). Rows past the largest
bucket solve in groups of it. It says what joining could save and where, for the GPU A/B
(``stream_churn_bench.py --starts``) to confirm. Runs anywhere (no model is built). Writes JSON + Markdown.

    python benchmarks/cfm_solve_plan.py --out DIR --slots 16
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from stream_churn_bench import _write, schedule

RESULTS = Path(__file__).parent / "results"
BUCKETS = (1, 2, 4, 8, 16)
POLICIES = ("by cache length (default)", "first and second chunks join (cfm_join_starts)")


def solve_times() -> dict[int, float]:
    """ms per steady direct solve as called, per batch bucket (H200, session 22)."""
    rows = json.loads((RESULTS / "code2wav_bench_session22_h200.json").read_text())["rows"]
    times = {r["batch"]: r["median_ms"] for r in rows if r["row"] == "fused + graph TF32 on, trimmed, direct"}
    probe = json.loads((RESULTS / "successor_probe_session22_run2_direct12_h200.json").read_text())
    times[2] = _probe_b2(probe)
    missing = [b for b in BUCKETS if b not in times]
    if missing:
        raise SystemExit(f"cfm_solve_plan: no solve time for batch bucket(s) {missing} in {RESULTS}")
    return times


def _probe_b2(probe: dict) -> float:
    """The batch-2 direct solve as called, median of the probe's row-copy rows: batch 2 runs the persistent block
    kernel's direct phase, which copies successor rows (``dit_block.ROW_COPY``, on since that probe)."""
    got = [r["called_ms"] for r in probe["rows"] if r["batch"] == 2 and r["variant"].startswith(
        "SUCCESSOR_ROW_COPY=True")]
    if not got:
        raise SystemExit("cfm_solve_plan: the successor probe holds no batch-2 SUCCESSOR_ROW_COPY=True row")
    return statistics.median(got)


def bucket(rows: int) -> int:
    return next(b for b in BUCKETS if b >= rows)


def solves(rows: int) -> list[int]:
    """The buckets ``rows`` rows solve at (groups of the largest bucket, then the rest)."""
    big = BUCKETS[-1]
    return [big] * (rows // big) + ([bucket(rows % big)] if rows % big else [])


def plan_round(active: list[tuple[int, int, bool]], join: bool) -> list[int]:
    """One round's solves (their buckets). A stream's cache length is set by its chunk index: 0 (prompt only),
    1 (prompt + 50), else the steady prompt + 100; finals join the solve of their length (or, joined, the one)."""
    lengths: dict[int, int] = {}
    for _, k, _ in active:
        lengths[min(k, 2)] = lengths.get(min(k, 2), 0) + 1
    if join:
        return solves(sum(lengths.values())) if lengths else []
    return [b for n in lengths.values() for b in solves(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.slots < 1 or args.rounds < 1:
        ap.error(f"--slots and --rounds must be >= 1, got {args.slots} and {args.rounds}")
    times = solve_times()
    plan = schedule(args.slots, args.rounds, args.seed)
    res = {"slots": args.slots, "rounds": args.rounds, "seed": args.seed, "solve_ms": times, "policies": {}}
    for join, name in zip((False, True), POLICIES):
        per = [plan_round(a, join) for a in plan]
        ms = [sum(times[b] for b in r) for r in per]
        res["policies"][name] = {"solves_per_round": [len(r) for r in per], "buckets": per, "cfm_ms": ms}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"cfm_solve_plan_slots{args.slots}"
    _write(args.out / f"{stem}.json", json.dumps(res, indent=2))

    base = res["policies"][POLICIES[0]]
    lines = [f"# CFM solves per churn round, by cache length or joined ({args.slots} slots, a model)", "",
             f"`stream_churn_bench` schedule ({args.slots} request slots, {args.rounds} rounds, seed {args.seed}); "
             "each solve priced at its batch bucket's steady direct solve as called on the H200 (session 22: "
             + ", ".join(f"B={b} {t:.2f}" for b, t in sorted(times.items())) + " ms). A model of the CFM's share "
             "of a round, not a measurement: `stream_churn_bench.py --starts` measures it.", "",
             "| policy | solves per round (median) | mean | rows per solve | CFM ms per round (median) | mean | "
             "all rounds | vs default |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows = sum(len(a) for a in plan)
    for name in POLICIES:
        p = res["policies"][name]
        n, ms = p["solves_per_round"], p["cfm_ms"]
        lines.append(f"| {name} | {statistics.median(n):.0f} | {statistics.mean(n):.2f} | {rows / max(1, sum(n)):.1f} | "
                     f"{statistics.median(ms):.1f} | {statistics.mean(ms):.1f} | {sum(ms):.0f} | "
                     f"{sum(base['cfm_ms']) / max(sum(ms), 1e-9):.2f}x |")
    _write(args.out / f"{stem}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
