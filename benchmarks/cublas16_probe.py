"""Staged body with FP16 operands (batch 4-16): sets of GEMM roles as cuBLAS FP16 GEMMs (``FusedDiT.cublas16``,
``fused_dit.CUBLAS16_ALL``) against the Triton tile GEMMs, in the solve as the flow calls it (trimmed, direct).

Both forms multiply the same FP16 operands exactly and sum in FP32, so outputs differ only by summation
order (but for fc1 through cuBLASLt's GELU epilogue, which takes its bias in FP16: ``--roles``). Per batch and variant: the solve as called and its graph replay (medians of CUDA-event timings,
two alternating rounds), and the mel's relative difference from the tile-GEMM variant.

    PYTHONPATH=src python benchmarks/cublas16_probe.py --out DIR [--batches 16,8,4] [--roles proj+fc2,all]

Writes cublas16_probe.json / .md into --out (CUDA only).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from code2wav_bench import L, S, T, chunk_inputs, randomize_, timed  # noqa: E402

from minicpmo_rt.code2wav.euler_graph import GraphConfig, WholeEulerSolver  # noqa: E402
from minicpmo_rt.code2wav.flow import Flow  # noqa: E402
from minicpmo_rt.code2wav.flow_config import FULL_SIZE  # noqa: E402
from minicpmo_rt.code2wav.fused_dit import CUBLAS16_ALL, CUBLAS16_ROLES  # noqa: E402

# the first is the reference of the mel differences
DEFAULT_ROLES = "tiles,proj+fc2,proj+conv+fc2,proj+conv+fc1+fc2"


def variants(spec: str | None) -> dict[str, frozenset]:
    """``--roles``: comma-separated role sets joined by '+' ('' or 'tiles': none; 'all': every role of
    ``CUBLAS16_ALL``), the first the reference of the mel differences; the default's name says so."""
    out = {}
    for part in spec.split(","):
        part = part.strip()
        if part in ("", "tiles"):
            roles = frozenset()
        elif part == "all":
            roles = CUBLAS16_ALL
        else:
            roles = frozenset(r.strip() for r in part.split("+"))
        unknown = roles - CUBLAS16_ALL
        if unknown:
            raise SystemExit(f"cublas16_probe.py --roles: unknown roles {sorted(unknown)} in {part!r}; "
                             f"choose from {sorted(CUBLAS16_ALL)}")
        name = "tile GEMMs" if not roles else "cuBLAS " + " + ".join(r for r in ROLE_ORDER if r in roles)
        if roles == CUBLAS16_ROLES:
            name += " (default)"
        out[name] = roles
    return out


ROLE_ORDER = ("qkv", "proj", "conv", "fc1", "fc2")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="16,8,4")
    ap.add_argument("--budget", type=float, default=0.3)
    ap.add_argument("--roles", default=DEFAULT_ROLES, help="role sets to compare, e.g. 'proj+fc2,proj+fc2+qkv,all' "
                    f"(the first the mel reference; default {DEFAULT_ROLES})")
    args = ap.parse_args(argv)
    chosen = variants(args.roles)
    if not torch.cuda.is_available():
        ap.error("needs CUDA")
    args.out.mkdir(parents=True, exist_ok=True)
    flow = Flow(FULL_SIZE)
    randomize_(flow, 0)
    cfm = flow.to("cuda").eval().decoder
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    trim = (L - 100, 100)
    for B in (int(b) for b in args.batches.split(",")):
        cnn, att, mu, spk, cond = chunk_inputs(B)
        cfg = GraphConfig(batch_buckets=(B,), query_buckets=(T,), offset_bucket=50, offset_anchor=L, max_graphs=4)
        solvers, last, ref = {}, {}, None
        with torch.inference_mode():
            for name, roles in chosen.items():
                s = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S,
                                     config=cfg, gemm_operands="fp16")
                s.fused.cublas16 = roles
                last[name] = [s.solve(mu, spk, cond, cnn, att, copy_out=False, trim=trim)]
                mel = last[name][0][0].float()
                if ref is None:
                    ref = mel.clone()
                err = float((mel - ref).norm() / ref.norm())
                solvers[name] = (s, err)
            times = {n: ([], []) for n in chosen}
            for _ in range(2):          # alternating rounds: drift shows as a spread, not as a variant's gain
                for name, (s, _) in solvers.items():
                    def call(s=s, name=name):
                        last[name][0] = s.solve(mu, spk, cond, cnn, att, copy_out=False, trim=trim)
                    st = next(iter(s._statics.values()))
                    times[name][0].extend(timed(call, args.budget))
                    times[name][1].extend(timed(st.graph.replay, args.budget))
        for name, (s, err) in solvers.items():
            called, rep = times[name]
            r = {"batch": B, "variant": name, "called_ms": statistics.median(called), "replay_ms": statistics.median(rep),
                 "called_spread_ms": [min(called), max(called)], "mel_rel_diff_vs_first": err}
            res["rows"].append(r)
            print(f"B={B:2d} {name:28s} as called {r['called_ms']:7.2f} ms, replay {r['replay_ms']:7.2f} ms, "
                  f"mel diff {err:.1e}", flush=True)
        (args.out / "cublas16_probe.json").write_text(json.dumps(res, indent=1))
        (args.out / "cublas16_probe.md").write_text(markdown(res))
        del solvers, last, cnn, att
        gc.collect()
        torch.cuda.empty_cache()
    print(markdown(res))
    return 0


def markdown(res: dict) -> str:
    lines = [f"# Staged body, FP16 operands: cuBLAS FP16 GEMMs (FP32 out) vs tile GEMMs ({res['gpu']})", "",
             f"torch {res['torch']}; one steady 1-s chunk (query {T}, {S} Euler steps, CFG, cache {L}, trimmed, "
             "direct), ms, medians of two alternating rounds.", "",
             "| B | variant | as called | replay | mel rel. diff vs the first row |", "|---|---|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['batch']} | {r['variant']} | {r['called_ms']:.2f} | {r['replay_ms']:.2f} | "
                     f"{r.get('mel_rel_diff_vs_first', r.get('mel_rel_diff_vs_tiles')):.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
