"""TurnService: the one thread that runs the turn pipeline for the server, in batches.

The pipeline's stages keep per-device state (static caches, graphs, Code2Wav streams), so a single worker
owns it and HTTP threads only queue requests and read events. The worker takes the oldest request, waits
``batch_wait_s`` for others, and runs up to ``max_batch`` spoken requests through ``TurnPipeline.run`` together
(they share the Thinker's and Talker's steps and Code2Wav's calls; each answer equals its solo run, which
the tests check). A spoken request that arrives while a batch runs waits for the next batch, or, opt-in
(``join_running``), joins the running one (``TurnPipeline.run``'s ``admit``) while fewer than ``max_batch`` of
its requests are unfinished: on the H200 joining was the slower of the two (median time to first audio 1.17-1.33x,
``benchmarks/results/serve_session56_h200.md``), since a run with joiners alternates Thinker and Talker steps.
Text-only requests run through the Thinker alone, one at a time, between batches.

Each request gets a ``Ticket``: events in order, ``Text`` pieces as the Thinker makes them (``TurnTrace.on_steps``;
a spoken answer's text is complete before the Talker starts), then (spoken) ``Audio`` chunks, then one ``Done``
or ``Failed``. A batch that fails before any audio went out (one request's text was empty, say) is rerun request
by request, so one bad request does not fail the others; text already sent is not sent again (a rerun makes the
same text: same seed, and the batched Thinker equals the solo one).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Union

import numpy as np

from ..errors import InputError
from ..runtime.contracts import TurnRequest
from ..runtime.turn import TurnPipeline, TurnTrace
from .openai_api import ApiError, ChatRequest, new_id
from .voices import check_voices

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Audio:
    samples: np.ndarray      # 24 kHz float32, the next samples of the answer


@dataclass(frozen=True)
class Done:
    finish_reason: str       # "stop": the Thinker ended its text; "length": it hit the token limit
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str
    bad_request: bool        # the request itself could not be answered (else the server failed)


Event = Union[Text, Audio, Done, Failed]


class Ticket:
    """One queued request and the events of its answer."""

    def __init__(self, chat: ChatRequest):
        self.id, self.chat = new_id(), chat
        self._events: queue.Queue[Event] = queue.Queue()
        self.sent_text = ""         # the text sent so far
        self._run_text = ""         # the text the current run has made (a rerun repeats what was sent)
        self.audio_sent = False
        self.finished = False

    def begin_run(self) -> None:
        self._run_text = ""

    def text(self, piece: str) -> None:
        """The run's next text; only what goes beyond the text already sent is sent."""
        self._run_text += piece
        sent, made = self.sent_text, self._run_text
        if not (sent.startswith(made) if len(made) <= len(sent) else made.startswith(sent)):
            raise RuntimeError(f"{self.id}: a rerun made other text than the first run sent ({made!r} vs {sent!r})")
        if len(made) > len(sent):
            self.sent_text = made
            self._events.put(Text(made[len(sent):]))

    def audio(self, samples: np.ndarray) -> None:
        self.audio_sent = True
        self._events.put(Audio(samples))

    def finish(self, event: Done | Failed) -> None:
        if not self.finished:
            self.finished = True
            self._events.put(event)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The answer's events until ``Done`` or ``Failed`` (``queue.Empty`` after ``timeout`` s of silence)."""
        while True:
            ev = self._events.get(timeout=timeout)
            yield ev
            if isinstance(ev, (Done, Failed)):
                return


class TurnService:
    """Serves ``ChatRequest``s on ``pipe`` from one worker thread; ``voices``: name -> reference WAV (or any voice
    ``Code2Wav.open_stream`` takes). ``join_running`` (opt-in): a spoken request that arrives while a batch runs
    joins it instead of waiting for the next batch."""

    def __init__(self, pipe: TurnPipeline, voices: dict[str, Path], max_batch: int | None = None,
                 batch_wait_s: float = 0.02, join_running: bool = False):
        self.pipe, self.voices = pipe, check_voices(voices, "TurnService")
        self.join_running = join_running
        self.max_batch = max_batch or pipe.talker.capacity
        if self.max_batch < 1:
            raise ValueError(f"TurnService: max_batch must be >= 1, got {self.max_batch}")
        self.batch_wait_s = batch_wait_s
        self._queue: queue.Queue[Ticket | None] = queue.Queue()
        self._held: deque[Ticket] = deque()     # taken from the queue by a running batch, not spoken: run next
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="turn-service", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._queue.qsize() + len(self._held)

    def submit(self, chat: ChatRequest) -> Ticket:
        if not self._thread.is_alive():
            raise ApiError("the turn service has stopped; restart the server", status=503, kind="server_error")
        ticket = Ticket(chat)
        self._queue.put(ticket)
        return ticket

    def close(self, timeout: float | None = None) -> None:
        """Stop after the batch in progress; requests still queued fail."""
        self._queue.put(None)
        self._thread.join(timeout)

    # ---- the worker --------------------------------------------------------------------------------------

    def _next(self, timeout: float | None) -> Ticket | None:
        """The next ticket to run (those a batch set aside first); None: the service is closing."""
        if self._held:
            return self._held.popleft()
        if self._stopping:
            return None
        t = self._queue.get(timeout=timeout)
        if t is None:
            self._stopping = True
        return t

    def _work(self) -> None:
        while True:
            first = self._next(None)
            if first is None:
                break
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    t = self._next(self.batch_wait_s)
                except queue.Empty:
                    break
                if t is None:
                    break
                batch.append(t)
            spoken = [t for t in batch if t.chat.speak]
            for t in batch:
                if not t.chat.speak:
                    self._guarded([t], self._think)
            if spoken:
                self._guarded(spoken, self._speak_admitting if self.join_running else self._speak, rerun=self._speak)
        while True:     # closed: whatever is still queued is answered with a failure
            try:
                t = self._held.popleft() if self._held else self._queue.get_nowait()
            except queue.Empty:
                return
            if t is not None:
                t.finish(Failed("the server is shutting down", bad_request=False))

    def _admit(self, tickets: list[Ticket], by_id: dict[str, Ticket]) -> list[TurnRequest]:
        """Spoken requests queued since the batch started, while fewer than ``max_batch`` of its requests are
        unfinished; they join ``tickets``. Text-only ones are set aside for after the batch."""
        out: list[TurnRequest] = []
        while not self._stopping and sum(not t.finished for t in tickets) < self.max_batch:
            try:
                t = self._queue.get_nowait()
            except queue.Empty:
                break
            if t is None:
                self._stopping = True
            elif not t.chat.speak:
                self._held.append(t)
            else:
                try:
                    req = self._request(t)
                except InputError as exc:
                    t.finish(Failed(str(exc), bad_request=True))
                    continue
                t.begin_run()
                tickets.append(t)
                by_id[t.id] = t
                out.append(req)
        return out

    def _guarded(self, tickets: list[Ticket], run, rerun=None) -> None:
        """``run(tickets)``; a failure before any audio reruns each unfinished request alone (``rerun``, default
        ``run``), so one bad request does not fail the others; after audio, every unfinished request of the batch
        (those that joined it included) fails with the error."""
        for t in tickets:
            t.begin_run()
        try:
            run(tickets)
        except Exception as exc:  # noqa: BLE001 (reported to the client, never swallowed)
            if len(tickets) > 1 and not any(t.audio_sent for t in tickets):
                for t in list(tickets):
                    if not t.finished:
                        self._guarded([t], rerun or run)
                return
            bad = isinstance(exc, InputError)
            if not bad:
                log.exception("turn batch of %d failed", len(tickets))
            for t in tickets:
                t.finish(Failed(str(exc) if bad else f"internal error: {type(exc).__name__}: {exc}", bad))

    def _request(self, t: Ticket) -> TurnRequest:
        c = t.chat
        return TurnRequest.make(t.id, c.messages, self.voices[c.voice] if c.speak else None, c.seed, c.max_tokens,
                                c.max_codes)

    def _think(self, tickets: list[Ticket]) -> None:
        (t,) = tickets
        prompt, n, finish = 0, 0, "length"
        for steps in self.pipe.think(self._request(t)):
            for s in steps:
                prompt = prompt or s.position
                n += 1
                if s.is_terminator:
                    finish = "stop"
                    break
                t.text(s.text)
        t.finish(Done(finish, prompt, n))

    def _speak_admitting(self, tickets: list[Ticket]) -> None:
        self._speak(tickets, admit=True)

    def _speak(self, tickets: list[Ticket], admit: bool = False) -> None:
        """One ``TurnPipeline.run`` for ``tickets``; with ``admit``, requests queued meanwhile join it (appended
        to ``tickets``)."""
        by_id = {t.id: t for t in tickets}

        def heard(rid: str, steps) -> None:
            for s in steps:
                if not s.is_terminator:
                    by_id[rid].text(s.text)

        trace = TurnTrace(on_steps=heard)
        joining = (lambda: self._admit(tickets, by_id)) if admit else None
        for chunk in self.pipe.run([self._request(t) for t in tickets], trace, admit=joining):
            t = by_id[chunk.request_id]
            if len(chunk.samples):
                t.audio(chunk.samples)
            if chunk.final:
                steps = trace.steps[t.id]
                stopped = trace.talker_inputs[t.id].terminator is not None
                t.finish(Done("stop" if stopped else "length", steps[0].position, len(steps)))
        for t in tickets:      # a run that ended without a request's final chunk would leave its client waiting
            t.finish(Failed("internal error: the turn ended without its final audio chunk", bad_request=False))
