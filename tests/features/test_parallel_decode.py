"""Parallel frame prefetch: chunk plan, bit-identical frames, seek fallback, errors, shutdown, worker count."""

from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest

from minicpmo_rt.errors import InputError
from minicpmo_rt.features import easycom, prefetch, video
from minicpmo_rt.features.easycom import EasyComSession
from minicpmo_rt.features.prefetch import DECODE_WORKERS_ENV, default_decode_workers
from minicpmo_rt.features.synthetic import make_session

# closed GOPs (IDR every 10 frames) with B-frames, so presentation order differs from decode order
KEYINT10 = "keyint=10:min-keyint=10:scenecut=0:bframes=2"
WANTED = {"all": list(range(80)), "every4": list(range(3, 80, 4)), "1hz": [19, 39, 59, 79]}


@pytest.fixture(scope="module")
def kf(tmp_path_factory):
    """Segments of 30, 30, 20 frames (a gap after the first), keyframes at local 0, 10, 20."""
    return make_session(tmp_path_factory.mktemp("kf"), 4, width=64, height=48, segment_seconds=1.5, seed=5,
                        x264_params=KEYINT10)


@pytest.fixture(scope="module")
def ref(kf):
    """Every frame through the sequential reader on the main thread (no prefetch)."""
    with EasyComSession(kf, frame_cache_size=0) as s:
        return [s.frame(i) for i in range(s.timeline.total_frames)]


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("frame-prefetch")]


def _consume(d, wanted, workers, depth=3, **kw):
    with EasyComSession(d, frame_cache_size=0, **kw) as s:
        s.prefetch(wanted, depth=depth, workers=workers)
        got = {i: s.frame(i) for i in wanted}
        return got, s.stats


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("wanted", list(WANTED))
def test_parallel_prefetch_is_bit_identical_to_sequential(kf, ref, workers, wanted):
    idx = WANTED[wanted]
    got, stats = _consume(kf, idx, workers)
    for i in idx:
        assert got[i].flags.c_contiguous and np.array_equal(got[i], ref[i]), i
    assert stats.prefetched == len(idx) and stats.frames_decoded_requests == 0
    assert stats.prefetch_workers == min(workers, stats.prefetch_chunks)
    assert stats.prefetch_seek_fallbacks == 0
    assert not _prefetch_threads()


def test_plan_splits_at_segment_boundaries_and_keyframes(kf):
    with EasyComSession(kf) as s:
        table = s.segment_index(0)
        assert [k for k, _ in table.keyframes] == [10, 20] and table.open_gop_keyframes == 0
        assert len(table.rank) == 30
        plan = s.plan_prefetch(WANTED["all"])
        assert [(c.segment, c.start, c.indices[0], c.indices[-1]) for c in plan] == [
            (0, 0, 0, 9), (0, 10, 10, 19), (0, 20, 20, 29),  # the gap follows segment 0
            (1, 0, 30, 39), (1, 10, 40, 49), (1, 20, 50, 59),
            (2, 0, 60, 69), (2, 10, 70, 79)]
        assert all(c.indices == tuple(range(c.indices[0], c.indices[-1] + 1)) for c in plan)
        for c in plan:  # a chunk seeks exactly to its keyframe, except at a segment's start
            assert (c.start_pts is None) == (c.start == 0)
            if c.start:
                assert s.segment_index(c.segment).rank[c.start_pts] == c.start
        # 1 frame per second: frame 39 (local 9 of segment 1) lies before that segment's first split
        assert [(c.segment, c.start, c.indices) for c in s.plan_prefetch(WANTED["1hz"])] == [
            (0, 10, (19,)), (1, 0, (39,)), (1, 20, (59,)), (2, 10, (79,))]
        s.prefetch(WANTED["every4"], workers=8)
        assert s.stats.prefetch_chunks == 8 and s.stats.prefetch_workers == 8


def test_open_gop_keyframes_are_not_split_points(tmp_path):
    d = make_session(tmp_path, 3, width=64, height=48, segment_seconds=1.5, seed=7,
                     x264_params=KEYINT10 + ":open-gop=1")
    with EasyComSession(d, frame_cache_size=0) as s:
        assert s.segment_index(0).keyframes == () and s.segment_index(0).open_gop_keyframes == 2
        assert [(c.segment, c.start) for c in s.plan_prefetch(range(60))] == [(0, 0), (1, 0)]
        want = [s.frame(i) for i in range(60)]
    got, stats = _consume(d, list(range(60)), 2)
    assert all(np.array_equal(got[i], want[i]) for i in range(60)) and stats.prefetch_workers == 2


def _seek_to_start(container, stream, pts):
    container.seek(0, stream=stream, backward=True, any_frame=False)


def _mismatch_third_frame(orig):
    def check(self, frame):
        if self._verify and self.pos == self.index.rank[self.index.keyframes[0][1]] + 2:
            raise video._SeekMismatch("forced")
        orig(self, frame)
    return check


@pytest.mark.parametrize("fault", ["seek_lands_elsewhere", "mismatch_mid_chunk"])
def test_seek_mismatch_falls_back_to_segment_start(kf, ref, monkeypatch, fault):
    if fault == "seek_lands_elsewhere":
        monkeypatch.setattr(video, "_seek_keyframe", _seek_to_start)
    else:  # frames 10, 11 served from the seek, the rest of the chunk from the start
        monkeypatch.setattr(video._SeekingPyAVReader, "_check",
                            _mismatch_third_frame(video._SeekingPyAVReader._check))
    got, stats = _consume(kf, WANTED["all"], 2)
    assert all(np.array_equal(got[i], ref[i]) for i in WANTED["all"])
    seeks = 5 if fault == "seek_lands_elsewhere" else 3  # chunks at a keyframe / at the first keyframe
    assert stats.prefetch_seek_fallbacks == seeks and stats.prefetched == 80


def test_session8_crop_through_prefetch(tmp_path):
    d = make_session(tmp_path, 1, session=8, width=1940, height=16, x264_params=KEYINT10)
    with EasyComSession(d, frame_cache_size=0) as s:
        want = [s.frame(i) for i in range(20)]
    got, stats = _consume(d, list(range(20)), 2)
    assert stats.prefetch_chunks == 2
    assert all(got[i].shape == (16, 1920, 3) and np.array_equal(got[i], want[i]) for i in range(20))


def test_worker_error_reaches_consumer_and_close_joins_workers(kf, ref, tmp_path):
    shutil.copytree(kf.parents[1], tmp_path / "copy")
    d = tmp_path / "copy" / "Video_Compressed" / kf.name
    tl = easycom.build_timeline(d)
    p = d / "01-01-500.mp4"  # segment 1: frames 30-59
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
    with EasyComSession(d, timeline=tl, frame_cache_size=0) as s:
        s.prefetch(range(80), depth=2, workers=3)
        assert s.stats.prefetch_workers == 3
        for i in range(30):  # the chunks before the broken segment still arrive intact
            assert np.array_equal(s.frame(i), ref[i])
        with pytest.raises(InputError, match="01-01-500.mp4"):
            s.frame(30)
    assert not _prefetch_threads()


# 10-frame chunks test the per-chunk slots; 2-3-frame chunks the window of `workers` chunks
@pytest.mark.parametrize("wanted", ["all", "every4"])
def test_memory_bound_and_close_after_partial_consumption(kf, wanted):
    depth, workers = 2, 3
    s = EasyComSession(kf, frame_cache_size=0)
    try:
        s.prefetch(WANTED[wanted], depth=depth, workers=workers)
        s.frame(3)
        pf = s._prefetcher
        peak, deadline = 0, time.monotonic() + 0.5
        while time.monotonic() < deadline:
            peak = max(peak, sum(q.qsize() for q in pf._queues))
            time.sleep(0.01)
        assert 0 < peak <= workers * depth
        assert len(_prefetch_threads()) == workers
    finally:
        s.close()
    assert not _prefetch_threads()
    with pytest.raises(RuntimeError, match="consumer broke"):  # an exception mid-consumption
        with EasyComSession(kf, frame_cache_size=0) as s2:
            s2.prefetch(range(80), depth=depth, workers=workers)
            s2.frame(0)
            raise RuntimeError("consumer broke")
    assert not _prefetch_threads()


def test_decode_workers_env_and_argument(kf, monkeypatch):
    monkeypatch.delenv(DECODE_WORKERS_ENV, raising=False)
    monkeypatch.setattr(prefetch.os, "cpu_count", lambda: 16)
    assert default_decode_workers() == 8
    monkeypatch.setattr(prefetch.os, "cpu_count", lambda: 2)
    assert default_decode_workers() == 1
    monkeypatch.setenv(DECODE_WORKERS_ENV, " 3 ")
    assert default_decode_workers() == 3
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv(DECODE_WORKERS_ENV, bad)
        with pytest.raises(InputError, match=f"{DECODE_WORKERS_ENV}=.*positive integer"):
            default_decode_workers()
    with EasyComSession(kf) as s:
        with pytest.raises(InputError, match=DECODE_WORKERS_ENV):
            s.prefetch([3, 7])
        s.prefetch(range(80), workers=2)  # the argument wins over the environment
        assert s.stats.prefetch_workers == 2
        for bad in (0, -1, 1.5, True):
            with pytest.raises(InputError, match="workers"):
                s.prefetch([3], workers=bad)
    monkeypatch.setenv(DECODE_WORKERS_ENV, "64")
    with EasyComSession(kf) as s:
        s.prefetch(WANTED["1hz"])  # never more workers than chunks
        assert (s.stats.prefetch_chunks, s.stats.prefetch_workers) == (4, 4)


def test_decord_prefetch_one_chunk_per_segment(kf):
    pytest.importorskip("decord")
    with EasyComSession(kf, decoder="decord", decoder_threads=1, frame_cache_size=0) as s:
        want = {i: s.frame(i) for i in WANTED["every4"]}
        assert [c.segment for c in s.plan_prefetch(WANTED["every4"])] == [0, 1, 2]
    got, stats = _consume(kf, WANTED["every4"], 3, decoder="decord", decoder_threads=1)
    assert stats.prefetch_chunks == 3 and all(np.array_equal(got[i], want[i]) for i in want)


def test_close_is_prompt_during_a_long_forward_decode(kf, monkeypatch):
    def slow(orig):
        def check(self, frame):
            time.sleep(0.1)  # a slow decoder: reaching frame 79 from its keyframe (70) takes ~1 s
            orig(self, frame)
        return check
    for cls in (video._PyAVReader, video._SeekingPyAVReader):
        monkeypatch.setattr(cls, "_check", slow(cls._check))
    s = EasyComSession(kf, frame_cache_size=0)
    s.prefetch([79], workers=1)
    time.sleep(0.15)
    t0 = time.perf_counter()
    s.close()
    assert time.perf_counter() - t0 < 0.5 and not _prefetch_threads()
