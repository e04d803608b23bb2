"""HiFT alone on the GPU (steady stream chunk: 8 cached + 50 new mel frames, cached excitation):
eager vs CUDA graphs, batch 1 and 16, IEEE FP32. Reuses code2wav_bench's HiFT rows.

    python benchmarks/hift_bench.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import code2wav_bench as cb  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=0.5)
    args = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": [], "notes": []}

    def row(name, B, ms, replay=None, extra=None):
        r = {"row": name, "batch": B, "median_ms": statistics.median(ms), "reps": len(ms), **(extra or {})}
        res["rows"].append(r)
        print(r, flush=True)

    cb.hift_rows(res, row, args.budget)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hift_h200.json").write_text(json.dumps(res, indent=2))
    lines = [f"# HiFT per steady 1-s chunk ({res['gpu']}, torch {res['torch']}, IEEE FP32)", "",
             "| row | batch | median ms | rel err vs eager |", "|---|---|---|---|"]
    lines += [f"| {r['row']} | {r['batch']} | {r['median_ms']:.2f} | {r.get('rel_err_vs_eager', '')} |"
              for r in res["rows"]]
    lines += [f"- note: {n}" for n in res["notes"]]
    (args.out / "hift_h200.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
