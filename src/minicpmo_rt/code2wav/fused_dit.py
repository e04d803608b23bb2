"""The fused DiT body: the original estimator's math in ~12 kernels per block.

It reads the SAME parameters as the original body (``dit.blocks[i].attn.to_q``,
``conv.block.1`` ...; upstream's names, so the upstream module works too). The
only derived tensors are packed views of those weights, built once:

* ``to_q|to_k|to_v`` packed into one QKV GEMM (bias included);
* each causal conv's weight (Cout, Cin, K) as a taps matrix (K*Cout, Cin), so the
  conv over a history buffer ``[cache(K-1) | x(T)]`` is one GEMM whose output row
  t+k, column block k, summed over k, is the conv output at t (the "tap sum").

Per block (R rows = CFG-doubled batch, T query frames, C hidden):
  1  residual + modulated LN (fused with the previous block's MLP residual)
  2  QKV GEMM             3  q/k head LN, k/v written straight into the [k|v] cache
  4  attention (Triton tiled TF32 on SM80+, SDPA elsewhere)   5  out-proj GEMM
  6  residual + modulated LN written straight into conv1's history buffer
  7  conv1 GEMM           8  tap sum + bias + LN + Mish into conv2's history buffer
  9  conv2 GEMM           10 tap sum + bias + residual + modulated LN (MLP input)
  11 fc1 GEMM with tanh-GELU in the cuBLASLt epilogue          12 fc2 GEMM
The original body launches ~47 kernels per block (see benchmarks/results). With few rows
(<= SPLIT_MAX_ROWS, i.e. up to batch 5 with CFG) the QKV, out-proj, conv and fc2 GEMMs each
write split-K partials from one strided-batched cuBLAS call, and stages 3, 6, 8, 10 and the
next block's 1 sum them (with the bias) while loading: more CTAs per GEMM, no extra kernel.

With many rows (>= WIDE_MIN_ROWS: batch 8+ with CFG, TF32 on CUDA) the GEMMs but fc2 are Triton tile
GEMMs instead (``kernels/wide_gemm.py``, ``blocks``): conv1/conv2 as implicit GEMMs over their taps
(stages 8 and 10 then read one C-wide output), fc1's GELU in the GEMM, and stage 3 inside the QKV
GEMM's epilogue (``WIDE_QKV_LN_MAX_ROWS``): 11 kernels per block, none of them cuBLAS's GELU or
memset kernels. With FP16 operands (``gemm_operands="fp16"``, which the knobs pick where the weights'
range certificate fits, ``operand_range``) they take every staged row
count, but for the out-proj, the convs, fc1 and fc2, which on CUDA run as cuBLAS FP16 GEMMs
(``CUBLAS16_ROLES``): only the QKV, with its head LNs in the epilogue, stays a tile GEMM there.

Without Triton (CPU CI, pre-SM80 CUDA, HIP) every fused stage runs as its torch
formulation on the same buffers and attention goes through SDPA: the "SDPA
fallback", which is what the CPU tests exercise; under ``TRITON_INTERPRET=1`` the
Triton stages run on CPU tensors too.

Modulation: per timestep a table (depth, 9, C) with the scale entries stored as
``1 + scale`` plus the final layer's (2, C), computed from ``t`` through the
original ``t_embedder``/``adaLN_modulation`` modules (outside any graph).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import AVAILABLE as TRITON_AVAILABLE, interpreting, usable_on
from .kernels import dit_block, dit_ops, euler_step
from .kernels.small_gemm import small_gemm
from .kernels.tiled_attention import (StreamKV, device_tma, direct_attention, packed_kv, sdpa_attention,
                                      tiled_attention)
from .kernels.wide_gemm import wide_gemm as _wide_gemm, wide_qkv as _wide_qkv

__all__ = ["supports_fused_body", "FusedDiT", "DiTLayout", "Modulation"]

AttentionKind = Literal["triton-tf32", "triton-ieee", "sdpa"]
GemmKind = Literal["cublas", "triton", "cublas-split"]
OperandKind = Literal["fp32", "fp16"]

# Attention launch shape by grid fill (H200 sweep, benchmarks/code2wav_kernels_bench.py): with
# rows x heads >= 128 there are enough programs (32-query blocks, no key split); below that,
# 16-query blocks and keys split until ~512 programs (2 rows x 8 heads: 18.3 -> 8.6 us).
ATTN_FULL_GRID_ROWS_HEADS = 128
ATTN_TARGET_PROGRAMS = 512
# IEEE dots (attention "triton-ieee") run on the FMA units with each thread's share of the q, k, v and p
# tiles in registers. ptxas for SM90 spills kilobytes per thread for a 64-query block (the direct attention
# 27 KB), 828 bytes for a 32-query block on 4 warps, 280-352 with TMA-staged tiles, and nothing for 32
# queries on 8 warps with pointer loads (compile_gate.py checks). The 64-query TMA shape made the H200's
# IEEE solve 515 ms at B=16 against 119 now. So IEEE attention takes at most IEEE_BLOCK_M queries per
# program, on IEEE_WARPS warps, without TMA (the TF32 shapes above are unchanged).
IEEE_BLOCK_M, IEEE_WARPS = 32, 8
# direct_attention (each stream's cache read in place): keys split to ~256 programs, one query block each,
# with no full-grid rule of its own. H200, replay / solve as called (ms per chunk), the splits on whole key
# tiles (tiled_attention.DIRECT_ALIGNED_SPLITS; session 19, direct_splits_probe_session19_*_h200.md):
# batch 4 (64 rows x heads) 2 splits 15.32 / 16.29, 3 15.04 / 15.64, 4 14.76 / 15.27, 8 16.14 / 17.10;
# batch 8 (128) 1 split 16.92-16.95 / 17.77-18.10, 2 16.62-16.66 / 17.44-17.90; batch 16 (256) 1 split
# 24.92-24.98 replay, 2 26.47-26.66. Session 14, before the alignment: batch 4 2 splits 16.89, 8 18.57.
DIRECT_TARGET_PROGRAMS = 256
# With key splits the split that finishes a query block last combines the partials in the attention's own
# launch (``tiled_attention._last_combine``, counted in ``Workspace.att_ctr``) instead of a second kernel.
# Whole-solve replays (last_combine_probe_session21_h200.md), off / on: B=4 14.72-14.74 / 14.71-14.76 ms,
# B=8 16.31-16.47 / 16.30: the same time, one kernel (and graph node) fewer per block.
ATTN_LAST_COMBINE = True

# Split-K for few rows ("cublas-split", the default): at ~100 rows cuBLAS tiles a DiT GEMM into
# 16-48 CTAs that each stream a long weight stripe. Each GEMM of <= SPLIT_MAX_ROWS rows runs as
# one strided-batched cuBLAS GEMM over SPLIT_K_FEW_ROWS K slices (>= SPLIT_MIN_K each); the fused
# stage that consumes the output sums the partials (plus the bias) while loading, so there is no
# reduction kernel. H200 sweep (benchmarks/results/code2wav_split_k_h200.md), solve per 1-s chunk:
# B=1 12.97 ms unsplit, 12.22 with 2 partials, 12.92 with ~256 CTAs (4-16 partials), 13.45 with
# 8; B=4 18.04 unsplit, 17.73 with 2; from ~10 rows x 50 frames on nothing is split.
SPLIT_MAX_ROWS = 512
SPLIT_K_FEW_ROWS = 2
SPLIT_MIN_K = 128

# Many rows (batch >= 8 with CFG at 50 frames): the GEMMs run as Triton tile GEMMs (``wide_gemm``)
# with the conv taps summed inside the GEMM (output C wide, not K*C), fc1's GELU in its epilogue,
# and every GEMM operand stored rounded to nearest TF32 by the stage that writes it (the tensor
# core truncates), as in the persistent block kernel. fc2 (K 2048) stays on cuBLAS: no faster there.
# H200, whole-solve replay per 1-s chunk (code2wav_gemm_probe_session10_h200.md): B=16 23.32 vs 24.69
# ms with cuBLAS GEMMs, B=8 16.43 vs 17.31; at B=4 (400 rows) the split-K cuBLAS GEMMs stay.
WIDE_MIN_ROWS = 768
# With FP16 operands (``gemm_operands="fp16"``) the tile GEMMs take every staged body's rows: in
# isolation at 100 rows one block's five GEMMs take 25 us against cuBLAS TF32's 34
# (fp16_operand_probe_session13_h200.md).
WIDE16_MIN_ROWS = 0
# ... but for these roles, which on CUDA run through cuBLAS (``torch.mm(out_dtype=)``: FP16 operands, FP32 outputs,
# the tile GEMMs' arithmetic; the GEMMs alone came out bit-identical at every role's shape on the H100). The
# out-proj's and fc2's bias goes to the residual stage after them, as split-K partials' does (session 60,
# cublas16_probe_session60_h100.md: B=16 as called 22.66 -> 21.91 ms, the mel bit-identical). The convs run as
# cuBLAS's taps products (K*C wide), which the row stages after them sum; fc1 as bias + tanh-GELU in cuBLASLt's
# epilogue with an FP16 output (fc2's operand), its bias rounded to FP16. Those two move FP32 roundings out of
# the tile GEMMs' epilogues, so the mel moves by 1.5e-4 (TF32-level; tests/code2wav/test_fused_dit.py says
# why). Session 62, the flow's solve as called, proj + fc2 / + conv + fc1 (cublas16_roles_probe_session62_*.md):
# H100 B=4 11.67 / 10.64 ms, B=8 14.20 / 13.48, B=16 20.86 / 20.43; the H200 (conv, fc1 and the QKV measured
# apart there) gave B=16 20.05 against 19.82 with the conv alone, 19.41 with fc1 alone. The QKV stays a tile GEMM
# with its head LNs in the epilogue: on cuBLAS with a separate LN stage it cost time at B=4-8 (H100 10.64 ->
# 10.90, 13.48 -> 13.80) and was level at B=16. The CPU interpreter has no such cuBLAS call: tile GEMMs there.
CUBLAS16_ROLES = frozenset({"proj", "conv", "fc1", "fc2"})
# Every role ``FusedDiT.cublas16`` may name. "qkv": the QKV GEMM into ws.qkv, its head LNs and [k|v] cache write a
# row stage of their own (``dit_ops.qkv_head_ln``); "conv": both convs as cuBLAS's taps products (K*C wide outputs,
# summed by the row stages after them, as with FP32 cuBLAS); "fc1": bias + tanh-GELU in cuBLASLt's epilogue with
# an FP16 output (fc2's operand), which takes the bias in FP16 (rounded: TF32's unit roundoff, not bit-identical).
# ``benchmarks/cublas16_probe.py --roles`` times sets of them in the solve.
CUBLAS16_ALL = frozenset({"qkv", "proj", "conv", "fc1", "fc2"})
# Up to this many rows (None: any) the wide path's QKV GEMM also applies the q/k head LNs in its
# epilogue and writes [k|v] straight into the cache (``wide_qkv``). H200 whole-solve replays, same
# machine (code2wav_gemm_probe_session11_qkv_h200.md): B=8 16.14 vs 16.45 ms with the separate LN
# stage; B=16 22.91 vs 23.47 once the epilogue runs on 64x128 tiles (``wide_gemm.QKV_TILES``; at
# session 10's 128x128 it was the slower one, 23.81).
WIDE_QKV_LN_MAX_ROWS: int | None = None

# adaLN chunk order of the original block
SH_MSA, SC_MSA, G_MSA, SH_MLP, SC_MLP, G_MLP, SH_CONV, SC_CONV, G_CONV = range(9)


class AttnShape(NamedTuple):
    """How the staged body launches its Triton attention (``FusedDiT._attn_shape`` / ``_direct_shape``)."""

    block_m: int        # queries per program
    splits: int         # key splits (partials combined by a second kernel when > 1)
    stages: int         # software-pipelining depth of the key loop
    tma: bool           # K/V tiles through TMA descriptors (host-made, or built per (row, head) by direct_attention)
    warps: int


@dataclass(frozen=True)
class DiTLayout:
    depth: int
    hidden: int
    heads: int
    head_dim: int
    mlp_hidden: int
    in_channels: int
    out_channels: int
    taps: int
    norm_eps: float      # norm1..3 / norm_final (affine-free)
    qk_eps: float
    conv_ln_eps: float


def _is_ln(m, n: int, affine: bool | None = None) -> bool:
    if not isinstance(m, nn.LayerNorm) or tuple(m.normalized_shape) != (n,):
        return False
    return affine is None or m.elementwise_affine == affine


def _is_plain_conv(m, c: int) -> bool:
    return (isinstance(m, nn.Conv1d) and m.in_channels == c and m.out_channels == c and m.stride == (1,)
            and m.dilation == (1,) and m.groups == 1 and m.padding in ((0,), 0) and m.bias is not None
            and m.padding_mode == "zeros")


def supports_fused_body(dit: nn.Module) -> tuple[bool, str]:
    """(eligible, why not) for the fused body over ``dit``'s parameters."""
    try:
        blocks = dit.blocks
        C = dit.in_proj.out_features
        for i, blk in enumerate(blocks):
            a = blk.attn
            H, D = a.num_heads, a.head_dim
            where = f"blocks.{i}"
            for n in ("norm1", "norm2", "norm3"):
                if not _is_ln(getattr(blk, n), C, affine=False):
                    return False, f"{where}.{n} is not an affine-free LayerNorm({C})"
            for n in ("to_q", "to_k", "to_v"):
                lin = getattr(a, n)
                if not isinstance(lin, nn.Linear) or lin.bias is None or lin.out_features != H * D:
                    return False, f"{where}.attn.{n} is not a biased Linear to {H}x{D}"
            if not (_is_ln(a.q_norm, D, affine=True) and _is_ln(a.k_norm, D, affine=True)):
                return False, f"{where}.attn q/k norms are not affine LayerNorm({D})"
            if D < 16 or D & (D - 1):
                return False, f"{where}.attn head_dim {D} is not a power of two >= 16"
            seq = blk.conv.block
            if len(seq) != 8 or not (_is_plain_conv(seq[1], C) and _is_ln(seq[3], C, affine=True)
                                     and _is_plain_conv(seq[6], C)):
                return False, f"{where}.conv.block is not [_, Conv1d, _, LayerNorm, Mish, _, Conv1d, _]"
            if not isinstance(seq[4], nn.Mish):
                return False, f"{where}.conv.block.4 is {type(seq[4]).__name__}, not Mish"
            if seq[1].kernel_size != seq[6].kernel_size:
                return False, f"{where}.conv kernels differ"
            act = getattr(blk.mlp, "act", None)
            if act is not None and not (isinstance(act, nn.GELU) and act.approximate == "tanh"):
                return False, f"{where}.mlp.act is not tanh-GELU"
            if not isinstance(getattr(blk.mlp, "norm", nn.Identity()), nn.Identity):
                return False, f"{where}.mlp has a hidden norm"
            ada = blk.adaLN_modulation[-1]
            if not isinstance(ada, nn.Linear) or ada.out_features != 9 * C:
                return False, f"{where}.adaLN_modulation is not Linear({C}, {9 * C})"
        fl = dit.final_layer
        if not _is_ln(fl.norm_final, C, affine=False):
            return False, "final_layer.norm_final is not an affine-free LayerNorm"
    except AttributeError as exc:
        return False, f"unknown DiT layout ({exc})"
    return True, ""


def split_k_for(M: int, N: int, K: int) -> int:
    """Split-K partials for an (M x K) @ (K x N) GEMM of the "cublas-split" kind (1: no split)."""
    s = SPLIT_K_FEW_ROWS
    if M > SPLIT_MAX_ROWS or K % s or K // s < SPLIT_MIN_K:
        return 1
    return s


def layout_of(dit: nn.Module) -> DiTLayout:
    b0 = dit.blocks[0]
    return DiTLayout(depth=len(dit.blocks), hidden=dit.in_proj.out_features, heads=b0.attn.num_heads,
                     head_dim=b0.attn.head_dim, mlp_hidden=b0.mlp.fc1.out_features,
                     in_channels=dit.in_proj.in_features, out_channels=dit.final_layer.linear.out_features,
                     taps=b0.conv.block[1].kernel_size[0], norm_eps=b0.norm1.eps, qk_eps=b0.attn.q_norm.eps,
                     conv_ln_eps=b0.conv.block[3].eps)


@dataclass
class Modulation:
    """adaLN tables for Rm rows (Rm = 1 when every row shares the timestep)."""

    blocks: torch.Tensor   # (Rm, depth, 9, C), scale entries hold 1 + scale (a view of chain)
    final: torch.Tensor    # (Rm, 2, C): shift, 1 + scale (a view of chain)
    chain: torch.Tensor    # (Rm, depth+1, 9, C): blocks, then a row whose slots 0/1 hold final


@dataclass
class Workspace:
    """Per-call buffers for R rows, T frames (reused by a captured graph). GEMM outputs carry a
    leading split-K axis: its length is the GEMM's partial count (``FusedDiT.gemm_splits``)."""

    h: torch.Tensor        # (R, T, C) residual stream
    norm: torch.Tensor     # (R, T, C) modulated-LN output
    qkv: torch.Tensor      # (Sq, R, T, 3*H*D)
    q: torch.Tensor        # (R, T, H, D)
    o: torch.Tensor        # (R, T, H, D)
    y: torch.Tensor        # (Sp, R, T, C) attention out-projection
    taps: torch.Tensor     # (Sc, R, T+K-1, K*C)
    mlp: torch.Tensor      # (R, T, 4C)
    y2: torch.Tensor       # (Sf, R, T, C) fc2
    # persistent block kernel only (None otherwise): attention split scratch and barrier counters
    attn_acc: torch.Tensor | None = None   # flat, R*H*8*T*D
    attn_ml: torch.Tensor | None = None    # flat, R*H*8*T*2
    ctr: torch.Tensor | None = None        # (depth,) int32, zeroed per evaluation
    # Triton attention: per query block (of >= 16 queries), its key splits counted in; zero between launches
    att_ctr: torch.Tensor | None = None    # (R*H*ceil(T/16),) int32
    wide: bool = False                     # Triton tile GEMMs (``FusedDiT.uses_wide``); taps then (1, R, T+K-1, C)


class FusedDiT:
    """Fused forward over an original DiT's parameters (the module is not modified)."""

    def __init__(self, dit: nn.Module, attention: AttentionKind = "sdpa", use_triton: bool | None = None,
                 gemm: GemmKind = "cublas-split", attn_splits: int | None = None, attn_block_m: int | None = None,
                 split_k: int | None = None, block_kernel: bool | None = None, attn_tma: bool | None = None,
                 attn_stages: int | None = None, wide_gemm: bool | None = None,
                 gemm_operands: OperandKind = "fp32"):
        """``gemm="triton"`` runs every GEMM through the few-row Triton kernel while TF32 is on
        (opt-in: on the H200 it made a batch-1 solve slower, 15.3 vs 13.1 ms, and its TF32
        rounding costs ~2x cuBLAS's error; see benchmarks/results/code2wav_kernels_h200.md).
        ``attn_splits`` / ``attn_block_m``: Triton attention launch shape (None: by grid fill).
        ``attn_tma``: the staged body's attention fetches K/V tiles through a TMA descriptor
        (``tiled_attention(tma=True)``; CUDA capability >= 9, packed contiguous ``[k|v]`` caches). None
        (default): on such devices when the grid is full (rows x heads >= ATTN_FULL_GRID_ROWS_HEADS, batch
        >= 8 with CFG), with 64-query blocks and 3 stages (H200: 31.2 vs 36.0 us per block over 32 rows'
        caches, solve at B=16 31.20 vs 32.43 ms; with a pooled key mask 34.9 vs 56.7 us); True/False:
        always/never. ``attn_stages``: the attention's software-pipelining depth (None: 3 with TMA, 2
        otherwise).
        ``gemm="cublas-split"``: few-row GEMMs split over K (``split_k`` partials, None: by
        ``split_k_for``) as strided-batched cuBLAS GEMMs, summed by the fused stage after them.
        ``block_kernel``: run every block as ONE persistent Triton launch (``kernels/dit_block.py``)
        when the rows are few (R*T <= dit_block.MAX_ROWS) and Triton runs on the device (own or
        pooled caches); otherwise the staged body. None (default): on CUDA with TF32 attention, while
        TF32 matmuls are on (H200, batch 1: 8.86 vs 12.04 ms per chunk); True: also with IEEE dots and
        on CPU under Triton's interpreter (the tests); False: never.
        ``wide_gemm``: the staged body's GEMMs (all but fc2) as Triton tile GEMMs (``kernels/wide_gemm.py``:
        conv taps summed in the GEMM, fc1's GELU in its epilogue, the q/k (up to WIDE_QKV_LN_MAX_ROWS rows if set)
        head LNs in the QKV GEMM's epilogue, operands rounded to TF32 by their producers). None (default):
        on CUDA SM80+ while TF32 matmuls are on, for R*T >= WIDE_MIN_ROWS (decided when the workspace is
        made); True: whenever the staged body runs Triton (also on CPU under the interpreter; with TF32 off
        their IEEE dots run on the FMA units, 2.3x slower than cuBLAS at B=16, ``wide_gemm.IEEE_TILE``);
        False: never.
        ``gemm_operands="fp16"`` (the knobs' choice where ``operand_range`` certifies the weights; default
        "fp32" here): where Triton GEMMs run under TF32 (the tile GEMMs, from any
        staged row count, and the persistent block kernel), the buffers holding their operands (the LN
        outputs, the conv histories, the attention output, fc1's output) and the GEMM weights are FP16,
        and fc2 runs as a tile GEMM too. A TF32-rounded value in FP16's range is exact
        in FP16 (both keep 10 mantissa bits), so the products are TF32's; the operands take half the bytes
        and the tensor cores run at twice the rate (``benchmarks/fp16_operand_probe.py``). Values beyond
        FP16's range saturate at +-65504 and ones below 6.1e-5 lose mantissa bits (at most 3e-8 absolute).
        Everything else (the residual stream, q, the attention cache, the CNN caches handed out) stays FP32."""
        ok, why = supports_fused_body(dit)
        if not ok:
            raise ValueError(f"DiT layout not supported by the fused body: {why}")
        if gemm not in ("cublas", "triton", "cublas-split"):
            raise ValueError(f"gemm must be 'cublas', 'triton' or 'cublas-split', got {gemm!r}")
        if split_k is not None and (split_k < 1 or split_k & (split_k - 1)):
            raise ValueError(f"split_k must be a power of two >= 1 or None, got {split_k}")
        if attn_stages is not None and attn_stages < 1:
            raise ValueError(f"attn_stages must be >= 1, got {attn_stages}")
        if attn_splits is not None and attn_splits < 1:
            raise ValueError(f"attn_splits must be >= 1 or None, got {attn_splits}")
        if gemm_operands not in ("fp32", "fp16"):
            raise ValueError(f"gemm_operands must be 'fp32' or 'fp16', got {gemm_operands!r}")
        self.dit = dit
        self.gemm_operands = gemm_operands
        self.L = layout_of(dit)
        self.attention = attention
        self.use_triton = TRITON_AVAILABLE if use_triton is None else use_triton
        self.gemm, self.attn_splits, self.attn_block_m, self.split_k = gemm, attn_splits, attn_block_m, split_k
        self.attn_tma, self.attn_stages = attn_tma, attn_stages
        self.attn_warps: int | None = None     # the attention's warps (None: by precision, ``_ieee_cap``)
        self.wide = wide_gemm
        self.wide_qkv_ln_max_rows = WIDE_QKV_LN_MAX_ROWS
        self.attn_pv16: bool | None = None     # P @ V in FP16 (None: with FP16 operands; tiled_attention.pv16_for)
        # direct_attention's tiles through descriptors it builds per (row, head) (None: where the device can,
        # tiled_attention.device_tma); False: pointer loads
        self.direct_tma: bool | None = None
        # direct_attention's splits walk both key sources in one loop (pointer loads, so no TMA then; TF32 dots:
        # the IEEE ones keep their two pointer loops, untimed otherwise) instead of one loop per source through TMA
        # descriptors: bit-identical. H100, the flow's solve (staged_one_loop_probe_
        # session62_h100.md), replay two / one loop: B=4 11.41-11.45 / 11.26-11.27 ms, B=8 13.88-13.91 /
        # 13.69-13.72, B=16 20.59-20.62 / 20.27 (as called 20.86-20.89 / 20.53-20.59)
        self.direct_one_loop: bool = True
        self.direct_block_n: int = 64       # direct_attention's key tile (benchmarks/gpu_pending.sh s62b times others)
        self.block_k_step_scale: int | None = None     # block kernel's K step x this (None: 2 with FP16 weights)
        # staged body with FP16 operands: the GEMM roles that run as cuBLAS FP16 GEMMs with FP32 outputs
        # (None: ``CUBLAS16_ROLES`` on CUDA, none elsewhere; benchmarks/cublas16_probe.py sets them)
        self.cublas16: frozenset[str] | None = None
        ok, why = dit_block.supported(self.L.hidden, self.L.heads, self.L.head_dim, self.L.mlp_hidden)
        if block_kernel and not ok:
            raise ValueError(f"block_kernel: this DiT's shapes do not fit the persistent kernel: {why}")
        self.block_kernel = (attention == "triton-tf32" and ok) if block_kernel is None else bool(block_kernel)
        self._block_auto = block_kernel is None
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-derive the packed weights (after loading new parameters)."""
        self.w_qkv, self.b_qkv, self.w_taps1, self.w_taps2 = [], [], [], []
        for blk in self.dit.blocks:
            a = blk.attn
            self.w_qkv.append(torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight], 0).contiguous())
            self.b_qkv.append(torch.cat([a.to_q.bias, a.to_k.bias, a.to_v.bias], 0).contiguous())
            for conv, dst in ((blk.conv.block[1], self.w_taps1), (blk.conv.block[6], self.w_taps2)):
                w = conv.weight                                   # (Cout, Cin, K)
                dst.append(w.permute(2, 0, 1).reshape(-1, w.shape[1]).contiguous())   # (K*Cout, Cin)
        # built on first use: the block kernel's stacked weights, fc1's FP16 biases (``_fc1_bias16``)
        self._stacked: dict[tuple, dit_block.BlockWeights | torch.Tensor] = {}
        # the input projection split into x's columns and the step-invariant [mu | spk | cond] ones
        # (the Euler-step junction projects only x per step; ``embed_const`` the rest once per chunk)
        w, n = self.dit.in_proj.weight, self.L.out_channels
        self.w_in_x, self.w_in_rest = w[:, :n].contiguous(), w[:, n:].contiguous()

    def stacked_weights(self, rounded: bool, dtype: torch.dtype = torch.float32) -> dit_block.BlockWeights:
        """The blocks' weights stacked over depth for ``dit_blocks`` (one copy, made once; the module is
        not modified). ``rounded``: the GEMM weights rounded to nearest TF32, as compiled TF32 reads them.
        ``dtype`` float16: the GEMM weights as FP16 operands (``gemm_operands="fp16"``; rounded to nearest
        by the conversion itself)."""
        key = (rounded, self.w_qkv[0].device, dtype)
        if dtype == torch.float16 and key not in self._stacked:
            self._stacked[key] = self.stacked_weights(False).gemm_as(torch.float16)
        if key not in self._stacked:
            per_block = []
            for i, blk in enumerate(self.dit.blocks):
                a, seq, mlp = blk.attn, blk.conv.block, blk.mlp
                per_block.append(dit_block.BlockWeights(
                    self.w_qkv[i], self.b_qkv[i], a.q_norm.weight, a.q_norm.bias, a.k_norm.weight, a.k_norm.bias,
                    a.proj.weight, a.proj.bias, self.w_taps1[i], seq[1].bias, seq[3].weight, seq[3].bias,
                    self.w_taps2[i], seq[6].bias, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias))
            w = dit_block.stack_weights(per_block)
            self._stacked[key] = w.rounded_() if rounded else w
        return self._stacked[key]

    # ------------------------------------------------------------------ modulation
    @torch.no_grad()
    def modulation(self, t: torch.Tensor) -> Modulation:
        """t (Rm,) timesteps -> tables; uses the original modules, so the same GEMMs and rounding."""
        c = self.dit.t_embedder(t)                                  # (Rm, C)
        blocks = torch.stack([blk.adaLN_modulation(c).view(-1, 9, self.L.hidden) for blk in self.dit.blocks], 1)
        blocks = blocks.clone()
        for i in (SC_MSA, SC_MLP, SC_CONV):
            blocks[:, :, i] = 1 + blocks[:, :, i]
        fin = self.dit.final_layer.adaLN_modulation(c).view(-1, 2, self.L.hidden).clone()
        fin[:, 1] = 1 + fin[:, 1]
        # one chain (Rm, depth+1, 9, C): row depth holds the final layer's shift/scale in slots 0/1, so
        # "the next block's shift/scale" of the last block needs no special case (dit_blocks)
        Rm, depth, C = blocks.shape[0], self.L.depth, self.L.hidden
        chain = torch.zeros(Rm, depth + 1, 9, C, device=blocks.device, dtype=blocks.dtype)
        chain[:, :depth] = blocks
        chain[:, depth, :2] = fin
        return Modulation(chain[:, :depth], chain[:, depth, :2], chain)

    # ------------------------------------------------------------------ buffers
    def uses_block_kernel(self, R: int, T: int, device) -> bool:
        """Can ``body`` run the persistent block kernel for R rows x T frames (own or pooled
        caches)? ``runs_persistent`` adds the precision rule."""
        dev = torch.device(device)
        if self._block_auto and dev.type != "cuda":
            return False
        on_device = dev.type == "cuda" or (dev.type == "cpu" and interpreting())
        return self.block_kernel and R * T <= dit_block.MAX_ROWS and self.use_triton and on_device

    def uses_wide(self, R: int, T: int, device) -> bool:
        """Does a workspace for R rows x T frames take the Triton tile GEMMs (``wide_gemm``)?"""
        dev = torch.device(device)
        if self.wide is False or not self.use_triton or self.uses_block_kernel(R, T, dev):
            return False
        if self.wide is None:
            least = WIDE16_MIN_ROWS if self.gemm_operands == "fp16" else WIDE_MIN_ROWS
            return (dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 8 and R * T >= least
                    and torch.backends.cuda.matmul.allow_tf32)
        return dev.type == "cuda" or (dev.type == "cpu" and interpreting())

    def gemm_splits(self, R: int, T: int, device=None) -> dict:
        """Split-K partials per GEMM role for R rows x T frames (all 1 unless gemm="cublas-split"
        or the block kernel runs, whose tiles fix them)."""
        L = self.L
        shapes = dit_block.gemm_shapes(R, T, L.hidden, L.heads, L.head_dim, L.mlp_hidden, L.taps)
        roles = {k: shapes[k] for k in ("qkv", "proj", "conv", "fc2")}    # (M, N, K); fc1 is never split
        if device is not None and self.uses_block_kernel(R, T, device):
            wave = dit_block.wave_programs(device)
            return {k: dit_block.gemm_splits(K, k, M, N, wave) for k, (M, N, K) in roles.items()}
        if self.gemm != "cublas-split" or (device is not None and self.uses_wide(R, T, device)):
            return {k: 1 for k in roles}
        if self.split_k is not None:
            return {k: (self.split_k if K % self.split_k == 0 else 1) for k, (_, _, K) in roles.items()}
        return {k: split_k_for(*mnk) for k, mnk in roles.items()}

    def operand_dtype(self, R: int, T: int, device) -> torch.dtype:
        """The dtype of the GEMM operand buffers for R rows x T frames: FP16 with ``gemm_operands="fp16"``
        where Triton GEMMs (tile GEMMs or the block kernel) run under TF32 (or under the interpreter, for
        the tests), else FP32."""
        dev = torch.device(device)
        if self.gemm_operands != "fp16" or not (self.uses_wide(R, T, dev) or self.uses_block_kernel(R, T, dev)):
            return torch.float32
        if dev.type == "cpu":
            return torch.float16
        # CUDA: only where TF32 exists (SM80+) and is on, the arithmetic the FP16 operands reproduce
        ok = torch.cuda.get_device_capability(dev)[0] >= 8 and torch.backends.cuda.matmul.allow_tf32
        return torch.float16 if ok else torch.float32

    def _operands_for(self, R: int, T: int, device, dtype: torch.dtype) -> torch.dtype:
        """The GEMM operand buffers' dtype for a ``dtype`` body: ``operand_dtype`` for FP32, else dtype
        itself (the one rule for the workspace and the conv histories)."""
        return self.operand_dtype(R, T, device) if dtype == torch.float32 else dtype

    def workspace(self, R: int, T: int, device, dtype=torch.float32) -> Workspace:
        """Buffers for R rows x T frames (own or pooled caches); the GEMM operands' in ``operand_dtype``."""
        L = self.L
        e = lambda *s: torch.empty(*s, device=device, dtype=dtype)  # noqa: E731
        op = self._operands_for(R, T, device, dtype)
        eo = lambda *s: torch.empty(*s, device=device, dtype=op)  # noqa: E731
        sp = self.gemm_splits(R, T, device)
        wide = self.uses_wide(R, T, device)
        # the conv outputs: summed over taps in a tile GEMM (C wide), else cuBLAS's taps products (K*C)
        summed = wide and not (op == torch.float16 and "conv" in self.cublas16_roles(device))
        ws = Workspace(h=e(R, T, L.hidden), norm=eo(R, T, L.hidden),
                       qkv=e(sp["qkv"], R, T, 3 * L.heads * L.head_dim),
                       q=e(R, T, L.heads, L.head_dim), o=eo(R, T, L.heads, L.head_dim), y=e(sp["proj"], R, T, L.hidden),
                       taps=e(sp["conv"], R, T + L.taps - 1, (1 if summed else L.taps) * L.hidden),
                       mlp=eo(R, T, L.mlp_hidden), y2=e(sp["fc2"], R, T, L.hidden), wide=wide,
                       att_ctr=torch.zeros(R * L.heads * -(-T // 16), device=device, dtype=torch.int32))
        if self.uses_block_kernel(R, T, device):
            ws.attn_acc = e(R * L.heads * 8 * T * L.head_dim)
            ws.attn_ml = e(R * L.heads * 8 * T * 2)
            ws.ctr = torch.zeros(L.depth, device=device, dtype=torch.int32)
        return ws

    def _triton(self, t: torch.Tensor) -> bool:
        return self.use_triton and usable_on(t)

    # ------------------------------------------------------------------ fused stages
    def _res_ln(self, ws: Workspace, y, bias, gate, shift, scale, out, eps, taps=0, round_out=False, prefetch=None):
        """x += gate*y (y: S partials (S, R, T', N), plain or tap sum, + bias; None: no residual);
        out = LN(x)*scale+shift (rounded to TF32 with ``round_out``). gate/shift/scale (Rm, C) rows of
        the modulation tables. ``prefetch``: the next GEMM's weight, for the Triton stage to ask L2 for."""
        x = ws.h
        if self._triton(x):
            dit_ops.residual_mod_ln(x, y, bias, gate, shift, scale, out, eps, taps, round_out, prefetch)
            return
        if y is not None:
            y = _sum_partials(y)
            if taps:
                T = x.shape[1]
                C = x.shape[2]
                y = sum(y[:, k:k + T, k * C:(k + 1) * C] for k in range(taps))
            if bias is not None:
                y = y + bias
            x.add_(gate[:, None] * y)
        out.copy_(F.layer_norm(x, (x.shape[-1],), eps=eps) * scale[:, None] + shift[:, None])
        if round_out and out.dtype == torch.float32:
            dit_block.round_tf32_(out)

    def _qkv_ln(self, ws: Workspace, blk, kv_cur: torch.Tensor, rows=None, pos=None, bias=None):
        a = blk.attn
        if self._triton(ws.qkv):
            dit_ops.qkv_head_ln(ws.qkv, a.q_norm.weight, a.q_norm.bias, a.k_norm.weight, a.k_norm.bias,
                                ws.q, kv_cur, self.L.qk_eps, rows, pos, bias)
            return
        qkv = _sum_partials(ws.qkv)
        if bias is not None:
            qkv = qkv + bias
        R, T, _ = qkv.shape
        H, D = self.L.heads, self.L.head_dim
        q, k, v = qkv.reshape(R, T, 3, H, D).unbind(2)
        ws.q.copy_(F.layer_norm(q, (D,), a.q_norm.weight, a.q_norm.bias, self.L.qk_eps))
        k = F.layer_norm(k, (D,), a.k_norm.weight, a.k_norm.bias, self.L.qk_eps)
        if pos is None:
            kv_cur[..., :D].copy_(k.transpose(1, 2))
            kv_cur[..., D:].copy_(v.transpose(1, 2))
        else:   # pool (P, H, F, 2D): (rows, pos) index pairs -> (R, T, H, 2D)
            r_idx, p_idx = rows.long()[:, None].expand(-1, T), pos.long()
            kv_cur[r_idx, :, p_idx] = torch.cat([k, v], -1)

    def _taps_ln_mish(self, taps_out: torch.Tensor, conv, ln, out: torch.Tensor, K: int | None = None,
                      round_out: bool = False, prefetch: torch.Tensor | None = None):
        """out = Mish(LN(tap sum of taps_out + bias)); K taps (default the conv's; 1: already summed);
        ``prefetch`` as ``_res_ln``'s."""
        K = self.L.taps if K is None else K
        if self._triton(taps_out):
            dit_ops.taps_ln_mish(taps_out, conv.bias, ln.weight, ln.bias, out, ln.eps, K, round_out, prefetch)
            return
        T, C = out.shape[1], out.shape[2]
        taps_out = _sum_partials(taps_out)
        y = sum(taps_out[:, k:k + T, k * C:(k + 1) * C] for k in range(K)) + conv.bias
        out.copy_(F.mish(F.layer_norm(y, (C,), ln.weight, ln.bias, ln.eps)))
        if round_out and out.dtype == torch.float32:
            dit_block.round_tf32_(out)

    def _attend(self, ws: Workspace, kv: torch.Tensor, mask: torch.Tensor | None, rows=None, round_out=False,
                streams: StreamKV | None = None, layer: int = 0):
        D = self.L.head_dim
        q = ws.q.transpose(1, 2)                 # (R, H, T, D) view
        if streams is not None:                  # kv holds this chunk's frames only; the old ones stay put
            shape = self._direct_shape(q.shape[0], q.shape[1], q.shape[2], device_tma(q.device))
            tma = shape.tma and streams.tail is None     # a shared tail is read through pointers
            direct_attention(q, kv, streams, layer, ws.o.transpose(1, 2),
                             precision="tf32" if self.attention == "triton-tf32" else "ieee", block_m=shape.block_m,
                             splits=shape.splits, num_stages=shape.stages, num_warps=shape.warps,
                             round_out=round_out, pv16=self.attn_pv16, tma=tma, counters=self._counters(ws),
                             one_loop=self._one_key_loop and not tma,
                             block_n=self.direct_block_n)
            return
        k, v = kv[..., :D], kv[..., D:]
        if self.attention != "sdpa" and self._triton(q):
            tma_ok = _has_tma(q.device) and (self.attn_tma or packed_kv(k, v) is not None)
            shape = self._attn_shape(q.shape[0], q.shape[1], q.shape[2], tma_ok)
            tiled_attention(q, k, v, mask, kv_rows=rows,
                            precision="tf32" if self.attention == "triton-tf32" else "ieee",
                            out=ws.o.transpose(1, 2), block_m=shape.block_m, splits=shape.splits,
                            num_stages=shape.stages, num_warps=shape.warps, tma=shape.tma,
                            round_out=round_out, pv16=self.attn_pv16, counters=self._counters(ws))
        else:
            o = sdpa_attention(q, k, v, mask, rows).transpose(1, 2)
            ws.o.copy_(o.clamp(-65504.0, 65504.0) if ws.o.dtype == torch.float16 else o)   # store_operand's saturation
            if round_out and ws.o.dtype == torch.float32:
                dit_block.round_tf32_(ws.o)

    @staticmethod
    def _counters(ws: Workspace) -> torch.Tensor | None:
        """The attention's split counters (``ATTN_LAST_COMBINE``), or None for a combine kernel."""
        return ws.att_ctr if ATTN_LAST_COMBINE else None

    def _attn_shape(self, R: int, H: int, T: int, tma_ok: bool = False) -> AttnShape:
        """Launch shape for R rows x H heads x T queries; ``tma_ok``: the device and cache can take TMA
        descriptor loads."""
        full = R * H >= ATTN_FULL_GRID_ROWS_HEADS
        tma = tma_ok and (full and not self._ieee if self.attn_tma is None else self.attn_tma)
        bm, warps = self._ieee_cap(self.attn_block_m or (64 if tma and full else 32 if full else 16))
        stages = self.attn_stages or (3 if tma else 2)
        return AttnShape(bm, self._key_splits(R, H, T, bm, ATTN_TARGET_PROGRAMS), stages, tma, warps)

    @property
    def _one_key_loop(self) -> bool:
        """Does ``direct_attention`` walk its two key sources in one loop? ``direct_one_loop``, for TF32 dots only
        (where it was timed; IEEE dots keep one pointer loop per source)."""
        return bool(self.direct_one_loop) and not self._ieee

    @property
    def _ieee(self) -> bool:
        """IEEE (FMA) attention dots: their tiles live in registers, so no TMA staging and small blocks."""
        return self.attention == "triton-ieee"

    def _ieee_cap(self, bm: int) -> tuple[int, int]:
        """(query block, warps): ``bm`` on 4 warps, or for IEEE dots at most IEEE_BLOCK_M on IEEE_WARPS (an
        explicit ``attn_block_m`` / ``attn_warps`` is taken as given)."""
        if not self._ieee:
            return bm, self.attn_warps or 4
        if self.attn_block_m is None:
            bm = min(bm, IEEE_BLOCK_M)
        return bm, self.attn_warps or (IEEE_WARPS if bm >= IEEE_BLOCK_M else 4)

    def _key_splits(self, R: int, H: int, T: int, bm: int, target: int,
                    full_grid: int | None = ATTN_FULL_GRID_ROWS_HEADS) -> int:
        """The attention's key splits: ``attn_splits`` if set, 1 on a full grid (rows x heads >= ``full_grid``;
        None: no such rule), else enough (at most 8) for about ``target`` programs of ``bm``-query blocks."""
        if self.attn_splits is not None:
            return self.attn_splits
        if full_grid is not None and R * H >= full_grid:
            return 1
        return max(1, min(8, target // (R * H * -(-T // bm))))

    def _direct_shape(self, R: int, H: int, T: int, tma_ok: bool = False) -> AttnShape:
        """Launch shape of ``direct_attention``: one query block per (row, head) up to 64 queries (more
        blocks would each re-read every key tile; IEEE dots: up to IEEE_BLOCK_M); keys split to about
        DIRECT_TARGET_PROGRAMS programs (no full-grid rule); tiles through in-kernel TMA descriptors where
        ``tma_ok`` (``device_tma``) unless ``direct_tma`` says otherwise (IEEE dots: only if it says so), or
        ``direct_one_loop`` (pointer loads) leaves them to pointers."""
        bm, warps = self._ieee_cap(self.attn_block_m or min(64, max(16, dit_block._pow2(T))))
        if self.direct_tma is None:     # one key loop takes pointer loads (an explicit direct_tma wins)
            tma = tma_ok and not self._ieee and not self._one_key_loop
        else:
            tma = bool(self.direct_tma)
        splits = self._key_splits(R, H, T, bm, DIRECT_TARGET_PROGRAMS, full_grid=None)
        return AttnShape(bm, splits, self.attn_stages or 3, tma, warps)

    def _small_gemm(self, x2d: torch.Tensor) -> bool:
        """Few-row Triton GEMM for this call? Opt-in, and only under TF32 (IEEE stays on cuBLAS)."""
        return (self.gemm == "triton" and self._triton(x2d) and torch.backends.cuda.matmul.allow_tf32)

    def _linear(self, x2d: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out2d: torch.Tensor,
                gelu: bool = False):
        if self._small_gemm(x2d):
            small_gemm(x2d, w, b, out2d, gelu=gelu, precision="tf32")
            return
        if b is None:
            torch.mm(x2d, w.t(), out=out2d)
            return
        if gelu and x2d.is_cuda and torch.backends.cuda.matmul.allow_tf32:
            # bias + tanh-GELU in the cuBLASLt epilogue. Only under TF32: the epilogue's tanh is
            # not IEEE-exact, which would break the <=1e-5 IEEE parity (and CPU has erf-GELU there).
            torch._addmm_activation(b, x2d, w.t(), use_gelu=True, out=out2d)
            return
        torch.addmm(b, x2d, w.t(), out=out2d)
        if gelu:
            torch._C._nn.gelu_(out2d, approximate="tanh")

    def _gemm(self, x2d: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
              wide: bool = False, taps: int = 1, gelu: bool = False, round_out: bool = False,
              cublas16: bool = False):
        """``out`` (S, ..., N) = x2d @ w.T (+ b) as S split-K partials. S == 1: one GEMM with its bias
        (and tanh-GELU), returns None. S > 1: partial s = x2d[:, slice s] @ w[:, slice s].T, one
        strided-batched GEMM (no copies: both slicings are strides cuBLAS takes); returns the bias
        left to the stage that sums the partials.
        ``wide``: a Triton tile GEMM (``wide_gemm``, S == 1) instead, where ``taps`` > 1 makes it the
        implicit conv (w the taps matrix, out C wide) and ``round_out`` stores the result TF32-rounded;
        without ``wide`` the taps matrix gives cuBLAS's taps products (out K*C wide) and ``taps`` and
        ``round_out`` are not used.
        ``cublas16``: FP16 operands into an FP32 ``out`` by cuBLAS (``CUBLAS16_ROLES``: the tile GEMMs'
        arithmetic), returning the bias for the stage that reads ``out``, as split-K partials do."""
        M = x2d.shape[0]
        if cublas16 and gelu:   # fc1: bias (FP16) + tanh-GELU in cuBLASLt's epilogue, FP16 out (fc2's operand)
            torch._addmm_activation(b, x2d, w.t(), use_gelu=True, out=out.view(M, -1))
            return None
        if cublas16:
            torch.mm(x2d, w.t(), out_dtype=torch.float32, out=out.view(M, -1))
            return b
        if wide:
            _wide_gemm(x2d, w, b, out.view(M, -1), gelu=gelu, taps=taps, round_out=round_out,
                       precision=dot_precision(x2d), tma=_has_tma(x2d.device))
            return None
        S, N = out.shape[0], w.shape[0]
        if S == 1:
            self._linear(x2d, w, b, out.view(M, N), gelu=gelu)
            return None
        Ks = x2d.shape[1] // S
        torch.bmm(x2d.view(M, S, Ks).transpose(0, 1), w.view(N, S, Ks).permute(1, 2, 0), out=out.view(S, M, N))
        return b

    # ------------------------------------------------------------------ the body
    def body(self, xin: torch.Tensor, mod: Modulation, hist: torch.Tensor, kv: torch.Tensor,
             mask: torch.Tensor | None, ws: Workspace, out: torch.Tensor,
             rows: torch.Tensor | None = None, pos: torch.Tensor | None = None,
             streams: StreamKV | None = None, successor: StreamKV | None = None) -> torch.Tensor:
        """One estimator evaluation, caches in place.

        xin (R, T, in_channels) staged input, time-major. hist (depth, 2, R, T+K-1, C): conv histories
        whose first K-1 frames hold the CNN cache (new cache = frames [q, q+K-1) for q valid frames).
        kv (depth, R, H, T+L, 2D): frames [0, T) receive this chunk's [k|v], [T, T+L) hold the old cache.
        mask (R, T, T+L) bool or None. out (R, T, out_channels).
        Pooled caches (``slot_pool``): kv is (depth, P, H, F, 2D), ``rows`` (R,) int32 are the pool
        rows of the batch rows and ``pos`` (R, T) int32 the frames the current K/V go to; mask (R, T, F).
        Per-stream caches (``streams``, see ``blocks``): kv is (depth, R, H, T, 2D), this chunk's frames.
        ``successor``: see ``blocks``.
        """
        self.embed(xin, mod, ws)
        self.blocks(mod, hist, kv, mask, ws, rows, pos, streams=streams, successor=successor)
        self.project(ws, out)
        return out

    def embed(self, xin: torch.Tensor, mod: Modulation, ws: Workspace) -> None:
        """ws.h = the input projection of xin; ws.norm = block 0's modulated LayerNorm of it."""
        R, T, _ = xin.shape
        N, C = R * T, self.L.hidden
        self._linear(xin.reshape(N, -1), self.dit.in_proj.weight, self.dit.in_proj.bias, ws.h.view(N, C))
        mb = mod.blocks
        rnd = ws.wide and dit_block.rounds(dot_precision(ws.h), ws.h.device)
        self._res_ln(ws, None, None, None, mb[:, 0, SH_MSA], mb[:, 0, SC_MSA], ws.norm, self.L.norm_eps, round_out=rnd)

    def embed_const(self, xin_rest: torch.Tensor, hc: torch.Tensor) -> None:
        """hc (R, T, C) = the input projection's bias plus its step-invariant columns applied to
        ``xin_rest`` (R, T, in_channels - out_channels): xin without the x columns."""
        R, T, _ = xin_rest.shape
        self._linear(xin_rest.reshape(R * T, -1), self.w_in_rest, self.dit.in_proj.bias, hc.view(R * T, -1))

    def project(self, ws: Workspace, out: torch.Tensor) -> None:
        """out = the final linear of ws.norm (the final layer's modulated LayerNorm, left by ``blocks``)."""
        R, T, C = ws.norm.shape
        fl = self.dit.final_layer.linear
        self._linear(ws.norm.view(R * T, C).to(fl.weight.dtype), fl.weight, fl.bias, out.view(R * T, -1))

    def _gemm_weights(self, half: bool, rounded: bool) -> dit_block.BlockWeights:
        """The stacked GEMM weights as the Triton GEMMs read them: FP16 copies for FP16 operands, else
        FP32 (rounded to nearest TF32 with ``rounded``)."""
        return self.stacked_weights(False, torch.float16) if half else self.stacked_weights(rounded)

    def cublas16_roles(self, device) -> frozenset[str]:
        """The staged body's GEMM roles that run as cuBLAS FP16 GEMMs (FP32 out; fc1 FP16 out) when its operands
        are FP16."""
        if self.cublas16 is not None:
            unknown = set(self.cublas16) - CUBLAS16_ALL
            if unknown:
                raise ValueError(f"FusedDiT.cublas16: unknown GEMM roles {sorted(unknown)}; "
                                 f"choose from {sorted(CUBLAS16_ALL)}")
            return frozenset(self.cublas16)
        return CUBLAS16_ROLES if torch.device(device).type == "cuda" else frozenset()

    def _fc1_bias16(self, device) -> torch.Tensor:
        """fc1's biases stacked over depth in FP16, for cuBLASLt's GELU epilogue (``CUBLAS16_ALL``'s "fc1")."""
        key = ("b_fc1_16", torch.device(device))
        if key not in self._stacked:
            self._stacked[key] = torch.stack([blk.mlp.fc1.bias.detach() for blk in self.dit.blocks]).to(
                device=device, dtype=torch.float16)
        return self._stacked[key]

    def runs_persistent(self, ws: Workspace) -> bool:
        """Does ``blocks`` take the persistent block kernel for this workspace under the current
        TF32 setting? Auto: only while TF32 is on (its IEEE dots would trail cuBLAS FP32); the
        workspace's split counts then serve the staged body as well."""
        return ws.ctr is not None and (dot_precision(ws.h) == "tf32" or not self._block_auto)

    def blocks(self, mod: Modulation, hist: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None,
               ws: Workspace, rows: torch.Tensor | None = None, pos: torch.Tensor | None = None,
               ctr_zeroed: bool = False, streams: StreamKV | None = None,
               successor: StreamKV | None = None) -> None:
        """The DiT blocks from ws.h and its block-0 LN in ws.norm (``embed``); leaves ws.norm = the
        final layer's modulated LN. ``ctr_zeroed``: the caller already zeroed the block kernel's
        barrier counters (``kernels.euler_step``). ``streams``: kv (depth, R, H, T, 2D) receives only
        this chunk's frames; each row's old frames are read where they are and the trimmed successor
        written by the attention (``direct_attention``, or its unit in the block kernel's attention phase;
        Triton attention, unmasked). ``successor`` (the block kernel only, unmasked): kv is read as usual and
        the attention phase also writes each row's trimmed successor where the StreamKV's ``dst`` table says
        (``dit_block.dit_blocks``), so no trim copy follows the solve."""
        L, dit = self.L, self.dit
        R, T, C = ws.h.shape
        N, K = R * T, L.taps
        mb = mod.blocks
        precision = dot_precision(ws.h)
        persistent = self.runs_persistent(ws)
        half = ws.norm.dtype == torch.float16      # gemm_operands="fp16": operands and weights FP16
        if half and precision != "tf32":
            raise RuntimeError("FusedDiT: this workspace holds FP16 GEMM operands (TF32 arithmetic) but TF32 "
                               "matmuls are off now; make the workspace under the same TF32 setting")
        if streams is not None and (mask is not None or rows is not None
                                    or self.attention == "sdpa" or not self._triton(ws.h)):
            raise ValueError("FusedDiT.blocks: per-stream caches (streams) need Triton attention, no mask and "
                             "no pooled rows; solve through the arena otherwise")
        if successor is not None and (not persistent or streams is not None or mask is not None or rows is not None):
            raise ValueError("FusedDiT.blocks: a successor is written only by the persistent block kernel's attention "
                             "over unmasked, unpooled arena frames; trim the new cache afterwards otherwise")
        if persistent and streams is not None and streams.tail is not None:
            raise ValueError("FusedDiT.blocks: the persistent block kernel reads each row's whole cache; pass "
                             "streams without a shared tail (StreamKV.tail) there")
        if persistent:
            if not ctr_zeroed:
                ws.ctr.zero_()
            weights = self._gemm_weights(half, dit_block.rounds(precision, ws.h.device))
            nprog = dit_block.programs(ws.h.device)
            if streams is None:
                a_splits, per_split = dit_block.attention_splits(R, L.heads, T, kv.shape[3], nprog)
                cur_keys = None
            else:
                a_splits, per_split, cur_keys = dit_block.direct_attention_splits(R, L.heads, T, streams.n_old,
                                                                                  nprog)
            per = dit_block.BLOCKS_PER_LAUNCH or L.depth
            for j, b0 in enumerate(range(0, L.depth, per)):
                dit_block.dit_blocks(
                    h=ws.h, norm=ws.norm, qkv=ws.qkv, q=ws.q, kv=kv, mask=mask, o=ws.o, attn_acc=ws.attn_acc,
                    attn_ml=ws.attn_ml, y=ws.y, hist=hist, taps=ws.taps, mlp=ws.mlp, y2=ws.y2,
                    ctr=ws.ctr[j:j + 1], w=weights, mod_chain=mod.chain, first=b0, n_blocks=min(per, L.depth - b0),
                    eps=L.norm_eps, qk_eps=L.qk_eps, conv_eps=L.conv_ln_eps, attn_splits=a_splits,
                    keys_per_split=per_split, nprog=nprog, precision=precision, rows=rows, pos=pos,
                    pv16=self.attn_pv16, k_step_scale=self.block_k_step_scale, streams=streams, cur_keys=cur_keys,
                    tile_ctr=ws.att_ctr, successor=successor)
            return
        # the staged body: cuBLAS GEMMs, or with ``ws.wide`` Triton tile GEMMs (the conv taps summed in the
        # GEMM, so ``ws.taps`` is (1, R, T+K-1, C) and its readers take one tap; fc1's GELU in its
        # epilogue; the q/k head LNs in the QKV GEMM's epilogue, up to ``wide_qkv_ln_max_rows`` rows if set) whose
        # operands, under compiled TF32, the stage that writes each stores rounded (weights: the rounded copy;
        # with FP16 operands every operand buffer and weight is FP16, ``store_operand``)
        wide = ws.wide
        rnd = wide and dit_block.rounds(precision, ws.h.device)
        by_cublas = self.cublas16_roles(ws.h.device) if half else frozenset()
        wts = self._gemm_weights(half, True) if half or rnd else None
        kt = ws.taps.shape[-1] // C     # taps the conv outputs still hold (1: summed in a tile GEMM)
        if kt != (1 if wide and "conv" not in by_cublas else K):
            raise ValueError(f"FusedDiT.blocks: the workspace's conv outputs ({kt} taps wide) do not fit the "
                             f"conv GEMM's form (cuBLAS roles {sorted(by_cublas)}); make the workspace after "
                             "setting FusedDiT.cublas16")
        b_fc1 = self._fc1_bias16(ws.h.device) if "fc1" in by_cublas else None

        def wt(name: str, i: int, own: torch.Tensor) -> torch.Tensor:   # block i's GEMM weight as read
            return own if wts is None else getattr(wts, name)[i]

        def ahead(w: torch.Tensor, role: str) -> torch.Tensor | None:
            # the row stage before a tile GEMM asks L2 for its weights (dit_ops.STAGED_PREFETCH). H200, replay
            # (prefetch_staged_probe_session20_h200.md): B=8 16.79 -> 16.38 ms, B=16 25.19 -> 24.61; before
            # cuBLAS's GEMMs (B=4) it cost time, 14.81 -> 15.18
            return w if wide and role not in by_cublas else None

        for i, blk in enumerate(dit.blocks):
            a, seq, mlp = blk.attn, blk.conv.block, blk.mlp
            m = mb[:, i]
            nxt = (mb[:, i + 1, SH_MSA], mb[:, i + 1, SC_MSA]) if i + 1 < L.depth else (mod.final[:, 0], mod.final[:, 1])
            kv_cur = kv[i][:, :, :T] if pos is None else kv[i]
            if wide and "qkv" not in by_cublas and (self.wide_qkv_ln_max_rows is None
                                                    or N <= self.wide_qkv_ln_max_rows):
                # [k|v] straight into the cache from the GEMM's epilogue (ws.qkv unused)
                _wide_qkv(ws.norm.view(N, C), wt("w_qkv", i, self.w_qkv[i]), self.b_qkv[i], a.q_norm.weight,
                          a.q_norm.bias, a.k_norm.weight, a.k_norm.bias, ws.q, kv_cur, T, L.qk_eps, rows=rows,
                          pos=pos, precision=precision, tma=_has_tma(ws.h.device))
            else:
                b = self._gemm(ws.norm.view(N, C), wt("w_qkv", i, self.w_qkv[i]), self.b_qkv[i], ws.qkv, wide,
                               cublas16="qkv" in by_cublas)
                self._qkv_ln(ws, blk, kv_cur, rows, pos, bias=b)
            self._attend(ws, kv[i], mask, rows, round_out=rnd, streams=streams, layer=i)
            b = self._gemm(ws.o.view(N, -1), wt("w_proj", i, a.proj.weight), a.proj.bias, ws.y, wide,
                           cublas16="proj" in by_cublas)
            h1, h2 = hist[i, 0], hist[i, 1]
            w_taps1, w_taps2, w_fc1 = (wt("w_taps1", i, self.w_taps1[i]), wt("w_taps2", i, self.w_taps2[i]),
                                       wt("w_fc1", i, mlp.fc1.weight))
            self._res_ln(ws, ws.y, b, m[:, G_MSA], m[:, SH_CONV], m[:, SC_CONV], h1[:, K - 1:], L.norm_eps,
                         round_out=rnd, prefetch=ahead(w_taps1, "conv"))
            self._gemm(h1.reshape(-1, C), w_taps1, None, ws.taps, wide, taps=K, cublas16="conv" in by_cublas)
            self._taps_ln_mish(ws.taps, seq[1], seq[3], h2[:, K - 1:], K=kt, round_out=rnd,
                               prefetch=ahead(w_taps2, "conv"))
            self._gemm(h2.reshape(-1, C), w_taps2, None, ws.taps, wide, taps=K, cublas16="conv" in by_cublas)
            self._res_ln(ws, ws.taps, seq[6].bias, m[:, G_CONV], m[:, SH_MLP], m[:, SC_MLP], ws.norm, L.norm_eps,
                         taps=kt, round_out=rnd, prefetch=ahead(w_fc1, "fc1"))
            self._gemm(ws.norm.view(N, C), w_fc1, mlp.fc1.bias if b_fc1 is None else b_fc1[i],
                       ws.mlp.view(1, N, -1), wide, gelu=True, round_out=rnd, cublas16=b_fc1 is not None)
            # fc2: cuBLAS with FP32 operands (a tile GEMM is no faster there); with FP16 ones cuBLAS's FP16 GEMM
            # on CUDA (CUBLAS16_ROLES), a tile GEMM under the interpreter
            b = self._gemm(ws.mlp.view(N, -1), wt("w_fc2", i, mlp.fc2.weight), mlp.fc2.bias, ws.y2, half,
                           cublas16="fc2" in by_cublas)
            # this block's MLP residual fused with the next block's attention-input LN (or the final one)
            self._res_ln(ws, ws.y2, b, m[:, G_MLP], *nxt, ws.norm, L.norm_eps, round_out=rnd,
                         prefetch=ahead(wt("w_qkv", i + 1, self.w_qkv[i + 1]), "qkv") if i + 1 < L.depth else None)

    # ------------------------------------------------------------------ original-compatible API
    @torch.no_grad()
    def forward_chunk(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor | None,
                      cond: torch.Tensor | None, cnn_cache: torch.Tensor | None = None,
                      att_cache: torch.Tensor | None = None, mask: torch.Tensor | None = None):
        """Same contract as the original ``DiT.forward_chunk`` (allocating; graphs use ``body``).

        x, mu, cond (R, 80, T); t (R,); spks (R, 80); cnn_cache (depth, R, 2C, K-1); att_cache
        (depth, R, H, L, 2D) newest first. Returns (velocity (R, 80, T), new cnn cache, new att cache).
        """
        L = self.L
        R, _, T = x.shape
        dev = x.device
        parts = [x, mu]
        if spks is not None:
            parts.append(spks[:, :, None].expand(-1, -1, T))
        if cond is not None:
            parts.append(cond)
        xin = torch.cat(parts, 1).transpose(1, 2).contiguous()
        Lc = 0 if att_cache is None else att_cache.shape[3]
        kv = torch.empty(L.depth, R, L.heads, T + Lc, 2 * L.head_dim, device=dev, dtype=x.dtype)
        if Lc:
            kv[:, :, :, T:].copy_(att_cache)
        hist = self.new_hist(R, T, dev, x.dtype)
        load_cnn_cache(hist, cnn_cache, L.taps - 1)
        ws = self.workspace(R, T, dev, x.dtype)
        out = torch.empty(R, T, L.out_channels, device=dev, dtype=x.dtype)
        mod = self.modulation(t)
        self.body(xin, mod, hist, kv, mask, ws, out)
        return out.transpose(1, 2), read_cnn_cache(hist, T, L.taps - 1).to(x.dtype), kv

    def new_hist(self, R: int, T: int, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Conv histories (depth, 2, R, T+K-1, C) for a ``dtype`` body: the convs' GEMM operands, so in
        the workspace's operand dtype."""
        L = self.L
        return torch.empty(L.depth, 2, R, T + L.taps - 1, L.hidden, device=device,
                           dtype=self._operands_for(R, T, device, dtype))


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    """Can the tiled attention fetch K/V through TMA descriptors on ``device`` (Hopper or newer, and a
    Triton with host tensor descriptors)?"""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def dot_precision(t: torch.Tensor) -> str:
    """The Triton dots' precision for tensors like ``t``: TF32 while TF32 matmuls are on (and on CPU,
    where the interpreter computes plain FP32 either way), IEEE otherwise."""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 or not t.is_cuda else "ieee"


def _sum_partials(y: torch.Tensor) -> torch.Tensor:
    """(S, ...) split-K partials -> their sum (the one partial itself when S == 1)."""
    return y[0] if y.shape[0] == 1 else y.sum(0)


def load_cnn_cache(hist: torch.Tensor, cnn_cache: torch.Tensor | None, k1: int) -> None:
    """Put the original-layout CNN cache (depth, R, 2C, K-1) into history frames [0, K-1); None = zeros."""
    if cnn_cache is None:
        hist[:, :, :, :k1].zero_()
        return
    euler_step.cnn_roll_ref(hist, None, cnn_cache, None)


def read_cnn_cache(hist: torch.Tensor, valid: int, k1: int) -> torch.Tensor:
    """History frames [valid, valid+K-1) -> original-layout CNN cache (depth, R, 2C, K-1)."""
    depth, _, R, _, C = hist.shape
    return hist[:, :, :, valid:valid + k1].permute(0, 2, 1, 4, 3).reshape(depth, R, 2 * C, k1)
