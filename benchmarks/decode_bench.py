"""Frame delivery rate of the extractor's video path alone (no model): how many session
seconds per wall second the prefetching decoder can feed each mode.

    python benchmarks/decode_bench.py ROOT [--seconds 60] [--workers N] [--threads T] [--json OUT.json]

ROOT is a synthetic session's root as features_bench.py makes it (made here when missing:
1920x1080, 20-s segments, the same generator and seed).

Uses exactly the extractor's settings (EasyComSession, frame cache 32, prefetch depth 16,
the native rows' frames or every 5 Hz row's frame); prints frames/s and session-x per mode.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from minicpmo_rt.features.easycom import EasyComSession, frame_index_at
from minicpmo_rt.features.extract import row_time
from minicpmo_rt.features.synthetic import make_session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    rows = []
    n_rows = int(args.seconds * 5)
    video_dir = args.root / "Video_Compressed" / "Session_1"
    if not video_dir.is_dir():
        make_session(args.root, args.seconds, width=1920, height=1080, segment_seconds=min(20.0, args.seconds), seed=0)
    for mode, wanted in (("native-1hz-hold", range(4, n_rows, 5)), ("cached-partial-5hz", range(n_rows))):
        media = EasyComSession(video_dir, decoder="pyav", decoder_threads=args.threads, frame_cache_size=32)
        idx = [frame_index_at(row_time(k)) for k in wanted]
        t0 = time.perf_counter()
        media.prefetch(idx, depth=16, workers=args.workers)
        first = None
        for i in idx:
            media.frame(i)
            first = first or time.perf_counter() - t0
        wall = time.perf_counter() - t0
        print(f"{mode}: {len(idx)} frames in {wall:.3f} s (first after {first:.3f} s): "
              f"{len(idx) / wall:.0f} wanted frames/s, {args.seconds / wall:.1f}x real time "
              f"({args.seconds * 20 / wall:.0f} decoded frames/s)", flush=True)
        rows.append({"mode": mode, "threads": args.threads, "workers": args.workers, "frames": len(idx),
                     "wall_s": round(wall, 3), "first_frame_s": round(first, 3),
                     "x_realtime": round(args.seconds / wall, 1)})
        media.close()
    if args.json is not None:
        args.json.write_text(json.dumps({"session_s": args.seconds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
