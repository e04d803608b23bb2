import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import soundfile as sf
from typer.testing import CliRunner

from minicpmo_rt.cli import app
from minicpmo_rt.code2wav.pipeline import SAMPLES_PER_CODE, Code2Wav, check_codes
from minicpmo_rt.errors import CheckpointError, InputError

runner = CliRunner()



@pytest.fixture(scope="module")
def c2w(tiny_ckpt):
    return Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2)


def _codes(n, seed=0):
    return [int(x) for x in np.random.default_rng(seed).integers(0, 6561, n)]


def test_whole_and_stream_lengths_match_the_codes(c2w, voice):
    codes = _codes(33)
    whole = c2w.synthesize(codes, voice)
    done: list[int] = []
    streamed = c2w.stream_codes(codes, voice, window=25, first_window=10, progress=done.append)
    assert done == [10, 33]     # progress: codes decoded after each payload (first window 10, then the rest)
    for wav in (whole, streamed):
        assert wav.dtype == np.float32 and wav.shape == (33 * SAMPLES_PER_CODE,)
        assert np.isfinite(wav).all() and np.abs(wav).max() > 0


def test_steady_chunk_is_one_second_and_prompt_state_is_shared(c2w, voice):
    solves = c2w.prompts.solves
    a, b = c2w.open_stream(voice), c2w.open_stream(voice)
    assert a.cache is b.cache  # one prompt solve, shared read-only
    assert c2w.prompts.solves <= solves + 1
    ctx = [4218] * 3
    codes = _codes(50, seed=1)
    first = a.push(ctx + codes[:25])
    steady = a.push(codes[22:50])
    assert steady.shape == (24000,)  # 25 codes -> 50 mel frames -> 1 s
    assert first.shape[0] == 24000  # causal HiFT: 8-frame lead silence + 42 frames (8 held back)
    tail = a.push(codes[47:50], last=True)
    assert tail.shape[0] > 0
    b.close()
    with pytest.raises(InputError, match="after the final payload"):
        a.push(codes[:28])


@pytest.mark.parametrize("codes, msg", [([], "empty"), ([1, 2, 6561], "6561 at index 2"), ([-1], "outside")])
def test_bad_codes_are_named(codes, msg):
    with pytest.raises(InputError, match=msg):
        check_codes(codes)


def test_cli_whole_and_stream(tiny_ckpt, voice, tmp_path):
    codes = tmp_path / "codes.json"
    codes.write_text(json.dumps(_codes(30, seed=2)))
    for flag in ([], ["--stream"]):
        out = tmp_path / f"out{len(flag)}.wav"
        res = runner.invoke(app, ["code2wav", "--model", str(tiny_ckpt), "--codes", str(codes), "--voice",
                                  str(voice), "--output", str(out), "--n-timesteps", "2", *flag])
        assert res.exit_code == 0, res.output
        wav, sr = sf.read(out)
        assert sr == 24000 and wav.shape == (30 * 960,)


def test_cli_errors_leave_no_file_and_keep_a_good_one(tiny_ckpt, voice, tmp_path):
    out = tmp_path / "keep.wav"
    sf.write(out, np.zeros(10, np.float32), 24000)
    before = out.read_bytes()
    bad = tmp_path / "bad.json"
    for content, msg in [("[]", "empty"), ("[1, 99999]", "outside"), ("{", "not valid JSON"), ('["a"]', "integers")]:
        bad.write_text(content)
        res = runner.invoke(app, ["code2wav", "--model", str(tiny_ckpt), "--codes", str(bad), "--voice", str(voice),
                                  "--output", str(out)])
        assert res.exit_code == 2 and msg in res.output, res.output
    bad.write_text("[1, 2, 3]")
    for steps in ("0", "-3"):      # an IndexError deep in the solve, before the check
        res = runner.invoke(app, ["code2wav", "--model", str(tiny_ckpt), "--codes", str(bad), "--voice", str(voice),
                                  "--output", str(out), "--n-timesteps", steps])
        assert res.exit_code == 2 and f"--n-timesteps must be >= 1, got {steps}" in res.output, res.output
    assert out.read_bytes() == before
    good = tmp_path / "good.json"
    good.write_text("[1, 2, 3, 4, 5]")
    short = tmp_path / "short.wav"
    sf.write(short, np.zeros(800, np.float32), 16000)
    notaudio = tmp_path / "not.wav"
    notaudio.write_text("hello")
    for v in (short, notaudio, tmp_path / "missing.wav"):
        res = runner.invoke(app, ["code2wav", "--model", str(tiny_ckpt), "--codes", str(good), "--voice", str(v),
                                  "--output", str(tmp_path / "x.wav")])
        assert res.exit_code == 2 and str(v.name) in res.output, res.output
        assert not (tmp_path / "x.wav").exists()


def test_snapshot_without_token2wav_assets_is_named(tiny_ckpt, tmp_path):
    clone = tmp_path / "noassets"
    shutil.copytree(tiny_ckpt, clone, ignore=shutil.ignore_patterns("assets"))
    with pytest.raises(CheckpointError, match="assets/token2wav"):
        Code2Wav.from_snapshot(clone)


def test_fused_fast_path_stream_matches_reference(tiny_ckpt, voice):
    """cfm_fused_body: true on CPU runs the fused body (SDPA fallback) through the solver; the
    streamed audio equals the reference path's (fp32)."""
    ref = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2)
    assert ref.choice.body == "original" and ref.flow.chunk_solver is None
    fast = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_fused_body": True})
    assert fast.choice.body == "fused" and fast.flow.chunk_solver is not None
    codes = _codes(30, seed=5)
    a = ref.stream_codes(codes, voice)
    b = fast.stream_codes(codes, voice)
    err = float(np.linalg.norm(a - b) / np.linalg.norm(a))
    assert err < 1e-5, err


def test_hift_carry_knob_streams_the_same_audio(tiny_ckpt, voice):
    """``hift_carry: true`` makes the causal stream vocoder carry its convs' context (``Vocoder.stream_carry``);
    a whole streamed utterance equals the default's (fp32 on the CPU, the same samples in another summation
    order: <= 1e-5)."""
    ref = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2)
    carried = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"hift_carry": True})
    assert carried.vocoders.stream.variant == "causal"      # the tiny checkpoint ships 1.0.7's causal HiFT
    assert not ref.vocoders.stream.stream_carry and carried.vocoders.stream.stream_carry
    codes = _codes(100, seed=6)
    a = ref.stream_codes(codes, voice)
    model = carried.vocoders.stream.model
    calls = []
    model.run_decode_next = lambda *args: calls.append(args[0].shape) or type(model).run_decode_next(model, *args)
    b = carried.stream_codes(codes, voice)
    assert len(calls) >= 2      # the chunks after the first decoded their new frames only
    assert a.shape == b.shape
    err = float(np.linalg.norm(a - b) / np.linalg.norm(a))
    assert err < 1e-5, err


def test_stream_caches_do_not_alias_the_solver_buffers(tiny_ckpt, voice):
    """The flow takes the solver's caches as views of its buffers and copies them once (the trim, or a
    clone while the cache is still short): a kept FlowCache must survive later solves unchanged and
    never share memory with the solver's arena."""
    import torch
    fast = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_fused_body": True})
    fast.flow.chunk_solver.fused.use_triton = False    # the torch stages: same buffers, faster on CPU
    s = fast.open_stream(voice)
    codes = _codes(100, seed=9)
    sv = fast.flow.chunk_solver
    kept = []
    for i in range(0, 100, 25):
        s.push(([4218] * 3 + codes[:25]) if i == 0 else codes[i - 3:i + 25])
        c = s.cache
        solver_mem = {sv._arena.untyped_storage().data_ptr()} | {
            st.cnn_out.untyped_storage().data_ptr() for st in sv._statics.values()}
        assert c.estimator_att.untyped_storage().data_ptr() not in solver_mem
        assert c.estimator_cnn.untyped_storage().data_ptr() not in solver_mem
        kept.append((c, c.estimator_att.clone(), c.estimator_cnn.clone()))
    p = s.cache.prompt_frames
    # short caches are cloned, then trimmed ones copied; the last two solves reuse one solver shape
    assert [c.estimator_att.shape[4] for c, _, _ in kept] == [p + 50, p + 100, p + 100, p + 100]
    for c, att, cnn in kept:
        assert torch.equal(c.estimator_att, att) and torch.equal(c.estimator_cnn, cnn)


def test_graph_knobs_reach_the_solver_and_precapture_covers_a_stream(tiny_ckpt, voice):
    """``cfm_max_graphs`` becomes the solver's graph budget (a bad value is named); precapture waits for CUDA
    (nothing pending, nothing captured here), and the keys it would capture for a voice
    (``precapture_plan`` -> ``precapture_keys``) are the keys that voice's streamed chunks solve under, final
    chunks wider than a steady one (query bucket 56) included; a budget drops the final chunks' keys first."""
    fast = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_fused_body": True, "cfm_max_graphs": 5})
    sv = fast.flow.chunk_solver
    assert sv.config.max_graphs == 5 and not fast.precapture_pending
    sv.fused.use_triton = False    # the torch stages: the same keys, faster on CPU
    s = fast.open_stream(voice)
    assert fast.precapture(s.prompt_frames) == 0 and not sv.graphs()
    seen, key_of = [], sv.solve_key
    sv.solve_key = lambda *a, **k: seen.append(key_of(*a, **k)) or seen[-1]
    codes = _codes(110, seed=4)
    for i in range(0, 100, 25):
        s.push(([4218] * 3 + codes[:25]) if i == 0 else codes[i - 3:i + 25])
    s.push(codes[97:110], last=True)                       # a final chunk: narrower, masked
    solved = list(seen)
    for n in (24, 25):     # final payloads wider than a steady chunk: 3 + 24 / 25 codes, 54 / 56 frames
        w = fast.open_stream(voice)
        for i in range(0, 100, 25):
            w.push(([4218] * 3 + codes[:25]) if i == 0 else codes[i - 3:i + 25])
        seen.clear()
        w.push(codes[97:100] + codes[:n], last=True)
        solved.append(seen[-1])
    plan = fast.precapture_plan(s.prompt_frames)
    full = sv.precapture_keys(**{**plan, "final": False}, device="cpu")
    planned = sv.precapture_keys(**plan, device="cpu")
    assert sv.config.query_buckets == (50, 56) and plan["query"] == 50 and plan["wide"] == 56
    assert len(full) == 3 * len(sv.config.batch_buckets) and set(full) < set(planned)
    finals = set(planned) - set(full)
    # final chunks' keys, where their arena fits: masked at a steady chunk's width, or at the wide final bucket
    # (masked, and the widest final's own width) for the batches final_batch covers
    assert all(k.masked for k in finals if k.query == 50)
    wide = {k for k in finals if k.query == 56}
    assert {(k.batch, k.masked) for k in wide} == {(b, m) for b in (1, 2, 4) for m in (True, False)}
    assert len(solved) == 7 and len(set(solved)) == 6 and set(solved) <= set(planned)
    assert solved[4].masked and solved[4] not in full
    assert (solved[5].query, solved[5].masked) == (56, True) and (solved[6].query, solved[6].masked) == (56, False)
    # under a budget the wide finals' keys go first, then the narrow finals': a steady key is never dropped
    assert set(sv.precapture_keys(**plan, device="cpu", limit=len(planned) - len(wide))) == set(planned) - wide
    assert set(sv.precapture_keys(**plan, device="cpu", limit=len(full))) == set(full)
    with pytest.raises(InputError, match="cfm_max_graphs"):
        Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_max_graphs": "lots"})


def test_join_starts_knob_reaches_the_flow_and_precaptures_its_keys(tiny_ckpt, voice):
    """``cfm_join_starts: true`` on the fused body sets ``Code2Wav.join_starts`` (the reference body ignores it),
    and the precapture plan then also holds, for every batch bucket from 2 whose steady key is direct, that key
    with rows of their own cache lengths (``SolveKey.rows``; direct keys need Triton: under the interpreter
    here, else the set is empty on both sides)."""
    from dataclasses import replace

    import torch

    ref = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_join_starts": True})
    assert not ref.join_starts
    fast = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_fused_body": True, "cfm_join_starts": True})
    assert fast.join_starts
    sv, p = fast.flow.chunk_solver, fast.open_stream(voice).prompt_frames
    from minicpmo_rt.code2wav import kernels
    triton_here = kernels.AVAILABLE and (kernels.interpreting() or torch.cuda.is_available())
    if triton_here:     # the direct path's attention (on the CPU: under the interpreter; keys only, no solve)
        sv.fused.use_triton, sv.fused.attention = True, "triton-ieee"
    plan, dev = fast.precapture_plan(p), "cuda" if torch.cuda.is_available() else "cpu"   # Triton's device
    keys = sv.precapture_keys(**plan, device=dev)
    plain = sv.precapture_keys(**{**plan, "row_lengths": False}, device=dev)
    steady = {k for k in plain if k.direct and k.batch > 1 and k.offset == p + 100 and not k.masked
              and k.query == plan["query"]}     # not the widest final chunks' keys (query 56)
    assert {k for k in keys if k.rows} == {replace(k, rows=True) for k in steady}
    assert set(keys) - {k for k in keys if k.rows} == set(plain)
    assert len(steady) == (len(sv.config.batch_buckets) - 1 if triton_here else 0)


def test_a_prompt_of_another_length_solves_unmasked(tiny_ckpt):
    """A ``PromptFeatures`` that is not the frontend's 6 s (140 tokens, 280 mel frames): the flow's trimmed
    solves anchor the offset grid at its own steady length (``GraphConfig.anchor_at_trim``, on in Code2Wav's
    solver), so every chunk of its stream solves unmasked and exactly at its cache length, and the precapture
    plan for that prompt holds each key. On the configured 6-s grid its steady cache (380 frames) would snap to
    400 and every steady chunk would be masked (through the arena, Q + offset frames per row)."""
    import torch

    from minicpmo_rt.code2wav.frontend import PromptFeatures

    fast = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_fused_body": True})
    sv = fast.flow.chunk_solver
    assert sv.config.anchor_at_trim and sv.config.offset_anchor == 400
    sv.fused.use_triton = False    # the torch stages: the same keys, faster on CPU
    g = torch.Generator().manual_seed(3)
    feats = PromptFeatures(torch.randint(0, 6561, (1, 140), generator=g), torch.randn(1, 192, generator=g),
                           torch.randn(1, 280, 80, generator=g), 280, "short prompt")
    s = fast.open_stream(feats)
    assert s.prompt_frames == 280
    seen, key_of = [], sv.solve_key
    sv.solve_key = lambda *a, **k: seen.append(key_of(*a, **k)) or seen[-1]
    codes = _codes(130, seed=5)
    for i in range(0, 125, 25):
        s.push(([4218] * 3 + codes[:25]) if i == 0 else codes[i - 3:i + 25])
    assert [(k.offset, k.masked) for k in seen] == [(280, False), (330, False), (380, False), (380, False),
                                                    (380, False)]
    assert set(seen) <= set(sv.precapture_keys(**fast.precapture_plan(280), device="cpu"))
    sv.config = replace(sv.config, anchor_at_trim=False)
    assert key_of(1, 50, 380, torch.zeros(1, 80, 50), trim=(280, 100)).masked


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_prompt_of_another_length_replays_its_precaptured_graphs(tiny_ckpt):
    """On CUDA a 280-frame prompt's stream (first, growing and steady chunks) replays the graphs precaptured
    for that prompt (offsets 280 / 330 / 380, unmasked): no capture and no arena regrowth mid-stream, and its
    PCM equals a lazily captured instance's to <= 1e-5."""
    import torch

    from minicpmo_rt.code2wav.frontend import PromptFeatures

    g = torch.Generator().manual_seed(3)
    feats = PromptFeatures(torch.randint(0, 6561, (1, 140), generator=g), torch.randn(1, 192, generator=g),
                           torch.randn(1, 280, 80, generator=g), 280, "short prompt")
    codes = _codes(130, seed=5)
    payloads = [[4218] * 3 + codes[:25]] + [codes[i - 3:i + 25] for i in range(25, 125, 25)]
    warm = Code2Wav.from_snapshot(tiny_ckpt, device="cuda", n_timesteps=2)
    s = warm.open_stream(feats)     # precaptures for this prompt
    solver = warm.flow.chunk_solver
    held, captures = {k for k, st in solver._statics.items() if st.graph is not None}, solver.captures
    assert {k.offset for k in held if not k.masked} == {280, 330, 380}
    seen, key_of = [], solver.solve_key
    solver.solve_key = lambda *a, **k: seen.append(key_of(*a, **k)) or seen[-1]
    got = [s.push(p) for p in payloads]
    assert [k.offset for k in seen] == [280, 330, 380, 380, 380] and not any(k.masked for k in seen)
    assert set(seen) <= held and solver.captures == captures and solver.arena_regrowths == 0
    cold = Code2Wav.from_snapshot(tiny_ckpt, device="cuda", n_timesteps=2, extra={"cfm_graph_precapture": False})
    c = cold.open_stream(feats)
    want = [c.push(p) for p in payloads]
    for k, (a, b) in enumerate(zip(got, want)):
        err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        assert a.shape == b.shape and err <= 1e-5, (k, err)


@pytest.mark.parametrize("vocoder", ["stream", "whole"])
def test_warm_up_stream_leaves_no_trace(tiny_ckpt, voice, vocoder):
    """``warm_up`` pushes silence through a throwaway stream (on CUDA with every encoder and vocoder graph set
    capturing at a shape's first call; on CPU there are none, so it returns {}). Afterwards the shared prompt
    state is unchanged and unleased, the RNG state is as before (the original HiFT, ``whole``, draws its
    excitation from it) and a new stream's PCM equals that of a fresh instance bit for bit."""
    import torch

    from minicpmo_rt.code2wav.prompt_state import PromptStateCache
    from minicpmo_rt.code2wav.vocoder import VocoderSet

    warm, fresh = (Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2) for _ in range(2))
    for c in (warm, fresh):
        voc = getattr(c.vocoders, vocoder)
        c.vocoders = VocoderSet(voc, c.vocoders.whole)
    warm.prompts = PromptStateCache(4, check=True)
    torch.manual_seed(5)
    rng = torch.random.get_rng_state()
    assert warm.stream_graph_sets() == {}
    assert warm.warm_up(voice, chunks=3) == {}
    assert warm.warm_up(voice, chunks=2, batches=(3,)) == {}      # three streams in lockstep (push_many)
    assert torch.equal(torch.random.get_rng_state(), rng)
    (key, entry), = warm.prompts._entries.items()
    assert entry.leases == 0 and warm.prompts.verify(key)
    codes = _codes(75, seed=7)
    payloads = [[4218] * 3 + codes[:25], codes[22:50], codes[47:75]]
    pcm = []
    for c in (warm, fresh):
        s = c.open_stream(voice)
        torch.manual_seed(6)
        pcm.append([s.push(p) for p in payloads])
    for a, b in zip(*pcm):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        warm.warm_up(voice, chunks=0)
    for bad in ((), (0,), (1.5,)):
        with pytest.raises(ValueError, match="batches must be stream counts"):
            warm.warm_up(voice, batches=bad)
    assert warm.warm_up_batches() == (1,)     # no CFM solver on the CPU reference path: one stream


def test_warm_up_with_join_starts_pushes_a_fresh_stream_among_steady_ones(tiny_ckpt, voice):
    """With ``join_starts`` the warm-up at each batch from 2 has one more round in which a fresh stream (its first
    chunk) joins steady ones, so the encoder's padded graphs are captured before serving; the fresh stream
    leaves unfinished and no prompt lease stays behind. Without the knob, every warm-up round is in lockstep."""
    c2w = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_fused_body": True})
    c2w.flow.chunk_solver.fused.use_triton = False     # the torch stages: the same grouping, faster on CPU
    rounds, push_many = [], c2w.push_many

    def spy(items, *a, **k):
        rounds.append(sorted({s.cache.estimator_frames for s, payload, _ in items if payload}))
        return push_many(items, *a, **k)

    c2w.push_many = spy
    for join in (False, True):
        c2w.join_starts = join
        rounds.clear()
        c2w.warm_up(voice, chunks=2, batches=(1, 3))
        mixed = [r for r in rounds if len(r) > 1]
        assert len(mixed) == (1 if join else 0), rounds
        if join:
            assert mixed[0][0] < mixed[0][-1]            # the fresh stream's prompt-only cache among longer ones
        assert all(e.leases == 0 for e in c2w.prompts._entries.values())
    c2w.join_starts = False


def test_warm_up_stops_at_the_batch_that_runs_out_of_memory(tiny_ckpt, voice, monkeypatch, caplog):
    """A warm-up round that runs out of device memory stops the warm-up there with a warning (no larger
    batch is tried) and leaves no lease behind. Running out of GPU memory cannot happen on a CPU, so
    ``push_many`` raises the CUDA error here on purpose."""
    import logging

    import torch

    c2w = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2)
    tried = []

    def oom(items, *a, **k):
        tried.append(len(items))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")

    monkeypatch.setattr(c2w, "push_many", oom)
    with caplog.at_level(logging.WARNING):
        assert c2w.warm_up(voice, chunks=2, batches=(1, 3, 5)) == {}
    assert tried == [3] and "3 concurrent streams ran out of device memory" in caplog.text
    assert all(e.leases == 0 for e in c2w.prompts._entries.values())


@pytest.fixture
def ieee_convs():
    """cuDNN convolutions in IEEE FP32 for the test (the process default, TF32, is left to the process)."""
    from conftest import ieee_cudnn

    with ieee_cudnn():
        yield


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_first_stream_replays_from_its_first_chunk(tiny_ckpt, voice, ieee_convs):
    """On CUDA the first ``open_stream`` precaptures the CFM graphs and runs the warm-up streams at every batch
    bucket: the first real stream's five chunks (first, growing, steady), then rounds of 3 concurrent streams
    (``push_many``, padded to the bucket of 4) capture nothing and run nothing eagerly in any graph set (CFM,
    encoder, HiFT stages), and the PCM equals that of an instance with ``cfm_graph_precapture: false``
    (graphs captured lazily, first calls eager) to <= 1e-5. The trio's final chunks then replay one solve (their
    batch-4 key was precaptured, ``GraphConfig.final_batch``) and keep every CFM graph and the arena. Their
    encoder call and that of the first stream's final payload of another length replay the warm-up's graphs of
    final chunks (``Flow.encode_ends``).

    cuDNN runs in IEEE here: under its process-default TF32 the trio's vocoder final call, replayed at the
    bucket of 4 on the precaptured instance and eager at 3 rows on the lazy one, rounds apart by 2.7e-4 (H200;
    IEEE: 6.1e-7; ``cuda_tests_session28_h200.txt``)."""
    warm = Code2Wav.from_snapshot(tiny_ckpt, device="cuda", n_timesteps=2)
    cold = Code2Wav.from_snapshot(tiny_ckpt, device="cuda", n_timesteps=2, extra={"cfm_graph_precapture": False})
    assert warm.precapture_pending and not cold.precapture_pending
    s = warm.open_stream(voice)
    assert not warm.precapture_pending
    sets = warm.stream_graph_sets()
    assert {"encoder", "HiFT f0", "HiFT decode"} <= set(sets)

    def held():
        return ({k: (len(g.graphs), g.captures, g.eager_calls) for k, g in sets.items()},
                len(warm.flow.chunk_solver.graphs()))

    before = held()
    assert all(before[0].values()) and before[1], before
    # the vocoder's final call (zero look-ahead) was captured too, at every bucket the warm-up ran
    finals = {k[0][0][0] for k in sets["HiFT decode"].graphs if ("finalize", True) in k}
    assert finals == set(warm.warm_up_batches()), finals
    codes = _codes(125, seed=8)
    payloads = [[4218] * 3 + codes[:25]] + [codes[i - 3:i + 25] for i in range(25, 125, 25)]
    got = [s.push(p) for p in payloads]
    trio = [warm.open_stream(voice) for _ in range(3)]
    got += [w for p in payloads for w in warm.push_many([(t, p, False) for t in trio])]
    assert held() == before
    solver = warm.flow.chunk_solver
    graphs, arena = {k: id(st.graph) for k, st in solver._statics.items()}, solver._arena.numel()
    replays = []
    ended = sets["encoder (final chunks)"]
    ended_before = (ended.captures, ended.eager_calls, ended.replays)
    solver._static_for = lambda key, *a, _f=solver._static_for, **k: replays.append(key) or _f(key, *a, **k)
    got += warm.push_many([(t, codes[-13:], True) for t in trio])    # final chunks: masked, one batch-4 solve
    del solver._static_for
    assert [(k.batch, k.masked) for k in replays] == [(4, True)]
    last = codes[-3:] + codes[:4]       # a final payload of another length, one stream alone
    got.append(s.push(last, last=True))
    # the finals' encoder calls (13 and 7 codes, padded to a steady payload's: encode_ends) replayed the graphs
    # the warm-up captured at buckets 4 and 1
    assert (ended.captures, ended.eager_calls) == ended_before[:2] and ended.replays == ended_before[2] + 2
    assert {k: id(st.graph) for k, st in solver._statics.items()} == graphs and solver._arena.numel() == arena
    # the lazy instance's held graphs would split its trio's finals into rows that fit its smaller arena (batch
    # 1, which TF32 rounds apart from batch 4): there the arena grows instead
    cold.flow.chunk_solver.config = replace(cold.flow.chunk_solver.config, keep_arena=False)
    c = cold.open_stream(voice)
    want = [c.push(p) for p in payloads]
    trio = [cold.open_stream(voice) for _ in range(3)]    # batched: TF32 rounds a batch-4 solve apart from batch 1
    want += [w for p in payloads for w in cold.push_many([(t, p, False) for t in trio])]
    want += cold.push_many([(t, codes[-13:], True) for t in trio])
    want.append(c.push(last, last=True))
    for k, (a, b) in enumerate(zip(got, want)):
        err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        print(f"output {k}: precaptured vs lazy {err:.2e}")
        assert a.shape == b.shape and err <= 1e-5, (k, err)
