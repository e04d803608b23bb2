"""The duplex decode policy's cost per draw on the CPU, where it runs for every conversation and decode step:
``DuplexDecoder.decode`` as it is, beside the full-vocabulary form it replaced (session 42), on the real
vocabulary (151,748 logits), one torch thread.

The replaced form is rebuilt here as the reference: the raw ``<|chunk_eos|>`` check as a multinomial over the
softmax of all logits, and top-k -> top-p by sorting the whole masked vocabulary, then a multinomial over it.
Both share the rest of ``decode`` (masks, penalties). Greedy decoding is timed too (unchanged; its raw check
and final pick are argmaxes).

    python benchmarks/duplex_decode_policy_bench.py OUT [--draws 200]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minicpmo_rt.checkpoint.tokenizer import load_tokenizer, vendored_tokenizer_dir
from minicpmo_rt.thinker.duplex import DuplexDecodeConfig, DuplexDecoder
from minicpmo_rt.thinker.generate import _top_p_drop


class FullVocabDecoder(DuplexDecoder):
    """The pre-session-42 sampling: every draw over the whole vocabulary (same distributions)."""

    def _raw_draw_is(self, logits, token):
        if self.config.mode == "greedy":
            return int(torch.argmax(logits)) == token
        return int(torch.multinomial(F.softmax(logits, dim=-1), 1, generator=self.generator)) == token

    def _sample(self, scaled):
        cfg = self.config
        masked = scaled.clone()
        if cfg.top_k > 0:
            masked[masked < torch.topk(masked, min(cfg.top_k, masked.numel())).values[-1]] = float("-inf")
        vals, order = torch.sort(masked, descending=True)
        masked[order[_top_p_drop(vals, cfg.top_p)]] = float("-inf")
        return int(torch.multinomial(F.softmax(masked, dim=-1), 1, generator=self.generator))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_draws(decoder, logits, draws: int) -> list[float]:
    decoder.decode(logits)                      # warm-up
    out = []
    for _ in range(draws):
        t = time.perf_counter()
        decoder.decode(logits)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--draws", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer(vendored_tokenizer_dir())
    logits = torch.randn(151748, generator=torch.Generator().manual_seed(0)) * 3
    rows = []
    for mode in ("sampling", "greedy"):
        for form, cls in (("before: full vocabulary", FullVocabDecoder), ("now: nucleus only", DuplexDecoder)):
            d = cls(tok, DuplexDecodeConfig(mode=mode), torch.Generator().manual_seed(1))
            ms = time_draws(d, logits, args.draws)
            rows.append({"mode": mode, "form": form, "median_ms": statistics.median(ms), "draws": args.draws})
            print(f"{mode:8s} {form:26s} {rows[-1]['median_ms']:.3f} ms per draw", flush=True)
    res = {"cpu": cpu_name(), "torch": torch.__version__, "threads": 1, "vocab": 151748, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "duplex_decode_policy_bench.json").write_text(json.dumps(res, indent=1))
    base = {r["mode"]: r["median_ms"] for r in rows if r["form"].startswith("before")}
    lines = [f"# Duplex decode policy per draw ({res['cpu']}, 1 torch thread, torch {res['torch']})", "",
             f"Median ms of `DuplexDecoder.decode` over {args.draws} draws on 151,748 random logits; the "
             "full-vocabulary form is the policy before session 42 (rebuilt in the script). Greedy runs the same code "
             "in both forms (argmaxes); its two rows differ by run-to-run noise.", "",
             "| mode | form | ms per draw | x faster than before |", "|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['form']} | {r['median_ms']:.3f} | {base[r['mode']] / r['median_ms']:.2f} |")
    (args.out / "duplex_decode_policy_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
