"""Tiled FP32 attention with TF32 (or IEEE) tensor-core dots and online softmax.

One program per (batch row, head, block of BLOCK_M queries) walks the keys in
BLOCK_N tiles keeping a running max and denominator (flash-attention style), so
the (nq, nk) score matrix never reaches device memory. With ``splits`` > 1 the keys
are also divided among programs (flash-decoding): at batch 1 a chunk has only
rows x heads x query-blocks = 32 programs, too few for 132 SMs, so each split writes
its partial (acc, max, denominator), and the split of each query block that finishes last
combines them (``counters``: a count per query block, ``dit_ops.last_arrival``), or without
counters a small second kernel does. Semantics follow
``F.scaled_dot_product_attention`` with a boolean mask: True means "attend",
scores are scaled by D^-0.5, and a query row whose keys are all masked returns 0.

K and V may be strided views of a packed ``[k|v]`` cache (last dim 2*D), and
``kv_rows`` lets query row b read K/V batch row ``kv_rows[b]`` (pooled caches). With
``tma=True`` (Hopper, opt-in) the K/V tiles of a contiguous packed cache arrive through a tensor
descriptor instead of pointer loads (``attn_tile``'s TMA branch).

``direct_attention`` serves batch rows whose old frames live in separate tensors (each stream's own
estimator cache): a small table gives each row's offset from one base pointer, so the caller never
gathers the caches into one buffer, and the kernel writes every key tile it reads into the row's
trimmed successor, the next chunk's cache (``euler_graph``'s direct solves).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from . import AVAILABLE, interpreting

# As ``dit_block.RUNTIME_INTS``: the direct attention's integers that change from launch to launch (Euler step,
# layer), the query count and the trim span are not specialised. Specialised, the default voice's precapture
# compiled this kernel 81 times on a cold cache (120 s: step and layer each 0, 1 or other, times three cache
# lengths and three batch forms; triton_compile_census_session24_before_h200.md), 9 times since (9 s,
# _session24_h200.md). The cache lengths and key counts stay specialised (a few compiles per batch form):
# unspecialised, the batch-16 replay took 24.74-24.77 ms against 24.62-24.63 (specialize_probe_session24_run2_
# h200.md; B=1 and B=8 alike).
DIRECT_RUNTIME_INTS = ("step", "layer", "nq", "drop0", "drop1")

if AVAILABLE:
    import triton
    import triton.language as tl

    from .dit_ops import last_arrival, store_operand

    @triton.jit
    def _mask_tile(M, b, offs_m, offs_n, row_ok, k_hi, smb, smm, smn, KEY_MASK: tl.constexpr):
        """Mask bytes of key columns offs_n (0 past k_hi): one (BLOCK_N,) key vector with KEY_MASK,
        else the (BLOCK_M, BLOCK_N) tile."""
        col_ok = offs_n < k_hi
        if KEY_MASK:
            mk = tl.load(M + b * smb + offs_n * smn, mask=col_ok, other=0)
        else:
            mk = tl.load(M + b * smb + offs_m[:, None] * smm + offs_n[None, :] * smn,
                         mask=row_ok[:, None] & col_ok[None, :], other=0)
        return mk

    @triton.jit
    def _query_block(Q, b, h, mblk, sqb, sqh, sqm, sqd, nq, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr):
        """Query block ``mblk`` of (row b, head h) and the empty online-softmax state for it: (query offsets,
        valid rows, q, running max, denominator, accumulator). The running max starts finite so an
        all-masked tile gives exp(-inf) = 0, never NaN."""
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_D)
        row_ok = offs_m < nq
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=row_ok[:, None], other=0.0)
        return (offs_m, row_ok, q, tl.full([BLOCK_M], -1.0e30, tl.float32), tl.zeros([BLOCK_M], tl.float32),
                tl.zeros([BLOCK_M, HEAD_D], tl.float32))

    @triton.jit
    def _scores(q, kt, keep, m_i, l_i, scale, PRECISION: tl.constexpr):
        """One key tile's softmax weights p (unnormalised, against the new running max) and the factor
        alpha that rescales what was accumulated before; returns (p, alpha, new max, new denominator)."""
        s = tl.where(keep, tl.dot(q, kt, input_precision=PRECISION) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)

    @triton.jit
    def _weigh_values(p, v, acc, alpha, PRECISION: tl.constexpr, PV16: tl.constexpr):
        """acc * alpha + p @ v (FP16 operands with PV16, see ``attn_tile``)."""
        if PV16:
            v16 = tl.clamp(v, -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float16)
            pv = tl.dot(p.to(tl.float16), v16)
        else:
            pv = tl.dot(p, v, input_precision=PRECISION)
        return acc * alpha[:, None] + pv

    @triton.jit
    def _finish(acc, m_i, l_i, b, h, mblk, split, H, O, PACC, PML, sob, soh, som, sod, offs_m, row_ok, nq,
                HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, ROUND_OUT: tl.constexpr,
                CNT, LAST_COMBINE: tl.constexpr):
        """Store a query block's output (one key split), or its partial for ``_attn_combine``.

        LAST_COMBINE: the split that stores its partial last also combines them (``_last_combine``), so no
        second kernel (or, in the block kernel, no combine phase and its barrier) is needed."""
        offs_d = tl.arange(0, HEAD_D)
        if SPLITS == 1:
            denom = tl.where(l_i > 0, l_i, 1.0)
            store_operand(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
                          tl.where((l_i > 0)[:, None], acc / denom[:, None], 0.0), row_ok[:, None], ROUND_OUT)
        else:
            # partial (unnormalised acc, running max, denominator) of this key range; contiguous
            # scratch (B, H, SPLITS, nq, D) and (B, H, SPLITS, nq, 2), combined by _attn_combine
            part = ((b * H + h) * SPLITS + split).to(tl.int64) * nq
            tl.store(PACC + (part + offs_m[:, None]) * HEAD_D + offs_d[None, :], acc, mask=row_ok[:, None])
            tl.store(PML + (part + offs_m) * 2, m_i, mask=row_ok)
            tl.store(PML + (part + offs_m) * 2 + 1, l_i, mask=row_ok)
            if LAST_COMBINE:
                _last_combine(b, h, mblk, H, O, PACC, PML, sob, soh, som, sod, nq, HEAD_D, BLOCK_M, SPLITS,
                              ROUND_OUT, CNT)

    @triton.jit
    def _last_combine(b, h, mblk, H, O, PACC, PML, sob, soh, som, sod, nq,
                      HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, ROUND_OUT: tl.constexpr,
                      CNT):
        """Count this split's partial of query block ``mblk`` of (row b, head h) in; the SPLITS-th to arrive
        combines them (CNT: one int32 per query block, 0 on entry, 0 after; ``dit_ops.last_arrival``)."""
        if last_arrival(CNT, (b * H + h) * tl.cdiv(nq, BLOCK_M) + mblk, SPLITS):
            attn_combine_tile(b, h, mblk, PACC, PML, O, sob, soh, som, sod, H, nq, HEAD_D, BLOCK_M, SPLITS,
                              ROUND_OUT)

    @triton.jit
    def stream_row(BASE, TABLE, b, h, step, layer, n_frames, HEAD_D: tl.constexpr):
        """Row b's (step, layer, head h) frames through its ``StreamKV`` table row [offset from BASE, step
        stride, layer stride, present, ...] (elements, ``TABLE_WIDTH`` = 8 per row): (pointer to its frame 0,
        present). The offsets are
        declared multiples of 16 elements (``stream_table`` checks): a pointer made from a loaded integer
        carries no alignment, and its loads and stores would not vectorise."""
        ptr = BASE + tl.multiple_of(tl.load(TABLE + b * 8) + step * tl.load(TABLE + b * 8 + 1)
                                    + layer * tl.load(TABLE + b * 8 + 2) + h.to(tl.int64) * n_frames * (2 * HEAD_D),
                                    16)
        return ptr, tl.load(TABLE + b * 8 + 3) != 0

    @triton.jit
    def tail_row(BASE, TAILS, b, h, step, layer):
        """Row b's (step, layer, head h) shared tail through its ``StreamKV.tail`` row [offset from BASE, step
        stride, layer stride, start, head stride, ...] (elements): (pointer to the tail's first frame, the old
        frame it stands for). The offset and strides are multiples of 16 elements (``tail_table`` checks)."""
        ptr = BASE + tl.multiple_of(tl.load(TAILS + b * 8) + step * tl.load(TAILS + b * 8 + 1)
                                    + layer * tl.load(TAILS + b * 8 + 2) + h.to(tl.int64) * tl.load(TAILS + b * 8 + 4),
                                    16)
        return ptr, tl.load(TAILS + b * 8 + 3).to(tl.int32)

    @triton.jit
    def _kept_frames(offs_n, w_hi, f0, drop0, drop1, HEAD_D: tl.constexpr):
        """(which of keys offs_n, at frames f0 + offs_n of the concatenated [current | old] order, go into a
        trimmed successor, their element offsets there): keys below w_hi, frames [drop0, drop1) left out and
        the ones after them moved down. (w_hi, a scalar, stands in for a scalar-and-vector mask, which
        Triton's interpreter mistypes.)"""
        f = f0 + offs_n
        kept = (offs_n < w_hi) & ((f < drop0) | (f >= drop1))
        return kept, tl.where(f < drop0, f, f - (drop1 - drop0)).to(tl.int64) * (2 * HEAD_D)

    @triton.jit
    def _write_kept(dst, kt, v, offs_n, w_hi, f0, drop0, drop1, HEAD_D: tl.constexpr, w_end=None):
        """Key tile (kt (HEAD_D, BLOCK_N), v (BLOCK_N, HEAD_D)) from the registers the dots use into a trimmed
        successor at ``dst`` (``_kept_frames``): the ``ROW_COPY=False`` form. ``w_end``: successor frames from
        there on are left as they are (a reused successor already holds them)."""
        offs_d = tl.arange(0, HEAD_D)
        kept, fo = _kept_frames(offs_n, w_hi, f0, drop0, drop1, HEAD_D)
        if w_end is not None:
            kept = kept & (fo < w_end.to(tl.int64) * (2 * HEAD_D))
        tl.store(dst + fo[None, :] + offs_d[:, None], kt, mask=kept[None, :])
        tl.store(dst + fo[:, None] + HEAD_D + offs_d[None, :], v, mask=kept[:, None])

    @triton.jit
    def _load_kept(src, offs_n, w_hi, f0, drop0, drop1, HEAD_D: tl.constexpr):
        """The ``ROW_COPY`` form of ``_write_kept``, first half: the kept frames' packed [k|v] rows (BLOCK_N,
        2*HEAD_D) read again from the source (frames 2*HEAD_D apart from ``src``; an L2 hit, the tile was
        just loaded) in a plain row-major layout, so the store is 16-byte vectors along whole frames, not the
        scattered elements of the dot operands' layouts. Issued before the tile's dots, stored after them
        (``_store_kept``), so its latency hides under them."""
        offs_c = tl.arange(0, 2 * HEAD_D)
        kept, fo = _kept_frames(offs_n, w_hi, f0, drop0, drop1, HEAD_D)
        rows = tl.load(src + offs_n.to(tl.int64)[:, None] * (2 * HEAD_D) + offs_c[None, :], mask=kept[:, None],
                       other=0.0)
        return rows, kept, fo

    @triton.jit
    def _load_kept_at(at, offs_n, w_hi, f0, drop0, drop1, w_end, HEAD_D: tl.constexpr):
        """``_load_kept`` with each key's [k|v] row at its own pointer ``at`` (a shared tail's keys elsewhere), and
        successor frames from ``w_end`` on left as they are (``_write_kept``)."""
        offs_c = tl.arange(0, 2 * HEAD_D)
        kept, fo = _kept_frames(offs_n, w_hi, f0, drop0, drop1, HEAD_D)
        kept = kept & (fo < w_end.to(tl.int64) * (2 * HEAD_D))
        rows = tl.load(at[:, None] + offs_c[None, :], mask=kept[:, None], other=0.0)
        return rows, kept, fo

    @triton.jit
    def _store_kept(dst, rows, kept, fo, HEAD_D: tl.constexpr):
        offs_c = tl.arange(0, 2 * HEAD_D)
        tl.store(dst + fo[:, None] + offs_c[None, :], rows, mask=kept[:, None])

    @triton.jit
    def attn_tile(b, h, mblk, split, H, Q, K, V, O, M, KVR, PACC, PML,
                  sqb, sqh, sqm, sqd,
                  skb, skh, skn, skd,
                  svb, svh, svn, svd,
                  sob, soh, som, sod,
                  smb, smm, smn,
                  nq, nk, scale, keys_per_split,
                  HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_KVR: tl.constexpr, PRECISION: tl.constexpr,
                  SPLITS: tl.constexpr, ROUND_OUT: tl.constexpr = False, KV_DESC=None, TMA: tl.constexpr = False,
                  KEY_MASK: tl.constexpr = False, PV16: tl.constexpr = False, CNT=None,
                  LAST_COMBINE: tl.constexpr = False, SUCC_DST=None, succ_present=False, drop0=0, drop1=0,
                  SUCC: tl.constexpr = False, ROW_COPY: tl.constexpr = True):
        """Query block ``mblk`` x key split ``split`` of (row b, head h) of H heads (also a phase
        of the persistent block kernel). LAST_COMBINE: the last split to finish combines (``_finish``).

        SUCC (unmasked keys in [current | old] order, as the block kernel's arena holds them): every key
        tile read is also written into the row's trimmed successor at SUCC_DST (if ``succ_present``;
        frames [drop0, drop1) left out) by one of the query blocks, in turn, as ``direct_tile`` does, so
        the arena needs no trim copy after the solve. Packed [k|v] frames only (V = K + HEAD_D, frames
        ``skn`` = 2*HEAD_D apart); ``ROW_COPY``: see ``_load_kept``.

        TMA: K and V tiles arrive through KV_DESC, a tensor descriptor over the packed cache as a
        (rows*heads*nk, 2*HEAD_D) matrix with (BLOCK_N, HEAD_D) boxes (key tile = box (row0 + start, 0),
        its values box (row0 + start, HEAD_D)). Keys past this (row, head)'s nk then belong to the
        next head (or are zero past the end): their scores are masked to -inf, so their p is 0.

        KEY_MASK: the mask does not vary over queries (query stride 0, e.g. the slot pool's one key row
        per batch row): each key tile loads one BLOCK_N vector instead of a BLOCK_M x BLOCK_N tile
        (``tiled_attention(key_mask=True)``).

        PV16: P @ V with FP16 operands (for FP16 GEMM operands, ``pv16_for``): p in (0, 1] and v rounded
        to 10 mantissa bits, TF32's precision (p below 6.1e-5 keeps fewer, at most 3e-8 absolute; v
        saturates at +-65504); an FP16 B operand may be N-major, so V needs no per-tile
        transpose (TF32 wgmma takes only K-major operands)."""
        kvb = b
        if HAS_KVR:
            kvb = tl.load(KVR + b)
        offs_d = tl.arange(0, HEAD_D)
        offs_m, row_ok, q, m_i, l_i, acc = _query_block(Q, b, h, mblk, sqb, sqh, sqm, sqd, nq, HEAD_D, BLOCK_M)
        k_base = K + kvb.to(tl.int64) * skb + h * skh
        v_base = V + kvb.to(tl.int64) * svb + h * svh
        row0 = (kvb * H + h) * nk
        k_lo = split * keys_per_split
        k_hi = tl.minimum(k_lo + keys_per_split, nk)
        if HAS_MASK:
            # The mask of key tile j is loaded while tile j-1 is processed: the compiler pipelines
            # only the K/V loads, so a mask loaded where it is used stalled every tile for a memory
            # latency (H200, 32 rows: 60 vs 36 us per block with vs without a mask).
            mk_next = _mask_tile(M, b, offs_m, k_lo + tl.arange(0, BLOCK_N), row_ok, k_hi, smb, smm, smn, KEY_MASK)
        for start in range(k_lo, k_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            col_ok = offs_n < k_hi
            if SUCC:    # this query block's turn at writing the tile, or no keys (w_hi)
                w_hi = tl.where(succ_present & ((start // BLOCK_N) % tl.cdiv(nq, BLOCK_M) == mblk), k_hi, k_lo)
                if ROW_COPY:
                    rows, kept, fo = _load_kept(k_base, offs_n, w_hi, 0, drop0, drop1, HEAD_D)
            if HAS_MASK:
                mk = mk_next
                mk_next = _mask_tile(M, b, offs_m, offs_n + BLOCK_N, row_ok, k_hi, smb, smm, smn, KEY_MASK)
            if TMA:
                kt = tl.trans(KV_DESC.load([row0 + start, 0]))
            else:
                kt = tl.load(k_base + offs_n[None, :] * skn + offs_d[:, None] * skd, mask=col_ok[None, :], other=0.0)
            keep = row_ok[:, None] & col_ok[None, :]
            if HAS_MASK:
                if KEY_MASK:
                    keep = keep & (mk != 0)[None, :]
                else:
                    keep = keep & (mk != 0)
            p, alpha, m_i, l_i = _scores(q, kt, keep, m_i, l_i, scale, PRECISION)
            if TMA:
                v = KV_DESC.load([row0 + start, HEAD_D])
            else:
                v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=col_ok[:, None], other=0.0)
            acc = _weigh_values(p, v, acc, alpha, PRECISION, PV16)
            if SUCC:
                if ROW_COPY:
                    _store_kept(SUCC_DST, rows, kept, fo, HEAD_D)
                else:
                    _write_kept(SUCC_DST, kt, v, offs_n, w_hi, 0, drop0, drop1, HEAD_D)
        _finish(acc, m_i, l_i, b, h, mblk, split, H, O, PACC, PML, sob, soh, som, sod, offs_m, row_ok, nq,
                HEAD_D, BLOCK_M, SPLITS, ROUND_OUT, CNT, LAST_COMBINE)

    @triton.jit
    def _attn_fwd(Q, K, V, O, M, KVR, PACC, PML,
                  sqb, sqh, sqm, sqd,
                  skb, skh, skn, skd,
                  svb, svh, svn, svd,
                  sob, soh, som, sod,
                  smb, smm, smn,
                  nq, nk, scale, keys_per_split, KV_DESC, CNT,
                  HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_KVR: tl.constexpr, PRECISION: tl.constexpr,
                  SPLITS: tl.constexpr, TMA: tl.constexpr, KEY_MASK: tl.constexpr, ROUND_OUT: tl.constexpr,
                  PV16: tl.constexpr, LAST_COMBINE: tl.constexpr):
        attn_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2) // SPLITS, tl.program_id(2) % SPLITS,
                  tl.num_programs(1), Q, K, V, O, M, KVR, PACC, PML, sqb, sqh, sqm, sqd, skb, skh, skn, skd,
                  svb, svh, svn, svd, sob, soh, som, sod, smb, smm, smn, nq, nk, scale, keys_per_split,
                  HEAD_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_KVR, PRECISION, SPLITS, ROUND_OUT, KV_DESC, TMA, KEY_MASK,
                  PV16, CNT, LAST_COMBINE)

    @triton.jit
    def _key_tile(q, m_i, l_i, acc, base, desc, first, hi, w_hi, f0, row_ok, dst, drop0, drop1, scale,
                  HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PV16: tl.constexpr,
                  TMA: tl.constexpr, ROW_COPY: tl.constexpr, tail=None, t_start=0, TAIL: tl.constexpr = False,
                  w_end=0):
        """One key tile, keys [first, first + BLOCK_N) below ``hi`` of a packed [k|v] source (frames 2*HEAD_D apart
        from ``base``; with TMA through ``desc``), folded into the running softmax; its keys below ``w_hi`` also go
        into the trimmed successor at ``dst`` (their frames f0 + key of the [current | old] order).
        TAIL (pointer loads): keys from ``t_start`` on are read at ``tail`` instead (key t_start there), a copy of
        them that every row of a voice shares (``StreamKV.tail``), so they come from L2, not each row's cache;
        and successor frames from ``w_end`` on are not written (a reused successor holds them already)."""
        offs_d = tl.arange(0, HEAD_D)
        offs_n = first + tl.arange(0, BLOCK_N)
        col_ok = offs_n < hi
        if TAIL:
            at = tl.where(offs_n >= t_start, tail + (offs_n - t_start).to(tl.int64) * (2 * HEAD_D),
                          base + offs_n.to(tl.int64) * (2 * HEAD_D))
            if ROW_COPY:
                rows, kept, fo = _load_kept_at(at, offs_n, w_hi, f0, drop0, drop1, w_end, HEAD_D)
            kt = tl.load(at[None, :] + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        else:
            if ROW_COPY:
                rows, kept, fo = _load_kept(base, offs_n, w_hi, f0, drop0, drop1, HEAD_D)
            if TMA:
                kt = tl.trans(desc.load([first, 0]))
            else:
                kt = tl.load(base + offs_n[None, :] * (2 * HEAD_D) + offs_d[:, None], mask=col_ok[None, :],
                             other=0.0)
        p, alpha, m_i, l_i = _scores(q, kt, row_ok[:, None] & col_ok[None, :], m_i, l_i, scale, PRECISION)
        if TAIL:
            v = tl.load(at[:, None] + HEAD_D + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        elif TMA:
            v = desc.load([first, HEAD_D])
        else:
            v = tl.load(base + offs_n[:, None] * (2 * HEAD_D) + HEAD_D + offs_d[None, :], mask=col_ok[:, None],
                        other=0.0)
        acc = _weigh_values(p, v, acc, alpha, PRECISION, PV16)
        if ROW_COPY:
            _store_kept(dst, rows, kept, fo, HEAD_D)
        elif TAIL:
            _write_kept(dst, kt, v, offs_n, w_hi, f0, drop0, drop1, HEAD_D, w_end)
        else:
            _write_kept(dst, kt, v, offs_n, w_hi, f0, drop0, drop1, HEAD_D)
        return m_i, l_i, acc

    @triton.jit
    def _direct_keys(q, m_i, l_i, acc, base, lo, hi, f0, row_ok, dst, present, mblk, n_mblk, drop0, drop1, scale,
                     HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PV16: tl.constexpr,
                     TMA: tl.constexpr, ROW_COPY: tl.constexpr = True, tail=None, t_start=0,
                     TAIL: tl.constexpr = False, w_end=0):
        """Keys [lo, hi) of one packed [k|v] source (frames 2*HEAD_D apart from ``base``) folded into the
        running softmax. Their frame in the concatenated [current | old] order is f0 + key. Where the row's
        successor is ``present``, each tile also goes to ``dst`` at its frame in the trimmed successor (frames
        [drop0, drop1) left out), written by one of the n_mblk query blocks that all read it, in turn.
        TMA: the tiles arrive through a descriptor built here over the source's first ``hi`` frames (Hopper;
        frames past ``hi`` read as zeros, masked like the pointer loads' ``other``). TAIL: keys from ``t_start``
        on read at ``tail``, successor frames from ``w_end`` on not written (``_key_tile``)."""
        if TMA:
            desc = tl.make_tensor_descriptor(base, shape=[hi, 2 * HEAD_D], strides=[2 * HEAD_D, 1],
                                             block_shape=[BLOCK_N, HEAD_D])
        else:
            desc = base         # unused: pointer loads
        for start in range(lo, hi, BLOCK_N):
            # keys below w_hi are written (_write_kept)
            w_hi = tl.where(present & ((start // BLOCK_N) % n_mblk == mblk), hi, lo)
            m_i, l_i, acc = _key_tile(q, m_i, l_i, acc, base, desc, start, hi, w_hi, f0, row_ok, dst, drop0, drop1,
                                      scale, HEAD_D, BLOCK_N, PRECISION, PV16, TMA, ROW_COPY, tail, t_start, TAIL,
                                      w_end)
        return m_i, l_i, acc

    @triton.jit
    def _direct_keys_one_loop(q, m_i, l_i, acc, cur, src, k_lo, k_hi, n_cur, cur_keys, nq, row_ok, dst,
                              present, mblk, n_mblk, drop0, drop1, scale, HEAD_D: tl.constexpr,
                              BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PV16: tl.constexpr,
                              ROW_COPY: tl.constexpr = True, tail=None, t_start=0, TAIL: tl.constexpr = False,
                              w_end=0):
        """``_direct_keys`` over both sources in one loop (pointer loads only): split keys [k_lo, k_hi), of which
        [0, cur_keys) are this chunk's frames (the first n_cur valid) and the rest row b's old ones. The splits
        cut whole tiles of each source (``direct_key_splits``), so each tile comes from one source, picked per
        tile; the tiles arrive in the two loops' order (the same sums, bit for bit), but the loads pipeline
        across the sources' boundary instead of draining and refilling there. TAIL: old keys from ``t_start`` on
        read at ``tail``, successor frames from ``w_end`` on not written (``_key_tile``)."""
        cur_hi = tl.minimum(k_hi, n_cur)                    # the two loops' bounds, in each source's keys
        old_lo = tl.maximum(k_lo, cur_keys) - cur_keys
        old_hi = k_hi - cur_keys
        n_cur_tiles = tl.cdiv(tl.maximum(cur_hi - k_lo, 0), BLOCK_N)
        n_tiles = n_cur_tiles + tl.cdiv(tl.maximum(old_hi - old_lo, 0), BLOCK_N)
        for t in range(0, n_tiles):
            now = t < n_cur_tiles
            base = tl.where(now, cur, src)
            first = tl.where(now, k_lo + t * BLOCK_N, old_lo + (t - n_cur_tiles) * BLOCK_N)  # in its source
            hi = tl.where(now, cur_hi, old_hi)
            w_hi = tl.where(present & ((first // BLOCK_N) % n_mblk == mblk), hi, 0)
            m_i, l_i, acc = _key_tile(q, m_i, l_i, acc, base, base, first, hi, w_hi, tl.where(now, 0, nq), row_ok,
                                      dst, drop0, drop1, scale, HEAD_D, BLOCK_N, PRECISION, PV16, False, ROW_COPY,
                                      tail, tl.where(now, hi, t_start), TAIL, w_end)
        return m_i, l_i, acc

    @triton.jit
    def direct_tile(b, h, mblk, split, H, Q, CUR, BASE, SRC, DST, O, PACC, PML,
                    sqb, sqh, sqm, sqd, scb, sch, sob, soh, som, sod,
                    step, layer, nq, n_old, n_out, drop0, drop1, scale, keys_per_split, cur_keys,
                    HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                    SPLITS: tl.constexpr, ROUND_OUT: tl.constexpr, PV16: tl.constexpr, TMA: tl.constexpr = False,
                    CNT=None, LAST_COMBINE: tl.constexpr = False, ROW_COPY: tl.constexpr = True,
                    ROW_LENGTHS: tl.constexpr = False, ONE_LOOP: tl.constexpr = False, TAILS=None,
                    TAIL: tl.constexpr = False):
        """``direct_attention``'s unit (also a phase of the persistent block kernel): query block ``mblk`` x
        key split ``split`` of (row b, head h). The keys are this chunk's [k|v] (CUR) followed by row b's own
        old frames, found through its SRC table row [offset from BASE, step stride, layer stride, present]
        (elements; its last entry: how many of this chunk's nq frames row b attends, the rest being
        padding); every key tile read is also written into row b's trimmed successor (DST row, if
        present) by one of the query blocks. The key splits count the current frames as ``cur_keys`` keys
        (``direct_key_splits``: nq rounded up to a key tile, so every split walks whole tiles of each source).
        ROW_LENGTHS: each row's old-frame count, successor length and dropped span come from its table rows
        instead of n_old / n_out / drop0 / drop1 (which then only size the key splits: n_old the longest); a row
        with fewer old frames leaves its last splits empty (the combine weighs an empty split 0).
        TAIL: row b's old frames from its TAILS row's start on are read from the copy its voice's rows share
        (``StreamKV.tail``; pointer loads), not from its own cache, and the last frames of its successor that
        its DST row's eighth entry counts are not written (a reused successor holds them: ``stream_table(held=)``)."""
        if ROW_LENGTHS:     # a stream's first chunks (shorter caches) in a steady solve
            n_old = tl.load(SRC + b * 8 + 4).to(tl.int32)
            n_out = tl.load(DST + b * 8 + 4).to(tl.int32)
            drop0 = tl.load(DST + b * 8 + 5).to(tl.int32)
            drop1 = tl.load(DST + b * 8 + 6).to(tl.int32)
        offs_m, row_ok, q, m_i, l_i, acc = _query_block(Q, b, h, mblk, sqb, sqh, sqm, sqd, nq, HEAD_D, BLOCK_M)
        src, _ = stream_row(BASE, SRC, b, h, step, layer, n_old, HEAD_D)
        dst, present = stream_row(BASE, DST, b, h, step, layer, n_out, HEAD_D)
        # a narrower row (a stream's final chunk in a steady solve) attends its own first n_cur frames only
        n_cur = tl.minimum(tl.load(SRC + b * 8 + 3), nq).to(tl.int32)
        if TAIL:
            tail, t_start = tail_row(BASE, TAILS, b, h, step, layer)
            w_end = n_out - tl.load(DST + b * 8 + 7).to(tl.int32)
        else:
            tail, t_start, w_end = src, n_old, n_out
        n_mblk = tl.cdiv(nq, BLOCK_M)
        # split coordinates: the current frames span cur_keys (>= nq) keys, the old ones follow
        k_lo = split * keys_per_split
        k_hi = tl.minimum(k_lo + keys_per_split, cur_keys + n_old)
        cur = CUR + b.to(tl.int64) * scb + h * sch
        # the current frames (queries and keys alike), then the old ones: each source loads with its own
        # contiguous strides; the softmax does not depend on the order the keys arrive in
        if ONE_LOOP and not TMA:
            m_i, l_i, acc = _direct_keys_one_loop(q, m_i, l_i, acc, cur, src, k_lo, k_hi, n_cur, cur_keys, nq,
                                                  row_ok, dst, present, mblk, n_mblk, drop0, drop1, scale, HEAD_D,
                                                  BLOCK_N, PRECISION, PV16, ROW_COPY, tail, t_start, TAIL, w_end)
        else:
            m_i, l_i, acc = _direct_keys(q, m_i, l_i, acc, cur, k_lo, tl.minimum(k_hi, n_cur), 0, row_ok, dst,
                                         present, mblk, n_mblk, drop0, drop1, scale, HEAD_D, BLOCK_N, PRECISION, PV16,
                                         TMA, ROW_COPY)
            m_i, l_i, acc = _direct_keys(q, m_i, l_i, acc, src, tl.maximum(k_lo, cur_keys) - cur_keys,
                                         k_hi - cur_keys, nq, row_ok, dst, present, mblk, n_mblk, drop0, drop1, scale,
                                         HEAD_D, BLOCK_N, PRECISION, PV16, TMA, ROW_COPY, tail, t_start, TAIL,
                                         w_end)
        _finish(acc, m_i, l_i, b, h, mblk, split, H, O, PACC, PML, sob, soh, som, sod, offs_m, row_ok, nq,
                HEAD_D, BLOCK_M, SPLITS, ROUND_OUT, CNT, LAST_COMBINE)

    @triton.jit(do_not_specialize=DIRECT_RUNTIME_INTS)
    def _attn_direct(Q, CUR, BASE, SRC, DST, O, PACC, PML,
                     sqb, sqh, sqm, sqd, scb, sch, sob, soh, som, sod,
                     step, layer, nq, n_old, n_out, drop0, drop1, scale, keys_per_split, cur_keys, CNT,
                     HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                     SPLITS: tl.constexpr, ROUND_OUT: tl.constexpr, PV16: tl.constexpr, TMA: tl.constexpr,
                     LAST_COMBINE: tl.constexpr, ROW_COPY: tl.constexpr, ROW_LENGTHS: tl.constexpr,
                     ONE_LOOP: tl.constexpr = False, TAILS=None, TAIL: tl.constexpr = False):
        direct_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2) // SPLITS, tl.program_id(2) % SPLITS,
                    tl.num_programs(1), Q, CUR, BASE, SRC, DST, O, PACC, PML, sqb, sqh, sqm, sqd, scb, sch,
                    sob, soh, som, sod, step, layer, nq, n_old, n_out, drop0, drop1, scale, keys_per_split, cur_keys,
                    HEAD_D, BLOCK_M, BLOCK_N, PRECISION, SPLITS, ROUND_OUT, PV16, TMA, CNT, LAST_COMBINE, ROW_COPY,
                    ROW_LENGTHS, ONE_LOOP, TAILS, TAIL)

    @triton.jit
    def attn_combine_tile(b, h, mblk, PACC, PML, O, sob, soh, som, sod, H, nq,
                          HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr,
                          ROUND_OUT: tl.constexpr = False):
        """Merge the SPLITS partials of query block ``mblk`` of (row b, head h)."""
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_D)
        row_ok = offs_m < nq
        base = (b * H + h) * SPLITS
        m = tl.full([BLOCK_M], -1.0e30, tl.float32)
        for s in tl.static_range(SPLITS):
            m = tl.maximum(m, tl.load(PML + ((base + s) * nq + offs_m).to(tl.int64) * 2, mask=row_ok, other=-1.0e30))
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
        for s in tl.static_range(SPLITS):
            row = ((base + s) * nq + offs_m).to(tl.int64)
            w = tl.exp(tl.load(PML + row * 2, mask=row_ok, other=-1.0e30) - m)
            l_sum += w * tl.load(PML + row * 2 + 1, mask=row_ok, other=0.0)
            acc += w[:, None] * tl.load(PACC + row[:, None] * HEAD_D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        denom = tl.where(l_sum > 0, l_sum, 1.0)
        store_operand(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
                      tl.where((l_sum > 0)[:, None], acc / denom[:, None], 0.0), row_ok[:, None], ROUND_OUT)

    @triton.jit
    def _attn_combine(PACC, PML, O, sob, soh, som, sod, H, nq,
                      HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, ROUND_OUT: tl.constexpr):
        attn_combine_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2), PACC, PML, O, sob, soh, som, sod,
                          H, nq, HEAD_D, BLOCK_M, SPLITS, ROUND_OUT)


# ``direct_attention``'s successor writes: each kept key tile's [k|v] frames copied as whole rows read again from
# the source (``_load_kept``) instead of stored from the dot operands' registers (``_write_kept``). Whole-solve
# replays on the H200 (successor_probe_session22_run2_rowcopy_h200.md), staged direct body, registers / rows:
# B=4 14.77-14.84 / 15.01-15.03 ms, B=16 24.65-24.69 / 25.50 (the extra L2 reads cost more than the scattered
# stores there); the persistent block kernel takes rows (``dit_block.ROW_COPY``).
SUCCESSOR_ROW_COPY = False


def key_splits(nk: int, splits: int, block_n: int) -> tuple[int, int]:
    """(splits, keys per split) with each split walking a whole number of key tiles
    (fewer splits when the keys run out)."""
    tiles = -(-nk // block_n)
    splits = max(1, min(splits, tiles))
    per_split = -(-tiles // splits) * block_n
    return -(-nk // per_split), per_split


# The direct attention's key splits count the current frames as whole key tiles (``direct_key_splits``), so a
# split that starts among the old frames starts on a tile of theirs: batch 4 (2 splits), 50 + 400 keys in 64-key
# tiles, split 0 then walks 1 + 3 tiles and split 1 4, where splitting the 450 keys evenly gave 1 + 4 and 4.
DIRECT_ALIGNED_SPLITS = True


def direct_key_splits(nq: int, n_old: int, splits: int, block_n: int,
                      aligned: bool | None = None) -> tuple[int, int, int]:
    """(splits, keys per split, keys the current frames count as) of ``direct_tile``'s key splits over nq
    current and n_old old frames: the current frames rounded up to a whole key tile with ``aligned``
    (default ``DIRECT_ALIGNED_SPLITS``), else as they are."""
    aligned = DIRECT_ALIGNED_SPLITS if aligned is None else aligned
    cur = -(-nq // block_n) * block_n if aligned else nq
    s, per = key_splits(cur + n_old, splits, block_n)
    return s, per, cur


def check_counters(counters: torch.Tensor, n: int, device: torch.device, who: str) -> None:
    """``counters`` can count the key splits of ``n`` query blocks in (``_last_combine``): a contiguous int32
    tensor on ``device`` with at least n elements. It must be zero on entry; the kernel leaves it zero."""
    if counters.dtype != torch.int32 or counters.device != torch.device(device) or counters.numel() < n \
            or not counters.is_contiguous():
        raise ValueError(f"{who}: counters must be a contiguous int32 tensor of >= {n} zeros on {device} (one per "
                         f"query block), got {counters.dtype} {tuple(counters.shape)} on {counters.device}")


def pv16_for(out: torch.Tensor, precision: str) -> bool:
    """P @ V with FP16 operands by default exactly when the output is an FP16 GEMM operand under TF32
    (``FusedDiT(gemm_operands="fp16")``): the same 10-bit operand rounding the TF32 dot applies."""
    return out.dtype == torch.float16 and precision == "tf32"


def packed_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The (Bk*H*nk, 2D) matrix that k and v are the two halves of, when they are views of one
    contiguous packed ``[k|v]`` cache (Bk, H, nk, 2D) with a 16-byte aligned start (what a TMA
    descriptor needs); else None."""
    Bk, H, nk, D = k.shape
    if (k.stride() != (H * nk * 2 * D, nk * 2 * D, 2 * D, 1) or v.stride() != k.stride()
            or v.data_ptr() - k.data_ptr() != D * k.element_size() or k.data_ptr() % 16):
        return None
    return k.as_strided((Bk * H * nk, 2 * D), (2 * D, 1))


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    kv_rows: torch.Tensor | None = None, precision: str = "tf32",
                    out: torch.Tensor | None = None, block_m: int = 32, block_n: int = 64,
                    num_warps: int = 4, num_stages: int = 2, splits: int = 1, tma: bool = False,
                    key_mask: bool = False, round_out: bool = False, pv16: bool | None = None,
                    counters: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T D^-0.5, mask) v for fp32 q (B,H,nq,D), k/v (Bk,H,nk,D); mask (B,nq,nk) bool.

    ``out`` (B,H,nq,D) may be any strided view (e.g. (B,nq,H,D) transposed) so the
    caller's projection GEMM reads it without a copy. ``tma``: fetch K/V tiles through a tensor
    descriptor (``attn_tile``'s TMA branch; needs k and v to be the halves of one packed cache, ``packed_kv``).
    ``round_out``: store the output rounded to nearest TF32 (the operand of a TF32 GEMM that truncates).
    An FP16 ``out`` takes the output as an FP16 GEMM operand (``dit_ops.store_operand``). ``pv16``: P @ V
    with FP16 operands (``attn_tile``'s PV16); None: ``pv16_for(out, precision)``. ``counters``: with key
    splits, the last split of each query block to finish combines the partials in the same launch instead
    of a second kernel (``check_counters``: int32, zero on entry, left zero).
    """
    if not AVAILABLE:
        raise RuntimeError("tiled_attention needs Triton; use the SDPA fallback")
    if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
        raise TypeError(f"tiled_attention is FP32 only, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if precision not in ("tf32", "ieee"):
        raise ValueError(f"precision must be 'tf32' or 'ieee', got {precision!r}")
    B, H, nq, D = q.shape
    nk = k.shape[2]
    if D & (D - 1) or D < 16:
        raise ValueError(f"head dim {D} must be a power of two >= 16 for tensor-core dots")
    if out is None:
        out = torch.empty_like(q)
    if out.dtype not in (torch.float32, torch.float16):
        raise TypeError(f"tiled_attention: out must be float32 or float16 (a GEMM operand), got {out.dtype}")
    if mask is not None:
        if mask.shape != (B, nq, nk):
            raise ValueError(f"mask shape {tuple(mask.shape)} != (B, nq, nk) = {(B, nq, nk)}")
        m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        ms = m.stride()
    else:
        m, ms = q, (0, 0, 0)
    kvr = kv_rows.to(torch.int32) if kv_rows is not None else q
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    splits, per_split = key_splits(nk, splits, block_n)
    mblocks = triton.cdiv(nq, block_m)
    last = splits > 1 and counters is not None
    if last:
        check_counters(counters, B * H * mblocks, q.device, "tiled_attention")
    if splits > 1:
        pacc = torch.empty(B, H, splits, nq, D, device=q.device, dtype=torch.float32)
        pml = torch.empty(B, H, splits, nq, 2, device=q.device, dtype=torch.float32)
    else:
        pacc = pml = q
    desc = None
    if tma:
        kv2d = packed_kv(k, v)
        if kv2d is None:
            raise ValueError("tiled_attention(tma=True): k and v must be the two halves of one contiguous packed "
                             f"[k|v] cache with a 16-byte aligned start; got strides {k.stride()} / {v.stride()}")
        from triton.tools.tensor_descriptor import TensorDescriptor
        desc = TensorDescriptor.from_tensor(kv2d, block_shape=[block_n, D])
    _attn_fwd[(B, H, mblocks * splits)](q, k, v, out, m, kvr, pacc, pml,
                                        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *ms,
                                        nq, nk, float(D) ** -0.5, per_split, desc, counters if last else kvr,
                                        HEAD_D=D, BLOCK_M=block_m, BLOCK_N=block_n,
                                        HAS_MASK=mask is not None, HAS_KVR=kv_rows is not None,
                                        PRECISION=precision, SPLITS=splits, TMA=tma,
                                        KEY_MASK=bool(key_mask) and mask is not None and ms[1] == 0,
                                        ROUND_OUT=round_out, num_warps=num_warps, num_stages=num_stages,
                                        PV16=pv16_for(out, precision) if pv16 is None else pv16,
                                        LAST_COMBINE=last)
    if splits > 1 and not last:
        _attn_combine[(B, H, mblocks)](pacc, pml, out, *out.stride(), H, nq,
                                       HEAD_D=D, BLOCK_M=block_m, SPLITS=splits, ROUND_OUT=round_out, num_warps=4)
    return out


@dataclass(frozen=True)
class StreamKV:
    """Where ``direct_attention`` finds each batch row's old [k|v] frames and writes its trimmed successor.

    ``src`` / ``dst``: (R, ``TABLE_WIDTH``) int64 device tables (``stream_table``), row r = [offset of row r's
    (step 0, layer 0, head 0, frame 0) element from ``base``, step stride, layer stride, last, frames, drop0,
    drop1, 0] (in elements; each row's (heads, frames, 2D) block contiguous; ``frames``: the view's frame
    count, ``drop0``/``drop1``: the row's own dropped span, read with ``row_lengths``). ``dst``'s fourth
    entry: present (a row not present is not
    written: padding rows, and narrow rows, whose successor would lack their padding frames); ``src``'s: how
    many of this chunk's frames the row attends (``stream_table(current=)``; fewer than the chunk's for a
    stream's final chunk solved with full-width rows, its frames past that being padding).
    Frames [drop0, drop1) of the concatenated [current | old] order are left out of the successor (the
    flow's trim), which holds ``n_out`` frames. ``step``: the Euler step the tables are read at.
    ``row_lengths``: the rows' old frames, successor lengths and dropped spans differ (a stream's first and
    second chunks, whose caches are shorter, joining a steady solve): the kernels read them from the tables,
    and ``n_old`` is the longest row's (it sizes the key splits), ``n_out`` and ``drop`` that row's.
    ``tail``: an (R, ``TABLE_WIDTH``) table (``tail_table``) of where each row's last old frames are also
    found in memory that the rows of one voice share (the prompt's last frames, which every trimmed stream
    cache ends with: ``Flow``'s ``FlowCache.prompt_att``); the kernel reads them there (from L2, once for
    all the voice's rows) instead of from the row's own cache. Pointer loads only (not with ``tma``)."""

    base: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    n_old: int
    n_out: int
    drop: tuple[int, int]
    step: int = 0
    row_lengths: bool = False
    tail: torch.Tensor | None = None

    def at_step(self, step: int) -> "StreamKV":
        return replace(self, step=step)


# Entries per row of a ``StreamKV`` table (the kernels index rows by this literal).
TABLE_WIDTH = 8


def stream_table(rows: list[torch.Tensor | tuple[torch.Tensor, int] | None], base: torch.Tensor,
                 current: Sequence[int] | None = None,
                 drops: Sequence[tuple[int, int]] | None = None, held: Sequence[int] | None = None) -> torch.Tensor:
    """The (R, ``TABLE_WIDTH``) table of ``StreamKV`` for R row views (steps, depth, heads, frames, 2D)
    relative to ``base``; a pair (t, j) stands for the view ``t[:, :, j]`` of a (steps, depth, rows, heads,
    frames, 2D) tensor (read off its pointer and strides: a solve's tables cost no view per row); None: a row
    not present (not written). Offsets and strides must be multiples of 16 elements (64 bytes), what the
    kernel declares to the compiler. ``current`` makes a source table: each row's count of this chunk's
    frames it attends (its fourth entry); without it, a destination table (the fourth entry: present). Each
    row's fifth entry is its view's frame count; ``drops`` (a destination table's) the rows' own dropped
    spans (sixth and seventh; default none); ``held`` (a destination table's) how many of each row's last
    frames its view already holds, which a kernel reading a shared tail (``StreamKV.tail``) then does not
    write (eighth; default 0)."""
    if current is not None and len(current) != len(rows):
        raise ValueError(f"stream_table: {len(current)} current-frame counts for {len(rows)} rows")
    if drops is not None and len(drops) != len(rows):
        raise ValueError(f"stream_table: {len(drops)} dropped spans for {len(rows)} rows")
    if held is not None and len(held) != len(rows):
        raise ValueError(f"stream_table: {len(held)} held-frame counts for {len(rows)} rows")
    if current is not None and any(int(c) < 1 for c in current):
        raise ValueError(f"stream_table: current-frame counts {list(current)}; every row attends at least one "
                         "frame of its chunk")
    if base.dtype != torch.float32 or base.data_ptr() % 64:
        raise ValueError(f"stream_table: base must be a 64-byte aligned FP32 tensor (got {base.dtype} at "
                         f"{base.data_ptr() % 64} bytes past 64-byte alignment)")
    origin = base.data_ptr()
    views: dict[tuple[int, bool], tuple] = {}   # per tensor, checked once (``_table_view``)
    out = []
    for r in rows:
        if r is None:
            out.append((0,) * TABLE_WIDTH)
            continue
        t, j = r if isinstance(r, tuple) else (r, None)
        view = views.get((id(t), j is None))
        if view is None:
            view = views[id(t), j is None] = _table_view(t, origin, batched=j is not None)
        off, st0, st1, frames, row_stride, n_rows = view
        if j is not None:
            if not 0 <= j < n_rows:
                raise ValueError(f"stream_table: row {j} of a tensor {tuple(t.shape)}; expected a batch row of a "
                                 "(steps, depth, rows, heads, frames, 2D) tensor")
            off += j * row_stride
        d0, d1 = (frames, frames) if drops is None else drops[len(out)]
        h = 0 if held is None else int(held[len(out)])
        if not 0 <= h <= frames:
            raise ValueError(f"stream_table: row {len(out)} holds {h} of its {frames} frames; expected 0..{frames}")
        out.append((off, st0, st1, 1 if current is None else int(current[len(out)]), frames, int(d0), int(d1), h))
    return torch.tensor(out, dtype=torch.int64)


# A ``tail_table`` row's start for a row that shares no frames: past any cache's old frames.
NO_TAIL = 1 << 30


def tail_table(rows: Sequence[tuple[torch.Tensor, int] | None], base: torch.Tensor, starts: Sequence[int],
               frames: int) -> torch.Tensor:
    """The (R, ``TABLE_WIDTH``) table of ``StreamKV.tail``: row r's old frames from ``starts[r]`` on are the last
    ``frames`` frames of batch row j of ``t`` for rows[r] = (t, j), a (steps, depth, rows, heads, P, 2D) FP32
    tensor (a voice's prompt cache) whose (heads, P, 2D) blocks are contiguous; None: the row shares none.
    Entries: [offset from ``base`` of (step 0, layer 0, head 0, frame P - frames), step stride, layer stride,
    start, head stride, 0, 0, 0] in elements, offsets and strides multiples of 16 (what the kernel declares)."""
    if len(starts) != len(rows):
        raise ValueError(f"tail_table: {len(starts)} starts for {len(rows)} rows")
    if base.dtype != torch.float32 or base.data_ptr() % 64:
        raise ValueError(f"tail_table: base must be a 64-byte aligned FP32 tensor (got {base.dtype} at "
                         f"{base.data_ptr() % 64} bytes past 64-byte alignment)")
    out = []
    views: dict[int, tuple] = {}    # per tensor, checked once (a voice's rows share one)
    for r, start in zip(rows, starts):
        if r is None:
            out.append((0, 0, 0, NO_TAIL) + (0,) * (TABLE_WIDTH - 4))
            continue
        t, j = r
        view = views.get(id(t))
        if view is None:
            view = views[id(t)] = _table_view(t, base.data_ptr(), True, "tail_table")
        off, st0, st1, P, row_stride, n_rows = view
        if not 0 <= j < n_rows:
            raise ValueError(f"tail_table: row {j} of a tensor {tuple(t.shape)}; expected a batch row of a "
                             "(steps, depth, rows, heads, frames, 2D) tensor")
        if not 0 < frames <= P or start < 0:
            raise ValueError(f"tail_table: the last {frames} of {P} frames from old frame {start}; expected "
                             f"1..{P} frames and a start >= 0")
        off += j * row_stride + (P - frames) * t.shape[5]
        if off % 16:
            raise ValueError(f"tail_table: the last {frames} frames of a tensor {tuple(t.shape)} do not start on 16 "
                             "elements (64 bytes)")
        out.append((off, st0, st1, int(start), P * t.shape[5]) + (0,) * (TABLE_WIDTH - 5))
    return torch.tensor(out, dtype=torch.int64)


def _table_view(t: torch.Tensor, origin: int, batched: bool,
                who: str = "stream_table") -> tuple[int, int, int, int, int, int]:
    """``stream_table``'s (and ``tail_table``'s, ``who``) checks and numbers for one tensor, once per call whatever
    its row count: (offset of its first row from ``origin``, step and layer strides, frames, row stride, rows), in
    FP32 elements. A
    batched tensor is (steps, depth, rows, heads, frames, 2D) and its rows are read by index; else it is one
    row's (steps, depth, heads, frames, 2D) view."""
    if batched:
        if t.dim() != 6:
            raise ValueError(f"{who}: a batch row of a tensor {tuple(t.shape)}; expected a (steps, depth, "
                             "rows, heads, frames, 2D) tensor")
        st, shape = t.stride(), t.shape
        row_stride, n_rows = st[2], shape[2]
        st, shape = st[:2] + st[3:], shape[:2] + shape[3:]
    else:
        st, shape, row_stride, n_rows = t.stride(), t.shape, 0, 1
    if t.dtype != torch.float32 or len(shape) != 5 or st[2:] != (shape[3] * shape[4], shape[4], 1):
        raise ValueError(f"{who}: a row view {tuple(shape)} with strides {st} and dtype "
                         f"{t.dtype}; each (heads, frames, 2D) block must be contiguous FP32")
    off = (t.data_ptr() - origin) // 4
    if any(v % 16 for v in (off, st[0], st[1], row_stride if n_rows > 1 else 0)) or (shape[3] * shape[4]) % 16:
        raise ValueError(f"{who}: a row view at {t.data_ptr()} with strides {st} is not "
                         "aligned to 16 elements (64 bytes)")
    return off, st[0], st[1], shape[3], row_stride, n_rows


@functools.lru_cache(maxsize=None)
def device_tma(device: torch.device) -> bool:
    """Can a kernel build TMA descriptors itself on ``device`` (Hopper or newer, a Triton with
    ``tl.make_tensor_descriptor``)? The interpreter emulates them on the CPU."""
    if not AVAILABLE or not hasattr(tl, "make_tensor_descriptor") or _allocator_slot() is None:
        return False
    if device.type == "cpu":
        return interpreting()
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _allocator_slot():
    """Triton's per-context allocator slot (a ContextVar in Triton 3.3-3.9), or None in a Triton without one
    (then ``device_tma`` says no: the allocator could not be restored after a launch)."""
    try:
        from triton.runtime import _allocation
    except ImportError:
        return None
    var = getattr(_allocation, "_allocator", None)
    return var if hasattr(var, "get") and hasattr(var, "set") else None


@contextmanager
def descriptor_scratch(device: torch.device):
    """Triton's allocator, for the launch only, set to give kernels that build TMA descriptors their global
    scratch from torch's allocator on ``device`` (under graph capture: the graph's pool, so a replay finds
    it at the address it was captured with). The previous allocator is restored afterwards."""
    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    var = _allocator_slot()
    if var is None:
        raise RuntimeError("descriptor_scratch: this Triton has no allocator slot (triton.runtime._allocation)")
    prev = var.get()
    token = var.set(alloc)
    try:
        yield
    finally:
        if token is not None and hasattr(var, "reset"):
            var.reset(token)
        else:
            var.set(prev)


def direct_attention(q: torch.Tensor, cur: torch.Tensor, streams: StreamKV, layer: int, out: torch.Tensor,
                     precision: str = "tf32", block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                     num_stages: int = 2, splits: int = 1, round_out: bool = False,
                     pv16: bool | None = None, tma: bool = False,
                     counters: torch.Tensor | None = None, one_loop: bool = False) -> torch.Tensor:
    """Unmasked attention of q (R, H, T, D) over this chunk's keys ``cur`` (R, H, T, 2D) packed [k|v],
    then each row's own old frames (``streams``: no copy of them into a shared buffer first), at DiT
    block ``layer`` of Euler step ``streams.step``. Every key frame it reads is also written once into
    the row's trimmed successor. Same numerics as ``tiled_attention`` over the concatenated
    [cur | old] cache (keys arrive in another tile grouping). ``tma``: every (row, head) builds TMA
    descriptors over its two key sources and loads tiles through them (``device_tma``; the per-stream
    caches have no host descriptor), instead of pointer loads. ``counters``: as ``tiled_attention``'s.
    ``one_loop``: each split walks both sources' key tiles in one loop (``_direct_keys_one_loop``; pointer
    loads, so not with ``tma``), the same sums bit for bit. ``streams.tail``: each row's last old frames read
    from its voice's shared copy (pointer loads, so not with ``tma``), the same sums bit for bit where the
    copy holds what the row's cache does."""
    if not AVAILABLE:
        raise RuntimeError("direct_attention needs Triton")
    if one_loop and tma:
        raise ValueError("direct_attention(one_loop=True) walks its key tiles with pointer loads; pass tma=False")
    if streams.tail is not None and tma:
        raise ValueError("direct_attention: a shared tail (StreamKV.tail) is read with pointer loads; pass tma=False")
    if tma and not device_tma(q.device):
        raise ValueError(f"direct_attention(tma=True): {q.device} cannot build TMA descriptors in a kernel (needs "
                         "CUDA capability >= 9 and a Triton with tl.make_tensor_descriptor); pass tma=False")
    R, H, T, D = q.shape
    if q.dtype != torch.float32 or cur.dtype != torch.float32:
        raise TypeError(f"direct_attention is FP32 only, got q {q.dtype}, cur {cur.dtype}")
    if cur.shape != (R, H, T, 2 * D) or cur.stride()[2:] != (2 * D, 1):
        raise ValueError(f"direct_attention: cur {tuple(cur.shape)} strides {cur.stride()}; expected "
                         f"{(R, H, T, 2 * D)} with each frame's [k|v] contiguous")
    tables = (streams.src, streams.dst) + (() if streams.tail is None else (streams.tail,))
    if any(t.shape != (R, TABLE_WIDTH) for t in tables):
        raise ValueError(f"direct_attention: stream tables {[tuple(t.shape) for t in tables]} for {R} rows; "
                         f"expected ({R}, {TABLE_WIDTH})")
    if precision not in ("tf32", "ieee"):
        raise ValueError(f"precision must be 'tf32' or 'ieee', got {precision!r}")
    nk = T + streams.n_old
    d0, d1 = streams.drop
    if not streams.row_lengths and nk - (d1 - d0) != streams.n_out:
        raise ValueError(f"direct_attention: {nk} key frames less the dropped [{d0}, {d1}) is not the successor's "
                         f"{streams.n_out}")
    splits, per_split, cur_keys = direct_key_splits(T, streams.n_old, splits, block_n)
    last = splits > 1 and counters is not None
    if last:
        check_counters(counters, R * H * triton.cdiv(T, block_m), q.device, "direct_attention")
    if splits > 1:
        pacc = torch.empty(R, H, splits, T, D, device=q.device, dtype=torch.float32)
        pml = torch.empty(R, H, splits, T, 2, device=q.device, dtype=torch.float32)
    else:
        pacc = pml = q
    if tma and (cur.data_ptr() % 16 or cur.stride(0) % 4 or cur.stride(1) % 4):
        raise ValueError(f"direct_attention(tma=True): cur at {cur.data_ptr() % 16} bytes past 16-byte alignment "
                         f"with strides {cur.stride()}; TMA needs 16-byte aligned (row, head) blocks")
    with descriptor_scratch(q.device) if tma else nullcontext():
        _attn_direct[(R, H, triton.cdiv(T, block_m) * splits)](
            q, cur, streams.base, streams.src, streams.dst, out, pacc, pml, *q.stride(), cur.stride(0), cur.stride(1),
            *out.stride(), streams.step, layer, T, streams.n_old, streams.n_out, d0, d1, float(D) ** -0.5, per_split,
            cur_keys, counters if last else streams.src,
            HEAD_D=D, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, SPLITS=splits, ROUND_OUT=round_out,
            PV16=pv16_for(out, precision) if pv16 is None else pv16, TMA=tma, num_warps=num_warps,
            num_stages=num_stages, LAST_COMBINE=last, ROW_COPY=SUCCESSOR_ROW_COPY, ROW_LENGTHS=streams.row_lengths,
            ONE_LOOP=one_loop, TAILS=streams.src if streams.tail is None else streams.tail,
            TAIL=streams.tail is not None)
    if splits > 1 and not last:
        _attn_combine[(R, H, triton.cdiv(T, block_m))](pacc, pml, out, *out.stride(), H, T,
                                                       HEAD_D=D, BLOCK_M=block_m, SPLITS=splits,
                                                       ROUND_OUT=round_out, num_warps=4)
    return out


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                   kv_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The same contract through ``F.scaled_dot_product_attention`` (CPU, pre-SM80 CUDA).

    SDPA's math kernel returns NaN for a fully masked row, so such rows are zeroed
    explicitly to keep the contract.
    """
    if kv_rows is not None:
        k, v = k.index_select(0, kv_rows.long()), v.index_select(0, kv_rows.long())
    if mask is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
    dead = ~mask.any(dim=-1)                       # (B, nq)
    return o.masked_fill(dead[:, None, :, None], 0.0)
