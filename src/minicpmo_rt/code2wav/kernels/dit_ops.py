"""Fused element-wise stages of the DiT block (Triton), one program per token row.

* ``residual_mod_ln``: optional ``x += gate * y`` (y plain, or the tap sum of a
  conv-as-GEMM output plus bias), then ``LN(x) * (1 + scale) + shift`` written to
  any strided destination (e.g. straight into a conv history buffer).
* ``qkv_head_ln``: per-head LayerNorm of q and k from the packed QKV GEMM output;
  writes q to a query buffer and k, v straight into the ``[k|v]`` attention cache.
* ``taps_ln_mish``: the tap sum of a conv-as-GEMM output + bias, LayerNorm
  (affine) and Mish, written into the next conv's history buffer.

Each stage can read a GEMM output given as split-K partials (S, ...): it sums the S partials
(and the bias the split GEMM left out) while loading, so a few-row GEMM can be split over K for
more CTAs without a reduction kernel of its own.

Statistics are FP32 two-pass (mean, then centred variance), like torch's LayerNorm.
Row r of the modulation tables is ``row // T`` scaled by a row stride that is 0
when one table serves every row.

``residual_mod_ln`` and ``taps_ln_mish`` can also ask L2 for the weights of the GEMM after them
(``prefetch``): the weights are cold (the blocks' 288 MB pass through L2 every Euler step) and do not
depend on the row stage, so their HBM latency runs under the kernel boundary (``STAGED_PREFETCH``).
"""

from __future__ import annotations

import torch

from . import AVAILABLE, interpreting

STAGED_PREFETCH = True

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def round_tf32(x, ROUND: tl.constexpr):
        """x rounded to nearest TF32 (10-bit mantissa, ties away from zero) when ROUND: a GEMM operand
        stored pre-rounded so the tensor core's truncation is exact (the persistent block kernel)."""
        if ROUND:
            x = ((x.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
        return x

    @triton.jit
    def store_operand(ptr, x, mask, ROUND: tl.constexpr):
        """Store x as a GEMM operand: rounded to nearest TF32 with ROUND into an FP32 buffer, or into an
        FP16 one (``FusedDiT(gemm_operands="fp16")``), where round-to-nearest keeps the same 10-bit
        mantissa. FP16 saturates at +-65504 rather than turning a huge activation into inf (a NaN stays
        NaN)."""
        if ptr.dtype.element_ty == tl.float16:
            tl.store(ptr, tl.clamp(x, -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float16),
                     mask=mask)
        else:
            tl.store(ptr, round_tf32(x, ROUND), mask=mask)

    @triton.jit
    def res_ln_row(n, X, Y, BIAS, GATE, SHIFT, SCALE, OUT,
                   sxr, sxt, syr, syt, sor, sot, s_gate, s_mod, s_split,
                   T, C, eps,
                   TAPS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                   SPLITS: tl.constexpr, BLOCK_C: tl.constexpr, ROUND_OUT: tl.constexpr = False):
        """Token row ``n`` of ``residual_mod_ln`` (also a phase of the persistent block kernel)."""
        r = n // T
        t = n % T
        offs = tl.arange(0, BLOCK_C)
        ok = offs < C
        xp = X + r * sxr + t * sxt + offs
        x = tl.load(xp, mask=ok, other=0.0)
        # every load issued before the first reduction: loads after it wait out its barrier and then
        # a memory latency of their own (the LN stage is latency-bound: one row per program)
        sh = tl.load(SHIFT + r * s_mod + offs, mask=ok, other=0.0)
        sc = tl.load(SCALE + r * s_mod + offs, mask=ok, other=0.0)
        if HAS_RES:
            # conv output at t = sum_k Y[t + k, k*C + c] (+ bias): Y rows are history frames;
            # each of the SPLITS partials adds its share of the K sum
            if HAS_BIAS:   # bias first: the unsplit sum keeps its order (bias + taps)
                y = tl.load(BIAS + offs, mask=ok, other=0.0)
            else:
                y = tl.zeros([BLOCK_C], tl.float32)
            for sp in tl.static_range(SPLITS):
                ys = Y + sp * s_split + r * syr
                if TAPS > 0:
                    for k in tl.static_range(TAPS):
                        y += tl.load(ys + (t + k) * syt + k * C + offs, mask=ok, other=0.0)
                else:
                    y += tl.load(ys + t * syt + offs, mask=ok, other=0.0)
            g = tl.load(GATE + r * s_gate + offs, mask=ok, other=0.0)
            x = x + g * y
            tl.store(xp, x, mask=ok)
        mean = tl.sum(x, axis=0) / C
        d = tl.where(ok, x - mean, 0.0)
        var = tl.sum(d * d, axis=0) / C
        xn = d / tl.sqrt(var + eps)
        store_operand(OUT + r * sor + t * sot + offs, xn * sc + sh, ok, ROUND_OUT)

    @triton.jit
    def prefetch_share(n, pid, nprog):
        """(first float, bytes) of program pid's share of a bulk prefetch of n floats: the bytes in
        whole 16-byte units split evenly over the programs (the instruction's size unit), the last
        share cut at the end and rounded down to a unit (a prefetch never reaches past P[n-1])."""
        per = tl.cdiv(tl.cdiv(n * 4, nprog), 16) * 16
        size = tl.minimum(tl.maximum(n * 4 - pid * per, 0), per) // 16 * 16
        return pid * (per // 4), size

    @triton.jit
    def prefetch_l2(P, n, pid, nprog, BULK: tl.constexpr):
        """Ask L2 for P[0:n) (floats), split evenly over the programs: a hint that neither blocks nor
        faults (the persistent block kernel's programs issue it at their barriers, the staged body's row
        kernels for the GEMM after them). BULK (SM90): one ``cp.async.bulk.prefetch`` per program, from
        its first thread; else one ``prefetch`` per 128-byte line (in the block kernel, issued before the
        barrier arrival, ~190 per program lengthened the row phase by 0.3-0.9 us on the H200)."""
        if BULK:
            first, size = prefetch_share(n, pid, nprog)
            tl.inline_asm_elementwise(
                "{ .reg .pred p, q; .reg .b32 t; .reg .b64 a; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                "setp.gt.s32 q, $2, 0; and.pred p, p, q; and.b64 a, $1, -16; "      # 16-byte aligned, as it must be
                "@p cp.async.bulk.prefetch.L2.global [a], $2; mov.u32 $0, 0; }",
                "=r,l,r", [P + first + tl.zeros([1], tl.int32), size + tl.zeros([1], tl.int32)],
                dtype=tl.int32, is_pure=False, pack=1)
        else:
            lines = tl.cdiv(n, 32)
            per = tl.cdiv(lines, nprog)
            for l0 in range(pid * per, pid * per + per, 256):
                offs = l0 + tl.arange(0, 256)
                ok = (offs < lines) & (offs < pid * per + per)
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                    "=r,l,r", [P + offs.to(tl.int64) * 32, ok.to(tl.int32)], dtype=tl.int32, is_pure=False,
                    pack=1)

    @triton.jit
    def _residual_mod_ln(X, Y, BIAS, GATE, SHIFT, SCALE, OUT,
                         sxr, sxt, syr, syt, sor, sot, s_gate, s_mod, s_split,
                         T, C, eps, PF, pf_n,
                         TAPS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                         SPLITS: tl.constexpr, BLOCK_C: tl.constexpr, ROUND_OUT: tl.constexpr,
                         PREFETCH: tl.constexpr = 0):
        res_ln_row(tl.program_id(0), X, Y, BIAS, GATE, SHIFT, SCALE, OUT, sxr, sxt, syr, syt, sor, sot,
                   s_gate, s_mod, s_split, T, C, eps, TAPS, HAS_RES, HAS_BIAS, SPLITS, BLOCK_C, ROUND_OUT)
        if PREFETCH > 0:        # the next GEMM's weights (PREFETCH 2: bulk)
            prefetch_l2(PF, pf_n, tl.program_id(0), tl.num_programs(0), PREFETCH == 2)

    @triton.jit
    def qkv_head_ln_row(n, QKV, BIAS, QW, QB, KW, KB, QOUT, KV, ROWS, POS,
                        s_in_r, s_in_t, s_split, sq_r, sq_t, sq_h, skv_r, skv_h, skv_t,
                        T, H, D, eps,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_POS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr):
        """Token row ``n`` of ``qkv_head_ln`` (also a phase of the persistent block kernel)."""
        r = n // T
        t = n % T
        kr = r
        kt = t
        if HAS_POS:   # pooled cache: row r's frame t lives at slot row ROWS[r], frame POS[r, t]
            kr = tl.load(ROWS + r)
            kt = tl.load(POS + n)
        oh = tl.arange(0, BLOCK_H)
        od = tl.arange(0, BLOCK_D)
        ok = (oh[:, None] < H) & (od[None, :] < D)
        base = QKV + r * s_in_r + t * s_in_t + oh[:, None] * D + od[None, :]
        inner = H * D
        wq = tl.load(QW + od, mask=od < D, other=0.0)
        bq = tl.load(QB + od, mask=od < D, other=0.0)
        wk = tl.load(KW + od, mask=od < D, other=0.0)
        bk = tl.load(KB + od, mask=od < D, other=0.0)
        cols = oh[:, None] * D + od[None, :]
        q = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        k = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        v = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for sp in tl.static_range(SPLITS):
            q += tl.load(base + sp * s_split, mask=ok, other=0.0)
            k += tl.load(base + sp * s_split + inner, mask=ok, other=0.0)
            v += tl.load(base + sp * s_split + 2 * inner, mask=ok, other=0.0)
        if HAS_BIAS:
            q += tl.load(BIAS + cols, mask=ok, other=0.0)
            k += tl.load(BIAS + inner + cols, mask=ok, other=0.0)
            v += tl.load(BIAS + 2 * inner + cols, mask=ok, other=0.0)
        mq = tl.sum(q, axis=1) / D
        dq = tl.where(ok, q - mq[:, None], 0.0)
        q = dq / tl.sqrt(tl.sum(dq * dq, axis=1) / D + eps)[:, None] * wq[None, :] + bq[None, :]
        tl.store(QOUT + r * sq_r + t * sq_t + oh[:, None] * sq_h + od[None, :], q, mask=ok)
        mk = tl.sum(k, axis=1) / D
        dk = tl.where(ok, k - mk[:, None], 0.0)
        k = dk / tl.sqrt(tl.sum(dk * dk, axis=1) / D + eps)[:, None] * wk[None, :] + bk[None, :]
        dst = KV + kr.to(tl.int64) * skv_r + oh[:, None] * skv_h + kt * skv_t + od[None, :]
        tl.store(dst, k, mask=ok)
        tl.store(dst + D, v, mask=ok)

    @triton.jit
    def last_arrival(CNT, i, N: tl.constexpr):
        """Count this program's part of item i in (CNT[i] is 0 before the first of N parts): True for the
        N-th, which then sees every part's stores and resets CNT[i] to 0 for the next use. The count's
        acquire-release pairs each part's stores with the last one's loads, as a grid barrier does; the
        reset is an atomic, so it reaches L2 before any later count."""
        tl.debug_barrier()      # every warp's stores of this part are issued before the program counts in
        last = tl.atomic_add(CNT + i, 1, sem="acq_rel", scope="gpu") == N - 1
        if last:
            tl.atomic_xchg(CNT + i, 0, sem="relaxed", scope="gpu")
        return last

    @triton.jit
    def _qkv_head_ln(QKV, BIAS, QW, QB, KW, KB, QOUT, KV, ROWS, POS,
                     s_in_r, s_in_t, s_split, sq_r, sq_t, sq_h, skv_r, skv_h, skv_t,
                     T, H, D, eps,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_POS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr):
        qkv_head_ln_row(tl.program_id(0), QKV, BIAS, QW, QB, KW, KB, QOUT, KV, ROWS, POS,
                        s_in_r, s_in_t, s_split, sq_r, sq_t, sq_h, skv_r, skv_h, skv_t, T, H, D, eps,
                        BLOCK_H, BLOCK_D, HAS_POS, HAS_BIAS, SPLITS)

    @triton.jit
    def taps_ln_mish_row(n, Y, BIAS, W, B, OUT, syr, syt, sor, sot, s_split, T, C, eps,
                         TAPS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_C: tl.constexpr,
                         ROUND_OUT: tl.constexpr = False):
        """Token row ``n`` of ``taps_ln_mish`` (also a phase of the persistent block kernel)."""
        r = n // T
        t = n % T
        offs = tl.arange(0, BLOCK_C)
        ok = offs < C
        y = tl.load(BIAS + offs, mask=ok, other=0.0)
        w = tl.load(W + offs, mask=ok, other=0.0)     # before the reductions, as in res_ln_row
        b = tl.load(B + offs, mask=ok, other=0.0)
        for sp in tl.static_range(SPLITS):
            for k in tl.static_range(TAPS):
                y += tl.load(Y + sp * s_split + r * syr + (t + k) * syt + k * C + offs, mask=ok, other=0.0)
        mean = tl.sum(y, axis=0) / C
        d = tl.where(ok, y - mean, 0.0)
        var = tl.sum(d * d, axis=0) / C
        h = d / tl.sqrt(var + eps) * w + b
        # mish(h) = h * tanh(softplus(h)) = h * n / (n + 2) with n = e^h (e^h + 2); exact form, no tanh call
        e = tl.exp(tl.minimum(h, 20.0))
        nn_ = e * (e + 2.0)
        m = tl.where(h > 20.0, h, h * nn_ / (nn_ + 2.0))
        store_operand(OUT + r * sor + t * sot + offs, m, ok, ROUND_OUT)

    @triton.jit
    def _taps_ln_mish(Y, BIAS, W, B, OUT, syr, syt, sor, sot, s_split, T, C, eps, PF, pf_n,
                      TAPS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_C: tl.constexpr, ROUND_OUT: tl.constexpr,
                      PREFETCH: tl.constexpr = 0):
        taps_ln_mish_row(tl.program_id(0), Y, BIAS, W, B, OUT, syr, syt, sor, sot, s_split, T, C, eps,
                         TAPS, SPLITS, BLOCK_C, ROUND_OUT)
        if PREFETCH > 0:
            prefetch_l2(PF, pf_n, tl.program_id(0), tl.num_programs(0), PREFETCH == 2)


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def bulk_prefetch_on(device: torch.device) -> bool:
    """Does ``prefetch_l2`` take its bulk form on this device: SM90+ (and CPU tensors, which only the compile
    gate launches outside the interpreter, compiling for SM90)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def _prefetch_args(t: torch.Tensor | None, like: torch.Tensor) -> tuple:
    """(pointer, floats, PREFETCH) of a row kernel's L2 prefetch of ``t`` (the GEMM after it): off without
    ``t``, with ``STAGED_PREFETCH`` off, under the interpreter (inline PTX) and for non-FP32 weights; the
    bulk form from SM90 (and in the compile gate's CPU runs), one per line before."""
    if t is None or not STAGED_PREFETCH or interpreting() or t.dtype != torch.float32 or not t.is_contiguous():
        return like, 0, 0
    return t, t.numel(), 2 if bulk_prefetch_on(like.device) else 1


def _splits_of(y, dims: int):
    """(partials S, split stride, y as its first partial) for y with ``dims`` dims or S partials of it."""
    if y.dim() == dims + 1:
        return y.shape[0], y.stride(0), y[0]
    return 1, 0, y


def residual_mod_ln(x, y, bias, gate, shift, scale1p, out, eps: float, taps: int = 0, round_out: bool = False,
                    prefetch: torch.Tensor | None = None) -> None:
    """x (R,T,C) in place; y (R,T,C) or taps output (R,T+taps-1,taps*C), or S split-K partials of
    either (S,...); bias (C,) or None; mods (Rm,C); out (R,T,C) view, stored rounded to nearest TF32
    with ``round_out`` (the operand of a TF32 GEMM that truncates), or FP16 (``store_operand``).
    ``prefetch``: the next GEMM's weight, which the programs then ask L2 for (``_prefetch_args``)."""
    R, T, C = x.shape
    if shift.stride(0) != scale1p.stride(0):
        raise ValueError("shift and scale tables must share their row stride")
    s_mod = shift.stride(0) if shift.shape[0] > 1 else 0
    has_res = y is not None
    s_gate = gate.stride(0) if has_res and gate.shape[0] > 1 else 0
    splits, s_split, yy = _splits_of(y, 3) if has_res else (1, 0, x)
    pf = _prefetch_args(prefetch, x)
    _residual_mod_ln[(R * T,)](
        x, y if has_res else x, bias if bias is not None else x, gate if has_res else shift, shift, scale1p, out,
        x.stride(0), x.stride(1), yy.stride(0), yy.stride(1), out.stride(0), out.stride(1), s_gate, s_mod, s_split,
        T, C, eps, *pf[:2], TAPS=taps if has_res else 0, HAS_RES=has_res, HAS_BIAS=has_res and bias is not None,
        SPLITS=splits, BLOCK_C=_pow2(C), ROUND_OUT=round_out, PREFETCH=pf[2], num_warps=4)


def qkv_head_ln(qkv, q_w, q_b, k_w, k_b, q_out, kv, eps: float, rows=None, pos=None, bias=None) -> None:
    """qkv (R,T,3*H*D) or S split-K partials (S,R,T,3*H*D) with the GEMM's ``bias`` (3*H*D,) added
    here; q_out (R,T,H,D) view; kv (R,H,>=T,2D) view whose frames 0..T-1 get [k|v].

    With ``rows`` (R,) and ``pos`` (R,T) int32, kv is a pool (P,H,F,2D) and row r's frame t goes
    to pool row rows[r], frame pos[r, t].
    """
    splits, s_split, q0 = _splits_of(qkv, 3)
    R, T, _ = q0.shape
    _, H, _, D2 = kv.shape
    D = D2 // 2
    has_pos = pos is not None
    _qkv_head_ln[(R * T,)](
        qkv, bias if bias is not None else qkv, q_w, q_b, k_w, k_b, q_out, kv, rows if has_pos else qkv,
        pos if has_pos else qkv, q0.stride(0), q0.stride(1), s_split, q_out.stride(0), q_out.stride(1),
        q_out.stride(2), kv.stride(0), kv.stride(1), kv.stride(2), T, H, D, eps,
        BLOCK_H=_pow2(H), BLOCK_D=_pow2(D), HAS_POS=has_pos, HAS_BIAS=bias is not None, SPLITS=splits,
        num_warps=4)


def taps_ln_mish(y, bias, w, b, out, eps: float, taps: int, round_out: bool = False,
                 prefetch: torch.Tensor | None = None) -> None:
    """y (R,T+taps-1,taps*C) conv-as-GEMM output or S split-K partials of it; out (R,T,C) view
    (rounded to nearest TF32 with ``round_out``, or FP16: ``store_operand``); ``prefetch`` as
    ``residual_mod_ln``'s."""
    R, T, C = out.shape
    splits, s_split, y0 = _splits_of(y, 3)
    pf = _prefetch_args(prefetch, out)
    _taps_ln_mish[(R * T,)](y, bias, w, b, out, y0.stride(0), y0.stride(1), out.stride(0), out.stride(1),
                            s_split, T, C, eps, *pf[:2], TAPS=taps, SPLITS=splits, BLOCK_C=_pow2(C),
                            ROUND_OUT=round_out, PREFETCH=pf[2], num_warps=4)
