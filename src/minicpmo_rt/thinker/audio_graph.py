"""The streaming audio encoder step as a CUDA-graph replay (the fast path beside
``Thinker.embed_audio_chunk``).

One 1-s chunk is only ~50 encoder frames through 24 Whisper layers: the eager step is
launch-bound. Its shapes depend on the mel length, the redundancy frames and the cache
length, which repeat every stream (the cache grows by one chunk per commit and resets
before 1500 positions), so one graph per (mel shape, cache length, redundancy) covers a
stream after ~30 captures. The cache stays immutable for snapshots: before a replay the
cached K/V are copied into static views of one preallocated buffer, and after it the new
cache and embeddings are cloned out of the graphs' shared memory pool. A shape whose
capture fails stays eager (``failures`` keeps the reason).
"""

from __future__ import annotations

import torch

from .audio import AudioEncoderCache, avg_pool, conv_output_length, extra_conv_frames
from .model import AudioChunkEmbedding, Thinker


@torch.no_grad()
def stream_body(thinker: Thinker, mel: torch.Tensor, cache: AudioEncoderCache | None, prefix_extra: int,
                suffix_extra: int) -> tuple[torch.Tensor, AudioEncoderCache]:
    """``Thinker.embed_audio_chunk`` after its reset decision: mel [1, n_mels, T] on the device."""
    hidden, cache = thinker.apm.stream(mel, cache, prefix_extra, suffix_extra)
    embeds = avg_pool(thinker.audio_projection_layer(hidden), thinker.audio_pool_step)[0]
    return embeds.to(thinker.dtype), cache


class AudioGraphs:
    """``embed_chunk(mel, cache, prefix_extra, suffix_extra)`` with ``Thinker.embed_audio_chunk``'s contract."""

    def __init__(self, thinker: Thinker):
        self.thinker = thinker
        self._graphs: dict[tuple, tuple] = {}
        self._pool = None
        self._past: torch.Tensor | None = None  # [layers, 2, 1, heads, max_positions, head_dim]
        self.failures: dict[tuple, str] = {}

    @torch.no_grad()
    def embed_chunk(self, mel: torch.Tensor, cache: AudioEncoderCache | None, prefix_extra: int,
                    suffix_extra: int) -> AudioChunkEmbedding:
        th = self.thinker
        n_mel = int(mel.shape[-1])
        back = extra_conv_frames(suffix_extra)
        n_conv = conv_output_length(n_mel) - extra_conv_frames(prefix_extra) if n_mel else 0
        n_conv -= back if 0 < back < n_conv else 0
        if n_conv < th.audio_pool_step or th.device.type != "cuda":
            return th.embed_audio_chunk(mel, cache, prefix_extra, suffix_extra)
        reset = th.apm.needs_reset(cache, n_mel)
        if reset:
            cache = None
        x = mel[None].to(th.device)
        past = cache.length if cache is not None else 0
        key = (tuple(x.shape), x.dtype, past, int(prefix_extra), int(suffix_extra))
        if key in self.failures:
            embeds, cache = stream_body(th, x, cache, prefix_extra, suffix_extra)
            return AudioChunkEmbedding(embeds, cache, reset)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(x, cache, prefix_extra, suffix_extra)
            except Exception as e:  # an op that syncs with the host: this shape stays eager
                self.failures[key] = f"{type(e).__name__}: {e}"
                torch.cuda.synchronize()
                embeds, cache = stream_body(th, x, cache, prefix_extra, suffix_extra)
                return AudioChunkEmbedding(embeds, cache, reset)
        g, sx, views, out_embeds, out_cache = self._graphs[key]
        sx.copy_(x)
        if views is not None:
            for (vk, vv), k, v in zip(views, cache.keys, cache.values):
                vk.copy_(k)
                vv.copy_(v)
        g.replay()
        new = AudioEncoderCache(tuple(k.clone() for k in out_cache.keys), tuple(v.clone() for v in out_cache.values))
        return AudioChunkEmbedding(out_embeds.clone(), new, reset)

    def _views(self, cache: AudioEncoderCache):
        if self._past is None:
            k = cache.keys[0]
            shape = (len(cache.keys), 2, k.shape[0], k.shape[1], self.thinker.apm.max_source_positions, k.shape[3])
            self._past = torch.zeros(shape, dtype=k.dtype, device=k.device)
        n = cache.length
        return [(self._past[i, 0, :, :, :n], self._past[i, 1, :, :, :n]) for i in range(len(cache.keys))]

    def _capture(self, x, cache, prefix_extra, suffix_extra):
        th = self.thinker
        sx = x.clone()
        views = self._views(cache) if cache is not None else None
        if views is not None:
            for (vk, vv), k, v in zip(views, cache.keys, cache.values):
                vk.copy_(k)
                vv.copy_(v)
        static_cache = AudioEncoderCache(tuple(v[0] for v in views), tuple(v[1] for v in views)) if views else None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                stream_body(th, sx, static_cache, prefix_extra, suffix_extra)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        # One pool for every chunk shape: outputs are cloned right after each replay, so a
        # later graph may reuse an earlier one's memory.
        with torch.cuda.graph(g, pool=self._pool):
            out_embeds, out_cache = stream_body(th, sx, static_cache, prefix_extra, suffix_extra)
        if self._pool is None:
            self._pool = g.pool()
        return g, sx, views, out_embeds, out_cache
