"""Shared prompt state: each voice's prompt is solved once and shared read-only.

A voice prompt's initial state (encoder + CFM caches of ``Flow.setup_cache``, prompt features)
costs a full flow solve. Every new stream of the same voice starts from the same state, so
``PromptStateCache`` keeps it in a bounded LRU keyed by ``(prompt_cache_id, wav digest)``;
``acquire`` returns a lease on the shared object (never a copy). Streams must treat it as
read-only (``FlowCache`` is immutable and ``Flow.inference_chunk`` returns new caches);
``verify`` re-checks a stored fingerprint to catch accidental in-place writes in tests.
Only entries nobody holds a lease on are evicted; when every entry is held the cache
overflows its bound rather than drop a live state (logged once).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Generic, Hashable, TypeVar

import torch

__all__ = ["PromptStateCache", "PromptLease", "prompt_key"]

log = logging.getLogger(__name__)
S = TypeVar("S")


def prompt_key(wav: torch.Tensor | bytes, sample_rate: int, prompt_cache_id: str | None = None) -> tuple:
    """Key of a voice prompt: its id (if any) and a digest of the waveform and rate."""
    h = hashlib.sha256()
    if isinstance(wav, torch.Tensor):
        t = wav.detach().to("cpu", torch.float32).contiguous()
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    else:
        h.update(bytes(wav))
    h.update(str(int(sample_rate)).encode())
    return (prompt_cache_id, h.hexdigest())


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def fingerprint(obj: Any) -> tuple:
    """Cheap content fingerprint: shape and float64 sums of every tensor inside."""
    return tuple((tuple(t.shape), float(t.double().sum()), float(t.double().abs().sum())) for t in _tensors(obj))


@dataclass
class _Entry(Generic[S]):
    state: S
    leases: int = 0
    fingerprint: tuple = ()


class PromptLease(Generic[S]):
    """A stream's hold on a shared prompt state; release it (or use ``with``) when the stream ends."""

    def __init__(self, cache: "PromptStateCache[S]", key: Hashable, state: S):
        self._cache, self.key, self.state = cache, key, state
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._cache._release(self.key)

    def __enter__(self) -> S:
        return self.state

    def __exit__(self, *exc) -> None:
        self.release()


class PromptStateCache(Generic[S]):
    """Bounded LRU of solved prompt states (``capacity`` unleased entries at most)."""

    def __init__(self, capacity: int = 1, check: bool = False):
        if capacity < 1:
            raise ValueError(f"prompt state cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.check = check
        self._entries: OrderedDict[Hashable, _Entry[S]] = OrderedDict()
        self._lock = threading.Lock()
        self.solves = 0
        self._warned = False

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def acquire(self, key: Hashable, solve: Callable[[], S]) -> PromptLease[S]:
        """Lease the state for ``key``, solving it with ``solve()`` only if it is not cached."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                entry.leases += 1
                return PromptLease(self, key, entry.state)
        state = solve()           # outside the lock: a solve is long; a racing duplicate is harmless
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.solves += 1
                entry = _Entry(state, 0, fingerprint(state) if self.check else ())
                self._entries[key] = entry
            entry.leases += 1
            self._entries.move_to_end(key)
            self._evict()
            return PromptLease(self, key, entry.state)

    def _release(self, key: Hashable) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.leases = max(0, entry.leases - 1)
                self._evict()

    def _evict(self) -> None:
        while len(self._entries) > self.capacity:
            victim = next((k for k, e in self._entries.items() if e.leases == 0), None)
            if victim is None:
                if not self._warned:
                    self._warned = True
                    log.warning("prompt state cache: all %d entries are in use; exceeding capacity %d",
                                len(self._entries), self.capacity)
                return
            del self._entries[victim]

    def verify(self, key: Hashable) -> bool:
        """True when the shared state still matches its fingerprint (needs ``check=True``)."""
        entry = self._entries[key]
        return not self.check or fingerprint(entry.state) == entry.fingerprint
