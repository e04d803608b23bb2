"""Perceiver resampler: 64 learned queries cross-attend to one image's patches (prefix ``resampler.``).

Keys carry a 2-D sin-cos position code of the patch grid, values do not. The code
table starts at 70x70 and grows when a larger grid arrives; it is a non-persistent
buffer, never part of the checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..checkpoint.config import MiniCPMOConfig
from ..errors import InputError


def sincos_1d(dim: int, pos: np.ndarray) -> np.ndarray:
    """[*pos.shape, dim]: sin of pos * omega in the first half, cos in the second."""
    omega = np.arange(dim // 2, dtype=np.float32)
    omega /= dim / 2.0
    omega = 1.0 / 10000 ** omega
    angles = np.einsum("hw,d->hwd", pos, omega)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)


def sincos_2d(dim: int, height: int, width: int) -> torch.Tensor:
    """[height, width, dim] float32. As upstream, the FIRST half encodes the column (w)
    index and the second half the row (h) index (meshgrid puts w first)."""
    if dim % 4:
        raise ValueError(f"resampler embed_dim {dim} must be a multiple of 4 for the 2-D sin-cos code")
    cols, rows = np.meshgrid(np.arange(width, dtype=np.float32), np.arange(height, dtype=np.float32))
    emb = np.concatenate([sincos_1d(dim // 2, cols), sincos_1d(dim // 2, rows)], axis=-1)
    return torch.from_numpy(emb).float()


class Resampler(nn.Module):
    """forward(x [B,L,kv_dim], tgt_sizes [B,2] (h, w) patches) -> [B, num_queries, embed_dim]."""

    def __init__(self, num_queries: int, embed_dim: int, num_heads: int, kv_dim: int | None = None,
                 max_size: tuple[int, int] = (70, 70)):
        super().__init__()
        self.num_queries = num_queries
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.query = nn.Parameter(torch.zeros(num_queries, embed_dim))
        self.kv_proj = (nn.Linear(kv_dim, embed_dim, bias=False)
                        if kv_dim is not None and kv_dim != embed_dim else nn.Identity())
        self.attn = nn.MultiheadAttention(embed_dim, num_heads)
        self.ln_q = nn.LayerNorm(embed_dim, eps=1e-6)
        self.ln_kv = nn.LayerNorm(embed_dim, eps=1e-6)
        self.ln_post = nn.LayerNorm(embed_dim, eps=1e-6)
        self.proj = nn.Parameter((embed_dim ** -0.5) * torch.randn(embed_dim, embed_dim))
        self.max_size = tuple(max_size)
        self.register_buffer("pos_embed", torch.empty(0), persistent=False)

    def _pos_table(self, max_h: int, max_w: int, device: torch.device) -> torch.Tensor:
        # Built lazily (also right after a meta-device build); grows, never shrinks.
        size = (max(max_h, self.max_size[0]), max(max_w, self.max_size[1]))
        pe = self.pos_embed
        if pe.dim() != 3 or pe.is_meta or pe.shape[0] < size[0] or pe.shape[1] < size[1] or pe.device != device:
            self.max_size = size
            self.pos_embed = sincos_2d(self.embed_dim, *size).to(device)
        return self.pos_embed

    def forward(self, x: torch.Tensor, tgt_sizes: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or tgt_sizes.dim() != 2 or tgt_sizes.shape[0] != x.shape[0]:
            raise InputError(f"resampler: expected x [B,L,D] and tgt_sizes [B,2]; got {list(x.shape)} "
                             f"and {list(tgt_sizes.shape)}")
        bs, device, dtype = x.shape[0], x.device, x.dtype
        sizes = tgt_sizes.detach().cpu().long()
        patch_len = sizes[:, 0] * sizes[:, 1]
        max_len = int(patch_len.max())
        if max_len > x.shape[1]:
            raise InputError(f"resampler: tgt_sizes need {max_len} patches but x holds {x.shape[1]}")
        table = self._pos_table(int(sizes[:, 0].max()), int(sizes[:, 1].max()), device)
        pos = torch.zeros(bs, max_len, self.embed_dim, dtype=dtype, device=device)
        key_padding = torch.ones(bs, max_len, dtype=torch.bool, device=device)  # True = ignore
        for i in range(bs):
            h, w = int(sizes[i, 0]), int(sizes[i, 1])
            pos[i, : h * w] = table[:h, :w].reshape(h * w, -1).to(dtype)
            key_padding[i, : h * w] = False
        kv = self.ln_kv(self.kv_proj(x[:, :max_len])).transpose(0, 1)   # [L, B, D]
        q = self.ln_q(self.query)[:, None, :].expand(-1, bs, -1)         # [Q, B, D]
        out = self.attn(q, kv + pos.transpose(0, 1), kv, key_padding_mask=key_padding, need_weights=False)[0]
        return self.ln_post(out.transpose(0, 1)) @ self.proj


def build_resampler(config: MiniCPMOConfig) -> Resampler:
    # Upstream: num_heads = embed_dim // 128, kv_dim = the vision width.
    return Resampler(config.query_num, config.llm.hidden_size, config.llm.hidden_size // 128,
                     kv_dim=config.vision.hidden_size)
