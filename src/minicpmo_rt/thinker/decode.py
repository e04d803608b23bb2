"""Static-KV-cache decoding for the Thinker's Qwen3 (the GPU fast path, gpt-fast style).

``transformers``' own forward stays the reference (``llm.py``); this module runs the same
weights through a fixed-shape step that a CUDA graph can capture: QKV and gate/up are
packed into one GEMM each, the KV cache is a preallocated tensor written in place at a
device-side position, and attention spans a static bucket of the cache under a mask.
The math is Qwen3's: per-head RMSNorm on q and k before RoPE (rotate-half layout).

Two kernel sets compute the same step: ``"torch"`` (the plain reference: eager ops, SDPA
under a boolean mask over the span ``[0, kv_len)``) and ``"triton"`` (``kernels.py``: fused
residual+RMSNorm, q/k-norm+RoPE+cache write, split-KV attention that reads each row's
position from device memory, SiLU*mul -- about ten launches per layer, and one CUDA graph
for every decode position because nothing in the launch depends on the span). ``"auto"``
picks Triton on CUDA and torch elsewhere.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels as K
from .staging import staging_on, upload_ints

KERNEL_SETS = ("auto", "torch", "triton")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def padded_runs(keys: Sequence[int], seqs: Sequence[torch.Tensor], join: bool = True):
    """Sequences [T_i, H] bound for cache rows ``keys`` (distinct), grouped into runs of consecutive rows (one
    run each when ``join`` is False): yields (the run's indices into ``keys``, its first row, the run's
    sequences right-padded with zeros to the longest, [n, T, H]) for one batched prefill per run. The causal
    mask keeps the padding out of every real position, and the K/V it leaves past a sequence's end is
    rewritten by that row's decode steps before any read."""
    runs: list[list[int]] = []
    for i in sorted(range(len(keys)), key=lambda i: keys[i]):
        if runs and join and keys[i] == keys[runs[-1][-1]] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    for run in runs:
        x = seqs[run[0]].new_zeros(len(run), max(int(seqs[i].shape[0]) for i in run), seqs[run[0]].shape[-1])
        for j, i in enumerate(run):
            x[j, :seqs[i].shape[0]] = seqs[i]
        yield run, keys[run[0]], x


def pack_layers(layers) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each decoder layer's q/k/v projections and gate/up projections packed into one weight each (copies):
    one GEMM apiece in ``fused_layers``."""
    with torch.no_grad():
        wqkv = [torch.cat([l.self_attn.q_proj.weight, l.self_attn.k_proj.weight, l.self_attn.v_proj.weight])
                for l in layers]
        w13 = [torch.cat([l.mlp.gate_proj.weight, l.mlp.up_proj.weight]) for l in layers]
    return wqkv, w13


def fused_layers(layers, norm_w: torch.Tensor, wqkv, w13, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, n_heads: int, n_kv: int,
                 eps: float, read: torch.Tensor | None = None) -> torch.Tensor:
    """A Llama-family decoder (the Thinker's Qwen3, with per-head q/k norms; the Talker's Llama, without)
    through the fused kernels of ``kernels.py``: x [B,T,H] at positions pos [B,T] (K/V written there into
    ``k_cache``/``v_cache`` [layers, B, KV, S, D]) -> final-norm hidden [B,T,H] (``norm_w``). Each row attends
    to its cache rows <= its position, or <= ``read`` [B,T] where given (a row whose output is unused can read
    one row instead of a whole cache). ``wqkv``/``w13``: ``pack_layers``."""
    s, h = K.add_rms_norm(x, None, layers[0].input_layernorm.weight, eps)
    for li, layer in enumerate(layers):
        att = layer.self_attn
        q_norm, k_norm = getattr(att, "q_norm", None), getattr(att, "k_norm", None)
        kc, vc = k_cache[li], v_cache[li]
        q = K.qk_norm_rope_cache(F.linear(h, wqkv[li]), None if q_norm is None else q_norm.weight,
                                 None if k_norm is None else k_norm.weight, cos, sin, pos, kc, vc, n_heads, n_kv, eps)
        o = K.attention(q, kc, vc, pos if read is None else read)
        s, h = K.add_rms_norm(s, F.linear(o.flatten(2), att.o_proj.weight), layer.post_attention_layernorm.weight, eps)
        m = K.silu_mul(F.linear(h, w13[li]))
        nxt = layers[li + 1].input_layernorm.weight if li + 1 < len(layers) else norm_w
        s, h = K.add_rms_norm(s, F.linear(m, layer.mlp.down_proj.weight), nxt, eps)
    return h


class StaticDecoder(nn.Module):
    """Holds packed weights (views of nothing: copies) and a static KV cache for ``batch`` rows."""

    def __init__(self, llm: nn.Module, max_len: int, batch: int = 1, kernels: str = "auto",
                 share_weights: "StaticDecoder | None" = None):
        super().__init__()
        if kernels not in KERNEL_SETS:
            raise ValueError(f"StaticDecoder: kernels={kernels!r}; choose one of {', '.join(KERNEL_SETS)}")
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
        if share_weights is not None and share_weights.layers[0] is model.layers[0]:
            # Another decoder of the same model: its packed copies serve here too (~9 GB at full size).
            self.wqkv, self.w13 = share_weights.wqkv, share_weights.w13
        else:
            self.wqkv, self.w13 = pack_layers(model.layers)
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
        if kernels == "auto":
            kernels = "triton" if self.device.type == "cuda" and K.usable_on(self.k_cache) else "torch"
        elif kernels == "triton" and not K.usable_on(self.k_cache):
            raise ValueError(f"StaticDecoder: Triton kernels cannot run on {self.device} here (need CUDA, or "
                             "TRITON_INTERPRET=1 set before import on CPU); use kernels='torch'")
        self.kernels = kernels
        self._prefill_graphs: dict[tuple[int, int], tuple] = {}
        # kv_len (None with the Triton kernels) -> (graph, tokens, positions, logits, hidden)
        self._graphs: dict[int | None, tuple] = {}
        # prefill_at's row starts go up pinned (views share it): a copy from pageable memory syncs the stream
        self.uploads = staging_on(self.device, slots=8)

    def row_view(self, row: int) -> "StaticDecoder":
        """A batch-1 decoder on row ``row`` of this one's cache (same weights, the cache a view, graphs of
        its own): a session prefills its own row, and a step of this decoder feeds every row at once."""
        return self.rows_view(row, 1)

    def rows_view(self, start: int, n: int) -> "StaticDecoder":
        """``row_view`` over ``n`` consecutive rows from ``start`` (several prompts prefilled in one forward)."""
        if n < 1 or not 0 <= start or start + n > self.batch:
            raise ValueError(f"rows_view: rows [{start}, {start + n}) of a {self.batch}-row decoder")
        view = copy.copy(self)     # a shallow copy: weights, tables and modules are shared
        view.batch, view.row = n, start
        view.k_cache, view.v_cache = self.k_cache[:, start:start + n], self.v_cache[:, start:start + n]
        view._prefill_graphs, view._graphs = {}, {}
        return view

    def step(self, x: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """x [B,T,H] embeddings at positions pos [B,T]; returns final-norm hidden [B,T,H].

        Writes K/V at ``pos``; attends to cache rows [0, kv_len) at key positions <= query position
        (the Triton set ignores ``kv_len``: it reads rows <= each query's position directly).
        """
        if self.kernels == "triton":
            return self.fused_step(x, pos)
        return self.plain_step(x, pos, kv_len)

    def fused_step(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``plain_step`` through the fused kernels of ``kernels.py`` (no mask, no span)."""
        return fused_layers(self.layers, self.norm_w, self.wqkv, self.w13, self.k_cache, self.v_cache, self.cos,
                            self.sin, x, pos, self.n_heads, self.n_kv, self.eps)

    def plain_step(self, x: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """The reference step: eager torch ops, SDPA under a mask over [0, kv_len)."""
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
    def prefill_at(self, embeds: torch.Tensor, starts: Sequence[int]) -> torch.Tensor:
        """``prefill`` with row b from its own position ``starts[b]`` (sessions of different lengths on
        consecutive rows). Every row spans T positions: a row right-padded past its own input writes K/V past
        its end, which its next feed rewrites before anything reads it."""
        B, T, _ = embeds.shape
        if len(starts) != B:
            raise ValueError(f"prefill_at: {len(starts)} starts for {B} rows")
        if min(starts) < 0 or max(starts) + T > self.max_len:
            raise ValueError(f"static cache of {self.max_len} positions cannot hold rows from {list(starts)} + {T}")
        # on the device from the starts: a pageable copy of the positions would sync the stream first, and in a
        # duplex second the commits' prefill then waited for the vision encoder queued before it
        first = upload_ints(self.uploads, list(starts), self.device)
        pos = first[:, None] + torch.arange(T, device=self.device)[None]
        return self.step(embeds.to(self.dtype), pos, max(starts) + T)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, kv_len: int | None = None):
        """One token per row: tokens [B], positions [B] -> (logits [B,V] float32, hidden [B,H])."""
        kv_len = kv_len or self.max_len
        h = self.step(self.embed(tokens)[:, None], pos[:, None], kv_len)[:, 0]
        return self.lm_head(h).float(), h

    # ---- CUDA graphs: one per attention-span bucket ------------------------------------------
    @torch.no_grad()
    def decode_graph(self, tokens: torch.Tensor, pos: torch.Tensor, kv_len: int | None = None):
        """``decode`` through a CUDA graph captured once per ``kv_len`` (use bucketed spans); with
        the Triton kernels one graph serves every position (``kv_len`` is ignored)."""
        if self.kernels == "triton":
            kv_len = None
        if kv_len not in self._graphs:
            st = torch.zeros_like(tokens)
            # Warm-up runs execute: write their K/V in the last row (rewritten before any read),
            # never over the live prefix at row 0.
            sp = torch.full_like(pos, self.max_len - 1)
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

    @torch.no_grad()
    def prefill_graph(self, embeds: torch.Tensor, start: int) -> torch.Tensor:
        """``prefill`` through a CUDA graph captured once per input length (Triton kernels only:
        the plain step's mask depends on ``start``). Returns a copy of the final-norm hidden."""
        if self.kernels != "triton":
            raise ValueError("prefill_graph needs kernels='triton' (the plain step's span depends on start)")
        B, T, _ = embeds.shape
        if start + T > self.max_len:
            raise ValueError(f"static cache of {self.max_len} positions cannot hold {start + T}")
        key = (B, T)
        if key not in self._prefill_graphs:
            sx = torch.zeros(B, T, embeds.shape[-1], dtype=self.dtype, device=self.device)
            # Warm-up / capture positions: the last T rows, overwritten by any real prefill there.
            sp = torch.arange(self.max_len - T, self.max_len, device=self.device)[None].expand(B, T).contiguous()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.fused_step(sx, sp)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = self.fused_step(sx, sp)
            self._prefill_graphs[key] = (g, sx, sp, out)
        g, sx, sp, out = self._prefill_graphs[key]
        sx.copy_(embeds)
        sp.copy_(torch.arange(start, start + T, device=self.device)[None].expand(B, T))
        g.replay()
        return out.clone()
