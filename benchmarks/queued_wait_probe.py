"""Which stages of a duplex second wait for the device: each stage's first call in one second, with ~1 s of
device work queued just before it (``torch.cuda._sleep``).

A stage that only queues work returns in milliseconds. A stage that syncs the stream on the way (a copy from
pageable memory, a host read of a device value) takes about the queued second. In a real second, a stage of the
second kind stops the host from running ahead of the GPU, for example while the vision encoder runs. Session 51
found two: the batched mel's row table and the audio step's positions. This probe lists the rest in one run.

The conversations are those of ``duplex_batch_bench.py`` (``batch-rows``: every unit speaking, a 448x448 frame,
full-size random weights on the GPU). After ``--warm`` plain seconds, each further second probes one stage (the
first call of that stage in that second; later calls run plain). The seconds in between run plain too.
Expected waits: ``StaticRows.step_logits`` callers read logits on the host after it, not inside it.

    python benchmarks/queued_wait_probe.py OUT --conversations 16      # GPU
    python benchmarks/queued_wait_probe.py OUT --tiny --conversations 2  # CPU: host times only, nothing queued
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from minicpmo_rt.runtime.duplex import DuplexBatch, DuplexInput
from minicpmo_rt.thinker.duplex import DuplexDecodeConfig

from code2wav_pipeline_bench import device_label
from duplex_batch_bench import COUNTED, attach_code2wav, duplex_models, machine_state
from duplex_bench import sync

SPIN_CYCLES = 2_000_000_000     # ~1 s on the H200's 1.98 GHz clock
WAITS_FROM_S = 0.3              # a probed call slower than this waited for the queue


def stages(batch: DuplexBatch) -> list[tuple[str, object, str]]:
    """(label, owner, attribute) of each stage probed, in the order a second calls them."""
    import minicpmo_rt.thinker.session as session_module

    session = batch.conversations[0].session
    return [("vision (StreamingSession.embed_frames)", session, "embed_frames"),
            ("unit input (StreamingSession._unit_input)", type(session), "_unit_input"),
            ("mel, one session (StreamingMel.process)", type(session.mel), "process"),
            ("mel, all sessions (mel.process_many)", session_module, "process_many"),
            ("audio steps (session.audio_steps)", session_module, "audio_steps"),
            ("unit rows (StreamingSession._unit_rows)", type(session), "_unit_rows"),
            ("prefill (StaticRows.feed_many)", batch.rows, "feed_many"),
            ("apply unit (StreamingSession._apply_unit)", type(session), "_apply_unit"),
            ("decode step (StaticRows.step_logits)", batch.rows, "step_logits"),
            ("Talker (TalkerTurns.generate_units)", batch.talker, "generate_units"),
            ("Code2Wav (Code2Wav.push_many)", batch.code2wav, "push_many")]


def sync_causes(dev: torch.device, staging=None) -> dict:
    """``machine_state``'s counters without the clock: cudaMalloc calls, cuFFT plans made, pinned allocations,
    the shared staging ring's waits and slots grown, collections (calls on the way that may synchronise or cost
    host time)."""
    return {k: v for k, v in machine_state(dev, staging, clock=False).items() if k in COUNTED}


class Probe:
    """Wraps one stage so that its first call runs behind ~1 s of queued device work and is timed; ``undo``
    puts the attribute back. ``causes`` (a function returning counters, ``sync_causes``): their change over
    the call goes into ``counts``."""

    def __init__(self, owner, name: str, dev: torch.device, causes=dict):
        self.owner, self.name, self.dev = owner, name, dev
        self.had = name in vars(owner)
        self.old = vars(owner).get(name)
        self.fn = getattr(owner, name)
        self.host_s: float | None = None
        self.counts: dict = {}
        probe = self

        def call(*a, **k):
            if probe.host_s is not None:
                return probe.fn(*a, **k)
            sync(dev)
            if dev.type == "cuda":
                torch.cuda._sleep(SPIN_CYCLES)
            before = causes()
            t0 = time.perf_counter()
            try:
                return probe.fn(*a, **k)
            finally:
                probe.host_s = time.perf_counter() - t0
                after = causes()
                probe.counts = {key: after[key] - before.get(key, 0) for key in after}
                sync(dev)

        if isinstance(owner, type):     # a method patched on the class: the wrapper takes self first
            setattr(owner, name, lambda this, *a, **k: call(this, *a, **k))
        else:
            setattr(owner, name, call)

    def undo(self) -> None:
        if self.had:
            setattr(self.owner, self.name, self.old)
        else:
            delattr(self.owner, self.name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (a check of the script)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--warm", type=int, default=3, help="plain seconds first (captures, compiles)")
    ap.add_argument("--batched-mel", action="store_true", help="the commits' mels in one batch (opt-in path)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    thinker, tok, tts, c2w, feats, _, options = duplex_models(args.tiny, dev)
    options = options or {"llm_cache": "static", "llm_kernels": "torch"}     # CPU: static rows on torch kernels
    n = args.conversations
    batch = DuplexBatch(thinker, tok, tts, None, [None] * n, seeds=list(range(n)), fast=True,
                        decode=DuplexDecodeConfig(mode="greedy"), session_options=options, shared_decode=True)
    batch.batched_mel = args.batched_mel
    batch.code2wav = c2w
    attach_code2wav(batch.conversations, c2w, feats)
    frame = np.random.default_rng(1).integers(0, 255, (448, 448, 3), dtype=np.uint8)
    rng = np.random.default_rng(n)

    def second() -> float:
        inputs = [DuplexInput((0.1 * rng.standard_normal(16000)).astype(np.float32), frame) for _ in range(n)]
        sync(dev)
        t0 = time.perf_counter()
        batch.step(inputs)
        sync(dev)
        return (time.perf_counter() - t0) * 1e3

    staging = batch.conversations[0].session.staging
    plain = [second() for _ in range(args.warm)]
    rows = []
    for label, owner, name in stages(batch):
        probe = Probe(owner, name, dev, lambda: sync_causes(dev, staging))
        try:
            ms = second()
        finally:
            probe.undo()
        plain.append(second())      # a plain second between probes: no probe sees another's queue
        waited = probe.host_s is not None and dev.type == "cuda" and probe.host_s > WAITS_FROM_S
        rows.append({"stage": label, "called": probe.host_s is not None,
                     "host_ms": None if probe.host_s is None else probe.host_s * 1e3,
                     "waits": waited, "second_ms": ms, "counts": probe.counts})
        state = ("not called" if probe.host_s is None
                 else f"{probe.host_s * 1e3:8.1f} ms" + ("  WAITS" if waited else "")
                 + "".join(f"  {k}+{v}" for k, v in probe.counts.items() if v))
        print(f"{label:45s} {state}", flush=True)
    batch.close()
    res = {"gpu": device_label(dev), "torch": torch.__version__, "conversations": n, "batched_mel": args.batched_mel,
           "spin_cycles": SPIN_CYCLES if dev.type == "cuda" else 0, "plain_seconds_ms": plain, "stages": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "queued_wait_probe.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Stages of a duplex second behind ~1 s of queued device work ({res['gpu']}, N={n}"
             f"{', batched mel' if args.batched_mel else ''})", "",
             "Host time of each stage's first call in one second, with ~1 s of device work queued just before "
             "it. A stage that waits (over 300 ms) synchronised with the stream.", "",
             "The last column counts the calls the stage made that may synchronise: cudaMalloc (num_device_alloc),"
             " cuFFT plans (cufft_plans), pinned allocations (host_allocs, staging_grows) and waits for a staging"
             " slot.", "",
             "| stage | host ms | waits | sync-prone calls |", "|---|---:|---|---|"]
    for r in rows:
        host = "-" if r["host_ms"] is None else f"{r['host_ms']:.1f}"
        calls = ", ".join(f"{k} {v}" for k, v in r["counts"].items() if v)
        lines.append(f"| {r['stage']} | {host} | {'yes' if r['waits'] else ''} | {calls} |")
    (args.out / "queued_wait_probe.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
