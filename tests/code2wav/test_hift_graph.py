"""GraphedHiFT vs the eager HiFTGenerator (same weights, same RNG stream)."""

import types

import pytest
import torch

from minicpmo_rt.code2wav.hift_graph import GraphedHiFT, ShapeGraphs
from minicpmo_rt.code2wav.precision import ieee_fp32, tf32_enabled

from conftest import rel_err, requires_cuda
from test_fused_dit import ieee_cudnn, randomize


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


def test_window_patch_is_scoped():
    from minicpmo_rt.code2wav import hift as hift_mod
    graphed = GraphedHiFT(types.SimpleNamespace(f0_predictor=None, decode=None))
    before = hift_mod.hann_window
    with graphed._device_windows():
        w = hift_mod.hann_window(16, "cpu")
        assert hift_mod.hann_window(16, "cpu") is w          # served from the cache
    assert hift_mod.hann_window is before
    assert torch.equal(w, before(16, "cpu"))


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
