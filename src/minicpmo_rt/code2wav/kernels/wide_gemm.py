"""``out = act(x @ w.T + b)`` for many rows: a tiled Triton TF32 GEMM with its epilogue in the tile.

At batch 8-16 a CFG-doubled 1-s chunk is 800-1600 token rows and every DiT GEMM has a short K
(512, or 2048 for fc2) and 512-2048 columns. cuBLAS runs those at 28-57% of the TF32 peak on the
H200 (benchmarks/results/code2wav_replay_profile_session9_h200.md): one wave of 128x128 tiles
leaves SMs idle (1600x512 is 52 tiles on 132 SMs) and its tanh-GELU epilogue for fc1 is a
separate kernel. Here the tile shape is chosen per GEMM shape (``TILES``, from the H200 probe in
benchmarks/code2wav_gemm_probe.py), bias and tanh-GELU are applied to the accumulator before the
one store, a causal conv is one GEMM whose K steps walk its taps (``taps``: the output is the conv,
C wide, not the K*C tap products of cuBLAS's form), and on Hopper the operand tiles arrive through
TMA descriptors (``tma=True``). ``wide_qkv`` is the QKV projection with the per-head q/k LayerNorms
and the [k|v] cache write in its epilogue.

Operands are loaded as stored and the tensor core truncates them to TF32 (``input_precision=
"tf32"``); the fused body stores them already rounded to nearest (``round_out`` of the stage that
writes each one, weights from ``FusedDiT.stacked_weights(True)``), which gives cuBLAS TF32's error.
With ``FusedDiT(gemm_operands="fp16")`` they are FP16 (TF32-exact in FP16's range; own tiles,
``TILES16``), and an FP16 ``out`` is stored saturated (``dit_ops.store_operand``).
Semantics are those of ``torch.addmm`` (+ tanh-GELU).
"""

from __future__ import annotations

import torch

from . import AVAILABLE

if AVAILABLE:
    import triton
    import triton.language as tl

    from .dit_ops import store_operand

    @triton.jit
    def _tile_origin(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
        """(first row, first column) of this program's output tile, in grouped order: GROUP_M row
        tiles walk the column tiles together (their A rows stay in L2)."""
        pid = tl.program_id(0)
        n_m = tl.cdiv(M, BM)
        per_group = GROUP_M * tl.cdiv(N, BN)
        first_m = (pid // per_group) * GROUP_M
        rows_in = tl.minimum(n_m - first_m, GROUP_M)
        return (first_m + (pid % per_group) % rows_in) * BM, ((pid % per_group) // rows_in) * BN

    @triton.jit
    def _tile_acc(A, W, a_desc, w_desc, M, N, K, sam, sak, swn, swk, m0, n0,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TAPS: tl.constexpr,
                  TMA: tl.constexpr, PRECISION: tl.constexpr):
        """The (BM, BN) tile at (m0, n0) of A @ W.T, or of the implicit conv over TAPS taps."""
        offs_m = m0 + tl.arange(0, BM)
        offs_n = n0 + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        # K steps over taps x input columns: tap j reads A shifted down j rows and W's row block j
        # (TAPS = 1: a plain GEMM). A ragged last column tile reads the next tap's rows (or zeros past
        # W) into accumulator columns >= N, which are never stored.
        for kk in range(0, TAPS * K, BK):
            j = kk // K
            c = kk - j * K
            if TMA:
                a = a_desc.load([m0 + j, c])
                w = w_desc.load([j * N + n0, c])
            else:
                a = tl.load(A + (offs_m + j)[:, None] * sam + (c + offs_k)[None, :] * sak,
                            mask=(offs_m + j)[:, None] < M, other=0.0)
                w = tl.load(W + (j * N + offs_n)[:, None] * swn + (c + offs_k)[None, :] * swk,
                            mask=offs_n[:, None] < N, other=0.0)
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _wide_gemm(A, W, BIAS, OUT, a_desc, w_desc, M, N, K,
                   sam, sak, swn, swk, som, son,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, ROUND_OUT: tl.constexpr,
                   TMA: tl.constexpr, PRECISION: tl.constexpr):
        m0, n0 = _tile_origin(M, N, BM, BN, GROUP_M)
        acc = _tile_acc(A, W, a_desc, w_desc, M, N, K, sam, sak, swn, swk, m0, n0, BM, BN, BK, TAPS, TMA, PRECISION)
        offs_m = m0 + tl.arange(0, BM)
        offs_n = n0 + tl.arange(0, BN)
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=offs_n < N, other=0.0)[None, :]
        if GELU:
            # 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
            u2 = 1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)
            acc = acc / (1.0 + tl.exp(-u2))
        store_operand(OUT + offs_m[:, None] * som + offs_n[None, :] * son, acc,
                      (offs_m[:, None] < M) & (offs_n[None, :] < N), ROUND_OUT)

    @triton.jit
    def _wide_qkv(A, W, BIAS, QW, QB, KW, KB, QOUT, KV, ROWS, POS, a_desc, w_desc, M, K,
                  sam, sak, swn, swk, sq_r, sq_t, sq_h, skv_r, skv_h, skv_t, T, eps,
                  H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  GROUP_M: tl.constexpr, HAS_POS: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr):
        """The QKV GEMM with the q/k head LayerNorms in its epilogue: q to QOUT (R, T, H, D), [k|v] to
        the attention cache KV (R, H, >=T, 2D), or with HAS_POS to pool row ROWS[r], frame POS[r, t]
        (what ``dit_ops.qkv_head_ln`` does from a stored QKV). BN divides H*D and is a multiple of D,
        so a tile holds BN // D whole heads of one of q, k, v."""
        N: tl.constexpr = 3 * H * D
        NH: tl.constexpr = BN // D
        m0, n0 = _tile_origin(M, N, BM, BN, GROUP_M)
        acc = _tile_acc(A, W, a_desc, w_desc, M, N, K, sam, sak, swn, swk, m0, n0, BM, BN, BK, 1, TMA, PRECISION)
        acc += tl.load(BIAS + n0 + tl.arange(0, BN))[None, :]
        part = n0 // (H * D)                              # 0 q, 1 k, 2 v
        head = (n0 - part * H * D) // D + tl.arange(0, NH)
        od = tl.arange(0, D)
        x = tl.reshape(acc, [BM, NH, D])
        mean = tl.sum(x, axis=2) / D
        xc = x - mean[:, :, None]
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=2) / D + eps)
        w = tl.where(part == 0, tl.load(QW + od), tl.load(KW + od))
        b = tl.where(part == 0, tl.load(QB + od), tl.load(KB + od))
        y = tl.where(part == 2, x, xc * rstd[:, :, None] * w[None, None, :] + b[None, None, :])
        offs_m = m0 + tl.arange(0, BM)
        row_ok = offs_m < M
        r = offs_m // T
        t = offs_m % T
        kr = r
        kt = t
        if HAS_POS:
            kr = tl.load(ROWS + r, mask=row_ok, other=0)
            kt = tl.load(POS + offs_m, mask=row_ok, other=0)
        ok = row_ok[:, None, None] & (od[None, None, :] < D)
        which = od[None, None, :] * 0 + part              # the tile's part as a mask operand
        q_dst = QOUT + r[:, None, None] * sq_r + t[:, None, None] * sq_t + head[None, :, None] * sq_h + od[None, None, :]
        tl.store(q_dst, y, mask=ok & (which == 0))
        kv_dst = (KV + kr.to(tl.int64)[:, None, None] * skv_r + head[None, :, None] * skv_h
                  + kt[:, None, None] * skv_t + (part - 1) * D + od[None, None, :])
        tl.store(kv_dst, y, mask=ok & (which > 0))


Tile = tuple[int, int, int, int, int]     # (BM, BN, BK, warps, stages)
# By (M >= BIG_M, N, K, taps) for the DiT's GEMMs: the best of six tables timed as whole Whole-Euler
# solve replays on the H200 (benchmarks/code2wav_gemm_probe.py "solve", code2wav_gemm_probe_session10_
# h200.md), where the GEMMs run with cold weights between their real neighbours. That ranking differs
# from isolated GEMM timings: there Triton beat cuBLAS on every GEMM but fc2 by 8-30%, in place its
# GEMMs sum to about cuBLAS's time, and the solve gains from what disappears around them (fc1's
# separate GELU kernel, the 3x wider conv outputs, kernel gaps). BK 64 for the implicit conv (24 K
# steps, not 48) was worth ~2 ms per batch-8 solve.
BIG_M = 1200
TILES: dict[tuple[bool, int, int, int], Tile] = {
    (True, 1536, 512, 1): (128, 128, 32, 8, 3), (True, 512, 512, 1): (64, 64, 64, 4, 4),
    (True, 2048, 512, 1): (128, 256, 32, 8, 3), (True, 512, 512, 3): (64, 128, 64, 4, 3),
    (False, 1536, 512, 1): (64, 64, 32, 4, 4), (False, 512, 512, 1): (64, 64, 64, 4, 4),
    (False, 2048, 512, 1): (64, 128, 32, 4, 4), (False, 512, 512, 3): (64, 64, 64, 4, 4),
}
DEFAULT_TILE: Tile = (64, 128, 32, 4, 4)
# ``wide_qkv``'s own tile by M >= BIG_M (its per-head epilogue weighs on the tile choice); absent: TILES'.
# 1600 rows: 64x128 tiles, whole-solve replay 22.91 ms against 23.81 at TILES' 128x128 and 23.09-24.18
# for four other shapes (H200, code2wav_gemm_probe_session11_qkv_h200.md).
QKV_TILES: dict[bool, Tile] = {True: (64, 128, 32, 4, 4)}
# FP16 operands (BK 64-128: the same bytes per K step as FP32's 32-64), by M >= BIG_M16: the isolated
# sweep's best at 1600 rows (benchmarks/fp16_operand_probe.py, fp16_operand_probe_session13_h200.md);
# below, BK 128 tiles everywhere (DEFAULT_TILE16). Whole-solve replays on the H200 (code2wav_gemm_probe.py
# fp16, code2wav_gemm_probe_session13_fp16_h200.md), five tables: the big table first at batch 16
# (17.52 ms, others 17.95-18.25) and batch 8 (13.03 against 13.26 for BK 128), BK 128 first at batch 4
# (11.97 against 12.87).
BIG_M16 = 768
TILES16: dict[tuple[bool, int, int, int], Tile] = {
    (True, 1536, 512, 1): (128, 64, 64, 4, 4), (True, 512, 512, 1): (64, 64, 128, 4, 3),
    (True, 2048, 512, 1): (64, 128, 64, 4, 4), (True, 512, 512, 3): (64, 64, 128, 4, 3),
    (True, 512, 2048, 1): (64, 128, 64, 4, 4),
}
DEFAULT_TILE16: Tile = (64, 64, 128, 4, 3)
QKV_TILES16: dict[bool, Tile] = {True: (128, 64, 64, 4, 4)}


# IEEE dots (``precision="ieee"``: TF32 off with ``FusedDiT(wide_gemm=True)``) run on the FMA units, which
# keep each thread's share of both operand tiles in registers. The TF32 tables' tiles then spill: ptxas for
# SM90 reported 4-26 KB of spill stores per thread (benchmarks/results/compile_spills_session17.md), as the
# IEEE attention did before session 16. TMA-staged tiles spill at BK 32 too. So IEEE GEMMs without an
# explicit tile take IEEE_TILE on pointer loads, which compiles without spills (compile_gate.py checks it).
# Whole-solve replays with TF32 off on the H200 (code2wav_gemm_probe_session17_ieee_h200.md), B=16 / B=8:
# the TF32 tables' tiles with TMA 2361.7 / 649.3 ms, 64x64 BK 32 on 4 warps 198.9 / 121.9 (five other
# spill-free tiles 214-330 / 166-194), cuBLAS IEEE 86.3 / 55.0. FMA dots stay 2.3x slower than cuBLAS's
# SGEMM, which is why ``FusedDiT`` takes the tile GEMMs by default only under TF32.
IEEE_TILE: Tile | None = (64, 64, 32, 4, 3)


def _ieee_launch(precision: str, tile: Tile | None, tma: bool) -> tuple[Tile | None, bool]:
    """(tile, tma) of a launch: an IEEE launch without an explicit tile takes IEEE_TILE, pointer loads."""
    if precision == "ieee" and tile is None and IEEE_TILE is not None:
        return IEEE_TILE, False
    return tile, tma


def tile_for(M: int, N: int, K: int, taps: int = 1, dtype: torch.dtype = torch.float32) -> Tile:
    if dtype == torch.float16:
        return TILES16.get((M >= BIG_M16, N, K, taps), DEFAULT_TILE16)
    return TILES.get((M >= BIG_M, N, K, taps), DEFAULT_TILE)


def _fit_k(BK: int, K: int) -> int:
    """A table's K tile halved (down to 16) until it divides K: the tables are for the full-size DiT."""
    while K % BK and BK > 16:
        BK //= 2
    return BK


def _descriptors(x: torch.Tensor, w: torch.Tensor, BM: int, BN: int, BK: int, who: str):
    """TMA descriptors of x's (BM, BK) and w's (BN, BK) tiles; both need contiguous 16-byte aligned rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    for name, t in (("x", x), ("w", w)):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            raise ValueError(f"{who}(tma=True): {name} needs contiguous 16-byte aligned rows, got strides {t.stride()}")
    return TensorDescriptor.from_tensor(x, block_shape=[BM, BK]), TensorDescriptor.from_tensor(w, block_shape=[BN, BK])


def wide_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor, gelu: bool = False,
              taps: int = 1, round_out: bool = False, precision: str = "tf32", tma: bool = False,
              tile: Tile | None = None, group_m: int = 8) -> torch.Tensor:
    """out (M, N) = x (M, K) @ w (N, K).T (+ b) (then tanh-GELU), as ``torch.addmm``.

    ``taps`` > 1: a causal conv over the rows of x as one GEMM, w (taps*N, K) holding tap j's (N, K)
    weight in row block j: out[m] = sum_j x[m + j] @ w_j.T (+ b); rows past x's end read zeros, so
    the last taps-1 rows of out are partial (a caller stacking sequences reads only each one's
    first rows). ``round_out``: store the result rounded to nearest TF32 (the operand of a later
    TF32 GEMM). ``out`` may be any 2-D strided view. ``tma``: operand tiles through TMA descriptors
    (CUDA capability >= 9; x and w with contiguous, 16-byte aligned rows). ``tile``: (BM, BN, BK,
    warps, stages), default ``tile_for``; for ``precision="ieee"`` IEEE_TILE on pointer loads.
    """
    if not AVAILABLE:
        raise RuntimeError("wide_gemm needs Triton; use torch.addmm")
    # FP16 operands (experimental, benchmarks/fp16_operand_probe.py): a TF32-rounded value in FP16's
    # range is exact in FP16 (same 10-bit mantissa), at half the bytes and twice the tensor-core rate.
    if x.dtype != w.dtype or x.dtype not in (torch.float32, torch.float16) or out.dtype not in (torch.float32, torch.float16):
        raise TypeError(f"wide_gemm takes FP32 (or FP16) x and w of one dtype and an FP32/FP16 out, "
                        f"got x {x.dtype}, w {w.dtype}, out {out.dtype}")
    if precision not in ("tf32", "ieee"):
        raise ValueError(f"precision must be 'tf32' or 'ieee', got {precision!r}")
    if x.dim() != 2 or w.dim() != 2 or out.dim() != 2:
        raise ValueError(f"wide_gemm takes 2-D x, w, out; got {x.dim()}-D, {w.dim()}-D, {out.dim()}-D")
    M, K = x.shape
    if taps < 1 or w.shape[0] % taps:
        raise ValueError(f"wide_gemm: w has {w.shape[0]} rows, not a whole number of {taps} taps")
    N = w.shape[0] // taps
    if w.shape[1] != K or out.shape != (M, N):
        raise ValueError(f"wide_gemm shapes: x {tuple(x.shape)}, w {tuple(w.shape)} ({taps} taps), "
                         f"out {tuple(out.shape)}; want out ({M}, {N})")
    explicit = tile is not None
    tile, tma = _ieee_launch(precision, tile, tma)
    BM, BN, BK, warps, stages = tile or tile_for(M, N, K, taps, x.dtype)
    BK = BK if explicit else _fit_k(BK, K)
    if K % BK:
        raise ValueError(f"wide_gemm: K={K} is not a multiple of the K tile {BK}")
    a_desc, w_desc = _descriptors(x, w, BM, BN, BK, "wide_gemm") if tma else (None, None)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _wide_gemm[grid](x, w, b if b is not None else x, out, a_desc, w_desc, M, N, K,
                     *x.stride(), *w.stride(), *out.stride(),
                     BM=BM, BN=BN, BK=BK, GROUP_M=group_m, TAPS=taps, HAS_BIAS=b is not None, GELU=gelu,
                     ROUND_OUT=round_out, TMA=tma, PRECISION=precision, num_warps=warps, num_stages=stages)
    return out


def wide_qkv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, q_w: torch.Tensor, q_b: torch.Tensor,
             k_w: torch.Tensor, k_b: torch.Tensor, q_out: torch.Tensor, kv: torch.Tensor, T: int, eps: float,
             rows: torch.Tensor | None = None, pos: torch.Tensor | None = None, precision: str = "tf32",
             tma: bool = False, tile: Tile | None = None, group_m: int = 8) -> None:
    """The QKV projection with the q/k head LayerNorms in its epilogue, for x (R*T, C) and the packed
    weight w (3*H*D, C) + bias b: q = LN_q(x @ Wq.T + bq) into q_out (R, T, H, D); k = LN_k(...) and
    the raw v into the [k|v] cache kv (R, H, >=T, 2D) frames [0, T); with ``rows`` (R,) and ``pos``
    (R, T) int32, kv is a pool (P, H, F, 2D) and row r's frame t goes to rows[r], pos[r, t]. The same
    result as ``torch.addmm`` then ``dit_ops.qkv_head_ln``, without the (R*T, 3*H*D) round trip."""
    if not AVAILABLE:
        raise RuntimeError("wide_qkv needs Triton; use the GEMM and dit_ops.qkv_head_ln")
    M, K = x.shape
    _, H, _, D2 = kv.shape
    D = D2 // 2
    if w.shape != (3 * H * D, K) or q_out.shape != (M // T, T, H, D) or M % T:
        raise ValueError(f"wide_qkv shapes: x {tuple(x.shape)}, w {tuple(w.shape)}, q_out {tuple(q_out.shape)}, "
                         f"kv {tuple(kv.shape)}, T={T}")
    if q_out.stride(3) != 1 or kv.stride(3) != 1:
        raise ValueError("wide_qkv: q_out and kv need a contiguous last (head-dim) axis")
    if x.dtype != w.dtype or x.dtype not in (torch.float32, torch.float16):
        raise TypeError(f"wide_qkv takes FP32 (or FP16) x and w of one dtype, got x {x.dtype}, w {w.dtype}")
    explicit = tile is not None
    tile, tma = _ieee_launch(precision, tile, tma)
    qkv_tile = QKV_TILES16.get(M >= BIG_M16) if x.dtype == torch.float16 else QKV_TILES.get(M >= BIG_M)
    BM, BN, BK, warps, stages = tile or qkv_tile or tile_for(M, 3 * H * D, K, 1, x.dtype)
    BK = BK if explicit else _fit_k(BK, K)
    while BN > D and (H * D) % BN:      # a tile must hold whole heads of one of q, k, v
        BN //= 2
    if BN < D or BN % D or (H * D) % BN or D & (D - 1):
        raise ValueError(f"wide_qkv: no column tile of whole heads for H={H}, D={D} (tile {BN})")
    if K % BK:
        raise ValueError(f"wide_qkv: K={K} is not a multiple of the K tile {BK}")
    a_desc, w_desc = _descriptors(x, w, BM, BN, BK, "wide_qkv") if tma else (None, None)
    has_pos = pos is not None
    grid = (triton.cdiv(M, BM) * (3 * H * D // BN),)
    _wide_qkv[grid](x, w, b, q_w, q_b, k_w, k_b, q_out, kv, rows if has_pos else x, pos if has_pos else x,
                    a_desc, w_desc, M, K, *x.stride(), *w.stride(), q_out.stride(0), q_out.stride(1),
                    q_out.stride(2), kv.stride(0), kv.stride(1), kv.stride(2), T, eps,
                    H=H, D=D, BM=BM, BN=BN, BK=BK, GROUP_M=group_m, HAS_POS=has_pos, TMA=tma,
                    PRECISION=precision, num_warps=warps, num_stages=stages)
