"""Duplex conversation on the tiny checkpoint (random weights: the plumbing, not speech).

The unit loop's branches (listen, the listen -> tts_bos swap, the 28-character limit, the forced
chunk_eos at step 19, <|turn_eos|>, a barge-in) depend on what the model decodes, which random
weights rarely reach. ``_Script`` wraps the real LM head and, at chosen calls, lifts one id far above
the rest, so the real decode policy picks it; everything else is the real path."""

import numpy as np
import pytest
import torch
from torch import nn

from minicpmo_rt.checkpoint.tokenizer import load_tokenizer
from minicpmo_rt.errors import InputError
from minicpmo_rt.runtime.duplex import PCM_RATE, DuplexConversation, conversation_track
from minicpmo_rt.talker.chunked import TalkerSeat, TalkerTurn
from minicpmo_rt.talker.load import load_talker
from minicpmo_rt.thinker.duplex import DuplexDecodeConfig, DuplexDecoder, TurnState, generate_unit
from minicpmo_rt.thinker.model import Thinker
from minicpmo_rt.thinker.session import StreamingSession

from conftest import rel_err, requires_cuda

WORD = 14990   # " hello"-like short ascii piece: checked below to decode to a few characters


class _Script(nn.Module):
    """The real LM head; call i (0-based) with a script entry puts that id on top."""

    def __init__(self, head: nn.Module, script: dict[int, int]):
        super().__init__()
        self.head, self.script, self.calls = head, dict(script), 0

    def forward(self, h):
        out = self.head(h)
        tok = self.script.get(self.calls)
        self.calls += 1
        if tok is not None:
            out = out.clone()
            out[..., tok] = out.max() + 1000.0
        return out


@pytest.fixture(scope="module")
def parts(tiny_ckpt):
    return Thinker.from_snapshot(tiny_ckpt), load_tokenizer(tiny_ckpt), load_talker(tiny_ckpt)


def _audio(seconds, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * 200 * t) + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def _unit(thinker, tok, script, turn=None, cfg=DuplexDecodeConfig(mode="greedy"), force_listen=False, session=None):
    s = session or StreamingSession(thinker, tok)
    s.commit(_audio(1), None)
    head = thinker.llm.lm_head
    thinker.llm.lm_head = _Script(head, script)
    try:
        gen = generate_unit(s, DuplexDecoder(tok, cfg), tok, turn or TurnState(), force_listen=force_listen)
    finally:
        thinker.llm.lm_head = head
    return s, gen


def test_word_token_is_short_text(tok):
    assert 0 < len(tok.decode([WORD])) <= 8


def test_listen_ends_the_unit_unfed_and_is_fed_with_unit_end_next(parts):
    thinker, tok, _ = parts
    sp = tok.special
    s, gen = _unit(thinker, tok, {0: sp.listen})
    assert gen.listen and gen.decoded == (sp.listen,) and gen.fed == () and gen.talker_ids == ()
    before = s.cache_len
    s.commit(_audio(1, 1), None)
    assert list(s.history[-1].piece.ids[-2:]) == [sp.listen, sp.unit_end]
    assert s.cache_len == before + 2 + 11


def test_speech_tokens_feed_and_step0_never_reaches_the_talker(parts):
    thinker, tok, _ = parts
    sp = tok.special
    s, gen = _unit(thinker, tok, {0: sp.speak, 1: WORD, 2: WORD + 1, 3: sp.chunk_eos})
    assert gen.decoded == (sp.speak, WORD, WORD + 1, sp.chunk_eos)
    assert gen.fed == (sp.speak, WORD, WORD + 1) and gen.talker_ids == (WORD, WORD + 1)
    assert gen.terminator == sp.chunk_eos and not gen.listen and not gen.turn_end
    assert list(s.open_unit.piece.ids[-3:]) == [sp.speak, WORD, WORD + 1]
    # the Talker's rows are the final-norm hidden at each token's own position
    assert gen.talker_hidden.shape == (2, thinker.hidden_size)
    assert rel_err(gen.talker_hidden[-1], s.read_state()) == 0.0
    assert gen.text == tok.decode([WORD, WORD + 1], skip_special_tokens=True)


def test_listen_while_the_turn_is_open_becomes_tts_bos(parts):
    thinker, tok, _ = parts
    sp = tok.special
    turn = TurnState(open=True)
    _, gen = _unit(thinker, tok, {0: sp.listen, 1: sp.chunk_eos}, turn=turn)
    assert gen.decoded == (sp.tts_bos, sp.chunk_eos) and gen.fed == (sp.tts_bos,) and turn.open


def test_turn_eos_is_fed_and_closes_the_turn(parts):
    thinker, tok, _ = parts
    sp = tok.special
    turn = TurnState()
    _, gen = _unit(thinker, tok, {0: sp.speak, 1: WORD, 2: sp.turn_eos, 3: sp.listen}, turn=turn)
    assert gen.turn_end and gen.listen and not turn.open
    assert gen.talker_ids == (WORD, sp.turn_eos)   # <|turn_eos|> stays in the Talker's condition


def test_character_limit_drops_the_token_and_forces_chunk_eos(parts):
    thinker, tok, _ = parts
    sp = tok.special
    script = {0: sp.speak, **{i: WORD for i in range(1, 19)}}
    _, gen = _unit(thinker, tok, script, cfg=DuplexDecodeConfig(mode="greedy", repetition_penalty=1.0))
    n = len(gen.talker_ids)
    assert len(tok.decode([WORD] * n, skip_special_tokens=True)) < 28 <= len(tok.decode([WORD] * (n + 1)))
    assert gen.decoded == (sp.speak,) + (WORD,) * n + (sp.chunk_eos,) and gen.terminator == sp.chunk_eos


def test_step_19_is_a_forced_chunk_eos(parts):
    thinker, tok, _ = parts
    sp = tok.special
    script = {i: sp.tts_bos for i in range(25)}    # special: no characters, so no limit
    _, gen = _unit(thinker, tok, script, cfg=DuplexDecodeConfig(mode="greedy", repetition_penalty=1.0))
    assert len(gen.decoded) == 20 and gen.decoded[-1] == sp.chunk_eos and len(gen.fed) == 19


def test_force_listen_units_and_barge_in(parts):
    thinker, tok, _ = parts
    sp = tok.special
    cfg = DuplexDecodeConfig(mode="greedy", force_listen_units=1)
    turn = TurnState()
    s, gen = _unit(thinker, tok, {0: WORD}, turn=turn, cfg=cfg)
    assert gen.listen and gen.decoded == (sp.listen,)       # the first unit listens whatever is decoded
    turn.open = True
    s.commit(_audio(1, 2), None)
    gen = generate_unit(s, DuplexDecoder(tok, cfg), tok, turn, force_listen=True)
    assert gen.interrupted and gen.listen and not turn.open
    assert gen.decoded == (sp.turn_eos, sp.listen) and list(s.open_unit.piece.ids[-1:]) == [sp.turn_eos]


# ------------------------------------------------------------------------------------------ conversation

@pytest.fixture(scope="module")
def conv(tiny_ckpt, voice):
    c = DuplexConversation.from_snapshot(tiny_ckpt, voice, n_timesteps=2, seed=3,
                                         decode=DuplexDecodeConfig(mode="greedy"))
    yield c
    c.close()


def test_conversation_units_release_a_second_of_audio_each(conv):
    units = [conv.step(_audio(1, k)) for k in range(3)]
    for u in units:
        if u.listen:
            assert u.pcm.size == 0 and u.codes == ()
        else:
            assert u.pcm.dtype == np.float32 and u.pcm.size >= PCM_RATE and np.isfinite(u.pcm).all()
            assert len(u.codes) <= 25
    tail = conv.flush()
    track = conversation_track(units)
    assert track.size == sum(PCM_RATE if u.listen else u.pcm.size for u in units)
    assert tail.dtype == np.float32
    assert conv._stream is None and conv.talker.text_start_pos == 0


def test_codes_only_and_barge_in_drop_the_turn(tiny_ckpt, parts):
    thinker, tok, tts = parts
    c = DuplexConversation(thinker, tok, tts, decode=DuplexDecodeConfig(mode="greedy"))
    u = c.step(_audio(1))
    assert u.pcm.size == 0
    c.turn.open = True
    u = c.step(_audio(1, 1), force_listen=True)
    assert u.interrupted and u.listen and c.talker.cache is None
    c.close()


def test_bad_setups_are_named(tiny_ckpt, parts, voice):
    thinker, tok, tts = parts
    from minicpmo_rt.code2wav.pipeline import Code2Wav

    c2w = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2)
    with pytest.raises(InputError, match="needs a voice"):
        DuplexConversation(thinker, tok, tts, c2w)
    with pytest.raises(InputError, match="turn profile; a duplex conversation needs a duplex profile"):
        DuplexConversation.from_snapshot(tiny_ckpt, voice, profile="minicpmo_4_5_turn_mrv2")


def test_static_talker_conversation_equals_the_reference(parts, voice):
    """``fast=True`` off CUDA: the plain Thinker session, the Talker on its static cache (no graphs):
    the same units, codes included, as the reference."""
    thinker, tok, tts = parts
    cfg = DuplexDecodeConfig(mode="greedy")
    ref = DuplexConversation(thinker, tok, tts, voice=voice, decode=cfg, seed=4)
    fast = DuplexConversation(thinker, tok, tts, voice=voice, decode=cfg, seed=4, fast=True)
    assert isinstance(fast.talker, TalkerSeat) and fast.talker.turns.graphs == 0 and isinstance(ref.talker, TalkerTurn)
    for k in range(3):
        a, b = ref.step(_audio(1, k)), fast.step(_audio(1, k))
        assert (a.listen, a.token_ids, a.codes) == (b.listen, b.token_ids, b.codes), f"unit {k}"
    ref.close()
    fast.close()


@requires_cuda
@pytest.mark.parametrize("fast", [False, True])
def test_conversation_on_cuda_matches_the_cpu_decisions(tiny_ckpt, voice, parts, fast):
    """The same greedy conversation on CUDA (fp32), plain and fast paths: the same unit decisions and
    Talker tokens as on the CPU, finite audio."""
    thinker, tok, tts = parts
    cfg = DuplexDecodeConfig(mode="greedy")
    cpu = DuplexConversation(thinker, tok, tts, voice=voice, decode=cfg)   # codes only, same system prompt
    gpu = DuplexConversation.from_snapshot(tiny_ckpt, voice, device="cuda", n_timesteps=2, decode=cfg, fast=fast)
    assert isinstance(gpu.talker, TalkerSeat) == fast and (not fast or gpu.talker.turns.graphs > 0)
    try:
        for k in range(3):
            a, b = cpu.step(_audio(1, k)), gpu.step(_audio(1, k))
            assert (a.listen, a.token_ids, a.terminator) == (b.listen, b.token_ids, b.terminator), f"unit {k}"
            assert b.pcm.size == 0 if b.listen else (b.pcm.size >= PCM_RATE and np.isfinite(b.pcm).all())
        assert np.isfinite(gpu.flush()).all()
    finally:
        cpu.close()
        gpu.close()


def test_track_keeps_the_last_words_of_a_unit_that_ends_its_turn_and_listens():
    from minicpmo_rt.runtime.duplex import DuplexUnit

    words = np.full(1234, 0.5, np.float32)
    units = [DuplexUnit(0, True, "", (), 1, False, False, (), np.zeros(0, np.float32)),
             DuplexUnit(1, True, "bye", (5,), 1, True, False, (7,), words)]
    track = conversation_track(units)
    assert track.shape == (PCM_RATE + 1234,) and np.array_equal(track[PCM_RATE:], words)


def test_a_turn_that_ends_is_voiced_to_its_end_and_the_next_starts_fresh(conv):
    sp = conv.tokenizer.special
    head = conv.thinker.llm.lm_head
    # unit A speaks (its turn stays open), unit B ends the turn and then listens
    conv.thinker.llm.lm_head = _Script(head, {0: sp.speak, 1: WORD, 2: sp.chunk_eos,
                                              3: sp.speak, 4: WORD, 5: sp.turn_eos, 6: sp.listen})
    try:
        a = conv.step(_audio(1, 7))
        b = conv.step(_audio(1, 8))
    finally:
        conv.thinker.llm.lm_head = head
    assert not a.listen and not a.turn_end and a.pcm.size >= PCM_RATE
    assert b.turn_end and b.listen and b.token_ids == (WORD, sp.turn_eos)
    assert b.pcm.size > 0 and np.isfinite(b.pcm).all()          # the final payload: the turn's last words
    assert conv._stream is None and conv.talker.text_start_pos == 0 and not conv.turn.open


# ------------------------------------------------------------------------------------ several conversations

class _Mixed(nn.Module):
    """The real LM head with a pseudo-random id of ``ids`` lifted on top at each call (a fixed sequence of
    calls): conversations that run in the same call order decode the same units."""

    def __init__(self, head: nn.Module, ids: list[int], seed: int = 0):
        super().__init__()
        self.head, self.ids, self.calls = head, ids, 0
        self.rng = np.random.default_rng(seed)

    def forward(self, h):
        out = self.head(h).clone()
        out[..., self.ids[int(self.rng.integers(len(self.ids)))]] = out.max() + 1000.0
        self.calls += 1
        return out


class _ByState(nn.Module):
    """The real LM head with one id of ``ids`` lifted on top of each row, picked from that row's own real
    logits (their argmax and the argmax of every 7th id): the same hidden state lifts the same id whatever
    else runs and in whatever order, so conversations stepped together or alone decode the same units."""

    def __init__(self, head: nn.Module, ids: list[int]):
        super().__init__()
        self.head = head
        # a buffer on the head's device: a CUDA graph cannot capture a host-to-device copy
        self.register_buffer("ids", torch.tensor(ids, device=head.weight.device), persistent=False)

    def forward(self, h):
        out = self.head(h).clone()
        pick = (out.argmax(-1, keepdim=True) + out[..., ::7].argmax(-1, keepdim=True)) % len(self.ids)
        return out.scatter(-1, self.ids[pick], out.amax(-1, keepdim=True) + 1000.0)


def _pcm_err(a, b) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b.astype(np.float64)), 1e-30))


@pytest.mark.parametrize("rows", [False, True])
def test_batch_says_what_each_conversation_says_alone(parts, tiny_ckpt, voice, shared_dir, rows):
    """Three conversations (two voices) stepped together for 6 s, one of them skipping a second, with a
    barge-in: each unit (decision, Talker tokens, codes) equals that conversation stepped alone, and its
    audio matches (one flow solve / HiFT call for the streams in step against one per stream: same math
    per row, <= 1e-5). The units cover listening, speaking and turn ends. ``rows``: the batch's sessions
    sit on rows of one static decoder (``shared_decode``; torch kernels here, Triton and graphs on CUDA), so
    every decode step of the three is one forward (StaticRows); the conversations alone run the plain
    dynamic cache."""
    from minicpmo_rt.code2wav.pipeline import Code2Wav
    from minicpmo_rt.runtime.duplex import DuplexBatch, DuplexInput

    thinker, tok, tts = parts
    sp = tok.special
    c2w = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2)
    voices = [voice, shared_dir / "media" / "ref_minicpm_signature.wav", voice]
    cfg = DuplexDecodeConfig(mode="greedy", repetition_penalty=1.0)
    alone = [DuplexConversation(thinker, tok, tts, c2w, v, decode=cfg, seed=10 + i) for i, v in enumerate(voices)]
    # shared_decode left unset: on with static caches and more than one seat (the CUDA default)
    options = {"session_options": {"llm_cache": "static", "llm_kernels": "torch"}} if rows else {}
    batch = DuplexBatch(thinker, tok, tts, c2w, voices, seeds=[10, 11, 12], decode=cfg, **options)
    assert (batch.rows is not None) == rows
    assert batch.batched_commit == rows      # with shared rows the seconds' prefills run together (commit_many)
    ids = [sp.listen, sp.speak, WORD, WORD + 1, WORD + 2, sp.chunk_eos, sp.turn_eos]
    head = thinker.llm.lm_head
    seen = []
    try:
        thinker.llm.lm_head = _ByState(head, ids)
        for run in ("alone", "batch"):
            for k in range(6):
                inputs = [DuplexInput(_audio(1, 10 * k + i), force_listen=(k == 4 and i == 1)) for i in range(3)]
                if k == 2:
                    inputs[2] = None            # conversation 2 skips this second
                if run == "alone":
                    seen.append([None if x is None else c.step(x.audio, force_listen=x.force_listen)
                                 for c, x in zip(alone, inputs)])
                else:
                    for i, (a, b) in enumerate(zip(seen[k], batch.step(inputs))):
                        assert (a is None) == (b is None), (k, i)
                        if a is None:
                            continue
                        assert (a.index, a.listen, a.token_ids, a.terminator, a.turn_end, a.interrupted, a.codes) == \
                               (b.index, b.listen, b.token_ids, b.terminator, b.turn_end, b.interrupted, b.codes), (k, i)
                        assert a.pcm.shape == b.pcm.shape, (k, i)
                        if a.pcm.size:
                            assert _pcm_err(b.pcm, a.pcm) <= 1e-5, (k, i)
        tails = batch.flush()
        for c, t in zip(alone, tails):
            ref = c.flush()
            assert ref.shape == t.shape and (ref.size == 0 or _pcm_err(t, ref) <= 1e-5)
    finally:
        thinker.llm.lm_head = head
        for c in alone:
            c.close()
        batch.close()
    units = [u for row in seen for u in row if u is not None]
    assert len(units) == 17
    assert any(u.listen and not u.turn_end for u in units) and any(u.codes for u in units)
    assert any(u.turn_end for u in units), [(u.listen, u.turn_end, len(u.codes)) for u in units]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_warm_up_leaves_every_seat_a_fresh_conversation(parts, tiny_ckpt, voice, device):
    """``DuplexBatch.warm_up`` steps every seat through seconds of silence (units that speak: the Talker draws
    and Code2Wav streams open), then reopens every seat with its voice and seed: afterwards the batch says,
    second by second, what a fresh batch with the same seeds says (decisions, tokens, codes, audio), so the
    warm-up leaves nothing behind but what it made ahead (a reopened seat also keeps a seed given to
    ``reopen``). On CUDA (fp32) with the fast paths: shared decoder rows, graphs, the Talker's precaptured
    prefill graphs."""
    from minicpmo_rt.code2wav.pipeline import Code2Wav
    from minicpmo_rt.runtime.duplex import DuplexBatch, DuplexInput

    thinker, tok, tts = parts
    if device == "cuda":
        thinker, tts = Thinker.from_snapshot(tiny_ckpt, device="cuda"), load_talker(tiny_ckpt, device="cuda")
    sp = tok.special
    cfg = DuplexDecodeConfig(mode="greedy", repetition_penalty=1.0)
    c2w = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, device=device)
    head = thinker.llm.lm_head
    thinker.llm.lm_head = _ByState(head, [sp.speak, WORD, WORD + 1, sp.chunk_eos, sp.listen])
    warm = DuplexBatch(thinker, tok, tts, c2w, [voice, voice], seeds=[3, 4], decode=cfg)
    fresh = None
    try:
        with pytest.raises(InputError, match="warm_up seconds must be >= 0"):
            warm.warm_up(-1)
        warm.reopen(1, voice, seed=5)
        took = warm.warm_up(2, frame=np.full((28, 28, 3), 128, np.uint8))
        assert len(took) == 2 and all(t > 0 for t in took)
        # (8, 16, 32) rows at every attention bucket, precaptured: a long turn never captures one mid-conversation
        assert device == "cpu" or {(r, kv) for r in (8, 16, 32) for kv in warm.talker.buckets} <= \
            set(warm.talker._prefill_graphs)
        assert warm.seeds == [3, 5] and warm.talker.draws == [0, 0]
        fresh = DuplexBatch(thinker, tok, tts, c2w, [voice, voice], seeds=[3, 5], decode=cfg)
        spoke = 0
        for k in range(3):
            inputs = [DuplexInput(_audio(1, 10 * k + i)) for i in range(2)]
            for a, b in zip(fresh.step(inputs), warm.step(inputs)):
                assert (a.index, a.listen, a.token_ids, a.codes) == (b.index, b.listen, b.token_ids, b.codes), k
                assert a.pcm.shape == b.pcm.shape and (a.pcm.size == 0 or _pcm_err(b.pcm, a.pcm) <= 1e-5), k
                spoke += bool(a.codes)
        assert spoke > 0
    finally:
        thinker.llm.lm_head = head
        warm.close()
        if fresh is not None:
            fresh.close()


def test_batch_embeds_the_seconds_frames_in_one_vision_call(parts):
    """The frames of one second go through the vision encoder in one batch per frame size (the sessions
    share the thinker), then each session commits its embedded frame: three conversations, two frame
    sizes and one without a frame, two seconds. Each unit decides as that conversation stepped alone with
    its raw frame, and each session's state after the second is within fp32 rounding (1e-5) of it."""
    from minicpmo_rt.runtime.duplex import DuplexBatch, DuplexInput

    thinker, tok, tts = parts
    cfg = DuplexDecodeConfig(mode="greedy")
    rng = np.random.default_rng(4)
    frames = [rng.integers(0, 255, (40, 56, 3), dtype=np.uint8), None, rng.integers(0, 255, (40, 56, 3), dtype=np.uint8)]
    alone = [DuplexConversation(thinker, tok, tts, decode=cfg, seed=i) for i in range(3)]
    batch = DuplexBatch(thinker, tok, tts, voices=[None] * 3, seeds=[0, 1, 2], decode=cfg)
    calls = []
    embed = thinker.embed_image
    try:
        for k in range(2):
            if k == 1:
                frames[1] = rng.integers(0, 255, (64, 48, 3), dtype=np.uint8)     # another size: its own batch
            inputs = [DuplexInput(_audio(1, 20 * k + i), frames[i]) for i in range(3)]
            want = [c.step(x.audio, x.frame) for c, x in zip(alone, inputs)]
            thinker.embed_image = lambda p, _e=embed: (calls.append(len(p) if isinstance(p, list) else 1), _e(p))[1]
            got = batch.step(inputs)
            thinker.embed_image = embed
            assert calls == ([2] if k == 0 else [2, 2, 1]), calls
            for a, b, ca, cb in zip(want, got, alone, batch.conversations):
                assert (a.listen, a.text, a.codes) == (b.listen, b.text, b.codes)
                assert rel_err(cb.session.read_state(), ca.session.read_state()) <= 1e-5
    finally:
        thinker.embed_image = embed
        for c in alone:
            c.close()
        batch.close()


def test_batch_from_snapshot_steps_and_names_bad_input(parts, tiny_ckpt, voice):
    from minicpmo_rt.runtime.duplex import DuplexBatch, DuplexInput

    loaded = DuplexBatch.from_snapshot(tiny_ckpt, [voice, voice], n_timesteps=2, seeds=[1, 2],
                                       decode=DuplexDecodeConfig(mode="greedy"))
    assert len(loaded) == 2 and loaded.talker.seats == 2
    units = loaded.step([DuplexInput(_audio(1, 5)), DuplexInput(_audio(1, 6), sample_rate=16000)])
    assert [u.index for u in units] == [0, 0]
    assert all(u.pcm.size == 0 if u.listen and not u.turn_end else u.pcm.size > 0 for u in units)
    loaded.close()
    thinker, tok, tts = parts
    with pytest.raises(InputError, match="2 seeds for 3 conversations"):
        DuplexBatch(thinker, tok, tts, voices=[None] * 3, seeds=[1, 2])
    with pytest.raises(InputError, match="at least one conversation"):
        DuplexBatch(thinker, tok, tts, voices=[])
    b = DuplexBatch(thinker, tok, tts, voices=[None, None], decode=DuplexDecodeConfig(mode="greedy"))
    with pytest.raises(InputError, match="1 inputs for 2 conversations"):
        b.step([DuplexInput(_audio(1))])
    units = b.step([DuplexInput(_audio(1)), None])     # codes only: no Code2Wav
    assert units[1] is None and units[0].pcm.size == 0
    # a bad input for conversation 1 is refused before conversation 0 commits its second
    b.step([DuplexInput(_audio(1, 1)), DuplexInput(_audio(1, 2))])   # past the first chunk (padded when short)
    before = [c.session.cache_len for c in b.conversations]
    for bad, match in ((DuplexInput(_audio(1)[:, None].repeat(2, 1)), "conversation 1: audio of shape"),
                       (DuplexInput(_audio(1), frame=np.zeros((4, 4, 7), np.uint8)), "conversation 1: frame"),
                       (DuplexInput(_audio(0.5)), "conversation 1: a native chunk needs"),
                       (_audio(1), "conversation 1: got a ndarray")):
        with pytest.raises(InputError, match=match):
            b.step([DuplexInput(_audio(1, 3)), bad])
        assert [c.session.cache_len for c in b.conversations] == before and b.conversations[0].units == 2
    b.close()


def test_reopened_seat_talks_as_a_fresh_conversation(parts, voice):
    """After ``reopen``, seat 1 (new seed, its Talker seat reset) says what a fresh conversation with that
    seed says alone, while seat 0 carries on."""
    from minicpmo_rt.runtime.duplex import DuplexBatch, DuplexInput

    thinker, tok, tts = parts
    cfg = DuplexDecodeConfig(mode="greedy")
    head = thinker.llm.lm_head
    thinker.llm.lm_head = _Mixed(head, [tok.special.speak, WORD, WORD + 1, tok.special.chunk_eos], seed=3)
    try:
        batch = DuplexBatch(thinker, tok, tts, voices=[None, None], seeds=[1, 2], decode=cfg)
        for k in range(2):
            batch.step([DuplexInput(_audio(1, k)), DuplexInput(_audio(1, 10 + k))])
        assert batch.talker.draws[1] > 0
        fresh = batch.reopen(1, seed=9)
        assert batch.conversations[1] is fresh and batch.talker.draws[1] == 0 and batch.talker.text_start_pos[1] == 0
        alone = DuplexConversation(thinker, tok, tts, decode=cfg, seed=9)
        for k in range(2):
            thinker.llm.lm_head.rng = np.random.default_rng(100 + k)   # the same scripted ids for both
            got = batch.step([None, DuplexInput(_audio(1, 20 + k))])[1]
            thinker.llm.lm_head.rng = np.random.default_rng(100 + k)
            ref = alone.step(_audio(1, 20 + k))
            assert (got.index, got.listen, got.token_ids, got.codes) == (ref.index, ref.listen, ref.token_ids,
                                                                         ref.codes), k
        assert got.codes    # the scripted units speak
        with pytest.raises(InputError, match="conversation 2 does not exist"):
            batch.reopen(2)
        alone.close()
        batch.close()
    finally:
        thinker.llm.lm_head = head


def test_shared_decode_defaults_on_for_static_caches_and_several_seats(parts):
    """Unset, ``shared_decode`` puts the sessions on rows of one decoder only where that can run and pays:
    static caches and more than one seat. Explicit False keeps each session's own decoder, and an explicit
    True without static caches is refused by name."""
    from minicpmo_rt.runtime.duplex import DuplexBatch

    thinker, tok, tts = parts
    static = {"session_options": {"llm_cache": "static", "llm_kernels": "torch"}}
    assert DuplexBatch(thinker, tok, tts, voices=[None, None], **static).rows is not None
    assert DuplexBatch(thinker, tok, tts, voices=[None], **static).rows is None
    assert DuplexBatch(thinker, tok, tts, voices=[None, None], shared_decode=False, **static).rows is None
    assert DuplexBatch(thinker, tok, tts, voices=[None, None]).rows is None        # dynamic caches (CPU default)
    with pytest.raises(InputError, match="shared_decode needs sessions on static caches"):
        DuplexBatch(thinker, tok, tts, voices=[None, None], shared_decode=True)


@requires_cuda
def test_batch_on_cuda_shares_decode_steps_and_matches_the_cpu(tiny_ckpt, parts):
    """On CUDA (fp32, fast paths, ``shared_decode``: sessions on rows of one static decoder with the Triton
    kernels, every decode step of the three conversations one graph replay; the Talker seats' graphs) the
    batch makes the decisions and Talker tokens of each conversation stepped alone on the CPU (passed on
    the H200 in session 42, duplex_cuda_tests_session42_h200.txt)."""
    from minicpmo_rt.runtime.duplex import DuplexBatch, DuplexInput

    thinker, tok, tts = parts
    sp = tok.special
    ids = [sp.listen, sp.speak, WORD, WORD + 1, WORD + 2, sp.chunk_eos, sp.turn_eos]
    cfg = DuplexDecodeConfig(mode="greedy", repetition_penalty=1.0)
    gpu_thinker = Thinker.from_snapshot(tiny_ckpt, device="cuda")
    gpu_head = gpu_thinker.llm.lm_head
    head = thinker.llm.lm_head
    thinker.llm.lm_head, gpu_thinker.llm.lm_head = _ByState(head, ids), _ByState(gpu_head, ids)
    alone = [DuplexConversation(thinker, tok, tts, decode=cfg, seed=i) for i in range(3)]
    batch = DuplexBatch(gpu_thinker, tok, load_talker(tiny_ckpt, device="cuda"), voices=[None] * 3, seeds=[0, 1, 2],
                        decode=cfg, shared_decode=True)
    try:
        assert batch.rows is not None and batch.rows.graphs and batch.talker.graphs > 0
        for k in range(4):
            inputs = [DuplexInput(_audio(1, 10 * k + i)) for i in range(3)]
            for c, x, b in zip(alone, inputs, batch.step(inputs)):
                a = c.step(x.audio)
                assert (a.listen, a.token_ids, a.terminator, a.turn_end) == \
                       (b.listen, b.token_ids, b.terminator, b.turn_end), k
    finally:
        thinker.llm.lm_head = head
        for c in alone:
            c.close()
        batch.close()
