"""What one stream-vocoder stage call costs per batch bucket: the data a cost-aware plan for the HiFT calls of a
serving round needs (``hift._plan_calls`` fills only the rows a call pads up to anyway; whether letting a call
grow into the next bucket to take a shorter one pays depends on these times).

The full-size causal HiFT (random weights, weight norm fused, as ``load_vocoder`` serves it) behind the stream
vocoder's default runner (``GraphedHiFT``, decode blocks of 50 frames). One stream's stage calls are recorded:
its first chunk, the next two, a steady one, a final chunk of 26 mel frames (its look-ahead calls, then the final
call). Each distinct call is then timed at every batch bucket (its batch-1 inputs repeated), after two calls (the
graph set captures a shape on its second call): medians of ``--reps`` calls, ms,

  * ``as called``: ``runner.run_<op>`` with a device synchronisation before and after (graph replay plus the
    input and output copies and the host work around them);
  * ``events``: the same call's device time between CUDA events.

Then, per pair of a steady decode call of n rows and a shorter one of m rows: the as-called time of one call of
n + m rows (its bucket) against two calls. Writes JSON + Markdown to ``--out``. ``--tiny --device cpu`` is a
smoke run of the script (eager, times meaningless).

    python benchmarks/hift_stage_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from code2wav_bench import timed
from code2wav_pipeline_bench import bench_device, bench_models, device_label
from encoder_probe import _host_ms
from minicpmo_rt.atomic import atomic_write
from minicpmo_rt.code2wav.hift import StageCall
from minicpmo_rt.code2wav.hift_causal import BoundedStream
from minicpmo_rt.code2wav.hift_graph import ROW_BUCKETS
from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder

CHUNKS = ((50, "first chunk"), (50, "second chunk"), (50, "third chunk"), (50, "steady chunk"),
          (26, "final chunk"))


class Recorder:
    """A runner that runs the model eagerly and notes each stage call (first sight of a key only)."""

    def __init__(self, model):
        self.model, self.calls, self.label = model, {}, ""

    def _run(self, op, *args, finalize=None):
        call = StageCall(op, tuple(a.clone() for a in args), finalize)
        self.calls.setdefault(call.key(), (self.label, call))
        fn = getattr(self.model, "run_" + op)
        return fn(*args) if finalize is None else fn(*args, finalize=finalize)

    def run_f0(self, mel, finalize=True):
        return self._run("f0", mel, finalize=finalize)

    def run_excite(self, f0, phase, noise):
        return self._run("excite", f0, phase, noise)

    def run_decode(self, mel, source, finalize=True):
        return self._run("decode", mel, source, finalize=finalize)


def stream_calls(model, block_frames: int, dev) -> list[tuple[str, StageCall]]:
    rec = Recorder(model)
    stream = BoundedStream(model, block_frames=block_frames, runner=rec)
    g = torch.Generator().manual_seed(0)
    for k, (frames, label) in enumerate(CHUNKS):
        last = k == len(CHUNKS) - 1
        rec.label = label
        stream.push((torch.randn(1, 80, frames, generator=g) - 5).to(dev), last=False)
        if last:
            rec.label = "final call"
            stream.push(torch.zeros(1, 80, 0, device=dev), last=True)
    return list(rec.calls.values())


def describe(label: str, call: StageCall) -> str:
    fin = "" if call.finalize is None else (" (final)" if call.finalize else "")
    return f"{label}: {call.op}{fin} {tuple(call.args[0].shape[1:])}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny HiFT (smoke run of the script)")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    dev = bench_device("hift_stage_probe", args.device)
    _, gen, _, _ = bench_models(args.tiny, dev)
    voc = Vocoder(gen, CAUSAL)
    runner = voc.runner
    calls = stream_calls(voc.model, voc.stream_block_frames, dev)
    gpu = device_label(dev)
    res = {"gpu": gpu, "torch": torch.__version__, "block_frames": voc.stream_block_frames,
           "path": voc.describe_stream_path(), "buckets": list(ROW_BUCKETS), "rows": []}
    for label, call in calls:
        for b in ROW_BUCKETS:
            xs = tuple(a.repeat(b, *([1] * (a.ndim - 1))) for a in call.args)
            fn = getattr(runner, "run_" + call.op)

            def once(fn=fn, xs=xs, fin=call.finalize):
                return fn(*xs) if fin is None else fn(*xs, finalize=fin)
            once()
            once()      # captured here (capture_after=2)
            row = {"call": describe(label, call), "op": call.op, "finalize": call.finalize, "batch": b,
                   "as_called_ms": _host_ms(once, dev, args.reps),
                   "events_ms": (statistics.median(timed(once, budget_s=float("inf"), max_reps=args.reps,
                                                         min_reps=args.reps)) if dev.type == "cuda"
                                 else float("nan"))}
            res["rows"].append(row)
            print(row, flush=True)
    res["path_after"] = voc.describe_stream_path()
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out / "hift_stage_probe.json", lambda f: f.write(json.dumps(res, indent=2).encode()))

    names = list(dict.fromkeys(r["call"] for r in res["rows"]))
    at = {(r["call"], r["batch"]): r for r in res["rows"]}
    lines = [f"# Stream-vocoder stage calls per batch bucket ({gpu}, torch {res['torch']})", "",
             f"{res['path_after']}. One stream's calls, each timed at every bucket (batch-1 inputs repeated) after "
             f"its capture; medians of {args.reps} calls, ms as called (device synchronised around each call) / "
             "device time between CUDA events.", "",
             "| call | " + " | ".join(f"B={b}" for b in ROW_BUCKETS) + " |", "|---|" + "---:|" * len(ROW_BUCKETS)]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(f"{at[n, b]['as_called_ms']:.3f} / {at[n, b]['events_ms']:.3f}"
                                               for b in ROW_BUCKETS) + " |")
    # the steady call is the longest look-ahead decode (a later chunk's calls repeat an earlier chunk's keys)
    look_ahead = [r for r in res["rows"] if r["op"] == "decode" and r["finalize"] is False and r["batch"] == 1]
    frames = {r["call"]: int(r["call"].rsplit(", ", 1)[1].rstrip(")")) for r in look_ahead}
    steady = max(frames, key=frames.get, default=None)
    shorter = sorted((n for n in frames if n != steady), key=frames.get, reverse=True)
    if steady and shorter:
        lines += ["", f"Growing a call into the next bucket to take a shorter call along, decode, as called: one call "
                      f"of the steady shape at bucket(n + m) against a steady call at bucket(n) plus `{shorter[0]}` "
                      "at bucket(m) (ms; < 1 means the merged call is cheaper):", "",
                  "| n \\ m | " + " | ".join(str(m) for m in (1, 2, 4)) + " |", "|---|---:|---:|---:|"]

        def bucket(k):
            return next((b for b in ROW_BUCKETS if b >= k), None)
        for n_rows in (1, 2, 3, 4, 6, 8, 12):
            cells = []
            for m in (1, 2, 4):
                big = bucket(n_rows + m)
                if big is None:
                    cells.append("-")
                    continue
                one = at[steady, big]["as_called_ms"]
                two = at[steady, bucket(n_rows)]["as_called_ms"] + at[shorter[0], bucket(m)]["as_called_ms"]
                cells.append(f"{one:.2f} / {two:.2f} ({one / two:.2f})")
            lines.append(f"| {n_rows} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    atomic_write(args.out / "hift_stage_probe.md", lambda f: f.write(text.encode()))
    print(text)


if __name__ == "__main__":
    main()
