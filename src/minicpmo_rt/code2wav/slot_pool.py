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
from typing import Sequence

import numpy as np
import torch

from . import bulk_copy
from .euler_graph import GraphConfig, SolveKey, WholeEulerSolver, _Static
from ..thinker.staging import HostStaging
from .precision import matmul_tf32

__all__ = ["SlotPool", "SlotHandle", "SlotSolver"]


@dataclass
class SlotHandle:
    slot: int
    prompt_frames: int
    frames: list[int] = field(default_factory=list)   # logical (newest first) -> physical frame
    pool: "SlotPool | None" = None
    # numpy copy of ``frames`` for the per-chunk mask (rebuilt when ``frames`` is replaced by
    # another list or changes length; assign a new list rather than editing it in place)
    _arr: np.ndarray | None = field(default=None, repr=False, compare=False)
    _arr_of: list | None = field(default=None, repr=False, compare=False)

    @property
    def length(self) -> int:
        """Estimator cache length: the noise offset of the stream's next chunk."""
        return len(self.frames)

    def _frames_array(self) -> np.ndarray:
        if self._arr_of is not self.frames or len(self._arr) != len(self.frames):
            self._arr, self._arr_of = np.asarray(self.frames, dtype=np.int64), self.frames
        return self._arr

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

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

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
            bulk_copy.copy_(self.kv[:, :, c, :, :L], att_cache[:, :, 0])
            bulk_copy.copy_(self.kv[:, :, u, :, :L], att_cache[:, :, 1])
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
    """Whole-Euler solves over pooled caches; several streams (any cache lengths) per replay.

    Per chunk the host work is small and never waits for the device: the streams' free frames and
    key masks are computed with numpy into a pinned int32 buffer (two, alternating) that reaches the
    device in one non-blocking copy; the (rows, frames) indices, the key mask and the noise gather
    are expanded from it on the device. The mask the attention reads is a stride-0 view of one key
    row per batch row. The CNN caches are gathered from and written back to the pool inside the
    captured program, so a replay needs no host-built index tensors.
    """

    def __init__(self, cfm, pool: SlotPool, attention: str = "triton-tf32", tf32: bool = False,
                 n_timesteps: int = 10, config: GraphConfig = GraphConfig(), use_triton: bool | None = None,
                 split_k: int | None = None, block_kernel: bool | None = None, attn_tma: bool | None = None,
                 wide_gemm: bool | None = None, gemm_operands: str = "fp32"):
        super().__init__(cfm, body="fused", attention=attention, tf32=tf32, n_timesteps=n_timesteps,
                         config=config, use_triton=use_triton, split_k=split_k, block_kernel=block_kernel,
                         attn_tma=attn_tma, wide_gemm=wide_gemm, gemm_operands=gemm_operands)
        self.pool = pool
        self._staging: dict[tuple, _Staging] = {}

    def key_for(self, B: int, T: int, L: int = 0) -> SolveKey | None:
        Bb = self._snap(B, self.config.batch_buckets)
        Q = self._snap(T, self.config.query_buckets)
        return None if Bb is None or Q is None else SolveKey(Bb, Q, 0, True)

    def precapture_key(self, key: SolveKey, device) -> bool:
        """Capture ``key``'s graph before its first solve (``Code2Wav.warm_up`` does, for final chunks wider
        than a steady one), its rows pointing at the scratch slot as at any capture; True if a graph is then
        held. Off CUDA, with graphs off or the budget spent: no graph (False)."""
        device = torch.device(device)
        if device.type != "cuda" or self._graphs_off_reason is not None:
            return False
        with matmul_tf32(self.tf32):
            return self._static_for(key, device, want_graph=True).graph is not None

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
        st.hc = z(R, Q, self.C)
        st.cnn_idx = torch.arange(Q, Q + self.K1, device=device)
        # Until the first fill (capture warm-ups run before it) every row points at the scratch
        # slot, so warm-up writes never touch a live stream's frames.
        c, u = self.pool.rows(self.pool.scratch)
        st.rows = torch.tensor([c] * Bb + [u] * Bb, device=device, dtype=torch.int32)
        st.pos = torch.arange(Q, device=device, dtype=torch.int32).repeat(R, 1)
        # one key row per batch row; every query of the row reads it (a stride-0 mask view)
        keys = torch.zeros(R, F, device=device, dtype=torch.bool)
        keys[:, :Q] = True
        st.mask = keys[:, None, :].expand(R, Q, F)
        st.extra["keys"] = keys
        st.extra["rows64"] = st.rows.long()
        return st

    def _program(self, st: _Static) -> None:
        # The pool's CNN caches in and out are part of the program (captured with it).
        rows64 = st.extra["rows64"]
        rows64.copy_(st.rows)
        torch.index_select(self.pool.cnn, 2, rows64, out=st.cnn_in)
        super()._program(st)
        # Padded batch rows write the scratch slot's rows (several times; never read by a stream).
        self.pool.cnn.index_copy_(2, rows64, st.cnn_out)

    def _stage(self, Bb: int, Q: int, device) -> "_Staging":
        key = (Bb, Q, self.pool.frames, device)
        stg = self._staging.get(key)
        if stg is None:
            stg = self._staging[key] = _Staging(Bb, Q, self.pool.frames, self._host_uploads(device))
        return stg

    @torch.inference_mode()
    def solve_slots(self, handles: list[SlotHandle], mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                    temperature: float = 1.0, graph: bool = True, widths: Sequence[int] | None = None
                    ) -> torch.Tensor:
        """One chunk for every handle (caches may differ in length). mu, cond (B,80,T); spks (B,80).

        ``widths``: each row's own frame count (<= T; default T each), for final chunks narrower than the
        others in the solve: a row's frames past its width are neither keys nor kept in its slot, and it reads
        the noise at its own offset, so its real frames are those of a solve at its own width (causal convs,
        masked keys). Its slot's CNN history is then not its own: only a stream's final chunk may be narrower."""
        B, _, T = mu.shape
        if len(handles) != B:
            raise ValueError(f"{len(handles)} handles for a batch of {B}")
        widths = [T] * B if widths is None else [int(w) for w in widths]
        if len(widths) != B or not all(1 <= w <= T for w in widths):
            raise ValueError(f"widths {widths}: one per row of the batch of {B}, each in 1..{T}")
        key = self.key_for(B, T)
        if key is None:
            raise ValueError(f"batch {B} / width {T} exceed the slot solver's buckets")
        Bb, Q, F = key.batch, key.query, self.pool.frames
        device = mu.device
        want_graph = graph and device.type == "cuda" and self._graphs_off_reason is None
        n_noise = self.cfm.rand_noise.shape[2]

        # ---- host: indices and key masks of this chunk (numpy, no device round trip)
        stg = self._stage(Bb, Q, device)
        rows, pos, keys, nidx = stg.begin(B, T)
        new_frames = []
        for i in range(Bb):
            if i < B:
                h, w = handles[i], widths[i]
                kr = keys[i]
                kr[h._frames_array()] = 1
                free = (kr == 0).nonzero()[0][:Q]
                if len(free) < Q:
                    raise RuntimeError(f"slot {h.slot} has {F - len(h.frames)} free frames, {Q} needed")
                if h.length + w > n_noise:
                    raise ValueError(f"noise buffer holds {n_noise} frames; "
                                     f"frames {h.length}..{h.length + w} requested (utterance or cache too long)")
                kr[free[:w]] = 1
                pos[i] = free
                # frames past a narrow row's width repeat its last noise column (never read back)
                nidx[i] = np.minimum(stg.arange[:T], w - 1) + h.length
                c, u = self.pool.rows(h.slot)
                new_frames.append(free[:w])
            else:   # padded batch row: scratch slot, attends to its own new frames only
                c, u = self.pool.rows(self.pool.scratch)
                pos[i] = stg.arange[:Q]
                keys[i, :T] = 1
            rows[i], rows[Bb + i] = c, u

        with matmul_tf32(self.tf32):
            st = self._static_for(key, device, want_graph)
            d_rows, d_pos, d_keys, d_nidx = stg.upload(B, T)
            # noise: row i reads the fixed noise at its own offset (zeros in padded rows / frames)
            z = self.cfm.rand_noise[0].index_select(1, d_nidx)                    # (80, B*T)
            if temperature != 1.0:
                z = z * temperature
            st.z[:B, :T].copy_(z.to(mu.dtype).view(-1, B, T).permute(1, 2, 0))
            if B < Bb:
                st.z[B:].zero_()
            if T < Q:
                st.z[:B, T:].zero_()
            st.mu[:B, :T].copy_(mu.transpose(1, 2))
            st.cond[:B, :T].copy_(cond.transpose(1, 2))
            if T < Q:
                st.mu[:B, T:].copy_(st.mu[:B, T - 1:T].expand(-1, Q - T, -1))
                st.cond[:B, T:].copy_(st.cond[:B, T - 1:T].expand(-1, Q - T, -1))
            st.spk[:B].copy_(spks)
            st.rows.copy_(d_rows)
            st.pos.view(2, Bb, Q).copy_(d_pos[None].expand(2, Bb, Q))
            st.extra["keys"].view(2, Bb, F).copy_(d_keys[None].expand(2, Bb, F))
            if st.extra.get("cnn_T") != T:
                st.cnn_idx.copy_(torch.arange(T, T + self.K1, device=device))
                st.extra["cnn_T"] = T
            if st.graph is not None and want_graph:
                st.graph.replay()
            else:
                self._program(st)
        keep = self.pool.keep
        for h, new in zip(handles, new_frames):
            frames, arr = new.tolist() + h.frames, np.concatenate((new, h._frames_array()))
            p = h.prompt_frames
            if len(frames) > p + keep:     # the dense trim's rule, on the frame list only
                frames, arr = frames[:p] + frames[-keep:], np.concatenate((arr[:p], arr[-keep:]))
            h.frames, h._arr, h._arr_of = frames, arr, frames
        return st.x[:B, :T].transpose(1, 2).clone()


class _Staging:
    """Host-side index buffers of one (batch bucket, query bucket): int32
    ``[rows (2Bb) | frames (Bb, Q) | keys (Bb, F) | noise columns (Bb*Q)]``, filled on the host and
    uploaded into one device buffer through ``uploads`` (pinned: the host never waits for the device)."""

    def __init__(self, Bb: int, Q: int, F: int, uploads: HostStaging):
        self.Bb, self.Q, self.F = Bb, Q, F
        self.o_pos = 2 * Bb
        self.o_keys = self.o_pos + Bb * Q
        self.o_noise = self.o_keys + Bb * F
        self.n = self.o_noise + Bb * Q
        self.arange = np.arange(max(Q, 1), dtype=np.int32)
        self.uploads = uploads
        self.host = np.empty(self.n, dtype=np.int32)
        self.dev = torch.empty(self.n, dtype=torch.int32, device=uploads.device)

    def begin(self, B: int, T: int):
        """Views (rows, frames, keys, noise columns) of the host buffer, keys cleared."""
        a = self.host
        keys = a[self.o_keys:self.o_noise].reshape(self.Bb, self.F)
        keys[:] = 0
        return (a[:self.o_pos], a[self.o_pos:self.o_keys].reshape(self.Bb, self.Q), keys,
                a[self.o_noise:self.o_noise + B * T].reshape(B, T))

    def upload(self, B: int, T: int):
        """Device views (rows, frames, keys, noise columns) of the buffer filled since ``begin``."""
        n = self.o_noise + B * T
        d = self.dev
        self.uploads.upload(self.host[:n], out=d[:n])
        return (d[:self.o_pos], d[self.o_pos:self.o_keys].view(self.Bb, self.Q),
                d[self.o_keys:self.o_noise].view(self.Bb, self.F), d[self.o_noise:self.o_noise + B * T])


def default_pool_frames(prompt_frames: int, keep: int = 100, query: int = 50) -> int:
    """Slot capacity: steady cache plus one chunk's frames, aligned to 16.

    A stream's frame list is trimmed to ``prompt_frames + keep`` after every chunk, and a chunk
    needs ``query`` (the query bucket) free frames, so this is all a slot ever uses when the
    admitted cache is at most the steady length. The attention walks every frame of the slot
    (masked ones too), so extra capacity costs attention time on every chunk.
    """
    return int(math.ceil((prompt_frames + keep + query) / 16) * 16)
