"""The fused Snake kernel (``kernels.snake``) against the torch formula (``hift.snake_reference``).

On the CPU the kernel runs through Triton's interpreter (``tl.sin`` = numpy's float32 sine there);
on CUDA it uses libdevice's sine, and the CUDA test checks the same 1e-6 bound on the GPU.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from minicpmo_rt.code2wav import hift
from minicpmo_rt.code2wav.kernels import AVAILABLE

from conftest import ieee_cudnn, rel_err, requires_cuda

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs triton")

TOL = 1e-6


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def case(b, c, t, seed, dev=None, time_major=False, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, c, t, generator=g) * scale
    alpha = torch.rand(c, generator=g) * 2 + 0.05
    alpha[0] = 1.0                                     # the initial value
    if c > 2:
        alpha[1] = 1e-4                                # small alphas: 1/alpha large
    res = torch.randn(b, c, t, generator=g)
    dev = dev or device()
    x, alpha, res = x.to(dev), alpha.to(dev), res.to(dev)
    if time_major:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
        res = res.transpose(1, 2).contiguous().transpose(1, 2)
    return x, alpha, res


def check(got, want):
    assert got.shape == want.shape
    err = rel_err(got, want)
    worst = float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))
    assert err <= TOL and worst <= TOL, (err, worst)
    return err


@pytest.mark.parametrize("b,c,t", [(1, 4, 1), (2, 16, 37), (1, 64, 1500), (3, 5, 300)])
@pytest.mark.parametrize("time_major", [False, True])
def test_snake_matches_torch_formula(b, c, t, time_major):
    from minicpmo_rt.code2wav.kernels.snake import snake
    x, alpha, _ = case(b, c, t, seed=b * 100 + c + t, time_major=time_major)
    check(snake(x, alpha), hift.snake_reference(x, alpha))


@pytest.mark.parametrize("left,right", [(0, 0), (2, 0), (5, 5), (0, 3), (10, 10)])
@pytest.mark.parametrize("time_major", [False, True])
def test_padding_and_residual(left, right, time_major):
    """Padded output = F.pad(snake(x + r)); the sum is x + r exactly, in x's layout."""
    from minicpmo_rt.code2wav.kernels.snake import snake
    x, alpha, res = case(2, 24, 77, seed=left * 7 + right, time_major=time_major)
    out = snake(x, alpha, left, right)
    check(out, F.pad(hift.snake_reference(x, alpha), (left, right)))
    assert torch.all(out[..., :left] == 0) and torch.all(out[..., out.shape[2] - right:] == 0)
    out, total = snake(x, alpha, left, right, residual=res)
    assert torch.equal(total, x + res)
    check(out, F.pad(hift.snake_reference(x + res, alpha), (left, right)))
    if time_major:
        assert out.stride(1) == 1 and total.stride(1) == 1


@pytest.mark.parametrize("time_major", [False, True])
def test_act_pad_variants(time_major):
    """LeakyReLU + nearest repeat + padding; bias and residual folding; exact where torch is."""
    from minicpmo_rt.code2wav.kernels.snake import act_pad, snake
    x, alpha, res = case(2, 12, 33, seed=3, time_major=time_major)
    bias = torch.randn(12, generator=torch.Generator().manual_seed(1)).to(x.device)
    # leaky relu, repeat 5, left pad 4: the causal upsampler's input (all exact ops)
    got = act_pad(x, "leaky", slope=0.1, left=4, repeat=5)
    want = F.pad(F.leaky_relu(x, 0.1).repeat_interleave(5, dim=2), (4, 0))
    assert torch.equal(got, want)
    assert torch.equal(act_pad(x, "leaky", slope=0.01, left=6, right=1),
                       F.pad(F.leaky_relu(x, 0.01), (6, 1)))
    # x + (res + bias), no activation, no second output: a resblock's last residual add
    got = act_pad(x, "none", residual=res, bias=bias, return_sum=False)
    assert torch.equal(got, x + (res + bias[None, :, None]))
    # snake of (conv output + bias): the bias of the conv before it
    check(snake(x, alpha, 2, 2, bias=bias), F.pad(hift.snake_reference(x + bias[None, :, None], alpha), (2, 2)))
    out, total = snake(x, alpha, 3, 0, residual=res, bias=bias)
    assert torch.equal(total, x + (res + bias[None, :, None]))
    check(out, F.pad(hift.snake_reference(total, alpha), (3, 0)))
    # layout: as the input unless asked
    assert hift.is_time_major(act_pad(x, "none", left=1)) == time_major
    assert hift.is_time_major(act_pad(x, "none", left=1, tm=True))
    with pytest.raises(ValueError):
        act_pad(x, "none", residual=res, repeat=2)


def test_strided_input_and_input_checks():
    from minicpmo_rt.code2wav.kernels.snake import snake
    x, alpha, _ = case(2, 8, 200, seed=5)
    view = x[:, :, 10:150]                           # non-contiguous time window
    check(snake(view, alpha, 1, 2), F.pad(hift.snake_reference(view, alpha), (1, 2)))
    with pytest.raises(TypeError):
        snake(x.double(), alpha.double())
    with pytest.raises(ValueError):
        snake(x, alpha[:3])


@pytest.mark.parametrize("variant", ["original", "causal"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_decode_with_the_kernels_matches_the_torch_path(variant, channels_last):
    """A TINY HiFT decode with the fused kernels forced on (the interpreter on CPU), with or
    without time-major conv weights, vs the plain torch path of the same model."""
    from minicpmo_rt.code2wav.hift import TINY, HiFTGenerator
    from minicpmo_rt.code2wav.hift_causal import CausalHiFTGenerator
    from test_fused_dit import randomize
    model = randomize(HiFTGenerator(TINY) if variant == "original" else CausalHiFTGenerator(TINY), seed=2)
    model = model.to(device())
    g = torch.Generator().manual_seed(0)
    mel = (torch.randn(2, 80, 14, generator=g) - 5).to(device())
    source = (0.01 * torch.randn(2, 1, 14 * 480, generator=g)).to(device())
    with torch.inference_mode(), ieee_cudnn():   # on a GPU: IEEE convs on both sides
        with hift.fused_kernels(False):
            want = [model.run_decode(mel, source, finalize=f) for f in (False, True)]
        model.freeze_weight_norm(channels_last=channels_last)
        assert model.time_major() == channels_last
        with hift.fused_kernels(True):
            got = [model.run_decode(mel, source, finalize=f) for f in (False, True)]
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert rel_err(a, b) <= 1e-5


class NHWCConvs(TorchDispatchMode):
    """Logs the layout of every conv's input, 1-D or the 2-D conv of [N, C, 1, T] views
    (``hift.conv1d_as_2d``; logged as the 1-D signal); a 1-D conv given a time-major input or weight
    returns a time-major output, as cuDNN does (the CPU backends may return a contiguous one). Under
    inference mode the mode sees ``conv1d``/``conv2d`` themselves, not only the ``convolution`` below."""

    CONVS = ("aten::convolution", "aten::conv1d", "aten::conv_transpose1d", "aten::conv2d",
             "aten::conv_transpose2d")

    def __init__(self):
        super().__init__()
        self.inputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name in self.CONVS:
            x, w = args[0], args[1]
            if x.ndim == 4:         # a 2-D conv of the [N, C, 1, T] views: its output keeps the views' layout
                self.inputs.append((tuple(x.squeeze(2).shape), hift.is_time_major(x.squeeze(2))))
            else:
                self.inputs.append((tuple(x.shape), hift.is_time_major(x)))
                if hift.is_time_major(x) or hift.is_time_major(w):
                    out = hift.to_time_major(out)
        return out


@pytest.mark.parametrize("as_2d", [False, True])
@pytest.mark.parametrize("variant", ["original", "causal"])
def test_time_major_layout_reaches_every_conv(variant, as_2d):
    """With time-major conv weights and the fused kernels, every conv after conv_pre (whose input
    is the caller's mel) reads a time-major input: cuDNN then needs no NCHW<->NHWC conversion. Both conv
    forms: ``F.conv1d`` (the CPU's default) and the 2-D conv of the views (CUDA's)."""
    from minicpmo_rt.code2wav.hift import TINY, HiFTGenerator
    from minicpmo_rt.code2wav.hift_causal import CausalHiFTGenerator
    from test_fused_dit import randomize
    # on the machine's device: the kernels run on CUDA, or on the CPU only under the interpreter
    dev = device()
    model = randomize(HiFTGenerator(TINY) if variant == "original" else CausalHiFTGenerator(TINY), seed=2).to(dev)
    model.freeze_weight_norm(channels_last=True)
    mel, source = torch.randn(1, 80, 12, device=dev) - 5, 0.01 * torch.randn(1, 1, 12 * 480, device=dev)
    with hift.conv1d_as_2d(as_2d), hift.fused_kernels(True), torch.inference_mode(), NHWCConvs() as log:
        model.run_decode(mel, source, finalize=False)
    assert len(log.inputs) == 80
    assert log.inputs[0] == ((1, 80, 12), False)                 # conv_pre: the caller's mel
    assert all(tm for _, tm in log.inputs[1:]), [s for s, tm in log.inputs if not tm]


def test_kernel_only_where_allowed():
    x, alpha, _ = case(1, 4, 10, seed=1, dev=device())   # CUDA, or the CPU under the interpreter
    with torch.no_grad():
        with hift.fused_kernels(True):
            assert hift.fused_kernels_for(x) and not hift.fused_kernels_for(x.double())
            with hift.fused_kernels(None):               # default: CUDA tensors only
                assert hift.fused_kernels_for(x) is x.is_cuda
            with hift.fused_kernels(False):
                assert hift.fused_kernels_for(x) is False
            assert hift.fused_kernels_for(x)             # the outer mode is back
        assert hift.fused_kernels_for(x) is x.is_cuda    # and the default after the block
    with hift.fused_kernels(True):
        assert not hift.fused_kernels_for(x)             # grad on: the kernels have no backward


# every kernel variant the HiFT launches: (ACT, HAS_RES, HAS_BIAS, HAS_SUM, REPEAT)
VARIANTS = [(0, 0, 0, False, 1), (0, 1, 1, True, 1), (0, 0, 1, False, 1), (1, 0, 0, False, 8),
            (1, 0, 0, False, 1), (2, 1, 1, False, 1)]


# The child that compiles every variant: the kernels must be imported with the interpreter off, and a
# test process that has run interpreted kernels has Triton's language functions patched for the
# interpreter (after such tests, an in-process compile failed on ``div_rn`` and the test skipped itself).
_COMPILE_FOR_SM90 = r"""
import re, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton.backends.nvidia  # noqa: F401 - the compiler for sm_90
except ImportError as exc:
    print(f"no NVIDIA backend: {exc!r}")
    sys.exit(3)
from minicpmo_rt.code2wav.kernels import snake as kernels
VARIANTS = %r
fn = kernels._act_pad
types = ["*fp32"] * 6 + ["i32"] * 4 + ["fp32"] + ["i32"] * 12 + ["constexpr"] * 9
for act, res, bias, keep, rep in VARIANTS:
    for tm in (False, True):
        sig = dict(zip(fn.arg_names, types))
        consts = dict(ACT=act, HAS_RES=res, HAS_BIAS=bias, HAS_SUM=keep, REPEAT=rep, LIBDEVICE_SIN=True,
                      BLOCK_C=64 if tm else 2, BLOCK_T=16 if tm else 512)
        for k in (("sxc", "src", "soc", "ssc") if tm else ("sxt", "srt", "sot", "sst")):
            sig[k], consts[k] = "constexpr", 1
        ptx = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4, "enable_fp_fusion": False,
                                      "enable_reflect_ftz": False}).asm["ptx"]
        approx = [a for a in ("sin.approx", "cos.approx", "div.full", "div.approx", "ex2.approx", ".ftz")
                  if a in ptx]
        print("variant", act, res, bias, rep, int(tm), "approx=" + ",".join(approx),
              "div_rn=%%d" %% ("div.rn.f32" in ptx), "fma=%%d" %% (re.search(r"\bfma\.", ptx) is not None))
print("compiled")
""" % (VARIANTS,)


def test_kernels_compile_for_sm90_with_exact_math():
    """No GPU needed: each variant compiles to H200 (sm_90) PTX with the IEEE division, no
    approximate sine/cosine/division/exp and no flush-to-zero; only the Snake variants contain
    FMAs (libdevice's own, inside its sinf), so nothing of the formula itself is contracted.
    Compiled in a child process with the interpreter off (see ``_COMPILE_FOR_SM90``)."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(Path(tempfile.mkdtemp()) / "triton")
    r = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode == 3:
        pytest.skip(f"Triton's NVIDIA backend is not installed: {r.stdout.strip()}")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("variant ")]
    assert len(lines) == 2 * len(VARIANTS)
    for _, act, res, bias, rep, tm, approx, div_rn, fma in lines:
        where = (act, res, bias, rep, tm)
        assert approx == "approx=", where
        assert div_rn == f"div_rn={int(act == '0')}", where
        assert fma == f"fma={int(act == '0')}", where


@requires_cuda
def test_cuda_snake_within_1e6_of_torch():
    """On the GPU: libdevice sine and IEEE reciprocal, no FMA contraction; also reports how many
    values are bit-identical to torch's ~7-kernel formula."""
    from minicpmo_rt.code2wav.kernels.snake import snake
    for (b, c, t), tm in (((1, 256, 464), False), ((1, 128, 2320), True), ((4, 64, 6961), True)):
        x, alpha, res = case(b, c, t, seed=c, dev="cuda", time_major=tm)
        out, total = snake(x, alpha, 3, 3, residual=res)
        want = F.pad(hift.snake_reference(x + res, alpha), (3, 3))
        err = check(out, want)
        same = float((out == want).float().mean())
        print(f"snake {b}x{c}x{t} time_major={tm}: rel err {err:.2e}, bit-identical {same:.4%}")
        assert torch.equal(total, x + res)
    with torch.no_grad():
        assert hift.fused_kernels_for(x)   # the HiFT forward takes this kernel on CUDA by default
