"""Turn heads over 5 Hz states: [B, T, D] -> logits [B, T, C], strictly causal in T.

Every head standardises its input with the training set's mean/std (buffers, saved with the
weights) so a linear probe on raw LLM states is well conditioned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class HeadConfig:
    kind: str = "linear"        # linear | tcn | gru
    in_dim: int = 0
    num_targets: int = 11
    hidden: int = 64
    layers: int = 3             # TCN blocks (dilations 1, 2, 4, ...) or GRU layers
    kernel: int = 3
    dropout: float = 0.1


class _Standardize(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    def set_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        self.mean.copy_(mean)
        self.std.copy_(std.clamp_min(1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class LinearProbe(nn.Module):
    """One linear map per row: sees only the current state."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.norm = _Standardize(cfg.in_dim)
        self.out = nn.Linear(cfg.in_dim, cfg.num_targets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class CausalConv(nn.Module):
    def __init__(self, channels: int, kernel: int, dilation: int):
        super().__init__()
        self.pad = (kernel - 1) * dilation  # left padding only: row t never sees t+1
        self.conv = nn.Conv1d(channels, channels, kernel, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, T]
        return self.conv(F.pad(x, (self.pad, 0)))


class TCN(nn.Module):
    """Residual causal dilated convolutions; receptive field 1 + (k-1)(2^L - 1) rows."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.norm = _Standardize(cfg.in_dim)
        self.inp = nn.Linear(cfg.in_dim, cfg.hidden)
        self.blocks = nn.ModuleList(CausalConv(cfg.hidden, cfg.kernel, 2 ** i) for i in range(cfg.layers))
        self.drop = nn.Dropout(cfg.dropout)
        self.out = nn.Linear(cfg.hidden, cfg.num_targets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(self.norm(x)).transpose(1, 2)
        for block in self.blocks:
            h = h + self.drop(F.gelu(block(h)))
        return self.out(h.transpose(1, 2))


class GRUHead(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.norm = _Standardize(cfg.in_dim)
        self.inp = nn.Linear(cfg.in_dim, cfg.hidden)
        self.gru = nn.GRU(cfg.hidden, cfg.hidden, num_layers=cfg.layers, batch_first=True,
                          dropout=cfg.dropout if cfg.layers > 1 else 0.0)
        self.out = nn.Linear(cfg.hidden, cfg.num_targets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(F.gelu(self.inp(self.norm(x))))
        return self.out(h)


KINDS = {"linear": LinearProbe, "tcn": TCN, "gru": GRUHead}


def build_head(cfg: HeadConfig) -> nn.Module:
    if cfg.kind not in KINDS:
        from ..errors import InputError

        raise InputError(f"model {cfg.kind!r} is not one of {sorted(KINDS)}")
    return KINDS[cfg.kind](cfg)
