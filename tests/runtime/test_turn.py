"""The turn pipeline on the tiny checkpoint (random weights: the plumbing, not speech)."""

import numpy as np
import pytest
import torch
from torch import nn

from conftest import rel_err
from minicpmo_rt.checkpoint.weights import load_tensors
from minicpmo_rt.errors import InputError
from minicpmo_rt.runtime.contracts import IM_END_ID, TurnRequest
from minicpmo_rt.runtime.turn import SAMPLES_PER_CODE, TurnPipeline, TurnTrace, collect, turn_prompt
from minicpmo_rt.talker.load import load_talker
from minicpmo_rt.talker.sampler import SamplingParams
from minicpmo_rt.thinker.llm import final_norm_hidden




@pytest.fixture(scope="module")
def pipe(tiny_ckpt):
    return TurnPipeline.from_snapshot(tiny_ckpt, capacity=2, n_timesteps=2,
                                      talker_params=SamplingParams(min_codes=5))


def test_load_talker_is_strict_and_exact(tiny_ckpt):
    tts = load_talker(tiny_ckpt)
    state = load_tensors(tiny_ckpt, ("tts.",))
    got = tts.state_dict()
    assert set(got) == {k[len("tts."):] for k in state}
    assert all(torch.equal(got[k[len("tts."):]], v.float()) for k, v in state.items())
    rot = tts.model.rotary_emb
    fresh = type(rot)(rot.config)
    assert torch.equal(rot.inv_freq, fresh.inv_freq)


class _StopAt(nn.Module):
    """The real LM head, except that its ``at``-th call puts <|im_end|> on top."""

    def __init__(self, head: nn.Module, at: int):
        super().__init__()
        self.head, self.at, self.calls = head, at, 0

    def forward(self, h):
        out = self.head(h)
        self.calls += 1
        if self.calls == self.at:
            out = out.clone()
            out[..., IM_END_ID] = out.max() + 100.0
        return out


def test_terminator_row_never_reaches_the_talker(pipe):
    # Call 1 is the prefill, calls 2.. follow each fed token: the 4th sample is <|im_end|>.
    llm = pipe.thinker.llm
    head = llm.lm_head
    llm.lm_head = _StopAt(head, at=4)
    try:
        req = TurnRequest.make("stop", "Hello there, who are you?", seed=3, max_new_tokens=8, max_codes=12)
        trace = TurnTrace()
        codes = pipe.codes([req], trace)["stop"]
    finally:
        llm.lm_head = head
    steps = trace.steps["stop"]
    assert [s.is_terminator for s in steps] == [False] * 3 + [True] and steps[-1].token_id == IM_END_ID
    assert steps[-1].hidden is None
    talker_req = trace.talker_requests["stop"]
    assert talker_req.text_ids.tolist() == [s.token_id for s in steps[:3]]
    assert torch.equal(talker_req.hidden, torch.stack([s.hidden for s in steps[:3]]))
    # Independent: one full forward over prompt + the 3 fed tokens; row i = token i's own position.
    prompt = list(turn_prompt(pipe.builder, req.messages).ids)
    ids = prompt + talker_req.text_ids.tolist()
    assert [s.position for s in steps] == list(range(len(prompt), len(ids) + 1))
    with torch.no_grad():
        h, _ = final_norm_hidden(llm, llm.model.embed_tokens(torch.tensor([ids])))
    err = rel_err(talker_req.hidden, h[0, len(prompt):])
    assert err < 1e-5, err
    assert 0 < len(codes) <= 12 and all(0 <= c < 6561 for c in codes)
    assert not pipe.talker.slots and not pipe.talker.pending


def test_respond_streams_960_samples_per_code_in_order(pipe, voice):
    trace = TurnTrace()
    chunks = list(pipe.respond("Tell me a story.", voice, request_id="one", seed=1, max_new_tokens=6,
                               max_codes=30, trace=trace))
    assert [c.seq for c in chunks] == list(range(len(chunks))) and len(chunks) >= 2
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    wav = collect(chunks)["one"]
    codes = trace.codes("one")
    assert 5 <= len(codes) <= 30 and wav.shape == (len(codes) * SAMPLES_PER_CODE,)
    assert np.isfinite(wav).all() and np.abs(wav).max() > 0
    # The stream equals Code2Wav's own streamed decode of the same codes (same windows).
    prof = pipe.profile.talker
    ref = pipe.code2wav.stream_codes(codes, voice, window=prof.window, first_window=prof.first_window)
    assert np.array_equal(wav, ref)
    # respond_waveform: the same turn (same seed) as one array
    whole = pipe.respond_waveform("Tell me a story.", voice, request_id="two", seed=1, max_new_tokens=6, max_codes=30)
    assert whole.dtype == np.float32 and np.array_equal(whole, wav)


def test_two_requests_in_one_batch_equal_each_alone(pipe, voice):
    """Two requests share the Talker's decode steps and Code2Wav's calls: each round's chunks go to
    ``push_many`` together (one flow solve and HiFT call for both streams where their shapes agree).
    Codes are identical to each request alone; the waveforms are identical with per-stream pushes
    (``batch_code2wav=False``) and within FP32 reordering (1e-5: the batched GEMMs block rows
    differently, over the flow's Euler steps) with the batched ones."""
    reqs = [TurnRequest.make("a", "What is the weather like?", voice, seed=11, max_new_tokens=5, max_codes=28),
            TurnRequest.make("b", [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Name a colour."}], voice, seed=12,
                             max_new_tokens=7, max_codes=20)]
    c2w = pipe.code2wav
    calls = []
    push_many = c2w.push_many

    def spy(items, *a, **k):
        calls.append([s for s, _, _ in items])
        return push_many(items, *a, **k)

    c2w.push_many = spy
    try:
        together_trace = TurnTrace()
        together = list(pipe.run(reqs, together_trace))
    finally:
        del c2w.push_many
    # The two requests shared decode steps (both slots live), and their chunks interleave.
    assert {c.request_id for c in together} == {"a", "b"}
    assert calls and all(len(c) == 2 for c in calls)    # every round with both requests' chunks: one call
    pipe.batch_code2wav = False
    try:
        apart = collect(list(pipe.run(reqs)))
    finally:
        pipe.batch_code2wav = True
    both = collect(together)
    for r in reqs:
        alone_trace = TurnTrace()
        alone = collect(list(pipe.run([r], alone_trace)))[r.request_id]
        assert together_trace.codes(r.request_id) == alone_trace.codes(r.request_id)
        assert np.array_equal(apart[r.request_id], alone), r.request_id
        assert both[r.request_id].shape == alone.shape
        err = rel_err(torch.from_numpy(both[r.request_id]), torch.from_numpy(alone))
        assert err < 1e-5, r.request_id
    assert not pipe.talker.slots


def test_bad_requests_are_named(pipe, voice, tmp_path):
    with pytest.raises(InputError, match="reference audio not found"):
        list(pipe.respond("hi", tmp_path / "missing.wav"))
    with pytest.raises(InputError, match="user text is empty"):
        pipe.respond("  ", voice)
    r = TurnRequest.make("dup", "hi", voice)
    with pytest.raises(InputError, match="used twice"):
        pipe.run([r, r])
    with pytest.raises(InputError, match="turn-mode profile"):
        TurnPipeline.from_snapshot("/nonexistent", profile="minicpmo_4_5_duplex_h200")
    with pytest.raises(InputError, match="can never fit"):
        pipe.codes([TurnRequest.make("big", "hi", max_new_tokens=2, max_codes=10 ** 7)])
    assert not pipe.talker.slots and not pipe.talker.pending


def test_abandoned_stream_frees_its_slot(pipe, voice):
    it = pipe.respond("Go on.", voice, request_id="quit", seed=2, max_new_tokens=4, max_codes=60)
    first = next(it)
    assert first.seq == 0
    it.close()
    assert not pipe.talker.slots and not pipe.talker.pending


def test_static_kv_thinker_path_matches_plain_path(pipe):
    from minicpmo_rt.thinker.decode import StaticDecoder
    from minicpmo_rt.thinker.generate import SamplingConfig

    greedy = SamplingConfig(greedy=True, max_new_tokens=6)
    plain = TurnPipeline(pipe.thinker, pipe.tokenizer, pipe.talker, None, pipe.profile, greedy)
    fast = TurnPipeline(pipe.thinker, pipe.tokenizer, pipe.talker, None, pipe.profile, greedy,
                        decoder=StaticDecoder(pipe.thinker.llm, 96, kernels="torch"))
    req = TurnRequest.make("s", "Count to three.", seed=0)
    a = [s for chunk in plain.think(req) for s in chunk]
    b = [s for chunk in fast.think(req) for s in chunk]
    assert [s.token_id for s in a] == [s.token_id for s in b] and len(a) == 6
    assert [s.position for s in a] == [s.position for s in b]
    err = rel_err(torch.stack([s.hidden for s in b]), torch.stack([s.hidden for s in a]))
    assert err < 1e-5, err
    with pytest.raises(InputError, match="static cache"):
        list(fast.think(TurnRequest.make("t", "Count to three.", max_new_tokens=90)))


def test_copied_step_outlives_static_buffers():
    """A CUDA-graph step returns views of static buffers that the next replay overwrites."""
    from minicpmo_rt.runtime.turn import _CopiedStep

    hbuf, lbuf = torch.zeros(1, 4), torch.zeros(1, 10)

    def graph_like(token):
        hbuf.fill_(token)
        lbuf.fill_(token)
        return hbuf, lbuf

    step = _CopiedStep(graph_like)
    rows = [step(t)[0] for t in (1, 2, 3)]
    assert [float(r[0, 0]) for r in rows] == [1.0, 2.0, 3.0]


def test_prepare_voice_solves_the_prompt_at_load(tiny_ckpt, voice):
    """``prepare_voice`` runs ``Code2Wav.prepare`` while loading: the voice's prompt state is solved (and,
    on CUDA, its graphs captured; none exist on CPU), so no first stream waits for it."""
    pipe = TurnPipeline.from_snapshot(tiny_ckpt, capacity=1, n_timesteps=2, prepare_voice=voice)
    c2w = pipe.code2wav
    assert c2w.prompts.solves == 1 and not c2w.precapture_pending
    c2w.open_stream(voice).close()
    assert c2w.prompts.solves == 1


def test_warm_up_answers_short_turns_and_leaves_later_answers_as_they_were(tiny_ckpt, voice):
    """``TurnPipeline.warm_up`` answers short turns at each batch size; a request answered afterwards gets
    the codes and audio a fresh pipeline gives it (nothing of the warm-up turns stays behind)."""
    warm = TurnPipeline.from_snapshot(tiny_ckpt, capacity=2, n_timesteps=2)
    fresh = TurnPipeline.from_snapshot(tiny_ckpt, capacity=2, n_timesteps=2)
    with pytest.raises(InputError, match="batches"):
        warm.warm_up(voice, batches=(1, 0))
    with pytest.raises(InputError, match="tokens"):
        warm.warm_up(voice, tokens=0)
    took = warm.warm_up(voice, batches=(1, 2, 2), codes=6)
    assert list(took) == [1, 2] and all(t > 0 for t in took.values())
    reqs = [TurnRequest.make(f"r{i}", "Say something.", voice, seed=3 + i, max_new_tokens=5, max_codes=30)
            for i in range(2)]
    got = [(warm.codes(reqs), collect(list(warm.run(reqs)))), (fresh.codes(reqs), collect(list(fresh.run(reqs))))]
    assert got[0][0] == got[1][0] and all(len(c) > 0 for c in got[0][0].values())
    for rid, pcm in got[1][1].items():
        assert got[0][1][rid].shape == pcm.shape and np.allclose(got[0][1][rid], pcm, rtol=0, atol=1e-6)


def test_progress_reports_tokens_then_codes(pipe):
    """``progress`` hears the Thinker's token count after each generation chunk, then the Talker's code count
    after each codec chunk: counts rise, the last of each equals what the trace holds, every Thinker event
    comes before the first Talker one."""
    seen: list[tuple[str, str, int]] = []
    req = TurnRequest.make("p", "Count with me.", seed=5, max_new_tokens=7, max_codes=20)
    trace = TurnTrace()
    codes = pipe.codes([req], trace, progress=lambda *e: seen.append(e))["p"]
    stages = [e[0] for e in seen]
    assert stages == sorted(stages, key=["thinker", "talker"].index) and {"thinker", "talker"} == set(stages)
    assert all(rid == "p" for _, rid, _ in seen)
    for stage in ("thinker", "talker"):
        counts = [n for s, _, n in seen if s == stage]
        assert counts == sorted(counts) and counts[0] > 0
    assert [n for s, _, n in seen if s == "thinker"][-1] == sum(not s.is_terminator for s in trace.steps["p"])
    assert [n for s, _, n in seen if s == "talker"][-1] == len(codes) > 0


def test_thinker_rows_decode_requests_together_as_each_alone(pipe, voice):
    """``think_rows``: three requests on two rows of one static decoder (the third takes a row when one
    frees), every decode step one forward for the live rows. Each request draws the same tokens as
    ``think`` alone (its own seed, sampling and history) with hidden rows within FP32 reordering, and the
    Talker makes the same codes from them."""
    from minicpmo_rt.thinker.llm_cache import StaticRows

    reqs = [TurnRequest.make("r0", "What is the weather like?", voice, seed=21, max_new_tokens=6, max_codes=12),
            TurnRequest.make("r1", "Name a colour.", voice, seed=22, max_new_tokens=11, max_codes=12),
            TurnRequest.make("r2", "Count to three.", voice, seed=23, max_new_tokens=4, max_codes=12)]
    alone_trace = TurnTrace()
    alone = pipe.codes(reqs, alone_trace)
    rows = StaticRows(pipe.thinker, 2, 256, kernels="torch")
    steps_seen = []
    forward = rows.step_logits
    rows.step_logits = lambda feeds: (steps_seen.append(sorted(feeds)), forward(feeds))[1]
    pipe.rows = rows
    try:
        trace = TurnTrace()
        together = pipe.codes(reqs, trace)
    finally:
        pipe.rows = None
    assert together == alone
    for r in reqs:
        a, b = alone_trace.steps[r.request_id], trace.steps[r.request_id]
        assert [(s.token_id, s.position, s.text, s.is_terminator) for s in b] == \
               [(s.token_id, s.position, s.text, s.is_terminator) for s in a]
        h = [s.hidden for s in a if s.hidden is not None]
        assert rel_err(torch.stack([s.hidden for s in b if s.hidden is not None]), torch.stack(h)) < 1e-5
    assert max(len(f) for f in steps_seen) == 2 and [0, 1] in steps_seen     # two requests per forward
    assert len(rows._free) == 2                                               # every row handed back


def test_thinker_rows_end_on_a_terminator_and_free_the_row(pipe, voice):
    """A row whose draw is a turn terminator ends its request there (the terminator step carries no hidden
    row and never reaches the Talker) and its row is free for the next request."""
    from minicpmo_rt.thinker.llm_cache import StaticRows

    class _EndInRows(nn.Module):      # <|im_end|> on top of every row of a batched rows step
        def __init__(self, head):
            super().__init__()
            self.head, self.armed = head, False

        def forward(self, h):
            out = self.head(h)
            if self.armed:
                out = out.clone()
                out[..., IM_END_ID] = out.max() + 100.0
            return out

    llm = pipe.thinker.llm
    head = llm.lm_head
    llm.lm_head = _EndInRows(head)
    rows = StaticRows(pipe.thinker, 2, 256, kernels="torch")
    forward = rows.step_logits

    def armed(feeds):
        llm.lm_head.armed = True
        try:
            return forward(feeds)
        finally:
            llm.lm_head.armed = False

    rows.step_logits = armed
    pipe.rows = rows
    try:
        reqs = [TurnRequest.make(f"t{i}", "Hello there.", voice, seed=i, max_new_tokens=8, max_codes=10)
                for i in range(3)]
        trace = TurnTrace()
        pipe.codes(reqs, trace)
    finally:
        pipe.rows = None
        llm.lm_head = head
    for r in reqs:
        steps = trace.steps[r.request_id]
        assert [s.is_terminator for s in steps] == [False, True] and steps[-1].token_id == IM_END_ID
        assert steps[-1].hidden is None and len(trace.talker_inputs[r.request_id].token_ids) == 1
    assert len(rows._free) == 2


def _omni_request(rid: str, seed: int, voice=None, words: str = "What do you see and hear?"):
    """A user message of an image, 1.5 s of sound and words (random pixels and noise: the tiny model only
    needs the plumbing)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = Image.fromarray((rng.random((120, 200, 3)) * 255).astype(np.uint8))
    audio = (rng.standard_normal(24000) * 0.1).astype(np.float32)
    return TurnRequest.make(rid, [{"role": "user", "content": [image, audio, words]}], voice, seed=seed,
                            max_new_tokens=5, max_codes=10), image, audio


def test_spoken_and_pictured_turn_feeds_the_encodings_in_their_placeholders(pipe):
    """A user message of an image, a recording and words: the prompt is upstream's ``streaming_prefill`` layout
    (omni mode: the parts joined with nothing between them), the image as ``<image>`` + 64 ``<unk>`` +
    ``</image>`` and the 1.5 s of audio as ``<|audio_start|>`` + 15 ``<unk>`` + ``<|audio_end|>`` (written out
    here by hand; the official layout is checked in test_official_parity), and the Thinker's hidden rows equal one
    full forward over those
    ids with the encodings (the whole recording through the encoder with full attention) scattered into the
    ``<unk>`` runs by hand."""
    from minicpmo_rt.thinker.prompt import DEFAULT_SYSTEM_PROMPT, UNK_ID

    req, image, audio = _omni_request("omni", 4)
    trace = TurnTrace()
    pipe.codes([req], trace)
    th, tok = pipe.thinker, pipe.tokenizer
    text = (f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
            f"<image>{'<unk>' * 64}</image><|audio_start|>{'<unk>' * 15}<|audio_end|>What do you see and hear?")
    prompt = tok.encode(text) + list(pipe.builder.assistant_bos().ids)
    assert list(turn_prompt(pipe.builder, req.messages).ids) == prompt
    ids = prompt + list(trace.talker_requests["omni"].text_ids.tolist())
    unk = [i for i, t in enumerate(ids) if t == UNK_ID]
    assert len(unk) == 64 + 15
    with torch.no_grad():
        embeds = th.llm.model.embed_tokens(torch.tensor(ids)).clone()
        embeds[unk[:64]] = th.embed_image(np.asarray(image))[0]
        embeds[unk[64:]] = th.embed_audio(audio, chunk_length=None)
        h, _ = final_norm_hidden(th.llm, embeds[None])
    steps = [s for s in trace.steps["omni"] if s.hidden is not None]
    assert [s.position for s in steps] == list(range(len(prompt), len(ids)))
    err = rel_err(torch.stack([s.hidden for s in steps]), h[0, len(prompt):])
    assert err < 1e-5, err
    # the same words without the picture and the sound make another prompt and other hidden rows
    words = TurnRequest.make("words", "What do you see and hear?", seed=4, max_new_tokens=5, max_codes=10)
    plain = TurnTrace()
    pipe.codes([words], plain)
    assert rel_err(plain.steps["words"][0].hidden, steps[0].hidden) > 1e-2


def test_the_first_recording_is_front_padded_to_1035_ms_as_upstream_feeds_it(pipe):
    """Upstream's ``streaming_prefill`` pads the session's first audio with zeros on the left to 1035 ms (16560
    samples) and no later one: a 0.5-s question after a 0.5-s clip in an earlier message takes 5 positions, the
    clip 10, and the clip's encoding is that of the padded samples."""
    from minicpmo_rt.runtime.contracts import AudioPart
    from minicpmo_rt.runtime.turn import fed_audio

    rng = np.random.default_rng(11)
    clip, question = (rng.standard_normal((2, 8000)) * 0.1).astype(np.float32)
    req = TurnRequest.make("pad", [{"role": "user", "content": [clip, "Remember this."]},
                                   {"role": "assistant", "content": "OK."},
                                   {"role": "user", "content": [AudioPart(question)]}])
    fed = fed_audio(req.messages)
    assert [x.size for x in fed] == [16560, 8000]
    assert not fed[0][:8560].any() and np.array_equal(fed[0][8560:], clip) and np.array_equal(fed[1], question)
    piece = turn_prompt(pipe.builder, req.messages)
    assert [s.length for s in piece.slots if s.kind == "audio"] == [10, 5]


def test_the_encoders_of_a_turns_media_run_without_cudnn_attention(pipe, monkeypatch):
    """A recording's and a picture's encoder calls have lengths that follow the input, so they run with cuDNN's
    SDPA backend off (a new cuDNN plan per shape costs 36-60 ms on the H200), and the flag is restored after."""
    seen = []
    th = pipe.thinker
    for name in ("embed_audio", "embed_image"):
        real = getattr(th, name)
        monkeypatch.setattr(th, name, lambda *a, _real=real, _n=name, **k: (
            seen.append((_n, torch.backends.cuda.cudnn_sdp_enabled())), _real(*a, **k))[1])
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert before           # torch's default: the check below can fail
    req, _, _ = _omni_request("cudnn", 1)
    pipe._prompt(req)
    assert sorted(seen) == [("embed_audio", False), ("embed_image", False)]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_thinker_rows_take_spoken_turns_as_think_does(pipe, voice):
    """``think_rows`` prefills a request with an image and audio in its row (beside a text-only one, in one
    forward) and decodes the same tokens with the same hidden rows as ``think`` alone."""
    from minicpmo_rt.thinker.llm_cache import StaticRows

    reqs = [_omni_request("m0", 7, voice)[0],
            TurnRequest.make("m1", "Name a colour.", voice, seed=8, max_new_tokens=6, max_codes=10)]
    alone = TurnTrace()
    codes = pipe.codes(reqs, alone)
    pipe.rows = StaticRows(pipe.thinker, 2, 512, kernels="torch")
    try:
        together = TurnTrace()
        assert pipe.codes(reqs, together) == codes
    finally:
        pipe.rows = None
    for r in reqs:
        a, b = alone.steps[r.request_id], together.steps[r.request_id]
        assert [(s.token_id, s.position) for s in b] == [(s.token_id, s.position) for s in a]
        assert rel_err(torch.stack([s.hidden for s in b if s.hidden is not None]),
                       torch.stack([s.hidden for s in a if s.hidden is not None])) < 1e-5


@pytest.mark.parametrize("on_rows", [False, True])
def test_requests_that_join_a_run_in_progress_get_their_solo_answers(pipe, voice, on_rows):
    """``run(admit=...)``: one request starts the run, a second joins at the 3rd step and a third once the first
    has its first codec chunk, while it is still speaking (on two Thinker rows the third waits for a free one).
    Each request's codes are its solo run's, its audio within the batched Code2Wav's FP32 reordering of its solo
    audio, and the run ends once all three are done."""
    from minicpmo_rt.thinker.llm_cache import StaticRows

    reqs = [TurnRequest.make(f"j{i}", text, voice, seed=30 + i, max_new_tokens=5, max_codes=40)
            for i, text in enumerate(["Tell me a story.", "Name a colour.", "Count to three."])]
    solo = {}
    for r in reqs:
        trace = TurnTrace()
        solo[r.request_id] = (collect(list(pipe.run([r], trace)))[r.request_id], trace.codes(r.request_id))
    calls, joined, trace = [], [], TurnTrace()

    def admit():
        calls.append(len(calls))
        if len(calls) == 3:
            return [reqs[1]]
        if trace.chunks.get("j0") and reqs[2] not in calls:
            calls.append(reqs[2])
            joined.append(not any(c.final for c in trace.chunks["j0"]))     # j0 still speaking
            return [reqs[2]]
        return []

    pipe.rows = StaticRows(pipe.thinker, 2, 256, kernels="torch") if on_rows else None
    try:
        chunks = list(pipe.run(reqs[:1], trace, admit=admit))
    finally:
        pipe.rows = None
    wavs = collect(chunks)
    assert joined == [True]
    for r in reqs:
        wav, codes = solo[r.request_id]
        assert trace.codes(r.request_id) == codes
        assert wavs[r.request_id].shape == wav.shape
        assert rel_err(torch.from_numpy(wavs[r.request_id]), torch.from_numpy(wav)) < 1e-5
    assert reqs[2] in calls and not pipe.talker.slots and not pipe.talker.pending


def _join_while_speaking(pipe, voice, clock_after_join=None):
    """l0 speaks; l1 joins once l0's first PCM is out, on Thinker rows (which tick once per decode step). Returns
    (the run's events: "T" per Talker step, ("join", id), ("submit", id) when a request's text is done; the codes
    of both; their audio)."""
    from minicpmo_rt.thinker.llm_cache import StaticRows

    reqs = [TurnRequest.make(f"l{i}", text, voice, seed=40 + i, max_new_tokens=6, max_codes=45)
            for i, text in enumerate(["Tell me a story.", "Name a colour."])]
    events, trace, now = [], TurnTrace(), [0.0]
    eng = pipe.talker
    real_step, real_submit = eng.step, eng.submit

    def step():
        events.append("T")
        return real_step()

    def submit(r):
        events.append(("submit", r.request_id))
        return real_submit(r)

    def admit():
        if trace.chunks.get("l0") and ("join", "l1") not in events:
            events.append(("join", "l1"))
            if clock_after_join is not None:
                now[0] = clock_after_join
            return [reqs[1]]
        return []

    clock, pipe.clock = pipe.clock, lambda: now[0]      # frozen unless the test moves it: no lead runs out by itself
    eng.step, eng.submit = step, submit
    pipe.rows = StaticRows(pipe.thinker, 2, 256, kernels="torch")
    try:
        wavs = collect(list(pipe.run(reqs[:1], trace, admit=admit)))
    finally:
        del eng.step, eng.submit
        pipe.rows, pipe.clock = None, clock
    return events, {r.request_id: trace.codes(r.request_id) for r in reqs}, wavs


def _talker_steps_while_joining(events, rid="l1"):
    return events[events.index(("join", rid)):events.index(("submit", rid))].count("T")


def test_a_joiner_thinks_at_the_thinkers_pace_while_the_others_are_ahead(pipe, voice):
    """``talker_lead_s``: a request that joins while another speaks gets its whole text before the Talker steps
    again, as long as the speaker's audio stays that far ahead of the (here frozen) clock; once the clock has moved
    past the speaker's lead, the Talker steps between the joiner's tokens as without it. Either way each request's
    codes and audio are those of the plain schedule."""
    plain = _join_while_speaking(pipe, voice)
    assert _talker_steps_while_joining(plain[0]) >= 4         # one Talker step per Thinker step
    pipe.talker_lead_s = 0.5
    try:
        led = _join_while_speaking(pipe, voice)
        late = _join_while_speaking(pipe, voice, clock_after_join=60.0)
    finally:
        pipe.talker_lead_s = None
    assert _talker_steps_while_joining(led[0]) == 0
    assert _talker_steps_while_joining(late[0]) == _talker_steps_while_joining(plain[0])
    # the joiner reaches the Talker sooner, so the two share more of its steps
    assert led[0].count("T") < plain[0].count("T") == late[0].count("T")
    for events, codes, wavs in (led, late):
        assert codes == plain[1] and all(codes.values())
        for rid, wav in plain[2].items():
            assert rel_err(torch.from_numpy(wavs[rid]), torch.from_numpy(wav)) < 1e-5
    assert not pipe.talker.slots and not pipe.talker.pending


def test_talker_lead_must_be_a_duration(tiny_ckpt):
    with pytest.raises(InputError, match="talker_lead_s must be >= 0"):
        TurnPipeline.from_snapshot(tiny_ckpt, with_code2wav=False, talker_lead_s=-1.0)


def test_a_request_that_joins_with_a_taken_id_is_refused(pipe, voice):
    req = TurnRequest.make("same", "Hello.", voice, seed=1, max_new_tokens=3, max_codes=10)
    with pytest.raises(InputError, match="used twice"):
        list(pipe.run([req], admit=lambda: [req]))
    assert not pipe.talker.slots and not pipe.talker.pending


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pipeline_defaults_match_the_plain_path(tiny_ckpt):
    """On CUDA, ``from_snapshot`` decodes the Thinker on shared rows (Triton kernels, CUDA graphs) and the
    Talker from per-bucket graphs; the same requests give the same tokens and codes as the single-request
    static decoder with an eager Talker. Either way the Thinker's hidden rows reach the Talker on the GPU
    (``TalkerInput``: the Thinker's device), and from the shared rows as from the plain decoder."""
    kw = dict(device="cuda", with_code2wav=False, capacity=2, talker_params=SamplingParams(min_codes=5),
              thinker_max_len=512)
    fast = TurnPipeline.from_snapshot(tiny_ckpt, **kw)
    plain = TurnPipeline.from_snapshot(tiny_ckpt, thinker_rows=0, talker_graph=False, **kw)
    assert fast.rows is not None and fast.talker._graphs and plain.rows is None and not plain.talker._graphs
    reqs = [TurnRequest.make(f"g{i}", q, seed=30 + i, max_new_tokens=9, max_codes=40)
            for i, q in enumerate(("What is the weather like?", "Name a colour.", "Count to three."))]
    a, b = TurnTrace(), TurnTrace()
    assert fast.codes(reqs, a) == plain.codes(reqs, b)
    for r in reqs:
        assert [s.token_id for s in a.steps[r.request_id]] == [s.token_id for s in b.steps[r.request_id]]
        for trace in (a, b):
            assert trace.talker_inputs[r.request_id].hidden.is_cuda
            assert all(s.hidden.is_cuda for s in trace.steps[r.request_id] if s.hidden is not None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pipeline_takes_spoken_and_pictured_turns(tiny_ckpt):
    """On CUDA a request with a picture and a recording (encoded on the GPU, written into its prompt's slots)
    decodes on the shared rows as on the single-request static decoder, beside a text-only request."""
    kw = dict(device="cuda", with_code2wav=False, capacity=2, talker_params=SamplingParams(min_codes=5),
              thinker_max_len=512)
    fast = TurnPipeline.from_snapshot(tiny_ckpt, **kw)
    plain = TurnPipeline.from_snapshot(tiny_ckpt, thinker_rows=0, talker_graph=False, **kw)
    reqs = [_omni_request("m0", 7)[0], TurnRequest.make("m1", "Name a colour.", seed=8, max_new_tokens=6,
                                                        max_codes=20)]
    piece, embeds = fast._prompt(reqs[0])
    assert embeds.is_cuda and embeds.shape[0] == len(piece)
    a, b = TurnTrace(), TurnTrace()
    assert fast.codes(reqs, a) == plain.codes(reqs, b)
    for r in reqs:
        assert [s.token_id for s in a.steps[r.request_id]] == [s.token_id for s in b.steps[r.request_id]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_talker_on_its_own_stream_gives_the_same_codes(tiny_ckpt):
    """``talker_side_stream``: with the stages overlapped, the Talker's admissions and steps run on a stream of their
    own beside the Thinker's rows; every request's tokens and codes are those of the one-stream schedule, and the
    caller's stream is ordered after the Talker's last step."""
    kw = dict(device="cuda", with_code2wav=False, capacity=2, talker_params=SamplingParams(min_codes=5),
              thinker_max_len=512, overlap_stages=True)
    pipe = TurnPipeline.from_snapshot(tiny_ckpt, **kw)
    reqs = [TurnRequest.make(f"s{i}", q, seed=50 + i, max_new_tokens=n, max_codes=40)
            for i, (q, n) in enumerate((("Hello!", 3), ("Tell me a story.", 30), ("Why?", 24)))]
    one, two = TurnTrace(), TurnTrace()
    want = pipe.codes(reqs, one)
    pipe.talker_side_stream = True
    got = pipe.codes(reqs, two)
    assert pipe._side is not None and pipe._side != torch.cuda.current_stream()
    assert got == want and all(want.values())
    for r in reqs:
        assert [s.token_id for s in two.steps[r.request_id]] == [s.token_id for s in one.steps[r.request_id]]
    assert not pipe.talker.slots and not pipe.talker.pending


@pytest.mark.parametrize("on_rows", [False, True])
def test_overlapped_stages_give_each_request_its_own_codes_and_start_the_talker_early(pipe, voice, on_rows):
    """``overlap_stages``: a request enters the Talker as soon as its text is done, and Talker steps run
    between the Thinker's (one request after another, or on shared rows with a third request waiting for
    a row). The codes and Thinker steps are those of the stages run one after the other; the audio is
    within FP32 reordering (the Code2Wav rounds group the streams differently); the Talker emits its
    first chunk before the Thinker's last token."""
    from minicpmo_rt.thinker.llm_cache import StaticRows

    reqs = [TurnRequest.make(f"o{i}", q, voice, seed=40 + i, max_new_tokens=n, max_codes=30)
            for i, (q, n) in enumerate((("Hello!", 3), ("Tell me a story.", 40), ("Why?", 36)))]
    if on_rows:
        pipe.rows = StaticRows(pipe.thinker, 2, 256, kernels="torch")
    try:
        want_trace = TurnTrace()
        want = collect(list(pipe.run(reqs, want_trace)))
        events = []
        pipe.overlap_stages = True
        got_trace = TurnTrace()
        got = collect(list(pipe.run(reqs, got_trace, progress=lambda stage, rid, n: events.append(stage))))
    finally:
        pipe.overlap_stages = False
        rows, pipe.rows = pipe.rows, None
    for r in reqs:
        rid = r.request_id
        assert got_trace.codes(rid) == want_trace.codes(rid)
        assert [s.token_id for s in got_trace.steps[rid]] == [s.token_id for s in want_trace.steps[rid]]
        assert got[rid].shape == want[rid].shape
        assert rel_err(torch.from_numpy(got[rid]), torch.from_numpy(want[rid])) < 1e-5, rid
    assert events.index("talker") < len(events) - 1 - events[::-1].index("thinker")
    assert not pipe.talker.slots and not pipe.talker.pending
    if on_rows:
        assert len(rows._free) == 2


def test_overlapped_stages_name_a_request_that_never_fits_and_leave_nothing_behind(pipe, voice):
    from minicpmo_rt.thinker.llm_cache import StaticRows

    reqs = [TurnRequest.make("fits", "Hello!", voice, seed=1, max_new_tokens=3, max_codes=30),
            TurnRequest.make("huge", "Hello!", voice, seed=2, max_new_tokens=3, max_codes=10 ** 7)]
    pipe.rows, pipe.overlap_stages = StaticRows(pipe.thinker, 2, 256, kernels="torch"), True
    try:
        with pytest.raises(InputError, match="can never fit"):
            pipe.codes(reqs)
        rows = pipe.rows
    finally:
        pipe.rows, pipe.overlap_stages = None, False
    assert not pipe.talker.slots and not pipe.talker.pending and len(rows._free) == 2
