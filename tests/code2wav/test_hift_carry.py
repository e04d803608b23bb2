"""Carried-context decoding of the causal HiFT's streams (``hift_carry``, ``Vocoder.stream_carry``): after an
utterance's first decode each look-ahead decode computes only its new frames, carrying every causal conv's left
context, the source downsamplers' STFT frames and the iSTFT's overlap-add tail. The bounded decode re-decodes
the history instead; both compute the utterance's causal decode, so they must agree to rounding."""

import os

import pytest
import torch

from minicpmo_rt.code2wav import hift, hift_carry
from minicpmo_rt.code2wav.hift_graph import ROW_BUCKETS
from minicpmo_rt.code2wav.vocoder import CAUSAL

from conftest import ieee_cudnn, rel_err, requires_cuda
from test_vocoder_batched import (STAGGERED, STARTS, Counting, assets, compare, mels,  # noqa: F401 (fixture)
                                  pushed_alone, pushed_staggered, vocoder)

# chunk plans: steady chunks, a short final one, a final one shorter than the look-ahead, a one-chunk utterance
PLANS = ([50, 50, 50, 50, 26], [50, 50, 3], [37, 50, 50], [20])


@pytest.mark.parametrize("block", [50, 16, 7])
def test_carried_streams_equal_the_bounded_ones(assets, block):
    """Voiced, float64: every stream's samples equal the bounded stream's (<= 1e-12: the same products in
    another order; a context off by one frame or a lost tail shows at 1e-3..1), in every decode-block size.
    The look-ahead decodes after the first take only their new frames plus conv_pre's look-ahead."""
    voc = vocoder(assets, CAUSAL, torch.float64)
    voc.stream_block_frames = block
    chunks = mels(11, torch.float64, plans=PLANS)
    voc.runner = bounded = Counting(voc.model)
    want = pushed_alone(voc, chunks)
    voc.stream_carry = True
    voc.runner = carried = Counting(voc.model)
    got = pushed_alone(voc, chunks)
    worst = compare(got, want)
    print(f"blocks of {block}: carried vs bounded {worst:.1e}")
    assert worst <= 1e-12
    # all audio came out (plus the lead silence of streams whose first push is not their last)
    assert [sum(w.shape[1] for w in g) for g in got] == [(sum(p) + 8 * (len(p) > 1)) * 480 for p in PLANS]
    ops = [o for o, _ in carried.calls]
    assert ops.count("decode_first") == len(PLANS) and ops.count("decode_next") > len(PLANS)
    right = voc.model.cfg.conv_pre_look_right
    steady = [f for o, f, _ in carried.frames if o == "decode_next"]
    bounded_steady = [f for o, f, fin in bounded.frames if o == "decode" and fin is False]
    assert max(steady) <= block + right and max(bounded_steady) >= max(steady) + voc.model.history_frames()
    # final calls stay the bounded decode over the kept history
    assert sorted(f for o, f, fin in carried.frames if fin) == sorted(f for o, f, fin in bounded.frames if fin)


def test_carried_streams_batch_as_rows(assets):
    """Streams at their first, steady and final chunks in one round (``push_many``, rows padded to buckets and
    small calls grown as on the GPU): each equals its bounded stream pushed alone (float64, <= 1e-10: batched
    GEMMs sum in other orders, 3.1e-12 seen on one CPU; a wrong carry shows at 1e-3..1), and the carried decodes
    of several streams ran as one call."""
    voc = vocoder(assets, CAUSAL, torch.float64)
    voc.stream_block_frames = 50
    chunks = mels(7, torch.float64, plans=STAGGERED)
    want = pushed_alone(voc, chunks)
    voc.stream_carry = True
    voc.runner = runner = Counting(voc.model, buckets=ROW_BUCKETS, grow=4)
    got = pushed_staggered(voc, chunks, STARTS)
    worst = compare(got, want)
    print(f"carried, batched: worst rel err vs bounded alone {worst:.1e}")
    assert worst <= 1e-10
    assert max(b for o, b in runner.calls if o == "decode_next") >= 3
    assert max(b for o, b in runner.calls if o == "decode_first") >= 2


def test_failed_round_restores_the_carried_state(assets):
    """A stage call that fails leaves every stream as it was, carried state included: pushing the chunk
    again gives what an undisturbed stream gives."""
    voc = vocoder(assets, CAUSAL, torch.float64)
    voc.stream_block_frames = 50
    voc.stream_carry = True
    chunks = mels(5, torch.float64, plans=([50, 50, 50],))[0]
    s, ref = voc.open_stream(), voc.open_stream()
    s.push(chunks[0])
    ref.push(chunks[0])
    want = [ref.push(chunks[1]), ref.push(chunks[2])]
    before = s.carried
    voc.runner = Counting(voc.model, fail_on=3)      # F0, excitation, then the carried decode fails
    with pytest.raises(RuntimeError, match="injected"):
        voc.push_many([(s, chunks[1], False)])
    assert s.carried is before
    voc.runner = voc.model
    got = [s.push(chunks[1]), s.push(chunks[2])]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_decode_next_input_errors():
    from minicpmo_rt.code2wav.hift import TINY
    from minicpmo_rt.code2wav.hift_causal import CausalHiFTGenerator
    model = CausalHiFTGenerator(TINY).eval()
    lay = hift_carry.layout(model)
    state = torch.zeros(1, lay.size)
    with torch.inference_mode(), pytest.raises(ValueError, match="excitation"):
        hift_carry.decode_next(model, torch.zeros(1, 80, 14), torch.zeros(1, 1, 10 * 480), state)
    with torch.inference_mode(), pytest.raises(ValueError, match="m >= 1"):
        hift_carry.decode_next(model, torch.zeros(1, 80, 4), torch.zeros(1, 1, 12), state)


@pytest.mark.skipif(not hift_carry.fused_available(), reason="needs triton")
def test_carried_decode_through_the_fused_kernels_and_conv_views():
    """The GPU's path on the CPU: fused activation kernels (Triton's interpreter), time-major weights and the
    convs as 2-D views, where each conv's left context goes into the padding the activation kernel wrote.
    Carried against bounded, both through that path (float32: <= 1e-5)."""
    from minicpmo_rt.code2wav.hift import TINY
    from minicpmo_rt.code2wav.hift_causal import BoundedStream, CausalHiFTGenerator
    from test_fused_dit import randomize
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the fused kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = randomize(CausalHiFTGenerator(TINY), seed=2).to(dev).eval()
    with torch.no_grad():
        model.f0_predictor.classifier.bias += 150.0
    model.freeze_weight_norm(channels_last=True)
    g = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(1, 80, n, generator=g) - 5).to(dev) for n in (50, 50, 50, 20)]
    outs = []
    with torch.inference_mode(), ieee_cudnn(), hift.fused_kernels(True), hift.conv1d_as_2d(True):
        assert model.time_major()
        for carry in (False, True):
            s = BoundedStream(model, block_frames=50, carry=carry)
            outs.append(torch.cat([s.push(c, last=k == 3) for k, c in enumerate(chunks)], dim=1))
    err = rel_err(outs[1], outs[0])
    print(f"fused kernels, conv views: carried vs bounded {err:.1e}")
    assert err <= 1e-5


@requires_cuda
def test_cuda_carried_streams_from_graphs_match_bounded():
    """Full-size causal HiFT on CUDA, the default graph runner, streams in lockstep: carried against bounded
    (IEEE convs; the graph captures may pick other cuDNN algorithms, and the excitation's phase integral
    amplifies F0 rounding: the graph tests' 1e-4)."""
    from minicpmo_rt.code2wav.hift import FULL_SIZE, fuse_weight_norm
    from minicpmo_rt.code2wav.vocoder import Vocoder, build_generator
    from test_fused_dit import randomize
    from test_vocoder_batched import pushed_many
    model = fuse_weight_norm(randomize(build_generator(CAUSAL, FULL_SIZE), seed=11, mild=True)).cuda().eval()
    bounded, carried = Vocoder(model, CAUSAL), Vocoder(model, CAUSAL, stream_carry=True)
    plans = [[50] * 6 + [12]] * 3 + [[50] * 4 + [30]]
    g = torch.Generator().manual_seed(7)
    chunks = [[torch.randn(1, 80, n, generator=g) - 5 for n in plan] for plan in plans]
    with ieee_cudnn():
        want = pushed_many(bounded, chunks)
        got = pushed_many(carried, chunks)
    worst = compare(got, want)
    print(f"{carried.describe_stream_path()}; carried vs bounded {worst:.2e}")
    assert worst <= 1e-4
    r = carried.runner
    assert r.decode_next.graphs and r.decode_next.replays > 0


def test_switches_are_per_thread():
    """``carrying``, ``fused_kernels`` and ``conv1d_as_2d`` hold their setting per thread (ContextVars): while
    one thread decodes a stream inside ``carrying(its carry)`` with the torch path forced, a second thread's
    conv runs with no carry and the default path. As module globals (before), the second thread's conv spliced
    the first thread's carry into its padding and wrote its frames into that carry: a concurrent server's
    streams corrupted each other. Barriers order the two threads, so this fails deterministically then."""
    import threading

    torch.manual_seed(0)
    conv = hift.PaddedConv1d(4, 4, 3, left=2)
    x = torch.randn(1, 4, 9)
    with torch.no_grad():
        plain = conv(x)
    carry = hift_carry.Carry({conv: torch.full((1, 4, 2), 5.0)})
    # timeouts and daemon threads: a thread that fails breaks the barriers instead of hanging the other
    inside, other, done = (threading.Barrier(2, timeout=30) for _ in range(3))
    seen: dict[str, object] = {}
    errors: list[BaseException] = []

    def guarded(body):
        def run():
            try:
                body()
            except BaseException as exc:    # re-raised below, in the test's thread
                errors.append(exc)
                for b in (inside, other, done):
                    b.abort()
        return run

    def first():
        with torch.no_grad(), hift.carrying(carry), hift.fused_kernels(False), hift.conv1d_as_2d(True):
            seen["first"] = conv(x)
            inside.wait()
            other.wait()            # the second thread's conv ran while this thread's switches were set
            seen["first_mode"] = (hift.fused_kernels_for(x), hift._conv_as_2d.get())
        done.wait()

    def second():
        inside.wait()
        with torch.no_grad():
            seen["second"] = conv(x)
        seen["second_mode"] = (hift._fused_mode.get(), hift._conv_as_2d.get(), hift._carry.get())
        other.wait()
        done.wait()

    threads = [threading.Thread(target=guarded(f), daemon=True) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    if errors:      # the first real failure, not the broken barriers it caused in the other thread
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    assert seen["second_mode"] == (None, None, None)
    assert torch.equal(seen["second"], plain)          # zeros in its padding, not the first thread's 5s
    assert not torch.equal(seen["first"], plain)       # the carry did reach the first thread's conv
    assert list(carry.new) == [conv] and torch.equal(carry.new[conv], x[:, :, -2:])
    assert seen["first_mode"] == (False, True)         # its own settings, untouched by the second thread
