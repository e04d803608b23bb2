"""The flow's encoder half of a streamed chunk, replayed from CUDA graphs.

``Flow.encode_chunk`` runs token embedding -> ``UpsampleConformerEncoderV2.forward_chunk`` ->
``encoder_proj``: ten conformer layers of small ops, launch-bound at any batch. On CUDA the fast
path replays that through ``hift_graph.ShapeGraphs`` (the vocoder's per-shape graph cache), one
graph per (batch, tokens, cached token frames, final chunk, matmul and cuDNN TF32 flags): a steady
stream's chunks hit one graph. A graph keeps the precision flags it was captured under, which is why
they are part of the key. The outputs are copied out, so callers own what they get.

A shape is captured on its second call (its first runs eagerly), so one-off shapes (a final chunk's
odd length, a cache still growing) never take a graph; with ``max_graphs`` held, the least recently
replayed graph makes room (logged once). A capture failure turns the graphs off (logged once).
Rows pad to batch buckets (``hift_graph.ROW_BUCKETS``: the conformer is row-independent), so the
batch sizes of a round of concurrent streams, which wander as streams come and go, share 5 graphs
per cache shape; the budget holds every bucket of a stream's four cache shapes (first, growing,
steady). Two more sets, each with a budget of its own: ``padded`` (caches of several lengths in one call,
``cfm_join_starts``) and ``ended`` (a round's final chunks, of any length, padded to one shape:
``Flow.encode_ends``), so neither evicts the steady chunks' graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .encoder import EncoderCache
from .hift_graph import ROW_BUCKETS, ShapeGraphs

__all__ = ["EncoderGraphs"]


@dataclass(frozen=True)
class EncoderKey:
    batch: int                   # the batch bucket: the rows the graph runs
    tokens: int
    cached_tokens: int
    last_chunk: bool
    tf32: tuple[bool, bool]      # (matmul, cuDNN) TF32 flags at capture


def _tf32_flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


class EncoderGraphs:
    """``flow``'s encoder half (see the module docstring); ``run`` has ``Flow._encode``'s contract."""

    def __init__(self, flow, max_graphs: int = 24, warmups: int = ShapeGraphs.WARMUPS,
                 batch_buckets: Sequence[int] = ROW_BUCKETS):
        self.flow = flow
        # (token, cnn, att) in, (h, cnn, att) out: the attention cache is layer-major, its rows on axis 1
        self.shapes = ShapeGraphs(self._body, "encoder", max_graphs, warmups, capture_after=2,
                                  key_extra=_tf32_flags, evict=True, batch_buckets=batch_buckets,
                                  batch_axes=(0, 0, 1), out_batch_axes=(0, 0, 1))
        # rows whose caches were padded at the front to a common length (a stream's first and second chunks
        # among steady ones, cfm_join_starts): the padding counts come in as a fourth input
        self.padded = ShapeGraphs(self._body_padded, "encoder (rows of their own lengths)", max_graphs, warmups,
                                  capture_after=2, key_extra=_tf32_flags, evict=True, batch_buckets=batch_buckets,
                                  batch_axes=(0, 0, 1, 0), out_batch_axes=(0, 0, 1))
        # final chunks of streams that end (``Flow.encode_ends``): rows of their own token counts padded at the
        # back to one length, and their caches at the front to the steady length, so every final chunk of a round
        # replays one graph per bucket (which ``Code2Wav.warm_up`` captures) whatever its length; front padding
        # and token counts come in as inputs
        self.ended = ShapeGraphs(self._body_ended, "encoder (final chunks)", max_graphs, warmups, capture_after=2,
                                 key_extra=_tf32_flags, evict=True, batch_buckets=batch_buckets,
                                 batch_axes=(0, 0, 1, 0, 0), out_batch_axes=(0, 0, 1))

    @property
    def max_graphs(self) -> int:
        return self.shapes.max_graphs

    def _body(self, token: torch.Tensor, cnn: torch.Tensor, att: torch.Tensor, *, last_chunk: bool):
        h, enc = self.flow._encode(token, EncoderCache(cnn, att), last_chunk)
        return h, enc.cnn, enc.att

    def _body_padded(self, token: torch.Tensor, cnn: torch.Tensor, att: torch.Tensor, pad: torch.Tensor, *,
                     last_chunk: bool):
        h, enc = self.flow._encode(token, EncoderCache(cnn, att), last_chunk, pad)
        return h, enc.cnn, enc.att

    def _body_ended(self, token: torch.Tensor, cnn: torch.Tensor, att: torch.Tensor, pad: torch.Tensor,
                    valid: torch.Tensor):
        h, enc = self.flow._encode(token, EncoderCache(cnn, att), True, pad, valid)
        return h, enc.cnn, enc.att

    def graphs(self) -> list[EncoderKey]:
        # ShapeGraphs keys: ((token shape, dtype), (cnn ...), (att shape, dtype), ("last_chunk", v), *flags)
        return [EncoderKey(k[0][0][0], k[0][0][1], k[2][0][3] // 2, k[3][1], k[4:]) for k in self.shapes.graphs]

    def run(self, token: torch.Tensor, cache: EncoderCache, last_chunk: bool,
            copy_out: bool = True, pad: torch.Tensor | None = None, valid: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, EncoderCache]:
        """token (b, n) int64 on the device, cache the stream(s)' encoder cache -> (h (b, frames, 80)
        before the transpose, next encoder cache, untrimmed), owned by the caller (``copy_out=False``: views of
        a graph's outputs where one replayed, valid until it replays again). ``pad`` (b,) int64 on the device:
        rows padded at the front (``Flow.encode_streams``), through graphs of their own. ``valid`` (b,) int64 on the
        device (final chunks only): each row's own token count, the rest padding at the back (``Flow.encode_ends``),
        through the ``ended`` graphs (``pad`` zeros where None); the next cache is then not each row's own."""
        if valid is not None:
            if not last_chunk:
                raise ValueError("EncoderGraphs.run: valid (rows padded at the back) is for final chunks only")
            if pad is None:
                pad = torch.zeros_like(valid)
            h, cnn, att = self.ended(token, cache.cnn, cache.att, pad, valid, copy_out=copy_out)
            return h, EncoderCache(cnn, att)
        if pad is not None:
            h, cnn, att = self.padded(token, cache.cnn, cache.att, pad, copy_out=copy_out,
                                      last_chunk=bool(last_chunk))
            return h, EncoderCache(cnn, att)
        h, cnn, att = self.shapes(token, cache.cnn, cache.att, copy_out=copy_out, last_chunk=bool(last_chunk))
        return h, EncoderCache(cnn, att)
