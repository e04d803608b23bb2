"""``out = act(x @ w.T + b)`` for few rows: a Triton TF32 GEMM that spreads thin weights wide.

At batch 1 a CFG-doubled 1-s chunk is ~100 rows, so every DiT GEMM is (100 x 512..2048) times a
1-4 MB weight. cuBLAS picks 64x64 tiles for that: 16-48 CTAs on a 132-SM GPU, each streaming a
long stripe of the weight, so the GEMM is latency-bound at a few percent of bandwidth. Here one
program owns a narrow (BLOCK_N = 16/32) column stripe for ALL rows (BLOCK_M covers M), so the
weight is read exactly once by 4-8x more programs; optional split-K adds programs for the long
K of ``fc2`` and reduces with FP32 atomics into a zeroed output (order-dependent rounding at the
1e-7 level, inside the TF32 budget). The tanh-GELU epilogue is fused when there is no split.

Used only under TF32 (``input_precision="tf32"``): the IEEE path keeps cuBLAS so that the
fused body stays within 1e-5 of the original there. Semantics are those of ``torch.addmm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import AVAILABLE

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _gemm(A, W, BIAS, OUT, M, N, K,
              sam, sak, swn, swk, som, son,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
              HAS_BIAS: tl.constexpr, GELU: tl.constexpr, PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            kk = k0 + offs_k
            k_ok = kk < K
            a = tl.load(A + offs_m[:, None] * sam + kk[None, :] * sak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + offs_n[None, :] * swn + kk[:, None] * swk, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0)[None, :]
        if GELU:
            # tanh-GELU; tanh(u) = 1 - 2 / (exp(2u) + 1) stays finite for any u
            u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            acc = 0.5 * acc * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
        ptrs = OUT + offs_m[:, None] * som + offs_n[None, :] * son
        ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(ptrs, acc, mask=ok)
        else:
            tl.atomic_add(ptrs, acc, mask=ok, sem="relaxed")


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 32
    block_k: int = 32
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def default_config(M: int, N: int, K: int) -> GemmConfig:
    """A launch shape for few rows: all rows in one or two row tiles, columns split to fill the GPU.

    Chosen from the H200 sweep in benchmarks/code2wav_bench.py (``gemm_micro``)."""
    bm = min(128, max(16, _pow2(M)))
    bn = 16 if N <= 1024 else 32
    split = 4 if K >= 2048 else 1
    return GemmConfig(block_m=bm, block_n=bn, block_k=32, split_k=split, num_warps=4, num_stages=3)


def small_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
               gelu: bool = False, precision: str = "tf32", config: GemmConfig | None = None) -> torch.Tensor:
    """out (M, N) = [gelu](x (M, K) @ w (N, K).T + b (N,)); strided 2-D views allowed for x and out."""
    if not AVAILABLE:
        raise RuntimeError("small_gemm needs Triton; use torch.addmm")
    M, K = x.shape
    N, K2 = w.shape
    if K2 != K or out.shape != (M, N):
        raise ValueError(f"small_gemm shapes: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    if x.dtype != torch.float32 or w.dtype != torch.float32 or out.dtype != torch.float32:
        raise TypeError("small_gemm is FP32 only")
    if precision not in ("tf32", "ieee"):
        raise ValueError(f"precision must be 'tf32' or 'ieee', got {precision!r}")
    cfg = config or default_config(M, N, K)
    if gelu and cfg.split_k > 1:
        raise ValueError("small_gemm: a GELU epilogue needs the whole K sum (split_k=1)")
    if cfg.split_k > 1:
        out.zero_()
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), cfg.split_k)
    _gemm[grid](x, w, b if b is not None else w, out, M, N, K,
                x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                HAS_BIAS=b is not None, GELU=gelu, PRECISION=precision,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
