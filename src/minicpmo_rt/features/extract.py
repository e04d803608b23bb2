"""Causal global features from a frozen MiniCPM-o 4.5 Thinker on the 5 Hz grid (seed 004).

Row k ends at t = 0.2 (k + 1) s of media time (see easycom.py for the timeline across gaps).
Second s is the half-open chunk [s - 1, s): 16 kHz audio of that span and the newest frame
that started before s (frame 20 s - 1).

native-1hz-hold
    One input-only AV chunk is committed per completed second; the newest committed state is
    forward-held onto the grid. Rows 0.2-0.8 s hold zeros (``initialization_mask``) and are
    never backfilled; ``state_source_times`` is floor(t).

cached-partial-5hz
    At a non-boundary cutoff t the session is snapshotted (LLM cache, audio-encoder cache,
    mel buffer, chunk index, RNG) by ``session.transaction()``, which also suspends destructive
    pruning; the half-open tail [floor(t), t) is appended, the final-norm hidden state read,
    and the snapshot restored. At a boundary the complete chunk is committed natively (with
    the normal window policy). ``state_source_times`` == ``times``.

    A session that offers ``evaluate_forks`` (``StreamingSession``) gets one second's 4 tails
    at once: they all start from the same committed state, so they are evaluated as 4 forks of
    it (each unit's encoders on that state, then one batched LLM prefill on a copy of the live
    cache rows; with a cache that cannot fork, one transaction per unit). Same values as one
    transaction per tail up to the batch's floating-point summation order (bit-identical on
    CPU; ~1e-2 relative in bf16 at full size with random weights). The boundary's temporary
    full chunk stays a transaction, the same computation as the native commit it is checked
    against, and the replays read their tail row through the same 4-tail batch, so boundary
    and clean-replay checks stay bit-identical; the perturbed replay's later tails carry audio
    past the cutoff, so the future intervention also checks that a batch leaks nothing.

Frames (sessions with ``embed_frames``)
    The vision tower runs per frame, so frames are embedded in fixed groups: native mode the 4
    commit frames of seconds 4m+1..4m+4, cached-partial the 5 frames of one second's rows. A
    group is a fixed function of time, so the main session and the clean replays read
    bit-identical embeddings; the future-intervention view embeds its own groups (its changed
    frames share a batch with unchanged ones, so any leak across a batch would show).

Audits (cached-partial-5hz; their figures go to ``verification``)
    boundary             every boundary: the same chunk committed temporarily inside a
                         transaction (pruning suspended) vs the native commit that follows (the
                         session reads a commit's state before its window pruning, so pruning
                         commits compare too; their entries carry pruned=True).
    clean_replay         a fresh session replays the prefix from the session start to t and
                         must match the cached state (rel. error <= the dtype's tolerance).
    future_intervention  a fresh replay whose audio after t (and frames that start at or after
                         t) are replaced must equal the clean replay *exactly*.
    snapshot_restoration every transaction and every second's fork batch:
                         ``session.fingerprint()`` (LLM/audio cache lengths and checksums, mel
                         state, chunk index, history, position offset, RNG) before == after.
    Cadence: the first clean replay and future intervention run at the first non-boundary row
    after the first commit (t = 1.2 s); then, with ``--verify-every N`` /
    ``--future-intervention-every N`` (N rows, 250 = 50 s), at the first non-boundary row at or
    after each further multiple of N. 0 means first-only. Boundary and restoration checks
    always run. If any audit fails, or the first replay/intervention or a boundary check never
    ran (the session is too short), nothing is saved unless ``--allow-unverified-partial-tail``,
    which saves ``mode=minicpmo-unverified-partial-tail``.

native-1hz-hold runs the clean replay and future intervention at native update rows (first
at t = 2.0 s, or 1.0 s for a shorter session) with the same cadence flags; boundary and
restoration do not apply (no transaction is ever opened).

Target alignment (``--target``, a 5 Hz ``.npy`` for the whole session)
    Target row j belongs to grid time 0.2 (j + 1). Structured records (turn_head make-targets)
    are stored as a float64 matrix in field order, the names in ``target_info["columns"]``.
    Its length must be within one row of the
    session's full grid (floor(5 x media seconds)): an off-by-one length (the session end
    rounded differently) is accepted and the rows are cut to the shorter of the two; a larger
    difference is an InputError. With ``--end`` the aligned targets are cut to the extracted rows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.profiler import record_function

from ..atomic import check_output_path
from ..errors import InputError, MiniCPMORTError
from .artifact import (MODE_UNVERIFIED, MODE_VERIFIED, FeatureArtifact, grid_times, held_alignment,
                       save_artifact)
from .easycom import DECODERS, FPS, SAMPLE_RATE, EasyComSession, build_timeline, frame_index_at

MODES = ("native-1hz-hold", "cached-partial-5hz")
ROW_MS = 200
# Relative-error tolerance of the replay-vs-cache comparisons: the same computation in the
# same order is bit-identical on CPU; GPU kernels may choose different reductions for a fresh
# cache layout, so half precisions get a few ulps of headroom.
REPLAY_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
MAX_LISTED = 64  # per-check entries kept in `verification` (plus every failure)
NATIVE_FRAME_GROUP = 4   # native mode embeds the frames of 4 consecutive seconds in one vision batch
EMBEDDED_FRAMES_KEPT = 64  # embedded frames a view keeps (older groups are recomputed, identically)


def native_frame_group(t: float, end: float) -> list[float]:
    """The commit times embedded together with the commit at second ``t``."""
    s = int(round(t))
    first = NATIVE_FRAME_GROUP * ((s - 1) // NATIVE_FRAME_GROUP) + 1
    return [float(u) for u in range(first, first + NATIVE_FRAME_GROUP) if u <= end + 1e-9]


def partial_frame_group(t: float, end: float) -> list[float]:
    """The row times of the second that row time ``t`` falls in (its 4 tails and its boundary)."""
    s = math.ceil(round(t, 6))
    return [u for u in (round(s - 1 + ROW_MS * j / 1000.0, 9) for j in range(1, 1000 // ROW_MS + 1))
            if u <= end + 1e-9]


# ----------------------------------------------------------------------------- options

@dataclass
class ExtractOptions:
    easycom_session_dir: Path
    mode: str
    model_id: str = "openbmb/MiniCPM-o-4_5"
    revision: str | None = None
    end: float | None = None
    target: Path | None = None
    decoder: str = "pyav"
    decoder_threads: int = 1
    max_open_readers: int = 1
    frame_cache_size: int = 32
    media_only: bool = False
    dtype: str = "auto"
    attention: str = "sdpa"
    device: str = "auto"
    output: Path | None = None
    verify_every: int = 0
    future_intervention_every: int = 0
    allow_unverified_partial_tail: bool = False
    progress: bool = True
    command_line: str = ""


def build_parser(prog: str = "streaming_minicpmo_features_directly.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Causal global MiniCPM-o 4.5 features of an EasyCom "
                                "session on the 5 Hz grid (native-1hz-hold or verified cached-partial-5hz).")
    p.add_argument("--model-id", default="openbmb/MiniCPM-o-4_5",
                   help="Local snapshot directory, or a hub id resolved ONLY from the local HF cache.")
    p.add_argument("--revision", default=None, help="Immutable revision to use/record.")
    p.add_argument("--easycom-session-dir", required=True, type=Path,
                   help=".../Video_Compressed/Session_N (WAVs are read from the sibling Glasses_Microphone_Array_Audio).")
    p.add_argument("--end", type=float, default=None, help="Seconds of media to extract (default: the whole session).")
    p.add_argument("--target", type=Path, default=None, help="5 Hz target .npy of the whole session to align and store.")
    p.add_argument("--mode", required=True, choices=MODES,
                   help="native-1hz-hold: one state per completed second, forward-held onto the 5 Hz grid (zeros "
                        "before 1 s); cached-partial-5hz: a state every 0.2 s, the partial tail read on a snapshot of "
                        "the cached completed seconds, audited against clean replays.")
    p.add_argument("--decoder", choices=DECODERS, default="pyav", help="Video decoder (decord must be installed).")
    p.add_argument("--decoder-threads", type=int, default=1, help="FFmpeg threads per open video (0: the decoder's choice).")
    p.add_argument("--max-open-readers", type=int, default=1, help="Video segments kept open at once (LRU).")
    p.add_argument("--frame-cache-size", type=int, default=32, help="Decoded frames kept (LRU; 0 disables the cache).")
    p.add_argument("--media-only", action="store_true", help="Check the timeline and decoders; load no model.")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU.")
    p.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa", help="The Thinker's attention implementation.")
    p.add_argument("--device", default="auto", help="cuda:0, cpu, ... (auto: cuda:0 when available).")
    p.add_argument("--output", type=Path, default=None, help="Artifact .pt to write (atomically).")
    p.add_argument("--verify-every", type=int, default=0,
                   help="Clean-replay audit every N 5 Hz rows after the first (0: first only).")
    p.add_argument("--future-intervention-every", type=int, default=0,
                   help="Future-intervention audit every N rows after the first (0: first only).")
    p.add_argument("--allow-unverified-partial-tail", action="store_true",
                   help="Save a failed/too-short audit as mode=minicpmo-unverified-partial-tail (never for paper runs).")
    p.add_argument("--no-progress", dest="progress", action="store_false", help=argparse.SUPPRESS)
    return p


def parse_options(argv: Sequence[str] | None, prog: str = "streaming_minicpmo_features_directly.py") -> ExtractOptions:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser(prog).parse_args(argv)
    opts = ExtractOptions(**vars(ns))
    opts.command_line = shlex.join([prog, *argv])
    return opts


# ----------------------------------------------------------------------------- inputs

class Inputs:
    """Audio and frames by media time; ``perturbed_after`` builds the future-intervention view."""

    def __init__(self, media: EasyComSession, end: float,
                 frame_group: Callable[[float, float], list[float]] | None = None):
        self.media = media
        self.end = end
        self._audio = media.audio(0.0, end)
        self._cutoff: float | None = None
        self.frame_group = frame_group
        self._embedded: dict[int, Any] = {}

    def perturbed_after(self, cutoff: float) -> "Inputs":
        """The future-intervention view. It embeds its own frames (same groups), so a frame's
        embedding leaking from the changed frames of its batch would show in the audit."""
        twin = Inputs.__new__(Inputs)
        twin.media, twin.end, twin._cutoff = self.media, self.end, cutoff
        twin.frame_group, twin._embedded = self.frame_group, {}
        k = int(round(cutoff * SAMPLE_RATE))
        rng = np.random.default_rng(12345)
        audio = self._audio.copy()
        audio[k:] = (0.3 * rng.standard_normal(len(audio) - k)).astype(np.float32) - audio[k:]
        twin._audio = audio
        return twin

    @property
    def perturbed_samples(self) -> int:
        return 0 if self._cutoff is None else len(self._audio) - int(round(self._cutoff * SAMPLE_RATE))

    def audio(self, start: float, end: float) -> np.ndarray:
        a, b = int(round(start * SAMPLE_RATE)), int(round(end * SAMPLE_RATE))
        return self._audio[a:b]

    @record_function("inputs.frame_at")
    def frame_at(self, t: float) -> np.ndarray:
        idx = frame_index_at(t)
        img = self.media.frame(idx)
        if self._cutoff is not None and idx / FPS >= self._cutoff - 1e-9:
            img = 255 - img  # a frame that starts at/after the cutoff: changed, must not matter
        return img

    def frame_for(self, session: Any, t: float):
        """The frame at ``t`` as ``session`` takes it: embedded through the vision tower in this
        view's fixed groups (``frame_group``) when the session offers ``embed_frames``, else raw.

        Groups are a fixed function of time, so every session reading this view (the main
        session and the clean replays) gets bit-identical embeddings, recomputed or not."""
        embed = getattr(session, "embed_frames", None)
        if embed is None or self.frame_group is None:
            return self.frame_at(t)
        idx = frame_index_at(t)
        hit = self._embedded.get(idx)
        if hit is None:
            times = self.frame_group(t, self.end)
            idxs = [frame_index_at(u) for u in times]
            if idx not in idxs:  # not on the grid the groups cover: embed it alone
                times, idxs = [t], [idx]
            keep = sorted({i: u for u, i in zip(times, idxs)}.items())
            with record_function("inputs.embed_frames"):
                embedded = embed([self.frame_at(u) for _, u in keep])
            for (i, _), e in zip(keep, embedded):
                self._embedded[i] = e
            while len(self._embedded) > EMBEDDED_FRAMES_KEPT:
                self._embedded.pop(next(iter(self._embedded)))
            hit = self._embedded[idx]
        return hit


def row_time(k: int) -> float:
    return round(ROW_MS * (k + 1) / 1000.0, 9)


# ----------------------------------------------------------------------------- audits

@dataclass
class Audit:
    """One audit's checks and figures.

    ``compare`` judges at once (one read of the device); the extractor uses ``compare_later``
    and ``restoration_later``, whose figures stay on the device until ``resolve`` (called by
    ``passed`` / ``to_dict``) reads them all in one transfer, so the host keeps queueing work
    while the GPU runs. Entries are judged in the order they were made either way."""

    name: str
    exact: bool
    rtol: float
    checks: list[dict[str, Any]] = field(default_factory=list)
    runs: int = 0
    failed: int = 0
    skipped: int = 0
    max_abs_diff: float = 0.0
    max_rel_err: float = 0.0
    _pending: list[tuple[list[torch.Tensor], Callable[[list[float]], None]]] = field(default_factory=list,
                                                                                      repr=False)
    _last_ok: bool = field(default=True, repr=False)

    def compare(self, row: int, t: float, got: torch.Tensor, ref: torch.Tensor, **extra) -> bool:
        self.compare_later(row, t, got, ref, **extra)
        self.resolve()
        return self._last_ok

    def compare_later(self, row: int, t: float, got: torch.Tensor, ref: torch.Tensor, **extra) -> None:
        g = got.detach().double()
        r = ref.detach().to(g.device).double()
        diff = g - r
        max_abs = diff.abs().max() if diff.numel() else torch.zeros((), dtype=torch.float64, device=g.device)
        rel = diff.norm() / r.norm().clamp_min(1e-30)

        def judge(values: list[float]) -> None:
            max_abs, rel = values
            ok = max_abs == 0.0 if self.exact else (rel <= self.rtol and math.isfinite(rel))
            self._record(dict(row=row, t=t, max_abs_diff=max_abs, rel_err=rel, bit_identical=max_abs == 0.0,
                              passed=ok, **extra), ok)
            self.max_abs_diff = max(self.max_abs_diff, max_abs)
            self.max_rel_err = max(self.max_rel_err, rel)

        self._pending.append(([max_abs, rel], judge))

    def restoration_later(self, row: int, t: float, before: Any, after: Any,
                          done: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Snapshot restoration: every fingerprint field equal before and after (checksums may be
        lazy device tensors); ``done`` gets the resolved ``after`` as a dict."""
        b, a = _fingerprint_dict(before), _fingerprint_dict(after)
        lazy = [(d, key) for d in (b, a) for key, v in d.items() if torch.is_tensor(v)]

        def judge(values: list[float]) -> None:
            for (d, key), v in zip(lazy, values):
                d[key] = v
            diff = sorted(key for key in b if b[key] != a.get(key))
            self.record({"row": row, "t": t, "changed": diff} if diff else {"row": row, "t": t}, not diff)
            if done is not None:
                done(a)

        self._pending.append(([d[key] for d, key in lazy], judge))

    def resolve(self) -> None:
        """Judge every deferred check (one device read for all of them)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        flat = [x for xs, _ in pending for x in xs]
        if flat:
            dev = next((x.device for x in flat if x.device.type != "cpu"), torch.device("cpu"))
            values = torch.stack([x.to(dev, torch.float64) for x in flat]).cpu().tolist()
        else:
            values = []
        i = 0
        for xs, judge in pending:
            judge(values[i:i + len(xs)])
            i += len(xs)

    def _record(self, entry: dict[str, Any], ok: bool) -> None:
        self._last_ok = ok
        self.runs += 1
        self.failed += 0 if ok else 1
        if len(self.checks) < MAX_LISTED or not ok:
            self.checks.append(entry)

    def record(self, entry: dict[str, Any], ok: bool) -> None:
        self._record(dict(entry, passed=ok), ok)

    def skip(self, entry: dict[str, Any]) -> None:
        self.skipped += 1
        if len(self.checks) < MAX_LISTED:
            self.checks.append(dict(entry, passed=None))

    @property
    def passed(self) -> bool:
        self.resolve()
        return self.runs > 0 and self.failed == 0

    def to_dict(self) -> dict[str, Any]:
        self.resolve()
        return {"passed": self.passed, "runs": self.runs, "failed": self.failed, "skipped": self.skipped,
                "criterion": "bit-identical" if self.exact else f"rel_err <= {self.rtol:g}",
                "max_abs_diff": self.max_abs_diff, "max_rel_err": self.max_rel_err,
                "checks": self.checks}


def _fingerprint_dict(fp: Any) -> dict[str, Any]:
    # fields one level deep (asdict would deep-copy a lazy checksum tensor)
    d = {f.name: getattr(fp, f.name) for f in dataclasses.fields(fp)} if dataclasses.is_dataclass(fp) \
        else dict(vars(fp))
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


class Cadence:
    """First run at the first eligible row at/after ``first``; then at/after each multiple of ``every``."""

    def __init__(self, first_row: int, every: int):
        self.next_due = first_row
        self.every = every
        self.first_done = False

    def due(self, row: int) -> bool:
        if self.next_due is None or row < self.next_due:
            return False
        self.first_done = True
        if self.every > 0:
            self.next_due = (row // self.every + 1) * self.every
        else:
            self.next_due = None
        return True


# ----------------------------------------------------------------------------- extraction core

SessionFactory = Callable[[], Any]


def _commit(session: Any, inputs: Inputs, sec: int) -> None:
    session.commit(inputs.audio(sec - 1, sec), inputs.frame_for(session, float(sec)))


def tail_rows(row: int, rows: int) -> list[int]:
    """The tail rows (not on a whole second) of the second that row ``row`` falls in: the rows a
    session with ``evaluate_forks`` evaluates in one batch."""
    first = 5 * (row // 5)
    return [k for k in range(first, min(first + 5, rows)) if ROW_MS * (k + 1) % 1000]


def _tail_unit(view: Inputs, session: Any, k: int) -> tuple[np.ndarray, Any, bool]:
    t = row_time(k)
    return view.audio(ROW_MS * (k + 1) // 1000, t), view.frame_for(session, t), False


def replay_states(factory: SessionFactory, views: Sequence[Inputs], row: int,
                  batch_rows: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Fresh sessions, one per input view, from the session start up to row ``row``'s cutoff.

    The views are stepped together, second by second, so each frame is decoded once and
    served to the other views from the frame cache (a replay far into a session would
    otherwise decode the prefix once per view). A tail row is read as the cached run read it:
    with ``batch_rows`` (its second's tail rows) through the same fork batch when the session
    forks (so the clean replay can match bit for bit, and a perturbed view's later tails in
    the batch, whose audio lies past the cutoff, must not change this row), else alone in a
    transaction.
    """
    t_ms = ROW_MS * (row + 1)
    sec, frac = divmod(t_ms, 1000)
    sessions: list[Any] = []
    try:
        for _ in views:   # opened inside the try: a failing second factory call still closes the first
            sessions.append(factory())
        for k in range(1, sec + 1):
            for s, view in zip(sessions, views):
                _commit(s, view, k)
        if frac == 0:
            return [_read(s) for s in sessions]
        t = t_ms / 1000.0
        out = []
        for s, view in zip(sessions, views):
            forks = getattr(s, "evaluate_forks", None)
            if forks is not None and batch_rows and row in batch_rows:
                hs = forks([_tail_unit(view, s, k) for k in batch_rows], on_device=True)
                out.append(hs[list(batch_rows).index(row)])
                continue
            with s.transaction():
                s.append_tail(view.audio(sec, t), view.frame_for(s, t))
                out.append(_read(s))
        return out
    finally:
        for s in sessions:   # pooled resources (a fast session's static cache) go back for the next replay
            _close(s)


def _read(session: Any) -> torch.Tensor:
    """The session's read-out state, float32, left on the model's device (no wait for the GPU;
    rows reach the host once, at the end of the run)."""
    return session.read_state(on_device=True)


def _close(session: Any) -> None:
    close = getattr(session, "close", None)
    if close is not None:
        close()


def replay_state(factory: SessionFactory, inputs: Inputs, row: int) -> torch.Tensor:
    """A fresh session from the session start up to row ``row``'s cutoff (cached-partial semantics)."""
    return replay_states(factory, [inputs], row)[0]


def _run_replays(factory: SessionFactory, inputs: Inputs, k: int, t: float, cached: torch.Tensor,
                 do_r: bool, do_f: bool, replay: Audit, future: Audit,
                 batch_rows: Sequence[int] | None = None) -> None:
    """The clean replay (always needed: it is also the future intervention's reference) and,
    when due, the perturbed replay, stepped together."""
    pert = inputs.perturbed_after(t) if do_f else None
    states = replay_states(factory, [inputs] + ([pert] if pert is not None else []), k, batch_rows)
    if do_r:
        replay.compare_later(k, t, cached, states[0])
    if pert is not None:
        future.compare_later(k, t, states[1], states[0], perturbed_samples=pert.perturbed_samples)


@dataclass
class ExtractResult:
    states: torch.Tensor
    state_source_times: torch.Tensor
    native_update_mask: torch.Tensor
    initialization_mask: torch.Tensor
    verification: dict[str, Any]
    admissible: bool
    pruning: list[dict[str, Any]]
    window: dict[str, Any]


def _pruning_rows(session: Any, seen: int, row: int, t: float) -> tuple[int, list[dict[str, Any]]]:
    events = list(getattr(session, "pruning_events", []) or [])
    new = []
    for ev in events[seen:]:
        d = dataclasses.asdict(ev) if dataclasses.is_dataclass(ev) else (ev._asdict() if hasattr(ev, "_asdict") else
                                                                         {"event": list(ev)})
        new.append(dict(d, row=row, t=t))
    return len(events), new


def _window_dict(session: Any) -> dict[str, Any]:
    w = getattr(session, "window", None)
    if w is None:
        return {"name": "none"}
    return dataclasses.asdict(w) if dataclasses.is_dataclass(w) else {"name": str(w)}


def extract_native(factory: SessionFactory, inputs: Inputs, rows: int, *, verify_every: int = 0,
                   future_every: int = 0, tick: Callable[[float], None] | None = None) -> ExtractResult:
    session = factory()
    try:   # the main session is closed here: its pooled decoder (and graphs) go to the next run
        return _native(session, factory, inputs, rows, verify_every, future_every, tick)
    finally:
        _close(session)


def _native(session: Any, factory: SessionFactory, inputs: Inputs, rows: int, verify_every: int,
            future_every: int, tick: Callable[[float], None] | None) -> ExtractResult:
    src, native, init = held_alignment(rows)
    seconds = sum(1 for k in range(rows) if (k + 1) % 5 == 0)
    first = 9 if seconds >= 2 else 4  # row of t = 2.0 s (a cache exists), else 1.0 s
    replay, future = Audit("clean_replay", exact=False, rtol=_rtol(session)), Audit("future_intervention", True, 0.0)
    c_replay, c_future = Cadence(first, verify_every), Cadence(first, future_every)
    held: torch.Tensor | None = None
    states: torch.Tensor | None = None
    pruning: list[dict[str, Any]] = []
    seen = 0
    for k in range(rows):
        t = row_time(k)
        if native[k]:
            sec = (k + 1) // 5
            with record_function("native.commit"):
                _commit(session, inputs, sec)
                held = _read(session)
            seen, new = _pruning_rows(session, seen, k, t)
            pruning += new
            if states is None:
                states = torch.zeros(rows, held.shape[-1], dtype=torch.float32, device=held.device)
            do_r, do_f = c_replay.due(k), c_future.due(k)
            if do_r or do_f:
                with record_function("audit.replays"):
                    _run_replays(factory, inputs, k, t, held, do_r, do_f, replay, future)
        if held is not None:
            states[k] = held
        if tick:
            tick(0.2)
    if states is None:  # fewer than 5 rows: every row is initialisation; D from a probe commit-free read
        raise InputError(f"--end {rows / 5:.1f}: native-1hz-hold needs at least one completed second (--end >= 1)")
    states = states.cpu()
    checks = {
        "clean_replay": replay.to_dict(), "future_intervention": future.to_dict(),
        "boundary": {"passed": None, "not_applicable": "native mode opens no transaction; every row is a native commit"},
        "snapshot_restoration": {"passed": None, "not_applicable": "native mode never snapshots or restores"},
    }
    too_short = not (c_replay.first_done and c_future.first_done)
    ok = replay.passed and future.passed and not too_short
    verification = {"all_passed": ok, "too_short": too_short, **checks,
                    "cadence": {"verify_every": verify_every, "future_intervention_every": future_every,
                                "first_row": first}}
    return ExtractResult(states, src, native, init, verification, False, pruning, _window_dict(session))


def _rtol(session: Any) -> float:
    dtype = getattr(session, "dtype", None) or getattr(getattr(session, "thinker", None), "dtype", torch.float32)
    return REPLAY_RTOL.get(dtype, 1e-5)


def extract_partial(factory: SessionFactory, inputs: Inputs, rows: int, *, verify_every: int = 0,
                    future_every: int = 0, tick: Callable[[float], None] | None = None) -> ExtractResult:
    session = factory()
    try:
        return _partial(session, factory, inputs, rows, verify_every, future_every, tick)
    finally:
        _close(session)


def _partial(session: Any, factory: SessionFactory, inputs: Inputs, rows: int, verify_every: int,
             future_every: int, tick: Callable[[float], None] | None) -> ExtractResult:
    rtol = _rtol(session)
    boundary = Audit("boundary", exact=False, rtol=rtol)
    replay = Audit("clean_replay", exact=False, rtol=rtol)
    future = Audit("future_intervention", exact=True, rtol=0.0)
    restore = Audit("snapshot_restoration", exact=True, rtol=0.0)
    first = 5  # t = 1.2 s: the first partial row with a committed chunk under it
    c_replay, c_future = Cadence(first, verify_every), Cadence(first, future_every)
    states: torch.Tensor | None = None
    pruning: list[dict[str, Any]] = []
    seen = 0
    last_fp: dict[str, Any] | None = None

    known: Any = None  # the session's fingerprint while nothing has changed it since (saves a cache read)

    def fingerprint_before() -> Any:
        return known if known is not None else session.fingerprint(lazy=True)

    def keep_last(fp: dict[str, Any]) -> None:
        nonlocal last_fp
        last_fp = fp

    def check_restored(k: int, t: float, before: Any) -> None:
        nonlocal known
        after = session.fingerprint(lazy=True)
        restore.restoration_later(k, t, before, after, done=keep_last)
        known = after

    forks = getattr(session, "evaluate_forks", None)

    def unit(k: int) -> tuple[float, bool, np.ndarray, Any]:
        """Row k's input: the second ending at it (whole) or the tail since the last second."""
        t = row_time(k)
        sec, frac = divmod(ROW_MS * (k + 1), 1000)
        if frac == 0:
            return t, True, inputs.audio(sec - 1, sec), inputs.frame_for(session, float(sec))
        audio, frame, _ = _tail_unit(inputs, session, k)
        return t, False, audio, frame

    def commit_boundary(k: int, t: float, audio, frame, temp: torch.Tensor) -> torch.Tensor:
        nonlocal seen, pruning, known
        with record_function("partial.commit"):
            session.commit(audio, frame)
            known = None
            h = _read(session)
        n_before = seen
        seen, new = _pruning_rows(session, seen, k, t)
        pruning += new
        # The session reads a commit's state out before it prunes, so a pruning commit is
        # still comparable; the entry says it pruned.
        boundary.compare_later(k, t, temp, h, pruned=seen > n_before)
        return h

    def audit_replays(k: int, t: float, h: torch.Tensor, batch_rows: Sequence[int] | None = None) -> None:
        nonlocal known
        do_r, do_f = c_replay.due(k), c_future.due(k)
        if do_r or do_f:
            with record_function("audit.replays"):
                _run_replays(factory, inputs, k, t, h, do_r, do_f, replay, future, batch_rows)
            known = None  # replays touch process-wide state (RNG, allocator): read it afresh

    def store(k: int, h: torch.Tensor) -> None:
        nonlocal states
        if states is None:
            states = torch.zeros(rows, h.shape[-1], dtype=torch.float32, device=h.device)
        states[k] = h
        if tick:
            tick(0.2)

    forked: dict[int, torch.Tensor] = {}
    for first_row in range(0, rows, 5):
        group = range(first_row, min(first_row + 5, rows))
        batch = tail_rows(first_row, rows) if forks is not None else []
        if batch:
            # The second's tails, all forked off the same committed state, in one batch (the
            # boundary's temporary full chunk stays a transaction: the same B=1 computation as
            # the native commit it is checked against).
            before = fingerprint_before()
            with record_function("partial.forks"):
                hs = forks([_tail_unit(inputs, session, k) for k in batch], on_device=True)
            check_restored(batch[-1], row_time(batch[-1]), before)
            forked = dict(zip(batch, hs))
        for k in group:
            if k in forked:
                h = forked.pop(k)
                audit_replays(k, row_time(k), h, batch)
                store(k, h)
                continue
            t, whole, audio, frame = unit(k)
            before = fingerprint_before()
            if whole:
                with record_function("partial.boundary_check"), session.transaction():
                    session.commit(audio, frame)
                    temp = _read(session)
                check_restored(k, t, before)
                h = commit_boundary(k, t, audio, frame, temp)
            else:
                with record_function("partial.tail"), session.transaction():
                    session.append_tail(audio, frame)
                    h = _read(session)
                check_restored(k, t, before)
                audit_replays(k, t, h)
            store(k, h)
    assert states is not None
    states = states.cpu()
    for audit in (boundary, replay, future, restore):
        audit.resolve()
    times = grid_times(rows)
    native = torch.tensor([(k + 1) % 5 == 0 for k in range(rows)], dtype=torch.bool)
    too_short = not (c_replay.first_done and c_future.first_done and boundary.runs > 0)
    ok = not too_short and all(a.passed for a in (boundary, replay, future, restore))
    verification = {
        "all_passed": ok, "too_short": too_short,
        "boundary": boundary.to_dict(), "clean_replay": replay.to_dict(),
        "future_intervention": future.to_dict(),
        "snapshot_restoration": dict(restore.to_dict(), last_fingerprint=last_fp),
        "cadence": {"verify_every": verify_every, "future_intervention_every": future_every, "first_row": first},
    }
    return ExtractResult(states, times.clone(), native, torch.zeros(rows, dtype=torch.bool), verification, ok,
                         pruning, _window_dict(session))


# ----------------------------------------------------------------------------- targets

def align_targets(target: Path, full_rows: int, rows: int) -> tuple[torch.Tensor, dict[str, Any], int]:
    """(aligned targets [rows', ...], info, rows') under the off-by-one policy of the module docstring."""
    if not target.is_file():
        raise InputError(f"--target {target}: file not found")
    try:
        arr = np.load(target, allow_pickle=False)
    except Exception as exc:
        raise InputError(f"--target {target}: cannot be read as a .npy array ({type(exc).__name__}: {exc})") from exc
    if arr.ndim < 1 or arr.shape[0] == 0:
        raise InputError(f"--target {target}: has shape {arr.shape}; expected [rows, ...] at 5 Hz")
    n = int(arr.shape[0])
    if abs(n - full_rows) > 1:
        raise InputError(f"--target {target}: has {n} rows but the session has {full_rows} rows at 5 Hz "
                         f"({full_rows / 5:.1f} s of media); only an off-by-one difference is accepted. Was it "
                         f"built for this session and on the same gap-skipping media timeline?")
    columns, file_shape, file_dtype = None, list(arr.shape), str(arr.dtype)
    if arr.dtype.names:  # structured records (turn_head make-targets): a float64 matrix in field order
        columns = list(arr.dtype.names)
        bad = [c for c in columns if arr.dtype[c].shape or arr.dtype[c].kind not in "biuf"]
        if bad:
            raise InputError(f"--target {target}: structured fields {bad} are not numeric scalars; "
                             f"store a numeric [rows, ...] array")
        arr = np.stack([arr[c].astype(np.float64) for c in columns], axis=1)
    elif arr.dtype.kind not in "biuf":
        raise InputError(f"--target {target}: dtype {arr.dtype} is not numeric")
    use = min(rows, n)
    info = {"path": str(target), "shape": file_shape, "dtype": file_dtype, "stored_shape": [use, *arr.shape[1:]],
            "stored_dtype": str(arr.dtype), "target_rows": n, "columns": columns,
            "session_rows": full_rows, "rows": use,
            "policy": "target row j <-> grid time 0.2*(j+1); |len - session rows| <= 1 accepted, cut to the shorter",
            "dropped_feature_rows": rows - use, "dropped_target_rows": n - use}
    return torch.from_numpy(np.ascontiguousarray(arr[:use])), info, use


# ----------------------------------------------------------------------------- driver

def _resolve_device_dtype(opts: ExtractOptions) -> tuple[torch.device, torch.dtype]:
    dev = opts.device
    if dev == "auto":
        dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {opts.device}: CUDA is not available on this machine; use --device cpu")
    name = opts.dtype
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return device, getattr(torch, name)


def load_session_factory(opts: ExtractOptions) -> tuple[SessionFactory, dict[str, Any]]:
    """Thinker + tokenizer from the snapshot (local path or cached hub id) and a fresh-session factory."""
    from ..checkpoint.snapshot import resolve_snapshot
    from ..checkpoint.tokenizer import load_tokenizer
    from ..thinker.model import Thinker

    device, dtype = _resolve_device_dtype(opts)
    snap = resolve_snapshot(opts.model_id, opts.revision)
    thinker = Thinker.from_snapshot(snap, dtype=dtype, device=device, attn_implementation=opts.attention)
    thinker.eval()
    tok = load_tokenizer(snap.path)
    factory, fast = session_factory(thinker, tok)
    info = {"model_id": snap.model_id, "model_path": str(snap.path), "revision": snap.revision,
            "revision_source": snap.revision_source, "dtype": str(dtype).replace("torch.", ""),
            "device": str(device), "attention": opts.attention, "session_fast_paths": fast}
    return factory, info


def session_factory(thinker: Any, tok: Any, fast: bool | None = None) -> tuple[SessionFactory, bool]:
    """Fresh-session factory: on CUDA every session fast path (static-cache Triton prefill from
    graphs, GPU frame preprocessing, vision and audio graphs), built once and shared by all the
    sessions (main and audit replays); the plain reference path elsewhere or when
    MINICPMO_RT_FEATURES_FAST=0. Returns (factory, fast)."""
    from ..thinker.session import StreamingSession, fast_path_census, shared_fast_paths

    if fast is None:
        env = os.environ.get("MINICPMO_RT_FEATURES_FAST", "")
        if env not in ("", "0", "1"):
            raise InputError(f"MINICPMO_RT_FEATURES_FAST={env!r}: use 1 (fast paths on CUDA) or 0 (plain reference)")
        fast = thinker.device.type == "cuda" and env != "0"
    options = shared_fast_paths(thinker) if fast else {}

    def factory():
        return StreamingSession(thinker, tok, **options)

    factory.census = lambda: fast_path_census(options)  # graph counts, for benchmarks
    return factory, fast


def plan_rows(opts: ExtractOptions, duration: float) -> tuple[int, int, float]:
    """(rows to extract, rows of the whole session, end seconds)."""
    full_rows = int(math.floor(duration * 5 + 1e-6))
    if opts.end is None:
        return full_rows, full_rows, full_rows / 5
    if not opts.end > 0:
        raise InputError(f"--end {opts.end}: must be > 0 seconds")
    if opts.end > duration + 1e-6:
        raise InputError(f"--end {opts.end}: beyond the session ({duration:.2f} s of media in "
                         f"{opts.easycom_session_dir}); pass --end <= {duration:.2f} or omit it")
    rows = int(math.floor(opts.end * 5 + 1e-6))
    if rows == 0:
        raise InputError(f"--end {opts.end}: shorter than one 0.2 s row")
    return rows, full_rows, rows / 5


def run(opts: ExtractOptions, factory: SessionFactory | None = None,
        model_info: dict[str, Any] | None = None, echo: Callable[[str], None] = print) -> FeatureArtifact | None:
    """Validate inputs, extract, audit and save. Returns the artifact (None for --media-only)."""
    from .. import __version__

    t_start = time.perf_counter()
    if opts.verify_every < 0 or opts.future_intervention_every < 0:
        raise InputError("--verify-every / --future-intervention-every must be >= 0 (0: first audit only)")
    if not opts.media_only and opts.output is None:
        raise InputError("--output PATH.pt is required (or pass --media-only)")
    if opts.output is not None and not opts.media_only:
        check_output_path(opts.output, "--output")
        if opts.output.suffix != ".pt":
            raise InputError(f"--output {opts.output}: name it <something>.pt; the artifact is a torch file, and "
                             "train_turn_head and load_artifact's directory scan read only *.pt")
        if not opts.output.parent.is_dir():
            raise InputError(f"--output {opts.output}: directory {opts.output.parent} does not exist; create it first")
    timeline = build_timeline(opts.easycom_session_dir)
    rows, full_rows, end = plan_rows(opts, timeline.duration)
    target = tinfo = None
    if opts.target is not None:
        target, tinfo, rows = align_targets(opts.target, full_rows, rows)
        end = rows / 5
    if opts.mode == "native-1hz-hold" and rows < 5 and not opts.media_only:
        raise InputError(f"--end {end:.1f}: native-1hz-hold needs at least one completed second (--end >= 1)")
    media = EasyComSession(opts.easycom_session_dir, decoder=opts.decoder, decoder_threads=opts.decoder_threads,
                           max_open_readers=opts.max_open_readers, frame_cache_size=opts.frame_cache_size,
                           timeline=timeline)
    with contextlib.closing(media):
        if opts.media_only:
            echo(timeline.summary())
            echo(f"decoder {opts.decoder} (threads {opts.decoder_threads}, max open readers "
                 f"{opts.max_open_readers}, frame cache {opts.frame_cache_size}):")
            for line in media.check_decoders():
                echo(line)
            echo(f"--end {end:.1f}s -> {rows} rows at 5 Hz of {full_rows}; mode {opts.mode}; media OK (no model loaded)")
            return None
        # The main loop's frames, decoded ahead on worker threads while the audio and the model
        # load and then while the model runs (closing ``media`` stops them if a later step fails).
        # depth: wanted frames a worker may decode ahead per chunk (1080p RGB ~6 MB each)
        wanted = range(rows) if opts.mode == "cached-partial-5hz" else range(4, rows, 5)
        media.prefetch([frame_index_at(row_time(k)) for k in wanted], depth=16)
        group = native_frame_group if opts.mode == "native-1hz-hold" else partial_frame_group
        inputs = Inputs(media, end, frame_group=group)
        if factory is None:
            factory, model_info = load_session_factory(opts)
        bar = _progress(end, opts.progress)
        t0 = time.perf_counter()
        try:   # every session is closed where it is opened (extract_*, replay_states), also on failure
            fn = extract_native if opts.mode == "native-1hz-hold" else extract_partial
            with torch.inference_mode():
                res = fn(factory, inputs, rows, verify_every=opts.verify_every,
                         future_every=opts.future_intervention_every,
                         tick=(lambda _dt: bar.update(1)) if bar else None)
        finally:
            if bar:
                bar.close()
        wall = time.perf_counter() - t0
        reader_stats = dataclasses.asdict(media.stats)
    ok = res.verification["all_passed"]
    _print_summary(echo, opts, rows, end, res, wall)
    if not ok and not opts.allow_unverified_partial_tail:
        why = "too short for the mandatory audits" if res.verification["too_short"] else "an audit failed"
        raise VerificationError(f"{opts.easycom_session_dir}: {why} ({_audit_line(res.verification)}); nothing was "
                                f"saved to {opts.output}. Diagnose it; --allow-unverified-partial-tail saves it as "
                                f"mode={MODE_UNVERIFIED} (rejected by the default loader)")
    provenance = dict(model_info or {})
    provenance.update({
        "decoder": opts.decoder, "decoder_threads": opts.decoder_threads,
        "max_open_readers": opts.max_open_readers, "frame_cache_size": opts.frame_cache_size,
        "session_dir": str(opts.easycom_session_dir), "session": timeline.session, "end": end,
        "rows": rows, "session_rows": full_rows,
        "target_path": str(opts.target) if opts.target else None,
        "target_shape": tinfo["shape"] if tinfo else None,
        "package": "minicpmo-rt", "package_version": __version__, "torch_version": torch.__version__,
        "command_line": opts.command_line, "timeline": timeline.to_dict(),
        "wall_time_s": round(wall, 3), "real_time_factor": round(end / wall, 3) if wall > 0 else None,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "allow_unverified_partial_tail": opts.allow_unverified_partial_tail,
        "reader_stats": reader_stats,
        "frame_batches": ("the 4 commit frames of seconds 4m+1..4m+4 in one vision batch"
                          if opts.mode == "native-1hz-hold" else
                          "the 5 frames of one second's rows (4 tails + boundary) in one vision batch"),
    })
    art = FeatureArtifact(
        mode=MODE_VERIFIED if ok else MODE_UNVERIFIED, extractor_mode=opts.mode, states=res.states,
        times=grid_times(rows), state_source_times=res.state_source_times,
        native_update_mask=res.native_update_mask, initialization_mask=res.initialization_mask,
        partial_tail_admissible=bool(res.admissible and ok), verification=res.verification,
        provenance=provenance, session=timeline.session, window=res.window, pruning=res.pruning,
        targets=target, target_info=tinfo)
    save_artifact(opts.output, art)
    echo(f"saved {opts.output} (mode={art.mode}, {rows} rows x {art.dim}) in "
         f"{time.perf_counter() - t_start:.1f}s total")
    return art


class VerificationError(MiniCPMORTError):
    """A mandatory audit failed or was too short; nothing was saved."""


def _progress(total: float, enabled: bool):
    """A bar over 5 Hz rows shown in session seconds; the rate is session-seconds per second."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=int(round(total * 5)), unit="s", unit_scale=0.2, desc="session-seconds",
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s "
                           "[{elapsed}<{remaining}, {rate_noinv_fmt}]",
                dynamic_ncols=True, file=sys.stderr)


def _audit_line(v: dict[str, Any]) -> str:
    parts = []
    for name in ("boundary", "clean_replay", "future_intervention", "snapshot_restoration"):
        a = v.get(name, {})
        if a.get("not_applicable"):
            parts.append(f"{name} n/a")
        else:
            parts.append(f"{name} {'PASS' if a.get('passed') else 'FAIL'} {a.get('runs', 0) - a.get('failed', 0)}"
                         f"/{a.get('runs', 0)}" + (f" max_rel {a['max_rel_err']:.2e}" if a.get("runs") else ""))
    return "; ".join(parts)


def _print_summary(echo, opts: ExtractOptions, rows: int, end: float, res: ExtractResult, wall: float) -> None:
    v = res.verification
    echo(f"{opts.mode}: {rows} rows ({end:.1f} s of media) x {res.states.shape[1]} in {wall:.2f}s wall, "
         f"real-time factor {end / wall if wall > 0 else float('inf'):.2f}x; pruning events {len(res.pruning)}")
    for name in ("boundary", "clean_replay", "future_intervention", "snapshot_restoration"):
        a = v[name]
        if a.get("not_applicable"):
            echo(f"  {name:21s} n/a ({a['not_applicable']})")
            continue
        echo(f"  {name:21s} {'PASS' if a['passed'] else 'FAIL'}  runs {a['runs']} failed {a['failed']} "
             f"skipped {a['skipped']}  max_abs_diff {a['max_abs_diff']:.3e}  max_rel_err {a['max_rel_err']:.3e}  "
             f"({a['criterion']})")
    echo(f"  audits {'ALL PASSED' if v['all_passed'] else 'NOT PASSED'}" + ("  (too short)" if v["too_short"] else ""))


def main(argv: Sequence[str] | None = None, prog: str = "streaming_minicpmo_features_directly.py") -> int:
    try:
        opts = parse_options(argv, prog)
        run(opts)
    except MiniCPMORTError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0

