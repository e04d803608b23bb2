"""Where the turn Talker's slower first answer goes (session 48 left it unexplained).

Session 48 (``turn_warm_up_session48_h200.md``): after ``TurnPipeline.warm_up`` or the bench's own warm-up, the
first timed turn's Talker took 232-289 ms against ~150 in later runs of the same shapes. This runs turns as
``turn_bench.py`` does (the H200 profile, form ``talker-kernels``, 24 text tokens and 100 codes per answer) after
``TurnPipeline.warm_up`` and splits each run's Talker time by the engine's calls (``_admit`` with its prefill
``_prefill_many``, the decode step ``_run_step``, ``_emit``), synchronised around each, listing every call of
more than ``--slow`` ms. Then it times the Talker prefill alone at condition lengths no turn has prefilled yet,
twice each, to tell a per-shape first-call cost from the rest.

Session 49 found the cause (cuDNN's SDPA backend builds a plan per new shape) and runs the Talker's attention
without it (``sdpa_backend``). ``--talker-sdpa torch`` puts torch's own choice back for an A/B in fresh processes,
and ``--vary-tokens`` gives run k ``--tokens`` + k text tokens, so that each run's conditions have a length no
turn had before, as in serving (the bench's answers all have the same length). ``--talker-prefill eager`` drops
the engine's prefill graphs (session 49) for an A/B against them. Each run also counts Python's garbage-collector
pauses by generation (``gc.callbacks``), and ``--gc off`` disables the collector over the timed runs.
``--profile-admit`` runs each admission under cProfile and keeps the slowest one's functions per run, and
``--hidden-rows host|pinned|device`` hands the requests' hidden rows to the Talker in plain host memory (the
contract before session 50), pinned host memory or on the GPU (the contract since session 50: the default,
``contract``, hands them over as the runtime does).

    python benchmarks/talker_first_run_probe.py OUT                 # GPU
    python benchmarks/talker_first_run_probe.py OUT --tiny          # CPU check of the script
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from minicpmo_rt.checkpoint.tokenizer import load_tokenizer, vendored_tokenizer_dir

from code2wav_pipeline_bench import bench_models, device_label
from duplex_batch_bench import Clock
from duplex_bench import build, sync
from turn_bench import pipeline, run

PROFILE = "minicpmo_4_5_turn_mrv2_h200"


def call_summary(calls: list[tuple[str, float]], slow: float) -> dict:
    """A ``Clock``'s calls by name: total, count, median and max ms, and the slowest calls over ``slow`` ms."""
    by: dict[str, list[float]] = {}
    for name, ms in calls:
        by.setdefault(name, []).append(ms)
    slow_calls = [(i, name, round(ms, 2)) for i, (name, ms) in enumerate(calls) if ms > slow]
    return {"total_ms": {k: round(sum(v), 2) for k, v in by.items()}, "calls": {k: len(v) for k, v in by.items()},
            "median_ms": {k: round(statistics.median(v), 3) for k, v in by.items()},
            "max_ms": {k: round(max(v), 2) for k, v in by.items()},
            "slow_calls": len(slow_calls), "slowest": sorted(slow_calls, key=lambda c: -c[2])[:12]}


class GcLog:
    """Python's garbage-collector pauses (``gc.callbacks``): ms per generation while attached."""

    def __init__(self):
        self.ms: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.ms[g] = round(self.ms.get(g, 0.0) + (time.perf_counter() - self._t0) * 1e3, 2)
            self.count[g] = self.count.get(g, 0) + 1


def profile_calls(clock: Clock, obj, name: str, dev, top: int = 15) -> list:
    """Patch ``obj.name`` (through ``clock``, whose ``restore`` removes it) so that each call runs under cProfile,
    synchronised at both ends; returns the list the slowest call's (ms, its top functions by cumulative and own
    time) lands in."""
    import cProfile
    import io
    import pstats

    fn, worst = getattr(obj, name), []

    def profiled(*a, **k):
        prof = cProfile.Profile()
        sync(dev)
        t0 = time.perf_counter()
        prof.enable()
        out = fn(*a, **k)
        sync(dev)
        prof.disable()
        ms = (time.perf_counter() - t0) * 1e3
        if not worst or ms > worst[0][0]:
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf)
            stats.sort_stats("cumulative").print_stats(top)
            stats.sort_stats("tottime").print_stats(top)
            worst[:] = [(round(ms, 2), buf.getvalue())]
        return out

    clock.patch(obj, name, profiled)
    return worst


def rows_where(where: str, dev: torch.device) -> None:
    """Each TalkerRequest's hidden rows handed to the Talker in plain host memory, pinned host memory or on
    ``dev``, instead of where the ``TalkerInput`` contract puts them (a diagnosis of the admission's host->device
    stall: with rows on the device, ``_admit`` joins them there and moves nothing)."""
    from dataclasses import replace

    from minicpmo_rt.runtime.contracts import TalkerInput

    plain = TalkerInput.to_request

    def to_request(self, seed, max_codes=None):
        req = plain(self, seed, max_codes)
        rows = {"host": lambda h: h.cpu(), "pinned": lambda h: h.cpu().pin_memory(), "device": lambda h: h.to(dev)}
        return replace(req, hidden=rows[where](req.hidden))

    TalkerInput.to_request = to_request


def prefill_probe(engine, lengths, dev) -> list[dict]:
    """The engine's prefill of one condition of each length into slot 0, twice each (first call, then again)."""
    w = engine.tts.emb_text.weight
    out = []
    for n in lengths:
        cond = torch.randn(n, w.shape[1], device=dev, dtype=w.dtype)
        row = {"len": n}
        for tag in ("first", "second"):
            sync(dev)
            t0 = time.perf_counter()
            engine._prefill_many([0], [cond])
            sync(dev)
            row[tag] = round((time.perf_counter() - t0) * 1e3, 2)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--requests", default="1,16")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--codes", type=int, default=100)
    ap.add_argument("--slow", type=float, default=5.0, help="list calls longer than this (ms)")
    ap.add_argument("--talker-sdpa", choices=("no-cudnn", "torch"), default="no-cudnn",
                    help="the Talker's attention: without cuDNN's backend (the runtime's) or torch's own choice")
    ap.add_argument("--vary-tokens", action="store_true", help="run k answers with --tokens + k text tokens")
    ap.add_argument("--profile-admit", action="store_true", help="cProfile every admission; keep the slowest "
                    "one's top functions per run (in the JSON, and as text under --profile-admit-dir)")
    ap.add_argument("--profile-admit-dir", type=Path)
    ap.add_argument("--hidden-rows", choices=("contract", "host", "pinned", "device"), default="contract",
                    help="where the Talker requests' hidden rows are handed over (contract: as the runtime hands "
                    "them, on the Thinker's device since session 50; host: plain host memory, the contract before)")
    ap.add_argument("--gc", choices=("on", "off"), default="on", help="Python's garbage collector in the timed runs")
    ap.add_argument("--talker-prefill", choices=("graph", "eager"), default="graph",
                    help="admissions' prefill from the engine's graphs (the runtime's on CUDA) or eagerly")
    args = ap.parse_args()
    if args.talker_sdpa == "torch":
        import torch.nn.functional as F

        import minicpmo_rt.talker.engine as engine_module
        engine_module.attention = F.scaled_dot_product_attention
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if args.hidden_rows == "pinned" and dev.type != "cuda":
        ap.error("--hidden-rows pinned needs CUDA (pinned host memory is a CUDA allocation)")
    if args.hidden_rows != "contract":
        rows_where(args.hidden_rows, dev)
    tok = load_tokenizer(vendored_tokenizer_dir())
    thinker, tts = build(args.tiny, dev, dtype)
    flow, gen, feats, _ = bench_models(args.tiny, dev)
    pipe = pipeline(PROFILE, "talker-kernels", (thinker, tok, tts, flow, gen, feats), dev, args.codes, {})
    if args.talker_prefill == "eager":
        pipe.talker._prefill_graphs.clear()
    ns = [int(n) for n in args.requests.split(",")]
    res = {"gpu": device_label(dev), "torch": torch.__version__, "profile": PROFILE,
           "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(), "talker_sdpa": args.talker_sdpa,
           "talker_prefill": args.talker_prefill, "prefill_graphs": sorted(pipe.talker._prefill_graphs),
           "vary_tokens": args.vary_tokens, "hidden_rows": args.hidden_rows, "runs": []}
    res["warm_up_ms"] = pipe.warm_up(feats, batches=ns)
    eng = pipe.talker
    res["gc"] = args.gc
    if args.gc == "off":
        gc.collect()
        gc.disable()
    for n in ns:
        for k in range(args.runs):
            clock = Clock(dev)
            for name in ("_admit", "_prefill_many", "_run_step", "_emit"):
                clock.wrap(eng, name, name)
            for name in ("admit", "admit_many"):        # per request before session 50, then per admission
                if hasattr(eng.state, name):
                    clock.wrap(eng.state, name, name)
            clock.wrap(eng.tts, "logits", "logits")
            clock.wrap(eng.tts.projector_semantic, "forward", "forward")
            worst = profile_calls(clock, eng, "_admit", dev) if args.profile_admit else []
            pauses = GcLog()
            gc.callbacks.append(pauses)
            try:
                tokens = args.tokens + (k if args.vary_tokens else 0)
                row = run(pipe, n, feats, tokens, args.codes, dev, f"probe-{n}-{k}")
            finally:
                gc.callbacks.remove(pauses)
                clock.restore()
            row.update(run=k, tokens=tokens, split=call_summary(clock.calls, args.slow), gc_ms=pauses.ms,
                       gc_count=pauses.count)
            if worst:
                row["admit_profile"] = {"ms": worst[0][0], "stats": worst[0][1]}
                if args.profile_admit_dir:
                    args.profile_admit_dir.mkdir(parents=True, exist_ok=True)
                    (args.profile_admit_dir / f"admit_N{n}_run{k}.txt").write_text(f"{worst[0][0]} ms\n{worst[0][1]}")
            res["runs"].append(row)
            print(f"N={n} run {k} ({tokens} tokens): wall {row['wall_ms']:.0f}, Talker {row['talker_ms']:.0f}, Code2Wav "
                  f"{row['code2wav_ms']:.0f} ms; GC {pauses.ms} ms ({pauses.count}); {row['split']}", flush=True)
    lengths = (11, 13, 29, 37, 45) if not args.tiny else (5, 7)
    res["prefill"] = prefill_probe(eng, lengths, dev)
    print(f"prefill at new lengths ({args.talker_sdpa}):", res["prefill"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"talker_first_run_probe_{args.talker_sdpa}_{args.talker_prefill}_gc{args.gc}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
