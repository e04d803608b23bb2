"""The opt-in slot pool in the streaming pipeline (connector knob ``cfm_slot_pool``): pooled streams
give what dense streams pushed alone give, several cache lengths share one solve, failures roll back,
and streams the pool cannot hold run the dense path."""

import logging

import numpy as np
import pytest
import torch

from conftest import requires_cuda
from minicpmo_rt.code2wav.knobs import row_offset_merge, slot_pool_slots
from minicpmo_rt.code2wav.pipeline import Code2Wav
from minicpmo_rt.errors import InputError

from test_pipeline_batched import StageSpy, _payloads, _rel  # noqa: E402

SLOTS = 3


def _fast(c2w: Code2Wav) -> Code2Wav:
    # the fused body's torch formulation + SDPA (the CPU fallback; the Triton stages have their own tests)
    c2w.flow.chunk_solver.fused.use_triton = False
    if c2w.slot_solver is not None:
        c2w.slot_solver.fused.use_triton = False
    return c2w


@pytest.fixture(scope="module")
def dense(tiny_ckpt):
    return _fast(Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_fused_body": True}))


@pytest.fixture(scope="module")
def pooled(tiny_ckpt):
    c2w = _fast(Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={
        "cfm_fused_body": True, "cfm_slot_pool": SLOTS, "cfm_row_offset_merge": True}))
    assert c2w.slot_solver is not None and c2w.slot_pool_slots == SLOTS and c2w.row_offset_merge
    return c2w


def _alone(c2w, voice, plan):
    s = c2w.open_stream(voice)
    return [s.push(p, last) for p, last in plan]


def _rounds(c2w, streams, plans, n):
    """The first ``n`` payloads of each plan, one round each through ``push_many``: each stream's PCM chunks."""
    got = [[] for _ in plans]
    for k in range(n):
        for j, wav in enumerate(c2w.push_many([(s, *plan[k]) for s, plan in zip(streams, plans)])):
            got[j].append(wav)
    return got


class Spy:
    def __init__(self, obj, name):
        self.obj, self.name, self.calls = obj, name, []
        self.real = getattr(obj, name)

    def __enter__(self):
        def call(*a, **k):
            self.calls.append(a)
            return self.real(*a, **k)
        setattr(self.obj, self.name, call)
        return self

    def __exit__(self, *exc):
        delattr(self.obj, self.name)


def test_knob_values():
    assert [slot_pool_slots(e) for e in (None, {}, {"cfm_slot_pool": 0}, {"cfm_slot_pool": "off"},
                                          {"cfm_slot_pool": 4}, {"cfm_slot_pool": "8"}, {"cfm_slot_pool": True})] \
        == [0, 0, 0, 0, 4, 8, 18]
    assert [row_offset_merge(e) for e in (None, {"cfm_row_offset_merge": False}, {"cfm_row_offset_merge": "true"})] \
        == [False, False, True]
    with pytest.raises(InputError, match="cfm_row_offset_merge"):
        row_offset_merge({"cfm_row_offset_merge": "sometimes"})
    for bad in (-1, "many", 2.5):
        with pytest.raises(InputError, match="cfm_slot_pool"):
            slot_pool_slots({"cfm_slot_pool": bad})


def test_knobs_ignored_without_the_fused_body_or_the_pool(tiny_ckpt, caplog):
    with caplog.at_level(logging.WARNING):
        c2w = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_slot_pool": 2})   # CPU: original body
        assert c2w.slot_solver is None and "needs the fused CFM body" in caplog.text
        c2w.configure_fast_path({"cfm_fused_body": True, "cfm_row_offset_merge": True})
    assert c2w.slot_solver is None and not c2w.row_offset_merge and "cfm_slot_pool is off" in caplog.text


def test_pooled_streams_equal_dense_streams_pushed_alone(pooled, dense, voice):
    plans = [_payloads(seed) for seed in (11, 12, 13)]
    alone = [_alone(dense, voice, plan) for plan in plans]
    streams = [pooled.open_stream(voice) for _ in plans]
    assert all(s.handle is not None and s.cache is None for s in streams)
    assert pooled.slot_solver.pool.free_slots == 0
    with Spy(pooled.slot_solver, "solve_slots") as solves, Spy(pooled.flow, "inference_chunk") as dense_calls:
        got = [pooled.push_many([(s, plan[k][0], plan[k][1]) for s, plan in zip(streams, plans)])
               for k in range(len(plans[0]))]
    assert [len(c[0]) for c in solves.calls] == [3] * len(plans[0]) and not dense_calls.calls
    worst = max(_rel(got[k][j], alone[j][k]) for j in range(3) for k in range(len(plans[0])))
    print(f"worst PCM rel err pooled (batched) vs dense alone: {worst:.3e}")
    assert worst <= 1e-5
    assert _rel(got[2][0], got[2][1]) > 1e-2          # rows really differ
    assert all(s.finished for s in streams) and pooled.slot_solver.pool.free_slots == SLOTS


def test_different_cache_lengths_share_one_solve_with_row_offset_merging(pooled, dense, voice):
    plan_a, plan_b = _payloads(21), _payloads(22)
    ref_a, ref_b = _alone(dense, voice, plan_a), _alone(dense, voice, plan_b)
    a, b = pooled.open_stream(voice), pooled.open_stream(voice)
    out_a = [a.push(*plan_a[0])]                       # single-stream pooled push
    assert _rel(out_a[0], ref_a[0]) <= 1e-5
    assert a.handle.length == b.handle.length + 50     # a is one chunk ahead
    with Spy(pooled.slot_solver, "solve_slots") as solves, Spy(pooled.flow, "encode_chunk") as encodes:
        out = pooled.push_many([(a, *plan_a[1]), (b, *plan_b[0])])
    assert len(solves.calls) == 1                      # merged: one replay for both lengths
    assert len(encodes.calls) == 2                     # the conformer caches differ: two encoder halves
    assert _rel(out[0], ref_a[1]) <= 1e-5 and _rel(out[1], ref_b[0]) <= 1e-5
    pooled.row_offset_merge = False                    # off: one solve per cache length
    try:
        with Spy(pooled.slot_solver, "solve_slots") as solves:
            out = pooled.push_many([(a, *plan_a[2]), (b, *plan_b[1])])
    finally:
        pooled.row_offset_merge = True
    assert len(solves.calls) == 2
    assert _rel(out[0], ref_a[2]) <= 1e-5 and _rel(out[1], ref_b[1]) <= 1e-5
    a.close(), b.close()


def test_failed_vocoding_restores_the_slots(pooled, dense, voice):
    plans = [_payloads(seed, windows=(25, 25, 10)) for seed in (31, 32)]
    alone = [_alone(dense, voice, plan) for plan in plans]
    streams = [pooled.open_stream(voice) for _ in plans]
    pooled.push_many([(s, *plan[0]) for s, plan in zip(streams, plans)])
    pool = pooled.slot_solver.pool
    before = [(list(s.handle.frames), s.encoder, pool.cnn[:, :, list(pool.rows(s.handle.slot))].clone())
              for s in streams]
    voc = pooled.vocoders.stream
    voc.runner = StageSpy(voc.model, fail_on=2)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            pooled.push_many([(s, *plan[1]) for s, plan in zip(streams, plans)])
    finally:
        voc.runner = voc.model
    for s, (frames, enc, cnn) in zip(streams, before):
        assert s.handle.frames == frames and s.encoder is enc and not s.finished
        assert torch.equal(pool.cnn[:, :, list(pool.rows(s.handle.slot))], cnn)
    for k in (1, 2):
        out = pooled.push_many([(s, *plan[k]) for s, plan in zip(streams, plans)])
        for j in range(2):
            assert _rel(out[j], alone[j][k]) <= 1e-5
    assert pool.free_slots == SLOTS


def test_wide_chunk_and_full_pool_run_the_dense_path(pooled, dense, voice, caplog):
    """A payload wider than the query bucket (30 new codes: 60 mel frames > 50) solves densely from the
    slot's dense copy and re-admits the result; a stream beyond the slots runs dense from the start."""
    plan = _payloads(41, windows=(30, 25, 25, 25, 10))
    ref = _alone(dense, voice, plan)
    streams = [pooled.open_stream(voice) for _ in range(SLOTS)]
    with caplog.at_level(logging.WARNING):
        extra = pooled.open_stream(voice)
    assert extra.handle is None and extra.cache is not None and "slot pool full" in caplog.text
    s = streams[0]
    out = [s.push(*plan[0])]
    assert s.handle is not None and s.handle.length == s.prompt_frames + 60
    out += [s.push(p, last) for p, last in plan[1:]]
    worst = max(_rel(a, b) for a, b in zip(out, ref))
    assert worst <= 1e-5, worst
    assert np.abs(out[-1]).max() > 0
    got = [extra.push(p, last) for p, last in plan]
    assert max(_rel(a, b) for a, b in zip(got, ref)) <= 1e-5
    for t in streams[1:]:
        t.close()
    assert pooled.slot_solver.pool.free_slots == SLOTS


def test_open_streams_keep_their_slot_solver_across_a_reconfiguration(tiny_ckpt, dense, voice):
    extra = {"cfm_fused_body": True, "cfm_slot_pool": 2}
    c2w = _fast(Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra=extra))
    plan = _payloads(51, windows=(25, 25, 10))
    ref = _alone(dense, voice, plan)
    s = c2w.open_stream(voice)
    out = [s.push(*plan[0])]
    old = c2w.slot_solver
    c2w.configure_fast_path(extra)
    _fast(c2w)
    assert c2w.slot_solver is not old and s.slot_solver is old
    out += [c2w.push_many([(s, *plan[1])])[0], s.push(*plan[2])]
    assert max(_rel(a, b) for a, b in zip(out, ref)) <= 1e-5
    assert old.pool.free_slots == 2


def test_a_pool_made_inside_inference_mode_admits_streams_outside_it(tiny_ckpt, voice):
    """The pool is made at the first admission, which may come from inside ``torch.inference_mode`` (the
    warm-up streams of ``prepare`` are): its tensors are then inference tensors, and a stream opened later
    outside inference mode must still be admitted (found on the H200: RuntimeError "Inplace update to
    inference tensor outside InferenceMode")."""
    c2w = _fast(Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_fused_body": True, "cfm_slot_pool": 2}))
    with torch.inference_mode():
        c2w.open_stream(voice).close()
    assert c2w.slot_solver.pool is not None
    s = c2w.open_stream(voice)
    assert s.handle is not None
    assert s.push(_payloads(3)[0][0]).size > 0
    s.close()


@pytest.mark.parametrize("merge", [True, False])
def test_final_chunks_join_the_pooled_solve_at_their_own_widths(tiny_ckpt, dense, voice, merge):
    """Pooled streams ending in a round join the slot solve of those that go on (``join_finals``): a final
    chunk no wider than the steady one (3 + 10 codes, 26 frames) rides the steady solve at its own width, and
    the finals wider than it (3 + 24 and 3 + 25 codes: 54 and 56 frames) share one solve, the widest hosting.
    Their encoder halves run as one call per solve (``Flow.encode_ends``). Every stream's PCM equals the stream
    pushed alone on the dense path within 1e-5; a narrow row whose frames leaked into the others (keys,
    noise offsets) would miss by far more. With the joining off, each final payload length solves alone."""
    c2w = _fast(Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={
        "cfm_fused_body": True, "cfm_slot_pool": 4, "cfm_row_offset_merge": merge}))
    plans = [_payloads(61, windows=(25, 25, 25, 25, 10)), _payloads(62, windows=(25,) * 6),
             _payloads(63, windows=(25, 25, 25, 25, 24)), _payloads(64, windows=(25,) * 5)]
    alone = [_alone(dense, voice, plan) for plan in plans]
    streams = [c2w.open_stream(voice) for _ in plans]
    assert all(s.handle is not None for s in streams)
    got = _rounds(c2w, streams, plans, 4)
    with Spy(c2w.slot_solver, "solve_slots") as solves, Spy(c2w.flow, "encode_ends") as ends:
        out = c2w.push_many([(s, *plan[4]) for s, plan in zip(streams, plans)])
    for j, wav in enumerate(out):
        got[j].append(wav)
    assert sorted(len(c[0]) for c in solves.calls) == [2, 2]          # [steady + narrow final], [56 + 54]
    assert sorted(c[1].shape[2] for c in solves.calls) == [50, 56]
    assert [len(c[0]) for c in ends.calls] == [1, 2]                  # the finals' tokens, per solve
    got[1].append(streams[1].push(*plans[1][5]))                      # a wide final alone
    for j in range(4):
        _check = [_rel(a, b) for a, b in zip(got[j], alone[j])]
        assert len(got[j]) == len(alone[j]) and max(_check) <= 1e-5, (j, _check)
    assert all(s.finished for s in streams) and c2w.slot_solver.pool.free_slots == 4

    c2w.join_finals = False     # off: each final payload length solves alone
    streams = [c2w.open_stream(voice) for _ in plans]
    _rounds(c2w, streams, plans, 4)
    with Spy(c2w.slot_solver, "solve_slots") as solves:
        out = c2w.push_many([(s, *plan[4]) for s, plan in zip(streams, plans)])
    assert sorted(len(c[0]) for c in solves.calls) == [1, 1, 1, 1]
    assert max(_rel(out[j], alone[j][4]) for j in range(4)) <= 1e-5
    streams[1].close()


def test_pooled_final_chunks_replay_the_warm_up_encoder_graph(tiny_ckpt, dense, voice):
    """The warm-up's final-chunk encoder call (``Code2Wav._warm_final_encoder``) now covers pooled streams,
    and a round's pooled finals of other lengths (3 + 24 and 3 + 25 codes) replay that graph: their encoder
    call pads to a steady payload and cache (``Flow.encode_ends``), so no final length runs eagerly or captures
    mid-serving (on the H200 before this: 45 eager calls and 36 captures in 60 rounds). Captures are faked on
    the CPU (``_CPUGraphs``: CUDA graphs cannot run here; the CUDA tests of ``test_encoder_graph`` run real
    ones); the PCM of every stream equals it pushed alone on the dense path within 1e-5."""
    from test_encoder_graph import _CPUGraphs

    c2w = _fast(Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_fused_body": True, "cfm_slot_pool": 3}))
    graphs = c2w.flow.encoder_graphs = _CPUGraphs(c2w.flow, 16)
    plans = [_payloads(71, windows=(25,) * 6), _payloads(72, windows=(25, 25, 25, 25, 24)),
             _payloads(73, windows=(25,) * 5)]
    alone = [_alone(dense, voice, plan) for plan in plans]
    streams = [c2w.open_stream(voice) for _ in plans]
    assert all(s.handle is not None for s in streams)
    got = _rounds(c2w, streams, plans, 4)
    with torch.inference_mode():
        for _ in range(2):              # a shape is captured on its second call
            c2w._warm_final_encoder(streams[1:])
    ended = graphs.ended
    assert ended.captures == 1 and ended.eager_calls == 1
    replays = ended.replays
    for j, wav in enumerate(c2w.push_many([(s, *plan[4]) for s, plan in zip(streams, plans)])):
        got[j].append(wav)
    assert (ended.captures, ended.eager_calls, ended.replays) == (1, 1, replays + 1)
    got[0].append(streams[0].push(*plans[0][5]))
    for j in range(3):
        assert len(got[j]) == len(alone[j])
        assert max(_rel(a, b) for a, b in zip(got[j], alone[j])) <= 1e-5, j
    c2w.flow.encoder_graphs = None


def test_warm_up_precaptures_the_pooled_wide_final_keys(tiny_ckpt, voice):
    """``warm_up`` with pooled streams asks the slot solver for the graph of final chunks wider than a steady
    one (query bucket 56) at each warmed batch bucket up to ``GraphConfig.final_batch`` (4), none beyond.
    ``precapture_key`` is recorded, not run: a CUDA graph cannot be captured on a CPU (off CUDA it captures
    nothing, checked here too)."""
    from minicpmo_rt.code2wav.euler_graph import SolveKey

    c2w = _fast(Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, extra={"cfm_fused_body": True, "cfm_slot_pool": 8}))
    sv = c2w.slot_solver
    assert sv.config.final_batch == 4 and max(sv.config.query_buckets) == 56
    with Spy(sv, "precapture_key") as asked:
        c2w.warm_up(voice, chunks=1, batches=(1, 2, 3, 8))
    assert [c[0] for c in asked.calls] == [SolveKey(1, 56, 0, True), SolveKey(2, 56, 0, True),
                                           SolveKey(4, 56, 0, True)]
    assert not sv.graphs() and sv.pool.free_slots == 8


@requires_cuda
def test_cuda_pooled_wide_finals_replay_the_warm_up_graph(tiny_ckpt, voice):
    """On CUDA: after ``warm_up`` at batches 1 and 2 the slot solver holds the wide final keys (query 56), and
    a round whose two pooled streams end with payloads of 3 + 24 and 3 + 25 codes solves them together from
    that graph: no capture during the round. Their PCM equals each stream pushed alone on the same pooled
    Code2Wav within 1e-4. IEEE GEMMs and cuDNN: under TF32 a batch-2 and a batch-1 solve round apart by
    ~3e-4 (another GEMM kernel per row count), which the vocoder carries into the PCM. No precapture at the
    first ``open_stream``, so the graphs held are this test's warm-up's and those captured as solves come.
    (A first version, TF32 and 1e-4, failed on the H200 in session 33 with its output cut; this one passed
    there in session 34.)"""
    from conftest import ieee_cudnn
    from minicpmo_rt.code2wav.euler_graph import SolveKey

    c2w = Code2Wav.from_snapshot(tiny_ckpt, n_timesteps=2, device="cuda", extra={
        "cfm_fused_body": True, "token2wav_allow_tf32": False, "cfm_slot_pool": 4, "cfm_graph_precapture": False})
    sv = c2w.slot_solver
    assert sv is not None and not sv.tf32
    with ieee_cudnn():
        c2w.warm_up(voice, chunks=1, batches=(1, 2))
        held = set(sv.graphs())
        print(f"slot graphs after the warm-up: {sorted(map(str, held))}")
        assert {SolveKey(1, 56, 0, True), SolveKey(2, 56, 0, True)} <= held
        plans = [_payloads(81, windows=(25, 25, 25, 25, 24)), _payloads(82, windows=(25,) * 5)]
        alone = [_alone(c2w, voice, plan) for plan in plans]
        streams = [c2w.open_stream(voice) for _ in plans]
        _rounds(c2w, streams, plans, 4)
        captures = sv.captures
        with Spy(sv, "solve_slots") as solves:
            out = c2w.push_many([(s, *plan[4]) for s, plan in zip(streams, plans)])
    errs = [_rel(out[j], alone[j][4]) for j in range(2)]
    print(f"wide finals joined vs alone: PCM rel err {errs}; captures during the round {sv.captures - captures}")
    assert sv.captures == captures and [len(c[0]) for c in solves.calls] == [2]
    assert max(errs) <= 1e-4
