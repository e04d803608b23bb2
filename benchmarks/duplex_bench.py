"""Duplex unit latency: Thinker (unit prefill + up to 20 decode steps) and Talker (one chunk of
up to 26 draws) per second of input, full-size random weights in bf16 on the GPU.

A unit must finish well inside its second for a live conversation. Every unit here is made to
speak (the LM head puts an ordinary text token on top at every decode step, so each unit speaks
until the 28-character limit, the longest an ordinary unit speaks), with a 448x448 frame per unit. Two
Thinker session back-ends side by side in one run: the plain reference (transformers on a
DynamicCache, and the Talker on transformers' forward) and the fast paths (``shared_fast_paths``:
static cache with Triton kernels and CUDA-graph prefill, vision and audio graphs; the Talker's
static cache: a one-seat ``TalkerTurns``, what ``DuplexConversation`` runs on CUDA). Code2Wav is not in the loop here: its steady chunk
is measured by ``code2wav_pipeline_bench.py`` (12.4 ms per stream, session 33).

    python benchmarks/duplex_bench.py OUT               # GPU, full size
    python benchmarks/duplex_bench.py OUT --tiny        # CPU smoke test at tiny size
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, reference_config, tiny_config
from minicpmo_rt.checkpoint.tokenizer import load_tokenizer, vendored_tokenizer_dir
from minicpmo_rt.talker.chunked import TalkerTurn, TalkerTurns
from minicpmo_rt.talker.model import MiniCPMTTS, rebuild_rotary_
from minicpmo_rt.thinker.duplex import DuplexDecodeConfig, DuplexDecoder, TurnState, generate_unit
from minicpmo_rt.thinker.model import Thinker
from minicpmo_rt.thinker.session import StreamingSession, shared_fast_paths

from features_bench import randomize_on_device_

SPEECH_IDS = (1000, 2000, 3000, 4000)   # ordinary text pieces, a few characters each


class _Speak(nn.Module):
    """The real LM head with one text id of ``SPEECH_IDS`` lifted on top of every row: every unit speaks for
    its whole budget. The id is picked from the row's own logits (its argmax), not from Python state, so
    the head gives the same answer inside a CUDA graph (the batched decode's) as outside it; the lift
    (+1000) keeps it on top whatever the repetition penalty does."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head
        self.register_buffer("ids", torch.tensor(SPEECH_IDS, device=head.weight.device), persistent=False)

    def forward(self, h):
        out = self.head(h).clone()
        pick = out.argmax(-1, keepdim=True) % len(SPEECH_IDS)
        return out.scatter(-1, self.ids[pick], out.amax(-1, keepdim=True) + 1000.0)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def build(tiny: bool, dev: torch.device, dtype: torch.dtype):
    cfg = MiniCPMOConfig.from_dict(tiny_config() if tiny else reference_config())
    with torch.device(dev):
        thinker = Thinker(cfg)
    randomize_on_device_(thinker)
    thinker = thinker.to(device=dev, dtype=dtype).eval()
    thinker.rebuild_buffers()
    with torch.device("meta"):
        tts = MiniCPMTTS(cfg.tts)
    tts = tts.to_empty(device=dev)
    randomize_(tts, seed=0, prefix="tts.")
    tts = rebuild_rotary_(tts.to(dtype).eval())
    thinker.llm.lm_head = _Speak(thinker.llm.lm_head)
    return thinker, tts


def run(thinker, tts, tok, options: dict, units: int, dev: torch.device, frame: np.ndarray | None) -> list[dict]:
    rng = np.random.default_rng(0)
    session = StreamingSession(thinker, tok, ref_audio=(0.1 * rng.standard_normal(16000 * 3)).astype(np.float32),
                               **options)
    decoder = DuplexDecoder(tok, DuplexDecodeConfig(mode="greedy"))
    # the fast variant: a one-seat TalkerTurns (static cache, a CUDA graph per attention bucket)
    talker = TalkerTurns(tts, 1, seeds=[0]).seat(0) if options else TalkerTurn(tts, seed=0)
    turn = TurnState()
    rows = []
    for k in range(units):
        audio = (0.1 * rng.standard_normal(16000)).astype(np.float32)
        sync(dev)
        t0 = time.perf_counter()
        session.commit(audio, frame)
        sync(dev)
        t1 = time.perf_counter()
        gen = generate_unit(session, decoder, tok, turn)
        sync(dev)
        t2 = time.perf_counter()
        codes = talker.generate_unit(gen.talker_ids, gen.talker_hidden, turn_end=False)
        sync(dev)
        t3 = time.perf_counter()
        rows.append({"unit": k, "prefill_ms": (t1 - t0) * 1e3, "decode_ms": (t2 - t1) * 1e3,
                     "decode_steps": len(gen.decoded), "fed": len(gen.fed), "talker_ms": (t3 - t2) * 1e3,
                     "codes": len(codes.codes), "unit_ms": (t3 - t0) * 1e3, "cache_len": session.cache_len})
    session.close()
    return rows


def summarize(rows: list[dict], warm: int) -> dict:
    steady = rows[warm:]
    med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    return {"units": len(steady), "unit_ms": med("unit_ms"), "unit_ms_max": max(r["unit_ms"] for r in steady),
            "prefill_ms": med("prefill_ms"), "decode_ms": med("decode_ms"), "decode_steps": med("decode_steps"),
            "decode_ms_per_step": statistics.median(r["decode_ms"] / max(r["decode_steps"], 1) for r in steady),
            "talker_ms": med("talker_ms"), "codes": med("codes"),
            "talker_ms_per_draw": statistics.median(r["talker_ms"] / (r["codes"] + 1) for r in steady)}


def write_table(res: dict, path: Path) -> None:
    """The Markdown table of a run's JSON, with each variant's speed-up over the plain one."""
    plain = res["variants"].get("plain", {}).get("summary")
    lines = [f"# Duplex unit latency ({res['gpu']}, {res['dtype']}, "
             f"{'tiny' if res['tiny'] else 'full-size'} random weights, torch {res['torch']})", "",
             f"Every unit speaks until its 28-character limit, with a 448x448 frame; medians over units "
             f"{res['warm']}..{res['units'] - 1}; run order {', '.join(res['order'])}; {res['cpu_threads']} CPU threads.",
             "", "| Thinker session | unit ms | max | prefill ms | decode ms | steps | ms/step | Talker ms | codes | "
             "ms/draw | x plain |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, v in res["variants"].items():
        s = v["summary"]
        ratio = f"{plain['unit_ms'] / s['unit_ms']:.1f}" if plain else "-"
        lines.append(f"| {name} | {s['unit_ms']:.1f} | {s['unit_ms_max']:.1f} | {s['prefill_ms']:.1f} | "
                     f"{s['decode_ms']:.1f} | {s['decode_steps']:.0f} | {s['decode_ms_per_step']:.2f} | "
                     f"{s['talker_ms']:.1f} | {s['codes']:.0f} | {s['talker_ms_per_draw']:.2f} | {ratio} |")
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (a check of the script)")
    ap.add_argument("--units", type=int, default=12)
    ap.add_argument("--warm", type=int, default=3, help="first units left out of the medians (captures, compiles)")
    ap.add_argument("--order", default="plain,fast", help="Thinker session back-ends to run, in order (a name may "
                                                          "repeat, to see whether order matters)")
    ap.add_argument("--table", type=Path, help="only rewrite OUT/duplex_bench.md from this run's JSON")
    args = ap.parse_args()
    if args.table:
        args.out.mkdir(parents=True, exist_ok=True)
        return write_table(json.loads(args.table.read_text()), args.out / "duplex_bench.md")
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tok = load_tokenizer(vendored_tokenizer_dir())
    thinker, tts = build(args.tiny, dev, dtype)
    frame = np.random.default_rng(1).integers(0, 255, (448, 448, 3), dtype=np.uint8)
    fast = shared_fast_paths(thinker) if dev.type == "cuda" else None
    order = [v for v in args.order.split(",") if v != "fast" or fast is not None]
    res = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "dtype": str(dtype).replace("torch.", ""), "tiny": args.tiny, "units": args.units, "warm": args.warm,
           "cpu_threads": torch.get_num_threads(), "order": order, "variants": {}}
    for i, name in enumerate(order):
        rows = run(thinker, tts, tok, fast if name == "fast" else {}, args.units, dev, frame)
        name = f"{name}" if name not in res["variants"] else f"{name} (again, run {i + 1})"
        res["variants"][name] = {"summary": summarize(rows, args.warm), "rows": rows}
        s = res["variants"][name]["summary"]
        print(f"{name:5s} unit {s['unit_ms']:7.1f} ms (max {s['unit_ms_max']:.1f}): prefill {s['prefill_ms']:.1f}, "
              f"decode {s['decode_ms']:.1f} ({s['decode_steps']:.0f} steps, {s['decode_ms_per_step']:.2f}/step), "
              f"talker {s['talker_ms']:.1f} ({s['codes']:.0f} codes, {s['talker_ms_per_draw']:.2f}/draw)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "duplex_bench.json").write_text(json.dumps(res, indent=1))
    write_table(res, args.out / "duplex_bench.md")

if __name__ == "__main__":
    main()
