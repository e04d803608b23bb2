"""The fused Triton kernels of the static-cache LLM step vs their torch formulations, and the
fused decoder vs the plain one (fp32, CPU under TRITON_INTERPRET=1, tiny sizes)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from minicpmo_rt.checkpoint.config import MiniCPMOConfig  # noqa: E402
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config  # noqa: E402
from minicpmo_rt.thinker import kernels as K  # noqa: E402
from minicpmo_rt.thinker.decode import StaticDecoder  # noqa: E402
from minicpmo_rt.thinker.llm import build_llm  # noqa: E402

from conftest import rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not K.usable_on(torch.empty(0, device=DEV)),
                                reason="Triton kernels cannot run here (TRITON_INTERPRET=1 must be set before import)")


def _rope_tables(S: int, D: int):
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2).float() / D))
    f = torch.outer(torch.arange(S).float(), inv)
    emb = torch.cat([f, f], -1)
    return emb.cos().to(DEV), emb.sin().to(DEV)


def test_add_rms_norm_and_silu_mul():
    g = torch.Generator().manual_seed(0)
    x, d = torch.randn(2, 3, 96, generator=g), torch.randn(2, 3, 96, generator=g)  # 96: a non-power-of-two width
    w = torch.randn(96, generator=g)
    x, d, w = x.to(DEV), d.to(DEV), w.to(DEV)
    s, h = K.add_rms_norm(x, d, w, 1e-6)
    rs, rh = K.add_rms_norm_torch(x, d, w, 1e-6)
    assert torch.equal(s, rs) and rel_err(h, rh) <= 1e-6
    _, h0 = K.add_rms_norm(x, None, w, 1e-6)
    assert rel_err(h0, K.rms_norm_torch(x, w, 1e-6)) <= 1e-6
    gu = torch.randn(2, 3, 2 * 80, generator=g).to(DEV)
    assert rel_err(K.silu_mul(gu), K.silu_mul_torch(gu)) <= 1e-6


def test_qk_norm_rope_cache_write_and_attention():
    """Two rows at different positions (a ragged batch), GQA 4:2; the kernel writes exactly the
    fed cache rows, and attention (several splits, and one) equals masked SDPA."""
    g = torch.Generator().manual_seed(1)
    B, T, H, KV, D, S = 2, 5, 4, 2, 32, 160
    qkv = torch.randn(B, T, (H + 2 * KV) * D, generator=g).to(DEV)
    qw, kw = torch.randn(D, generator=g).to(DEV), torch.randn(D, generator=g).to(DEV)
    cos, sin = _rope_tables(S, D)
    pos = torch.stack([torch.arange(100, 105), torch.arange(40, 45)]).to(DEV)
    kc, vc = torch.randn(B, KV, S, D, generator=g).to(DEV), torch.randn(B, KV, S, D, generator=g).to(DEV)
    rk, rv = kc.clone(), vc.clone()
    q = K.qk_norm_rope_cache(qkv, qw, kw, cos, sin, pos, kc, vc, H, KV, 1e-6)
    rq = K.qk_norm_rope_cache_torch(qkv, qw, kw, cos, sin, pos, rk, rv, H, KV, 1e-6)
    assert rel_err(q, rq) <= 1e-6 and rel_err(kc, rk) <= 1e-6 and torch.equal(vc, rv)
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[100:105] = False
    assert torch.equal(kc[0][:, untouched], rk[0][:, untouched])  # only the fed rows changed
    ref = K.attention_torch(q, kc, vc, pos)
    for split in (None, 64, 1024):
        assert rel_err(K.attention(q, kc, vc, pos, split=split), ref) <= 1e-5, split
    q1, p1 = q[:, -1:].contiguous(), pos[:, -1:]
    assert rel_err(K.attention(q1, kc, vc, p1), K.attention_torch(q1, kc, vc, p1)) <= 1e-5


@torch.no_grad()
def test_fused_decoder_equals_plain_decoder():
    """Prefill 7 positions then decode 3 tokens: the Triton step vs the plain step (hidden,
    logits and the cache rows written)."""
    cfg = MiniCPMOConfig.from_dict(tiny_config())
    llm = build_llm(cfg)
    randomize_(llm, seed=11, prefix="llm.")
    llm.to(DEV).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, 7, cfg.llm.hidden_size, generator=g).to(DEV)
    plain = StaticDecoder(llm, max_len=64, kernels="torch")
    fused = StaticDecoder(llm, max_len=64, kernels="triton")
    assert rel_err(fused.prefill(prompt, 0), plain.prefill(prompt, 0)) <= 1e-5
    for i in range(3):
        tok, pos = torch.tensor([5 + i], device=DEV), torch.tensor([7 + i], device=DEV)
        lp, hp = plain.decode(tok, pos, 64)
        lf, hf = fused.decode(tok, pos)
        assert rel_err(hf, hp) <= 1e-5 and rel_err(lf, lp) <= 1e-5
    assert rel_err(fused.k_cache[:, :, :, :10], plain.k_cache[:, :, :, :10]) <= 1e-5
    assert rel_err(fused.v_cache[:, :, :, :10], plain.v_cache[:, :, :, :10]) <= 1e-5
