"""Where a steady HiFT chunk's time goes on the GPU (both HiFT variants, batch 1).

Original HiFT: the F0 graph, the eager excitation and the decode graph of one steady 1-s
chunk (8 cached + 50 new mel frames, 3840 cached excitation samples), each timed alone with
CUDA events, plus the kernels of one decode replay. Causal HiFT: one steady 1-s chunk through
``BoundedStream`` with ``GraphedHiFT`` as its runner. Writes OUT/hift_profile.{json,md}.

    python benchmarks/hift_profile.py OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from code2wav_bench import randomize_, timed  # noqa: E402


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def kernel_table(fn, top: int = 25) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or 0
        if t > 0 and "cuda" in str(getattr(e, "device_type", "")).lower():
            rows.append({"kernel": e.key[:100], "count": e.count, "us": round(t, 1)})
    rows.sort(key=lambda r: -r["us"])
    return rows[:top] + [{"kernel": "TOTAL", "count": sum(r["count"] for r in rows), "us": round(sum(r["us"] for r in rows), 1)}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget", type=float, default=0.3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from minicpmo_rt.code2wav.hift import FULL_SIZE as HIFT_FULL, HiFTGenerator
    from minicpmo_rt.code2wav.hift_graph import GraphedHiFT
    from minicpmo_rt.code2wav.precision import ieee_fp32

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "original": {}, "causal": {}}
    model = HiFTGenerator(HIFT_FULL)
    randomize_(model, 3)
    model = model.cuda().eval()
    g = GraphedHiFT(model)
    mel = torch.randn(1, 80, 58, device="cuda")
    src = 0.01 * torch.randn(1, 1, 3840, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode(), ieee_fp32():
        for _ in range(3):
            g(mel, src, generator=gen, copy_out=False)
        f0 = g.f0(mel)
        source = model.excitation(f0, gen)
        parts = {
            "whole call": lambda: g(mel, src, generator=gen, copy_out=False),
            "f0 replay": lambda: g.f0(mel),
            "excitation (eager)": lambda: model.excitation(f0, gen),
            "decode replay": lambda: g.decode(mel, source),
        }
        for name, fn in parts.items():
            res["original"][name] = round(med(timed(fn, args.budget)), 3)
            print(f"original HiFT {name}: {res['original'][name]:.3f} ms", flush=True)
        res["original"]["decode kernels"] = kernel_table(lambda: g.decode(mel, source))
        res["original"]["excitation kernels"] = kernel_table(lambda: model.excitation(f0, gen))
        res["original"]["f0 kernels"] = kernel_table(lambda: g.f0(mel))
    try:
        from minicpmo_rt.code2wav.hift_causal import CausalHiFTGenerator, BoundedStream
        cm = CausalHiFTGenerator()
        randomize_(cm, 4)
        cm = cm.cuda().eval()
        cg = GraphedHiFT(cm)
        stream = BoundedStream(cm, runner=cg)
        chunks = [torch.randn(1, 80, 50, device="cuda") for _ in range(8)]
        with torch.inference_mode():
            for c in chunks[:4]:
                stream.push(c)
            it = iter(chunks[4:] * 100)
            res["causal"]["steady push (50 mel)"] = round(med(timed(lambda: stream.push(next(it)), args.budget)), 3)
            res["causal"]["graphs"] = cg.describe()
            res["causal"]["push kernels"] = kernel_table(lambda: stream.push(next(it)))
        print(f"causal HiFT steady push: {res['causal']['steady push (50 mel)']:.3f} ms ({cg.describe()})", flush=True)
    except Exception as exc:  # noqa: BLE001
        res["causal"]["error"] = repr(exc)
        print(f"causal HiFT failed: {exc!r}", flush=True)
    (args.out / "hift_profile.json").write_text(json.dumps(res, indent=2))
    lines = [f"# HiFT steady chunk on {res['device']} (torch {res['torch']}), batch 1", ""]
    for variant in ("original", "causal"):
        for k, v in res[variant].items():
            if isinstance(v, list):
                lines += ["", f"{variant} {k}:", "", "| kernel | count | us |", "|---|---:|---:|"]
                lines += [f"| `{r['kernel']}` | {r['count']} | {r['us']} |" for r in v]
            else:
                lines.append(f"- {variant} {k}: {v}")
    (args.out / "hift_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
