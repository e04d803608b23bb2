"""How fast can the Whole-Euler solver copy the streams' attention caches into its arena?

The default (non-pooled) solve copies each stream's per-step cache (S, depth, 2B, H, L, 2D) behind the
current-chunk slot of the arena (S, depth, 2Bb, H, Q+O, 2D): at batch 16 that is 8.4 GB per chunk.
Variants, side by side on the same tensors (CUDA-event medians):

* ``two copies``: cond rows and uncond rows as two strided ``copy_`` calls (what ``_fill`` did);
* ``one copy``: both halves in one ``copy_`` when the batch fills its bucket (B == Bb);
* ``... as 16-byte elements``: the same with both sides viewed as complex128, so each thread moves
  16 bytes (torch's strided copy does not vectorise 4-byte elements);
* ``torch clone``: a contiguous clone of the source (the device's plain copy rate, for scale);
* ``trim``: the successor cache out of the arena without the frames the flow's trim drops
  (``euler_graph.trim_frames``, prompt 300 + last 100 of 450 frames), as an arena solve returns it.

``one copy as 16-byte elements`` is what ``bulk_copy.copy_`` runs for the fill. At batch 1-2 the fill and
the trim are what an arena solve spends outside its graph replay.

    python benchmarks/arena_copy_probe.py --out DIR [--batches 16,8]     # session 18: --batches 1,2,16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from code2wav_bench import timed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from minicpmo_rt.code2wav.euler_graph import trim_frames  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="16,8")
    args = ap.parse_args()
    S, depth, H, Q, L, D2 = 10, 16, 8, 50, 400, 128
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for B in (int(b) for b in args.batches.split(",")):
        arena = torch.zeros(S, depth, 2 * B, H, Q + L, D2, device="cuda")
        src = torch.randn(S, depth, 2 * B, H, L, D2, device="cuda")
        dst = arena[..., Q:Q + L, :]
        gb = src.numel() * 4 / 1e9

        def two():
            dst[:, :, :B].copy_(src[:, :, :B])
            dst[:, :, B:].copy_(src[:, :, B:])

        def one():
            dst.copy_(src)

        a16 = arena.view(torch.complex128)              # (..., Q+L, D2/4)
        d16 = a16[..., Q:Q + L, :]
        s16 = src.view(torch.complex128)

        def one16():
            d16.copy_(s16)

        def two16():
            d16[:, :, :B].copy_(s16[:, :, :B])
            d16[:, :, B:].copy_(s16[:, :, B:])

        def clone():
            return src.clone()

        def trim():
            return trim_frames(arena, 300, 100)

        for name, fn in (("two copies", two), ("one copy", one), ("two copies as 16-byte elements", two16),
                         ("one copy as 16-byte elements", one16), ("torch clone (contiguous)", clone),
                         ("trim (trim_frames)", trim)):
            if name != "trim (trim_frames)":
                arena.zero_()
            us = statistics.median(timed(fn, min_reps=15, max_reps=15)) * 1e3
            if name == "trim (trim_frames)":
                ok = bool(torch.equal(trim(), torch.cat([arena[..., :300, :], arena[..., 350:, :]], -2)))
            else:
                ok = bool(torch.equal(dst, src)) if name != "torch clone (contiguous)" else True
            res["rows"].append({"batch": B, "variant": name, "us": us, "gb": gb, "tb_s_read_plus_write": 2 * gb / us * 1e3,
                                "exact": ok})
            print(f"B={B:2d} {name:34s} {us / 1e3:7.2f} ms {2 * gb / us * 1e3:5.2f} TB/s exact={ok}", flush=True)
        del arena, src, dst, a16, d16, s16
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "arena_copy_probe.json").write_text(json.dumps(res, indent=1))
    (args.out / "arena_copy_probe.md").write_text(markdown(res))
    return 0


def markdown(res: dict) -> str:
    out = [f"# Whole-Euler arena fill: copying the streams' attention caches ({res['gpu']})", "",
           f"torch {res['torch']}; (S=10, depth=16, 2B, H=8, 400 frames, 128) FP32 caches into the arena's "
           "(..., 50 + 400, 128) slots; CUDA-event medians of 15.", "",
           "| B | variant | ms | GB | TB/s (read + write) | bit-exact |", "|---:|---|---:|---:|---:|---|"]
    for r in res["rows"]:
        out.append(f"| {r['batch']} | {r['variant']} | {r['us'] / 1e3:.2f} | {r['gb']:.2f} | "
                   f"{r['tb_s_read_plus_write']:.2f} | {r['exact']} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
