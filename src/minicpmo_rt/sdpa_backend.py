"""Attention without cuDNN's SDPA backend, for eager calls whose shapes change with every input.

torch (2.11 on the H200) runs the runtime's bf16 ``F.scaled_dot_product_attention`` calls through cuDNN's
backend, which builds a plan for each new shape: 36-60 ms for the first call at a shape, then 0.1-0.3 ms
(``benchmarks/results/talker_prefill_session49_h200.md``). Without it, torch's flash / memory-efficient kernels take
0.05-0.45 ms from the first call on. A shape that comes back (a graph replay, a fixed-size chunk) pays the plan
once; the Talker's prefill does not come back: its condition is each answer's own text, so every new length
paid the plan again (66-100 ms of a turn's first audio, the same file).

So the calls whose lengths follow the input (the Talker's conditions, a turn's prompt on the dynamic cache)
run inside ``no_cudnn_sdpa()``; fixed-shape paths (graphed audio and vision steps, the feature extractor)
keep torch's choice.

The flag is torch's and process-wide (as ``code2wav.precision``'s TF32 flag): while one thread is inside the
block, SDPA calls another thread makes at that moment skip cuDNN too, which changes their speed, not their
contract (every backend computes the same attention, to bf16 rounding).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

__all__ = ["no_cudnn_sdpa", "attention"]


@contextmanager
def no_cudnn_sdpa() -> Iterator[None]:
    """cuDNN's SDPA backend off inside the block; the previous setting restored on exit and on exceptions."""
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` inside ``no_cudnn_sdpa()``."""
    with no_cudnn_sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)
