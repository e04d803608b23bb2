"""HiFT's Snake activation as one Triton kernel (FP32 in, FP32 out).

``snake(x, alpha)`` is ``x + 1/(alpha + 1e-9) * sin(alpha * x)^2`` per channel, computed with the
same operations and roundings as the torch formula in ``hift.Snake`` (which stays the
reference): ``a + 1e-9`` in FP32, an IEEE division for the reciprocal (``div_rn``, as torch's
``reciprocal``), an accurate sine (libdevice ``sinf``, the CUDA math library's, as torch's
``sin``; never the approximate ``sin.approx``), ``s * s`` for the square (what torch's
``pow(2)`` computes) and separate multiply and add (FMA contraction off, and libdevice's
flush-to-zero variant off, as in torch's kernels). Torch runs that formula as ~7 element-wise
kernels; here it is one.

Two fusions the HiFT resblocks use:
* ``left`` / ``right``: the output carries that many zero frames on each side (the next conv's
  padding), so no separate ``F.pad`` (a fill and a copy) follows;
* ``residual``: the activation is applied to ``x + residual`` (the resblock's residual add), and
  that sum is returned too, for the next residual add.

Inputs are [B, C, T] with any strides (contiguous, or time-major: channel stride 1); the output
and the sum are allocated in the input's layout. Under ``TRITON_INTERPRET=1`` (CPU tests) the
kernel uses ``tl.sin``, because the interpreter has no libdevice; numpy's float32 sine there is
accurate to about 1 ulp.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import AVAILABLE, interpreting

EPS = 1e-9  # hift.Snake's epsilon

if AVAILABLE:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _snake(X, RES, ALPHA, OUT, SUM, C, T, T_OUT, left,
               sxb, sxc, sxt, srb, src, srt, sob, soc, sot, ssb, ssc, sst,
               HAS_RES: tl.constexpr, LIBDEVICE_SIN: tl.constexpr,
               BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
        b = tl.program_id(2).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        to = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        ti = to - left
        c_ok = c < C
        inside = (ti >= 0) & (ti < T)
        m_in = c_ok[:, None] & inside[None, :]
        x = tl.load(X + b * sxb + c[:, None] * sxc + ti[None, :] * sxt, mask=m_in, other=0.0)
        if HAS_RES:
            x = x + tl.load(RES + b * srb + c[:, None] * src + ti[None, :] * srt, mask=m_in, other=0.0)
            tl.store(SUM + b * ssb + c[:, None] * ssc + ti[None, :] * sst, x, mask=m_in)
        a = tl.load(ALPHA + c, mask=c_ok, other=1.0)[:, None]
        xa = x * a
        if LIBDEVICE_SIN:
            s = libdevice.sin(xa)
        else:
            s = tl.sin(xa)
        r = tl.math.div_rn(1.0, a + 1e-9)
        y = x + r * (s * s)
        y = tl.where(inside[None, :], y, 0.0)  # the padding frames are exact zeros
        m_out = c_ok[:, None] & (to < T_OUT)[None, :]
        tl.store(OUT + b * sob + c[:, None] * soc + to[None, :] * sot, y, mask=m_out)


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def time_major(x: torch.Tensor) -> bool:
    """[B, C, T] laid out as [B, T, C] in memory (channel stride 1, as the NHWC convs give)."""
    return x.shape[1] > 1 and x.stride(1) == 1 and x.shape[2] > 1 and x.stride(2) == x.shape[1]


def empty_like_layout(x: torch.Tensor, frames: int) -> torch.Tensor:
    """An uninitialised [B, C, frames] tensor in ``x``'s layout (time-major or contiguous)."""
    b, c, _ = x.shape
    if time_major(x):
        return torch.empty(b, frames, c, dtype=x.dtype, device=x.device).transpose(1, 2)
    return torch.empty(b, c, frames, dtype=x.dtype, device=x.device)


def snake(x: torch.Tensor, alpha: torch.Tensor, left: int = 0, right: int = 0,
          residual: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Snake of ``x`` (or of ``x + residual``) [B, C, T] with per-channel ``alpha`` [C], padded
    with ``left`` / ``right`` zero frames -> out [B, C, left + T + right]; with ``residual`` also
    the sum ``x + residual`` -> (out, sum)."""
    if not AVAILABLE:
        raise RuntimeError("kernels.snake needs Triton; use hift.snake_reference")
    if x.ndim != 3 or alpha.shape != (x.shape[1],):
        raise ValueError(f"snake: x must be [B, C, T] and alpha [C]; got {list(x.shape)}, {list(alpha.shape)}")
    if x.dtype != torch.float32 or alpha.dtype != torch.float32:
        raise TypeError("snake: FP32 only")
    if left < 0 or right < 0:
        raise ValueError("snake: negative padding")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("snake: residual must match x")
    B, C, T = x.shape
    t_out = left + T + right
    out = empty_like_layout(x, t_out)
    total = empty_like_layout(x, T) if residual is not None else None
    if out.numel() == 0:
        return out if residual is None else (out, x + residual)
    if out.stride(2) == 1:   # time contiguous: long rows of frames
        block_t = min(1024, _pow2(t_out))
        block_c = min(_pow2(C), max(1, 1024 // block_t))
    else:                    # channels contiguous: all (or 256) channels of a few frames
        block_c = min(256, _pow2(C))
        block_t = min(_pow2(t_out), max(1, 1024 // block_c))
    grid = (triton.cdiv(t_out, block_t), triton.cdiv(C, block_c), B)
    res = residual if residual is not None else x
    tot = total if total is not None else out
    alpha = alpha.contiguous()
    _snake[grid](x, res, alpha, out, tot, C, T, t_out, left,
                 x.stride(0), x.stride(1), x.stride(2), res.stride(0), res.stride(1), res.stride(2),
                 out.stride(0), out.stride(1), out.stride(2), tot.stride(0), tot.stride(1), tot.stride(2),
                 HAS_RES=residual is not None, LIBDEVICE_SIN=not interpreting(),
                 BLOCK_C=block_c, BLOCK_T=block_t, num_warps=4, enable_fp_fusion=False,
                 enable_reflect_ftz=False)
    return out if residual is None else (out, total)
