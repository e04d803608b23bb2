"""Opt-in slot pooling and row-offset merging for the fused Whole-Euler solve (off by default).

``SlotPool`` keeps every stream's estimator attention cache resident in one pool
``(steps, depth, 2*(slots+1), heads, frames, 2*head_dim)`` (cond rows, then uncond rows; the
last slot is scratch for padded batch rows). A ``SlotHandle`` holds the stream's logical frame
list (newest first, the original cache order) mapping to physical frames of its slot:

* a chunk's new K/V are written by the QKV kernel straight into free frames of the slot;
* trimming (keep the first ``prompt_frames`` and the last ``keep`` logical frames, exactly as
  ``flow.trim_estimator_att`` does to the dense cache) only edits the list;
* attention reads the slot through ``kv_rows`` with a per-row mask over physical frames.

So no attention cache is copied per chunk. Because masks and noise offsets are per row, streams
whose caches differ only in length run in ONE replay (row-offset merging): each row reads the
fixed noise at its own offset. Graphs are keyed by (batch bucket, query bucket) only. Unmasked
softmax attention does not depend on key order, so results match per-stream solves up to
floating-point summation order. Requires the fused body and an FP32 cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .euler_graph import GraphConfig, SolveKey, WholeEulerSolver, _Static

__all__ = ["SlotPool", "SlotHandle", "SlotSolver"]


@dataclass
class SlotHandle:
    slot: int
    prompt_frames: int
    frames: list[int] = field(default_factory=list)   # logical (newest first) -> physical frame
    pool: "SlotPool | None" = None

    @property
    def length(self) -> int:
        """Estimator cache length: the noise offset of the stream's next chunk."""
        return len(self.frames)

    def release(self) -> None:
        if self.pool is not None:
            self.pool._free(self)
            self.pool = None

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache in the original layout: cnn (S, depth, 2, 2C, K-1), att (S, depth, 2, H, L, 2D)."""
        p = self.pool
        rows = torch.tensor(p.rows(self.slot), device=p.kv.device)
        idx = torch.tensor(self.frames, device=p.kv.device, dtype=torch.long)
        att = p.kv.index_select(2, rows).index_select(4, idx)
        return p.cnn.index_select(2, rows), att


class SlotPool:
    def __init__(self, solver_like: WholeEulerSolver, slots: int, frames: int, keep: int = 100, device="cuda"):
        s = solver_like
        self.slots, self.frames, self.keep = slots, frames, keep
        P = 2 * (slots + 1)
        self.kv = torch.zeros(s.S, s.depth, P, s.H, frames, 2 * s.D, device=device)
        self.cnn = torch.zeros(s.S, s.depth, P, 2 * s.C, s.K1, device=device)
        self._free_slots = list(range(slots))
        self.scratch = slots

    def rows(self, slot: int) -> tuple[int, int]:
        return slot, self.slots + 1 + slot

    def admit(self, cnn_cache: torch.Tensor | None, att_cache: torch.Tensor | None, prompt_frames: int) -> SlotHandle:
        """Place a stream's initial caches (S, depth, 2, ...) in a free slot (one copy per stream)."""
        if not self._free_slots:
            raise RuntimeError(f"slot pool full ({self.slots} slots); release a finished stream first")
        slot = self._free_slots.pop(0)
        c, u = self.rows(slot)
        L = 0 if att_cache is None else att_cache.shape[4]
        if L > self.frames:
            raise ValueError(f"cache of {L} frames does not fit a slot of {self.frames}")
        if att_cache is not None:
            self.kv[:, :, c, :, :L] = att_cache[:, :, 0]
            self.kv[:, :, u, :, :L] = att_cache[:, :, 1]
        if cnn_cache is None:
            self.cnn[:, :, [c, u]] = 0
        else:
            self.cnn[:, :, c] = cnn_cache[:, :, 0]
            self.cnn[:, :, u] = cnn_cache[:, :, 1]
        return SlotHandle(slot, prompt_frames, list(range(L)), self)

    def _free(self, h: SlotHandle) -> None:
        if h.slot not in self._free_slots:
            self._free_slots.append(h.slot)


class SlotSolver(WholeEulerSolver):
    """Whole-Euler solves over pooled caches; several streams (any cache lengths) per replay."""

    def __init__(self, cfm, pool: SlotPool, attention: str = "triton-tf32", tf32: bool = False,
                 n_timesteps: int = 10, config: GraphConfig = GraphConfig(), use_triton: bool | None = None):
        super().__init__(cfm, body="fused", attention=attention, tf32=tf32, n_timesteps=n_timesteps,
                         config=config, use_triton=use_triton)
        self.pool = pool

    def key_for(self, B: int, T: int, L: int = 0) -> SolveKey | None:
        Bb = self._snap(B, self.config.batch_buckets)
        Q = self._snap(T, self.config.query_buckets)
        return None if Bb is None or Q is None else SolveKey(Bb, Q, 0, True)

    def _new_static(self, key: SolveKey, device) -> _Static:
        z = lambda *s, dtype=torch.float32: torch.zeros(*s, device=device, dtype=dtype)  # noqa: E731
        Bb, Q, R, F = key.batch, key.query, 2 * key.batch, self.pool.frames
        cnn = (self.S, self.depth, R, 2 * self.C, self.K1)
        st = _Static(key=key, z=z(Bb, Q, self.n_mel), x=z(Bb, Q, self.n_mel), mu=z(Bb, Q, self.n_mel),
                     spk=z(Bb, self.n_mel), cond=z(Bb, Q, self.n_mel), cnn_in=z(*cnn), cnn_out=z(*cnn))
        st.kv = self.pool.kv
        st.xin = z(R, Q, 4 * self.n_mel)
        st.hist = self.fused.new_hist(R, Q, device).zero_()
        st.ws = self.fused.workspace(R, Q, device)
        st.out = z(R, Q, self.n_mel)
        st.cnn_idx = torch.arange(Q, Q + self.K1, device=device)
        # Until the first fill (capture warm-ups run before it) every row points at the scratch
        # slot, so warm-up writes never touch a live stream's frames.
        c, u = self.pool.rows(self.pool.scratch)
        st.rows = torch.tensor([c] * Bb + [u] * Bb, device=device, dtype=torch.int32)
        st.pos = torch.arange(Q, device=device, dtype=torch.int32).repeat(R, 1)
        st.mask = torch.zeros(R, Q, F, device=device, dtype=torch.bool)
        st.mask[:, :, :Q] = True
        return st

    @torch.inference_mode()
    def solve_slots(self, handles: list[SlotHandle], mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                    temperature: float = 1.0, graph: bool = True) -> torch.Tensor:
        """One chunk for every handle (caches may differ in length). mu, cond (B,80,T); spks (B,80)."""
        B, _, T = mu.shape
        if len(handles) != B:
            raise ValueError(f"{len(handles)} handles for a batch of {B}")
        key = self.key_for(B, T)
        if key is None:
            raise ValueError(f"batch {B} / width {T} exceed the slot solver's buckets")
        Bb, Q, F = key.batch, key.query, self.pool.frames
        device = mu.device
        want_graph = graph and device.type == "cuda" and self._graphs_off_reason is None
        with torch.no_grad():
            rows = torch.empty(2 * Bb, dtype=torch.int32)
            pos = torch.empty(2 * Bb, Q, dtype=torch.int32)
            mask = torch.zeros(2 * Bb, Q, F, dtype=torch.bool)
            z = torch.zeros(Bb, Q, self.n_mel, device=device)
            for i in range(Bb):
                if i < B:
                    h = handles[i]
                    used = set(h.frames)
                    free = [f for f in range(F) if f not in used][:Q]
                    if len(free) < Q:
                        raise RuntimeError(f"slot {h.slot} has {F - len(used)} free frames, {Q} needed")
                    keys = torch.zeros(F, dtype=torch.bool)
                    keys[h.frames] = True
                    keys[free[:T]] = True
                    c, u = self.pool.rows(h.slot)
                    z[i, :T] = self.cfm.noise(h.length, T, temperature).to(mu.dtype)[0].t()
                else:   # padded batch row: scratch slot, attends to its own new frames only
                    free, c, u = list(range(Q)), *self.pool.rows(self.pool.scratch)
                    keys = torch.zeros(F, dtype=torch.bool)
                    keys[:T] = True
                rows[i], rows[Bb + i] = c, u
                pos[i] = pos[Bb + i] = torch.tensor(free, dtype=torch.int32)
                mask[i] = mask[Bb + i] = keys[None, :].expand(Q, F)
            with_rows = torch.cat([rows[:B], rows[Bb:Bb + B]]).long().to(device)
            from .precision import matmul_tf32
            with matmul_tf32(self.tf32):
                st = self._static_for(key, device, want_graph)
                st.z.copy_(z)
                st.mu[:B, :T].copy_(mu.transpose(1, 2))
                st.cond[:B, :T].copy_(cond.transpose(1, 2))
                if T < Q:
                    st.mu[:B, T:].copy_(st.mu[:B, T - 1:T].expand(-1, Q - T, -1))
                    st.cond[:B, T:].copy_(st.cond[:B, T - 1:T].expand(-1, Q - T, -1))
                st.spk[:B].copy_(spks)
                st.rows.copy_(rows)
                st.pos.copy_(pos)
                st.mask.copy_(mask)
                st.cnn_idx.copy_(torch.arange(T, T + self.K1))
                cnn_rows = torch.cat([rows[:Bb], rows[Bb:]]).long().to(device)
                st.cnn_in.copy_(self.pool.cnn.index_select(2, cnn_rows))
                if st.graph is not None and want_graph:
                    st.graph.replay()
                else:
                    self._program(st)
                # CNN caches back into the pool (small); attention caches are already in place
                out_rows = torch.cat([torch.arange(B), torch.arange(Bb, Bb + B)]).to(device)
                self.pool.cnn.index_copy_(2, with_rows, st.cnn_out.index_select(2, out_rows))
            for i, h in enumerate(handles):
                h.frames = [int(f) for f in pos[i, :T]] + h.frames
                limit = h.prompt_frames + self.pool.keep
                if len(h.frames) > limit:     # the dense trim's rule, on the frame list only
                    h.frames = h.frames[:h.prompt_frames] + h.frames[-self.pool.keep:]
            return st.x[:B, :T].transpose(1, 2).clone()


def default_pool_frames(prompt_frames: int, keep: int = 100, query: int = 50) -> int:
    """Slot capacity: steady cache plus one chunk's frames, aligned to 16."""
    return int(math.ceil((prompt_frames + keep + max(query, 2 * keep)) / 16) * 16)
