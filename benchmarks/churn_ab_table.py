"""Table of a churn_ab.sh run: per side (baseline, new), the medians over its runs of the round median,
the whole 60 rounds, and the rounds with and without final chunks; the warm-up run is left out.

    python benchmarks/churn_ab_table.py DIR --out benchmarks/results/NAME [--title TEXT]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_churn_bench import _write, summary  # noqa: E402

FIELDS = (("median", "round median"), ("total", "all rounds"), ("with_finals", "rounds with finals"),
          ("without_finals", "without"), ("prepare_ms", "prepare"), ("eager", "eager calls"),
          ("captures", "captures"))


def load(folder: Path) -> tuple[dict[str, list[dict]], list[str]]:
    """(each side's run summaries, the devices the runs name (GPU and torch) and the final payloads' code counts
    where not the default)."""
    sides: dict[str, list[dict]] = {}
    devices: set[str] = set()
    finals: set[tuple] = set()
    # run_N_SIDE/stream_churn_bench.json as churn_ab.sh leaves them, or flat copies churn_N_SIDE.json
    found = [(p.name, p / "stream_churn_bench.json") for p in folder.glob("run_*_*")]
    found += [(p.stem, p) for p in folder.glob("churn_*_*.json")]
    for name, path in sorted(found):
        side = name.split("_", 2)[2]
        if side == "warm" or not path.exists():
            continue
        res = json.loads(path.read_text())
        devices.add(f"{res.get('gpu', 'unknown device')}, torch {res.get('torch', '?')}")
        if "final_codes" in res:
            finals.add(tuple(res["final_codes"]))
        for per_run in res["runs"].values():
            sides.setdefault(side, []).extend(summary(r) for r in per_run)
    if not {"base", "new"} <= sides.keys():
        raise SystemExit(f"{folder}: expected run_N_base and run_N_new folders from churn_ab.sh, found "
                         f"{sorted(sides)}; run churn_ab.sh with OUT={folder} first")
    return sides, sorted(devices) + [f"final payloads of 3 + {lo}-{hi} codes" for lo, hi in sorted(finals)
                                     if (lo, hi) != (10, 10)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="path without suffix: writes .json and .md")
    ap.add_argument("--title", default="Serving rounds before/after")
    args = ap.parse_args()
    sides, devices = load(args.folder)
    med = {s: {k: statistics.median(r[k] for r in rs) for k, _ in FIELDS} for s, rs in sides.items()}
    lines = [f"# {args.title} ({'; '.join(devices)})", "",
             "`benchmarks/churn_ab.sh` (stream_churn_bench.py, default variant, 2 runs per call, baseline and new "
             f"alternating {len(sides['base']) // 2} times after a discarded warm-up call); medians over each side's "
             f"{len(sides['base'])} runs, ms; eager calls and captures: the encoder and HiFT graph sets' during the "
             "rounds.", "",
             "| side | " + " | ".join(t for _, t in FIELDS) + " |", "|---|" + "---:|" * len(FIELDS)]
    for s in ("base", "new"):
        lines.append(f"| {s} | " + " | ".join(f"{med[s][k]:.1f}" for k, _ in FIELDS) + " |")
    lines.append("| base / new | " + " | ".join(f"{med['base'][k] / med['new'][k]:.3f}x" if med["new"][k] else "-"
                                              for k, _ in FIELDS) + " |")
    lines += ["", "Every run's round median: " + "; ".join(
        f"{s}: " + ", ".join(f"{r['median']:.1f}" for r in sides[s]) for s in ("base", "new")), ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _write(args.out.with_suffix(".json"), json.dumps({"devices": devices, "medians": med, "runs": sides}, indent=1))
    _write(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
