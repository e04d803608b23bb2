"""A small causal recurrent model that honours the StreamingSession contract (THINKER_API.md).

It lets the extractor's alignment and audit logic be tested, including broken sessions the
audits must catch, without the Thinker. The real-model tests live in test_extract.py.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ToyFingerprint:
    llm_cache_len: int
    llm_checksum: float
    audio_chunk_idx: int
    history_len: int


@dataclass(frozen=True)
class ToyWindow:
    name: str = "toy"
    high_tokens: int = 0
    low_tokens: int = 0


@dataclass(frozen=True)
class ToyPrune:
    commit_index: int
    cache_len_before: int
    tokens_dropped: int


class ToySession:
    dim = 12
    dtype = torch.float32

    def __init__(self, *, broken_restore: bool = False, window_high: int = 0, nondeterministic: bool = False):
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(self.dim, 16, generator=g, dtype=torch.float64)
        self.cache: list[torch.Tensor] = []
        self.chunk_idx = 0
        self.committed_chunks = 0
        self.pruning_events: list[ToyPrune] = []
        self.window = ToyWindow(high_tokens=window_high, low_tokens=max(0, window_high - 2))
        self._in_tx = False
        self._suspended = False
        self._last = torch.zeros(self.dim)
        self.broken_restore = broken_restore
        self.nondeterministic = nondeterministic

    def _token(self, audio: np.ndarray, frame) -> torch.Tensor:
        a = torch.from_numpy(np.asarray(audio, dtype=np.float64))
        if a.numel() == 0:
            raise ValueError("empty audio")
        spec = torch.fft.rfft(a).abs()
        bands = torch.stack([b.mean() for b in torch.tensor_split(spec, 8)])
        img = torch.from_numpy(np.asarray(frame, dtype=np.float64)) / 255.0
        feats = torch.cat([bands, img.mean(dim=(0, 1)), img[: img.shape[0] // 2].mean(dim=(0, 1)),
                           torch.tensor([a.numel() / 16000.0, float(len(self.cache))])])
        tok = torch.tanh(self.w @ feats)
        if self.nondeterministic:
            tok = tok + 1e-3 * torch.randn_like(tok)
        return tok

    def commit(self, audio, frame) -> None:
        self.cache.append(self._token(audio, frame))
        self._last = self._fold()  # read out before pruning, as the real session does
        self.chunk_idx += 1
        self.committed_chunks += 1
        hi = self.window.high_tokens
        if hi and len(self.cache) > hi and not self._suspended:
            drop = len(self.cache) - self.window.low_tokens
            self.pruning_events.append(ToyPrune(self.committed_chunks, len(self.cache), drop))
            self.cache = self.cache[drop:]

    def append_tail(self, audio, frame) -> None:
        if not self._in_tx:
            raise RuntimeError("append_tail outside transaction()")
        self.cache.append(self._token(audio, frame))
        self._last = self._fold()

    def _fold(self) -> torch.Tensor:
        acc = torch.zeros(self.dim, dtype=torch.float64)
        for tok in self.cache:
            acc = torch.tanh(0.7 * acc + tok)
        return acc.float()

    def read_state(self, *, on_device: bool = False) -> torch.Tensor:  # CPU: already 'on device'
        return self._last.clone()

    def snapshot(self):
        return (list(self.cache), self.chunk_idx, self.committed_chunks, copy.copy(self.pruning_events), self._last)

    def restore(self, snap) -> None:
        cache, self.chunk_idx, self.committed_chunks, self.pruning_events, self._last = snap
        self.cache = list(cache)
        if self.broken_restore and self.cache:
            self.cache[-1] = self.cache[-1] + 1e-9

    def fingerprint(self, *, lazy: bool = False) -> ToyFingerprint:
        return ToyFingerprint(len(self.cache), float(sum(float(t.sum()) for t in self.cache)),
                              self.chunk_idx, self.committed_chunks)

    @contextlib.contextmanager
    def pruning_suspended(self):
        prev, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = prev

    @contextlib.contextmanager
    def transaction(self):
        snap = self.snapshot()
        self._in_tx = True
        try:
            with self.pruning_suspended():
                yield
        finally:
            self._in_tx = False
            self.restore(snap)
