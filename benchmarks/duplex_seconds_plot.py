"""Each second's wall time of ``duplex_batch_bench.py`` runs, one line per run, from their JSONs.

A slow second is easier to see than to find in a table, and ``--diag`` runs say what it did: seconds whose
caching allocator called cudaMalloc are marked with a triangle, those that page-locked host memory (the
staging ring's slots grown) with a cross.

    python benchmarks/duplex_seconds_plot.py OUT.png "before=a.json" "after=b.json"

Each run of a JSON is drawn (labelled ``label`` or ``label run k`` when the JSON has several).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from minicpmo_rt.atomic import save_png  # noqa: E402


def load(spec: str) -> list[tuple[str, list[dict]]]:
    """``label=path``: that JSON's runs as (label, rows); raises ValueError naming the file when it is not one."""
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise ValueError(f"{spec!r}: give each run as LABEL=PATH.json")
    try:
        runs = json.loads(Path(path).read_text())["runs"]
        out = [(label if len(runs) == 1 else f"{label} run {k + 1}", [dict(r) for r in run["rows"]])
               for k, run in enumerate(runs)]
        for _, rows in out:
            for r in rows:
                r["second"], r["ms"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a duplex_batch_bench.py JSON ({type(exc).__name__}: {exc})") from None
    if not any(rows for _, rows in out):
        raise ValueError(f"{path}: its runs have no seconds to draw")
    return out


def plot(runs: list[tuple[str, list[dict]]], path: Path, title: str) -> None:
    """ms per second for each run, with the seconds that allocated marked; written whole or not at all."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(10, 4.8))
    for label, rows in runs:
        line, = ax.plot([r["second"] for r in rows], [r["ms"] for r in rows], marker="o", ms=3, label=label)
        for key, marker, what in (("num_device_alloc", "^", "cudaMalloc"), ("host_allocs", "x", "pinned alloc")):
            hit = [r for r in rows if r.get("state", {}).get(key, 0) > 0]
            if hit:
                ax.scatter([r["second"] for r in hit], [r["ms"] for r in hit], marker=marker, s=70,
                           color=line.get_color(), zorder=4, label=f"{label}: {what} that second")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("second of the run")
    ax.set_ylabel("wall ms of the second (all seats)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the PNG to write")
    ap.add_argument("runs", nargs="+", metavar="LABEL=PATH", help="duplex_batch_bench.py JSONs, each labelled")
    ap.add_argument("--title", default="", help="the plot's title (default: the first JSON's GPU)")
    args = ap.parse_args(argv)
    if args.out.suffix != ".png":
        print(f"{args.out}: the plot is a PNG; name the output *.png", file=sys.stderr)
        return 2
    try:
        runs = [r for spec in args.runs for r in load(spec)]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    title = args.title
    if not title:
        gpu = json.loads(Path(args.runs[0].partition("=")[2]).read_text()).get("gpu", "?")
        title = f"duplex seconds ({gpu})"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, args.out, title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
