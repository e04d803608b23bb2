"""HiFT parity: the same random state_dict loaded strictly into minicpmo-rt's vocoders and
upstream's (minicpmo-utils 1.0.7 ``stepaudio2``) classes; waveforms compared in fp32.

The original HiFT draws its oscillator phases/noise from torch's global RNG, so both
sides run from the same seed; the causal HiFT uses fixed noise tables, copied from
the upstream instance into ours.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import rel_err
from minicpmo_rt.checkpoint.tiny import randomize_
from minicpmo_rt.code2wav.hift import TINY, HiFTGenerator, HiFTStream
from minicpmo_rt.code2wav.hift_causal import BoundedStream, CausalHiFTGenerator
from upstream import import_upstream

TOL = 1e-5  # fp32, identical op order: observed errors are 0 to ~1e-7


def _audible(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights tuned so F0 straddles the 10 Hz voicing threshold and the output is not clipped."""
    sd = model.state_dict()
    with torch.no_grad():
        sd["f0_predictor.classifier.bias"].fill_(12.0)
        sd["f0_predictor.classifier.weight"].mul_(10.0)
        sd["conv_post.parametrizations.weight.original0"].mul_(0.03)
    return model


def _mel(frames: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 80, frames, generator=g) * 2 - 5


@pytest.fixture(scope="module")
def original_pair():
    up = import_upstream("stepaudio2.flashcosyvoice.modules.hifigan")
    ours = _audible(randomize_(HiFTGenerator(TINY), seed=11)).eval()
    ref = up.HiFTGenerator(base_channels=TINY.base_channels,
                           f0_predictor=up.ConvRNNF0Predictor(1, 80, TINY.f0_channels)).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


@pytest.fixture(scope="module")
def causal_pair():
    gen = import_upstream("stepaudio2.causal_vocoder.generator")
    f0m = import_upstream("stepaudio2.causal_vocoder.f0_predictor")
    ours = _audible(randomize_(CausalHiFTGenerator(TINY), seed=12)).eval()
    ref = gen.CausalHiFTGenerator(
        in_channels=80, base_channels=TINY.base_channels, nb_harmonics=8, sampling_rate=24000,
        upsample_rates=[8, 5, 3], upsample_kernel_sizes=[16, 11, 7], istft_params={"n_fft": 16, "hop_len": 4},
        source_resblock_kernel_sizes=[7, 7, 11], source_resblock_dilation_sizes=[[1, 3, 5]] * 3,
        conv_pre_look_right=4, f0_predictor=f0m.CausalConvRNNF0Predictor(1, 80, TINY.f0_channels)).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    sine = ref.m_source.l_sin_gen
    ours.set_noise_tables(sine.rand_ini, sine.sine_waves)
    return ours, ref


def test_original_hift_waveform(original_pair):
    ours, ref = original_pair
    mel = _mel(40)
    f0 = ref.f0_predictor(mel)
    assert 0 < float((f0 > 10).float().mean()) < 1  # both voiced and unvoiced frames exercised
    torch.manual_seed(5)
    a, sa = ours(mel)
    torch.manual_seed(5)
    b, sb = ref(mel)
    assert a.shape == b.shape == (1, 40 * 480)
    assert rel_err(sa, sb) <= TOL
    assert rel_err(a, b) <= TOL
    assert float((b.abs() >= 0.99).float().mean()) < 0.01


def _reference_stream_original(ref, chunks):
    """stepaudio2 0.1.1 ``Token2wav.stream``'s vocoder part, written from its description."""
    mel_cache, source_cache, speech_cache = torch.zeros(1, 80, 0), torch.zeros(1, 1, 0), torch.zeros(1, 0)
    window = torch.from_numpy(np.hamming(2 * 3840))
    out = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        mel = torch.cat([mel_cache, chunk], dim=2)
        speech, source = ref(mel, source_cache)
        if speech_cache.shape[1]:
            speech = speech.clone()
            speech[:, :3840] = speech[:, :3840] * window[:3840] + speech_cache[:, -3840:] * window[3840:]
        mel_cache, source_cache, speech_cache = mel[:, :, -8:], source[:, :, -3840:], speech[:, -3840:]
        out.append(speech if last else speech[:, :-3840])
    return out


def test_original_hift_stream(original_pair):
    ours, ref = original_pair
    mel = _mel(50, seed=1)
    chunks = [mel[:, :, :20], mel[:, :, 20:40], mel[:, :, 40:]]
    torch.manual_seed(7)
    expect = _reference_stream_original(ref, chunks)
    torch.manual_seed(7)
    stream = HiFTStream(ours)
    got = [stream.push(c, last=i == len(chunks) - 1) for i, c in enumerate(chunks)]
    # 3840 samples held back, so a steady chunk of n frames emits exactly n * 480 samples
    assert [g.shape[1] for g in got] == [20 * 480 - 3840, 20 * 480, 10 * 480 + 3840]
    for g, e in zip(got, expect):
        assert rel_err(g, e) <= TOL
    # total length equals the mel length; a push after the last chunk is refused
    assert sum(g.shape[1] for g in got) == 50 * 480
    with pytest.raises(RuntimeError, match="reset"):
        stream.push(chunks[0])


def test_original_stream_lead_silence(original_pair):
    ours, _ = original_pair
    stream = HiFTStream(ours, lead_silence=True, generator=torch.Generator().manual_seed(0))
    first = stream.push(_mel(20))
    assert first.shape[1] == 20 * 480 and torch.all(first[:, :3840] == 0)


@pytest.mark.parametrize("finalize", [True, False])
def test_causal_hift_waveform(causal_pair, finalize):
    ours, ref = causal_pair
    mel = _mel(30, seed=2)
    a, sa = ours(mel, finalize=finalize)
    b, sb = ref.inference(mel, finalize=finalize)
    frames = 30 if finalize else 30 - 8
    assert a.shape == b.shape == (1, frames * 480)
    assert rel_err(sa, sb) <= TOL
    assert rel_err(a, b) <= TOL


def test_causal_bounded_stream(causal_pair):
    ours, ref = causal_pair
    bv = import_upstream("stepaudio2.causal_vocoder.bounded_vocoder")
    mel = _mel(55, seed=3)
    sizes = [20, 17, 15, 3]
    upstream = bv.BoundedVocoder(ref)
    stream = BoundedStream(ours, lead_silence=False)
    assert stream.history == upstream.history and stream.model.delay_frames == upstream.delay == 8
    got, expect, start = [], [], 0
    for i, n in enumerate(sizes):
        last = i == len(sizes) - 1
        chunk = mel[:, :, start:start + n]
        start += n
        expect.append(upstream.stream(chunk, finalize=last))
        got.append(stream.push(chunk, last=last))
    for g, e in zip(got, expect):
        assert g.shape == e.shape
        if e.shape[1]:
            assert rel_err(g, e) <= TOL
    total = torch.cat(got, dim=1)
    assert total.shape[1] == 55 * 480
    # The bounded stream equals whole-utterance causal vocoding up to fp32 noise.
    whole, _ = ours(mel, finalize=True)
    assert rel_err(total, whole) <= 1e-4
    # bounded: the mel history it keeps does not grow with the utterance
    assert stream.mel.shape[2] <= stream.history + stream.model.delay_frames + stream.block_frames


def test_causal_stream_block_size_only_changes_rounding(causal_pair):
    ours, _ = causal_pair
    mel = _mel(60, seed=5)
    outs = []
    for block in (16, 50):
        stream = BoundedStream(ours, block_frames=block, lead_silence=False)
        outs.append(torch.cat([stream.push(mel[:, :, :50]), stream.push(mel[:, :, 50:], last=True)], dim=1))
    assert outs[0].shape == outs[1].shape == (1, 60 * 480)
    assert rel_err(outs[1], outs[0]) <= TOL


def test_causal_stream_lead_silence(causal_pair):
    ours, _ = causal_pair
    stream = BoundedStream(ours)
    first = stream.push(_mel(20, seed=4))
    assert first.shape[1] == 20 * 480  # 12 frames of audio + 8 frames of leading zeros
    assert torch.all(first[:, :3840] == 0)
    tail = stream.push(_mel(0), last=True)
    assert tail.shape[1] == 8 * 480
