"""Whole-Euler CFM solves: all Euler steps of one chunk in one CUDA graph.

``WholeEulerSolver.solve`` has the contract of ``CausalConditionalCFM.forward_chunk``
(mu, projected speaker, cond, per-step caches -> mel, new caches) and runs:

* eagerly, the same code a graph would capture (CPU, or when graphs are off/out of
  budget/failed), or
* as one graph replay per chunk, keyed by (batch bucket, query-width bucket, cache-offset
  bucket, masked). Widths snap up to a bucket (x zero-padded, mu/cond replicate-padded,
  padded keys masked, padded queries reuse row 0's mask so they never produce NaN);
  offsets snap up on a grid anchored at the steady length (prompt + 100: the configured one,
  or with ``GraphConfig.anchor_at_trim`` the trimmed call's own), so the steady solve is never
  padded and runs unmasked; batches snap to a power of two (padded rows
  are independent and discarded) and larger batches run in groups.

Each step stages ``[x | mu | spk | cond]`` for the ``[cond rows | uncond rows]`` batch, runs
the body (fused, or the original module's ``forward_chunk``), writes that step's caches into
per-step output slices, then applies CFG and the Euler update with ``dt`` baked in (where Triton
runs, that glue is two kernels per step, ``kernels/euler_step.py``: 48 instead of 185 kernels per
batch-1 chunk, 8.86 vs 9.30 ms on the H200). The
adaLN tables of every step are computed once, outside the graph, under the solver's
precision. TF32 for the DiT GEMMs is on only inside ``solve``/capture (``precision``), so a
graph keeps the precision it was captured with.

One attention arena (steps, depth, rows, heads, query+offset, 2*head_dim), shared by every
fused-body graph, holds each step's ``[current(query) | cache(offset)]``: the input cache is
copied directly behind the current-chunk slot, so no concatenation happens inside the graph
and the steady new cache is a view of it. Growing the arena drops the graphs that view it.

Direct solves (``solve(trim=...)`` on the staged fused body with Triton attention, unmasked keys; on the
persistent block kernel from ``BLOCK_DIRECT_MIN_ROWS`` rows, or always with ``direct=True``):
the arena holds only the current frames; the attention reads each row's old frames from the
caller's own cache through a table of addresses and writes every frame it reads into the trimmed
successor (``kernels.tiled_attention.direct_attention``). The 8.4-GB fill of a batch-16 chunk and the
trim's copy after it are gone: the cache is read once and its successor written once.

Trimmed solves on the block kernel's arena (batch 1, ``ARENA_SUCCESSOR``, off by default: measured slower):
the old cache is still copied into the arena (the block kernel reads the arena faster than each stream's
cache in place), but its attention phase writes the trimmed successor as it reads, so no trim copy follows
the replay.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Literal, Sequence

import torch

from . import bulk_copy
from .fused_dit import SC_MSA, SH_MSA, FusedDiT, Modulation, dot_precision
from .kernels import dit_block, euler_step
from .kernels.tiled_attention import TABLE_WIDTH, StreamKV, stream_table, tail_table
from ..thinker.staging import HostStaging
from .precision import matmul_tf32

__all__ = ["GraphConfig", "SolveKey", "WholeEulerSolver"]

log = logging.getLogger(__name__)

# Trimmed solves on the persistent block kernel's arena write the successor from its attention phase
# (``dit_block.dit_blocks(successor=...)``) instead of trimming a copy after the replay. Off: on the H200
# (successor_probe_session22_run2_succ_h200.md) the writes cost the replay more than the trim copy they save,
# off / on, as called: B=1 8.05-8.23 / 8.28-8.34 ms, B=2 11.39-11.42 / 11.44-11.47 (replay B=1 7.25-7.27 /
# 7.55-7.60).
ARENA_SUCCESSOR = False
# From this many rows (batch 2 with CFG) the block kernel's trimmed solves read the old caches in place by
# default (its direct phase), below it they go through the arena. H200, as called (one run:
# successor_probe_session22_run2_succ_h200.md and _direct12_h200.md): arena B=1 8.05-8.23 / B=2 11.39-11.42 ms,
# direct 8.10-8.24 / 11.11-11.13.
BLOCK_DIRECT_MIN_ROWS = 200


@dataclass(frozen=True)
class GraphConfig:
    enabled: bool = True
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16)
    query_buckets: tuple[int, ...] = (50,)
    offset_bucket: int = 50
    offset_anchor: int | None = None      # steady cache length (prompt + 100); None: grid from 0
    max_graphs: int = 32
    # Eager solves on a side stream before each capture. One is enough: it compiles (or loads) the kernels and
    # makes cuBLAS's workspace, all a capture needs. H200, Code2Wav.prepare with 15 graphs, 3 / 2 / 1 warm-ups
    # (precapture_probe_session24_h200.md): 8.3 / 5.7 / 4.5 s, the stream's PCM bit-identical, no graph
    # captured mid-stream either way (the staged body's eager solves at batch 4-16 cost ~200 ms each, launches).
    warmups: int = 1
    # Once graphs are held, a chunk narrower than its query bucket (a final chunk: one per utterance) whose
    # arena would outgrow the current one (masked, it needs query + offset frames per row; a direct steady
    # solve only the query's) runs in row groups that fit instead: growing the arena drops every graph that
    # views it, and recapturing the precaptured set costs seconds in the middle of a stream
    # (stream_churn_bench). Full-width chunks still grow it: masked ones (an offset off the grid: a prompt that
    # is not the frontend's 6 s, without ``anchor_at_trim``) recur every round, so one regrowth costs less than
    # splitting them for good.
    # False: always grow, as before.
    keep_arena: bool = True
    # Final chunks' keys up to this batch bucket are precaptured even where their arena outgrows the steady
    # solves' (a masked chunk holds query + offset frames per row, a direct steady one only the query's), so
    # the arena is sized for them once, before any graph views it, and that many streams ending in one round
    # share one solve instead of ``keep_arena``'s groups of one. 0: only the final keys that fit the steady
    # arena (batch 1 with the default grid). H200, stream_churn_bench (16 slots, 60 rounds, medians of 2;
    # stream_churn_finals_session26_h200.md), 0 / 2 / 4 / 8: arena 0.98 / 1.10 / 2.20 / 4.39 GiB, all rounds
    # 5901 / 5671 / 5755 / 5528 ms, rounds with final chunks (median) 98.9 / 93.8 / 91.7 / 90.0 ms, their
    # solves 127 / 78 / 58 / 54 programs for 127 final rows; prepare +0.2 / +1.0 / +1.4 s.
    final_batch: int = 4
    # With ``solve(trim=(prompt, keep))``, anchor the offset grid at the call's own steady length prompt + keep
    # instead of ``offset_anchor``: a voice whose prompt is not the frontend's 6 s (a
    # ``PromptFeatures`` of another length) then solves its steady chunks unmasked and direct, like the
    # default voice, instead of masked through the arena (Q + offset frames per row: at batch 16 an arena of
    # ~9 GiB, grown mid-stream, dropping every graph). The same grid as ``offset_anchor`` for a 6-s prompt.
    # Code2Wav's solver turns it on; off, every call snaps onto ``offset_anchor``'s grid.
    anchor_at_trim: bool = False

    def __post_init__(self):
        if self.final_batch < 0:
            raise ValueError(f"GraphConfig.final_batch must be >= 0 (0: only the final keys that fit the steady "
                             f"arena), got {self.final_batch}")


@dataclass(frozen=True)
class SolveKey:
    batch: int
    query: int
    offset: int
    masked: bool
    direct: tuple[int, int] | None = None   # a direct solve's dropped frame span; None: through the arena
    succ: tuple[int, int] | None = None     # an arena solve whose block kernel writes the trimmed successor: its span
    # a direct solve whose rows hold caches of their own lengths (at most ``offset``: a stream's first and second
    # chunks joining steady ones); each row's old frames, successor and dropped span come from the tables
    rows: bool = False
    # a direct solve on the staged body reading each row's last old frames from its voice's prompt cache
    # (WholeEulerSolver.share_tail; rows whose caller passed no prompt cache read their own)
    tail: bool = False


def trim_span(frames: int, prompt_frames: int, keep: int) -> tuple[int, int]:
    """The frames [d0, d1) the flow's trim leaves out of a ``frames``-long estimator cache: past
    ``prompt_frames + keep`` frames it keeps the first ``prompt_frames`` and the last ``keep``
    (empty span otherwise)."""
    if frames <= prompt_frames + keep:
        return frames, frames
    return prompt_frames, frames - keep


def trim_frames(att: torch.Tensor, prompt_frames: int, keep: int) -> torch.Tensor:
    """An estimator attention cache (..., frames, 2D) without the frames ``trim_span`` drops: ``att`` itself
    when none are, else a copy."""
    d0, d1 = trim_span(att.shape[-2], prompt_frames, keep)
    if d0 == d1:
        return att
    return bulk_copy.cat([att[..., :d0, :], att[..., d1:, :]], att.dim() - 2)


@dataclass
class _Static:
    key: SolveKey
    z: torch.Tensor                     # (Bb, Q, 80) noise, time-major
    x: torch.Tensor                     # (Bb, Q, 80) Euler state
    mu: torch.Tensor                    # (Bb, Q, 80)
    spk: torch.Tensor                   # (Bb, 80)
    cond: torch.Tensor                  # (Bb, Q, 80)
    cnn_in: torch.Tensor                # (S, depth, 2Bb, 2C, K-1)
    cnn_out: torch.Tensor               # (S, depth, 2Bb, 2C, K-1)
    kv: torch.Tensor | None = None      # fused: arena view (S, depth, 2Bb, H, Q+O, 2D)
    att_in: torch.Tensor | None = None  # original: (S, depth, 2Bb, H, O, 2D)
    att_out: torch.Tensor | None = None  # original: (S, depth, 2Bb, H, Q+O, 2D)
    mask: torch.Tensor | None = None    # (2Bb, Q, Q+O)
    cnn_idx: torch.Tensor | None = None  # (K-1,) frames of the new CNN cache
    cnn_idx_width: int | None = None    # the chunk width _fill last made cnn_idx for
    xin: torch.Tensor | None = None
    hist: torch.Tensor | None = None
    hc: torch.Tensor | None = None      # fused: (2Bb, Q, C) step-invariant part of the input projection
    ws: object = None
    out: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None
    rows: torch.Tensor | None = None    # slot pool: (2Bb,) pool rows of the batch rows
    pos: torch.Tensor | None = None     # slot pool: (2Bb, Q) frames the current K/V go to
    streams: StreamKV | None = None     # direct solve: each row's own old cache and trimmed successor
    successor: StreamKV | None = None   # arena solve writing the trimmed successors (key.succ): their table
    extra: dict = field(default_factory=dict)


class WholeEulerSolver:
    """Solve one chunk's CFM with the original or fused body, eagerly or from graphs."""

    def __init__(self, cfm, body: Literal["original", "fused"] = "fused", attention: str = "triton-tf32",
                 tf32: bool = False, n_timesteps: int = 10, config: GraphConfig = GraphConfig(),
                 use_triton: bool | None = None, gemm: str = "cublas-split", attn_splits: int | None = None,
                 attn_block_m: int | None = None, split_k: int | None = None, block_kernel: bool | None = None,
                 step_kernels: bool | None = None, attn_tma: bool | None = None, attn_stages: int | None = None,
                 wide_gemm: bool | None = None, gemm_operands: str = "fp32", direct: bool | None = None):
        """``step_kernels``: the glue between two evaluations as two Triton kernels per step
        (``kernels/euler_step.py``) instead of ~12 torch ops; None (default) and True: whenever the
        fused body's Triton stages run; False: the torch ops (the reference the tests compare).
        ``wide_gemm``: ``FusedDiT``'s (None: Triton tile GEMMs with TF32 from WIDE_MIN_ROWS rows on CUDA).
        ``gemm_operands``: ``FusedDiT``'s ("fp16": the Triton GEMMs' operands stored as FP16;
        ``solver_from_knobs`` picks it where ``operand_range`` fits).
        ``direct``: trimmed solves read each stream's cache where it is (module docstring); None (default):
        wherever the staged body runs, and the persistent block kernel's from ``BLOCK_DIRECT_MIN_ROWS`` rows
        (batch 2); True: the block kernel's batch-1 solves too (as fast as the arena there since session 22's
        row copies, as called 8.10-8.24 vs 8.05-8.23 ms; 9.77 vs 8.46 in session 19); False: always through
        the arena."""
        self.cfm = cfm
        self.step_kernels = step_kernels
        self.direct = direct
        self._uploads: HostStaging | None = None     # _host_uploads
        self.dit = cfm.estimator
        self.body = body
        self.tf32 = bool(tf32)
        self.S = n_timesteps
        self.cfg_rate = float(cfm.inference_cfg_rate)
        self.config = config
        self.fused = (FusedDiT(self.dit, attention=attention, use_triton=use_triton, gemm=gemm,
                               attn_splits=attn_splits, attn_block_m=attn_block_m, attn_tma=attn_tma,
                               wide_gemm=wide_gemm, gemm_operands=gemm_operands,
                               attn_stages=attn_stages,
                               split_k=split_k, block_kernel=block_kernel) if body == "fused" else None)
        b0 = self.dit.blocks[0]
        self.depth, self.C = len(self.dit.blocks), self.dit.in_proj.out_features
        self.H, self.D = b0.attn.num_heads, b0.attn.head_dim
        self.K1 = b0.conv.block[1].kernel_size[0] - 1
        self.n_mel = self.dit.out_channels
        self._steps: dict[torch.device, tuple[list[float], list[float]]] = {}
        self._mods: dict[torch.device, list[Modulation]] = {}
        self._statics: dict[SolveKey, _Static] = {}
        self._arena: torch.Tensor | None = None
        self._pool = None
        self._graphs_off_reason: str | None = None if config.enabled else "disabled"
        self._logged: set[str] = set()
        self.captures = 0         # graphs captured, and arena growths that dropped graphs (for logs, benchmarks)
        self.arena_regrowths = 0
        # Direct solves on the staged body read each stream's last min(prompt, kept) old frames from its voice's
        # prompt cache (``solve(tails=)``, ``FlowCache.prompt_att``): one copy in L2 for all of a voice's rows
        # instead of one per row from HBM, a quarter of a steady cache's frames. Off until timed on a GPU
        # (benchmarks/gpu_pending.sh tail); decides the keys, so set it before the first solve.
        self.share_tail = False

    # ------------------------------------------------------------------ schedule
    def _schedule(self, device) -> tuple[list[float], list[float]]:
        """t_k and dt_k exactly as the reference solver accumulates them (float32 on the device)."""
        device = torch.device(device)
        if device not in self._steps:
            t_span = 1 - torch.cos(torch.linspace(0, 1, self.S + 1, device=device) * 0.5 * math.pi)
            ts, dts = [], []
            t, dt = t_span[0], t_span[1] - t_span[0]
            for step in range(1, self.S + 1):
                ts.append(float(t))
                dts.append(float(dt))
                t = t + dt
                if step < self.S:
                    dt = t_span[step + 1] - t
            self._steps[device] = (ts, dts)
        return self._steps[device]

    def _modulations(self, device) -> list[Modulation]:
        device = torch.device(device)
        if device not in self._mods:
            ts, _ = self._schedule(device)
            with matmul_tf32(self.tf32):
                self._mods[device] = [self.fused.modulation(torch.tensor([t], device=device)) for t in ts]
        return self._mods[device]

    # ------------------------------------------------------------------ keys
    def _log_once(self, what: str, msg: str) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(msg)

    @staticmethod
    def _snap(value: int, buckets: tuple[int, ...]) -> int | None:
        fits = [b for b in buckets if b >= value]
        return min(fits) if fits else None

    def snap_offset(self, L: int, anchor: int | None = None) -> int:
        """L snapped up onto the offset grid, anchored at ``anchor`` (default: the configured one)."""
        g, a = self.config.offset_bucket, self.config.offset_anchor if anchor is None else anchor
        if a is None:
            return max(g, math.ceil(L / g) * g) if L else 0
        return a + math.ceil((L - a) / g) * g if L > a else max(0, a - ((a - L) // g) * g)

    def key_for(self, B: int, T: int, L: int, anchor: int | None = None) -> SolveKey | None:
        Bb = self._snap(B, self.config.batch_buckets)
        if Bb is None:
            return None
        if self.body == "original":       # the original body takes no mask: exact widths only
            return SolveKey(Bb, T, L, False)
        Q = self._snap(T, self.config.query_buckets)
        if Q is None:
            return None
        O = self.snap_offset(L, anchor)
        return SolveKey(Bb, Q, O, masked=(Q != T or O != L))

    # ------------------------------------------------------------------ buffers
    def _arena_shape(self, key: SolveKey) -> tuple[int, ...]:
        frames = key.query if key.direct else key.query + key.offset
        return (self.S, self.depth, 2 * key.batch, self.H, frames, 2 * self.D)

    def rows_in_arena(self, B: int, T: int, L: int, mu: torch.Tensor, trim: tuple[int, int] | None = None,
                      caches: Sequence[torch.Tensor | None] | None = None, ragged: bool = False) -> int:
        """How many of B rows one solve takes (``GraphConfig.keep_arena``): B, or for a chunk narrower than its
        query bucket (or with narrower rows, ``ragged``, that the direct path cannot take) while graphs are
        held and B's arena would outgrow the current one, the largest batch bucket below B whose solve fits it
        (B when none does: then the arena grows, as without the rule)."""
        Q = self._snap(T, self.config.query_buckets)
        if Q is None:
            return B
        # rows narrower than their bucket hold query + offset frames each in a masked arena solve; full-width
        # ones are a steady shape that recurs: grow once rather than split for good
        narrow = T < Q or (ragged and not self.solve_key(B, T, L, mu, trim, caches, True).direct)
        if not narrow:
            return B
        if not (self.config.keep_arena and self.fused is not None and self._arena is not None and self.graphs()):
            return B
        have = self._arena.numel()
        for b in [B] + [k for k in sorted(self.config.batch_buckets, reverse=True) if k < B]:
            key = self.solve_key(b, T, L, mu, trim, caches, ragged)
            if math.prod(self._arena_shape(key)) <= have:
                return b
        return B

    def _arena_view(self, key: SolveKey, device) -> torch.Tensor:
        shape = self._arena_shape(key)
        n = math.prod(shape)
        if self._arena is None or self._arena.numel() < n or self._arena.device != torch.device(device):
            held = sum(s.graph is not None for s in self._statics.values())
            if held:    # eager statics (CPU, graphs off) are rebuilt at no cost: nothing worth a warning
                self.arena_regrowths += 1
                self._log_once(f"grow{n}", f"Whole-Euler arena grows to {n * 4 / 2**30:.2f} GiB; "
                                           f"dropping {held} graph(s) that view it")
            self._statics.clear()
            # The dropped graphs were the private pool's only users; capturing into a pool whose
            # use count fell to zero trips the caching allocator, so later graphs get a new pool.
            self._pool = None
            self._arena = torch.zeros(n, device=device)
        return self._arena[:n].view(shape)

    def _new_static(self, key: SolveKey, device) -> _Static:
        z = lambda *s, dtype=torch.float32: torch.zeros(*s, device=device, dtype=dtype)  # noqa: E731
        Bb, Q, O, R = key.batch, key.query, key.offset, 2 * key.batch
        cnn = (self.S, self.depth, R, 2 * self.C, self.K1)
        st = _Static(key=key, z=z(Bb, Q, self.n_mel), x=z(Bb, Q, self.n_mel), mu=z(Bb, Q, self.n_mel),
                     spk=z(Bb, self.n_mel), cond=z(Bb, Q, self.n_mel), cnn_in=z(*cnn), cnn_out=z(*cnn))
        if self.body == "fused":
            st.kv = self._arena_view(key, device)
            st.xin = z(R, Q, 4 * self.n_mel)
            st.hist = self.fused.new_hist(R, Q, device)
            st.hist.zero_()
            st.ws = self.fused.workspace(R, Q, device)
            st.out = z(R, Q, self.n_mel)
            st.hc = z(R, Q, self.C)
            st.cnn_idx = torch.arange(Q, Q + self.K1, device=device)
            if key.masked:
                st.mask = torch.ones(R, Q, Q + O, device=device, dtype=torch.bool)
            span = key.direct or key.succ
            if span:
                d0, d1 = span
                tables = torch.zeros(2 + key.tail, R, TABLE_WIDTH, device=device, dtype=torch.int64)  # [src, dst, tail]
                # the tables hold offsets from the arena, a pointer with an alignment the compiler knows
                kv = StreamKV(self._arena, tables[0], tables[1], O, Q + O - (d1 - d0), span, row_lengths=key.rows,
                              tail=tables[2] if key.tail else None)
                if key.direct:
                    st.streams = kv
                else:
                    st.successor = kv
                st.extra["tables"] = tables
        else:
            st.att_in = z(self.S, self.depth, R, self.H, O, 2 * self.D)
            st.att_out = z(self.S, self.depth, R, self.H, Q + O, 2 * self.D)
        return st

    # ------------------------------------------------------------------ the captured program
    def _program(self, st: _Static) -> None:
        if self.body == "fused":
            self._program_fused(st)
        else:
            self._program_original(st)

    def _program_fused(self, st: _Static) -> None:
        Bb, n = st.key.batch, self.n_mel
        ts, dts = self._schedule(st.x.device)
        mods = self._modulations(st.x.device)
        xin = st.xin
        xin[:Bb, :, n:2 * n].copy_(st.mu)
        xin[:Bb, :, 2 * n:3 * n].copy_(st.spk[:, None, :].expand(-1, st.key.query, -1))
        xin[:Bb, :, 3 * n:].copy_(st.cond)          # uncond rows keep zeros there
        st.x.copy_(st.z)
        if self._uses_step_kernels(st.x):
            self._steps_with_kernels(st, mods, dts)
            return
        r = self.cfg_rate
        for s in range(self.S):
            xin[:Bb, :, :n].copy_(st.x)
            xin[Bb:, :, :n].copy_(st.x)
            euler_step.cnn_roll_ref(st.hist, None, st.cnn_in[s], st.cnn_idx)
            self.fused.body(xin, mods[s], st.hist, st.kv[s], st.mask, st.ws, st.out, st.rows, st.pos,
                            streams=_at_step(st.streams, s), successor=_at_step(st.successor, s))
            # new CNN cache = history frames [valid, valid+K-1) (valid = real width, via index)
            euler_step.cnn_roll_ref(st.hist, st.cnn_out[s], None, st.cnn_idx)
            v = st.out
            st.x.add_(dts[s] * ((1.0 + r) * v[:Bb] - r * v[Bb:]))

    def _uses_step_kernels(self, x: torch.Tensor) -> bool:
        return self.fused is not None and self.step_kernels is not False and self.fused._triton(x)

    def _steps_with_kernels(self, st: _Static, mods: list[Modulation], dts: list[float]) -> None:
        """The same program with the glue between evaluations in two kernels per step
        (``kernels/euler_step.py``): the final linear, CFG, Euler update, next input projection
        and block-0 LN in one; the CNN-cache roll in the other; the staged x copies are gone."""
        f, ws, n, S = self.fused, st.ws, self.n_mel, self.S
        precision = dot_precision(st.x)
        if st.x.is_cuda and torch.cuda.get_device_capability(st.x.device)[0] < 8:
            precision = "ieee"      # no TF32 tensor cores before SM80: FMA dots
        rounded = dit_block.rounds(precision, st.x.device)
        fl = self.dit.final_layer.linear
        ctr = ws.ctr if f.runs_persistent(ws) else None
        f.embed_const(st.xin[..., n:], st.hc)

        def junction(dt: float, has_v: bool, nxt: Modulation | None) -> None:
            shift, scale = (None, None) if nxt is None else (nxt.blocks[:, 0, SH_MSA], nxt.blocks[:, 0, SC_MSA])
            euler_step.euler_junction(ws.norm, fl.weight, fl.bias, st.x, f.w_in_x, st.hc, shift, scale, ws.h,
                                      dt, self.cfg_rate, f.L.norm_eps, has_v=has_v, ctr=ctr,
                                      precision=precision, rounded=rounded)

        euler_step.cnn_roll(st.hist, None, st.cnn_in[0], st.cnn_idx)
        junction(0.0, False, mods[0])
        for s in range(S):
            f.blocks(mods[s], st.hist, st.kv[s], st.mask, ws, st.rows, st.pos, ctr_zeroed=ctr is not None,
                     streams=_at_step(st.streams, s), successor=_at_step(st.successor, s))
            euler_step.cnn_roll(st.hist, st.cnn_out[s], st.cnn_in[s + 1] if s + 1 < S else None, st.cnn_idx)
            junction(dts[s], True, mods[s + 1] if s + 1 < S else None)

    def _program_original(self, st: _Static) -> None:
        Bb = st.key.batch
        ts, dts = self._schedule(st.x.device)
        r = self.cfg_rate
        mu = st.mu.transpose(1, 2)
        cond = st.cond.transpose(1, 2)
        mu_in = torch.cat([mu, torch.zeros_like(mu)], 0)
        spk_in = torch.cat([st.spk, torch.zeros_like(st.spk)], 0)
        cond_in = torch.cat([cond, torch.zeros_like(cond)], 0)
        x = st.z.transpose(1, 2)
        O = st.key.offset
        for s in range(self.S):
            t = torch.full((2 * Bb,), ts[s], device=x.device)
            v, c, a = self.dit.forward_chunk(torch.cat([x, x], 0), mu_in, t, spk_in, cond_in,
                                             st.cnn_in[s], st.att_in[s] if O else None)
            st.cnn_out[s].copy_(c)
            st.att_out[s].copy_(a)
            x = x + dts[s] * ((1.0 + r) * v[:Bb] - r * v[Bb:])
        st.x.copy_(x.transpose(1, 2))

    # ------------------------------------------------------------------ graphs
    def _capture(self, st: _Static) -> None:
        stream = torch.cuda.Stream(device=st.x.device)
        stream.wait_stream(torch.cuda.current_stream(st.x.device))
        with torch.cuda.stream(stream):
            for _ in range(self.config.warmups):
                self._program(st)
        torch.cuda.current_stream(st.x.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._program(st)
        st.graph = g
        self.captures += 1

    def _static_for(self, key: SolveKey, device, want_graph: bool) -> _Static:
        st = self._statics.get(key)
        if st is not None and (st.graph is not None or not want_graph):
            return st
        if st is None:
            st = self._new_static(key, device)
        if self.body == "fused":
            self._modulations(device)      # tables are computed outside any graph
        if want_graph:
            n_graphs = sum(1 for s in self._statics.values() if s.graph is not None)
            if n_graphs >= self.config.max_graphs:
                self._log_once("budget", f"Whole-Euler graph budget ({self.config.max_graphs}) spent; "
                                         f"new shapes such as {key} run eagerly")
            else:
                try:
                    self._capture(st)
                except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly
                    st.graph = None
                    self._graphs_off_reason = f"capture failed: {exc}"
                    self._log_once("capture", f"Whole-Euler capture failed for {key} ({exc}); "
                                              "Whole-Euler graphs are off, solving eagerly")
        self._statics[key] = st
        return st

    def graphs(self) -> list[SolveKey]:
        return [k for k, s in self._statics.items() if s.graph is not None]

    def precapture_keys(self, batches: Sequence[int], query: int, offsets: Sequence[int], device="cuda",
                        trim: tuple[int, int] | None = None, final: bool = False,
                        row_lengths: bool = False, wide: int | None = None,
                        limit: int | None = None) -> list[SolveKey]:
        """The keys ``solve`` will take for B rows of width ``query`` over each offset (with the flow's
        ``trim``), each once, the largest arena first (a larger one would regrow it and drop the graphs).
        ``final``: also the keys of narrower (final) chunks over those offsets (masked: one key per
        bucket, whatever the width), for the batches whose arena fits the one the full-width keys need or
        that ``GraphConfig.final_batch`` covers (more rows solve in groups that fit, ``keep_arena``).
        ``row_lengths``: also the direct keys at the longest offset with rows of their own cache lengths
        (``SolveKey.rows``: first and second chunks joining steady ones), from batch 2. ``wide``: also the keys of
        final chunks wider than ``query`` (a final payload of more codes than a steady one's), up to ``wide``
        frames, a query bucket (``GraphConfig.query_buckets``): at that width and one frame narrower (masked:
        every narrower width), at the longest offset, for the batches ``GraphConfig.final_batch`` covers.
        ``limit``: at most that many keys, the wide finals' dropped first (then the narrow finals', the rows
        keys), so a budget never drops a steady chunk's key for them."""
        mu = torch.empty(1, self.n_mel, query, device=device)
        keys = dict.fromkeys(self.solve_key(B, query, L, mu, trim) for L in offsets for B in batches)
        if row_lengths and offsets:
            steady = (self.solve_key(B, query, max(offsets), mu, trim) for B in batches if B > 1)
            keys.update(dict.fromkeys(replace(k, rows=True) for k in steady if k.direct))
        size = lambda k: math.prod(self._arena_shape(k))  # noqa: E731
        if final and query > 1 and keys:
            most = max(map(size, keys))
            narrow = (self.solve_key(B, query - 1, L, mu, trim) for L in offsets for B in batches)
            keys.update(dict.fromkeys(k for k in narrow if size(k) <= most or k.batch <= self.config.final_batch))
        if final and wide and wide > query and offsets and self._snap(wide, self.config.query_buckets) == wide:
            wmu = torch.empty(1, self.n_mel, wide, device=device)
            small = [B for B in batches if B <= max(1, self.config.final_batch)]
            keys.update(dict.fromkeys(self.solve_key(B, T, max(offsets), wmu, trim) for B in small
                                      for T in (wide, wide - 1)))
        chosen = list(keys)[:limit] if limit is not None else list(keys)    # in the order they were added
        return sorted(chosen, key=size, reverse=True)

    def precapture(self, batches: Sequence[int], query: int, offsets: Sequence[int], device="cuda",
                   trim: tuple[int, int] | None = None, final: bool = False, row_lengths: bool = False,
                   wide: int | None = None) -> int:
        """Capture graphs ahead of the first chunk (``precapture_keys``); returns how many are held now.
        Stops where the budget is spent or a capture fails (the solver then runs eagerly, as ``solve``). A key
        whose buffers do not fit in device memory is skipped (logged once): the largest come first, so on a
        small device the arena is sized by the next key that fits, and ``keep_arena`` splits wider solves."""
        device = torch.device(device)
        if device.type != "cuda" or not self.config.enabled:
            return 0
        if device.index is None:    # as solve's inputs name it: the arena compares devices
            device = torch.device("cuda", torch.cuda.current_device())
        with torch.inference_mode(), matmul_tf32(self.tf32):
            room = max(0, self.config.max_graphs - len(self.graphs()))
            for key in self.precapture_keys(batches, query, offsets, device, trim, final, row_lengths, wide, room):
                if self._graphs_off_reason or len(self.graphs()) >= self.config.max_graphs:
                    break
                try:
                    self._static_for(key, device, want_graph=True)
                except torch.cuda.OutOfMemoryError:
                    self._log_once("precapture-oom", f"Whole-Euler precapture: {key} does not fit in device "
                                                     "memory, skipped (such solves run in row groups that fit, "
                                                     "or allocate when met)")
                    torch.cuda.empty_cache()
        return len(self.graphs())

    # ------------------------------------------------------------------ solve
    @torch.inference_mode()
    def solve(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
              cnn_cache: torch.Tensor | None = None, att_cache: torch.Tensor | Sequence[torch.Tensor] | None = None,
              temperature: float = 1.0, graph: bool = True, copy_out: bool = True,
              trim: tuple[int, int] | None = None, widths: Sequence[int] | None = None,
              tails: Sequence[torch.Tensor | None] | None = None,
              reuse: Sequence[torch.Tensor | None] | None = None):
        """mu, cond (B, 80, T); spks (B, 80) projected; caches (S, depth, 2B, ...) or None.

        Returns (mel (B, 80, T), new cnn cache (S, depth, 2B, 2C, K-1), new att cache
        (S, depth, 2B, H, T+L, 2D)). With ``copy_out=False`` the caches may be views of the
        solver's buffers, valid until the next ``solve``.

        ``trim`` = (prompt frames, kept frames): the new attention cache comes back trimmed like the
        flow's (``trim_span``) and in memory of its own. Where the direct path applies (module docstring)
        the old cache is then read in place and never copied.

        ``att_cache`` may also be B per-stream caches (S, depth, 2, H, L, 2D) (each stream's [cond |
        uncond] rows, one shape): they are copied straight into the solver's rows, and the new
        attention cache comes back in the same form, one (S, depth, 2, H, T+L, 2D) per stream (views
        with ``copy_out=False``), so a batch of streams needs no stacked copy of its largest state
        on the way in or out.

        Per-stream caches may differ in length (with ``trim``, where the direct path applies; else ValueError):
        a stream's first and second chunks (caches of prompt and prompt + 50 frames) then solve among the
        steady ones (``SolveKey.rows``, keyed at the longest). Each row reads the fixed noise at its own cache
        length and its old frames in place, and gets its own successor, trimmed by its own length.

        ``widths``: each row's own frame count (at most T; the fused body only): a row narrower than T is a
        stream's final chunk solved among full-width rows (mu / cond past its width are padding). Its mel
        frames past its width are padding, its caches are not computed (its CNN cache rows unspecified, its
        attention cache None in the per-stream form, unspecified rows in the stacked one): a final chunk's
        stream ends. Where the direct path applies every row keeps
        it (each row's current-frame count in its source table: one graph for any mix of widths); else the
        solve is masked, row by row.

        ``tails``: with per-stream caches and ``trim``, each stream's voice prompt cache (steps, depth, 2, heads,
        trim[0], 2D) or None (``FlowCache.prompt_att``): the stream's cache must end with that cache's last
        min(trim) frames (every trimmed descendant of the prompt's state does). Under ``share_tail`` a direct
        solve on the staged body reads those frames there (``SolveKey.tail``); elsewhere they are not used.

        ``reuse``: with per-stream caches, per stream None or memory for its successor where the direct path
        writes one: a cache of the successor's shape that no one needs any more, of the same voice (a retired
        cache of one of its streams), so it ends with the voice prompt's last min(trim) frames already; a
        ``SolveKey.tail`` solve then writes all but those (a quarter of a steady successor). It must share no
        memory with the caches read. Elsewhere (arena solves) it is not used.
        """
        B, _, T = mu.shape
        if widths is not None:
            widths = [int(w) for w in widths]
            if len(widths) != B or not all(1 <= w <= T for w in widths):
                raise ValueError(f"solve: widths {widths} for {B} rows of {T} frames; one per row, each in 1..{T}")
            if self.body != "fused" and min(widths) < T:
                raise ValueError("solve: rows of their own widths need the fused body (the original body takes "
                                 "no mask); solve each width apart")
            if min(widths) == T:
                widths = None
        ragged = widths is not None
        per_stream = isinstance(att_cache, (list, tuple))
        if per_stream:
            att_cache = _check_streams(att_cache, B, lengths_differ=trim is not None)
        if tails is not None:
            tails = self._check_tails(tails, att_cache if per_stream else None, B, trim)
        if reuse is not None and len(reuse) != B:
            raise ValueError(f"solve: {len(reuse)} reused successors for a batch of {B}; pass one per stream (or None)")
        # a stream's or the batch's cache: its shape (per-stream caches of several lengths: the longest)
        one = max(att_cache, key=lambda c: c.shape[4]) if per_stream else att_cache
        L = 0 if one is None else one.shape[4]
        if one is not None and one.shape[0] != self.S:
            raise ValueError(f"estimator cache has {one.shape[0]} steps, the solver {self.S}")
        big = min(B, max(self.config.batch_buckets))
        if big > 1:   # rows that would regrow the arena (dropping the graphs) run in groups that fit it
            big = self.rows_in_arena(big, T, L, mu, trim, att_cache if per_stream else [att_cache], ragged)
        if B > big:   # groups of the largest bucket, or of those that fit the arena
            outs = [self.solve(mu[i:i + big], spks[i:i + big], cond[i:i + big],
                               None if cnn_cache is None else _rows(cnn_cache, B, i, min(B, i + big)),
                               None if att_cache is None else (att_cache[i:i + big] if per_stream
                                                               else _rows(att_cache, B, i, min(B, i + big))),
                               temperature, graph, True, trim, None if widths is None else widths[i:i + big],
                               None if tails is None else tails[i:i + big],
                               None if reuse is None else reuse[i:i + big])
                    for i in range(0, B, big)]
            att = ([a for o in outs for a in o[2]] if per_stream else _cat_rows([o[2] for o in outs]))
            return torch.cat([o[0] for o in outs], 0), _cat_rows([o[1] for o in outs]), att
        device = mu.device
        if per_stream and any(c.shape[4] != L for c in att_cache):
            key = self._rows_key(B, T, L, mu, trim, att_cache, ragged)
            if not key.direct:
                raise ValueError(f"solve: per-stream caches of {sorted({c.shape[4] for c in att_cache})} frames "
                                 f"solve together only on the direct path, not under {key}; solve each length "
                                 "apart (WholeEulerSolver.joins_lengths says when they may join)")
            key = replace(key, rows=True)
        else:
            key = self.solve_key(B, T, L, mu, trim, att_cache if per_stream else [att_cache], ragged)
        want_graph = (graph and device.type == "cuda" and self._graphs_off_reason is None)
        with matmul_tf32(self.tf32):
            st = self._static_for(key, device, want_graph=False)
            self._fill(st, mu, spks, cond, cnn_cache, att_cache, temperature, B, T, L, widths)
            direct = (self._bind_streams(st, att_cache, B, per_stream, T, widths, trim, tails, reuse)
                      if key.direct or key.succ else None)
            if want_graph and st.graph is None:     # captured on real inputs: a direct graph's warm-up
                st = self._static_for(key, device, want_graph)  # runs read through the bound tables
            if st.graph is not None and want_graph:
                st.graph.replay()
            else:
                self._program(st)
        if direct is not None:
            mel, cnn, _ = self._read(st, B, T, 0, copy_out, with_att=False)
            return mel, cnn, direct
        mel, cnn, att = self._read(st, B, T, L, copy_out, per_stream, copy_att=trim is None)
        if widths is not None and per_stream:     # a narrow row's cache holds padding frames: none comes back
            att = [None if w < T else a for a, w in zip(att, widths)]
        return mel, cnn, att if trim is None else _trimmed(att, trim)

    def joins_lengths(self, T: int, caches: Sequence[torch.Tensor], mu: torch.Tensor, trim: tuple[int, int],
                      ragged: bool = False) -> bool:
        """Can ``solve`` take these per-stream caches of several lengths together (``SolveKey.rows``)? Every row
        group it would run (groups of the largest batch bucket) whose lengths differ must take the direct
        path, at full query width."""
        if self.fused is None or self._snap(T, self.config.query_buckets) != T:
            return False
        big = min(len(caches), max(self.config.batch_buckets))
        for i in range(0, len(caches), big):
            group = caches[i:i + big]
            lengths = {c.shape[4] for c in group}
            if len(lengths) > 1 and not self._rows_key(len(group), T, max(lengths), mu, trim, group, ragged).direct:
                return False
        return True

    def _rows_key(self, B: int, T: int, L: int, mu: torch.Tensor, trim: tuple[int, int],
                  caches: Sequence[torch.Tensor], ragged: bool) -> SolveKey:
        """The key per-stream caches of several lengths (the longest L) solve under: the steady length's
        (``sum(trim)``) where that is a direct key, else the longest's. The rows read their own lengths from
        the tables; the key's length only sizes the key splits, and a shorter row leaves its last ones empty.
        So a round of starting streams alone (second and first chunks) replays the steady rows graph that
        ``precapture(row_lengths=True)`` took, instead of capturing one mid-serving."""
        if L < sum(trim):
            steady = self.solve_key(B, T, sum(trim), mu, trim, caches, ragged)
            if steady.direct:
                return steady
        return self.solve_key(B, T, L, mu, trim, caches, ragged)

    def solve_key(self, B: int, T: int, L: int, mu: torch.Tensor, trim: tuple[int, int] | None = None,
                  caches: Sequence[torch.Tensor | None] | None = None, ragged: bool = False) -> SolveKey:
        """The key (and so the graph) ``solve`` runs B rows of width T over L cached frames under: the bucketed
        shape (an exact, unmasked one beyond the buckets), then with ``trim`` the direct path or the arena's
        successor writes where they apply. ``mu`` stands for the solve's inputs (device, dtype); ``caches``
        the old attention caches (None: assumed FP32 and aligned, as the flow's own are; ``precapture``).
        ``ragged``: some rows are narrower than T (``solve(widths=)``): the direct key as for full-width rows
        (its tables carry the widths), else a masked one (the mask does)."""
        anchor = sum(trim) if trim is not None and self.config.anchor_at_trim else None
        key = self.key_for(B, T, L, anchor)
        if key is None:   # beyond the buckets: an exact, unmasked shape
            key = SolveKey(B, T, L, False)
        if trim is not None and self._direct_applies(key, mu, caches):
            key = replace(key, direct=trim_span(key.query + key.offset, *trim), tail=self._tail_applies(key, mu))
        elif ragged:
            key = replace(key, masked=True)
        elif trim is not None and self._successor_applies(key, mu):
            key = replace(key, succ=trim_span(key.query + key.offset, *trim))
        return key

    def _direct_applies(self, key: SolveKey, mu: torch.Tensor, caches: Sequence[torch.Tensor | None] | None) -> bool:
        """Can this solve read its old cache in place (``direct_attention``)? The fused body with Triton
        attention (the staged body; the block kernel from ``BLOCK_DIRECT_MIN_ROWS`` rows or with ``direct=True``),
        an unmasked steady shape, and FP32 caches whose (heads, frames, 2D) blocks are contiguous and 64-byte
        aligned (what the attention's offset tables describe; ``caches`` None: assumed so)."""
        f = self.fused
        if (self.direct is False or f is None or key.masked or not key.offset or f.attention == "sdpa"
                or not f._triton(mu)):
            return False
        block = f.uses_block_kernel(2 * key.batch, key.query, mu.device)
        if self.direct is None and block and 2 * key.batch * key.query < BLOCK_DIRECT_MIN_ROWS:
            return False    # the block kernel's direct phase from BLOCK_DIRECT_MIN_ROWS rows (or with direct=True)
        return caches is None or all(c is not None and c.dtype == torch.float32 and c.data_ptr() % 64 == 0
                                     and c.stride()[3:] == (c.shape[4] * c.shape[5], c.shape[5], 1) for c in caches)

    def _tail_applies(self, key: SolveKey, mu: torch.Tensor) -> bool:
        """Does this direct solve read shared prompt tails (``share_tail``)? Only on the staged body, whose
        ``direct_attention`` takes them (the block kernel's direct phase does not)."""
        return self.share_tail and not self.fused.uses_block_kernel(2 * key.batch, key.query, mu.device)

    def _check_tails(self, tails, caches: list[torch.Tensor] | None, B: int,
                     trim: tuple[int, int] | None) -> list[torch.Tensor | None] | None:
        """``solve(tails=)``: one per stream, each None or a prompt cache of the streams' steps, depth, heads
        and head size over trim[0] frames, as long as its stream's cache at least (else ValueError). Without
        per-stream caches and a trim there is nothing to share them with: None."""
        tails = list(tails)
        if len(tails) != B:
            raise ValueError(f"solve: {len(tails)} prompt tails for a batch of {B}; pass one per stream (or None)")
        if caches is None or trim is None:
            return None
        for i, (t, c) in enumerate(zip(tails, caches)):
            if t is None:
                continue
            if (t.dim() != 6 or t.shape[:4] != c.shape[:4] or t.shape[5] != c.shape[5] or t.shape[4] != trim[0]
                    or t.dtype != c.dtype or t.device != c.device or c.shape[4] < min(trim)):
                raise ValueError(f"solve: stream {i}'s prompt tail {tuple(t.shape)} ({t.dtype}, {t.device}) does not "
                                 f"fit its cache {tuple(c.shape)} ({c.dtype}, {c.device}) trimmed at {trim}; expected "
                                 "the voice's prompt cache (steps, depth, 2, heads, trim[0] frames, 2*head_dim) "
                                 "(FlowCache.prompt_att), or None")
        return tails if any(t is not None for t in tails) else None

    def _successor_applies(self, key: SolveKey, mu: torch.Tensor) -> bool:
        """Does this trimmed arena solve run the block kernel, whose attention can write the successors
        (``ARENA_SUCCESSOR``)? An unmasked steady shape with an old cache, Triton attention, and the block
        kernel under the solver's precision (``FusedDiT.runs_persistent``: auto only with TF32)."""
        f = self.fused
        if (not ARENA_SUCCESSOR or f is None or key.masked or not key.offset or f.attention == "sdpa"
                or not f._triton(mu) or not f.uses_block_kernel(2 * key.batch, key.query, mu.device)):
            return False
        with matmul_tf32(self.tf32):
            return dot_precision(mu) == "tf32" or not f._block_auto

    def _bind_streams(self, st: _Static, att_cache, B: int, per_stream: bool, T: int,
                      widths: Sequence[int] | None = None, trim: tuple[int, int] | None = None,
                      tails: Sequence[torch.Tensor | None] | None = None,
                      reuse: Sequence[torch.Tensor | None] | None = None):
        """Point a direct solve's address tables at this call's caches and at new successors (their own
        memory, returned): row r < Bb is stream r's cond half, row Bb + r its uncond half; padding rows
        read stream 0 and write nothing. Each source row carries how many of the chunk's T frames its row
        attends (``widths``; default T); a narrower row writes no successor (None in a per-stream list). An
        arena solve writing successors (``st.successor``) reads nothing through the tables: its source rows
        stay empty. With ``SolveKey.rows`` each stream's successor is trimmed by its own length (``trim``).
        With ``SolveKey.tail`` each row's last min(trim) old frames are read from its stream's prompt cache in
        ``tails`` (a padding row: stream 0's), where there is one. A stream's successor goes into its ``reuse``
        tensor where one is given (checked: ``_reused``); with a tail, all but its last min(trim) frames."""
        tabled = st.streams or st.successor
        Bb, n_out = st.key.batch, tabled.n_out
        dev = st.x.device
        wide = [True] * B if widths is None else [w >= T for w in widths]
        spans = None
        if st.key.rows:     # per-stream caches of their own lengths (solve checked): their own trims
            Q = st.key.query
            spans = [trim_span(Q + c.shape[4], *trim) for c in att_cache]
        if per_stream:
            shapes = [(self.S, self.depth, 2, self.H,
                       n_out if spans is None else Q + c.shape[4] - (spans[i][1] - spans[i][0]), 2 * self.D)
                      for i, c in enumerate(att_cache)]
            if reuse is not None:
                reuse = self._reused(reuse, shapes, att_cache, tails, dev)
            outs = [None if not wide[i] else reuse[i] if reuse is not None and reuse[i] is not None
                    else torch.empty(shape, device=dev) for i, shape in enumerate(shapes)]
            src = lambda i, half: (att_cache[i], half)      # noqa: E731  (stream_table: the view [:, :, half])
            dst = lambda i, half: (outs[i], half)           # noqa: E731
        else:
            outs = torch.empty(self.S, self.depth, 2 * B, self.H, n_out, 2 * self.D, device=dev)
            src = lambda i, half: (att_cache, half * B + i)     # noqa: E731
            dst = lambda i, half: (outs, half * B + i)          # noqa: E731
        rows = [(r % Bb, r // Bb) for r in range(2 * Bb)]
        current = [widths[i] if widths is not None and i < B else T for i, _ in rows]
        base = tabled.base
        if st.streams is None:
            src = lambda i, half: None      # noqa: E731
        drops = None if spans is None else [spans[i] if i < B else (0, 0) for i, _ in rows]
        held = None
        if st.key.tail and per_stream and reuse is not None and tails is not None:
            held = [min(trim) if i < B and reuse[i] is not None and tails[i] is not None else 0 for i, _ in rows]
        tables = [stream_table([src(i, h) if i < B else src(0, 0) for i, h in rows], base, current),
                  stream_table([dst(i, h) if i < B and wide[i] else None for i, h in rows], base, drops=drops,
                               held=held)]
        if st.key.tail:
            tables.append(self._tail_table(rows, att_cache, B, per_stream, tails, trim, base))
        tables = torch.stack(tables)
        self._host_uploads(dev).upload(tables, out=st.extra["tables"])
        return outs

    @staticmethod
    def _reused(reuse, shapes, caches, tails, device) -> list[torch.Tensor | None]:
        """``solve(reuse=)``'s tensors, checked: each the successor's shape, contiguous FP32 on ``device``, 64-byte
        aligned (what the tables declare), and sharing no memory with the caches or prompt caches read."""
        read = {t.untyped_storage().data_ptr() for t in list(caches) + list(tails or ()) if t is not None}
        for i, (t, shape) in enumerate(zip(reuse, shapes)):
            if t is None:
                continue
            if (tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != torch.device(device)
                    or not t.is_contiguous() or t.data_ptr() % 64):
                raise ValueError(f"solve: stream {i}'s reused successor is a {t.dtype} {tuple(t.shape)} on {t.device} "
                                 f"(contiguous {t.is_contiguous()}); expected a contiguous, 64-byte aligned FP32 "
                                 f"{shape} on {device}")
            if t.untyped_storage().data_ptr() in read:
                raise ValueError(f"solve: stream {i}'s reused successor shares memory with a cache this solve reads; "
                                 "reuse only caches no stream holds any more")
        return list(reuse)

    def _tail_table(self, rows, att_cache, B: int, per_stream: bool, tails, trim, base) -> torch.Tensor:
        """The rows' ``StreamKV.tail`` table: row (stream i, half h) reads its last min(trim) old frames from
        ``tails[i]``'s half h (a padding row, which reads stream 0's cond half, from that one's); rows of streams
        without one read their own."""
        shared = min(trim)
        if tails is None or not per_stream:
            return tail_table([None] * len(rows), base, [0] * len(rows), shared)
        pick = [(i, h) if i < B else (0, 0) for i, h in rows]
        return tail_table([None if tails[i] is None else (tails[i], h) for i, h in pick], base,
                          [att_cache[i].shape[4] - shared for i, _ in pick], shared)

    def _host_uploads(self, device) -> HostStaging:
        """The solver's host -> device uploads (index and address tables): through pinned buffers, since a
        copy from pageable memory would wait for the device and staging could not run ahead of it."""
        if self._uploads is None or self._uploads.device != torch.device(device):
            self._uploads = HostStaging(device, slots=2)
        return self._uploads

    def _fill(self, st, mu, spks, cond, cnn_cache, att_cache, temperature, B, T, L, widths=None) -> None:
        """This call's inputs into the static buffers the graph reads: as few launches as may be, since the
        host time they take comes before the replay (~1 ms of a batch-16 solve as called, in session 61)."""
        Bb, Q, O = st.key.batch, st.key.query, st.key.offset
        if st.key.rows:     # each row's noise at its own cache length, one copy per run of equal lengths
            i = 0
            while i < B:
                n = att_cache[i].shape[4]
                j = next((k for k in range(i, B) if att_cache[k].shape[4] != n), B)
                z = self.cfm.noise(n, T, temperature, view=True).to(mu.dtype).transpose(1, 2)
                st.z[i:j, :T].copy_(z.expand(j - i, -1, -1))
                i = j
        else:
            z = self.cfm.noise(L, T, temperature, view=True).to(mu.dtype).transpose(1, 2)      # (1, T, 80)
            st.z[:B, :T].copy_(z.expand(B, -1, -1))
        st.mu[:B, :T].copy_(mu.transpose(1, 2))
        st.cond[:B, :T].copy_(cond.transpose(1, 2))
        for i, w in enumerate(widths or ()):
            if w < T:   # a narrow row's padding: replicated like a narrow chunk's (finite; never attended)
                st.mu[i, w:T].copy_(st.mu[i, w - 1:w].expand(T - w, -1))
                st.cond[i, w:T].copy_(st.cond[i, w - 1:w].expand(T - w, -1))
        if T < Q:   # x zero-padded, mu / cond replicate-padded
            st.z[:, T:].zero_()
            st.mu[:B, T:].copy_(st.mu[:B, T - 1:T].expand(-1, Q - T, -1))
            st.cond[:B, T:].copy_(st.cond[:B, T - 1:T].expand(-1, Q - T, -1))
        st.spk[:B].copy_(spks)
        if cnn_cache is None:
            st.cnn_in.zero_()
        elif B == Bb:
            st.cnn_in.copy_(cnn_cache)
        else:
            st.cnn_in[:, :, :B].copy_(cnn_cache[:, :, :B])
            st.cnn_in[:, :, Bb:Bb + B].copy_(cnn_cache[:, :, B:])
        copy = _copy_streams if isinstance(att_cache, list) else _copy_rows
        if self.body == "fused":
            if L and st.streams is None:   # the bulk of a chunk's copying (8.4 GB at batch 16): 16 bytes per access
                copy(st.kv[..., Q:Q + L, :], att_cache, B, Bb)
            if st.cnn_idx_width != T:    # made on the device (a host copy would wait for it), once per width
                torch.arange(T, T + self.K1, out=st.cnn_idx)
                st.cnn_idx_width = T
            if st.mask is not None:
                keys = torch.zeros(Bb, Q + O, dtype=torch.bool)
                keys[:, :T] = True
                for i, w in enumerate(widths or ()):
                    keys[i, w:T] = False
                keys[:, Q:Q + L] = True
                keys = torch.cat([keys, keys])      # the uncond rows as their cond rows
                # pinned staging: a copy from pageable memory would wait for the device
                self._host_uploads(st.mask.device).upload(keys[:, None, :].expand(st.mask.shape).contiguous(),
                                                          out=st.mask)
        elif L:
            copy(st.att_in, att_cache, B, Bb)

    def _read(self, st: _Static, B: int, T: int, L: int, copy_out: bool, per_stream: bool = False,
              copy_att: bool = True, with_att: bool = True):
        """(mel, cnn cache, attention cache) out of the static buffers; with ``copy_out`` in memory of their
        own (the attention cache only with ``copy_att`` too: a trim copies it anyway). ``with_att=False``: no
        attention cache (None; a direct solve wrote its own), so a padded batch picks no rows of it."""
        Bb, Q = st.key.batch, st.key.query
        mel = st.x[:B, :T].transpose(1, 2)
        cnn = _pick_rows(st.cnn_out, Bb, B)
        if not with_att:
            return mel.clone(), cnn.clone() if copy_out and B == Bb else cnn, None
        if per_stream:      # stream i's rows i and Bb + i, each a view or one copy
            if self.body == "original" or T == Q:
                full = st.att_out if self.body == "original" else st.kv[..., :Q + L, :]
                att = [full[:, :, i:i + Bb + 1:Bb] for i in range(B)]
                if copy_out and copy_att:
                    att = [bulk_copy.clone(a) for a in att]
            else:
                att = [bulk_copy.cat([st.kv[:, :, i:i + Bb + 1:Bb, :, :T], st.kv[:, :, i:i + Bb + 1:Bb, :, Q:Q + L]], 4)
                       for i in range(B)]
            return mel.clone(), cnn.clone() if copy_out and B == Bb else cnn, att
        if self.body == "fused":
            att = st.kv[..., : Q + L, :] if T == Q else bulk_copy.cat([st.kv[..., :T, :], st.kv[..., Q:Q + L, :]], 4)
        else:
            att = st.att_out
        att = _pick_rows(att, Bb, B)
        if copy_out:   # views of solver buffers become the caller's own tensors
            if B == Bb:
                cnn = cnn.clone()
                if copy_att and (self.body == "original" or T == Q):
                    att = bulk_copy.clone(att)
        return mel.clone(), cnn, att


def _at_step(streams: StreamKV | None, s: int) -> StreamKV | None:
    return None if streams is None else streams.at_step(s)


def _trimmed(att, trim: tuple[int, int]):
    """An attention cache (or per-stream list of them) trimmed like the flow's, in memory of its own."""
    if isinstance(att, list):
        return [None if a is None else _trimmed(a, trim) for a in att]
    out = trim_frames(att, *trim)
    return bulk_copy.clone(att) if out is att else out


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, B: int, Bb: int) -> None:
    """Rows [cond 0..B-1 | uncond 0..B-1] of src (S, depth, 2B, ...) into rows [0, B) and [Bb, Bb+B)
    of dst (S, depth, 2Bb, ...): one copy when the batch fills its bucket."""
    if B == Bb:
        bulk_copy.copy_(dst, src)
        return
    bulk_copy.copy_(dst[:, :, :B], src[:, :, :B])
    bulk_copy.copy_(dst[:, :, Bb:Bb + B], src[:, :, B:])


def _check_streams(caches, B: int, lengths_differ: bool = False) -> list[torch.Tensor]:
    """B per-stream caches of one shape (``lengths_differ``: but for their frame counts)."""
    caches = list(caches)
    if len(caches) != B:
        raise ValueError(f"{len(caches)} per-stream attention caches for a batch of {B}")
    shape = caches[0].shape
    for i, c in enumerate(caches):
        same = (c.shape[:4] + c.shape[5:] == shape[:4] + shape[5:]) if lengths_differ else c.shape == shape
        if c.dim() != 6 or c.shape[2] != 2 or not same:
            but = " but for the frames" if lengths_differ else ""
            raise ValueError(f"per-stream attention cache {i} has shape {tuple(c.shape)}; every stream's must be "
                             f"(steps, depth, 2, heads, frames, 2*head_dim) and equal to stream 0's {tuple(shape)}"
                             f"{but}")
    return caches


def _copy_streams(dst: torch.Tensor, caches: list[torch.Tensor], B: int, Bb: int) -> None:
    """Stream i's [cond | uncond] rows (S, depth, 2, ...) into rows i and Bb + i of dst (S, depth, 2Bb, ...)."""
    for i, c in enumerate(caches):
        bulk_copy.copy_(dst[:, :, i:i + Bb + 1:Bb], c)


def _pick_rows(t: torch.Tensor, Bb: int, B: int) -> torch.Tensor:
    """Rows [cond 0..B-1 | uncond Bb..Bb+B-1] of a (S, depth, 2Bb, ...) buffer (a view when B == Bb)."""
    if B == Bb:
        return t
    return bulk_copy.cat([t[:, :, :B], t[:, :, Bb:Bb + B]], 2)


def _rows(cache: torch.Tensor, B: int, i: int, j: int) -> torch.Tensor:
    return bulk_copy.cat([cache[:, :, i:j], cache[:, :, B + i:B + j]], 2)


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    conds, unconds = [], []
    for p in parts:
        h = p.shape[2] // 2
        conds.append(p[:, :, :h])
        unconds.append(p[:, :, h:])
    return bulk_copy.cat(conds + unconds, 2)


def solver_from_knobs(cfm, extra: dict | None, device, config: GraphConfig = GraphConfig(),
                      n_timesteps: int = 10, env: dict | None = None):
    """Resolve the connector knobs for ``cfm`` on ``device`` and build the matching solver.

    Returns ``(solver, choice)``; the choice is logged once here and is what ``inspect`` reports.
    Graphs are used only on CUDA (the solver runs the same program eagerly elsewhere).
    """
    from .fused_dit import supports_fused_body
    from .knobs import device_facts, log_choice, resolve_code2wav

    ok, why = supports_fused_body(cfm.estimator)
    fit = None
    if ok and torch.device(device).type == "cuda":      # only there can the GEMM operands be FP16
        from .operand_range import operand_range

        rng = operand_range(cfm.estimator, n_timesteps)
        fit = rng.fits_fp16
        log.info("Code2Wav CFM: %s", rng.describe())
    facts = device_facts(device, att_cache_dtype=torch.float32, layout_supported=ok, operands_fit_fp16=fit)
    choice = resolve_code2wav(extra, facts, env)
    if not ok and choice.body == "original" and why:
        log.info("fused DiT body not eligible: %s", why)
    log_choice(choice)
    attention = choice.attention or "sdpa"
    solver = WholeEulerSolver(cfm, body=choice.body, attention=attention, tf32=choice.tf32,
                              n_timesteps=n_timesteps, gemm_operands=choice.gemm_operands,
                              config=config if torch.device(device).type == "cuda"
                              else GraphConfig(**{**config.__dict__, "enabled": False}))
    return solver, choice
