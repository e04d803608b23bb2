"""The glue between two estimator evaluations of a Whole-Euler solve, as two kernels per step.

Between the last DiT block of Euler step s and the first block of step s+1 the reference program
runs about a dozen small kernels: the final linear, the CFG combination and the Euler update
(five element-wise ops), two copies of x into the staged input, the input projection, block 0's
modulated LayerNorm, the CNN-cache read-out and read-in and the block kernel's counter reset. At
batch 1 each is a few microseconds of launch latency in the graph, not work.

* ``euler_junction``: per frame t of batch row b (its cond row b and uncond row Bb+b together):
  ``v = norm @ Wf^T + bf`` for both rows, ``x += dt * ((1+r) v_cond - r v_uncond)``, then the next
  step's residual stream ``h = x @ Wx^T + hc`` (Wx: the input projection's x columns; hc: the
  projection of the step-invariant ``[mu | spk | cond]`` columns plus bias, computed once per
  chunk) and its block-0 modulated LayerNorm (two-pass FP32 statistics, like ``dit_ops``).
  Optionally zeroes the persistent block kernel's barrier counters for the next evaluation.
* ``cnn_roll``: step s's new CNN cache (history frames ``idx``) out to its per-step slot and
  step s+1's input cache into history frames [0, K-1), in one launch.

``euler_junction_ref`` / ``cnn_roll_ref`` are the same contracts in torch (CPU without Triton,
and what the tests compare against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import AVAILABLE

# The junction's batch rows and counts are not specialised: one compile serves every batch bucket (on a cold cache
# 12 compiles before, triton_compile_census_session24_before_h200.md; 6 since, _session24_h200.md).
JUNCTION_RUNTIME_INTS = ("Bb", "T", "n_ctr")

if AVAILABLE:
    import triton
    import triton.language as tl

    from .dit_ops import round_tf32, store_operand

    @triton.jit
    def _mod_ln_store(hp, op, mean, den, SHIFT, SCALE, offs_c, c_ok, hm, ROUND: tl.constexpr):
        """(h - mean) / den * scale + shift for a (rows, channels) tile of h at ``hp``, stored at ``op``."""
        d = tl.load(hp, mask=hm, other=0.0) - mean[:, None]
        sh = tl.load(SHIFT + offs_c, mask=c_ok, other=0.0)
        sc = tl.load(SCALE + offs_c, mask=c_ok, other=0.0)
        store_operand(op, d / den[:, None] * sc[None, :] + sh[None, :], hm, ROUND)

    @triton.jit(do_not_specialize=JUNCTION_RUNTIME_INTS)
    def _euler_junction(NORM, WF, BF, X, WX, HC, SHIFT, SCALE, H, CTR,
                        s_nr, s_nt, s_xb, s_xt, s_wf, s_wx, s_cr, s_ct, s_hr, s_ht, s_mod,
                        Bb, T, C, NM, n_ctr, dt, cfg, eps,
                        HAS_V: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_CTR: tl.constexpr,
                        BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
                        BCTR: tl.constexpr, ROUND: tl.constexpr, PRECISION: tl.constexpr):
        b = tl.program_id(0)
        tb = tl.program_id(1)
        rc = b
        ru = Bb + b
        offs_t = tb * BT + tl.arange(0, BT)
        t_ok = offs_t < T
        offs_n = tl.arange(0, BN)
        n_ok = offs_n < NM
        xm = t_ok[:, None] & n_ok[None, :]
        xp = X + b * s_xb + offs_t[:, None] * s_xt + offs_n[None, :]
        x = tl.load(xp, mask=xm, other=0.0)
        if HAS_V:
            acc_c = tl.zeros([BT, BN], tl.float32)
            acc_u = tl.zeros([BT, BN], tl.float32)
            for k0 in range(0, C, BK):
                offs_k = k0 + tl.arange(0, BK)
                k_ok = offs_k < C
                w = round_tf32(tl.load(WF + offs_n[None, :] * s_wf + offs_k[:, None],
                                       mask=n_ok[None, :] & k_ok[:, None], other=0.0), ROUND)
                am = t_ok[:, None] & k_ok[None, :]
                # an FP16 NORM (FP16 GEMM operands) holds TF32-exact values: widened, not rounded again
                nc = round_tf32(tl.load(NORM + rc * s_nr + offs_t[:, None] * s_nt + offs_k[None, :],
                                        mask=am, other=0.0).to(tl.float32), ROUND)
                nu = round_tf32(tl.load(NORM + ru * s_nr + offs_t[:, None] * s_nt + offs_k[None, :],
                                        mask=am, other=0.0).to(tl.float32), ROUND)
                acc_c = tl.dot(nc, w, acc_c, input_precision=PRECISION)
                acc_u = tl.dot(nu, w, acc_u, input_precision=PRECISION)
            bf = tl.load(BF + offs_n, mask=n_ok, other=0.0)
            vc = acc_c + bf[None, :]
            vu = acc_u + bf[None, :]
            # the reference's order: dt * ((1 + r) * v_cond - r * v_uncond), then x + that
            x = x + dt * ((1.0 + cfg) * vc - cfg * vu)
            tl.store(xp, x, mask=xm)
        if HAS_CTR:
            if b + tb == 0:
                oc = tl.arange(0, BCTR)
                tl.store(CTR + oc, tl.zeros([BCTR], tl.int32), mask=oc < n_ctr)
        if HAS_NEXT:
            # this program's NORM rows were read above and are rewritten below
            tl.debug_barrier()
            xr = round_tf32(x, ROUND)
            sum_c = tl.zeros([BT], tl.float32)
            sum_u = tl.zeros([BT], tl.float32)
            for c0 in range(0, C, BC):
                offs_c = c0 + tl.arange(0, BC)
                c_ok = offs_c < C
                w = round_tf32(tl.load(WX + offs_c[None, :] * s_wx + offs_n[:, None],
                                       mask=n_ok[:, None] & c_ok[None, :], other=0.0), ROUND)
                p = tl.dot(xr, w, input_precision=PRECISION)
                hm = t_ok[:, None] & c_ok[None, :]
                hcp = HC + offs_t[:, None] * s_ct + offs_c[None, :]
                hp = H + offs_t[:, None] * s_ht + offs_c[None, :]
                h_c = tl.where(hm, p + tl.load(hcp + rc * s_cr, mask=hm, other=0.0), 0.0)
                h_u = tl.where(hm, p + tl.load(hcp + ru * s_cr, mask=hm, other=0.0), 0.0)
                tl.store(hp + rc * s_hr, h_c, mask=hm)
                tl.store(hp + ru * s_hr, h_u, mask=hm)
                sum_c += tl.sum(h_c, axis=1)
                sum_u += tl.sum(h_u, axis=1)
            mean_c = sum_c / C
            mean_u = sum_u / C
            tl.debug_barrier()      # the h rows stored above are read back by other threads
            var_c = tl.zeros([BT], tl.float32)
            var_u = tl.zeros([BT], tl.float32)
            for c0 in range(0, C, BC):
                offs_c = c0 + tl.arange(0, BC)
                hm = t_ok[:, None] & (offs_c < C)[None, :]
                hp = H + offs_t[:, None] * s_ht + offs_c[None, :]
                d_c = tl.where(hm, tl.load(hp + rc * s_hr, mask=hm, other=0.0) - mean_c[:, None], 0.0)
                d_u = tl.where(hm, tl.load(hp + ru * s_hr, mask=hm, other=0.0) - mean_u[:, None], 0.0)
                var_c += tl.sum(d_c * d_c, axis=1)
                var_u += tl.sum(d_u * d_u, axis=1)
            den_c = tl.sqrt(var_c / C + eps)
            den_u = tl.sqrt(var_u / C + eps)
            for c0 in range(0, C, BC):
                offs_c = c0 + tl.arange(0, BC)
                c_ok = offs_c < C
                hm = t_ok[:, None] & c_ok[None, :]
                hp = H + offs_t[:, None] * s_ht + offs_c[None, :]
                op = NORM + offs_t[:, None] * s_nt + offs_c[None, :]
                _mod_ln_store(hp + rc * s_hr, op + rc * s_nr, mean_c, den_c, SHIFT + rc * s_mod, SCALE + rc * s_mod,
                              offs_c, c_ok, hm, ROUND)
                _mod_ln_store(hp + ru * s_hr, op + ru * s_nr, mean_u, den_u, SHIFT + ru * s_mod, SCALE + ru * s_mod,
                              offs_c, c_ok, hm, ROUND)

    @triton.jit
    def _cnn_roll(HIST, OUT, IN, IDX, C, K1,
                  s_hd, s_hh, s_hr, s_hf, s_od, s_or, s_id, s_ir,
                  HAS_OUT: tl.constexpr, HAS_IN: tl.constexpr, BJ: tl.constexpr, BC: tl.constexpr):
        d = tl.program_id(0)
        half = tl.program_id(1)
        r = tl.program_id(2)
        oj = tl.arange(0, BJ)
        j_ok = oj < K1
        hist = HIST + d * s_hd + half * s_hh + r * s_hr
        for c0 in range(0, C, BC):
            oc = c0 + tl.arange(0, BC)
            m = j_ok[:, None] & (oc < C)[None, :]
            # original cache layout (.., 2C, K-1): channel half*C + c, frame j at (half*C + c) * (K-1) + j
            lay = (half * C + oc[None, :]) * K1 + oj[:, None]
            if HAS_OUT:
                f = tl.load(IDX + oj, mask=j_ok, other=0)
                old = tl.load(hist + f[:, None] * s_hf + oc[None, :], mask=m, other=0.0)
            if HAS_IN:
                new = tl.load(IN + d * s_id + r * s_ir + lay, mask=m, other=0.0)
            tl.debug_barrier()      # frames idx and [0, K-1) may overlap: every read before any write
            if HAS_OUT:
                tl.store(OUT + d * s_od + r * s_or + lay, old, mask=m)
            if HAS_IN:     # FP16 histories (FP16 GEMM operands) take the FP32 cache saturated
                store_operand(hist + oj[:, None] * s_hf + oc[None, :], new, m, False)


# Warps of ``euler_junction``. 8 measured the same as 4 on the H200 (whole-solve replays B=1 8.04 ms, B=16
# 22.7 either way, benchmarks/results/junction_probe_session16_h200.md); compiled as a launch specialises
# it, the 4-warp build does not spill (compile_gate.py).
JUNCTION_WARPS = 4


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def euler_junction(norm: torch.Tensor, wf: torch.Tensor, bf: torch.Tensor, x: torch.Tensor, wx: torch.Tensor,
                   hc: torch.Tensor, shift: torch.Tensor | None, scale1p: torch.Tensor | None, h: torch.Tensor,
                   dt: float, cfg_rate: float, eps: float, has_v: bool = True, ctr: torch.Tensor | None = None,
                   precision: str = "tf32", rounded: bool = False) -> None:
    """One Euler step's junction in place (see the module docstring).

    norm, h, hc (2Bb, T, C) (rows [0, Bb) cond, [Bb, 2Bb) uncond; norm: final-LN output in,
    block-0 LN output out; FP32, or FP16 for FP16 GEMM operands); x (Bb, T, NM) Euler state; wf (NM, C), bf (NM,) the final linear;
    wx (C, NM) the input projection's x columns (a strided view is fine); shift/scale1p (Rm, C)
    block 0's modulation of the next step (None: last step, no next h); ``has_v`` False: the
    first step's start (x is already the noise). ``rounded``: operands rounded to nearest TF32
    in-kernel and the LN output stored rounded (compiled TF32, as ``dit_block.rounds``).
    """
    R, T, C = norm.shape
    Bb, NM = x.shape[0], x.shape[2]
    if R != 2 * Bb or x.shape[1] != T or h.shape != norm.shape or hc.shape != norm.shape:
        raise ValueError(f"euler_junction: norm {tuple(norm.shape)}, h {tuple(h.shape)}, hc {tuple(hc.shape)} "
                         f"must all be (2*Bb, T, C) for x {tuple(x.shape)}")
    if wf.shape != (NM, C) or wx.shape != (C, NM) or bf.shape != (NM,):
        raise ValueError(f"euler_junction: wf {tuple(wf.shape)}, bf {tuple(bf.shape)}, wx {tuple(wx.shape)} "
                         f"do not match C={C}, NM={NM}")
    for name, t in (("norm", norm), ("x", x), ("hc", hc), ("h", h), ("wf", wf), ("wx", wx)):
        if t.stride(-1) != 1:
            raise ValueError(f"euler_junction: {name} needs a unit last stride, got {t.stride()}")
    has_next = shift is not None
    if has_next and (shift.stride() != scale1p.stride() or shift.stride(-1) != 1):
        raise ValueError("euler_junction: shift and scale tables must share a layout with unit last stride")
    s_mod = shift.stride(0) if has_next and shift.shape[0] > 1 else 0
    BT = 16
    _euler_junction[(Bb, triton.cdiv(T, BT))](
        norm, wf, bf, x, wx, hc, shift if has_next else norm, scale1p if has_next else norm, h,
        ctr if ctr is not None else x,
        norm.stride(0), norm.stride(1), x.stride(0), x.stride(1), wf.stride(0), wx.stride(0),
        hc.stride(0), hc.stride(1), h.stride(0), h.stride(1), s_mod,
        Bb, T, C, NM, ctr.numel() if ctr is not None else 0, float(dt), float(cfg_rate), float(eps),
        HAS_V=has_v, HAS_NEXT=has_next, HAS_CTR=ctr is not None, BT=BT, BN=max(16, _pow2(NM)),
        BK=min(64, max(16, _pow2(C))), BC=min(128, max(16, _pow2(C))),
        BCTR=_pow2(ctr.numel()) if ctr is not None else 1, ROUND=rounded, PRECISION=precision,
        num_warps=JUNCTION_WARPS)


def euler_junction_ref(norm, wf, bf, x, wx, hc, shift, scale1p, h, dt: float, cfg_rate: float, eps: float,
                       has_v: bool = True, ctr=None) -> None:
    """``euler_junction`` in torch: the reference program's ops, in its order."""
    Bb = x.shape[0]
    if has_v:
        v = F.linear(norm.to(wf.dtype), wf, bf)
        x.add_(dt * ((1.0 + cfg_rate) * v[:Bb] - cfg_rate * v[Bb:]))
    if ctr is not None:
        ctr.zero_()
    if shift is not None:
        p = x @ wx.t()
        h.copy_(torch.cat([p, p], 0) + hc)
        C = h.shape[-1]
        norm.copy_(F.layer_norm(h, (C,), eps=eps) * scale1p[:, None] + shift[:, None])


def cnn_roll(hist: torch.Tensor, out: torch.Tensor | None, inp: torch.Tensor | None, idx: torch.Tensor) -> None:
    """hist (depth, 2, R, F, C) conv histories; ``out`` (depth, R, 2C, K-1) <- frames ``idx`` (K-1,);
    then frames [0, K-1) <- ``inp`` (depth, R, 2C, K-1). Either may be None."""
    depth, _, R, _, C = hist.shape
    K1 = idx.numel()
    for name, t in (("out", out), ("inp", inp)):
        if t is not None and (t.shape != (depth, R, 2 * C, K1) or t.stride(2) != K1 or t.stride(3) != 1):
            raise ValueError(f"cnn_roll: {name} {tuple(t.shape)} stride {t.stride()} is not a (depth, R, 2C, K-1) "
                             f"cache with contiguous channels x frames ({(depth, R, 2 * C, K1)})")
    if hist.stride(-1) != 1:
        raise ValueError(f"cnn_roll: hist needs a unit channel stride, got {hist.stride()}")
    if out is None and inp is None:
        return
    o = out if out is not None else hist
    i = inp if inp is not None else hist
    _cnn_roll[(depth, 2, R)](hist, o, i, idx, C, K1, hist.stride(0), hist.stride(1), hist.stride(2), hist.stride(3),
                             o.stride(0), o.stride(1), i.stride(0), i.stride(1),
                             HAS_OUT=out is not None, HAS_IN=inp is not None, BJ=max(2, _pow2(K1)),
                             BC=min(256, _pow2(C)), num_warps=4)


def cnn_roll_ref(hist: torch.Tensor, out: torch.Tensor | None, inp: torch.Tensor | None,
                 idx: torch.Tensor | None) -> None:
    """``cnn_roll`` in torch (reads before writes, as the kernel); ``idx`` may be None without ``out``."""
    depth, _, R, _, C = hist.shape
    if out is not None:
        new = hist.index_select(3, idx)                                   # (depth, 2, R, K-1, C)
        out.copy_(new.permute(0, 2, 1, 4, 3).reshape(out.shape))
    if inp is not None:
        K1 = inp.shape[-1]
        hist[:, :, :, :K1].copy_(inp.view(depth, R, 2, C, K1).permute(0, 2, 1, 4, 3))
