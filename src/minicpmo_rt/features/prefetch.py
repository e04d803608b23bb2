"""Parallel decoding of a known, increasing list of frames ahead of use (``FramePrefetcher``).

``EasyComSession.plan_prefetch`` splits the wanted frames into ``DecodeChunk``s that decode
independently (segment boundaries, IDR keyframes of ``video.index_segment``); worker threads
decode chunks into per-chunk queues that the consumer reads in frame order.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InputError
from .video import _DecordReader, _PyAVReader, _SeekingPyAVReader, _Stopped

if TYPE_CHECKING:
    from .easycom import EasyComSession, Segment


DECODE_WORKERS_ENV = "MINICPMO_RT_DECODE_WORKERS"


def default_decode_workers() -> int:
    """Prefetch worker threads: ``$MINICPMO_RT_DECODE_WORKERS`` or max(1, min(8, cpus // 2))."""
    raw = os.environ.get(DECODE_WORKERS_ENV)
    if raw is None or raw.strip() == "":
        return max(1, min(8, (os.cpu_count() or 2) // 2))
    try:
        n = int(raw.strip())
    except ValueError:
        n = 0
    if n < 1:
        raise InputError(f"{DECODE_WORKERS_ENV}={raw!r}: must be a positive integer (frame-decoding worker "
                         f"threads); fix it or unset it for the default max(1, min(8, cpus // 2))")
    return n


@dataclass(frozen=True)
class DecodeChunk:
    """Wanted frames of one segment that one worker decodes on its own.

    ``start`` is the local index decoding begins at: 0 (open the segment and decode from its
    first frame, exactly as the sequential reader) or a keyframe's, then ``start_pts`` is that
    keyframe's pts to seek to.
    """

    segment: int
    start: int
    start_pts: int | None
    indices: tuple[int, ...]  # global frame indices, increasing


class _WorkerDecoder:
    """One worker thread's readers (PyAV containers are never shared across threads)."""

    def __init__(self, session: "EasyComSession", stop: "threading.Event", on_fallback):
        self.timeline, self.decoder, self.threads = session.timeline, session.decoder, session.decoder_threads
        self._index = session._index
        self._stop, self._on_fallback = stop, on_fallback
        self._seeker: _SeekingPyAVReader | None = None  # kept open across this worker's chunks of one segment

    def _drop_seeker(self) -> None:
        if self._seeker is not None:
            self._seeker.close()
            self._seeker = None

    def frames(self, chunk: DecodeChunk):
        """Yield the chunk's frames (cropped, contiguous) in order; each is decoded on ``next``."""
        seg = self.timeline.segments[chunk.segment]
        crop = self.timeline.crop_right
        raw = self._raw(chunk, seg)
        try:
            for img in raw:
                if crop:
                    img = img[:, -crop:]
                yield np.ascontiguousarray(img)
        finally:
            raw.close()  # closes its reader now, also when the consumer stopped early

    def _raw(self, chunk: DecodeChunk, seg: Segment):
        locals_ = [i - seg.frame_offset for i in chunk.indices]
        if self.decoder == "decord":  # decord seeks by itself: one chunk per segment
            r = _DecordReader(seg.video, self.threads)
            try:
                for local in locals_:
                    if self._stop.is_set():
                        raise _Stopped
                    yield r.read(local)
            finally:
                r.close()
            return
        done = 0
        if chunk.start_pts is not None:
            try:
                if self._seeker is None or self._seeker.path != seg.video:
                    self._drop_seeker()
                    self._seeker = _SeekingPyAVReader(seg.video, self.threads, self._index[chunk.segment],
                                                      self._stop)
                self._seeker.seek(chunk.start_pts, chunk.start)
                for local in locals_:
                    img = self._seeker.read(local)
                    done += 1
                    yield img
                return
            except _Stopped:
                raise
            except Exception:
                # the seek gave other frames than the table promised (or failed): the frames
                # already served had the right pts; the rest come from the segment's start
                self._drop_seeker()
                self._on_fallback()
        r = _PyAVReader(seg.video, self.threads, self._stop)
        try:
            for local in locals_[done:]:
                yield r.read(local)
        finally:
            r.close()

    def close(self) -> None:
        self._drop_seeker()


class FramePrefetcher:
    """Decodes a known, increasing sequence of frames ahead of use on ``workers`` threads.

    The frames are planned into ``DecodeChunk``s (``EasyComSession.plan_prefetch``). Each worker
    takes the next chunk not yet started and decodes it into that chunk's own queue; the consumer
    (``take``) reads the queues strictly in frame order. A worker starts chunk k only while
    k < (consumer's chunk) + workers and holds a free slot of the chunk (``depth`` of them) before
    decoding each frame, so at most ``workers * depth`` decoded frames are in flight. Each worker
    has its own readers, and the main thread may still read any other frame (replays) through its
    own. PyAV releases the GIL while decoding, so workers decode in parallel with each other and
    with the model; each worker's FFmpeg decoder still uses ``decoder_threads`` threads of its
    own. An exception in a worker is re-raised by ``take`` for the frame it broke.
    """

    def __init__(self, session: "EasyComSession", chunks: list[DecodeChunk], depth: int, workers: int):
        self.chunks = chunks
        self.indices = [i for c in chunks for i in c.indices]
        self.workers = max(1, min(workers, len(chunks)))
        self._session = session
        self._pos = 0  # into indices
        self._chunk, self._in_chunk = 0, 0  # consumer's chunk and its position in it
        # a chunk's queue is bounded by its slots (not maxsize) so that a worker waits for room
        # *before* decoding the next frame: a frame held while waiting would exceed the bound
        self._queues: list[queue.Queue] = [queue.Queue() for _ in chunks]
        self._slots = [threading.Semaphore(max(1, depth)) for _ in chunks]
        self._next = 0  # next chunk a worker starts
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"frame-prefetch-{k}", daemon=True)
                         for k in range(self.workers)]
        for t in self._threads:
            t.start()

    def _fallback(self) -> None:
        with self._cond:
            self._session.stats.prefetch_seek_fallbacks += 1

    def _claim(self) -> int | None:
        with self._cond:
            while not self._stop.is_set() and self._next < len(self.chunks) \
                    and self._next >= self._chunk + self.workers:
                self._cond.wait()
            if self._stop.is_set() or self._next >= len(self.chunks):
                return None
            self._next += 1
            return self._next - 1

    def _run(self) -> None:
        dec = _WorkerDecoder(self._session, self._stop, self._fallback)
        k: int | None = None
        try:
            while (k := self._claim()) is not None:
                q, slots = self._queues[k], self._slots[k]
                frames = dec.frames(self.chunks[k])
                try:
                    for idx in self.chunks[k].indices:
                        while not slots.acquire(timeout=0.1):  # room for one more frame of this chunk
                            if self._stop.is_set():
                                return
                        q.put((idx, next(frames), None))
                except _Stopped:
                    return
                except Exception as exc:  # handed to the consumer, raised at this frame
                    q.put((None, None, exc))
                finally:
                    frames.close()
        except BaseException as exc:  # not expected; still reach the consumer rather than hang it
            if k is not None:
                self._queues[k].put((None, None, exc))
            raise
        finally:
            dec.close()

    @property
    def next_index(self) -> int | None:
        return self.indices[self._pos] if self._pos < len(self.indices) else None

    def take(self) -> np.ndarray:
        q = self._queues[self._chunk]
        while True:
            try:
                idx, img, exc = q.get(timeout=0.5)
                break
            except queue.Empty:
                if not any(t.is_alive() for t in self._threads) and q.empty():
                    missing = self.indices[self._pos]
                    self._pos = len(self.indices)
                    raise RuntimeError(f"frame prefetch: every worker exited before frame {missing} "
                                       f"was decoded") from None
        if exc is not None:
            self._pos = len(self.indices)
            self._stop.set()  # nothing more will be taken: let the workers go
            with self._cond:
                self._cond.notify_all()
            raise exc
        assert idx == self.indices[self._pos], (idx, self._pos)
        self._slots[self._chunk].release()
        self._pos += 1
        self._in_chunk += 1
        if self._in_chunk == len(self.chunks[self._chunk].indices):
            with self._cond:  # the window moves: a worker may start chunk + workers
                self._chunk, self._in_chunk = self._chunk + 1, 0
                self._cond.notify_all()
        return img

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        self._queues = []  # drop decoded frames nobody will take
