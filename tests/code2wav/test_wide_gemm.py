"""The many-row Triton tile GEMM (``kernels.wide_gemm``) against torch in float64.

On CPU the kernel runs through Triton's interpreter, whose TF32 dots compute in plain FP32: these
tests prove the tiling, ragged edges, the implicit conv over taps, the bias + GELU epilogue and the
TF32 rounding of the output. The CUDA tests check TF32 precision and TMA loads on the model's shapes.
"""


import pytest
import torch

from minicpmo_rt.code2wav.kernels import AVAILABLE
from minicpmo_rt.code2wav.kernels.dit_block import round_tf32_
from minicpmo_rt.code2wav.kernels import wide_gemm as wg
from minicpmo_rt.code2wav.kernels.wide_gemm import tile_for, wide_gemm

from conftest import rel_err, requires_cuda

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs triton")
SMALL = (32, 32, 32, 4, 2)


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, w, b, gelu=False, taps=1):
    """float64 addmm (+ tanh-GELU); taps > 1: out[m] = sum_j x[m + j] @ w_j.T with zero rows past x."""
    x, w = x.double(), w.double()
    M, K = x.shape
    N = w.shape[0] // taps
    xp = torch.cat([x, x.new_zeros(taps - 1, K)])
    y = sum(xp[j:j + M] @ w[j * N:(j + 1) * N].t() for j in range(taps))
    if b is not None:
        y = y + b.double()
    return torch.nn.functional.gelu(y, approximate="tanh") if gelu else y


@pytest.mark.parametrize("M,N,K,taps,gelu,bias", [(37, 45, 64, 1, False, True), (70, 96, 96, 1, True, True),
                                                 (33, 40, 32, 1, False, False), (26, 48, 64, 3, False, False),
                                                 (26, 40, 64, 3, False, True)])
def test_matches_reference(M, N, K, taps, gelu, bias):
    g = torch.Generator().manual_seed(M + N + taps)
    dev = device()
    x = torch.randn(M, K, generator=g).to(dev)
    w = (torch.randn(taps * N, K, generator=g) / K ** 0.5).to(dev)
    b = torch.randn(N, generator=g).to(dev) if bias else None
    out = torch.full((M, N), float("nan"), device=dev)
    wide_gemm(x, w, b, out, gelu=gelu, taps=taps, tile=SMALL)
    tol = 1e-6 if dev == "cpu" else 2e-3
    assert rel_err(out, reference(x, w, b, gelu, taps)) <= tol


def test_strided_output_and_rounded_store():
    """out may be a column slice of a wider buffer (the rest untouched); round_out stores the
    result rounded to nearest TF32, exactly what round_tf32_ makes of the plain result."""
    g = torch.Generator().manual_seed(3)
    dev = device()
    x = torch.randn(40, 64, generator=g).to(dev)
    w = torch.randn(48, 64, generator=g).to(dev)
    b = torch.randn(48, generator=g).to(dev)
    buf = torch.zeros(40, 100, device=dev)
    wide_gemm(x, w, b, buf[:, 10:58], tile=SMALL)
    assert rel_err(buf[:, 10:58], reference(x, w, b)) <= (1e-6 if dev == "cpu" else 2e-3)
    assert buf[:, :10].abs().max() == 0 and buf[:, 58:].abs().max() == 0
    plain = buf[:, 10:58].clone()
    rounded = torch.empty(40, 48, device=dev)
    wide_gemm(x, w, b, rounded, round_out=True, tile=SMALL)
    assert torch.equal(rounded, round_tf32_(plain.clone()))
    assert not torch.equal(rounded, plain)
    low = rounded.view(torch.int32) & 0x1FFF
    assert int(low.abs().max()) == 0           # 13 low mantissa bits cleared


def test_bad_inputs_are_named():
    dev = device()
    x, w = torch.randn(8, 64, device=dev), torch.randn(16, 64, device=dev)
    with pytest.raises(TypeError, match="FP32"):
        wide_gemm(x.double(), w, None, torch.empty(8, 16, device=dev))
    with pytest.raises(ValueError, match="want out"):
        wide_gemm(x, w, None, torch.empty(8, 15, device=dev))
    with pytest.raises(ValueError, match="taps"):
        wide_gemm(x, w, None, torch.empty(8, 5, device=dev), taps=3)
    with pytest.raises(ValueError, match="multiple of the K tile"):
        wide_gemm(torch.randn(8, 48, device=dev), torch.randn(16, 48, device=dev), None,
                  torch.empty(8, 16, device=dev), tile=(32, 32, 32, 4, 2))
    with pytest.raises(ValueError, match="precision"):
        wide_gemm(x, w, None, torch.empty(8, 16, device=dev), precision="fp16")


def test_tile_table_covers_the_dit_gemms():
    """Every GEMM the wide path launches at full size has a probed tile whose BK divides its K."""
    for M in (800, 1600):
        for N, K, taps in ((1536, 512, 1), (512, 512, 1), (2048, 512, 1), (512, 512, 3)):
            bm, bn, bk, warps, stages = tile_for(M, N, K, taps)
            assert K % bk == 0 and warps in (4, 8) and stages >= 2


@requires_cuda
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("role", ["qkv", "proj", "conv", "fc1"])
def test_cuda_full_size_tf32(role, tma):
    """The DiT's shapes at batch 16 with CFG, TF32: with operands rounded to nearest TF32 (as the
    fused body stores them) the error is cuBLAS TF32's (~3e-4 on these inputs), and TMA loads
    give the pointer loads' result up to summation order."""
    if tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper")
    M, N, K, taps, gelu = {"qkv": (1600, 1536, 512, 1, False), "proj": (1600, 512, 512, 1, False),
                           "conv": (1664, 512, 512, 3, False), "fc1": (1600, 2048, 512, 1, True)}[role]
    g = torch.Generator(device="cuda").manual_seed(5)
    x = round_tf32_(torch.randn(M, K, device="cuda", generator=g))
    w = round_tf32_(torch.randn(taps * N, K, device="cuda", generator=g) / K ** 0.5)
    b = 0.02 * torch.randn(N, device="cuda", generator=g)
    out = torch.empty(M, N, device="cuda")
    wide_gemm(x, w, b, out, gelu=gelu, taps=taps, tma=tma)
    err = rel_err(out, reference(x, w, b, gelu, taps))
    print(f"wide_gemm {role} tma={tma}: rel err {err:.2e}")
    assert err <= 1e-5        # operands exact in TF32: only the FP32 accumulation order differs
    if tma:
        ptr = torch.empty_like(out)
        wide_gemm(x, w, b, ptr, gelu=gelu, taps=taps, tma=False)
        assert rel_err(out, ptr) <= 1e-6


def test_ieee_launches_take_their_own_tile_on_pointer_loads():
    """IEEE dots without an explicit tile take IEEE_TILE and pointer loads (on the TF32 tables' tiles, and
    with TMA-staged ones, the FMA dots spilled kilobytes per thread); TF32 and explicit tiles keep theirs."""
    assert wg._ieee_launch("ieee", None, True) == (wg.IEEE_TILE, False)
    assert wg._ieee_launch("ieee", SMALL, True) == (SMALL, True)
    assert wg._ieee_launch("tf32", None, True) == (None, True)


@pytest.mark.parametrize("M,N,K,taps,gelu", [(70, 130, 96, 1, True), (26, 40, 48, 3, False)])
def test_ieee_default_tile_matches_reference(M, N, K, taps, gelu):
    """The IEEE launch on its own tile (ragged rows and columns; K 48 fits BK down to 16) computes the GEMM."""
    g = torch.Generator().manual_seed(M + taps)
    dev = device()
    x = torch.randn(M, K, generator=g).to(dev)
    w = (torch.randn(taps * N, K, generator=g) / K ** 0.5).to(dev)
    b = torch.randn(N, generator=g).to(dev)
    out = torch.full((M, N), float("nan"), device=dev)
    wide_gemm(x, w, b, out, gelu=gelu, taps=taps, precision="ieee", tma=True)
    assert rel_err(out, reference(x, w, b, gelu, taps)) <= 1e-6


@requires_cuda
@pytest.mark.parametrize("role", ["qkv", "conv", "fc1"])
def test_cuda_full_size_ieee(role):
    """IEEE dots at batch 16 with CFG on the IEEE tile (FP32 FMA): the FP32 GEMM's error (~1e-7)."""
    M, N, K, taps, gelu = {"qkv": (1600, 1536, 512, 1, False), "conv": (1664, 512, 512, 3, False),
                           "fc1": (1600, 2048, 512, 1, True)}[role]
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(M, K, device="cuda", generator=g)
    w = torch.randn(taps * N, K, device="cuda", generator=g) / K ** 0.5
    b = 0.02 * torch.randn(N, device="cuda", generator=g)
    out = torch.empty(M, N, device="cuda")
    wide_gemm(x, w, b, out, gelu=gelu, taps=taps, precision="ieee", tma=True)
    err = rel_err(out, reference(x, w, b, gelu, taps))
    print(f"wide_gemm {role} ieee: rel err {err:.2e}")
    assert err <= 1e-6


def qkv_reference(x, w, b, qn, kn, H, D, T):
    """float64 QKV projection + per-head LayerNorms: (q (R,T,H,D), k (R,T,H,D), v (R,T,H,D))."""
    y = (x.double() @ w.double().t() + b.double()).view(-1, T, 3, H, D)
    q, k, v = y.unbind(2)
    ln = lambda z, m: torch.nn.functional.layer_norm(z, (D,), m.weight.double(), m.bias.double(), m.eps)  # noqa: E731
    return ln(q, qn), ln(k, kn), v


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("tile", [(32, 64, 32, 4, 2), (16, 32, 32, 4, 2)])
def test_qkv_with_head_norms_in_the_epilogue(pooled, tile):
    """wide_qkv = the QKV GEMM + dit_ops.qkv_head_ln: q normalised into q_out, normalised k and raw v
    into the [k|v] cache (own rows, or pool rows/frames), nothing else of the cache touched; a 64-wide
    column tile holds two heads, a 32-wide one one; R*T = 21 leaves a ragged row tile."""
    from minicpmo_rt.code2wav.kernels.wide_gemm import wide_qkv
    g = torch.Generator().manual_seed(11)
    dev = device()
    R, T, H, D, C = 3, 7, 2, 32, 64
    x = torch.randn(R * T, C, generator=g).to(dev)
    w = (torch.randn(3 * H * D, C, generator=g) / C ** 0.5).to(dev)
    b = torch.randn(3 * H * D, generator=g).to(dev)
    qn, kn = torch.nn.LayerNorm(D).to(dev), torch.nn.LayerNorm(D).to(dev)
    with torch.no_grad():
        for m in (qn, kn):
            m.weight.copy_(1 + 0.2 * torch.randn(D, generator=g))
            m.bias.copy_(0.1 * torch.randn(D, generator=g))
    q = torch.full((R, T, H, D), float("nan"), device=dev)
    if pooled:
        kv = torch.zeros(5, H, 12, 2 * D, device=dev)
        rows = torch.tensor([4, 0, 2], dtype=torch.int32, device=dev)
        pos = torch.stack([torch.randperm(12, generator=g)[:T] for _ in range(R)]).to(torch.int32).to(dev)
    else:
        kv = torch.zeros(R, H, T + 4, 2 * D, device=dev)
        rows = pos = None
    wide_qkv(x, w, b, qn.weight, qn.bias, kn.weight, kn.bias, q, kv if pooled else kv[:, :, :T], T, 1e-6,
             rows=rows, pos=pos, tile=tile)
    rq, rk, rv = qkv_reference(x, w, b, qn, kn, H, D, T)
    tol = 1e-5 if dev == "cpu" else 2e-3      # FP32 LayerNorm against FP64: a few 1e-6
    assert rel_err(q, rq) <= tol
    if pooled:
        r_idx, p_idx = rows.long()[:, None].expand(-1, T), pos.long()
        got = kv[r_idx, :, p_idx]                               # (R, T, H, 2D)
        written = torch.zeros(5, 12, dtype=torch.bool, device=dev)
        written[r_idx, p_idx] = True
        assert kv.permute(0, 2, 1, 3)[~written].abs().max() == 0
    else:
        got = kv[:, :, :T].transpose(1, 2)
        assert kv[:, :, T:].abs().max() == 0
    assert rel_err(got[..., :D], rk) <= tol and rel_err(got[..., D:], rv) <= tol
    with pytest.raises(ValueError, match="whole heads"):
        wide_qkv(x, w, b, qn.weight, qn.bias, kn.weight, kn.bias, q, kv if pooled else kv[:, :, :T], T, 1e-6,
                 rows=rows, pos=pos, tile=(32, 16, 32, 4, 2))


@requires_cuda
@pytest.mark.parametrize("tma,tile", [(False, None), (True, None), (True, (64, 128, 32, 4, 4)),
                                      (True, (64, 64, 32, 4, 4)), (True, (128, 64, 32, 4, 4))])
def test_cuda_qkv_full_size(tma, tile):
    """wide_qkv at batch 16 with CFG (1600 rows, 8 heads of 64) on TF32-exact operands: FP32-level
    agreement with the FP64 reference, through TMA or pointer loads, default and candidate tiles."""
    if tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper")
    from minicpmo_rt.code2wav.kernels.wide_gemm import wide_qkv
    g = torch.Generator(device="cuda").manual_seed(6)
    R, T, H, D, C = 32, 50, 8, 64, 512
    x = round_tf32_(torch.randn(R * T, C, device="cuda", generator=g))
    w = round_tf32_(torch.randn(3 * H * D, C, device="cuda", generator=g) / C ** 0.5)
    b = 0.02 * torch.randn(3 * H * D, device="cuda", generator=g)
    qn, kn = torch.nn.LayerNorm(D, eps=1e-6).cuda(), torch.nn.LayerNorm(D, eps=1e-6).cuda()
    q = torch.empty(R, T, H, D, device="cuda")
    kv = torch.zeros(R, H, T + 400, 2 * D, device="cuda")
    wide_qkv(x, w, b, qn.weight, qn.bias, kn.weight, kn.bias, q, kv[:, :, :T], T, 1e-6, tma=tma, tile=tile)
    rq, rk, rv = qkv_reference(x, w, b, qn, kn, H, D, T)
    got = kv[:, :, :T].transpose(1, 2)
    errs = [rel_err(q, rq), rel_err(got[..., :D], rk), rel_err(got[..., D:], rv)]
    print(f"wide_qkv tma={tma} tile={tile}: q {errs[0]:.2e}, k {errs[1]:.2e}, v {errs[2]:.2e}")
    assert max(errs) <= 1e-5 and kv[:, :, T:].abs().max() == 0


def test_fp16_output_saturates_and_keeps_nan():
    """An FP16 ``out`` (an FP16 GEMM operand) is stored through ``dit_ops.store_operand``: a value
    beyond FP16's range becomes +-65504, not inf, and a NaN stays NaN (CPU: Triton's interpreter)."""
    from minicpmo_rt.code2wav.kernels import interpreting
    if not (AVAILABLE and (torch.cuda.is_available() or interpreting())):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.full((16, 32), 100.0, device=dev).half()            # each dot: 32 * 100 * +-100 = +-320000
    w = torch.cat([torch.full((8, 32), 100.0), torch.full((8, 32), -100.0)]).to(dev).half()
    x[3, 5] = float("nan")
    out = torch.empty(16, 16, device=dev, dtype=torch.float16)
    wide_gemm(x, w, None, out, tile=(16, 16, 32, 4, 2))
    good = torch.ones(16, dtype=torch.bool)
    good[3] = False
    assert torch.isnan(out[3]).all() and not torch.isinf(out).any()
    assert (out[good, :8] == 65504).all() and (out[good, 8:] == -65504).all()
