
import pytest
import torch

from minicpmo_rt.code2wav.kernels import AVAILABLE, usable_on
from minicpmo_rt.code2wav.kernels.tiled_attention import sdpa_attention, tiled_attention

from conftest import rel_err, requires_cuda

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs triton")


def reference(q, k, v, mask, kv_rows=None):
    """fp64 softmax attention; fully masked rows give 0."""
    q, k, v = q.double(), k.double(), v.double()
    if kv_rows is not None:
        k, v = k[kv_rows.long()], v[kv_rows.long()]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


def ragged_mask(B, nq, nk, gen):
    m = torch.rand(B, nq, nk, generator=gen) > 0.3
    m[0, 1] = False                         # a fully masked row
    m[-1, :, nk // 2:] = False              # a short (ragged) cache row
    return m


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("nq,nk", [(5, 13), (17, 40)])
def test_matches_fp64_ieee(use_mask, nq, nk, splits):
    gen = torch.Generator().manual_seed(nq * 100 + nk)
    B, H, D = 2, 2, 16
    q, k, v = (torch.randn(B, H, n, D, generator=gen) for n in (nq, nk, nk))
    mask = ragged_mask(B, nq, nk, gen) if use_mask else None
    dev = device()
    if not usable_on(q.to(dev)):
        pytest.skip("Triton cannot run here (set TRITON_INTERPRET=1 on CPU)")
    out = torch.full_like(q, float("nan")).to(dev)   # poisoned: every element must be written
    tiled_attention(q.to(dev), k.to(dev), v.to(dev), None if mask is None else mask.to(dev),
                    precision="ieee", out=out, block_m=16, block_n=16, splits=splits)
    ref = reference(q, k, v, mask)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5
    if mask is not None:
        assert out[0, :, 1].abs().max() == 0            # fully masked row gives exactly 0
        assert rel_err(sdpa_attention(q, k, v, mask), ref) < 1e-5


def test_packed_cache_views_kv_rows_and_strided_out():
    gen = torch.Generator().manual_seed(7)
    B, H, nq, nk, D = 3, 2, 6, 20, 16
    q = torch.randn(B, H, nq, D, generator=gen)
    cache = torch.randn(4, H, nk, 2 * D, generator=gen)       # [k|v] packed, 4 pooled rows
    k, v = cache[..., :D], cache[..., D:]
    kv_rows = torch.tensor([3, 0, 2], dtype=torch.int32)
    mask = ragged_mask(B, nq, nk, gen)
    dev = device()
    if not usable_on(q.to(dev)):
        pytest.skip("Triton cannot run here (set TRITON_INTERPRET=1 on CPU)")
    ref = reference(q, k, v, mask, kv_rows)
    cache = cache.to(dev)
    for splits, tma in ((1, False), (2, False), (1, True), (2, True)):
        # split keys: partials through contiguous scratch, output still strided; tma: K/V tiles through a
        # descriptor over the packed cache (nk=20 is not a multiple of the 16-key tile, so the last tile
        # reaches into the next head's frames, and past the end of the cache for the last one)
        out_bnhd = torch.full((B, nq, H, D), float("nan"), device=dev)
        tiled_attention(q.to(dev), cache[..., :D], cache[..., D:], mask.to(dev), kv_rows=kv_rows.to(dev),
                        precision="ieee", out=out_bnhd.transpose(1, 2), block_m=16, block_n=16, splits=splits,
                        tma=tma)
        assert rel_err(out_bnhd.transpose(1, 2), ref) < 1e-5, (splits, tma)
    with pytest.raises(ValueError, match="packed"):
        tiled_attention(q.to(dev), k.contiguous().to(dev), v.contiguous().to(dev), tma=True)
    assert rel_err(sdpa_attention(q, k, v, mask, kv_rows), ref) < 1e-5


@pytest.mark.parametrize("splits", [1, 2])
def test_key_only_mask_view_matches_materialised_mask(splits):
    """A mask whose query stride is 0 (one key row per batch row, as the slot pool passes it) read as one
    key vector per tile (key_mask=True) or as full tiles must give what the same mask materialised per
    query gives, including a row with every key masked and kv_rows (pooled caches)."""
    gen = torch.Generator().manual_seed(11)
    B, H, nq, nk, D = 3, 2, 7, 37, 16
    q = torch.randn(B, H, nq, D, generator=gen)
    cache = torch.randn(4, H, nk, 2 * D, generator=gen)
    kv_rows = torch.tensor([2, 0, 3], dtype=torch.int32)
    keys = torch.rand(B, nk, generator=gen) > 0.4
    keys[1] = False                                   # batch row 1 attends to nothing
    view = keys[:, None, :].expand(B, nq, nk)         # stride 0 over queries
    assert view.stride(1) == 0
    dev = device()
    if not usable_on(q.to(dev)):
        pytest.skip("Triton cannot run here (set TRITON_INTERPRET=1 on CPU)")
    ref = reference(q, cache[..., :D], cache[..., D:], view, kv_rows)
    cache = cache.to(dev)
    outs = [tiled_attention(q.to(dev), cache[..., :D], cache[..., D:], m.to(dev), kv_rows=kv_rows.to(dev),
                            precision="ieee", block_m=16, block_n=16, splits=splits, key_mask=km)
            for m, km in ((view, True), (view, False), (view.contiguous(), True))]
    for out in outs:
        assert rel_err(out, ref) < 1e-5
        assert out[1].abs().max() == 0
    assert rel_err(outs[0], outs[1]) < 1e-6 and rel_err(outs[0], outs[2]) < 1e-6


def test_split_keys_one_tile_per_split_and_a_split_past_the_end():
    """More splits than key tiles are clamped; a fully masked split contributes nothing."""
    gen = torch.Generator().manual_seed(3)
    B, H, nq, nk, D = 1, 2, 4, 33, 16
    q, k, v = (torch.randn(B, H, n, D, generator=gen) for n in (nq, nk, nk))
    mask = torch.ones(B, nq, nk, dtype=torch.bool)
    mask[:, :, :16] = False                  # the whole first split is masked
    dev = device()
    if not usable_on(q.to(dev)):
        pytest.skip("Triton cannot run here (set TRITON_INTERPRET=1 on CPU)")
    ref = reference(q, k, v, mask)
    for splits in (2, 3, 8):
        out = tiled_attention(q.to(dev), k.to(dev), v.to(dev), mask.to(dev), precision="ieee",
                              block_m=16, block_n=16, splits=splits)
        assert rel_err(out, ref) < 1e-5, splits
    with pytest.raises(ValueError, match="splits"):
        tiled_attention(q.to(dev), k.to(dev), v.to(dev), None, splits=0)


@requires_cuda
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("precision,tol", [("ieee", 1e-5), ("tf32", 2e-3)])
def test_cuda_model_shape(precision, tol, splits):
    """Pointer loads and TMA descriptor loads of the K/V tiles (the latter: Hopper)."""
    torch.manual_seed(0)
    B, H, nq, nk, D = 4, 8, 50, 450, 64
    q = torch.randn(B, H, nq, D, device="cuda")
    cache = torch.randn(B, H, nk, 2 * D, device="cuda")
    mask = torch.rand(B, nq, nk, device="cuda") > 0.1
    mask[1, 3] = False
    ref = reference(q.cpu(), cache[..., :D].cpu(), cache[..., D:].cpu(), mask.cpu())
    for tma in (False, True):
        out = tiled_attention(q, cache[..., :D], cache[..., D:], mask, precision=precision, splits=splits, tma=tma)
        err = rel_err(out, ref)
        print(f"tiled attention {precision}{' TMA' if tma else ''} splits={splits}: rel err {err:.2e}")
        assert err < tol
        assert out[1, :, 3].abs().max() == 0
    # a key-only mask (query stride 0) read as key vectors and as full tiles, and materialised; under
    # TF32 the compiled loops may round differently, so each goes against the reference
    keys = mask[:, 0]
    keys[2] = False
    view = keys[:, None, :].expand(B, nq, nk)
    ref = reference(q.cpu(), cache[..., :D].cpu(), cache[..., D:].cpu(), view.cpu())
    for tma in (False, True):
        for m, km in ((view, True), (view, False), (view.contiguous(), False)):
            out = tiled_attention(q, cache[..., :D], cache[..., D:], m, precision=precision, splits=splits, tma=tma,
                                  key_mask=km)
            assert rel_err(out, ref) < tol, (tma, km, m.stride())
            assert out[2].abs().max() == 0


@pytest.mark.parametrize("splits", [1, 3])
def test_fp16_operand_output_and_fp16_pv(splits):
    """An FP16 ``out`` (an FP16 GEMM operand, ``FusedDiT(gemm_operands="fp16")``) with P @ V in FP16
    (``pv16``, its default under TF32): p and v rounded to 10 mantissa bits and the output to FP16,
    TF32's precision, so the TF32 tolerance 1e-3 applies; a fully masked row still gives exact 0. The
    same P @ V into an FP32 output, and the FP32 path, agree within it."""
    from minicpmo_rt.code2wav.kernels.tiled_attention import pv16_for
    gen = torch.Generator().manual_seed(41)
    dev = device()
    B, H, nq, nk, D = 2, 2, 7, 150, 32
    q, k, v = (torch.randn(B, H, n, D, generator=gen).to(dev) for n in (nq, nk, nk))
    mask = ragged_mask(B, nq, nk, gen).to(dev)
    ref = reference(q, k, v, mask)
    out16 = torch.empty(B, H, nq, D, device=dev, dtype=torch.float16)
    assert pv16_for(out16, "tf32") and not pv16_for(out16, "ieee") and not pv16_for(q, "tf32")
    tiled_attention(q, k, v, mask, out=out16, splits=splits)
    err = rel_err(out16.float(), ref)
    assert 1e-6 < err <= 1e-3, err
    assert out16[0, :, 1].abs().max() == 0
    pv16 = tiled_attention(q, k, v, mask, splits=splits, pv16=True)
    assert rel_err(pv16, ref) <= 1e-3
    assert rel_err(pv16, tiled_attention(q, k, v, mask, splits=splits)) <= 1e-3      # the FP32 path
    with pytest.raises(TypeError, match="float32 or float16"):
        tiled_attention(q, k, v, mask, out=torch.empty(B, H, nq, D, device=dev, dtype=torch.bfloat16))


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("T", [5, 20])
@pytest.mark.parametrize("splits", [1, 3])
def test_direct_attention_reads_own_caches_and_writes_the_trimmed_successor(splits, T, tma, aligned, monkeypatch):
    """``direct_attention`` (the fill-free path): each row's old frames from its own tensor through the
    stream tables, at (step 1, layer 1) of (2, 2, ...) caches; the output matches FP64 attention over
    [current | old], and each written row's successor is [current | old] less the dropped frames,
    bit for bit. Row 2 is a padding row (not present): its successor stays untouched. 16-key tiles,
    so tiles straddle both the current/old boundary and, with splits, the split edges; T=20 makes two
    16-query blocks, which take turns writing the tiles they both read. ``tma``: the tiles through
    descriptors the kernel builds (frames past a source's end read as zeros, then masked), and the successor
    written as whole rows read again (``SUCCESSOR_ROW_COPY``; without TMA: stored from the tiles' registers).
    ``aligned``: the key splits count the current frames as whole tiles (the default) or as they are. Without
    TMA, ``one_loop=True`` (one loop over both sources' tiles) must give the same bits."""
    from minicpmo_rt.code2wav.kernels import tiled_attention as ta
    from minicpmo_rt.code2wav.kernels.tiled_attention import StreamKV, device_tma, direct_attention, stream_table

    monkeypatch.setattr(ta, "DIRECT_ALIGNED_SPLITS", aligned)
    monkeypatch.setattr(ta, "SUCCESSOR_ROW_COPY", tma)

    gen = torch.Generator().manual_seed(11)
    R, H, D, n_old, S, depth = 3, 2, 16, 37, 2, 2
    dev = device()
    q = torch.randn(R, H, T, D, generator=gen).to(dev)
    if not usable_on(q):
        pytest.skip("Triton cannot run here (set TRITON_INTERPRET=1 on CPU)")
    if tma and not device_tma(q.device):
        pytest.skip("this device cannot build TMA descriptors in a kernel")
    cur = torch.randn(R, H, T, 2 * D, generator=gen).to(dev)
    # two streams' caches (steps, depth, [cond|uncond], H, frames, 2D); rows 0/1 = stream 0 cond / stream 1 uncond
    olds = [torch.randn(S, depth, 2, H, n_old, 2 * D, generator=gen).to(dev) for _ in range(2)]
    drop = (12, 12 + 20)                                   # keep 12 + the last T + 17 frames
    n_out = T + n_old - 20
    outs = [torch.full((S, depth, 2, H, n_out, 2 * D), float("nan"), device=dev) for _ in range(2)]
    base = outs[1]          # any aligned FP32 tensor: the tables hold element offsets from it
    src = stream_table([olds[0][:, :, 0], olds[1][:, :, 1], olds[0][:, :, 0]], base, current=[T] * R).to(dev)
    dst = stream_table([outs[0][:, :, 0], outs[1][:, :, 1], None], base).to(dev)
    # (tensor, batch row) pairs, as a solve passes them, read the same rows off pointer and strides
    assert torch.equal(stream_table([(olds[0], 0), (olds[1], 1), (olds[0], 0)], base, [T] * R), src.cpu())
    with pytest.raises(ValueError, match="batch row"):
        stream_table([(olds[0], 2)], base)
    streams = StreamKV(base, src, dst, n_old, n_out, drop).at_step(1)
    o = torch.full((R, T, H, D), float("nan"), device=dev)
    direct_attention(q, cur, streams, layer=1, out=o.transpose(1, 2), precision="ieee", block_m=16, block_n=16,
                     splits=splits, tma=tma)
    rows_old = torch.stack([olds[0][1, 1, 0], olds[1][1, 1, 1], olds[0][1, 1, 0]])      # (R, H, n_old, 2D)
    full = torch.cat([cur, rows_old], 2)
    ref = reference(q.cpu(), full[..., :D].cpu(), full[..., D:].cpu(), None)
    assert rel_err(o.transpose(1, 2).cpu(), ref) < 1e-5
    want = torch.cat([full[:, :, :drop[0]], full[:, :, drop[1]:]], 2)
    assert torch.equal(outs[0][1, 1, 0], want[0]) and torch.equal(outs[1][1, 1, 1], want[1])
    assert torch.isnan(outs[0][1, 1, 1]).all() and torch.isnan(outs[0][0]).all()     # other rows / steps untouched
    if not tma:     # ``one_loop``: both sources' tiles in one loop, in the same order: the same bits everywhere
        written = [x.clone() for x in outs]
        for x in outs:
            x.fill_(float("nan"))
        o1 = torch.full_like(o, float("nan"))
        direct_attention(q, cur, streams, layer=1, out=o1.transpose(1, 2), precision="ieee", block_m=16, block_n=16,
                         splits=splits, one_loop=True)
        assert torch.equal(o1, o)
        assert all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(outs, written))
    with pytest.raises(ValueError, match="pointer loads"):
        direct_attention(q, cur, streams, 1, o.transpose(1, 2), tma=True, one_loop=True)
    with pytest.raises(ValueError, match="dropped"):
        direct_attention(q, cur, StreamKV(base, src, dst, n_old, n_out + 1, drop), 1, o.transpose(1, 2))
    with pytest.raises(ValueError, match="aligned"):       # 4 elements (16 bytes) off the 64-byte grid
        stream_table([olds[0].view(-1)[4:4 + olds[0].numel() // 2].view(S, depth, 1, H, n_old, 2 * D)[:, :, 0]],
                     base)


@pytest.mark.parametrize("splits", [1, 3])
def test_direct_attention_narrow_rows_attend_only_their_own_frames(splits):
    """A row whose source-table entry counts fewer current frames than the chunk's T (a stream's final chunk
    solved among full-width rows) attends [its first w current frames | its old frames]: the frames past w
    (padding, here NaN-free garbage) never reach its output, and it writes no successor (not present). Full-width
    rows in the same launch are unchanged, bit for bit, against a launch without narrow rows. 16-key tiles: w
    = 3 ends inside the first tile, w = 17 one frame into the second."""
    from minicpmo_rt.code2wav.kernels.tiled_attention import StreamKV, direct_attention, stream_table

    gen = torch.Generator().manual_seed(12)
    R, H, D, T, n_old = 4, 2, 16, 20, 37
    dev = device()
    q = torch.randn(R, H, T, D, generator=gen).to(dev)
    if not usable_on(q):
        pytest.skip("Triton cannot run here (set TRITON_INTERPRET=1 on CPU)")
    cur = torch.randn(R, H, T, 2 * D, generator=gen).to(dev)
    old = torch.randn(R, 1, 1, H, n_old, 2 * D, generator=gen).to(dev)
    widths = [T, 3, 17, T]
    outs = torch.full((R, 1, 1, H, T + n_old, 2 * D), float("nan"), device=dev)

    def run(current, present):
        src = stream_table(list(old[:, :, :]), outs, current=current).to(dev)
        dst = stream_table([outs[r] if present[r] else None for r in range(R)], outs).to(dev)
        o = torch.full((R, T, H, D), float("nan"), device=dev)
        direct_attention(q, cur, StreamKV(outs, src, dst, n_old, T + n_old, (T + n_old, T + n_old)), 0,
                         o.transpose(1, 2), precision="ieee", block_m=16, block_n=16, splits=splits)
        return o.transpose(1, 2).cpu()

    full = run([T] * R, [True] * R)
    outs.fill_(float("nan"))
    o = run(widths, [w == T for w in widths])
    for r, w in enumerate(widths):
        keys = torch.cat([cur[r, :, :w], old[r, 0, 0]], 1).cpu()
        ref = reference(q[r:r + 1].cpu(), keys[None, ..., :D], keys[None, ..., D:], None)[0]
        assert rel_err(o[r], ref) < 1e-5, r
        if w == T:
            assert torch.equal(o[r], full[r])
            assert not torch.isnan(outs[r]).any()
        else:
            assert torch.isnan(outs[r]).all()       # a narrow row's successor is never written
    with pytest.raises(ValueError, match="at least one"):
        stream_table(list(old[:, :, :]), outs, current=[T, 0, T, T])
    with pytest.raises(ValueError, match="counts for"):
        stream_table(list(old[:, :, :]), outs, current=[T])


@pytest.mark.parametrize("splits", [1, 3])
def test_direct_attention_rows_of_their_own_cache_lengths(splits):
    """``StreamKV(row_lengths=True)``: rows whose old caches differ in length (a stream's first and second
    chunks, prompt and prompt + 50 frames, solved among steady ones at prompt + 100) each attend [current |
    their own old frames] and write their own successor, trimmed by their own span (the longest row
    dropping frames, the shorter ones none), all read from the tables. The key splits are sized for the
    longest row, so with 3 splits a short row leaves its last split empty. 16-key tiles, IEEE dots; the
    padding row (3) reads row 0's cache and writes nothing."""
    from minicpmo_rt.code2wav.kernels.tiled_attention import StreamKV, direct_attention, stream_table

    gen = torch.Generator().manual_seed(13)
    R, H, D, T = 4, 2, 16, 20
    p, keep = 24, 2 * T           # the flow's proportions: 50-frame chunks, 100 frames kept
    lengths = [p + keep, p, p + T, p + keep]       # steady (longest), first, second chunk; padding
    dev = device()
    q = torch.randn(R, H, T, D, generator=gen).to(dev)
    if not usable_on(q):
        pytest.skip("Triton cannot run here (set TRITON_INTERPRET=1 on CPU)")
    cur = torch.randn(R, H, T, 2 * D, generator=gen).to(dev)
    olds = [torch.randn(1, 1, 1, H, n, 2 * D, generator=gen).to(dev) for n in lengths[:3]]

    def span(n):        # the flow's trim of a [current | old] cache of T + n frames (euler_graph.trim_span)
        return (T + n, T + n) if T + n <= p + keep else (p, T + n - keep)

    spans = [span(n) for n in lengths[:3]]
    outs = [torch.full((1, 1, 1, H, T + n - (d1 - d0), 2 * D), float("nan"), device=dev)
            for n, (d0, d1) in zip(lengths, spans)]
    assert spans[0] != (T + lengths[0],) * 2 and spans[1] == (T + p,) * 2       # only the longest row drops
    base = outs[0]
    src = stream_table([o[:, :, 0] for o in olds] + [olds[0][:, :, 0]], base, current=[T] * R).to(dev)
    dst = stream_table([o[:, :, 0] for o in outs] + [None], base, drops=spans + [(0, 0)]).to(dev)
    assert src[:, 4].tolist() == lengths and dst[:3, 4].tolist() == [o.shape[4] for o in outs]
    n_old = max(lengths)
    streams = StreamKV(base, src, dst, n_old, outs[0].shape[4], spans[0], row_lengths=True)
    o = torch.full((R, T, H, D), float("nan"), device=dev)
    direct_attention(q, cur, streams, 0, o.transpose(1, 2), precision="ieee", block_m=16, block_n=16,
                     splits=splits)
    for r in range(R):
        old = olds[min(r, 3) if r < 3 else 0][0, 0, 0]
        full = torch.cat([cur[r], old], 1).cpu()
        ref = reference(q[r:r + 1].cpu(), full[None, ..., :D], full[None, ..., D:], None)[0]
        assert rel_err(o.transpose(1, 2)[r].cpu(), ref) < 1e-5, r
        if r < 3:
            d0, d1 = spans[r]
            assert torch.equal(outs[r][0, 0, 0].cpu(), torch.cat([full[:, :d0], full[:, d1:]], 1)), r
    with pytest.raises(ValueError, match="spans for"):
        stream_table([o[:, :, 0] for o in outs], base, drops=spans[:1])


@pytest.mark.parametrize("row_lengths", [False, True])
@pytest.mark.parametrize("one_loop,row_copy", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("splits", [1, 3])
def test_direct_attention_reads_a_shared_tail(splits, one_loop, row_copy, row_lengths, monkeypatch):
    """``StreamKV.tail``: each row's last old frames (here 10 of 37, or of 27 for a shorter row with
    ``row_lengths``) are read from a (steps, depth, [cond|uncond], H, P, 2D) prompt cache that ends with them,
    shared by the rows of one voice. The rows' own copies of those frames are NaN, so any read of them would
    show; the output and every successor (whose last frames are written from the shared copy) must equal,
    bit for bit, a launch without the tail over the rows' clean caches. 16-key tiles: the tail starts
    inside a tile (frame 27 of old frames 16-31), so a tile takes keys from both places. Row 2 shares nothing
    (its own clean cache); row 3 is padding. ``row_copy``: the successor written as rows read again
    (``SUCCESSOR_ROW_COPY``), which must read the tail's frames where the dots did. With ``held`` counts in the
    destination table (a reused successor that holds the tail already), those last frames are left as they
    are (a sentinel there survives) and every other frame is written as before."""
    from minicpmo_rt.code2wav.kernels import tiled_attention as ta
    from minicpmo_rt.code2wav.kernels.tiled_attention import (NO_TAIL, StreamKV, direct_attention, stream_table,
                                                              tail_table)

    monkeypatch.setattr(ta, "SUCCESSOR_ROW_COPY", row_copy)
    gen = torch.Generator().manual_seed(14)
    R, H, D, T, S, depth, P, shared = 4, 2, 16, 20, 2, 2, 24, 10
    lengths = [37, 27 if row_lengths else 37, 37, 37]
    dev = device()
    q = torch.randn(R, H, T, D, generator=gen).to(dev)
    if not usable_on(q):
        pytest.skip("Triton cannot run here (set TRITON_INTERPRET=1 on CPU)")
    cur = torch.randn(R, H, T, 2 * D, generator=gen).to(dev)
    prompt = torch.randn(S, depth, 2, H, P, 2 * D, generator=gen).to(dev)
    halves = [0, 1, 0]       # rows 0 / 1: a stream's cond / another's uncond half; row 2 shares nothing
    clean = []
    for r, n in enumerate(lengths[:3]):
        c = torch.randn(S, depth, 1, H, n, 2 * D, generator=gen).to(dev)
        c[..., n - shared:, :] = prompt[:, :, halves[r]:halves[r] + 1, :, P - shared:]
        clean.append(c)
    poisoned = [c.clone() for c in clean]
    for c in poisoned[:2]:
        c[..., c.shape[4] - shared:, :] = float("nan")
    drop = (5, 5 + T)           # every row drops as many frames, so its successor holds T + n - T frames
    outs = [torch.full((S, depth, 1, H, n, 2 * D), float("nan"), device=dev) for n in lengths[:3]]
    base = outs[0]
    drops = [drop] * 3 + [(0, 0)]

    def run(caches, tail, held=None):
        for x in outs:
            x.fill_(float("nan"))
            if held:
                x[..., x.shape[4] - shared:, :] = 7.0
        src = stream_table([(c, 0) for c in caches] + [(caches[0], 0)], base, current=[T] * R).to(dev)
        dst = stream_table([(x, 0) for x in outs] + [None], base, drops=drops if row_lengths else None,
                           held=held).to(dev)
        kv = StreamKV(base, src, dst, max(lengths), T + 37 - T, drop, row_lengths=row_lengths, tail=tail).at_step(1)
        o = torch.full((R, T, H, D), float("nan"), device=dev)
        direct_attention(q, cur, kv, 1, o.transpose(1, 2), precision="ieee", block_m=16, block_n=16,
                         splits=splits, one_loop=one_loop)
        return o, [x.clone() for x in outs]

    o_ref, succ_ref = run(clean, None)
    starts = [n - shared for n in lengths[:2]] + [0, lengths[0] - shared]     # the padding row reads row 0's
    tails = tail_table([(prompt, 0), (prompt, 1), None, (prompt, 0)], base, starts, shared).to(dev)
    assert tails[2, 3] == NO_TAIL
    o, succ = run(poisoned, tails)
    assert not torch.isnan(o).any()
    assert torch.equal(o, o_ref)
    assert all(torch.equal(a[1, 1], b[1, 1]) for a, b in zip(succ, succ_ref))      # (step 1, layer 1) written
    assert not any(torch.isnan(a[1, 1]).any() for a in succ)
    assert all(torch.isnan(a[0]).all() for a in succ)
    o_held, succ_held = run(poisoned, tails, held=[shared, shared, 0, 0])
    assert torch.equal(o_held, o_ref)
    for r, (a, b) in enumerate(zip(succ_held, succ_ref)):
        n = a.shape[4]
        assert torch.equal(a[1, 1, ..., :n - shared, :], b[1, 1, ..., :n - shared, :]), r
        if r < 2:       # held: the sentinel is still there
            assert (a[1, 1, ..., n - shared:, :] == 7.0).all(), r
        else:
            assert torch.equal(a[1, 1], b[1, 1]), r
    with pytest.raises(ValueError, match="holds 38 of its 37"):
        stream_table([(outs[0], 0)], base, held=[38])
    full = torch.cat([cur[0], clean[0][1, 1, 0]], 1).cpu()
    ref = reference(q[:1].cpu(), full[None, ..., :D], full[None, ..., D:], None)[0]
    assert rel_err(o.transpose(1, 2)[0].cpu(), ref) < 1e-5
    with pytest.raises(ValueError, match="pointer loads"):
        direct_attention(q, cur, StreamKV(base, tails, tails, 37, 37, drop, tail=tails), 0, o.transpose(1, 2),
                         tma=True)
    with pytest.raises(ValueError, match="last 30 of 24"):
        tail_table([(prompt, 0)], base, [0], 30)
    with pytest.raises(ValueError, match="batch row"):
        tail_table([(prompt, 2)], base, [0], shared)
    with pytest.raises(ValueError, match="starts for"):
        tail_table([(prompt, 0)], base, [0, 1], shared)


def test_direct_key_splits_start_every_split_on_a_key_tile_of_its_source():
    """Batch 4's direct attention (2 splits, 64-key tiles, 50 current + 400 old frames): counting the current
    frames as one whole tile, split 0 walks 1 current + 3 old tiles and split 1 the old frames from 192 (4
    tiles); split evenly over 450 keys, split 1 would start at old frame 206 and split 0 walk 1 + 4 tiles."""
    from minicpmo_rt.code2wav.kernels.tiled_attention import direct_key_splits

    def tiles(nq, n_old, splits, bn, aligned):
        s, per, cur = direct_key_splits(nq, n_old, splits, bn, aligned)
        walks = []
        for j in range(s):      # the loops of direct_tile: current keys, then old ones, in split coordinates
            lo, hi = j * per, min(j * per + per, cur + n_old)
            walks.append(len(range(lo, min(hi, nq), bn)) + len(range(max(lo, cur) - cur, hi - cur, bn)))
        return (s, per, cur), walks

    assert tiles(50, 400, 2, 64, True) == ((2, 256, 64), [4, 4])
    assert tiles(50, 400, 2, 64, False) == ((2, 256, 50), [5, 4])
    assert tiles(50, 400, 1, 64, True) == ((1, 512, 64), [8])       # a full grid: one split either way
    assert tiles(64, 400, 2, 64, True) == tiles(64, 400, 2, 64, False)     # whole tiles already


def test_direct_attention_refuses_tma_where_the_device_cannot(monkeypatch):
    """``tma=True`` on a device without in-kernel TMA descriptors (pre-Hopper CUDA, an old Triton) is
    refused by name before any launch, and says how to proceed."""
    from minicpmo_rt.code2wav.kernels import tiled_attention as ta

    monkeypatch.setattr(ta, "device_tma", lambda device: False)
    R, H, T, D = 1, 1, 4, 16
    q = torch.zeros(R, H, T, D)
    tables = torch.zeros(R, ta.TABLE_WIDTH, dtype=torch.int64)
    streams = ta.StreamKV(q, tables, tables, 0, T, (T, T))
    with pytest.raises(ValueError, match="cannot build TMA descriptors.*tma=False"):
        ta.direct_attention(q, torch.zeros(R, H, T, 2 * D), streams, 0, torch.zeros(R, H, T, D), tma=True)


def test_descriptor_scratch_restores_the_previous_allocator():
    """Triton's allocator is set only for a direct launch with in-kernel descriptors: the one in place
    before comes back afterwards, also when the launch raises."""
    from minicpmo_rt.code2wav.kernels import tiled_attention as ta

    slot = ta._allocator_slot()
    if slot is None:
        pytest.skip("this Triton has no allocator slot")
    before = slot.get()
    with ta.descriptor_scratch(torch.device("cpu")):
        buf = slot.get()(64, 16, None)
        assert slot.get() is not before and buf.numel() == 64 and buf.device.type == "cpu"
    assert slot.get() is before
    with pytest.raises(RuntimeError, match="boom"):
        with ta.descriptor_scratch(torch.device("cpu")):
            raise RuntimeError("boom")
    assert slot.get() is before


@pytest.mark.parametrize("direct", [False, True])
def test_last_split_combines_in_the_same_launch(direct):
    """With ``counters`` the split of each query block that finishes last combines the partials (no second
    kernel): the output is the combine kernel's bit for bit, the counters are back to zero after the launch
    (so a second launch reuses them: run twice), and a counter buffer that cannot count every query block
    is refused."""
    from minicpmo_rt.code2wav.kernels.tiled_attention import StreamKV, direct_attention, stream_table

    gen = torch.Generator().manual_seed(5)
    R, H, T, D, nk = 2, 2, 20, 16, 70      # 5 key tiles: 3 splits
    dev = device()
    q = torch.randn(R, H, T, D, generator=gen).to(dev)
    if not usable_on(q):
        pytest.skip("Triton cannot run here (set TRITON_INTERPRET=1 on CPU)")
    mblocks = -(-T // 16)
    if direct:
        cur = torch.randn(R, H, T, 2 * D, generator=gen).to(dev)
        old = torch.randn(R, H, nk - T, 2 * D, generator=gen).to(dev)
        outs = torch.zeros(R, H, nk, 2 * D, device=dev)
        streams = StreamKV(outs, stream_table(list(old[:, None, None]), outs, current=[T] * R).to(dev),
                           stream_table(list(outs[:, None, None]), outs).to(dev), nk - T, nk, (0, 0))

        def run(counters):
            return direct_attention(q, cur, streams, 0, torch.empty_like(q), precision="ieee", block_m=16,
                                    block_n=16, splits=3, counters=counters)
    else:
        k, v = (torch.randn(R, H, nk, D, generator=gen).to(dev) for _ in range(2))
        mask = ragged_mask(R, T, nk, gen).to(dev)

        def run(counters):
            return tiled_attention(q, k, v, mask, precision="ieee", block_m=16, block_n=16, splits=3,
                                   counters=counters)
    want = run(None)
    ctr = torch.zeros(R * H * mblocks, device=dev, dtype=torch.int32)
    for _ in range(2):
        assert torch.equal(run(ctr), want)
        assert int(ctr.abs().sum()) == 0
    with pytest.raises(ValueError, match="counters must be a contiguous int32"):
        run(ctr[1:])
    with pytest.raises(ValueError, match="counters must be a contiguous int32"):
        run(ctr.long())
