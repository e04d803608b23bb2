"""H200 probe: what launching a Whole-Euler graph costs the host, and whether the GPU waits for it.

For each batch, the default fused TF32 solver is captured as the flow calls it (trimmed; the direct path
from batch 4) and its graph is launched alone, medians of 20:

* ``host_launch_ms``: the CPU time of ``graph.replay()`` (no sync), i.e. ``cudaGraphLaunch``;
* ``idle_start_ms``: CUDA-event time from an event recorded on an idle stream just before the launch to
  one after it: the replay plus however long the GPU waited for the launch to be submitted;
* ``queued_ms``: the same with the launch made while the stream is still busy (a 20-ms sleep kernel ahead of
  it), so the submission overlaps the earlier work: the replay alone;

Control rows: straight-line graphs of N one-element adds, the same three times.

    PYTHONPATH=src:benchmarks python benchmarks/graph_launch_probe.py --out DIR --batches 1,4,16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from code2wav_bench import L, S, T, _triton_version, chunk_inputs, randomize_  # noqa: E402


def launch_times(graph: torch.cuda.CUDAGraph, reps: int = 20) -> dict:
    """Medians (ms) of the host's launch, the launch onto an idle stream and the launch behind queued work."""
    host, idle, queued = [], [], []
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        torch.cuda.synchronize()
        e0.record()
        t0 = time.perf_counter()
        graph.replay()
        host.append((time.perf_counter() - t0) * 1e3)
        e1.record()
        torch.cuda.synchronize()
        idle.append(e0.elapsed_time(e1))
        torch.cuda._sleep(40_000_000)      # ~20 ms of GPU work ahead of the launch
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        queued.append(e0.elapsed_time(e1))
    return {"host_launch_ms": statistics.median(host), "idle_start_ms": statistics.median(idle),
            "queued_ms": statistics.median(queued)}


def markdown(res: dict) -> str:
    lines = [f"# Graph launch cost ({res['gpu']})", "",
             f"torch {res['torch']} (CUDA {res['cuda']}), triton {res['triton']}; medians of 20 launches.", "",
             "| graph | host launch ms | idle start ms | queued ms |", "|---|---:|---:|---:|"]
    lines += [f"| {r['graph']} | {r['host_launch_ms']:.3f} | {r['idle_start_ms']:.3f} | {r['queued_ms']:.3f} |"
              for r in res["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--controls", default="100,1000,2000", help="node counts of the straight-line control graphs")
    args = ap.parse_args(argv)
    from minicpmo_rt.code2wav.euler_graph import GraphConfig, WholeEulerSolver
    from minicpmo_rt.code2wav.flow import Flow
    from minicpmo_rt.code2wav.flow_config import FULL_SIZE

    args.out.mkdir(parents=True, exist_ok=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": _triton_version(),
           "cuda": torch.version.cuda, "rows": []}

    def save():
        (args.out / "graph_launch_probe.json").write_text(json.dumps(res, indent=1))

    x = torch.zeros(1, device="cuda")
    for n in (int(v) for v in args.controls.split(",")):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(n):
                x.add_(1)
        res["rows"].append({"graph": f"straight line of {n} adds", **launch_times(g)})
        print(res["rows"][-1], flush=True)
        save()

    flow = Flow(FULL_SIZE)
    randomize_(flow, 0)
    cfm = flow.to("cuda").eval().decoder
    for B in (int(b) for b in args.batches.split(",")):
        cnn, att, mu, spk, cond = chunk_inputs(B)
        cfg = GraphConfig(batch_buckets=(B,), query_buckets=(T,), offset_bucket=50, offset_anchor=L, max_graphs=4)
        sv = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S, config=cfg)
        keep = [sv.solve(mu, spk, cond, cnn, att, copy_out=False, trim=(L - 100, 100))]
        st = next(iter(sv._statics.values()))
        res["rows"].append({"graph": f"Whole-Euler solve B={B}", "batch": B, "direct": bool(st.key.direct),
                            **launch_times(st.graph)})
        print(res["rows"][-1], flush=True)
        save()
        del sv, st, keep
        torch.cuda.empty_cache()
    (args.out / "graph_launch_probe.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
