"""StreamingSession on the static LLM cache (the fast path) vs the plain DynamicCache session:
same read-outs and cache rows (fp32 rel err), bit-exact snapshot/restore and transactions,
identical pruning bookkeeping, and named capacity errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
from minicpmo_rt.errors import InputError
from minicpmo_rt.thinker import kernels as K
from minicpmo_rt.thinker.llm_cache import DynamicLLMCache, StaticLLMCache
from minicpmo_rt.thinker.model import Thinker
from minicpmo_rt.thinker.session import ContextLimitError, StreamingSession, WindowPolicy

from conftest import make_tiny_thinker, rel_err, requires_cuda



@pytest.fixture(scope="module")
def thinker() -> Thinker:
    return make_tiny_thinker(seed=11)



def _audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(round(seconds * 16000))
    t = np.arange(n) / 16000
    return (0.3 * np.sin(2 * np.pi * (150 + 50 * rng.random()) * t) + 0.02 * rng.standard_normal(n)).astype(np.float32)


def _frame(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).random((72, 128, 3)) * 255).astype(np.uint8)


def _run(s, audio, seconds, first=0):
    for k in range(first, first + seconds):
        s.commit(audio[16000 * k:16000 * (k + 1)], _frame(k) if k % 2 == 0 else None)


def _static_rows(s, layer: int):
    n = s.cache_len
    return s.cache.k_cache[layer, :, :, :n], s.cache.v_cache[layer, :, :, :n]


def test_static_session_equals_dynamic_session(thinker, tok):
    audio = _audio(3, 0)
    d = StreamingSession(thinker, tok)
    s = StreamingSession(thinker, tok, llm_cache="static", static_capacity=512)
    assert isinstance(d.llm_cache, DynamicLLMCache) and isinstance(s.llm_cache, StaticLLMCache)
    assert s.cache.kernels == "torch" and not s.llm_cache.graphs  # auto on CPU: the torch step, no graphs
    for k in range(3):
        _run(d, audio, 1, k)
        _run(s, audio, 1, k)
        assert s.cache_len == d.cache_len
        assert rel_err(s.read_state(), d.read_state()) <= 1e-5
    for layer in range(len(d.cache.layers)):
        k, v = _static_rows(s, layer)
        assert rel_err(k, d.cache.layers[layer].keys) <= 1e-5 and rel_err(v, d.cache.layers[layer].values) <= 1e-5


def test_static_transaction_restores_bit_exactly(thinker, tok):
    audio = _audio(4, 1)
    a = StreamingSession(thinker, tok, llm_cache="static", static_capacity=512)
    b = StreamingSession(thinker, tok, llm_cache="static", static_capacity=512)
    _run(a, audio, 2)
    _run(b, audio, 2)
    fp, state = a.fingerprint(), a.read_state()
    snap = a.snapshot(checksum=True)
    with a.transaction():
        a.append_tail(audio[32000:32000 + 6400], _frame(9))
        assert a.cache_len == fp.llm_cache_len + 1 + 1 + 66 + 4 and not torch.equal(a.read_state(), state)
    assert a.fingerprint() == fp and torch.equal(a.read_state(), state)
    a.restore(snap)  # the checksum is verified over the live rows
    assert all(getattr(a.fingerprint(), f.name) == getattr(b.fingerprint(), f.name) for f in dataclasses.fields(fp))
    # The tail's stale rows past the length are overwritten: continuing is bit-identical.
    a.commit(audio[32000:48000], _frame(2))
    b.commit(audio[32000:48000], _frame(2))
    assert torch.equal(a.read_state(), b.read_state()) and a.fingerprint() == b.fingerprint()
    # ...and a temporary full chunk equals the native commit.
    with a.transaction():
        a.commit(audio[48000:64000], None)
        temporary = a.read_state()
    a.commit(audio[48000:64000], None)
    assert torch.equal(temporary, a.read_state())


def test_static_pruning_equals_dynamic_pruning(thinker, tok):
    window = WindowPolicy.input_only(high_tokens=250, low_tokens=170)
    audio = _audio(5, 2)
    d = StreamingSession(thinker, tok, window=window)
    s = StreamingSession(thinker, tok, window=window, llm_cache="static")
    assert s.llm_cache.capacity == 250 + 2048
    _run(d, audio, 5)
    _run(s, audio, 5)
    assert s.pruning_events == d.pruning_events and len(s.pruning_events) >= 1
    assert s.position_offset == d.position_offset and s.cache_len == d.cache_len
    assert rel_err(s.read_state(), d.read_state()) <= 1e-5
    k, v = _static_rows(s, 0)
    assert rel_err(k, d.cache.layers[0].keys) <= 1e-5 and rel_err(v, d.cache.layers[0].values) <= 1e-6


def test_static_drop_rows_rerotates_exactly_as_dynamic(thinker):
    """Same rows in, same rows out: the all-layer re-rotation equals the per-layer one bit for bit."""
    g = torch.Generator().manual_seed(3)
    embeds = torch.randn(40, thinker.hidden_size, generator=g)
    d, s = DynamicLLMCache(thinker, 64), StaticLLMCache(thinker, 64)
    d.feed(embeds)
    s.feed(embeds)
    for layer in range(len(d.store.layers)):  # make the starting rows identical
        s.store.k_cache[layer, :, :, :40] = d.store.layers[layer].keys
        s.store.v_cache[layer, :, :, :40] = d.store.layers[layer].values
    inv = thinker.llm.model.rotary_emb.inv_freq
    d.drop_rows(5, 12, inv)
    s.drop_rows(5, 12, inv)
    assert s.length == d.length == 28
    for layer in range(len(d.store.layers)):
        assert torch.equal(s.store.k_cache[layer, :, :, :28], d.store.layers[layer].keys)
        assert torch.equal(s.store.v_cache[layer, :, :, :28], d.store.layers[layer].values)


def test_static_capacity_is_named_and_leaves_state_unchanged(thinker, tok):
    audio = _audio(3, 4)
    s = StreamingSession(thinker, tok, window=WindowPolicy.off(), llm_cache="static", static_capacity=150)
    _run(s, audio, 2)
    assert s.cache_len + 79 > 150 > s.cache_len
    fp = s.fingerprint()
    with pytest.raises(ContextLimitError, match="static_capacity"):
        s.commit(audio[32000:48000], _frame(2))
    assert s.fingerprint() == fp
    with pytest.raises(InputError, match="llm_cache"):
        StreamingSession(thinker, tok, llm_cache="paged")


@pytest.mark.skipif(not K.usable_on(torch.empty(0)) or torch.cuda.is_available(),
                    reason="the Triton kernels on CPU need TRITON_INTERPRET=1 before import")
def test_static_session_with_triton_kernels_equals_dynamic(thinker, tok):
    audio = _audio(2, 5)
    d = StreamingSession(thinker, tok)
    s = StreamingSession(thinker, tok, llm_cache="static", static_capacity=256, llm_kernels="triton")
    assert s.cache.kernels == "triton"
    _run(d, audio, 2)
    _run(s, audio, 2)
    assert rel_err(s.read_state(), d.read_state()) <= 1e-5
    fp, state = s.fingerprint(), s.read_state()
    with s.transaction():
        s.append_tail(audio[:4800], None)
    assert s.fingerprint() == fp and torch.equal(s.read_state(), state)
    # forked units: one batched prefill through the Triton kernels (rows at different lengths)
    tails = [(audio[:1600 * j], _frame(j), False) for j in (1, 3, 5)]
    got = s.evaluate_forks(tails)
    assert s.fingerprint() == fp and s.llm_cache.fork_batch == 3
    for (a, f, _), g in zip(tails, got):
        with d.transaction():
            d.append_tail(a, f)
            assert rel_err(g, d.read_state()) <= 1e-5


def test_audio_graph_body_and_session_option(thinker, tok):
    """The captured audio body is the eager step exactly; on CPU AudioGraphs runs eagerly, so a
    session with it is bit-identical to the plain one (also across a shared instance)."""
    from minicpmo_rt.thinker.audio_graph import AudioGraphs, stream_body

    audio = _audio(3, 7)
    plain = StreamingSession(thinker, tok)
    shared = AudioGraphs(thinker)
    a = StreamingSession(thinker, tok, audio_graphs=shared)
    b = StreamingSession(thinker, tok, audio_graphs=shared)
    for k in range(3):
        for s in (plain, a, b):
            _run(s, audio, 1, k)
        assert torch.equal(a.read_state(), plain.read_state()) and torch.equal(b.read_state(), plain.read_state())
    mel = a.mel.process(audio[:16000], last_chunk=False)
    x = mel.features[None]
    ref = thinker.embed_audio_chunk(mel.features, a.audio_cache, mel.prefix_extra, mel.suffix_extra)
    embeds, cache = stream_body(thinker, x, a.audio_cache, mel.prefix_extra, mel.suffix_extra)
    assert torch.equal(embeds, ref.embeds) and cache.checksum() == ref.cache.checksum()


@pytest.mark.parametrize("split", [False, True], ids=["sdpa", "split-attention"])
def test_buffered_audio_body_matches_the_growing_cache_step(thinker, tok, split):
    """The capture-safe audio step (fixed K/V buffer, row mask) equals the eager step that
    concatenates the cache, chunk after chunk, including the first (no cache) chunk; also with
    the split-key Triton attention the CUDA graphs use (here in Triton's interpreter)."""
    from minicpmo_rt.thinker import kernels
    from minicpmo_rt.thinker.audio_graph import buffered_stream_body, stream_body

    if split and not kernels.usable_on(torch.zeros(1)):
        pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 (scripts/test.sh sets it)")
    tol = 1e-5 if split else 1e-6   # fp32; the split kernel sums keys in another order

    s = StreamingSession(thinker, tok)
    apm = thinker.apm
    a = apm.layers[0].self_attn
    P = apm.max_source_positions
    buf = torch.full((len(apm.layers), 2, 1, a.num_heads, P, a.head_dim), float("nan"))
    buf[..., : P // 2, :] = 0.0          # rows past every cache stay NaN: masked rows must not leak
    buf[..., P // 2:, :] = 1e4
    mask = torch.zeros(1, 1, 1, P, dtype=torch.bool)
    audio = _audio(4, 5)
    cache = None
    steps = 0
    for k in range(4):
        mel = s.mel.process(audio[16000 * k:16000 * (k + 1)], last_chunk=False)
        if mel.features.shape[-1] < 20:      # the mel waits for its lookahead first
            continue
        steps += 1
        x = mel.features[None]
        ref, new = stream_body(thinker, x, cache, mel.prefix_extra, mel.suffix_extra)
        past = cache.length if cache is not None else 0
        n = new.length - past
        rows = torch.arange(past, past + n)
        mask[..., :] = torch.arange(P) < past + n
        got = buffered_stream_body(thinker, x, buf, rows, mask, mel.prefix_extra, mel.suffix_extra, split)
        assert rel_err(got, ref) <= tol
        for i in range(len(apm.layers)):
            # layer 0 sees identical inputs; later layers inherit the attention's summation order
            same = torch.equal if i == 0 else (lambda a, b: rel_err(a, b) <= tol)
            assert same(buf[i, 0, :, :, :past + n], new.keys[i])
            assert same(buf[i, 1, :, :, :past + n], new.values[i])
        cache = new
    assert steps >= 2


@requires_cuda
def test_cuda_fast_session_matches_plain_and_restores_exactly(tok):
    """bf16 on CUDA: every fast path (static cache with Triton kernels and CUDA-graph prefill,
    torch frame preprocessing, vision graph) vs the plain session, and bit-exact transactions."""
    from minicpmo_rt.thinker.session import FAST_PATH_OPTIONS

    t = Thinker(MiniCPMOConfig.from_dict(tiny_config()))
    randomize_(t, seed=11)
    t.to(device="cuda", dtype=torch.bfloat16).rebuild_buffers()
    audio = _audio(4, 6)
    plain = StreamingSession(t, tok)
    a = StreamingSession(t, tok, **FAST_PATH_OPTIONS)     # audio graphs included
    b = StreamingSession(t, tok, **FAST_PATH_OPTIONS)
    assert a.cache.kernels == "triton" and a.llm_cache.graphs
    for s in (plain, a, b):
        _run(s, audio, 2)
    assert rel_err(a.read_state(), plain.read_state()) <= 5e-2  # bf16, different kernels and preprocessing
    fp, state = a.fingerprint(), a.read_state()
    with a.transaction():
        a.append_tail(audio[32000:38400], _frame(7))
    assert a.fingerprint() == fp and torch.equal(a.read_state(), state)
    a.commit(audio[32000:48000], _frame(2))
    b.commit(audio[32000:48000], _frame(2))
    assert torch.equal(a.read_state(), b.read_state()) and a.fingerprint() == b.fingerprint()
    assert not a.vision.failures and not a.audio_graphs.failures
    # one audio graph per chunk shape, not per cache length
    assert a.audio_graphs.captures <= 3, a.audio_graphs.captures
    for k in range(3):   # the cache grows by one chunk per commit; no new capture
        a.commit(audio[32000:48000], _frame(k))
    assert a.audio_graphs.captures <= 3
    # forks: batched prefill from a graph on a fork decoder == one transaction per unit (bf16:
    # batch-5 vs batch-1 GEMMs), the session untouched
    units = [(audio[32000:32000 + 3200 * j], _frame(j), False) for j in (1, 2, 3, 4)] + \
        [(audio[32000:48000], _frame(5), True)]
    fp = a.fingerprint()
    got = a.evaluate_forks(units)
    got2 = a.evaluate_forks(units)
    assert a.fingerprint() == fp and all(torch.equal(x, y) for x, y in zip(got, got2))
    for (au, f, whole), g in zip(units, got):
        with a.transaction():
            (a.commit if whole else a.append_tail)(au, f)
            err = rel_err(g, a.read_state())
        print(f"fork vs transaction (bf16, CUDA graphs): {err:.2e}")
        assert err <= 2e-2


@requires_cuda
def test_cuda_graph_decode_and_prefill_equal_eager():
    from minicpmo_rt.thinker.decode import StaticDecoder
    from minicpmo_rt.thinker.llm import build_llm

    cfg = MiniCPMOConfig.from_dict(tiny_config())
    llm = build_llm(cfg)
    randomize_(llm, seed=11, prefix="llm.")
    llm.to(device="cuda", dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, 9, cfg.llm.hidden_size, generator=g).to("cuda", torch.bfloat16)
    eager, graph = StaticDecoder(llm, 128), StaticDecoder(llm, 128, share_weights=None)
    assert eager.kernels == graph.kernels == "triton"
    # Same kernels replayed (cuBLAS may pick another algorithm under capture: bf16-level tolerance).
    assert rel_err(graph.prefill_graph(prompt, 0).float(), eager.prefill(prompt, 0).float()) <= 1e-2
    for i in range(3):
        tok, pos = torch.tensor([7 + i], device="cuda"), torch.tensor([9 + i], device="cuda")
        le, he = eager.decode(tok, pos)
        lg, hg = graph.decode_graph(tok, pos)
        assert rel_err(hg.float(), he.float()) <= 1e-2 and rel_err(lg, le) <= 1e-2
    # the plain torch step agrees within bf16 rounding
    plain = StaticDecoder(llm, 128, kernels="torch")
    assert rel_err(plain.prefill(prompt, 0).float(), eager.prefill(prompt, 0).float()) <= 2e-2


def test_decoder_pool_shares_weights_and_reuses_released_decoders(thinker, tok):
    """Pooled static caches give the same states as private ones; a closed session's decoder
    (stale rows and all) serves the next session, which still matches a fresh one."""
    from minicpmo_rt.thinker.llm_cache import StaticDecoderPool

    pool = StaticDecoderPool(thinker, kernels="torch")
    audio = _audio(3, 9)
    ref = StreamingSession(thinker, tok, llm_cache="static", static_capacity=256, llm_kernels="torch")
    a = StreamingSession(thinker, tok, llm_cache="static", static_capacity=256, llm_pool=pool)
    b = StreamingSession(thinker, tok, llm_cache="static", static_capacity=256, llm_pool=pool)
    assert pool.created == 2 and b.llm_cache.store.wqkv is a.llm_cache.store.wqkv   # packed weights shared
    _run(ref, audio, 3)
    _run(a, audio, 3)
    assert torch.equal(a.read_state(), ref.read_state())
    store = a.llm_cache.store
    a.close()
    with pytest.raises(InputError, match="after close"):
        a.commit(audio[:16000], None)
    c = StreamingSession(thinker, tok, llm_cache="static", static_capacity=256, llm_pool=pool)
    assert c.llm_cache.store is store and pool.created == 2      # reused, not rebuilt
    _run(c, audio, 2, first=1)                                   # different content over stale rows
    fresh = StreamingSession(thinker, tok, llm_cache="static", static_capacity=256, llm_kernels="torch")
    _run(fresh, audio, 2, first=1)
    assert torch.equal(c.read_state(), fresh.read_state()) and c.fingerprint() == fresh.fingerprint()
    c.close()
    c.close()                                                    # idempotent
    with pytest.raises(ValueError, match="released already"):
        pool.release(store)
    b.close()
    rich = next(d for d in pool._free[(256, 1)] if d is not store)    # mark one free decoder as graph-rich
    rich._prefill_graphs[(1, 99)] = None
    assert pool.free_prefill_graphs()[0] == len(rich._prefill_graphs)
    assert pool.acquire(256) is rich                             # the richest goes first


def test_feature_session_factory_plain_on_cpu_and_env_switch(thinker, tok, monkeypatch):
    from minicpmo_rt.features.extract import session_factory

    factory, fast = session_factory(thinker, tok)
    assert fast is False and factory().llm_cache.__class__.__name__ == "DynamicLLMCache"
    factory, fast = session_factory(thinker, tok, fast=True)   # forced: the fast options on CPU
    s1, s2 = factory(), factory()
    assert fast and s1.audio_graphs is s2.audio_graphs and s1.vision is s2.vision
    s1.close()
    assert s1.llm_cache.pool.created == 2
    assert factory().llm_cache.pool.created == 2               # s1's decoder is reused
    monkeypatch.setenv("MINICPMO_RT_FEATURES_FAST", "yes")
    with pytest.raises(InputError, match="MINICPMO_RT_FEATURES_FAST"):
        session_factory(thinker, tok)


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not K.usable_on(torch.empty(0)) or torch.cuda.is_available(), reason="the Triton kernels on the CPU need "
    "TRITON_INTERPRET=1 (CUDA runs them in the CUDA tests)"))])
def test_static_rows_feed_several_sessions_in_one_step(thinker, tok, kernels):
    """Two sessions on rows of one StaticRows decoder (torch kernels, and the Triton kernels through the
    interpreter: each row view's cache is a slice of the shared one): each commits on its own row, then one
    ``step`` feeds a token to both (and later, through ``step_logits`` with the rows' LM head, to one, the
    other row idle); ``accept_token`` leaves each
    session as ``feed_token`` on its own static cache does: hidden rows, cache rows and lengths within fp32
    rounding, the next commit too. Named errors: a third session, a dynamic session's ``token_row``."""
    from minicpmo_rt.thinker.llm_cache import StaticRows

    rows = StaticRows(thinker, 2, 512, kernels=kernels, graphs=False)
    shared = [StreamingSession(thinker, tok, llm_cache="static", static_capacity=512, llm_pool=rows,
                               llm_graphs=False) for _ in range(2)]
    assert shared[0].llm_cache.store.kernels == kernels
    alone = [StreamingSession(thinker, tok, llm_cache="static", static_capacity=512) for _ in range(2)]
    assert [s.llm_cache.store.row for s in shared] == [0, 1] and rows.big.k_cache.shape[3] == 513
    with pytest.raises(InputError, match="all 2 rows are taken"):
        StreamingSession(thinker, tok, llm_cache="static", static_capacity=512, llm_pool=rows)
    audio = [_audio(2, 5), _audio(2, 6)]
    for k, tokens in enumerate(([1000, 2000], [3000, None])):
        for s, a, b in zip(range(2), shared, alone):
            a.commit(audio[s][16000 * k:16000 * (k + 1)], None)
            b.commit(audio[s][16000 * k:16000 * (k + 1)], None)
        where = {i: shared[i].token_row() for i in range(2) if tokens[i] is not None}
        feeds = {row: (tokens[i], pos) for i, (row, pos) in where.items()}
        if k == 0:
            out = rows.step(feeds)
        else:       # with the LM head of the fed rows, which the sessions' logits() then return
            st = rows.step_logits(feeds)
            assert st.rows == [where[i][0] for i in where] and st.logits.shape == (len(where), thinker.llm.lm_head.out_features)
        for j, i in enumerate(where):
            if k == 0:
                got = shared[i].accept_token(tokens[i], out[where[i][0]])
            else:
                lg = st.logits[j]
                got = shared[i].accept_token(tokens[i], st.hidden[j], logits=lg)
                assert shared[i].logits() is lg
            want = alone[i].feed_token(tokens[i])
            assert rel_err(got, want) <= 1e-5 and rel_err(shared[i].logits(), alone[i].logits()) <= 1e-5
        for a, b in zip(shared, alone):
            a.end_unit(tok.special.chunk_eos)
            b.end_unit(tok.special.chunk_eos)
            assert a.cache_len == b.cache_len
            n = a.cache_len
            assert rel_err(a.cache.k_cache[0, :, :, :n], b.cache.k_cache[0, :, :, :n]) <= 1e-5
    for a, b in zip(shared, alone):
        a.commit(audio[0][:16000], None)
        b.commit(audio[0][:16000], None)
        assert rel_err(a.read_state(), b.read_state()) <= 1e-5
    plain = StreamingSession(thinker, tok)
    plain.commit(audio[0][:16000], None)
    with pytest.raises(InputError, match="not a row of a StaticRows"):
        plain.token_row()
    for s in shared + alone:
        s.close()
    assert len(rows._free) == 2


def test_static_rows_prefill_many_equals_each_prompt_alone(thinker, monkeypatch):
    """Four prompts of different lengths into rows 0, 1, 3 and 2 (acquired out of order: two runs of
    consecutive rows after sorting, one forward each, right-padded): each row's K/V over its prompt and its
    last hidden equal a prompt prefilled alone into a fresh decoder (fp32 rounding), and a live row outside
    the runs keeps its cache bit for bit."""
    from minicpmo_rt.thinker.decode import StaticDecoder
    from minicpmo_rt.thinker.llm_cache import StaticRows

    torch.manual_seed(3)
    H = thinker.llm.config.hidden_size
    rows = StaticRows(thinker, 5, 64, kernels="torch", graphs=False)
    views = [rows.acquire(64) for _ in range(5)]            # rows 0..4
    rows.big.k_cache[:, 4].normal_()                        # row 4: a live request's cache
    kept = rows.big.k_cache[:, 4].clone()
    lens = {0: 7, 1: 12, 3: 3, 2: 9}
    order = [0, 3, 1, 2]
    prompts = [torch.randn(lens[r], H) for r in order]
    calls = []
    prefill = StaticDecoder.prefill
    monkeypatch.setattr(StaticDecoder, "prefill", lambda self, x, start: (
        calls.append((self.row, self.batch, x.shape[1])), prefill(self, x, start))[1])
    last = rows.prefill_many([views[r] for r in order], prompts)
    assert sorted(calls) == [(0, 4, 12)]           # rows 0-3 are one run once sorted
    assert last.shape == (4, H)
    for j, r in enumerate(order):
        alone = StaticDecoder(thinker.llm, 64, kernels="torch")
        h = prefill(alone, prompts[j][None], 0)[0]
        n = lens[r]
        assert rel_err(last[j], h[-1]) <= 1e-5
        assert rel_err(rows.big.k_cache[:, r, :, :n], alone.k_cache[:, 0, :, :n]) <= 1e-5
        assert rel_err(rows.big.v_cache[:, r, :, :n], alone.v_cache[:, 0, :, :n]) <= 1e-5
    assert torch.equal(rows.big.k_cache[:, 4], kept)
    # rows 0 and 2 only: two runs
    calls.clear()
    rows.prefill_many([views[2], views[0]], [prompts[3], prompts[0]])
    assert sorted(calls) == [(0, 1, 7), (2, 1, 9)]
    with pytest.raises(ValueError, match="2 rows for 1 prompts"):
        rows.prefill_many(views[:2], prompts[:1])


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not K.usable_on(torch.empty(0)) or torch.cuda.is_available(), reason="the Triton kernels on the CPU need "
    "TRITON_INTERPRET=1 (CUDA runs them in the CUDA tests)"))])
def test_feed_many_rows_from_their_own_lengths_equal_each_feed_alone(thinker, kernels):
    """Rows 0-2 of a StaticRows at lengths 5, 0 and 11 take inputs of 4, 9 and 6 positions in one forward
    (right-padded to 9, each row from its own length; ``prefill_at``): each row's K/V and hidden rows equal
    the same feeds into separate caches (fp32 rounding), the lengths advance by each input's own size, and a
    row that is not fed keeps its cache bit for bit."""
    from minicpmo_rt.thinker.decode import StaticDecoder
    from minicpmo_rt.thinker.llm_cache import StaticRows

    torch.manual_seed(5)
    H = thinker.llm.config.hidden_size
    rows = StaticRows(thinker, 4, 32, kernels=kernels, graphs=False)
    caches = [StaticLLMCache(thinker, 32, kernels=kernels, graphs=False, pool=rows) for _ in range(4)]
    alone = [StaticLLMCache(thinker, 32, kernels=kernels, graphs=False) for _ in range(3)]
    for c, a, n in zip(caches, alone, (5, 0, 11)):
        if n:
            x = torch.randn(n, H)
            c.feed(x)
            a.feed(x)
    caches[3].feed(torch.randn(7, H))
    kept = rows.big.k_cache[:, 3].clone()
    xs = [torch.randn(n, H) for n in (4, 9, 6)]
    steps = rows.feed_many(caches[:3], xs)
    for c, a, x, st in zip(caches, alone, xs, steps):
        want = a.feed(x)
        assert c.length == a.length and st.hidden.shape == want.hidden.shape
        assert rel_err(st.hidden, want.hidden) <= 1e-5
        n = a.length
        assert rel_err(c.store.k_cache[:, 0, :, :n], a.store.k_cache[:, 0, :, :n]) <= 1e-5
        assert rel_err(c.store.v_cache[:, 0, :, :n], a.store.v_cache[:, 0, :, :n]) <= 1e-5
    assert torch.equal(rows.big.k_cache[:, 3], kept)
    with pytest.raises(ValueError, match="cannot hold rows from"):
        rows.big.rows_view(0, 2).prefill_at(torch.zeros(2, 30, H), [0, 10])
    assert isinstance(rows.big, StaticDecoder)


def test_commit_many_equals_each_session_committing_alone(thinker, tok):
    """Three sessions on rows 0-2 of one StaticRows (torch kernels; different lengths after their first seconds: one starts a
    second later, with frames on some seconds) commit together through ``commit_many``: the prefills run as
    one forward (``StaticRows.feed_many``, rows from their own positions, right-padded), and each session ends
    as the same session committing alone on its own static cache: hidden state, logits and cache rows within
    fp32 rounding, and the same books (lengths, units, carried samples)."""
    from minicpmo_rt.thinker.llm_cache import StaticRows
    from minicpmo_rt.thinker.session import commit_many

    seconds = 3
    rows = StaticRows(thinker, 3, 512, kernels="torch", graphs=False)
    shared = [StreamingSession(thinker, tok, llm_cache="static", static_capacity=512, llm_pool=rows,
                               llm_graphs=False) for _ in range(3)]
    alone = [StreamingSession(thinker, tok, llm_cache="static", static_capacity=512) for _ in range(3)]
    audio = [_audio(4, 20 + i) for i in range(3)]
    forwards = []
    prefill_at = rows.big.__class__.prefill_at

    def spy(self, x, starts):
        forwards.append((self.row, self.batch, list(starts)))
        return prefill_at(self, x, starts)

    rows.big.__class__.prefill_at = spy
    try:
        for k in range(seconds):
            live = [i for i in range(3) if not (i == 2 and k == 0)]     # session 2 starts a second later
            sec = lambda i: audio[i][16000 * k:16000 * (k + 1)]          # noqa: E731
            frame = lambda i: _frame(k + i) if (k + i) % 2 == 0 else None  # noqa: E731
            commit_many([shared[i] for i in live], [(sec(i), frame(i), 16000) for i in live], rows)
            for i in live:
                alone[i].commit(sec(i), frame(i))
            for i in live:
                a, b = shared[i], alone[i]
                assert a.cache_len == b.cache_len and a.next_unit_id == b.next_unit_id
                assert np.array_equal(a.carry, b.carry) and len(a.history) == len(b.history)
                assert rel_err(a.read_state(), b.read_state()) <= 1e-5
                assert rel_err(a.logits(), b.logits()) <= 1e-5
                k_a, _ = _static_rows(a, 1)
                k_b, _ = _static_rows(b, 1)
                assert rel_err(k_a, k_b) <= 1e-5
            for s in shared + alone:
                if s.open_unit is not None and s.open_unit.terminator is None:
                    s.end_unit(tok.special.listen)
    finally:
        rows.big.__class__.prefill_at = prefill_at
    # one forward per second for the runs of two or three rows, each row from its own length
    assert [f[:2] for f in forwards] == [(0, 2), (0, 3), (0, 3)]
    assert len(set(forwards[1][2])) > 1
    for s in shared + alone:
        s.close()


def test_commit_many_leaves_every_session_as_it_was_when_one_fails(thinker, tok):
    """A session whose next unit would not fit its cache fails the call: no session moved (lengths, units,
    carried samples, mel state), and each commits normally afterwards."""
    from minicpmo_rt.thinker.llm_cache import StaticRows
    from minicpmo_rt.thinker.session import commit_many

    rows = StaticRows(thinker, 2, 160, kernels="torch", graphs=False)
    ss = [StreamingSession(thinker, tok, llm_cache="static", static_capacity=160, llm_pool=rows, llm_graphs=False)
          for _ in range(2)]
    audio = _audio(6, 3)
    while True:                                 # fill session 1 until its next unit does not fit
        try:
            ss[1].commit(audio[:16000], None)
        except ContextLimitError:
            break
        ss[1].end_unit(tok.special.listen)
    ss[0].commit(audio[:16000], None)
    ss[0].end_unit(tok.special.listen)
    before = [(s.cache_len, s.next_unit_id, s.carry.copy(), len(s.history), s.audio_chunk_idx) for s in ss]
    with pytest.raises(ContextLimitError):
        commit_many(ss, [(audio[16000:32000], None, 16000), (audio[16000:32000], None, 16000)], rows)
    for s, (n, u, carry, h, idx) in zip(ss, before):
        assert (s.cache_len, s.next_unit_id, len(s.history), s.audio_chunk_idx) == (n, u, h, idx)
        assert np.array_equal(s.carry, carry)
    ss[0].commit(audio[16000:32000], None)
    assert ss[0].cache_len > before[0][0]
    with pytest.raises(InputError, match="feed_many takes the caches of sessions on these rows"):
        other = StreamingSession(thinker, tok, llm_cache="static", static_capacity=160)
        rows.feed_many([other.llm_cache], [torch.zeros(3, thinker.llm.config.hidden_size)])
    for s in ss:
        s.close()
