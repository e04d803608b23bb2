"""Several streams' audio steps in one batch, each on its own cache (``audio_graph.embed_chunks_eager`` /
``AudioGraphs.embed_chunks``, what a duplex batch's commits take), against one streaming step per stream
(``Thinker.embed_audio_chunk``, the reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minicpmo_rt.thinker import kernels
from minicpmo_rt.thinker.audio_graph import CHUNK_BATCHES, AudioGraphs, embed_chunks_eager
from minicpmo_rt.thinker.mel import StreamingMel

from conftest import behind_queued_work, make_tiny_thinker, rel_err, requires_cuda


def _audio(seconds: float, seed: int) -> np.ndarray:
    """A tone in noise, its pitch set by ``seed`` (streams that differ)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * 16000))) / 16000
    return (0.3 * np.sin(2 * np.pi * (150 + 60 * rng.random()) * t) + 0.05 * rng.standard_normal(t.size)
            ).astype(np.float32)


def _stream(thinker, seconds: int, seed: int, device=None):
    """A stream's audio cache after ``seconds`` committed chunks, and its next whole chunk's mel."""
    audio = _audio(seconds + 1.1, seed)
    mel = StreamingMel(device=device)
    cache = None
    pending = np.zeros(int(1035 * 16) - 16000, np.float32)  # upstream's first-chunk left pad
    for k in range(seconds + 1):
        buf = np.concatenate([pending, audio[16000 * k:16000 * (k + 1)]])
        c = mel.process(buf[:mel.chunk_size()])
        pending = buf[mel.chunk_size():]
        if k == seconds:
            return cache, c
        cache = thinker.embed_audio_chunk(c.features, cache, c.prefix_extra, c.suffix_extra).cache


def _streams(thinker, seconds=(1, 4, 2), device=None):
    got = [_stream(thinker, s, 30 + i, device) for i, s in enumerate(seconds)]
    caches, mels = [g[0] for g in got], [g[1] for g in got]
    assert len({(tuple(m.features.shape), m.prefix_extra, m.suffix_extra) for m in mels}) == 1
    return caches, mels


def _assert_steps_equal(thinker, caches, mels, got, tol):
    """Each stream's embeddings, new cache and reset flag as its own step's."""
    for cache, m, g in zip(caches, mels, got):
        ref = thinker.embed_audio_chunk(m.features, cache, m.prefix_extra, m.suffix_extra)
        assert g.reset == ref.reset and g.embeds.shape == ref.embeds.shape
        assert rel_err(g.embeds.float(), ref.embeds.float()) <= tol
        assert g.cache.length == ref.cache.length
        for a, b in zip(g.cache.keys + g.cache.values, ref.cache.keys + ref.cache.values):
            assert a.shape == b.shape and rel_err(a.float(), b.float()) <= tol


@pytest.mark.parametrize("split", [False, True], ids=["sdpa", "split-attention"])
def test_eager_batch_equals_one_step_per_stream(split):
    """Three streams with caches of 1, 4 and 2 s: each one's embeddings and new cache as its own step's (fp32:
    1e-5), also through the split-key Triton attention of the CUDA graphs (per-row key ends, here in
    Triton's interpreter). Each row writes its new K/V and embeds its positions at its own offset."""
    if split and not kernels.usable_on(torch.zeros(1)):
        pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 (scripts/test.sh sets it)")
    th = make_tiny_thinker(seed=5)
    caches, mels = _streams(th)
    got = embed_chunks_eager(th, [m.features for m in mels], caches, mels[0].prefix_extra, mels[0].suffix_extra,
                             split_attention=split)
    _assert_steps_equal(th, caches, mels, got, 1e-5)


def test_a_stream_whose_cache_is_full_resets_in_the_batch():
    """A stream whose cache would pass the encoder's positions starts again from no cache (as its own step
    does, reset flagged), beside streams that go on."""
    th = make_tiny_thinker(seed=6)
    caches, mels = _streams(th, (1, 3))
    real = th.apm.max_source_positions
    th.apm.max_source_positions = caches[1].length + 30     # stream 1's next chunk resets, stream 0's does not
    try:
        got = embed_chunks_eager(th, [m.features for m in mels], caches, mels[0].prefix_extra, mels[0].suffix_extra)
        assert [g.reset for g in got] == [False, True]
        _assert_steps_equal(th, caches, mels, got, 1e-5)
    finally:
        th.apm.max_source_positions = real


def test_a_stream_is_independent_of_the_other_streams_of_its_batch():
    """Changing one stream's mel changes no other stream's embeddings or cache (bit for bit): the rows' new
    keys and the other rows' caches are masked out."""
    th = make_tiny_thinker(seed=7)
    caches, mels = _streams(th)
    x = [m.features for m in mels]
    args = (caches, mels[0].prefix_extra, mels[0].suffix_extra)
    a = embed_chunks_eager(th, x, *args)
    b = embed_chunks_eager(th, x[:2] + [x[2] + 0.5], *args)
    for u, v in zip(a[:2], b[:2]):
        assert torch.equal(u.embeds, v.embeds) and all(torch.equal(p, q) for p, q in zip(u.cache.keys, v.cache.keys))
    assert not torch.equal(a[2].embeds, b[2].embeds)


def test_embed_chunks_groups_streams_and_leaves_the_rest_to_their_own_steps():
    """``AudioGraphs.embed_chunks`` (eager off CUDA): streams of one chunk shape run together; a stream alone
    in its shape, or with a chunk too short for one embedding, gets None (its session then steps alone)."""
    th = make_tiny_thinker(seed=8)
    caches, mels = _streams(th)
    g = AudioGraphs(th)
    odd = mels[0].features[:, :-20]                     # another shape: alone in its group
    short = mels[0].features[:, :4]                     # under one pooled embedding
    feats = [mels[0].features, odd, mels[1].features, short, mels[2].features]
    cs = [caches[0], caches[0], caches[1], caches[1], caches[2]]
    got = g.embed_chunks(feats, cs, [mels[0].prefix_extra] * 5, [mels[0].suffix_extra] * 5)
    assert got[1] is None and got[3] is None
    _assert_steps_equal(th, [cs[i] for i in (0, 2, 4)], [mels[0], mels[1], mels[2]], [got[i] for i in (0, 2, 4)],
                        1e-5)
    assert g.embed_chunks(feats[:1], cs[:1], [mels[0].prefix_extra], [mels[0].suffix_extra]) == [None]


def test_commit_many_takes_the_audio_steps_together_and_keeps_each_sessions_state(tok):
    """Sessions sharing one ``AudioGraphs`` commit through ``commit_many``: their audio steps run in one batch
    (``audio_steps``), and every session ends where it ends with the audio steps one by one
    (``batched_audio=False``): audio cache and LLM state within fp32 rounding, the same books."""
    from minicpmo_rt.thinker.llm_cache import StaticRows
    from minicpmo_rt.thinker.session import StreamingSession, commit_many

    th = make_tiny_thinker(seed=9)
    runs = {}
    calls = []
    for batched in (True, False):
        graphs = AudioGraphs(th)
        chunks = graphs.embed_chunks
        graphs.embed_chunks = lambda *a, _f=chunks: calls.append(len(a[0])) or _f(*a)
        rows = StaticRows(th, 3, 512, kernels="torch", graphs=False)
        ss = [StreamingSession(th, tok, llm_cache="static", static_capacity=512, llm_pool=rows, llm_graphs=False,
                               audio_graphs=graphs) for _ in range(3)]
        audio = [_audio(3, 40 + i) for i in range(3)]
        for k in range(3):
            live = [i for i in range(3) if not (i == 2 and k == 0)]     # session 2 starts a second later
            commit_many([ss[i] for i in live], [(audio[i][16000 * k:16000 * (k + 1)], None, 16000) for i in live],
                        rows, batched_audio=batched)
            for i in live:
                ss[i].end_unit(tok.special.listen)
        runs[batched] = ss
    assert calls == [2, 3, 3]           # the batched run's seconds; the other one never asked
    for a, b in zip(runs[True], runs[False]):
        assert (a.cache_len, a.next_unit_id, a.audio_chunk_idx) == (b.cache_len, b.next_unit_id, b.audio_chunk_idx)
        assert a.audio_cache.length == b.audio_cache.length
        assert rel_err(a.audio_cache.keys[-1], b.audio_cache.keys[-1]) <= 1e-5
        assert rel_err(a.read_state(), b.read_state()) <= 1e-5
    for s in runs[True] + runs[False]:
        s.close()


@requires_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cuda_graphed_streams_equal_one_step_per_stream(dtype, tol):
    """The graphed batch (each cache copied into its row of a fixed batched buffer, per-row positions and
    masks; three streams in the bucket of four) vs one eager step per stream; a second call with other cache
    lengths (and a stream whose cache resets) replays the same graph."""
    th = make_tiny_thinker(seed=10).to(device="cuda", dtype=dtype)
    th.rebuild_buffers()
    g = AudioGraphs(th)
    for seconds in ((1, 4, 2), (3, 2, 5)):
        caches, mels = _streams(th, seconds, device="cuda")
        got = g.embed_chunks([m.features for m in mels], caches, [m.prefix_extra for m in mels],
                             [m.suffix_extra for m in mels])
        assert all(x is not None for x in got)
        _assert_steps_equal(th, caches, mels, got, tol)
    real = th.apm.max_source_positions
    th.apm.max_source_positions = caches[2].length + 30
    try:
        got = g.embed_chunks([m.features for m in mels], caches, [m.prefix_extra for m in mels],
                             [m.suffix_extra for m in mels])
        assert [x.reset for x in got] == [False, False, True]
        _assert_steps_equal(th, caches, mels, got, tol)
    finally:
        th.apm.max_source_positions = real
    assert len(g._chunk_graphs) == 1 and not g.failures and CHUNK_BATCHES[1] == 4


@requires_cuda
def test_cuda_graphed_streams_never_wait_for_queued_work():
    """With ~1 s of device work queued ahead (a duplex second's vision encoder runs just before the commits' audio
    steps), ``embed_chunks`` replays without waiting for it: the rows' positions go up pinned (a copy from pageable
    memory syncs the stream first, as the positions did until session 51). The results stay each stream's own."""
    th = make_tiny_thinker(seed=11).to(device="cuda", dtype=torch.float32)
    th.rebuild_buffers()
    g = AudioGraphs(th)
    caches, mels = _streams(th, (1, 4, 2), device="cuda")
    args = ([m.features for m in mels], caches, [m.prefix_extra for m in mels], [m.suffix_extra for m in mels])
    g.embed_chunks(*args)      # captures the group's graph: not timed
    got, host_s = behind_queued_work(lambda: g.embed_chunks(*args))
    assert host_s < 0.2, f"embed_chunks waited {host_s:.3f} s for the queued work"
    _assert_steps_equal(th, caches, mels, got, 1e-5)
