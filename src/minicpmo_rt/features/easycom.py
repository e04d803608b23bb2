"""EasyCom session reader: segment timeline, video frames and 16 kHz audio.

Layout (research/easycom_turn_taking.md section 1)::

    <root>/Video_Compressed/Session_N/mm-ss-SSS.mp4                 1920x1080, 20 fps, H.264
    <root>/Glasses_Microphone_Array_Audio/Session_N/mm-ss-SSS.wav   48 kHz, 6 channels

Timeline policy (what happens across a gap)
    Segments are ordered by the start time in their names. The extractor's time axis is
    *media time*: the concatenation of the segments' own media, each segment lasting
    ``frames / 20`` s where ``frames = min(video frames, whole 20 fps frames of audio)``.
    A redacted gap (the next name starts more than ``GAP_THRESHOLD_S`` after the previous
    segment's media ends) is never filled with invented frames or silence: media time simply
    continues with the first post-gap frame, and the streaming context is carried across
    (the model sees a cut, as in an edited video). Every gap is recorded in ``Timeline.gaps``
    with its session-time span and the media time at which it occurs, and it goes into the
    artifact's provenance, so 5 Hz rows can be mapped back to session time
    (``Timeline.media_to_session_time``). Name jitter below the threshold (EasyCom names drift
    by a few hundred ms per minute) is not a gap. A global 20 fps frame index is the local
    (0-based) frame index plus the frames of the earlier segments, which is how transcript
    frames (1-based, local per file) map onto the same axis.

Frames
    The frame paired with a cutoff ``t`` is the newest frame that started strictly before
    ``t``: global index ``ceil(20 t) - 1`` (t = 1.0 -> frame 19). On the 5 Hz grid that is every
    4th frame (3, 7, 11, ...), read by sequential decoding, never by seeking. Session_8's frames
    carry a wrong ID banner on the left and are cropped to their rightmost 1920 columns.

Audio
    From the sibling WAVs: the mean of channels 5 and 6, the binaural microphones in the
    wearer's ear canals. They hear the scene from the wearer's head as a listener does, pick
    up the wearer's own voice and the partners' alike, and averaging the two ears keeps both
    sides (channels 1-4 on the glasses frame are for beamforming, not listening). When the
    session has no WAV directory, the mp4's own audio track is used (mean of its channels);
    if neither exists the reader raises InputError. Resampling to 16 kHz is a *causal*
    polyphase FIR (scipy ``upfirdn``): a 16 kHz sample depends only on input up to its own
    time, so no future audio leaks into a cutoff. Its group delay (0.6 ms for 48 kHz) is left
    uncompensated because compensating it would look ahead.
"""

from __future__ import annotations

import bisect
import math
import os
import queue
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from ..errors import InputError

FPS = 20
SAMPLE_RATE = 16000
SAMPLES_PER_FRAME = SAMPLE_RATE // FPS
GAP_THRESHOLD_S = 1.0
SESSION8_WIDTH = 1920
WAV_CHANNELS = (4, 5)  # 0-based: channels 5 and 6 (binaural ear microphones)
SEGMENT_RE = re.compile(r"^(\d{2})-(\d{2})-(\d{3})$")
DECODERS = ("pyav", "decord")


def parse_segment_name(stem: str) -> float:
    """``mm-ss-SSS`` -> seconds (``01-00-288`` -> 60.288)."""
    m = SEGMENT_RE.match(stem)
    if not m:
        raise ValueError(stem)
    mm, ss, ms = (int(g) for g in m.groups())
    return mm * 60 + ss + ms / 1000.0


def segment_name(seconds: float) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 60000:02d}-{(ms // 1000) % 60:02d}-{ms % 1000:03d}"


def frame_index_at(t: float) -> int:
    """Newest frame that started strictly before cutoff ``t`` (seconds of media time)."""
    return max(0, math.ceil(round(t * FPS, 6)) - 1)


@dataclass(frozen=True)
class Segment:
    name: str
    video: Path
    audio: Path | None  # the WAV; None when the mp4's audio track is used
    name_start: float  # session time from the file name
    frames: int  # 20 fps frames used: min(video, audio) in whole frames
    video_frames: int
    audio_seconds: float
    frame_offset: int  # global index of this segment's first frame
    width: int
    height: int

    @property
    def duration(self) -> float:
        return self.frames / FPS

    @property
    def media_start(self) -> float:
        return self.frame_offset / FPS


@dataclass(frozen=True)
class Gap:
    after: str  # name of the segment before the gap
    session_start: float
    session_end: float
    media_time: float

    @property
    def seconds(self) -> float:
        return self.session_end - self.session_start


@dataclass(frozen=True)
class Timeline:
    session: str
    session_dir: Path
    segments: tuple[Segment, ...]
    gaps: tuple[Gap, ...]
    audio_source: str  # "wav:ch5+ch6" | "mp4"
    crop_right: int | None

    @property
    def total_frames(self) -> int:
        return sum(s.frames for s in self.segments)

    @property
    def duration(self) -> float:
        return self.total_frames / FPS

    def locate(self, index: int) -> tuple[int, int]:
        """Global frame index -> (segment index, local frame index)."""
        if not 0 <= index < self.total_frames:
            raise InputError(f"{self.session_dir}: frame {index} is outside the session's {self.total_frames} frames")
        for k, s in enumerate(self.segments):
            if index < s.frame_offset + s.frames:
                return k, index - s.frame_offset
        raise AssertionError("unreachable")

    def media_to_session_time(self, t: float) -> float:
        """Map a media time to the session clock of the segment names (gaps reinserted)."""
        for s in reversed(self.segments):
            if t >= s.media_start:
                return s.name_start + (t - s.media_start)
        return t

    def to_dict(self) -> dict:
        return {
            "session": self.session, "session_dir": str(self.session_dir), "fps": FPS,
            "audio_source": self.audio_source, "crop_right": self.crop_right,
            "gap_policy": "media time concatenates segments; gaps skipped, never filled; context carried across",
            "segments": [{"name": s.name, "name_start": s.name_start, "media_start": s.media_start,
                          "frames": s.frames, "video_frames": s.video_frames,
                          "audio_seconds": round(s.audio_seconds, 4), "size": [s.width, s.height]}
                         for s in self.segments],
            "gaps": [{"after": g.after, "session_start": g.session_start, "session_end": g.session_end,
                      "media_time": g.media_time} for g in self.gaps],
        }

    def summary(self) -> str:
        lines = [f"session {self.session}: {len(self.segments)} segments, {self.total_frames} frames, "
                 f"{self.duration:.2f} s of media at {FPS} fps, audio {self.audio_source}"
                 + (f", frames cropped to the rightmost {self.crop_right} columns" if self.crop_right else "")]
        for s in self.segments:
            lines.append(f"  {s.name}  session {s.name_start:9.3f}s  media {s.media_start:9.3f}s  "
                         f"{s.frames:6d} frames ({s.video_frames} video, {s.audio_seconds:.3f}s audio)  "
                         f"{s.width}x{s.height}")
        for g in self.gaps:
            lines.append(f"  gap after {g.after}: session {g.session_start:.3f}-{g.session_end:.3f}s "
                         f"({g.seconds:.3f}s redacted) skipped at media {g.media_time:.3f}s")
        if not self.gaps:
            lines.append("  no gaps")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- decoders

def _open_av(path: Path):
    import av

    try:
        return av.open(str(path))
    except Exception as exc:  # av.error.* for corrupt or foreign files
        raise InputError(f"{path}: cannot be opened as a video ({type(exc).__name__}: {exc}); "
                         f"the file is corrupt or not an mp4, re-extract it from the EasyCom archive") from exc


def _probe_video(path: Path) -> tuple[int, int, int, float]:
    """(frames, width, height, fps) from the container, without decoding."""
    c = _open_av(path)
    try:
        if not c.streams.video:
            raise InputError(f"{path}: has no video stream")
        st = c.streams.video[0]
        fps = float(st.average_rate) if st.average_rate else 0.0
        frames = int(st.frames or 0)
        if frames <= 0 and st.duration is not None and st.time_base is not None:
            frames = int(round(float(st.duration * st.time_base) * fps))
        width, height = int(st.codec_context.width), int(st.codec_context.height)
    finally:
        c.close()
    if abs(fps - FPS) > 0.5:
        raise InputError(f"{path}: video is {fps:.3f} fps; EasyCom video is {FPS} fps (is this the right directory?)")
    if frames <= 0 or width <= 0 or height <= 0:
        raise InputError(f"{path}: video stream reports {frames} frames of {width}x{height}; the file is corrupt")
    return frames, width, height, fps


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


# ----------------------------------------------------------------------------- audio

def resample_causal(x: np.ndarray, sr_in: int, sr_out: int = SAMPLE_RATE) -> np.ndarray:
    """Polyphase FIR resampling whose output sample n depends only on input up to time n/sr_out."""
    from scipy.signal import firwin, upfirdn

    x = np.asarray(x, dtype=np.float32)
    if sr_in == sr_out:
        return x.copy()
    ratio = Fraction(sr_out, sr_in)
    up, down = ratio.numerator, ratio.denominator
    taps = 20 * max(up, down) + 1
    h = firwin(taps, 1.0 / max(up, down), window=("kaiser", 5.0)) * up
    y = upfirdn(h, x.astype(np.float64), up, down)
    n = (len(x) * up) // down
    return y[:n].astype(np.float32)


def read_wav_16k(path: Path) -> np.ndarray:
    import soundfile as sf

    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:
        raise InputError(f"{path}: cannot be read as a WAV ({type(exc).__name__}: {exc})") from exc
    if data.shape[1] < max(WAV_CHANNELS) + 1:
        raise InputError(f"{path}: has {data.shape[1]} channels; the EasyCom glasses array has 6 "
                         f"(channels 5 and 6 are the binaural ear microphones this reader uses)")
    mono = data[:, list(WAV_CHANNELS)].mean(axis=1)
    return resample_causal(mono, int(sr))


def read_mp4_audio_16k(path: Path) -> np.ndarray:
    """The mp4's own audio track, downmixed to mono float by FFmpeg at its native rate, then resampled causally."""
    import av

    c = _open_av(path)
    try:
        if not c.streams.audio:
            raise InputError(f"{path}: missing audio: no WAV and no audio track in the mp4")
        st = c.streams.audio[0]
        sr = int(st.rate)
        mixer = av.AudioResampler(format="flt", layout="mono", rate=sr)
        chunks = []
        for frame in c.decode(st):
            for out in mixer.resample(frame):
                chunks.append(out.to_ndarray().reshape(-1))
        for out in mixer.resample(None):
            chunks.append(out.to_ndarray().reshape(-1))
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: decoding its audio track failed ({type(exc).__name__}: {exc})") from exc
    finally:
        c.close()
    if not chunks:
        raise InputError(f"{path}: its audio track is empty")
    return resample_causal(np.concatenate(chunks).astype(np.float32), sr)


def _probe_wav_seconds(path: Path) -> float:
    import soundfile as sf

    try:
        info = sf.info(str(path))
    except Exception as exc:
        raise InputError(f"{path}: cannot be read as a WAV ({type(exc).__name__}: {exc})") from exc
    if info.channels < max(WAV_CHANNELS) + 1:
        raise InputError(f"{path}: has {info.channels} channels; the EasyCom glasses array has 6")
    return info.frames / info.samplerate


def _probe_mp4_audio_seconds(path: Path) -> float:
    c = _open_av(path)
    try:
        if not c.streams.audio:
            raise InputError(f"{path}: missing audio: no WAV under Glasses_Microphone_Array_Audio and the mp4 "
                             f"has no audio track; restore the session's WAV directory")
        st = c.streams.audio[0]
        if st.duration is not None and st.time_base is not None:
            return float(st.duration * st.time_base)
        return float(c.duration) / 1e6 if c.duration else 0.0
    finally:
        c.close()


# ----------------------------------------------------------------------------- timeline

def wav_dir_for(session_dir: Path) -> Path:
    return session_dir.parent.parent / "Glasses_Microphone_Array_Audio" / session_dir.name


def build_timeline(session_dir: str | Path) -> Timeline:
    session_dir = Path(session_dir)
    if not session_dir.is_dir():
        raise InputError(f"--easycom-session-dir {session_dir}: not a directory; pass "
                         f".../Video_Compressed/Session_N")
    named = []
    for p in session_dir.glob("*.mp4"):
        try:
            named.append((parse_segment_name(p.stem), p))
        except ValueError:
            continue  # not an EasyCom segment (e.g. a stray export); ignored on purpose
    if not named:
        raise InputError(f"--easycom-session-dir {session_dir}: no mm-ss-SSS.mp4 segments in it; pass "
                         f".../Video_Compressed/Session_N of an extracted EasyCom release")
    named.sort()
    wdir = wav_dir_for(session_dir)
    wavs = {p.stem: p for p in wdir.glob("*.wav")} if wdir.is_dir() else {}
    use_wav = bool(wavs)
    crop = SESSION8_WIDTH if session_dir.name == "Session_8" else None
    segments: list[Segment] = []
    gaps: list[Gap] = []
    offset = 0
    for start, p in named:
        frames_v, w, h, _ = _probe_video(p)
        if use_wav:
            wav = wavs.get(p.stem)
            if wav is None:
                raise InputError(f"{p}: missing audio: {wdir} has WAVs but no {p.stem}.wav; restore it "
                                 f"(mixing WAV and mp4 audio within a session is not supported)")
            audio_s = _probe_wav_seconds(wav)
        else:
            wav = None
            audio_s = _probe_mp4_audio_seconds(p)
        frames = min(frames_v, int(math.floor(audio_s * FPS + 1e-6)))
        if frames <= 0:
            raise InputError(f"{p}: has {frames_v} video frames and {audio_s:.3f}s of audio; nothing usable")
        if crop is not None and w < crop:
            raise InputError(f"{p}: Session_8 frames are cropped to the rightmost {crop} columns but this one "
                             f"is only {w} wide")
        if segments:
            prev = segments[-1]
            end = prev.name_start + prev.duration
            if start - end > GAP_THRESHOLD_S:
                gaps.append(Gap(after=prev.name, session_start=end, session_end=start,
                                media_time=offset / FPS))
        segments.append(Segment(name=p.stem, video=p, audio=wav, name_start=start, frames=frames,
                                video_frames=frames_v, audio_seconds=audio_s, frame_offset=offset,
                                width=min(w, crop) if crop else w, height=h))
        offset += frames
    return Timeline(session=session_dir.name, session_dir=session_dir, segments=tuple(segments),
                    gaps=tuple(gaps), audio_source="wav:ch5+ch6" if use_wav else "mp4", crop_right=crop)


# ----------------------------------------------------------------------------- session

@dataclass
class ReaderStats:
    frames_decoded_requests: int = 0
    cache_hits: int = 0
    readers_opened: int = 0
    readers_evicted: int = 0
    prefetched: int = 0  # frames served from prefetch
    prefetch_chunks: int = 0  # of the latest prefetch(): independently decodable chunks planned
    prefetch_workers: int = 0  # of the latest prefetch(): decoding threads started
    prefetch_seek_fallbacks: int = 0  # chunks re-decoded from their segment's start after a bad seek


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


class EasyComSession:
    """Frames and 16 kHz audio of one session on its media timeline.

    ``max_open_readers`` bounds the open containers (LRU); ``frame_cache_size`` bounds the
    decoded frames kept (LRU; 0 disables it).
    """

    def __init__(self, session_dir: str | Path, *, decoder: str = "pyav", decoder_threads: int = 1,
                 max_open_readers: int = 1, frame_cache_size: int = 32, timeline: Timeline | None = None):
        if decoder not in DECODERS:
            raise InputError(f"--decoder {decoder!r}: choose one of {DECODERS}")
        if decoder == "decord":
            _import_decord()
        if max_open_readers < 1:
            raise InputError(f"--max-open-readers {max_open_readers}: must be >= 1")
        if frame_cache_size < 0:
            raise InputError(f"--frame-cache-size {frame_cache_size}: must be >= 0")
        if decoder_threads < 0:
            raise InputError(f"--decoder-threads {decoder_threads}: must be >= 0 (0 = decoder's choice)")
        self.timeline = timeline or build_timeline(session_dir)
        self.decoder, self.decoder_threads = decoder, decoder_threads
        self.max_open_readers, self.frame_cache_size = max_open_readers, frame_cache_size
        self._readers: OrderedDict[int, object] = OrderedDict()
        self._frames: OrderedDict[int, np.ndarray] = OrderedDict()
        self._audio: list[np.ndarray | None] = [None] * len(self.timeline.segments)
        self._prefetcher: FramePrefetcher | None = None
        self._index: dict[int, SegmentIndex | None] = {}  # per-segment keyframe tables (None: unreadable)
        self._last: tuple[int, np.ndarray] | None = None
        self.stats = ReaderStats()

    def prefetch(self, indices: list[int], depth: int = 8, workers: int | None = None) -> None:
        """Decode ``indices`` ahead on worker threads; ``frame`` serves them in order.

        ``workers`` caps the threads (default ``$MINICPMO_RT_DECODE_WORKERS`` or
        max(1, min(8, cpus // 2))); no more are started than there are chunks to decode, and each
        one's FFmpeg decoder still runs ``decoder_threads`` threads. At most ``workers * depth``
        decoded frames wait for the consumer (see ``FramePrefetcher``).
        """
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise InputError(f"prefetch(workers={workers!r}): must be a positive integer (decoding threads)")
        max_workers = workers if workers is not None else default_decode_workers()
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        chunks = self.plan_prefetch(indices)
        if chunks:
            self._prefetcher = FramePrefetcher(self, chunks, depth, max_workers)
        self.stats.prefetch_chunks = len(chunks)
        self.stats.prefetch_workers = self._prefetcher.workers if self._prefetcher else 0

    def segment_index(self, seg: int) -> SegmentIndex | None:
        """The segment's keyframe table (cached); None when it cannot be demuxed, so its frames are
        decoded from the segment start and the worker reports the file's error where a frame needs it."""
        if seg not in self._index:
            try:
                self._index[seg] = index_segment(self.timeline.segments[seg].video)
            except InputError:
                self._index[seg] = None
        return self._index[seg]

    def plan_prefetch(self, indices: list[int]) -> list[DecodeChunk]:
        """Split the wanted frames into independently decodable chunks, in frame order: at every
        segment boundary, and (PyAV) inside a segment at each safe keyframe with a wanted frame
        at or after it; decord random-accesses by itself, so it gets one chunk per segment."""
        idx = sorted(set(int(i) for i in indices))
        if not idx:
            return []
        self.timeline.locate(idx[0])
        self.timeline.locate(idx[-1])  # range check with the usual error
        starts = [s.frame_offset for s in self.timeline.segments]
        groups: dict[tuple[int, int], list[int]] = {}
        for i in idx:
            seg = bisect.bisect_right(starts, i) - 1
            start = 0
            if self.decoder == "pyav":
                table = self.segment_index(seg)
                keys = table.keyframes if table else ()
                k = bisect.bisect_right(keys, (i - starts[seg], math.inf)) - 1
                start = keys[k][0] if k >= 0 else 0
            groups.setdefault((seg, start), []).append(i)
        chunks = []
        for (seg, start), members in groups.items():  # insertion order is frame order
            pts = None
            if start:
                table = self._index[seg]
                pts = next(p for local, p in table.keyframes if local == start)
            chunks.append(DecodeChunk(segment=seg, start=start, start_pts=pts, indices=tuple(members)))
        return chunks

    # -- video
    def _reader(self, seg: int):
        r = self._readers.get(seg)
        if r is not None:
            self._readers.move_to_end(seg)
            return r
        while len(self._readers) >= self.max_open_readers:
            _, old = self._readers.popitem(last=False)
            old.close()
            self.stats.readers_evicted += 1
        path = self.timeline.segments[seg].video
        r = _PyAVReader(path, self.decoder_threads) if self.decoder == "pyav" else _DecordReader(path, self.decoder_threads)
        self._readers[seg] = r
        self.stats.readers_opened += 1
        return r

    def frame(self, index: int) -> np.ndarray:
        """Global 20 fps frame ``index`` as HxWx3 uint8 (Session_8 cropped)."""
        hit = self._frames.get(index)
        if hit is not None:
            self._frames.move_to_end(index)
            self.stats.cache_hits += 1
            return hit
        if self._last is not None and self._last[0] == index:
            return self._last[1]
        pf = self._prefetcher
        while pf is not None and pf.next_index is not None and pf.next_index < index:
            pf.take()  # scheduled but never asked for: drop it so the schedule stays in step
        if pf is not None and pf.next_index == index:
            img = pf.take()
            self._last = (index, img)  # served again without a decode even with no frame cache
            self.stats.prefetched += 1
        else:
            seg, local = self.timeline.locate(index)
            img = self._reader(seg).read(local)
            if self.timeline.crop_right:
                img = img[:, -self.timeline.crop_right:]
            img = np.ascontiguousarray(img)
            self.stats.frames_decoded_requests += 1
        if self.frame_cache_size:
            self._frames[index] = img
            while len(self._frames) > self.frame_cache_size:
                self._frames.popitem(last=False)
        return img

    def frame_at(self, t: float) -> np.ndarray:
        return self.frame(frame_index_at(t))

    # -- audio
    def _segment_audio(self, seg: int) -> np.ndarray:
        a = self._audio[seg]
        if a is None:
            s = self.timeline.segments[seg]
            a = read_wav_16k(s.audio) if s.audio is not None else read_mp4_audio_16k(s.video)
            need = s.frames * SAMPLES_PER_FRAME
            if len(a) < need:
                raise InputError(f"{s.audio or s.video}: decoded {len(a)} samples at 16 kHz, fewer than the "
                                 f"{need} its header promised; the file is truncated")
            a = a[:need]
            self._audio[seg] = a
        return a

    def audio(self, start: float, end: float) -> np.ndarray:
        """16 kHz mono float32 samples of media time [start, end)."""
        s0, s1 = int(round(start * SAMPLE_RATE)), int(round(end * SAMPLE_RATE))
        if s0 < 0 or s1 > self.timeline.total_frames * SAMPLES_PER_FRAME or s1 < s0:
            raise InputError(f"{self.timeline.session_dir}: audio [{start}, {end}) s is outside the "
                             f"{self.timeline.duration:.2f} s session")
        out = []
        for k, seg in enumerate(self.timeline.segments):
            a0, a1 = seg.frame_offset * SAMPLES_PER_FRAME, (seg.frame_offset + seg.frames) * SAMPLES_PER_FRAME
            lo, hi = max(s0, a0), min(s1, a1)
            if lo < hi:
                out.append(self._segment_audio(k)[lo - a0: hi - a0])
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def check_decoders(self) -> list[str]:
        """Decode the first and last used frame and the audio of every segment (``--media-only``)."""
        report = []
        for k, s in enumerate(self.timeline.segments):
            first = self.frame(s.frame_offset)
            self.frame(s.frame_offset + s.frames - 1)  # the last used frame decodes, or raises
            a = self._segment_audio(k)
            report.append(f"  {s.name}: frames {first.shape[1]}x{first.shape[0]} ok (first, last #{s.frames - 1}), "
                          f"audio {len(a) / SAMPLE_RATE:.3f}s rms {float(np.sqrt(np.mean(a.astype(np.float64) ** 2))):.4f}")
            self._audio[k] = None  # media-only: keep memory flat
        return report

    def close(self) -> None:
        if getattr(self, "_prefetcher", None) is not None:
            self._prefetcher.close()
            self._prefetcher = None
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        self._frames.clear()

    def __enter__(self) -> "EasyComSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
