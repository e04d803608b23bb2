"""First call of ``F.scaled_dot_product_attention`` at a shape it has not seen, per call site, cuDNN's backend on/off.

``talker_first_run_probe.py`` found the turn Talker's prefill (eager, SDPA under a boolean mask) taking 66-100 ms at
each condition length it had not prefilled before and ~16 ms after (H200, torch 2.11): cuDNN's attention backend
builds a plan per shape. With that backend disabled the first call took ~17 ms. This times SDPA alone in the
shapes of the runtime's eager call sites whose lengths vary with the input (bf16, full-size heads): the Talker's
prefill, the Thinker's reference prefill (GQA), the audio encoder with and without a mask, the vision tower's
key mask. Each site: a first call at a throwaway length (library loading), then at each of ``--lengths`` a
first and a second call, with cuDNN's backend on and then off (lengths offset so that neither setting sees a
shape the other met).

    python benchmarks/sdpa_first_call_probe.py OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def site_inputs(site: str, n: int, dev, dtype):
    """(q, k, v, kwargs) of ``site`` at length ``n``."""
    r = lambda *s: torch.randn(*s, device=dev, dtype=dtype)  # noqa: E731
    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    if site == "talker_prefill":           # TalkerEngine._layers: 12 heads x 64, causal bool mask
        return r(1, 12, n, 64), r(1, 12, n, 64), r(1, 12, n, 64), {"attn_mask": causal[None, None]}
    if site == "thinker_prefill":          # thinker.kernels.attention_torch: 32 q heads, 8 kv heads x 128
        return r(1, 32, n, 128), r(1, 8, n, 128), r(1, 8, n, 128), {"attn_mask": causal[None, None],
                                                                     "enable_gqa": True}
    if site == "audio_nomask":             # thinker.audio: 16 heads x 64, no mask (a whole clip)
        return r(1, 16, n, 64), r(1, 16, n, 64), r(1, 16, n, 64), {}
    if site == "audio_mask":
        return r(1, 16, n, 64), r(1, 16, n, 64), r(1, 16, n, 64), {"attn_mask": causal[None, None]}
    if site == "vision_keymask":           # thinker.vision: 16 heads x 72, key mask [B,1,1,L]
        km = torch.ones(1, 1, 1, n, dtype=torch.bool, device=dev)
        km[..., n - 3:] = False
        return r(1, 16, n, 72), r(1, 16, n, 72), r(1, 16, n, 72), {"attn_mask": km}
    raise ValueError(site)


def timed(dev, q, k, v, kw) -> float:
    sync(dev)
    t0 = time.perf_counter()
    F.scaled_dot_product_attention(q, k, v, **kw)
    sync(dev)
    return (time.perf_counter() - t0) * 1e3


SITES = ("talker_prefill", "thinker_prefill", "audio_nomask", "audio_mask", "vision_keymask")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--lengths", default="27,61,133,257,517")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    lengths = [int(x) for x in args.lengths.split(",")]
    res = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "sites": {}}
    prev = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for site in SITES:
            row = {}
            for offset, on in ((0, True), (1, False)):
                torch.backends.cuda.enable_cudnn_sdp(on)
                tag = "cudnn_on" if on else "cudnn_off"
                row[tag + "_load"] = round(timed(dev, *site_inputs(site, 9 + offset, dev, dtype)), 2)
                calls = []
                for n in lengths:
                    inp = site_inputs(site, n + offset, dev, dtype)
                    calls.append({"len": n + offset, "first": round(timed(dev, *inp), 3),
                                  "second": round(timed(dev, *inp), 3)})
                row[tag] = calls
            res["sites"][site] = row
            print(site, json.dumps(row), flush=True)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(prev)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sdpa_first_call_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
