"""``Thinker``: the MiniCPM-o 4.5 input side (LLM, vision, resampler, audio encoder and
projection) under upstream's attribute names, so that ``Thinker.state_dict()`` keys are
the checkpoint's keys minus ``tts.``; plus the KV-cache operations the streaming
session needs (length, truncation, checksum, drop-and-re-rotate).

Model math only: what to feed when, and when to prune, is ``session``'s business.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache

from ..checkpoint.config import MiniCPMOConfig, load_config
from ..checkpoint.weights import load_strict, load_tensors
from .audio import (AudioEncoderCache, avg_pool, block_causal_mask, build_audio_encoder, build_audio_projection,
                    chunk_conv_frames, conv_output_length)
from .image_processor import pack_patches, process_image
from .llm import build_llm, final_norm_hidden
from .resampler import build_resampler
from .vision import build_vision

THINKER_PREFIXES = ("llm.", "vpm.", "resampler.", "apm.", "audio_projection_layer.")


@dataclass(frozen=True)
class LLMStep:
    """One prefill's read-out: final-norm hidden (after ``llm.model.norm``) of every new position."""

    hidden: torch.Tensor                 # [L, H]
    logits: torch.Tensor | None = None   # [V] at the last position, only when asked

    @property
    def last(self) -> torch.Tensor:
        return self.hidden[-1]


@dataclass(frozen=True)
class AudioChunkEmbedding:
    embeds: torch.Tensor          # [n, H] LLM-space audio embeddings (10 per second)
    cache: AudioEncoderCache      # the encoder cache after this chunk
    reset: bool                   # the cache was dropped before this chunk (upstream's 1500 rule)


class Thinker(nn.Module):
    def __init__(self, config: MiniCPMOConfig, attn_implementation: str = "sdpa"):
        super().__init__()
        self.config = config
        self.llm = build_llm(config, attn_implementation)
        self.vpm = build_vision(config)
        self.resampler = build_resampler(config)
        self.apm = build_audio_encoder(config)
        self.audio_projection_layer = build_audio_projection(config)
        self.audio_pool_step = config.audio_pool_step
        self._device_ids: dict[tuple, torch.Tensor] = {}  # (device, ids) -> ids on it (embed_tokens)
        self.eval()

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_snapshot(cls, path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                      attn_implementation: str = "sdpa") -> "Thinker":
        """Build on the meta device and strictly load every thinker prefix (``tts.`` is ignored)."""
        directory = Path(getattr(path, "path", path))
        config = load_config(directory)
        with torch.device("meta"):
            model = cls(config, attn_implementation)
        state = load_tensors(directory, THINKER_PREFIXES)
        for prefix in THINKER_PREFIXES:
            name = prefix.rstrip(".")
            load_strict(getattr(model, name), state, where=f"{directory} ({prefix}*)", prefix=prefix)
        del state
        model.rebuild_buffers()  # the non-persistent buffers are still on the meta device
        model.to(device=device, dtype=dtype)
        model.rebuild_buffers()  # .to(dtype) rounded the RoPE frequencies
        return model.eval()

    def rebuild_buffers(self) -> None:
        """Recompute non-persistent buffers: the RoPE frequencies in fp32 (they are not in
        the checkpoint and must not be rounded to the weight dtype); the resampler's
        sin-cos table is rebuilt lazily on first use."""
        rot = self.llm.model.rotary_emb
        device = self.llm.model.embed_tokens.weight.device
        inv_freq, _ = rot.compute_default_rope_parameters(self.llm.config)
        rot.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        rot.original_inv_freq = rot.inv_freq.clone()
        if self.resampler.pos_embed.is_meta:
            self.resampler.pos_embed = torch.empty(0, device=device)
        meta = [name for name, b in self.named_buffers() if b.is_meta]
        if meta:
            raise RuntimeError(f"Thinker: buffers left on the meta device: {', '.join(meta)}")

    @property
    def device(self) -> torch.device:
        return self.llm.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.llm.model.embed_tokens.weight.dtype

    @property
    def hidden_size(self) -> int:
        return self.config.llm.hidden_size

    # -- embeddings ---------------------------------------------------------------------------
    @torch.no_grad()
    def embed_tokens(self, ids) -> torch.Tensor:
        ids = tuple(ids)
        if self.device.type != "cuda":
            return self.llm.model.embed_tokens(torch.tensor(ids, dtype=torch.long, device=self.device))
        # A pageable host->device copy waits for the whole stream first; streaming units repeat
        # a few id sequences, so their device copies are kept (bounded) and reused.
        cache, key = self._device_ids, (self.device, ids)
        dev = cache.get(key)
        if dev is None:
            if len(cache) >= 256:
                cache.pop(next(iter(cache)))
            dev = cache[key] = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.llm.model.embed_tokens(dev)

    @torch.no_grad()
    def embed_image(self, image, max_slice_nums: int = 1) -> torch.Tensor:
        """One image -> [n_sub, 64, H] (source image first, then slices); a list of processed
        images -> their sub-images in order, in one batch."""
        processed = image if hasattr(image, "patches") or isinstance(image, list) else \
            process_image(image, max_slice_nums)
        batch = pack_patches(processed)
        feats = self.vpm(batch.pixel_values.to(self.device, self.vpm.embeddings.patch_embedding.weight.dtype),
                         batch.patch_attention_mask.to(self.device), batch.tgt_sizes)
        return self.resampler(feats, batch.tgt_sizes).to(self.dtype)

    @torch.no_grad()
    def embed_audio_chunk(self, mel: torch.Tensor, cache: AudioEncoderCache | None, prefix_extra_frames: int,
                          suffix_extra_frames: int) -> AudioChunkEmbedding:
        """Mel frames of one streaming chunk [n_mels, T] -> LLM-space embeddings [n, H].

        Encoder with the streaming cache (reset first when it would pass 1500
        positions), final LayerNorm, projection, AvgPool(5).
        """
        n_mel = int(mel.shape[-1])
        if chunk_conv_frames(n_mel, prefix_extra_frames, suffix_extra_frames) < self.audio_pool_step:
            # Too short to make one pooled embedding (a tiny tail): nothing to feed, cache untouched.
            empty = torch.zeros(0, self.hidden_size, dtype=self.dtype, device=self.device)
            return AudioChunkEmbedding(empty, cache, False)
        reset = self.apm.needs_reset(cache, n_mel)
        if reset:
            cache = None
        hidden, cache = self.apm.stream(mel[None].to(self.device), cache, prefix_extra_frames, suffix_extra_frames)
        embeds = avg_pool(self.audio_projection_layer(hidden), self.audio_pool_step)[0]
        return AudioChunkEmbedding(embeds.to(self.dtype), cache, reset)

    @torch.no_grad()
    def embed_audio(self, waveform, chunk_length: float | None = 1.0) -> torch.Tensor:
        """A whole recording (mono 16 kHz float samples) -> [n, H] LLM-space embeddings, as upstream's
        non-streaming ``get_audio_embedding(..., chunk_length)``: 1.0 (a 1-s block-causal encoder, a duplex
        voice reference) or None (full attention, ``chunk_length=-1``: the audio of a turn-mode user message,
        which upstream's ``streaming_prefill`` encodes whole with ``stream_input=False``).

        Each 30-s piece is zero-padded to 30 s before the mel (dynamic max-8 floor), cut to the
        feature extractor's ``ceil(len / 160)`` frames, encoded, projected and pooled; the pieces'
        embeddings are concatenated in order (``prompt.audio_piece_counts`` gives each piece's count)."""
        from .mel import SAMPLE_RATE, log_mel

        x = waveform.detach().float() if isinstance(waveform, torch.Tensor) else \
            torch.from_numpy(np.array(waveform, dtype=np.float32))      # a copy: the caller's may be read-only
        x = x.reshape(-1).cpu()
        window = 30 * SAMPLE_RATE
        parts = []
        for start in range(0, x.numel(), window):
            piece = x[start:start + window]
            frames = -(-piece.numel() // 160)
            n = conv_output_length(frames)
            if n < self.audio_pool_step:
                continue  # a tail too short for one pooled embedding, as upstream's pooling drops it
            padded = torch.zeros(window)
            padded[:piece.numel()] = piece
            mel = log_mel(padded, True)[:, :frames][None].to(self.device)
            mask = None if chunk_length is None else block_causal_mask(n, int(chunk_length * 50), device=self.device)
            hidden = self.apm(mel, mask)
            parts.append(avg_pool(self.audio_projection_layer(hidden), self.audio_pool_step)[0])
        if not parts:
            return torch.zeros(0, self.hidden_size, dtype=self.dtype, device=self.device)
        return torch.cat(parts).to(self.dtype)

    def fill_slots(self, piece, images: Sequence[torch.Tensor] = (), audio: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """A prompt piece's input rows [L, H]: its token embeddings, with each image slot taking the next
        sub-image's 64 rows of ``images`` (each [n_sub, 64, H]) and the audio slots the rows of ``audio``
        [n, H] in order, as upstream scatters encoder outputs over the ``<unk>`` placeholders."""
        embeds = self.embed_tokens(piece.ids).clone()
        image_rows = [row for im in images for row in im]
        audio_rows = audio if audio is not None else embeds[:0]
        n_image = sum(1 for s in piece.slots if s.kind == "image")
        n_audio = sum(s.length for s in piece.slots if s.kind == "audio")
        if n_image != len(image_rows) or n_audio != audio_rows.shape[0]:
            raise ValueError(f"prompt slots ({n_image} image, {n_audio} audio rows) do not match the encoder "
                             f"outputs ({len(image_rows)} sub-images, {audio_rows.shape[0]} audio rows)")
        next_image, at = iter(image_rows), 0
        for slot in piece.slots:
            if slot.kind == "image":
                embeds[slot.start:slot.start + slot.length] = next(next_image).to(embeds.dtype)
            else:
                embeds[slot.start:slot.start + slot.length] = audio_rows[at:at + slot.length].to(embeds.dtype)
                at += slot.length
        return embeds

    # -- the LLM --------------------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.llm.config)

    @torch.no_grad()
    def forward_embeds(self, inputs_embeds: torch.Tensor, cache: DynamicCache,
                       logits: bool = False) -> LLMStep:
        """Feed ``inputs_embeds`` [L, H] at positions cache_len.. (upstream's ``StreamDecoder.feed``)
        into ``cache``; return the final-norm hidden of the new positions (and the last
        position's logits only when asked: features never need the LM head)."""
        if inputs_embeds.dim() == 2:
            inputs_embeds = inputs_embeds[None]
        start = cache_length(cache)
        pos = torch.arange(start, start + inputs_embeds.shape[1], device=inputs_embeds.device)[None]
        hidden, _ = final_norm_hidden(self.llm, inputs_embeds.to(self.dtype), cache, pos)
        out = self.llm.lm_head(hidden[:, -1])[0] if logits else None
        return LLMStep(hidden[0], out)


# -- KV-cache operations ------------------------------------------------------------------------

def _layers(cache: DynamicCache):
    return [layer for layer in cache.layers if getattr(layer, "is_initialized", False) and layer.keys is not None
            and layer.keys.numel()]


def cache_length(cache: DynamicCache | None) -> int:
    if cache is None:
        return 0
    layers = _layers(cache)
    return int(layers[0].keys.shape[-2]) if layers else 0


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Keep rows [0, length) of every layer (views: no copy; later appends concatenate)."""
    for layer in _layers(cache):
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def cache_checksum(cache: DynamicCache | None, *, as_tensor: bool = False) -> float | torch.Tensor:
    """float64 sum of every layer's K and V (``as_tensor``: a 0-d tensor on the cache's device)."""
    layers = _layers(cache) if cache is not None else []
    if not layers:
        return torch.zeros((), dtype=torch.float64) if as_tensor else 0.0
    total = torch.zeros((), dtype=torch.float64, device=layers[0].keys.device)
    for layer in layers:
        total = total + layer.keys.sum(dtype=torch.float64) + layer.values.sum(dtype=torch.float64)
    return total if as_tensor else float(total)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Same fp32 angle arithmetic as the model's rotary embedding, so the inverse is exact
    # up to the rotation's own rounding.
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rerotate_keys(keys: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
                  inv_freq: torch.Tensor) -> torch.Tensor:
    """Move RoPE'd keys [B, heads, T, d] from ``old_positions`` to ``new_positions``:
    inverse rotation, then forward rotation (HF rotate_half layout), computed in fp32."""
    k = keys.float()
    cos, sin = _cos_sin(old_positions.to(k.device), inv_freq.to(k.device))
    base = k * cos - _rotate_half(k) * sin
    cos, sin = _cos_sin(new_positions.to(k.device), inv_freq.to(k.device))
    return (base * cos + _rotate_half(base) * sin).to(keys.dtype)


def drop_rows(cache: DynamicCache, start: int, length: int, inv_freq: torch.Tensor) -> None:
    """Remove rows [start, start+length) and re-rotate the kept suffix's keys from
    positions start+length.. to start.. (values untouched), as upstream's
    ``drop_tokens_from_cache``."""
    total = cache_length(cache)
    if length <= 0:
        return
    if start < 0 or start + length > total:
        raise ValueError(f"cannot drop rows [{start}, {start + length}) of a {total}-row cache")
    suffix = total - start - length
    for layer in _layers(cache):
        dev = layer.keys.device
        keep_k = layer.keys[..., start + length:, :]
        if suffix:
            old = torch.arange(start + length, total, device=dev)
            new = torch.arange(start, start + suffix, device=dev)
            keep_k = rerotate_keys(keep_k, old, new, inv_freq)
        layer.keys = torch.cat([layer.keys[..., :start, :], keep_k], dim=-2).contiguous()
        layer.values = torch.cat([layer.values[..., :start, :], layer.values[..., start + length:, :]],
                                 dim=-2).contiguous()
