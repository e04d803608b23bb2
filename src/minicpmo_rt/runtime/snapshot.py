"""Async output snapshot: a stage publishes its outputs as an immutable snapshot that the
next stage reads while the producer moves on.

A ``Snapshot`` is a frozen (version, items, closed) record; ``publish`` builds a new one and
swaps a single reference under a lock, so a reader holds either the old or the new snapshot,
never a half-updated one, and never blocks the producer for longer than that swap. Readers
keep their own cursor (``SnapshotReader``), so any number of them can follow one publisher.
Items are appended by tuple concatenation (O(n) per publish): fine for a turn's hundreds of
steps or chunks; a stage that publishes many small items should batch them per publish.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Snapshot(Generic[T]):
    version: int
    items: tuple[T, ...]
    closed: bool = False


class SnapshotClosed(RuntimeError):
    """Publish after close: the producer already declared its output complete."""


class SnapshotPublisher(Generic[T]):
    def __init__(self, name: str = "stage"):
        self.name = name
        self._cond = threading.Condition()
        self._snap: Snapshot[T] = Snapshot(0, ())

    def publish(self, *items: T, close: bool = False) -> Snapshot[T]:
        with self._cond:
            old = self._snap
            if old.closed:
                raise SnapshotClosed(f"{self.name}: publish after close")
            self._snap = Snapshot(old.version + 1, old.items + tuple(items), close)
            self._cond.notify_all()
            return self._snap

    def close(self) -> Snapshot[T]:
        return self.publish(close=True)

    def latest(self) -> Snapshot[T]:
        return self._snap  # one reference read: always a whole snapshot

    def wait_newer(self, version: int, timeout: float | None = None) -> Snapshot[T]:
        """The first snapshot with a version above ``version`` (or the current one on timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: self._snap.version > version, timeout)
            return self._snap


class SnapshotReader(Generic[T]):
    """One consumer's cursor over a publisher: ``poll`` returns the items it has not seen."""

    def __init__(self, publisher: SnapshotPublisher[T]):
        self.publisher = publisher
        self.seen = 0
        self.version = 0
        self.closed = False

    def _take(self, snap: Snapshot[T]) -> tuple[T, ...]:
        new = snap.items[self.seen:]
        self.seen, self.version, self.closed = len(snap.items), snap.version, snap.closed
        return new

    def poll(self) -> tuple[T, ...]:
        return self._take(self.publisher.latest())

    def __iter__(self) -> Iterator[T]:
        """Block for new items until the publisher closes (for a consumer on its own thread)."""
        while True:
            snap = self.publisher.wait_newer(self.version)
            yield from self._take(snap)
            if self.closed:
                return
