"""H200 probe: one switch of the fast path, A/B in place, as whole Whole-Euler replays.

Sets ``minicpmo_rt.code2wav.<attr>`` (or, for ``FusedDiT.NAME``, the solver's FusedDiT attribute) to each
value in turn, twice over (A B A B, one machine), builds the default fused TF32 solver for each batch and
times its CUDA-graph replay per steady 1-s chunk (median of 15; the untrimmed arena solve, or with
``--trim`` the solve as the flow calls it; ``--gemm-operands fp16`` for the opt-in). Each row also gives the max relative difference of its outputs from the
batch's first row. Used for:

    # the Euler-step junction on 4 vs 8 warps (the same time; junction_probe_session16_h200.md)
    python benchmarks/solve_switch_probe.py --out DIR --attr kernels.euler_step.JUNCTION_WARPS --values 4,8

The same probe timed the persistent block kernel's GEMM phases with evenly shared row tiles, a switch
that lost and was removed (balanced_tiles_probe_session16_h200.md). ``--fixed ATTR=VALUE`` holds another
attribute for every variant, e.g. the block kernel's attention key tile under two query-block sizes:

    python benchmarks/solve_switch_probe.py --out DIR --attr kernels.dit_block.ATT_BN --values 64,128 \
        --fixed kernels.dit_block.ATT_BM=32 --batches 1,2

``--called`` also times the whole solve call (what the flow waits for: staging, the arena fill and the trim
included); ``--direct on|off`` sets the solver's direct path (on: the block kernel's direct phase at batch 1-2
too); ``--no-successor`` (measurement only) lets a direct solve read the old caches in place but write no
successor. Session 19's direct key splits, e.g.:

    python benchmarks/solve_switch_probe.py --out DIR --attr kernels.tiled_attention.DIRECT_ALIGNED_SPLITS \
        --values 1,0 --batches 1,2,4 --trim --called --direct on
    python benchmarks/solve_switch_probe.py --out DIR --attr FusedDiT.attn_splits --values 2,4,3 --batches 4 \
        --trim --called

A dict entry takes '/'-separated tuples, e.g. the block kernel's fc1 tile with 64- and 32-wide K steps (the
lead of session 20's tile profile, dit_block_profile_tiles_session20_h200.json):

    python benchmarks/solve_switch_probe.py --out DIR --attr "kernels.dit_block.TILES[fc1]" \
        --values 64/32/1/64,64/32/1/32 --batches 1,2 --trim --called
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from code2wav_bench import _triton_version  # noqa: E402
from code2wav_gemm_probe import _in_solve_sweep, _vs_first, vs_first_table  # noqa: E402

import torch  # noqa: E402

from minicpmo_rt.code2wav.euler_graph import WholeEulerSolver  # noqa: E402


def _resolve(attr: str):
    """(module, name) of ``mod.path.NAME`` under minicpmo_rt.code2wav; NAME may be ``DICT[key]``, an entry of a
    dict attribute (e.g. ``kernels.dit_block.TILES[fc1]``). LookupError names what is missing."""
    mod_name, _, name = attr.rpartition(".")
    module = importlib.import_module(f"minicpmo_rt.code2wav.{mod_name}")
    base, _, key = name.partition("[")
    if not hasattr(module, base):
        raise LookupError(f"minicpmo_rt.code2wav.{mod_name} has no attribute {base}")
    if key and (not key.endswith("]") or key[:-1] not in getattr(module, base)):
        raise LookupError(f"minicpmo_rt.code2wav.{mod_name}.{base} has no entry {key.rstrip(']')!r}")
    return module, name


def _get(module, name: str):
    base, _, key = name.partition("[")
    return getattr(module, base)[key[:-1]] if key else getattr(module, base)


def _set(module, name: str, value) -> None:
    base, _, key = name.partition("[")
    if key:
        getattr(module, base)[key[:-1]] = value
    else:
        setattr(module, base, value)


def _value(default, text: str):
    """A --values item as the attribute's type: a '/'-separated int tuple for a tuple, else an int (bool/int)."""
    if isinstance(default, tuple):
        return tuple(int(x) for x in text.split("/"))
    cast = type(default) if isinstance(default, (bool, int)) else int
    return cast(int(text))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--attr", required=True, help="module attribute under minicpmo_rt.code2wav, e.g. "
                    "kernels.dit_block.BALANCED_TILES, an entry of a dict attribute, e.g. "
                    "kernels.dit_block.TILES[fc1], or FusedDiT.NAME: the solver's FusedDiT attribute NAME "
                    "(e.g. FusedDiT.attn_stages)")
    ap.add_argument("--values", required=True, help="comma list of integer values (booleans as 0/1), or of "
                    "'/'-separated integer tuples for a tuple-valued entry, e.g. 64/32/1/64,64/32/1/32")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--fixed", action="append", default=[], metavar="ATTR=VALUE",
                    help="another integer attribute held at VALUE for every variant (repeatable)")
    ap.add_argument("--gemm-operands", choices=("fp32", "fp16"), default="fp32",
                    help="the solver's GEMM operands (fp16: the cfm_fp16_operands opt-in)")
    ap.add_argument("--trim", action="store_true", help="solve as the flow calls it (trimmed successor; the "
                    "direct path from batch 4) instead of the untrimmed arena solve")
    ap.add_argument("--direct", choices=("auto", "on", "off"), default="auto",
                    help="the solver's direct path: auto (its default), on (the block kernel's direct phase at "
                    "batch 1-2 too), off (always the arena); matters with --trim")
    ap.add_argument("--no-successor", action="store_true", help="measurement only: a direct solve's tables "
                    "mark no row's successor present, so its attention reads the old caches in place and writes "
                    "nothing (the returned caches are then garbage; what the successor writes cost)")
    ap.add_argument("--called", action="store_true", help="also time the whole solve call (staging, arena "
                    "fill and trim copies included), not only the graph replay")
    args = ap.parse_args(argv)

    def resolve(attr: str):
        try:
            return _resolve(attr)
        except LookupError as exc:
            ap.error(str(exc))

    on_fused = args.attr.startswith("FusedDiT.")
    if on_fused:        # an attribute of the solver's FusedDiT, set before its first solve (capture)
        module, name = None, args.attr.split(".", 1)[1]
        default = None
    else:
        module, name = resolve(args.attr)
        default = _get(module, name)
    fixed = []
    for item in args.fixed:
        attr, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--fixed {item!r}: expected ATTR=VALUE")
        m, n = resolve(attr)
        fixed.append((m, n, _value(_get(m, n), value)))
    saved = [(m, n, _get(m, n)) for m, n, _ in fixed]
    for m, n, v in fixed:
        _set(m, n, v)
    values = [_value(default, v) for v in args.values.split(",")]
    variants = [(f"{name}={v}" + (" (again)" if rep else ""), v) for rep in (0, 1) for v in values]
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": _triton_version(),
           "attr": args.attr, "default": default, "fixed": args.fixed, "gemm_operands": args.gemm_operands,
           "trim": args.trim, "direct": args.direct, "no_successor": args.no_successor, "rows": []}

    def setup(wg, B, big, variant):
        if on_fused:
            def tune(fused, v=variant[1]):
                if not hasattr(fused, name):
                    raise AttributeError(f"FusedDiT has no attribute {name}")
                setattr(fused, name, v)
            return None, tune
        _set(module, name, variant[1])
        return None, None     # the solver's default GEMMs for the batch (the block kernel at batch 1-2)

    def save():
        (args.out / "solve_switch_probe.json").write_text(json.dumps(res, indent=1))

    record = _vs_first(res, "rows", save, value_key="value", label=args.attr)

    bind = WholeEulerSolver._bind_streams
    if args.no_successor:
        def bind_without_successors(self, st, *a, **k):
            outs = bind(self, st, *a, **k)
            st.extra["tables"][1, :, 3] = 0      # after the upload, in stream order
            return outs
        WholeEulerSolver._bind_streams = bind_without_successors
    try:
        _in_solve_sweep([int(b) for b in args.batches.split(",")], variants, setup, record,
                        gemm_operands=args.gemm_operands, trim=args.trim,
                        direct={"auto": None, "on": True, "off": False}[args.direct], called=args.called)
    finally:
        WholeEulerSolver._bind_streams = bind
        if not on_fused:
            _set(module, name, default)
        for m, n, v in saved:
            _set(m, n, v)
    lines = [f"# {args.attr} A/B in place ({res['gpu']})", "",
             f"torch {res['torch']}, triton {res['triton']}; Whole-Euler solve replay per steady 1-s chunk "
             f"(fused + graph TF32, {'trimmed as the flow calls it' if args.trim else 'arena'}, {args.gemm_operands} GEMM "
             f"operands, direct {args.direct}{', no successor writes' if args.no_successor else ''}), median of 15; "
             f"default {default}"
             + "".join(f"; {f}" for f in args.fixed) + ".", ""] + vs_first_table(res["rows"])
    (args.out / "solve_switch_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
