"""Turn mode end to end, per deploy profile: N concurrent spoken turns, Thinker -> Talker -> Code2Wav.

Seed 000 asks for new end-to-end measurements of the two turn profiles (generic MRv2: Talker capacity 8,
2 GiB KV; ``minicpmo_4_5_turn_mrv2_h200``: capacity 16, 4 GiB) on the revised codec backend. This runs
N requests through ``TurnPipeline.run`` per profile, full-size random weights (Thinker and Talker bf16,
Code2Wav FP32 with each profile's Code2Wav knobs, its graphs prepared for the voice), and two forms of
the pipeline side by side in one process:

- ``before``: the pipeline before session 44: the Talker's decode step eager, attending over the whole
  static cache (the profiles' 4096 positions per slot) every step; each Code2Wav chunk pushed into its
  own stream;
- ``talker-graphs``: the Talker's step over the shortest key bucket, replayed from CUDA graphs (one per
  bucket); Code2Wav still per stream;
- ``batched``: that, and each Talker step's chunks sent to Code2Wav as one ``push_many``;
- ``thinker-rows``: that, and the Thinker decoding up to the Talker's capacity of requests together on
  the rows of one static decoder (``TurnPipeline.think_rows``: one forward, a CUDA graph, per step for
  every live request; a request takes a row as soon as one frees), each row drawing its token on its own
  (``Generation.draw``: three waits on the device per row and step);
- ``batched-draws``: that, and every row's token drawn in one batch (``thinker.generate.draw_many``: the
  same tokens, one wait on the device per step);
- ``batched-prefill``: that, and the prompts admitted together prefilled in one forward, in the Thinker's
  rows (``StaticRows.prefill_many``) and in the Talker's slots (``TalkerEngine._prefill_many``), instead of
  one forward per request;
- ``talker-kernels``: that, and the Talker's decode step through the Thinker's fused Triton kernels (packed
  QKV and gate/up GEMMs, fused residual + RMSNorm, RoPE + cache write, split-KV attention at each slot's
  device-side position: about ten launches a layer instead of ~35, one graph for every position). The
  pipeline's default now.
- ``overlap`` (opt-in, ``overlap_stages``): that, and each request entering the Talker as soon as its text is
  done, the Talker stepping once per Thinker decode step meanwhile. With equal answers it can only help where
  N exceeds the Thinker's rows; on the H200 (session 45) it measured the same as without it.

Every request is made to answer with exactly ``--tokens`` text tokens (``duplex_bench._Speak`` lifts an
ordinary text id over each row, so no terminator comes early) and exactly ``--codes`` codes (the Talker's
EOS is held off until then), so every form does the same work. Measured per run: the wall time of all N
turns, each request's time to its first PCM chunk (all Thinker work runs before the Talker starts, so it
grows with N), the audio produced and its rate against the wall time, and the time inside the Talker's
steps and Code2Wav's pushes (synchronised around each call; the Thinker is the rest).

    python benchmarks/turn_bench.py OUT                                  # GPU: both profiles, N = 1, 8, 16
    python benchmarks/turn_bench.py OUT --tiny --requests 1,2 --tokens 4 --codes 30    # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from minicpmo_rt.checkpoint.tokenizer import load_tokenizer, vendored_tokenizer_dir
from minicpmo_rt.code2wav.pipeline import Code2Wav
from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder, VocoderSet
from minicpmo_rt.profiles import load_profile
from minicpmo_rt.runtime.contracts import TurnRequest
from minicpmo_rt.runtime.turn import SAMPLES_PER_CODE, TurnPipeline
from minicpmo_rt.talker.engine import TalkerEngine
from minicpmo_rt.talker.sampler import SamplingParams
from minicpmo_rt.thinker.decode import StaticDecoder
from minicpmo_rt.thinker.llm_cache import StaticRows

from code2wav_pipeline_bench import bench_models, device_label, parse_batches
from duplex_batch_bench import Clock, profile_text
from duplex_bench import build, sync

PROFILES = ("minicpmo_4_5_turn_mrv2", "minicpmo_4_5_turn_mrv2_h200")
THINKER_LEN = 2048     # positions of the Thinker's static cache per request
FORMS = ("before", "talker-graphs", "batched", "thinker-rows", "batched-draws", "batched-prefill", "talker-kernels",
         "overlap")
ROW_FORMS = ("thinker-rows", "batched-draws", "batched-prefill", "talker-kernels", "overlap")
QUESTIONS = ("What is the weather like today?", "Tell me a short story about a fox.",
             "How do I make a cup of tea?", "Why is the sky blue?")


def pipeline(profile: str, form: str, parts, dev: torch.device, codes: int, shared: dict) -> TurnPipeline:
    """One profile's pipeline on shared models (the Thinker's static decoder and each Code2Wav setting are
    built once in ``shared``); the form picks the Talker's key spans and graphs and Code2Wav's batching."""
    thinker, tok, tts, flow, gen, feats = parts
    prof = load_profile(profile)
    cuda = dev.type == "cuda"
    fused = form in ("talker-kernels", "overlap")      # the Talker's fused decode step ("auto": on CUDA)
    engine = TalkerEngine(tts, prof.talker.capacity, prof.talker.kv_cache_bytes,
                          SamplingParams(min_codes=codes, max_codes=codes), prof.talker.window,
                          prof.talker.first_window, kernels="auto" if fused else "torch")
    if form == "before":
        engine.buckets = (engine.max_len,)      # every step over the whole cache, as before the buckets
    elif cuda:
        engine.capture_cuda_graph()
    key = (prof.code2wav.n_timesteps, json.dumps(prof.code2wav.extra, sort_keys=True, default=str))
    if key not in shared:
        voc = Vocoder(gen, CAUSAL)
        c2w = Code2Wav(flow, VocoderSet(voc, voc), frontend=None, n_timesteps=prof.code2wav.n_timesteps)
        c2w.configure_fast_path(prof.code2wav.extra)
        if cuda:
            c2w.prepare(feats)
        shared[key] = c2w
    if "decoder" not in shared:
        shared["decoder"] = StaticDecoder(thinker.llm, THINKER_LEN) if cuda else None
    rows = None
    if form in ROW_FORMS:
        if ("rows", engine.capacity) not in shared:
            shared["rows", engine.capacity] = StaticRows(thinker, engine.capacity, THINKER_LEN,
                                                         kernels="auto" if cuda else "torch")
        rows = shared["rows", engine.capacity]
    pipe = TurnPipeline(thinker, tok, engine, shared[key], prof, decoder=shared["decoder"], use_graph=cuda,
                        batch_code2wav=form in ("batched",) + ROW_FORMS, rows=rows, overlap_stages=form == "overlap")
    pipe.batched_draws = form != "thinker-rows"
    # one prefill per request in the Thinker's rows and the Talker's slots up to batched-draws
    pipe.batched_prefill = engine.batched_prefill = form in ("batched-prefill", "talker-kernels", "overlap")
    return pipe


def run(pipe: TurnPipeline, n: int, voice, tokens: int, codes: int, dev: torch.device, tag: str) -> dict:
    reqs = [TurnRequest.make(f"{tag}-{i}", QUESTIONS[i % len(QUESTIONS)], voice, seed=i, max_new_tokens=tokens,
                             max_codes=codes) for i in range(n)]
    clock = Clock(dev)
    clock.wrap(pipe.talker, "step", "talker")
    # Code2Wav: push_many, and each stream's own push (the forms without push_many; push_many never calls it)
    clock.wrap(pipe.code2wav, "push_many", "code2wav")
    open_stream = pipe.code2wav.open_stream

    def opened(v):
        stream = open_stream(v)
        clock.wrap(stream, "push", "code2wav")
        return stream

    clock.patch(pipe.code2wav, "open_stream", opened)
    first: dict[str, float] = {}
    samples = 0
    try:
        sync(dev)
        t0 = time.perf_counter()
        for pcm in pipe.run(reqs):
            if pcm.request_id not in first:
                first[pcm.request_id] = (time.perf_counter() - t0) * 1e3
            samples += len(pcm.samples)
        sync(dev)
        wall = (time.perf_counter() - t0) * 1e3
    finally:
        clock.restore()
    audio_s = samples / 24000.0
    ttfa = sorted(first.values())
    talker, code2wav = clock.ms.get("talker", 0.0), clock.ms.get("code2wav", 0.0)
    return {"n": n, "wall_ms": wall, "ttfa_ms_first": ttfa[0], "ttfa_ms_median": statistics.median(ttfa),
            "ttfa_ms_last": ttfa[-1], "audio_s": audio_s, "x_real_time": audio_s / (wall / 1e3),
            "talker_ms": talker, "code2wav_ms": code2wav, "thinker_ms": wall - talker - code2wav,
            "expected_audio_s": n * codes * SAMPLES_PER_CODE / 24000.0}


def profile_run(pipe: TurnPipeline, n: int, voice, args, dev: torch.device, path: Path) -> None:
    """One more run of ``n`` turns under cProfile; the functions by own and by cumulative time. On CUDA the
    host's waits on the device show up as time inside the calls that wait (``tolist``, ``item``, syncs)."""
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    row = run(pipe, n, voice, args.tokens, args.codes, dev, f"cprofile-{n}")
    prof.disable()
    path.write_text(profile_text(prof, f"N={n}: wall {row['wall_ms']:.0f} ms under cProfile (Thinker "
                                       f"{row['thinker_ms']:.0f}, Talker {row['talker_ms']:.0f}, Code2Wav "
                                       f"{row['code2wav_ms']:.0f} ms)\n"))
    print(f"cProfile of {n} turns: {path}", flush=True)


def write_table(res: dict, path: Path) -> None:
    lines = [f"# Turn mode end to end per profile ({res['gpu']}, Thinker/Talker {res['dtype']}, "
             f"{'tiny' if res['tiny'] else 'full-size'} random weights, torch {res['torch']})", "",
             f"N concurrent turns through `TurnPipeline.run`, each answering with {res['tokens']} text tokens and "
             f"{res['codes']} codes ({res['codes'] * SAMPLES_PER_CODE / 24000:.1f} s of audio); each row is the run "
             f"of median wall time out of {res.get('repeat', 1)}, "
             + {"bench": "after warm-up runs per pipeline (each N, full-length answers of short text)",
                "warm_up": "after the pipeline's own `TurnPipeline.warm_up` at each N (ms: " + json.dumps(
                    {k: {n: round(t) for n, t in v.items()} for k, v in res.get("warm_up_ms", {}).items()}) + ")",
                "none": "with no warm-up: the first runs pay every capture and compile"}[res.get("startup", "bench")]
             + ". Time to first audio "
             "(TTFA) is from the call to each request's first PCM chunk. Stage columns: time inside the Talker's "
             "steps and Code2Wav's pushes (synchronised around each call); the Thinker is the rest. `before`: eager "
             "Talker step over the whole 4096-position cache, one Code2Wav push per chunk; `talker-graphs`: Talker "
             "step over the shortest key bucket from CUDA graphs; `batched`: that, and each step's chunks in one "
             "`push_many`; `thinker-rows`: that, and the Thinker decoding up to the Talker's capacity of requests "
             "together on one static decoder's rows, each row drawing its token alone; `batched-draws`: that, and every "
             "row's token drawn in one batch; `batched-prefill`: that, and the prompts admitted together prefilled in "
             "one forward in the Thinker's rows and the Talker's slots; `talker-kernels`: that, and the Talker's decode "
             "step through fused Triton kernels (the default now); `overlap`: that, and each request entering the "
             "Talker as soon as its text is done (opt-in).", "",
             "| profile | capacity / KV | N | form | wall ms | TTFA first / median / last ms | audio s | x real time "
             "| Thinker ms | Talker ms | Code2Wav ms | x before |",
             "|---|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    base = {(r["profile"], r["n"]): r["wall_ms"] for r in res["rows"] if r["form"] == "before"}
    for r in sorted(res["rows"], key=lambda r: (r["profile"], r["n"], FORMS.index(r["form"]))):
        key = (r["profile"], r["n"])
        ratio = f"{base[key] / r['wall_ms']:.2f}" if r["form"] != "before" and key in base else "-"
        lines.append(f"| {r['profile']} | {r['capacity']} / {r['kv']} | {r['n']} | {r['form']} | {r['wall_ms']:.0f} | "
                     f"{r['ttfa_ms_first']:.0f} / {r['ttfa_ms_median']:.0f} / {r['ttfa_ms_last']:.0f} | "
                     f"{r['audio_s']:.1f} | {r['x_real_time']:.2f} | {r['thinker_ms']:.0f} | {r['talker_ms']:.0f} | "
                     f"{r['code2wav_ms']:.0f} | {ratio} |")
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (a check of the script)")
    ap.add_argument("--requests", default="1,8,16", help="N concurrent turns per run")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--tokens", type=int, default=24, help="text tokens per answer")
    ap.add_argument("--codes", type=int, default=100, help="codes per answer (25 per second of audio)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row; the row is the run of median wall time")
    ap.add_argument("--startup", choices=("bench", "warm_up", "none"), default="bench",
                    help="before each pipeline's timed runs: 'bench', short answers at each N (the default); "
                         "'warm_up', TurnPipeline.warm_up(voice, batches=N...); 'none', nothing (the first runs "
                         "pay every capture and compile: run it with --repeat 1 in a fresh process)")
    ap.add_argument("--table", type=Path, help="only rewrite OUT/turn_bench.md from this run's JSON")
    ap.add_argument("--cprofile", metavar="FORM", help="after FORM's timed rows, one more run at the largest N "
                    "under cProfile: OUT/turn_bench_cprofile_{profile}_{FORM}.txt (where the host's time goes)")
    args = ap.parse_args()
    if args.table:
        args.out.mkdir(parents=True, exist_ok=True)
        return write_table(json.loads(args.table.read_text()), args.out / "turn_bench.md")
    ns = parse_batches(ap, args.requests)
    profiles = [p for p in args.profiles.split(",") if p]
    forms = [f for f in args.forms.split(",") if f]
    if set(forms) - set(FORMS):
        ap.error(f"--forms: choose from {', '.join(FORMS)} (got {args.forms!r})")
    if args.cprofile is not None and args.cprofile not in forms:
        ap.error(f"--cprofile: {args.cprofile!r} is not one of the forms run ({', '.join(forms)})")
    for name in profiles:
        if load_profile(name).mode != "turn":
            ap.error(f"--profiles: {name!r} is not a turn-mode profile")
    if args.tokens < 1 or args.codes < 1 or args.repeat < 1:
        ap.error("--tokens, --codes and --repeat must be positive")
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tok = load_tokenizer(vendored_tokenizer_dir())
    thinker, tts = build(args.tiny, dev, dtype)
    flow, gen, feats, _ = bench_models(args.tiny, dev)
    parts = (thinker, tok, tts, flow, gen, feats)
    res = {"gpu": device_label(dev), "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
           "tiny": args.tiny, "tokens": args.tokens, "codes": args.codes, "repeat": args.repeat,
           "startup": args.startup, "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    shared: dict = {}
    for name in profiles:
        prof = load_profile(name)
        for form in forms:
            pipe = pipeline(name, form, parts, dev, args.codes, shared)
            # captures and compiles at every batch and cache length the runs will see (Code2Wav's graphs are
            # shared by the forms and keyed by batch and cache length, so the first form to meet one would pay
            # its capture; session 44's runs warmed with 60-code answers and the batched form paid them at
            # N = 8 and 16): each N, full-length answers of short text
            if args.startup == "bench":
                for n in ns:
                    run(pipe, n, feats, min(2, args.tokens), args.codes, dev, f"warm{n}")
            elif args.startup == "warm_up":     # the pipeline's own start-up call, at the sizes the runs use
                res.setdefault("warm_up_ms", {})[f"{name} {form}"] = pipe.warm_up(feats, batches=ns)
            for n in ns:
                # the run of median wall time out of --repeat (a single run moved by up to ~15% between two
                # forms that do the same work, session 45)
                runs = sorted((run(pipe, n, feats, args.tokens, args.codes, dev, f"{form}-{n}-{k}")
                               for k in range(args.repeat)), key=lambda r: r["wall_ms"])
                row = runs[len(runs) // 2]
                row["wall_ms_runs"] = [r["wall_ms"] for r in runs]
                if abs(row["audio_s"] - row["expected_audio_s"]) > 1e-6:
                    raise RuntimeError(f"{name} {form} N={n}: {row['audio_s']} s of audio, expected "
                                       f"{row['expected_audio_s']} (every answer must do the same work)")
                row.update(profile=name, form=form, capacity=pipe.talker.capacity,
                           kv=f"{prof.talker.kv_cache_bytes / 2 ** 30:g} GiB", talker_max_len=pipe.talker.max_len)
                res["rows"].append(row)
                print(f"{name} {form:10s} N={n:2d}: {row['wall_ms']:8.0f} ms, TTFA {row['ttfa_ms_first']:.0f}/"
                      f"{row['ttfa_ms_median']:.0f}/{row['ttfa_ms_last']:.0f} ms, {row['audio_s']:.1f} s audio "
                      f"({row['x_real_time']:.2f}x real time); Thinker {row['thinker_ms']:.0f}, Talker "
                      f"{row['talker_ms']:.0f}, Code2Wav {row['code2wav_ms']:.0f} ms", flush=True)
                (args.out / "turn_bench.json").write_text(json.dumps(res, indent=1))   # a cut-off run keeps its rows
            if form == args.cprofile:
                profile_run(pipe, max(ns), feats, args, dev, args.out / f"turn_bench_cprofile_{name}_{form}.txt")
            del pipe
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    write_table(res, args.out / "turn_bench.md")


if __name__ == "__main__":
    main()
