"""Audio encoder (apm.) and projection: keys, streaming cache vs a block-causal full pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
from minicpmo_rt.thinker.audio import (AudioEncoderCache, avg_pool, block_causal_mask, build_audio_encoder,
                                       build_audio_projection)
from conftest import rel_err



@pytest.fixture(scope="module")
def config() -> MiniCPMOConfig:
    return MiniCPMOConfig.from_dict(tiny_config())


@pytest.fixture(scope="module")
def encoder(config):
    return randomize_(build_audio_encoder(config).float().eval(), seed=3, prefix="apm.")


def test_manifest_keys_real_config(shared_dir):
    from minicpmo_rt.snapshot_tools import check_manifest

    result = check_manifest(shared_dir / "config.json", shared_dir / "state_dict_manifest.json")
    for part in ("apm", "audio_projection_layer"):
        rep = result.reports[part]
        assert rep.ok, rep.details()
        assert rep.matched > 0
    assert result.reports["apm"].matched == 367  # 24 layers x 15 + conv1/2 (4) + positions + final LN (2)


def test_keys_match_transformers_whisper_encoder(config, encoder):
    """Same key names as transformers' WhisperEncoder (what upstream subclasses)."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    hf = WhisperEncoder(_whisper_config(config))
    assert set(hf.state_dict()) == set(encoder.state_dict())
    assert "self_attn.k_proj.bias" not in " ".join(encoder.state_dict())


def _whisper_config(config):
    from transformers import WhisperConfig

    a = config.audio
    wc = WhisperConfig(d_model=a.d_model, encoder_layers=a.encoder_layers, encoder_attention_heads=a.encoder_attention_heads,
                       encoder_ffn_dim=a.encoder_ffn_dim, num_mel_bins=a.num_mel_bins,
                       max_source_positions=a.max_source_positions, activation_function="gelu")
    wc._attn_implementation = "eager"
    return wc


def _reference_block_causal(config, encoder, mel: torch.Tensor, block: int) -> torch.Tensor:
    """transformers' Whisper layers over the whole mel with an additive block-causal mask."""
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    hf = WhisperEncoder(_whisper_config(config)).float().eval()
    hf.load_state_dict(encoder.state_dict(), strict=True)
    with torch.no_grad():
        x = torch.nn.functional.gelu(hf.conv2(torch.nn.functional.gelu(hf.conv1(mel)))).transpose(1, 2)
        x = x + hf.embed_positions.weight[: x.shape[1]]
        allowed = block_causal_mask(x.shape[1], block)
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        for layer in hf.layers:
            x = layer(x, mask)
            x = x[0] if isinstance(x, tuple) else x
        return hf.layer_norm(x)


def _stream(encoder, mel: torch.Tensor, n_chunks: int):
    """Slice ``mel`` as the streaming mel processor emits it (core 100 +-2 redundancy)."""
    outs, cache, lengths = [], None, []
    for k in range(n_chunks):
        lo = max(0, 100 * k - 2)
        hi = 100 * k + 102
        h, cache = encoder.stream(mel[:, :, lo:hi], cache, prefix_extra_frames=100 * k - lo, suffix_extra_frames=2)
        outs.append(h)
        lengths.append(cache.length)
    return torch.cat(outs, dim=1), cache, lengths


def test_streaming_equals_block_causal_full_pass(config, encoder):
    n = 4
    gen = torch.Generator().manual_seed(0)
    mel = torch.randn(1, config.audio.num_mel_bins, 100 * n + 2, generator=gen)
    with torch.no_grad():
        streamed, cache, lengths = _stream(encoder, mel, n)
        own_full = encoder(mel, attn_mask=block_causal_mask(50 * n + 1, 50))[:, : 50 * n]
    ref = _reference_block_causal(config, encoder, mel, 50)[:, : 50 * n]
    assert streamed.shape == (1, 50 * n, config.audio.d_model)
    assert lengths == [50, 100, 150, 200]  # positions continue from the cache length
    assert rel_err(streamed, ref) <= 1e-5
    assert rel_err(own_full, ref) <= 1e-5
    # The cache really is used: without it the later chunks change.
    with torch.no_grad():
        alone, _ = encoder.stream(mel[:, :, 98:202], None, 2, 2)
    assert rel_err(alone, ref[:, 50:100]) > 1e-2


def test_cache_is_never_mutated_and_clones(encoder, config):
    mel = torch.randn(1, config.audio.num_mel_bins, 102, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, c1 = encoder.stream(mel, None, 0, 2)
        before = c1.clone()
        _, c2 = encoder.stream(torch.randn(1, config.audio.num_mel_bins, 104), c1, 2, 2)
    assert c2.length == 100 and c1.length == 50
    assert all(torch.equal(a, b) for a, b in zip(c1.keys + c1.values, before.keys + before.values))
    assert c1.checksum() == before.checksum()


def test_reset_rule_and_position_overflow(encoder, config):
    """Upstream resets when cache + this chunk's conv frames reach 1500 (after 29 chunks)."""
    mel_len = 104
    cache = AudioEncoderCache(tuple(torch.zeros(1, 2, 1400, 32) for _ in range(2)),
                              tuple(torch.zeros(1, 2, 1400, 32) for _ in range(2)))
    assert not encoder.needs_reset(cache, mel_len)  # 1400 + 52 < 1500
    cache29 = AudioEncoderCache(tuple(torch.zeros(1, 2, 1450, 32) for _ in range(2)), cache.values)
    assert encoder.needs_reset(cache29, mel_len)  # 1450 + 52 >= 1500
    assert not encoder.needs_reset(None, mel_len)
    pos = encoder.positions(1490, 20)
    table = encoder.embed_positions.weight
    assert torch.equal(pos[:10], table[1490:]) and torch.equal(pos[10:], table[-1:].expand(10, -1))


def test_projection_and_pool(config):
    proj = randomize_(build_audio_projection(config).float(), seed=1, prefix="audio_projection_layer.")
    x = torch.randn(1, 50, config.audio.d_model)
    y = avg_pool(proj(x), config.audio_pool_step)
    assert y.shape == (1, 10, config.llm.hidden_size)
    ref = torch.relu(x @ proj.linear1.weight.T + proj.linear1.bias) @ proj.linear2.weight.T + proj.linear2.bias
    assert rel_err(y[0, 3], ref[0, 15:20].mean(0)) <= 1e-6
    # 52 frames pool to 10 (the remainder is dropped, as AvgPool1d(5) does)
    assert avg_pool(torch.randn(1, 52, 4), 5).shape == (1, 10, 4)


def test_checksum_paths_agree_for_one_buffer_trimmed_slices_and_separate_layers():
    """The three layouts a cache takes (every layer a view of one buffer; layers trimmed to a
    window, i.e. slices of it; separate tensors) give the same float64 sum up to rounding,
    and any changed element shows."""
    from minicpmo_rt.thinker.audio import AudioEncoderCache

    g = torch.Generator().manual_seed(0)
    kv = torch.randn(3, 2, 1, 4, 40, 8, generator=g)
    whole = AudioEncoderCache(tuple(kv[:, 0].unbind(0)), tuple(kv[:, 1].unbind(0)))
    trimmed = AudioEncoderCache(tuple(k[..., 10:, :] for k in whole.keys), tuple(v[..., 10:, :] for v in whole.values))
    separate = AudioEncoderCache(tuple(k.clone() for k in trimmed.keys), tuple(v.clone() for v in trimmed.values))
    ref = sum(float(t.double().sum()) for t in whole.keys + whole.values)
    ref_trim = sum(float(t.double().sum()) for t in trimmed.keys + trimmed.values)
    assert abs(whole.checksum() - ref) <= 1e-9 * abs(kv).sum().item()
    assert abs(trimmed.checksum() - ref_trim) <= 1e-9 * abs(kv).sum().item()
    assert abs(separate.checksum() - ref_trim) <= 1e-9 * abs(kv).sum().item()
    assert torch.is_tensor(trimmed.checksum(as_tensor=True)) and trimmed.checksum(as_tensor=True).item() == \
        trimmed.checksum()
    changed = AudioEncoderCache(trimmed.keys[:2] + (trimmed.keys[2] + 1e-3,), trimmed.values)
    assert changed.checksum() != trimmed.checksum()
