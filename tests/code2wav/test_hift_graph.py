"""GraphedHiFT vs the eager HiFTGenerator (same weights, same RNG stream)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from minicpmo_rt.code2wav.hift_graph import GraphedHiFT, ShapeGraphs
from minicpmo_rt.code2wav.precision import ieee_fp32, tf32_enabled

from conftest import ieee_cudnn, rel_err, requires_cuda
from fake_graphs import FakeGraphs
from test_fused_dit import randomize


def hift(device="cpu", full=False):
    from minicpmo_rt.code2wav.hift import FULL_SIZE, TINY, HiFTGenerator
    return randomize(HiFTGenerator(FULL_SIZE if full else TINY), seed=11).to(device)


def run_pair(model, graphed, mel, cache, seed):
    ge = torch.Generator(device=mel.device).manual_seed(seed)
    gg = torch.Generator(device=mel.device).manual_seed(seed)
    with torch.inference_mode(), ieee_fp32():
        want = model(mel, cache, generator=ge)
    got = graphed(mel, cache, generator=gg)
    return got, want


def test_cpu_path_is_the_eager_model_exactly():
    model = hift()
    graphed = GraphedHiFT(model)
    mel = torch.randn(2, 80, 6)
    cache = torch.randn(2, 1, 4 * 480) * 0.01
    (wav, src), (wav_e, src_e) = run_pair(model, graphed, mel, cache, seed=3)
    assert torch.equal(wav, wav_e) and torch.equal(src, src_e)
    assert torch.isfinite(wav).all() and wav.abs().max() > 0


def test_shape_graphs_fall_back_on_cpu_and_count_nothing():
    sg = ShapeGraphs(lambda x: x * 2, "t")
    assert torch.equal(sg(torch.ones(3)), torch.full((3,), 2.0))
    assert not sg.graphs


def test_shape_graphs_capture_after_budget_and_copy_out():
    sg = FakeGraphs(lambda x: x * 2, "t", max_graphs=1, capture_after=2)
    a, b = torch.ones(3), torch.ones(4)
    assert torch.equal(sg(a), a * 2) and not sg.graphs            # first sight: eager
    first = sg(a)
    assert len(sg.graphs) == 1 and sg.replays == 1                # second: captured, replayed
    kept = sg(a * 5, copy_out=True)
    assert torch.equal(sg(a * 7), a * 14) and torch.equal(first, a * 14)  # static output overwritten...
    assert torch.equal(kept, a * 10)                              # ...a copy_out result is not
    sg(b), sg(b)
    assert len(sg.graphs) == 1                                    # budget spent: b stays eager
    with pytest.raises(ValueError, match="capture_after"):
        ShapeGraphs(lambda x: x, "t", capture_after=0)


def test_batch_buckets_pad_rows_into_one_graph_and_cut_the_outputs():
    """Rows pad up to the next batch bucket (copies of the last real row; rows on axis 1 for a layer-major
    input and output), so 3 and 4 rows replay ONE graph; the caller gets its own rows only, equal to the
    function on its rows, also after a bigger call left other rows in the padding. Beyond the last bucket
    the key is exact. ``eager_calls`` / ``captures`` count the calls that did not replay."""
    def fn(x, y):            # x (b, 3), y (2, b, 5): row-independent, outputs (b, 3) and (2, b, 5)
        return x * 2 + y.sum((0, 2))[:, None], (y + 1).cumsum(2)

    sg = FakeGraphs(fn, "t", capture_after=2, batch_buckets=(1, 2, 4), batch_axes=(0, 1), out_batch_axes=(0, 1))
    g = torch.Generator().manual_seed(0)

    def call(b, copy_out=False):
        x, y = torch.randn(b, 3, generator=g), torch.randn(2, b, 5, generator=g)
        got = sg(x, y, copy_out=copy_out)
        want = fn(x, y)
        assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        return got

    call(3)
    assert not sg.graphs and sg.eager_calls == 1                  # first sight of bucket 4: eager, unpadded
    call(4)
    assert len(sg.graphs) == 1 and sg.captures == 1               # 4 rows: bucket 4 captured
    call(3), call(4), call(3)                                     # 3 rows replay it: stale padding is harmless
    assert len(sg.graphs) == 1 and sg.replays == 4
    [(shapes_x, _), (shapes_y, _)] = next(iter(sg.graphs))
    assert shapes_x == (4, 3) and shapes_y == (2, 4, 5)
    kept = call(3, copy_out=True)
    assert all(o.is_contiguous() for o in kept)                   # a cut on axis 1 is copied out contiguous
    call(5), call(5)
    assert sorted(k[0][0][0] for k in sg.graphs) == [4, 5]        # past the last bucket: exact rows
    with pytest.raises(ValueError, match="disagree on their batch size"):
        sg(torch.ones(3, 3), torch.ones(2, 4, 5))
    for bad in ((2, 1), (0, 1), (1, 1)):
        with pytest.raises(ValueError, match="batch_buckets"):
            ShapeGraphs(fn, "t", batch_buckets=bad)


def test_capturing_at_once_captures_a_first_call_and_restores_the_threshold():
    """``capturing_at_once`` (the warm-up stream's mode): a shape is captured at its first call inside it;
    ``capture_after`` is back afterwards, also when the body raises."""
    sg = FakeGraphs(lambda x: x * 2, "t", capture_after=2)
    with sg.capturing_at_once():
        assert torch.equal(sg(torch.ones(3)), torch.full((3,), 2.0))
        assert len(sg.graphs) == 1
    assert sg.capture_after == 2
    sg(torch.ones(4))
    assert len(sg.graphs) == 1                                    # outside: first sight runs eagerly
    with pytest.raises(RuntimeError, match="boom"), sg.capturing_at_once():
        raise RuntimeError("boom")
    assert sg.capture_after == 2


@pytest.mark.parametrize("variant", ["causal", "original"])
def test_graph_runner_replays_through_streams_equal_eager(variant):
    """Streams (alone and batched) through a GraphedHiFT whose graphs replay into fixed memory:
    no stream output or state may alias a graph's output buffer (it is overwritten by the next
    replay). Bit-identical to the eager streams."""
    from minicpmo_rt.code2wav.hift import TINY
    from minicpmo_rt.code2wav.vocoder import Vocoder, build_generator

    model = randomize(build_generator(variant, TINY), seed=5)
    with torch.no_grad():  # F0 ~150 Hz: voiced, so the F0 stage's output reaches the samples
        model.f0_predictor.classifier.bias += 150.0
    eager = Vocoder(model, variant)
    g = torch.Generator().manual_seed(1)
    # three streams: two rows of equal length pad to a bucket of 2, three to a bucket of 4
    chunks = [[torch.randn(1, 80, n, generator=g) - 5 for n in plan]
              for plan in ([50, 50, 50, 9], [50, 50, 50, 20], [50, 50, 50, 20])]

    def run(voc, many, max_batch=None):
        sts = [voc.open_stream(generator=torch.Generator().manual_seed(i)) for i in range(len(chunks))]
        out = []
        for k in range(4):
            items = [(s, c[k], k == 3) for s, c in zip(sts, chunks)]
            out += voc.push_many(items, max_batch) if many else [s.push(m, last) for s, m, last in items]
        return out

    graphed = Vocoder(model, variant)
    graphed.runner = runner = GraphedHiFT(model, max_graphs=8, capture_after=2)
    for sg in runner.shape_sets().values():
        sg.__class__ = FakeGraphs          # the real sets' configuration (batch buckets), faked capture
    # the causal HiFT's block excitation (tuple output: source, phase) replays too
    assert (runner.excite is None) == (variant == "original")
    # max_batch=1: equal-key rows replay one graph back to back before any stream resumes
    for many, cap in ((False, None), (True, None), (True, 1)):
        want, got = run(eager, many, cap), run(graphed, many, cap)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert {k[0][0][0] for k in runner.decode.graphs} == {1, 4}, "3 rows run in the bucket of 4"
    assert runner.decode.replays > 0 and runner.f0.replays > 0 and runner.decode.graphs
    assert variant == "original" or (runner.excite.replays > 0 and runner.excite.graphs)
    # the causal HiFT's final calls (zero look-ahead, the steady history's length) replay graphs of their own
    finals = [k for k in runner.decode.graphs if ("finalize", True) in k]
    assert bool(finals) == (variant == "causal")


def test_frames_to_held_picks_the_fewest_frames_of_a_matching_graph():
    """``ShapeGraphs.frames_to_held``: 0 for a held shape of its own, for other static arguments, dtypes, row
    buckets or other non-frame dims; else the fewest frames to a held longer graph (every input growing by the
    same frames at its own entries per frame)."""
    sg = FakeGraphs(lambda m, s, finalize: m.sum(1) + s[:, 0, ::4], "t", capture_after=1, batch_buckets=(1, 2, 4))
    for n in (20, 30):
        sg(torch.zeros(2, 3, n), torch.zeros(2, 1, 4 * n), finalize=False)
    per = (1, 4)
    assert sg.frames_to_held((torch.zeros(2, 3, 12), torch.zeros(2, 1, 48)), per, finalize=False) == 8
    assert sg.frames_to_held((torch.zeros(2, 3, 25), torch.zeros(2, 1, 100)), per, finalize=False) == 5
    assert sg.frames_to_held((torch.zeros(1, 3, 25), torch.zeros(1, 1, 100)), per, finalize=False) == 0  # bucket 1
    assert sg.frames_to_held((torch.zeros(2, 3, 20), torch.zeros(2, 1, 80)), per, finalize=False) == 0   # own
    assert sg.frames_to_held((torch.zeros(2, 3, 31), torch.zeros(2, 1, 124)), per, finalize=False) == 0  # longest
    assert sg.frames_to_held((torch.zeros(2, 3, 12), torch.zeros(2, 1, 48)), per, finalize=True) == 0
    assert sg.frames_to_held((torch.zeros(4, 3, 12), torch.zeros(4, 1, 48)), per, finalize=False) == 0  # bucket 4
    assert sg.frames_to_held((torch.zeros(2, 5, 12), torch.zeros(2, 1, 48)), per, finalize=False) == 0
    assert sg.frames_to_held((torch.zeros(2, 3, 12), torch.zeros(2, 1, 50)), per, finalize=False) == 0  # uneven
    assert ShapeGraphs(lambda x: x, "cpu").frames_to_held((torch.zeros(1, 3, 5),), (1,)) == 0


def test_final_look_ahead_calls_pad_to_a_held_graph(monkeypatch):
    """A stream's final chunk has a length of its own, so its look-ahead F0 and decode calls (causal beyond their
    own frames) would run eagerly or spend the graph budget. With graphs of longer calls held, they pad with zero
    frames and replay one (``GraphedHiFT.frames_to_graph``, ``ShapeGraphs.frames_to_held``), the output cut back.
    Tiny causal HiFT in float64, captures faked on the CPU, every shape captured at its first call: each
    stream's samples equal the eager streams' within 1e-10 (a padded frame leaking in or a wrong cut shows at
    1e-3..1), and the final round adds no F0 or decode graph. Without the padding (control) it adds them."""
    from minicpmo_rt.code2wav.hift import TINY
    from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder, build_generator

    model = randomize(build_generator(CAUSAL, TINY), seed=5).double()
    with torch.no_grad():  # F0 ~150 Hz: voiced, so the F0 stage's output reaches the samples
        model.f0_predictor.classifier.bias += 150.0
    g = torch.Generator().manual_seed(3)
    plans = ([50, 50, 23], [50, 50, 31])
    chunks = [[torch.randn(1, 80, n, generator=g, dtype=torch.float64) - 5 for n in plan] for plan in plans]

    def look_ahead_graphs(runner):      # the final calls (zero look-ahead) never pad: graphs of their own
        return sum(("finalize", False) in key for sg in (runner.f0, runner.decode) for key in sg.graphs)

    def run(voc, runner=None):
        if runner is not None:      # as prepare's warm-up: a stream alone holds the batch-1 graphs too
            warm = voc.open_stream()
            for c in chunks[0][:2]:
                warm.push(c, False)
        sts = [voc.open_stream() for _ in plans]
        out, grown = [], None
        for k in range(len(plans[0])):
            if k == len(plans[0]) - 1 and runner is not None:
                held = look_ahead_graphs(runner)
            out += voc.push_many([(s, c[k], k == len(plans[0]) - 1) for s, c in zip(sts, chunks)])
        if runner is not None:
            grown = look_ahead_graphs(runner) - held
        return out, grown

    def graphed():
        voc = Vocoder(model, CAUSAL, stream_block_frames=50)
        voc.runner = runner = GraphedHiFT(model, max_graphs=16, capture_after=1)
        for sg in runner.shape_sets().values():
            sg.__class__ = FakeGraphs
        return voc, runner

    want, _ = run(Vocoder(model, CAUSAL, stream_block_frames=50))
    voc, runner = graphed()
    got, grown = run(voc, runner)
    assert max(rel_err(a, b) for a, b in zip(got, want)) <= 1e-10
    assert grown == 0, grown      # the final chunks' look-ahead calls replayed the held graphs
    monkeypatch.setattr(GraphedHiFT, "frames_to_graph", lambda *a, **k: 0)
    voc, runner = graphed()
    got, grown = run(voc, runner)
    assert max(rel_err(a, b) for a, b in zip(got, want)) <= 1e-10
    assert grown >= 2, grown


def test_short_excitation_blocks_pad_to_a_whole_block():
    """With a runner that replays graphs (``GraphedHiFT.pads_excitation_blocks``, CUDA) a short excitation block
    (an utterance's first; those of its final push, of whatever length) runs padded with zero-F0 frames to a
    whole block and is cut back, so it replays the steady blocks' graph. Tiny causal HiFT in float64 (voiced, so
    the excitation reaches the samples), final pushes of 3, 17 and 31 frames: every excitation call of the padding
    streams has a whole block, their samples equal the unpadded streams' within 1e-12 and the phase carried after
    the last block is bit-identical (a zero F0 advances none); without the runner's flag (the control) the short
    blocks keep their lengths."""
    from minicpmo_rt.code2wav.hift import TINY
    from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder, build_generator

    model = randomize(build_generator(CAUSAL, TINY), seed=6).double()
    with torch.no_grad():
        model.f0_predictor.classifier.bias += 150.0

    class Runner:       # the eager stages, counting the excitation calls' frames
        def __init__(self, pads):
            self.pads_excitation_blocks, self.frames = pads, []

        def run_f0(self, mel, finalize=True):
            return model.run_f0(mel, finalize)

        def run_decode(self, mel, source, finalize=True):
            return model.run_decode(mel, source, finalize)

        def run_excite(self, f0, phase, noise):
            self.frames.append(f0.shape[1])
            return model.run_excite(f0, phase, noise)

    g = torch.Generator().manual_seed(4)
    for final in (3, 17, 31):
        mel = [torch.randn(1, 80, n, generator=g, dtype=torch.float64) - 5 for n in (50, 50, final)]
        out = {}
        for pads in (True, False):
            voc = Vocoder(model, CAUSAL, stream_block_frames=50)
            voc.runner = runner = Runner(pads)
            st = voc.open_stream()
            wav = torch.cat([st.push(m, k == 2) for k, m in enumerate(mel)], dim=1)
            out[pads] = (wav, st.phase, runner.frames)
        (a, pa, fa), (b, pb, fb) = out[True], out[False]
        assert a.shape == b.shape and rel_err(a, b) <= 1e-12, (final, rel_err(a, b))
        assert torch.equal(pa, pb), final
        assert set(fa) == {50} and min(fb) < 50 and len(fa) == len(fb), (final, fa, fb)


# Ops that read a device value back to the host: each synchronizes, which a CUDA graph
# capture cannot contain (cudaErrorStreamCaptureInvalidated). ``aten.equal`` is how
# ``torch.istft`` reads its window-envelope check back.
HOST_READS = {"aten._local_scalar_dense", "aten.item", "aten.equal", "aten.is_nonzero", "aten.nonzero",
              "aten.any", "aten.all"}


class OpLog(TorchDispatchMode):
    """Every aten op below autograd (composites decomposed) and the devices of its tensors."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.devices: set[tuple[str, str]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name if hasattr(func, "_schema") else str(func)
        self.ops.append(name.replace("::", "."))
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self.devices.add((self.ops[-1], t.device.type))
        return out


def test_istft_is_torch_istft_bitwise():
    """The capture-safe iSTFT has torch.istft's exact numbers (same ops, same order)."""
    from minicpmo_rt.code2wav.hift import hann_window, istft
    window = hann_window(16)
    g = torch.Generator().manual_seed(0)
    for batch, frames in ((1, 2), (2, 121), (3, 6001)):
        mag = torch.randn(batch, 9, frames, generator=g).exp().clamp(max=1e2)
        phase = torch.sin(torch.randn(batch, 9, frames, generator=g))
        spec = torch.complex(mag * torch.cos(phase), mag * torch.sin(phase))
        want = torch.istft(spec, 16, 4, 16, window=window)
        got = istft(spec, window, 4)
        assert got.shape == want.shape and torch.equal(got, want), (batch, frames)


def test_torch_istft_reads_back_to_host_and_ours_does_not():
    """Shows the cause of the capture failure: torch.istft makes a host read every call."""
    from minicpmo_rt.code2wav.hift import hann_window, istft
    spec = torch.randn(1, 9, 20, dtype=torch.complex64)
    with torch.no_grad(), OpLog() as theirs:
        torch.istft(spec, 16, 4, 16, window=hann_window(16))
    with torch.no_grad(), OpLog() as ours:
        istft(spec, hann_window(16), 4)
    assert HOST_READS & set(theirs.ops)
    assert not HOST_READS & set(ours.ops)


def test_stft_window_is_a_device_buffer_outside_the_state_dict():
    from minicpmo_rt.code2wav.hift import TINY, HiFTGenerator
    with torch.device("meta"):                     # as the loader builds it: the window stays real
        model = HiFTGenerator(TINY)
    n = torch.arange(16, dtype=torch.float64)
    periodic_hann = (0.5 - 0.5 * torch.cos(2 * torch.pi * n / 16)).float()
    assert model.stft_window.device.type == "cpu"
    assert torch.allclose(model.stft_window, periodic_hann, atol=1e-7, rtol=0)
    assert "stft_window" not in model.state_dict()  # checkpoints keep loading strictly
    assert model.to("meta").stft_window.device.type == "meta"   # moves with the model


def test_nola_violation_is_refused_at_build_time():
    import dataclasses

    from minicpmo_rt.code2wav.hift import TINY, HiFTGenerator
    from minicpmo_rt.errors import CheckpointError
    with pytest.raises(CheckpointError, match="NOLA"):
        HiFTGenerator(dataclasses.replace(TINY, hop_len=16))   # Hann's zero end leaves gaps


def test_decode_stays_on_the_input_device_and_never_reads_back():
    """decode with model and inputs on ``meta``: a host read fails there (no values), and every
    tensor any op touches must be on ``meta``, so nothing is built on the CPU and copied over
    (the two things that invalidated the H200 capture). Also checked on the CPU op log."""
    model = hift()
    mel, source = torch.randn(1, 80, 6), torch.randn(1, 1, 6 * 480) * 0.01
    with torch.no_grad(), OpLog() as cpu_log:
        model.decode(mel, source)
    assert not HOST_READS & set(cpu_log.ops)
    meta_model = hift().to("meta")
    mel_m, source_m = mel.to("meta"), source.to("meta")
    with torch.no_grad(), OpLog() as meta_log:
        wav = meta_model.decode(mel_m, source_m)
    assert wav.device.type == "meta" and wav.shape == (1, 6 * 480)
    assert {dev for _, dev in meta_log.devices} == {"meta"}, sorted(meta_log.devices)
    assert not HOST_READS & set(meta_log.ops)


def test_decode_twice_is_identical():
    model = hift()
    mel, source = torch.randn(2, 80, 7), torch.randn(2, 1, 7 * 480) * 0.01
    with torch.inference_mode():
        a, b = model.decode(mel, source), model.decode(mel, source)
    assert torch.equal(a, b) and a.abs().max() > 0


@requires_cuda
def test_cuda_graph_matches_eager_and_keeps_ieee():
    torch.backends.cuda.matmul.allow_tf32 = True          # a caller's process setting...
    model = hift("cuda", full=True)
    graphed = GraphedHiFT(model)
    for T, cache_len in ((50, 0), (58, 3840), (58, 3840)):
        mel = torch.randn(1, 80, T, device="cuda")
        cache = torch.randn(1, 1, cache_len, device="cuda") * 0.01 if cache_len else None
        with ieee_cudnn():   # test-local: the convs run in cuDNN, whose own TF32 default is on
            (wav, _), (wav_e, _) = run_pair(model, graphed, mel, cache, seed=T)
        err = rel_err(wav, wav_e)
        print(f"HiFT graph vs eager T={T}: {err:.2e}")
        # cuDNN may pick another conv algorithm inside a capture; F0 then differs by rounding
        # and the excitation's phase integral (cumsum over ~28k samples) amplifies that to ~1e-5
        assert err <= 1e-4
    assert tf32_enabled() is True                          # ...is restored after capture and replay
    assert len(graphed.decode.graphs) == 2 and graphed.decode.off is None
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.parametrize("variant", ["causal", "original"])
def test_conv_views_compute_what_conv1d_does(variant):
    """The 2-D-view formulation of the HiFT's convs (``hift.conv1d_as_2d``: CUDA takes it by default, ``True``
    forces it here) maps stride, padding, dilation and the transposed convs' output padding onto the views'
    width axis: each of the model's convs, on a time-major input (as the fused kernels leave them on CUDA),
    gives what ``F.conv1d`` / ``F.conv_transpose1d`` give. Float64 on the CPU with time-major weights, so only
    the summation order may differ (<= 1e-12); every conv must really take the 2-D path, and a channel-major
    input keeps the 1-D one."""
    from torch.profiler import ProfilerActivity, profile

    from minicpmo_rt.code2wav.hift import TINY, Conv1d, ConvTranspose1d, conv1d_as_2d, conv_weight, \
        freeze_weight_norm
    from minicpmo_rt.code2wav.vocoder import build_generator

    model = randomize(build_generator(variant, TINY), seed=3).double().eval()
    freeze_weight_norm(model, channels_last=True)
    g = torch.Generator().manual_seed(4)

    def ops(fn) -> list[str]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = fn()
        return out, [e.name for e in prof.events() if e.name.startswith("aten::conv")]

    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, (Conv1d, ConvTranspose1d))]
    assert len(convs) >= 70 and any(isinstance(m, ConvTranspose1d) for _, m in convs) == (variant == "original")
    worst = 0.0
    with torch.inference_mode():
        for name, m in convs:
            x = torch.randn(2, 64, m.in_channels, generator=g, dtype=torch.float64).transpose(1, 2)

            def conv(x=x, m=m):
                return m(x) if isinstance(m, ConvTranspose1d) else m._conv_forward(x, conv_weight(m), m.bias)
            with conv1d_as_2d(False):
                want, names_1d = ops(conv)
            with conv1d_as_2d(True):
                got, names_2d = ops(conv)
                _, names_cm = ops(lambda: conv(x.contiguous()))     # channel-major: no views
            assert got.shape == want.shape, name
            worst = max(worst, rel_err(got, want))
            kind = "conv_transpose" if isinstance(m, ConvTranspose1d) else "conv"
            assert f"aten::{kind}1d" in names_1d and f"aten::{kind}2d" not in names_1d, (name, names_1d)
            assert f"aten::{kind}2d" in names_2d and f"aten::{kind}1d" not in names_2d, (name, names_2d)
            assert f"aten::{kind}1d" in names_cm, (name, names_cm)
            with torch.no_grad():   # the default off CUDA is F.conv1d
                assert torch.equal(conv(), want), name
    print(f"{variant}: {len(convs)} convs, 2-D views vs F.conv1d worst {worst:.1e}")
    assert worst <= 1e-12


@requires_cuda
@pytest.mark.parametrize("variant", ["causal", "original"])
def test_cuda_time_major_convs_run_without_copies(variant):
    """On CUDA the frozen HiFT's convs get time-major operands; through ``F.conv1d`` torch copies each input to
    channel-major and back to NHWC (two copies per conv). Run as the 2-D conv of their views
    (``hift.conv1d_as_2d``, the default on CUDA) the decode makes no such copies and gives the same samples: cuDNN
    gets the same NHWC operands (IEEE convs here). H200: causal bit-identical; original 3.4e-6, where cuDNN
    picks another algorithm for a transposed conv or a view's alignment, and the other summation order
    (~1e-7 per conv) passes through ~40 convs: bound 1e-5."""
    from torch.profiler import ProfilerActivity, profile

    from minicpmo_rt.code2wav.hift import FULL_SIZE, conv1d_as_2d, fuse_weight_norm
    from minicpmo_rt.code2wav.vocoder import build_generator

    model = fuse_weight_norm(randomize(build_generator(variant, FULL_SIZE), seed=11, mild=True)).cuda().eval()
    assert model.freeze_weight_norm() > 0
    g = torch.Generator().manual_seed(2)
    mel = (torch.randn(2, 80, 86, generator=g) - 5).cuda()
    source = (0.01 * torch.randn(2, 1, 86 * 480, generator=g)).cuda()

    def decode():
        return model.decode(mel, source, finalize=False) if variant == "causal" else model.decode(mel, source)

    def copies(fn) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        return sum(1 for e in prof.events() if e.name == "aten::copy_")

    with torch.inference_mode(), ieee_fp32(), ieee_cudnn():
        assert model.time_major()       # frozen tensors are read with grad off
        with conv1d_as_2d(False):
            want = decode()
            n_old = copies(decode)
        got = decode()
        n_new = copies(decode)
    err = rel_err(got, want)
    print(f"{variant}: conv2d views vs conv1d {err:.1e}; aten::copy_ per decode {n_old} -> {n_new}")
    assert err <= 1e-5
    assert n_old - n_new >= 2 * 70, (n_old, n_new)   # two per conv gone (80 convs causal, 77 original)
