"""H200 probe: the batch-1/2 arena solve's cache copies outside its graph replay, each timed alone.

The arena fill (the old estimator cache into the arena behind the current-chunk frames) and the trim
(the successor without the dropped frames) as ``euler_graph`` runs them (``bulk_copy``), against a plain
contiguous clone of the same bytes. CUDA-event medians; writes cache_copy_probe.json into --out.

    PYTHONPATH=src python benchmarks/cache_copy_probe.py --out DIR --batches 1,2,16
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from minicpmo_rt.code2wav import bulk_copy
from minicpmo_rt.code2wav.euler_graph import trim_frames


def _ms(fn, reps: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,2,16")
    args = ap.parse_args()
    S, depth, H, Q, L, D2 = 10, 16, 8, 50, 400, 128
    res = {"gpu": torch.cuda.get_device_name(), "rows": []}
    for B in (int(b) for b in args.batches.split(",")):
        R = 2 * B
        arena = torch.zeros(S, depth, R, H, Q + L, D2, device="cuda")
        att = torch.randn(S, depth, R, H, L, D2, device="cuda")
        dst = arena[..., Q:Q + L, :]
        mb = att.numel() * 4 / 1e6
        row = {"batch": B, "cache_MB": mb,
               "fill_bulk_ms": _ms(lambda: bulk_copy.copy_(dst, att)),
               "fill_torch_ms": _ms(lambda: dst.copy_(att)),
               "trim_bulk_ms": _ms(lambda: trim_frames(arena, 300, 100)),
               "clone_contiguous_ms": _ms(lambda: att.clone())}
        for k in ("fill_bulk", "fill_torch", "clone_contiguous"):
            row[k + "_TBps"] = 2 * mb / 1e6 / (row[k + "_ms"] / 1e3)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_copy_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
