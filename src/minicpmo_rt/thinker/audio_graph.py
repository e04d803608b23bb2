"""The streaming audio encoder step as a CUDA-graph replay (the fast path beside
``Thinker.embed_audio_chunk``).

One 1-s chunk is only ~50 encoder frames through 24 Whisper layers: the eager step is
launch-bound. The eager step concatenates the new K/V onto the cache, so its shapes change
with the cache length every chunk; a graph per cache length would need ~30 captures per
stream (~90 ms each on the H200, more than the whole stream's replays save). Here the cache
lives in ONE fixed buffer of ``max_source_positions`` rows per layer: a step writes its n
new K/V rows at ``past + arange(n)`` and attends over the whole buffer under a row mask
(rows < past + n), so one graph per (mel shape, redundancy frames) serves every cache
length. Masked rows get exactly zero weight; the unmasked sum runs over the same keys, so
the result equals the eager step up to the attention kernel's summation order.

The session's cache stays immutable for snapshots: before a replay the cached K/V are copied
into the buffer (skipped when the buffer already holds them: the previous step's output),
and after it the new cache is cloned out. A shape whose capture fails stays eager
(``failures`` keeps the reason). An instance may be shared by every session of one thinker.
"""

from __future__ import annotations

import torch

from .audio import AudioEncoderCache, avg_pool, chunk_conv_frames
from .model import AudioChunkEmbedding, Thinker


@torch.no_grad()
def stream_body(thinker: Thinker, mel: torch.Tensor, cache: AudioEncoderCache | None, prefix_extra: int,
                suffix_extra: int) -> tuple[torch.Tensor, AudioEncoderCache]:
    """``Thinker.embed_audio_chunk`` after its reset decision: mel [1, n_mels, T] on the device."""
    hidden, cache = thinker.apm.stream(mel, cache, prefix_extra, suffix_extra)
    embeds = avg_pool(thinker.audio_projection_layer(hidden), thinker.audio_pool_step)[0]
    return embeds.to(thinker.dtype), cache


@torch.no_grad()
def buffered_stream_body(thinker: Thinker, mel: torch.Tensor, buf: torch.Tensor, rows: torch.Tensor,
                         mask: torch.Tensor, prefix_extra: int, suffix_extra: int) -> torch.Tensor:
    """``stream_body`` over a fixed cache buffer (capture-safe: no shape depends on the cache).

    buf [layers, 2, 1, heads, P, head_dim] holds the cached K/V at rows [0, past); this step's
    n new rows go to ``rows`` (= past + arange(n), long) and every query attends to the rows
    where ``mask`` [1, 1, 1, P] (bool) is True, i.e. rows < past + n. Returns the embeddings.
    """
    apm = thinker.apm
    h = apm.trim_extra(apm.conv_frames(mel), prefix_extra, suffix_extra)
    table = apm.embed_positions.weight
    # upstream repeats the last learned position past the table (unreachable before a reset)
    h = h + table.index_select(0, rows.clamp_max(table.shape[0] - 1)).to(h.dtype)
    for i, layer in enumerate(apm.layers):
        h, _, _ = layer(h, (buf[i, 0], buf[i, 1]), mask, rows)
    hidden = apm.layer_norm(h)
    return avg_pool(thinker.audio_projection_layer(hidden), thinker.audio_pool_step)[0].to(thinker.dtype)


class AudioGraphs:
    """``embed_chunk(mel, cache, prefix_extra, suffix_extra)`` with ``Thinker.embed_audio_chunk``'s contract."""

    def __init__(self, thinker: Thinker):
        self.thinker = thinker
        # (mel shape, dtype, prefix, suffix) -> (graph, static mel, static rows, output embeddings)
        self._graphs: dict[tuple, tuple] = {}
        self._pool = None
        self._buf: torch.Tensor | None = None     # [layers, 2, 1, heads, P, head_dim]
        self._mask: torch.Tensor | None = None    # [1, 1, 1, P] bool
        self._arange: torch.Tensor | None = None  # [P] long
        # caches whose rows the buffer holds: the last step's output and, as its prefix, its input
        # (forked units all start from one input cache: no re-copy between them)
        self._resident: tuple[AudioEncoderCache | None, ...] = ()
        self.failures: dict[tuple, str] = {}
        self.captures = 0

    def _eager(self, x, cache, prefix_extra, suffix_extra, reset) -> AudioChunkEmbedding:
        self._resident = ()
        embeds, cache = stream_body(self.thinker, x, cache, prefix_extra, suffix_extra)
        return AudioChunkEmbedding(embeds, cache, reset)

    def _buffers(self) -> None:
        if self._buf is not None:
            return
        apm, th = self.thinker.apm, self.thinker
        a = apm.layers[0].self_attn
        P = apm.max_source_positions
        self._buf = torch.zeros(len(apm.layers), 2, 1, a.num_heads, P, a.head_dim, dtype=th.dtype, device=th.device)
        self._mask = torch.zeros(1, 1, 1, P, dtype=torch.bool, device=th.device)
        self._arange = torch.arange(P, device=th.device)

    @torch.no_grad()
    def embed_chunk(self, mel: torch.Tensor, cache: AudioEncoderCache | None, prefix_extra: int,
                    suffix_extra: int) -> AudioChunkEmbedding:
        th = self.thinker
        n_mel = int(mel.shape[-1])
        n_conv = chunk_conv_frames(n_mel, prefix_extra, suffix_extra)
        if n_conv < th.audio_pool_step or th.device.type != "cuda":
            self._resident = ()
            return th.embed_audio_chunk(mel, cache, prefix_extra, suffix_extra)
        reset = th.apm.needs_reset(cache, n_mel)
        if reset:
            cache = None
        x = mel[None].to(th.device)
        key = (tuple(x.shape), x.dtype, int(prefix_extra), int(suffix_extra))
        if key in self.failures or (cache is not None and cache.keys[0].dtype != th.dtype):
            return self._eager(x, cache, prefix_extra, suffix_extra, reset)
        self._buffers()
        past = cache.length if cache is not None else 0
        if cache is not None and not any(cache is r for r in self._resident):
            torch._foreach_copy_([self._buf[i, j, :, :, :past] for i in range(len(cache.keys)) for j in (0, 1)],
                                 [t for kv in zip(cache.keys, cache.values) for t in kv])
        torch.lt(self._arange, past + n_conv, out=self._mask[0, 0, 0])
        try:
            if key not in self._graphs:
                self._graphs[key] = self._capture(x, n_conv, prefix_extra, suffix_extra)
        except Exception as e:  # an op that syncs with the host: this shape stays eager
            self.failures[key] = f"{type(e).__name__}: {e}"
            torch.cuda.synchronize()
            return self._eager(x, cache, prefix_extra, suffix_extra, reset)
        g, sx, rows, out = self._graphs[key]
        sx.copy_(x)
        torch.add(self._arange[:n_conv], past, out=rows)
        g.replay()
        kv = self._buf[:, :, :, :, :past + n_conv].clone()
        new = AudioEncoderCache(tuple(kv[:, 0].unbind(0)), tuple(kv[:, 1].unbind(0)))
        self._resident = (new, cache) if cache is not None else (new,)
        return AudioChunkEmbedding(out.clone(), new, reset)

    def _capture(self, x, n_conv, prefix_extra, suffix_extra):
        th = self.thinker
        sx = x.clone()
        rows = torch.empty(n_conv, dtype=torch.long, device=x.device)
        # Warm-up and capture write rows past the end of every real cache (the last n rows of the
        # buffer) under a mask that keeps only them: the cached rows [0, past) stay untouched.
        P = self._buf.shape[4]
        rows.copy_(self._arange[P - n_conv:])
        saved = self._mask.clone()
        self._mask.copy_(self._arange >= P - n_conv)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                buffered_stream_body(th, sx, self._buf, rows, self._mask, prefix_extra, suffix_extra)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        # One pool for every chunk shape: outputs are cloned right after each replay, so a
        # later graph may reuse an earlier one's memory.
        with torch.cuda.graph(g, pool=self._pool):
            out = buffered_stream_body(th, sx, self._buf, rows, self._mask, prefix_extra, suffix_extra)
        if self._pool is None:
            self._pool = g.pool()
        self._mask.copy_(saved)
        self.captures += 1
        return g, sx, rows, out
