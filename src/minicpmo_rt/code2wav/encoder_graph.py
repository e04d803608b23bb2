"""The flow's encoder half of a streamed chunk, replayed from CUDA graphs.

``Flow.encode_chunk`` runs token embedding -> ``UpsampleConformerEncoderV2.forward_chunk`` ->
``encoder_proj``: ten conformer layers of small ops, launch-bound at any batch. On CUDA the fast
path replays that as one graph per (batch, tokens, cached token frames, final chunk, matmul and
cuDNN TF32 flags): a steady stream's chunks hit one graph. The token ids and the cache are copied
into the graph's inputs; the outputs are copied out, so callers own what they get (nothing aliases
a buffer the next replay rewrites). A graph keeps the precision flags it was captured under, which
is why they are part of the key.

A shape is captured on its second call (its first runs eagerly), so one-off shapes (a final chunk's
odd length, a cache still growing) never take a graph; with ``max_graphs`` held, the least recently
replayed graph makes room (logged once). A capture failure turns the graphs off (logged once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import bulk_copy
from .encoder import EncoderCache

__all__ = ["EncoderGraphs"]

log = logging.getLogger(__name__)

SEEN_KEPT = 256     # shapes remembered as called once


@dataclass(frozen=True)
class EncoderKey:
    batch: int
    tokens: int
    cached_tokens: int
    last_chunk: bool
    tf32: tuple[bool, bool]      # (matmul, cuDNN) TF32 flags at capture


@dataclass
class _Graph:
    token: torch.Tensor          # (b, n) int64
    cnn: torch.Tensor            # encoder cnn cache input
    att: torch.Tensor            # encoder att cache input
    h: torch.Tensor | None = None
    out: EncoderCache | None = None
    graph: torch.cuda.CUDAGraph | None = None


class EncoderGraphs:
    """``flow``'s encoder half (see the module docstring); ``run`` has ``Flow._encode``'s contract."""

    def __init__(self, flow, max_graphs: int = 8, warmups: int = 2):
        self.flow = flow
        self.max_graphs = max_graphs
        self.warmups = warmups
        self._graphs: dict[EncoderKey, _Graph] = {}     # least recently replayed first
        self._seen: dict[EncoderKey, None] = {}         # shapes called once (bounded, oldest first)
        self._pool = None
        self._off: str | None = None
        self._logged: set[str] = set()

    def _log_once(self, what: str, msg: str) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(msg)

    def graphs(self) -> list[EncoderKey]:
        return [k for k, g in self._graphs.items() if g.graph is not None]

    def run(self, token: torch.Tensor, cache: EncoderCache, last_chunk: bool) -> tuple[torch.Tensor, EncoderCache]:
        """token (b, n) int64 on the device, cache the stream(s)' encoder cache -> (h (b, frames, 80)
        before the transpose, next encoder cache, untrimmed), owned by the caller."""
        if not self._eligible(token):
            return self.flow._encode(token, cache, last_chunk)
        key = EncoderKey(token.shape[0], token.shape[1], cache.token_frames, bool(last_chunk),
                         (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        g = self._graphs.pop(key, None)
        if g is None:
            if key not in self._seen:                   # a first call: eager
                if len(self._seen) >= SEEN_KEPT:
                    self._seen.pop(next(iter(self._seen)))
                self._seen[key] = None
                return self.flow._encode(token, cache, last_chunk)
            del self._seen[key]
            if len(self._graphs) >= self.max_graphs:
                old = next(iter(self._graphs))
                del self._graphs[old]
                if not self._graphs:    # a private pool nobody uses any more must not be captured into
                    self._pool = None
                self._log_once("evict", f"encoder graph budget ({self.max_graphs}) held: {key} replaces the least "
                                        f"recently replayed graph ({old}); further replacements are not logged")
            g = _Graph(torch.empty_like(token), torch.empty_like(cache.cnn), torch.empty_like(cache.att))
            g.token.copy_(token)
            bulk_copy.copy_(g.cnn, cache.cnn)
            bulk_copy.copy_(g.att, cache.att)
            try:
                self._capture(g, key)
            except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly
                self._off = f"capture failed: {exc}"
                self._log_once("capture", f"encoder graph capture failed for {key} ({exc}); encoding eagerly")
                return self.flow._encode(token, cache, last_chunk)
            self._graphs[key] = g
        else:
            self._graphs[key] = g                       # now the most recently replayed
            g.token.copy_(token)
            bulk_copy.copy_(g.cnn, cache.cnn)
            bulk_copy.copy_(g.att, cache.att)
        g.graph.replay()
        return g.h.clone(), EncoderCache(g.out.cnn.clone(), bulk_copy.clone(g.out.att))

    def _eligible(self, token: torch.Tensor) -> bool:
        return token.device.type == "cuda" and self._off is None

    def _capture(self, g: _Graph, key: EncoderKey) -> None:
        def body():
            return self.flow._encode(g.token, EncoderCache(g.cnn, g.att), key.last_chunk)

        stream = torch.cuda.Stream(device=g.token.device)
        stream.wait_stream(torch.cuda.current_stream(g.token.device))
        with torch.cuda.stream(stream):     # warm-ups also fill the encoder's position-table memo
            for _ in range(self.warmups):
                body()
        torch.cuda.current_stream(g.token.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            g.h, g.out = body()
        g.graph = graph
