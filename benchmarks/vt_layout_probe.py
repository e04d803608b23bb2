"""Probe: would a value-transposed cache layout speed up the B=16 attention? (issue #7, session 38)

TF32 wgmma takes only K-major shared operands. In the [k|v] cache V is stored frame-major (head dim
contiguous), so for P @ V every V tile goes through a transposed shared copy. This probe times one
steady block's attention (32 rows = 16 streams x CFG by default, `--rows`; 8 heads of 64, 50
queries, 450 keys, FP32 cache, TF32 dots) on standalone kernels that differ only in the cache layout
and the load form, plus two truncated kernels (loads only; scores without P @ V) that split the
time:

  kv      packed [k|v] frames (the project's layout), pointer loads
  kv_tma  the same through a tensor descriptor (the project's default at B=16)
  vt      K frame-major, V stored transposed (keys contiguous), pointer loads
  vt_tma  the same through descriptors
  loads   kv's loads only (summed so they are not dropped)
  scores  kv's loads and Q K^T + online softmax, V summed instead of P @ V

Each timing is a CUDA graph over `--caches` distinct caches (16; so the reads come from HBM, not L2),
median of replays, us per block; TB/s counts the cache bytes read. Outputs are checked against SDPA.

    python benchmarks/vt_layout_probe.py --out DIR [--block-n 64,32] [--stages 2,3,4] [--rows 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

H, D, NQ, NK, NKP = 8, 64, 50, 450, 464   # NKP: V^T rows padded to 16-byte multiples


@triton.jit
def _probe(Q, KV, K, VT, O, KV_DESC, K_DESC, VT_DESC, nk, nkp, scale,
           D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr, TMA: tl.constexpr,
           STAGES: tl.constexpr):
    # MODE 0: [k|v] (KV, or KV_DESC), 1: K + V^T, 2: loads only, 3: scores only
    rh = tl.program_id(0)            # row * H + head
    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < 50
    q = tl.load(Q + rh * 50 * D + offs_m[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BM], -1.0e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    kv = KV + rh.to(tl.int64) * nk * (2 * D)
    kb = K + rh.to(tl.int64) * nk * D
    vtb = VT + rh.to(tl.int64) * D * nkp
    for start in tl.range(0, nk, BN, num_stages=STAGES):
        offs_n = start + tl.arange(0, BN)
        col_ok = offs_n < nk
        if MODE == 1:
            if TMA:
                kt = tl.trans(K_DESC.load([rh * nk + start, 0]))
                vt = VT_DESC.load([rh * D, start])
            else:
                kt = tl.load(kb + offs_n[None, :] * D + offs_d[:, None], mask=col_ok[None, :], other=0.0)
                vt = tl.load(vtb + offs_d[:, None] * nkp + offs_n[None, :], mask=col_ok[None, :], other=0.0)
            v = tl.trans(vt)
        else:
            if TMA:
                kt = tl.trans(KV_DESC.load([rh * nk + start, 0]))
                v = KV_DESC.load([rh * nk + start, D])
            else:
                kt = tl.load(kv + offs_n[None, :] * (2 * D) + offs_d[:, None], mask=col_ok[None, :], other=0.0)
                v = tl.load(kv + offs_n[:, None] * (2 * D) + D + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        if MODE == 2:
            acc += tl.sum(kt, axis=1)[None, :] + tl.sum(v, axis=0)[None, :]
            l_i += 1.0      # keeps the output (and so the loads) alive
        else:
            s = tl.dot(q, kt, input_precision="tf32") * scale
            s = tl.where(row_ok[:, None] & col_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            if MODE == 3:
                acc = acc * alpha[:, None] + tl.sum(tl.where(col_ok[:, None], v, 0.0), axis=0)[None, :]
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="tf32")
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(O + rh * 50 * D + offs_m[:, None] * D + offs_d[None, :], out, mask=row_ok[:, None])


def _graphed_us(work, per: int, reps: int) -> float:
    """Median microseconds per unit of ``work`` (``per`` units) replayed from one CUDA graph."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        work()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per)
    return statistics.median(times)


MODES = {"kv": (0, False), "kv_tma": (0, True), "vt": (1, False), "vt_tma": (1, True),
         "loads": (2, False), "scores": (3, False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--caches", type=int, default=16)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--block-n", default="64,32")
    ap.add_argument("--stages", default="3", help="K/V pipeline depths to sweep")
    ap.add_argument("--rows", type=int, default=32,
                    help="batch rows x CFG: 32 is batch 16; 2 (batch 1, 16 programs) shows one program's tile chain")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("vt_layout_probe.py times Triton kernels on a CUDA GPU (the TMA rows need Hopper); "
                         "none is visible here: run it on the device machine")
    dev = torch.device("cuda")
    R = args.rows
    torch.manual_seed(0)
    q = torch.randn(R * H, NQ, D, device=dev)
    out = torch.empty_like(q)
    caches = []
    for _ in range(args.caches):
        kv = torch.randn(R * H, NK, 2 * D, device=dev)
        k = kv[..., :D].contiguous()
        vt = torch.zeros(R * H, D, NKP, device=dev)
        vt[..., :NK] = kv[..., D:].transpose(1, 2)
        caches.append((kv, k, vt))
    scale = D ** -0.5
    ref = F.scaled_dot_product_attention(q, caches[0][0][..., :D], caches[0][0][..., D:])
    bytes_read = R * H * NK * 2 * D * 4
    rows = []
    configs = [(bn, st) for bn in (int(x) for x in args.block_n.split(","))
               for st in (int(x) for x in args.stages.split(","))]
    for bn, stages in configs:
        for name, (mode, tma) in MODES.items():
            def launch(c):
                kv, k, vt = c
                kv_desc = TensorDescriptor.from_tensor(kv.view(-1, 2 * D), [bn, D])
                k_desc = TensorDescriptor.from_tensor(k.view(-1, D), [bn, D])
                vt_desc = TensorDescriptor.from_tensor(vt.view(-1, NKP), [D, bn])
                _probe[(R * H,)](q, kv, k, vt, out, kv_desc, k_desc, vt_desc, NK, NKP, scale,
                                 D=D, BM=64, BN=bn, MODE=mode, TMA=tma, STAGES=stages, num_warps=4)
            try:
                launch(caches[0])
                torch.cuda.synchronize()
            except Exception as exc:   # a form this Triton cannot compile is a row, not a crash
                rows.append({"block_n": bn, "stages": stages, "variant": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
                print(rows[-1])
                continue
            err = ((out - ref).norm() / ref.norm()).item() if mode in (0, 1) else None
            us = _graphed_us(lambda: [launch(c) for c in caches], len(caches), args.reps)
            rows.append({"block_n": bn, "stages": stages, "variant": name, "us_per_block": us, "tb_s": bytes_read / us / 1e6,
                         "rel_err_vs_sdpa": err})
            print(rows[-1])
    # the same bytes summed by torch: the bandwidth a plain read reaches
    sums = torch.empty(len(caches), device=dev)
    torch_us = _graphed_us(lambda: [torch.sum(c[0].view(-1), 0, out=sums[i]) for i, c in enumerate(caches)],
                           len(caches), args.reps)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "shape": {"rows": R, "heads": H, "head_dim": D, "queries": NQ, "keys": NK},
            "torch_sum_us": torch_us, "torch_sum_tb_s": bytes_read / torch_us / 1e6, "rows": rows}
    (args.out / "vt_layout_probe.json").write_text(json.dumps(meta, indent=1))
    lines = [f"# Attention cache layout probe, one block at {R} rows ({gpu})", "",
             f"torch {torch.__version__}, triton {triton.__version__}; {R} rows x 8 heads, 50 queries, 450 keys, "
             f"FP32 cache, TF32 dots; graphs over {len(caches)} caches, median of {args.reps} replays. "
             f"A torch sum over the same caches: {torch_us:.1f} us ({bytes_read / torch_us / 1e6:.2f} TB/s).", "",
             "| BLOCK_N | stages | variant | us per block | TB/s | rel err vs SDPA |", "|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['block_n']} | {r['stages']} | {r['variant']} | {r['error']} | | |")
        else:
            e = "" if r["rel_err_vs_sdpa"] is None else f"{r['rel_err_vs_sdpa']:.1e}"
            lines.append(f"| {r['block_n']} | {r['stages']} | {r['variant']} | {r['us_per_block']:.1f} | {r['tb_s']:.2f} | {e} |")
    (args.out / "vt_layout_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
