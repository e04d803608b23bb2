"""Where do the staged FP16 body's cuBLAS GEMM roles depart from its tile GEMMs? (CUDA only.)

1. Each GEMM shape of a batch-16 block (and the QKV at batch 4): cuBLAS FP16 -> FP32 (``torch.mm(out_dtype=)``,
   with and without reduced-precision reductions allowed) and the tile GEMM (``wide_gemm``) against an FP64
   product of the same FP16 operands, and against each other.
2. The fused body at 32 rows (batch 16 with CFG), one block and all sixteen, with each role set on cuBLAS against
   every GEMM a tile GEMM: relative differences of velocity, CNN cache and attention cache.

    PYTHONPATH=src:tests python benchmarks/cublas16_roles_check.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "code2wav"))

from minicpmo_rt.code2wav.flow_config import FULL_SIZE  # noqa: E402
from minicpmo_rt.code2wav.fused_dit import FusedDiT  # noqa: E402
from minicpmo_rt.code2wav.kernels.wide_gemm import wide_gemm  # noqa: E402
from minicpmo_rt.code2wav.precision import matmul_tf32  # noqa: E402

SHAPES = [(1600, 1536, 512, "qkv"), (1664, 1536, 512, "conv products"), (1600, 512, 512, "proj"),
          (1600, 2048, 512, "fc1"), (1600, 512, 2048, "fc2"), (400, 1536, 512, "qkv B4")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def gemms() -> None:
    torch.manual_seed(0)
    flag = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    try:
        for M, N, K, name in SHAPES:
            x = torch.randn(M, K, device="cuda").half()
            w = (torch.randn(N, K, device="cuda") / K ** 0.5).half()
            ref = x.double() @ w.double().t()
            got = {}
            for red in (True, False):
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = red
                got[red] = torch.empty(M, N, device="cuda")
                torch.mm(x, w.t(), out_dtype=torch.float32, out=got[red])
            tile = torch.empty(M, N, device="cuda")
            with matmul_tf32(True):
                wide_gemm(x, w, None, tile, precision="tf32", tma=True)
            print(f"{name:14s} {M}x{N}x{K}: cuBLAS fp16->fp32 {rel(got[True], ref):.2e} (no reduced-precision "
                  f"reduction {rel(got[False], ref):.2e}), tile {rel(tile, ref):.2e}, "
                  f"cuBLAS vs tile {rel(got[True], tile):.2e}", flush=True)
    finally:
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = flag


def bodies() -> None:
    from test_fused_dit import inputs, our_dit
    for depth in (1, 16):
        cfg = dataclasses.replace(FULL_SIZE.dit, depth=depth)
        dit = our_dit(cfg, seed=7).cuda()
        kw = inputs(32, 50, 400, depth, 512, 8, 64, seed=8, device="cuda")
        outs = {}
        for roles in ("", "qkv", "conv", "fc1", "proj fc2"):
            fused = FusedDiT(dit, attention="triton-tf32", gemm="cublas-split", gemm_operands="fp16")
            fused.cublas16 = frozenset(roles.split())
            with matmul_tf32(True):
                outs[roles] = fused.forward_chunk(**kw)
        for roles, out in outs.items():
            print(f"depth {depth}: roles [{roles}] vs tiles (velocity, cnn cache, att cache):",
                  [f"{rel(a, b):.2e}" for a, b in zip(out, outs[""])], flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("cublas16_roles_check.py needs CUDA")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    gemms()
    bodies()
