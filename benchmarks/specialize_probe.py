"""H200 probe: the CFM kernels with their launch-varying integers unspecialised (``do_not_specialize``, the
default since session 24) against Triton's default specialisation, as whole Whole-Euler replays.

Triton compiles a kernel once per combination of integer arguments that are 1 or a multiple of 16. The
persistent block kernel (``dit_block._dit_block``), the direct attention (``tiled_attention._attn_direct``)
and the Euler junction (``euler_step._euler_junction``) take such integers (Euler step, layer, cache lengths,
trim span, batch rows), which cost 141 compiles on a cold cache (``triton_compile_census.py``). Unspecialised,
the kernels can no longer use a known multiple of 16 (the steady cache length here, 400, is one), so this
times what that costs: each batch's solve as the flow calls it (trimmed, direct where it applies) with the
module's kernels, then with copies of them re-wrapped by ``triton.jit`` specialising some of those integers
again (``--variants``), twice over (A B A B), one machine; each row gives its replay and whole-call medians
and the max relative difference from the batch's first row (the same arithmetic: 0 expected).

    python benchmarks/specialize_probe.py --out DIR [--batches 1,2,4,8,16] [--variants "all;cur_keys"]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from code2wav_bench import _triton_version  # noqa: E402
from code2wav_gemm_probe import _in_solve_sweep, _vs_first, vs_first_table  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from minicpmo_rt.code2wav.kernels import dit_block, euler_step, tiled_attention  # noqa: E402

KERNELS = ((dit_block, "_dit_block", dit_block.RUNTIME_INTS), (tiled_attention, "_attn_direct",
            tiled_attention.DIRECT_RUNTIME_INTS), (euler_step, "_euler_junction", euler_step.JUNCTION_RUNTIME_INTS))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--variants", default="all", help="';'-separated variants after the default, each the "
                    "comma-separated integers specialised again ('all': every one, Triton's default)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device: it times CUDA-graph replays")
    kept = {name: getattr(mod, name) for mod, name, _ in KERNELS}
    tables = {"unspecialised (default)": kept}
    for v in args.variants.split(";"):
        keep = {n.strip() for n in v.split(",")}
        known = {n for *_, ints in KERNELS for n in ints}
        if "all" not in keep and not keep <= known:
            ap.error(f"--variants {v!r}: {sorted(keep - known)} is not among the unspecialised integers "
                     f"{sorted(known)}")
        label = "specialised: all (before)" if "all" in keep else f"specialised: {', '.join(sorted(keep))}"
        # the same Python functions with those integers specialised again ('all': a plain triton.jit)
        tables[label] = {name: triton.jit(kept[name].fn, do_not_specialize=[
            n for n in ints if "all" not in keep and n not in keep]) for _, name, ints in KERNELS}
    variants = [(label + (" (again)" if rep else ""), label) for rep in (0, 1) for label in tables]
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": _triton_version(),
           "kernels": [name for _, name, _ in KERNELS], "rows": []}

    def setup(wg, B, big, variant):
        for mod, name, _ in KERNELS:
            setattr(mod, name, tables[variant[1]][name])
        return None, None

    def save():
        (args.out / "specialize_probe.json").write_text(json.dumps(res, indent=1))

    record = _vs_first(res, "rows", save, value_key="kernels_variant", label="specialisation")
    try:
        _in_solve_sweep([int(b) for b in args.batches.split(",")], variants, setup, record, trim=True, called=True)
    finally:
        for mod, name, _ in KERNELS:
            setattr(mod, name, kept[name])
    lines = [f"# CFM kernels: launch-varying integers unspecialised vs specialised ({res['gpu']})", "",
             f"torch {res['torch']}, triton {res['triton']}; kernels {', '.join(res['kernels'])}. Whole-Euler solve "
             "per steady 1-s chunk (cache 400 frames) as the flow calls it (trimmed; direct where it applies), "
             "median of 15 replays and of 15 whole calls.", ""] + vs_first_table(res["rows"])
    (args.out / "specialize_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
