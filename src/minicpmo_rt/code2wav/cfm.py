"""Causal conditional flow matching: Euler solve of the DiT velocity with classifier-free guidance.

* schedule: t_k = 1 - cos(k/n * pi/2), k = 0..n (cosine, dense near t=0);
* guidance: each step runs the estimator on ``[cond rows | uncond rows]`` (the uncond half has
  mu, speaker and cond zeroed) and steps ``x += dt * ((1+r) v_cond - r v_uncond)``, r = 0.7;
* noise: a fixed buffer ``rand_noise`` (1, 80, 30000) — 600 s at 50 Hz — read at
  ``[offset : offset+T]`` where offset is the estimator cache length, so a streamed chunk
  gets the same noise frames as the same frames of a whole solve. Upstream draws it from
  the global RNG at construction (unseeded); we draw it from ``torch.Generator`` seeded with
  ``noise_seed`` so every process agrees. It is not in ``flow.pt`` (non-persistent).

Chunk caches stack the DiT's caches over steps: cnn (steps, depth, 2b, 2*hidden, 2) and
att (steps, depth, 2b, heads, L, 2*head_dim) with frames newest first.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .dit import DiT
from .flow_config import CFMConfig

NOISE_FRAMES = 50 * 600


def cosine_t_span(n_timesteps: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    t = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
    return 1 - torch.cos(t * 0.5 * math.pi)


class CausalConditionalCFM(nn.Module):
    def __init__(self, cfg: CFMConfig, noise_seed: int = 0, noise_frames: int = NOISE_FRAMES):
        super().__init__()
        self.cfg = cfg
        self.estimator = DiT(cfg.estimator)
        self.inference_cfg_rate = float(cfg.inference_cfg_rate)
        self.out_channels = cfg.estimator.out_channels
        if self.inference_cfg_rate <= 0:
            raise ValueError(f"inference_cfg_rate {self.inference_cfg_rate} must be > 0 (guidance is always on)")
        # Explicit CPU device: real values even while the module is being built on ``meta``.
        gen = torch.Generator(device="cpu").manual_seed(noise_seed)
        noise = torch.randn(1, self.out_channels, noise_frames, generator=gen, device="cpu")
        self.register_buffer("rand_noise", noise, persistent=False)

    def noise(self, offset: int, frames: int, temperature: float = 1.0, view: bool = False) -> torch.Tensor:
        """The fixed noise frames [offset, offset + frames) times ``temperature``, (1, 80, frames), in memory of
        their own; ``view=True``: at temperature 1 a read-only view of the buffer instead (no kernel launch)."""
        if offset + frames > self.rand_noise.shape[2]:
            raise ValueError(f"noise buffer holds {self.rand_noise.shape[2]} frames; "
                             f"frames {offset}..{offset + frames} requested (utterance or cache too long)")
        z = self.rand_noise[:, :, offset:offset + frames]
        return z if view and temperature == 1.0 else z * temperature

    def _guide(self, v: torch.Tensor) -> torch.Tensor:
        cond, uncond = v.chunk(2, dim=0)
        return (1.0 + self.inference_cfg_rate) * cond - self.inference_cfg_rate * uncond

    @staticmethod
    def _with_uncond(*xs: torch.Tensor) -> list[torch.Tensor]:
        return [torch.cat([x, torch.zeros_like(x)], dim=0) for x in xs]

    def forward(self, mu: torch.Tensor, mask: torch.Tensor | None, spks: torch.Tensor, cond: torch.Tensor,
                n_timesteps: int = 10, temperature: float = 1.0) -> torch.Tensor:
        """Whole-utterance solve. mu, cond (b, 80, T); mask (b, 1, T) or None; spks (b, 80) -> mel (b, 80, T)."""
        b, _, frames = mu.shape
        x = self.noise(0, frames, temperature).to(mu.dtype).expand(b, -1, -1)
        t_span = cosine_t_span(n_timesteps, mu.device, mu.dtype)
        mu_in, spks_in, cond_in = self._with_uncond(mu, spks, cond)
        mask_in = torch.cat([mask, mask], dim=0) if mask is not None else None
        # t accumulates by dt like upstream (t_k + dt is not always bit-equal to t_{k+1}).
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            v = self.estimator(torch.cat([x, x], 0), mask_in, mu_in, t.expand(2 * b), spks_in, cond_in)
            x = x + dt * self._guide(v)
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x

    def forward_chunk(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, n_timesteps: int = 10,
                      temperature: float = 1.0, cnn_cache: torch.Tensor | None = None,
                      att_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Solve one chunk against per-step caches (see module docstring for their shapes).

        Returns (mel (b, 80, T), new cnn cache, new att cache holding L+T frames).
        """
        b, _, frames = mu.shape
        if att_cache is not None and att_cache.shape[0] != n_timesteps:
            raise ValueError(f"estimator cache was built with {att_cache.shape[0]} steps; "
                             f"n_timesteps={n_timesteps} given")
        offset = att_cache.shape[4] if att_cache is not None else 0
        x = self.noise(offset, frames, temperature).to(mu.dtype).expand(b, -1, -1)
        t_span = cosine_t_span(n_timesteps, mu.device, mu.dtype)
        mu_in, spks_in, cond_in = self._with_uncond(mu, spks, cond)
        new_cnn, new_att = [], []
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            v, c_cache, a_cache = self.estimator.forward_chunk(
                torch.cat([x, x], 0), mu_in, t.expand(2 * b), spks_in, cond_in,
                None if cnn_cache is None else cnn_cache[step - 1],
                None if att_cache is None else att_cache[step - 1])
            new_cnn.append(c_cache)
            new_att.append(a_cache)
            x = x + dt * self._guide(v)
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x, torch.stack(new_cnn, 0), torch.stack(new_att, 0)
