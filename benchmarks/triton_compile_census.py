"""Which Triton kernels a fresh machine compiles before its first Code2Wav stream, and how long each takes.

Points ``TRITON_CACHE_DIR`` at an empty folder (a cold cache, as on a fresh machine), installs Triton's JIT
hooks (``knobs.runtime.jit_cache_hook`` before a compile, ``jit_post_compile_hook`` after it) and runs what a
server runs: ``Code2Wav.prepare(voice)`` on full-size random weights with the knobs' default fast path, then
one stream of six 1-s chunks. Each compile is recorded with its kernel, host seconds and the specialisation
Triton keyed it on (per argument: its type, and for integers whether it was 1 or a multiple of 16). Kernels
compiled more than once are listed with the arguments whose specialisation differed between the compiles:
those are the ones a ``do_not_specialize`` would fold into one compile. Writes JSON + Markdown to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path


def _spec(names, compile: dict) -> dict[str, str]:
    """Per argument what the compile was keyed on: a constexpr's value, else the type and Triton's attributes
    (``tt.divisibility`` 16 for an integer or pointer it found a multiple of 16) and any specialised value."""
    sig, consts, attrs = compile.get("signature", {}), compile.get("constants", {}), compile["configs"][0]
    out = {}
    for i, name in enumerate(names):
        ty = sig.get(name, "?") if isinstance(sig, dict) else "?"
        if ty == "constexpr":
            out[name] = f"= {consts.get((i,), consts.get(name))!r}"
        else:
            out[name] = f"{ty} {attrs.get((i,), '')}" + (f" = {consts[(i,)]!r}" if (i,) in consts else "")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cache-dir", type=Path, default=None, help="Triton cache folder (default: a new empty one)")
    ap.add_argument("--stream-chunks", type=int, default=6)
    args = ap.parse_args()
    if args.cache_dir is not None and args.cache_dir.exists() and any(args.cache_dir.iterdir()):
        ap.error(f"--cache-dir {args.cache_dir} is not empty: a census needs a cold cache; give a new folder or "
                 "leave --cache-dir out (a new temporary one)")
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="triton_cold_"))
    os.environ["TRITON_CACHE_DIR"] = str(cache)     # before triton is imported anywhere

    import torch
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device: the census counts what Triton compiles for the GPU")
    from triton import knobs

    from code2wav_pipeline_bench import bench_models
    from first_chunk_bench import fresh_code2wav, stream_payloads

    compiles: list[dict] = []
    open_: dict = {}

    def before(*, key, fn, **_):
        open_[key] = time.perf_counter()
        return False                    # False: go on and compile

    def after(*, key, fn, compile, **_):
        t0 = open_.pop(key, time.perf_counter())
        try:
            spec = _spec(fn.jit_function.arg_names, compile)
        except Exception as exc:  # noqa: BLE001 - a census entry without its key beats a lost run
            spec = {"?": repr(exc)}
        compiles.append({"kernel": fn.name, "seconds": time.perf_counter() - t0, "spec": spec})

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
    dev = torch.device("cuda")
    flow, gen, feats, g = bench_models(False, dev)
    c2w = fresh_code2wav(flow, gen, {})
    marks = {}
    t = time.perf_counter()
    c2w.prepare(feats)
    torch.cuda.synchronize()
    marks["prepare_s"] = time.perf_counter() - t
    n_prepare = len(compiles)
    stream = c2w.open_stream(feats)
    payloads = stream_payloads(g, args.stream_chunks)
    t = time.perf_counter()
    for p in payloads:
        stream.push(p)
    torch.cuda.synchronize()
    marks["stream_s"] = time.perf_counter() - t
    stream.close()

    by_kernel: dict[str, list[dict]] = defaultdict(list)
    for c in compiles:
        by_kernel[c["kernel"]].append(c)
    summary = []
    for name, cs in sorted(by_kernel.items(), key=lambda kv: -sum(c["seconds"] for c in kv[1])):
        differing = sorted({n for c in cs for n in c["spec"] if len({str(d["spec"].get(n)) for d in cs}) > 1})
        summary.append({"kernel": name, "compiles": len(cs), "seconds": sum(c["seconds"] for c in cs),
                        "max_seconds": max(c["seconds"] for c in cs), "differing_args": differing})
        for c in cs:    # each compile keeps only the arguments that tell it from its kernel's other compiles
            c["spec"] = {n: c["spec"][n] for n in differing if n in c["spec"]}
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": sys.version.split()[0],
           **marks, "compiles_in_prepare": n_prepare, "compiles_in_stream": len(compiles) - n_prepare,
           "compile_seconds": sum(c["seconds"] for c in compiles), "summary": summary, "compiles": compiles}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "triton_compile_census.json").write_text(json.dumps(res, indent=2))
    lines = [f"# Triton compiles on a cold cache before and during the first stream ({res['gpu']})", "",
             f"torch {res['torch']}, python {res['python']}. `Code2Wav.prepare(voice)` {marks['prepare_s']:.1f} s "
             f"({n_prepare} compiles), then a {args.stream_chunks}-chunk stream {marks['stream_s']:.1f} s "
             f"({len(compiles) - n_prepare} compiles); {res['compile_seconds']:.1f} s compiling in all.", "",
             "| kernel | compiles | seconds | slowest | arguments whose specialisation differed |",
             "|---|---:|---:|---:|---|"]
    lines += [f"| {s['kernel']} | {s['compiles']} | {s['seconds']:.1f} | {s['max_seconds']:.1f} | "
              f"{', '.join(s['differing_args']) or '-'} |" for s in summary]
    (args.out / "triton_compile_census.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
