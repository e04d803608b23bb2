from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
import soundfile as sf

from minicpmo_rt.errors import InputError
from minicpmo_rt.features.easycom import (EasyComSession, build_timeline, frame_index_at, parse_segment_name,
                                          resample_causal, segment_name)
from minicpmo_rt.features.synthetic import make_session


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    root = tmp_path_factory.mktemp("easycom")
    return make_session(root, 4, width=64, height=48, segment_seconds=1.5, seed=3)


def _copy(syn, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(syn.parents[1], root)
    return root / "Video_Compressed" / syn.name


def test_names_and_frame_index():
    assert parse_segment_name("01-00-288") == pytest.approx(60.288)
    assert segment_name(60.288) == "01-00-288"
    assert [frame_index_at(t) for t in (0.2, 0.4, 1.0, 1.2)] == [3, 7, 19, 23]


def test_timeline_skips_gap_and_records_it(syn):
    tl = build_timeline(syn)
    assert [s.name for s in tl.segments] == ["00-00-000", "01-01-500", "01-03-037"]
    assert [s.frames for s in tl.segments] == [30, 30, 20]
    assert [s.frame_offset for s in tl.segments] == [0, 30, 60]
    assert tl.duration == pytest.approx(4.0) and tl.audio_source == "wav:ch5+ch6"
    (gap,) = tl.gaps  # the 37 ms name drift is not a gap
    assert (gap.after, gap.session_start, gap.session_end, gap.media_time) == ("00-00-000", 1.5, 61.5, 1.5)
    assert tl.media_to_session_time(1.0) == pytest.approx(1.0)
    assert tl.media_to_session_time(2.0) == pytest.approx(62.0)
    assert tl.locate(35) == (1, 5)
    assert "skipped at media 1.500s" in tl.summary()


def test_audio_is_mean_of_ear_channels_resampled_causally(syn):
    tl = build_timeline(syn)
    with EasyComSession(syn) as s:
        got = s.audio(0.0, 4.0)
        assert got.shape == (64000,) and got.dtype == np.float32
        parts = []
        for seg in tl.segments:
            data, sr = sf.read(str(seg.audio), dtype="float32", always_2d=True)
            assert sr == 48000 and data.shape[1] == 6
            parts.append(resample_causal(data[:, 4:6].mean(axis=1), sr)[: seg.frames * 800])
        np.testing.assert_array_equal(got, np.concatenate(parts))
        np.testing.assert_array_equal(s.audio(1.2, 2.4), got[19200:38400])


def test_resampler_is_causal_and_accurate():
    sr = 48000
    t = np.arange(sr) / sr
    x = np.sin(2 * np.pi * 1000 * t).astype(np.float32)
    y = resample_causal(x, sr)
    delay = 30 / sr  # (taps - 1) / 2 at the input rate
    ref = np.sin(2 * np.pi * 1000 * (np.arange(16000) / 16000 - delay))
    assert np.abs(y[100:] - ref[100:]).max() < 1e-3
    x2 = x.copy()
    x2[24000:] = 0.7  # change only input at or after 0.5 s
    y2 = resample_causal(x2, sr)
    np.testing.assert_array_equal(y[:8000], y2[:8000])
    assert not np.array_equal(y[8000:], y2[8000:])


def test_frames_sequential_cache_and_reader_lru(syn):
    with EasyComSession(syn, max_open_readers=1, frame_cache_size=4) as s:
        seq = [s.frame(i) for i in range(0, 80, 4)]
        assert s.stats.readers_opened == 3 and s.stats.readers_evicted == 2
        assert len(s._readers) == 1 and len(s._frames) == 4
        again = s.frame(0)  # backwards across segments: reopen and decode forward
        np.testing.assert_array_equal(again, seq[0])
        np.testing.assert_array_equal(s.frame(0), seq[0])
        assert s.stats.cache_hits >= 1
    with EasyComSession(syn, max_open_readers=2, frame_cache_size=0) as s2:
        for i in (0, 40, 4, 44):
            np.testing.assert_array_equal(s2.frame(i), seq[i // 4])
        assert s2.stats.readers_opened == 2 and len(s2._frames) == 0
    # moving content: consecutive 5 Hz frames differ
    assert all(np.abs(a.astype(int) - b.astype(int)).mean() > 1 for a, b in zip(seq, seq[1:]))


def test_decord_matches_pyav(syn):
    pytest.importorskip("decord")
    with EasyComSession(syn, decoder="pyav") as a, EasyComSession(syn, decoder="decord", decoder_threads=1) as b:
        for i in (3, 7, 33, 79):
            np.testing.assert_array_equal(a.frame(i), b.frame(i))


def test_decord_missing_is_a_named_error(syn, monkeypatch):
    monkeypatch.setitem(sys.modules, "decord", None)
    with pytest.raises(InputError, match="pip install decord"):
        EasyComSession(syn, decoder="decord")


def test_session8_cropped_to_rightmost_1920(tmp_path):
    d = make_session(tmp_path, 1, session=8, width=1940, height=16)
    tl = build_timeline(d)
    assert tl.crop_right == 1920 and tl.segments[0].width == 1920
    import av
    with av.open(str(tl.segments[0].video)) as c:
        full = next(c.decode(video=0)).to_ndarray(format="rgb24")
    with EasyComSession(d) as s:
        f = s.frame(0)
    assert f.shape == (16, 1920, 3)
    np.testing.assert_array_equal(f, full[:, 20:])


def test_mp4_audio_track_used_without_wavs(tmp_path):
    d = make_session(tmp_path, 2, width=32, height=32, wavs=False, mp4_audio=True)
    tl = build_timeline(d)
    assert tl.audio_source == "mp4" and tl.segments[0].audio is None
    with EasyComSession(d) as s:
        a = s.audio(0, 2.0)
    assert a.shape == (32000,) and float(np.sqrt(np.mean(a ** 2))) > 0.005


def test_transcripts_match_speech_in_audio(syn):
    tl = build_timeline(syn)
    tdir = syn.parents[1] / "Speech_Transcriptions" / syn.name
    speech, silence = [], []
    with EasyComSession(syn) as s:
        for seg in tl.segments:
            utts = json.loads((tdir / f"{seg.name}.json").read_text())
            mask = np.zeros(seg.frames, bool)
            for u in utts:
                assert set(u) == {"Participant_ID", "Transcription", "Start_Frame", "End_Frame", "Target_of_Speech"}
                assert 1 <= u["Start_Frame"] <= u["End_Frame"] <= seg.frames
                assert u["Participant_ID"] in (1, 2, 3, 4)
                mask[u["Start_Frame"] - 1:u["End_Frame"]] = True
            a = s.audio(seg.media_start, seg.media_start + seg.duration).reshape(seg.frames, 800)
            rms = np.sqrt((a.astype(np.float64) ** 2).mean(axis=1))
            speech += list(rms[mask])
            silence += list(rms[~mask])
    assert speech and silence and np.median(speech) > 5 * np.median(silence)


@pytest.mark.parametrize("fault, msg", [
    ("missing", "not a directory"),
    ("empty", "no mm-ss-SSS.mp4"),
    ("corrupt", "cannot be opened as a video"),
    ("no_wav", "missing audio"),
    ("no_audio_at_all", "missing audio"),
])
def test_bad_sessions_are_named(syn, tmp_path, fault, msg):
    d = _copy(syn, tmp_path)
    if fault == "missing":
        d = d.parent / "Session_99"
    elif fault == "empty":
        d = d.parent / "Session_98"
        d.mkdir()
    elif fault == "corrupt":
        (d / "01-01-500.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 this is not a video" * 10)
    elif fault == "no_wav":
        (d.parents[1] / "Glasses_Microphone_Array_Audio" / d.name / "01-03-037.wav").unlink()
    elif fault == "no_audio_at_all":
        shutil.rmtree(d.parents[1] / "Glasses_Microphone_Array_Audio")
    with pytest.raises(InputError, match=msg):
        build_timeline(d)


def test_truncated_mp4_is_named(syn, tmp_path):
    d = _copy(syn, tmp_path)
    p = d / "01-01-500.mp4"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 3])
    with pytest.raises(InputError, match="01-01-500.mp4"):
        tl = build_timeline(d)
        with EasyComSession(d, timeline=tl) as s:
            for i in range(tl.segments[1].frame_offset, tl.segments[1].frame_offset + tl.segments[1].frames):
                s.frame(i)


def test_prefetch_serves_identical_frames_and_replays_still_work(syn):
    with EasyComSession(syn, frame_cache_size=0) as ref:
        want = {i: ref.frame(i) for i in (3, 7, 19, 23, 39, 79)}
    with EasyComSession(syn, frame_cache_size=0) as s:
        s.prefetch([3, 7, 19, 23, 39, 79], depth=2)
        np.testing.assert_array_equal(s.frame(3), want[3])
        np.testing.assert_array_equal(s.frame(7), want[7])
        np.testing.assert_array_equal(s.frame(7), want[7])  # asked twice: no decode, no schedule slip
        np.testing.assert_array_equal(s.frame(3), want[3])  # a replay going back: own readers
        np.testing.assert_array_equal(s.frame(23), want[23])  # 19 skipped by the consumer
        np.testing.assert_array_equal(s.frame(79), want[79])
        assert s.stats.prefetched == 4 and s.stats.frames_decoded_requests == 1


def test_prefetch_error_reaches_consumer(syn, tmp_path):
    d = _copy(syn, tmp_path)
    tl = build_timeline(d)
    p = d / "01-01-500.mp4"
    p.write_bytes(p.read_bytes()[:2000])
    with EasyComSession(d, timeline=tl) as s:
        s.prefetch([3, 33, 37])
        s.frame(3)
        with pytest.raises(InputError, match="01-01-500.mp4"):
            s.frame(33)
