"""``no_cudnn_sdpa``: cuDNN's SDPA backend off inside the block and restored after, and the variable-length
call sites (the Talker's prefill and reference forward, a turn's prompt on the dynamic cache) running inside it.

The flag is torch's own process setting, which CPU builds keep too, so the scoping is tested here on the CPU;
the speed it buys (no per-shape cuDNN plan) is a GPU measurement (``benchmarks/sdpa_first_call_probe.py``)."""

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
from minicpmo_rt.runtime.contracts import TurnRequest
from minicpmo_rt.runtime.turn import TurnPipeline
from minicpmo_rt.sdpa_backend import attention, no_cudnn_sdpa
from minicpmo_rt.talker.chunked import TalkerTurn
from minicpmo_rt.talker.engine import TalkerEngine
from minicpmo_rt.talker.model import MiniCPMTTS
from minicpmo_rt.talker.sampler import SamplingParams


@pytest.fixture
def cudnn_flag():
    """Leaves the process's flag as it found it, whatever a test sets."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.fixture
def sdpa_flags(monkeypatch):
    """The cuDNN flag at each ``F.scaled_dot_product_attention`` call (transformers' modules and ours look the
    function up on the module at call time, so the patch sees theirs too)."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("before", [True, False])
def test_block_turns_cudnn_off_and_restores_it(cudnn_flag, before):
    torch.backends.cuda.enable_cudnn_sdp(before)
    with no_cudnn_sdpa():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() is before
    with pytest.raises(RuntimeError, match="inside"):
        with no_cudnn_sdpa():
            raise RuntimeError("inside")
    assert torch.backends.cuda.cudnn_sdp_enabled() is before


def test_attention_is_sdpa_without_cudnn(cudnn_flag, sdpa_flags):
    torch.backends.cuda.enable_cudnn_sdp(True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7, 16, generator=g) for _ in range(3))
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    got = attention(q, k, v, attn_mask=mask)
    assert sdpa_flags == [False] and torch.backends.cuda.cudnn_sdp_enabled()
    ref = torch.softmax((q @ k.transpose(-1, -2) / 4.0).masked_fill(~mask, float("-inf")), -1) @ v
    assert rel_err(got, ref) < 1e-6
    kv = [t[:, :2] for t in (k, v)]     # grouped-query heads, as the Thinker's
    got = attention(q, *kv, enable_gqa=True)
    assert rel_err(got, attention(q, *(t.repeat_interleave(2, 1) for t in kv))) < 1e-6


@pytest.fixture(scope="module")
def tts():
    m = MiniCPMTTS(MiniCPMOConfig.from_dict(tiny_config()).tts)
    randomize_(m, seed=3, prefix="tts.")
    return m.eval()


def test_talker_prefills_and_reference_forward_skip_cudnn(cudnn_flag, sdpa_flags, tts):
    torch.backends.cuda.enable_cudnn_sdp(True)
    eng = TalkerEngine(tts, capacity=2, kv_budget_bytes=1 << 22, kernels="torch")
    conds = [torch.randn(n, tts.cfg.hidden_size) for n in (5, 9)]
    with torch.no_grad():
        eng._prefill_many([0, 1], conds)
        eng._prefill(0, conds[1])
        eng.decode_step(128)            # the torch step over a key bucket goes through the same layers
    n = tts.cfg.num_hidden_layers
    assert sdpa_flags == [False] * (3 * n)
    turn = TalkerTurn(tts, seed=0)
    turn._forward(conds[0], 0)
    turn._forward(conds[1][:3], 5)
    assert len(sdpa_flags) == 5 * n and not any(sdpa_flags)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_turn_prompt_on_the_dynamic_cache_skips_cudnn(cudnn_flag, sdpa_flags, tiny_ckpt):
    torch.backends.cuda.enable_cudnn_sdp(True)
    pipe = TurnPipeline.from_snapshot(tiny_ckpt, capacity=1, n_timesteps=2, thinker_fast=False,
                                      talker_params=SamplingParams(min_codes=5))
    pipe._prefill(TurnRequest.make("r", "Why is the sky blue?", max_new_tokens=4, max_codes=8))
    assert sdpa_flags and not any(sdpa_flags)
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN's backend is a GPU one)")
@pytest.mark.parametrize("shape, gqa", [((1, 12, 27, 64), False), ((1, 32, 61, 128), True)])
def test_attention_matches_torchs_own_choice_on_cuda(cudnn_flag, shape, gqa):
    """The Talker's prefill heads and the Thinker's GQA heads in bf16: the backend without cuDNN against
    torch's default choice (cuDNN where it takes the shape) within bf16 rounding."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, t, d = shape
    q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, h // 4 if gqa else h, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    mask = torch.ones(t, t, dtype=torch.bool, device="cuda").tril()[None, None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    assert rel_err(attention(q, k, v, attn_mask=mask, enable_gqa=gqa).float(), ref.float()) < 1e-2
