"""Where ``Code2Wav.prepare`` spends its time, and what the CFM graphs' warm-up count buys.

Full-size random weights on CUDA, the knobs' default fast path, a 6-s voice prompt (``bench_models``). Each
run builds a fresh ``Code2Wav`` on the same weights with ``GraphConfig.warmups`` set to one of ``--warmups``,
runs ``prepare(voice)`` with every Whole-Euler capture timed on the host with a device synchronisation (split
into its warm-up solves and the capture itself), then pushes six 1-s payloads through a stream and keeps the
PCM. Every variant's PCM is compared with the first variant's (the same kernels replay, so it should be
bit-identical) and each stream chunk must replay without a new capture. Run order: one discarded run
(Triton's JIT), then the variants alternating, ``--runs`` each. Writes JSON + Markdown to --out.

``--shape-warmups 2,1`` varies instead (or as well: every pair) the eager calls before each capture of the
encoder and HiFT graph sets (``ShapeGraphs.warmups``, the sets of ``Code2Wav.stream_graph_sets``), which
``prepare``'s warm-up streams capture at every batch bucket.
``--conv-views default,off`` varies the HiFT's conv path as well (``hift.conv1d_as_2d``: 2-D convs of the
time-major views, the CUDA default since session 29, against ``F.conv1d``), to find where the views' longer
``prepare`` goes (each run's CFM captures are timed apart from the rest, which holds the HiFT captures).
``--tiny --device cpu`` is a smoke run of the script (no graphs there: the tables stay empty).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from minicpmo_rt.code2wav import hift

from code2wav_pipeline_bench import bench_models, device_label
from first_chunk_bench import _sync, fresh_code2wav, release, stream_payloads
from stream_churn_bench import _write


def one_run(flow, gen, feats, dev, warmups: int, payloads, shape_warmups: int | None = None) -> dict:
    c2w = fresh_code2wav(flow, gen, {"cfm_graph_precapture": True})
    if shape_warmups is not None:
        for sets in c2w.stream_graph_sets().values():
            sets.warmups = shape_warmups
    solver = c2w.flow.chunk_solver
    captures = []
    if solver is not None and hasattr(solver, "config"):
        solver.config = dataclasses.replace(solver.config, warmups=warmups)
        program, capture, static_for = solver._program, solver._capture, solver._static_for
        clock = {"warm": 0.0, "key": None}

        def keyed_static_for(key, device, want_graph):
            clock["key"] = key
            return static_for(key, device, want_graph)

        def timed_program(st):          # the warm-up solves run _program outside the capture
            if torch.cuda.is_current_stream_capturing():
                return program(st)
            t = time.perf_counter()
            program(st)
            _sync(dev)
            clock["warm"] += time.perf_counter() - t

        def timed_capture(st):
            clock["warm"] = 0.0
            _sync(dev)
            t = time.perf_counter()
            capture(st)
            _sync(dev)
            total = time.perf_counter() - t
            captures.append({"key": str(clock["key"]), "total_ms": 1000 * total, "warm_ms": 1000 * clock["warm"]})

        solver._program, solver._capture, solver._static_for = timed_program, timed_capture, keyed_static_for
    set_ms: dict[str, float] = {}      # the encoder's and HiFT's graph captures (warm-up calls included), per set
    for name, sets in c2w.stream_graph_sets().items():
        def timed_set_capture(xs, fn, _capture=sets._capture, _name=name):
            _sync(dev)
            t = time.perf_counter()
            got = _capture(xs, fn)
            _sync(dev)
            set_ms[_name] = set_ms.get(_name, 0.0) + 1000 * (time.perf_counter() - t)
            return got
        sets._capture = timed_set_capture
    _sync(dev)
    t = time.perf_counter()
    held = c2w.prepare(feats)
    _sync(dev)
    prepare_ms = 1000 * (time.perf_counter() - t)
    before = {k: len(g.graphs) for k, g in c2w.stream_graph_sets().items()}
    n_cfm = len(solver.graphs()) if solver is not None and hasattr(solver, "graphs") else 0
    stream = c2w.open_stream(feats)
    pcm, chunk_ms = [], []
    for p in payloads:
        t = time.perf_counter()
        pcm.append(stream.push(p))
        _sync(dev)
        chunk_ms.append(1000 * (time.perf_counter() - t))
    stream.close()
    after = {k: len(g.graphs) for k, g in c2w.stream_graph_sets().items()}
    n_cfm_after = len(solver.graphs()) if solver is not None and hasattr(solver, "graphs") else 0
    out = {"warmups": warmups, "shape_warmups": shape_warmups, "prepare_ms": prepare_ms, "held": held, "chunk_ms": chunk_ms,
           "captures": captures, "capture_ms": sum(c["total_ms"] for c in captures),
           "capture_warm_ms": sum(c["warm_ms"] for c in captures),
           "set_capture_ms": dict(set_ms), "sets_capture_ms": sum(set_ms.values()),
           "new_graphs_in_stream": (n_cfm_after - n_cfm) + sum(after[k] - before[k] for k in after)}
    del c2w, stream
    release(dev)
    return out, np.concatenate(pcm)


VIEWS = {"default": None, "off": False, "on": True}     # --conv-views names -> hift.conv1d_as_2d modes


def _label(v: tuple[int, int | None, str | None]) -> str:
    return f"{v[0]}" + ("" if v[1] is None else f" / {v[1]}") + ("" if v[2] is None else f" / views {v[2]}")


def _run(flow, gen, feats, dev, v, payloads):
    with hift.conv1d_as_2d(VIEWS[v[2] or "default"]):
        return one_run(flow, gen, feats, dev, v[0], payloads, v[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=2, help="runs per variant (after one discarded run)")
    ap.add_argument("--warmups", default="3,2,1", help="comma-separated GraphConfig.warmups values")
    ap.add_argument("--shape-warmups", default="", help="comma-separated ShapeGraphs.warmups values for the "
                    "encoder and HiFT graph sets (default: leave theirs); variants are every (--warmups, "
                    "--shape-warmups) pair")
    ap.add_argument("--conv-views", default="", help="comma-separated HiFT conv paths (default, off, on; "
                    "hift.conv1d_as_2d) as one more variant dimension (default: leave it)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny flow/HiFT sizes (smoke run of the script)")
    args = ap.parse_args()
    try:
        counts = [int(x) for x in args.warmups.split(",")]
        shapes = [int(x) for x in args.shape_warmups.split(",")] if args.shape_warmups else [None]
        views = args.conv_views.split(",") if args.conv_views else [None]
        if any(x is not None and x not in VIEWS for x in views):
            raise ValueError
    except ValueError:
        ap.error(f"--warmups and --shape-warmups take comma-separated integers and --conv-views names from "
                 f"{sorted(VIEWS)}, got {args.warmups!r}, {args.shape_warmups!r} and {args.conv_views!r}")
    if args.runs < 1 or not counts or min(counts) < 1 or any(k is not None and k < 0 for k in shapes):
        ap.error(f"--runs and every --warmups value must be >= 1 and --shape-warmups >= 0, got {args.runs}, "
                 f"{args.warmups!r} and {args.shape_warmups!r}")
    variants = [(k, w, cv) for k in counts for w in shapes for cv in views]
    dev = torch.device(args.device)
    flow, gen, feats, g = bench_models(args.tiny, dev)
    payloads = stream_payloads(g)
    gpu = device_label(dev)
    res = {"gpu": gpu, "torch": torch.__version__, "runs": {_label(v): [] for v in variants}}
    res["discarded_run"], ref = _run(flow, gen, feats, dev, variants[0], payloads)
    print("discarded run (JIT)", res["discarded_run"]["prepare_ms"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for _ in range(args.runs):
        for v in variants:
            r, pcm = _run(flow, gen, feats, dev, v, payloads)
            r["pcm_max_abs_diff_vs_discarded"] = float(np.abs(pcm - ref).max())
            res["runs"][_label(v)].append(r)
            print(_label(v), {x: r[x] for x in ("prepare_ms", "capture_ms", "capture_warm_ms", "new_graphs_in_stream",
                                                "pcm_max_abs_diff_vs_discarded")}, flush=True)
            _write(args.out / "precapture_probe.json", json.dumps(res, indent=2))

    head = ("CFM warm-ups" + (" / encoder+HiFT warm-ups" if shapes != [None] else "")
            + (" / HiFT conv path" if views != [None] else ""))
    lines = [f"# Code2Wav.prepare: graph warm-ups ({gpu}, torch {res['torch']})", "",
             f"Host ms with a device synchronisation, median of {args.runs} run(s) per variant after one discarded "
             "run; full-size random weights, 6-s prompt. 'CFM captures' sums the Whole-Euler captures (their "
             "warm-up solves, then the capture); the rest of prepare is the prompt solve and the warm-up streams "
             "(the encoder and HiFT captures among them).",
             "'Encoder+HiFT captures' sums those graph sets' captures (each with its warm-up call).",
             "", f"| {head} | prepare | CFM captures | of which warm-up solves | encoder+HiFT captures | rest | "
             "steady chunk 5 | new graphs in the stream | PCM max abs diff |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for v in variants:
        runs = res["runs"][_label(v)]
        med = {x: statistics.median(r[x] for r in runs)
               for x in ("prepare_ms", "capture_ms", "capture_warm_ms", "sets_capture_ms")}
        lines.append(f"| {_label(v)} | {med['prepare_ms']:.0f} | {med['capture_ms']:.0f} | {med['capture_warm_ms']:.0f} | "
                     f"{med['sets_capture_ms']:.0f} | "
                     f"{med['prepare_ms'] - med['capture_ms'] - med['sets_capture_ms']:.0f} | "
                     f"{statistics.median(r['chunk_ms'][4] for r in runs):.2f} | "
                     f"{max(r['new_graphs_in_stream'] for r in runs)} | "
                     f"{max(r['pcm_max_abs_diff_vs_discarded'] for r in runs):.1e} |")
    names = sorted({n for runs in res["runs"].values() for r in runs for n in r["set_capture_ms"]})
    if names:
        lines += ["", "Encoder and HiFT captures per graph set, median ms:", "",
                  "| variant | " + " | ".join(names) + " |", "|---" + "|---:" * len(names) + "|"]
        for v in variants:
            runs = res["runs"][_label(v)]
            lines.append(f"| {_label(v)} | " + " | ".join(
                f"{statistics.median(r['set_capture_ms'].get(n, 0.0) for r in runs):.0f}" for n in names) + " |")
    caps = res["runs"][_label(variants[0])][-1]["captures"]
    if caps:
        lines += ["", f"Per capture, last run of {_label(variants[0])} (ms):", "",
                  "| key | total | warm-up solves |", "|---|---:|---:|"]
        lines += [f"| {c['key']} | {c['total_ms']:.0f} | {c['warm_ms']:.0f} |" for c in caps]
    _write(args.out / "precapture_probe.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
