"""The vision tower + resampler of one frame as a CUDA-graph replay (the fast path beside
``Thinker.embed_image``).

A 1080p frame is ~1000 patches through 27 SigLIP layers: a few hundred small launches
that the eager forward issues one by one from Python. A stream's frames share one size,
so one graph per (pixel shape, target sizes) serves the whole stream. The graph body is
``embed_body``: the eager forward with the two host round trips hoisted out (the patch
position ids and the padding mask are computed on the host before the replay and copied
into static inputs), so it can be captured. If capture fails for a shape, that shape
stays eager and the reason is kept in ``failures``.
"""

from __future__ import annotations

import torch

from .image_processor import ProcessedImage, pack_patches
from .model import Thinker


@torch.no_grad()
def embed_body(thinker: Thinker, pixels: torch.Tensor, pos_ids: torch.Tensor, key_mask: torch.Tensor | None,
               tgt_sizes: torch.Tensor) -> torch.Tensor:
    """``Thinker.embed_image`` after packing, given device ``pixels``, ``pos_ids`` and ``key_mask``."""
    vpm = thinker.vpm
    x = vpm.post_layernorm(vpm.encoder(vpm.embeddings.embed(pixels, pos_ids), key_mask))
    return thinker.resampler(x, tgt_sizes).to(thinker.dtype)


class VisionGraphs:
    """``__call__(processed) -> [n_sub, 64, H]`` (a list of frames: their sub-images in one batch),
    replayed from a CUDA graph per frame shape and batch
    (eager through ``embed_body`` on other devices or where capture failed)."""

    def __init__(self, thinker: Thinker):
        self.thinker = thinker
        self._graphs: dict[tuple, tuple] = {}
        self.failures: dict[tuple, str] = {}

    def _inputs(self, processed: ProcessedImage | list[ProcessedImage]):
        th = self.thinker
        batch = pack_patches(processed)
        valid = batch.patch_attention_mask.reshape(batch.pixel_values.shape[0], -1)
        pos = th.vpm.embeddings.position_ids(valid, batch.tgt_sizes)
        mask = None if bool(valid.all()) else valid[:, None, None, :]
        pixels = batch.pixel_values.to(th.vpm.embeddings.patch_embedding.weight.dtype)
        key = (tuple(pixels.shape), tuple(map(tuple, batch.tgt_sizes.tolist())), mask is None)
        return key, pixels, pos, mask, batch.tgt_sizes

    @torch.no_grad()
    def __call__(self, processed: ProcessedImage | list[ProcessedImage]) -> torch.Tensor:
        th = self.thinker
        dev = th.device
        key, pixels, pos, mask, tgt = self._inputs(processed)
        if dev.type != "cuda" or key in self.failures:
            return embed_body(th, pixels.to(dev), pos.to(dev), None if mask is None else mask.to(dev), tgt)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(pixels, pos, mask, tgt)
            except Exception as e:  # an op that syncs with the host: this shape stays eager
                self.failures[key] = f"{type(e).__name__}: {e}"
                torch.cuda.synchronize()
                return embed_body(th, pixels.to(dev), pos.to(dev), None if mask is None else mask.to(dev), tgt)
        g, sx, sp, sm, out = self._graphs[key]
        sx.copy_(pixels, non_blocking=True)
        sp.copy_(pos, non_blocking=True)
        if sm is not None:
            sm.copy_(mask, non_blocking=True)
        g.replay()
        return out.clone()

    def _capture(self, pixels, pos, mask, tgt):
        th = self.thinker
        dev = th.device
        sx, sp = pixels.to(dev), pos.to(dev)
        sm = None if mask is None else mask.to(dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # also builds the resampler's lazy sin-cos table outside the capture
                embed_body(th, sx, sp, sm, tgt)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = embed_body(th, sx, sp, sm, tgt)
        return g, sx, sp, sm, out
