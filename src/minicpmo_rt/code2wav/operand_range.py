"""Can FP16 hold every operand of the fused DiT body's TF32 GEMMs? A range certificate from the weights.

The fused body's Triton GEMMs multiply operands rounded to TF32 (10 mantissa bits, FP32's exponent).
FP16 has the same 10 mantissa bits, so a TF32-rounded value whose magnitude lies in FP16's normal range
[2^-14, 65504] is stored exactly, the tensor core forms the same exact products and sums them in FP32
as a TF32 dot does: the arithmetic is TF32's, with half the operand bytes (``FusedDiT(gemm_operands=
"fp16")``). The two ways FP16 could differ:

* overflow: a value beyond 65504 saturates. This module bounds every operand from the weights alone,
  whatever the input, and the fused body takes FP16 operands by default only when every bound fits
  (``fits_fp16``);
* underflow: a value below 2^-14 keeps fewer bits (FP16 subnormals, step 2^-24), so it moves by at most
  2^-25 ~ 3e-8 in absolute terms, against TF32's own rounding of 2^-11 relative: an operand of
  magnitude ~1 is already rounded by ~5e-4. Those tiny operands add at most 2^-25 * sum|w| to an
  output, far below the TF32 error the policy accepts.

Why bounds exist whatever the input: every GEMM operand is a normalised quantity or a bounded function
of one, with modulations that depend on the Euler step's time only (adaLN-Zero on the timestep
embedding), and a solve's steps are fixed by ``n_timesteps``:

* QKV, conv1 and fc1 read ``LN(x) * (1 + scale) + shift`` with an affine-free LayerNorm over C
  channels: a zero-mean vector with sum of squares <= C has no entry beyond sqrt(C - 1);
* the out-projection reads the attention output, a convex combination of V rows, and V is the
  QKV GEMM's output on that bounded input: |V_i| <= sum_j |Wv_ij| * bound_j + |bv_i|. Cached frames
  of earlier chunks were made by the same block at one of the same steps, so they obey the same bound;
* conv2 reads Mish(affine LN(conv1)): |LN_j| <= sqrt(C - 1)|g_j| + |b_j|, Mish(u) lies in [-0.31, u];
* fc2 reads tanh-GELU(fc1): |GELU(z)| <= max(|z|, 0.18) with z bounded as V is.

Bounds are taken over every block and every step (a cache frame may come from any step), computed in
float64 from the modulation the model itself computes, and ``MARGIN`` covers the FP32 evaluation of the
LayerNorms and modulations on the device and the operands' TF32 rounding (2^-11).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .cfm import cosine_t_span

FP16_MAX = 65504.0
MARGIN = 1.01
MISH_LOW = 0.31     # -min Mish(u) = 0.3088...
GELU_LOW = 0.18     # -min tanh-GELU(z) = 0.1700...
ROLES = ("qkv", "proj", "conv1", "conv2", "fc1", "fc2")


@dataclass(frozen=True)
class OperandRange:
    """The largest magnitude each GEMM's activation operand can take (over blocks and Euler steps), and the
    largest GEMM weight, for one DiT at one step count."""

    n_timesteps: int
    activations: dict[str, float]     # role (``ROLES``) -> bound on |operand|
    weights: float                    # max |w| over the GEMM weights (stored as FP16 too)

    @property
    def largest(self) -> tuple[str, float]:
        role = max(self.activations, key=self.activations.get)
        if self.weights > self.activations[role]:
            return "weights", self.weights
        return role, self.activations[role]

    @property
    def fits_fp16(self) -> bool:
        """Does every operand stay inside FP16's range, with ``MARGIN`` to spare?"""
        return math.isfinite(self.largest[1]) and self.largest[1] * MARGIN <= FP16_MAX

    def describe(self) -> str:
        role, value = self.largest
        verdict = "fit" if self.fits_fp16 else "do not fit"
        return (f"GEMM operands {verdict} FP16 (largest bound {value:.4g}, {role}, against {FP16_MAX:g}; "
                f"{self.n_timesteps} Euler steps)")


def _mod_bound(shift: torch.Tensor, scale: torch.Tensor, root: float) -> torch.Tensor:
    """Per channel, over steps (rows): max |LN(x) * (1 + scale) + shift| for an affine-free LN."""
    return (root * (1 + scale).abs() + shift.abs()).amax(0)


def _linear_bound(lin: nn.Module, bound_in: torch.Tensor) -> torch.Tensor:
    """Per output: max |W x + b| over inputs with |x_j| <= bound_in_j."""
    w = lin.weight.detach().double()
    out = w.abs() @ bound_in
    return out + lin.bias.detach().double().abs() if lin.bias is not None else out


def _finite_max(b: torch.Tensor) -> float:
    """max(b), or inf where b holds a NaN or inf (Python's max would skip a NaN)."""
    return float(b.max()) if bool(torch.isfinite(b).all()) else math.inf


@torch.no_grad()
def operand_range(dit: nn.Module, n_timesteps: int = 10) -> OperandRange:
    """The certificate for ``dit`` (the original body's modules, ``dit.DiT``) solved in ``n_timesteps``
    Euler steps; evaluated on the weights' own device."""
    if n_timesteps < 1:
        raise ValueError(f"n_timesteps must be >= 1, got {n_timesteps}")
    p = dit.in_proj.weight
    t = cosine_t_span(n_timesteps, p.device, p.dtype)[:-1]     # the times the estimator is evaluated at
    c = dit.t_embedder(t)                                        # (S, C), as the model computes it
    C = c.shape[-1]
    root = math.sqrt(C - 1)
    acts = dict.fromkeys(ROLES, 0.0)
    wmax = 0.0
    for blk in dit.blocks:
        sh_a, sc_a, _, sh_m, sc_m, _, sh_c, sc_c, _ = blk.adaLN_modulation(c).double().chunk(9, dim=-1)
        a1, a2, a3 = _mod_bound(sh_a, sc_a, root), _mod_bound(sh_m, sc_m, root), _mod_bound(sh_c, sc_c, root)
        v = _linear_bound(blk.attn.to_v, a1)
        ln = blk.conv.block[3]
        mish = (root * ln.weight.detach().double().abs() + ln.bias.detach().double().abs()).clamp_min(MISH_LOW)
        gelu = _linear_bound(blk.mlp.fc1, a2).clamp_min(GELU_LOW)
        for role, b in zip(ROLES, (a1, v, a3, mish, a2, gelu)):
            acts[role] = max(acts[role], _finite_max(b))
        for lin in (blk.attn.to_q, blk.attn.to_k, blk.attn.to_v, blk.attn.proj, blk.conv.block[1],
                    blk.conv.block[6], blk.mlp.fc1, blk.mlp.fc2):
            wmax = max(wmax, _finite_max(lin.weight.detach().abs()))
    return OperandRange(n_timesteps=n_timesteps, activations=acts, weights=wmax)
