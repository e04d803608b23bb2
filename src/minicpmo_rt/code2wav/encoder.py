"""Token encoder of the flow: ``UpsampleConformerEncoderV2`` (25 Hz tokens -> 50 Hz frames).

embed (Linear+LN, x sqrt(d)) -> pre-lookahead conv (3 tokens of right context)
-> ``num_blocks`` conformer layers -> nearest x2 upsample + causal conv
-> up_embed -> ``num_up_blocks`` conformer layers -> LayerNorm.

The conformer layers are pre-norm attention + FFN (no conv module) with ESPnet
relative-position self-attention. Attention is unmasked in both the whole and the
chunked path (a chunk sees every cached frame and itself).

Streaming cache (packed as upstream, so trimming code and fast paths share it):
  * ``cnn``: (b, d, 2 + 2*stride) = [pre-lookahead conv2 input (2) | upsample conv input (2*stride)]
  * ``att``: (num_blocks + num_up_blocks, b, heads, 2*t, 2*d_k), each entry ``[k | v]`` on the
    last axis, oldest frame first. The token-rate layers hold t frames, stored twice along
    time (``[c, c]``) so every layer's cache has the mel-rate length 2*t.
Parameter names follow upstream's state_dict (``embed.out.0``, ``encoders.{i}.self_attn.linear_q``...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .flow_config import EncoderConfig
from .keepalive import capturing, keep_for_graph


@dataclass
class EncoderCache:
    """Streaming state of the encoder (see the module docstring for the layout)."""

    cnn: torch.Tensor
    att: torch.Tensor

    @property
    def token_frames(self) -> int:
        """Token-rate frames the token-rate layers have cached."""
        return self.att.shape[3] // 2

    def clone(self) -> "EncoderCache":
        return EncoderCache(self.cnn.clone(), self.att.clone())


def rel_position_table(size: int, d_model: int, device: torch.device | None = None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ESPnet relative position encodings for relative distances size-1 ... -(size-1).

    Shape (1, 2*size-1, d_model); row ``size-1`` is distance 0. Computed in fp32 the
    same way as upstream's table (sin on even, cos on odd channels).
    """
    rel = torch.arange(size - 1, -size, -1, dtype=torch.float32).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    pe = torch.zeros(2 * size - 1, d_model)
    angle = rel * inv_freq  # (-p)*w == -(p*w) exactly, so this equals upstream's two half-tables
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe.unsqueeze(0).to(device=device, dtype=dtype)


# Position tables kept per encoder (the oldest dropped first): a stream's chunks need two sizes.
POS_TABLES_KEPT = 16


def _kept(memo: dict, key: tuple, make, device: torch.device) -> torch.Tensor:
    """``memo[key]``, made by ``make()`` when missing and kept (the oldest dropped past POS_TABLES_KEPT), handed
    out through ``keep_for_graph``. One made inside a graph capture is not kept: its values exist only once the
    graph replays."""
    t = memo.get(key)
    if t is None:
        t = make()
        if capturing(device):
            return t
        if len(memo) >= POS_TABLES_KEPT:
            memo.pop(next(iter(memo)))      # the oldest
        memo[key] = t
    return keep_for_graph(t)


def _real_keys(n: int, start: torch.Tensor | None, end: torch.Tensor | None,
               device: torch.device) -> torch.Tensor | None:
    """(b, n) bool: key frames [start, end) of each row (None: from 0 / to n); None where every key is real."""
    if start is None and end is None:
        return None
    j = torch.arange(n, device=device)[None, :]
    ok = None if start is None else j >= start[:, None]
    if end is not None:
        ok = j < end[:, None] if ok is None else ok & (j < end[:, None])
    return ok


class LinearEmbed(nn.Module):
    """Linear -> LayerNorm -> (dropout), then scaled by sqrt(d) as the rel-pos encoder does."""

    def __init__(self, idim: int, odim: int, dropout: float):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5), nn.Dropout(dropout))
        self.xscale = math.sqrt(odim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


class RelPositionAttention(nn.Module):
    """Multi-head self-attention with Transformer-XL relative positions (ESPnet flavour)."""

    def __init__(self, n_head: int, n_feat: int, key_bias: bool):
        super().__init__()
        self.h = n_head
        self.d_k = n_feat // n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat, bias=key_bias)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(n_head, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)
        self._proj: dict[tuple, torch.Tensor] = {}

    def _projected(self, pos_table: torch.Tensor) -> torch.Tensor:
        """``linear_pos(pos_table)``: the same for every call of one size while the weights stay as they are,
        so outside autograd it is made once per (size, device, dtype, weight version) and kept (the oldest
        dropped past POS_TABLES_KEPT, ``_kept``): a streamed chunk's 10 layers otherwise redo a (2*t2-1) x d x d
        GEMM each call whatever the batch (at batch 1 more work than the layers' own rows)."""
        w = self.linear_pos.weight
        if torch.is_grad_enabled() or torch.is_inference(w):   # an inference tensor has no version counter
            return self.linear_pos(pos_table)
        key = (pos_table.shape[1], pos_table.device, pos_table.dtype, torch.is_inference_mode_enabled(),
               w.data_ptr(), w._version)
        return _kept(self._proj, key, lambda: self.linear_pos(pos_table), pos_table.device)

    def forward(self, x: torch.Tensor, pos_table: torch.Tensor, cache: torch.Tensor | None = None,
                key_ok: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t1, d); pos_table (1, 2*t2-1, d) with t2 = cached + t1; cache (b, h, t2-t1, 2*d_k).
        ``key_ok`` (b, t2) bool: the keys each row attends (rows whose caches were padded at the front to a
        common length, ``UpsampleConformerEncoderV2.forward_chunk(pad=)``); None: all.

        Returns the output (b, t1, d) and the new cache (b, h, t2, 2*d_k).
        """
        b, t1, _ = x.shape
        q = self.linear_q(x).view(b, t1, self.h, self.d_k)
        k = self.linear_k(x).view(b, t1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t1, self.h, self.d_k).transpose(1, 2)
        if cache is not None and cache.shape[2] > 0:
            k_old, v_old = cache.split(self.d_k, dim=-1)
            k = torch.cat([k_old, k], dim=2)
            v = torch.cat([v_old, v], dim=2)
        new_cache = torch.cat([k, v], dim=-1)
        t2 = k.shape[2]

        p = self._projected(pos_table).view(1, -1, self.h, self.d_k).transpose(1, 2)  # (1, h, 2*t2-1, d_k)
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))  # (b, h, t1, t2)
        position = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))  # (b, h, t1, 2*t2-1)
        # Query i sits at absolute position (t2 - t1 + i); key j at j. Its distance i' - j is
        # column (t2-1) - (t2-t1+i-j) = t1-1-i+j of the table (the rel_shift trick, as a gather).
        i = torch.arange(t1, device=x.device).unsqueeze(1)
        j = torch.arange(t2, device=x.device).unsqueeze(0)
        column = (t1 - 1 - i + j).expand(b, self.h, t1, t2)
        position = position.gather(-1, column)
        scores = (content + position) / math.sqrt(self.d_k)
        if key_ok is not None:
            scores = scores.masked_fill(~key_ok[:, None, None, :], float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t1, self.h * self.d_k)
        return self.linear_out(out), new_cache


class FeedForward(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(d, hidden)
        self.w_2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm attention + FFN residual block (upstream ``ConformerEncoderLayer`` without conv)."""

    def __init__(self, d: int, heads: int, ffn: int, key_bias: bool):
        super().__init__()
        self.self_attn = RelPositionAttention(heads, d, key_bias)
        self.feed_forward = FeedForward(d, ffn)
        self.norm_ff = nn.LayerNorm(d, eps=1e-12)
        self.norm_mha = nn.LayerNorm(d, eps=1e-12)

    def forward(self, x: torch.Tensor, pos_table: torch.Tensor, cache: torch.Tensor | None = None,
                key_ok: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        att, new_cache = self.self_attn(self.norm_mha(x), pos_table, cache, key_ok)
        x = x + att
        x = x + self.feed_forward(self.norm_ff(x))
        return x, new_cache


class PreLookaheadLayer(nn.Module):
    """conv k=L+1 over L future tokens -> leaky_relu -> causal conv k=3 -> residual."""

    def __init__(self, channels: int, pre_lookahead_len: int):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None,
                pad_future: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t, c). With ``pad_future`` the last L tokens see zeros as their future and the
        output keeps length t; without, the last L tokens are context only (output t-L).
        ``cache`` (b, c, 2): the previous conv1 outputs (zeros at the start).
        """
        h = x.transpose(1, 2)
        if pad_future:
            h = F.pad(h, (0, self.pre_lookahead_len))
        h = F.leaky_relu(self.conv1(h))
        if cache is None:
            cache = h.new_zeros(h.shape[0], h.shape[1], 2)
        h = torch.cat([cache, h], dim=2)
        new_cache = h[..., -2:]
        out = self.conv2(h).transpose(1, 2)
        return out + x[:, : out.shape[1]], new_cache


class Upsample1D(nn.Module):
    """Nearest-neighbour x stride, then a conv over (2*stride) cached frames + the new ones."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, 2 * stride + 1)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, c, t) -> (b, c, stride*t); cache (b, c, 2*stride), zeros at the start."""
        up = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        if cache is None:
            cache = up.new_zeros(up.shape[0], up.shape[1], 2 * self.stride)
        up = torch.cat([cache, up], dim=2)
        return self.conv(up), up[..., -2 * self.stride:]


class UpsampleConformerEncoderV2(nn.Module):
    """The flow's token encoder (see module docstring)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.output_size
        self.embed = LinearEmbed(cfg.input_size, d, cfg.dropout_rate)
        self.pre_lookahead_layer = PreLookaheadLayer(d, cfg.pre_lookahead_len)
        self.encoders = nn.ModuleList(ConformerLayer(d, cfg.attention_heads, cfg.linear_units, cfg.key_bias)
                                      for _ in range(cfg.num_blocks))
        self.up_layer = Upsample1D(d, cfg.up_stride)
        self.up_embed = LinearEmbed(cfg.input_size, d, cfg.dropout_rate)
        self.up_encoders = nn.ModuleList(ConformerLayer(d, cfg.attention_heads, cfg.linear_units, cfg.key_bias)
                                         for _ in range(cfg.num_up_blocks))
        self.after_norm = nn.LayerNorm(d, eps=1e-5)
        self._pos_tables: dict[tuple, torch.Tensor] = {}

    @property
    def pre_lookahead_len(self) -> int:
        return self.cfg.pre_lookahead_len

    @property
    def up_rate(self) -> int:
        return self.cfg.up_stride

    def _pos(self, size: int, like: torch.Tensor) -> torch.Tensor:
        """The position table for ``size`` frames, made once per (size, device, dtype) and kept (a
        streamed chunk's sizes repeat; a table made on the host cannot be copied inside a CUDA graph).
        A graph captured reading it keeps it alive past its eviction (``keepalive``)."""
        key = (size, like.device, like.dtype, torch.is_inference_mode_enabled())   # inference tensors stay there
        return _kept(self._pos_tables, key,
                     lambda: rel_position_table(size, self.cfg.output_size, like.device, like.dtype), like.device)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        """Whole sequence: xs (b, t, input_size) embedded tokens -> (b, stride*t, d).

        The last ``pre_lookahead_len`` tokens see zeros as their future. Every row is
        taken as full length (no padding masks: the flow runs one utterance at a time).
        """
        x = self.embed(xs)
        x, _ = self.pre_lookahead_layer(x, pad_future=True)
        pos = self._pos(x.shape[1], x)
        for layer in self.encoders:
            x, _ = layer(x, pos)
        x, _ = self.up_layer(x.transpose(1, 2))
        x = self.up_embed(x.transpose(1, 2))
        pos = self._pos(x.shape[1], x)
        for layer in self.up_encoders:
            x, _ = layer(x, pos)
        return self.after_norm(x)

    def forward_chunk(self, xs: torch.Tensor, last_chunk: bool = False, cache: EncoderCache | None = None,
                      pad: torch.Tensor | None = None, valid: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, EncoderCache]:
        """One streaming chunk: xs (b, n, input_size) embedded tokens -> (b, stride*m, d).

        A non-final chunk's last ``pre_lookahead_len`` tokens are lookahead only (m = n - L);
        with ``last_chunk`` they are encoded too against zero future (m = n).
        ``pad`` (b,) int64: rows whose caches are shorter, padded at the front (the oldest end) with that many
        token frames (``pad_encoder_caches``), which no query attends. The relative positions of the real
        frames are unchanged (every position shifts by the padding), so each row computes what it would
        alone; its new cache keeps the padding in front (``trim_split_conformer_att(pads=)`` drops it).
        ``valid`` (b,) int64, final chunks only: each row's own token count, the rest padding at the back (final
        chunks of several lengths in one call, ``Flow.encode_ends``). Their embeddings are zeroed, which is the
        zero future a final chunk's look-ahead conv sees anyway, and no query attends them; every later op is
        causal or per frame, so each row's first ``stride * valid`` output frames are what it gives alone. Its
        new cache is not: the padding frames are in it (a final chunk's stream ends).
        """
        n_tok = len(self.encoders)
        stride = self.cfg.up_stride
        if cache is not None:
            if cache.att.shape[3] % 2:
                raise ValueError(f"encoder att cache length {cache.att.shape[3]} must be even (packed layout)")
            past = cache.token_frames
            att_tok = [cache.att[i, :, :, :past] for i in range(n_tok)]
            att_up = [cache.att[n_tok + i] for i in range(len(self.up_encoders))]
            cnn_pre, cnn_up = cache.cnn[:, :, :2], cache.cnn[:, :, 2:]
        else:
            past = 0
            att_tok = [None] * n_tok
            att_up = [None] * len(self.up_encoders)
            cnn_pre = cnn_up = None

        if valid is not None and not last_chunk:
            raise ValueError("forward_chunk: valid (rows padded at the back) is for final chunks only: a non-final "
                             "chunk's look-ahead tokens are real")
        x = self.embed(xs)
        if valid is not None:
            x = x * _real_keys(x.shape[1], None, valid, x.device).unsqueeze(-1).to(x.dtype)
        x, new_cnn_pre = self.pre_lookahead_layer(x, cnn_pre, pad_future=last_chunk)
        pos = self._pos(past + x.shape[1], x)
        # key frame j of a row is real from its front padding on and before its back padding (token, then mel rate)
        ok_tok = _real_keys(past + x.shape[1], pad, None if valid is None else past + valid, x.device)
        new_tok = []
        for layer, c in zip(self.encoders, att_tok):
            x, nc = layer(x, pos, c, ok_tok)
            new_tok.append(nc)
        x, new_cnn_up = self.up_layer(x.transpose(1, 2), cnn_up)
        x = self.up_embed(x.transpose(1, 2))
        pos = self._pos(past * stride + x.shape[1], x)
        ok_up = _real_keys(past * stride + x.shape[1], None if pad is None else stride * pad,
                           None if valid is None else stride * (past + valid), x.device)
        new_up = []
        for layer, c in zip(self.up_encoders, att_up):
            x, nc = layer(x, pos, c, ok_up)
            new_up.append(nc)
        x = self.after_norm(x)

        tok = torch.stack(new_tok, 0)
        att = torch.cat([tok.repeat(1, 1, 1, stride, 1), torch.stack(new_up, 0)], dim=0)
        return x, EncoderCache(torch.cat([new_cnn_pre, new_cnn_up], dim=2), att)
