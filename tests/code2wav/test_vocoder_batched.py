"""Vocoder.push_many: several streams' chunks through batched HiFT calls equal each stream pushed
alone, for both HiFT variants; the graph runner on the CPU is the eager path exactly."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from minicpmo_rt.code2wav.hift import StageCall
from minicpmo_rt.code2wav.hift_graph import ROW_BUCKETS, GraphedHiFT
from minicpmo_rt.code2wav.vocoder import CAUSAL, ORIGINAL, WHOLE_FILE, Vocoder, load_vocoder, load_vocoders, \
    write_tiny_hift
from minicpmo_rt.errors import InputError

from conftest import ieee_cudnn, rel_err, requires_cuda

# Per stream, its chunks' mel lengths; the last chunk of each plan is final. Mixed on purpose:
# streams 0-2 stay in step (equal lengths and states: batched; stream 3 too at first), stream 3 ends early, stream 4
# starts with a 5-frame chunk (the original HiFT buffers it) and so is out of step afterwards.
PLANS = ([50, 50, 50, 50, 12], [50, 50, 50, 50, 12], [50, 50, 50, 50, 30], [50, 33], [5, 50, 50, 50, 50, 7])
SHORT = ([50, 50, 12], [50, 50, 12], [50, 33], [5, 50, 7])  # same mix, fewer rounds


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("t2w")
    write_tiny_hift(d, seed=0)
    return d


def voiced(model: torch.nn.Module) -> torch.nn.Module:
    """Shift the F0 predictor's output to ~150 Hz. Random tiny weights give F0 of 0-3 Hz, all
    below the 10 Hz voiced threshold, so the harmonics (everything F0 feeds) would be multiplied
    by zero and an F0 or phase bug could not show in the samples."""
    with torch.no_grad():
        model.f0_predictor.classifier.bias += 150.0
    return model


def vocoder(assets: Path, variant: str, dtype: torch.dtype = torch.float32, with_pitch: bool = True) -> Vocoder:
    voc = load_vocoders(assets).stream if variant == CAUSAL else load_vocoder(assets / WHOLE_FILE)
    assert voc.variant == variant
    model = copy.deepcopy(voc.model)
    return Vocoder((voiced(model) if with_pitch else model).to(dtype), variant)


def mels(seed: int, dtype: torch.dtype = torch.float32, plans=PLANS) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(1, 80, n, generator=g) - 5).to(dtype) for n in plan] for plan in plans]


def open_streams(voc: Vocoder, n: int) -> list:
    # own generators (the original HiFT's random excitation), seeded per stream
    return [voc.open_stream(generator=torch.Generator(device=voc.device).manual_seed(100 + i)) for i in range(n)]


def pushed_alone(voc: Vocoder, chunks) -> list[list[torch.Tensor]]:
    out = []
    for st, mine in zip(open_streams(voc, len(chunks)), chunks):
        out.append([st.push(m.to(voc.device), last=k == len(mine) - 1) for k, m in enumerate(mine)])
    return out


def pushed_many(voc: Vocoder, chunks, max_batch=None) -> list[list[torch.Tensor]]:
    """Round k pushes chunk k of every stream that still has one (finished streams drop out)."""
    streams = open_streams(voc, len(chunks))
    out: list[list[torch.Tensor]] = [[] for _ in chunks]
    for k in range(max(map(len, chunks))):
        idx = [j for j in range(len(chunks)) if k < len(chunks[j])]
        items = [(streams[j], chunks[j][k].to(voc.device), k == len(chunks[j]) - 1) for j in idx]
        for j, wav in zip(idx, voc.push_many(items, max_batch=max_batch)):
            out[j].append(wav)
    return out


class Counting:
    """A runner that records (op, batch rows) of every stage call, then runs it eagerly. With ``buckets`` it
    reports the batch buckets a graph runner pads rows to (``row_bucket``), as ``GraphedHiFT`` does, so
    ``drive_many`` plans its calls as it would for the graphs (``grow``: its ``grow_rows``); ``frames`` then
    records each call's frame counts too."""

    def __init__(self, model, fail_on: int | None = None, buckets: tuple[int, ...] | None = None, grow: int = 0):
        self.model, self.calls, self.fail_on = model, [], fail_on
        self.frames: list[tuple[str, int, bool]] = []
        if buckets is not None:
            self.row_bucket = lambda rows: next((b for b in buckets if b >= rows), rows)
            self.grow_rows = grow

    def _run(self, op, *args, **kw):
        self.calls.append((op, args[0].shape[0]))
        self.frames.append((op, args[0].shape[-1], kw.get("finalize")))
        if self.fail_on is not None and len(self.calls) == self.fail_on:
            raise RuntimeError("injected failure")
        return getattr(self.model, "run_" + op)(*args, **kw)

    def run_f0(self, *a, **k):
        return self._run("f0", *a, **k)

    def run_excite(self, *a, **k):
        return self._run("excite", *a, **k)

    def run_decode(self, *a, **k):
        return self._run("decode", *a, **k)

    def run_decode_first(self, *a, **k):
        return self._run("decode_first", *a, **k)

    def run_decode_next(self, *a, **k):
        return self._run("decode_next", *a, **k)


def compare(got, want) -> float:
    worst = 0.0
    for g_rows, w_rows in zip(got, want):
        assert len(g_rows) == len(w_rows)
        for a, b in zip(g_rows, w_rows):
            assert a.shape == b.shape and a.dtype == b.dtype
            if b.numel():
                worst = max(worst, rel_err(a, b))
    return worst


@pytest.mark.parametrize("variant", [CAUSAL, ORIGINAL])
def test_batched_equals_alone_in_float64(assets, variant):
    """Voiced, in float64: batching changes only float64 rounding (a few kernels pick another
    path for some batch sizes: measured <= 5e-13), so anything above 1e-10 is a bookkeeping bug
    (state, F0, excitation or RNG crossing between rows, misplaced splits), which shows at
    1e-3..1. With max_batch=1 the lockstep driver must give the alone path bit for bit."""
    voc = vocoder(assets, variant, torch.float64)
    chunks = mels(1, torch.float64)
    alone = voc.runner = Counting(voc.model)
    want = pushed_alone(voc, chunks)
    many = voc.runner = Counting(voc.model)
    got = pushed_many(voc, chunks)
    worst = compare(got, want)
    print(f"{variant}: float64 worst rel err batched vs alone {worst:.1e}")
    assert worst <= 1e-10
    lead = 8 * 480 if variant == CAUSAL else 0  # the causal stream's default lead silence
    assert sum(w.shape[1] for w in got[0]) == sum(PLANS[0]) * 480 + lead  # all audio came out
    ops = ("f0", "excite", "decode") if variant == CAUSAL else ("f0", "decode")
    for op in ops:  # every call made alone ran exactly once as a batch row, in fewer calls
        rows = [b for o, b in many.calls if o == op]
        assert sum(rows) == sum(1 for o, _ in alone.calls if o == op) > len(rows)
        assert max(rows) >= 3, (op, rows)


@pytest.mark.parametrize("variant", [CAUSAL, ORIGINAL])
def test_batched_equals_alone_in_float32(assets, variant):
    """fp32, the tiny checkpoint's weights as they are (F0 below the voiced threshold, as in the
    pipeline tests): oneDNN picks another conv kernel for batch > 1 at some shapes (~3e-7 per
    conv), which the random tiny HiFT amplifies (measured 1.9e-6 causal, 5.8e-6 original).
    Voiced, the original HiFT's fp32 phase integral turns that F0 rounding into ~4e-4 (the
    causal one predicts F0 in float64: ~4e-6); the float64 test covers exactness there."""
    voc = vocoder(assets, variant, with_pitch=False)
    chunks = mels(2)
    want = pushed_alone(voc, chunks)
    voc.runner = Counting(voc.model)
    got = pushed_many(voc, chunks)
    worst = compare(got, want)
    print(f"{variant}: worst rel err batched vs alone {worst:.2e}")
    assert worst <= 1e-5
    assert max(b for _, b in voc.runner.calls) >= 3
    # rows really differ: batching did not collapse them onto one stream
    assert rel_err(got[0][2], got[1][2]) > 1e-2


def pushed_staggered(voc: Vocoder, chunks, starts) -> list[list[torch.Tensor]]:
    """Like ``pushed_many``, but stream j pushes its first chunk in round ``starts[j]``: streams at their first,
    steady and final chunks meet in one round, as on a server."""
    streams = open_streams(voc, len(chunks))
    out: list[list[torch.Tensor]] = [[] for _ in chunks]
    for r in range(max(s + len(c) for s, c in zip(starts, chunks))):
        idx = [j for j in range(len(chunks)) if 0 <= r - starts[j] < len(chunks[j])]
        items = [(streams[j], chunks[j][r - starts[j]].to(voc.device), r - starts[j] == len(chunks[j]) - 1)
                 for j in idx]
        for j, wav in zip(idx, voc.push_many(items)):
            out[j].append(wav)
    return out


# Round 2: streams 0-2 at a steady chunk (3 rows: a bucket of 4 has one free row), stream 3 at its final
# chunk (26 frames: a shorter look-ahead call, then the final call), stream 4 at its first chunk.
STAGGERED = ([50, 50, 50, 50], [50, 50, 50, 50], [50, 50, 50, 50], [50, 50, 26], [50, 50])
STARTS = (0, 0, 0, 0, 2)


def test_look_ahead_calls_fill_the_rows_a_bucket_pads(assets):
    """With a runner that pads rows to batch buckets, a shorter look-ahead F0 / decode call runs in a longer
    call's padding rows (zero frames appended, output cut back): in float64 each stream's samples equal it
    pushed alone (<= 1e-10: a bookkeeping bug, a wrong cut or a padded frame leaking into a row shows at
    1e-3..1), and the round needs fewer calls than with exact-shape groups only."""
    voc = vocoder(assets, CAUSAL, torch.float64)
    voc.stream_block_frames = 50   # the graphs' default: one look-ahead call per stage and chunk
    chunks = mels(7, torch.float64, plans=STAGGERED)
    want = pushed_alone(voc, chunks)
    voc.runner = exact = Counting(voc.model)
    pushed_staggered(voc, chunks, STARTS)
    voc.runner = filled = Counting(voc.model, buckets=ROW_BUCKETS)
    got = pushed_staggered(voc, chunks, STARTS)
    worst = compare(got, want)
    print(f"look-ahead calls in padding rows: worst rel err vs alone {worst:.1e}")
    assert worst <= 1e-10
    assert sum(w.shape[1] for w in got[3]) == sum(STAGGERED[3]) * 480 + 8 * 480   # all audio came out
    for op in ("f0", "decode"):
        n_exact, n_filled = (sum(1 for o, _ in r.calls if o == op) for r in (exact, filled))
        assert n_filled < n_exact, (op, n_exact, n_filled)
        assert sum(b for o, b in filled.calls if o == op) == sum(b for o, b in exact.calls if o == op)
    # round 2's steady decode call (3 rows, a bucket of 4) took the final chunk's look-ahead call; final calls
    # (zero look-ahead) never take padding
    assert filled.calls.count(("decode", 4)) == exact.calls.count(("decode", 4)) + 1
    assert sorted(f for o, f, fin in filled.frames if fin) == sorted(f for o, f, fin in exact.frames if fin)


def test_small_calls_grow_past_their_bucket(assets):
    """With ``grow_rows`` (``GraphedHiFT``: 8; 4 here), a one-row steady call grows to a bucket of 2 to take a starting
    stream's shorter look-ahead call along instead of both running at batch 1: in float64 each stream's samples
    equal it pushed alone (<= 1e-10, as above), with fewer F0 and decode calls than padding rows alone give."""
    voc = vocoder(assets, CAUSAL, torch.float64)
    voc.stream_block_frames = 50
    plans, starts = ([50, 50, 50, 50], [50, 50]), (0, 2)    # round 2: a steady chunk meets a first chunk
    chunks = mels(8, torch.float64, plans=plans)
    want = pushed_alone(voc, chunks)
    voc.runner = filled = Counting(voc.model, buckets=ROW_BUCKETS)
    pushed_staggered(voc, chunks, starts)
    voc.runner = grown = Counting(voc.model, buckets=ROW_BUCKETS, grow=4)
    got = pushed_staggered(voc, chunks, starts)
    worst = compare(got, want)
    print(f"grown calls: worst rel err vs alone {worst:.1e}")
    assert worst <= 1e-10
    for op in ("f0", "decode"):
        n_filled, n_grown = (sum(1 for o, _ in r.calls if o == op) for r in (filled, grown))
        assert n_grown < n_filled, (op, n_filled, n_grown)
        assert sum(b for o, b in grown.calls if o == op) == sum(b for o, b in filled.calls if o == op)
    assert grown.calls.count(("decode", 2)) == filled.calls.count(("decode", 2)) + 1


def test_look_ahead_stages_ignore_frames_after_their_own(assets):
    """Why padding is exact: the causal HiFT's look-ahead F0 and decode calls give the same output frames when
    any frames follow the input's own (random here, not zeros), float64. The final call (zero look-ahead)
    does not: its last frames read what follows, so final calls never pad."""
    model = vocoder(assets, CAUSAL, torch.float64).model
    g = torch.Generator().manual_seed(11)
    mel = torch.randn(1, 80, 47, generator=g, dtype=torch.float64) - 5
    source = torch.randn(1, 1, 47 * 480, generator=g, dtype=torch.float64) * 0.1
    more_mel = torch.cat([mel, torch.randn(1, 80, 39, generator=g, dtype=torch.float64)], 2)
    more_source = torch.cat([source, torch.randn(1, 1, 39 * 480, generator=g, dtype=torch.float64)], 2)
    for finalize in (False, True):
        f0, f0_more = model.run_f0(mel, finalize=finalize), model.run_f0(more_mel, finalize=finalize)
        wav = model.run_decode(mel, source, finalize=finalize)
        wav_more = model.run_decode(more_mel, more_source, finalize=finalize)
        f0_err = rel_err(f0_more[:, :f0.shape[1]], f0)
        wav_err = rel_err(wav_more[:, :wav.shape[1]], wav)
        if finalize:
            assert f0_err > 1e-6 and wav_err > 1e-6
        else:
            assert f0.shape[1] == 47 - 3 and wav.shape[1] == (47 - 5) * 480
            assert f0_err <= 1e-12 and wav_err <= 1e-12


def test_plan_calls_fill_padding_rows_longest_first():
    """``_plan_calls``: exact-shape groups (capped), then each call's padding rows (up to its bucket, never past
    the cap) taken by shorter calls of its ragged family, longest first; other families and calls without
    ``per_frame`` never mix."""
    from minicpmo_rt.code2wav.hift import _plan_calls

    def call(frames: int, finalize=False, channels=80):
        mel = torch.zeros(1, channels, frames)
        return StageCall("f0", (mel,), finalize, None if finalize else (1, 1))

    bucket = lambda n: next(b for b in (1, 2, 4, 8, 16) if b >= n)   # noqa: E731
    # 3 steady (room for 1 in a bucket of 4), then shorter calls of 50, 37, 37 frames
    waiting = {0: call(61), 1: call(61), 2: call(61), 3: call(37), 4: call(50), 5: call(37)}
    assert sorted(map(sorted, _plan_calls(waiting, 16, bucket))) == [[0, 1, 2, 4], [3, 5]]
    assert sorted(map(sorted, _plan_calls(waiting, 16, None))) == [[0, 1, 2], [3, 5], [4]]
    # the cap bounds a call even where its bucket has room: 3 rows capped at 3 take nobody
    assert sorted(map(sorted, _plan_calls(waiting, 3, bucket))) == [[0, 1, 2], [3, 5], [4]]
    # a call of 2 rows in a bucket of 2 has no room; the 37-frame pair's bucket is full too
    two = {0: call(61), 1: call(61), 2: call(37), 3: call(37), 4: call(20)}
    assert sorted(map(sorted, _plan_calls(two, 16, bucket))) == [[0, 1], [2, 3], [4]]
    # final calls (no per_frame) and other channel counts stay apart
    mixed = {0: call(61), 1: call(61), 2: call(61), 3: call(11, finalize=True), 4: call(40, channels=64)}
    assert sorted(map(sorted, _plan_calls(mixed, 16, bucket))) == [[0, 1, 2], [3], [4]]
    # a remainder of 5 rows (bucket 8) takes 3 shorter rows; the fifth shorter row runs alone
    many = {i: call(61) for i in range(5)} | {5 + i: call(30 - i) for i in range(4)}
    plan = _plan_calls(many, 16, bucket)
    assert sorted(map(sorted, plan)) == [[0, 1, 2, 3, 4, 5, 6, 7], [8]]
    # growing past the bucket (grow=4): whole shorter calls join a call of fewer rows, up to 4 rows
    assert sorted(map(sorted, _plan_calls({0: call(61), 1: call(37)}, 16, bucket, grow=4))) == [[0, 1]]
    assert sorted(map(sorted, _plan_calls({0: call(61), 1: call(37)}, 16, bucket))) == [[0], [1]]
    # one row grows to 2 (a 50-frame call), then to 4 (the 37-frame pair)
    three = {0: call(61), 1: call(50), 2: call(37), 3: call(37)}
    assert sorted(map(sorted, _plan_calls(three, 16, bucket, grow=4))) == [[0, 1, 2, 3]]
    # 3 rows fill their padding row with one of the pair; the other would need a 5th row: it runs alone
    assert sorted(map(sorted, _plan_calls({0: call(61), 1: call(61), 2: call(61), 3: call(37), 4: call(37)},
                                          16, bucket, grow=4))) == [[0, 1, 2, 3], [4]]
    # with GraphedHiFT's grow of 8 the second of the pair joins too (a bucket of 8); 4 steady rows take a
    # pair (6 rows); 8 steady rows never grow to 16
    assert sorted(map(sorted, _plan_calls({0: call(61), 1: call(61), 2: call(61), 3: call(37), 4: call(37)},
                                          16, bucket, grow=8))) == [[0, 1, 2, 3, 4]]
    four = {i: call(61) for i in range(4)} | {4: call(37), 5: call(37)}
    assert sorted(map(sorted, _plan_calls(four, 16, bucket, grow=8))) == [[0, 1, 2, 3, 4, 5]]
    eight = {i: call(61) for i in range(8)} | {8: call(37)}
    assert sorted(map(sorted, _plan_calls(eight, 16, bucket, grow=8))) == [list(range(8)), [8]]
    # the cap bounds growth; final calls never grow or join
    assert sorted(map(sorted, _plan_calls({0: call(61), 1: call(37), 2: call(37)}, 2, bucket, grow=4))) == \
        [[0], [1, 2]]
    assert sorted(map(sorted, _plan_calls({0: call(61), 1: call(11, finalize=True)}, 16, bucket, grow=4))) == \
        [[0], [1]]


def test_streams_sharing_the_global_rng_draw_in_item_order(assets):
    """Original-HiFT streams without a generator (the pipeline's default) share torch's global
    RNG: push_many gives what pushing them one after another in item order gives."""
    voc = vocoder(assets, ORIGINAL, torch.float64)
    chunks = mels(6, torch.float64, plans=SHORT)
    results = []
    for many in (False, True):
        torch.manual_seed(123)
        streams = [voc.open_stream() for _ in chunks]
        out: list[list[torch.Tensor]] = [[] for _ in chunks]
        for k in range(max(map(len, chunks))):
            idx = [j for j in range(len(chunks)) if k < len(chunks[j])]
            items = [(streams[j], chunks[j][k], k == len(chunks[j]) - 1) for j in idx]
            wavs = voc.push_many(items) if many else [s.push(m, last) for s, m, last in items]
            for j, w in zip(idx, wavs):
                out[j].append(w)
        results.append(out)
    for g_rows, w_rows in zip(*results):
        for a, b in zip(g_rows, w_rows):
            assert torch.equal(a, b)


def test_max_batch_caps_rows_and_one_means_alone(assets):
    voc = vocoder(assets, CAUSAL)
    chunks = mels(3, plans=SHORT)
    want = pushed_alone(voc, chunks)
    voc.runner = Counting(voc.model)
    pushed_many(voc, chunks, max_batch=2)
    assert max(b for _, b in voc.runner.calls) == 2
    voc.runner = Counting(voc.model)
    got = pushed_many(voc, chunks, max_batch=1)
    assert {b for _, b in voc.runner.calls} == {1}
    for g_rows, w_rows in zip(got, want):  # every call alone: the alone path exactly
        for a, b in zip(g_rows, w_rows):
            assert torch.equal(a, b)


@pytest.mark.parametrize("variant", [CAUSAL, ORIGINAL])
def test_graph_runner_on_cpu_is_the_eager_path_exactly(assets, variant):
    """GraphedHiFT off CUDA runs the same stage functions: bit-identical, alone and batched."""
    voc = vocoder(assets, variant)
    assert voc.runner is voc.model  # CPU: eager by default
    chunks = mels(4, plans=SHORT)
    want_alone = pushed_alone(voc, chunks)
    voc.runner = Counting(voc.model, buckets=ROW_BUCKETS)   # the graph runner's call plan (padding rows filled)
    want_many = pushed_many(voc, chunks)
    voc.runner = GraphedHiFT(voc.model, max_graphs=4, capture_after=2)
    for got, want in ((pushed_alone(voc, chunks), want_alone), (pushed_many(voc, chunks), want_many)):
        for g_rows, w_rows in zip(got, want):
            for a, b in zip(g_rows, w_rows):
                assert torch.equal(a, b)
    assert not voc.runner.decode.graphs and "eager" not in voc.describe_stream_path()


@pytest.mark.parametrize("variant", [CAUSAL, ORIGINAL])
def test_failure_restores_every_stream(assets, variant):
    voc = vocoder(assets, variant, torch.float64)
    chunks = mels(5, torch.float64, plans=SHORT)
    want = pushed_alone(voc, chunks)
    streams = open_streams(voc, 3)

    def round_(k):
        return [(s, c[k], k == len(c) - 1) for s, c in zip(streams, chunks)]

    first = voc.push_many(round_(0))
    snaps = [s.snapshot() for s in streams]
    voc.runner = Counting(voc.model, fail_on=2)  # the second stage call of the round raises
    with pytest.raises(RuntimeError, match="injected"):
        voc.push_many(round_(1))
    for s, snap in zip(streams, snaps):
        for k, v in s.snapshot().items():
            same = torch.equal(v, snap[k]) if isinstance(v, torch.Tensor) else v == snap[k]
            assert same, k
    voc.runner = voc.model
    second = voc.push_many(round_(1))
    for j in range(3):  # the retry continues as if the failed call never happened
        assert rel_err(first[j], want[j][0]) <= 1e-10 and rel_err(second[j], want[j][1]) <= 1e-10


def test_push_many_input_errors(assets):
    voc, other = vocoder(assets, CAUSAL), vocoder(assets, CAUSAL)
    a, b = voc.open_stream(), other.open_stream()
    mel = torch.randn(1, 80, 10)
    with pytest.raises(InputError, match="more than once"):
        voc.push_many([(a, mel, False), (a, mel, False)])
    with pytest.raises(InputError, match="item 1 is a stream of another vocoder"):
        voc.push_many([(a, mel, False), (b, mel, False)])
    with pytest.raises(InputError, match="max_batch"):
        voc.push_many([(a, mel, False)], max_batch=0)
    with pytest.raises(ValueError, match="mel must be"):
        voc.push_many([(a, torch.randn(1, 81, 10), False)])
    assert a.snapshot()["mel"].shape[2] == 0  # nothing ran


@requires_cuda
@pytest.mark.parametrize("variant,with_pitch", [(CAUSAL, False), (CAUSAL, True), (ORIGINAL, False)])
def test_cuda_graphed_batched_matches_eager_alone(variant, with_pitch):
    """Full-size HiFT on CUDA: streams pushed through push_many with the default runner (graphs,
    batched) match each stream pushed alone eagerly, within test_hift_graph's tolerance. Voiced
    only for the causal HiFT (F0 in float64); the original's fp32 phase integral amplifies F0
    rounding past that tolerance when voiced (CPU analogue, batched vs alone: 4e-5 full size)."""
    from minicpmo_rt.code2wav.hift import FULL_SIZE, fuse_weight_norm
    from minicpmo_rt.code2wav.vocoder import build_generator
    from test_fused_dit import randomize

    # mild weights: batched vs alone on the CPU (fp32 conv kernels differ by batch) measured
    # 3.8e-6 original / 9.3e-6 causal with these, vs 2-4e-5 with the default random weights
    model = randomize(build_generator(variant, FULL_SIZE), seed=11, mild=True)
    if with_pitch:
        voiced(model)  # CPU analogue, batched vs alone: 9.5e-6
    model = fuse_weight_norm(model).cuda().eval()  # as load_vocoder serves it
    graphed, eager = Vocoder(model, variant), Vocoder(model, variant, cuda_graphs=False)
    assert isinstance(graphed.runner, GraphedHiFT) and eager.runner is model
    plans = [[50] * 6 + [12]] * 4 + [[50] * 5 + [30]]   # 5 streams in step, then 4 and one final
    g = torch.Generator().manual_seed(7)
    chunks = [[torch.randn(1, 80, n, generator=g) - 5 for n in plan] for plan in plans]
    with ieee_cudnn():
        want = pushed_alone(eager, chunks)
        got = pushed_many(graphed, chunks)
    worst = compare(got, want)
    print(f"{variant}: {graphed.describe_stream_path()}; worst rel err vs eager alone {worst:.2e}")
    # as test_hift_graph: cuDNN may pick another algorithm inside a capture; the phase integral
    # amplifies the F0 rounding to ~1e-5
    assert worst <= 1e-4
    r = graphed.runner
    assert r.decode.off is None and r.f0.off is None
    assert r.decode.graphs and r.decode.replays > 0 and r.f0.replays > 0
    assert max(key[0][0][0] for key in r.decode.graphs) >= 4  # batched rows replayed from a graph


@requires_cuda
def test_cuda_small_calls_grow_and_match_eager_alone(monkeypatch):
    """Full-size causal HiFT on CUDA, the default graph runner: a steady stream's one-row calls grow to a bucket
    of 2 to take a starting stream's look-ahead calls along (``GraphedHiFT.grow_rows``), and both streams'
    samples match each pushed alone eagerly within the tolerance above."""
    from minicpmo_rt.code2wav import hift
    from minicpmo_rt.code2wav.hift import FULL_SIZE, fuse_weight_norm
    from minicpmo_rt.code2wav.vocoder import build_generator
    from test_fused_dit import randomize

    model = fuse_weight_norm(randomize(build_generator(CAUSAL, FULL_SIZE), seed=11, mild=True)).cuda().eval()
    graphed, eager = Vocoder(model, CAUSAL), Vocoder(model, CAUSAL, cuda_graphs=False)
    assert graphed.runner.grow_rows == 8
    graphed.stream_block_frames = eager.stream_block_frames = 50
    g = torch.Generator().manual_seed(3)
    chunks = [[torch.randn(1, 80, n, generator=g) - 5 for n in plan] for plan in ([50] * 4, [50, 50])]
    calls = []
    inner = hift.run_stage

    def logged(runner, batch):
        calls.append((batch[0].op, len(batch), batch[0].finalize))
        return inner(runner, batch)
    monkeypatch.setattr(hift, "run_stage", logged)
    with ieee_cudnn():
        want = pushed_alone(eager, chunks)
        calls.clear()
        got = pushed_staggered(graphed, chunks, (0, 2))
    worst = compare(got, want)
    print(f"grown calls on CUDA: {graphed.describe_stream_path()}; worst rel err vs eager alone {worst:.2e}")
    assert worst <= 1e-4
    assert ("decode", 2, False) in calls and ("f0", 2, False) in calls, calls


def test_noise_table_moves_to_the_accelerator_once():
    """The causal HiFT reads a block of noise-table rows per stream block: on an accelerator the
    table is copied there once and reused (``meta`` stands in for CUDA here), also for "cuda"
    vs "cuda:0"-style device names; the CPU path keeps reading the host table."""
    from minicpmo_rt.code2wav.hift import TINY
    from minicpmo_rt.code2wav.hift_causal import CausalHiFTGenerator

    model = CausalHiFTGenerator(TINY)
    host = model.table_noise(5, 10, torch.device("cpu"))
    assert model._device_table is None and torch.equal(host, model.noise_tables()[1][:, 5:15])
    rows = model.table_noise(5, 10, "meta")
    held = model._device_table
    assert rows.device.type == "meta" and held is not None
    n = held.shape[1]
    assert model.table_noise(n - 3, 10, torch.device("meta")).shape == (1, 10, TINY.nb_harmonics + 1)  # wraps
    assert model._device_table is held
