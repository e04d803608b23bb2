"""One persistent Triton kernel for the DiT blocks of an evaluation, for few rows (batch 1-2 with CFG).

At batch 1 a block is ~100 token rows, and each of the ~14 kernels the staged fused body launches
per block sits near a 3-6 us floor (launch gap, ramp, drain) whatever its work. Here one kernel
with one program per SM runs every block (weights stacked over depth, ``stack_weights``) as a
sequence of phases separated by grid-wide barriers (an atomic arrival counter, ~0.9 us on the
H200 against ~3 us per kernel boundary), with one more barrier between blocks (one launch per
block measured 51.2 vs 50.5 us per block for one launch in all, so the launch itself was cheap):

  0 QKV GEMM -> split-K partials      1 q/k head LN, [k|v] into the cache
  2 attention (key splits)            3 split combine (``LAST_COMBINE``: in phase 2)
  4 out-proj GEMM -> partials         5 residual + modulated LN into conv1's history
  6 conv1 taps GEMM -> partials       7 tap sum + bias + LN + Mish into conv2's history
  8 conv2 taps GEMM -> partials       9 tap sum + residual + modulated LN (MLP input)
  10 fc1 GEMM + bias + tanh-GELU      11 fc2 GEMM -> partials
  12 residual + the next block's modulated LN

Weights do not depend on the phase before them, and each block's are cold (the 16 blocks' 288 MB of FP32 weights pass
through the 50-MB L2 every Euler step). So between its arrival at a barrier and its wait each program asks L2
for its share of the next GEMM's weights (and, after the QKV GEMM, of the attention's cache): one bulk
prefetch per program on SM90 (``PREFETCH``, ``_phase_end``). The GEMM and attention phases then start on L2
hits: 47.1 -> 44.6 us per block on the H200.

The row phases and the attention are the staged body's own Triton functions (``dit_ops``,
``tiled_attention``), called per work unit instead of per program; only the GEMM phase is new:
TF32 tensor-core tiles whose operands are rounded to nearest TF32 (the tensor core truncates the
13 low mantissa bits, which would double the error). The weights are rounded once (a stacked copy,
``BlockWeights.rounded_``) and each phase stores the operand it produces for the next GEMM already
rounded (the first block's input comes from the staged LN and is truncated); loads stay plain, so
Triton's asynchronous copy pipelining of the K loop is kept (an in-loop rounding of the loaded
tiles serialised every K step, ~1 us each, in the first H200 profile).

All programs must be resident at once for the barriers (one per SM, launched as a plain grid of
``multi_processor_count`` programs). Triton's CPU interpreter runs programs one after another,
so there (and with ``phase_by_phase=True``) the same kernel is launched once per block and phase:
the same code, the kernel boundary standing in for the barrier. With a single program the
interpreter also runs the one-launch form (its barriers pass on its own arrivals). Both are what
the CPU tests exercise; the GPU tests compare the one-launch form with them (bit-identical).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import AVAILABLE, interpreting
from .dit_ops import bulk_prefetch_on
from .tiled_attention import TABLE_WIDTH, check_counters, direct_key_splits, key_splits, pv16_for

# GEMM tiles (rows BM x columns BN, K split S ways) per role at ~100 rows; H200 probe
# (benchmarks/results/persistent_probe_h200.json): us per phase incl. the barrier, vs the same GEMM
# as a graph-replayed cuBLAS call split 2 ways: qkv 4.56 vs 5.48, proj 2.58 vs 4.99, conv 4.53 vs
# 5.89, fc2 5.83 vs 7.34. fc1 keeps K whole so its bias + GELU run in the epilogue.
# Each tuple: (BM, BN, K splits, BK); BK 64 halves the serial K steps of the long-K phases
# (fc1 7.3 -> 5.7-6.9 us in dit_block_profile_h200.json). Since the weights are prefetched into L2
# (PREFETCH), fc1's K steps are short again: whole-solve replays (fc1_tile_probe_session21_h200.md) with
# BK 64 / 32: B=1 7.34-7.37 / 7.29-7.31 ms, B=2 11.59-11.62 / 11.39 (FP16 operands, B=1: 6.79-6.82 / 6.72).
TILES = {"qkv": (128, 64, 4, 32), "proj": (64, 32, 4, 32), "conv": (128, 64, 4, 32), "fc1": (64, 32, 1, 32),
         "fc2": (64, 64, 8, 64)}
BK = 32                 # the smallest K step: every GEMM's K must be a multiple of it
# Attention: 16-query blocks, keys split until there is about one unit per program (batch 1: 64
# blocks x 2 splits). H200 profile (dit_block_profile_h200.json): 64-query blocks x 8 splits of one
# key tile each were no faster (attention 7.0 us either way) and cost 0.5 us more in the combine.
ATT_BM, ATT_BN, COMBINE_BM = 16, 64, 16
MAX_ROWS = 256          # R*T above which the staged body (more CTAs per GEMM) is used
# On CUDA a GEMM phase's K splits are halved while its units (row tiles x column tiles x splits) outnumber the
# programs, so each phase runs in one wave: at batch 2 (200 rows) the tiles above give 192-256 units for the
# H200's 132 SMs, a second, partial wave. Whole-solve replays (fill_wave_probe_session21_h200.md), off / fc2
# only / every split phase (kept): B=2 11.40-11.42 / 10.96 / 9.89-9.92 ms; B=1 (<= 128 units, no change)
# 7.29 / 7.32 / 7.23-7.31.
FILL_WAVE = True
# With FILL_WAVE, a phase that has no K splits left to halve (fc1, whose bias + GELU need whole K) doubles its row
# tile (to at most 128) while its units outnumber the programs: at batch 2 fc1's 64 x 32 tiles make 256 units,
# 128 x 32 ones 128. H200, whole-solve replays, off / on (fill_wave_rows_probe_session22_h200.md): B=2 10.85-10.87
# / 10.52-10.53 ms (as called 11.40-11.57 / 11.16-11.22), B=1 unchanged (7.26-7.33 / 7.29-7.31; its 128 units
# already fit, and a 128-row tile there cost 0.3 ms in fc1_tile_probe_session22_h200.md).
FILL_WAVE_ROWS = True
BLOCKS_PER_LAUNCH: int | None = None    # None: every block of an evaluation in one launch
# Software-pipelining depth of the phases' loops (the launch's num_stages). Whole-solve replays on the H200
# (block_kernel_stages_probe_session18_h200.md), 2 / 3 / 4 / 5 / 6 stages: B=1 9.64 / 8.02 / 7.72 / 7.78 /
# 7.84 ms, B=2 16.1 / 12.73 / 12.04 / 12.09 / 12.22 (outputs bit-identical); 4 stages take 131072 bytes of
# shared memory per program, 8 would exceed the SM's 232448.
BLOCK_STAGES = 4
# At most this many programs (None: one per SM). H200 B=1: 132 and 128 programs 7.99 ms, 112 10.00
# (block_kernel_programs_probe_session18_h200.md).
MAX_PROGRAMS: int | None = None
# L2 prefetch of each GEMM's weights (and the attention's cache) at the end of the phase before it
# (``_prefetch_at``): 0 off, 1 issued before the program's barrier arrival, 11 after it (``_phase_end``).
# Whole-solve replays on the H200 (prefetch_probe_session20_h200.md), 0 / 1 / 11: B=1 7.77 / 7.50-7.55 /
# 7.41-7.43 ms, B=2 12.06-12.08 / 11.79-11.84 / 11.61-11.64 (outputs bit-identical). Measured and removed:
# two phases ahead (B=1 7.41-7.57, B=2 11.74-11.79) and all of a block's weights after the q/k LN (B=1 7.69-7.75).
PREFETCH = 11
# SM90's bulk prefetch (one per program and region) instead of one per 128-byte line (dit_block_profile_prefetch_
# session20_h200.json, PREFETCH 11: 44.55 against 44.76 us per block, 190 registers against 236)
BULK_PREFETCH = True
# The direct phase (each row's old frames read where its stream cache holds them) prefetches those frames of the
# block's step and layer with the weights, at the end of the QKV GEMM (``_prefetch_at``), as the arena's phase
# prefetches the arena. H100, whole-solve replays on the direct path (direct_prefetch_probe_session61_h100.md),
# off / on: B=1 7.41-7.52 / 7.52-7.53 ms (level), B=2 10.68-10.69 / 10.53-10.59; bit-identical.
DIRECT_PREFETCH = True
# The direct phase walking a split's current and old key tiles in one loop (``tiled_attention._direct_keys_one_loop``)
# instead of one loop per source (whose pipelines each fill and drain): bit-identical. H100, the flow's solve on the
# direct path (direct_one_loop_probe_session62_h100.md), two loops / one: B=1 replay 7.51-7.58 / 7.37-7.38 ms, B=2
# 10.63-10.68 / 9.93-9.95 (as called 11.15-11.55 / 10.37-10.55, at or below the arena path's 10.63-10.79).
DIRECT_ONE_LOOP = True
# With key splits, the split that finishes a query block last combines its partials (``tiled_attention.
# _last_combine``, counted in ``tile_ctr``) instead of phase 3 after a barrier of its own. Whole-solve replays
# (last_combine_probe_session21_h200.md), off / on: B=1 7.42-7.45 / 7.30-7.34 ms (B=2 has no key splits).
# Measured and removed: the q/k head LNs done the same way by the QKV phase's last split of each tile (no
# phase 1): B=1 7.33-7.37 -> 8.05-8.09 ms, B=2 11.69-11.70 -> 12.60-12.63; one program per tile then sums
# four 32-KB partials and normalises 128 rows, which took longer than the LN phase and barrier it saved.
LAST_COMBINE = True
# The attention phase's successor writes (direct phase, or the arena with a successor) copy each kept key tile's
# [k|v] frames as whole rows read again from L2 (``tiled_attention._load_kept``), not from the dot operands'
# registers, whose layouts scatter the stores. Whole-solve replays on the H200
# (successor_probe_session22_run2_direct12_h200.md), direct phase, registers / rows: B=1 8.21-8.31 / 7.86-7.87 ms,
# B=2 11.48-11.50 / 10.79-10.80.
ROW_COPY = True
N_PHASES = 13
# The integers that change between the launches of one solve and with the cache length, trim and voice (Euler
# step, cache lengths, trim span, key counts) are not specialised: Triton compiles a variant for each integer
# argument that happens to be 1 or a multiple of 16, so on a cold cache the default voice's precapture compiled
# this kernel 11 times (62 s, triton_compile_census_session24_before_h200.md; twice since, _session24_h200.md),
# and a voice with another prompt length would compile more mid-stream. Whole-solve replays, unspecialised /
# specialised (specialize_probe_session24_h200.md): B=1 7.28-7.31 / 7.32-7.35 ms, B=2 10.41-10.44 / 10.48-10.49.
RUNTIME_INTS = ("step", "n_old", "n_out", "drop0", "drop1", "cur_keys", "kv_extent", "first", "n_blocks", "nk",
                "keys_per_split")

if AVAILABLE:
    import triton
    import triton.language as tl

    from .dit_ops import prefetch_l2 as _prefetch_l2
    from .dit_ops import qkv_head_ln_row, res_ln_row, store_operand, taps_ln_mish_row
    from .tiled_attention import attn_combine_tile, attn_tile, direct_tile, stream_row

    @triton.jit
    def _prefetch_at(END: tl.constexpr, ON: tl.constexpr, pid, nprog, KV, kv_extent, WPROJ, WT1, WT2, W1, W2,
                     WQKV_NEXT, n_qkv_next, n_proj, n_taps, n_mlp, BULK: tl.constexpr,
                     BASE, SRC, step, layer, R, H: tl.constexpr, D: tl.constexpr, DIRECT: tl.constexpr):
        """The L2 prefetches due at the end of phase END (none unless ON): each GEMM's weights at the end of
        the phase just before it (the attention's combine for the out-proj, the previous block's last phase
        for the QKV), and the attention's cache at the end of the QKV GEMM: the arena's, or (``DIRECT``) each
        row's old frames of this step and layer where its ``SRC`` table row says (a contiguous (H, frames,
        2D) block per row). Neither depends on the phase before, so their HBM latency runs under that phase's
        barrier."""
        if ON:
            if END == 0:
                if DIRECT:
                    for b in range(R):
                        old, _ = stream_row(BASE, SRC, b, 0 * b, step, layer, 0, D)     # head 0: the row's block start
                        _prefetch_l2(old, H * (2 * D) * tl.load(SRC + b * 8 + 4), pid, nprog, BULK)
                else:
                    _prefetch_l2(KV, kv_extent, pid, nprog, BULK)
            if END == 3:
                _prefetch_l2(WPROJ, n_proj, pid, nprog, BULK)
            if END == 5:
                _prefetch_l2(WT1, n_taps, pid, nprog, BULK)
            if END == 7:
                _prefetch_l2(WT2, n_taps, pid, nprog, BULK)
            if END == 9:
                _prefetch_l2(W1, n_mlp, pid, nprog, BULK)
            if END == 10:
                _prefetch_l2(W2, n_mlp, pid, nprog, BULK)
            if END == 12:
                _prefetch_l2(WQKV_NEXT, n_qkv_next, pid, nprog, BULK)

    @triton.jit
    def _phase_end(END: tl.constexpr, CTR, nb, nprog, TIMES, pid, TIMED: tl.constexpr, PREFETCH: tl.constexpr,
                   BULK: tl.constexpr, KV, kv_extent, WPROJ, WT1, WT2, W1, W2, WQKV_NEXT, n_qkv_next, n_proj, n_taps,
                   n_mlp, BASE, SRC, step, layer, R, H: tl.constexpr, D: tl.constexpr, DIRECT: tl.constexpr):
        """The grid barrier after phase END (barrier nb+1: nb+1 arrivals per program; stamped; returns nb+1),
        with the prefetches due then (``PREFETCH``: 1 before this program's arrival, 11 between its arrival
        and its wait)."""
        _prefetch_at(END, PREFETCH == 1, pid, nprog, KV, kv_extent, WPROJ, WT1, WT2, W1, W2, WQKV_NEXT,
                     n_qkv_next, n_proj, n_taps, n_mlp, BULK, BASE, SRC, step, layer, R, H, D, DIRECT)
        nb += 1
        if TIMED == 2:      # this program's arrival
            tl.store(TIMES + (2 * nb - 1) * nprog + pid, tl.extra.cuda.globaltimer())
        tl.debug_barrier()      # every warp's stores of the phase are issued before the program arrives
        tl.atomic_add(CTR, 1, sem="release", scope="gpu")
        _prefetch_at(END, PREFETCH == 11, pid, nprog, KV, kv_extent, WPROJ, WT1, WT2, W1, W2,
                     WQKV_NEXT, n_qkv_next, n_proj, n_taps, n_mlp, BULK, BASE, SRC, step, layer, R, H, D, DIRECT)
        while tl.atomic_add(CTR, 0, sem="acquire", scope="gpu") < nb * nprog:
            pass
        tl.debug_barrier()
        _stamp(TIMES, nb, pid, nprog, TIMED)
        return nb

    @triton.jit
    def _stamp(TIMES, j, pid, nprog, TIMED: tl.constexpr):
        # profiling only (benchmarks/dit_block_profile.py), the clock after barrier j (0: the start):
        # TIMED 1: program 0's at TIMES[j]; 2: every program's at TIMES[2j, pid] (arrivals at [2j-1, pid])
        if TIMED == 1:
            if pid == 0:
                tl.store(TIMES + j, tl.extra.cuda.globaltimer())
        if TIMED == 2:
            tl.store(TIMES + 2 * j * nprog + pid, tl.extra.cuda.globaltimer())

    @triton.jit
    def _gemm_phase(pid, nprog, A, W, OUT, BIAS, M, N, K,
                    S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK_: tl.constexpr,
                    GELU: tl.constexpr, ROUND: tl.constexpr, PRECISION: tl.constexpr):
        """OUT (S, M, N) = split-K partials of A (M, K) @ W (N, K)^T; GELU: S == 1, + bias, tanh-GELU."""
        mt = tl.cdiv(M, BM)
        nt = tl.cdiv(N, BN)
        klen = K // S
        for u in range(pid, mt * nt * S, nprog):
            sp = u % S
            tile = u // S
            offs_m = (tile % mt) * BM + tl.arange(0, BM)
            offs_n = (tile // mt) * BN + tl.arange(0, BN)
            offs_k = tl.arange(0, BK_)
            row_ok = offs_m < M
            col_ok = offs_n < N
            acc = tl.zeros([BM, BN], tl.float32)
            for k in range(sp * klen, sp * klen + klen, BK_):
                a = tl.load(A + offs_m[:, None] * K + (k + offs_k)[None, :], mask=row_ok[:, None], other=0.0)
                w = tl.load(W + offs_n[None, :] * K + (k + offs_k)[:, None], mask=col_ok[None, :], other=0.0)
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GELU:
                acc += tl.load(BIAS + offs_n, mask=col_ok, other=0.0)[None, :]
                # 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
                u2 = 1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)
                acc = acc / (1.0 + tl.exp(-u2))
                store_operand(OUT + offs_m[:, None] * N + offs_n[None, :], acc,      # fc2's operand
                              row_ok[:, None] & col_ok[None, :], ROUND)
            else:
                tl.store(OUT + sp * M * N + offs_m[:, None] * N + offs_n[None, :], acc,
                         mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit(do_not_specialize=RUNTIME_INTS)
    def _dit_block(HX, NORM, QKV, Q, KV_ALL, MASK, O, PACC, PML, Y, HIST, TAPSB, MLP, Y2, CTR, TCTR, ROWS, POS,
                   BASE, SRC, DST, step, n_old, n_out, drop0, drop1, cur_keys, kv_extent,
                   WQKV_ALL, BQKV_ALL, QNW_ALL, QNB_ALL, KNW_ALL, KNB_ALL, WPROJ_ALL, BPROJ_ALL, WT1_ALL, BC1_ALL,
                   LNW_ALL, LNB_ALL, WT2_ALL, BC2_ALL, W1_ALL, B1_ALL, W2_ALL, B2_ALL,
                   MOD_ALL, s_mod, TIMES, first, n_blocks,
                   R, T, nk, s_kv_blk, skv_r, skv_h, skv_t, smb, smm, smn,
                   eps, qk_eps, conv_eps, attn_scale, keys_per_split,
                   C: tl.constexpr, H: tl.constexpr, D: tl.constexpr, MLPH: tl.constexpr, TAPS: tl.constexpr,
                   BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                   S_QKV: tl.constexpr, BM_QKV: tl.constexpr, BN_QKV: tl.constexpr, BK_QKV: tl.constexpr,
                   S_PROJ: tl.constexpr, BM_PROJ: tl.constexpr, BN_PROJ: tl.constexpr, BK_PROJ: tl.constexpr,
                   S_CONV: tl.constexpr, BM_CONV: tl.constexpr, BN_CONV: tl.constexpr, BK_CONV: tl.constexpr,
                   BM_FC1: tl.constexpr, BN_FC1: tl.constexpr, BK_FC1: tl.constexpr,
                   S_FC2: tl.constexpr, BM_FC2: tl.constexpr, BN_FC2: tl.constexpr, BK_FC2: tl.constexpr,
                   A_BM: tl.constexpr, A_BN: tl.constexpr, A_SPLITS: tl.constexpr, C_BM: tl.constexpr,
                   COMBINE_PHASE: tl.constexpr,
                   HAS_MASK: tl.constexpr, POOLED: tl.constexpr,
                   PHASE: tl.constexpr, ROUND: tl.constexpr, PRECISION: tl.constexpr, TIMED: tl.constexpr,
                   PV16: tl.constexpr = False, DIRECT: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
                   BULK_PREFETCH: tl.constexpr = False, LAST_COMBINE: tl.constexpr = False,
                   SUCC: tl.constexpr = False, ROW_COPY: tl.constexpr = True,
                   ROW_LENGTHS: tl.constexpr = False, PF_OLD: tl.constexpr = False,
                   ONE_LOOP: tl.constexpr = False):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        M = R * T
        Th = T + TAPS - 1          # conv history frames per row
        Mh = R * Th
        HD = H * D
        NT = TAPS * C              # taps GEMM width
        n_mblk = tl.cdiv(T, A_BM)
        nb = 0 * pid               # barriers passed: barrier j waits for j arrivals per program
        _stamp(TIMES, 0, pid, nprog, TIMED)
        for i in range(first, first + n_blocks):
            # block i's slices of the stacked weights, caches and modulation chain
            WQKV = WQKV_ALL + i * (3 * HD * C)
            BQKV = BQKV_ALL + i * (3 * HD)
            QNW = QNW_ALL + i * D
            QNB = QNB_ALL + i * D
            KNW = KNW_ALL + i * D
            KNB = KNB_ALL + i * D
            WPROJ = WPROJ_ALL + i * (C * HD)
            BPROJ = BPROJ_ALL + i * C
            WT1 = WT1_ALL + i * (NT * C)
            BC1 = BC1_ALL + i * C
            LNW = LNW_ALL + i * C
            LNB = LNB_ALL + i * C
            WT2 = WT2_ALL + i * (NT * C)
            BC2 = BC2_ALL + i * C
            W1 = W1_ALL + i * (MLPH * C)
            B1 = B1_ALL + i * MLPH
            W2 = W2_ALL + i * (C * MLPH)
            B2 = B2_ALL + i * C
            KV = KV_ALL + i * s_kv_blk
            HIST1 = HIST + i * (2 * Mh * C)
            HIST2 = HIST1 + Mh * C
            MOD = MOD_ALL + i * (9 * C)
            pf_next = tl.where(i + 1 < first + n_blocks, 3 * HD * C, 0)     # the next block's QKV weights
            # modulation rows of this block: shift/scale/gate for msa, mlp, conv (fused_dit order); the
            # next block's (or, past the last block, the final layer's) shift and scale follow them
            G_MSA = MOD + 2 * C
            SH_MLP = MOD + 3 * C
            SC_MLP = MOD + 4 * C
            G_MLP = MOD + 5 * C
            SH_CONV = MOD + 6 * C
            SC_CONV = MOD + 7 * C
            G_CONV = MOD + 8 * C
            NSH = MOD + 9 * C
            NSC = MOD + 10 * C

            if PHASE < 0 or PHASE == 0:
                _gemm_phase(pid, nprog, NORM, WQKV, QKV, BQKV, M, 3 * HD, C, S_QKV, BM_QKV, BN_QKV, BK_QKV,
                            False, ROUND, PRECISION)
            if PHASE < 0:
                nb = _phase_end(0, CTR, nb, nprog, TIMES, pid, TIMED, PREFETCH, BULK_PREFETCH, KV, kv_extent, WPROJ,
                                WT1, WT2, W1, W2, WQKV + 3 * HD * C, pf_next, C * HD, NT * C, MLPH * C,
                                BASE, SRC, step, i, R, H, D, PF_OLD)
            if PHASE < 0 or PHASE == 1:
                for n in range(pid, M, nprog):
                    qkv_head_ln_row(n, QKV, BQKV, QNW, QNB, KNW, KNB, Q, KV, ROWS, POS,
                                    T * 3 * HD, 3 * HD, M * 3 * HD, T * HD, HD, D, skv_r, skv_h, skv_t,
                                    T, H, D, qk_eps, BLOCK_H, D, POOLED, True, S_QKV)
            if PHASE < 0:
                nb = _phase_end(1, CTR, nb, nprog, TIMES, pid, TIMED, PREFETCH, BULK_PREFETCH, KV, kv_extent, WPROJ,
                                WT1, WT2, W1, W2, WQKV + 3 * HD * C, pf_next, C * HD, NT * C, MLPH * C,
                                BASE, SRC, step, i, R, H, D, PF_OLD)
            if PHASE < 0 or PHASE == 2:
                for u in range(pid, R * H * n_mblk * A_SPLITS, nprog):
                    split = u % A_SPLITS
                    rest = u // A_SPLITS
                    mblk = rest % n_mblk
                    bh = rest // n_mblk
                    if DIRECT:      # KV holds this chunk's frames; each row's old ones stay in its own cache
                        direct_tile(bh // H, bh % H, mblk, split, H, Q, KV, BASE, SRC, DST, O, PACC, PML,
                                    T * HD, D, HD, 1, skv_r, skv_h, T * HD, D, HD, 1, step, i, T, n_old, n_out,
                                    drop0, drop1, attn_scale, keys_per_split, cur_keys, D, A_BM, A_BN, PRECISION,
                                    A_SPLITS, ROUND, PV16, CNT=TCTR, LAST_COMBINE=LAST_COMBINE, ROW_COPY=ROW_COPY,
                                    ROW_LENGTHS=ROW_LENGTHS, ONE_LOOP=ONE_LOOP)
                    else:
                        if SUCC:    # the arena's frames are read here; the trimmed successor is written too
                            succ, present = stream_row(BASE, DST, bh // H, bh % H, step, i, n_out, D)
                        else:
                            succ, present = KV, False
                        attn_tile(bh // H, bh % H, mblk, split, H, Q, KV, KV + D, O, MASK, ROWS, PACC, PML,
                                  T * HD, D, HD, 1, skv_r, skv_h, skv_t, 1, skv_r, skv_h, skv_t, 1,
                                  T * HD, D, HD, 1, smb, smm, smn, T, nk, attn_scale, keys_per_split,
                                  D, A_BM, A_BN, HAS_MASK, POOLED, PRECISION, A_SPLITS, ROUND, PV16=PV16,
                                  CNT=TCTR, LAST_COMBINE=LAST_COMBINE, SUCC_DST=succ, succ_present=present,
                                  drop0=drop0, drop1=drop1, SUCC=SUCC, ROW_COPY=ROW_COPY)
            if PHASE < 0:     # the out-proj's weights are due here unless a combine phase follows
                nb = _phase_end(2 + (COMBINE_PHASE == 0), CTR, nb, nprog, TIMES, pid, TIMED, PREFETCH, BULK_PREFETCH,
                                KV, kv_extent, WPROJ, WT1, WT2, W1, W2, WQKV + 3 * HD * C, pf_next, C * HD, NT * C,
                                MLPH * C, BASE, SRC, step, i, R, H, D, PF_OLD)
            if COMBINE_PHASE:
                if PHASE < 0 or PHASE == 3:
                    n_cblk = tl.cdiv(T, C_BM)
                    for u in range(pid, R * H * n_cblk, nprog):
                        bh = u // n_cblk
                        attn_combine_tile(bh // H, bh % H, u % n_cblk, PACC, PML, O, T * HD, D, HD, 1, H, T,
                                          D, C_BM, A_SPLITS, ROUND)
                if PHASE < 0:
                    nb = _phase_end(3, CTR, nb, nprog, TIMES, pid, TIMED, PREFETCH, BULK_PREFETCH, KV, kv_extent, WPROJ,
                                    WT1, WT2, W1, W2, WQKV + 3 * HD * C, pf_next, C * HD, NT * C, MLPH * C,
                                    BASE, SRC, step, i, R, H, D, PF_OLD)
            if PHASE < 0 or PHASE == 4:
                _gemm_phase(pid, nprog, O, WPROJ, Y, BPROJ, M, C, HD, S_PROJ, BM_PROJ, BN_PROJ, BK_PROJ,
                            False, ROUND, PRECISION)
            if PHASE < 0:
                nb = _phase_end(4, CTR, nb, nprog, TIMES, pid, TIMED, PREFETCH, BULK_PREFETCH, KV, kv_extent, WPROJ,
                                WT1, WT2, W1, W2, WQKV + 3 * HD * C, pf_next, C * HD, NT * C, MLPH * C,
                                BASE, SRC, step, i, R, H, D, PF_OLD)
            if PHASE < 0 or PHASE == 5:
                for n in range(pid, M, nprog):
                    res_ln_row(n, HX, Y, BPROJ, G_MSA, SH_CONV, SC_CONV, HIST1 + (TAPS - 1) * C,
                               T * C, C, T * C, C, Th * C, C, s_mod, s_mod, M * C, T, C, eps,
                               0, True, True, S_PROJ, BLOCK_C, ROUND)
            if PHASE < 0:
                nb = _phase_end(5, CTR, nb, nprog, TIMES, pid, TIMED, PREFETCH, BULK_PREFETCH, KV, kv_extent, WPROJ,
                                WT1, WT2, W1, W2, WQKV + 3 * HD * C, pf_next, C * HD, NT * C, MLPH * C,
                                BASE, SRC, step, i, R, H, D, PF_OLD)
            if PHASE < 0 or PHASE == 6:
                _gemm_phase(pid, nprog, HIST1, WT1, TAPSB, BC1, Mh, NT, C, S_CONV, BM_CONV, BN_CONV, BK_CONV,
                            False, ROUND, PRECISION)
            if PHASE < 0:
                nb = _phase_end(6, CTR, nb, nprog, TIMES, pid, TIMED, PREFETCH, BULK_PREFETCH, KV, kv_extent, WPROJ,
                                WT1, WT2, W1, W2, WQKV + 3 * HD * C, pf_next, C * HD, NT * C, MLPH * C,
                                BASE, SRC, step, i, R, H, D, PF_OLD)
            if PHASE < 0 or PHASE == 7:
                for n in range(pid, M, nprog):
                    taps_ln_mish_row(n, TAPSB, BC1, LNW, LNB, HIST2 + (TAPS - 1) * C, Th * NT, NT, Th * C, C,
                                     Mh * NT, T, C, conv_eps, TAPS, S_CONV, BLOCK_C, ROUND)
            if PHASE < 0:
                nb = _phase_end(7, CTR, nb, nprog, TIMES, pid, TIMED, PREFETCH, BULK_PREFETCH, KV, kv_extent, WPROJ,
                                WT1, WT2, W1, W2, WQKV + 3 * HD * C, pf_next, C * HD, NT * C, MLPH * C,
                                BASE, SRC, step, i, R, H, D, PF_OLD)
            if PHASE < 0 or PHASE == 8:
                _gemm_phase(pid, nprog, HIST2, WT2, TAPSB, BC2, Mh, NT, C, S_CONV, BM_CONV, BN_CONV, BK_CONV,
                            False, ROUND, PRECISION)
            if PHASE < 0:
                nb = _phase_end(8, CTR, nb, nprog, TIMES, pid, TIMED, PREFETCH, BULK_PREFETCH, KV, kv_extent, WPROJ,
                                WT1, WT2, W1, W2, WQKV + 3 * HD * C, pf_next, C * HD, NT * C, MLPH * C,
                                BASE, SRC, step, i, R, H, D, PF_OLD)
            if PHASE < 0 or PHASE == 9:
                for n in range(pid, M, nprog):
                    res_ln_row(n, HX, TAPSB, BC2, G_CONV, SH_MLP, SC_MLP, NORM,
                               T * C, C, Th * NT, NT, T * C, C, s_mod, s_mod, Mh * NT, T, C, eps,
                               TAPS, True, True, S_CONV, BLOCK_C, ROUND)
            if PHASE < 0:
                nb = _phase_end(9, CTR, nb, nprog, TIMES, pid, TIMED, PREFETCH, BULK_PREFETCH, KV, kv_extent, WPROJ,
                                WT1, WT2, W1, W2, WQKV + 3 * HD * C, pf_next, C * HD, NT * C, MLPH * C,
                                BASE, SRC, step, i, R, H, D, PF_OLD)
            if PHASE < 0 or PHASE == 10:
                _gemm_phase(pid, nprog, NORM, W1, MLP, B1, M, MLPH, C, 1, BM_FC1, BN_FC1, BK_FC1,
                            True, ROUND, PRECISION)
            if PHASE < 0:
                nb = _phase_end(10, CTR, nb, nprog, TIMES, pid, TIMED, PREFETCH, BULK_PREFETCH, KV, kv_extent, WPROJ,
                                WT1, WT2, W1, W2, WQKV + 3 * HD * C, pf_next, C * HD, NT * C, MLPH * C,
                                BASE, SRC, step, i, R, H, D, PF_OLD)
            if PHASE < 0 or PHASE == 11:
                _gemm_phase(pid, nprog, MLP, W2, Y2, B2, M, C, MLPH, S_FC2, BM_FC2, BN_FC2, BK_FC2,
                            False, ROUND, PRECISION)
            if PHASE < 0:
                nb = _phase_end(11, CTR, nb, nprog, TIMES, pid, TIMED, PREFETCH, BULK_PREFETCH, KV, kv_extent, WPROJ,
                                WT1, WT2, W1, W2, WQKV + 3 * HD * C, pf_next, C * HD, NT * C, MLPH * C,
                                BASE, SRC, step, i, R, H, D, PF_OLD)
            if PHASE < 0 or PHASE == 12:
                for n in range(pid, M, nprog):
                    res_ln_row(n, HX, Y2, B2, G_MLP, NSH, NSC, NORM,
                               T * C, C, T * C, C, T * C, C, s_mod, s_mod, M * C, T, C, eps,
                               0, True, True, S_FC2, BLOCK_C, ROUND)
            if PHASE < 0:
                if i + 1 < first + n_blocks:     # block i+1 reads the residual stream block i wrote
                    nb = _phase_end(12, CTR, nb, nprog, TIMES, pid, TIMED, PREFETCH, BULK_PREFETCH, KV, kv_extent,
                                    WPROJ, WT1, WT2, W1, W2, WQKV + 3 * HD * C, pf_next, C * HD, NT * C, MLPH * C,
                                    BASE, SRC, step, i, R, H, D, PF_OLD)
        if PHASE < 0:
            if TIMED == 2:      # the last phase's end, as an arrival
                tl.store(TIMES + (2 * nb + 1) * nprog + pid, tl.extra.cuda.globaltimer())
            else:
                _stamp(TIMES, nb + 1, pid, nprog, TIMED)


GEMM_WEIGHTS = ("w_qkv", "w_proj", "w_taps1", "w_taps2", "w_fc1", "w_fc2")


@dataclass(frozen=True)
class BlockWeights:
    """A DiT block's parameters as the kernel reads them: per block (packed QKV and conv taps, the
    rest the original module's own tensors), or every block stacked over depth (``stack_weights``),
    which is what ``dit_blocks`` takes."""

    w_qkv: torch.Tensor
    b_qkv: torch.Tensor
    qn_w: torch.Tensor
    qn_b: torch.Tensor
    kn_w: torch.Tensor
    kn_b: torch.Tensor
    w_proj: torch.Tensor
    b_proj: torch.Tensor
    w_taps1: torch.Tensor
    b_conv1: torch.Tensor
    ln_w: torch.Tensor
    ln_b: torch.Tensor
    w_taps2: torch.Tensor
    b_conv2: torch.Tensor
    w_fc1: torch.Tensor
    b_fc1: torch.Tensor
    w_fc2: torch.Tensor
    b_fc2: torch.Tensor

    def rounded_(self) -> "BlockWeights":
        """The GEMM weights rounded in place to nearest TF32 (biases and norms stay FP32): the tensor
        core truncates operands, so pre-rounded operands give cuBLAS-like TF32 error. Only for copies
        (``stack_weights``), never the module's own parameters."""
        for k in GEMM_WEIGHTS:
            round_tf32_(getattr(self, k))
        return self

    def gemm_as(self, dtype: torch.dtype) -> "BlockWeights":
        """A copy whose GEMM weights are ``dtype`` (FP16 operands of the tile GEMMs); the rest shared."""
        return replace(self, **{k: getattr(self, k).to(dtype) for k in GEMM_WEIGHTS})


def rounds(precision: str, device: torch.device) -> bool:
    """Does the kernel store its GEMM operands rounded to TF32 (and expect ``BlockWeights.rounded``)?
    Compiled TF32 only: the interpreter computes its dots in FP32, where rounding would only add error."""
    return precision == "tf32" and torch.device(device).type == "cuda" and not interpreting()


def round_tf32_(t: torch.Tensor) -> torch.Tensor:
    """t rounded in place to nearest TF32 (ties away from zero): add half an ulp of the 13 dropped
    mantissa bits to the magnitude's bit pattern, then clear them (the kernels' ``round_tf32``)."""
    if t.dtype != torch.float32:
        raise TypeError(f"round_tf32_: float32 only, got {t.dtype}")
    bits = t.view(torch.int32)
    bits.add_(0x1000).bitwise_and_(-8192)
    return t


def tile(role: str, K: int, k_step_scale: int = 1, M: int | None = None, N: int | None = None,
         nprog: int | None = None) -> tuple[int, int, int, int]:
    """(BM, BN, K splits, BK) of ``role``'s GEMM phase over inner size K: the role's tile with its
    splits halved (and BK dropped to 32) until every K slice is a whole number of K steps; given the
    phase's M x N output and ``nprog`` programs (CUDA), halved further while the units outnumber the
    programs (``FILL_WAVE``), then with no splits left the row tile doubled up to 128 (``FILL_WAVE_ROWS``);
    then BK times ``k_step_scale`` where the K slices stay whole numbers of steps (the splits never change:
    the workspace's partial buffers are sized by them)."""
    bm, bn, s, bk = TILES[role]
    if K % bk:
        bk = BK
    while s > 1 and (K % s or (K // s) % bk):
        s //= 2
    if FILL_WAVE and M is not None and N is not None and nprog is not None:
        while s > 1 and -(-M // bm) * -(-N // bn) * s > nprog:
            s //= 2
        while FILL_WAVE_ROWS and bm < 128 and -(-M // bm) * -(-N // bn) * s > nprog:
            bm *= 2
    if k_step_scale > 1 and (K // s) % (bk * k_step_scale) == 0:
        bk *= k_step_scale
    return bm, bn, s, bk


def gemm_splits(K: int, role: str, M: int | None = None, N: int | None = None, nprog: int | None = None) -> int:
    """K-split count of ``role``'s GEMM phase over inner size K (and M x N outputs over ``nprog`` programs:
    ``tile``)."""
    return tile(role, K, 1, M, N, nprog)[2]


def gemm_shapes(R: int, T: int, hidden: int, heads: int, head_dim: int, mlp_hidden: int, taps: int) -> dict:
    """(M, N, K) of each GEMM phase for R rows x T frames."""
    return {"qkv": (R * T, 3 * heads * head_dim, hidden), "proj": (R * T, hidden, heads * head_dim),
            "conv": (R * (T + taps - 1), taps * hidden, hidden), "fc1": (R * T, mlp_hidden, hidden),
            "fc2": (R * T, hidden, mlp_hidden)}


def wave_programs(device: torch.device) -> int | None:
    """The program count the GEMM phases' splits are fitted to (``tile``): the launch's on CUDA; None
    elsewhere (the interpreter's few programs would leave nothing to split)."""
    device = torch.device(device)
    return programs(device) if device.type == "cuda" else None


def supported(hidden: int, heads: int, head_dim: int, mlp_hidden: int) -> tuple[bool, str]:
    """The kernel's shape requirements (every GEMM's K a multiple of BK, power-of-two head dim)."""
    for name, k in (("hidden", hidden), ("heads*head_dim", heads * head_dim), ("mlp_hidden", mlp_hidden)):
        if k % BK:
            return False, f"{name} {k} is not a multiple of {BK}"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return False, f"head_dim {head_dim} is not a power of two >= 16"
    return True, ""


def _wanted_splits(R: int, H: int, T: int, nprog: int) -> int:
    """Key splits (at most 8) that give the attention phase about one unit per program."""
    units = R * H * -(-T // ATT_BM)
    return max(1, min(8, nprog // max(units, 1)))


def attention_splits(R: int, H: int, T: int, nk: int, nprog: int) -> tuple[int, int]:
    """(key splits, keys per split) so the attention phase has about one unit per program."""
    return key_splits(nk, _wanted_splits(R, H, T, nprog), ATT_BN)


def direct_attention_splits(R: int, H: int, T: int, n_old: int, nprog: int) -> tuple[int, int, int]:
    """(key splits, keys per split, keys the current frames count as) of the direct attention phase: about
    one unit per program, as ``attention_splits``, with each split walking whole key tiles of each source
    (``tiled_attention.direct_key_splits``)."""
    return direct_key_splits(T, n_old, _wanted_splits(R, H, T, nprog), ATT_BN)


def programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (all resident, as the barriers need; fewer with
    ``MAX_PROGRAMS``)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return sms if MAX_PROGRAMS is None else max(1, min(sms, MAX_PROGRAMS))
    return 3     # interpreter: a few programs, so the unit loops are exercised


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def dit_blocks(*, h, norm, qkv, q, kv, mask, o, attn_acc, attn_ml, y, hist, taps, mlp, y2, ctr,
               w: BlockWeights, mod_chain, first: int, n_blocks: int, eps: float, qk_eps: float,
               conv_eps: float, attn_splits: int, keys_per_split: int, nprog: int, precision: str = "tf32",
               phase_by_phase: bool | None = None, num_warps: int = 8, times: torch.Tensor | None = None,
               per_program: bool = False, rows: torch.Tensor | None = None, pos: torch.Tensor | None = None,
               pv16: bool | None = None, k_step_scale: int | None = None, streams=None, cur_keys: int | None = None,
               tile_ctr: torch.Tensor | None = None, successor=None):
    """Blocks [first, first + n_blocks) in place, in ONE launch (see the module docstring).

    Shapes as ``fused_dit.Workspace``: h, norm (R,T,C); qkv (Sq,R,T,3HD); q, o (R,T,H,D); kv
    (depth,R,H,nk,2D), each block's frames [0,T) receive this chunk's [k|v] (pooled caches, ``slot_pool``:
    kv (depth,P,H,nk,2D), row r's frame t goes to pool row ``rows[r]`` (R,) int32, frame ``pos[r, t]``
    (R,T) int32, and its attention reads pool row rows[r]); mask (R,T,nk) bool or
    None; attn_acc (R*H*8*T*D,) and attn_ml (R*H*8*T*2,) scratch; y (Sp,R,T,C); hist (depth,2,R,T+K-1,C)
    conv histories with the CNN cache in frames [0,K-1); taps (Sc,R,T+K-1,K*C); mlp (R,T,4C); y2
    (Sf,R,T,C); ctr an int32 counter that is 0 on entry; w the blocks' weights stacked over depth
    (``stack_weights``); mod_chain (Rm,depth+1,9,C) modulation rows (scales hold 1+scale; row depth
    holds the final layer's shift and scale in slots 0 and 1). precision "tf32" (operands stored
    rounded to nearest TF32 on CUDA; ``w`` rounded too) or "ieee" for every dot.
    ``times`` (int64, >= 13 * n_blocks + 1, or 12 * n_blocks + 1 without a combine phase; profiling, one
    launch only): program 0's clock (ns) at the start, after each barrier and at the end; with
    ``per_program``, (2 * that, nprog): every program's clock at the start and after each barrier
    (even rows) and at its arrival at each barrier and at its end (odd rows). Returns the compiled
    kernel (registers, spills) of the last launch.
    ``streams`` (``tiled_attention.StreamKV``, unmasked and unpooled only): kv (depth,R,H,T,2D) holds just
    this chunk's frames; the attention phase reads each row's old frames where ``streams`` says and writes
    the trimmed successors (``direct_attention``'s unit); ``keys_per_split`` then counts ``cur_keys`` (default
    T) + old frames, the current frames counted as ``cur_keys`` keys (``direct_attention_splits``).
    ``tile_ctr`` (int32, >= R*H*ceil(T/ATT_BM), zero; left zero): with key splits and ``LAST_COMBINE``, the
    last split of each query block combines them (no combine phase).
    ``successor`` (``tiled_attention.StreamKV``, its ``dst`` table, ``n_out``, ``drop`` and ``step``; unmasked,
    unpooled, kv's frames [T, nk) the old cache): the attention phase reads kv as usual and also writes each
    row's trimmed successor (frames ``drop`` of kv's order left out), as the direct phase does.
    """
    if precision not in ("tf32", "ieee"):
        raise ValueError(f"dit_blocks: precision must be 'tf32' or 'ieee', got {precision!r}")
    if not AVAILABLE:
        raise RuntimeError("dit_blocks needs Triton")
    R, T, C = h.shape
    depth, _, H, nk, D2 = kv.shape
    D = D2 // 2
    K = hist.shape[3] - T + 1
    if not 0 <= first < first + n_blocks <= depth:
        raise ValueError(f"dit_blocks: blocks [{first}, {first + n_blocks}) outside the depth {depth}")
    for name, t in (("h", h), ("norm", norm), ("qkv", qkv), ("q", q), ("o", o), ("y", y), ("hist", hist),
                    ("taps", taps), ("mlp", mlp), ("y2", y2), ("attn_acc", attn_acc)):
        if not t.is_contiguous():
            raise ValueError(f"dit_blocks: {name} must be contiguous, got strides {t.stride()}")
    if (rows is None) != (pos is None):
        raise ValueError("dit_blocks: pooled caches need both rows and pos (or neither)")
    if pos is not None and (rows.shape != (R,) or pos.shape != (R, T) or rows.dtype != torch.int32
                            or pos.dtype != torch.int32 or not pos.is_contiguous()):
        raise ValueError(f"dit_blocks: rows {tuple(rows.shape)} {rows.dtype} / pos {tuple(pos.shape)} {pos.dtype} "
                         f"must be int32 ({R},) and contiguous int32 ({R}, {T})")
    if kv.stride(4) != 1:
        raise ValueError(f"dit_blocks: kv's last dim must be contiguous, got strides {kv.stride()}")
    if streams is not None and (mask is not None or pos is not None or nk != T or kv.stride(3) != D2
                                or streams.src.shape != (R, TABLE_WIDTH)):
        raise ValueError("dit_blocks: per-stream caches (streams) take no mask and no pooled rows, and kv must "
                         f"hold exactly this chunk's {T} frames with contiguous [k|v] rows; got kv "
                         f"{tuple(kv.shape)} strides {kv.stride()}, tables {tuple(streams.src.shape)}")
    if successor is not None and (streams is not None or mask is not None or pos is not None
                                  or successor.dst.shape != (R, TABLE_WIDTH)
                                  or nk - (successor.drop[1] - successor.drop[0]) != successor.n_out):
        raise ValueError("dit_blocks: a successor is written from the arena's unmasked, unpooled frames (no "
                         f"streams), {nk} frames less the dropped {successor.drop} making its {successor.n_out}; "
                         f"got tables {tuple(successor.dst.shape)}, mask {mask is not None}, pooled {pos is not None}")
    if mod_chain.shape[1:] != (depth + 1, 9, C) or not mod_chain[0].is_contiguous():
        raise ValueError(f"dit_blocks: mod_chain must be (Rm, {depth + 1}, 9, {C}) with contiguous rows, "
                         f"got {tuple(mod_chain.shape)}")
    if w.w_qkv.shape[0] != depth:
        raise ValueError(f"dit_blocks: weights stacked over {w.w_qkv.shape[0]} blocks, the caches hold {depth}")
    for name, t in (("norm", norm), ("o", o), ("mlp", mlp), ("hist", hist)):
        if t.dtype != w.w_qkv.dtype:
            raise TypeError(f"dit_blocks: {name} is {t.dtype} but the GEMM weights are {w.w_qkv.dtype}; the "
                            "operand buffers and weights share one dtype (FusedDiT.workspace / stacked_weights)")
    if k_step_scale is None:    # FP16 operands: K steps of twice the elements carry FP32's bytes
        k_step_scale = 2 if w.w_qkv.dtype == torch.float16 else 1
    wave = nprog if wave_programs(h.device) is not None else None      # splits fitted to this launch (CUDA)
    tiles = {r: tile(r, k, k_step_scale, m, n, wave)
             for r, (m, n, k) in gemm_shapes(R, T, C, H, D, mlp.shape[-1], K).items()}
    expect = {"qkv": (qkv, tiles["qkv"][2]), "y": (y, tiles["proj"][2]), "taps": (taps, tiles["conv"][2]),
              "y2": (y2, tiles["fc2"][2])}
    for name, (t, s) in expect.items():
        if t.shape[0] != s:
            raise ValueError(f"dit_blocks: {name} holds {t.shape[0]} split-K partials, the kernel writes {s}")
    s_mod = mod_chain.stride(0) if mod_chain.shape[0] > 1 else 0
    if mask is not None:
        m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        ms = m.stride()
    else:
        m, ms = h, (0, 0, 0)
    if phase_by_phase is None:
        phase_by_phase = interpreting() or h.device.type != "cuda"
    last = LAST_COMBINE and attn_splits > 1 and tile_ctr is not None
    if last:
        check_counters(tile_ctr, R * H * -(-T // ATT_BM), h.device, "dit_blocks")
    combine_phase = attn_splits > 1 and not last
    per_block = N_PHASES - (not combine_phase)       # barriers a block passes
    stamps = (per_block * n_blocks + 1) * (2 * nprog if per_program else 1)
    if times is not None and times.numel() < stamps:
        raise ValueError(f"dit_blocks: times holds {times.numel()} stamps, {n_blocks} block(s) write {stamps}")
    round_tf32 = rounds(precision, h.device)
    # the prefetch is inline PTX, which the interpreter cannot run; the cache's extent only for an arena block
    prefetch = 0 if interpreting() else PREFETCH
    if prefetch not in (0, 1, 11):
        raise ValueError(f"dit_block.PREFETCH must be 0, 1 or 11, got {prefetch!r}")
    bulk = BULK_PREFETCH and bulk_prefetch_on(h.device)
    kv_extent = 0
    if streams is None and pos is None:
        kv_extent = (R - 1) * kv.stride(1) + (H - 1) * kv.stride(2) + (nk - 1) * kv.stride(3) + 2 * D
    tables = streams if streams is not None else successor
    if tables is None:
        direct = (h, ctr, ctr, 0, 0, 0, 0, 0, 0)
    else:
        direct = (tables.base, tables.src, tables.dst, tables.step, tables.n_old, tables.n_out, *tables.drop,
                  T if cur_keys is None else cur_keys)
    (bq, nq_, _, kq), (bp, np_, _, kp), (bc, nc, _, kc), (b1, n1, _, k1), (b2, n2, _, k2) = (
        tiles[r] for r in ("qkv", "proj", "conv", "fc1", "fc2"))
    def args(b0: int, nb: int) -> tuple:
        return (h, norm, qkv, q, kv, m, o, attn_acc, attn_ml, y, hist, taps, mlp, y2, ctr,
                tile_ctr if last else ctr, rows if rows is not None else ctr, pos if pos is not None else ctr,
                *direct, kv_extent,
                w.w_qkv, w.b_qkv, w.qn_w, w.qn_b, w.kn_w, w.kn_b, w.w_proj, w.b_proj, w.w_taps1, w.b_conv1,
                w.ln_w, w.ln_b, w.w_taps2, w.b_conv2, w.w_fc1, w.b_fc1, w.w_fc2, w.b_fc2,
                mod_chain, s_mod, times if times is not None else ctr, b0, nb,
                R, T, nk, kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), *ms,
                eps, qk_eps, conv_eps, float(D) ** -0.5, keys_per_split)
    meta = dict(C=C, H=H, D=D, MLPH=mlp.shape[-1], TAPS=K, BLOCK_C=_pow2(C), BLOCK_H=_pow2(H),
                S_QKV=qkv.shape[0], BM_QKV=bq, BN_QKV=nq_, BK_QKV=kq, S_PROJ=y.shape[0], BM_PROJ=bp,
                BN_PROJ=np_, BK_PROJ=kp, S_CONV=taps.shape[0], BM_CONV=bc, BN_CONV=nc, BK_CONV=kc,
                BM_FC1=b1, BN_FC1=n1, BK_FC1=k1, S_FC2=y2.shape[0], BM_FC2=b2, BN_FC2=n2, BK_FC2=k2,
                A_BM=ATT_BM, A_BN=ATT_BN, C_BM=COMBINE_BM, COMBINE_PHASE=combine_phase, LAST_COMBINE=last,
                A_SPLITS=attn_splits, HAS_MASK=mask is not None, POOLED=pos is not None, ROUND=round_tf32,
                PRECISION=precision, PV16=pv16_for(o, precision) if pv16 is None else pv16,
                TIMED=0 if times is None or phase_by_phase else 2 if per_program else 1, num_warps=num_warps,
                DIRECT=streams is not None, PREFETCH=prefetch, BULK_PREFETCH=bulk, SUCC=successor is not None,
                PF_OLD=streams is not None and DIRECT_PREFETCH, ONE_LOOP=DIRECT_ONE_LOOP,
                ROW_COPY=ROW_COPY, ROW_LENGTHS=streams is not None and streams.row_lengths)
    if phase_by_phase:     # one launch per block and phase: the launch boundary is the barrier
        for b in range(first, first + n_blocks):
            for p in range(N_PHASES):
                k = _dit_block[(nprog,)](*args(b, 1), PHASE=p, **meta)
        return k
    return _dit_block[(nprog,)](*args(first, n_blocks), PHASE=-1, num_stages=BLOCK_STAGES, **meta)


def stack_weights(blocks: list[BlockWeights]) -> BlockWeights:
    """The blocks' weights as one BlockWeights of (depth, ...) tensors (copies), as ``dit_blocks`` reads them."""
    return BlockWeights(**{k: torch.stack([getattr(b, k).detach() for b in blocks]).contiguous()
                           for k in blocks[0].__dict__})
