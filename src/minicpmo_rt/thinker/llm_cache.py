"""Where a ``StreamingSession`` keeps its LLM KV cache: two backends with one contract.

- ``DynamicLLMCache`` (the plain reference, default): transformers' own Qwen3 forward on a
  ``DynamicCache`` (``Thinker.forward_embeds``), truncation by slicing, pruning by
  concatenation (``model.drop_rows``).
- ``StaticLLMCache`` (the fast path): ``decode.StaticDecoder``'s preallocated cache, fed by
  its packed-weight prefill (fused Triton kernels on CUDA, optionally one CUDA graph per
  input length). Its length is a host-side integer, so truncation is free; rows past the
  length are stale and never read (every prefill writes its rows before attending to them).

Contract (what the session relies on): ``feed(embeds [L,H])`` appends L positions and
returns the final-norm hidden of each; ``length``; ``truncate(n)`` keeps rows [0, n);
``checksum()`` is a float64 sum of K and V over the live rows (comparable within one
backend only; ``checksum(as_tensor=True)`` the same as a 0-d device tensor, without a
sync); ``drop_rows(start, n, inv_freq)`` removes rows and re-rotates the kept suffix's keys
exactly as ``model.drop_rows`` does (same fp32 element-wise arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..errors import InputError
from .decode import StaticDecoder, padded_runs
from .model import LLMStep, Thinker, cache_checksum, cache_length, drop_rows, rerotate_keys, truncate_cache
from .staging import upload_ints

LLM_CACHES = ("dynamic", "static")


class LLMCache(Protocol):
    capacity: int

    @property
    def length(self) -> int: ...

    def feed(self, embeds: torch.Tensor) -> LLMStep: ...

    def truncate(self, length: int) -> None: ...

    def checksum(self, *, as_tensor: bool = False) -> float | torch.Tensor: ...

    def close(self) -> None: ...

    def drop_rows(self, start: int, length: int, inv_freq: torch.Tensor) -> None: ...


class DynamicLLMCache:
    """transformers' forward on a growing ``DynamicCache`` (``store``)."""

    def __init__(self, thinker: Thinker, capacity: int):
        self.thinker, self.capacity = thinker, capacity
        self.store = thinker.new_cache()

    @property
    def length(self) -> int:
        return cache_length(self.store)

    def close(self) -> None:
        """Nothing pooled: the DynamicCache goes with the session."""

    def feed(self, embeds: torch.Tensor) -> LLMStep:
        return self.thinker.forward_embeds(embeds, self.store)

    def truncate(self, length: int) -> None:
        truncate_cache(self.store, length)

    def checksum(self, *, as_tensor: bool = False) -> float | torch.Tensor:
        return cache_checksum(self.store, as_tensor=as_tensor)

    def drop_rows(self, start: int, length: int, inv_freq: torch.Tensor) -> None:
        drop_rows(self.store, start, length, inv_freq)


class StaticDecoderPool:
    """Reusable ``StaticDecoder``s of one thinker, for short-lived sessions (audit replays).

    A fresh decoder costs a copy of the packed weights (~9 GB at full size) and a CUDA-graph
    capture per prefill length. Decoders from one pool share the first one's packed weights,
    and a released decoder (with its graphs) serves the next session that asks for the same
    capacity. Stale cache rows need no clearing: a decoder only reads rows below the
    positions it has been fed since it was acquired.
    """

    def __init__(self, thinker: Thinker, kernels: str = "auto"):
        self.thinker, self.kernels = thinker, kernels
        self._free: dict[tuple[int, int], list[StaticDecoder]] = {}   # (capacity, batch) -> free decoders
        self._donor: StaticDecoder | None = None
        self.created = 0

    def acquire(self, capacity: int, batch: int = 1) -> StaticDecoder:
        free = self._free.get((capacity, batch))
        if free:
            # the decoder with the most prefill graphs: a run's first session (its main one, which
            # feeds the most shapes) then captures least
            best = max(range(len(free)), key=lambda i: len(free[i]._prefill_graphs))
            return free.pop(best)
        dec = StaticDecoder(self.thinker.llm, max_len=capacity, batch=batch, kernels=self.kernels,
                            share_weights=self._donor)
        self._donor = self._donor or dec
        self.created += 1
        return dec

    def free_prefill_graphs(self) -> list[int]:
        """Prefill graphs held by each free decoder, most first (for benchmarks' census)."""
        return sorted((len(d._prefill_graphs) for free in self._free.values() for d in free), reverse=True)

    def release(self, dec: StaticDecoder) -> None:
        key = (dec.max_len, dec.batch)
        if any(d is dec for d in self._free.get(key, [])):
            raise ValueError("StaticDecoderPool.release: this decoder was released already")
        self._free.setdefault(key, []).append(dec)


@dataclass(frozen=True)
class RowsStep:
    """One ``StaticRows.step_logits``: the fed rows in the feeds' order, and for each its final-norm hidden
    [n, H] (model dtype) and LM-head output [n, V] (float32), both on the model's device."""
    rows: list[int]
    hidden: torch.Tensor
    logits: torch.Tensor


class StaticRows:
    """One ``batch``-row ``StaticDecoder`` whose rows serve ``batch`` sessions: passed as a session's
    ``llm_pool``, it hands each session a row (``StaticDecoder.row_view``; the session prefills it alone),
    and ``step`` feeds one token to each of several sessions in one forward (a CUDA graph with the Triton
    kernels: duplex decode steps of concurrent conversations). The cache holds one row more than a session
    may use: a row that does not feed in a step writes at that last position, which no session reads."""

    def __init__(self, thinker: Thinker, batch: int, capacity: int, kernels: str = "auto",
                 pool: StaticDecoderPool | None = None, graphs: bool | None = None):
        self.thinker, self.capacity, self.batch = thinker, capacity, batch
        self.big = pool.acquire(capacity + 1, batch) if pool is not None else \
            StaticDecoder(thinker.llm, max_len=capacity + 1, batch=batch, kernels=kernels)
        self.pool = pool
        self.graphs = (self.big.kernels == "triton" and self.big.device.type == "cuda") if graphs is None else graphs
        self._free = [self.big.row_view(i) for i in range(batch)]

    def acquire(self, capacity: int, batch: int = 1) -> StaticDecoder:
        if batch != 1 or capacity != self.capacity:
            raise InputError(f"static rows: a session asked for {batch} row(s) of {capacity} positions; these rows "
                             f"hold {self.capacity} (one session each)")
        if not self._free:
            raise InputError(f"static rows: all {self.batch} rows are taken; close a session first")
        return self._free.pop(0)

    def release(self, dec: StaticDecoder) -> None:
        if any(d is dec for d in self._free):
            raise ValueError("StaticRows.release: this row was released already")
        self._free.append(dec)

    @torch.no_grad()
    def prefill_many(self, views: Sequence[StaticDecoder], prompts: Sequence[torch.Tensor],
                     join: bool = True) -> torch.Tensor:
        """Each prompt [T_i, H] (embeddings) into its acquired row from position 0; the prompts of
        consecutive rows run as one forward, right-padded to the longest (``decode.padded_runs``), so the
        weights are read once per run of rows instead of once per prompt. Returns each prompt's final-norm
        hidden at its last position, [n, H]. ``join`` False: one forward per prompt."""
        if len(views) != len(prompts):
            raise ValueError(f"prefill_many: {len(views)} rows for {len(prompts)} prompts")
        last: list[torch.Tensor | None] = [None] * len(views)
        for run, row, x in padded_runs([v.row for v in views], prompts, join=join):
            hidden = self.big.rows_view(row, len(run)).prefill(x, 0)
            for j, i in enumerate(run):
                last[i] = hidden[j, int(prompts[i].shape[0]) - 1]
        return torch.stack(last)

    @torch.no_grad()
    def feed_many(self, caches: Sequence["StaticLLMCache"], embeds: Sequence[torch.Tensor]) -> list[LLMStep]:
        """``caches[i].feed(embeds[i])`` for sessions on rows of these (each cache's ``store`` one of the rows
        handed out here), where consecutive rows run as one forward (``decode.padded_runs``), each row from
        its own length: the weights are read once per run instead of once per session. Rows whose padding
        would pass the cache's end feed alone."""
        if len(caches) != len(embeds):
            raise ValueError(f"feed_many: {len(caches)} caches for {len(embeds)} inputs")
        seqs = [e.reshape(-1, e.shape[-1]) for e in embeds]
        for c, x in zip(caches, seqs):
            if c.store is None or getattr(c.store, "row", None) is None or c.pool is not self:
                raise InputError("static rows: feed_many takes the caches of sessions on these rows (llm_pool)")
            if c.length + x.shape[0] > c.capacity:
                raise InputError(f"static LLM cache: {c.length} + {x.shape[0]} positions pass its capacity of "
                                 f"{c.capacity}; build the session with a larger static_capacity (or a tighter window)")
        out: list[LLMStep | None] = [None] * len(caches)
        for run, row, x in padded_runs([c.store.row for c in caches], seqs):
            starts = [caches[i].length for i in run]
            if len(run) == 1 or max(starts) + x.shape[1] > self.big.max_len:
                for i in run:
                    out[i] = caches[i].feed(seqs[i])
                continue
            hidden = self.big.rows_view(row, len(run)).prefill_at(x, starts)
            for j, i in enumerate(run):
                n = int(seqs[i].shape[0])
                caches[i].advance(n)
                out[i] = LLMStep(hidden[j, :n])
        return out

    @torch.no_grad()
    def step(self, feeds: dict[int, tuple[int, int]]) -> dict[int, torch.Tensor]:
        """{row: (token id, position)} -> {row: final-norm hidden [H]}: every token fed in one forward (rows
        without a token write at the spare last position)."""
        _, hidden = self._forward(feeds)
        return {row: hidden[row].clone() for row in feeds}

    @torch.no_grad()
    def step_logits(self, feeds: dict[int, tuple[int, int]]) -> RowsStep:
        """``step`` with the LM head of the fed rows, in one batch: the graph's own head output when it
        ran the thinker's current head, else the head on the fed rows (one GEMM for all, not one GEMV per
        session)."""
        logits, hidden = self._forward(feeds)
        rows = list(feeds)
        pick = upload_ints(self.big.uploads, rows, hidden.device)     # pinned: no wait on the device
        hidden = hidden.index_select(0, pick)            # a copy: the graph's outputs change at its next replay
        head = self.thinker.llm.lm_head
        if logits is not None and self.big.lm_head is head:
            logits = logits.index_select(0, pick)
        else:
            logits = head(hidden.to(self.thinker.dtype)).float()
        return RowsStep(rows, hidden, logits)

    def _forward(self, feeds: dict[int, tuple[int, int]]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits [batch, V] or None, hidden [batch, H]) of one forward of every row (graph outputs)."""
        big = self.big
        both = [[0] * self.batch, [self.capacity] * self.batch]     # tokens, positions
        for row, (token, position) in feeds.items():
            if not 0 <= position < self.capacity:
                raise InputError(f"static rows: position {position} is outside the {self.capacity} rows of a session")
            both[0][row], both[1][row] = token, position
        # one pinned upload (a copy from pageable memory syncs the stream before it starts)
        tokens, pos = upload_ints(big.uploads, both, big.device)
        if self.graphs:
            return big.decode_graph(tokens, pos)
        return None, big.step(big.embed(tokens)[:, None], pos[:, None], self.capacity + 1)[:, 0]

    def close(self) -> None:
        """Hand the decoder back to its pool (every session on a row must be closed)."""
        if self.pool is not None and self.big is not None:
            self.pool.release(self.big)
        self.big = None


class StaticLLMCache:
    """``StaticDecoder`` prefill on its preallocated cache (``store``) of ``capacity`` rows."""

    def __init__(self, thinker: Thinker, capacity: int, kernels: str = "auto", graphs: bool | None = None,
                 pool: StaticDecoderPool | None = None):
        self.thinker, self.capacity = thinker, capacity
        self.pool = pool
        self.store = pool.acquire(capacity) if pool is not None else \
            StaticDecoder(thinker.llm, max_len=capacity, kernels=kernels)
        if graphs is None:
            graphs = self.store.kernels == "triton" and self.store.device.type == "cuda"
        if graphs and not (self.store.kernels == "triton" and self.store.device.type == "cuda"):
            raise InputError("static LLM cache: CUDA-graph prefill needs a CUDA model and the Triton kernels; "
                             "pass graphs=False")
        self.graphs = graphs
        self._length = 0
        self._fork: StaticDecoder | None = None   # batch decoder of fork_feed, held until close()
        self._synced = 0   # rows [0, _synced) of every fork row equal this cache's rows

    @property
    def fork_batch(self) -> int:
        return self._fork.batch if self._fork is not None else 0

    @property
    def length(self) -> int:
        return self._length

    def close(self) -> None:
        """Hand a pooled decoder back; the cache is unusable afterwards."""
        if self.pool is not None and self.store is not None:
            self.pool.release(self.store)
            if self._fork is not None:
                self.pool.release(self._fork)
        self.store = self._fork = None

    @torch.no_grad()
    def feed(self, embeds: torch.Tensor) -> LLMStep:
        if self.store is None:
            raise InputError("static LLM cache: used after close(); open a new session")
        if embeds.dim() == 2:
            embeds = embeds[None]
        n = int(embeds.shape[1])
        if self._length + n > self.capacity:
            raise InputError(f"static LLM cache: {self._length} + {n} positions pass its capacity of {self.capacity}; "
                             "build the session with a larger static_capacity (or a tighter window)")
        run = self.store.prefill_graph if self.graphs else self.store.prefill
        hidden = run(embeds, self._length)
        self._length += n
        return LLMStep(hidden[0])

    def advance(self, n: int) -> None:
        """``n`` rows past the length were written by a forward of the rows' owner (``StaticRows.step``)."""
        if self._length + n > self.capacity:
            raise InputError(f"static LLM cache: {self._length} + {n} positions pass its capacity of {self.capacity}")
        self._length += n

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a {self._length}-row cache to {length} rows")
        self._length = int(length)
        self._synced = min(self._synced, self._length)   # rows past it will be rewritten

    @torch.no_grad()
    def fork_feed(self, units: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each unit ``[L_i, H]`` fed ALONE after the live rows: its final-norm hidden at its last
        position, as ``feed`` then ``truncate`` back would give. The live cache is not touched.

        The units run as one batch (rows right-padded to the longest; causal attention keeps the
        padding out of every real position) on a fork decoder whose rows hold a copy of the live
        rows: one prefill instead of one per unit, so the packed weights are read once. Only
        rows changed since the last fork are copied. The batch grows to the largest count
        seen (extra rows repeat unit 0), so one graph per unit length serves every call."""
        if self.store is None:
            raise InputError("static LLM cache: used after close(); open a new session")
        if not units:
            return []
        n, T = self._length, max(int(u.shape[0]) for u in units)
        if n + T > self.capacity:
            raise InputError(f"static LLM cache: {n} + {T} positions pass its capacity of {self.capacity}; "
                             "build the session with a larger static_capacity (or a tighter window)")
        B = max(len(units), self.fork_batch)
        if self._fork is None or self._fork.batch < B:
            if self._fork is not None and self.pool is not None:
                self.pool.release(self._fork)
            self._fork = self.pool.acquire(self.capacity, B) if self.pool is not None else \
                StaticDecoder(self.thinker.llm, max_len=self.capacity, batch=B, kernels=self.store.kernels,
                              share_weights=self.store)
            self._synced = 0
        fork, lo = self._fork, self._synced
        if lo < n:
            for src, dst in ((self.store.k_cache, fork.k_cache), (self.store.v_cache, fork.v_cache)):
                dst[:, :, :, lo:n].copy_(src[:, :1, :, lo:n].expand(-1, fork.batch, -1, -1, -1))
            self._synced = n
        x = torch.zeros(fork.batch, T, units[0].shape[-1], dtype=fork.dtype, device=fork.device)
        for i in range(fork.batch):
            u = units[i] if i < len(units) else units[0]
            x[i, :u.shape[0]] = u.to(fork.dtype)
        run = fork.prefill_graph if self.graphs else fork.prefill
        hidden = run(x, n)
        return [hidden[i, int(u.shape[0]) - 1] for i, u in enumerate(units)]

    def checksum(self, *, as_tensor: bool = False) -> float | torch.Tensor:
        n = self._length
        if not n:
            return torch.zeros((), dtype=torch.float64) if as_tensor else 0.0
        k, v = self.store.k_cache[:, :, :, :n], self.store.v_cache[:, :, :, :n]
        # Row sums over the contiguous head dim in fp32 first, then one fp64 total: a direct
        # fp64 sum of this strided bf16 view took ~2.8 ms per call on the H200 (5 calls per
        # second of cached-partial extraction); deterministic either way.
        rows = torch.stack([k.sum(dim=-1, dtype=torch.float32), v.sum(dim=-1, dtype=torch.float32)])
        total = rows.sum(dtype=torch.float64)
        return total if as_tensor else float(total)

    @torch.no_grad()
    def drop_rows(self, start: int, length: int, inv_freq: torch.Tensor) -> None:
        total = self._length
        if length <= 0:
            return
        if start < 0 or start + length > total:
            raise ValueError(f"cannot drop rows [{start}, {start + length}) of a {total}-row cache")
        suffix = total - start - length
        self._synced = min(self._synced, start)
        if suffix:
            kc, vc = self.store.k_cache, self.store.v_cache
            dev = kc.device
            old = torch.arange(start + length, total, device=dev)
            new = torch.arange(start, start + suffix, device=dev)
            # All layers at once: the rotation is element-wise, so this equals the per-layer form.
            keys = rerotate_keys(kc[:, :, :, start + length:total], old, new, inv_freq)
            kc[:, :, :, start:start + suffix] = keys
            vc[:, :, :, start:start + suffix] = vc[:, :, :, start + length:total].clone()
        self._length = start + suffix


def make_llm_cache(kind: str, thinker: Thinker, capacity: int, *, kernels: str = "auto",
                   graphs: bool | None = None, pool: StaticDecoderPool | None = None) -> DynamicLLMCache | StaticLLMCache:
    if kind == "dynamic":
        return DynamicLLMCache(thinker, capacity)
    if kind == "static":
        return StaticLLMCache(thinker, capacity, kernels=kernels, graphs=graphs, pool=pool)
    raise InputError(f"llm_cache={kind!r}: choose one of {', '.join(LLM_CACHES)}")
