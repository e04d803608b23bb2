from __future__ import annotations

import math

import pytest
import torch

from conftest import rel_err
from minicpmo_rt.checkpoint.config import MiniCPMOConfig, load_config
from minicpmo_rt.checkpoint.manifest import compare_prefix, load_manifest, shapes_of
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
from minicpmo_rt.checkpoint.weights import module_shapes
from minicpmo_rt.errors import InputError
from minicpmo_rt.thinker.resampler import Resampler, build_resampler, sincos_2d


def _tiny(seed=0) -> Resampler:
    cfg = MiniCPMOConfig.from_dict(tiny_config())
    return randomize_(build_resampler(cfg), seed, prefix="resampler.").eval()


def _pos_ref(dim: int, h: int, w: int) -> torch.Tensor:
    """Direct formula in float64: [w-code | h-code], each [sin(p*omega) | cos(p*omega)]."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows = torch.arange(h, dtype=torch.float64)[:, None, None].expand(h, w, 1)
    cols = torch.arange(w, dtype=torch.float64)[None, :, None].expand(h, w, 1)
    code = lambda p: torch.cat([torch.sin(p * omega), torch.cos(p * omega)], -1)  # noqa: E731
    return torch.cat([code(cols), code(rows)], -1)


def _reference(m: Resampler, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """One image, no padding, attention written out per head."""
    D, H = m.embed_dim, m.num_heads
    kv = torch.nn.functional.layer_norm(x[: h * w] @ m.kv_proj.weight.T, (D,), m.ln_kv.weight, m.ln_kv.bias, 1e-6)
    q = torch.nn.functional.layer_norm(m.query, (D,), m.ln_q.weight, m.ln_q.bias, 1e-6)
    Wq, Wk, Wv = m.attn.in_proj_weight.chunk(3)
    bq, bk, bv = m.attn.in_proj_bias.chunk(3)
    Q = (q @ Wq.T + bq).view(-1, H, D // H).transpose(0, 1)
    K = ((kv + _pos_ref(D, h, w).reshape(h * w, D).float()) @ Wk.T + bk).view(-1, H, D // H).transpose(0, 1)
    V = (kv @ Wv.T + bv).view(-1, H, D // H).transpose(0, 1)
    att = torch.softmax(Q @ K.transpose(1, 2) / math.sqrt(D // H), -1)
    o = (att @ V).transpose(0, 1).reshape(-1, D) @ m.attn.out_proj.weight.T + m.attn.out_proj.bias
    o = torch.nn.functional.layer_norm(o, (D,), m.ln_post.weight, m.ln_post.bias, 1e-6)
    return o @ m.proj


def test_resampler_keys_match_manifest(shared_dir):
    cfg = load_config(shared_dir / "config.json")
    with torch.device("meta"):
        model = build_resampler(cfg)
    rep = compare_prefix(shapes_of(load_manifest(shared_dir / "state_dict_manifest.json")["keys"]),
                         module_shapes(model, "resampler."), "resampler.")
    assert rep.ok, rep.details()
    assert model.num_heads == 32 and "pos_embed" not in model.state_dict()


def test_sincos_table():
    assert rel_err(sincos_2d(64, 5, 7), _pos_ref(64, 5, 7)) < 1e-6


def test_resampler_batched_padding_matches_reference():
    torch.manual_seed(0)
    m = _tiny()
    kv_dim = m.kv_proj.in_features
    grids = [(3, 4), (5, 2), (2, 2)]
    L = max(h * w for h, w in grids)
    x = torch.randn(len(grids), L, kv_dim)
    with torch.no_grad():
        out = m(x, torch.tensor(grids))
        assert out.shape == (3, 64, m.embed_dim)
        for i, (h, w) in enumerate(grids):
            assert rel_err(out[i], _reference(m, x[i], h, w)) < 1e-5
        # Padding rows must not leak into the result.
        x2 = x.clone()
        x2[2, 4:] = 1e3
        assert rel_err(m(x2, torch.tensor(grids))[2], out[2]) < 1e-6


def test_resampler_pos_cache_grows():
    m = _tiny()
    x = torch.randn(1, 72 * 3, m.kv_proj.in_features)
    with torch.no_grad():
        out = m(x, torch.tensor([[72, 3]]))
    assert m.pos_embed.shape[:2] == (72, 70)
    assert rel_err(out[0], _reference(m, x[0], 72, 3)) < 1e-5


def test_resampler_rejects_bad_sizes():
    m = _tiny()
    with pytest.raises(InputError, match="tgt_sizes"):
        m(torch.randn(1, 4, m.kv_proj.in_features), torch.tensor([[3, 3]]))
