"""One Euler step's estimator cache between the callers' caches and the solver's arena, through address tables.

A trimmed arena solve copies each stream's old [k|v] frames into the arena before its replay and the trimmed
successor out after it (``euler_graph``). Both copies need the callers' tensors, whose addresses change every
call, so they ran outside the graph, in series with it. Here they read and write through ``StreamKV`` tables
(device memory the solve uploads), so the graph can hold them, one Euler step at a time: step s's old frames
are needed only by step s, and step s's successor is final once step s has run, so on a second stream the
copies of the other steps run beside the persistent block kernel, which holds one program per SM and leaves
most of each SM's registers free.

``fill_step``: arena[s, :, r, :, f0 + f] = row r's old frame f (its SRC table row) for f < n_old.
``trim_step``: row r's successor frame (DST table row) = arena[s, :, r, :, f] for f < frames, the span
``drop`` left out and the frames after it moved down (``tiled_attention._kept_frames``).
Padding rows (a table row not present) are neither read nor written.
"""

from __future__ import annotations

import torch

from . import AVAILABLE

# Programs of a copy launch: few, each looping over its units, so the copies never queue enough programs to
# delay the block kernel's (which must all be resident for its barriers) and use a small share of each SM.
PROGRAMS = 64
BLOCK_F = 16        # frames per unit: 16 x 2D floats, 8 KB at D=64

if AVAILABLE:
    import triton
    import triton.language as tl

    from .tiled_attention import _kept_frames, stream_row

    @triton.jit
    def _cache_copy(ARENA, BASE, TABLE, step, a_step, a_layer, a_row, a_head, n_table, n_frames, f0, drop0, drop1,
                    R, DEPTH, H, HEAD_D: tl.constexpr, BLOCK_F: tl.constexpr, TO_ARENA: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        nfb = tl.cdiv(n_frames, BLOCK_F)
        offs_c = tl.arange(0, 2 * HEAD_D)
        for u in range(pid, R * DEPTH * H * nfb, nprog):
            fb = u % nfb
            rest = u // nfb
            h = rest % H
            rest = rest // H
            layer = rest % DEPTH
            r = rest // DEPTH
            arena = ARENA + (step * a_step + layer * a_layer + r.to(tl.int64) * a_row + h * a_head)
            row, present = stream_row(BASE, TABLE, r, h, step, layer, n_table, HEAD_D)
            offs_f = fb * BLOCK_F + tl.arange(0, BLOCK_F)
            w_hi = tl.where(present, n_frames, 0)       # a scalar bound, not a scalar-and-vector mask
            if TO_ARENA:
                ok = offs_f < w_hi
                x = tl.load(row + offs_f.to(tl.int64)[:, None] * (2 * HEAD_D) + offs_c[None, :], mask=ok[:, None])
                tl.store(arena + (f0 + offs_f).to(tl.int64)[:, None] * (2 * HEAD_D) + offs_c[None, :], x,
                         mask=ok[:, None])
            else:
                ok, fo = _kept_frames(offs_f, w_hi, 0, drop0, drop1, HEAD_D)
                x = tl.load(arena + offs_f.to(tl.int64)[:, None] * (2 * HEAD_D) + offs_c[None, :], mask=ok[:, None])
                tl.store(row + fo[:, None] + offs_c[None, :], x, mask=ok[:, None])


def _launch(arena: torch.Tensor, streams, step: int, table: torch.Tensor, n_table: int, n_frames: int, f0: int,
            drop: tuple[int, int], to_arena: bool) -> None:
    if not AVAILABLE:
        raise RuntimeError("cache_copy needs Triton")
    S, depth, R, H, F, D2 = arena.shape
    if arena.dtype != torch.float32 or arena.stride(4) != D2 or arena.stride(5) != 1:
        raise ValueError(f"cache_copy: the arena must be FP32 with contiguous [k|v] frames, got {arena.dtype} "
                         f"strides {arena.stride()}")
    if table.shape != (R, 4) or not 0 <= step < S:
        raise ValueError(f"cache_copy: table {tuple(table.shape)} for {R} rows, step {step} of {S}")
    if f0 + (n_frames if to_arena else 0) > F or (not to_arena and n_frames > F):
        raise ValueError(f"cache_copy: {n_frames} frames from frame {f0} do not fit the arena's {F}")
    units = R * depth * H * triton.cdiv(n_frames, BLOCK_F)
    _cache_copy[(max(1, min(PROGRAMS, units)),)](
        arena, streams.base, table, step, *arena.stride()[:4], n_table, n_frames, f0, drop[0], drop[1],
        R, depth, H, HEAD_D=D2 // 2, BLOCK_F=BLOCK_F, TO_ARENA=to_arena, num_warps=4)


def fill_step(arena: torch.Tensor, streams, step: int, f0: int) -> None:
    """Arena (S, depth, R, H, F, 2D) step ``step``, frames [f0, f0 + streams.n_old): each present row's old frames,
    read through ``streams.src`` (``tiled_attention.StreamKV``)."""
    _launch(arena, streams, step, streams.src, streams.n_old, streams.n_old, f0, (0, 0), True)


def trim_step(arena: torch.Tensor, streams, step: int, frames: int) -> None:
    """Each present row's successor (``streams.dst``, ``streams.n_out`` frames) at step ``step``: the arena's
    frames [0, frames) less ``streams.drop``."""
    d0, d1 = streams.drop
    if frames - (d1 - d0) != streams.n_out:
        raise ValueError(f"cache_copy.trim_step: {frames} frames less the dropped [{d0}, {d1}) are not the "
                         f"successor's {streams.n_out}")
    _launch(arena, streams, step, streams.dst, streams.n_out, frames, 0, streams.drop, False)
