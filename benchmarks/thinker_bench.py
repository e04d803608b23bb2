"""Thinker on the GPU: full-size random weights in bf16 (or --tiny on CPU as a smoke test).

Measures, side by side in one run: image preprocessing (CPU) and vision encode per
1920x1080 frame; one native 1-s commit and one tail transaction through StreamingSession
with the plain LLM cache (transformers' forward on a DynamicCache) vs the static cache
(fused Triton kernels, eager and with CUDA-graph prefill), each with a per-stage
breakdown (frame preprocessing, vision, mel+audio encoder, LLM); read_state and
snapshot+restore; a 78-token LLM prefill onto a 1024-token context per path; batch-1
decode tokens/s: transformers eager, static cache with the plain torch step (eager,
CUDA graph) and with the fused kernels (eager, CUDA graph); and the fast paths' relative
error against the plain ones on this device. Writes JSON + Markdown (GPU named) to --out.

    python benchmarks/thinker_bench.py            # H200: full size, bf16 (~2-3 min)
    TRITON_INTERPRET=1 python benchmarks/thinker_bench.py --tiny --commits 3 --decode-tokens 4   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, reference_config, tiny_config
from minicpmo_rt.checkpoint.tokenizer import load_tokenizer, vendored_tokenizer_dir
from minicpmo_rt.thinker import kernels as K
from minicpmo_rt.thinker.decode import StaticDecoder
from minicpmo_rt.thinker.image_processor import process_frame_torch, process_image
from minicpmo_rt.thinker.model import Thinker
from minicpmo_rt.thinker.session import StreamingSession
from minicpmo_rt.thinker.audio_graph import AudioGraphs
from minicpmo_rt.thinker.vision_graph import VisionGraphs


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


class StageClock:
    """Wraps callables so each call's synchronised wall time is added to a named stage."""

    def __init__(self, dev):
        self.dev, self.ms = dev, {}

    def wrap(self, name, fn):
        def timed_call(*a, **kw):
            sync(self.dev)
            t = time.perf_counter()
            out = fn(*a, **kw)
            sync(self.dev)
            self.ms.setdefault(name, []).append((time.perf_counter() - t) * 1e3)
            return out
        return timed_call

    def reset(self):
        self.ms = {}


def timed(fn, dev, n):
    out = []
    for _ in range(n):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        out.append((time.perf_counter() - t) * 1e3)
    return out


@torch.no_grad()
def fill_random_(module: torch.nn.Module, seed: int) -> None:
    """Fast on-device random weights (values only matter for not being zeros)."""
    g = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, p in module.named_parameters():
        if p.ndim <= 1:
            p.copy_(1.0 + 0.02 * torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32))
        else:
            fan_in = p[0].numel()
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) / fan_in ** 0.5)


def speechlike(seconds: float, sr: int = 16000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    env = (np.sin(2 * np.pi * 3 * t) > 0).astype(np.float32)
    return (0.1 * env * np.sin(2 * np.pi * 180 * t) + 0.01 * rng.standard_normal(t.shape)).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--commits", type=int, default=12)
    ap.add_argument("--decode-tokens", type=int, default=128)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = MiniCPMOConfig.from_dict(tiny_config() if args.tiny else reference_config())
    t0 = time.perf_counter()
    with torch.device("meta"):
        thinker = Thinker(cfg)
    thinker = thinker.to_empty(device=dev)
    if args.tiny:
        randomize_(thinker, seed=0)
    else:
        fill_random_(thinker, seed=0)
    thinker.rebuild_buffers()
    thinker = thinker.to(dtype)
    thinker.rebuild_buffers()
    thinker.eval()
    build_s = time.perf_counter() - t0
    tok = load_tokenizer(vendored_tokenizer_dir())
    rng = np.random.default_rng(0)
    h, w = (1080, 1920) if not args.tiny else (180, 320)
    frames = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for _ in range(4)]
    rows = {}

    pre = timed(lambda: process_image(frames[0], 1), torch.device("cpu"), 5)
    processed = process_image(frames[0], 1)
    thinker.embed_image(processed)
    vis = timed(lambda: thinker.embed_image(processed), dev, 10)
    rows["image preprocessing (CPU) per frame"] = statistics.median(pre)
    rows["vision encode + resampler per frame"] = statistics.median(vis)
    rows[f"image preprocessing (torch on {dev.type}) per frame"] = statistics.median(
        timed(lambda: process_frame_torch(frames[0], device=dev), dev, 10))
    errors = {"resampler output: torch vs PIL preprocessing (1080p random frame)": rel(
        thinker.embed_image(process_frame_torch(frames[0], device=dev)), thinker.embed_image(processed))}
    vg = VisionGraphs(thinker)
    errors["resampler output: vision CUDA graph (or eager body) vs embed_image"] = rel(
        vg(processed), thinker.embed_image(processed))
    rows["vision encode + resampler per frame, CUDA graph"] = statistics.median(timed(lambda: vg(processed), dev, 10))
    vision_graph_failures = {str(k): v for k, v in vg.failures.items()}
    del vg

    audio = speechlike(args.commits + 2)
    tail = audio[args.commits * 16000: args.commits * 16000 + 6400]
    fast_kernels = "triton" if K.usable_on(torch.empty(0, device=dev)) else "torch"
    variants = {"plain (DynamicCache)": dict(llm_cache="dynamic"),
                f"static cache, {fast_kernels} kernels, eager": dict(llm_cache="static", llm_kernels=fast_kernels,
                                                                    llm_graphs=False)}
    if dev.type == "cuda":
        variants[f"static cache, {fast_kernels} kernels, CUDA-graph prefill"] = dict(
            llm_cache="static", llm_kernels=fast_kernels, llm_graphs=True)
    # On CPU (--tiny smoke) the same combinations run with eager prefill and eager graph fallbacks.
    graphs = dev.type == "cuda"
    fast = f"static cache, {fast_kernels} kernels, {'CUDA-graph' if graphs else 'eager'} prefill"
    variants[f"{fast}, torch frame preprocessing, vision graph"] = dict(
        llm_cache="static", llm_kernels=fast_kernels, llm_graphs=graphs, image_preprocess="torch", vision_graphs=True)
    variants[f"{fast}, torch frame preprocessing, vision graph, audio graphs"] = dict(
        llm_cache="static", llm_kernels=fast_kernels, llm_graphs=graphs, image_preprocess="torch", vision_graphs=True,
        audio_graphs=AudioGraphs(thinker), warm=True)
    commit_rows, tail_rows, breakdown, states, graph_failures = {}, {}, {}, {}, {}
    ctx = None
    for name, kw in variants.items():
        clock = StageClock(dev)
        thinker.embed_audio_chunk = clock.wrap("audio encoder", Thinker.embed_audio_chunk.__get__(thinker))
        thinker.embed_image = clock.wrap("vision + resampler", Thinker.embed_image.__get__(thinker))
        commit_ms, stage, sess = [], {}, None
        kw = dict(kw)
        try:
            if kw.pop("warm", False):
                # Capture the per-cache-length audio graphs once (a stream's first ~30 s do this);
                # the measured session below then replays them.
                warm = StreamingSession(thinker, tok, system_prompt="You are a helpful assistant.", **kw)
                for i in range(args.commits):
                    warm.commit(audio[i * 16000:(i + 1) * 16000], frames[i % 4])
                with warm.transaction():
                    warm.append_tail(tail, frames[0])
                del warm
            sess = StreamingSession(thinker, tok, system_prompt="You are a helpful assistant.", **kw)
            sess._check_frame = clock.wrap("frame preprocessing (CPU)", sess._check_frame)
            sess.mel.process = clock.wrap("mel", sess.mel.process)
            sess.llm_cache.feed = clock.wrap("LLM prefill", sess.llm_cache.feed)
            graph_objs = [o for o in (sess.vision, sess.audio_graphs) if o is not None]
            if sess.vision is not None:
                sess.vision = clock.wrap("vision + resampler", sess.vision)
            if sess.audio_graphs is not None:
                sess.audio_graphs.embed_chunk = clock.wrap("audio encoder", sess.audio_graphs.embed_chunk)
            for i in range(args.commits):
                a = audio[i * 16000:(i + 1) * 16000]
                clock.reset()
                commit_ms += timed(lambda: sess.commit(a, frames[i % 4]), dev, 1)
                if i >= 2:
                    for k, v in clock.ms.items():
                        stage.setdefault(k, []).append(sum(v))
            commit_rows[name] = statistics.median(commit_ms[2:])
            breakdown[name] = {k: statistics.median(v) for k, v in stage.items()}
            states[name] = sess.read_state()
            fails = {k: v for o in graph_objs for k, v in o.failures.items()}
            if fails:
                graph_failures[name] = {str(k): v for k, v in fails.items()}
            ctx = sess.cache_len

            def transaction():
                with sess.transaction():
                    sess.append_tail(tail, frames[0])
                    sess.read_state()

            transaction()  # first tail length: compiles / captures once
            tail_rows[name] = statistics.median(timed(transaction, dev, 5))
            if name.startswith("plain"):
                rows["read_state"] = statistics.median(timed(sess.read_state, dev, 20))

                def snap_restore():
                    sess.restore(sess.snapshot())

                rows["snapshot + restore"] = statistics.median(timed(snap_restore, dev, 20))
            else:
                errors[f"read_state after {args.commits} commits: {name} vs plain"] = rel(
                    states[name], states["plain (DynamicCache)"])
        except Exception as e:  # keep the other rows of the one device run
            commit_rows[name] = f"failed: {type(e).__name__}: {e}"[:300]
        finally:
            del thinker.embed_audio_chunk, thinker.embed_image
            del sess
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    for name, v in commit_rows.items():
        rows[f"native 1-s commit: {name}"] = v
    for name, v in tail_rows.items():
        rows[f"tail transaction (0.4 s tail + frame): {name}"] = v

    llm = thinker.llm
    n_prompt = 1024 if not args.tiny else 64
    max_len = 2048 if not args.tiny else 256
    prompt = torch.randn(1, n_prompt, cfg.llm.hidden_size, device=dev, dtype=dtype)
    unit = torch.randn(1, 78, cfg.llm.hidden_size, device=dev, dtype=dtype)

    # LLM prefill of one 78-token unit onto the n_prompt context, per path.
    prefill = {}
    from minicpmo_rt.thinker.model import truncate_cache
    hf_cache = thinker.new_cache()
    thinker.forward_embeds(prompt[0], hf_cache)

    def hf_prefill():
        thinker.forward_embeds(unit[0], hf_cache)
        truncate_cache(hf_cache, n_prompt)

    hf_prefill()
    prefill["transformers eager (DynamicCache)"] = statistics.median(timed(hf_prefill, dev, 10))
    del hf_cache
    sd = StaticDecoder(llm, max_len=max_len, kernels="torch")
    fd = StaticDecoder(llm, max_len=max_len, kernels=fast_kernels, share_weights=sd)
    with torch.no_grad():
        for d in (sd, fd):
            d.prefill(prompt, 0)
        ref_h = sd.prefill(unit, n_prompt)
        errors[f"78-token prefill hidden: {fast_kernels} vs torch step"] = rel(fd.prefill(unit, n_prompt), ref_h)
    prefill["static cache, torch step, eager"] = statistics.median(timed(lambda: sd.prefill(unit, n_prompt), dev, 10))
    prefill[f"static cache, {fast_kernels} kernels, eager"] = statistics.median(
        timed(lambda: fd.prefill(unit, n_prompt), dev, 10))
    if dev.type == "cuda" and fast_kernels == "triton":
        try:
            errors["78-token prefill hidden: triton CUDA graph vs torch step"] = rel(fd.prefill_graph(unit, n_prompt),
                                                                                     ref_h)
            prefill["static cache, triton kernels, CUDA graph"] = statistics.median(
                timed(lambda: fd.prefill_graph(unit, n_prompt), dev, 10))
        except Exception as e:
            prefill["static cache, triton kernels, CUDA graph"] = f"failed: {type(e).__name__}: {e}"[:300]

    # Decode tokens/s at batch 1.
    decode = {}
    out = llm.model(inputs_embeds=prompt, use_cache=True)
    cache = out.past_key_values
    tokid = torch.tensor([[100]], device=dev)

    def hf_step():
        nonlocal cache
        o = llm(input_ids=tokid, past_key_values=cache, use_cache=True)
        cache = o.past_key_values

    n = 16 if args.tiny else 32
    decode["transformers eager (dynamic cache)"] = n / (sum(timed(hf_step, dev, n)) / 1e3)
    del cache, out
    for d in (sd, fd):
        d.prefill(prompt, 0)
    pos = torch.tensor([n_prompt], device=dev)
    t1 = torch.tensor([100], device=dev)
    # kv_len: the 256-bucket holding the position, as StaticStepper uses (the Triton set ignores it).
    span = min(max_len, -(-(n_prompt + 1) // 256) * 256)
    with torch.no_grad():
        lp, hp = sd.decode(t1, pos, span)
        lf, hf = fd.decode(t1, pos, span)
    errors[f"decode hidden: {fast_kernels} vs torch step"] = rel(hf, hp)
    errors[f"decode logits: {fast_kernels} vs torch step"] = rel(lf, lp)
    decode["static cache, torch step, eager"] = n / (sum(timed(lambda: sd.decode(t1, pos, span), dev, n)) / 1e3)
    decode[f"static cache, {fast_kernels} kernels, eager"] = n / (
        sum(timed(lambda: fd.decode(t1, pos, span), dev, n)) / 1e3)
    if dev.type == "cuda":
        for label, d in (("static cache, torch step, CUDA graph", sd),
                         (f"static cache, {fast_kernels} kernels, CUDA graph", fd)):
            try:
                d.decode_graph(t1, pos, span)
                ms = timed(lambda: d.decode_graph(t1, pos, span), dev, args.decode_tokens)
                decode[label] = args.decode_tokens / (sum(ms) / 1e3)
            except Exception as e:
                decode[label] = f"failed: {type(e).__name__}: {e}"[:300]
        with torch.no_grad():
            lg, hg = fd.decode_graph(t1, pos, span)
        errors[f"decode hidden: {fast_kernels} CUDA graph vs torch step"] = rel(hg, hp)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    res = {"gpu": gpu, "dtype": str(dtype), "torch": torch.__version__, "tiny": args.tiny,
           "build_s": build_s, "latency_ms_median": rows, "commit_breakdown_ms_median": breakdown,
           "llm_prefill_78_tokens_ms_median": prefill, "decode_tokens_per_s": decode,
           "fast_vs_plain_rel_err": errors, "fast_kernels": fast_kernels,
           "vision_graph_failures": vision_graph_failures, "session_graph_failures": graph_failures,
           "llm_context_after_commits": ctx, "commits": args.commits,
           "goals": {"decode_tokens_per_s": 180, "native_commit_ms": 25}}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "thinker" + ("_tiny_cpu" if args.tiny else "")
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    lines = [f"# Thinker ({gpu}, {dtype}, {'tiny' if args.tiny else 'full-size random weights'})", "",
             "| quantity | median (ms) |", "|---|---|"]
    fmt = lambda v, p: f"{v:.{p}f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines += [f"| {k} | {fmt(v, 2)} |" for k, v in rows.items()]
    lines += ["", "| commit stage (median ms) | " + " | ".join(breakdown) + " |",
              "|---|" + "---|" * len(breakdown)]
    stages = sorted({k for b in breakdown.values() for k in b})
    lines += [f"| {st} | " + " | ".join(fmt(b.get(st, float("nan")), 2) for b in breakdown.values()) + " |"
              for st in stages]
    lines += ["", "| LLM prefill, 78 tokens onto %d | median (ms) |" % n_prompt, "|---|---|"]
    lines += [f"| {k} | {fmt(v, 2)} |" for k, v in prefill.items()]
    lines += ["", "| decode at batch 1 (context %d) | tokens/s |" % n_prompt, "|---|---|"]
    lines += [f"| {k} | {fmt(v, 1)} |" for k, v in decode.items()]
    lines += ["", "| fast path vs plain path (this device, %s) | rel err |" % str(dtype).replace("torch.", ""),
              "|---|---|"]
    lines += [f"| {k} | {v:.2e} |" for k, v in errors.items()]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
