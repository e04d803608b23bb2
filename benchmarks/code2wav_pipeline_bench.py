"""Whole Code2Wav chunk on the GPU (encoder + CFM + HiFT) and 16 concurrent streams.

Full-size random weights, fp32, a 6-s voice prompt (150 tokens, 300 mel frames), steady
chunks of 28 codes (3 context + 25) once the caches sit at prompt + 100 frames. Rows:
reference path (original DiT, eager) and the fast path the knobs pick on CUDA (fused body +
Whole-Euler graphs, TF32 scoped to the DiT). 16 streams are pushed round-robin, one chunk
each per round; RTF = round time / 1 s of audio per stream. Each path also gets a "16 streams
batched" row: the round goes through ``Code2Wav.push_many``, so the 16 steady streams share
ONE encoder + flow solve (batch 16) and only the vocoding stays per stream.
Writes JSON + Markdown to --out. ``--tiny --device cpu`` is a smoke run of the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from minicpmo_rt.checkpoint.tiny import randomize_
from minicpmo_rt.code2wav import flow_config, hift
from minicpmo_rt.code2wav.flow import Flow
from minicpmo_rt.code2wav.frontend import PromptFeatures
from minicpmo_rt.code2wav.pipeline import Code2Wav
from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder, VocoderSet, build_generator


def timed(fn, n):
    out = []
    if not torch.cuda.is_available():
        for _ in range(n):
            t = time.perf_counter(); fn(); out.append(1000 * (time.perf_counter() - t))
        return out
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
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny flow/HiFT sizes (smoke run of the script)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    flow = Flow(flow_config.TINY if args.tiny else flow_config.FULL_SIZE)
    randomize_(flow, seed=1)
    gen = build_generator(CAUSAL, hift.TINY if args.tiny else hift.FULL_SIZE)
    randomize_(gen, seed=2)
    voc = Vocoder(gen.to(dev).eval(), CAUSAL)
    g = torch.Generator().manual_seed(0)
    feats = PromptFeatures(torch.randint(0, 6561, (1, 150), generator=g), torch.randn(1, 192, generator=g),
                           torch.randn(1, 300, 80, generator=g), 300, "bench")
    c2w = Code2Wav(flow.to(dev).eval(), VocoderSet(voc, voc), frontend=None, n_timesteps=10)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else f"{dev.type} (smoke run)"
    res = {"gpu": gpu, "torch": torch.__version__, "rows": []}

    def payload():
        return torch.randint(0, 6561, (28,), generator=g).tolist()

    def chunk(stream):
        return stream.push(payload())

    def batched_round(streams):
        return c2w.push_many([(s, payload(), False) for s in streams])

    def batched_vs_alone(n=4, rounds=4):
        """Max PCM rel err of push_many vs each stream pushed alone (same payloads, fresh streams)."""
        plans = [[payload() for _ in range(rounds)] for _ in range(n)]
        ones = [c2w.open_stream(feats) for _ in range(n)]
        alone = [[s.push(p) for p in plan] for s, plan in zip(ones, plans)]
        bs = [c2w.open_stream(feats) for _ in range(n)]
        both = [c2w.push_many([(s, plan[k], False) for s, plan in zip(bs, plans)]) for k in range(rounds)]
        for s in ones + bs:
            s.close()
        return max(float(np.linalg.norm(both[k][j] - alone[j][k]) / max(np.linalg.norm(alone[j][k]), 1e-30))
                   for j in range(n) for k in range(rounds))

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
        batched_round(streams)  # warm-up: captures the batch-16 graph on the fast paths
        rnd_b = statistics.median(timed(lambda: batched_round(streams), max(3, args.reps // 3)))
        row = {"path": f"{label}, {args.streams} streams batched (one solve per round)",
               "choice": choice.describe(), "whole_chunk_ms_b1": None,
               "round_ms_16_streams": rnd_b, "rtf_16_streams": rnd_b / 1000.0,
               "pcm_rel_err_batched_vs_alone": batched_vs_alone()}
        res["rows"].append(row)
        print(row, flush=True)
        for s in streams:
            s.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "code2wav_pipeline_h200.json").write_text(json.dumps(res, indent=2))
    lines = [f"# Code2Wav whole chunk and {args.streams} streams ({res['gpu']}, torch {res['torch']})", "",
             "Steady 1-s chunk = encoder + 10-step CFG flow + causal HiFT (eager vocoder), full-size random "
             "weights. RTF = seconds of compute per second of audio for all streams, one chunk each.", "",
             f"| path | whole chunk, 1 stream (ms) | round of {args.streams} streams (ms) | RTF ({args.streams} streams) "
             "| PCM rel err batched vs alone |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['path']} | {'-' if r['whole_chunk_ms_b1'] is None else format(r['whole_chunk_ms_b1'], '.1f')} | "
              f"{r['round_ms_16_streams']:.1f} | "
              f"{r['rtf_16_streams']:.3f} | {format(r['pcm_rel_err_batched_vs_alone'], '.1e') if 'pcm_rel_err_batched_vs_alone' in r else '-'} |"
              for r in res["rows"]]
    (args.out / "code2wav_pipeline_h200.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
