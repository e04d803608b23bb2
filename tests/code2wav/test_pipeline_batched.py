"""Batched decoding: several streams' chunks in one flow solve equal each stream pushed alone."""

import numpy as np
import pytest
import torch

from minicpmo_rt.code2wav.flow import split_flow_cache, stack_flow_caches
from minicpmo_rt.code2wav.pipeline import Code2Wav
from minicpmo_rt.errors import InputError

SIL = [4218] * 3



def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _payloads(seed: int, windows=(25, 25, 25, 25, 10)):
    """3 context + window codes per chunk; the last window goes out as a final payload.
    Four 25-code chunks take the caches past prompt + 100 frames (the trimmed steady state)."""
    codes = [int(x) for x in np.random.default_rng(seed).integers(0, 6561, sum(windows))]
    out, ctx, i = [], SIL, 0
    for k, w in enumerate(windows):
        payload = ctx + codes[i:i + w]
        i += w
        out.append((payload, k == len(windows) - 1))
        ctx = payload[-3:]
    return out


def _same_audio(got, alone, tag) -> None:
    """Each stream's PCM chunks (``got[j]``) equal those of the stream pushed alone within 1e-5."""
    for j in range(len(alone)):
        assert len(got[j]) == len(alone[j])
        for k, (a, b) in enumerate(zip(got[j], alone[j])):
            assert a.shape == b.shape and np.abs(b).max() > 0
            assert _rel(a, b) <= 1e-5, (tag, j, k, _rel(a, b))


class StageSpy:
    """Stands in for a vocoder's runner: records (op, batch rows) of every HiFT stage call, runs
    it on the model, and raises on call ``fail_on`` (1-based) if given."""

    def __init__(self, model, fail_on=None):
        self.model, self.calls, self.fail_on = model, [], fail_on

    def __getattr__(self, name):
        fn = getattr(self.model, name)

        def call(*args, **kw):
            self.calls.append((name[len("run_"):], args[0].shape[0]))
            if self.fail_on is not None and len(self.calls) == self.fail_on:
                raise RuntimeError("injected vocoder failure")
            return fn(*args, **kw)
        return call


@pytest.fixture(scope="module", params=["reference", "fused"])
def c2w(request, tiny_ckpt):
    extra = {"cfm_fused_body": True} if request.param == "fused" else None
    c2w = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra=extra)
    assert (c2w.flow.chunk_solver is not None) == (request.param == "fused")
    if request.param == "fused":
        # The fused body's torch formulation + SDPA (the CPU fallback): the Triton stages under
        # TRITON_INTERPRET cost ~9 s a chunk here and have their own tests (test_fused_dit).
        c2w.flow.chunk_solver.fused.use_triton = False
    return c2w


def test_batched_streams_equal_streams_pushed_alone(c2w, voice):
    plans = [_payloads(seed) for seed in (11, 12, 13)]
    alone = []
    for plan in plans:
        s = c2w.open_stream(voice)
        alone.append([s.push(p, last) for p, last in plan])
    streams = [c2w.open_stream(voice) for _ in plans]
    calls, joined = [], []
    real, joint = c2w.flow.inference_chunk_many, c2w.flow.inference_chunks_joined

    def spy(token, *a, **k):
        calls.append(token.shape[0])
        return real(token, *a, **k)

    def spy_joint(parts, *a, **k):
        joined.append([p.token.shape[0] for p in parts])
        return joint(parts, *a, **k)

    c2w.flow.inference_chunk_many, c2w.flow.inference_chunks_joined = spy, spy_joint
    voc = c2w.vocoders.stream
    voc.runner = stages = StageSpy(voc.model)
    try:
        batched, frames = [], []
        for k in range(len(plans[0])):
            frames.append(streams[0].cache.estimator_frames)
            batched.append(c2w.push_many([(s, plan[k][0], plan[k][1]) for s, plan in zip(streams, plans)]))
    finally:
        del c2w.flow.inference_chunk_many, c2w.flow.inference_chunks_joined
        voc.runner = voc.model
    # one solve per round, all three rows in it; the final round's through inference_chunks_joined (its encoder
    # half pads: encode_ends), which on the reference body solves through inference_chunk_many
    fused = c2w.flow.joins_widths(c2w.n_timesteps)
    assert joined == [[3]] and calls == [3] * (len(plans[0]) - fused)
    # the vocoding was batched too: the streams stay in step, so every HiFT stage call had 3 rows
    assert stages.calls and {rows for _, rows in stages.calls} == {3}
    assert {op for op, _ in stages.calls} == ({"f0", "excite", "decode"} if voc.variant == "causal" else {"f0", "decode"})
    prompt = streams[0].cache.prompt_frames
    # rounds 4 and 5 start from the trimmed steady cache (prompt + 100 frames)
    assert frames[3:] == [prompt + 100] * 2 and frames[2] == prompt + 100 and frames[1] == prompt + 50
    worst = 0.0
    for j in range(len(plans)):
        for k in range(len(plans[0])):
            a, b = batched[k][j], alone[j][k]
            assert a.shape == b.shape and a.dtype == np.float32
            assert np.abs(b).max() > 0
            worst = max(worst, _rel(a, b))
    print(f"worst PCM rel err batched vs alone: {worst:.3e}")
    assert worst <= 1e-5
    assert all(s.finished for s in streams)
    # rows really differ (different codes): batching did not collapse them onto one stream
    assert _rel(batched[2][0], batched[2][1]) > 1e-2


def test_final_chunks_join_the_steady_solve_of_streams_that_go_on(c2w, voice):
    """Four streams in step; in round 4 (caches at the trimmed steady length) stream 1 sends its final 3 + 10
    codes (26 frames), streams 2 and 3 finals of 3 + 25 and 3 + 23 (56 and 52, wider than a steady chunk's 50)
    while stream 0 goes on with 3 + 25. With ``join_finals`` on the fused body the 26-frame final joins stream
    0's steady solve (its rows padded, attending their own frames only) and the two wide finals join each other
    (the 52-frame one padded to 56): two solves of two rows. The reference body (no rows of their own widths)
    and ``join_finals=False`` solve each shape apart. Every final chunk's encoder half pads
    (``Flow.encode_ends``). Every stream's PCM equals the stream pushed alone, and stream 0 goes on from the
    joined solve's cache."""
    plans = [_payloads(41, (25, 25, 25, 25, 25, 10)), _payloads(42, (25, 25, 25, 10)),
             _payloads(43, (25, 25, 25, 25)), _payloads(44, (25, 25, 25, 23))]
    alone = []
    for plan in plans:
        s = c2w.open_stream(voice)
        alone.append([s.push(p, last) for p, last in plan])
    fused = c2w.flow.joins_widths(c2w.n_timesteps)
    assert fused == (c2w.flow.chunk_solver is not None)
    for join in (True, False):
        c2w.join_finals = join
        streams = [c2w.open_stream(voice) for _ in plans]
        calls, joined = [], []
        many, joint = c2w.flow.inference_chunk_many, c2w.flow.inference_chunks_joined

        def spy_many(token, *a, **k):
            calls.append(token.shape[0])
            return many(token, *a, **k)

        def spy_joint(parts, *a, **k):
            joined.append([(p.token.shape[1], p.last, p.token.shape[0]) for p in parts])
            return joint(parts, *a, **k)

        c2w.flow.inference_chunk_many, c2w.flow.inference_chunks_joined = spy_many, spy_joint
        try:
            got = [[] for _ in plans]
            for k in range(len(plans[0])):
                live = [(j, s) for j, s in enumerate(streams) if k < len(plans[j])]
                outs = c2w.push_many([(s, *plans[j][k]) for j, s in live])
                for (j, _), out in zip(live, outs):
                    got[j].append(out)
        finally:
            c2w.join_finals = True
            del c2w.flow.inference_chunk_many, c2w.flow.inference_chunks_joined
        # every round with a final chunk goes through inference_chunks_joined (the finals' encoder calls pad:
        # encode_ends); the reference body solves each part there through inference_chunk_many
        if join and fused:      # round 4: steady + the narrow final, then the wide finals; round 6: the final
            assert joined == [[(28, False, 1), (13, True, 1)], [(28, True, 1), (26, True, 1)], [(13, True, 1)]]
            assert calls == [4, 4, 4, 1]            # stream 0's steady chunk alone in round 5
        else:
            assert joined == [[(13, True, 1)], [(28, True, 1)], [(26, True, 1)], [(13, True, 1)]]
            assert calls == ([4, 4, 4, 1, 1, 1, 1, 1, 1] if not fused else [4, 4, 4, 1, 1])
        _same_audio(got, alone, join)
        assert all(s.finished for s in streams)


def test_join_starts_groups_first_chunks_with_steady_ones_and_streams_the_same_audio(c2w, voice):
    """``join_starts`` (knob ``cfm_join_starts``): streams starting one round apart (their caches at three
    lengths in round 2: steady, second, first) reach the flow in ONE ``inference_chunks_joined`` call per round
    on the fused body, a part per cache length. Here (CPU, the fused body's SDPA fallback) the solver cannot
    read rows of several lengths in place (``WholeEulerSolver.joins_lengths``), so the flow solves each length
    apart; the direct path's joined solve is ``test_first_and_second_chunks_join_the_steady_direct_solve``. Every
    stream's PCM equals the stream pushed alone, with the knob on and off; the reference body ignores it."""
    plans = [_payloads(51, (25, 25, 25, 10)), _payloads(52, (25, 25, 10)), _payloads(53, (25, 10))]
    alone = []
    for plan in plans:
        s = c2w.open_stream(voice)
        alone.append([s.push(p, last) for p, last in plan])
    fused = c2w.flow.joins_widths(c2w.n_timesteps)
    for join in (True, False):
        c2w.join_starts = join
        streams = [c2w.open_stream(voice) for _ in plans]
        joined = []
        joint = c2w.flow.inference_chunks_joined

        def spy_joint(parts, *a, **k):
            joined.append(sorted(p.caches[0].estimator_frames for p in parts))
            return joint(parts, *a, **k)

        c2w.flow.inference_chunks_joined = spy_joint
        try:
            got = [[] for _ in plans]
            for k in range(len(plans[0])):      # stream j starts in round j, all end in round 3
                live = [(j, s) for j, s in enumerate(streams) if j <= k < j + len(plans[j])]
                outs = c2w.push_many([(s, *plans[j][k - j]) for j, s in live])
                for (j, _), out in zip(live, outs):
                    got[j].append(out)
        finally:
            c2w.join_starts = False
            del c2w.flow.inference_chunks_joined
        p = streams[0].prompt_frames
        if join and fused:      # rounds 1-3 join every length (the flow then splits them, its calls recorded too)
            mixed = [sorted(set(j)) for j in joined if len(set(j)) > 1]
            assert mixed == [[p, p + 50], [p, p + 50, p + 100], [p + 50, p + 100]], joined
        else:       # without the knob (or on the reference body) only round 3's finals, each of its own length
            assert joined and all(len(set(j)) == 1 for j in joined), joined
        _same_audio(got, alone, join)
        assert all(s.finished for s in streams)


def test_inference_chunks_joined_refuses_a_narrow_part_that_is_not_final(c2w, voice):
    """Only a final chunk may solve narrower than the widest part (its padding frames would enter its cache);
    parts with their cache counts and rows out of step are refused by name."""
    from minicpmo_rt.code2wav.flow import ChunkPart

    a, b = c2w.open_stream(voice), c2w.open_stream(voice)
    spk = torch.cat([a.spk, b.spk])
    wide = ChunkPart(torch.randint(0, 6561, (1, 28)), spk[:1], [a.cache])
    with pytest.raises(InputError, match="not final"):
        c2w.flow.inference_chunks_joined([wide, ChunkPart(torch.randint(0, 6561, (1, 13)), spk[1:], [b.cache])])
    with pytest.raises(InputError, match="one cache per row"):
        c2w.flow.inference_chunks_joined([wide, ChunkPart(torch.randint(0, 6561, (1, 13)), spk, [b.cache], True)])
    a.close(), b.close()


def test_mismatched_streams_run_alone_and_match(c2w, voice):
    plan_a, plan_b = _payloads(21), _payloads(22)
    ref = []
    for plan in (plan_a, plan_b):
        s = c2w.open_stream(voice)
        s.push(*plan[0])
        ref.append(s.push(*plan[1]))
    a, b = c2w.open_stream(voice), c2w.open_stream(voice)
    a.push(*plan_a[0])  # a is one chunk ahead: different cache lengths -> separate solves
    calls = []
    real = c2w.flow.inference_chunk
    c2w.flow.inference_chunk = lambda token, *x, **k: (calls.append(token.shape[0]), real(token, *x, **k))[1]
    try:
        out = c2w.push_many([(a, *plan_a[1]), (b, *plan_b[0])])
    finally:
        del c2w.flow.inference_chunk
    assert sorted(calls) == [1, 1]
    assert _rel(out[0], ref[0]) <= 1e-6
    with pytest.raises(InputError, match="more than once"):
        c2w.push_many([(a, *plan_a[2]), (a, *plan_a[2])])
    a.close(), b.close()


def test_failed_vocoding_leaves_every_stream_as_it_was(c2w, voice):
    """A failure inside the batched vocoding (after the flow solve succeeded) rolls back nothing
    half-way: flow caches, vocoder states and the final flag stay as before; a retry then gives
    what pushing each stream alone gives."""
    plans = [_payloads(seed, windows=(25, 25, 10)) for seed in (31, 32)]
    alone = []
    for plan in plans:
        s = c2w.open_stream(voice)
        alone.append([s.push(p, last) for p, last in plan])
    streams = [c2w.open_stream(voice) for _ in plans]
    c2w.push_many([(s, *plan[0]) for s, plan in zip(streams, plans)])
    before = [(s.cache, s.vocoder.snapshot(), s.finished) for s in streams]
    voc = c2w.vocoders.stream
    for fail_on in (1, 4):  # the first HiFT call of the round, and one after state had moved
        voc.runner = StageSpy(voc.model, fail_on=fail_on)
        try:
            with pytest.raises(RuntimeError, match="injected"):
                c2w.push_many([(s, *plan[1]) for s, plan in zip(streams, plans)])
        finally:
            voc.runner = voc.model
        for s, (cache, snap, finished) in zip(streams, before):
            assert s.cache is cache and s.finished == finished
            for k, v in s.vocoder.snapshot().items():
                assert torch.equal(v, snap[k]) if isinstance(v, torch.Tensor) else v == snap[k], k
    for k in (1, 2):
        out = c2w.push_many([(s, *plan[k]) for s, plan in zip(streams, plans)])
        for j in range(len(plans)):
            assert _rel(out[j], alone[j][k]) <= 1e-5
    assert all(s.finished for s in streams)


def test_stack_split_round_trip(c2w, voice):
    caches = [c2w.open_stream(voice).cache for _ in range(2)]
    x = caches[0]
    fake = type(x)(x.conformer_cnn + 1, x.conformer_att + 1, x.estimator_cnn + 1, x.estimator_att + 1,
                   x.prompt_frames)
    st = stack_flow_caches([x, fake])
    assert st.estimator_att.shape[2] == 4
    # [cond rows | uncond rows]: row 1 is the second stream's cond, row 2 the first's uncond
    assert torch.equal(st.estimator_att[:, :, 1], fake.estimator_att[:, :, 0])
    assert torch.equal(st.estimator_att[:, :, 2], x.estimator_att[:, :, 1])
    back = split_flow_cache(st, [1, 1])
    for got, want in zip(back, (x, fake)):
        for name in ("conformer_cnn", "conformer_att", "estimator_cnn", "estimator_att"):
            assert torch.equal(getattr(got, name), getattr(want, name))


@pytest.mark.parametrize("frames", [60, 140, 141])
def test_trim_split_conformer_att_equals_trim_then_split(frames):
    """Each row's trimmed conformer cache cut straight out of the batch (one copy of what it keeps) equals
    trimming the batch and splitting it, bit for bit, rows at their own prompt frames, below the trim length
    (a copy), each row in memory of its own; an odd prompt length (no whole tokens) is refused by name."""
    from minicpmo_rt.code2wav.flow import split_encoder_cache, trim_conformer_att, trim_split_conformer_att
    from minicpmo_rt.code2wav.encoder import EncoderCache

    g = torch.Generator().manual_seed(frames)
    att = torch.randn(5, 3, 2, frames, 8, generator=g)
    prompts = [20, 30, 26]
    got = trim_split_conformer_att(att, prompts, 3, keep=40)
    for i, p in enumerate(prompts):
        want = split_encoder_cache(EncoderCache(torch.zeros(3, 1, 1), trim_conformer_att(att, p, 3, keep=40)),
                                   [1, 1, 1])[i].att
        assert torch.equal(got[i], want), (i, p)
        assert got[i].is_contiguous() and got[i].untyped_storage().data_ptr() != att.untyped_storage().data_ptr()
    if frames > 61:
        with pytest.raises(ValueError, match="even"):
            trim_split_conformer_att(att, [21], 3, keep=40)


def test_inference_chunk_many_equals_stack_chunk_split(c2w, voice):
    """Several streams' own caches in one flow chunk: the mel and every next cache equal (bit for
    bit) those of stacking the caches, one ``inference_chunk`` and splitting, on the fast path
    (caches straight into and out of the solver) and on the reference path (which stacks); past
    the trim (the steady state) too. Each next cache has its own memory. Caches with different
    prompt lengths are refused by name."""
    streams = [c2w.open_stream(voice) for _ in range(3)]
    f = c2w.flow
    g = torch.Generator().manual_seed(7)
    caches = [s.cache for s in streams]
    spk = torch.cat([s.spk for s in streams])
    with torch.inference_mode():
        for step in range(4):       # 4 chunks of 25 codes: past prompt + 100 frames
            toks = torch.randint(0, 6561, (3, 28), generator=g)
            mel_ref, stacked = f.inference_chunk(toks, spk, stack_flow_caches(caches))
            want = split_flow_cache(stacked, [1, 1, 1])
            mel, got = f.inference_chunk_many(toks, spk, caches)
            assert torch.equal(mel, mel_ref)
            for a, b in zip(got, want):
                assert a.prompt_frames == b.prompt_frames
                for name in ("conformer_cnn", "conformer_att", "estimator_cnn", "estimator_att"):
                    assert torch.equal(getattr(a, name), getattr(b, name)), (step, name)
            ptrs = [c.estimator_att.untyped_storage().data_ptr() for c in got]
            assert len(set(ptrs)) == 3
            caches = got
        odd = type(caches[0])(*[getattr(caches[0], n) for n in ("conformer_cnn", "conformer_att", "estimator_cnn",
                                                                 "estimator_att")], caches[0].prompt_frames + 2)
        if f.chunk_solver is not None:
            with pytest.raises(InputError, match="prompt frames differ"):
                f.inference_chunk_many(toks, spk, [caches[0], odd, caches[2]])
        short = type(odd)(caches[1].conformer_cnn, caches[1].conformer_att, caches[1].estimator_cnn,
                          caches[1].estimator_att[..., :-1, :], caches[1].prompt_frames)
        with pytest.raises(InputError, match="cache 1's estimator_att"):
            f.inference_chunk_many(toks, spk, [caches[0], short, caches[2]])
        with pytest.raises(InputError, match="2 caches for 3 token rows"):
            f.inference_chunk_many(toks, spk, caches[:2])
    for s in streams:
        s.close()


def test_batched_flow_chunk_mel_matches_single_rows(c2w, voice):
    """The flow alone (before the random tiny HiFT, which amplifies rounding ~10x): one solve
    over 3 stacked caches equals each row solved alone to fp32 rounding of batched GEMMs."""
    streams = [c2w.open_stream(voice) for _ in range(3)]
    toks = [torch.randint(0, 6561, (1, 28), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    f = c2w.flow
    with torch.inference_mode():
        ones = [f.inference_chunk(t, s.spk, s.cache)[0] for t, s in zip(toks, streams)]
        mel, _ = f.inference_chunk(torch.cat(toks), torch.cat([s.spk for s in streams]),
                                   stack_flow_caches([s.cache for s in streams]))
    errs = [_rel(mel[i:i + 1].numpy(), ones[i].numpy()) for i in range(3)]
    print(f"mel rel err batched vs single rows: {max(errs):.3e}")
    assert max(errs) <= 2e-6
    for s in streams:
        s.close()


def test_inference_chunk_many_direct_solves_match_the_reference(tiny_ckpt, voice):
    """The flow's batched chunk with its solver on the direct path (each stream's estimator cache read in
    place, the trimmed successor written by the attention) against the reference flow path (original DiT,
    caches stacked, trimmed after), chunk after chunk up to past the trim, under Triton's interpreter with
    IEEE dots: the mel and every next cache within 1e-5, each in its own memory. Every cache on either path
    ends with its voice prompt cache's last min(prompt, 100) frames, bit for bit (``FlowCache.prompt_att``, carried
    from the prompt state), and the solver reading those frames from the prompt cache (``share_tail``) gives
    the same bits as reading each stream's own. ~100 s on 2 CPUs."""
    from minicpmo_rt.code2wav import kernels
    if not (kernels.AVAILABLE and kernels.interpreting()) and not torch.cuda.is_available():
        pytest.skip("the direct path needs Triton (CUDA or TRITON_INTERPRET=1)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    c2w = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_fused_body": True}, device=dev)
    f, solver = c2w.flow, c2w.flow.chunk_solver
    solver.fused.use_triton, solver.fused.attention, solver.tf32 = True, "triton-ieee", False
    streams = [c2w.open_stream(voice) for _ in range(2)]
    caches = [s.cache for s in streams]
    spk = torch.cat([s.spk for s in streams])
    g = torch.Generator().manual_seed(8)
    drops = []
    with torch.inference_mode():
        for step in range(3):       # 50 frames a chunk: the 3rd takes the cache past prompt + 100
            toks = torch.randint(0, 6561, (2, 28), generator=g).to(dev)
            f.chunk_solver = None
            try:
                mel_ref, want = f.inference_chunk_many(toks, spk, caches)
            finally:
                f.chunk_solver = solver
            mel, got = f.inference_chunk_many(toks, spk, caches)
            solver.share_tail = True
            try:
                mel_shared, shared = f.inference_chunk_many(toks, spk, caches)
            finally:
                solver.share_tail = False
            assert torch.equal(mel_shared, mel) and any(k.tail for k in solver._statics)
            assert all(torch.equal(a.estimator_att, b.estimator_att) for a, b in zip(shared, got))
            for c in got + want:
                prompt = c.prompt_att
                assert prompt is streams[0].cache.prompt_att
                n = min(c.prompt_frames, 100)
                assert torch.equal(c.estimator_att[..., -n:, :], prompt[..., -n:, :]), step
            drops += [k.direct for k in solver._statics if k.direct and k.direct[0] != k.direct[1]]
            assert _rel(mel.cpu().numpy(), mel_ref.cpu().numpy()) < 1e-5, step
            for a, b in zip(got, want):
                assert a.estimator_att.shape == b.estimator_att.shape
                assert _rel(a.estimator_att.cpu().numpy(), b.estimator_att.cpu().numpy()) < 1e-5, step
            assert len({c.estimator_att.untyped_storage().data_ptr() for c in got}) == 2
            caches = got
    assert drops, "no chunk took the direct path with a trim"
    for s in streams:
        s.close()


@pytest.mark.parametrize("n_steady", [1, 3])
def test_joined_final_rides_the_direct_solve_and_matches_the_reference(tiny_ckpt, voice, n_steady):
    """A final chunk (3 + 10 codes, 26 frames) joined to ``n_steady`` streams' steady chunks (50 frames) at the
    trimmed steady cache: ONE direct solve (each row's own cache read in place, the final row's padding frames
    never attended: its current-frame count in the source table, no successor written for it), with IEEE dots
    (on the CPU under Triton's interpreter), against the reference flow path solving each part apart: every mel
    and the steady streams' next caches within 1e-5. The caches reach the steady length on the reference path
    (cheap on the CPU). On CUDA batch 2 runs the persistent block kernel's direct phase, batch 4 the staged
    body's direct attention; on the CPU only batch 2 runs (~25 s on 2 CPUs; batch 4 would take ~50 s more)."""
    from minicpmo_rt.code2wav import kernels
    from minicpmo_rt.code2wav.flow import ChunkPart
    if not (kernels.AVAILABLE and kernels.interpreting()) and not torch.cuda.is_available():
        pytest.skip("the direct path needs Triton (CUDA or TRITON_INTERPRET=1)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and n_steady > 1:
        pytest.skip("batch 4 through Triton's interpreter: run on CUDA (batch 2 covers the logic on the CPU)")
    c2w = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_fused_body": True}, device=dev)
    f, solver = c2w.flow, c2w.flow.chunk_solver
    solver.fused.use_triton, solver.fused.attention, solver.tf32 = True, "triton-ieee", False
    n = n_steady + 1
    streams = [c2w.open_stream(voice) for _ in range(n)]
    caches = [s.cache for s in streams]
    spk = torch.cat([s.spk for s in streams])
    g = torch.Generator().manual_seed(9)
    with torch.inference_mode():
        f.chunk_solver = None
        try:
            for _ in range(3):      # past prompt + 100 frames: the trimmed steady length
                _, caches = f.inference_chunk_many(torch.randint(0, 6561, (n, 28), generator=g).to(dev), spk, caches)
            steady = torch.randint(0, 6561, (n_steady, 28), generator=g).to(dev)
            final = torch.randint(0, 6561, (1, 13), generator=g).to(dev)
            mel_ref, want = f.inference_chunk_many(steady, spk[:n_steady], caches[:n_steady])
            fin_ref, _ = f.inference_chunk(final, spk[n_steady:], caches[n_steady], last_chunk=True)
        finally:
            f.chunk_solver = solver
        keys, static_for = [], solver._static_for
        solver._static_for = lambda key, *a, **k: (keys.append(key), static_for(key, *a, **k))[1]
        try:
            (mel, got), (fin, none) = f.inference_chunks_joined(
                [ChunkPart(steady, spk[:n_steady], caches[:n_steady]),
                 ChunkPart(final, spk[n_steady:], caches[n_steady:], last=True)])
        finally:
            del solver._static_for
    assert len(set(keys)) == 1 and keys[0].direct and not keys[0].masked, keys      # one solve, direct
    assert keys[0].batch == (2 if n == 2 else 4), keys
    assert none is None and fin.shape == fin_ref.shape == (1, 80, 26)
    assert _rel(mel.cpu().numpy(), mel_ref.cpu().numpy()) < 1e-5
    assert _rel(fin.cpu().numpy(), fin_ref.cpu().numpy()) < 1e-5
    for a, b in zip(got, want):
        for name in ("estimator_cnn", "estimator_att", "conformer_cnn", "conformer_att"):
            assert getattr(a, name).shape == getattr(b, name).shape
            assert _rel(getattr(a, name).cpu().numpy(), getattr(b, name).cpu().numpy()) < 1e-5, name
    for s in streams:
        s.close()


@pytest.mark.parametrize("starts", [("first",), ("first", "second")])
def test_first_and_second_chunks_join_the_steady_direct_solve(tiny_ckpt, voice, starts):
    """Streams at their first chunk (estimator cache = the prompt's frames) and second (prompt + 50) joined to a
    steady stream (prompt + 100) in ONE direct solve (``SolveKey.rows``: each row reads its own cache in place,
    the fixed noise at its own offset, and writes its own successor trimmed by its own length), with IEEE dots
    (on the CPU under Triton's interpreter), against the reference flow path solving each stream apart: every
    mel and next cache within 1e-5, each next cache as long as the reference's. On CUDA batch 2 runs the
    persistent block kernel's direct phase, batch 3 (bucket 4) the staged body's direct attention; on the CPU
    only batch 2 (~30 s on 2 CPUs)."""
    from minicpmo_rt.code2wav import kernels
    from minicpmo_rt.code2wav.flow import ChunkPart
    if not (kernels.AVAILABLE and kernels.interpreting()) and not torch.cuda.is_available():
        pytest.skip("the direct path needs Triton (CUDA or TRITON_INTERPRET=1)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and len(starts) > 1:
        pytest.skip("batch 3 through Triton's interpreter: run on CUDA (batch 2 covers the logic on the CPU)")
    c2w = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_fused_body": True}, device=dev)
    f, solver = c2w.flow, c2w.flow.chunk_solver
    solver.fused.use_triton, solver.fused.attention, solver.tf32 = True, "triton-ieee", False
    n = 1 + len(starts)
    streams = [c2w.open_stream(voice) for _ in range(n)]
    spk = torch.cat([s.spk for s in streams])
    g = torch.Generator().manual_seed(10)
    tok = lambda b: torch.randint(0, 6561, (b, 28), generator=g).to(dev)      # noqa: E731
    with torch.inference_mode():
        f.chunk_solver = None
        try:        # stream 0 to the steady length, stream 2 (if any) to its second chunk
            caches = [s.cache for s in streams]
            for _ in range(2):
                caches[0] = f.inference_chunk(tok(1), spk[:1], caches[0])[1]
            if n > 2:
                caches[2] = f.inference_chunk(tok(1), spk[2:3], caches[2])[1]
            p = caches[0].prompt_frames
            assert [c.estimator_frames for c in caches] == [p + 100, p, p + 50][:n]
            toks = [tok(1) for _ in range(n)]
            want = [f.inference_chunk(t, spk[i:i + 1], c) for i, (t, c) in enumerate(zip(toks, caches))]
        finally:
            f.chunk_solver = solver
        keys, static_for = [], solver._static_for
        solver._static_for = lambda key, *a, **k: (keys.append(key), static_for(key, *a, **k))[1]
        try:
            got = f.inference_chunks_joined([ChunkPart(t, spk[i:i + 1], [c]) for i, (t, c) in
                                             enumerate(zip(toks, caches))])
        finally:
            del solver._static_for
    assert len(set(keys)) == 1 and keys[0].direct and keys[0].rows and keys[0].offset == p + 100, keys
    for (mel, news), (mel_ref, new_ref) in zip(got, want):
        assert _rel(mel.cpu().numpy(), mel_ref.cpu().numpy()) < 1e-5
        for name in ("estimator_cnn", "estimator_att", "conformer_cnn", "conformer_att"):
            a, b = getattr(news[0], name), getattr(new_ref, name)
            assert a.shape == b.shape, name
            assert _rel(a.cpu().numpy(), b.cpu().numpy()) < 1e-5, name
    for s in streams:
        s.close()


def test_join_starts_streams_through_the_direct_path(tiny_ckpt, voice, monkeypatch):
    """``cfm_join_starts`` where the solver reads caches in place (CUDA; on the CPU only with Triton's interpreter
    and MINICPMO_SLOW_TESTS=1, ~5-7 min): three streams starting one round apart reach ONE CFM solve per round, on
    a key with rows of their own cache lengths in rounds 1 and 2 (second + first; steady + second + first).
    Round 3 holds only final chunks (26 frames, narrower than the query bucket: masked solves through the arena,
    which reads no cache in place), so its two cache lengths solve apart. IEEE dots. Every stream's PCM matches
    the stream pushed alone (batch 1, its own solves) within 1e-4."""
    import os

    from minicpmo_rt.code2wav import kernels
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not (kernels.AVAILABLE and kernels.interpreting() and os.environ.get("MINICPMO_SLOW_TESTS")):
        pytest.skip("needs CUDA (or TRITON_INTERPRET=1 and MINICPMO_SLOW_TESTS=1: ~5-7 min on 2 CPUs)")
    # IEEE convs too (the encoder's and HiFT's run in cuDNN, whose TF32 default is the process's): batch 1
    # and batch 2 calls may pick other TF32 algorithms, 8.5e-4 apart in PCM on the H200
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    c2w = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, device=dev,
                                 extra={"cfm_fused_body": True, "cfm_join_starts": True, "cfm_graph_precapture": False})
    assert c2w.join_starts
    solver = c2w.flow.chunk_solver
    solver.fused.use_triton, solver.fused.attention, solver.tf32 = True, "triton-ieee", False
    plans = [_payloads(61, (25, 25, 25, 10)), _payloads(62, (25, 25, 10)), _payloads(63, (25, 10))]
    alone = []
    for plan in plans:
        s = c2w.open_stream(voice)
        alone.append([s.push(p, last) for p, last in plan])
    streams = [c2w.open_stream(voice) for _ in plans]
    keys, solve, depth = [], solver.solve, [0]

    def spy(mu, *a, **k):     # counts the flow's solves; row groups (``keep_arena``, CUDA) recurse into one
        if not depth[0]:
            keys.append([])
        depth[0] += 1
        try:
            return solve(mu, *a, **k)
        finally:
            depth[0] -= 1

    static_for = solver._static_for
    solver.solve = spy
    solver._static_for = lambda key, *a, **k: (keys[-1].append(key) if keys else None, static_for(key, *a, **k))[1]
    try:
        got, per_round = [[] for _ in plans], []
        for k in range(len(plans[0])):
            n = len(keys)
            live = [(j, s) for j, s in enumerate(streams) if j <= k < j + len(plans[j])]
            for (j, _), out in zip(live, c2w.push_many([(s, *plans[j][k - j]) for j, s in live])):
                got[j].append(out)
            per_round.append(keys[n:])
    finally:
        del solver.solve, solver._static_for
    assert [len(r) for r in per_round] == [1, 1, 1, 2], per_round      # one solve per round but the finals'
    assert all(key.rows and key.direct for key in per_round[1][0] + per_round[2][0]), per_round
    assert not any(key.rows for solve in per_round[3] for key in solve), per_round
    for j in range(len(plans)):
        for k, (a, b) in enumerate(zip(got[j], alone[j])):
            assert a.shape == b.shape and _rel(a, b) <= 1e-4, (j, k, _rel(a, b))
