"""Whisper log-mel and the streaming mel buffer (upstream's stable-frame semantics)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minicpmo_rt.thinker.mel import StreamingMel, log_mel, mel_filters

from conftest import behind_queued_work, rel_err, requires_cuda



def _speechlike(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    t = np.arange(n) / 16000
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)
    x = 0.2 * env * np.sin(2 * np.pi * (180 + 40 * np.sin(2 * np.pi * 0.5 * t)) * t) + 0.01 * rng.standard_normal(n)
    return x.astype(np.float32)


def _numpy_reference(x: np.ndarray, dynamic: bool) -> np.ndarray:
    """Upstream's numpy path: transformers' numpy spectrogram, last frame dropped, floor, (x+4)/4."""
    from transformers.audio_utils import spectrogram, window_function

    spec = spectrogram(x, window_function(400, "hann"), frame_length=400, hop_length=160, power=2.0,
                       mel_filters=mel_filters().T.double().numpy(), log_mel="log10", dtype=np.float64)[:, :-1]
    spec = np.maximum(spec, spec.max() - 8.0 if dynamic else -10.0)
    return (spec + 4.0) / 4.0


@pytest.mark.parametrize("dynamic", [False, True])
def test_log_mel_matches_numpy_reference(dynamic):
    x = _speechlike(2.3)
    ours = log_mel(x, dynamic)
    ref = _numpy_reference(x, dynamic)
    assert ours.shape == (80, len(x) // 160) == ref.shape
    assert rel_err(ours, torch.from_numpy(ref)) <= 1e-5


def test_log_mel_dynamic_equals_whisper_feature_extractor():
    from transformers import WhisperFeatureExtractor

    x = _speechlike(6.0, seed=1)
    ref = WhisperFeatureExtractor(feature_size=80)(x, sampling_rate=16000, return_tensors="pt",
                                                   padding=False).input_features[0]
    assert torch.equal(log_mel(x, True), ref)


def _feed_native(mel: StreamingMel, audio: np.ndarray, n_chunks: int):
    """Drive the processor as the duplex session does (chunk 0 left-padded to 16560, 80-sample carry)."""
    pending = np.concatenate([np.zeros(560, np.float32), audio])
    out = []
    for _ in range(n_chunks):
        need = mel.chunk_size()
        out.append(mel.process(pending[:need]))
        pending = pending[need:]
    return out, pending


def test_stream_emits_stable_frames_equal_to_whole_buffer_mel():
    audio = _speechlike(4.0, seed=2)
    mel = StreamingMel()
    chunks, _ = _feed_native(mel, audio, 3)
    assert [(c.start, c.end, c.prefix_extra, c.suffix_extra) for c in chunks] == \
        [(0, 102, 0, 2), (98, 202, 2, 2), (198, 302, 2, 2)]
    whole = log_mel(np.concatenate([np.zeros(560, np.float32), audio]), dynamic=False)  # < 5 s: fixed floor
    for c in chunks:
        assert rel_err(c.features, whole[:, c.start:c.end]) <= 1e-6
    st = mel.state
    assert (st.chunk_count, st.last_emitted_T, st.total_samples_processed) == (3, 300, 16480 + 2 * 16000)


def test_first_chunk_is_16480_samples_and_unstable_tail_needs_last_chunk_mode():
    mel = StreamingMel()
    assert mel.chunk_size() == 16480
    mel.process(np.zeros(16480, np.float32) + 0.01)
    assert mel.chunk_size() == 16000
    snap = mel.snapshot()
    tail = _speechlike(0.2, seed=3)
    tail = np.concatenate([np.zeros(80, np.float32), tail])
    assert mel.process(tail).n_frames == 0  # not stable yet: upstream emits nothing
    mel.restore(snap)
    c = mel.process(tail, last_chunk=True)
    assert (c.start, c.end, c.prefix_extra, c.suffix_extra) == (98, 123, 2, 0)


def test_dynamic_floor_from_five_seconds():
    audio = _speechlike(6.5, seed=4)
    audio[64000:72000] = 0.0  # silence, so that the floor matters
    mel = StreamingMel()
    chunks, _ = _feed_native(mel, audio, 6)
    padded = np.concatenate([np.zeros(560, np.float32), audio])
    for k, c in enumerate(chunks):
        buffer_len = 16480 + 16000 * k
        buf = padded[:buffer_len]
        expect = log_mel(buf, dynamic=buffer_len >= 80000)[:, c.start:c.end]
        assert torch.equal(c.features, expect), k
    # chunk 4 (96480 samples) is the first with the dynamic floor, and it differs from the fixed one
    fixed = log_mel(padded[:16480 + 16000 * 4], dynamic=False)[:, chunks[4].start:chunks[4].end]
    assert not torch.equal(chunks[4].features, fixed)


def test_sliding_window_at_30_seconds_keeps_global_frames():
    audio = _speechlike(31.0, seed=5)
    mel = StreamingMel()
    chunks, _ = _feed_native(mel, audio, 31)
    st = mel.state
    # chunk 29 brings the buffer to 480480 samples >= 30 s: 10 s (160000 samples) drop once
    assert st.left_samples_dropped == 160000 and st.base_T == 1000
    assert [c.start for c in chunks[28:]] == [2798, 2898, 2998]
    assert all(c.n_frames == 104 for c in chunks[1:])
    padded = np.concatenate([np.zeros(560, np.float32), audio])
    buf = padded[160000:16480 + 16000 * 29]
    assert torch.equal(chunks[29].features, log_mel(buf, True)[:, 2898 - 1000:3002 - 1000])


def test_snapshot_restore_is_bit_exact():
    audio = _speechlike(3.0, seed=6)
    a, b = StreamingMel(), StreamingMel()
    _feed_native(a, audio[:16000], 1)
    _feed_native(b, audio[:16000], 1)
    snap = b.snapshot()
    digest = snap.digest()
    b.process(np.ones(4000, np.float32), last_chunk=True)
    assert b.state.digest() != digest
    b.restore(snap)
    assert b.state.digest() == digest
    nxt = audio[15920:31920]
    ca, cb = a.process(nxt), b.process(nxt)
    assert torch.equal(ca.features, cb.features) and a.state.digest() == b.state.digest()
    with pytest.raises(ValueError):
        snap.buffer[0] = 1.0  # snapshots cannot be written through


def test_too_short_buffer_is_an_error():
    with pytest.raises(ValueError, match="at least 400 samples"):
        StreamingMel().process(np.zeros(100, np.float32), last_chunk=True)


@pytest.mark.parametrize("n", [400, 401, 16000, 16480, 48123, 480000, 499999])
def test_bucketed_stft_equals_the_plain_centered_stft(n):
    """The accelerator path pads the FFT batch to whole seconds of frames (few cuFFT plans);
    every kept frame reads the same samples, so on the CPU it is bit-identical."""
    from minicpmo_rt.thinker.mel import STFT_BUCKET_FRAMES, _bucketed_stft

    w = torch.from_numpy(np.random.default_rng(n).standard_normal(n).astype(np.float32))
    ref = torch.stft(w, 400, 160, window=torch.hann_window(400), return_complex=True)
    got = _bucketed_stft(w)
    assert got.shape == ref.shape and torch.equal(got, ref)
    assert STFT_BUCKET_FRAMES == 100


def test_the_warmed_stft_plans_are_the_ones_every_buffer_uses():
    """The warm-ups (``warm_mel``, ``_warmed_rows``) plan one STFT per ``stft_buckets`` entry, a batch's at
    ``batch_width`` samples a row; every buffer of up to 32 s lands on one of those buckets, and a row that wide
    makes exactly that many frames. Until session 52 the batched widths warmed were one frame longer, so each new
    second's bucket made its cuFFT plan mid-stream, which waited for all queued device work (the batched mel, once
    per duplex second)."""
    from minicpmo_rt.thinker.mel import HOP, N_FFT, batch_width, frame_bucket, stft_buckets

    buckets = stft_buckets(32.0)
    assert buckets[0] == 100 and buckets[-1] >= 1 + 32 * 16000 // HOP and len(set(buckets)) == len(buckets)
    used = {frame_bucket(1 + n // HOP) for n in range(N_FFT, 32 * 16000 + 1, 997)}
    assert used <= set(buckets)
    window = torch.hann_window(N_FFT)
    for bucket in (buckets[0], buckets[1], buckets[-1]):
        x = torch.zeros(2, batch_width(bucket))
        assert torch.stft(x, N_FFT, HOP, window=window, center=False, return_complex=True).shape[-1] == bucket


@pytest.mark.parametrize("n", [16480, 16000 * 5 + 150, 16000 * 17 + 149, 480000])
def test_the_mel_of_the_bucket_wide_stft_equals_upstreams(n):
    """The accelerator path runs the whole mel at the frame bucket's width (so its GEMM has the shapes
    ``warm_mel`` ran) and cuts the kept frames at the end: on the CPU it equals upstream's path (fp32, 1e-6).
    The signal is quiet but for its last 100 samples, which only the dropped frame and the bucket's extra
    frames read (when n % 160 > 140): a dynamic floor taken over the bucket's width would be wrong."""
    from minicpmo_rt.thinker.mel import _floored_mel, _stft_of_bucket, mel_filters

    w = 1e-3 * np.random.default_rng(n).standard_normal(n).astype(np.float32)
    w[-100:] *= 1e4
    wave = torch.from_numpy(w)
    stft = _stft_of_bucket(wave)
    assert stft.shape[-1] > n // 160 + 1     # extra frames to leave out
    for dynamic in (False, True):
        ref = log_mel(w, dynamic)
        got = _floored_mel(stft, mel_filters(), n // 160, dynamic)
        assert got.shape == ref.shape
        assert ((got - ref).norm() / ref.norm()).item() < 1e-6, (n, dynamic)


def test_warm_mel_is_a_no_op_off_cuda_and_both_floors_start_where_streams_reach_them():
    """``warm_mel`` loads the mel's kernels on CUDA only (the CPU runs upstream's path, nothing to load); the
    dynamic floor it warms starts at 5 s of buffer, which a stream's buffer (1.035 s, then 1 s a second) first
    reaches at its 5th second, after any warm-up of fewer seconds."""
    from minicpmo_rt.thinker.mel import frame_bucket, stft_buckets, uses_dynamic_floor, warm_mel

    assert warm_mel("cpu") == 0
    # the lengths warm_mel runs fill each bucket but for a frame (a zero padding, as in a stream)
    assert all(frame_bucket(1 + ((b - 1) * 160 - 80) // 160) == b and ((b - 1) * 160 - 80) // 160 + 1 < b
               for b in stft_buckets())
    first_dynamic = next(k for k in range(10) if uses_dynamic_floor(16480 + 16000 * k))
    assert first_dynamic == 4


def _cuda_kernels(fn) -> set[str]:
    """The names of the CUDA kernels ``fn()`` launches (copies and fills left out: they load nothing)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))}


@requires_cuda
def test_cuda_warm_mel_launches_every_kernel_a_streaming_mel_launches():
    """Every CUDA kernel ``log_mel`` launches, with either floor and at any buffer length, is one ``warm_mel``
    launched: the first launch of a kernel in a process loads it, and the dynamic floor's, first used at a
    stream's 5th second, took a 16-seat duplex second's mel from ~12 to 34 ms (session 53). cuBLAS picks the
    mel bank's GEMM kernel by shape (split-K at 1 s), hence every step at the frame bucket's width."""
    from minicpmo_rt.thinker.mel import _warmed_mel, uses_dynamic_floor, warm_mel

    _warmed_mel.cache_clear()     # warmed by an earlier test in this process, it would launch nothing
    warmed = _cuda_kernels(lambda: warm_mel("cuda"))
    plans = torch.backends.cuda.cufft_plan_cache[torch.cuda.current_device()].size
    rng = np.random.default_rng(0)
    # a stream's buffer at each of its seconds (1.035 s, then 1 s more each), and lengths off those
    for seconds in [1.035 + k for k in range(30)] + [0.7, 5.03, 17.3, 29.9]:
        wave = rng.standard_normal(int(seconds * 16000)).astype(np.float32)
        dynamic = uses_dynamic_floor(wave.shape[0])
        used = _cuda_kernels(lambda: log_mel(wave, dynamic, device="cuda"))
        assert used and used <= warmed, (seconds, dynamic, used - warmed)
    # and no cuFFT plan made: a plan made mid-stream waits for the device (session 52)
    assert torch.backends.cuda.cufft_plan_cache[torch.cuda.current_device()].size == plans


def test_warmed_rows_runs_the_batched_mel_at_every_bucket():
    """``_warmed_rows`` (a row count's first ``log_mel_many`` batch on CUDA) runs the batch's math at every bucket
    with both floors; run here on the CPU, where the batched path runs the same ops, for its shapes."""
    from minicpmo_rt.thinker.mel import _warmed_rows, stft_buckets

    assert _warmed_rows(torch.device("cpu"), 2) == len(stft_buckets()) == 33


@requires_cuda
def test_cuda_batched_mel_launches_no_kernel_and_makes_no_plan_after_its_first_batch():
    """After a row count's first ``log_mel_many`` batch (which runs ``_warmed_rows``), four streams' buffers at
    each of their 30 seconds, with their floors, launch only kernels that batch launched and make no cuFFT plan:
    a kernel's first launch loads it and a plan made mid-stream waits for the device (sessions 52-54)."""
    from minicpmo_rt.thinker.mel import _warmed_rows, log_mel_many, uses_dynamic_floor

    _warmed_rows.cache_clear()
    rng = np.random.default_rng(0)

    def batch(seconds: float) -> list[np.ndarray]:     # four streams a few hops apart
        return [rng.standard_normal(int(seconds * 16000) + 37 * i).astype(np.float32) for i in range(4)]

    def mels(waves):
        return log_mel_many(waves, [uses_dynamic_floor(w.shape[0]) for w in waves], device="cuda")

    warmed = _cuda_kernels(lambda: mels(batch(1.035)))
    plans = torch.backends.cuda.cufft_plan_cache[torch.cuda.current_device()].size
    for seconds in [1.035 + k for k in range(30)]:
        waves = batch(seconds)
        used = _cuda_kernels(lambda: mels(waves))
        assert used and used <= warmed, (seconds, used - warmed)
    assert torch.backends.cuda.cufft_plan_cache[torch.cuda.current_device()].size == plans


def test_log_mel_many_equals_each_buffer_alone():
    """One batch of buffers of different lengths (rows padded to a power of two, each to the longest's frame
    bucket, the reflect padding built by a gather) gives each buffer's ``log_mel`` (fp32, 1e-6), with each
    row's own floor: fixed, or dynamic from its own frames only (a loud longer row must not lift a quiet
    one's floor)."""
    from minicpmo_rt.thinker.mel import batch_rows, log_mel_many

    loud = 5.0 * _speechlike(7.3, seed=3)
    burst = 0.001 * _speechlike(2.0, seed=5)
    burst[-40:] = 50.0              # loudest in the frame log_mel drops (the last one): it must not set the floor
    waves = [_speechlike(1.03, seed=1), loud, 0.01 * _speechlike(6.0, seed=2), np.zeros(400, np.float32),
             _speechlike(2.5, seed=4), burst]
    dynamic = [False, True, True, False, True, True]
    got = log_mel_many(waves, dynamic)
    assert batch_rows(len(waves)) == 8 and [batch_rows(n) for n in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]
    for w, d, g in zip(waves, dynamic, got):
        want = log_mel(w, d)
        assert g.shape == want.shape
        assert rel_err(g, want) <= 1e-6
    with pytest.raises(ValueError, match="waveform 1 has 100 samples"):
        log_mel_many([waves[0], np.zeros(100, np.float32)], [False, False])
    with pytest.raises(ValueError, match="one choice per waveform"):
        log_mel_many(waves, dynamic[:2])


def test_process_many_emits_what_each_processor_emits_alone():
    """``process_many`` (the duplex batch's commits) against each processor's own ``process``: the same chunks
    (fp32, 1e-6) and the same states, over streams of different ages (first chunk, steady, past 5 s where the
    floor turns dynamic), then in last-chunk mode. On the CPU it batches only when asked (``batched=True``);
    a failure leaves every state as it was."""
    from minicpmo_rt.thinker.mel import process_many

    def streams():
        procs = [StreamingMel(device="cpu") for _ in range(3)]
        for k, p in enumerate(procs):          # ages 0, 2 and 6 chunks
            for c in range(2 * k + (k == 2) * 2):
                p.process(_speechlike(1.0 if c else 1.03, seed=10 * k + c)[:p.chunk_size()])
        return procs

    alone, together = streams(), streams()
    for step, last in ((0, False), (1, False), (2, True)):
        audios = [_speechlike(1.03, seed=100 + step + i)[:p.chunk_size()] for i, p in enumerate(alone)]
        want = [p.process(a, last_chunk=last) for p, a in zip(alone, audios)]
        got = process_many(together, audios, last_chunk=last, batched=True)
        for w, g, pa, pt in zip(want, got, alone, together):
            assert (g.start, g.end, g.core_start, g.core_end) == (w.start, w.end, w.core_start, w.core_end)
            assert g.features.shape == w.features.shape
            if w.n_frames:
                assert rel_err(g.features, w.features) <= 1e-6
            assert pt.state.digest() == pa.state.digest()
    with pytest.raises(ValueError, match="processors and"):
        process_many(together, audios[:2], batched=True)
    together[0].reset()                          # its next buffer is too short for a frame: the batch fails
    before = [p.state for p in together]
    with pytest.raises(ValueError, match="needs at least"):
        process_many(together, [np.zeros(10, np.float32)] * 3, batched=True)
    assert all(p.state is s for p, s in zip(together, before))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_process_many_batches_and_matches_each_alone():
    """On a CUDA device ``process_many`` batches by default (uploads through a shared ``HostStaging``): the
    chunks of each stream equal its own ``process`` on the same device within cuFFT's batch rounding (fp32,
    1e-5), its states bit for bit, over ages 0-6 s and a full 30-s window's slide."""
    from minicpmo_rt.thinker.mel import process_many
    from minicpmo_rt.thinker.staging import HostStaging

    staging = HostStaging("cuda")
    ages = (0, 1, 6, 30)

    def streams():
        procs = [StreamingMel(device="cuda", staging=staging) for _ in ages]
        for k, (p, age) in enumerate(zip(procs, ages)):
            for c in range(age):
                p.process(_speechlike(1.03, seed=10 * k + c)[:p.chunk_size()])
        return procs

    alone, together = streams(), streams()
    for step in range(3):
        audios = [_speechlike(1.03, seed=100 + step + i)[:p.chunk_size()] for i, p in enumerate(alone)]
        want = [p.process(a) for p, a in zip(alone, audios)]
        got = process_many(together, audios)
        for w, g, pa, pt in zip(want, got, alone, together):
            assert g.features.is_cuda and g.features.shape == w.features.shape
            if w.n_frames:
                assert rel_err(g.features, w.features) <= 1e-5
            assert pt.state.digest() == pa.state.digest()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_process_many_never_waits_for_queued_work():
    """With ~1 s of device work queued ahead (in duplex, the second's vision encoder), a batched ``process_many``
    returns long before it ends: every upload goes through the pinned staging. A copy from pageable memory
    syncs the stream first; the batch's row table went up that way until session 51 and waited out the queue.
    So does making a cuFFT plan: the first batch makes one for every frame bucket (a frame off until session
    52, so each new second's bucket planned mid-stream and waited). The first batch also reserves the largest
    upload of its sliding windows in the ring, and later calls take that idle slot instead of growing a
    frame's when their buffers outgrow a frame's 1 MiB (step 3 here). Its chunks still equal each stream's own
    ``process`` (fp32, 1e-5)."""
    from minicpmo_rt.thinker.mel import process_many
    from minicpmo_rt.thinker.staging import HostStaging

    staging = HostStaging("cuda", slots=4)
    alone = [StreamingMel(device="cuda") for _ in range(5)]
    together = [StreamingMel(device="cuda", staging=staging) for _ in range(5)]
    frame = np.zeros((448, 448, 3), np.uint8)
    for step in range(4):       # the first batch makes its plans and device constants: not timed
        audios = [_speechlike(1.03, seed=200 + 10 * step + i)[:p.chunk_size()] for i, p in enumerate(alone)]
        want = [p.process(a) for p, a in zip(alone, audios)]
        # a duplex second's frames share the ring (3 here), so the batch's turn comes round to a frame's slot
        for _ in range(3):
            staging.upload(frame)
        if step:
            plans = torch.backends.cuda.cufft_plan_cache.size
            got, host_s = behind_queued_work(lambda: process_many(together, audios))
            assert host_s < 0.2, f"process_many waited {host_s:.3f} s for the queued work"
            assert torch.backends.cuda.cufft_plan_cache.size == plans, "a batch made a cuFFT plan mid-stream"
            assert staging.grows == grown, "a batch grew a pinned slot (page-locking host memory every time)"
        else:
            got = process_many(together, audios)
            torch.cuda.synchronize()
            grown = staging.grows   # the first batch reserved the sliding window's largest upload
        for w, g in zip(want, got):
            assert g.features.shape == w.features.shape
            if w.n_frames:
                assert rel_err(g.features, w.features) <= 1e-5
