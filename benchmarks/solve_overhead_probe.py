"""Where a direct solve's time goes outside its graph replay (host staging, tables, successors).

One steady 1-s chunk (query 50, 10 Euler steps, CFG, cache 400) at batch B through
``WholeEulerSolver.solve(trim=...)`` as the flow calls it. Reports, per call: the CUDA-event time of
the whole solve, the replay alone, the host time to enqueue the solve (no sync) and its steps' host
times (static lookup, staging, the direct tables, graph launch, reading out), and a torch.profiler
table of the host ops of a few solves (the profiler inflates launches), and the GPU timeline of one solve as
called (``timeline``: each activity outside the graph's own kernels, the replay as one span, the GPU idle before
it). Writes ``solve_overhead_probe.json`` / ``.txt`` into --out.

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


def gpu_timeline(call, graph: tuple[set[str], int]) -> dict:
    """One ``call`` (GPU idle before it) under torch.profiler: its GPU activities in order, in us from the
    call's first host op, with the graph's n kernels (``graph``: their names and n) folded into one ``replay``
    span (the n kernels from the first of those names to start after the host's ``cudaGraphLaunch``); and how
    long the GPU sat idle before the replay and in all."""
    from torch.profiler import ProfilerActivity, profile
    names, n = graph
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.time_range.end > e.time_range.start]
    cpu = [e for e in ev if e.device_type == torch.autograd.DeviceType.CPU and "Synchronize" not in e.name]
    gpu = sorted((e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start)
    t0 = min(e.time_range.start for e in cpu)
    launch = next((e.time_range.start for e in cpu if e.name == "cudaGraphLaunch"), None)
    first = next((i for i, e in enumerate(gpu) if launch is not None and e.time_range.start >= launch
                  and e.name in names), len(gpu))
    spans: list[dict] = []
    for i, e in enumerate(gpu):
        a, b = e.time_range.start - t0, e.time_range.end - t0
        if first < i < first + n:
            spans[-1]["end_us"] = max(spans[-1]["end_us"], b)
            spans[-1]["kernels"] += 1
        else:
            spans.append({"name": "replay" if i == first else e.name[:70], "start_us": a, "end_us": b, "kernels": 1})
    busy, last, before = 0.0, 0.0, None
    for s in spans:
        if s["name"] == "replay":
            before = s["start_us"] - busy
        busy += max(0.0, s["end_us"] - max(s["start_us"], last))
        last = max(last, s["end_us"])
    rnd = lambda v: round(v, 2) if isinstance(v, float) else v      # noqa: E731
    return {"spans": [{k: rnd(v) for k, v in s.items()} for s in spans],
            "host_graph_launch_us": None if launch is None else rnd(launch - t0),
            "gpu_idle_before_replay_us": rnd(before), "gpu_end_us": rnd(last), "gpu_busy_us": rnd(busy)}


def graph_kernels(graph_replay) -> tuple[set[str], int]:
    """The names and number of the kernels one graph replay runs (profiled on its own)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph_replay()
        torch.cuda.synchronize()
    ks = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return set(ks), len(ks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="16,4")
    ap.add_argument("--direct", choices=("auto", "on", "off"), default="auto",
                    help="the solver's direct path: the flow's choice (auto), or forced on / off")
    ap.add_argument("--operands", choices=("flow", "fp32", "fp16"), default="flow",
                    help="the GEMM operands: the flow's choice (FP16 where the weights' range certificate fits)")
    args = ap.parse_args()
    from minicpmo_rt.code2wav.euler_graph import GraphConfig, WholeEulerSolver
    from minicpmo_rt.code2wav.flow import Flow
    from minicpmo_rt.code2wav.flow_config import FULL_SIZE

    args.out.mkdir(parents=True, exist_ok=True)
    flow = Flow(FULL_SIZE)
    randomize_(flow, 0)
    cfm = flow.to("cuda").eval().decoder
    operands = args.operands
    if operands == "flow":
        from minicpmo_rt.code2wav.operand_range import operand_range
        operands = "fp16" if operand_range(cfm.estimator, S).fits_fp16 else "fp32"
    res = {"gpu": torch.cuda.get_device_name(), "operands": operands, "direct": args.direct, "rows": []}
    text = []
    for B in (int(b) for b in args.batches.split(",")):
        cnn, att, mu, spk, cond = chunk_inputs(B)
        cfg = GraphConfig(batch_buckets=(B,), query_buckets=(T,), offset_bucket=50, offset_anchor=L, max_graphs=4)
        solver = WholeEulerSolver(cfm, n_timesteps=S, config=cfg, body="fused", attention="triton-tf32", tf32=True,
                                  direct={"auto": None, "on": True, "off": False}[args.direct], gemm_operands=operands)
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
        try:    # a new measurement: its failure must not lose the others
            timeline = gpu_timeline(call, graph_kernels(st.graph.replay))
        except Exception as e:      # noqa: BLE001
            timeline = {"error": repr(e), "spans": [], "host_graph_launch_us": None,
                        "gpu_idle_before_replay_us": None, "gpu_end_us": None, "gpu_busy_us": None}
        row = {"batch": B, "direct": bool(st.key.direct), "solve_ms": statistics.median(whole),
               "replay_ms": statistics.median(replay), "host_enqueue_ms": statistics.median(host),
               "host_step_ms": {k: statistics.median(v) for k, v in pieces.items() if v},   # per call
               "host_step_calls_per_solve": {k: len(v) / 10 for k, v in pieces.items()}, "timeline": timeline}
        res["rows"].append(row)
        spans = "\n".join(f"{x['start_us']:9.1f} {x['end_us']:9.1f} {x['kernels']:5d}  {x['name']}"
                          for x in timeline["spans"])
        text.append(f"## B={B}: {json.dumps({k: v for k, v in row.items() if k != 'timeline'})}\n\n{table}\n\n"
                    f"GPU timeline of one solve as called (us from its first host op; graph launched at "
                    f"{timeline['host_graph_launch_us']}, GPU idle before the replay "
                    f"{timeline['gpu_idle_before_replay_us']}, busy {timeline['gpu_busy_us']} of "
                    f"{timeline['gpu_end_us']}):\n"
                    f"    start       end  kern  activity\n{spans}\n")
        print(text[-1], flush=True)
        del solver, st, last
        torch.cuda.empty_cache()
    (args.out / "solve_overhead_probe.json").write_text(json.dumps(res, indent=1))
    (args.out / "solve_overhead_probe.txt").write_text("\n".join(text))


if __name__ == "__main__":
    main()
