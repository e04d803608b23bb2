"""The fused Snake kernel (``kernels.snake``) against the torch formula (``hift.snake_reference``).

On the CPU the kernel runs through Triton's interpreter (``tl.sin`` = numpy's float32 sine there);
on CUDA it uses libdevice's sine, and the CUDA test checks the same 1e-6 bound on the GPU.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernel import

from minicpmo_rt.code2wav import hift  # noqa: E402
from minicpmo_rt.code2wav.kernels import AVAILABLE  # noqa: E402

from conftest import rel_err, requires_cuda  # noqa: E402

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


def test_strided_input_and_input_checks():
    from minicpmo_rt.code2wav.kernels.snake import snake
    x, alpha, _ = case(2, 8, 200, seed=5)
    view = x[:, :, 10:150]                           # non-contiguous time window
    check(snake(view, alpha, 1, 2), F.pad(hift.snake_reference(view, alpha), (1, 2)))
    with pytest.raises(TypeError):
        snake(x.double(), alpha.double())
    with pytest.raises(ValueError):
        snake(x, alpha[:3])


def test_resblocks_with_the_kernel_match_the_torch_path():
    """A TINY HiFT decode with SNAKE_KERNEL forced on (the interpreter on CPU) vs the torch path."""
    from minicpmo_rt.code2wav.hift import TINY, HiFTGenerator
    from test_fused_dit import randomize
    model = randomize(HiFTGenerator(TINY), seed=2).to(device())
    g = torch.Generator().manual_seed(0)
    mel = (torch.randn(1, 80, 6, generator=g) - 5).to(device())
    source = (0.01 * torch.randn(1, 1, 6 * 480, generator=g)).to(device())
    prev = hift.SNAKE_KERNEL
    try:
        with torch.inference_mode():
            hift.SNAKE_KERNEL = False
            want = model.decode(mel, source)
            hift.SNAKE_KERNEL = True
            got = model.decode(mel, source)
    finally:
        hift.SNAKE_KERNEL = prev
    assert rel_err(got, want) <= 1e-5


def test_kernel_only_where_allowed():
    x, alpha, _ = case(1, 4, 10, seed=1, dev="cpu")
    assert not hift._snake_kernel_for(x.double(), alpha.double())
    prev = hift.SNAKE_KERNEL
    try:
        hift.SNAKE_KERNEL = None                     # default: CUDA tensors only
        assert hift._snake_kernel_for(x, alpha) is False
        hift.SNAKE_KERNEL = False
        assert hift._snake_kernel_for(x.to(device()), alpha.to(device())) is False
    finally:
        hift.SNAKE_KERNEL = prev
    a = torch.nn.Parameter(alpha)
    assert not hift._snake_kernel_for(x, a)          # grad on: no backward in the kernel


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
    assert hift._snake_kernel_for(x, alpha)
