"""Duplex spoken conversation (upstream's native V1 duplex): one unit per second of input.

    duplex = DuplexConversation.from_snapshot("/path/to/MiniCPM-o-4_5", voice="ref.wav")
    for second, frame in user_stream:                 # 1 s of 16 kHz audio (+ an optional frame)
        unit = duplex.step(second, frame)             # DuplexUnit: listened, or spoke text + PCM
        play(unit.pcm)

Per unit, as ``DuplexCapability`` (official MiniCPM-o 4.5 code, re-implemented):

1. Thinker: the second goes in as one unit (``StreamingSession.commit``: ``<unit>``, the frame,
   10 audio embeddings) on top of a system prompt holding the voice reference; then
   ``thinker.duplex.generate_unit`` decides: ``<|listen|>``, or up to 19 speech tokens ending in
   a unit terminator (``<|turn_eos|>`` inside them ends the model's turn).
2. Talker: the unit's speech tokens with their final-norm hidden rows condition one
   ``TalkerTurn.generate_unit`` (25 codes for a full second; its KV cache lives through the turn).
3. Code2Wav: the codes join the turn's stream (3 context codes + the new ones, the serving
   protocol; the first context is 3 x silence) and come back as 24 kHz PCM. Codes that are
   too few to decode (fewer than 5 new, the flow's look-ahead) wait for the next unit, as
   upstream's token2wav buffer does; a unit that ends the turn flushes them.

Output of a unit that spoke but is not the turn's last: at least 1 s of audio, left-padded with
silence as upstream. A listening unit carries no audio (``conversation_track`` fills it with
1 s of zeros for a continuous output track).

``DuplexBatch`` steps several conversations on one set of models, one second at a time: each
conversation's Thinker unit in turn (every conversation has its own session), then the speaking
units' Talker draws together (``TalkerTurns``: one batched forward per draw) and their Code2Wav
payloads together (``Code2Wav.push_many``: one flow solve for the streams in step). A conversation
says and hears what it would alone (same seeds; up to the batched arithmetic's rounding).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import numpy as np
import torch

from ..errors import InputError
from ..talker.chunked import ChunkSampling, SeatUnit, TalkerTurn, TalkerTurns
from ..talker.engine import CONTEXT_CODES, SILENCE_CODE
from ..thinker.duplex import (DecodeRequest, DuplexDecodeConfig, DuplexDecoder, TurnState, decode_many, generate_unit,
                              unit_steps)

PCM_RATE = 24000
SAMPLES_PER_CODE = 960
UNIT_CODES = 25   # codes per decoded payload (one second)
DEFAULT_DUPLEX_PROFILE = "minicpmo_4_5_duplex_h200"
DUPLEX_SYSTEM_TEXT = "Streaming Omni Conversation."


@dataclass(frozen=True)
class DuplexUnit:
    """What the model did during one second of input (Thinker -> Talker -> Code2Wav)."""

    index: int
    listen: bool                     # the unit ended with <|listen|> (it has speech only if it also ended the turn)
    text: str                        # the speech text of this unit (special tokens skipped)
    token_ids: tuple[int, ...]       # the Talker's tokens of this unit
    terminator: int
    turn_end: bool                   # the model finished its turn in this unit
    interrupted: bool                # a forced listen cut the model's turn short
    codes: tuple[int, ...]           # codec ids the Talker made in this unit (25 Hz)
    pcm: np.ndarray = field(repr=False)   # float32 24 kHz audio released in this unit (may be empty)

    @property
    def seconds(self) -> float:
        return len(self.pcm) / PCM_RATE


@dataclass(frozen=True)
class DuplexInput:
    """One conversation's second of input for ``DuplexBatch.step``: 1 s of mono audio (resampled
    from ``sample_rate`` when it is not 16 kHz), an optional video frame, and the client's barge-in."""

    audio: np.ndarray
    frame: object = None
    force_listen: bool = False
    sample_rate: int = 16000


class DuplexConversation:
    """One duplex conversation (one user, one voice). ``code2wav=None`` makes codes only.
    ``talker``: the Talker state to use (a ``TalkerTurns`` seat when the conversation belongs to a
    ``DuplexBatch``; default its own ``TalkerTurn``)."""

    def __init__(self, thinker, tokenizer, tts, code2wav=None, voice: Union[str, Path, None] = None,
                 decode: DuplexDecodeConfig = DuplexDecodeConfig(), talker_sampling: ChunkSampling = ChunkSampling(),
                 system_text: str = DUPLEX_SYSTEM_TEXT, seed: int = 0, window=None, session_options=None,
                 fast: bool | None = None, talker=None):
        from ..thinker.session import StreamingSession, WindowPolicy, shared_fast_paths

        # fast (default on CUDA): the Thinker session's fast paths (static cache, Triton kernels, graphs)
        # and the Talker's static cache (TalkerTurns) with CUDA graphs; the plain references otherwise
        fast = thinker.device.type == "cuda" if fast is None else fast
        if session_options is None:
            session_options = shared_fast_paths(thinker) if fast and thinker.device.type == "cuda" else {}

        ref16 = None
        if voice is not None:
            ref16 = read_audio_16k(voice)
            if code2wav is not None:
                code2wav.features(voice)   # reads and checks it for Code2Wav before any model work
        elif code2wav is not None:
            raise InputError("duplex: Code2Wav needs a voice; pass a reference recording (WAV)")
        self.thinker, self.tokenizer, self.code2wav, self.voice = thinker, tokenizer, code2wav, voice
        self.session = StreamingSession(thinker, tokenizer, system_prompt=system_text,
                                        window=window if window is not None else WindowPolicy.duplex_basic(),
                                        ref_audio=ref16, **session_options)
        generator = torch.Generator().manual_seed(seed)
        self.decoder = DuplexDecoder(tokenizer, decode, generator)
        if talker is None:    # fast: a one-seat TalkerTurns (graphs on CUDA)
            talker = TalkerTurns(tts, 1, talker_sampling, [seed]).seat(0) if fast else \
                TalkerTurn(tts, talker_sampling, seed)
        self.talker = talker
        self.turn = TurnState()
        self.units = 0
        self._stream = None          # the open turn's Code2Wav stream
        self._buffer: list[int] = [SILENCE_CODE] * CONTEXT_CODES   # upstream's token2wav buffer
        self._skip = 0               # samples of the stream's lead-in still to drop

    @classmethod
    def from_snapshot(cls, model, voice=None, profile: str = DEFAULT_DUPLEX_PROFILE, device: str = "cpu",
                      dtype: torch.dtype = torch.float32, with_code2wav: bool = True, n_timesteps: int | None = None,
                      decode: DuplexDecodeConfig = DuplexDecodeConfig(), seed: int = 0,
                      fast: bool | None = None) -> "DuplexConversation":
        thinker, tokenizer, tts, c2w = load_duplex_models(model, profile, device, dtype, with_code2wav, n_timesteps)
        return cls(thinker, tokenizer, tts, c2w, voice, decode=decode, seed=seed, fast=fast)

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, audio: np.ndarray, frame=None, *, sample_rate: int = 16000,
             force_listen: bool = False) -> DuplexUnit:
        """One second of user audio (16 kHz mono float; other rates are resampled) and an
        optional video frame. ``force_listen``: the client's barge-in (the model stops talking)."""
        index, gen = self._think(audio, frame, sample_rate, force_listen)
        if not speaks(gen):
            return self._unit(index, gen, (), np.zeros(0, np.float32))
        unit = self.talker.generate_unit(gen.talker_ids, gen.talker_hidden, gen.turn_end)
        pcm = self._vocode(unit.codes, gen.turn_end)
        return self._unit(index, gen, unit.codes, pcm)

    def flush(self) -> np.ndarray:
        """End the input: decode the open turn's waiting codes as its final payload (the model's
        last words are heard instead of dropped) and close the Talker's turn. Returns that audio.
        The Thinker's context is left as it is: call ``close`` next."""
        if self._stream is None:
            self.talker.reset()
            return np.zeros(0, np.float32)
        return self._vocode([], True)

    def close(self) -> None:
        self._drop_turn()
        self.session.close()

    # ------------------------------------------------------------------------------------------------
    def _think(self, audio, frame, sample_rate: int, force_listen: bool):
        """The Thinker's part of a step: commit the second, generate the unit -> (unit index, UnitGeneration)."""
        self.session.commit(audio, frame, sample_rate=sample_rate)
        return self._unit_done(generate_unit(self.session, self.decoder, self.tokenizer, self.turn,
                                             force_listen=force_listen))

    def _unit_done(self, gen):
        index, self.units = self.units, self.units + 1
        if gen.interrupted:
            self._drop_turn()
        return index, gen

    @staticmethod
    def _unit(index: int, gen, codes: tuple[int, ...], pcm: np.ndarray) -> DuplexUnit:
        if not speaks(gen):
            return DuplexUnit(index, True, "", (), gen.terminator, False, gen.interrupted, (), pcm)
        return DuplexUnit(index, gen.listen, gen.text, gen.talker_ids, gen.terminator, gen.turn_end,
                          gen.interrupted, tuple(codes), pcm)

    def _drop_turn(self) -> None:
        """An interrupted turn: its waiting codes and Code2Wav stream are dropped unheard, as
        upstream's reset for a new turn; the Talker's cache is reset too (upstream keeps it)."""
        self.talker.reset()
        if self._stream is not None:
            self._stream.close()
        self._stream, self._buffer = None, [SILENCE_CODE] * CONTEXT_CODES

    def _vocode(self, codes, turn_end: bool) -> np.ndarray:
        return self._release([stream.push(payload, last) for stream, payload, last in self._payloads(codes, turn_end)],
                             turn_end)

    def _payloads(self, codes, turn_end: bool) -> list[tuple[object, list[int], bool]]:
        """The Code2Wav pushes (stream, payload, last) the turn's codes so far allow, as upstream's
        token2wav buffer: it starts as 3 silence codes; while it holds the look-ahead + 5 codes, up to
        25 + look-ahead of them are decoded and all but the last look-ahead (the next context) leave it;
        the turn's last unit decodes the rest as the stream's final payload. ``_release`` takes their PCM."""
        if self.code2wav is None:
            return []
        self._buffer += list(codes)
        lookahead = self.code2wav.flow.pre_lookahead_len
        out = []
        if self._stream is None:
            self._stream = self.code2wav.open_stream(self.voice)
            self._skip = self._stream.lead_samples + CONTEXT_CODES * SAMPLES_PER_CODE
        while len(self._buffer) >= lookahead + 5:
            take = min(UNIT_CODES + lookahead, len(self._buffer))
            out.append((self._stream, self._buffer[:take], False))
            self._buffer = self._buffer[min(UNIT_CODES, take - lookahead):]
        if turn_end:
            out.append((self._stream, self._buffer, True))
        return out

    def _release(self, out: list[np.ndarray], turn_end: bool) -> np.ndarray:
        """The unit's audio from its pushes' PCM: the stream's lead-in dropped, a non-final unit
        left-padded to 1 s; a turn end closes the turn's stream and the Talker's turn."""
        if self.code2wav is None:
            if turn_end:
                self._drop_turn()
            return np.zeros(0, np.float32)
        if turn_end:
            self._stream, self._buffer = None, [SILENCE_CODE] * CONTEXT_CODES
            self.talker.reset()
        wav = np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)
        cut = min(self._skip, len(wav))
        self._skip -= cut
        wav = wav[cut:]
        if not turn_end and len(wav) < PCM_RATE:
            wav = np.concatenate([np.zeros(PCM_RATE - len(wav), np.float32), wav])
        return wav


def load_duplex_models(model, profile: str = DEFAULT_DUPLEX_PROFILE, device: str = "cpu",
                       dtype: torch.dtype = torch.float32, with_code2wav: bool = True, n_timesteps: int | None = None):
    """(thinker, tokenizer, tts, code2wav or None) of a snapshot, under a duplex profile."""
    from ..checkpoint.snapshot import resolve_snapshot
    from ..checkpoint.tokenizer import load_tokenizer
    from ..code2wav.pipeline import Code2Wav
    from ..profiles import load_profile
    from ..talker.load import load_talker
    from ..thinker.model import Thinker

    prof = load_profile(profile)
    if prof.mode != "duplex":
        raise InputError(f"profile {prof.name!r} is a {prof.mode} profile; a duplex conversation needs a "
                         f"duplex profile (e.g. {DEFAULT_DUPLEX_PROFILE})")
    snap = resolve_snapshot(model)
    thinker = Thinker.from_snapshot(snap.path, dtype=dtype, device=device)
    c2w = None
    if with_code2wav:
        c2w = Code2Wav.from_snapshot(snap.path, device=device, n_timesteps=n_timesteps or prof.code2wav.n_timesteps,
                                     extra=prof.code2wav.extra)
    return thinker, load_tokenizer(snap.path), load_talker(snap.path, dtype, device), c2w


def speaks(gen) -> bool:
    """Does this unit reach the Talker? A unit that ends the turn and then listens
    (<|turn_eos|> ... <|listen|>) is still voiced and closes the Talker's turn; upstream skips both
    (its text is never heard, its TTS cache leaks into the next turn)."""
    return not gen.listen or gen.turn_end


class DuplexBatch:
    """Several duplex conversations on one set of models, stepped one second at a time (module
    docstring). Conversation i has seat i of one ``TalkerTurns`` and ``seeds[i]``; on CUDA every
    conversation shares one set of Thinker fast paths (``shared_fast_paths``)."""

    def __init__(self, thinker, tokenizer, tts, code2wav=None, voices: Sequence = (None,),
                 seeds: Sequence[int] | None = None, decode: DuplexDecodeConfig = DuplexDecodeConfig(),
                 talker_sampling: ChunkSampling = ChunkSampling(), fast: bool | None = None,
                 talker_max_len: int = 4096, shared_decode: bool | None = None, **conversation_options):
        from ..thinker.llm_cache import StaticDecoderPool, StaticRows
        from ..thinker.session import WindowPolicy, shared_fast_paths, static_rows_for

        voices = list(voices)
        if not voices:
            raise InputError("duplex batch: give at least one conversation (one voice, or None, per conversation)")
        seeds = list(range(len(voices))) if seeds is None else list(seeds)
        if len(seeds) != len(voices):
            raise InputError(f"duplex batch: {len(seeds)} seeds for {len(voices)} conversations; give one per voice")
        fast = thinker.device.type == "cuda" if fast is None else fast
        if "session_options" not in conversation_options:
            conversation_options["session_options"] = (shared_fast_paths(thinker)
                                                       if fast and thinker.device.type == "cuda" else {})
        opts = dict(conversation_options["session_options"])
        # shared_decode: sessions on static caches take rows of one decoder, so each decode step of all the
        # conversations is one forward (StaticRows). Off, each unit decodes on its own session's cache. Unset
        # means on wherever it can be and pays: static caches (the CUDA fast paths) and more than one seat
        # (on the H200 one seat decodes ~10% slower on a two-row decoder; 16 seats' Thinker takes 417 ms
        # against 916, duplex_batch_bench_session42_h200.md).
        if shared_decode is None:
            shared_decode = opts.get("llm_cache") == "static" and len(voices) > 1
        self.rows = None
        if shared_decode:
            if opts.get("llm_cache") != "static":
                raise InputError("duplex batch: shared_decode needs sessions on static caches "
                                 "(session_options llm_cache='static')")
            window = conversation_options.get("window") or WindowPolicy.duplex_basic()
            pool = opts.get("llm_pool")
            self.rows = StaticRows(thinker, len(voices), static_rows_for(thinker, window, opts.get("static_capacity")),
                                   kernels=opts.get("llm_kernels", "auto"), graphs=opts.get("llm_graphs"),
                                   pool=pool if isinstance(pool, StaticDecoderPool) else None)
            conversation_options["session_options"] = {**opts, "llm_pool": self.rows}
        # with shared rows, the seconds' commits prefill in one forward per run of rows (commit_many), and
        # their audio-encoder steps run in one graph replay (batched_audio; sessions sharing AudioGraphs)
        self.batched_commit = self.rows is not None
        self.batched_audio = True
        # opt-in: the commits' mels in one batch. The mel itself is 2.5x faster; the whole second on the H200 moved
        # within its run-to-run spread (duplex_mel_batch_session51_h200.md)
        self.batched_mel = False
        self.code2wav = code2wav
        self.talker = TalkerTurns(tts, len(voices), talker_sampling, seeds, max_len=talker_max_len,
                                  graphs=fast and thinker.device.type == "cuda")
        self._make = lambda i, voice, seed: DuplexConversation(
            thinker, tokenizer, tts, code2wav, voice, decode=decode, talker_sampling=talker_sampling, seed=seed,
            fast=fast, talker=self.talker.seat(i), **conversation_options)
        self.conversations = [self._make(i, voice, seed) for i, (voice, seed) in enumerate(zip(voices, seeds))]
        self.voices, self.seeds = voices, seeds     # each seat's, as built or last reopened (warm_up reopens them)

    @classmethod
    def from_snapshot(cls, model, voices: Sequence, profile: str = DEFAULT_DUPLEX_PROFILE, device: str = "cpu",
                      dtype: torch.dtype = torch.float32, with_code2wav: bool = True, n_timesteps: int | None = None,
                      decode: DuplexDecodeConfig = DuplexDecodeConfig(), seeds: Sequence[int] | None = None,
                      fast: bool | None = None, shared_decode: bool | None = None) -> "DuplexBatch":
        thinker, tokenizer, tts, c2w = load_duplex_models(model, profile, device, dtype, with_code2wav, n_timesteps)
        return cls(thinker, tokenizer, tts, c2w, voices, seeds, decode, fast=fast, shared_decode=shared_decode)

    def __len__(self) -> int:
        return len(self.conversations)

    @torch.no_grad()
    def step(self, inputs: Sequence[DuplexInput | None]) -> list[DuplexUnit | None]:
        """One second for every conversation: ``inputs[i]`` is conversation i's, or None when it does
        not step this second (its unit is then None too)."""
        self.check(inputs)
        thought = self._think(inputs)
        talking = [i for i, (_, gen) in thought.items() if speaks(gen)]
        made = self.talker.generate_units([SeatUnit(i, thought[i][1].talker_ids, thought[i][1].talker_hidden,
                                                    thought[i][1].turn_end) for i in talking])
        codes = {i: u.codes for i, u in zip(talking, made)}
        plans = {i: self.conversations[i]._payloads(codes[i], thought[i][1].turn_end) for i in talking}
        pcm = {i: [] for i in talking}
        for r in range(max((len(p) for p in plans.values()), default=0)):   # push r of every conversation at once
            round_ = [(i, p[r]) for i, p in plans.items() if r < len(p)]
            for (i, _), wav in zip(round_, self.code2wav.push_many([item for _, item in round_])):
                pcm[i].append(wav)
        units: list[DuplexUnit | None] = [None] * len(self.conversations)
        for i, (index, gen) in thought.items():
            conv = self.conversations[i]
            if i in codes:
                units[i] = conv._unit(index, gen, codes[i], conv._release(pcm[i], gen.turn_end))
            else:
                units[i] = conv._unit(index, gen, (), np.zeros(0, np.float32))
        return units

    def _think(self, inputs) -> dict[int, tuple]:
        """Every stepping conversation's Thinker unit -> {i: (unit index, UnitGeneration)}: each commits its
        second, then the units generate in lock step, one forward per decode step for all of them on shared
        rows (one forward per conversation otherwise)."""
        from ..thinker.session import EmbeddedFrame, commit_many

        steps, pending, done = {}, {}, {}
        # the frames of this second go through the vision encoder in one batch (the sessions share the
        # thinker and its vision graphs); each session then commits its embedded frame
        frames = {i: x.frame for i, x in enumerate(inputs)
                  if x is not None and x.frame is not None and not isinstance(x.frame, EmbeddedFrame)}
        if len(frames) > 1:
            frames = dict(zip(frames, self.conversations[next(iter(frames))].session.embed_frames(list(frames.values()))))
        stepping = [i for i, x in enumerate(inputs) if x is not None]
        if self.rows is not None and self.batched_commit and len(stepping) > 1:
            # the seconds' LLM prefills in one forward per run of consecutive rows
            commit_many([self.conversations[i].session for i in stepping],
                        [(inputs[i].audio, frames.get(i, inputs[i].frame), inputs[i].sample_rate) for i in stepping],
                        self.rows, batched_audio=self.batched_audio, batched_mel=self.batched_mel)
        else:
            for i in stepping:
                x = inputs[i]
                self.conversations[i].session.commit(x.audio, frames.get(i, x.frame), sample_rate=x.sample_rate)
        for i in stepping:
            conv = self.conversations[i]
            steps[i] = unit_steps(conv.session, conv.decoder, conv.tokenizer, conv.turn, inputs[i].force_listen)
            pending[i] = None

        def advance(i, value) -> None:
            """Send ``value`` to conversation i's steps (None: start them); file what they ask next."""
            try:
                ask = next(steps[i]) if value is None else steps[i].send(value)
            except StopIteration as end:
                done[i] = self.conversations[i]._unit_done(end.value)
                return
            (asks if isinstance(ask, DecodeRequest) else nxt)[i] = ask

        while pending:
            hidden = {}
            if self.rows is not None and any(t is not None for t in pending.values()):
                where = {i: self.conversations[i].session.token_row() for i, t in pending.items() if t is not None}
                out = self.rows.step_logits({row: (pending[i], pos) for i, (row, pos) in where.items()})
                # the hidden rows reach the host in one copy (the Talker reads them there); the logits stay on
                # the device, where decode_many reads every seat's at once
                rows = out.hidden.float().cpu()
                for k, i in enumerate(where):
                    self.conversations[i].session.accept_token(pending[i], out.hidden[k], logits=out.logits[k])
                    hidden[i] = rows[k]
            nxt, asks = {}, {}
            for i, token in pending.items():
                advance(i, None if token is None else
                        hidden[i] if i in hidden else self.conversations[i].session.feed_token(token))
            while asks:     # every seat's decode policy in one pass over the stacked logits
                ready, asks = asks, {}
                tokens = decode_many([self.conversations[i].decoder for i in ready], [a.logits for a in ready.values()])
                for i, token in zip(ready, tokens):
                    advance(i, token)
            pending = nxt
        return done

    def check(self, inputs) -> None:
        """Every input is checked before any conversation commits its second, so a bad one for
        conversation k does not leave the others a second ahead (audio and frame, as ``commit`` checks them)."""
        from ..thinker.image_processor import to_rgb_image
        from ..thinker.session import EmbeddedFrame

        if len(inputs) != len(self.conversations):
            raise InputError(f"duplex batch: {len(inputs)} inputs for {len(self.conversations)} conversations; "
                             "give one per conversation (None for one that does not step)")
        for i, (conv, x) in enumerate(zip(self.conversations, inputs)):
            if x is None:
                continue
            where = f"duplex batch: conversation {i}"
            if not isinstance(x, DuplexInput):
                raise InputError(f"{where}: got a {type(x).__name__}; pass a DuplexInput(audio, frame) or None")
            conv.session._unit_input(x.audio, None, True, where, x.sample_rate)   # checks, feeds nothing
            if x.frame is not None and not isinstance(x.frame, EmbeddedFrame):
                to_rgb_image(x.frame, f"{where}: frame")

    def reopen(self, i: int, voice=None, seed: int = 0) -> DuplexConversation:
        """Close conversation ``i`` and start a new one in its place (a new user, ``voice``, ``seed``):
        a server keeps its seats and its captured graphs while users come and go."""
        if not 0 <= i < len(self.conversations):
            raise InputError(f"duplex batch: conversation {i} does not exist (0..{len(self.conversations) - 1})")
        self.conversations[i].close()
        self.talker.reseat(i, seed)
        self.conversations[i] = self._make(i, voice, seed)
        self.voices[i], self.seeds[i] = voice, seed
        return self.conversations[i]

    @torch.no_grad()
    def warm_up(self, seconds: int = 2, frame=None, talker_rows: Sequence[int] = (8, 16, 32),
                talker_kv: Sequence[int] | None = None) -> list[float]:
        """Make what the batch's seconds replay before a user's second needs it, then give every seat a fresh
        conversation (its voice and seed as before): Code2Wav's graphs for each voice (``Code2Wav.prepare``),
        the Talker's prefill graphs for conditions of ``talker_rows`` rows at the attention bucket of each
        ``talker_kv`` length (default: every bucket; ``TalkerTurns.precapture``), then
        ``seconds`` seconds of silence through every seat, with ``frame`` each second when given (the frame
        size the users will send), which compiles the kernels and captures the Thinker side's graphs (audio
        steps at the batch's size, the vision batch, the prefill shapes). On the H200 a fresh 16-seat batch's
        first two user seconds took 738 and 380 ms without it, 234 and 249 after a 0.9-s warm-up, a steady
        second's time (``benchmarks/results/duplex_warm_up_session48_h200.md``). Until session 52 only the
        smallest bucket (256 positions) was precaptured: a speaking seat's Talker context grows ~31 positions a
        second, so its 9th second captured the 512 bucket's graph mid-conversation (the slow second 8 of every
        16-seat run, ~60 ms and ~25 cudaMalloc calls; ``duplex_waits_session52_h200.md`` section 6), the 17th the
        1024 one. Returns each warm-up second's wall time in ms."""
        if seconds < 0:
            raise InputError(f"duplex batch: warm_up seconds must be >= 0 (got {seconds})")
        if self.code2wav is not None:
            for voice in dict.fromkeys(v for v in self.voices if v is not None):
                self.code2wav.prepare(voice)
        for kv in (self.talker.buckets if talker_kv is None else talker_kv):
            self.talker.precapture(talker_rows, kv)
        silence = np.zeros(16000, np.float32)
        dev = self.conversations[0].thinker.device
        took = []
        for _ in range(seconds):
            t0 = time.perf_counter()
            self.step([DuplexInput(silence, frame) for _ in self.conversations])
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            took.append((time.perf_counter() - t0) * 1e3)
        for i in range(len(self.conversations)):
            self.reopen(i, self.voices[i], self.seeds[i])
        return took

    def flush(self) -> list[np.ndarray]:
        """End every conversation's input (``DuplexConversation.flush`` each)."""
        return [conv.flush() for conv in self.conversations]

    def close(self) -> None:
        for conv in self.conversations:
            conv.close()
        if self.rows is not None:
            self.rows.close()


def read_audio_16k(path) -> np.ndarray:
    """Any soundfile-readable recording -> mono float32 samples at 16 kHz (the Thinker's rate)."""
    from ..code2wav.frontend import read_audio, resample

    x, sr = read_audio(path)
    return resample(x, sr, 16000)


def conversation_track(units, listen_seconds: float = 1.0) -> np.ndarray:
    """The model's side of the conversation as one 24 kHz track: each unit's audio in order, a
    listening unit without audio as ``listen_seconds`` of silence (upstream's listen result is 1 s
    of zeros; a unit that ends the turn and then listens still carries its last words)."""
    parts = [u.pcm if u.pcm.size or not u.listen else np.zeros(int(listen_seconds * PCM_RATE), np.float32)
             for u in units]
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
