"""H200 probe: the Euler-step junction kernel (``kernels/euler_step.py``) on 4 against 8 warps, in place.

On 4 warps ``_euler_junction`` spills 788-1564 bytes per thread (ptxas for SM90; compile_gate.py prints the
report); on 8 it does not. The junction runs once per Euler step (10 per chunk), so the question is what
the whole Whole-Euler replay gains. Variants alternate (A B A B) on one machine; every row is the GPU time
of the solve's CUDA-graph replay per steady 1-s chunk, median of 15, and its max relative difference from
the first row's outputs.

    python benchmarks/junction_probe.py --out DIR [--batches 1,16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from code2wav_bench import _triton_version  # noqa: E402
from code2wav_gemm_probe import _in_solve_sweep  # noqa: E402

import torch  # noqa: E402

from minicpmo_rt.code2wav import fused_dit  # noqa: E402
from minicpmo_rt.code2wav.kernels import euler_step  # noqa: E402

VARIANTS = (("junction 4 warps", 4), ("junction 8 warps", 8), ("junction 4 warps (again)", 4),
            ("junction 8 warps (again)", 8))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": _triton_version(), "rows": []}
    ref = {}
    default = euler_step.JUNCTION_WARPS

    def setup(wg, B, big, variant):
        euler_step.JUNCTION_WARPS = variant[1]
        return 2 * B * 50 >= fused_dit.WIDE_MIN_ROWS, None     # the default GEMMs for the batch

    def record(B, variant, got, ms):
        if B not in ref:
            ref.clear()
            ref[B] = [t.clone() for t in got]
        err = max(float((a - b).norm() / b.norm()) for a, b in zip(got, ref[B]))
        res["rows"].append({"batch": B, "variant": variant[0], "warps": variant[1], "replay_ms": ms,
                            "max_rel_diff_vs_first": err})
        print(f"B={B} {variant[0]:26s} replay {ms:.3f} ms (vs first {err:.1e})", flush=True)
        (args.out / "junction_probe.json").write_text(json.dumps(res, indent=1))

    try:
        _in_solve_sweep([int(b) for b in args.batches.split(",")], VARIANTS, setup, record)
    finally:
        euler_step.JUNCTION_WARPS = default
    lines = [f"# Euler-step junction on 4 vs 8 warps ({res['gpu']})", "",
             f"torch {res['torch']}, triton {res['triton']}; Whole-Euler solve replay per steady 1-s chunk "
             "(fused + graph TF32, arena), median of 15.", "",
             "| batch | variant | replay ms | max rel diff vs first |", "|---:|---|---:|---:|"]
    lines += [f"| {r['batch']} | {r['variant']} | {r['replay_ms']:.3f} | {r['max_rel_diff_vs_first']:.1e} |"
              for r in res["rows"]]
    (args.out / "junction_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
