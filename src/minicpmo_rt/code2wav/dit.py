"""The CFM estimator: the DiT's original body (plain PyTorch reference).

Input channels are ``[x | mu | speaker | cond]`` (4 x 80 = 320) -> ``in_proj`` -> ``depth``
adaLN-Zero blocks -> adaLN final layer -> 80 channels (the velocity).

Each block, conditioned on the timestep embedding ``c`` through 9 modulation chunks
(shift/scale/gate for attention, MLP and conv, in that order of the Linear output):
  x += gate_msa  * Attn(modulate(norm1(x)))     QKV with bias, per-head LayerNorm on q and k, no RoPE
  x += gate_conv * Conv(modulate(norm3(x)))     causal conv k3 -> LayerNorm -> Mish -> causal conv k3
  x += gate_mlp  * MLP(modulate(norm2(x)))      fc1 -> tanh-GELU -> fc2
norm1..3 have no affine and eps 1e-6. Whole-sequence attention is bidirectional (only a
key padding mask); streaming attention is unmasked over ``[current | cache]``.

Streaming caches, per block (stacked over blocks in ``forward_chunk``):
  * attention (b, heads, L, 2*head_dim) = ``[k | v]`` after the q/k norms, NEWEST frame first
    (each chunk's keys are prepended to the cache, as upstream does);
  * conv (b, 2*hidden, 2) = the last 2 input frames of conv1 then of conv2.

Module and parameter names are upstream's (``blocks.{i}.attn.to_q``, ``blocks.{i}.conv.block.1``,
``t_embedder.mlp.0``...), so a fused fast body can read the same parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .flow_config import DiTConfig


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    """sinusoid(256) of 1000*t -> Linear -> SiLU -> Linear."""

    def __init__(self, hidden: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def sinusoid(self, t: torch.Tensor, max_period: float = 10000.0) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half).to(t)
        args = t[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if self.freq_dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.sinusoid(t * 1000))


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        inner = num_heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.q_norm = nn.LayerNorm(head_dim)
        self.k_norm = nn.LayerNorm(head_dim)
        self.proj = nn.Linear(inner, dim)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (b, h, t, d)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.q_norm(self._heads(self.to_q(x)))
        k = self.k_norm(self._heads(self.to_k(x)))
        return q, k, self._heads(self.to_v(x))

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = o.shape
        return self.proj(o.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (b, t, dim); key_mask (b, t) bool, True = real frame."""
        q, k, v = self.qkv(x)
        mask = key_mask[:, None, None, :] if key_mask is not None else None
        return self._out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

    def forward_chunk(self, x: torch.Tensor,
                      cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t, dim); cache (b, h, L, 2*head_dim) newest first -> (out, cache (b, h, t+L, 2*head_dim))."""
        q, k, v = self.qkv(x)
        if cache is not None:
            k_old, v_old = cache.split(self.head_dim, dim=-1)
            k = torch.cat([k, k_old], dim=2)
            v = torch.cat([v, v_old], dim=2)
        new_cache = torch.cat([k, v], dim=-1)
        return self._out(F.scaled_dot_product_attention(q, k, v)), new_cache


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CausalConvBlock(nn.Module):
    """causal conv k3 -> LayerNorm -> Mish -> causal conv k3, on (b, t, c) input.

    ``block`` is indexed like upstream's Sequential (its transposes sat at 0, 2, 5, 7; here
    weightless placeholders) so checkpoint keys read ``conv.block.1/3/6`` and Mish is ``block[4]``.
    """

    def __init__(self, channels: int, kernel_size: int = 3):
        super().__init__()
        self.channels = channels
        self.pad = kernel_size - 1
        self.block = nn.ModuleList([
            nn.Identity(), nn.Conv1d(channels, channels, kernel_size), nn.Identity(),
            nn.LayerNorm(channels), nn.Mish(), nn.Identity(),
            nn.Conv1d(channels, channels, kernel_size), nn.Identity(),
        ])

    @property
    def conv1(self) -> nn.Conv1d:
        return self.block[1]

    @property
    def norm(self) -> nn.LayerNorm:
        return self.block[3]

    @property
    def conv2(self) -> nn.Conv1d:
        return self.block[6]

    def forward_chunk(self, x: torch.Tensor,
                      cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t, c); cache (b, 2c, k-1) (zeros at the start) -> (out (b, t, c), new cache)."""
        b = x.shape[0]
        if cache is None:
            cache = x.new_zeros(b, 2 * self.channels, self.pad)
        c1, c2 = cache.split(self.channels, dim=1)
        h = torch.cat([c1, x.transpose(1, 2)], dim=2)
        new1 = h[..., -self.pad:]
        h = self.conv1(h)
        h = self.block[4](self.norm(h.transpose(1, 2))).transpose(1, 2)
        h = torch.cat([c2, h], dim=2)
        new2 = h[..., -self.pad:]
        h = self.conv2(h)
        return h.transpose(1, 2), torch.cat([new1, new2], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_chunk(x)[0]


class DiTBlock(nn.Module):
    def __init__(self, hidden: int, num_heads: int, head_dim: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, num_heads, head_dim)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden, int(hidden * mlp_ratio))
        self.norm3 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.conv = CausalConvBlock(hidden, 3)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 9 * hidden))

    def _mods(self, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # order: shift/scale/gate msa, shift/scale/gate mlp, shift/scale/gate conv
        return self.adaLN_modulation(c).chunk(9, dim=-1)

    def forward(self, x: torch.Tensor, c: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        sh_a, sc_a, g_a, sh_m, sc_m, g_m, sh_c, sc_c, g_c = self._mods(c)
        x = x + g_a * self.attn(modulate(self.norm1(x), sh_a, sc_a), key_mask)
        x = x + g_c * self.conv(modulate(self.norm3(x), sh_c, sc_c))
        return x + g_m * self.mlp(modulate(self.norm2(x), sh_m, sc_m))

    def forward_chunk(self, x: torch.Tensor, c: torch.Tensor, cnn_cache: torch.Tensor | None,
                      att_cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sh_a, sc_a, g_a, sh_m, sc_m, g_m, sh_c, sc_c, g_c = self._mods(c)
        a, new_att = self.attn.forward_chunk(modulate(self.norm1(x), sh_a, sc_a), att_cache)
        x = x + g_a * a
        h, new_cnn = self.conv.forward_chunk(modulate(self.norm3(x), sh_c, sc_c), cnn_cache)
        x = x + g_c * h
        x = x + g_m * self.mlp(modulate(self.norm2(x), sh_m, sc_m))
        return x, new_cnn, new_att


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, out_channels)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """The estimator v(x, t | mu, speaker, cond) (see module docstring)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.in_channels = cfg.in_channels
        self.out_channels = cfg.out_channels
        self.t_embedder = TimestepEmbedder(cfg.hidden_size)
        self.in_proj = nn.Linear(cfg.in_channels, cfg.hidden_size)
        self.blocks = nn.ModuleList(DiTBlock(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.mlp_ratio)
                                    for _ in range(cfg.depth))
        self.final_layer = FinalLayer(cfg.hidden_size, cfg.out_channels)

    def _inputs(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor | None,
                cond: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Channel-stack the inputs (b, c, T) -> (b, T, hidden) and embed t -> (b, 1, hidden)."""
        parts = [x, mu]
        if spks is not None:
            parts.append(spks[:, :, None].expand(-1, -1, x.shape[-1]))
        if cond is not None:
            parts.append(cond)
        h = self.in_proj(torch.cat(parts, dim=1).transpose(1, 2))
        return h, self.t_embedder(t).unsqueeze(1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor | None = None, cond: torch.Tensor | None = None) -> torch.Tensor:
        """Whole sequence. x, mu, cond (b, 80, T); mask (b, 1, T) or None; t (b,); spks (b, 80).

        Returns the velocity (b, 80, T).
        """
        h, c = self._inputs(x, mu, t, spks, cond)
        key_mask = mask[:, 0].bool() if mask is not None else None
        for block in self.blocks:
            h = block(h, c, key_mask)
        return self.final_layer(h, c).transpose(1, 2)

    def forward_chunk(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor | None,
                      cond: torch.Tensor | None, cnn_cache: torch.Tensor | None = None,
                      att_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One chunk against caches stacked over blocks.

        cnn_cache (depth, b, 2*hidden, 2); att_cache (depth, b, heads, L, 2*head_dim) newest first.
        Returns (velocity (b, 80, T), new cnn cache, new att cache with L+T frames).
        """
        h, c = self._inputs(x, mu, t, spks, cond)
        new_cnn, new_att = [], []
        for i, block in enumerate(self.blocks):
            h, nc, na = block.forward_chunk(h, c, None if cnn_cache is None else cnn_cache[i],
                                            None if att_cache is None else att_cache[i])
            new_cnn.append(nc)
            new_att.append(na)
        out = self.final_layer(h, c).transpose(1, 2)
        return out, torch.stack(new_cnn, 0), torch.stack(new_att, 0)
