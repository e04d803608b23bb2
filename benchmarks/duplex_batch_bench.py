"""Concurrent duplex conversations on one GPU: the wall time of one second for N conversations, every
unit speaking, Thinker -> Talker -> Code2Wav, full-size random weights in bf16 (Code2Wav in FP32 with
the duplex profile's TF32 CFM).

A second of N conversations must finish inside one second for all of them to stay live. Two ways to
run N conversations side by side in one run:

- ``batch-rows``: one ``DuplexBatch`` with ``shared_decode=True`` (its default on CUDA from two conversations
  on): the sessions sit on rows of one static
  decoder, each commits its second, then every decode step of all of them is one forward
  (``StaticRows``); every speaking unit's Talker draws together (``TalkerTurns``: one batched forward
  per draw, a CUDA graph) and their Code2Wav payloads together (``push_many``);
- ``batch-rows-each``: ``batch-rows`` with each session's commit prefilling alone (``batched_commit=False``;
  ``batch-rows`` runs the seconds' commits' LLM prefills together, ``thinker.session.commit_many``);
- ``batch-rows-audio-each``: ``batch-rows`` with each session's audio-encoder step alone (``batched_audio=False``;
  ``batch-rows`` runs them in one graph replay, ``AudioGraphs.embed_chunks``);
- ``batch-rows-mel``: ``batch-rows`` with the commits' mels in one batch (``batched_mel=True``, opt-in:
  ``mel.process_many``; ``batch-rows`` runs one per session);
- ``batch``: ``DuplexBatch`` with ``shared_decode=False``: each session on its own static decoder, so the
  units decode one conversation at a time (the rows of ``duplex_batch_bench_session41_h200.md``);
- ``sequential``: N ``DuplexConversation``s stepped one after another (each its own Talker graph and
  Code2Wav pushes): what serving N users without the batch costs.

Every unit is made to speak (as ``duplex_bench.py``: the LM head puts an ordinary text token on top at
every decode step, so each unit speaks until the 28-character limit and no turn ends), with a 448x448
frame per conversation per second: the busiest second a conversation has. Code2Wav's voice is a random
6-s prompt (``code2wav_pipeline_bench.bench_models``), given to the streams directly.

    python benchmarks/duplex_batch_bench.py OUT --conversations 1,4,8,16 --sequential 1,4,8   # GPU
    python benchmarks/duplex_batch_bench.py OUT --tiny --conversations 1,2 --sequential 1,2   # CPU smoke run
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from minicpmo_rt.checkpoint.tokenizer import load_tokenizer, vendored_tokenizer_dir
from minicpmo_rt.code2wav.pipeline import Code2Wav
from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder, VocoderSet
from minicpmo_rt.profiles import load_profile
from minicpmo_rt.runtime.duplex import DEFAULT_DUPLEX_PROFILE, DuplexBatch, DuplexConversation, DuplexInput
from minicpmo_rt.thinker.duplex import DuplexDecodeConfig
from minicpmo_rt.thinker.session import shared_fast_paths

from code2wav_pipeline_bench import bench_models, device_label, parse_batches
from duplex_bench import build, sync


_UNSET = object()


class Clock:
    """Milliseconds spent in wrapped calls, synchronised at both ends (a benchmark's phase split), in total per
    phase (``ms``) and call by call (``calls``: (phase, ms) in order). The wrappers are instance attributes over
    the methods (or over a module's functions); ``restore`` puts back what each replaced (objects reused across
    runs)."""

    def __init__(self, dev: torch.device):
        self.dev, self.ms, self.calls, self._undo = dev, {}, [], []

    def patch(self, obj, name: str, fn) -> None:
        self._undo.append((obj, name, obj.__dict__.get(name, _UNSET)))
        setattr(obj, name, fn)

    def wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            sync(self.dev)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync(self.dev)
            ms = (time.perf_counter() - t0) * 1e3
            self.ms[phase] = self.ms.get(phase, 0.0) + ms
            self.calls.append((phase, ms))
            return out

        self.patch(obj, name, timed)

    def restore(self) -> None:
        for obj, name, old in reversed(self._undo):     # newest first: a wrap over a patch unwinds to the original
            if old is _UNSET:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, old)
        self._undo.clear()


def duplex_models(tiny: bool, dev: torch.device):
    """(thinker, tokenizer, tts, code2wav, voice features, Code2Wav's fast-path choice, session options): the models
    of a duplex bench on ``dev``, random weights (Thinker and Talker bf16 on CUDA), Code2Wav under the duplex
    profile and prepared for the voice on CUDA, the sessions' shared fast paths on CUDA (none elsewhere)."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tok = load_tokenizer(vendored_tokenizer_dir())
    thinker, tts = build(tiny, dev, dtype)
    flow, gen, feats, _ = bench_models(tiny, dev)
    voc = Vocoder(gen, CAUSAL)
    c2w = Code2Wav(flow, VocoderSet(voc, voc), frontend=None, n_timesteps=10)
    choice = c2w.configure_fast_path(load_profile(DEFAULT_DUPLEX_PROFILE).code2wav.extra)
    if dev.type == "cuda":
        c2w.prepare(feats)
    options = shared_fast_paths(thinker) if dev.type == "cuda" else {}
    return thinker, tok, tts, c2w, feats, choice, options


def attach_code2wav(convs, c2w, feats) -> None:
    """Random-weight Code2Wav has no frontend: the streams take the prompt features as their voice."""
    for c in convs:
        c.code2wav, c.voice = c2w, feats


ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries")
# counters (their change is what a row or a probed call records); the other machine_state keys are states
COUNTED = ("gc_collections", "host_allocs", "staging_waits", "staging_grows", "cufft_plans", "reserved_mib",
           *ALLOC_KEYS)


def machine_state(dev: torch.device, staging=None, clock: bool = True) -> dict:
    """Counters a second's row records the change of (``--diag``; ``queued_wait_probe`` records them around one
    call): the caching allocator's cudaMalloc / cudaFree calls and retries and the MiB it reserved, cuFFT plans
    made (the cache's size; a plan made mid-stream waits for the device, session 52), pinned host allocations,
    Python's garbage collections, the sessions' shared ``HostStaging`` uploads that waited for a slot's previous
    copy and its slots grown; with ``clock``, also the SM clock with NVML's throttle reasons at the second's end:
    what a run that slows down midway changed by."""
    import gc

    out = {"gc_collections": sum(g["collections"] for g in gc.get_stats())}
    if staging is not None:
        out["staging_waits"], out["staging_grows"] = staging.waits, staging.grows
    if dev.type != "cuda":
        return out
    stats = torch.cuda.memory_stats(dev)
    out.update({k: stats.get(k, 0) for k in ALLOC_KEYS})
    out["segments"] = stats.get("segment.all.current", 0)
    out["reserved_mib"] = round(stats.get("reserved_bytes.all.current", 0) / 2**20, 1)     # a change: cudaMalloc'd
    out["cufft_plans"] = torch.backends.cuda.cufft_plan_cache[dev.index or 0].size
    if hasattr(torch.cuda, "host_memory_stats"):
        out["host_allocs"] = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    if not clock:
        return out
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0)
        out["sm_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
        out["throttle"] = int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        out["temp_c"] = pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
    except Exception as e:     # no NVML here: the counters above still say something
        out["nvml"] = type(e).__name__
    return out


def project_path(filename: str) -> str | None:
    """``filename``'s path inside the project's package (``thinker/mel.py``), or None for a file outside it."""
    head, sep, tail = filename.rpartition(f"{os.sep}minicpmo_rt{os.sep}")
    return tail if sep else None


@contextlib.contextmanager
def calls_recorded(owner, name: str, sites: list[str]):
    """``owner.name`` wrapped for the block: each call appends its caller's site (the innermost frame in the
    project's ``src/``, as ``path:function``) to ``sites``, then runs as before; put back afterwards. ``--diag``
    wraps ``torch.cuda.CUDAGraph.capture_begin`` with it: a second that captured a graph says which code did."""
    original = owner.__dict__[name]

    def recorded(*args, **kwargs):
        f = sys._getframe(1)
        while f is not None and project_path(f.f_code.co_filename) is None:
            f = f.f_back
        sites.append("?" if f is None else f"{project_path(f.f_code.co_filename)}:{f.f_code.co_name}")
        return original(*args, **kwargs)

    setattr(owner, name, recorded)
    try:
        yield sites
    finally:
        setattr(owner, name, original)


SEGMENT_ACTIONS = ("segment_alloc", "segment_map")     # a cudaMalloc (or an expandable segment's growth)


def segment_sites(events: list[dict]) -> dict[str, float]:
    """MiB of new allocator segments by the code that asked for them: ``events`` are entries of
    ``torch.cuda.memory._snapshot()["device_traces"]``; the site is the innermost frame in the project's
    ``src/`` (``path:line:function``), or the innermost frame at all when none is the project's."""
    sites: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("action") not in SEGMENT_ACTIONS:
            continue
        frames = e.get("frames") or []
        f = next((f for f in frames if project_path(f.get("filename", ""))), frames[0] if frames else {})
        name = project_path(f.get("filename", "?")) or f.get("filename", "?")
        sites[f"{name}:{f.get('line', '?')}:{f.get('name', '?')}"] += e.get("size", 0) / 2**20
    return {k: round(v, 1) for k, v in sorted(sites.items(), key=lambda kv: -kv[1])}


@contextlib.contextmanager
def segment_history(dev: torch.device):
    """The caching allocator's history with Python stacks for the block (``--alloc-sites``): yields a function
    that returns the events recorded since its last call. Only segment events are kept where this torch can
    skip the others (each event costs a stack walk); off afterwards."""
    rec = torch.cuda.memory._record_memory_history
    kw = {"context": "alloc", "stacks": "python", "device": dev, "clear_history": True}
    try:
        rec("all", max_entries=100_000, skip_actions=["alloc", "free_requested", "free_completed"], **kw)
    except TypeError:     # an older torch: every event, in a ring large enough for a second of them
        rec("all", max_entries=2_000_000, **kw)
    seen = 0

    def since() -> list[dict]:
        nonlocal seen
        traces = torch.cuda.memory._snapshot(dev)["device_traces"][dev.index or 0]
        new, seen = traces[seen:], len(traces)
        return new

    try:
        yield since
    finally:
        rec(None, device=dev)


def triton_jit():
    """Triton's ``runtime.jit`` module, or None without Triton (its compiles are then not counted)."""
    try:
        import triton.runtime.jit as jit
    except ImportError:
        return None
    return jit


def state_change(before: dict, after: dict) -> dict:
    """A second's row entries: counters as the change over the second, the clock state as at its end."""
    return {k: (after[k] - before.get(k, 0) if k in COUNTED else after[k]) for k in after}


def run(kind: str, n: int, parts, units: int, frame, dev, decode: str = "greedy", profile=None,
        warm: int = 0, split: bool = False, warm_up: int = 0, diag: bool = False,
        alloc_sites: bool = False) -> list[dict]:
    """One run of ``units`` seconds. ``profile``: a ``cProfile.Profile`` enabled over the seconds from ``warm``
    on. With a profile or ``split`` the Thinker's time is also split by part (``thinker_parts``; each part
    synchronised, so only then). ``warm_up``: a batch first runs ``DuplexBatch.warm_up`` for that many seconds
    (with the frame), untimed but for its own seconds, which go into the first row as ``warm_up_ms``. ``diag``: each
    row also records ``machine_state``'s changes over its second and, on CUDA, the CUDA graphs captured and the
    Triton kernels compiled in it, by the project code that made them (``calls_recorded``). ``alloc_sites`` (CUDA):
    each row also records the MiB of new allocator segments by the code that asked (``segment_sites``)."""
    thinker, tok, tts, c2w, feats, options = parts
    cfg = DuplexDecodeConfig(mode=decode)
    rng = np.random.default_rng(n)
    clock = Clock(dev)
    rows_kind = kind in ("batch-rows", "batch-rows-each", "batch-rows-audio-each", "batch-rows-mel")
    if rows_kind and not options:     # CPU smoke run: static caches on the torch kernels
        options = {"llm_cache": "static", "llm_kernels": "torch"}
    if kind in ("batch", "batch-rows", "batch-rows-each", "batch-rows-audio-each", "batch-rows-mel"):
        batch = DuplexBatch(thinker, tok, tts, None, [None] * n, seeds=list(range(n)), decode=cfg, fast=True,
                            session_options=options, shared_decode=rows_kind)
        if kind == "batch-rows-each":     # each session's commit prefills alone (before commit_many)
            batch.batched_commit = False
        if kind == "batch-rows-audio-each":     # commit_many, each session's audio step alone (before embed_chunks)
            batch.batched_audio = False
        if kind == "batch-rows-mel":            # commit_many, the mels in one batch (opt-in since session 50)
            batch.batched_mel = True
        batch.code2wav = c2w
        took = []
        if warm_up:
            attach_code2wav(batch.conversations, c2w, feats)
            took = batch.warm_up(warm_up, frame)     # reopens every seat: the new ones get the voice below
        convs = batch.conversations
        clock.wrap(batch, "_think", "thinker")
        clock.wrap(batch.talker, "generate_units", "talker")
        clock.wrap(c2w, "push_many", "code2wav")
        if profile is not None or split:
            thinker_parts(clock, batch)
    else:
        batch = None
        convs = [DuplexConversation(thinker, tok, tts, None, None, decode=cfg, seed=i, fast=True,
                                    session_options=options) for i in range(n)]
        for c in convs:
            clock.wrap(c.talker, "generate_unit", "talker")
            clock.wrap(c, "_vocode", "code2wav")
            clock.wrap(c, "_think", "thinker")
    attach_code2wav(convs, c2w, feats)
    rows = []
    captured: list[str] = []
    compiled: list[str] | None = []
    recording = contextlib.ExitStack()
    if diag and dev.type == "cuda":     # which code captured a CUDA graph in a second (the slow ones after a warm-up)
        recording.enter_context(calls_recorded(torch.cuda.CUDAGraph, "capture_begin", captured))
        jit = getattr(triton_jit(), "JITFunction", None)
        if jit is not None and "_do_compile" in jit.__dict__:     # and which launch compiled a Triton kernel
            recording.enter_context(calls_recorded(jit, "_do_compile", compiled))
        else:     # a Triton without that method: the rows say nothing of compiles rather than "none"
            compiled = None
    since = recording.enter_context(segment_history(dev)) if alloc_sites and dev.type == "cuda" else None
    with recording:
        for k in range(units):
            inputs = [DuplexInput((0.1 * rng.standard_normal(16000)).astype(np.float32), frame) for _ in range(n)]
            clock.ms = {}
            sync(dev)
            state = machine_state(dev, options.get("staging")) if diag else None
            if profile is not None and k == warm:
                profile.enable()
            t0 = time.perf_counter()
            if batch is not None:
                out = batch.step(inputs)
            else:
                out = [c.step(x.audio, x.frame) for c, x in zip(convs, inputs)]
            sync(dev)
            ms = (time.perf_counter() - t0) * 1e3
            rows.append({"second": k, "ms": ms, **{f"{p}_ms": v for p, v in clock.ms.items()},
                         "speaking": sum(1 for u in out if u.codes), "codes": sum(len(u.codes) for u in out),
                         "tokens": sum(len(u.token_ids) for u in out),     # the Thinker's decode steps follow these
                         "audio_s": sum(u.seconds for u in out)})
            if diag:
                rows[-1]["state"] = state_change(state, machine_state(dev, options.get("staging")))
                rows[-1]["captures"] = dict(sorted(collections.Counter(captured).items()))
                if compiled is not None:
                    rows[-1]["compiles"] = dict(sorted(collections.Counter(compiled).items()))
                    compiled.clear()
                captured.clear()
            if since is not None:
                rows[-1]["segment_sites"] = segment_sites(since())
    if profile is not None:
        profile.disable()
    if batch is not None and took:
        rows[0]["warm_up_ms"] = took
    clock.restore()
    if batch is not None:
        batch.close()     # the conversations and the shared rows' decoder, back to its pool
    else:
        for c in convs:
            c.close()
    return rows


def release(dev: torch.device) -> float:
    """Free what a finished run held before the next one starts and return the GiB still allocated (which
    should stay flat from run to run): session 47's first 12-run plan ran out of the H200's memory at its 9th
    run, with neither this nor ``DuplexBatch.close`` (each run's shared rows stayed out of their pool)."""
    gc.collect()
    if dev.type != "cuda":
        return 0.0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(dev) / 2**30


THINKER_PARTS = ("vision", "mel", "audio", "prefill", "commit", "rows step", "host copy", "rest")


def thinker_parts(clock: Clock, batch: DuplexBatch) -> None:
    """Split a ``DuplexBatch``'s Thinker time: the second's frames through the vision encoder, each session's
    mel and audio-encoder step, the units' LLM prefill (``StaticRows.feed_many``, the seconds' commits
    together), each session's commit when it commits alone (its mel, audio and prefill then count here too),
    each shared decode step (``StaticRows``), the logits' copy to the host; what is left is the lock-step
    loop's host work (the decode policy, the commits' bookkeeping)."""
    import minicpmo_rt.thinker.session as session_module

    for conv in batch.conversations:
        clock.wrap(conv.session, "embed_frames", "vision")
        clock.wrap(conv.session, "_mel_step", "mel")
        clock.wrap(conv.session, "_audio_step", "audio")
    if hasattr(session_module, "process_many"):     # the commits' mels in one batch (commit_many, session 50)
        clock.wrap(session_module, "process_many", "mel")
    graphs = {id(c.session.audio_graphs): c.session.audio_graphs for c in batch.conversations
              if hasattr(c.session.audio_graphs, "embed_chunks")}
    for g in graphs.values():     # the batched audio steps (commit_many's audio_steps)
        clock.wrap(g, "embed_chunks", "audio")
        if not batch.batched_commit:
            clock.wrap(conv.session, "commit", "commit")
    if batch.rows is not None and batch.batched_commit:
        clock.wrap(batch.rows, "feed_many", "prefill")
    if batch.rows is not None:
        step_logits = batch.rows.step_logits

        def step_and_copy(*a, **k):
            out = step_logits(*a, **k)
            sync(clock.dev)
            t0 = time.perf_counter()
            # the logits' copy that ``DuplexBatch._think`` makes next, made here to time it: the loop's own
            # ``.cpu()`` then finds them on the host (the hidden rows' copy, 1/37 of the bytes, stays there)
            logits = out.logits.cpu()
            clock.ms["host copy"] = clock.ms.get("host copy", 0.0) + (time.perf_counter() - t0) * 1e3
            return dataclasses.replace(out, logits=logits)

        clock.patch(batch.rows, "step_logits", step_and_copy)
        clock.wrap(batch.rows, "step_logits", "rows step")


def profile_text(prof, head: str) -> str:
    """``head``, then a ``cProfile.Profile``'s functions by own time (40) and by cumulative time (60)."""
    import io
    import pstats

    buf = io.StringIO()
    buf.write(head)
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    return buf.getvalue()


def write_profile(rows: list[dict], prof, warm: int, n: int, path: Path) -> None:
    """The cProfile run's seconds and phase split, then its stats (by own time, then cumulative)."""
    steady = rows[warm:]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in steady)  # noqa: E731
    parts = ", ".join(f"{p} {med(p + '_ms'):.1f}" for p in THINKER_PARTS[:-1])
    rest = med("thinker_ms") - sum(med(p + "_ms") for p in THINKER_PARTS[:-1] if p != "host copy")
    head = (f"N={n}, batch-rows: {len(steady)} seconds{' under cProfile' if prof is not None else ''}, median {med('ms'):.0f} ms per second "
            f"(Thinker {med('thinker_ms'):.0f}, Talker {med('talker_ms'):.0f}, Code2Wav {med('code2wav_ms'):.0f} ms)\n"
            f"Thinker parts, ms per second (each synchronised; 'host copy', the logits' copy to the host, is inside "
            f"'rows step'): {parts}; the rest of the Thinker (the lock-step loop's host work: decode policy, "
            f"accepting tokens) {rest:.1f}\n\n")
    path.write_text(profile_text(prof, head) if prof is not None else head)
    print(head.rstrip(), flush=True)


def summarize(rows: list[dict], warm: int, n: int) -> dict:
    steady = rows[warm:]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in steady)  # noqa: E731
    return {"seconds": len(steady), "ms": med("ms"), "ms_max": max(r["ms"] for r in steady),
            "thinker_ms": med("thinker_ms"), "talker_ms": med("talker_ms"), "code2wav_ms": med("code2wav_ms"),
            "speaking": med("speaking"), "codes": med("codes"), "audio_s": med("audio_s"),
            "real_time_factor": med("ms") / 1000.0, "ms_per_conversation": med("ms") / n}


def write_table(res: dict, path: Path) -> None:
    lines = [f"# Concurrent duplex conversations ({res['gpu']}, Thinker/Talker {res['dtype']}, "
             f"{'tiny' if res['tiny'] else 'full-size'} random weights, torch {res['torch']})", "",
             "Wall time of one second of N conversations, every unit speaking to its 28-character limit with "
             f"{'a 448x448 frame' if res.get('frame', True) else 'no frame (audio only)'}; medians over seconds {res['warm']}..{res['units'] - 1}. A second is live while it "
             "takes under 1000 ms (real-time factor < 1). Phase columns are the summed time in each stage "
             "(synchronised around each call). `run` is the run's place in the process (the first run of a size "
             "also pays that size's first captures).", "",
             "| N | path | decode | ms per second | max | real-time factor | ms per conversation | Thinker ms | Talker ms | "
             "Code2Wav ms | codes | audio s | x sequential | run |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    dec = lambda r: r.get("decode", "greedy")      # noqa: E731  (runs before session 42 were all greedy)
    seq = {(r["n"], dec(r)): r["summary"]["ms"] for r in res["runs"] if r["kind"] == "sequential"}
    order = {id(r): i + 1 for i, r in enumerate(res["runs"])}
    for r in sorted(res["runs"], key=lambda r: (dec(r), r["n"], r["kind"] == "sequential", r["kind"])):
        s = r["summary"]
        key = (r["n"], dec(r))
        ratio = f"{seq[key] / s['ms']:.2f}" if r["kind"] != "sequential" and key in seq else "-"
        lines.append(f"| {r['n']} | {r['kind']} | {dec(r)} | {s['ms']:.1f} | {s['ms_max']:.1f} | {s['real_time_factor']:.3f} | "
                     f"{s['ms_per_conversation']:.1f} | {s['thinker_ms']:.1f} | {s['talker_ms']:.1f} | "
                     f"{s['code2wav_ms']:.1f} | {s['codes']:.0f} | {s['audio_s']:.2f} | {ratio} | {order[id(r)]} |")
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (a check of the script)")
    ap.add_argument("--conversations", default="1,4,8,16", help="N for the batched paths")
    ap.add_argument("--batch-kinds", default="batch-rows,batch", help="batched paths to run, in order")
    ap.add_argument("--sequential", default="1,4,8", help="N for the sequential path ('' for none)")
    ap.add_argument("--units", type=int, default=8, help="seconds per run")
    ap.add_argument("--warm", type=int, default=3, help="first seconds left out of the medians (captures, compiles)")
    ap.add_argument("--decode", default="greedy",
                    help="the Thinker's duplex decode modes to run, in order: greedy and/or sampling (upstream's "
                         "default, 0.7 / top-k 20 / top-p 0.8), e.g. greedy,sampling")
    ap.add_argument("--parts", default="", metavar="N,...",
                    help="after the timed runs, one batch-rows run of each N (the first --decode mode) with its Thinker "
                         "split by part, synchronised around each (no cProfile), after --warm-up, with --diag: "
                         "OUT/duplex_batch_bench_parts_N.txt, each second's rows in "
                         "OUT/duplex_batch_bench_parts_N.json")
    ap.add_argument("--warm-up", type=int, default=0, metavar="S",
                    help="each batched run first calls DuplexBatch.warm_up(S, frame) (start-up graphs and compiles "
                         "made before the timed seconds; its own seconds are reported beside them)")
    ap.add_argument("--diag", action="store_true",
                    help="each second's row records the allocator's cudaMalloc/cudaFree calls, pinned host allocations, "
                         "garbage collections, the SM clock (machine_state), the CUDA graphs captured and the Triton "
                         "kernels compiled, by the code that made them; printed per run")
    ap.add_argument("--alloc-sites", action="store_true",
                    help="on CUDA, each second's row also records the MiB of new allocator segments (cudaMalloc) by "
                         "the project code that asked for them, from the allocator's history with Python stacks "
                         "(slows the seconds a little)")
    ap.add_argument("--no-frame", action="store_true",
                    help="the units carry audio only (no 448x448 frame, so no vision encoder ahead of the commits)")
    ap.add_argument("--table", type=Path, help="only rewrite OUT/duplex_batch_bench.md from this run's JSON")
    ap.add_argument("--cprofile", type=int, metavar="N",
                    help="after the timed runs, one batch-rows run of N conversations (the first --decode mode) under "
                         "cProfile, its Thinker split by part: OUT/duplex_batch_bench_cprofile_N.txt")
    args = ap.parse_args()
    if args.table:
        args.out.mkdir(parents=True, exist_ok=True)
        return write_table(json.loads(args.table.read_text()), args.out / "duplex_batch_bench.md")
    args.diag = args.diag or args.alloc_sites     # the sites are printed with the rest of the census
    if args.warm >= args.units:
        ap.error(f"--warm {args.warm} leaves no measured second of --units {args.units}")
    batched = parse_batches(ap, args.conversations)
    sequential = parse_batches(ap, args.sequential) if args.sequential else []
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    thinker, tok, tts, c2w, feats, choice, options = duplex_models(args.tiny, dev)
    dtype = thinker.dtype
    frame = None if args.no_frame else np.random.default_rng(1).integers(0, 255, (448, 448, 3), dtype=np.uint8)
    res = {"gpu": device_label(dev), "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
           "tiny": args.tiny, "units": args.units, "warm": args.warm, "code2wav": str(choice), "frame": frame is not None,
           "runs": []}
    args.out.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in args.batch_kinds.split(",") if k]
    decodes = [d for d in args.decode.split(",") if d]
    if not decodes or set(decodes) - {"greedy", "sampling"}:
        ap.error(f"--decode: choose from greedy, sampling (got {args.decode!r})")
    if set(kinds) - {"batch", "batch-rows", "batch-rows-each", "batch-rows-audio-each", "batch-rows-mel"}:
        ap.error("--batch-kinds: choose from batch-rows, batch-rows-each, batch-rows-audio-each, batch-rows-mel, "
                 f"batch (got {args.batch_kinds!r})")
    plan = [(d, k, n) for d in decodes for n in batched for k in kinds] + \
        [(d, "sequential", n) for d in decodes for n in sequential]
    for decode, kind, n in plan:
        rows = run(kind, n, (thinker, tok, tts, c2w, feats, options), args.units, frame, dev, decode,
                   warm_up=args.warm_up if kind != "sequential" else 0, diag=args.diag, alloc_sites=args.alloc_sites)
        held = release(dev)
        s = summarize(rows, args.warm, n)
        res["runs"].append({"kind": kind, "n": n, "decode": decode, "summary": s, "rows": rows,
                            "allocated_after_gib": held})
        print(f"{kind:10s} {decode:8s} N={n:2d}: {s['ms']:7.1f} ms per second (max {s['ms_max']:.1f}; Thinker {s['thinker_ms']:.1f}, "
              f"Talker {s['talker_ms']:.1f}, Code2Wav {s['code2wav_ms']:.1f}), {s['codes']:.0f} codes, "
              f"{s['audio_s']:.2f} s of audio; {held:.1f} GiB held after", flush=True)
        warm_ms = rows[0].get("warm_up_ms", [])
        seconds = ", ".join(f"{r['ms']:.0f}" for r in rows)
        print(f"  seconds: {seconds} ms"
              + (f" (after warm_up: {', '.join(f'{t:.0f}' for t in warm_ms)} ms)" if warm_ms else ""), flush=True)
        if args.diag:
            thinker_ms = ", ".join(f"{r['thinker_ms']:.0f}" for r in rows)
            print(f"  Thinker: {thinker_ms} ms; tokens: {', '.join(str(r['tokens']) for r in rows)}", flush=True)
            for key in rows[0]["state"]:
                print(f"  {key}: {', '.join(str(r['state'][key]) for r in rows)}", flush=True)
            for r in rows:
                for what in ("captures", "compiles", "segment_sites"):
                    if r.get(what):
                        print(f"  second {r['second']} {what}: {r[what]}", flush=True)
        (args.out / "duplex_batch_bench.json").write_text(json.dumps(res, indent=1))   # a cut-off run keeps its rows
    write_table(res, args.out / "duplex_batch_bench.md")
    for n in parse_batches(ap, args.parts) if args.parts else []:
        rows = run("batch-rows", n, (thinker, tok, tts, c2w, feats, options), args.units, frame, dev, decodes[0],
                   warm=args.warm, split=True, warm_up=args.warm_up, diag=args.diag)
        release(dev)
        write_profile(rows, None, args.warm, n, args.out / f"duplex_batch_bench_parts_{n}.txt")
        (args.out / f"duplex_batch_bench_parts_{n}.json").write_text(json.dumps(rows, indent=1))     # each second's
        if args.diag:
            for p in THINKER_PARTS[:-1]:
                each = ", ".join(f"{r.get(p + '_ms', 0.0):.0f}" for r in rows)
                print(f"  {p}: {each} ms", flush=True)
    if args.cprofile:
        import cProfile

        prof = cProfile.Profile()
        rows = run("batch-rows", args.cprofile, (thinker, tok, tts, c2w, feats, options), args.units, frame, dev,
                   decodes[0], profile=prof, warm=args.warm)
        write_profile(rows, prof, args.warm, args.cprofile,
                      args.out / f"duplex_batch_bench_cprofile_{args.cprofile}.txt")


if __name__ == "__main__":
    main()
