"""Batched audio steps of forked units (``audio_graph.embed_forks_eager`` / ``AudioGraphs.embed_forks``)
against one streaming step per unit (``Thinker.embed_audio_chunk``, the reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minicpmo_rt.thinker import kernels
from minicpmo_rt.thinker.audio_graph import AudioGraphs, embed_forks_eager
from minicpmo_rt.thinker.mel import StreamingMel

from conftest import behind_queued_work, make_tiny_thinker, rel_err, requires_cuda


def _audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(round(seconds * 16000))
    t = np.arange(n) / 16000
    return (0.3 * np.sin(2 * np.pi * 180 * t) + 0.05 * rng.standard_normal(n)).astype(np.float32)


def _state_and_units(thinker, seconds: int, tails=(3200, 6400, 9600, 12800), whole=True, device=None):
    """The audio cache after ``seconds`` committed chunks, and the mel chunks of the next
    second's tails (last-chunk mode) and, with ``whole``, of the full next chunk."""
    audio = _audio(seconds + 1.2, 3)
    mel = StreamingMel(device=device)
    cache = None
    pending = np.zeros(int(1035 * 16) - 16000, np.float32)  # upstream's first-chunk left pad
    pos = 0
    for _ in range(seconds):
        need = mel.chunk_size()
        buf = np.concatenate([pending, audio[pos:pos + 16000]])
        pos += 16000
        c = mel.process(buf[:need])
        pending = buf[need:]
        cache = thinker.embed_audio_chunk(c.features, cache, c.prefix_extra, c.suffix_extra).cache
    snap = mel.snapshot()
    units = []
    for n in tails:
        units.append(mel.process(np.concatenate([pending, audio[pos:pos + n]]), last_chunk=True))
        mel.restore(snap)
    if whole:
        buf = np.concatenate([pending, audio[pos:pos + 16000]])
        units.append(mel.process(buf[:mel.chunk_size()]))
        mel.restore(snap)
    return cache, units


@pytest.mark.parametrize("split", [False, True], ids=["sdpa", "split-attention"])
@pytest.mark.parametrize("seconds", [0, 2])
def test_eager_batch_equals_one_step_per_unit(seconds, split):
    """Tails of four lengths plus a whole chunk (its own suffix trim), on no cache and on a
    2-s cache: every unit's embeddings as its own step's (fp32: 1e-5); also with the split-key
    Triton attention of the CUDA graphs (per-row key ends; here in Triton's interpreter)."""
    if split and not kernels.usable_on(torch.zeros(1)):
        pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 (scripts/test.sh sets it)")
    th = make_tiny_thinker(seed=5)
    cache, units = _state_and_units(th, seconds)
    assert len({u.prefix_extra for u in units}) == 1 and len({u.suffix_extra for u in units}) > 1
    got = embed_forks_eager(th, [u.features for u in units], cache, units[0].prefix_extra,
                            [u.suffix_extra for u in units], split_attention=split)
    for u, g in zip(units, got):
        ref = th.embed_audio_chunk(u.features, cache, u.prefix_extra, u.suffix_extra).embeds
        assert g.shape == ref.shape and rel_err(g, ref) <= 1e-5


def test_a_unit_is_independent_of_the_other_units_of_its_batch():
    """Changing one unit's mel changes no other unit's embeddings (bit for bit): the padded
    frames and the other rows' new keys are masked out."""
    th = make_tiny_thinker(seed=6)
    cache, units = _state_and_units(th, 1, whole=False)
    mels = [u.features for u in units]
    args = (cache, units[0].prefix_extra, [u.suffix_extra for u in units])
    a = embed_forks_eager(th, mels, *args)
    b = embed_forks_eager(th, mels[:3] + [mels[3] + 0.5], *args)
    assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3])) and not torch.equal(a[3], b[3])


def test_ineligible_batches_are_refused():
    """A single unit, or a unit whose step would reset the cache, is not batched (None: the
    session then runs one step each)."""
    th = make_tiny_thinker(seed=7)
    cache, units = _state_and_units(th, 1, whole=False)
    g = AudioGraphs(th)
    mels = [u.features for u in units]
    assert g.embed_forks(mels[:1], cache, units[0].prefix_extra, [0]) is None
    real = th.apm.max_source_positions
    th.apm.max_source_positions = cache.length + 10  # any chunk would now reset the cache
    try:
        assert g.embed_forks(mels, cache, units[0].prefix_extra, [u.suffix_extra for u in units]) is None
    finally:
        th.apm.max_source_positions = real
    assert g.embed_forks(mels, cache, units[0].prefix_extra, [u.suffix_extra for u in units]) is not None


@requires_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cuda_graphed_forks_equal_one_step_per_unit(dtype, tol):
    """The graphed batch (cache copied into a fixed per-batch buffer, row masks) vs one eager
    step per unit; a second call with another cache length replays the same graph."""
    th = make_tiny_thinker(seed=8).to(device="cuda", dtype=dtype)
    th.rebuild_buffers()
    g = AudioGraphs(th)
    for seconds in (1, 3):
        cache, units = _state_and_units(th, seconds, device="cuda")
        got = g.embed_forks([u.features for u in units], cache, units[0].prefix_extra,
                            [u.suffix_extra for u in units])
        assert got is not None
        for u, x in zip(units, got):
            ref = th.embed_audio_chunk(u.features, cache, u.prefix_extra, u.suffix_extra).embeds
            assert x.shape == ref.shape and rel_err(x.float(), ref.float()) <= tol
    assert len(g._fork_graphs) == 1 and not g.failures


@requires_cuda
def test_cuda_graphed_forks_never_wait_for_queued_work():
    """With ~1 s of device work queued ahead, ``embed_forks`` replays without waiting for it: each fork's mask end
    goes up pinned (a copy from pageable memory syncs the stream first, as it did until session 51)."""
    th = make_tiny_thinker(seed=8).to(device="cuda", dtype=torch.float32)
    th.rebuild_buffers()
    g = AudioGraphs(th)
    cache, units = _state_and_units(th, 2, device="cuda")
    args = ([u.features for u in units], cache, units[0].prefix_extra, [u.suffix_extra for u in units])
    g.embed_forks(*args)       # captures: not timed
    got, host_s = behind_queued_work(lambda: g.embed_forks(*args))
    assert host_s < 0.2, f"embed_forks waited {host_s:.3f} s for the queued work"
    for u, x in zip(units, got):
        ref = th.embed_audio_chunk(u.features, cache, u.prefix_extra, u.suffix_extra).embeds
        assert x.shape == ref.shape and rel_err(x.float(), ref.float()) <= 1e-5


def test_buffer_rows_are_mask_aligned_and_the_additive_mask_is_sdpa_own_form():
    """The fixed K/V buffer has a multiple of 16 rows (no padded mask copy per layer), and the
    float mask made once per step gives SDPA's result for the boolean mask bit for bit."""
    from minicpmo_rt.thinker.audio_graph import MASK_ALIGN, additive_mask, buffer_rows

    assert buffer_rows(1500) == 1504 and buffer_rows(1504) == 1504 and buffer_rows(1) == MASK_ALIGN
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7, 16, generator=g) for _ in range(3))
    mask = torch.arange(7)[None, None, None, :] < torch.tensor([5, 7])[:, None, None, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(mask, q.dtype))
    assert torch.equal(got, ref)
