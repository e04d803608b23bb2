"""bulk_copy: strided copies through 16-byte element views must move the same bits as torch's
copy_/cat/clone, take the wide path exactly where both layouts allow it, and fall back otherwise."""

from __future__ import annotations

import pytest
import torch

from minicpmo_rt.code2wav import bulk_copy


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.element_size() == 4 else t.contiguous()


def test_arena_slot_copy_is_wide_and_bit_exact():
    # the solver's fill: a cache behind the current-chunk slot of every (step, block, row, head)
    arena = torch.zeros(2, 3, 4, 2, 7 + 5, 16)
    src = torch.randn(2, 3, 4, 2, 5, 16)
    src.view(-1)[::7] = float("nan")          # payload bits travel unchanged
    dst = arena[..., 7:, :]
    assert bulk_copy._as_wide(dst) is not None and bulk_copy._as_wide(src) is not None
    assert bulk_copy.copy_(dst, src) is dst
    assert torch.equal(_bits(dst), _bits(src))
    assert torch.count_nonzero(arena[..., :7, :]) == 0       # the current-chunk slot is untouched


@pytest.mark.parametrize("case", ["odd_last_axis", "misaligned_start", "strided_last_axis", "odd_outer_stride"])
def test_layouts_that_cannot_go_wide_fall_back(case):
    base = torch.randn(6, 40)
    t = {"odd_last_axis": base[:, :6],              # 24 bytes per row
         "misaligned_start": base[:, 1:9],           # starts 4 bytes in
         "strided_last_axis": base[:, ::2],
         "odd_outer_stride": torch.randn(6, 41)[:, :8]}[case]
    assert bulk_copy._as_wide(t) is None
    out = torch.empty(t.shape)
    bulk_copy.copy_(out, t)
    assert torch.equal(out, t)


def test_copy_converts_and_broadcasts_like_torch():
    dst = torch.zeros(3, 8, dtype=torch.float64)
    bulk_copy.copy_(dst, torch.arange(8, dtype=torch.float32))     # other dtype, broadcast row
    assert torch.equal(dst, torch.arange(8, dtype=torch.float64).expand(3, 8))
    with pytest.raises(RuntimeError):
        bulk_copy.copy_(torch.zeros(3, 8), torch.zeros(3, 5))


def test_other_dtypes_move_whole_16_byte_groups():
    for dtype in (torch.float16, torch.int64, torch.uint8, torch.bool):
        src = (torch.randn(5, 3, 32) * 50).to(dtype)
        dst = torch.zeros(5, 4, 32, dtype=dtype)[:, 1:]
        assert bulk_copy._as_wide(dst) is not None
        bulk_copy.copy_(dst, src)
        assert torch.equal(dst, src), dtype


@pytest.mark.parametrize("dim", [0, 2, 4, -1])
def test_cat_matches_torch_cat_on_strided_views(dim):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 2, 6, 2, 20, 8, generator=g)
    # cache halves (rows) for the row axis; equal-shaped frame ranges of different rows otherwise
    parts = [a[:, :, :2], a[:, :, 4:]] if dim == 2 else [a[:, :, :2, :, :5], a[:, :, 4:, :, 5:10]]
    want = torch.cat(parts, dim)
    got = bulk_copy.cat(parts, dim)
    assert got.is_contiguous() and torch.equal(got, want)


def test_cat_of_mismatched_parts_reports_like_torch():
    with pytest.raises(RuntimeError):
        bulk_copy.cat([torch.zeros(2, 3), torch.zeros(2, 4)], 0)
    mixed = bulk_copy.cat([torch.zeros(2, 4), torch.ones(1, 4, dtype=torch.float64)], 0)   # torch promotes
    assert mixed.dtype == torch.float64 and torch.equal(mixed[2], torch.ones(4, dtype=torch.float64))


def test_clone_is_contiguous_own_memory():
    a = torch.randn(4, 10, 8)
    v = a[:, 2:7]
    c = bulk_copy.clone(v)
    assert c.is_contiguous() and torch.equal(c, v) and c.data_ptr() != v.data_ptr()
    a.zero_()
    assert torch.count_nonzero(c) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_arena_fill_halves_and_trim_are_bit_exact():
    """The solver's fill on the device (both CFG halves into a padded batch bucket) and the flow's
    trim of the result, against torch's copies."""
    from minicpmo_rt.code2wav.euler_graph import _copy_rows
    from minicpmo_rt.code2wav.flow import trim_estimator_att
    g = torch.Generator(device="cuda").manual_seed(0)
    S, depth, H, Q, L, D2, B, Bb = 2, 3, 4, 50, 400, 128, 3, 4
    src = torch.randn(S, depth, 2 * B, H, L, D2, device="cuda", generator=g)
    arena = torch.zeros(S, depth, 2 * Bb, H, Q + L, D2, device="cuda")
    _copy_rows(arena[..., Q:, :], src, B, Bb)
    assert torch.equal(arena[:, :, :B, :, Q:], src[:, :, :B]) and torch.equal(arena[:, :, Bb:Bb + B, :, Q:], src[:, :, B:])
    assert torch.count_nonzero(arena[:, :, B:Bb]) == 0 and torch.count_nonzero(arena[..., :Q, :]) == 0
    view = arena[..., :Q + L, :]
    want = torch.cat([view[..., :300, :], view[..., -100:, :]], 4)
    assert torch.equal(trim_estimator_att(view, 300), want)
