"""Thinker composition, loading, the LLM step and the KV-cache operations."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from minicpmo_rt.checkpoint.weights import load_tensors, read_shapes, save_sharded
from minicpmo_rt.errors import StrictLoadError
from minicpmo_rt.thinker.model import (Thinker, cache_checksum, cache_length, drop_rows, rerotate_keys,
                                       truncate_cache)

from conftest import make_tiny_thinker, rel_err



@pytest.fixture(scope="module")
def thinker() -> Thinker:
    return make_tiny_thinker(seed=5)


def test_state_dict_keys_are_checkpoint_keys_minus_tts(tiny_ckpt, thinker):
    ckpt = {k for k in read_shapes(tiny_ckpt) if not k.startswith("tts.")}
    assert set(thinker.state_dict()) == ckpt
    assert {k.split(".")[0] for k in ckpt} == {"llm", "vpm", "resampler", "apm", "audio_projection_layer"}


def test_from_snapshot_loads_strictly(tiny_ckpt):
    from minicpmo_rt.checkpoint.snapshot import resolve_snapshot

    model = Thinker.from_snapshot(resolve_snapshot(str(tiny_ckpt)), dtype=torch.float32)
    state = load_tensors(tiny_ckpt, ("apm.", "llm.model.norm"))
    assert torch.equal(model.apm.layers[1].fc2.weight, state["apm.layers.1.fc2.weight"].float())
    assert torch.equal(model.llm.model.norm.weight, state["llm.model.norm.weight"].float())
    assert model.dtype == torch.float32
    inv = model.llm.model.rotary_emb.inv_freq
    assert inv.dtype == torch.float32 and not inv.is_meta
    theta = model.config.llm.rope_theta
    d = model.config.llm.head_dim
    assert torch.allclose(inv, 1.0 / theta ** (torch.arange(0, d, 2).float() / d))


def test_from_snapshot_missing_key_is_named(tiny_ckpt, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_ckpt.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, bad / f.name)
    tensors = load_tensors(tiny_ckpt)
    del tensors["apm.layers.0.self_attn.q_proj.bias"]
    save_sharded(tensors, bad, 1 << 30)
    with pytest.raises(StrictLoadError, match=r"(?s)\(apm\.\*\).*missing: +layers\.0\.self_attn\.q_proj\.bias"):
        Thinker.from_snapshot(bad)


def test_forward_embeds_incremental_equals_one_shot(thinker):
    ids = [151644, 8948, 198, 151683, 151669, 128244, 151670, 151684, 151683]
    emb = thinker.embed_tokens(ids)
    cache = thinker.new_cache()
    a = thinker.forward_embeds(emb[:4], cache)
    b = thinker.forward_embeds(emb[4:], cache, logits=True)
    assert a.logits is None and cache_length(cache) == len(ids)
    with torch.no_grad():
        full = thinker.llm.model(inputs_embeds=emb[None]).last_hidden_state[0]
        ref_logits = thinker.llm(inputs_embeds=emb[None]).logits[0, -1]
    assert rel_err(torch.cat([a.hidden, b.hidden]), full) <= 1e-5
    assert rel_err(b.logits, ref_logits) <= 1e-5
    assert torch.equal(b.last, b.hidden[-1])


def test_truncate_then_refeed_is_bit_identical(thinker):
    emb = thinker.embed_tokens(range(100, 112))
    cache = thinker.new_cache()
    thinker.forward_embeds(emb[:6], cache)
    checksum = cache_checksum(cache)
    first = thinker.forward_embeds(emb[6:], cache)
    truncate_cache(cache, 6)
    assert cache_length(cache) == 6 and cache_checksum(cache) == checksum
    again = thinker.forward_embeds(emb[6:], cache)
    assert torch.equal(first.hidden, again.hidden)


def test_rerotate_keys_matches_transformers_rope(thinker):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    rot = thinker.llm.model.rotary_emb
    d = thinker.config.llm.head_dim
    u = torch.randn(1, 2, 50, d, generator=torch.Generator().manual_seed(0))
    old = torch.arange(5000, 5050)
    new = torch.arange(120, 170)
    cos_o, sin_o = rot(u, old[None])
    cos_n, sin_n = rot(u, new[None])
    k_old, _ = apply_rotary_pos_emb(u, u, cos_o, sin_o)
    k_new, _ = apply_rotary_pos_emb(u, u, cos_n, sin_n)
    assert rel_err(rerotate_keys(k_old, old, new, rot.inv_freq), k_new) <= 1e-5


def test_drop_rows_equals_fresh_prefill_at_compressed_positions(thinker):
    """Layer-0 keys/values depend only on the token and its position: after dropping a
    block and re-rotating, they equal a fresh prefill of the kept tokens."""
    emb = thinker.embed_tokens(range(300, 340))
    cache = thinker.new_cache()
    thinker.forward_embeds(emb[:5], cache)      # "system"
    thinker.forward_embeds(emb[5:20], cache)    # dropped unit
    thinker.forward_embeds(emb[20:], cache)     # kept
    prefix = cache.layers[0].keys[..., :5, :].clone()
    drop_rows(cache, 5, 15, thinker.llm.model.rotary_emb.inv_freq)
    assert cache_length(cache) == 25
    fresh = thinker.new_cache()
    thinker.forward_embeds(torch.cat([emb[:5], emb[20:]]), fresh)
    k, v = cache.layers[0].keys, cache.layers[0].values
    assert rel_err(k, fresh.layers[0].keys) <= 1e-5
    assert rel_err(v, fresh.layers[0].values) <= 1e-6
    # drop_rows leaves the prefix's bits alone. (Not compared bit-wise with the fresh prefill: BLAS
    # may round a 5-row and a 25-row projection differently; MKL's AVX-512 path does.)
    assert torch.equal(k[..., :5, :], prefix)
    with pytest.raises(ValueError):
        drop_rows(cache, 20, 10, thinker.llm.model.rotary_emb.inv_freq)


def test_embed_audio_chunk_counts_and_reset(thinker):
    g = torch.Generator().manual_seed(0)
    first = thinker.embed_audio_chunk(torch.randn(80, 102, generator=g), None, 0, 2)
    assert first.embeds.shape == (10, thinker.hidden_size) and first.cache.length == 50 and not first.reset
    second = thinker.embed_audio_chunk(torch.randn(80, 104, generator=g), first.cache, 2, 2)
    assert second.embeds.shape[0] == 10 and second.cache.length == 100
    tail = thinker.embed_audio_chunk(torch.randn(80, 25, generator=g), second.cache, 2, 0)
    assert tail.embeds.shape[0] == 2 and tail.cache.length == 112
    tiny = thinker.embed_audio_chunk(torch.randn(80, 6, generator=g), second.cache, 2, 0)
    assert tiny.embeds.shape[0] == 0 and tiny.cache is second.cache
    full = second.cache
    while full.length + 52 < 1500:
        full = thinker.embed_audio_chunk(torch.randn(80, 104, generator=g), full, 2, 2).cache
    after = thinker.embed_audio_chunk(torch.randn(80, 104, generator=g), full, 2, 2)
    assert after.reset and after.cache.length == 50


def test_embed_image_shapes(thinker):
    img = (np.random.default_rng(0).random((90, 160, 3)) * 255).astype(np.uint8)
    assert thinker.embed_image(img).shape == (1, 64, thinker.hidden_size)
    big = (np.random.default_rng(1).random((600, 1000, 3)) * 255).astype(np.uint8)
    sliced = thinker.embed_image(big, max_slice_nums=9)
    assert sliced.shape[0] > 1 and sliced.shape[1:] == (64, thinker.hidden_size)


@pytest.mark.parametrize("chunk_length", [1.0, None])
@pytest.mark.parametrize("seconds", [1.234567, 31.0])
def test_embed_audio_cuts_the_mel_where_the_whisper_feature_extractor_does(thinker, seconds, chunk_length):
    """Upstream's non-streaming audio path (``get_audio_embedding``: 1-s block-causal, or full attention with
    ``chunk_length=-1``): transformers' WhisperFeatureExtractor pads each 30-s piece to 30 s and keeps
    ``attention_mask.sum()`` = ceil(len / 160) frames. A length that is no multiple of 160 (and a second piece
    past 30 s) through that extractor, the encoder with upstream's mask, the projection and AvgPool(5), against
    ``embed_audio``."""
    from transformers import WhisperFeatureExtractor

    from minicpmo_rt.thinker.audio import avg_pool, block_causal_mask, conv_output_length
    from minicpmo_rt.thinker.prompt import audio_piece_counts

    x = np.random.default_rng(3).standard_normal(int(seconds * 16000)).astype(np.float32) * 0.1
    fe = WhisperFeatureExtractor(feature_size=80)
    refs = []
    for start in range(0, x.size, 480000):
        out = fe(x[start:start + 480000], sampling_rate=16000, return_tensors="pt", padding="max_length",
                 return_attention_mask=True)
        frames = int(out.attention_mask.sum())
        n = conv_output_length(frames)
        with torch.no_grad():
            mask = None if chunk_length is None else block_causal_mask(n, 50)
            hidden = thinker.apm(out.input_features[:, :, :frames], mask)
            refs.append(avg_pool(thinker.audio_projection_layer(hidden), 5)[0])
    ref = torch.cat(refs)
    got = thinker.embed_audio(x, chunk_length)
    assert got.shape == ref.shape and [r.shape[0] for r in refs] == audio_piece_counts(x.size)
    assert rel_err(got, ref) <= 1e-5
