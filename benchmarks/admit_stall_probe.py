"""Why a 16-request Talker admission stalls outside its prefill (session 49's open question).

Two suspects, each timed alone:

1. ``cat``: joining 16 requests' fp32 hidden rows on the host (what ``TalkerEngine._admit`` did with the
   ``TalkerInput`` contract's host rows). Timed with torch's default intra-op threads and with one thread,
   while the cgroup's CPU throttling counters (``cpu.stat``) are read before and after, since a CPU quota
   below the thread count stalls a parallel op for the rest of a 100-ms scheduler period.
2. ``projector``: the Talker's projector (4096 -> 768 -> 768, bf16) at a row count it has not met before
   (first call) and again (second call), after a warm-up at another count: the batch's total text rows
   change with every admission, and a GEMM shape whose kernel is not loaded yet pays for loading it.
   ``--buckets`` also times the same counts padded up to the engine's row buckets.

    python benchmarks/admit_stall_probe.py OUT_DIR [--device cuda]

Writes ``OUT_DIR/admit_stall_probe.json`` and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def cpu_stat() -> dict[str, int]:
    """The cgroup (v2 or v1) CPU accounting counters, or {} where there are none."""
    for path in ("/sys/fs/cgroup/cpu.stat", "/sys/fs/cgroup/cpu/cpu.stat", "/sys/fs/cgroup/cpu,cpuacct/cpu.stat"):
        try:
            return {k: int(v) for k, v in (line.split() for line in Path(path).read_text().splitlines())}
        except (OSError, ValueError):
            continue
    return {}


def cpu_quota() -> str:
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        try:
            return f"{path}: {Path(path).read_text().strip()}"
        except OSError:
            continue
    return "none found"


def stats(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {"median": round(statistics.median(s), 3), "p90": round(s[int(0.9 * (len(s) - 1))], 3),
            "max": round(s[-1], 3), "n": len(s)}


def time_cat(reps: int, threads: int, rows: int, dim: int) -> dict:
    before_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        parts = [torch.randn(rows, dim) for _ in range(16)]
        torch.cat(parts)
        st0 = cpu_stat()
        ms = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.cat(parts)
            ms.append((time.perf_counter() - t0) * 1e3)
        st1 = cpu_stat()
    finally:
        torch.set_num_threads(before_threads)
    delta = {k: st1[k] - st0.get(k, 0) for k in st1 if "throttled" in k}
    return {"threads": threads, "ms": stats(ms), "throttle_delta": delta}


def bucket(m: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= m), m)


def time_projector(dev: torch.device, counts: list[int], buckets: tuple[int, ...] | None) -> list[dict]:
    torch.manual_seed(0)
    proj = torch.nn.Sequential(torch.nn.Linear(4096, 768), torch.nn.ReLU(), torch.nn.Linear(768, 768))
    proj = proj.to(dev, torch.bfloat16)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with torch.no_grad():
        proj(torch.randn(64, 4096, device=dev, dtype=torch.bfloat16))     # warm-up at another count
        if buckets:
            for b in buckets:          # the engine warms every bucket when it captures its graphs
                proj(torch.randn(b, 4096, device=dev, dtype=torch.bfloat16))
        sync()
        out = []
        for m in counts:
            x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
            row = {"rows": m, "run_rows": bucket(m, buckets) if buckets else m}
            for tag in ("first", "second"):
                sync()
                t0 = time.perf_counter()
                if buckets:
                    pad = torch.zeros(row["run_rows"], 4096, device=dev, dtype=torch.bfloat16)
                    pad[:m] = x
                    proj(pad)[:m]
                else:
                    proj(x)
                sync()
                row[tag] = round((time.perf_counter() - t0) * 1e3, 3)
            out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "quota": cpu_quota(),
           "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None}
    print(res)
    res["cat"] = [time_cat(args.reps, t, 26, 4096) for t in (torch.get_num_threads(), 4, 1)]
    for r in res["cat"]:
        print("cat 16 x [26, 4096] fp32, threads", r["threads"], r["ms"], r["throttle_delta"])
    counts = [16 * n for n in range(24, 33)] + [200, 300, 500, 700, 1000]
    from minicpmo_rt.talker.engine import PROJECTOR_ROWS      # the engine's row buckets
    res["projector"] = time_projector(dev, counts, None)
    res["projector_buckets"] = time_projector(dev, counts, PROJECTOR_ROWS)
    for key in ("projector", "projector_buckets"):
        print(key, [(r["rows"], r["run_rows"], r["first"], r["second"]) for r in res[key]])
    tmp = args.out / "admit_stall_probe.json.tmp"
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(args.out / "admit_stall_probe.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
