"""Whole Code2Wav chunk on the GPU (encoder + CFM + HiFT) and 16 concurrent streams.

Full-size random weights, fp32, a 6-s voice prompt (150 tokens, 300 mel frames), steady
chunks of 28 codes (3 context + 25) once the caches sit at prompt + 100 frames. Rows:
reference path (original DiT, eager) and the fast path the knobs pick on CUDA (fused body +
Whole-Euler graphs, TF32 scoped to the DiT). 16 streams are pushed round-robin, one chunk
each per round; RTF = round time / 1 s of audio per stream. Each path also gets a "16 streams
batched" row: the round goes through ``Code2Wav.push_many``, so the 16 steady streams share
ONE encoder + flow solve (batch 16) while the vocoding stays per stream and eager (the old path,
``batch_vocoding=False``), and a "+ HiFT batched" row where ``push_many`` also vocodes the 16
streams through batched HiFT calls, replayed from CUDA graphs (``GraphedHiFT``; eager off CUDA).
A vocoder-only table times one steady 1-s chunk (50 mel frames) of every stream: per stream
eager (the old path), per stream graphed, batched eager, batched graphed.
The "+ slot pool" path is the fast path with the opt-in slot pool (``cfm_slot_pool``): every stream's
estimator cache resident in a slot, so a round neither stacks, copies, splits nor trims those caches.
Every row prints which vocoder path ran. Writes JSON + Markdown to --out.
``--tiny --device cpu`` is a smoke run of the script itself.
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
from minicpmo_rt.code2wav import bulk_copy
from minicpmo_rt.code2wav.encoder import EncoderCache
from minicpmo_rt.code2wav.flow import Flow, split_flow_cache, stack_flow_caches
from minicpmo_rt.code2wav.frontend import PromptFeatures
from minicpmo_rt.code2wav.pipeline import Code2Wav
from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder, VocoderSet, build_generator

CHUNK_FRAMES = 50  # mel frames of a steady 1-s chunk (25 codes)
ARENA_PATH = "fast path, arena solves (direct off)"   # the knobs-auto path as it ran before the direct solves
PTR_PATH = "fast path, direct solves on pointer loads"   # session 14's direct attention (no TMA descriptors)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


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


def bench_device(script: str, device: str) -> torch.device:
    """``--device`` as a torch device; a clear exit where it names CUDA and torch sees none."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{script}: --device cuda but torch sees no CUDA device; run it on the GPU machine, or pass "
                         "--tiny --device cpu for a smoke run of the script")
    return dev


def parse_batches(ap, text: str) -> list[int]:
    """A ``--batches`` value ("1,4,16") as batch sizes >= 1; a parser error naming it otherwise."""
    try:
        batches = [int(b) for b in text.split(",")]
    except ValueError:
        ap.error(f"--batches must be comma-separated integers, got {text!r}")
    if not batches or min(batches) < 1:
        ap.error(f"--batches must be >= 1, got {text!r}")
    return batches


def device_label(dev: torch.device) -> str:
    """The GPU's name for a results file, or what a CPU smoke run was."""
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{dev.type} (smoke run)"


def bench_models(tiny: bool, dev: torch.device):
    """Random flow (seed 1) and causal HiFT (seed 2), full size or ``tiny``, on ``dev`` in eval mode, and a
    random 6-s voice prompt (150 tokens, 300 mel frames) -> (flow, generator, prompt features, the
    ``torch.Generator`` that drew the prompt; callers draw their payloads from it next)."""
    torch.manual_seed(0)
    flow = Flow(flow_config.TINY if tiny else flow_config.FULL_SIZE)
    randomize_(flow, seed=1)
    gen = build_generator(CAUSAL, hift.TINY if tiny else hift.FULL_SIZE)
    randomize_(gen, seed=2)
    g = torch.Generator().manual_seed(0)
    feats = PromptFeatures(torch.randint(0, 6561, (1, 150), generator=g), torch.randn(1, 192, generator=g),
                           torch.randn(1, 300, 80, generator=g), 300, "bench")
    return flow.to(dev).eval(), gen.to(dev).eval(), feats, g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny flow/HiFT sizes (smoke run of the script)")
    ap.add_argument("--paths", default="", help="'|'-separated substrings: only the paths whose labels hold one "
                    "(default: all), e.g. 'fast path'")
    ap.add_argument("--skip-vocoder", action="store_true", help="skip the HiFT-alone table")
    ap.add_argument("--flow-many", action="store_true", help="on the fast path: the flow half of a batched round, "
                    "stacked caches against inference_chunk_many; the encoder half eager against its graphs")
    args = ap.parse_args()
    dev = torch.device(args.device)
    flow, gen, feats, g = bench_models(args.tiny, dev)
    # One model, two stream vocoders: the old per-stream eager path and the graphed one
    # (GraphedHiFT on CUDA; off CUDA it stays eager and the rows say so).
    voc = Vocoder(gen, CAUSAL, cuda_graphs=False)
    voc_fast = Vocoder(gen, CAUSAL)
    c2w = Code2Wav(flow, VocoderSet(voc, voc), frontend=None, n_timesteps=10)
    # shares the flow, so c2w.configure_fast_path (which installs flow.chunk_solver) applies to both
    c2w_fast = Code2Wav(flow, VocoderSet(voc_fast, voc_fast), frontend=None, n_timesteps=10)
    gpu = device_label(dev)
    res = {"gpu": gpu, "torch": torch.__version__, "streams": args.streams, "rows": [], "vocoder_rows": []}
    print(f"vocoder paths: old = {voc.describe_stream_path()}; new = {voc_fast.describe_stream_path()} "
          "(batched through Vocoder.push_many)", flush=True)

    def payload():
        return torch.randint(0, 6561, (28,), generator=g).tolist()

    def chunk(stream):
        return stream.push(payload())

    def batched_round(owner, streams, batch_vocoding):
        return owner.push_many([(s, payload(), False) for s in streams], batch_vocoding=batch_vocoding)

    def batched_vs_alone(owner, batch_vocoding, n=4, rounds=4):
        """Max PCM rel err of ``owner.push_many`` vs each stream pushed alone through the old path
        (eager vocoder; same payloads, fresh streams)."""
        plans = [[payload() for _ in range(rounds)] for _ in range(n)]
        ones = [c2w.open_stream(feats) for _ in range(n)]
        alone = [[s.push(p) for p in plan] for s, plan in zip(ones, plans)]
        bs = [owner.open_stream(feats) for _ in range(n)]
        both = [owner.push_many([(s, plan[k], False) for s, plan in zip(bs, plans)], batch_vocoding=batch_vocoding)
                for k in range(rounds)]
        for s in ones + bs:
            s.close()
        return max(float(np.linalg.norm(both[k][j] - alone[j][k]) / max(np.linalg.norm(alone[j][k]), 1e-30))
                   for j in range(n) for k in range(rounds))

    def add(row):
        row["ms_per_1s_chunk"] = row["round_ms_16_streams"] / args.streams
        res["rows"].append(row)
        print(row, flush=True)
        args.out.mkdir(parents=True, exist_ok=True)   # after every row, so a cut-off run keeps its numbers
        (args.out / "code2wav_pipeline_h200.json").write_text(json.dumps(res, indent=2))

    paths = (("reference (original DiT, eager)", None),
             ("original DiT + Whole-Euler graph (cfm_fused_body: false)", {"cfm_fused_body": False}),
             ("fast path (knobs auto: fused + Whole-Euler graphs, TF32)", {}),
             # FP16 operands are the auto default where the weights' range certificate fits: this is the old default
             ("fast path, FP32 operands (cfm_fp16_operands: false)", {"cfm_fp16_operands": False}),
             (ARENA_PATH, {}),
             (PTR_PATH, {}),
             (f"fast path + slot pool (cfm_slot_pool: {args.streams})", {"cfm_slot_pool": args.streams}),
             ("fast path, FP16 operands (cfm_fp16_operands: true)", {"cfm_fp16_operands": True}),
             (f"fast path + slot pool, FP16 operands (cfm_slot_pool: {args.streams}, cfm_fp16_operands: true)",
              {"cfm_slot_pool": args.streams, "cfm_fp16_operands": True}))
    for label, extra in paths:
        if args.paths and not any(w in label for w in args.paths.split("|")):
            continue
        choice = c2w.configure_fast_path(extra or {})
        c2w_fast.configure_fast_path(extra or {})    # the same knobs (its slot pool, if any, is its own)
        for solver in (c2w.flow.chunk_solver, c2w_fast.flow.chunk_solver):
            if solver is None:
                continue
            if label == ARENA_PATH:                  # the solves before the direct path: copy in, trim out
                solver.direct = False
            if label == PTR_PATH and solver.fused is not None:
                solver.fused.direct_tma = False
        if extra is None:
            c2w.flow.chunk_solver = None
        streams = [c2w.open_stream(feats) for _ in range(args.streams)]
        for s in streams:
            for _ in range(3):  # reach the steady cache (prompt + 100)
                chunk(s)
        one = statistics.median(timed(lambda: chunk(streams[0]), args.reps))
        rnd = statistics.median(timed(lambda: [chunk(s) for s in streams], max(3, args.reps // 3)))
        add({"path": label, "choice": choice.describe(), "vocoder": voc.describe_stream_path() + ", per stream",
             "whole_chunk_ms_b1": one, "round_ms_16_streams": rnd, "rtf_16_streams": rnd / 1000.0})
        if args.flow_many and extra == {} and label not in (ARENA_PATH, PTR_PATH):
            flow_many_rows(res, c2w.flow, streams, g, args.reps)
        batched_round(c2w, streams, False)  # warm-up: captures the batch-16 graph on the fast paths
        rnd_b = statistics.median(timed(lambda: batched_round(c2w, streams, False), max(3, args.reps // 3)))
        add({"path": f"{label}, {args.streams} streams batched (one solve per round)",
             "choice": choice.describe(), "vocoder": voc.describe_stream_path() + ", per stream",
             "whole_chunk_ms_b1": None, "round_ms_16_streams": rnd_b, "rtf_16_streams": rnd_b / 1000.0,
             "pcm_rel_err_batched_vs_alone": batched_vs_alone(c2w, False)})
        for s in streams:
            s.close()
        fast = [c2w_fast.open_stream(feats) for _ in range(args.streams)]
        for _ in range(6):  # steady cache (3 rounds), then HiFT graphs captured (a length on its 2nd call)
            batched_round(c2w_fast, fast, True)
        rnd_v = statistics.median(timed(lambda: batched_round(c2w_fast, fast, True), max(3, args.reps // 3)))
        for _ in range(3):  # one stream alone: its batch-1 shapes (HiFT graphs on a shape's 2nd call)
            chunk(fast[0])
        one_v = statistics.median(timed(lambda: chunk(fast[0]), args.reps))
        add({"path": f"{label}, {args.streams} streams batched + HiFT batched",
             "choice": choice.describe(), "vocoder": voc_fast.describe_stream_path() + ", batched",
             "whole_chunk_ms_b1": one_v, "whole_chunk_vocoder_b1": voc_fast.describe_stream_path() + ", per stream",
             "round_ms_16_streams": rnd_v, "rtf_16_streams": rnd_v / 1000.0,
             "pcm_rel_err_batched_vs_alone": batched_vs_alone(c2w_fast, True)})
        for s in fast:
            s.close()

    if not args.skip_vocoder:
        vocoder_rows(res, voc, voc_fast, args, dev)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "code2wav_pipeline_h200.json").write_text(json.dumps(res, indent=2))
    n = args.streams
    lines = [f"# Code2Wav whole chunk and {n} streams ({res['gpu']}, torch {res['torch']})", "",
             "Steady 1-s chunk = encoder + 10-step CFG flow + causal HiFT, full-size random weights (weight "
             "norm not fused). RTF = seconds of compute per second of audio for all streams, one chunk each; "
             f"per 1-s chunk = round / {n}. Vocoder column: the HiFT path that ran (eager per stream = the "
             "old path; batched = Vocoder.push_many, from CUDA graphs where it says so). PCM rel err is "
             "against each stream pushed alone through the old path. The whole chunk of a '+ HiFT batched' row "
             "is one stream pushed alone with the graphed vocoder (its batch-1 graphs).", "",
             f"| path | vocoder | whole chunk, 1 stream (ms) | round of {n} streams (ms) | per 1-s chunk (ms) "
             f"| RTF ({n} streams) | PCM rel err batched vs alone |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['path']} | {r['vocoder']} | "
              f"{'-' if r['whole_chunk_ms_b1'] is None else format(r['whole_chunk_ms_b1'], '.1f')} | "
              f"{r['round_ms_16_streams']:.1f} | {r['ms_per_1s_chunk']:.1f} | {r['rtf_16_streams']:.3f} | "
              f"{format(r['pcm_rel_err_batched_vs_alone'], '.1e') if 'pcm_rel_err_batched_vs_alone' in r else '-'} |"
              for r in res["rows"]]
    if res["vocoder_rows"]:   # none with --skip-vocoder
        lines += ["", f"## HiFT alone: one steady 1-s chunk ({CHUNK_FRAMES} mel frames) for each of {n} streams", "",
                  f"| vocoding | path that ran | round of {n} streams (ms) | per 1-s chunk (ms) | RTF ({n} streams) "
                  "| PCM rel err vs per-stream eager |",
                  "|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['vocoder']} | {r['round_ms']:.2f} | {r['ms_per_1s_chunk']:.2f} | {r['rtf']:.4f} | "
              f"{'-' if r['pcm_rel_err_vs_eager'] is None else format(r['pcm_rel_err_vs_eager'], '.1e')} |"
              for r in res["vocoder_rows"]]
    if "flow_many" in res:
        fm = res["flow_many"]
        lines += ["", f"## The flow half of a batched round ({fm['streams']} steady streams, GPU ms, medians)", "",
                  f"Stack + split vs many through the arena bit-identical: {fm['bit_identical']}; direct vs arena "
                  f"rel err: {', '.join(f'{k} {v:.1e}' for k, v in fm.get('direct_vs_arena_rel_err', {}).items())}.",
                  "", "| path | ms |", "|---|---:|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in fm["ms"].items()]
    if res.get("encoder"):
        lines += ["", "## The encoder half of a chunk (embedding, conformer, projection), GPU ms, medians", "",
                  "| streams | eager | CUDA graph | bit-identical |", "|---:|---:|---:|---|"]
        lines += [f"| {r['streams']} | {r['ms']['eager']:.2f} | {r['ms']['graphed']:.2f} | {r['bit_identical']} |"
                  for r in res["encoder"]]
    (args.out / "code2wav_pipeline_h200.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def flow_many_rows(res: dict, flow: Flow, streams, g: torch.Generator, reps: int) -> None:
    """The flow half of a batched round (16 steady streams, the same 28 codes each time): the caches
    stacked, one ``inference_chunk`` and the new cache split per stream (the path before
    ``inference_chunk_many``) against ``inference_chunk_many`` with its solver on the direct path (each
    stream's estimator cache read in place, the trimmed successor written by the attention) and through
    the arena (each cache copied into the solver's rows, the successor trimmed out of them), alternating.
    Stacked vs arena is compared bit for bit, direct vs arena by relative error (another key order)."""
    caches = [s.cache for s in streams]
    n = len(caches)
    spk = torch.cat([s.spk for s in streams])
    toks = torch.randint(0, 6561, (n, 28), generator=g).to(spk.device)

    def stacked():
        mel, new = flow.inference_chunk(toks, spk, stack_flow_caches(caches))
        return mel, split_flow_cache(new, [1] * n)

    solver = flow.chunk_solver

    def with_direct(direct, fn):        # the solver's direct switch for one call (no solver: the reference)
        if solver is None:
            return fn()
        was, solver.direct = solver.direct, direct
        try:
            return fn()
        finally:
            solver.direct = was

    def many(direct=None):
        return with_direct(direct, lambda: flow.inference_chunk_many(toks, spk, caches))

    keys = ("conformer_cnn", "conformer_att", "estimator_cnn", "estimator_att")
    # the stacked form's own solve through the arena too, so that it can match bit for bit
    (m1, c1), (m2, c2), (m3, c3) = with_direct(False, stacked), many(False), many(None)
    same = torch.equal(m1, m2) and all(torch.equal(getattr(a, k), getattr(b, k)) for a, b in zip(c1, c2) for k in keys)
    errs = {"mel": _rel(m3, m2), "estimator_att": max(_rel(a.estimator_att, b.estimator_att) for a, b in zip(c3, c2))}
    del m1, c1, m2, c2, m3, c3
    times = {"stack, inference_chunk, split": [], "inference_chunk_many, arena": [], "inference_chunk_many, direct": []}
    for _ in range(3):
        times["stack, inference_chunk, split"] += timed(lambda: with_direct(False, stacked), reps)
        times["inference_chunk_many, arena"] += timed(lambda: many(False), reps)
        times["inference_chunk_many, direct"] += timed(many, reps)
    res["flow_many"] = {"streams": n, "bit_identical": same, "direct_vs_arena_rel_err": errs,
                        "ms": {k: statistics.median(v) for k, v in times.items()}, "reps": {k: len(v) for k, v in times.items()}}
    print(f"flow chunk of {n} streams: {res['flow_many']}", flush=True)
    # the encoder half alone: eager against its CUDA graphs (Flow.encoder_graphs), 1 and n streams
    graphs = flow.encoder_graphs
    rows = res["encoder"] = []
    for b in (1, n):
        enc = EncoderCache(bulk_copy.cat([c.conformer_cnn for c in caches[:b]], 0),
                           bulk_copy.cat([c.conformer_att for c in caches[:b]], 1))

        def encode(use):
            flow.encoder_graphs = use
            try:
                return flow.encode_chunk(toks[:b], spk[:b], enc)
            finally:
                flow.encoder_graphs = graphs

        if graphs is None:
            break
        encode(graphs)                      # a shape's first call runs eagerly; its second captures
        a, c = encode(None), encode(graphs)
        same = torch.equal(a[0], c[0]) and torch.equal(a[2].att, c[2].att) and torch.equal(a[2].cnn, c[2].cnn)
        t = {"eager": [], "graphed": []}
        for _ in range(3):
            t["eager"] += timed(lambda: encode(None), reps)
            t["graphed"] += timed(lambda: encode(graphs), reps)
        rows.append({"streams": b, "bit_identical": same, "ms": {k: statistics.median(v) for k, v in t.items()}})
        print(f"encoder half, {b} stream(s): {rows[-1]}", flush=True)


def vocoder_rows(res: dict, voc: Vocoder, voc_fast: Vocoder, args, dev: torch.device) -> None:
    """HiFT alone at the steady state: each stream has had 3 chunks (full history), then every
    timed round pushes one 50-frame chunk into each stream. Per-stream rows call ``push`` stream by
    stream; batched rows call ``Vocoder.push_many`` once per round. Every mode replays the same
    chunk sequence from the same starting state, so their outputs are compared directly."""
    n = args.streams
    g = torch.Generator().manual_seed(5)
    warm = [torch.randn(n, 80, CHUNK_FRAMES, generator=g).to(dev) - 5 for _ in range(3)]
    rounds = max(3, args.reps // 3)
    timed_mels = [torch.randn(n, 80, CHUNK_FRAMES, generator=g).to(dev) - 5 for _ in range(rounds + 3)]

    def run(v: Vocoder, batched: bool) -> tuple[list[float], list[torch.Tensor]]:
        streams = [v.open_stream() for _ in range(n)]
        mels = iter(warm + timed_mels)
        outs: list[torch.Tensor] = []

        def one_round():
            mel = next(mels)
            if batched:
                outs.extend(v.push_many([(s, mel[i:i + 1], False) for i, s in enumerate(streams)]))
            else:
                outs.extend(s.push(mel[i:i + 1]) for i, s in enumerate(streams))

        for _ in range(len(warm) + 3):  # steady history; graphs captured (a length on its 2nd call)
            one_round()
        ms = timed(one_round, rounds)
        return ms, outs

    ref_ms, ref = run(voc, False)
    for mode, v, batched in (("per stream, eager (old path)", voc, False), ("per stream, graphed", voc_fast, False),
                             ("batched, eager", voc, True), ("batched, graphed", voc_fast, True)):
        ms, outs = (ref_ms, ref) if (v is voc and not batched) else run(v, batched)
        err = None if outs is ref else max(_rel(a, b) for a, b in zip(outs, ref))
        rnd = statistics.median(ms)
        row = {"mode": mode, "vocoder": v.describe_stream_path(), "round_ms": rnd, "ms_per_1s_chunk": rnd / n,
               "rtf": rnd / 1000.0, "pcm_rel_err_vs_eager": err}
        res["vocoder_rows"].append(row)
        print(row, flush=True)


if __name__ == "__main__":
    main()
