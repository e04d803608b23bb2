"""``StreamingSession``: one input-only audio-visual stream through the Thinker, with
exact snapshot/restore, temporary tails and a bounded context window.

Layout (upstream duplex ``streaming_prefill``, spec section 7). The system prompt is
the duplex one: ``<|im_start|>system\\n{text}\\n<|audio_start|><|audio_end|><|im_end|>``
(no reference audio). Each ``commit`` is one unit: ``<unit>``, then for the frame
``<image>`` + 64 embeddings + ``</image>`` (max_slice_nums=1, so never sliced), then the
chunk's 10 audio embeddings with no audio markers -- the position at which upstream
computes the unit's ``pending_logits``, and whose final-norm hidden ``read_state``
returns. Nothing is generated: no ``<|listen|>`` or speech token ever enters the cache.
Upstream's ``finalize_unit`` closes a unit with ``[terminator, </unit>]``; an
input-only unit has no terminator, so it is closed with ``</unit>`` alone (the
``terminator_id is None`` branch) and that token is fed at the start of the next
commit, in the same forward. A unit's record includes its closing ``</unit>``.

Audio follows upstream exactly: chunk 0 is left-padded with zeros to 1035 ms and
consumes 16480 samples (the 80 left over are carried, so every later 1-s commit
consumes 16000 and carries 80); mel via ``StreamingMel`` (stable frames, 2 CNN
redundancy frames each side); the Whisper encoder cuts the conv frames of the
redundancy (``use_extra_context``) and keeps its KV cache across chunks, reset when it
would pass 1500 positions.

Window (``WindowPolicy``). Upstream's duplex ``StreamDecoder.enforce_window``: when the
LLM cache holds more than ``high_tokens`` it drops whole units, oldest first, right
after the system prefix, until at most ``low_tokens`` remain, re-rotating the kept
keys (inverse then forward RoPE, theta from the config) so that positions stay
compressed; ``position_offset`` counts the dropped tokens. Upstream runs it in
``finalize_unit``; here it runs right after each commit's forward (the read-out of that
commit is taken before the drop, so a temporary full chunk inside a transaction equals
the native commit). Upstream's duplex default is ``off`` and its turn-mode window
never drops the single open round of an input-only session, so a 30-minute session
would pass the model's 40,960 positions after about 8.7 minutes; the default here is
``WindowPolicy.input_only()``: the same unit rule at upstream's 8000/6000 watermarks
(``DuplexWindowConfig``). ``duplex_basic()`` (4000/3500, ``DuplexCapability``) and
``off()`` are available; with ``off`` a session stops with ``ContextLimitError``.

Snapshots hold the LLM cache *length* (restore truncates; KV tensors are never
copied), the audio-encoder cache, mel state and carried samples (immutable values,
so holding them is a free clone), the chunk index, RNG states, history length and
open unit, position offset and the last read-out. Pruning cannot be undone by
truncation, so ``transaction()`` suspends it, and restoring a snapshot taken before a
pruning event is refused.

LLM cache backend (``llm_cache``, see ``llm_cache.py``): ``"dynamic"`` (default, the plain
reference: transformers' forward on a DynamicCache) or ``"static"`` (the fast path: the
packed-weight static-cache prefill, fused Triton kernels and CUDA-graph prefill on CUDA).
Both hold the same rows under the same snapshot/truncate/prune semantics. Frames are
preprocessed with PIL as upstream (``image_preprocess="pil"``, default) or in torch on
the model's device (``"torch"``: one or two pixel levels off PIL, see
``image_processor.process_frame_torch``). ``vision_graphs=True`` replays the vision tower +
resampler from a CUDA graph per frame shape (``vision_graph.py``); ``audio_graphs=True`` the
Whisper streaming step per chunk shape over a fixed cache buffer (``audio_graph.py``). The static
cache is preallocated: ``static_capacity`` rows (default: the window's high watermark plus
``STATIC_HEADROOM`` for units fed while pruning is suspended, or the model's positions).
``llm_pool`` draws that cache from a ``StaticDecoderPool`` (shared packed weights, graphs kept
across sessions; ``close()`` hands it back). ``shared_fast_paths(thinker)`` builds every fast
path once, for all the sessions of one thinker.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import MappingProxyType

import numpy as np
import torch
from torch.profiler import record_function

from ..errors import InputError, MiniCPMORTError
from .audio import AudioEncoderCache
from .image_processor import ProcessedImage, process_frame_torch, process_image
from .mel import SAMPLE_RATE, MelState, StreamingMel, check_audio, process_many, warm_mel
from .llm_cache import LLM_CACHES, StaticDecoderPool, make_llm_cache
from .model import AudioChunkEmbedding, Thinker
from .audio_graph import AudioGraphs
from .staging import HostStaging, staging_on
from .vision_graph import VisionGraphs
from .prompt import PromptBuilder, PromptPiece

FIRST_CHUNK_PAD_SAMPLES = int(1035 * SAMPLE_RATE / 1000)  # upstream pads chunk 0 on the left to 1035 ms
STATIC_HEADROOM = 2048  # static-cache rows above the window's high watermark (~26 units inside a transaction)
# Every fast path at once, for a CUDA model: ``StreamingSession(thinker, tok, **FAST_PATH_OPTIONS)``.
FAST_PATH_OPTIONS = MappingProxyType({"llm_cache": "static", "image_preprocess": "torch", "vision_graphs": True,
                                      "audio_graphs": True, "staging": True})


def shared_fast_paths(thinker: Thinker) -> dict:
    """FAST_PATH_OPTIONS with one vision-graph holder, one audio-graph holder and one decoder
    pool, to pass to every session of ``thinker`` (fresh sessions then reuse the captures).
    The mel's cuFFT plans are made here too, and its kernels loaded, once per process (see ``mel.warm_mel``)."""
    warm_mel(thinker.device)
    return {**FAST_PATH_OPTIONS, "vision_graphs": VisionGraphs(thinker), "audio_graphs": AudioGraphs(thinker),
            "llm_pool": StaticDecoderPool(thinker), "staging": HostStaging(thinker.device)}


def fast_path_census(options: dict) -> dict:
    """How many CUDA graphs the shared fast paths of ``shared_fast_paths`` hold (to tell, in a
    benchmark, whether a timed run still captured any)."""
    pool, vision, audio = options.get("llm_pool"), options.get("vision_graphs"), options.get("audio_graphs")
    return {"decoders_created": 0 if pool is None else pool.created,
            "free_decoder_prefill_graphs": [] if pool is None else pool.free_prefill_graphs(),
            "vision_graphs": len(vision._graphs) if isinstance(vision, VisionGraphs) else 0,
            "audio_graphs": len(audio._graphs) if isinstance(audio, AudioGraphs) else 0,
            "audio_fork_graphs": len(audio._fork_graphs) if isinstance(audio, AudioGraphs) else 0,
            "audio_chunk_graphs": len(audio._chunk_graphs) if isinstance(audio, AudioGraphs) else 0}


def static_rows_for(thinker: Thinker, window: "WindowPolicy", static_capacity: int | None = None) -> int:
    """The rows of a session's static LLM cache: ``static_capacity``, else the window's high watermark plus
    STATIC_HEADROOM (a bounded window), at most the model's positions."""
    limit = thinker.config.llm.max_position_embeddings
    if static_capacity is None and window.enabled:
        static_capacity = window.high_tokens + STATIC_HEADROOM
    return min(limit, static_capacity or limit)


class ContextLimitError(InputError):
    """The LLM context would pass the model's max_position_embeddings."""


class SnapshotError(MiniCPMORTError):
    """A snapshot cannot be restored exactly (or did not restore exactly)."""


@dataclass(frozen=True)
class WindowPolicy:
    name: str
    high_tokens: int | None   # None: never prune
    low_tokens: int | None

    def __post_init__(self):
        if (self.high_tokens is None) != (self.low_tokens is None):
            raise InputError(f"window {self.name!r}: give both high_tokens and low_tokens, or neither")
        if self.high_tokens is not None and not 0 < self.low_tokens <= self.high_tokens:
            raise InputError(f"window {self.name!r}: need 0 < low_tokens ({self.low_tokens}) <= high_tokens "
                             f"({self.high_tokens})")

    @property
    def enabled(self) -> bool:
        return self.high_tokens is not None

    @classmethod
    def off(cls) -> "WindowPolicy":
        return cls("off", None, None)

    @classmethod
    def input_only(cls, high_tokens: int = 8000, low_tokens: int = 6000) -> "WindowPolicy":
        return cls("input-only", high_tokens, low_tokens)

    @classmethod
    def duplex_basic(cls) -> "WindowPolicy":
        return cls("duplex-basic", 4000, 3500)


@dataclass(frozen=True)
class PruneEvent:
    commit_index: int      # committed_chunks when it happened
    cache_len_before: int
    tokens_dropped: int
    units_dropped: int = 0


@dataclass(frozen=True)
class UnitRecord:
    unit_id: int
    piece: PromptPiece     # ids fed for this unit (<unk> marks embedding slots), incl. </unit> once closed
    closed: bool = False
    terminator: int | None = None  # the generated unit terminator that closes it (duplex), fed with </unit>

    @property
    def length(self) -> int:
        return len(self.piece)


@dataclass(frozen=True)
class SessionFingerprint:
    llm_cache_len: int
    llm_checksum: float
    audio_cache_len: int
    audio_checksum: float
    mel_state: tuple
    audio_chunk_idx: int
    history_len: int
    position_offset: int
    rng_digest: str


@dataclass(frozen=True)
class RNGState:
    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] = ()

    @classmethod
    def capture(cls) -> "RNGState":
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else ()
        return cls(torch.get_rng_state(), cuda)

    def apply(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(list(self.cuda))

    def digest(self) -> str:
        h = hashlib.sha1(self.cpu.numpy().tobytes())
        for s in self.cuda:
            h.update(s.cpu().numpy().tobytes())
        return h.hexdigest()


@dataclass(frozen=True)
class SessionSnapshot:
    llm_cache_len: int
    llm_checksum: float | None
    audio_cache: AudioEncoderCache | None
    mel_state: MelState
    carry: np.ndarray
    audio_chunk_idx: int
    rng: RNGState
    history_len: int
    open_unit: UnitRecord | None
    next_unit_id: int
    position_offset: int
    committed_chunks: int
    prune_count: int
    last_hidden: torch.Tensor | None


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True)
class EmbeddedFrame:
    """A frame already preprocessed and through the vision tower (``StreamingSession.embed_frames``).

    ``commit`` / ``append_tail`` accept it in place of the raw frame, so a caller can embed
    several frames in one batch (one vision pass instead of one per frame). The vision tower
    is per frame: a frame's embedding does not depend on the other frames of its batch."""

    processed: ProcessedImage
    embeds: torch.Tensor  # [n_sub, 64, H] on the model's device


class StreamingSession:
    """One causal input-only stream (see the module docstring for the exact layout)."""

    def __init__(self, thinker: Thinker, tokenizer, *, system_prompt: str | None = None,
                 window: WindowPolicy | None = None, mel: StreamingMel | None = None,
                 llm_cache: str = "dynamic", static_capacity: int | None = None, llm_kernels: str = "auto",
                 llm_graphs: bool | None = None, image_preprocess: str = "pil",
                 vision_graphs: bool | VisionGraphs = False, audio_graphs: bool | AudioGraphs = False,
                 llm_pool: StaticDecoderPool | None = None, staging: bool | HostStaging = False,
                 ref_audio: np.ndarray | None = None, ref_sample_rate: int = SAMPLE_RATE):
        self.thinker = thinker
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer)
        self.window = window if window is not None else WindowPolicy.input_only()
        self.max_positions = thinker.config.llm.max_position_embeddings
        if self.window.enabled and self.window.high_tokens >= self.max_positions:
            raise InputError(f"window {self.window.name!r}: high_tokens {self.window.high_tokens} must stay below the "
                             f"model's {self.max_positions} positions (a unit is added before pruning runs)")
        # The mel runs where the model runs (on CPU exactly upstream's path; on an
        # accelerator the 30-s recomputation per call costs well under a millisecond).
        dev = thinker.device
        # pinned uploads of frames and the mel's waveform (shared by the sessions of a thinker)
        self.staging = staging if isinstance(staging, HostStaging) else \
            staging_on(dev) if staging else None
        self.mel = mel if mel is not None else StreamingMel(device=None if dev.type == "cpu" else dev,
                                                            staging=self.staging)
        if self.mel.staging is not None:     # page-locked now, not when the buffer outgrows a slot mid-conversation
            self.mel.staging.hold(self.mel.largest_upload)
        if image_preprocess not in ("pil", "torch"):
            raise InputError(f"image_preprocess={image_preprocess!r}: choose 'pil' (the reference) or 'torch' "
                             "(resize + normalise on the model's device)")
        self.image_preprocess = image_preprocess
        # An instance may be shared by sessions of one thinker (it holds graphs, no stream state).
        self.vision = vision_graphs if isinstance(vision_graphs, VisionGraphs) else \
            VisionGraphs(thinker) if vision_graphs else None
        self.audio_graphs = audio_graphs if isinstance(audio_graphs, AudioGraphs) else \
            AudioGraphs(thinker) if audio_graphs else None
        if llm_cache not in LLM_CACHES:
            raise InputError(f"llm_cache={llm_cache!r}: choose one of {', '.join(LLM_CACHES)}")
        capacity = self.max_positions
        if llm_cache == "static":
            capacity = static_rows_for(thinker, self.window, static_capacity)
        self.llm_cache = make_llm_cache(llm_cache, thinker, capacity, kernels=llm_kernels, graphs=llm_graphs,
                                        pool=llm_pool)
        self.audio_cache: AudioEncoderCache | None = None
        self.carry = _frozen(np.zeros(0, np.float32))  # samples received but not yet consumed by a chunk
        self.audio_chunk_idx = 0
        self.committed_chunks = 0
        self.position_offset = 0
        self.history: list[UnitRecord] = []
        self.open_unit: UnitRecord | None = None
        self.next_unit_id = 0
        self.pruning_events: list[PruneEvent] = []
        self.audio_resets = 0
        self._suspended = 0
        self._transactions = 0
        self._tail_appended = False
        self._last_hidden: torch.Tensor | None = None
        # (hidden, its LM-head output) handed in by accept_token; valid while that hidden is the last one
        self._head_out: tuple[torch.Tensor, torch.Tensor] | None = None
        # The voice reference of upstream's duplex prepare: its block-causal audio embeddings sit
        # between <|audio_start|> and <|audio_end|> of the system prompt.
        ref_rows = None
        if ref_audio is not None:
            ref_rows = thinker.embed_audio(check_audio(ref_audio, ref_sample_rate, "ref_audio"))
        self.system_piece = self.prompts.duplex_system(system_prompt, 0 if ref_rows is None else ref_rows.shape[0])
        if len(self.system_piece) > self.max_positions:
            raise ContextLimitError(f"system prompt: {len(self.system_piece)} tokens exceed the model's "
                                    f"{self.max_positions} positions; shorten it")
        if len(self.system_piece) > self.llm_cache.capacity:
            raise ContextLimitError(f"system prompt: {len(self.system_piece)} tokens exceed the static LLM "
                                    f"cache's {self.llm_cache.capacity} rows; pass a larger static_capacity")
        step = self.llm_cache.feed(thinker.fill_slots(self.system_piece, [], ref_rows) if ref_rows is not None
                                   else thinker.embed_tokens(self.system_piece.ids))
        self._last_hidden = step.last
        self.preserve = self.llm_cache.length

    # -- public API -------------------------------------------------------------------------
    def close(self) -> None:
        """Release pooled resources (a pooled static LLM cache goes back to its pool)."""
        self.llm_cache.close()

    def commit(self, audio: np.ndarray, frame, *, sample_rate: int = SAMPLE_RATE) -> None:
        """One native 1-s input-only AV chunk (see module docstring)."""
        if self._tail_appended:
            raise InputError("commit: a tail was appended in this transaction; leave the transaction (restore) "
                             "before committing")
        chunk, rest, processed = self._unit_input(audio, frame, True, "commit", sample_rate)
        self._atomically(lambda: self._feed_unit(chunk, rest, processed, last_chunk=False))

    def append_tail(self, audio: np.ndarray, frame, *, sample_rate: int = SAMPLE_RATE) -> None:
        """A half-open partial (< 1 s) chunk, mel in last-chunk mode; only inside ``transaction()``."""
        if self._transactions == 0:
            raise InputError("append_tail: a partial chunk may only be appended inside `with session.transaction():` "
                             "(it must be restored away before the next native commit)")
        if self._tail_appended:
            raise InputError("append_tail: this transaction already holds a tail; open a new transaction")
        chunk, rest, processed = self._unit_input(audio, frame, False, "append_tail", sample_rate)

        def run():
            self._feed_unit(chunk, rest, processed, last_chunk=True)
            self._tail_appended = True

        self._atomically(run)

    @torch.no_grad()
    def evaluate_forks(self, units, *, sample_rate: int = SAMPLE_RATE, on_device: bool = False) -> list[torch.Tensor]:
        """The read-out state after each of ``units``, each fed ALONE on the current state and
        undone; the session is unchanged afterwards.

        A unit is ``(audio, frame, whole)``: ``whole=True`` a complete 1-s chunk as ``commit``
        feeds it, ``False`` a partial tail as ``append_tail`` does. Per unit this is
        ``with transaction(): commit/append_tail(...); read_state()``, which is exactly what runs
        when the LLM cache cannot fork. A static LLM cache forks instead: every unit's mel runs
        on the current state (put back after each), their audio steps run as one batch where
        the audio graphs can (``AudioGraphs.embed_forks``, else one step each), then their
        prefills run as ONE batch on a copy of the live cache rows (``StaticLLMCache.fork_feed``),
        so the 8B weights are read once per batch instead of once per unit. Values equal the per-unit
        transactions up to the batch's floating-point summation order. The states are float32 on
        the CPU, or with ``on_device`` on the model's device (see ``read_state``).
        """
        if self._tail_appended:
            raise InputError("evaluate_forks: a tail was appended in this transaction; restore it first")
        fork = getattr(self.llm_cache, "fork_feed", None)
        if fork is None:
            out = []
            for audio, frame, whole in units:
                with self.transaction():
                    if whole:
                        self.commit(audio, frame, sample_rate=sample_rate)
                    else:
                        self.append_tail(audio, frame, sample_rate=sample_rate)
                    out.append(self.read_state(on_device=on_device))
            return out
        mel_state = self.mel.snapshot()
        try:
            with self.pruning_suspended():
                mels, frames = [], []
                for i, (audio, frame, whole) in enumerate(units):
                    chunk, _, processed = self._unit_input(audio, frame, whole, f"evaluate_forks: unit {i}",
                                                           sample_rate)
                    mels.append(self._mel_step(chunk, last_chunk=not whole))
                    frames.append(processed)
                    self.mel.restore(mel_state)
                audios = self._fork_audio_steps(mels)
                rows = [self._unit_rows(a, p)[0] for a, p in zip(audios, frames)]
            with record_function("session.llm_fork_feed"):
                hidden = fork(rows)
        finally:
            self.mel.restore(mel_state)
        states = torch.stack(hidden).to(dtype=torch.float32)
        return list((states if on_device else states.cpu()).unbind(0))

    @torch.no_grad()
    def embed_frames(self, frames) -> list[EmbeddedFrame | None]:
        """Preprocess ``frames`` (None entries stay None) and embed them in one vision batch.

        Frames of one size share one batch (a stream's frames all do); frames of other sizes
        are embedded in their own batches. The result feeds ``commit`` / ``append_tail``."""
        processed = [self._check_frame(f, f"embed_frames: frame {i}") for i, f in enumerate(frames)]
        out: list[EmbeddedFrame | None] = [None] * len(processed)
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(processed):
            if p is not None:
                groups.setdefault(tuple(map(tuple, p.tgt_sizes.tolist())), []).append(i)
        embed = self.vision if self.vision is not None else self.thinker.embed_image
        for members in groups.values():
            with record_function("session.vision"):
                rows = embed([processed[i] for i in members])
            for i, e in zip(members, rows.split([processed[i].num_sub_images for i in members])):
                out[i] = EmbeddedFrame(processed[i], e)
        return out

    @torch.no_grad()
    def logits(self) -> torch.Tensor:
        """[vocab] float32: the LM head at the last fed position (upstream's ``pending_logits``
        after a unit's prefill, or the next-token logits after ``feed_token``)."""
        if self._head_out is not None and self._head_out[0] is self._last_hidden:
            return self._head_out[1]
        return self.thinker.llm.lm_head(self._last_hidden.to(self.thinker.dtype)).float()

    @torch.no_grad()
    def feed_token(self, token_id: int) -> torch.Tensor:
        """Feed one generated token into the open unit (duplex ``StreamDecoder.feed``); returns
        its final-norm hidden row (the Talker conditions on it). The token becomes part of the
        unit, so pruning drops it with the unit."""
        self._check_token_feed("feed_token")
        piece = PromptPiece((int(token_id),))

        def run():
            step = self.llm_cache.feed(self.thinker.embed_tokens(piece.ids))
            self._last_hidden = step.last
            self.open_unit = replace(self.open_unit, piece=self.open_unit.piece + piece)

        self._atomically(run)
        return self._last_hidden

    def _check_token_feed(self, where: str) -> None:
        if self.open_unit is None or self.open_unit.terminator is not None:
            raise InputError(f"{where}: no open unit to generate into; commit a unit first (and do not feed "
                             "after end_unit)")
        if self._tail_appended:
            raise InputError(f"{where}: a tail was appended in this transaction; restore it first")
        if self.llm_cache.length + 1 > min(self.llm_cache.capacity, self.max_positions):
            raise ContextLimitError(f"{where}: the context is full ({self.llm_cache.length} rows); use a bounded "
                                    "WindowPolicy or a larger static_capacity")

    def token_row(self) -> tuple[int, int]:
        """Where ``feed_token``'s next token goes: (the session's row of a ``StaticRows`` cache, its position).
        A caller feeding several sessions' tokens in one ``StaticRows.step`` hands each result to
        ``accept_token``."""
        self._check_token_feed("token_row")
        row = getattr(getattr(self.llm_cache, "store", None), "row", None)
        if row is None or not hasattr(self.llm_cache, "advance"):
            raise InputError("token_row: this session's LLM cache is not a row of a StaticRows decoder; build it "
                             "with llm_cache='static' and llm_pool=StaticRows(...)")
        return row, self.llm_cache.length

    def accept_token(self, token_id: int, hidden: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """``feed_token`` whose forward ran elsewhere: the token's K/V are already at ``token_row()``'s
        position and ``hidden`` is its final-norm row. ``logits``: the LM head of that row when the forward
        computed it (float32, on any device; ``logits()`` then returns it, as it is, instead of running the
        head again). Returns ``hidden``."""
        self.token_row()
        self.llm_cache.advance(1)
        self._last_hidden = hidden
        self._head_out = None if logits is None else (hidden, logits)
        self.open_unit = replace(self.open_unit, piece=self.open_unit.piece + PromptPiece((int(token_id),)))
        return hidden

    def end_unit(self, terminator_id: int | None) -> None:
        """Close the open unit with the generated terminator (``<|listen|>``, ``<|chunk_eos|>``,
        ``<|chunk_tts_eos|>``; None for an input-only unit). As upstream's ``finalize_unit`` the
        terminator and ``</unit>`` are fed before the next unit's rows (here in the same forward)."""
        if self.open_unit is None:
            raise InputError("end_unit: no open unit; commit a unit first")
        if self.open_unit.terminator is not None:
            raise InputError(f"end_unit: unit {self.open_unit.unit_id} already ended")
        if terminator_id is not None:
            self.open_unit = replace(self.open_unit, terminator=int(terminator_id))

    def read_state(self, *, on_device: bool = False) -> torch.Tensor:
        """[hidden] float32 CPU: the final-norm hidden state at the last fed position.

        ``on_device=True`` keeps the copy on the model's device: the read does not wait for the
        GPU, so a caller that moves its rows to the host later lets the host queue the next
        units meanwhile."""
        h = self._last_hidden.detach()
        return h.to(device=h.device if on_device else "cpu", dtype=torch.float32, copy=True)

    def snapshot(self, checksum: bool = False) -> SessionSnapshot:
        """Capture everything ``restore`` needs; ``checksum=True`` also records the LLM cache
        checksum (a full read of the cache) so that ``restore`` verifies it."""
        return SessionSnapshot(
            llm_cache_len=self.llm_cache.length,
            llm_checksum=self.llm_cache.checksum() if checksum else None,
            audio_cache=self.audio_cache, mel_state=self.mel.snapshot(), carry=self.carry,
            audio_chunk_idx=self.audio_chunk_idx, rng=RNGState.capture(), history_len=len(self.history),
            open_unit=self.open_unit, next_unit_id=self.next_unit_id, position_offset=self.position_offset,
            committed_chunks=self.committed_chunks, prune_count=len(self.pruning_events),
            last_hidden=self._last_hidden)

    @record_function("session.restore")
    def restore(self, snap: SessionSnapshot) -> None:
        if snap.prune_count != len(self.pruning_events):
            raise SnapshotError(f"restore: the snapshot was taken before {len(self.pruning_events) - snap.prune_count} "
                                "pruning event(s); truncation cannot recreate pruned units (take snapshots inside "
                                "`transaction()`, which suspends pruning)")
        length = self.llm_cache.length
        if length < snap.llm_cache_len:
            raise SnapshotError(f"restore: the LLM cache holds {length} rows, fewer than the snapshot's "
                                f"{snap.llm_cache_len}; it was modified outside this session")
        self.llm_cache.truncate(snap.llm_cache_len)
        self.audio_cache = snap.audio_cache
        self.mel.restore(snap.mel_state)
        self.carry = snap.carry
        self.audio_chunk_idx = snap.audio_chunk_idx
        snap.rng.apply()
        del self.history[snap.history_len:]
        self.open_unit = snap.open_unit
        self.next_unit_id = snap.next_unit_id
        self.position_offset = snap.position_offset
        self.committed_chunks = snap.committed_chunks
        self._last_hidden = snap.last_hidden
        self._tail_appended = False
        if snap.llm_checksum is not None and self.llm_cache.checksum() != snap.llm_checksum:
            raise SnapshotError("restore: the LLM cache checksum differs from the snapshot's after truncation")

    @record_function("session.fingerprint")
    def fingerprint(self, *, lazy: bool = False) -> SessionFingerprint:
        """What a restore must leave unchanged. ``lazy``: the two checksums stay 0-d device
        tensors, read later (the extractor reads all of a run's at once, ``Audit.resolve``)."""
        carry = hashlib.sha1(np.ascontiguousarray(self.carry).tobytes()).hexdigest()
        return SessionFingerprint(
            llm_cache_len=self.llm_cache.length, llm_checksum=self.llm_cache.checksum(as_tensor=lazy),
            audio_cache_len=self.audio_cache.length if self.audio_cache is not None else 0,
            audio_checksum=self.audio_cache.checksum(as_tensor=lazy) if self.audio_cache is not None else 0.0,
            mel_state=self.mel.state.digest() + (int(self.carry.shape[0]), carry),
            audio_chunk_idx=self.audio_chunk_idx, history_len=self.history_len,
            position_offset=self.position_offset, rng_digest=RNGState.capture().digest())

    @contextmanager
    def transaction(self):
        """Snapshot; suspend destructive pruning; yield; restore (even on error)."""
        snap = self.snapshot()
        self._transactions += 1
        try:
            with self.pruning_suspended():
                yield self
        finally:
            self._transactions -= 1
            self.restore(snap)

    @contextmanager
    def pruning_suspended(self):
        self._suspended += 1
        try:
            yield self
        finally:
            self._suspended -= 1

    @property
    def history_len(self) -> int:
        """Units recorded so far (closed units plus the open one)."""
        return len(self.history) + (1 if self.open_unit is not None else 0)

    @property
    def cache_len(self) -> int:
        return self.llm_cache.length

    @property
    def cache(self):
        """The backend's store: a transformers DynamicCache, or the StaticDecoder holding the static KV."""
        return self.llm_cache.store

    # -- internals --------------------------------------------------------------------------
    @record_function("session.preprocess_frame")
    def _check_frame(self, frame, where: str) -> ProcessedImage | EmbeddedFrame | None:
        if frame is None or isinstance(frame, EmbeddedFrame):
            return frame
        if self.image_preprocess == "torch":
            return process_frame_torch(frame, device=self.thinker.device, where=f"{where}: frame",
                                       staging=self.staging)
        return process_image(frame, max_slice_nums=1, where=f"{where}: frame")

    def _unit_input(self, audio, frame, whole: bool, where: str, sample_rate: int):
        """One unit's checked inputs: (the mel's chunk, samples carried on, processed frame).
        A whole unit is a native chunk as ``commit`` feeds it; otherwise a partial tail."""
        audio = check_audio(audio, sample_rate, where)
        if not whole and audio.shape[0] >= self.mel.chunk_samples:
            raise InputError(f"{where}: {audio.shape[0]} samples is a whole chunk; a tail must be shorter than "
                             f"{self.mel.chunk_samples} samples (use commit for complete seconds)")
        processed = self._check_frame(frame, where)
        pending = self._pending_with(audio)
        if not whole:
            return pending, pending[:0], processed
        need = self.mel.chunk_size()
        if pending.shape[0] < need:
            raise InputError(f"{where}: a native chunk needs {need} samples here but only {pending.shape[0]} are "
                             f"available ({audio.shape[0]} new + {self.carry.shape[0]} carried); pass 1 s "
                             f"({SAMPLE_RATE} samples) per commit, or use append_tail for a partial chunk")
        return pending[:need], pending[need:], processed

    def _pending_with(self, audio: np.ndarray) -> np.ndarray:
        pending = np.concatenate([self.carry, audio]) if self.carry.size else audio
        if self.audio_chunk_idx == 0 and pending.shape[0] < FIRST_CHUNK_PAD_SAMPLES:
            pending = np.concatenate([np.zeros(FIRST_CHUNK_PAD_SAMPLES - pending.shape[0], np.float32), pending])
        return pending

    def _atomically(self, fn) -> None:
        """Run ``fn``; on any error put every piece of state back as it was."""
        snap = self.snapshot()
        events = list(self.pruning_events)
        try:
            fn()
        except BaseException:
            if len(self.pruning_events) == len(events):
                self.restore(snap)
            raise

    def _feed_unit(self, chunk: np.ndarray, rest: np.ndarray, processed: ProcessedImage | EmbeddedFrame | None,
                   last_chunk: bool) -> None:
        embeds, audio, closing, unit = self._unit_embeds(chunk, processed, last_chunk)
        with record_function("session.llm_feed"):
            step = self.llm_cache.feed(embeds)
        self._apply_unit(step, audio, closing, unit, rest, last_chunk)

    def _apply_unit(self, step, audio: AudioChunkEmbedding, closing: PromptPiece, unit: PromptPiece,
                    rest: np.ndarray, last_chunk: bool) -> None:
        """A unit's bookkeeping once its forward (``step``) succeeded."""
        self._last_hidden = step.last
        self.audio_cache = audio.cache
        self.audio_resets += int(audio.reset)
        self.carry = _frozen(np.array(rest, dtype=np.float32))
        if self.open_unit is not None:
            self.history.append(replace(self.open_unit, piece=self.open_unit.piece + closing, closed=True))
        self.open_unit = UnitRecord(self.next_unit_id, unit)
        self.next_unit_id += 1
        if not last_chunk:
            self.audio_chunk_idx += 1
            self.committed_chunks += 1
            self._enforce_window()

    def _unit_embeds(self, chunk: np.ndarray, processed: ProcessedImage | EmbeddedFrame | None,
                     last_chunk: bool):
        """A unit's LLM input rows (closing piece + unit) and its audio step; advances the mel."""
        return self._unit_rows(self._audio_step(self._mel_step(chunk, last_chunk)), processed)

    def _mel_step(self, chunk: np.ndarray, last_chunk: bool):
        # named ranges for torch.profiler (benchmarks/features_bench.py --torch-profile); ~1 us each otherwise
        with record_function("session.mel"):
            return self.mel.process(chunk, last_chunk=last_chunk)

    def _audio_step(self, mel) -> AudioChunkEmbedding:
        embed_audio = self.audio_graphs.embed_chunk if self.audio_graphs is not None else \
            self.thinker.embed_audio_chunk
        with record_function("session.audio_encoder"):
            return embed_audio(mel.features, self.audio_cache, mel.prefix_extra, mel.suffix_extra)

    def _fork_audio_steps(self, mels: list) -> list[AudioChunkEmbedding]:
        """Each mel chunk's audio step on the current cache, for units that are not kept: in one
        batched graph replay when the chunks can share one (same prefix trim, no cache reset),
        else one step each. Only the embeddings are returned (the cache stays None)."""
        batch = getattr(self.audio_graphs, "embed_forks", None)
        if batch is not None and len(mels) > 1 and len({m.prefix_extra for m in mels}) == 1:
            with record_function("session.audio_encoder_forks"):
                embeds = batch([m.features for m in mels], self.audio_cache, mels[0].prefix_extra,
                               [m.suffix_extra for m in mels])
            if embeds is not None:
                return [AudioChunkEmbedding(e, None, False) for e in embeds]
        return [self._audio_step(m) for m in mels]

    def _unit_rows(self, audio: AudioChunkEmbedding, processed: ProcessedImage | EmbeddedFrame | None):
        """The LLM input rows of a unit whose audio step is ``audio``: closing piece + unit."""
        th = self.thinker
        if isinstance(processed, EmbeddedFrame):
            images, processed = [processed.embeds], processed.processed
        else:
            embed_image = self.vision if self.vision is not None else th.embed_image
            with record_function("session.vision"):
                images = [embed_image(processed)] if processed is not None else []
        closing = self.prompts.duplex_unit_end(self.open_unit.terminator) if self.open_unit is not None \
            else PromptPiece(())
        unit = self.prompts.duplex_unit([processed] if processed is not None else [],
                                        audio_embeds=int(audio.embeds.shape[0]))
        piece = closing + unit
        start = self.llm_cache.length
        if start + len(piece) > self.llm_cache.capacity and self.llm_cache.capacity < self.max_positions:
            raise ContextLimitError(
                f"commit {self.committed_chunks}: the context would reach {start + len(piece)} rows, past the static "
                f"LLM cache's {self.llm_cache.capacity} (pruning {'suspended' if self._suspended else 'active'}); "
                "pass a larger static_capacity")
        if start + len(piece) > self.max_positions:
            raise ContextLimitError(
                f"commit {self.committed_chunks}: the context would reach {start + len(piece)} positions, past the "
                f"model's {self.max_positions} (window {self.window.name!r}, pruning "
                f"{'suspended' if self._suspended else 'active'}); use a bounded WindowPolicy or shorter sessions")
        with record_function("session.llm_feed"):
            embeds = self.thinker.fill_slots(piece, images, audio.embeds)
        return embeds, audio, closing, unit

    def _enforce_window(self) -> None:
        w = self.window
        before = self.llm_cache.length
        if self._suspended or not w.enabled or before <= w.high_tokens:
            return
        drop_len, n_units, length = 0, 0, before
        while length > w.low_tokens and n_units < len(self.history):
            unit_len = self.history[n_units].length
            drop_len += unit_len
            length -= unit_len
            n_units += 1
        if not n_units:
            return
        self.llm_cache.drop_rows(self.preserve, drop_len, self.thinker.llm.model.rotary_emb.inv_freq)
        del self.history[:n_units]
        self.position_offset += drop_len
        self.pruning_events.append(PruneEvent(self.committed_chunks, before, drop_len, n_units))
        expected = self.preserve + sum(u.length for u in self.history) + \
            (self.open_unit.length if self.open_unit is not None else 0)
        if expected != self.llm_cache.length:
            raise SnapshotError(f"window: bookkeeping ({expected} rows) disagrees with the cache "
                                f"({self.llm_cache.length} rows) after pruning")


def audio_steps(sessions: "list[StreamingSession]", mels: list) -> list[AudioChunkEmbedding]:
    """Each session's audio-encoder step on its mel chunk (``_audio_step``): sessions that share one
    ``AudioGraphs`` take theirs together (``AudioGraphs.embed_chunks``, a replay per group of equal chunk
    shapes), any other one by one."""
    out: list[AudioChunkEmbedding | None] = [None] * len(sessions)
    shared: dict[int, tuple[AudioGraphs, list[int]]] = {}
    for i, s in enumerate(sessions):
        if isinstance(s.audio_graphs, AudioGraphs):
            shared.setdefault(id(s.audio_graphs), (s.audio_graphs, []))[1].append(i)
    for graphs, idx in shared.values():
        if len(idx) > 1:
            with record_function("session.audio_encoder_many"):
                got = graphs.embed_chunks([mels[i].features for i in idx], [sessions[i].audio_cache for i in idx],
                                          [mels[i].prefix_extra for i in idx], [mels[i].suffix_extra for i in idx])
            for i, a in zip(idx, got):
                out[i] = a
    return [a if a is not None else s._audio_step(m) for a, s, m in zip(out, sessions, mels)]


def commit_many(sessions: "list[StreamingSession]", inputs, rows, batched_audio: bool = True,
                batched_mel: bool = False) -> None:
    """``sessions[i].commit(audio, frame, sample_rate=sr)`` for each ``inputs[i] = (audio, frame, sr)``, the
    sessions on rows of one ``StaticRows`` (``rows``, their ``llm_pool``): each prepares its unit as ``commit``
    does (mel, audio encoder, frame, prompt rows; with ``batched_mel`` the mels in one batch on a CUDA device,
    ``mel.process_many``, opt-in: on the H200 it took a 16-conversation second's mel from 10.1 to 4.1 ms, but
    the second's gain stays inside its run-to-run spread, duplex_mel_batch_session51_h200.md; with
    ``batched_audio`` the audio steps of sessions sharing one ``AudioGraphs`` run together, ``audio_steps``),
    then their LLM prefills run together, one forward per run of consecutive rows (``StaticRows.feed_many``),
    then each keeps its books. A failure anywhere puts
    every session back as it was, as ``commit`` does for one (but for one whose window pruned units in this
    call, which no snapshot can undo)."""
    for s in sessions:
        if s._tail_appended:
            raise InputError("commit: a tail was appended in this transaction; leave the transaction (restore) "
                             "before committing")
    units = [s._unit_input(audio, frame, True, "commit", sr) for s, (audio, frame, sr) in zip(sessions, inputs)]
    before = [(s.snapshot(), len(s.pruning_events)) for s in sessions]
    try:
        with record_function("session.mel"):       # opt-in: one batch on a CUDA device (mel.process_many)
            mels = process_many([s.mel for s in sessions], [chunk for chunk, _, _ in units],
                                batched=None if batched_mel else False)
        audio = audio_steps(sessions, mels) if batched_audio else [s._audio_step(m) for s, m in zip(sessions, mels)]
        prepared = [s._unit_rows(a, processed) for s, a, (_, _, processed) in zip(sessions, audio, units)]
        with record_function("session.llm_feed_many"):
            steps = rows.feed_many([s.llm_cache for s in sessions], [p[0] for p in prepared])
        for s, (_, rest, _), (_, audio, closing, unit), step in zip(sessions, units, prepared, steps):
            s._apply_unit(step, audio, closing, unit, rest, last_chunk=False)
    except BaseException:
        for s, (snap, events) in zip(sessions, before):
            if len(s.pruning_events) == events:
                s.restore(snap)
        raise
