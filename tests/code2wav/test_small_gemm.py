"""The few-row Triton GEMM (``kernels.small_gemm``) against torch.addmm in fp64.

On CPU the kernel runs through Triton's interpreter, whose TF32 dots compute in plain FP32:
these tests prove the tiling, masking, split-K reduction and GELU epilogue; the CUDA test
checks the TF32 precision on the model's shapes.
"""


import pytest
import torch

from minicpmo_rt.code2wav.kernels import AVAILABLE, usable_on
from minicpmo_rt.code2wav.kernels.small_gemm import GemmConfig, default_config, small_gemm

from conftest import rel_err, requires_cuda

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs triton")


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, w, b, gelu):
    y = torch.addmm(b.double(), x.double(), w.double().t()) if b is not None else x.double() @ w.double().t()
    return torch.nn.functional.gelu(y, approximate="tanh") if gelu else y


ONE_K, SPLIT3, SPLIT2 = GemmConfig(16, 16, 16, 1, 2, 1), GemmConfig(32, 16, 16, 3, 2, 1), GemmConfig(16, 32, 32, 2, 2, 1)


@pytest.mark.parametrize("cfg,gelu,bias", [(ONE_K, False, True), (ONE_K, True, True), (ONE_K, False, False),
                                           (SPLIT3, False, True), (SPLIT3, False, False), (SPLIT2, False, True)])
def test_matches_addmm(cfg, gelu, bias):
    gen = torch.Generator().manual_seed(cfg.block_m + 7 * cfg.split_k)
    M, N, K = 37, 45, 70                      # ragged in every dimension
    x = torch.randn(M + 3, K, generator=gen)[3:]          # an offset view
    w = torch.randn(N, K, generator=gen) / K ** 0.5
    b = torch.randn(N, generator=gen) if bias else None
    dev = device()
    if not usable_on(x.to(dev)):
        pytest.skip("Triton cannot run here (set TRITON_INTERPRET=1 on CPU)")
    big = torch.full((M, N + 5), float("nan"), device=dev)
    out = big[:, 2:N + 2]                    # strided destination; the rest must stay untouched
    small_gemm(x.to(dev), w.to(dev), None if b is None else b.to(dev), out, gelu=gelu, precision="ieee", config=cfg)
    assert rel_err(out, reference(x, w, b, gelu)) < 1e-5
    assert torch.isnan(big[:, :2]).all() and torch.isnan(big[:, N + 2:]).all()


def test_refuses_bad_input():
    x, w, out = torch.zeros(4, 8), torch.zeros(6, 8), torch.zeros(4, 6)
    with pytest.raises(ValueError, match="shapes"):
        small_gemm(x, torch.zeros(6, 9), None, out)
    with pytest.raises(TypeError, match="FP32"):
        small_gemm(x.double(), w.double(), None, out.double())
    with pytest.raises(ValueError, match="GELU"):
        small_gemm(x, w, None, out, gelu=True, config=GemmConfig(split_k=2))


def test_default_config_fills_few_rows():
    c = default_config(100, 512, 2048)
    assert c.block_m == 128 and c.split_k > 1       # long K gets split
    assert default_config(100, 2048, 512).split_k == 1


@requires_cuda
@pytest.mark.parametrize("M,N,K,gelu", [(100, 1536, 512, False), (104, 1536, 512, False),
                                        (100, 2048, 512, True), (100, 512, 2048, False), (1600, 512, 512, False)])
def test_cuda_dit_shapes_tf32(M, N, K, gelu):
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda")
    w = torch.randn(N, K, device="cuda") / K ** 0.5
    b = torch.randn(N, device="cuda")
    out = torch.empty(M, N, device="cuda")
    small_gemm(x, w, b, out, gelu=gelu, precision="tf32")
    err = rel_err(out, reference(x.cpu(), w.cpu(), b.cpu(), gelu))
    print(f"small_gemm tf32 {M}x{N}x{K}: rel err {err:.2e}")
    assert err < 1e-3
