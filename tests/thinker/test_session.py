"""StreamingSession: layout, read-out, exact snapshot/restore, tails, window, errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
from minicpmo_rt.checkpoint.tokenizer import load_tokenizer
from minicpmo_rt.errors import InputError
from minicpmo_rt.thinker.model import Thinker, cache_length
from minicpmo_rt.thinker.session import (ContextLimitError, SnapshotError, StreamingSession, WindowPolicy)

from conftest import make_tiny_thinker, rel_err, requires_cuda

UNIT, UNIT_END, IMG, IMG_END, UNK = 151683, 151684, 151669, 151670, 128244



@pytest.fixture(scope="module")
def thinker() -> Thinker:
    return make_tiny_thinker(seed=11)



def _audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(round(seconds * 16000))
    t = np.arange(n) / 16000
    return (0.3 * np.sin(2 * np.pi * (150 + 50 * rng.random()) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 2 * t))
            + 0.02 * rng.standard_normal(n)).astype(np.float32)


def _frame(seed: int, h: int = 72, w: int = 128) -> np.ndarray:
    return (np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8)


def _run(session, audio, seconds, frames=True):
    for k in range(seconds):
        session.commit(audio[16000 * k:16000 * (k + 1)], _frame(k) if frames else None)


def test_unit_layout_and_history(thinker, tok):
    s = StreamingSession(thinker, tok)
    sys_ids = tok.encode("<|im_start|>system\nStreaming Omni Conversation.\n<|audio_start|>") + \
        tok.encode("<|audio_end|><|im_end|>")
    assert list(s.system_piece.ids) == sys_ids and s.preserve == len(sys_ids)
    _run(s, _audio(2, 0), 2)
    assert len(s.history) == 1 and s.history[0].closed and s.open_unit is not None
    assert list(s.history[0].piece.ids) == [UNIT, IMG] + [UNK] * 64 + [IMG_END] + [UNK] * 10 + [UNIT_END]
    assert list(s.open_unit.piece.ids) == [UNIT, IMG] + [UNK] * 64 + [IMG_END] + [UNK] * 10
    assert s.cache_len == len(sys_ids) + 78 + 77 and s.history_len == 2
    assert (s.audio_chunk_idx, s.committed_chunks, s.audio_cache.length) == (2, 2, 100)
    assert s.carry.shape == (80,)  # upstream keeps the last 80 samples for the next chunk
    s.commit(_audio(1, 1), None)  # an audio-only unit
    assert list(s.open_unit.piece.ids) == [UNIT] + [UNK] * 10


def test_read_state_equals_one_shot_forward_of_everything_fed(thinker, tok, monkeypatch):
    fed = []
    original = thinker.forward_embeds

    def spy(embeds, cache, logits=False):
        fed.append(embeds.clone())
        return original(embeds, cache, logits)

    monkeypatch.setattr(thinker, "forward_embeds", spy)
    s = StreamingSession(thinker, tok)
    _run(s, _audio(3, 2), 3)
    with torch.no_grad():
        ref = thinker.llm.model(inputs_embeds=torch.cat(fed)[None]).last_hidden_state[0, -1]
    state = s.read_state()
    assert state.dtype == torch.float32 and state.shape == (thinker.hidden_size,)
    assert rel_err(state, ref) <= 1e-5


def test_transaction_with_tail_restores_bit_exactly(thinker, tok):
    audio = _audio(4, 3)
    a, b = StreamingSession(thinker, tok), StreamingSession(thinker, tok)
    _run(a, audio, 2)
    _run(b, audio, 2)
    fp, state = a.fingerprint(), a.read_state()
    with a.transaction():
        a.append_tail(audio[32000:32000 + 6400], _frame(99))
        tail_state = a.read_state()
        inside = a.fingerprint()
    assert not torch.equal(tail_state, state)
    assert inside.llm_cache_len == fp.llm_cache_len + 1 + 1 + 66 + 4  # </unit> <unit> image, 0.4 s -> 4 embeds
    assert inside.audio_cache_len > fp.audio_cache_len and inside.mel_state != fp.mel_state
    assert a.fingerprint() == fp and torch.equal(a.read_state(), state)
    assert all(getattr(a.fingerprint(), f.name) == getattr(b.fingerprint(), f.name)
               for f in dataclasses.fields(fp))
    # Continuing after the transaction is bit-identical to a session that never had one.
    a.commit(audio[32000:48000], _frame(2))
    b.commit(audio[32000:48000], _frame(2))
    assert torch.equal(a.read_state(), b.read_state()) and a.fingerprint() == b.fingerprint()


def test_snapshot_with_checksum_and_rng(thinker, tok):
    s = StreamingSession(thinker, tok)
    _run(s, _audio(1, 4), 1)
    snap = s.snapshot(checksum=True)
    torch.manual_seed(1234)  # RNG state is part of the snapshot
    with pytest.raises(InputError, match="inside"):
        s.append_tail(_audio(0.2, 5), None)  # outside a transaction
    s.commit(_audio(1, 5), None)
    s.restore(snap)
    assert s.fingerprint().rng_digest == snap.rng.digest() and s.cache_len == snap.llm_cache_len


def test_temporary_full_chunk_equals_native_commit(thinker, tok):
    audio = _audio(3, 6)
    s = StreamingSession(thinker, tok)
    _run(s, audio, 2)
    with s.transaction():
        s.commit(audio[32000:48000], _frame(2))
        temporary = s.read_state()
    s.commit(audio[32000:48000], _frame(2))
    assert torch.equal(temporary, s.read_state())


def test_future_intervention_leaves_state_unchanged(thinker, tok):
    audio = _audio(3, 7)
    changed = audio.copy()
    cutoff = int(2.4 * 16000)
    changed[cutoff:] = _audio(3, 8)[cutoff:]
    states = []
    for x in (audio, changed):
        s = StreamingSession(thinker, tok)
        _run(s, x, 2)
        with s.transaction():
            s.append_tail(x[32000:cutoff], _frame(2))
            states.append(s.read_state())
    assert torch.equal(states[0], states[1])
    # ...whereas a change before the cutoff does change it (the check can fail)
    early = audio.copy()
    early[cutoff - 1600:cutoff] *= -1.0
    s = StreamingSession(thinker, tok)
    _run(s, early, 2)
    with s.transaction():
        s.append_tail(early[32000:cutoff], _frame(2))
        assert not torch.equal(s.read_state(), states[0])


def test_tail_before_first_commit_is_left_padded_first_chunk(thinker, tok):
    s = StreamingSession(thinker, tok)
    with s.transaction():
        s.append_tail(_audio(0.2, 9), _frame(0))
        assert s.open_unit.piece.slot_lengths("audio") == [10]  # padded to 1035 ms, as upstream's chunk 0
    assert s.cache_len == s.preserve and s.history_len == 0


def test_window_prunes_whole_units_and_stays_bounded(thinker, tok):
    window = WindowPolicy.input_only(high_tokens=300, low_tokens=200)
    s = StreamingSession(thinker, tok, window=window)
    audio = _audio(8, 10)
    lens = []
    for k in range(8):
        s.commit(audio[16000 * k:16000 * (k + 1)], _frame(k))
        lens.append(s.cache_len)
        assert s.cache_len == s.preserve + sum(u.length for u in s.history) + s.open_unit.length
    assert max(lens) <= window.high_tokens and s.pruning_events
    assert s.position_offset == sum(e.tokens_dropped for e in s.pruning_events)
    for e in s.pruning_events:
        assert e.cache_len_before > window.high_tokens and e.tokens_dropped % 78 == 0
    # Inside a transaction the window is suspended, and an older snapshot cannot come back.
    old = s.snapshot()
    n_events = len(s.pruning_events)
    with s.transaction():
        for k in range(3):
            s.commit(audio[16000 * k:16000 * (k + 1)], _frame(k))
        assert len(s.pruning_events) == n_events and s.cache_len > window.high_tokens
    while len(s.pruning_events) == n_events:
        s.commit(audio[:16000], None)
    with pytest.raises(SnapshotError, match="pruning"):
        s.restore(old)


def test_pruned_cache_equals_fresh_prefill_of_kept_units_at_layer0(thinker, tok, monkeypatch):
    fed = []
    original = thinker.forward_embeds
    monkeypatch.setattr(thinker, "forward_embeds", lambda e, c, logits=False: (fed.append(e.clone()),
                                                                                original(e, c, logits))[1])
    s = StreamingSession(thinker, tok, window=WindowPolicy.input_only(high_tokens=250, low_tokens=170))
    audio = _audio(4, 11)
    _run(s, audio, 4)
    assert len(s.pruning_events) == 1
    ev = s.pruning_events[0]
    everything = torch.cat(fed)
    kept = torch.cat([everything[:s.preserve], everything[s.preserve + ev.tokens_dropped:]])
    fresh = thinker.new_cache()
    original(kept, fresh)
    assert cache_length(fresh) == s.cache_len
    assert rel_err(s.cache.layers[0].keys, fresh.layers[0].keys) <= 1e-5
    assert rel_err(s.cache.layers[0].values, fresh.layers[0].values) <= 1e-6


def test_context_limit_is_named_and_leaves_state_unchanged(tok):
    cfg = tiny_config()
    cfg["max_position_embeddings"] = 200
    t = Thinker(MiniCPMOConfig.from_dict(cfg))
    randomize_(t, seed=2)
    t.float().rebuild_buffers()
    s = StreamingSession(t, tok, window=WindowPolicy.off())
    audio = _audio(3, 12)
    _run(s, audio, 2)
    fp = s.fingerprint()
    with pytest.raises(ContextLimitError, match="past the model's 200"):
        s.commit(audio[32000:48000], _frame(2))
    assert isinstance(ContextLimitError("x"), InputError) and s.fingerprint() == fp
    # A bounded window keeps the same model going; suspended pruning does not.
    w = StreamingSession(t, tok, window=WindowPolicy.input_only(150, 100))
    _run(w, audio, 3)
    with w.pruning_suspended(), pytest.raises(ContextLimitError):
        for k in range(3):
            w.commit(audio[16000 * k:16000 * (k + 1)], _frame(k))
    with pytest.raises(InputError, match="must stay below"):
        StreamingSession(t, tok, window=WindowPolicy.input_only(250, 100))
    with pytest.raises(InputError, match="low_tokens"):
        WindowPolicy.input_only(100, 250)


def test_long_session_resets_audio_cache_and_slides_mel(thinker, tok):
    s = StreamingSession(thinker, tok, window=WindowPolicy.input_only(high_tokens=400, low_tokens=250))
    audio = _audio(31, 13)
    _run(s, audio, 31, frames=False)
    assert s.audio_resets == 1 and s.audio_cache.length == 50 * 2  # reset at chunk 29, then 2 more
    assert s.mel.state.base_T == 1000 and s.cache_len <= 400


def test_bad_inputs_are_named_and_change_nothing(thinker, tok):
    s = StreamingSession(thinker, tok)
    s.commit(_audio(1, 14), _frame(0))
    fp = s.fingerprint()
    cases = [
        (np.zeros(0, np.float32), _frame(1), "empty audio"),
        (np.zeros((2, 16000), np.float32), None, "not mono"),
        ((np.ones(16000) * 1000).astype(np.int16), None, "not floating"),
        (np.full(16000, np.nan, np.float32), None, "NaN"),
        (_audio(0.5, 1), None, "needs 16000 samples"),
        (_audio(1, 1), np.zeros((0, 10, 3), np.uint8), "zero-size"),
        (_audio(1, 1), "not an image", "not an image"),
        ([0.0] * 16000, None, "numpy array"),
    ]
    for audio, frame, msg in cases:
        with pytest.raises(InputError, match=msg):
            s.commit(audio, frame)
        assert s.fingerprint() == fp, msg
    with s.transaction(), pytest.raises(InputError, match="shorter than"):
        s.append_tail(_audio(1, 1), None)


def test_other_sample_rates_are_resampled(thinker, tok):
    from scipy.signal import resample_poly

    x48 = _audio(1, 15).repeat(3)  # any 48 kHz signal
    a, b = StreamingSession(thinker, tok), StreamingSession(thinker, tok)
    a.commit(x48, _frame(0), sample_rate=48000)
    b.commit(resample_poly(x48, 1, 3).astype(np.float32), _frame(0))
    assert torch.equal(a.read_state(), b.read_state())


def test_session_on_tiny_checkpoint(tiny_ckpt):
    t = Thinker.from_snapshot(tiny_ckpt, dtype=torch.float32)
    s = StreamingSession(t, load_tokenizer(tiny_ckpt))
    _run(s, _audio(2, 16), 2)
    fp, state = s.fingerprint(), s.read_state()
    with s.transaction():
        s.append_tail(_audio(0.6, 17), _frame(5))
    assert s.fingerprint() == fp and torch.equal(s.read_state(), state) and torch.isfinite(state).all()


@requires_cuda
def test_cuda_bf16_session_is_exact_and_mel_runs_on_device(tok):
    from minicpmo_rt.thinker.mel import log_mel

    t = Thinker(MiniCPMOConfig.from_dict(tiny_config()))
    randomize_(t, seed=11)
    t.to(device="cuda", dtype=torch.bfloat16).rebuild_buffers()
    assert t.llm.model.rotary_emb.inv_freq.dtype == torch.float32
    a, b = StreamingSession(t, tok), StreamingSession(t, tok)
    assert a.mel.device is not None and torch.device(a.mel.device).type == "cuda"
    audio = _audio(3, 20)
    _run(a, audio, 2)
    _run(b, audio, 2)
    fp, state = a.fingerprint(), a.read_state()
    with a.transaction():
        a.append_tail(audio[32000:40000], _frame(7))
    assert a.fingerprint() == fp and torch.equal(a.read_state(), state)
    a.commit(audio[32000:48000], _frame(2))
    b.commit(audio[32000:48000], _frame(2))
    assert torch.equal(a.read_state(), b.read_state())
    x = _audio(6, 21)
    assert rel_err(log_mel(x, True, device="cuda").cpu(), log_mel(x, True)) <= 1e-5


def test_embedded_frames_feed_like_raw_frames(thinker, tok):
    """A frame embedded ahead (alone) commits bit-identically to the raw frame; frames embedded
    in one batch match their one-by-one embeddings (the vision tower is per frame)."""
    audio = _audio(3, 5)
    raw, pre = StreamingSession(thinker, tok), StreamingSession(thinker, tok)
    frames = [_frame(k) for k in range(3)]
    batch = pre.embed_frames(frames + [None])
    assert batch[3] is None and all(b.embeds.shape[0] == 1 for b in batch[:3])
    for k in range(3):
        alone = pre.embed_frames([frames[k]])[0]
        assert rel_err(batch[k].embeds, alone.embeds) <= 1e-5
        chunk = audio[16000 * k:16000 * (k + 1)]
        raw.commit(chunk, frames[k])
        pre.commit(chunk, alone)
        assert torch.equal(raw.read_state(), pre.read_state())
    with raw.transaction(), pre.transaction():
        raw.append_tail(audio[:3200], frames[0])
        pre.append_tail(audio[:3200], batch[0])
        assert rel_err(pre.read_state(), raw.read_state()) <= 1e-5
    with pytest.raises(InputError, match="embed_frames: frame 0"):
        pre.embed_frames([np.zeros((4, 4, 5), np.uint8)])


@pytest.mark.parametrize("llm_cache,audio_graphs", [("dynamic", False), ("static", False), ("static", True)])
def test_evaluate_forks_equal_one_transaction_per_unit(thinker, tok, llm_cache, audio_graphs):
    """Forked units (batched on a static cache's fork, transactions on a dynamic one; with
    audio graphs, the units' audio steps batched too: eager on the CPU, as
    ``AudioGraphs.embed_forks`` runs off CUDA) read the same states as one transaction per
    unit, and leave the session exactly as it was; the fork's incremental row copy stays
    right across commits, restores and pruning."""
    audio = _audio(6, 7)
    kw = dict(llm_cache=llm_cache, window=WindowPolicy.input_only(high_tokens=250, low_tokens=150),
              static_capacity=1024)
    s = StreamingSession(thinker, tok, audio_graphs=audio_graphs, **kw)
    ref = StreamingSession(thinker, tok, **kw)
    if audio_graphs:
        calls = []
        inner = s.audio_graphs.embed_forks
        s.audio_graphs.embed_forks = lambda *a: calls.append(inner(*a)) or calls[-1]

    def units(sec):
        base = 16000 * sec
        tails = [(audio[base:base + 3200 * j], _frame(10 * sec + j), False) for j in (1, 2, 3, 4)]
        return tails + [(audio[base:base + 16000], _frame(10 * sec + 5), True)]

    for sec in range(5):
        us = units(sec)
        before = s.fingerprint()
        got = s.evaluate_forks(us)
        assert s.fingerprint() == before
        want = []
        for a, f, whole in us:
            with ref.transaction():
                (ref.commit if whole else ref.append_tail)(a, f)
                want.append(ref.read_state())
        for g, w in zip(got, want):
            assert rel_err(g, w) <= 1e-5
        for x in (s, ref):
            x.commit(us[-1][0], us[-1][1])
        assert torch.equal(s.read_state(), ref.read_state())
        assert rel_err(got[-1], s.read_state()) <= 1e-5   # the forked whole chunk = the native commit
    assert s.pruning_events and len(s.pruning_events) == len(ref.pruning_events)
    if llm_cache == "static":
        assert s.llm_cache.fork_batch == 5
    if audio_graphs:  # every second's 5 units went through one batched audio step
        assert len(calls) == 5 and all(c is not None and len(c) == 5 for c in calls)
    with pytest.raises(InputError, match="is a whole chunk"):
        s.evaluate_forks([(audio[:16000], None, False)])
    s.close()


def test_device_read_outs_and_lazy_fingerprints_equal_the_host_ones(thinker, tok):
    """read_state(on_device=True), evaluate_forks(on_device=True) and fingerprint(lazy=True)
    (checksums left as device tensors, read later) give the host-side values."""
    s = StreamingSession(thinker, tok)
    audio = _audio(2.5, 30)
    _run(s, audio, 2)
    dev = s.read_state(on_device=True)
    assert dev.dtype == torch.float32 and torch.equal(dev.cpu(), s.read_state())
    dev += 1  # a copy: the session's state is untouched
    assert not torch.equal(dev.cpu(), s.read_state())
    lazy = s.fingerprint(lazy=True)
    assert torch.is_tensor(lazy.llm_checksum) and torch.is_tensor(lazy.audio_checksum)
    resolved = dataclasses.replace(lazy, llm_checksum=float(lazy.llm_checksum),
                                   audio_checksum=float(lazy.audio_checksum))
    assert resolved == s.fingerprint()
    units = [(audio[32000:32000 + n], _frame(n), False) for n in (3200, 6400)]
    host = s.evaluate_forks(units)
    on_dev = s.evaluate_forks(units, on_device=True)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(host, on_dev))


# ---- duplex generation inside a unit (feed_token / end_unit / logits) -----------------------------
LISTEN, CHUNK_EOS = 151705, 151718


@pytest.mark.parametrize("llm_cache", ["dynamic", "static"])
def test_generated_tokens_join_the_unit_and_its_terminator_closes_it(thinker, tok, llm_cache):
    """Tokens fed after a unit's prefill belong to that unit; ``end_unit(t)`` makes the next
    commit feed ``[t, </unit>]`` before the next unit, as upstream's finalize_unit; the
    read-outs equal one plain forward of every row fed."""
    s = StreamingSession(thinker, tok, llm_cache=llm_cache)
    a = _audio(2, 5)
    s.commit(a[:16000], None)
    base = s.cache_len
    logits = s.logits()
    assert logits.shape == (thinker.config.llm.vocab_size,) and logits.dtype == torch.float32
    with torch.no_grad():
        assert rel_err(logits, thinker.llm.lm_head(s.read_state()).float()) <= 1e-6
    h1 = s.feed_token(1000)
    h2 = s.feed_token(2000)
    assert s.cache_len == base + 2 and list(s.open_unit.piece.ids[-2:]) == [1000, 2000]
    assert rel_err(h2.float().cpu(), s.read_state()) == 0.0 and rel_err(h1.float(), h2.float()) > 0
    s.end_unit(CHUNK_EOS)
    with pytest.raises(InputError, match="no open unit to generate into"):
        s.feed_token(3)
    with pytest.raises(InputError, match="already ended"):
        s.end_unit(LISTEN)
    s.commit(a[16000:], None)
    closed = s.history[-1]
    assert closed.closed and list(closed.piece.ids[-4:]) == [1000, 2000, CHUNK_EOS, UNIT_END]
    assert s.cache_len == base + 2 + 2 + 11  # terminator + </unit>, then <unit> + 10 audio rows
    # the same rows through one fresh forward: the generated tokens sit where they were fed
    ref = StreamingSession(thinker, tok, llm_cache=llm_cache)
    ref.commit(a[:16000], None)
    ref.feed_token(1000)
    ref.feed_token(2000)
    ref.end_unit(CHUNK_EOS)
    ref.commit(a[16000:], None)
    assert rel_err(ref.read_state(), s.read_state()) <= 1e-6


def test_generated_tokens_snapshot_and_prune_with_their_unit(thinker, tok):
    s = StreamingSession(thinker, tok, window=WindowPolicy("tight", 60, 40))
    a = _audio(6, 6)
    s.commit(a[:16000], None)
    snap = s.snapshot(checksum=True)
    s.feed_token(42)
    s.end_unit(LISTEN)
    s.restore(snap)
    assert s.open_unit.terminator is None and 42 not in s.open_unit.piece.ids
    for k in range(5):
        s.feed_token(42 + k)
        s.end_unit(LISTEN)
        s.commit(a[16000 * (k + 1):16000 * (k + 2)], None)
    assert s.pruning_events, "the tight window must have pruned"
    # bookkeeping (checked inside the session after each prune) and the cache agree
    assert s.cache_len == s.preserve + sum(u.length for u in s.history) + s.open_unit.length
    assert all(u.piece.ids[-2:] == (LISTEN, UNIT_END) for u in s.history)


def test_feed_token_before_any_unit_is_named(thinker, tok):
    s = StreamingSession(thinker, tok)
    with pytest.raises(InputError, match="commit a unit first"):
        s.feed_token(5)
    with pytest.raises(InputError, match="commit a unit first"):
        s.end_unit(LISTEN)
