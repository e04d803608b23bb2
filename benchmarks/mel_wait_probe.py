"""Does a batched mel (``mel.process_many``) wait for device work queued before it, and why.

Each step appends ~1 s to every stream, uploads ``--frames`` frame-sized arrays through the shared staging ring
(as a duplex second's frames do), then queues ~1 s of device work (``torch.cuda._sleep``) and times the batch's
host call. A call that returns in milliseconds only queued its work; one that takes the queued second made an
implicitly synchronising call on the way. Printed per step: the host ms and the change of the counters of such
calls (``queued_wait_probe.sync_causes``: cudaMalloc, cuFFT plans made, pinned allocations, the ring's slot
growths and waits). Each configuration runs ``--runs`` times in one process, fresh streams each time: a cause
that a run leaves cached (a plan, a slot) waits only in the first.

Session 52 found two causes with it: the plan warm-up (then ``warm_stft_plans``) warmed the batched STFT one
frame off each bucket (so each new second's bucket planned mid-stream), and the ring grew a frame's slot for the
batch's growing upload.

    python benchmarks/mel_wait_probe.py OUT.txt --streams 3 --steps 4        # CUDA only
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from minicpmo_rt.atomic import atomic_write
from minicpmo_rt.thinker.mel import StreamingMel, process_many
from minicpmo_rt.thinker.staging import HostStaging

from queued_wait_probe import sync_causes

SPIN_CYCLES = 2_000_000_000     # ~1 s on the H200's 1.98 GHz clock
DEV = torch.device("cuda")


def run(streams: int, steps: int, slots: int, frames: int, seed: int = 0) -> list[dict]:
    staging = HostStaging("cuda", slots=slots)
    procs = [StreamingMel(device="cuda", staging=staging) for _ in range(streams)]
    rng = np.random.default_rng(seed)
    frame = np.zeros((448, 448, 3), np.uint8)
    rows = []
    for step in range(steps):
        audios = [(0.1 * rng.standard_normal(p.chunk_size())).astype(np.float32) for p in procs]
        for _ in range(frames):
            staging.upload(frame)
        torch.cuda.synchronize()
        before = sync_causes(DEV, staging)
        if step:        # step 0 makes the batch's plans and constants, by design not behind the queue
            torch.cuda._sleep(SPIN_CYCLES)
        t0 = time.perf_counter()
        process_many(procs, audios)
        host_ms = (time.perf_counter() - t0) * 1e3
        after = sync_causes(DEV, staging)
        torch.cuda.synchronize()
        rows.append({"step": step, "host_ms": host_ms, **{k: after[k] - before[k] for k in after}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path, help="a text file for the printed table")
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--frames", type=int, default=0, help="frame uploads through the ring per step")
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mel_wait_probe.py: needs CUDA (it times waits for queued device work)")
    lines = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: process_many of {args.streams} streams, "
             f"{args.slots} slots, {args.frames} frame uploads per step"]
    for r in range(args.runs):
        for row in run(args.streams, args.steps, args.slots, args.frames):
            lines.append(f"run={r} " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in row.items()))
            print(lines[-1], flush=True)
    atomic_write(args.out, lambda f: f.write(("\n".join(lines) + "\n").encode()))


if __name__ == "__main__":
    main()
