"""Code2Wav: 25 Hz codec ids -> 24 kHz float32 PCM, whole-utterance or streamed.

    c2w = Code2Wav.from_snapshot("/path/to/MiniCPM-o-4_5")       # assets/token2wav/*
    wav = c2w.synthesize(codes, voice="ref.wav")                  # [N * 960] float32
    stream = c2w.open_stream(voice="ref.wav")
    for payload, last in chunks:                                   # 3 context + 25 new codes
        pcm = stream.push(payload, last)
    pcms = c2w.push_many([(s1, p1, False), (s2, p2, False)])      # one flow solve for both

``push_many`` runs streams whose caches and payloads have equal shapes (the steady state of
concurrent streams) as one encoder + CFM solve (``Flow.inference_chunk_many``: on the fast path
each stream's estimator cache goes straight into the solver's rows and its trimmed successor
straight out, no stacked copy; on CUDA the encoder half replays from ``encoder_graph.EncoderGraphs``).
The final chunks of streams that end in that round join that solve: their rows are padded to the steady
width and attend their own frames only (``join_finals``, ``Flow.inference_chunks_joined``). It then
vocodes them through
``Vocoder.push_many``: HiFT calls of equal shapes run as one batch (each stream keeping its own
vocoder state and excitation), from CUDA graphs on CUDA (``vocoder_graphs``).

Streaming follows the vLLM-Omni chunk protocol: every payload is 3 left-context codes and a
window of new codes (the first context is 3 x silence 4218). The flow decodes a payload's
context and all but its last 3 codes (lookahead, sent again as the next payload's context);
a final payload is decoded whole. The voice prompt is solved once per voice
(``Flow.setup_cache`` on ``prompt + 3 x 4218``) and that state is shared read-only by every
stream of that voice through ``PromptStateCache``. On CUDA the CFM solver's Whole-Euler graphs (at most
``cfm_max_graphs``) for that voice's chunks are captured when the first stream opens (``precapture``, knob
``cfm_graph_precapture``, default on), so no steady chunk waits for a capture; then throwaway streams of
silence (``warm_up``, 1, 2, 4, 8 and 16 of them in lockstep) capture the encoder's and the stream vocoder's
graphs for that voice's chunk shapes at every batch bucket (their rows pad to ``hift_graph.ROW_BUCKETS``),
so the first stream's chunks replay from its first chunk on, and so do rounds of concurrent streams however
their number wanders. A final chunk of several streams needs a larger CFM arena than a steady one: the
precapture sizes the arena for the final chunks of up to ``GraphConfig.final_batch`` streams, and with graphs
held more rows solve in groups that fit it instead of growing it (which would drop every graph:
``GraphConfig.keep_arena``).

Opt-in slot pool (connector knob ``cfm_slot_pool``: true or a slot count; fused CFM body only): each
stream's estimator cache is copied once into a resident slot of a ``slot_pool.SlotPool`` when the
stream opens; its chunks then solve through ``SlotSolver`` (new K/V written into free frames,
trimming an edit of the frame list), so no estimator cache is stacked, copied into the solver, split
or trimmed per chunk. With ``cfm_row_offset_merge`` (opt-in) pooled streams whose caches differ in
length share one solve (each row at its own noise offset; the encoder halves run once per conformer
cache shape); without it they group by cache length. Pooled final chunks join that solve at their own
widths (``join_finals``; those wider than a steady chunk join each other's), their encoder halves in one
padded call (``Flow.encode_ends``). Streams beyond the slots (or with a prompt longer than a slot) run
the dense path.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from ..checkpoint.snapshot import resolve_snapshot
from ..errors import CheckpointError, InputError
from .encoder import EncoderCache
from .encoder_graph import EncoderGraphs
from .flow import HISTORY_FRAMES, ChunkPart, Flow, FlowCache, load_flow, steady_token_frames
from .frontend import PromptFeatures, VoiceFrontend
from .hift_graph import GraphedHiFT, ShapeGraphs
from .knobs import (Code2WavChoice, cfm_join_starts, graph_budget, graph_precapture, hift_carry, row_offset_merge,
                    slot_pool_slots)
from .prompt_state import PromptLease, PromptStateCache
from .vocoder import CAUSAL, VocoderSet, load_vocoders

SAMPLE_RATE = 24000
CODE_RATE = 25
SAMPLES_PER_CODE = SAMPLE_RATE // CODE_RATE  # 960
N_CODES = 6561
SILENCE_CODE = 4218
REF_TOKENS = 150  # 6.0 s of reference at 25 Hz
CONTEXT = 3
WINDOW = 25  # new codes in a steady payload (1 s)
# A final payload's encoder call pads its codes to a steady payload's (``Flow.encode_ends``): one graph per
# batch bucket for final chunks of any length
FINAL_TOKENS = CONTEXT + WINDOW
# A warm-up stream's chunks: the first (no vocoder cache), a growing flow cache, then the steady
# shape twice (the second replays what the first captured).
WARM_UP_CHUNKS = 4
ASSET_FILES = ("flow.yaml", "flow.pt", "hift.pt", "speech_tokenizer_v2_25hz.onnx", "campplus.onnx")

Voice = Union[str, Path, PromptFeatures]

log = logging.getLogger(__name__)


def check_codes(codes: Sequence[int], where: str = "codes", allow_empty: bool = False) -> torch.Tensor:
    """Codec ids as a [1, n] long tensor; empty lists and ids outside 0..6560 are named errors."""
    try:
        t = torch.as_tensor(list(codes), dtype=torch.long)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InputError(f"{where}: expected a list of integers ({exc})") from None
    if t.ndim != 1:
        raise InputError(f"{where}: expected a flat list of integers, got shape {tuple(t.shape)}")
    if t.numel() == 0 and not allow_empty:
        raise InputError(f"{where}: the code list is empty; pass at least one codec id (0..{N_CODES - 1})")
    bad = ((t < 0) | (t >= N_CODES)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise InputError(f"{where}: code {int(t[i])} at index {i} is outside 0..{N_CODES - 1} "
                         f"({bad.numel()} such codes; 6561 is the Talker's EOS and never reaches Code2Wav)")
    return t[None]


def token2wav_dir(model: Union[str, Path]) -> Path:
    """``assets/token2wav`` of a snapshot (or the directory itself if it holds the assets)."""
    path = Path(model)
    if (path / "flow.yaml").is_file():
        return path
    snap = resolve_snapshot(model)
    asset_dir = snap.path / "assets" / "token2wav"
    if not asset_dir.is_dir():
        raise CheckpointError(f"{snap.path}: no assets/token2wav/ directory; a MiniCPM-o 4.5 snapshot carries the "
                              f"Code2Wav assets there ({', '.join(ASSET_FILES)})")
    missing = [f for f in ASSET_FILES if not (asset_dir / f).is_file()]
    if missing:
        raise CheckpointError(f"{asset_dir}: token2wav asset(s) missing: {', '.join(missing)}")
    return asset_dir


@dataclass(frozen=True)
class PromptState:
    """What every stream of one voice starts from (shared, never mutated)."""

    features: PromptFeatures
    flow_cache: FlowCache


def _batch_key(cache: FlowCache, spk: torch.Tensor) -> tuple:
    """Streams with equal keys can share one flow solve: every cache shape but the batch axis and the
    trimming anchor (prompt frames) agree (their payloads then group by length and final flag, the final
    ones joining a wider solve: ``Code2Wav.join_finals``)."""
    def but(t: torch.Tensor, axis: int) -> tuple:
        return tuple(t.shape[:axis]) + tuple(t.shape[axis + 1:])
    return (cache.prompt_frames, cache.estimator_att.dtype, str(cache.estimator_att.device),
            but(cache.conformer_cnn, 0), but(cache.conformer_att, 1), but(cache.estimator_cnn, 2),
            but(cache.estimator_att, 2), tuple(spk.shape[1:]))


def _join_key(cache: FlowCache, spk: torch.Tensor) -> tuple:
    """``_batch_key`` but for the caches' lengths (the encoder's and the estimator's frames): streams with equal
    keys may share one solve with ``join_starts`` (a stream's first and second chunks among steady ones)."""
    def but(t: torch.Tensor, *axes: int) -> tuple:
        return tuple(n for a, n in enumerate(t.shape) if a not in axes)
    return (cache.prompt_frames, cache.estimator_att.dtype, str(cache.estimator_att.device),
            but(cache.conformer_cnn, 0), but(cache.conformer_att, 1, 3), but(cache.estimator_cnn, 2),
            but(cache.estimator_att, 2, 4), tuple(spk.shape[1:]))


def _encoder_key(enc: EncoderCache, spk: torch.Tensor) -> tuple:
    """Pooled streams run their encoder halves together when these shapes agree."""
    return (tuple(enc.cnn.shape[1:]), tuple(enc.att.shape[:1]) + tuple(enc.att.shape[2:]), tuple(spk.shape[1:]))


@dataclass
class _Round:
    """A chunk round's deferred state changes: ``commits`` run once everything succeeded; ``undo``
    (restores of slots a pooled solve advanced in place) runs, newest first, if anything raised."""
    commits: list = field(default_factory=list)
    undo: list = field(default_factory=list)


@contextlib.contextmanager
def _round():
    r = _Round()
    try:
        yield r
    except BaseException:
        for restore in reversed(r.undo):
            restore()
        raise
    for commit in r.commits:
        commit()


def _join_finals(keys: list, frames: dict, final, rows: dict) -> list[list[int]]:
    """The solves of one cache home's groups (``keys``; ``frames``: each group's width; ``final(key)``; ``rows``:
    each group's item indices): the widest non-final group (with none, the widest final one), the most rows
    first, hosts the final groups no wider than it; the finals wider than it join each other, the widest
    hosting; every other non-final group solves alone. Each solve lists its items' indices, group by group."""
    host = max([k for k in keys if not final(k)] or keys, key=lambda k: (frames[k], len(rows[k])))
    joined = [host] + [k for k in keys if k != host and final(k) and frames[k] <= frames[host]]
    wide = sorted((k for k in keys if final(k) and k not in joined), key=lambda k: -frames[k])
    groups = [joined] + ([wide] if wide else []) + [[k] for k in keys if k not in joined and not final(k)]
    return [[i for k in g for i in rows[k]] for g in groups]


def _setter(obj, name: str, value):
    return lambda: setattr(obj, name, value)


def _readmit(stream: "Code2WavStream", new: FlowCache):
    """Commit of a pooled stream's dense-path chunk: its new encoder cache, and its new estimator cache
    copied into a slot (the old one released first, so a slot is always free)."""
    def commit():
        stream.encoder = new.encoder
        pool = stream.handle.pool
        stream.handle.release()
        stream.handle = pool.admit(new.estimator_cnn, new.estimator_att, new.prompt_frames)
    return commit


class Code2Wav:
    def __init__(self, flow: Flow, vocoders: VocoderSet, frontend: VoiceFrontend, n_timesteps: int = 10,
                 prompt_cache_size: int = 4):
        if n_timesteps < 1:
            raise InputError(f"n_timesteps must be >= 1 (Euler steps of the flow solve), got {n_timesteps}")
        self.flow, self.vocoders, self.frontend = flow, vocoders, frontend
        self.n_timesteps = n_timesteps
        self.prompts: PromptStateCache[PromptState] = PromptStateCache(prompt_cache_size)
        self._features: dict[str, PromptFeatures] = {}
        self.slot_solver = None          # SlotSolver when the opt-in slot pool is on (cfm_slot_pool)
        self.slot_pool_slots = 0
        self.row_offset_merge = False    # pooled streams of different cache lengths in one solve
        # The final chunks of streams ending in a round join the round's wider (steady) solve of streams with
        # the same cache shape, their rows attending their own frames only (Flow.inference_chunks_joined),
        # instead of a solve of their own. False: every payload length and final flag solves apart.
        self.join_finals = True
        # Opt-in (cfm_join_starts): streams' first and second chunks, whose caches are shorter, join the steady
        # solve too, where the solver reads each stream's cache in place (Flow.inference_chunks_joined).
        self.join_starts = False
        self.precapture_pending = False  # cfm_graph_precapture: capture when the first stream opens
        self._logged: set[str] = set()

    @classmethod
    def from_snapshot(cls, model: Union[str, Path], device: str | torch.device = "cpu",
                      n_timesteps: int = 10, prompt_cache_size: int = 4,
                      extra: Mapping[str, Any] | None = None, vocoder_graphs: bool = True) -> "Code2Wav":
        """Load the assets. ``extra`` is the connector mapping of the deploy profile
        (``cfm_fused_body``, ``token2wav_allow_tf32``; ``MINICPMO_CODE2WAV_TF32=off`` wins):
        on CUDA it selects the fast CFM path (code2wav.knobs); elsewhere the reference path
        runs unless ``cfm_fused_body: true`` asks for the fused body explicitly. ``cfm_slot_pool``
        (slots, opt-in) keeps the streams' estimator caches resident (module docstring).
        ``vocoder_graphs``: stream vocoding from CUDA graphs on CUDA (``Vocoder.cuda_graphs``)."""
        asset_dir = token2wav_dir(model)
        c2w = cls(load_flow(asset_dir, device), load_vocoders(asset_dir, device, cuda_graphs=vocoder_graphs),
                  VoiceFrontend(asset_dir), n_timesteps, prompt_cache_size)
        c2w.configure_fast_path(extra)
        return c2w

    def configure_fast_path(self, extra: Mapping[str, Any] | None) -> "Code2WavChoice":
        """Resolve the knobs for this device and install the chosen CFM chunk solver."""
        from .euler_graph import GraphConfig, solver_from_knobs

        # Offsets snap on a grid anchored at the steady cache (prompt + 100 frames): a 6-s
        # reference gives 150 tokens, 300 prompt frames; the flow's trimmed solves anchor it at
        # their own prompt's (anchor_at_trim), so a PromptFeatures of another length runs unmasked too.
        anchor = 2 * int(REF_TOKENS) + 100
        budget = graph_budget(extra)
        # Query buckets: a steady chunk's 50 frames, and a final payload's widest (3 + 25 codes: 56 frames), so
        # that final chunks wider than a steady one (payloads of 23-25 new codes) take 2 keys per batch bucket,
        # which precapture takes, instead of an exact key per width captured mid-serving
        buckets = (self.steady_frames, self.flow.chunk_frames(FINAL_TOKENS, True))
        solver, choice = solver_from_knobs(self.flow.decoder, dict(extra or {}), self.device,
                                           GraphConfig(offset_anchor=anchor, max_graphs=budget,
                                                       anchor_at_trim=True, query_buckets=buckets),
                                           n_timesteps=self.n_timesteps)
        self.choice = choice
        fast = choice.body == "fused" or self.device.type == "cuda"
        self.flow.chunk_solver = solver if fast else None
        graphs = fast and self.device.type == "cuda" and solver.config.enabled
        self.precapture_pending = graphs and budget > 0 and graph_precapture(extra)
        if graphs:
            log.info("Code2Wav CFM: Whole-Euler graphs, at most %d kept (cfm_max_graphs), %s", budget,
                     "precaptured, with the encoder and HiFT graphs, for the first stream's voice "
                     "(cfm_graph_precapture; Code2Wav.prepare does it earlier)" if self.precapture_pending
                     else "each captured at its first solve")
        self.flow.encoder_graphs = EncoderGraphs(self.flow) if graphs else None
        if graphs:
            log.info("Code2Wav encoder half of a chunk from CUDA graphs (a shape captured on its second call, "
                     "at most %d kept)", self.flow.encoder_graphs.max_graphs)
        self._configure_slot_pool(slot_pool_slots(extra), row_offset_merge(extra), choice, solver.config)
        self.join_starts = cfm_join_starts(extra) and choice.body == "fused"
        if self.join_starts:
            log.info("Code2Wav CFM: streams' first and second chunks join the steady solve where caches are read "
                     "in place (cfm_join_starts)")
        stream_voc = self.vocoders.stream
        stream_voc.stream_carry = hift_carry(extra) and stream_voc.variant == CAUSAL
        if stream_voc.stream_carry:
            log.info("Code2Wav vocoder: streams decode new frames only, carrying the convs' context (hift_carry)")
        return choice

    def _configure_slot_pool(self, slots: int, merge: bool, choice: Code2WavChoice, config) -> None:
        """Build the opt-in slot solver (its pool is sized at the first stream, from the voice's prompt)."""
        from .slot_pool import SlotSolver

        self.slot_solver, self.slot_pool_slots, self.row_offset_merge = None, 0, False
        if merge and not slots:
            log.warning("cfm_row_offset_merge ignored: it merges slot-pool solves and cfm_slot_pool is off")
        if not slots:
            return
        if choice.body != "fused":
            log.warning("cfm_slot_pool=%d ignored: the slot pool needs the fused CFM body; the knobs chose the "
                        "original body (%s)", slots, choice.reason)
            return
        self.slot_solver = SlotSolver(self.flow.decoder, pool=None, attention=choice.attention or "sdpa",
                                      tf32=choice.tf32, n_timesteps=self.n_timesteps, config=config,
                                      gemm_operands=choice.gemm_operands)
        self.slot_pool_slots, self.row_offset_merge = slots, merge
        log.info("Code2Wav slot pool: %d resident stream slots (opt-in cfm_slot_pool), row-offset merging %s",
                 slots, "on" if merge else "off")

    def _log_once(self, what: str, msg: str, *args) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(msg, *args)

    @torch.inference_mode()
    def _admit(self, state: PromptState):
        """A slot holding the prompt's estimator cache, or None (pool off or full, prompt too long). In inference
        mode whatever the caller's: the pool may have been made inside it (``warm_up``'s streams), and its
        inference tensors take in-place writes only there."""
        sv = self.slot_solver
        if sv is None:
            return None
        from .slot_pool import SlotPool, default_pool_frames

        cache = state.flow_cache
        if sv.pool is None:   # sized for the steady cache of a 6-s reference or this prompt, if longer
            frames = default_pool_frames(max(cache.prompt_frames, 2 * REF_TOKENS), HISTORY_FRAMES,
                                         max(sv.config.query_buckets))
            sv.pool = SlotPool(sv, self.slot_pool_slots, frames, keep=HISTORY_FRAMES, device=self.device)
        pool = sv.pool
        need = cache.prompt_frames + HISTORY_FRAMES + max(sv.config.query_buckets)
        if need > pool.frames:
            self._log_once(f"long{cache.prompt_frames}", "voice prompt of %d frames needs %d-frame slots, the "
                           "pool has %d: its streams run the dense path", cache.prompt_frames, need, pool.frames)
            return None
        if not pool.free_slots:
            self._log_once("full", "slot pool full (%d slots): further streams run the dense path until one "
                           "closes", pool.slots)
            return None
        return pool.admit(cache.estimator_cnn, cache.estimator_att, cache.prompt_frames)

    @property
    def device(self) -> torch.device:
        return self.flow.input_embedding.weight.device

    # ---- voice prompt -------------------------------------------------------------------------
    def features(self, voice: Voice) -> PromptFeatures:
        if isinstance(voice, PromptFeatures):
            return voice
        key = str(Path(voice).resolve())
        if key not in self._features:
            self._features[key] = self.frontend(voice)
        return self._features[key]

    def _solve(self, feats: PromptFeatures) -> PromptState:
        dev = self.device
        lookahead = torch.full((1, CONTEXT), SILENCE_CODE, dtype=torch.long)
        token = torch.cat([feats.tokens.long(), lookahead], 1).to(dev)
        cache = self.flow.setup_cache(token, feats.mel.to(dev), feats.spk_embedding.to(dev), self.n_timesteps)
        return PromptState(feats, cache)

    def lease_prompt(self, voice: Voice) -> PromptLease[PromptState]:
        feats = self.features(voice)
        return self.prompts.acquire(("voice", feats.key, self.n_timesteps), lambda: self._solve(feats))

    # ---- whole utterance ----------------------------------------------------------------------
    @torch.inference_mode()
    def synthesize(self, codes: Sequence[int], voice: Voice) -> np.ndarray:
        """All codes at once -> [len(codes) * 960] float32 at 24 kHz (original HiFT)."""
        token = check_codes(codes).to(self.device)
        feats = self.features(voice)
        dev = self.device
        mel = self.flow.inference(token, feats.tokens.long().to(dev), feats.mel.to(dev),
                                  feats.spk_embedding.to(dev), self.n_timesteps)
        return self.vocoders.whole.vocode(mel)[0].cpu().numpy().astype(np.float32)

    # ---- streaming ----------------------------------------------------------------------------
    def open_stream(self, voice: Voice) -> "Code2WavStream":
        if self.precapture_pending:
            self.prepare(voice)
        return Code2WavStream(self, self.lease_prompt(voice))

    def prepare(self, voice: Voice, batches: Sequence[int] | None = None) -> dict[str, int]:
        """Capture, before any stream needs them, the graphs a stream of ``voice`` replays: the CFM solver's
        (``precapture``), then the encoder's and the stream vocoder's (``warm_up``, at ``batches`` concurrent
        streams: default every batch bucket of the CFM solver, which ``push_many``'s rounds pad to), as
        upstream's precapture does. ``open_stream`` runs this for the first stream's voice when
        ``cfm_graph_precapture`` is on (the default, CUDA only); a server that knows its voice calls it at
        start-up instead, so that no request waits for it (about 4.2-5.5 s on the H200 with the default budget,
        about 35 s while Triton first compiles the kernels; ``benchmarks/precapture_probe.py``,
        ``benchmarks/triton_compile_census.py``). Returns the graphs each set holds ({} off CUDA)."""
        self.precapture_pending = False
        with self.lease_prompt(voice) as state:
            n = self.precapture(state.flow_cache.prompt_frames)
        if not self.stream_graph_sets():
            return {"CFM": n} if n else {}
        return {"CFM": n, **self.warm_up(voice, batches=self.warm_up_batches() if batches is None else batches)}

    def warm_up_batches(self) -> tuple[int, ...]:
        """The concurrent streams ``prepare``'s warm-up runs at: the CFM solver's batch buckets."""
        solver = self.flow.chunk_solver
        config = getattr(solver, "config", None)
        return tuple(config.batch_buckets) if config is not None else (1,)

    def stream_graph_sets(self) -> dict[str, ShapeGraphs]:
        """The per-shape graph sets a stream's chunks replay besides the CFM solver's (``ShapeGraphs`` by name:
        the encoder half, the stream vocoder's stages); empty off CUDA or with those graphs off."""
        sets = {}
        if self.flow.encoder_graphs is not None:
            sets["encoder"] = self.flow.encoder_graphs.shapes
            sets["encoder (final chunks)"] = self.flow.encoder_graphs.ended
            if self.join_starts:    # streams of several cache lengths in one call (captured as they come)
                sets["encoder (padded)"] = self.flow.encoder_graphs.padded
        runner = self.vocoders.stream.runner
        if isinstance(runner, GraphedHiFT):
            sets.update({f"HiFT {name}": g for name, g in runner.shape_sets().items()})
        return sets

    @torch.inference_mode()
    def warm_up(self, voice: Voice, chunks: int = WARM_UP_CHUNKS, batches: Sequence[int] = (1,)) -> dict[str, int]:
        """Push ``chunks`` payloads of silence codes, then an empty final one, through throwaway streams of
        ``voice`` with every graph set of ``stream_graph_sets`` capturing a shape at its first call, so a real
        stream's chunks (first, growing and steady) and its vocoder's final call replay instead of running
        eagerly or capturing. For each ``b`` in ``batches``, ``b`` streams
        run in lockstep through ``push_many`` (one stream: ``push``), so rounds of ``b`` concurrent streams, and
        those the graph sets pad to ``b`` rows, replay too. With ``join_starts`` one more round at each ``b`` from
        2 has a fresh stream among the steady ones (the encoder call of several cache lengths). The final chunks'
        encoder call (``Flow.encode_ends``: one shape for final payloads of any length) runs at each ``b`` too.
        Upstream's
        precapture takes the HiFT and flow-encoder graphs as well. Returns the graphs each set then holds ({}
        where there are none).

        The streams leave no trace: their prompt leases and slots (if any) are released, the graphs' capture
        thresholds and the RNG state (the original HiFT's excitation draws from it) are restored. Running out
        of device memory at some batch stops the warm-up there (logged); what it captured stays."""
        if chunks < 1:
            raise ValueError(f"Code2Wav.warm_up: chunks must be >= 1, got {chunks}")
        batches = tuple(batches)
        if not batches or any(int(b) != b or b < 1 for b in batches):
            raise ValueError(f"Code2Wav.warm_up: batches must be stream counts >= 1, got {batches}")
        sets = self.stream_graph_sets()
        t0 = time.perf_counter()
        rng_devices = [self.device] if self.device.type == "cuda" else []
        payload = [SILENCE_CODE] * (CONTEXT + WINDOW)
        with contextlib.ExitStack() as stack:
            for g in sets.values():
                stack.enter_context(g.capturing_at_once())
            stack.enter_context(torch.random.fork_rng(devices=rng_devices))
            for b in batches:
                streams: list[Code2WavStream] = []
                try:
                    streams += [Code2WavStream(self, self.lease_prompt(voice)) for _ in range(b)]
                    for _ in range(chunks):
                        if b == 1:
                            streams[0].push(payload)
                        else:
                            self.push_many([(s, payload, False) for s in streams])
                    if self.join_starts and b > 1:
                        # a fresh stream among steady ones: the round a stream's first chunk joins (the encoder's
                        # padded graph at this bucket; the CFM's rows key is precaptured). It leaves unfinished.
                        streams[-1].close()
                        streams[-1] = Code2WavStream(self, self.lease_prompt(voice))
                        self.push_many([(s, payload, False) for s in streams])
                        streams.pop().close()
                    self._warm_final_encoder(streams)
                    self._precapture_pooled_wide(streams)
                    # an empty final payload: the vocoder's final call alone, whose lengths (the steady
                    # history plus the look-ahead frames) are those of every stream that ends after a steady chunk
                    if len(streams) == 1:
                        streams[0].push([], last=True)
                    else:
                        self.push_many([(s, [], True) for s in streams])
                except torch.cuda.OutOfMemoryError as exc:
                    # a small GPU: what is captured stays, larger rounds capture when they come (or run eagerly)
                    log.warning("Code2Wav warm-up: %d concurrent streams ran out of device memory (%s); not warming "
                                "%s or more", b, str(exc).splitlines()[0] if str(exc) else "OOM", b)
                    break
                finally:
                    for s in streams:
                        s.close()
        held = {name: len(g.graphs) for name, g in sets.items()}
        if held:
            log.info("Code2Wav: warm-up streams (%d chunks at %s concurrent) in %.2f s; graphs held: %s", chunks,
                     "/".join(map(str, batches)), time.perf_counter() - t0,
                     ", ".join(f"{k} {v}" for k, v in held.items()))
        return held

    def _warm_final_encoder(self, streams: Sequence["Code2WavStream"]) -> None:
        """The final chunks' encoder call (``Flow.encode_ends``, every final payload padded to FINAL_TOKENS codes
        and every cache to the steady length) at these streams' bucket, as a round of final chunks makes it
        (dense and pooled streams alike); the streams' state is not touched."""
        if self.flow.encoder_graphs is None:
            return
        token = torch.full((len(streams), CONTEXT + 1), SILENCE_CODE, dtype=torch.long)
        self.flow.encode_ends([token], torch.cat([s.spk for s in streams]),
                              [s.cache.encoder if s.handle is None else s.encoder for s in streams],
                              FINAL_TOKENS, steady_token_frames(max(s.prompt_frames for s in streams)))

    def _precapture_pooled_wide(self, streams: Sequence["Code2WavStream"]) -> None:
        """The slot solver's graph for pooled final chunks wider than a steady one (the widest query bucket:
        payloads of 23-25 new codes, which solve together) at these streams' batch bucket, up to
        ``GraphConfig.final_batch`` streams, so that they replay instead of capturing mid-serving."""
        sv = streams[0].slot_solver
        if sv is None or any(s.slot_solver is not sv for s in streams) or len(streams) > sv.config.final_batch:
            return
        wide = max(sv.config.query_buckets)
        key = sv.key_for(len(streams), wide) if wide > self.steady_frames else None
        if key is not None:
            sv.precapture_key(key, self.device)

    def precapture(self, prompt_frames: int) -> int:
        """Capture the CFM solver's Whole-Euler graphs for the streaming chunks of a voice whose prompt holds
        ``prompt_frames`` mel frames: the full query width over each cache length a stream passes through
        (prompt, prompt + one chunk, ... up to the trimmed steady length prompt + ``HISTORY_FRAMES``), at
        every batch bucket, the flow's trim included, and a final (narrower) chunk over each of them at the
        batches whose arena fits or ``GraphConfig.final_batch`` covers (``WholeEulerSolver.precapture_keys``),
        until the graph budget is spent.
        Returns the graphs held (0 off CUDA or without graphs). The keys are shapes only: every voice with
        this prompt length (all of them: ``frontend`` makes every reference 6 s) replays these graphs."""
        solver = self.flow.chunk_solver
        if solver is None or self.device.type != "cuda" or not solver.config.enabled:
            return 0
        plan = self.precapture_plan(prompt_frames)
        t0 = time.perf_counter()
        n = solver.precapture(**plan, device=self.device)
        log.info("Code2Wav CFM: %d Whole-Euler graph(s) held after precapture (cache lengths %s, batches %s) in "
                 "%.1f s", n, plan["offsets"], list(plan["batches"]), time.perf_counter() - t0)
        return n

    @property
    def steady_frames(self) -> int:
        """Mel frames a steady chunk decodes (3 context + 25 new codes, the last 3 look-ahead: 50)."""
        return self.flow.chunk_frames(CONTEXT + WINDOW, False)

    def precapture_plan(self, prompt_frames: int) -> dict:
        """``precapture``'s arguments for the CFM solver (``WholeEulerSolver.precapture``/``precapture_keys``): a
        steady chunk's width over each cache length a stream passes through, the final chunks' keys, and those of
        final chunks wider than a steady one (``wide``: the widest query bucket, where it is wider)."""
        config = self.flow.chunk_solver.config
        q = self.steady_frames
        offsets = list(range(prompt_frames, prompt_frames + HISTORY_FRAMES, q)) + [prompt_frames + HISTORY_FRAMES]
        wide = max(config.query_buckets)
        return dict(batches=config.batch_buckets, query=q, offsets=offsets, trim=(prompt_frames, HISTORY_FRAMES),
                    final=True, row_lengths=self.join_starts, wide=wide if wide > q else None)

    @torch.inference_mode()
    def push_many(self, items: Sequence[tuple["Code2WavStream", Sequence[int], bool]],
                  max_batch: int | None = None, batch_vocoding: bool = True) -> list[np.ndarray]:
        """Push one payload into each of several streams -> their new PCM, in order.

        Streams whose caches have the same shapes (the steady state of concurrent streams)
        and whose payloads have the same length and final flag run ONE flow solve together
        (at most ``max_batch`` rows each). With ``join_finals``, final chunks of streams with those cache
        shapes join that solve when they are no wider (each non-final payload shape keeps its own encoder call;
        the final ones share one, ``Flow.encode_ends``); the rest run alone as ``push``. Vocoding goes through
        ``Vocoder.push_many``: HiFT calls of equal shapes run batched (at most ``max_batch``
        rows), each stream keeping its own vocoder state; ``batch_vocoding=False`` runs every
        HiFT call alone (the per-stream path, for comparison). Same result as pushing each
        stream alone (row-independent math; the noise offset is the shared cache length).
        A failed call leaves every stream as it was: flow caches advance only after all solves
        and the vocoding succeeded, and the vocoder states are restored on failure.
        """
        streams = [it[0] for it in items]
        if len({id(s) for s in streams}) != len(streams):
            raise InputError("push_many: a stream appears more than once; push its payloads in separate calls")
        for s in streams:
            if s.owner is not self:
                raise InputError("push_many: a stream belongs to another Code2Wav; push it through its own owner")
        tokens = [s._check(payload, bool(last)) for s, payload, last in items]
        groups: dict[tuple, list[int]] = {}
        dense: dict[tuple, dict[tuple[int, bool], list[int]]] = {}
        for i, ((s, _, last), tok) in enumerate(zip(items, tokens)):
            if tok.shape[1]:
                # pooled streams of one payload length share a CFM solve; across cache lengths and prompts
                # only with row-offset merging. Their encoder halves group by cache shape inside it.
                if s.handle is None:    # by cache shape, or with join_starts by all of it but the lengths
                    shape = _batch_key(s.cache, s.spk)
                    dense.setdefault(_join_key(s.cache, s.spk) if self.join_starts else shape, {}).setdefault(
                        (tok.shape[1], bool(last), shape), []).append(i)
                else:   # streams admitted before a reconfiguration keep their own (older) slot solver
                    key = ("pooled", id(s.slot_solver), tok.shape[1], bool(last)) + (
                        () if self.row_offset_merge else (s.handle.length, s.prompt_frames))
                    groups.setdefault(key, []).append(i)
        mels: list[torch.Tensor | None] = [None] * len(items)
        cap = max_batch or len(items)
        # Caches advance only once every solve and the vocoding succeeded.
        with _round() as rnd:
            for shapes in dense.values():
                for members in self._dense_solves(shapes):
                    for k in range(0, len(members), cap):
                        self._solve_dense(members[k:k + cap], items, tokens, mels, rnd)
            for members in self._pooled_solves(groups):
                pooled_cap = min(cap, max(streams[members[0]].slot_solver.config.batch_buckets))
                for k in range(0, len(members), pooled_cap):
                    rows = members[k:k + pooled_cap]
                    got = self._solve_pooled([streams[i] for i in rows], [tokens[i] for i in rows],
                                             [bool(items[i][2]) for i in rows], rnd)
                    for i, mel in zip(rows, got):
                        mels[i] = mel
            empty = torch.zeros(1, 80, 0, device=self.device)
            voc_items = [(s.vocoder, empty if mel is None else mel, bool(last))
                         for (s, _, last), mel in zip(items, mels)]
            wavs = self.vocoders.stream.push_many(voc_items, max_batch=max_batch if batch_vocoding else 1)
        out = []
        for (s, _, last), wav in zip(items, wavs):
            if last:
                s.close()
            out.append(wav[0].cpu().numpy().astype(np.float32))
        return out

    def _dense_solves(self, shapes: dict[tuple, list[int]]) -> list[list[int]]:
        """The solves of dense streams whose caches agree (with ``join_starts``: but for their lengths), grouped
        by (payload length, final, cache shape): each group its own solve, except that with ``join_finals`` (and
        a solver that takes rows of their own widths) the final groups of a cache shape no wider than its
        widest non-final one (or, with none, than its widest final one) join its solve, and those wider than it
        (payloads of more new codes than a steady one's) join each other. With ``join_starts``
        the host is the widest non-final group of any cache shape (the most rows first: the steady streams),
        and the non-final groups of its width and the final groups no wider join it (the flow solves each
        cache length apart where it cannot read them together). Each solve lists its items' indices, group by
        group."""
        keys = list(shapes)
        frames = {k: self.flow.chunk_frames(k[0], k[1]) for k in keys}
        if len(keys) < 2 or not self.join_finals or not self.flow.joins_widths(self.n_timesteps):
            return [shapes[k] for k in keys]
        def widest(ks):     # the widest non-final group (or, with none, final one), the most rows first
            return max([k for k in ks if not k[1]] or ks, key=lambda k: (frames[k], len(shapes[k])))

        solves, rest = [], keys
        if self.join_starts:
            host = widest(keys)
            joined = [host] + [k for k in keys if k != host and (frames[k] == frames[host] if not k[1]
                                                               else frames[k] <= frames[host])]
            solves.append([i for k in joined for i in shapes[k]])
            rest = [k for k in keys if k not in joined]
        for shape in dict.fromkeys(k[2] for k in rest):     # each cache shape: its finals join its widest
            own = [k for k in rest if k[2] == shape]
            solves += _join_finals(own, frames, lambda k: k[1], shapes)
        return solves

    def _solve_dense(self, rows: Sequence[int], items, tokens: Sequence[torch.Tensor],
                     mels: list, rnd: _Round) -> None:
        """One flow solve over dense streams ``rows`` (indices into ``items``; the rows of one payload shape
        form a part): their mels into ``mels``, their new caches into ``rnd.commits``."""
        streams = [items[i][0] for i in rows]
        by_shape: dict[tuple, list[int]] = {}     # (payload length, final, cache shape) -> its rows
        for i in rows:
            by_shape.setdefault((tokens[i].shape[1], bool(items[i][2]), _batch_key(items[i][0].cache,
                                                                                    items[i][0].spk)), []).append(i)
        parts = [(idx, key[1]) for key, idx in by_shape.items()]
        if len(parts) == 1 and not parts[0][1]:
            token = torch.cat([tokens[i] for i in rows], 0)     # host codes: the flow uploads them without a sync
            spk = torch.cat([s.spk for s in streams], 0)
            mel, news = self.flow.inference_chunk_many(token, spk, [s.cache for s in streams],
                                                       last_chunk=parts[0][1], n_timesteps=self.n_timesteps)
            results = [(mel, news)]
        else:
            results = self.flow.inference_chunks_joined(
                [ChunkPart(torch.cat([tokens[i] for i in idx], 0),
                           torch.cat([items[i][0].spk for i in idx], 0), [items[i][0].cache for i in idx], last)
                 for idx, last in parts], n_timesteps=self.n_timesteps, final_tokens=FINAL_TOKENS)
        for (idx, last), (mel, news) in zip(parts, results):
            for r, i in enumerate(idx):
                mels[i] = mel[r:r + 1]
                if news is not None:    # a final chunk's stream closes: its cache is not needed
                    rnd.commits.append(_setter(items[i][0], "cache", news[r]))

    def _pooled_solves(self, groups: dict[tuple, list[int]]) -> list[list[int]]:
        """The slot solves of pooled streams, from their groups keyed ("pooled", solver, payload length, final,
        [cache length, prompt]): each group its own solve, except that with ``join_finals`` the final groups of
        a solver (and, without row-offset merging, of a cache length) join as the dense path's do
        (``_join_finals``; the slot solver takes rows of their own widths)."""
        if not self.join_finals:
            return list(groups.values())
        frames = {k: self.flow.chunk_frames(k[2], k[3]) for k in groups}
        homes: dict[tuple, list[tuple]] = {}
        for k in groups:
            homes.setdefault((k[1],) + k[4:], []).append(k)
        return [rows for keys in homes.values() for rows in _join_finals(keys, frames, lambda k: k[3], groups)]

    def _solve_pooled(self, streams: Sequence["Code2WavStream"], tokens: Sequence[torch.Tensor],
                      lasts: Sequence[bool], rnd: _Round) -> list[torch.Tensor]:
        """One chunk of pooled streams -> each stream's mel (1, 80, its frames), their new state added to
        ``rnd.commits``: the encoder halves grouped by cache shape (the final chunks' all in one call, padded:
        ``Flow.encode_ends``), then ONE slot solve over every stream at its own cache length, final chunks
        narrower than the rest at their own widths. The solve advances the slots in place (frame lists, CNN
        cache rows), so their old state is saved first and ``rnd.undo`` gets its restore. A chunk wider than
        the slot solver's query buckets runs the dense path from each slot's dense copy and re-admits the new
        cache on commit."""
        sv, flow = streams[0].slot_solver, self.flow
        pool = sv.pool
        B = len(streams)
        frames = [flow.chunk_frames(t.shape[1], last) for t, last in zip(tokens, lasts)]
        T = max(frames)
        if any(f < T and not last for f, last in zip(frames, lasts)):
            # _pooled_solves never groups non-final chunks of different widths: a caller broke that rule
            raise RuntimeError(f"pooled solve of widths {frames}: only a stream's final chunk may be narrower than "
                               "the others (its slot's CNN history would be wrong)")
        if sv.key_for(B, T) is None:
            mels = []
            for s, tok, last in zip(streams, tokens, lasts):
                cnn, att = s.handle.dense()
                mel, new = flow.inference_chunk(tok, s.spk,
                                                FlowCache(s.encoder.cnn, s.encoder.att, cnn, att, s.prompt_frames),
                                                last_chunk=last, n_timesteps=self.n_timesteps)
                mels.append(mel)
                rnd.commits.append(_setter(s, "encoder", new.encoder) if last else _readmit(s, new))
            return mels
        mu, spk, encs = [None] * B, [None] * B, [None] * B
        groups: dict[tuple, list[int]] = {}
        for r, s in enumerate(streams):
            if not lasts[r]:
                groups.setdefault(_encoder_key(s.encoder, s.spk), []).append(r)
        for rows in groups.values():
            h, sp, new = flow.encode_streams(torch.cat([tokens[r] for r in rows], 0),
                                             torch.cat([streams[r].spk for r in rows], 0),
                                             [streams[r].encoder for r in rows], False,
                                             [streams[r].prompt_frames for r in rows])
            for j, (r, e) in enumerate(zip(rows, new)):
                mu[r], spk[r], encs[r] = h[j:j + 1], sp[j:j + 1], e
        ends = [r for r in range(B) if lasts[r]]
        if ends:    # streams that end: one encoder call for all, padded to the graph the warm-up captured
            steady = steady_token_frames(max(streams[r].prompt_frames for r in ends))
            hs, sp = flow.encode_ends([tokens[r] for r in ends], torch.cat([streams[r].spk for r in ends], 0),
                                      [streams[r].encoder for r in ends], FINAL_TOKENS, steady)
            for j, (r, h) in enumerate(zip(ends, hs)):
                mu[r], spk[r] = h, sp[j:j + 1]
        handles = [s.handle for s in streams]
        saved = [(h, h.frames, h._arr, h._arr_of) for h in handles]
        idx = flow.to_device(torch.tensor([r for h in handles for r in pool.rows(h.slot)]))
        cnn = pool.cnn.index_select(2, idx)

        def restore():
            for h, frames_, arr, of in saved:
                h.frames, h._arr, h._arr_of = frames_, arr, of
            pool.cnn.index_copy_(2, idx, cnn)

        rnd.undo.append(restore)
        mu = torch.cat([F.pad(m, (0, T - f)) for m, f in zip(mu, frames)], 0)
        mel = sv.solve_slots(handles, mu, torch.cat(spk, 0), torch.zeros_like(mu),
                             widths=frames if min(frames) < T else None)
        rnd.commits += [_setter(s, "encoder", e) for s, e in zip(streams, encs) if e is not None]
        return [mel[r:r + 1] if f == T else mel[r:r + 1, :, :f].contiguous() for r, f in enumerate(frames)]

    def stream_codes(self, codes: Sequence[int], voice: Voice, window: int = 25,
                     first_window: int | None = None,
                     progress: Callable[[int], None] | None = None) -> np.ndarray:
        """Stream ``codes`` through the 3 + window protocol and return the audio for the codes
        alone ([len(codes) * 960] samples): the decoded leading silence context is cut.
        ``progress(n)``: after each payload, the codes decoded so far."""
        check_codes(codes)
        codes = list(codes)
        stream = self.open_stream(voice)
        out, context, i, w = [], [SILENCE_CODE] * CONTEXT, 0, first_window or window
        while True:
            new = codes[i:i + w]
            i += len(new)
            last = i >= len(codes)
            payload = context + new
            out.append(stream.push(payload, last))
            if progress is not None:
                progress(i)
            if last:
                break
            context = payload[-CONTEXT:]
            w = window
        stream.close()
        wav = np.concatenate(out)
        start = stream.lead_samples + CONTEXT * SAMPLES_PER_CODE
        return wav[start:start + len(codes) * SAMPLES_PER_CODE]


class Code2WavStream:
    """One request's stream: flow cache (starting from the shared prompt state) + vocoder state."""

    def __init__(self, owner: Code2Wav, lease: PromptLease[PromptState]):
        self.owner, self.lease = owner, lease
        self.prompt_frames = lease.state.flow_cache.prompt_frames
        # opt-in slot pool: the estimator cache lives in a slot (the flow cache is then the encoder's only)
        self.handle = owner._admit(lease.state)
        self.slot_solver = owner.slot_solver if self.handle is not None else None
        self.cache = lease.state.flow_cache if self.handle is None else None
        self.encoder = lease.state.flow_cache.encoder if self.handle is not None else None
        self.spk = lease.state.features.spk_embedding.to(owner.device)
        self.vocoder = owner.vocoders.stream.open_stream()
        # Samples of vocoder-inserted leading silence (the causal HiFT's 8-frame alignment pad).
        self.lead_samples = 8 * 480 if getattr(self.vocoder, "lead_silence", False) else 0
        self.finished = False

    @torch.inference_mode()
    def push(self, payload: Sequence[int], last: bool = False) -> np.ndarray:
        """3 context codes + new codes (fewer allowed for the final payload) -> new PCM samples."""
        token = self._check(payload, last)
        if not token.shape[1]:
            return self._vocode(torch.zeros(1, 80, 0, device=self.owner.device), last)
        if self.handle is None and last:   # the stream ends: its final chunk's encoder call pads (encode_ends)
            (mel, _), = self.owner.flow.inference_chunks_joined([ChunkPart(token, self.spk, [self.cache], True)],
                                                                self.owner.n_timesteps, FINAL_TOKENS)
            return self._vocode(mel, last)
        if self.handle is None:
            mel, self.cache = self.owner.flow.inference_chunk(token, self.spk, self.cache,
                                                              last_chunk=last, n_timesteps=self.owner.n_timesteps)
            return self._vocode(mel, last)
        with _round() as rnd:
            (mel,) = self.owner._solve_pooled([self], [token], [last], rnd)
            wav = self.vocoder.push(mel, last)
        if last:
            self.close()
        return wav[0].cpu().numpy().astype(np.float32)

    def _check(self, payload: Sequence[int], last: bool) -> torch.Tensor:
        if self.finished:
            raise InputError("Code2Wav stream: push after the final payload; open a new stream")
        token = check_codes(payload, "codec payload", allow_empty=last)
        if not last and token.shape[1] <= self.owner.flow.pre_lookahead_len:
            raise InputError(f"codec payload: {token.shape[1]} codes; a non-final payload needs new codes plus "
                             f"{self.owner.flow.pre_lookahead_len} lookahead")
        return token

    def _vocode(self, mel: torch.Tensor, last: bool) -> np.ndarray:
        wav = self.vocoder.push(mel, last)
        if last:
            self.close()
        return wav[0].cpu().numpy().astype(np.float32)

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            if self.handle is not None:
                self.handle.release()
            self.lease.release()
