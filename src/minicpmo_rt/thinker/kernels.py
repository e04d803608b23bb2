"""Fused Triton kernels of the Thinker's static-cache LLM step (the decode / prefill fast path).

A Qwen3 layer in the plain step (``decode.StaticDecoder.step``) is ~50 small kernels: the
RMSNorm alone is seven elementwise ops, rotary and the cache scatter another dozen, and
SDPA over a bucketed span needs a materialised mask. Under CUDA-graph replay those
launches, not the weight reads, set the step time. Here a layer is four GEMMs plus six
kernels:

- ``add_rms_norm``: residual add + RMSNorm (one pass; the sum is written for the next add);
- ``qk_norm_rope_cache``: per-head RMSNorm of q and k, RoPE, and the K/V cache write at
  each row's device-side position (one program per (row, head));
- ``attention``: split-KV flash attention straight off the static cache; each query row
  attends to cache rows ``<= its position`` (read from device memory, so one CUDA graph
  serves every position and no mask is built), plus a small reduce over the splits;
- ``silu_mul``: SiLU(gate) * up.

Each wrapper has the torch formulation beside it (``*_torch``), which is also what the
tests compare against. Rounding follows the plain path: norms in fp32, rounded to the
model dtype before the weight multiply; RoPE and the softmax accumulate in fp32.
Kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before
this module is first imported; the tests do).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

try:  # pragma: no cover - exercised through AVAILABLE
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # pragma: no cover
    AVAILABLE = False

_LOG2E = 1.4426950408889634
# triton.jit picks the interpreter when a kernel is decorated, i.e. when this module is imported.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def usable_on(t: torch.Tensor) -> bool:
    """The kernels can run on ``t``'s device in this process."""
    if not AVAILABLE:
        return False
    return t.device.type == "cpu" and _INTERPRETED or t.device.type == "cuda" and not _INTERPRETED


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


if AVAILABLE:

    @triton.jit
    def _add_rms_norm_kernel(X, D, W, SUM, OUT, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(X + row * N + cols, mask=ok, other=0.0)
        if HAS_RES:
            # The add rounds to the model dtype first, as ``x = x + d`` does in the plain step.
            x = x + tl.load(D + row * N + cols, mask=ok, other=0.0)
            tl.store(SUM + row * N + cols, x, mask=ok)
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        w = tl.load(W + cols, mask=ok, other=0.0)
        y = (xf * r).to(X.dtype.element_ty) * w
        tl.store(OUT + row * N + cols, y, mask=ok)

    @triton.jit
    def _qk_norm_rope_cache_kernel(QKV, QOUT, KC, VC, QW, KW, COS, SIN, POS, T,
                                   s_row, s_qrow, s_cb, s_ch, s_cs, eps,
                                   H: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        b = (row // T).to(tl.int64)
        p = tl.load(POS + row).to(tl.int64)
        d = tl.arange(0, HALF)
        src = QKV + row.to(tl.int64) * s_row + head * (2 * HALF)
        x1 = tl.load(src + d)
        x2 = tl.load(src + HALF + d)
        dt = QKV.dtype.element_ty
        if head < H + KV:
            if head < H:
                wp = QW
            else:
                wp = KW
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            if NORM:
                r = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / (2 * HALF) + eps)
                y1 = ((f1 * r).to(dt) * tl.load(wp + d)).to(tl.float32)
                y2 = ((f2 * r).to(dt) * tl.load(wp + HALF + d)).to(tl.float32)
            else:       # Llama (the Talker): RoPE straight on the projections
                y1 = f1
                y2 = f2
            c1 = tl.load(COS + p * (2 * HALF) + d).to(tl.float32)
            c2 = tl.load(COS + p * (2 * HALF) + HALF + d).to(tl.float32)
            s1 = tl.load(SIN + p * (2 * HALF) + d).to(tl.float32)
            s2 = tl.load(SIN + p * (2 * HALF) + HALF + d).to(tl.float32)
            o1 = (y1 * c1 - y2 * s1).to(dt)
            o2 = (y2 * c2 + y1 * s2).to(dt)
            if head < H:
                dst = QOUT + row.to(tl.int64) * s_qrow + head * (2 * HALF)
            else:
                dst = KC + b * s_cb + (head - H) * s_ch + p * s_cs
            tl.store(dst + d, o1)
            tl.store(dst + HALF + d, o2)
        else:
            dst = VC + b * s_cb + (head - H - KV) * s_ch + p * s_cs
            tl.store(dst + d, x1)
            tl.store(dst + HALF + d, x2)

    @triton.jit
    def _attn_split_kernel(Q, KC, VC, POS, OP, MP, LP, T,
                           s_qb, s_qt, s_qh, s_cb, s_ch, s_cs, scale_log2,
                           G: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr, SPLIT: tl.constexpr,
                           NSPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           PRECISION: tl.constexpr):
        pid = tl.program_id(0)
        tile = tl.program_id(1)
        split = tl.program_id(2)
        b = pid // KV
        kvh = pid % KV
        r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        r_ok = r < T * G
        t = r // G
        h = kvh * G + r % G
        qpos = tl.load(POS + b * T + t, mask=r_ok, other=-1).to(tl.int32)
        d = tl.arange(0, HD)
        q = tl.load(Q + b.to(tl.int64) * s_qb + t[:, None] * s_qt + h[:, None] * s_qh + d[None, :],
                    mask=r_ok[:, None], other=0.0)
        lo = split * SPLIT
        hi = tl.minimum(lo + SPLIT, tl.max(qpos, axis=0) + 1)
        # Finite running max: a row with no key in this split keeps exp2(-inf - m) = 0, never NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        kb = KC + b.to(tl.int64) * s_cb + kvh * s_ch
        vb = VC + b.to(tl.int64) * s_cb + kvh * s_ch
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            kt = tl.load(kb + n[None, :].to(tl.int64) * s_cs + d[:, None], mask=n_ok[None, :], other=0.0)
            s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2
            s = tl.where(n[None, :] <= qpos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            pr = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            v = tl.load(vb + n[:, None].to(tl.int64) * s_cs + d[None, :], mask=n_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        # Partials laid out [B, T, H, NSPLIT(, HD)] so the reduce reads one row's splits contiguously.
        # Splits wholly past a row's position are neither written nor read (the reduce knows the
        # count from the position), so an unused split costs a launch slot, not memory traffic.
        hrow = ((b * T + t) * (KV * G) + h).to(tl.int64) * NSPLIT + split
        live = r_ok & (qpos >= lo)
        tl.store(MP + hrow, m_i, mask=live)
        tl.store(LP + hrow, l_i, mask=live)
        tl.store(OP + hrow[:, None] * HD + d[None, :], acc, mask=live[:, None])

    @triton.jit
    def _attn_reduce_kernel(OP, MP, LP, O, POS, H, NSPLIT: tl.constexpr, NS_P2: tl.constexpr, SPLIT: tl.constexpr,
                            HD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        sp = tl.arange(0, NS_P2)
        ok = sp <= tl.load(POS + row // H) // SPLIT  # the splits holding keys <= this row's position
        m = tl.load(MP + row * NSPLIT + sp, mask=ok, other=-1.0e30)
        l_ = tl.load(LP + row * NSPLIT + sp, mask=ok, other=0.0)
        w = tl.exp2(m - tl.max(m, axis=0))
        d = tl.arange(0, HD)
        acc = tl.load(OP + (row * NSPLIT + sp[:, None]) * HD + d[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l_, axis=0)
        tl.store(O + row * HD + d, out.to(O.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(GU, OUT, I, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        g = tl.load(GU + row * 2 * I + cols, mask=ok, other=0.0)
        u = tl.load(GU + row * 2 * I + I + cols, mask=ok, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(OUT + row * I + cols, act * u, mask=ok)


# ---- torch formulations (the references) -------------------------------------------------------

def rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)


def add_rms_norm_torch(x: torch.Tensor, d: torch.Tensor | None, w: torch.Tensor, eps: float):
    s = x if d is None else x + d
    return s, rms_norm_torch(s, w, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def qk_norm_rope_cache_torch(qkv, q_w, k_w, cos, sin, pos, k_cache, v_cache, n_heads: int, n_kv: int,
                             eps: float) -> torch.Tensor:
    """qkv [B,T,(H+2KV)*D] -> q [B,T,H,D] (normed, rotated); K/V written to ``k_cache``/``v_cache``
    [B,KV,S,D] at rows ``pos`` [B,T]. ``q_w``/``k_w`` None: no per-head norm (Llama's attention)."""
    B, T, _ = qkv.shape
    D = k_cache.shape[-1]
    q, k, v = qkv.view(B, T, n_heads + 2 * n_kv, D).split([n_heads, n_kv, n_kv], dim=2)
    c, s = cos[pos][:, :, None], sin[pos][:, :, None]
    if q_w is not None:
        q = rms_norm_torch(q, q_w, eps)
        k = rms_norm_torch(k, k_w, eps)
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    bi = torch.arange(B, device=qkv.device)[:, None].expand(B, T)
    k_cache.permute(0, 2, 1, 3)[bi, pos] = k
    v_cache.permute(0, 2, 1, 3)[bi, pos] = v
    return q


def attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """q [B,T,H,D]; each row attends to cache rows <= its position -> [B,T,H,D]."""
    span = int(pos.max()) + 1
    mask = (torch.arange(span, device=q.device)[None, None, :] <= pos[:, :, None])[:, None]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:, :, :span], v_cache[:, :, :span],
                                       attn_mask=mask, enable_gqa=k_cache.shape[1] != q.shape[2])
    return o.transpose(1, 2)


def silu_mul_torch(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


# ---- Triton wrappers -----------------------------------------------------------------------------

def add_rms_norm(x: torch.Tensor, d: torch.Tensor | None, w: torch.Tensor, eps: float):
    """(x + d, RMSNorm(x + d) * w) over the last dim; ``d`` None: (x, RMSNorm(x) * w)."""
    n = x.shape[-1]
    xs = x.contiguous()
    out = torch.empty_like(xs)
    s = xs if d is None else torch.empty_like(xs)
    block = _pow2(n)
    _add_rms_norm_kernel[(xs.numel() // n,)](xs, xs if d is None else d.contiguous(), w, s, out, n, eps,
                                             HAS_RES=d is not None, BLOCK=block,
                                             num_warps=8 if block >= 2048 else 4)
    return s, out


def qk_norm_rope_cache(qkv, q_w, k_w, cos, sin, pos, k_cache, v_cache, n_heads: int, n_kv: int,
                       eps: float) -> torch.Tensor:
    """The Triton form of ``qk_norm_rope_cache_torch`` (``k_cache``/``v_cache`` row-contiguous; ``q_w`` and
    ``k_w`` None: RoPE and the cache write only)."""
    B, T, _ = qkv.shape
    D = k_cache.shape[-1]
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or qkv.stride(-1) != 1:
        raise ValueError("qk_norm_rope_cache: K/V caches must share strides with unit last stride")
    q = torch.empty(B, T, n_heads, D, dtype=qkv.dtype, device=qkv.device)
    posc = pos.contiguous()
    _qk_norm_rope_cache_kernel[(B * T, n_heads + 2 * n_kv)](
        qkv, q, k_cache, v_cache, q if q_w is None else q_w, q if k_w is None else k_w, cos, sin, posc, T,
        qkv.stride(1), n_heads * D, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps,
        H=n_heads, KV=n_kv, HALF=D // 2, NORM=q_w is not None, num_warps=1)
    return q


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
              split: int | None = None, block_m: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Split-KV causal attention off the cache; q [B,T,H,D] contiguous, pos [B,T] -> [B,T,H,D].

    The number of splits depends only on the cache size (and ``split``), never on the
    positions, so the launch shape is fixed for a CUDA graph.
    """
    B, T, H, D = q.shape
    KV, S = k_cache.shape[1], k_cache.shape[2]
    G = H // KV
    rows = T * G
    if block_m is None:
        block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    block_n = 64 if D >= 64 else 32
    if split is None:
        # Short splits spread one token's keys over many SMs; splits past every position
        # exit at once, so the count (fixed by the cache size, as a CUDA graph needs) is cheap.
        # A batch of prefills (the extractor's forked tails: B=4 x ~80 rows) already has
        # enough row tiles: longer splits then write and reduce fewer partials
        # (benchmarks/results/llm_attention_h200.md: 214 -> 162 us at 3000 cached rows).
        split = 128 if rows <= 16 else (256 if B * KV * math.ceil(rows / block_m) < 128 else 1024)
    split = max(block_n, (split // block_n) * block_n)
    nsplit = math.ceil(S / split)
    op = torch.empty(B, T, H, nsplit, D, dtype=torch.float32, device=q.device)
    mp = torch.empty(B, T, H, nsplit, dtype=torch.float32, device=q.device)
    lp = torch.empty_like(mp)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    pos = pos.contiguous()
    _attn_split_kernel[(B * KV, math.ceil(rows / block_m), nsplit)](
        q, k_cache, v_cache, pos, op, mp, lp, T,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        _LOG2E / math.sqrt(D),
        G=G, KV=KV, HD=D, SPLIT=split, NSPLIT=nsplit, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=prec,
        num_warps=num_warps)
    o = torch.empty_like(q)
    _attn_reduce_kernel[(B * T * H,)](op, mp, lp, o, pos, H, NSPLIT=nsplit, NS_P2=max(2, _pow2(nsplit)),
                                      SPLIT=split, HD=D, num_warps=4)
    return o


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    i = gu.shape[-1] // 2
    gu = gu.contiguous()
    out = torch.empty(*gu.shape[:-1], i, dtype=gu.dtype, device=gu.device)
    block = min(1024, _pow2(i))
    _silu_mul_kernel[(gu.numel() // (2 * i), math.ceil(i / block))](gu, out, i, BLOCK=block, num_warps=4)
    return out
