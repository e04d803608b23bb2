"""The Euler-step junction and CNN-roll kernels vs their torch references (CPU: Triton's
interpreter, whose dots are plain FP32; CUDA: compiled, TF32 and IEEE)."""


import pytest
import torch

from minicpmo_rt.code2wav import kernels
from minicpmo_rt.code2wav.kernels import euler_step
from minicpmo_rt.code2wav.precision import matmul_tf32

from conftest import rel_err, requires_cuda

needs_triton = pytest.mark.skipif(not kernels.AVAILABLE, reason="Triton is not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def junction_inputs(Bb, T, C, NM, Rm, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    R = 2 * Bb
    w_in = r(C, 4 * NM) / (4 * NM) ** 0.5
    return dict(norm=r(R, T, C), wf=r(NM, C) / C ** 0.5, bf=0.1 * r(NM), x=r(Bb, T, NM),
                wx=w_in[:, :NM],                        # a strided view, as the solver passes it
                hc=r(R, T, C), shift=0.1 * r(Rm, C), scale1p=1 + 0.1 * r(Rm, C), h=r(R, T, C),
                ctr=torch.arange(1, 6, dtype=torch.int32, device=device))


def run_both(kw, dt, has_v, has_next, precision="ieee"):
    a = {k: (v.clone() if k != "wx" else v) for k, v in kw.items()}
    b = {k: (v.clone() if k != "wx" else v) for k, v in kw.items()}
    if not has_next:
        a["shift"] = a["scale1p"] = b["shift"] = b["scale1p"] = None
    euler_step.euler_junction(**a, dt=dt, cfg_rate=0.7, eps=1e-6, has_v=has_v, precision=precision)
    euler_step.euler_junction_ref(**b, dt=dt, cfg_rate=0.7, eps=1e-6, has_v=has_v)
    return a, b


@needs_triton
@pytest.mark.parametrize("Bb,T,C,NM,Rm,has_v,has_next", [
    (1, 50, 64, 80, 1, True, True),      # a middle step, one modulation row for all
    (2, 19, 64, 80, 4, True, True),      # T not a multiple of the frame block; per-row tables
    (1, 16, 32, 20, 1, False, True),     # the first step's start (x = noise)
    (2, 7, 64, 80, 1, True, False),      # the last step (no next h)
])
def test_junction_matches_reference(Bb, T, C, NM, Rm, has_v, has_next):
    if DEV == "cpu" and not kernels.interpreting():
        pytest.skip("no CUDA and TRITON_INTERPRET is not set")
    kw = junction_inputs(Bb, T, C, NM, Rm, seed=Bb * 100 + T)
    a, b = run_both(kw, 0.137, has_v, has_next)
    assert rel_err(a["x"], b["x"]) < 1e-6
    assert torch.equal(a["ctr"], torch.zeros_like(a["ctr"])) and torch.equal(a["ctr"], b["ctr"])
    if has_next:
        assert rel_err(a["h"], b["h"]) < 1e-6
        assert rel_err(a["norm"], b["norm"]) < 1e-5   # LN amplifies h's rounding by 1/std
    else:   # untouched
        assert torch.equal(a["h"], kw["h"]) and torch.equal(a["norm"], kw["norm"])


@needs_triton
def test_junction_rejects_mismatched_shapes():
    kw = junction_inputs(1, 8, 32, 20, 1, seed=3)
    kw["hc"] = kw["hc"][:, :4]
    with pytest.raises(ValueError, match="must all be"):
        euler_step.euler_junction(**kw, dt=0.1, cfg_rate=0.7, eps=1e-6)


def cnn_inputs(depth, R, C, K1, F, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    return r(depth, 2, R, F, C), r(depth, R, 2 * C, K1), r(depth, R, 2 * C, K1)


@needs_triton
@pytest.mark.parametrize("valid,with_out,with_in", [(50, True, True), (1, True, True), (50, False, True),
                                                    (50, True, False)])
def test_cnn_roll_matches_reference(valid, with_out, with_in):
    """valid=1 with K-1=2: history frames read (1, 2) and written (0, 1) overlap, so every read
    must come before any write."""
    if DEV == "cpu" and not kernels.interpreting():
        pytest.skip("no CUDA and TRITON_INTERPRET is not set")
    hist, out, inp = cnn_inputs(2, 3, 96, 2, 52, seed=valid)
    idx = torch.arange(valid, valid + 2, device=DEV)
    h1, o1 = hist.clone(), out.clone()
    h2, o2 = hist.clone(), out.clone()
    euler_step.cnn_roll(h1, o1 if with_out else None, inp if with_in else None, idx)
    euler_step.cnn_roll_ref(h2, o2 if with_out else None, inp if with_in else None, idx)
    assert torch.equal(h1, h2) and torch.equal(o1, o2)
    if with_out:
        assert not torch.equal(o1, out)
    if with_in:
        assert not torch.equal(h1, hist)


@requires_cuda
@needs_triton
@pytest.mark.parametrize("precision,tol", [("ieee", 1e-6), ("tf32", 1e-3)])
def test_junction_cuda_full_size(precision, tol):
    """Full-size shapes (C=512, 80 mel) compiled; TF32 rounds operands to nearest in-kernel."""
    kw = junction_inputs(16, 50, 512, 80, 1, seed=7, device="cuda")
    a = {k: (v.clone() if k != "wx" else v) for k, v in kw.items()}
    b = {k: (v.clone() if k != "wx" else v) for k, v in kw.items()}
    euler_step.euler_junction(**a, dt=0.137, cfg_rate=0.7, eps=1e-6, precision=precision,
                              rounded=precision == "tf32")
    with matmul_tf32(False):
        euler_step.euler_junction_ref(**b, dt=0.137, cfg_rate=0.7, eps=1e-6)
    assert rel_err(a["x"], b["x"]) < tol
    assert rel_err(a["h"], b["h"]) < tol
    assert rel_err(a["norm"], b["norm"]) < 10 * tol
