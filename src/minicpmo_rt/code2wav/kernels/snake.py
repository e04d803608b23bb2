"""HiFT's Snake activation as one Triton kernel (FP32 in, FP32 out), and the other element-wise
steps around HiFT's convolutions folded into that kernel.

``snake(x, alpha)`` is ``x + 1/(alpha + 1e-9) * sin(alpha * x)^2`` per channel, computed with the
same operations and roundings as the torch formula in ``hift.snake_reference`` (the reference):
``a + 1e-9`` in FP32, an IEEE division for the reciprocal (``div_rn``, as torch's
``reciprocal``), an accurate sine (libdevice ``sinf``, the CUDA math library's, as torch's
``sin``; never the approximate ``sin.approx``), ``s * s`` for the square (what torch's
``pow(2)`` computes) and separate multiply and add (FMA contraction off, and libdevice's
flush-to-zero variant off, as in torch's kernels). Torch runs that formula as ~7 element-wise
kernels; here it is one.

What else one launch can do (``act_pad``; each step is the torch op's exact rounding):
* ``bias`` [C]: added to the input first (the conv before ran without its bias: cuDNN's
  convolution adds the bias in a separate kernel anyway);
* ``residual``: the activation is applied to ``x + (residual [+ bias])`` (the resblock's residual
  add), and that sum is returned too, for the next residual add;
* ``left`` / ``right``: the output carries that many zero frames on each side (the next conv's
  padding), so no separate ``F.pad`` (a fill and a copy) follows;
* ``repeat``: each frame repeated ``repeat`` times (the causal upsampler's nearest upsampling);
* ``act``: ``"snake"``, ``"leaky"`` (LeakyReLU with ``slope``) or ``"none"``.

Inputs are [B, C, T] with any strides (contiguous, or time-major: channel stride 1, as cuDNN's
NHWC convolutions give); the outputs are allocated in the input's layout unless ``time_major``
says otherwise. Under ``TRITON_INTERPRET=1`` (CPU tests) the kernel uses ``tl.sin``, because the
interpreter has no libdevice; numpy's float32 sine there is accurate to about 1 ulp.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import AVAILABLE, interpreting

ACTS = {"snake": 0, "leaky": 1, "none": 2}

if AVAILABLE:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    # Sizes, the padding and the batch strides vary with every mel length: not specialised on
    # (divisibility by 16 would otherwise compile a variant per length class); the channel and
    # time strides are (one of them is 1, which makes the accesses vectorisable).
    @triton.jit(do_not_specialize=["C", "T", "T_OUT", "left", "sxb", "srb", "sob", "ssb"])
    def _act_pad(X, RES, BIAS, ALPHA, OUT, SUM, C, T, T_OUT, left, slope,
                 sxb, sxc, sxt, srb, src, srt, sob, soc, sot, ssb, ssc, sst,
                 ACT: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SUM: tl.constexpr,
                 REPEAT: tl.constexpr,
                 LIBDEVICE_SIN: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
        b = tl.program_id(2).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        to = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tp = to - left
        inside = (tp >= 0) & (tp < T * REPEAT)
        ti = tl.where(inside, tp, 0) // REPEAT
        c_ok = c < C
        m_in = c_ok[:, None] & inside[None, :]
        x = tl.load(X + b * sxb + c[:, None] * sxc + ti[None, :] * sxt, mask=m_in, other=0.0)
        if HAS_BIAS:
            bias = tl.load(BIAS + c, mask=c_ok, other=0.0)[:, None]
        if HAS_RES:
            r = tl.load(RES + b * srb + c[:, None] * src + ti[None, :] * srt, mask=m_in, other=0.0)
            if HAS_BIAS:
                r = r + bias
            x = x + r
            if HAS_SUM:
                tl.store(SUM + b * ssb + c[:, None] * ssc + ti[None, :] * sst, x, mask=m_in)
        elif HAS_BIAS:
            x = x + bias
        if ACT == 0:
            a = tl.load(ALPHA + c, mask=c_ok, other=1.0)[:, None]
            xa = x * a
            if LIBDEVICE_SIN:
                s = libdevice.sin(xa)
            else:
                s = tl.sin(xa)
            # the numerator as a tensor: newer Tritons reject a Python float in div_rn (the CPU compile
            # test skipped on Triton 3.9 until this); the same IEEE division either way
            r_a = tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), a + 1e-9)
            y = x + r_a * (s * s)
        elif ACT == 1:
            y = tl.where(x > 0, x, x * slope)
        else:
            y = x
        y = tl.where(inside[None, :], y, 0.0)  # the padding frames are exact zeros
        m_out = c_ok[:, None] & (to < T_OUT)[None, :]
        tl.store(OUT + b * sob + c[:, None] * soc + to[None, :] * sot, y, mask=m_out)


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def time_major(x: torch.Tensor) -> bool:
    """[B, C, T] laid out as [B, T, C] in memory (channel stride 1, as the NHWC convs give)."""
    return x.ndim == 3 and x.shape[1] > 1 and x.stride(1) == 1 and (x.shape[2] == 1 or x.stride(2) == x.shape[1])


def empty_like_layout(x: torch.Tensor, frames: int, tm: Optional[bool] = None) -> torch.Tensor:
    """An uninitialised [B, C, frames] tensor, time-major if ``tm`` (default: as ``x``)."""
    b, c, _ = x.shape
    if time_major(x) if tm is None else tm:
        return torch.empty(b, frames, c, dtype=x.dtype, device=x.device).transpose(1, 2)
    return torch.empty(b, c, frames, dtype=x.dtype, device=x.device)


def act_pad(x: torch.Tensor, act: str = "snake", alpha: Optional[torch.Tensor] = None, slope: float = 0.0,
            left: int = 0, right: int = 0, residual: Optional[torch.Tensor] = None,
            bias: Optional[torch.Tensor] = None, repeat: int = 1, tm: Optional[bool] = None,
            return_sum: bool = True) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``F.pad(act(x [+ residual] [+ bias]).repeat_interleave(repeat, 2), (left, right))`` in one
    kernel (see the module docstring); x [B, C, T] FP32 -> out [B, C, left + T*repeat + right];
    with ``residual`` and ``return_sum`` -> (out, x + (residual [+ bias]))."""
    if not AVAILABLE:
        raise RuntimeError("kernels.snake needs Triton; use the torch formulation in hift")
    if act not in ACTS:
        raise ValueError(f"act must be one of {sorted(ACTS)}, got {act!r}")
    if x.ndim != 3:
        raise ValueError(f"x must be [B, C, T], got {list(x.shape)}")
    B, C, T = x.shape
    if act == "snake" and (alpha is None or alpha.shape != (C,) or alpha.dtype != torch.float32):
        raise ValueError(f"snake needs an FP32 alpha of shape [{C}]")
    for t in (x, residual, bias):
        if t is not None and t.dtype != torch.float32:
            raise TypeError("act_pad: FP32 only")
    if residual is not None and residual.shape != x.shape:
        raise ValueError("act_pad: residual must match x")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"act_pad: bias must be [{C}]")
    if left < 0 or right < 0 or repeat < 1 or (residual is not None and repeat != 1):
        raise ValueError("act_pad: padding >= 0, repeat >= 1, and no repeat with a residual")
    t_out = left + T * repeat + right
    want_sum = residual is not None and return_sum
    out = empty_like_layout(x, t_out, tm)
    total = empty_like_layout(x, T, tm) if want_sum else None
    if out.numel() == 0:
        return (out, total) if want_sum else out
    if out.stride(2) == 1:   # time contiguous: long rows of frames
        block_t = min(1024, _pow2(t_out))
        block_c = min(_pow2(C), max(1, 1024 // block_t))
    else:                    # channels contiguous: all (or 256) channels of a few frames
        block_c = min(256, _pow2(C))
        block_t = min(_pow2(t_out), max(1, 1024 // block_c))
    grid = (triton.cdiv(t_out, block_t), triton.cdiv(C, block_c), B)
    res = residual if residual is not None else x
    tot = total if total is not None else out
    _act_pad[grid](x, res, bias.contiguous() if bias is not None else x,
                   alpha.contiguous() if alpha is not None else x, out, tot, C, T, t_out, left, float(slope),
                   x.stride(0), x.stride(1), x.stride(2), res.stride(0), res.stride(1), res.stride(2),
                   out.stride(0), out.stride(1), out.stride(2), tot.stride(0), tot.stride(1), tot.stride(2),
                   ACT=ACTS[act], HAS_RES=residual is not None, HAS_BIAS=bias is not None, HAS_SUM=want_sum,
                   REPEAT=repeat,
                   LIBDEVICE_SIN=not interpreting(), BLOCK_C=block_c, BLOCK_T=block_t, num_warps=4,
                   enable_fp_fusion=False, enable_reflect_ftz=False)
    return (out, total) if want_sum else out


def snake(x: torch.Tensor, alpha: torch.Tensor, left: int = 0, right: int = 0,
          residual: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
          tm: Optional[bool] = None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Snake of ``x`` (or of ``x + (residual [+ bias])``, or ``x + bias``) [B, C, T] with
    per-channel ``alpha`` [C], padded with ``left`` / ``right`` zero frames -> out
    [B, C, left + T + right]; with ``residual`` also the sum -> (out, sum)."""
    if x.ndim != 3 or alpha.shape != (x.shape[1],):
        raise ValueError(f"snake: x must be [B, C, T] and alpha [C]; got {list(x.shape)}, {list(alpha.shape)}")
    if x.dtype != torch.float32 or alpha.dtype != torch.float32:
        raise TypeError("snake: FP32 only")
    return act_pad(x, "snake", alpha, 0.0, left, right, residual, bias, 1, tm)
