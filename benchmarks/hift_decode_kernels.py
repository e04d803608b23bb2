"""Where a steady causal-HiFT decode call's GPU time goes, per batch bucket and cuDNN precision.

The stream vocoder's steady decode call (86 mel frames: 31 of history, 50 new, 5 of look-ahead; its excitation)
on the full-size causal HiFT as ``load_vocoder`` serves it (random weights, weight norm fused and frozen,
time-major convs), repeated to B rows. Per B, per conv path (``hift.conv1d_as_2d``: the 2-D conv of the
time-major views, the default, or ``F.conv1d``, which copies every input twice) and per cuDNN setting (the
process default, TF32 allowed, as the runtime leaves it; and IEEE FP32), the call is run eagerly under
``torch.profiler`` (the graph replays the same kernels) and its kernels' device time is summed by class:

  conv TF32     cuDNN / CUTLASS implicit-GEMM convolutions on tensor cores (``tf32`` in the name)
  conv FP32     convolutions on CUDA cores (``convolve_``, ``f32f32_f32f32`` implicit GEMMs, ``ffma``)
  layout        cuDNN's tensor conversions and padding (``convertTensor``, ``nchwToNhwc``, ``AddPadding``)
  fused         the HiFT's Triton kernels (activation + padding + residual, ``_act_pad`` and kin)
  fft           the excitation STFT and the iSTFT
  other         torch element-wise ops, copies, everything else

plus the graph replay's median time (CUDA events) and the convolutions' FLOPs (``torch.utils.flop_counter``),
so the achieved TFLOP/s says how far the convolutions are from the tensor-core or CUDA-core peak. Writes
JSON + Markdown to ``--out``. ``--tiny --device cpu`` is a smoke run (no profile, times meaningless).

    python benchmarks/hift_decode_kernels.py --out DIR [--batches 1,16]
"""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import contextmanager
from pathlib import Path

import torch

from code2wav_bench import timed
from code2wav_pipeline_bench import bench_device, bench_models, device_label, parse_batches
from code2wav_replay_profile import profile_kernels
from hift_stage_probe import stream_calls
from minicpmo_rt.atomic import atomic_write
from minicpmo_rt.code2wav.hift import conv1d_as_2d, fuse_weight_norm
from minicpmo_rt.code2wav.precision import ieee_fp32
from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder

CLASSES = ("conv TF32", "conv FP32", "layout", "fused", "fft", "other")


def kernel_class(name: str) -> str:
    n = name.lower()
    if any(w in n for w in ("converttensor", "nchwtonhwc", "nhwctonchw", "addpadding")):
        return "layout"
    if "fft" in n:
        return "fft"
    if any(w in n for w in ("xmma", "cutlass", "implicit_gemm", "convolve", "conv2d", "sgemm", "gemm")):
        return "conv TF32" if "tf32" in n else "conv FP32"
    if n.startswith("_") or "triton" in n:
        return "fused"
    return "other"


@contextmanager
def cudnn_tf32(on: bool):
    """cuDNN's TF32 flag for this measurement only (the runtime itself never touches it)."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = before


def conv_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as fc:
        fn()
    return int(fc.get_total_flops())


def markdown(res: dict) -> str:
    """The results file's Markdown (``--from-json`` writes it again from a results JSON)."""
    lines = [f"# Steady causal-HiFT decode call, GPU time by kernel class ({res['gpu']}, torch {res['torch']})", "",
             f"{res['path']}. One steady decode call (mel {tuple(res['call'])}, its excitation) repeated to B rows. "
             "`replay`: the graph replay's median (CUDA events); the classes: one eager call's kernels under the "
             "profiler (the same kernels), ms (count). `conv TFLOP/s`: the convolutions' FLOPs over their kernels' "
             "time.", "",
             "| B | cuDNN TF32 | convs | replay ms | kernels ms | " + " | ".join(CLASSES) + " | conv GFLOP | "
             "conv TFLOP/s |",
             "|---:|---|---|---:|---:|" + "---:|" * len(CLASSES) + "---:|---:|"]
    for r in res["rows"]:
        if "classes" not in r:
            continue
        cells = " | ".join(f"{r['classes'][c]['ms']:.2f} ({r['classes'][c]['count']})" for c in CLASSES)
        lines.append(f"| {r['batch']} | {'on' if r['cudnn_tf32'] else 'off'} | "
                     f"{'2-D views' if r['conv2d_views'] else 'F.conv1d'} | {r['replay_ms']:.2f} | "
                     f"{r['kernels_ms']:.2f} | {cells} | {r['conv_gflop']:.1f} | {r['conv_tflops']:.1f} |")
    replay = {(r["batch"], r["cudnn_tf32"], r["conv2d_views"]): r["replay_ms"] for r in res["rows"] if "replay_ms" in r}
    pairs = [(b, tf32) for b, tf32, views in replay if views and (b, tf32, False) in replay]
    if pairs:
        lines += ["", "Replay, F.conv1d against the 2-D views, side by side (ms):", "",
                  "| B | cuDNN TF32 | F.conv1d | 2-D views | F.conv1d / views |", "|---:|---|---:|---:|---:|"]
        for b, tf32 in pairs:
            old, new = replay[b, tf32, False], replay[b, tf32, True]
            lines.append(f"| {b} | {'on' if tf32 else 'off'} | {old:.2f} | {new:.2f} | {old / new:.2f}x |")
    for r in res["rows"]:
        if r.get("top"):
            lines += ["", f"Top kernels, B={r['batch']}, cuDNN TF32 {'on' if r['cudnn_tf32'] else 'off'}, "
                          f"{'2-D views' if r['conv2d_views'] else 'F.conv1d'}:", "",
                      "| kernel | count | us |", "|---|---:|---:|"]
            lines += [f"| `{t['kernel']}` | {t['count']} | {t['us']} |" for t in r["top"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of replays per timing")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny HiFT (smoke run of the script)")
    ap.add_argument("--from-json", type=Path, help="only write the Markdown again from a results JSON into --out")
    args = ap.parse_args()
    if args.from_json is not None:
        if not args.from_json.is_file():
            ap.error(f"--from-json {args.from_json}: no such file; pass a hift_decode_kernels JSON")
        text = markdown(json.loads(args.from_json.read_text()))
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write(args.out / "hift_decode_kernels.md", lambda f: f.write(text.encode()))
        return
    batches = parse_batches(ap, args.batches)
    dev = bench_device("hift_decode_kernels", args.device)
    _, gen, _, _ = bench_models(args.tiny, dev)
    gen = fuse_weight_norm(gen)     # as load_vocoder serves it
    voc = Vocoder(gen, CAUSAL)
    calls = stream_calls(voc.model, voc.stream_block_frames, dev)
    steady = max((c for _, c in calls if c.op == "decode" and c.finalize is False), key=lambda c: c.args[0].shape[-1])
    model, runner = voc.model, voc.runner
    res = {"gpu": device_label(dev), "torch": torch.__version__, "call": list(steady.args[0].shape[1:]),
           "path": voc.describe_stream_path(), "rows": []}
    for b in batches:
        mel, source = (a.repeat(b, *([1] * (a.ndim - 1))) for a in steady.args)
        for tf32, as_2d in ((True, False), (True, True), (False, False), (False, True)):
            with torch.inference_mode(), ieee_fp32(), cudnn_tf32(tf32), conv1d_as_2d(None if as_2d else False):
                def eager():
                    return model.run_decode(mel, source, finalize=False)

                def replay():
                    return runner.run_decode(mel, source, finalize=False)
                flops = conv_flops(eager)
                row = {"batch": b, "cudnn_tf32": tf32, "conv2d_views": as_2d, "conv_gflop": flops / 1e9}
                if dev.type == "cuda":
                    # a fresh runner per setting: graphs keep the precision and conv path they were captured with
                    runner = Vocoder(gen, CAUSAL).runner
                    for _ in range(3):
                        replay()
                    row["replay_ms"] = statistics.median(timed(replay, args.budget))
                    by, top = profile_kernels(eager, kernel_class, CLASSES)
                    row["classes"] = {k: {"ms": v["us"] / 1e3, "count": v["count"]} for k, v in by.items()}
                    row["kernels_ms"] = sum(v["us"] for v in by.values()) / 1e3
                    conv_ms = row["classes"]["conv TF32"]["ms"] + row["classes"]["conv FP32"]["ms"]
                    row["conv_tflops"] = flops / conv_ms / 1e9 if conv_ms else float("nan")
                    row["top"] = top
            res["rows"].append(row)
            print({k: v for k, v in row.items() if k != "top"}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out / "hift_decode_kernels.json", lambda f: f.write(json.dumps(res, indent=2).encode()))
    text = markdown(res)
    atomic_write(args.out / "hift_decode_kernels.md", lambda f: f.write(text.encode()))
    print(text)


if __name__ == "__main__":
    main()
