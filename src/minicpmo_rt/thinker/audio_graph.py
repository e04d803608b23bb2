"""The streaming audio encoder step as a CUDA-graph replay (the fast path beside
``Thinker.embed_audio_chunk``).

One 1-s chunk is only ~50 encoder frames through 24 Whisper layers: the eager step is
launch-bound. The eager step concatenates the new K/V onto the cache, so its shapes change
with the cache length every chunk; a graph per cache length would need ~30 captures per
stream (~90 ms each on the H200, more than the whole stream's replays save). Here the cache
lives in ONE fixed buffer of ``max_source_positions`` rows per layer (rounded up to a
multiple of 16, ``buffer_rows``): a step writes its n
new K/V rows at ``past + arange(n)`` and attends over the whole buffer under a row mask
(rows < past + n), so one graph per (mel shape, redundancy frames) serves every cache
length. Masked rows get exactly zero weight; the unmasked sum runs over the same keys, so
the result equals the eager step up to the attention kernel's summation order.

The session's cache stays immutable for snapshots: before a replay the cached K/V are copied
into the buffer (skipped when the buffer already holds them: the previous step's output),
and after it the new cache is cloned out. A shape whose capture fails stays eager
(``failures`` keeps the reason). An instance may be shared by every session of one thinker.

Sessions that step together (a duplex batch's commits, ``session.commit_many``) take their audio
steps in one replay (``embed_chunks``): each stream's cache goes into its own row of a batched
buffer, and each row writes and embeds at its own positions, so a second of N conversations is
one encoder pass over N x ~50 frames instead of N launch-bound passes.
"""

from __future__ import annotations

import torch

from . import kernels
from .audio import AudioEncoderCache, avg_pool, chunk_conv_frames, extra_conv_frames
from .model import AudioChunkEmbedding, Thinker
from .staging import HostStaging, staging_on, upload_ints


MASK_ALIGN = 16  # keys per row of an SDPA mask that the fused kernels take without a padded copy
# Batch sizes of ``embed_chunks``' graphs: a group of streams pads to the next (its padding rows embed
# silence at position 0 into their own buffer rows) and larger groups split. A bucket's buffer holds a
# whole encoder cache per row (~150 MB for MiniCPM-o 4.5's 24 layers, in bf16).
CHUNK_BATCHES = (2, 4, 8, 16, 32)


def buffer_rows(max_source_positions: int) -> int:
    """Rows of the fixed K/V buffer: the encoder's positions rounded up to ``MASK_ALIGN``. SDPA's
    fused kernels pad a mask whose key count is not a multiple of 16 (a copy of the broadcast
    mask in every layer); the extra rows are never unmasked."""
    return -(-max_source_positions // MASK_ALIGN) * MASK_ALIGN


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float form SDPA makes of a boolean mask (0 where True, -inf elsewhere), made once
    per step instead of once per layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


@torch.no_grad()
def stream_body(thinker: Thinker, mel: torch.Tensor, cache: AudioEncoderCache | None, prefix_extra: int,
                suffix_extra: int) -> tuple[torch.Tensor, AudioEncoderCache]:
    """``Thinker.embed_audio_chunk`` after its reset decision: mel [1, n_mels, T] on the device."""
    hidden, cache = thinker.apm.stream(mel, cache, prefix_extra, suffix_extra)
    embeds = avg_pool(thinker.audio_projection_layer(hidden), thinker.audio_pool_step)[0]
    return embeds.to(thinker.dtype), cache


def split_attention_usable(thinker: Thinker) -> bool:
    """The graphed steps attend through ``kernels.attention`` (split keys) on CUDA with Triton."""
    return thinker.device.type == "cuda" and kernels.usable_on(thinker.apm.conv1.weight)


@torch.no_grad()
def buffered_stream_body(thinker: Thinker, mel: torch.Tensor, buf: torch.Tensor, rows: torch.Tensor,
                         mask: torch.Tensor, prefix_extra: int, suffix_extra: int,
                         split_attention: bool = False) -> torch.Tensor:
    """``stream_body`` over a fixed cache buffer (capture-safe: no shape depends on the cache).

    buf [layers, 2, 1, heads, P, head_dim] holds the cached K/V at rows [0, past); this step's
    n new rows go to ``rows`` (= past + arange(n), long) and every query attends to the rows
    where ``mask`` [1, 1, 1, P] (bool) is True, i.e. rows < past + n. Returns the embeddings.
    ``split_attention``: attend through ``kernels.attention`` instead of SDPA (same keys).
    """
    return batched_stream_body(thinker, mel, buf, rows, mask, prefix_extra, suffix_extra, split_attention)[0]


@torch.no_grad()
def batched_stream_body(thinker: Thinker, mels: torch.Tensor, buf: torch.Tensor, rows: torch.Tensor,
                        mask: torch.Tensor, prefix_extra: int, suffix_extra: int,
                        split_attention: bool = False) -> torch.Tensor:
    """``buffered_stream_body`` of B streams at once (capture-safe), each continuing its OWN cache: mels
    [B, n_mels, T] (one chunk shape and trim for all), buf [layers, 2, B, heads, P, head_dim] holding row b's
    cache at [0, past_b), ``rows`` long [B, n] (= past_b + arange(n), where row b's new K/V go and which
    positions it embeds) and ``mask`` [B, 1, 1, P] (row b: rows < past_b + n). Returns [B, n // pool, H].
    With one row (or ``rows`` [n]) it is ``buffered_stream_body``."""
    apm = thinker.apm
    return _buffered_layers(thinker, apm.trim_extra(apm.conv_frames(mels), prefix_extra, suffix_extra),
                            buf, rows, mask, split_attention)


def _buffered_layers(thinker: Thinker, h: torch.Tensor, buf: torch.Tensor, rows: torch.Tensor,
                     mask: torch.Tensor, split_attention: bool = False) -> torch.Tensor:
    """Conv frames h [B, n, d] at positions ``rows`` (long [n], or [B, n] per batch row) through the layers
    over the fixed buffer (new K/V written at ``rows``, attention where ``mask``), then the final
    LayerNorm, the projection and the pooling: [B, n // pool, H]."""
    apm = thinker.apm
    table = apm.embed_positions.weight
    # upstream repeats the last learned position past the table (unreachable before a reset)
    h = h + table[rows.clamp_max(table.shape[0] - 1)].to(h.dtype)
    bias = last = None
    if split_attention:
        B, n = h.shape[0], h.shape[1]
        # the mask is a prefix of rows per batch row: its last live row, for every query
        last = (mask.reshape(B, -1).sum(-1) - 1).to(torch.int32)[:, None].expand(B, n).contiguous()
    else:
        bias = additive_mask(mask, h.dtype)
    for i, layer in enumerate(apm.layers):
        h, _, _ = layer(h, (buf[i, 0], buf[i, 1]), bias, rows, last)
    hidden = apm.layer_norm(h)
    return avg_pool(thinker.audio_projection_layer(hidden), thinker.audio_pool_step).to(thinker.dtype)


@torch.no_grad()
def forked_stream_body(thinker: Thinker, mels: torch.Tensor, mel_valid: torch.Tensor, buf: torch.Tensor,
                       rows: torch.Tensor, mask: torch.Tensor, prefix_extra: int,
                       split_attention: bool = False) -> torch.Tensor:
    """Several chunks that each continue ONE cache, in one batch (capture-safe).

    mels [B, n_mels, T] are the chunks' mel frames, zero-padded at the end; ``mel_valid``
    [B, 1, T] (float, 1 on a row's real frames) zeroes conv1's output past each row's end,
    which is exactly the zero padding conv2 sees in the row's own step. buf [layers, 2, B,
    heads, P, head_dim] holds the shared cache at rows [0, past) in every batch row; the new
    K/V of frame j go to row ``rows[j]`` (= past + j) and batch row b attends where
    ``mask[b]`` [1, 1, P] is True (rows < past + n_b). Frames past a row's n_b are computed
    but never attended to by its real frames, so each row's first n_b // pool embeddings equal
    its own step's. Returns [B, n // pool, H]; every row has the same prefix trim.
    """
    apm = thinker.apm
    h = apm.conv_frames(mels, mel_valid)
    front = extra_conv_frames(prefix_extra)
    return _buffered_layers(thinker, h[:, front:front + rows.shape[0]], buf, rows, mask, split_attention)


def fork_batch_inputs(mels: list[torch.Tensor], prefix_extras: list[int], suffix_extras: list[int],
                      width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Padded mels [B, n_mels, width], their valid-frame mask [B, 1, width] and each row's conv
    frames after the trims (``chunk_conv_frames``)."""
    width = width or max(int(m.shape[-1]) for m in mels)
    x = mels[0].new_zeros(len(mels), mels[0].shape[0], width)
    valid = mels[0].new_zeros(len(mels), 1, width)
    for b, m in enumerate(mels):
        x[b, :, :m.shape[-1]] = m
        valid[b, :, :m.shape[-1]] = 1
    n = [chunk_conv_frames(int(m.shape[-1]), p, s) for m, p, s in zip(mels, prefix_extras, suffix_extras)]
    return x, valid, n


@torch.no_grad()
def embed_forks_eager(thinker: Thinker, mels: list[torch.Tensor], cache: AudioEncoderCache | None,
                      prefix_extra: int, suffix_extras: list[int], split_attention: bool = False) -> list[torch.Tensor]:
    """``forked_stream_body`` on freshly built buffers (any device; the reference the graphed
    ``AudioGraphs.embed_forks`` is tested against, and its fallback)."""
    apm = thinker.apm
    a = apm.layers[0].self_attn
    x, valid, n = fork_batch_inputs([m.to(thinker.device) for m in mels], [prefix_extra] * len(mels), suffix_extras)
    past = cache.length if cache is not None else 0
    P = past + max(n)
    B = len(mels)
    buf = torch.zeros(len(apm.layers), 2, B, a.num_heads, P, a.head_dim, dtype=thinker.dtype, device=thinker.device)
    if past:
        for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
            buf[i, 0, :, :, :past] = k
            buf[i, 1, :, :, :past] = v
    rows = torch.arange(past, P, device=thinker.device)
    mask = torch.arange(P, device=thinker.device)[None] < torch.tensor([past + k for k in n],
                                                                        device=thinker.device)[:, None]
    out = forked_stream_body(thinker, x, valid, buf, rows, mask[:, None, None, :], prefix_extra, split_attention)
    return [out[b, :n[b] // thinker.audio_pool_step] for b in range(B)]


def chunk_batch_inputs(thinker: Thinker, caches: list[AudioEncoderCache | None], P: int, n: int, B: int | None = None,
                       staging: HostStaging | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """For ``batched_stream_body``: rows [B, n] (past_b + arange(n)), mask [B, 1, 1, P] (rows < past_b + n) and
    each stream's past; rows past ``len(caches)`` (padding) start at position 0. ``staging``: the pasts go up
    through it (pinned), since a copy from pageable memory syncs the stream first: behind a duplex second's
    vision encoder the commits' audio step waited for it."""
    pasts = [c.length if c is not None else 0 for c in caches]
    B = B or len(caches)
    past = upload_ints(staging, pasts + [0] * (B - len(caches)), thinker.device)
    rows = past[:, None] + torch.arange(n, device=thinker.device)[None]
    mask = (torch.arange(P, device=thinker.device)[None] < (past + n)[:, None])[:, None, None]
    return rows, mask, pasts


def fill_rows(buf: torch.Tensor, caches: list[AudioEncoderCache | None]) -> None:
    """Each stream's cache into its row of the batched buffer [layers, 2, B, heads, P, head_dim] (rows
    [0, past_b)), in one launch."""
    dst, src = [], []
    for b, c in enumerate(caches):
        for i, (k, v) in enumerate(zip(c.keys, c.values) if c is not None else ()):
            dst += [buf[i, 0, b:b + 1, :, :c.length], buf[i, 1, b:b + 1, :, :c.length]]
            src += [k, v]
    if dst:
        torch._foreach_copy_(dst, src)


def cut_caches(buf: torch.Tensor, pasts: list[int], n: int) -> list[AudioEncoderCache]:
    """Each stream's new cache (its first past_b + n buffer rows), copied out of the batched buffer."""
    out = []
    for b, past in enumerate(pasts):
        kv = buf[:, :, b:b + 1, :, :past + n].clone()
        out.append(AudioEncoderCache(tuple(kv[:, 0].unbind(0)), tuple(kv[:, 1].unbind(0))))
    return out


@torch.no_grad()
def embed_chunks_eager(thinker: Thinker, mels: list[torch.Tensor], caches: list[AudioEncoderCache | None],
                       prefix_extra: int, suffix_extra: int, split_attention: bool = False
                       ) -> list[AudioChunkEmbedding]:
    """``batched_stream_body`` on freshly built buffers: each stream's step on its own cache, mels of one
    shape (any device; the reference the graphed ``AudioGraphs.embed_chunks`` is tested against). A stream
    whose cache is full resets it first, as ``Thinker.embed_audio_chunk`` does."""
    apm = thinker.apm
    a = apm.layers[0].self_attn
    resets = [apm.needs_reset(c, int(m.shape[-1])) for m, c in zip(mels, caches)]
    caches = [None if r else c for r, c in zip(resets, caches)]
    n = chunk_conv_frames(int(mels[0].shape[-1]), prefix_extra, suffix_extra)
    P = max(c.length if c is not None else 0 for c in caches) + n
    B = len(mels)
    buf = torch.zeros(len(apm.layers), 2, B, a.num_heads, P, a.head_dim, dtype=thinker.dtype, device=thinker.device)
    rows, mask, pasts = chunk_batch_inputs(thinker, caches, P, n)
    fill_rows(buf, caches)
    x = torch.stack([m.to(thinker.device) for m in mels])
    out = batched_stream_body(thinker, x, buf, rows, mask, prefix_extra, suffix_extra, split_attention)
    caches = cut_caches(buf, pasts, n)
    return [AudioChunkEmbedding(out[b], cache, r) for b, (cache, r) in enumerate(zip(caches, resets))]


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
        # forks (``embed_forks``): one buffer per batch size, graphs keyed by (B, width, n, prefix)
        self._fork_bufs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # B -> (buf, mask)
        self._fork_graphs: dict[tuple, tuple] = {}
        # several streams' steps (``embed_chunks``): the forks' buffers, graphs keyed by (B, mel shape, trims)
        self._chunk_graphs: dict[tuple, tuple] = {}
        self.split_attention = split_attention_usable(thinker)
        # the batched steps' per-row positions go up pinned: a pageable copy would wait for the queued work
        self._staging = staging_on(thinker.device, slots=8)

    def _eager(self, x, cache, prefix_extra, suffix_extra, reset) -> AudioChunkEmbedding:
        self._resident = ()
        embeds, cache = stream_body(self.thinker, x, cache, prefix_extra, suffix_extra)
        return AudioChunkEmbedding(embeds, cache, reset)

    def _buffers(self) -> None:
        if self._buf is not None:
            return
        apm, th = self.thinker.apm, self.thinker
        a = apm.layers[0].self_attn
        P = buffer_rows(apm.max_source_positions)
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
        held = self._held(self._graphs, key, lambda: self._capture(x, n_conv, prefix_extra, suffix_extra))
        if held is None:    # this shape stays eager
            return self._eager(x, cache, prefix_extra, suffix_extra, reset)
        g, sx, rows, out = held
        sx.copy_(x)
        torch.add(self._arange[:n_conv], past, out=rows)
        g.replay()
        kv = self._buf[:, :, :, :, :past + n_conv].clone()
        new = AudioEncoderCache(tuple(kv[:, 0].unbind(0)), tuple(kv[:, 1].unbind(0)))
        self._resident = (new, cache) if cache is not None else (new,)
        return AudioChunkEmbedding(out.clone(), new, reset)

    @torch.no_grad()
    def embed_forks(self, mels: list[torch.Tensor], cache: AudioEncoderCache | None, prefix_extra: int,
                    suffix_extras: list[int]) -> list[torch.Tensor] | None:
        """The embeddings of several chunks that each continue ``cache`` (forks: none is kept), in
        one batch (``forked_stream_body``): a graph replay on CUDA, eager elsewhere. None when
        they cannot share one: fewer than two, a chunk too short for one embedding, or one that
        would reset the cache (the caller then runs one step each)."""
        th = self.thinker
        B = len(mels)
        if B < 2 or (cache is not None and cache.keys[0].dtype != th.dtype):
            return None
        if any(th.apm.needs_reset(cache, int(m.shape[-1])) for m in mels):
            return None
        x, valid, n = fork_batch_inputs(mels, [prefix_extra] * B, suffix_extras)
        if min(n) < th.audio_pool_step:
            return None
        if th.device.type != "cuda":
            return embed_forks_eager(th, mels, cache, prefix_extra, suffix_extras)
        width, n_max = int(x.shape[-1]), max(n)
        key = (B, width, n_max, int(prefix_extra))
        if key in self.failures:
            return None
        buf, mask = self._batch_buffers(B)
        self._buffers()
        held = self._held(self._fork_graphs, key,
                          lambda: self._capture_forks(buf, mask, x, valid, n_max, prefix_extra))
        if held is None:    # these forks run eagerly
            return None
        g, sx, svalid, rows, out = held
        past = cache.length if cache is not None else 0
        if past:
            kv = torch.stack([torch.stack([k, v]) for k, v in zip(cache.keys, cache.values)])  # [L, 2, 1, h, past, d]
            buf[:, :, :, :, :past].copy_(kv)  # broadcast over the batch rows
        sx.copy_(x)
        svalid.copy_(valid)
        torch.add(self._arange[:n_max], past, out=rows)
        ends = upload_ints(self._staging, [past + k for k in n], th.device)
        torch.lt(self._arange[None], ends[:, None], out=mask[:, 0, 0])
        g.replay()
        return [out[b, :n[b] // th.audio_pool_step].clone() for b in range(B)]

    def _held(self, graphs: dict, key: tuple, capture) -> tuple | None:
        """``graphs[key]``, captured now (``capture()``) if it is not held yet; None when the capture fails (an
        op that syncs with the host): ``failures`` keeps the reason, and callers skip that key from then on."""
        if key not in graphs:
            try:
                graphs[key] = capture()
            except Exception as e:
                self.failures[key] = f"{type(e).__name__}: {e}"
                torch.cuda.synchronize()
                return None
        return graphs[key]

    def _batch_buffers(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batched buffer [layers, 2, B, heads, P, head_dim] and row mask [B, 1, 1, P] of B rows (forks and
        several streams' steps share them: every replay first writes the rows it reads)."""
        if B not in self._fork_bufs:
            th, apm = self.thinker, self.thinker.apm
            a, P = apm.layers[0].self_attn, buffer_rows(apm.max_source_positions)
            self._fork_bufs[B] = (
                torch.zeros(len(apm.layers), 2, B, a.num_heads, P, a.head_dim, dtype=th.dtype, device=th.device),
                torch.zeros(B, 1, 1, P, dtype=torch.bool, device=th.device))
        return self._fork_bufs[B]

    @torch.no_grad()
    def embed_chunks(self, mels: list[torch.Tensor], caches: list[AudioEncoderCache | None],
                     prefix_extras: list[int], suffix_extras: list[int]) -> list[AudioChunkEmbedding | None]:
        """Several streams' steps, each ``embed_chunk(mels[i], caches[i], ...)``: streams whose chunks share a
        shape and trims run together, one graph replay per group of up to ``CHUNK_BATCHES[-1]`` (padded to a
        bucket) on CUDA, one eager batch elsewhere (``embed_chunks_eager``). A stream gets None where it cannot
        share one (the caller runs its own step): alone in its group, a chunk too short for one embedding, a
        cache of another dtype, a failed capture."""
        th = self.thinker
        out: list[AudioChunkEmbedding | None] = [None] * len(mels)
        groups: dict[tuple, list[int]] = {}
        for i, (mel, cache, prefix, suffix) in enumerate(zip(mels, caches, prefix_extras, suffix_extras)):
            if chunk_conv_frames(int(mel.shape[-1]), prefix, suffix) < th.audio_pool_step or \
                    (cache is not None and cache.keys[0].dtype != th.dtype):
                continue
            groups.setdefault((tuple(mel.shape), mel.dtype, int(prefix), int(suffix)), []).append(i)
        most = CHUNK_BATCHES[-1]
        for (_, _, prefix, suffix), idx in groups.items():
            for j in range(0, len(idx), most):
                part = idx[j:j + most]
                if len(part) < 2:
                    continue
                got = self._embed_group([mels[i] for i in part], [caches[i] for i in part], prefix, suffix)
                for i, r in zip(part, got or ()):
                    out[i] = r
        return out

    def _embed_group(self, mels, caches, prefix_extra: int, suffix_extra: int) -> list[AudioChunkEmbedding] | None:
        th, apm = self.thinker, self.thinker.apm
        if th.device.type != "cuda":
            return embed_chunks_eager(th, mels, caches, prefix_extra, suffix_extra)
        B = len(mels)
        Bb = next(b for b in CHUNK_BATCHES if b >= B)
        n_mel = int(mels[0].shape[-1])
        resets = [apm.needs_reset(c, n_mel) for c in caches]
        caches = [None if r else c for r, c in zip(resets, caches)]
        n = chunk_conv_frames(n_mel, prefix_extra, suffix_extra)
        key = ("chunks", Bb, tuple(mels[0].shape), mels[0].dtype, prefix_extra, suffix_extra)
        if key in self.failures:
            return None
        buf, mask = self._batch_buffers(Bb)
        self._buffers()
        held = self._held(self._chunk_graphs, key,
                          lambda: self._capture_chunks(buf, mask, Bb, mels[0], n, prefix_extra, suffix_extra))
        if held is None:    # these streams step one by one
            return None
        g, sx, rows, out = held
        # every stream's cache into its buffer row, its chunk and positions, then one replay
        fill_rows(buf, caches)
        sx[:B].copy_(torch.stack(mels).to(th.device, non_blocking=True))
        new_rows, new_mask, pasts = chunk_batch_inputs(th, caches, buf.shape[4], n, Bb, self._staging)
        rows.copy_(new_rows)
        mask.copy_(new_mask)
        g.replay()
        return [AudioChunkEmbedding(out[b].clone(), cache, r)
                for b, (cache, r) in enumerate(zip(cut_caches(buf, pasts, n), resets))]

    def _capture_chunks(self, buf, mask, B: int, mel: torch.Tensor, n: int, prefix_extra: int, suffix_extra: int):
        th = self.thinker
        sx = torch.zeros(B, *mel.shape, dtype=mel.dtype, device=th.device)
        P = buf.shape[4]
        rows = self._arange[P - n:][None].repeat(B, 1)  # warm-up and capture write past every real cache
        mask.copy_((self._arange >= P - n).expand(B, P)[:, None, None])
        g, out = self._graph(lambda: batched_stream_body(th, sx, buf, rows, mask, prefix_extra, suffix_extra,
                                                         self.split_attention))
        return g, sx, rows, out

    def _capture_forks(self, buf, mask, x, valid, n_max, prefix_extra):
        th = self.thinker
        sx, svalid = x.clone(), valid.clone()
        P = buf.shape[4]
        rows = self._arange[P - n_max:].clone()  # warm-up and capture write past every real cache
        mask.copy_((self._arange >= P - n_max).expand_as(mask[:, 0, 0])[:, None, None])
        g, out = self._graph(lambda: forked_stream_body(th, sx, svalid, buf, rows, mask, prefix_extra,
                                                        self.split_attention))
        return g, sx, svalid, rows, out

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
        g, out = self._graph(lambda: buffered_stream_body(th, sx, self._buf, rows, self._mask, prefix_extra,
                                                          suffix_extra, self.split_attention))
        self._mask.copy_(saved)
        return g, sx, rows, out

    def _graph(self, body):
        """Warm ``body`` up on a side stream, then capture it; returns (graph, its output)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        # One pool for every shape: outputs are cloned right after each replay, so a later
        # graph may reuse an earlier one's memory.
        with torch.cuda.graph(g, pool=self._pool):
            out = body()
        if self._pool is None:
            self._pool = g.pool()
        self.captures += 1
        return g, out
