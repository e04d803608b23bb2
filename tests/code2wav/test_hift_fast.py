"""HiFT fast path: frozen weight norm (bit-identical to computing it per call), the causal F0
predictor's float64 convs as GEMMs, the fused activation/pad structure of the resblocks, graph
safety; and on CUDA the whole fast path against the plain torch path. The Triton kernels
themselves (and the time-major layout) are tested in test_hift_snake_kernel.py."""

import copy

import pytest
import torch
import torch.nn.functional as F

from minicpmo_rt.code2wav.hift import TINY, HiFTGenerator, freeze_weight_norm, frozen, fuse_weight_norm
from minicpmo_rt.code2wav.hift_causal import CausalHiFTGenerator
from minicpmo_rt.code2wav.hift_graph import GraphedHiFT

from conftest import ieee_cudnn, rel_err, requires_cuda
from test_fused_dit import randomize
from test_hift_graph import OpLog


def build(variant: str, seed: int = 3) -> torch.nn.Module:
    model = HiFTGenerator(TINY) if variant == "original" else CausalHiFTGenerator(TINY)
    model = randomize(model, seed=seed)
    with torch.no_grad():  # voiced F0, so the F0 stage reaches the samples
        model.f0_predictor.classifier.bias += 150.0
    return model


def stages(model, mel, source):
    """F0 (in the F0 predictor's own dtype) and decode, both without look-ahead."""
    with torch.inference_mode():
        return model.run_f0(mel, finalize=False), model.run_decode(mel, source, finalize=False)


def inputs(batch=2, frames=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 80, frames, generator=g) - 5, 0.01 * torch.randn(batch, 1, frames * 480, generator=g)


WEIGHT_NORM_OPS = ("aten._weight_norm", "aten._weight_norm_interface", "aten.norm", "aten.linalg_vector_norm")


def weight_norm_ops(fn) -> int:
    with torch.inference_mode(), OpLog() as log:
        fn()
    return sum(op.startswith(WEIGHT_NORM_OPS) for op in log.ops)


# ----------------------------------------------------------------------------- 1. frozen weight norm

@pytest.mark.parametrize("variant", ["original", "causal"])
def test_frozen_weights_are_bit_identical_and_skip_the_norm(variant):
    model = build(variant)
    mel, source = inputs()
    keys = list(model.state_dict())
    want = stages(model, mel, source)
    assert weight_norm_ops(lambda: stages(model, mel, source)) > 0
    n = model.freeze_weight_norm()
    assert n >= 80  # every weight-normed conv (and the causal F0's float64 layers)
    got = stages(model, mel, source)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert weight_norm_ops(lambda: stages(model, mel, source)) == 0
    # the frozen tensors are exactly what the parametrization computes per call
    with torch.no_grad():
        for m in model.modules():
            w = frozen(m, "weight")
            if w is not None:
                assert torch.equal(w, m.weight)
    # the state_dict (keys, hence strict loading) is unchanged
    assert list(model.state_dict()) == keys
    model.load_state_dict(build(variant, seed=4).state_dict(), strict=True)


@pytest.mark.parametrize("variant", ["original", "causal"])
def test_frozen_weights_never_go_stale(variant):
    """New weights (strict load), in-place edits, a dtype cast or a copy make a module compute its
    weights per call again: outputs always equal those of an unfrozen model with the same weights."""
    model = build(variant)
    model.freeze_weight_norm()
    mel, source = inputs(batch=1, frames=20, seed=1)
    other = build(variant, seed=9)
    model.load_state_dict(other.state_dict(), strict=True)
    want = stages(other, mel, source)
    assert all(torch.equal(a, b) for a, b in zip(stages(model, mel, source), want))
    with torch.no_grad():  # edit one weight-normed conv's g in place
        model.conv_post.parametrizations.weight.original0.mul_(0.5)
        other.conv_post.parametrizations.weight.original0.mul_(0.5)
    want = stages(other, mel, source)
    assert all(torch.equal(a, b) for a, b in zip(stages(model, mel, source), want))
    model.freeze_weight_norm()  # frozen anew: the same values again
    assert all(torch.equal(a, b) for a, b in zip(stages(model, mel, source), want))
    twin = copy.deepcopy(model)
    assert all(torch.equal(a, b) for a, b in zip(stages(twin, mel, source), want))
    m64 = copy.deepcopy(model).double()
    o64 = copy.deepcopy(other).double()
    got, want = stages(m64, mel.double(), source.double()), stages(o64, mel.double(), source.double())
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_refreezing_writes_in_place():
    """A CUDA graph captured while reading a frozen weight keeps reading the same memory: freezing
    again after new weights overwrites that memory instead of replacing it."""
    model = build("original")
    model.freeze_weight_norm()
    with torch.no_grad():
        before = frozen(model.conv_pre, "weight")
        model.load_state_dict(build("original", seed=8).state_dict())
        assert frozen(model.conv_pre, "weight") is None      # stale: not served
        model.freeze_weight_norm()
        after = frozen(model.conv_pre, "weight")
        assert before is not None and after is before
        assert torch.equal(after, model.conv_pre.weight)
    assert frozen(model.conv_pre, "weight") is None           # grad on: never served


def test_frozen_weights_are_not_used_with_grad():
    model = build("original")
    model.freeze_weight_norm()
    mel, source = inputs(batch=1, frames=10)
    model.decode(mel, source).square().sum().backward()
    assert model.conv_post.parametrizations.weight.original0.grad is not None


@pytest.mark.parametrize("variant", ["original", "causal"])
def test_fused_model_freezes_float64_copies(variant):
    """A ``fuse_weight_norm``-ed model (as load_vocoder serves it) has nothing to normalise; the
    causal F0 predictor's float64 bias/classifier casts are frozen, values unchanged."""
    model = fuse_weight_norm(build(variant))
    mel, source = inputs()
    want = stages(model, mel, source)
    freeze_weight_norm(model)
    assert all(torch.equal(a, b) for a, b in zip(stages(model, mel, source), want))
    if variant == "causal":
        with torch.no_grad():
            assert frozen(model.f0_predictor.classifier, ("bias", torch.float64)) is not None


def test_graphed_hift_freezes_at_construction():
    model = build("causal")
    GraphedHiFT(model)
    with torch.no_grad():
        assert frozen(model.conv_pre, "weight") is not None
        assert frozen(model.f0_predictor.condnet[0], ("weight", torch.float64)) is not None


# ----------------------------------------------------------------------------- 2. resblock structure

@pytest.mark.parametrize("causal", [False, True])
def test_resblock_fused_structure_is_the_plain_formula(causal):
    """ResBlock.forward writes each conv's padding in the activation before it and folds the
    residual add into the next activation: on the torch path that is exactly
    x = x + c2(a2(c1(a1(x)))) per unit, bit for bit."""
    from minicpmo_rt.code2wav.hift import ResBlock, snake_reference
    block = randomize(ResBlock(8, 7, (1, 3, 5), causal=causal), seed=1)
    x = torch.randn(2, 8, 50)
    with torch.inference_mode():
        want = x
        for c1, c2, a1, a2 in zip(block.convs1, block.convs2, block.activations1, block.activations2):
            want = want + c2(snake_reference(c1(snake_reference(want, a1.alpha)), a2.alpha))
        assert torch.equal(block(x), want)


# ----------------------------------------------------------------------------- 3. float64 F0 convs as GEMMs

@pytest.mark.parametrize("left,right,k", [(0, 0, 4), (0, 3, 4), (2, 0, 3), (1, 1, 3)])
def test_conv1d_gemm_matches_conv1d_float64(left, right, k):
    from minicpmo_rt.code2wav.hift_causal import conv1d_gemm
    g = torch.Generator().manual_seed(k + left)
    x = torch.randn(3, 40, 17, generator=g, dtype=torch.float64)
    w = torch.randn(24, 40, k, generator=g, dtype=torch.float64)
    b = torch.randn(24, generator=g, dtype=torch.float64)
    want = F.conv1d(F.pad(x, (left, right)), w, b)
    got = conv1d_gemm(x.transpose(1, 2), w, b, left, right).transpose(1, 2)
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) <= 1e-14
    nob = conv1d_gemm(x.transpose(1, 2), w, None, left, right).transpose(1, 2)
    assert float((nob + b[:, None] - want).norm() / want.norm()) <= 1e-14


@pytest.mark.parametrize("finalize", [True, False])
@pytest.mark.parametrize("frozen_weights", [False, True])
def test_causal_f0_gemm_matches_conv_path(finalize, frozen_weights):
    """The float64 F0 predictor (GEMM convs) vs its F.conv1d formulation: same look-ahead and
    causal padding semantics (shapes), values ~1e-15 apart."""
    from minicpmo_rt.code2wav.hift import FULL_SIZE
    model = build("causal")
    f0p = model.f0_predictor
    if frozen_weights:
        model.freeze_weight_norm()
    mel, _ = inputs(batch=3, frames=27)
    with torch.inference_mode():
        got, want = f0p(mel, finalize=finalize), f0p.forward_conv(mel, finalize=finalize)
    assert got.dtype == torch.float64 and got.shape == want.shape == (3, 27 if finalize else 24)
    assert float((got - want).norm() / want.norm()) <= 1e-13
    # full-size channels (512): the GEMM's K is 1536
    from minicpmo_rt.code2wav.hift_causal import CausalF0Predictor
    big = randomize(CausalF0Predictor(80, FULL_SIZE.f0_channels), seed=1)
    with torch.no_grad():
        big.classifier.bias += 150.0
    with torch.inference_mode():
        got, want = big(mel, finalize=finalize), big.forward_conv(mel, finalize=finalize)
    assert float((got - want).norm() / want.norm()) <= 1e-13


# ----------------------------------------------------------------------------- graph safety

def test_causal_excitation_and_f0_are_capture_safe():
    """GraphedHiFT now also captures the causal block excitation, and the F0 predictor's GEMM
    convs: on ``meta`` (no values, so any host read fails) every op stays on the device."""
    from test_hift_graph import HOST_READS
    model = CausalHiFTGenerator(TINY).to("meta")
    model.set_noise_tables(torch.rand(1, 9), torch.rand(1, 1000, 9))
    f0 = torch.rand(2, 16, device="meta")
    phase = torch.zeros(2, 1, 9, dtype=torch.float64, device="meta")
    noise = torch.rand(2, 16 * 480, 9, device="meta")
    mel = torch.rand(2, 80, 27, device="meta")
    with torch.no_grad(), OpLog() as log:
        source, phase = model.run_excite(f0, phase, noise)
        f0 = model.run_f0(mel, finalize=False)
    assert source.shape == (2, 1, 16 * 480) and phase.shape == (2, 1, 9) and f0.shape == (2, 24)
    assert {dev for _, dev in log.devices} == {"meta"}
    assert not HOST_READS & set(log.ops)


# ----------------------------------------------------------------------------- on the GPU

def full(variant: str, seed: int = 11) -> torch.nn.Module:
    from minicpmo_rt.code2wav.hift import FULL_SIZE
    model = HiFTGenerator(FULL_SIZE) if variant == "original" else CausalHiFTGenerator(FULL_SIZE)
    model = randomize(model, seed=seed, mild=True)
    with torch.no_grad():
        model.f0_predictor.classifier.bias += 150.0
    return model.cuda().eval()


def plain(fn):
    """``fn()`` on the reference path: torch ops only (no fused kernels), weights as they are."""
    from minicpmo_rt.code2wav import hift
    with hift.fused_kernels(False):
        return fn()


@requires_cuda
@pytest.mark.parametrize("variant", ["original", "causal"])
def test_cuda_frozen_weight_norm_is_bit_identical(variant):
    """On the GPU too: frozen (NCHW) weights give exactly the per-call weight norm's outputs.

    cuDNN runs test-locally in deterministic mode: the original HiFT's transposed convs use
    cuDNN's dgrad kernels, whose default algorithms may accumulate with atomics, so two
    identical runs need not agree bit for bit otherwise (the first H200 run showed it)."""
    model = full(variant)
    mel = torch.randn(1, 80, 58, device="cuda") - 5
    source = 0.01 * torch.randn(1, 1, 58 * 480, device="cuda")
    prev = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        with ieee_cudnn():
            want = plain(lambda: stages(model, mel, source))
            again = plain(lambda: stages(model, mel, source))
            model.freeze_weight_norm(channels_last=False)
            got = plain(lambda: stages(model, mel, source))
    finally:
        torch.backends.cudnn.deterministic = prev
    assert all(torch.equal(a, b) for a, b in zip(again, want)), "cuDNN not deterministic here"
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@requires_cuda
@pytest.mark.parametrize("variant", ["original", "causal"])
def test_cuda_fast_path_matches_the_torch_path(variant):
    """The whole fast path (frozen time-major weights, NHWC convs, fused kernels, CUDA graphs) vs
    the plain eager torch path of the same weights, both IEEE (cuDNN TF32 off, test-local)."""
    model = full(variant)
    mel = torch.randn(2, 80, 58, device="cuda") - 5
    source = 0.01 * torch.randn(2, 1, 58 * 480, device="cuda")
    with ieee_cudnn():
        f0_ref, wav_ref = plain(lambda: stages(model, mel, source))
        # fused kernels, NCHW weights: only the kernels differ from the reference
        model.freeze_weight_norm(channels_last=False)
        f0_k, wav_k = stages(model, mel, source)
        graphed = GraphedHiFT(model)           # freezes time-major on CUDA
        with torch.no_grad():                  # frozen tensors are used (and seen) with grad off
            assert model.time_major()
        with torch.inference_mode():
            for _ in range(2):                 # first call eager, then captured and replayed
                f0_g = graphed.run_f0(mel, finalize=False)
                wav_g = graphed.run_decode(mel, source, finalize=False)
        assert graphed.decode.graphs and graphed.decode.off is None and graphed.f0.off is None
    e_k, e_g = rel_err(wav_k, wav_ref), rel_err(wav_g, wav_ref)
    print(f"{variant}: kernels (NCHW) vs torch {e_k:.2e} (bit-identical: {torch.equal(wav_k, wav_ref)}); "
          f"graphs (NHWC) vs torch {e_g:.2e}; F0 {rel_err(f0_g, f0_ref):.2e}")
    assert e_k <= 1e-5 and e_g <= 1e-5
    assert rel_err(f0_g, f0_ref) <= (1e-13 if variant == "causal" else 1e-5)


@requires_cuda
def test_cuda_causal_f0_gemm_matches_cudnn_float64():
    model = full("causal")
    f0p = model.f0_predictor
    mel = torch.randn(3, 80, 27, device="cuda") - 5
    with torch.inference_mode():
        for finalize in (False, True):
            got, want = f0p(mel, finalize=finalize), f0p.forward_conv(mel, finalize=finalize)
            assert got.shape == want.shape
            assert rel_err(got, want) <= 1e-13


def test_replaced_frozen_tensors_stay_allocated():
    """A layout change (or unfreezing) replaces frozen tensors; the old ones stay referenced by
    their module, since a captured CUDA graph may still read their memory."""
    import weakref
    from minicpmo_rt.code2wav.hift import unfreeze_weight_norm
    model = build("original")
    model.freeze_weight_norm(channels_last=False)
    with torch.no_grad():
        nchw = weakref.ref(frozen(model.conv_pre, "weight"))
        model.freeze_weight_norm(channels_last=True)
        assert model.time_major() and frozen(model.conv_pre, "weight") is not nchw()
        nhwc = weakref.ref(frozen(model.conv_pre, "weight"))
        unfreeze_weight_norm(model)
        assert frozen(model.conv_pre, "weight") is None and not model.time_major()
    import gc
    gc.collect()
    assert nchw() is not None and nhwc() is not None
