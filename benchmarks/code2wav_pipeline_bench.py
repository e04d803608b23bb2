"""Whole Code2Wav chunk on the GPU (encoder + CFM + HiFT) and 16 concurrent streams.

Full-size random weights, fp32, a 6-s voice prompt (150 tokens, 300 mel frames), steady
chunks of 28 codes (3 context + 25) once the caches sit at prompt + 100 frames. Rows:
reference path (original DiT, eager) and the fast path the knobs pick on CUDA (fused body +
Whole-Euler graphs, TF32 scoped to the DiT). 16 streams are pushed round-robin, one chunk
each per round; RTF = round time / 1 s of audio per stream. Writes JSON + Markdown to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from minicpmo_rt.checkpoint.tiny import randomize_
from minicpmo_rt.code2wav import flow_config, hift
from minicpmo_rt.code2wav.flow import Flow
from minicpmo_rt.code2wav.frontend import PromptFeatures
from minicpmo_rt.code2wav.pipeline import Code2Wav
from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder, VocoderSet, build_generator


def timed(fn, n):
    out = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    flow = Flow(flow_config.FULL_SIZE)
    randomize_(flow, seed=1)
    gen = build_generator(CAUSAL, hift.FULL_SIZE)
    randomize_(gen, seed=2)
    voc = Vocoder(gen.to(dev).eval(), CAUSAL)
    g = torch.Generator().manual_seed(0)
    feats = PromptFeatures(torch.randint(0, 6561, (1, 150), generator=g), torch.randn(1, 192, generator=g),
                           torch.randn(1, 300, 80, generator=g), 300, "bench")
    c2w = Code2Wav(flow.to(dev).eval(), VocoderSet(voc, voc), frontend=None, n_timesteps=10)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}

    def chunk(stream):
        return stream.push(torch.randint(0, 6561, (28,), generator=g).tolist())

    for label, extra in (("reference (original DiT, eager)", None),
                         ("original DiT + Whole-Euler graph (cfm_fused_body: false)", {"cfm_fused_body": False}),
                         ("fast path (knobs auto: fused + Whole-Euler graphs, TF32)", {})):
        choice = c2w.configure_fast_path(extra or {})
        if extra is None:
            c2w.flow.chunk_solver = None
        streams = [c2w.open_stream(feats) for _ in range(args.streams)]
        for s in streams:
            for _ in range(3):  # reach the steady cache (prompt + 100)
                chunk(s)
        one = statistics.median(timed(lambda: chunk(streams[0]), args.reps))
        rnd = statistics.median(timed(lambda: [chunk(s) for s in streams], max(3, args.reps // 3)))
        row = {"path": label, "choice": choice.describe(), "whole_chunk_ms_b1": one,
               "round_ms_16_streams": rnd, "rtf_16_streams": rnd / 1000.0}
        res["rows"].append(row)
        print(row, flush=True)
        for s in streams:
            s.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "code2wav_pipeline_h200.json").write_text(json.dumps(res, indent=2))
    lines = [f"# Code2Wav whole chunk and {args.streams} streams ({res['gpu']}, torch {res['torch']})", "",
             "Steady 1-s chunk = encoder + 10-step CFG flow + causal HiFT (eager vocoder), full-size random "
             "weights. RTF = seconds of compute per second of audio for all streams, one chunk each.", "",
             f"| path | whole chunk, 1 stream (ms) | round of {args.streams} streams (ms) | RTF ({args.streams} streams) |",
             "|---|---|---|---|"]
    lines += [f"| {r['path']} | {r['whole_chunk_ms_b1']:.1f} | {r['round_ms_16_streams']:.1f} | "
              f"{r['rtf_16_streams']:.3f} |" for r in res["rows"]]
    (args.out / "code2wav_pipeline_h200.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
