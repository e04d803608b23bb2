"""The Whisper-medium-style audio encoder (prefix ``apm.``), its streaming KV cache,
the audio projection (prefix ``audio_projection_layer.``) and the 5x average pool.

Upstream (``MiniCPMWhisperEncoder``) is transformers' WhisperEncoder with a KV cache
threaded through the self-attention, so that each 1-s chunk of mel frames attends to
every cached frame plus the whole current chunk (a block-causal pattern over chunks),
with the learned positions continuing from the cache length. We re-implement the
encoder directly: the encoder-side cache path is not part of transformers' public API.

Layout per chunk: conv1 (k3 p1) -> GELU -> conv2 (k3 s2 p1) -> GELU -> cut the
conv frames that only exist to give the convolutions their context (``ceil(extra/2)``
at either end) -> + embed_positions[past : past+n] -> pre-LN transformer layers
(k_proj has no bias) -> final LayerNorm. Then ``AudioProjection`` (linear1 -> ReLU ->
linear2) and ``AvgPool1d(5)``: 50 encoder frames per second become 10 LLM embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.config import AudioConfig
from . import kernels


@dataclass(frozen=True)
class AudioEncoderCache:
    """Per-layer keys and values ``[B, heads, T, head_dim]`` of every cached encoder frame.

    Never mutated in place: a streaming step returns a new cache built by
    concatenation. Holding a reference is therefore as good as a deep clone, which
    makes snapshotting it free.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2]) if self.keys else 0

    def clone(self) -> "AudioEncoderCache":
        return AudioEncoderCache(tuple(k.clone() for k in self.keys), tuple(v.clone() for v in self.values))

    def checksum(self, *, as_tensor: bool = False) -> float | torch.Tensor:
        """float64 sum of every layer's K and V (an audit figure, not a hash); ``as_tensor``: a
        0-d tensor on the cache's device, read without waiting for the device."""
        if not self.keys:
            return torch.zeros((), dtype=torch.float64) if as_tensor else 0.0
        tensors = self.keys + self.values
        base = tensors[0]._base
        if base is not None and all(t._base is base for t in tensors) and \
                sum(t.numel() for t in tensors) == base.numel():
            # every layer is a view of one buffer (the graphed step's clone): one reduction
            # instead of 2 x layers of them
            total = base.sum(dtype=torch.float64)
        elif len({(t.shape, t.dtype, t.device) for t in tensors}) == 1:
            # layers trimmed to a window are slices of the buffer: one copy + one reduction
            # (~100 small ops per checksum otherwise, host time that dominated the fingerprint)
            total = torch.stack(tensors).sum(dtype=torch.float64)
        else:
            total = torch.zeros((), dtype=torch.float64, device=self.keys[0].device)
            for k, v in zip(self.keys, self.values):
                total = total + k.sum(dtype=torch.float64) + v.sum(dtype=torch.float64)
        return total if as_tensor else float(total)


def conv_output_length(n_mel: int) -> int:
    """Encoder frames produced by conv2 (stride 2, padding 1) from ``n_mel`` mel frames."""
    return (n_mel - 1) // 2 + 1


def extra_conv_frames(extra_mel_frames: int) -> int:
    """Conv frames that belong to ``extra_mel_frames`` redundancy mel frames (ceil(x/2))."""
    return (extra_mel_frames + 1) // 2 if extra_mel_frames > 0 else 0


def chunk_conv_frames(n_mel: int, prefix_extra_frames: int, suffix_extra_frames: int) -> int:
    """Encoder frames a streaming chunk of ``n_mel`` mel frames feeds the transformer (after the
    redundancy cut of ``WhisperAudioEncoder.trim_extra``)."""
    if not n_mel:
        return 0
    n = conv_output_length(n_mel) - extra_conv_frames(prefix_extra_frames)
    back = extra_conv_frames(suffix_extra_frames)
    return n - back if 0 < back < n else n


def write_rows(cache: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    """x [B, heads, n, d] into cache [B, heads, P, d] at ``rows``: long [n] for every batch row, or [B, n], each
    batch row at its own (streams whose caches differ in length, ``audio_graph.embed_chunks``)."""
    if rows.dim() == 1:
        cache.index_copy_(2, rows, x)
    else:
        cache.scatter_(2, rows[:, None, :, None].expand(x.shape), x)


class WhisperSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"audio d_model {d_model} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None,
                attn_mask: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                last_key: torch.Tensor | None = None):
        """``past`` (K, V) [B, heads, L, head_dim]: the cache, concatenated before the new frames;
        or, with ``rows`` (long [n]), fixed buffers the new K/V are written into at those rows
        (the capture-safe form of ``audio_graph``: ``attn_mask`` then selects the live rows).
        ``last_key`` (int32 [B, n], with ``rows``): attend to buffer rows <= it through the
        split-key Triton kernel instead of SDPA under ``attn_mask``. SDPA's fused kernels give a
        50-query step one program per head walking the 1504 buffer rows serially (~28 us per
        layer on the H200); the split kernel spreads the keys over the SMs and takes q as
        [B, n, heads, d], as the projection writes it (no transposed copies)."""
        if last_key is not None:
            b, t, _ = x.shape
            write_rows(past[0], rows, self._heads(self.k_proj(x)))
            write_rows(past[1], rows, self._heads(self.v_proj(x)))
            q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
            o = kernels.attention(q, past[0], past[1], last_key)
            return self.out_proj(o.reshape(b, t, -1)), past[0], past[1]
        q = self._heads(self.q_proj(x))
        k = self._heads(self.k_proj(x))
        v = self._heads(self.v_proj(x))
        if rows is not None:
            write_rows(past[0], rows, k)
            write_rows(past[1], rows, v)
            k, v = past
        elif past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        # No mask in streaming: every new frame sees the cache and the whole chunk.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        b, _, t, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1)), k, v


class WhisperEncoderLayer(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        d = config.d_model
        self.self_attn = WhisperSelfAttention(d, config.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        if config.activation_function != "gelu":
            raise ValueError(f"audio activation {config.activation_function!r} is not supported (Whisper uses gelu)")

    def forward(self, x: torch.Tensor, past=None, attn_mask=None, rows=None, last_key=None):
        h, k, v = self.self_attn(self.self_attn_layer_norm(x), past, attn_mask, rows, last_key)
        x = x + h
        x = x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))
        return x, k, v


class WhisperAudioEncoder(nn.Module):
    """Whisper encoder with upstream's key names (``apm.``) and a streaming KV cache."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        d = config.d_model
        self.max_source_positions = config.max_source_positions
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(WhisperEncoderLayer(config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    # -- pieces -------------------------------------------------------------------------
    def conv_frames(self, mel: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """mel [B, n_mels, T] -> conv features [B, ceil(T/2), d]. ``valid`` [B, 1, T] (1 on a row's
        real frames) zeroes conv1's output past each row's end: the zero padding conv2 sees in
        that row's own unpadded step (batches of chunks of different lengths)."""
        mel = mel.to(dtype=self.conv1.weight.dtype, device=self.conv1.weight.device)
        h = F.gelu(self.conv1(mel))
        if valid is not None:
            h = h * valid.to(h.dtype)
        x = F.gelu(self.conv2(h))
        # contiguous, so the residual stream is not a strided view through all the layers
        return x.transpose(1, 2).contiguous()

    def positions(self, past: int, n: int) -> torch.Tensor:
        table = self.embed_positions.weight
        if past + n <= table.shape[0]:
            return table[past:past + n]
        # Upstream repeats the last learned position past 1500 frames (about 30 s).
        idx = torch.arange(past, past + n, device=table.device).clamp_max(table.shape[0] - 1)
        return table[idx]

    def encode(self, x: torch.Tensor, cache: AudioEncoderCache | None = None,
               attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, AudioEncoderCache]:
        """Transformer stack over conv features ``x`` [B, n, d] (positions added here).

        Returns (hidden after the final LayerNorm [B, n, d], cache extended by n frames).
        """
        past = cache.length if cache is not None else 0
        h = x + self.positions(past, x.shape[1]).to(x.dtype)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            layer_past = (cache.keys[i], cache.values[i]) if cache is not None and past else None
            h, k, v = layer(h, layer_past, attn_mask)
            keys.append(k)
            values.append(v)
        return self.layer_norm(h), AudioEncoderCache(tuple(keys), tuple(values))

    # -- entry points ---------------------------------------------------------------------
    def forward(self, mel: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Whole-utterance pass (no cache): mel [B, n_mels, T] -> [B, ceil(T/2), d].

        ``attn_mask`` (bool [n, n], True = may attend) gives e.g. upstream's 1-s
        block-causal mask of the offline ``chunk_length=1.0`` path.
        """
        hidden, _ = self.encode(self.conv_frames(mel), None, attn_mask)
        return hidden

    def stream(self, mel: torch.Tensor, cache: AudioEncoderCache | None, prefix_extra_frames: int = 0,
               suffix_extra_frames: int = 0) -> tuple[torch.Tensor, AudioEncoderCache]:
        """One streaming chunk: mel [1, n_mels, T] including redundancy frames.

        The conv frames computed only from redundancy mel frames are cut before the
        transformer (upstream's ``use_extra_context``): ceil(prefix/2) at the front, and
        ceil(suffix/2) at the back unless that would leave nothing.
        """
        x = self.trim_extra(self.conv_frames(mel), prefix_extra_frames, suffix_extra_frames)
        return self.encode(x, cache)

    @staticmethod
    def trim_extra(x: torch.Tensor, prefix_extra_frames: int, suffix_extra_frames: int) -> torch.Tensor:
        """Cut the conv frames [B, n, d] that exist only from redundancy mel frames."""
        front = extra_conv_frames(prefix_extra_frames)
        back = extra_conv_frames(suffix_extra_frames)
        if front:
            x = x[:, front:]
        if 0 < back < x.shape[1]:
            x = x[:, :-back]
        return x

    def needs_reset(self, cache: AudioEncoderCache | None, n_mel: int) -> bool:
        """Upstream drops the cache when cache + this chunk's conv frames would reach 1500."""
        return cache is not None and cache.length + conv_output_length(n_mel) >= self.max_source_positions


class AudioProjection(nn.Module):
    """``audio_projection_layer.``: linear1 -> ReLU -> linear2 (upstream MultiModalProjector)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.relu(self.linear1(x)))


def build_audio_projection(config) -> AudioProjection:
    """From a MiniCPMOConfig: input dim is ``encoder_ffn_dim // 4`` as upstream (== d_model)."""
    return AudioProjection(config.audio.encoder_ffn_dim // 4, config.llm.hidden_size)


def avg_pool(x: torch.Tensor, step: int) -> torch.Tensor:
    """[B, T, D] -> [B, floor(T/step), D] (AvgPool1d(step, stride=step) along T)."""
    return F.avg_pool1d(x.transpose(1, 2), kernel_size=step, stride=step).transpose(1, 2)


def block_causal_mask(n: int, block: int, device=None) -> torch.Tensor:
    """bool [n, n]: frame i sees every frame of its own and earlier ``block``-sized blocks."""
    idx = torch.arange(n, device=device)
    return (idx[None, :] // block) <= (idx[:, None] // block)


def build_audio_encoder(config) -> WhisperAudioEncoder:
    """From a MiniCPMOConfig (the ``apm.`` weight part)."""
    return WhisperAudioEncoder(config.audio)
