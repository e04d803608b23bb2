"""SigLIP (so400m) vision transformer in MiniCPM-o's NaViT form (prefix ``vpm.``).

Each sub-image arrives as a strip of 14x14 patches laid side by side ([3, 14, L*14],
see ``image_processor.reshape_by_patch``); a batch pads strips to the longest one and
a boolean ``patch_attention_mask`` says which patches are real. Every image, whatever
its patch grid (h, w), has its patch coordinates mapped onto the fixed 70x70 learned
position table by bucketizing fractional coordinates, as upstream does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ..checkpoint.config import MiniCPMOConfig, VisionConfig
from ..errors import InputError


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.patch_size = config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, self.embed_dim, kernel_size=self.patch_size,
                                         stride=self.patch_size, padding="valid")
        self.num_patches_per_side = config.image_size // config.patch_size
        self.position_embedding = nn.Embedding(self.num_patches_per_side ** 2, self.embed_dim)

    def position_ids(self, patch_attention_mask: torch.Tensor, tgt_sizes: torch.Tensor) -> torch.Tensor:
        """[B, L] indices into the side x side position table (padding patches get 0)."""
        side = self.num_patches_per_side
        batch, length = patch_attention_mask.shape[0], patch_attention_mask.shape[-1]
        # Same float32 arithmetic as upstream so bucket edges fall identically.
        boundaries = torch.arange(1 / side, 1.0, 1 / side)
        out = torch.zeros(batch, length, dtype=torch.long)
        sizes = tgt_sizes.detach().cpu().long()
        valid = patch_attention_mask.detach().reshape(batch, -1).cpu()
        for b in range(batch):
            nh, nw = sizes[b, 0], sizes[b, 1]
            frac_h = torch.arange(0, 1 - 1e-6, 1 / nh)
            frac_w = torch.arange(0, 1 - 1e-6, 1 / nw)
            bh = torch.bucketize(frac_h, boundaries, right=True)
            bw = torch.bucketize(frac_w, boundaries, right=True)
            out[b][valid[b]] = (bh[:, None] * side + bw).flatten()
        return out

    def embed(self, pixel_values: torch.Tensor, pos_ids: torch.Tensor) -> torch.Tensor:
        """Patch embeddings + learned positions ``pos_ids`` [B, L] (on the device) -> [B, L, D]."""
        # contiguous: a transposed residual stream would keep its strides through every layer's
        # adds, and each LayerNorm would first copy it (strided kernels, ~4 ms per 5-frame batch)
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2).contiguous()
        return x + self.position_embedding(pos_ids)

    def forward(self, pixel_values: torch.Tensor, patch_attention_mask: torch.Tensor,
                tgt_sizes: torch.Tensor) -> torch.Tensor:
        pos = self.position_ids(patch_attention_mask, tgt_sizes).to(pixel_values.device)
        return self.embed(pixel_values, pos)


class SiglipAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        if self.head_dim * self.num_heads != self.embed_dim:
            raise ValueError(f"vision hidden_size {self.embed_dim} is not divisible by {self.num_heads} heads")
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        # key_mask [B,1,1,L] True = attend; padded queries still see every real key, so no NaN rows.
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.out_proj(o.transpose(1, 2).reshape(b, n, self.embed_dim))


class SiglipMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.activation_fn = ACT2FN[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.self_attn = SiglipAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: VisionConfig, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList([SiglipEncoderLayer(config) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, key_mask)
        return x


class SiglipVisionTransformer(nn.Module):
    """forward(pixel_values [B,3,14,L*14], patch_attention_mask [B,1,L] bool, tgt_sizes [B,2]) -> [B,L,D].

    ``drop_last_layer`` mirrors upstream's ``drop_vision_last_layer`` (the last encoder layer
    is then neither built nor loaded).
    """

    def __init__(self, config: VisionConfig, drop_last_layer: bool = False):
        super().__init__()
        self.config = config
        self.embed_dim = config.hidden_size
        self.patch_size = config.patch_size
        self.embeddings = SiglipVisionEmbeddings(config)
        n = config.num_hidden_layers - (1 if drop_last_layer else 0)
        self.encoder = SiglipEncoder(config, n)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, patch_attention_mask: torch.Tensor | None = None,
                tgt_sizes: torch.Tensor | None = None) -> torch.Tensor:
        if pixel_values.dim() != 4 or pixel_values.shape[1] != self.config.num_channels:
            raise InputError(f"pixel_values: expected [B,{self.config.num_channels},{self.patch_size},L*"
                             f"{self.patch_size}], got {list(pixel_values.shape)}")
        b = pixel_values.shape[0]
        length = (pixel_values.shape[2] // self.patch_size) * (pixel_values.shape[3] // self.patch_size)
        if patch_attention_mask is None:
            patch_attention_mask = torch.ones(b, 1, length, dtype=torch.bool, device=pixel_values.device)
        if tgt_sizes is None:
            # Upstream derives the grid from the mask when no target size is given.
            m = patch_attention_mask.view(b, -1, length) if patch_attention_mask.dim() == 3 else patch_attention_mask
            tgt_sizes = torch.stack([m[:, :, 0].sum(1), m[:, 0].sum(1)], dim=1)
        valid = patch_attention_mask.reshape(b, -1).bool()
        x = self.embeddings(pixel_values, valid, tgt_sizes)
        key_mask = None if bool(valid.all()) else valid[:, None, None, :].to(x.device)
        x = self.encoder(x, key_mask)
        return self.post_layernorm(x)


def build_vision(config: MiniCPMOConfig) -> SiglipVisionTransformer:
    return SiglipVisionTransformer(config.vision, drop_last_layer=config.drop_vision_last_layer)
