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
import re
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from ..errors import InputError
from .prefetch import DecodeChunk, FramePrefetcher, default_decode_workers
from .video import SegmentIndex, _DecordReader, _import_decord, _open_av, _PyAVReader, index_segment

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
