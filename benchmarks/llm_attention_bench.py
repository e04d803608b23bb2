"""The static-cache LLM attention (``kernels.attention``) at the feature extractor's prefill
shapes, per launch configuration (split length, row block, warps): us per call (median of
CUDA-event timings over graph-free launches) and relative error vs ``attention_torch``.

    python benchmarks/llm_attention_bench.py OUT

Shapes: Qwen3-8B heads (32 q / 8 kv, head dim 128), bf16, static cache of 10048 rows
(8000-token window + 2048 headroom); B=1 x 96 new tokens (a commit) and B=4 x 80 (a
second's forked tails), with the newest position at 3000 and 7000 cached rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from minicpmo_rt.thinker import kernels as K


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, KV, D, S = 32, 8, 128, 10048
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for (B, T), ctx in itertools.product([(1, 96), (4, 80)], [3000, 7000]):
        kc = torch.randn(B, KV, S, D, generator=g, device=dev, dtype=dt)
        vc = torch.randn(B, KV, S, D, generator=g, device=dev, dtype=dt)
        q = torch.randn(B, T, H, D, generator=g, device=dev, dtype=dt)
        pos = torch.arange(ctx - T, ctx, device=dev)[None].expand(B, T).contiguous()
        ref = K.attention_torch(q, kc, vc, pos)
        for split, bm, nw in itertools.product([256, 512, 1024, 2048], [64, 128], [4, 8]):
            try:
                f = lambda: K.attention(q, kc, vc, pos, split=split, block_m=bm, num_warps=nw)  # noqa: E731
                out = f()
                for _ in range(3):
                    f()
                ts = []
                for _ in range(20):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    f()
                    b.record()
                    b.synchronize()
                    ts.append(a.elapsed_time(b) * 1e3)
                ts.sort()
                r = {"B": B, "T": T, "ctx": ctx, "split": split, "block_m": bm, "warps": nw,
                     "us": round(ts[len(ts) // 2], 1), "rel_err": rel(out, ref)}
            except Exception as e:  # noqa: BLE001 (a config the compiler rejects: recorded)
                r = {"B": B, "T": T, "ctx": ctx, "split": split, "block_m": bm, "warps": nw, "error": str(e)[:200]}
            rows.append(r)
            print(r, flush=True)
    (args.out / "llm_attention_bench.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
