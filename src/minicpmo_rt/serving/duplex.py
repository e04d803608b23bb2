"""DuplexService: duplex conversations for network clients, on the seats of one ``DuplexBatch``.

A client opens a session (a seat, a voice, a seed), then sends its user's audio one second at a time, each with
an optional camera frame, and gets back the model's unit for that second: listened, or spoke (text and 24 kHz
audio). Closing the session returns the model's last words (``flush``) and frees the seat.

One worker thread owns the batch: the seat bookkeeping lives here, behind a lock, and every model call runs on
the worker. Seconds that arrive within ``tick_wait_s`` of each other (different sessions) go through one
``DuplexBatch.step``, as the batch's benchmarks run them; a session sends its next second only after its last
unit came back. Each input is checked alone before the step (``DuplexBatch.check``): a bad one is refused with
its message and the other sessions still step. A session idle for ``idle_timeout_s`` is closed and its
seat given to the next client.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..runtime.contracts import SAMPLE_RATE
from ..runtime.duplex import DuplexBatch, DuplexInput, DuplexUnit
from ..thinker.mel import SAMPLE_RATE as INPUT_RATE
from .openai_api import ApiError, b64, pcm16
from .voices import check_voices

log = logging.getLogger(__name__)


@dataclass
class Session:
    id: str
    seat: int
    voice: str
    seed: int
    units: int = 0
    busy: bool = False               # a second or the close is with the worker
    last_seen: float = field(default_factory=time.monotonic)


@dataclass
class _Job:
    kind: str                        # "open" | "second" | "close"
    session: Session
    payload: DuplexInput | None = None
    reply: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=1))


class DuplexService:
    """Serves duplex sessions on ``batch``'s seats; ``voices``: name -> reference WAV (the first is the default)."""

    def __init__(self, batch: DuplexBatch, voices: dict[str, Path], idle_timeout_s: float = 60.0,
                 tick_wait_s: float = 0.05, reply_timeout_s: float = 600.0):
        self.batch, self.voices = batch, check_voices(voices, "DuplexService")
        self.idle_timeout_s, self.tick_wait_s, self.reply_timeout_s = idle_timeout_s, tick_wait_s, reply_timeout_s
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._free = list(range(len(batch)))
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="duplex-service", daemon=True)
        self._thread.start()

    @property
    def seats(self) -> int:
        return len(self.batch)

    @property
    def open_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    # ---- the client side (HTTP threads) ------------------------------------------------------------------

    def open(self, voice: str | None = None, seed: int = 0) -> Session:
        voice = next(iter(self.voices)) if voice is None else voice
        if voice not in self.voices:
            raise ApiError(f"voice {voice!r} is not one of this server's voices: {', '.join(self.voices)}", "voice")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ApiError(f"seed must be an integer, got {seed!r}", "seed")
        with self._lock:
            if not self._free:
                raise ApiError(f"all {self.seats} duplex seats are taken; retry when a session closes, or start the "
                               "server with more --seats", status=503, kind="server_error")
            session = Session("duplex-" + uuid.uuid4().hex[:16], self._free.pop(0), voice, seed, busy=True)
            self._sessions[session.id] = session
        try:
            self._call(_Job("open", session))
        except BaseException:
            self._release(session)
            raise
        session.busy = False
        return session

    def step(self, session_id: str, second: DuplexInput) -> DuplexUnit:
        session = self._claim(session_id)
        try:
            unit = self._call(_Job("second", session, second))
            session.units += 1
            return unit
        finally:
            session.busy, session.last_seen = False, time.monotonic()

    def close_session(self, session_id: str) -> np.ndarray:
        """End the session: the model's last words (24 kHz), and the seat is free again."""
        session = self._claim(session_id)
        try:
            return self._call(_Job("close", session))
        finally:
            self._release(session)

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker after the step in progress."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def session(self, session_id: str) -> Session:
        """The open session ``session_id`` (ApiError 404 when there is none)."""
        with self._lock:
            return self._known(session_id)

    def _known(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise ApiError(f"no duplex session {session_id!r} (closed, expired after {self.idle_timeout_s:g} s idle, "
                           "or never opened); open a new one", status=404)
        return session

    def _claim(self, session_id: str) -> Session:
        with self._lock:
            session = self._known(session_id)
            if session.busy:
                raise ApiError(f"session {session_id} is still answering its last request; send the next second "
                               "after its unit came back", status=409)
            session.busy = True
            return session

    def _release(self, session: Session) -> None:
        with self._lock:
            if self._sessions.pop(session.id, None) is not None:
                self._free.append(session.seat)

    def _call(self, job: _Job):
        if not self._thread.is_alive():
            raise ApiError("the duplex service has stopped", status=503, kind="server_error")
        self._jobs.put(job)
        try:
            result = job.reply.get(timeout=self.reply_timeout_s)
        except queue.Empty:
            raise ApiError(f"no answer for {self.reply_timeout_s:.0f} s", status=504, kind="server_error") from None
        if isinstance(result, BaseException):
            raise result
        return result

    # ---- the worker --------------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=1.0)
            except queue.Empty:
                self._expire()
                continue
            if job is None:
                return
            jobs, stop = [job], False
            deadline = time.monotonic() + self.tick_wait_s
            while job.kind == "second" and len(jobs) < self.seats:
                try:
                    nxt = self._jobs.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                jobs.append(nxt)
            for j in jobs:
                if j.kind != "second":
                    self._answer(j, self._open_or_close, j)
            self._step([j for j in jobs if j.kind == "second"])
            self._expire()
            if stop:
                return

    @staticmethod
    def _answer(job: _Job, fn, *args) -> None:
        try:
            job.reply.put(fn(*args))
        except InputError as exc:
            job.reply.put(ApiError(str(exc)))
        except Exception as exc:  # noqa: BLE001 (the client hears of it)
            log.exception("duplex %s of %s failed", job.kind, job.session.id)
            job.reply.put(ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error"))

    def _open_or_close(self, job: _Job):
        s = job.session
        if job.kind == "open":
            self.batch.reopen(s.seat, self.voices[s.voice], s.seed)
            return s
        return self.batch.conversations[s.seat].flush()

    def _step(self, jobs: list[_Job]) -> None:
        if not jobs:
            return
        inputs: list[DuplexInput | None] = [None] * self.seats
        ok = []
        for j in jobs:      # each input checked alone first: a bad one is refused, the others still step
            one: list[DuplexInput | None] = [None] * self.seats
            one[j.session.seat] = j.payload
            try:
                self.batch.check(one)
            except InputError as exc:
                j.reply.put(ApiError(str(exc), "audio"))
                continue
            inputs[j.session.seat] = j.payload
            ok.append(j)
        jobs = ok
        if not jobs:
            return
        try:
            units = self.batch.step(inputs)
        except Exception as exc:  # noqa: BLE001
            log.exception("duplex step of %d sessions failed", len(jobs))
            for j in jobs:
                j.reply.put(ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error"))
            return
        for j in jobs:
            j.reply.put(units[j.session.seat])

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [s for s in self._sessions.values()
                     if not s.busy and now - s.last_seen > self.idle_timeout_s]
            for s in stale:
                del self._sessions[s.id]
        for s in stale:     # on the worker: the seat's conversation ends before the seat is handed out again
            try:
                self.batch.conversations[s.seat].flush()
            except Exception:  # noqa: BLE001 (an expired session's tail has no one to go to)
                log.exception("duplex: flushing expired session %s failed", s.id)
            log.info("duplex session %s expired after %.0f s idle (seat %d free)", s.id, self.idle_timeout_s, s.seat)
            with self._lock:
                self._free.append(s.seat)


def _fields(body, allowed: set[str], what: str) -> None:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(f"unsupported field(s) {', '.join(unknown)}: {what} takes {', '.join(sorted(allowed))}",
                       unknown[0])


def _rate(body) -> int:
    rate = body.get("sample_rate", INPUT_RATE)
    if isinstance(rate, bool) or not isinstance(rate, int) or not 8000 <= rate <= 192000:
        raise ApiError(f"sample_rate must be an integer in 8000..192000 Hz, got {rate!r}", "sample_rate")
    return rate


def _pcm_bytes(body) -> bytes:
    import base64
    import binascii

    try:
        raw = base64.b64decode(body.get("audio") or "", validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise ApiError("audio must be base64 of 16-bit little-endian mono PCM", "audio") from None
    return raw


def _frame_and_force(body):
    import base64
    import binascii
    import io

    from PIL import Image, UnidentifiedImageError

    frame = None
    if body.get("frame") is not None:
        try:
            frame = Image.open(io.BytesIO(base64.b64decode(body["frame"], validate=True))).convert("RGB")
        except (binascii.Error, TypeError, ValueError, UnidentifiedImageError, OSError):
            raise ApiError("frame must be base64 of a JPEG or PNG image", "frame") from None
    force = body.get("force_listen", False)
    if not isinstance(force, bool):
        raise ApiError(f"force_listen must be true or false, got {force!r}", "force_listen")
    return frame, force


def pcm_second(raw: bytes, rate: int, frame=None, force_listen: bool = False) -> DuplexInput:
    """One second of 16-bit little-endian PCM at ``rate`` -> DuplexInput."""
    audio = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    return DuplexInput(audio, frame, force_listen, rate)


def parse_second(body) -> DuplexInput:
    """A ``seconds`` request body -> DuplexInput: ``audio`` base64 16-bit little-endian mono PCM of exactly one
    second at ``sample_rate`` (default 16000; others are resampled), optional ``frame`` (a base64 JPEG or PNG:
    the camera when the second ended), optional ``force_listen`` (the client's barge-in)."""
    _fields(body, {"audio", "sample_rate", "frame", "force_listen"}, "a second")
    rate = _rate(body)
    raw = _pcm_bytes(body)
    if len(raw) != 2 * rate:
        raise ApiError(f"audio holds {len(raw) / 2:g} samples; send exactly one second ({rate} 16-bit samples at "
                       f"{rate} Hz, {2 * rate} bytes)", "audio")
    return pcm_second(raw, rate, *_frame_and_force(body))


class AudioBuffer:
    """A realtime connection's ``input.audio`` pieces of any length, cut into whole seconds: each second carries
    the latest frame sent since the previous second and ``force_listen`` if any piece since then asked for it.
    The sample rate is the first piece's; a later piece at another rate is refused."""

    def __init__(self):
        self.raw, self.rate, self.frame, self.force = bytearray(), None, None, False

    def add(self, body) -> list[DuplexInput]:
        """One ``input.audio`` message's fields -> the whole seconds it completes (often none)."""
        _fields(body, {"audio", "sample_rate", "frame", "force_listen"}, "input.audio")
        rate = _rate(body)
        if self.rate is not None and rate != self.rate:
            raise ApiError(f"sample_rate {rate} differs from this session's audio so far ({self.rate} Hz); keep one "
                           "rate per session", "sample_rate")
        raw = _pcm_bytes(body)
        if len(raw) % 2:
            raise ApiError(f"audio holds {len(raw)} bytes, not a whole number of 16-bit samples", "audio")
        frame, force = _frame_and_force(body)
        self.rate = rate
        self.raw += raw
        self.frame = frame if frame is not None else self.frame
        self.force = self.force or force
        seconds = []
        while len(self.raw) >= 2 * rate:
            seconds.append(pcm_second(bytes(self.raw[:2 * rate]), rate, self.frame, self.force))
            del self.raw[:2 * rate]
            self.frame, self.force = None, False
        return seconds

    @property
    def pending_samples(self) -> int:
        return len(self.raw) // 2


def opened_body(session: Session) -> dict:
    return {"id": session.id, "voice": session.voice, "seed": session.seed, "input_sample_rate": INPUT_RATE,
            "output_sample_rate": SAMPLE_RATE}


def unit_body(session_id: str, unit: DuplexUnit) -> dict:
    """What the model did in the second: listened, or spoke (text, codes, 24 kHz PCM16 audio in base64)."""
    return {"session": session_id, "index": unit.index, "listen": unit.listen, "text": unit.text,
            "turn_end": unit.turn_end, "interrupted": unit.interrupted, "codes": len(unit.codes),
            "audio": b64(pcm16(unit.pcm)), "sample_rate": SAMPLE_RATE}


def closed_body(session_id: str, tail: np.ndarray) -> dict:
    """A closed session: the model's last words (24 kHz PCM16 in base64)."""
    return {"id": session_id, "closed": True, "audio": b64(pcm16(tail)), "sample_rate": SAMPLE_RATE}
