"""H200 probe: the DiT's GEMMs with FP16 operands instead of FP32 ones in TF32 dots.

The fused body stores every GEMM operand rounded to nearest TF32 (10-bit mantissa). FP16 has the
same 10-bit mantissa, so such a value in FP16's normal range (6.1e-5 .. 65504) is exact in FP16:
the products are the same numbers, accumulated in FP32 either way. FP16 operands are half the bytes
(the batch-16 tile GEMMs are L2-bound with FP32 operands) and run at twice the tensor-core rate.
This measures, per DiT GEMM shape at batch 16 and 1 (CFG rows, 50 queries):

- Triton ``wide_gemm`` with FP32 operands in TF32 dots (the shipped tile, TMA and pointer loads);
- the same kernel with FP16 operands over a few tiles (TMA loads);
- cuBLAS FP16 (FP16 out) as a ceiling, cuBLAS TF32 as the reference row;
- errors against an FP64 product of the same TF32-rounded operands, and FP16 against TF32.

    python benchmarks/fp16_operand_probe.py --out DIR [--batches 16,1]

GPU times of CUDA-graph replays (``code2wav_gemm_probe.graph_us``), us per GEMM. Writes
DIR/fp16_operand_probe.json and .md after every shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from code2wav_bench import T  # noqa: E402
from code2wav_gemm_probe import C, MLP, TAPS, graph_us  # noqa: E402

from minicpmo_rt.code2wav.kernels.wide_gemm import tile_for, wide_gemm  # noqa: E402
from minicpmo_rt.code2wav.precision import matmul_tf32  # noqa: E402

FP16_TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
              (64, 64, 64, 4, 4), (128, 256, 64, 8, 3), (64, 256, 64, 8, 3), (256, 128, 64, 8, 3),
              (64, 64, 128, 4, 3), (128, 128, 128, 8, 2)]


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """Nearest TF32 (ties away), as ``dit_ops.round_tf32``."""
    i = x.contiguous().view(torch.int32)
    return ((i + 0x1000) & -8192).view(torch.float32)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def probe(res: dict, save, batches) -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    for B in batches:
        R = 2 * B
        shapes = [("qkv", R * T, 3 * C, C, False, 1), ("proj", R * T, C, C, False, 1),
                  ("conv", R * (T + TAPS - 1), C, C, False, TAPS), ("fc1", R * T, MLP, C, True, 1),
                  ("fc2", R * T, C, MLP, False, 1)]
        for role, M, N, K, gelu, taps in shapes:
            # GELU outputs (fc2's input) are >= -0.17 and skewed; a LayerNorm'd input is ~N(0, 1)
            x = torch.randn(M, K, device=dev, generator=g)
            if role == "fc2":
                x = torch.nn.functional.gelu(2 * x, approximate="tanh")
            x = round_tf32(x)
            w = round_tf32(torch.randn(taps * N, K, device=dev, generator=g) / K ** 0.5)
            b = 0.02 * torch.randn(N, device=dev, generator=g)
            x16, w16 = x.half(), w.half()
            ref = x.double() @ w.double().t()
            if taps > 1:
                ref = sum(torch.cat([ref[j:, j * N:(j + 1) * N], ref.new_zeros(j, N)]) for j in range(taps))
            else:
                ref = ref[:, :N]
            ref = ref + b.double()
            if gelu:
                ref = torch.nn.functional.gelu(ref, approximate="tanh")
            out = torch.empty(M, N, device=dev)
            out_taps = torch.empty(M, taps * N, device=dev)
            flop = 2 * M * N * K * taps
            row = {"batch": B, "role": role, "M": M, "N": N, "K": K, "taps": taps, "gelu": gelu,
                   "fp16_exact": bool((x16.float() == x).all() and (w16.float() == w).all()), "variants": []}

            def add(name, fn, check):
                try:
                    fn()
                    err = rel(check(), ref) if check else float("nan")
                    us = graph_us(fn)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
                    row["variants"].append({"name": name, "error": repr(exc)[:200]})
                    return None
                row["variants"].append({"name": name, "us": us, "tflops": flop / us / 1e6, "err": err})
                return us

            with matmul_tf32(True):
                add("cuBLAS TF32", (lambda: torch.mm(x, w.t(), out=out_taps)) if taps > 1
                    else (lambda: torch.addmm(b, x, w.t(), out=out)), None)
                o16 = torch.empty(M, taps * N if taps > 1 else N, device=dev, dtype=torch.float16)
                add("cuBLAS FP16", (lambda: torch.mm(x16, w16.t(), out=o16)) if taps > 1
                    else (lambda: torch.addmm(b.half(), x16, w16.t(), out=o16)), None)
                tile = tile_for(M, N, K, taps)
                for tma in (True, False):
                    add(f"Triton FP32-op TF32 {tile} tma={tma}",
                        lambda tma=tma: wide_gemm(x, w, b, out, gelu=gelu, taps=taps, tma=tma), lambda: out)
                tf32_out = out.clone()
                best = None
                for cfg in FP16_TILES:
                    if K % cfg[2]:
                        continue
                    us = add(f"Triton FP16-op {cfg}",
                             lambda cfg=cfg: wide_gemm(x16, w16, b, out, gelu=gelu, taps=taps, tma=True, tile=cfg),
                             lambda: out)
                    if us is not None and (best is None or us < best[0]):
                        best = (us, cfg)
                if best is not None:
                    wide_gemm(x16, w16, b, out, gelu=gelu, taps=taps, tma=True, tile=best[1])
                    row["fp16_vs_tf32"] = rel(out, tf32_out)
                    row["best_fp16"] = {"us": best[0], "tile": best[1]}
            res["rows"].append(row)
            t32 = min(v["us"] for v in row["variants"] if v["name"].startswith("Triton FP32") and "us" in v)
            print(f"B={B:2d} {role:5s} {M}x{N}x{K}x{taps}: TF32 {t32:7.2f} us, FP16 "
                  f"{best[0] if best else float('nan'):7.2f} us {best[1] if best else ''} "
                  f"fp16 vs tf32 {row.get('fp16_vs_tf32', float('nan')):.1e}", flush=True)
            save()


def markdown(res: dict) -> str:
    lines = [f"# FP16-operand probe ({res['gpu']})", "",
             "us per GEMM (CUDA-graph replay, median). Errors: relative L2 against an FP64 product of the same",
             "TF32-rounded operands; `16 vs 32`: the FP16-operand result against the FP32-operand TF32 one.", "",
             "| B | GEMM | MxNxK(xtaps) | cuBLAS TF32 | cuBLAS FP16 | Triton TF32 (shipped) | Triton FP16 best | tile | "
             "ratio | err TF32 | err FP16 | 16 vs 32 |", "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    tot32 = {}
    tot16 = {}
    for r in res["rows"]:
        v = {x["name"]: x for x in r["variants"] if "us" in x}
        cub32 = v.get("cuBLAS TF32", {}).get("us", float("nan"))
        cub16 = v.get("cuBLAS FP16", {}).get("us", float("nan"))
        t32 = min((x for k, x in v.items() if k.startswith("Triton FP32")), key=lambda x: x["us"])
        b16 = r.get("best_fp16")
        e16 = next((x["err"] for k, x in v.items() if b16 and k == f"Triton FP16-op {tuple(b16['tile'])}"), float("nan"))
        tot32[r["batch"]] = tot32.get(r["batch"], 0) + t32["us"]
        tot16[r["batch"]] = tot16.get(r["batch"], 0) + (b16["us"] if b16 else float("nan"))
        lines.append(f"| {r['batch']} | {r['role']} | {r['M']}x{r['N']}x{r['K']}x{r['taps']} | {cub32:.1f} | "
                     f"{cub16:.1f} | {t32['us']:.1f} | {b16['us'] if b16 else float('nan'):.1f} | "
                     f"{tuple(b16['tile']) if b16 else ''} | {t32['us'] / b16['us'] if b16 else float('nan'):.2f} | "
                     f"{t32['err']:.1e} | {e16:.1e} | {r.get('fp16_vs_tf32', float('nan')):.1e} |")
    lines += ["", "Sum of one block's five GEMMs (us): "
              + ", ".join(f"B={b}: TF32 {tot32[b]:.1f}, FP16 {tot16[b]:.1f} ({tot32[b] / tot16[b]:.2f}x)"
                          for b in tot32), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="16,1")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp16_operand_probe needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    import triton
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "rows": []}

    def save():
        (args.out / "fp16_operand_probe.json").write_text(json.dumps(res, indent=1))
        (args.out / "fp16_operand_probe.md").write_text(markdown(res))

    probe(res, save, [int(b) for b in args.batches.split(",")])
    save()
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
