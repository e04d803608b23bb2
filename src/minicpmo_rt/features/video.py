"""Video decoding for EasyCom segments: sequential and keyframe-seeking PyAV readers, decord,
and the per-segment keyframe table that tells where a seek is safe.

``index_segment`` demuxes a segment's packets without decoding: a frame's local index is the
rank of its pts among all the segment's video packets (presentation order, no constant frame
rate assumed), and a keyframe is a split point only where its bitstream shows an IDR (H.264 /
HEVC; an open-GOP keyframe's leading frames would reference the previous GOP). The seeking
reader verifies every frame's pts against the table and raises ``_SeekMismatch`` otherwise, so
callers fall back to the sequential reader and frames stay bit-identical to it.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError


def _open_av(path: Path):
    import av

    try:
        return av.open(str(path))
    except Exception as exc:  # av.error.* for corrupt or foreign files
        raise InputError(f"{path}: cannot be opened as a video ({type(exc).__name__}: {exc}); "
                         f"the file is corrupt or not an mp4, re-extract it from the EasyCom archive") from exc


class _Stopped(Exception):
    """A prefetch worker was told to stop (``FramePrefetcher.close``) while decoding."""


class _SeekMismatch(Exception):
    """Decoding after a keyframe seek did not yield the expected frames; the caller decodes from the start."""


class _PyAVReader:
    """Sequential decoder; a backwards request reopens the file and decodes forward (no seeks).

    ``stop`` (set by another thread) ends a long forward decode between frames with ``_Stopped``.
    """

    def __init__(self, path: Path, threads: int, stop: "threading.Event | None" = None):
        self.path, self.threads, self._stop = path, threads, stop
        self._open()

    def _open(self) -> None:
        self.container = _open_av(self.path)
        st = self.container.streams.video[0]
        st.thread_type = "AUTO" if self.threads != 1 else "SLICE"
        st.thread_count = max(0, self.threads)
        self._frames = self.container.decode(st)
        self.pos = 0  # index of the next frame the iterator yields

    def _check(self, frame) -> None:
        """Hook for ``_SeekingPyAVReader``: validate a decoded frame before it is counted."""

    def read(self, index: int) -> np.ndarray:
        if index < self.pos:
            self.close()
            self._open()
        try:
            while True:
                if self._stop is not None and self._stop.is_set():
                    raise _Stopped
                frame = next(self._frames)
                self._check(frame)
                self.pos += 1
                if self.pos - 1 == index:
                    return frame.to_ndarray(format="rgb24")
        except StopIteration:
            raise InputError(f"{self.path}: ended after {self.pos} frames while frame {index} was requested; "
                             f"the file is truncated or corrupt") from None
        except (InputError, _Stopped, _SeekMismatch):
            raise
        except Exception as exc:
            raise InputError(f"{self.path}: decoding failed at frame {self.pos} ({type(exc).__name__}: {exc}); "
                             f"the file is corrupt") from exc

    def close(self) -> None:
        self.container.close()


@dataclass(frozen=True)
class SegmentIndex:
    """One segment's video packets in presentation order, from demuxing without decoding.

    ``rank`` maps a packet pts to its local frame index (the rank of the pts among all the
    segment's pts: no constant-frame-rate assumption). ``keyframes`` are the (local index, pts)
    of the keyframes after the first where a seek may start a chunk: IDRs, or keyframes whose
    kind the bitstream does not tell (a seek there is verified while decoding). Keyframes that
    are known not to be IDRs (open GOP: later frames may reference earlier ones) are only
    counted in ``open_gop_keyframes``.
    """

    rank: dict[int, int]
    keyframes: tuple[tuple[int, int], ...]
    open_gop_keyframes: int = 0


def _nal_types(codec: str, extradata: bytes | None, data: bytes) -> list[int] | None:
    """NAL unit types in one packet (avcC/hvcC length-prefixed or Annex B); None if unparseable."""
    if extradata and extradata[0] == 1 and len(extradata) > (21 if codec == "hevc" else 4):
        n = (extradata[21 if codec == "hevc" else 4] & 3) + 1
        heads, i = [], 0
        while i + n <= len(data):
            size = int.from_bytes(data[i:i + n], "big")
            i += n
            if size <= 0 or i + size > len(data):
                return None
            heads.append(data[i])
            i += size
    else:  # Annex B: emulation prevention keeps 00 00 01 out of NAL payloads
        heads = [data[m.end()] for m in re.finditer(b"\x00\x00\x01", data) if m.end() < len(data)]
    if codec == "h264":
        return [h & 0x1F for h in heads]
    return [(h >> 1) & 0x3F for h in heads]


def _keyframe_is_idr(codec: str, extradata: bytes | None, data: bytes) -> bool | None:
    """True for an IDR keyframe (no later frame references an earlier one: a safe seek point),
    False for a non-IDR one (open GOP, HEVC CRA/BLA), None when the codec or bitstream does not say."""
    if codec not in ("h264", "hevc"):
        return None
    types = _nal_types(codec, extradata, data)
    if not types:
        return None
    vcl = [t for t in types if 1 <= t <= 5] if codec == "h264" else [t for t in types if t <= 31]
    if not vcl:
        return None
    idr = (5,) if codec == "h264" else (19, 20)
    return all(t in idr for t in vcl)


def index_segment(path: Path) -> SegmentIndex:
    """Demux ``path``'s video packets (no decoding) into a ``SegmentIndex``."""
    c = _open_av(path)
    try:
        if not c.streams.video:
            raise InputError(f"{path}: has no video stream")
        st = c.streams.video[0]
        codec = st.codec_context.name
        extradata = st.codec_context.extradata
        pts: list[int] = []
        keys: list[tuple[int, bool | None]] = []
        for pkt in c.demux(st):
            if pkt.size == 0:
                continue  # the demuxer's final flush packet
            if pkt.pts is None:  # cannot rank frames: no keyframe splits (decode from the start)
                return SegmentIndex(rank={}, keyframes=())
            pts.append(int(pkt.pts))
            if pkt.is_keyframe:
                keys.append((int(pkt.pts), _keyframe_is_idr(codec, extradata, bytes(pkt))))
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: demuxing failed ({type(exc).__name__}: {exc}); the file is corrupt") from exc
    finally:
        c.close()
    order = sorted(pts)
    if len(set(order)) != len(order):  # duplicate pts: ranks are ambiguous, so no splits
        return SegmentIndex(rank={}, keyframes=())
    rank = {p: i for i, p in enumerate(order)}
    safe = tuple(sorted((rank[p], p) for p, idr in keys if idr is not False and rank[p] > 0))
    return SegmentIndex(rank=rank, keyframes=safe, open_gop_keyframes=sum(idr is False for _, idr in keys))


def _seek_keyframe(container, stream, pts: int) -> None:
    """Position the demuxer on the keyframe with ``pts`` (a module function so tests can break it)."""
    container.seek(pts, stream=stream, backward=True, any_frame=False)


class _SeekingPyAVReader(_PyAVReader):
    """A worker's decoder that may start at a keyframe: every frame decoded after a seek must carry
    the pts of the expected local index (``index.rank``), else ``_SeekMismatch``."""

    def __init__(self, path: Path, threads: int, index: SegmentIndex, stop: "threading.Event | None" = None):
        self.index, self._verify = index, False
        super().__init__(path, threads, stop)

    def _open(self) -> None:
        super()._open()
        self._verify = False

    def seek(self, pts: int, local: int) -> None:
        st = self.container.streams.video[0]
        try:
            _seek_keyframe(self.container, st, pts)
        except Exception as exc:
            raise _SeekMismatch(f"seek to pts {pts} failed ({type(exc).__name__}: {exc})") from exc
        self._frames = self.container.decode(st)  # PyAV's seek flushed the decoder
        self.pos, self._verify = local, True

    def _check(self, frame) -> None:
        if self._verify and (frame.pts is None or self.index.rank.get(int(frame.pts)) != self.pos):
            raise _SeekMismatch(f"{self.path}: after the seek, frame {self.pos} was expected but pts "
                                f"{frame.pts} came out")

    def read(self, index: int) -> np.ndarray:
        if index < self.pos:
            raise _SeekMismatch(f"{self.path}: frame {index} requested behind the decoder (at {self.pos})")
        return super().read(index)


def _import_decord():
    try:
        import decord  # noqa: F401
    except ImportError as exc:
        raise InputError("--decoder decord: the `decord` package is not importable "
                         f"({exc}); install it with `pip install decord` (x86_64 Linux wheels, "
                         "or `pip install 'minicpmo-rt[decord]'`), or use --decoder pyav") from exc
    return decord


class _DecordReader:
    def __init__(self, path: Path, threads: int):
        decord = _import_decord()
        self.path = path
        try:
            self.vr = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=max(0, threads))
        except Exception as exc:
            raise InputError(f"{path}: decord cannot open it ({type(exc).__name__}: {exc}); the file is corrupt "
                             f"or not an mp4") from exc

    def read(self, index: int) -> np.ndarray:
        try:
            return self.vr[index].asnumpy()
        except Exception as exc:
            raise InputError(f"{self.path}: decord failed at frame {index} ({type(exc).__name__}: {exc}); "
                             f"the file is truncated or corrupt") from exc

    def close(self) -> None:
        del self.vr
