"""Static-KV-cache decoding for the Thinker's Qwen3 (the GPU fast path, gpt-fast style).

``transformers``' own forward stays the reference (``llm.py``); this module runs the same
weights through a fixed-shape step that a CUDA graph can capture: QKV and gate/up are
packed into one GEMM each, the KV cache is a preallocated tensor written in place at a
device-side position, and attention spans a static bucket of the cache under a mask.
The math is Qwen3's: per-head RMSNorm on q and k before RoPE (rotate-half layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class StaticDecoder(nn.Module):
    """Holds packed weights (views of nothing: copies) and a static KV cache for ``batch`` rows."""

    def __init__(self, llm: nn.Module, max_len: int, batch: int = 1):
        super().__init__()
        cfg = llm.config
        p = next(llm.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
        self.eps = cfg.rms_norm_eps
        self.max_len, self.batch = max_len, batch
        model = llm.model
        self.embed = model.embed_tokens
        self.norm_w = model.norm.weight
        self.lm_head = llm.lm_head
        with torch.no_grad():
            self.wqkv = [torch.cat([l.self_attn.q_proj.weight, l.self_attn.k_proj.weight,
                                    l.self_attn.v_proj.weight]) for l in model.layers]
            self.w13 = [torch.cat([l.mlp.gate_proj.weight, l.mlp.up_proj.weight]) for l in model.layers]
        self.layers = list(model.layers)
        theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
        inv = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, device=self.device).float() / self.head_dim))
        t = torch.arange(max_len, device=self.device).float()
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], -1)
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        shape = (len(self.layers), batch, self.n_kv, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def step(self, x: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """x [B,T,H] embeddings at positions pos [B,T]; returns final-norm hidden [B,T,H].

        Writes K/V at ``pos``; attends to cache rows [0, kv_len) at key positions <= query position.
        """
        B, T, _ = x.shape
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [B,1,T,D]
        mask = (torch.arange(kv_len, device=x.device)[None, None, :] <= pos[:, :, None])[:, None]
        idx = pos[:, None, :, None].expand(B, KV, T, D)
        for li, layer in enumerate(self.layers):
            att = layer.self_attn
            h = _rms(x, layer.input_layernorm.weight, self.eps)
            qkv = F.linear(h, self.wqkv[li])
            q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
            q = _rms(q.view(B, T, H, D), att.q_norm.weight, self.eps).transpose(1, 2)
            k = _rms(k.view(B, T, KV, D), att.k_norm.weight, self.eps).transpose(1, 2)
            v = v.view(B, T, KV, D).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc.scatter_(2, idx, k)
            vc.scatter_(2, idx, v)
            o = F.scaled_dot_product_attention(q, kc[:, :, :kv_len], vc[:, :, :kv_len], attn_mask=mask,
                                               enable_gqa=KV != H)
            x = x + F.linear(o.transpose(1, 2).reshape(B, T, H * D), att.o_proj.weight)
            h = _rms(x, layer.post_attention_layernorm.weight, self.eps)
            gu = F.linear(h, self.w13[li])
            g, u = gu.chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, layer.mlp.down_proj.weight)
        return _rms(x, self.norm_w, self.eps)

    @torch.no_grad()
    def prefill(self, embeds: torch.Tensor, start: int) -> torch.Tensor:
        """Feed [B,T,H] embeddings at positions start.. start+T; returns final-norm hidden."""
        B, T, _ = embeds.shape
        if start + T > self.max_len:
            raise ValueError(f"static cache of {self.max_len} positions cannot hold {start + T}")
        pos = torch.arange(start, start + T, device=self.device)[None].expand(B, T)
        return self.step(embeds.to(self.dtype), pos, start + T)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, kv_len: int | None = None):
        """One token per row: tokens [B], positions [B] -> (logits [B,V] float32, hidden [B,H])."""
        kv_len = kv_len or self.max_len
        h = self.step(self.embed(tokens)[:, None], pos[:, None], kv_len)[:, 0]
        return self.lm_head(h).float(), h

    # ---- CUDA graphs: one per attention-span bucket ------------------------------------------
    @torch.no_grad()
    def decode_graph(self, tokens: torch.Tensor, pos: torch.Tensor, kv_len: int):
        """``decode`` through a CUDA graph captured once per ``kv_len`` (use bucketed spans)."""
        if kv_len not in self._graphs:
            st = torch.zeros_like(tokens)
            sp = torch.zeros_like(pos)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.decode(st, sp, kv_len)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                logits, hidden = self.decode(st, sp, kv_len)
            self._graphs[kv_len] = (g, st, sp, logits, hidden)
        g, st, sp, logits, hidden = self._graphs[kv_len]
        st.copy_(tokens)
        sp.copy_(pos)
        g.replay()
        return logits, hidden
