"""The duplex Talker: codec ids one unit at a time, the TTS KV cache living through a turn.

Upstream's ``MiniCPMTTS.generate_chunk`` as driven by ``DuplexCapability.streaming_generate``
(official MiniCPM-o 4.5 code; re-implemented here). Per unit the condition is the unit's
Talker tokens, ``emb_text(id) + L2norm(projector_semantic(hidden))`` per token (normalised
whatever the config says), then ``emb_text(audio_bos)``; a unit without tokens is the audio-bos
row alone. It is fed at positions ``text_start_pos ..`` on top of the turn's cache, and codes
are drawn one per step, each fed back before the next draw:

- at most ``max_new_codes`` (26) draws; the last draw (EOS, or the 26th code) is never fed or
  returned, so a full unit yields 25 codes, one second of audio;
- EOS (``num_audio_tokens - 1``) is masked for the first ``min_new_codes`` draws: 26 (never stop)
  except on the turn's first unit and on the unit that ends the turn (0);
- logits / temperature (0.8), then from the second draw on the repetition penalty (1.05) over the
  codes already drawn in this unit (at most the last 16): ``alpha = penalty ** count``, negative
  logits times alpha, others divided; no top-k/top-p; then a categorical draw.

After a unit ``text_start_pos`` grows by the condition and the returned codes (exactly the rows
in the cache); the unit that ends the turn resets the cache and the position to 0.

``TalkerTurn`` is the plain reference: one conversation on transformers' ``LlamaModel`` and a
DynamicCache. ``TalkerTurns`` is the fast path, for one conversation or several: one static KV cache
(the Talker engine's model math) with a row (seat) per conversation. Every unit's condition of a call
is prefilled in one forward (rows right-padded), then each draw is one batched forward for every seat,
replayed from a CUDA graph on CUDA; a seat with nothing to draw (and padding) feeds a dummy row at the
cache's last position, which no real position attends (a position attends the rows at or before it, so
rows left by an earlier turn are never seen either). Attention reads only the cache's first ``kv_len``
positions, the smallest power-of-two bucket (from 256) holding every live one, with one graph per
bucket, so a turn of a few hundred positions does not read the whole cache. On CUDA the draw's forward runs
through the Talker engine's fused kernels instead (``kernels="triton"``), which read each seat's position on
the device: one graph for every position, and an idle seat reads one row. The draw and the unit's books
(which units go on, the codes kept, what the next step feeds where) stay on the device too, one more graph
(``TalkerTurns._draw``): the host launches a unit's draws and steps without waiting and reads the codes once
at the end, or every four draws while a unit may stop (at one seat on the H200 the per-draw reads, ~40 eager
launches and the small uploads of the host-side loop made a 78-ms unit of 20 ms of GPU work). The units'
conditions prefill from graphs too, one per (rows padded to a power of two, attention bucket). Draws use
``sampler.uniform`` (counter-based: seed, draw index, code id), and each seat keeps its own seed and draw
counter, so a conversation draws what it would draw alone, whatever else runs in the process (up to the
batched forward's rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..sdpa_backend import no_cudnn_sdpa
from ..thinker.staging import upload_ints
from .engine import TalkerEngine, kv_bytes_per_token
from .model import MiniCPMTTS
from .sampler import MASK32, penalize, uniform

# default cap on the prefill graphs, one per (rows, attention bucket): 4-5 row buckets x the few buckets a turn reaches
# (a duplex warm-up precaptures 3 row buckets x the 5 attention buckets of 4096 positions)
MAX_PREFILL_GRAPHS = 24


@dataclass(frozen=True)
class ChunkSampling:
    temperature: float = 0.8
    repetition_penalty: float = 1.05
    window: int = 16
    max_new_codes: int = 26      # draws per unit; the last is not returned

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise InputError(f"talker temperature must be > 0 (got {self.temperature})")
        if self.max_new_codes < 1 or self.window < 1:
            raise InputError("talker max_new_codes and window must be >= 1")


@dataclass(frozen=True)
class UnitCodes:
    codes: tuple[int, ...]       # returned codec ids (the last draw excluded)
    eos: bool                    # the last draw was EOS
    start_pos: int               # text_start_pos before this unit
    turn_start: bool
    turn_end: bool


class TalkerTurn:
    """One duplex conversation's Talker state on the plain reference forward (module docstring)."""

    def __init__(self, tts: MiniCPMTTS, sampling: ChunkSampling = ChunkSampling(), seed: int = 0):
        self.tts, self.sampling = tts.eval(), sampling
        self.device = next(tts.parameters()).device
        self.seed = torch.tensor([seed & MASK32], dtype=torch.long, device=self.device)
        self.draws = 0             # draws over the whole conversation: the RNG counter
        self.reset()

    def reset(self) -> None:
        """Forget the turn (upstream does this when a turn ends or is interrupted)."""
        self.cache = None
        self.text_start_pos = 0

    def condition(self, text_ids, hidden: torch.Tensor) -> torch.Tensor:
        return unit_condition(self.tts, text_ids, hidden)

    @torch.no_grad()
    def _forward(self, rows: torch.Tensor, start: int) -> torch.Tensor:
        pos = torch.arange(start, start + rows.shape[0], device=self.device)[None]
        with no_cudnn_sdpa():       # a unit's condition length and the cache's change every call
            hidden, self.cache = self.tts.forward_reference(rows[None], pos, self.cache)
        return self.tts.logits(hidden[0, -1])

    def _feed_code(self, code: int, position: int) -> torch.Tensor:
        return self._forward(self.tts.embed_codes(torch.tensor([code], device=self.device)), position)

    def draw(self, logits: torch.Tensor, codes: list[int], mask_eos: bool) -> int:
        """One code from [V] logits (``draw_codes`` for one row at draw number ``self.draws``)."""
        code, = draw_codes(logits[None], [codes], [mask_eos], self.seed, [self.draws], self.sampling,
                           self.tts.eos_code)
        self.draws += 1
        return code

    @torch.no_grad()
    def generate_unit(self, text_ids, hidden: torch.Tensor, turn_end: bool) -> UnitCodes:
        s, tts = self.sampling, self.tts
        eos = tts.eos_code
        turn_start = self.text_start_pos == 0
        min_new = 0 if (turn_start or turn_end) else s.max_new_codes
        cond = self.condition(text_ids, hidden)
        start = self.text_start_pos
        logits = self._forward(cond, start)
        codes: list[int] = []
        drew_eos = False
        for t in range(s.max_new_codes):
            if t > 0:   # feed the previous draw, then draw again
                logits = self._feed_code(codes[-1], start + cond.shape[0] + t - 1)
            code = self.draw(logits, codes, mask_eos=t < min_new)
            if code == eos:
                drew_eos = True
                break
            if t == s.max_new_codes - 1:
                break      # the last draw is not returned (and was never fed)
            codes.append(code)
        out = UnitCodes(tuple(codes), drew_eos, start, turn_start, turn_end)
        if turn_end:
            self.reset()
        else:
            self.text_start_pos = start + cond.shape[0] + len(codes)
        return out


def unit_condition(tts: MiniCPMTTS, text_ids, hidden: torch.Tensor) -> torch.Tensor:
    """[n + 1, H]: a unit's token rows ``emb_text(id) + L2norm(projector_semantic(hidden))``, then the
    audio-bos row."""
    dev = tts.emb_text.weight.device
    bos = tts.emb_text(torch.tensor([tts.cfg.audio_bos_token_id], device=dev))
    if len(text_ids) == 0:
        return bos
    ids = torch.as_tensor(list(text_ids), dtype=torch.long, device=dev)
    if hidden.shape[0] != ids.shape[0]:
        raise InputError(f"talker unit: {ids.shape[0]} text ids but {hidden.shape[0]} hidden rows")
    proj = F.normalize(tts.projector_semantic(hidden.to(dev, tts.emb_text.weight.dtype)), p=2, dim=-1)
    return torch.cat([tts.emb_text(ids) + proj, bos])


def draw_rows(logits: torch.Tensor, history: torch.Tensor | None, mask_eos: torch.Tensor, seeds: torch.Tensor,
              counters: torch.Tensor, sampling: ChunkSampling, eos: int) -> torch.Tensor:
    """One code per row of [R, V] logits, on their device: temperature, the penalty over ``history`` [R, W]
    (each row's unit's codes so far, at most the last ``window``, -1 padded; None or all -1 changes nothing),
    EOS masked where ``mask_eos`` [R], then a categorical draw: Gumbel-max over the counter-based uniforms of
    (seed, draw number) [R] -> [R] codes. No host sync, so ``TalkerTurns._draw`` runs it inside a graph."""
    s = sampling
    x = logits.float() / s.temperature
    if s.repetition_penalty != 1.0 and history is not None:
        x = penalize(x, history, s.repetition_penalty)
    x[:, eos] = torch.where(mask_eos, float("-inf"), x[:, eos])
    u = uniform(seeds, counters, x.shape[-1])
    return torch.argmax(x.double() - torch.log(-torch.log(u)), dim=-1)


def draw_codes(logits: torch.Tensor, histories: Sequence[list[int]], mask_eos: Sequence[bool],
               seeds: torch.Tensor, draws: Sequence[int], sampling: ChunkSampling, eos: int) -> list[int]:
    """``draw_rows`` from host lists: each row's unit's draws so far (the last ``window`` count), whether its
    EOS is masked, its draw number."""
    s, dev = sampling, logits.device
    hist = None
    if any(histories):
        hist = torch.full((len(histories), s.window), -1, dtype=torch.long)
        for r, h in enumerate(histories):
            h = h[-s.window:]
            if h:
                hist[r, :len(h)] = torch.tensor(h)
        hist = hist.to(dev)
    return draw_rows(logits, hist, torch.tensor(list(mask_eos), device=dev), seeds,
                     torch.tensor(list(draws), device=dev), s, eos).tolist()


@dataclass(frozen=True)
class SeatUnit:
    """One conversation's unit for ``TalkerTurns.generate_units``: its seat, the unit's Talker tokens
    with their hidden rows, and whether it ends the turn."""

    seat: int
    text_ids: tuple[int, ...]
    hidden: torch.Tensor
    turn_end: bool


class TalkerTurns:
    """The fast duplex Talker of one or several conversations on one static KV cache (seat i:
    conversation i). Each seat behaves as its own ``TalkerTurn`` (same condition, positions, draw rules,
    seed and draw counter); the units of one call draw together, one batched forward per draw (module
    docstring)."""

    def __init__(self, tts: MiniCPMTTS, seats: int, sampling: ChunkSampling = ChunkSampling(),
                 seeds: Sequence[int] | None = None, max_len: int = 4096, graphs: bool | None = None,
                 kernels: str = "auto", max_prefill_graphs: int = MAX_PREFILL_GRAPHS):
        if seats < 1:
            raise InputError(f"talker turns: seats must be >= 1 (got {seats})")
        seeds = list(range(seats)) if seeds is None else list(seeds)
        if len(seeds) != seats:
            raise InputError(f"talker turns: {len(seeds)} seeds for {seats} seats; give one seed per seat")
        self.tts, self.sampling, self.seats = tts.eval(), sampling, seats
        p = next(tts.parameters())
        self.device = p.device
        # the engine's cache, its prefill layers and (kernels "triton", the default on CUDA) its fused decode layers
        self.engine = TalkerEngine(tts, seats, kv_bytes_per_token(tts, p.dtype) * max_len * seats, kernels=kernels)
        self.fused = self.engine.kernels == "triton"
        self.max_len = self.engine.max_len
        self.idle_pos = self.max_len - 1      # where a seat without a draw writes: beyond every real position
        self.seeds = torch.tensor([x & MASK32 for x in seeds], dtype=torch.long, device=self.device)
        self.draws = [0] * seats
        self.text_start_pos = [0] * seats
        self._codes = torch.zeros(seats, dtype=torch.long, device=self.device)
        self._pos = torch.full((seats, 1), self.idle_pos, dtype=torch.long, device=self.device)
        # The unit's draw state lives on the device (``_draw``): the host reads it once a call (and, when a
        # unit may stop early, every few draws), not once a draw.
        dev, M = self.device, sampling.max_new_codes
        vocab = tts.cfg.num_audio_tokens
        self._logits = torch.zeros(seats, vocab, device=dev)    # the next draw's logits (float32, as tts.logits)
        self._t = torch.zeros((), dtype=torch.long, device=dev)                   # the draw number in the unit
        self._live = torch.zeros(seats, dtype=torch.bool, device=dev)             # the seat's unit draws on
        self._hit = torch.zeros(seats, dtype=torch.bool, device=dev)              # ... or drew EOS
        self._drawn = torch.full((seats, M), -1, dtype=torch.long, device=dev)    # codes kept (-1: none)
        self._base = torch.zeros(seats, dtype=torch.long, device=dev)             # draw t is fed at base + t
        self._min_new = torch.zeros(seats, dtype=torch.long, device=dev)          # EOS masked while t < this
        self._counter = torch.zeros(seats, dtype=torch.long, device=dev)          # the seat's RNG draw counter
        self._ndraw = torch.zeros(seats, dtype=torch.long, device=dev)            # draws made in this call
        self._slots = torch.arange(M, device=dev)
        self.buckets = sorted({min(256 << i, self.max_len) for i in range(max(self.max_len.bit_length() - 8, 1))}
                              | {self.max_len})
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._draw_graph: torch.cuda.CUDAGraph | None = None
        self._prefill_graphs: dict[tuple[int, int], tuple] | None = None     # (rows, bucket) -> graph, inputs
        self.max_prefill_graphs = max_prefill_graphs
        if graphs if graphs is not None else self.device.type == "cuda":
            self._prefill_graphs = {}
            # the fused step reads each seat's position on the device: one graph (keyed by the whole cache)
            for kv_len in ([self.max_len] if self.fused else self.buckets):
                self._graphs[kv_len] = self._capture(lambda kv=kv_len: self._step(kv))
            self._draw_graph = self._capture(self._draw)

    def kv_bucket(self, positions: int) -> int:
        """The smallest attention length holding positions ``0 .. positions - 1``."""
        return next(b for b in self.buckets if b >= positions)

    def reset(self, seat: int) -> None:
        """Forget seat ``seat``'s turn (its turn ended or was interrupted)."""
        self.text_start_pos[seat] = 0

    def reseat(self, seat: int, seed: int) -> None:
        """Give seat ``seat`` to a new conversation: no turn, draw counter 0, ``seed``."""
        self.seat(seat)
        self.reset(seat)
        self.draws[seat] = 0
        self.seeds[seat] = seed & MASK32

    def seat(self, i: int) -> "TalkerSeat":
        if not 0 <= i < self.seats:
            raise InputError(f"talker turns: seat {i} does not exist (seats 0..{self.seats - 1})")
        return TalkerSeat(self, i)

    @torch.no_grad()
    def _step(self, kv_len: int) -> None:
        """Feed ``_codes`` at ``_pos`` (one per seat), attending the first ``kv_len`` positions; the [seats, V]
        logits go to ``_logits``. The fused step attends each seat's positions (``kv_len`` unused); an idle seat,
        writing at the cache's last position, reads only its first row (its output is never used)."""
        x = self.tts.embed_codes(self._codes)[:, None]
        if self.fused:
            read = self._pos.masked_fill(self._pos == self.idle_pos, 0)
            hidden = self.engine._fused_layers(x, self._pos, read)
        else:
            hidden = self.engine._layers(x, self._pos, slice(0, self.seats), kv_len, self._pos)
        self._logits.copy_(self.tts.logits(hidden[:, -1]))

    @torch.no_grad()
    def _draw(self) -> None:
        """Draw ``_t`` of every live seat's unit from ``_logits`` (``draw_rows``, as ``draw_codes`` draws it for
        that row; a seat that is not live draws too, and nothing of its draw is kept), then
        the unit's books: an EOS ends the unit, any other code but the last draw's is kept and is what the next
        step feeds, at ``_base + t``; seats with nothing to feed write at the idle position."""
        s, eos, t = self.sampling, self.tts.eos_code, self._t
        window = (self._slots < t) & (self._slots >= t - s.window)    # this unit's codes so far, the last window
        code = draw_rows(self._logits, torch.where(window, self._drawn, -1), t < self._min_new, self.seeds,
                         self._counter + self._ndraw, s, eos)
        live = self._live
        hit = live & (code == eos)
        keep = live & ~hit & (t < s.max_new_codes - 1)
        self._hit.logical_or_(hit)
        self._ndraw.add_(live.long())
        self._drawn.scatter_(1, t.expand(self.seats, 1), torch.where(keep, code, -1)[:, None])
        self._live.copy_(keep)
        self._codes.copy_(torch.where(keep, code, 0))
        self._pos.copy_(torch.where(keep, self._base + t, self.idle_pos)[:, None])
        self._t.add_(1)

    def _capture(self, fn) -> torch.cuda.CUDAGraph:
        """A graph of ``fn`` (``_step``, ``_draw`` or a ``_prefill_forward``, on persistent buffers). The step and
        draw graphs are captured before any unit: their warm-ups write at the idle position, and each call resets
        the draw state. A prefill graph is captured at its first call, whose warm-ups write what its replay then
        writes again."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    @torch.no_grad()
    def _prefill(self, seats: list[int], conds: list[torch.Tensor], starts: list[int]) -> None:
        """Every unit's condition in one forward -> ``_logits`` (each unit's seat: the logits at its condition's
        last row; other seats' rows are left meaningless). Rows are right-padded to a power of two (from 8), so
        that a few graphs serve every call: padding and seats without a unit write at the idle position. With
        graphs the forward replays one per (rows, attention bucket), captured at its first use, at most
        ``max_prefill_graphs`` (eager after that); at one seat on the H200 the eager forward (~35 launches a
        layer) took ~14 ms of a ~37-ms unit."""
        T = max(8, 1 << (max(c.shape[0] for c in conds) - 1).bit_length())
        kv_len = self.kv_bucket(max(start + c.shape[0] for start, c in zip(starts, conds)))
        x = torch.zeros(self.seats, T, conds[0].shape[-1], dtype=conds[0].dtype, device=self.device)
        meta = torch.full((self.seats, T + 1), self.idle_pos, dtype=torch.long)     # positions, then the last row
        meta[:, T] = 0
        for seat, cond, start in zip(seats, conds, starts):
            x[seat, :cond.shape[0]] = cond
            meta[seat, :cond.shape[0]] = torch.arange(start, start + cond.shape[0])
            meta[seat, T] = cond.shape[0] - 1
        meta = upload_ints(self.engine.uploads, meta.numpy(), self.device)     # pinned: a pageable copy would wait
        held = self._prefill_graph((T, kv_len), x, meta) if self._prefill_graphs is not None else None
        if held is None:
            return self._prefill_forward(x, meta, kv_len)
        graph, bx, bm = held
        bx.copy_(x)
        bm.copy_(meta)
        graph.replay()

    def _prefill_graph(self, key: tuple[int, int], x: torch.Tensor, meta: torch.Tensor) -> tuple | None:
        """The prefill graph of ``key`` (rows, attention bucket) with its input buffers, captured now (on
        copies of ``x`` and ``meta``, which its warm-ups run) while the budget allows; None past it."""
        if key not in self._prefill_graphs and len(self._prefill_graphs) < self.max_prefill_graphs:
            bx, bm = x.clone(), meta.clone()
            self._prefill_graphs[key] = (self._capture(lambda: self._prefill_forward(bx, bm, key[1])), bx, bm)
        return self._prefill_graphs.get(key)

    @torch.no_grad()
    def precapture(self, rows: Sequence[int] = (8, 16, 32), kv_len: int | None = None) -> int:
        """Capture the prefill graphs of conditions of ``rows`` rows (each padded as ``_prefill`` pads it) at
        the attention bucket holding ``kv_len`` positions (default: the smallest, where a turn starts), before
        a unit needs them: otherwise a conversation's first unit of each shape waits for a capture. Their
        warm-ups write at the idle position only. Returns the prefill graphs held (0 without graphs)."""
        if any(r < 1 for r in rows) or (kv_len is not None and not 1 <= kv_len <= self.max_len):
            raise InputError(f"talker turns: precapture rows {tuple(rows)} must be >= 1 and kv_len {kv_len} in "
                             f"1..{self.max_len}")
        if self._prefill_graphs is None:
            return 0
        kv = self.buckets[0] if kv_len is None else self.kv_bucket(kv_len)
        w = self.tts.emb_text.weight
        for r in rows:
            T = max(8, 1 << (r - 1).bit_length())
            meta = torch.full((self.seats, T + 1), self.idle_pos, dtype=torch.long, device=self.device)
            meta[:, T] = 0
            self._prefill_graph((T, kv), torch.zeros(self.seats, T, w.shape[1], dtype=w.dtype, device=self.device),
                                meta)
        return len(self._prefill_graphs)

    def _prefill_forward(self, x: torch.Tensor, meta: torch.Tensor, kv_len: int) -> None:
        T = x.shape[1]
        pos = meta[:, :T]
        hidden = self.engine._layers(x, pos, slice(0, self.seats), kv_len, pos)
        self._logits.copy_(self.tts.logits(hidden[torch.arange(self.seats, device=x.device), meta[:, T]]))

    @torch.no_grad()
    def generate_units(self, units: Sequence[SeatUnit]) -> list[UnitCodes]:
        """Each unit's codes, as ``TalkerTurn.generate_unit`` on its seat (one unit per seat per call)."""
        s = self.sampling
        seats = [u.seat for u in units]
        if len(set(seats)) != len(seats) or any(not 0 <= i < self.seats for i in seats):
            raise InputError(f"talker turns: seats {seats} must be distinct and in 0..{self.seats - 1}")
        starts, conds, min_new, rows = [], [], [], []
        for u in units:
            start = self.text_start_pos[u.seat]
            cond = unit_condition(self.tts, u.text_ids, u.hidden)
            # the unit's condition and draws must stay below the idle position
            if start + cond.shape[0] + s.max_new_codes > self.idle_pos:
                raise InputError(f"talker turns: seat {u.seat}'s turn would reach position "
                                 f"{start + cond.shape[0] + s.max_new_codes} of a static cache of {self.max_len}; "
                                 "build TalkerTurns with a larger max_len")
            starts.append(start)
            rows.append(cond)
            conds.append(cond.shape[0])
            min_new.append(0 if (start == 0 or u.turn_end) else s.max_new_codes)
        if not units:
            return []
        dev, M = self.device, s.max_new_codes
        self._prefill(seats, rows, starts)
        # the call's draw state, uploaded in one copy: per seat live, base, min_new, RNG counter (idle: 0)
        state = torch.zeros(4, self.seats, dtype=torch.long)
        state[3] = torch.tensor(self.draws)
        for r, seat in enumerate(seats):
            state[:3, seat] = torch.tensor([1, starts[r] + conds[r], min_new[r]])
        state = upload_ints(self.engine.uploads, state.numpy(), dev)
        self._live.copy_(state[0].bool())
        self._base.copy_(state[1])
        self._min_new.copy_(state[2])
        self._counter.copy_(state[3])
        self._hit.zero_()
        self._ndraw.zero_()
        self._drawn.fill_(-1)
        self._t.zero_()
        # a unit that may stop early (EOS not masked throughout) is looked at every few draws, so that a round
        # whose units all stopped skips the rest of its steps; otherwise every unit makes all M draws
        may_stop = any(m < M for m in min_new)
        reach = max(b + c for b, c in zip(starts, conds))     # the furthest unit's first draw position
        for t in range(M):
            self._draw_graph.replay() if self._draw_graph is not None else self._draw()
            if t == M - 1 or (may_stop and t % 4 == 3 and not bool(self._live.any())):
                break
            # the step after draw t feeds at base + t: its attention holds every unit's positions up to there
            kv_len = self.max_len if self.fused else self.kv_bucket(reach + t + 1)
            graph = self._graphs.get(kv_len)
            graph.replay() if graph is not None else self._step(kv_len)
        books = torch.cat([self._drawn, self._hit.long()[:, None], self._ndraw[:, None]], 1).cpu()   # one read
        drawn, books = books[:, :M], books[:, M:]
        codes = [[c for c in drawn[seat].tolist() if c >= 0] for seat in seats]
        drew_eos = [bool(books[seat, 0]) for seat in seats]
        for seat in seats:
            self.draws[seat] += int(books[seat, 1])
        out = []
        for r, u in enumerate(units):
            out.append(UnitCodes(tuple(codes[r]), drew_eos[r], starts[r], starts[r] == 0, u.turn_end))
            self.text_start_pos[u.seat] = 0 if u.turn_end else starts[r] + conds[r] + len(codes[r])
        return out


class TalkerSeat:
    """One seat of ``TalkerTurns`` with ``TalkerTurn``'s interface (``generate_unit``, ``reset``,
    ``text_start_pos``, ``draws``), for a conversation that steps alone."""

    def __init__(self, turns: TalkerTurns, seat: int):
        self.turns, self.index = turns, seat

    @property
    def text_start_pos(self) -> int:
        return self.turns.text_start_pos[self.index]

    @property
    def draws(self) -> int:
        return self.turns.draws[self.index]

    def reset(self) -> None:
        self.turns.reset(self.index)

    def generate_unit(self, text_ids, hidden: torch.Tensor, turn_end: bool) -> UnitCodes:
        return self.turns.generate_units([SeatUnit(self.index, tuple(text_ids), hidden, turn_end)])[0]
