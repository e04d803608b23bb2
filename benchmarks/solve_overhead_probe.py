"""Where a direct solve's time goes outside its graph replay (host staging, tables, successors).

One steady 1-s chunk (query 50, 10 Euler steps, CFG, cache 400) at batch B through
``WholeEulerSolver.solve(trim=...)`` as the flow calls it. Reports, per call: the CUDA-event time of
the whole solve, the replay alone, the host time to enqueue the solve (no sync) and its steps' host
times (static lookup, staging, the direct tables, graph launch, reading out), and a torch.profiler
table of the host ops of a few solves (the profiler inflates launches). Writes ``solve_overhead_probe.json`` / ``.txt`` into --out.

    PYTHONPATH=src python benchmarks/solve_overhead_probe.py --out DIR --batches 16,4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from code2wav_bench import L, S, T, chunk_inputs, randomize_, timed  # benchmarks/ is on sys.path when run as a script


def _host_timed(fn, into: list):
    """fn, appending each call's host time (ms, no sync) to ``into``."""
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append((time.perf_counter() - t0) * 1e3)
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="16,4")
    args = ap.parse_args()
    from minicpmo_rt.code2wav.euler_graph import GraphConfig, WholeEulerSolver
    from minicpmo_rt.code2wav.flow import Flow
    from minicpmo_rt.code2wav.flow_config import FULL_SIZE

    args.out.mkdir(parents=True, exist_ok=True)
    flow = Flow(FULL_SIZE)
    randomize_(flow, 0)
    cfm = flow.to("cuda").eval().decoder
    res = {"gpu": torch.cuda.get_device_name(), "rows": []}
    text = []
    for B in (int(b) for b in args.batches.split(",")):
        cnn, att, mu, spk, cond = chunk_inputs(B)
        cfg = GraphConfig(batch_buckets=(B,), query_buckets=(T,), offset_bucket=50, offset_anchor=L, max_graphs=4)
        solver = WholeEulerSolver(cfm, n_timesteps=S, config=cfg, body="fused", attention="triton-tf32", tf32=True)
        trim = (L - 100, 100)
        last = [solver.solve(mu, spk, cond, cnn, att, copy_out=False, trim=trim)]
        st = next(iter(solver._statics.values()))

        def call():
            last[0] = solver.solve(mu, spk, cond, cnn, att, copy_out=False, trim=trim)

        whole = timed(call, 1.0)
        replay = timed(st.graph.replay, 1.0)
        host = []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        # the same calls with the solve's steps timed on the host (wrappers on this solver and graph only)
        pieces: dict[str, list[float]] = {}
        steps = ((solver, "_static_for"), (solver, "_fill"), (solver, "_bind_streams"), (solver, "_read"),
                 (st.graph, "replay"))
        for obj, name in steps:
            setattr(obj, name, _host_timed(getattr(obj, name), pieces.setdefault(name, [])))
        for _ in range(10):
            torch.cuda.synchronize()
            call()
        torch.cuda.synchronize()
        for obj, name in steps:
            delattr(obj, name)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                call()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        row = {"batch": B, "direct": bool(st.key.direct), "solve_ms": statistics.median(whole),
               "replay_ms": statistics.median(replay), "host_enqueue_ms": statistics.median(host),
               "host_step_ms": {k: statistics.median(v) for k, v in pieces.items() if v},   # per call
               "host_step_calls_per_solve": {k: len(v) / 10 for k, v in pieces.items()}}
        res["rows"].append(row)
        text.append(f"## B={B}: {json.dumps(row)}\n\n{table}\n")
        print(text[-1], flush=True)
        del solver, st, last
        torch.cuda.empty_cache()
    (args.out / "solve_overhead_probe.json").write_text(json.dumps(res, indent=1))
    (args.out / "solve_overhead_probe.txt").write_text("\n".join(text))


if __name__ == "__main__":
    main()
