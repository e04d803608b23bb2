"""Tensors a CUDA graph reads that live outside it, kept alive as long as the graph.

A graph records addresses, not tensors: a capture that reads a tensor from a bounded cache (the encoder's
position tables, their projections) replays from freed memory once the cache drops it, and the next
allocation there makes the replay read something else. Caches hand out their tensors through
``keep_for_graph``; a capture inside ``keepalive()`` collects them, and its owner keeps the list with the
graph (``hift_graph.ShapeGraphs``).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

_held: ContextVar[list | None] = ContextVar("graph_keepalive", default=None)


def keep_for_graph(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a cache hands it out: noted for the capture in progress (inside ``keepalive()``), and on CUDA
    outside a capture marked as used by the current stream, so that once the cache drops it its memory is
    not reused before that stream's work on it is done (a cached tensor made on one stream, e.g. a capture's
    warm-up stream, is read on others)."""
    held = _held.get()
    if held is not None:
        held.append(t)
    if t.is_cuda and not capturing(t.device):
        t.record_stream(torch.cuda.current_stream(t.device))
    return t


@contextmanager
def keepalive():
    """Collect what ``keep_for_graph`` hands out inside: yields the list (the previous collector, if any,
    is restored afterwards, also on exceptions)."""
    token = _held.set([])
    try:
        yield _held.get()
    finally:
        _held.reset(token)


def capturing(device: torch.device) -> bool:
    """Is the current stream of ``device`` capturing a CUDA graph? (Never off CUDA.)"""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
