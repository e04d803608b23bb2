"""Thinker on the GPU: full-size random weights in bf16 (or --tiny on CPU as a smoke test).

Measures, side by side in one run: image preprocessing (CPU) and vision encode per
1920x1080 frame, one native 1-s commit through StreamingSession (frame + audio + prefill),
read_state, snapshot+restore, one tail transaction, and batch-1 decode tokens/s with
transformers' eager forward (dynamic cache) vs the static-cache decoder eager and as a
CUDA-graph replay. Writes JSON + Markdown (GPU named) to --out.
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
from minicpmo_rt.thinker.decode import StaticDecoder
from minicpmo_rt.thinker.image_processor import process_image
from minicpmo_rt.thinker.model import Thinker
from minicpmo_rt.thinker.session import StreamingSession


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


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

    sess = StreamingSession(thinker, tok, system_prompt="You are a helpful assistant.")
    audio = speechlike(args.commits + 2)
    commit_ms = []
    for i in range(args.commits):
        a = audio[i * 16000:(i + 1) * 16000]
        commit_ms += timed(lambda: sess.commit(a, frames[i % 4]), dev, 1)
    rows["native 1-s commit (frame + audio + prefill)"] = statistics.median(commit_ms[2:])
    rows["read_state"] = statistics.median(timed(sess.read_state, dev, 20))

    def snap_restore():
        s = sess.snapshot()
        sess.restore(s)

    rows["snapshot + restore"] = statistics.median(timed(snap_restore, dev, 20))
    tail = audio[args.commits * 16000: args.commits * 16000 + 6400]

    def transaction():
        with sess.transaction():
            sess.append_tail(tail, frames[0])
            sess.read_state()

    rows["tail transaction (0.4 s tail + frame)"] = statistics.median(timed(transaction, dev, 5))
    ctx = None
    try:
        from minicpmo_rt.thinker.model import cache_length
        ctx = cache_length(sess.cache)
    except Exception:
        pass

    # Decode tokens/s at batch 1.
    llm = thinker.llm
    n_prompt = 1024 if not args.tiny else 64
    max_len = 2048 if not args.tiny else 256
    prompt = torch.randn(1, n_prompt, cfg.llm.hidden_size, device=dev, dtype=dtype)
    decode = {}
    # transformers eager with its dynamic cache
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
    sd = StaticDecoder(llm, max_len=max_len)
    sd.prefill(prompt, 0)
    pos = torch.tensor([n_prompt], device=dev)
    t1 = torch.tensor([100], device=dev)
    decode["static cache eager"] = n / (sum(timed(lambda: sd.decode(t1, pos, max_len), dev, n)) / 1e3)
    if dev.type == "cuda":
        sd.decode_graph(t1, pos, max_len)
        ms = timed(lambda: sd.decode_graph(t1, pos, max_len), dev, args.decode_tokens)
        decode["static cache + CUDA graph"] = args.decode_tokens / (sum(ms) / 1e3)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    res = {"gpu": gpu, "dtype": str(dtype), "torch": torch.__version__, "tiny": args.tiny,
           "build_s": build_s, "latency_ms_median": rows, "decode_tokens_per_s": decode,
           "llm_context_after_commits": ctx, "commits": args.commits,
           "goals": {"decode_tokens_per_s": 180, "native_commit_ms": 25}}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "thinker" + ("_tiny_cpu" if args.tiny else "")
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    lines = [f"# Thinker ({gpu}, {dtype}, {'tiny' if args.tiny else 'full-size random weights'})", "",
             "| quantity | median (ms) |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in rows.items()]
    lines += ["", "| decode at batch 1 (context %d) | tokens/s |" % n_prompt, "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in decode.items()]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
