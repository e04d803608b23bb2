"""The fused Triton kernels of the static-cache LLM step vs their torch formulations, and the
fused decoder vs the plain one (fp32, CPU under TRITON_INTERPRET=1, tiny sizes)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
from minicpmo_rt.thinker import kernels as K
from minicpmo_rt.thinker.decode import StaticDecoder
from minicpmo_rt.thinker.llm import build_llm

from conftest import rel_err

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
    # without the per-head norm (Llama, the Talker): RoPE and the cache write only, and the norm weights matter
    # above
    q = K.qk_norm_rope_cache(qkv, None, None, cos, sin, pos, kc, vc, H, KV, 1e-6)
    rq = K.qk_norm_rope_cache_torch(qkv, None, None, cos, sin, pos, rk, rv, H, KV, 1e-6)
    assert rel_err(q, rq) <= 1e-6 and rel_err(kc, rk) <= 1e-6 and torch.equal(vc, rv)
    assert rel_err(q, K.qk_norm_rope_cache_torch(qkv, qw, kw, cos, sin, pos, rk.clone(), rv.clone(), H, KV,
                                                 1e-6)) > 0.1


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


_COMPILE_FOR_HOPPER = r"""
from pathlib import Path
import triton, triton.backends.nvidia as nv
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minicpmo_rt.thinker import kernels as K

if not (Path(nv.__file__).parent / "bin" / "ptxas").exists():
    raise SystemExit(3)
target = GPUTarget("cuda", 90, 32)

def build(kernel, sig, consts):
    return triton.compile(ASTSource(kernel, sig, consts), target=target, options={"num_warps": 4})

bf, i32, c = "*bf16", "i32", "constexpr"
for res in (True, False):
    build(K._add_rms_norm_kernel, dict(X=bf, D=bf, W=bf, SUM=bf, OUT=bf, N=i32, eps="fp32", HAS_RES=c, BLOCK=c),
          dict(HAS_RES=res, BLOCK=4096))
for heads, kv, half, norm in ((32, 8, 64, True), (12, 12, 32, False)):     # the Thinker's, the Talker's
    build(K._qk_norm_rope_cache_kernel,
          dict(QKV=bf, QOUT=bf, KC=bf, VC=bf, QW=bf, KW=bf, COS=bf, SIN=bf, POS="*i64", T=i32, s_row=i32,
               s_qrow=i32, s_cb=i32, s_ch=i32, s_cs=i32, eps="fp32", H=c, KV=c, HALF=c, NORM=c),
          dict(H=heads, KV=kv, HALF=half, NORM=norm))
for block_m, split, g, kv, hd in ((16, 128, 4, 8, 128), (64, 256, 4, 8, 128), (16, 128, 1, 12, 64)):
    k = build(K._attn_split_kernel,
              dict(Q=bf, KC=bf, VC=bf, POS="*i64", OP="*fp32", MP="*fp32", LP="*fp32", T=i32, s_qb=i32, s_qt=i32,
                   s_qh=i32, s_cb=i32, s_ch=i32, s_cs=i32, scale_log2="fp32", G=c, KV=c, HD=c, SPLIT=c, NSPLIT=c,
                   BLOCK_M=c, BLOCK_N=c, PRECISION=c),
              dict(G=g, KV=kv, HD=hd, SPLIT=split, NSPLIT=-(-10048 // split), BLOCK_M=block_m, BLOCK_N=64,
                   PRECISION="tf32"))
    assert k.metadata.shared <= 228 * 1024, k.metadata.shared  # fits an H100/H200 SM
build(K._attn_reduce_kernel, dict(OP="*fp32", MP="*fp32", LP="*fp32", O=bf, POS="*i64", H=i32, NSPLIT=c, NS_P2=c,
                                  SPLIT=c, HD=c), dict(NSPLIT=79, NS_P2=128, SPLIT=128, HD=128))
build(K._silu_mul_kernel, dict(GU=bf, OUT=bf, I=i32, BLOCK=c), dict(BLOCK=1024))
print("compiled")
"""


def test_kernels_compile_for_hopper_in_bf16():
    """Ahead-of-time compile of every kernel to an sm_90 cubin at the full-size shapes (bf16,
    head_dim 128, GQA 32:8, the decode and prefill attention tiles) with Triton's bundled
    ptxas: catches type and shape errors that the interpreter lets through, without a GPU.
    Runs in a child process because kernels decorated for the interpreter cannot compile."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(Path(tempfile.mkdtemp()) / "triton")}
    r = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode == 3 or "No module named 'triton.backends.nvidia'" in r.stderr:
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


def test_batched_prefill_attention_with_long_splits_equals_sdpa():
    """A batch of prefills (the extractor's forked tails) with the long splits its full-size
    launch uses by default (1024 keys; the default here is 256 at this small shape): rows with
    different contexts, one past the first split, stay exact (fp32)."""
    g = torch.Generator().manual_seed(3)
    B, T, H, KV, D, S = 4, 40, 8, 2, 32, 1280
    q = torch.randn(B, T, H, D, generator=g).to(DEV)
    kc, vc = torch.randn(B, KV, S, D, generator=g).to(DEV), torch.randn(B, KV, S, D, generator=g).to(DEV)
    ends = (1100, 1279, 300, 41)  # a row past one 1024-key split, rows inside the first
    pos = torch.stack([torch.arange(e - T + 1, e + 1) for e in ends]).clamp_min(0).to(DEV)
    ref = K.attention_torch(q, kc, vc, pos)
    for split in (None, 1024):
        assert rel_err(K.attention(q, kc, vc, pos, split=split), ref) <= 1e-5, split
