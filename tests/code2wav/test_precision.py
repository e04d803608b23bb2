import pytest
import torch

from minicpmo_rt.code2wav.precision import ieee_fp32, matmul_tf32, tf32_enabled


@pytest.fixture(autouse=True)
def _keep_flags():
    mm, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = mm, cudnn


@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("inside", [False, True])
def test_scope_sets_and_restores(before, inside):
    torch.backends.cuda.matmul.allow_tf32 = before
    with matmul_tf32(inside) as active:
        assert active is inside
        assert tf32_enabled() is inside
    assert tf32_enabled() is before


@pytest.mark.parametrize("before", [False, True])
def test_restores_on_exception(before):
    torch.backends.cuda.matmul.allow_tf32 = before
    with pytest.raises(RuntimeError, match="boom"):
        with matmul_tf32(not before):
            assert tf32_enabled() is (not before)
            raise RuntimeError("boom")
    assert tf32_enabled() is before


@pytest.mark.parametrize("cudnn_before", [False, True])
def test_never_touches_cudnn(cudnn_before):
    torch.backends.cudnn.allow_tf32 = cudnn_before
    with matmul_tf32(True):
        assert torch.backends.cudnn.allow_tf32 is cudnn_before
        with ieee_fp32():
            assert torch.backends.cudnn.allow_tf32 is cudnn_before
            assert not tf32_enabled()
        assert tf32_enabled()
    assert torch.backends.cudnn.allow_tf32 is cudnn_before


def test_nested_scopes_unwind_in_order():
    torch.backends.cuda.matmul.allow_tf32 = False
    with matmul_tf32(True):
        with ieee_fp32():
            with matmul_tf32(True):
                assert tf32_enabled()
            assert not tf32_enabled()
        assert tf32_enabled()
    assert not tf32_enabled()
