"""Synthetic sessions in the real EasyCom layout (``minicpmo-rt make-session``).

Writes under ``OUT``::

    Video_Compressed/Session_N/mm-ss-SSS.mp4               H.264, 20 fps, moving content
    Glasses_Microphone_Array_Audio/Session_N/mm-ss-SSS.wav  48 kHz, 6 channels, PCM_32
    Speech_Transcriptions/Session_N/mm-ss-SSS.json          EasyCom utterance lists

The media are split into short segments named by their start time; one redacted gap follows
the first segment (the next name jumps ``gap_seconds`` ahead), and later names drift by 37 ms
like the real ones. Audio carries speech-like bursts (a glottal pulse train through three
formant resonators, with syllable envelopes) separated by pauses; every burst is one
utterance in the transcript JSON of its segment, with 1-based local 20 fps frames,
participant 2 (the wearer) or a partner 1/3/4, and the matching ``Target_of_Speech``. Each
speaker has its own pitch and per-channel gains, so the array channels differ as they would
for talkers at different seats. Random but seeded: the same arguments give the same bytes of
audio and transcripts (video bytes depend on the encoder build).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from .easycom import FPS, segment_name

WAV_RATE = 48000
WEARER = 2
PARTNERS = (1, 3, 4)
_F0 = {1: 110.0, 2: 130.0, 3: 210.0, 4: 180.0}
_FORMANTS = ((700, 1200, 2600), (400, 2000, 2800), (300, 900, 2400), (600, 1700, 2500))


@dataclass(frozen=True)
class Utterance:
    participant: int
    start: float  # seconds, local to the segment
    end: float
    target: str


def _plan_utterances(rng: np.random.Generator, seconds: float) -> list[Utterance]:
    """Alternating talkers with pauses; bursts 0.4-1.6 s, pauses 0.2-0.8 s, inside [0, seconds)."""
    out: list[Utterance] = []
    t = float(rng.uniform(0.15, 0.5))
    who = WEARER
    while True:
        dur = float(rng.uniform(0.4, 1.6))
        if t + dur > seconds - 0.05:
            break
        target = str(int(rng.choice(PARTNERS))) if who == WEARER else ("2" if rng.random() < 0.6 else "Group")
        out.append(Utterance(who, t, t + dur, target))
        t += dur + float(rng.uniform(0.2, 0.8))
        who = int(rng.choice(PARTNERS)) if who == WEARER else (WEARER if rng.random() < 0.6 else
                                                               int(rng.choice([p for p in PARTNERS if p != who])))
    return out


def _speechlike(rng: np.random.Generator, n: int, f0: float, sr: int) -> np.ndarray:
    """A pulse train at ``f0`` (with jitter) through three formant resonators; syllable-rate envelope."""
    from scipy.signal import lfilter

    t = np.arange(n) / sr
    f = f0 * (1 + 0.08 * np.sin(2 * np.pi * 3.0 * t + rng.uniform(0, 6)))
    phase = np.cumsum(f / sr)
    src = (np.diff(np.floor(phase), prepend=0) > 0).astype(np.float64)
    src += 0.02 * rng.standard_normal(n)
    y = np.zeros(n)
    formants = _FORMANTS[int(rng.integers(len(_FORMANTS)))]
    for fc in formants:
        r = math.exp(-math.pi * 90.0 / sr)
        a = [1.0, -2 * r * math.cos(2 * math.pi * fc / sr), r * r]
        y += lfilter([1.0 - r], a, src)
    syl = 0.5 * (1 - np.cos(2 * np.pi * np.minimum(t * rng.uniform(3.5, 5.5), 1e9)))
    edge = np.minimum(1.0, np.minimum(t, t[-1] - t) / 0.03) if n > 1 else np.ones(n)
    y *= (0.3 + 0.7 * syl) * edge
    return (y / (np.abs(y).max() + 1e-9)).astype(np.float64)


def _write_video(path: Path, frames: int, width: int, height: int, t0: float, seed: int,
                 x264_params: str | None = None) -> None:
    import av

    yy, xx = np.mgrid[0:height, 0:width]
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, 3)
    with av.open(str(path), "w") as c:
        st = c.add_stream("libx264", rate=FPS)
        st.width, st.height, st.pix_fmt = width, height, "yuv420p"
        st.options = {"preset": "ultrafast", "crf": "23", **({"x264-params": x264_params} if x264_params else {})}
        size = max(4, min(width, height) // 4)
        for i in range(frames):
            t = t0 + i / FPS
            img = np.empty((height, width, 3), np.uint8)
            img[..., 0] = (base[0] + xx * 255 // max(1, width) + int(40 * t)) % 256
            img[..., 1] = (base[1] + yy * 255 // max(1, height) + int(25 * t)) % 256
            img[..., 2] = (base[2] + int(60 * t)) % 256
            cx = int((0.5 + 0.4 * math.sin(1.3 * t)) * (width - size))
            cy = int((0.5 + 0.4 * math.cos(0.9 * t)) * (height - size))
            img[cy:cy + size, cx:cx + size] = (255, 255, 255) if (i // 10) % 2 == 0 else (10, 10, 10)
            for packet in st.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(packet)
        for packet in st.encode():
            c.mux(packet)


def _mux_audio_track(path: Path, mono: np.ndarray, sr: int) -> None:
    """Rewrite ``path`` with an AAC track holding ``mono`` (for sessions without WAVs)."""
    import av

    tmp = path.with_suffix(".tmp.mp4")
    with av.open(str(path)) as src, av.open(str(tmp), "w") as dst:
        vin = src.streams.video[0]
        vout = dst.add_stream_from_template(vin)
        aout = dst.add_stream("aac", rate=sr)
        aout.layout = "mono"
        for packet in src.demux(vin):
            if packet.dts is None:
                continue
            packet.stream = vout
            dst.mux(packet)
        step = 1024
        for k in range(0, len(mono), step):
            block = mono[k:k + step].astype(np.float32)[None, :]
            frame = av.AudioFrame.from_ndarray(block, format="flt", layout="mono")
            frame.sample_rate = sr
            frame.pts = k
            for packet in aout.encode(frame):
                dst.mux(packet)
        for packet in aout.encode():
            dst.mux(packet)
    tmp.replace(path)


def make_session(out: str | Path, seconds: float, *, session: int = 1, width: int = 320, height: int = 180,
                 segment_seconds: float | None = None, gap_seconds: float = 60.0, seed: int = 0,
                 wavs: bool = True, mp4_audio: bool = False, x264_params: str | None = None) -> Path:
    """Write a synthetic session; return its ``Video_Compressed/Session_N`` directory.

    ``x264_params`` go to libx264 as ``-x264-params`` (tests use e.g. ``keyint=10:scenecut=0`` for
    segments with several keyframes, or ``open-gop=1`` for keyframes that are not IDRs).
    """
    import soundfile as sf

    if seconds < 1 or seconds * FPS != int(seconds * FPS):
        raise InputError(f"--seconds {seconds}: must be >= 1 and a whole number of 20 fps frames")
    if width % 2 or height % 2 or width < 16 or height < 16:
        raise InputError(f"--width/--height {width}x{height}: H.264 yuv420p needs even sizes >= 16")
    if not wavs and not mp4_audio:
        raise InputError("a synthetic session needs audio: keep the WAVs or add the mp4 audio track")
    out = Path(out)
    name = f"Session_{session}"
    vdir = out / "Video_Compressed" / name
    adir = out / "Glasses_Microphone_Array_Audio" / name
    tdir = out / "Speech_Transcriptions" / name
    if vdir.exists() and any(vdir.iterdir()):
        raise InputError(f"{vdir}: already holds files; choose another OUT or --session")
    for d in (vdir, tdir) + ((adir,) if wavs else ()):
        d.mkdir(parents=True, exist_ok=True)
    total_frames = int(round(seconds * FPS))
    seg_frames = int(round((segment_seconds or max(1.0, math.ceil(seconds / 3))) * FPS))
    rng = np.random.default_rng(seed)
    gains = {p: rng.uniform(0.2, 1.0, 6) for p in (1, 2, 3, 4)}
    gains[WEARER][4:] = 1.0  # the wearer is loudest at the ears
    name_t = 0.0
    done = 0
    k = 0
    while done < total_frames:
        n = min(seg_frames, total_frames - done)
        seg_s = n / FPS
        stem = segment_name(name_t)
        _write_video(vdir / f"{stem}.mp4", n, width, height, done / FPS, seed + k, x264_params)
        samples = int(round(seg_s * WAV_RATE))
        audio = 0.003 * rng.standard_normal((samples, 6))
        utts = _plan_utterances(rng, seg_s)
        for u in utts:
            a, b = int(u.start * WAV_RATE), int(u.end * WAV_RATE)
            burst = 0.25 * _speechlike(rng, b - a, _F0[u.participant], WAV_RATE)
            audio[a:b] += burst[:, None] * gains[u.participant][None, :]
        audio = np.clip(audio, -1, 1)
        if wavs:
            sf.write(str(adir / f"{stem}.wav"), audio, WAV_RATE, subtype="PCM_32")
        if mp4_audio:
            _mux_audio_track(vdir / f"{stem}.mp4", audio[:, 4:6].mean(axis=1), WAV_RATE)
        records = [{"Participant_ID": u.participant,
                    "Transcription": "[synthetic] " + " ".join(["ba", "da", "ga", "ma"][: 1 + int(u.end - u.start)]),
                    "Start_Frame": int(math.floor(u.start * FPS)) + 1,
                    "End_Frame": int(math.ceil(u.end * FPS)),
                    "Target_of_Speech": u.target} for u in utts]
        (tdir / f"{stem}.json").write_text(json.dumps(records, indent=1))
        done += n
        # one redacted gap after the first segment; later names drift like EasyCom's (+37 ms)
        name_t += seg_s + (gap_seconds if k == 0 else 0.037)
        k += 1
    return vdir
