"""Whisper log-mel features and upstream's streaming mel buffer.

``log_mel`` is the torch path of upstream's ``MiniCPMAAudioProcessor``: a centred
(reflect-padded) STFT with a periodic Hann window (n_fft 400, hop 160), power
spectrum, the last frame dropped, 80 Slaney mel filters (0-8 kHz), log10 of the
clamped energies, then a floor -- fixed (-10) or dynamic (max - 8) -- and (x+4)/4.

``StreamingMel`` mirrors upstream's ``StreamingMelProcessorExact`` as the duplex path
configures it (first chunk 1035 ms -> 16480 samples, then 1000 ms, 20 ms = 2 CNN
redundancy frames each side, 30 s trigger / 10 s stride sliding window): it keeps the
whole audio buffer, recomputes the mel of the buffer on every call and emits only
frames whose window lies inside the buffer ("stable" frames), or in last-chunk mode
whatever the buffer has. The floor is chosen from the buffer length on each call
(fixed under 5 s, dynamic from 5 s). All of its state is one ``MelState`` value.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
import torch

from ..errors import InputError
from .staging import HostStaging

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
N_MELS = 80
FIXED_FLOOR_DB = -10.0
DYNAMIC_RANGE_DB = 8.0
DYNAMIC_FROM_SECONDS = 5.0


@lru_cache(maxsize=4)
def mel_filters(n_mels: int = N_MELS, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """[n_mels, 1 + n_fft//2] float32 Slaney filters, exactly WhisperFeatureExtractor's."""
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(num_frequency_bins=1 + n_fft // 2, num_mel_filters=n_mels, min_frequency=0.0,
                           max_frequency=8000.0, sampling_rate=sample_rate, norm="slaney", mel_scale="slaney")
    return torch.from_numpy(bank).to(torch.float32).T.contiguous()


@lru_cache(maxsize=8)
def _filters_on(n_mels: int, device: torch.device) -> torch.Tensor:
    # one upload per device: a per-call .to(device) of the CPU bank is a blocking copy
    return mel_filters(n_mels).to(device)


@lru_cache(maxsize=8)
def _window_on(device: torch.device) -> torch.Tensor:
    return torch.hann_window(N_FFT, device=device)


STFT_BUCKET_FRAMES = 100  # 1 s of frames


def _bucketed_stft(wave: torch.Tensor) -> torch.Tensor:
    """``torch.stft(wave, center=True)`` with the FFT batch rounded up to whole seconds of frames.

    cuFFT plans are cached per batch size, and the streaming buffer has a new length at
    almost every call (it grows by each chunk or tail until it slides), so the exact batch
    made a new plan (milliseconds of host time) per call. Here the reflect padding of
    ``center=True`` is applied first, zeros are appended until the frame count reaches the
    next multiple of ``STFT_BUCKET_FRAMES``, and the extra frames are cut off: each kept
    frame reads exactly the samples it reads in the plain call, and ~31 plans cover a 30-s
    buffer. (The plain call is kept on the CPU, upstream's path.)
    """
    return _stft_of_bucket(wave)[:, :1 + wave.numel() // HOP]


def _stft_of_bucket(wave: torch.Tensor) -> torch.Tensor:
    """``_bucketed_stft`` before its extra frames are cut: [freq, frame_bucket(frames)]."""
    bucket = frame_bucket(1 + wave.numel() // HOP)
    half = N_FFT // 2
    padded = torch.nn.functional.pad(wave[None, None], (half, half), mode="reflect")[0, 0]
    padded = torch.nn.functional.pad(padded, (0, (bucket - 1) * HOP + N_FFT - padded.numel()))
    return torch.stft(padded, N_FFT, HOP, window=_window_on(wave.device), center=False, return_complex=True)


def warm_mel(device: torch.device | str, max_seconds: float = 32.0, sample_rate: int = SAMPLE_RATE) -> int:
    """``log_mel`` with each floor at every frame bucket of a buffer of up to ``max_seconds``: its cuFFT plans
    are made and every kernel a streaming mel launches is loaded (in a process, a kernel's first launch loads
    it) before a user's first second. The dynamic floor (a reduction over the whole mel) starts at 5 s of
    buffer, the 5th second of every stream, after a 2-s warm-up; its first use in a process took the 16-seat
    duplex second's mel from ~12 to 34 ms on the H200 (``duplex_waits_session53_h200.md``). Every bucket, since
    cuBLAS picks the mel bank's GEMM kernel by shape (split-K at 1 s, another at 5 s). Returns the number of
    buckets; a no-op off CUDA, and done once per process and device (``shared_fast_paths`` calls it for every
    batch or conversation it equips)."""
    device = torch.device(device)
    return _warmed_mel(device, max_seconds, sample_rate) if device.type == "cuda" else 0


@lru_cache(maxsize=8)
def _warmed_mel(device: torch.device, max_seconds: float, sample_rate: int) -> int:
    # a cache of work done, not a switch: the plans stay in cuFFT's cache and loaded kernels stay loaded
    buckets = stft_buckets(max_seconds, sample_rate)
    for bucket in buckets:
        # half a hop short of the bucket: frames = bucket - 1, so the zero padding is not empty, as in a stream
        wave = torch.zeros((bucket - 1) * HOP - HOP // 2, device=device)
        for dynamic in (False, True):
            log_mel(wave, dynamic, device=device)
    return len(buckets)


def stft_buckets(max_seconds: float = 32.0, sample_rate: int = SAMPLE_RATE) -> list[int]:
    """The padded frame counts (``frame_bucket``) of every buffer of up to ``max_seconds``."""
    return list(range(STFT_BUCKET_FRAMES, frame_bucket(1 + int(max_seconds * sample_rate) // HOP) + 1,
                      STFT_BUCKET_FRAMES))


def frame_bucket(frames: int) -> int:
    """``frames`` rounded up to whole ``STFT_BUCKET_FRAMES``: the STFT's batch, so that few cuFFT plans serve
    a buffer that grows at every call."""
    return -(-frames // STFT_BUCKET_FRAMES) * STFT_BUCKET_FRAMES


@lru_cache(maxsize=64)
def _warmed_rows(device: torch.device, rows: int, n_mels: int = N_MELS) -> int:
    """``log_mel_many``'s math for ``rows`` rows at every frame bucket, with both floors, once per process at a
    row count's first batch (a cache of work done, not a switch): its cuFFT plans are made and its kernels
    loaded (cuBLAS picks the batched GEMM's by shape) before the streams' buffers reach each bucket, as
    ``warm_mel`` does for one buffer. Returns the number of buckets."""
    buckets = stft_buckets()
    dyn = (torch.arange(rows, device=device) % 2)[:, None]       # both floors in each batch
    for bucket in buckets:
        kept = torch.full((rows, 1), bucket - 2, device=device)  # frames = bucket - 1: as a stream's, short of it
        _mel_rows(torch.zeros(rows, batch_width(bucket), device=device), bucket, kept, dyn, n_mels)
    return len(buckets)


def batch_width(bucket: int) -> int:
    """The samples of a ``log_mel_many`` row whose frames are padded to ``bucket`` (a multiple of
    ``STFT_BUCKET_FRAMES``): the STFT then makes ``bucket`` frames, one cuFFT plan per bucket and row count.
    Until session 52 the plan warm-up warmed widths of one frame more than a multiple, so every new bucket
    made its plan mid-stream, which waited for all queued device work (the batched mel, once per second)."""
    return (bucket - 1) * HOP + N_FFT


def batch_rows(n: int) -> int:
    """The row count ``log_mel_many`` runs ``n`` buffers at: the next power of two (few cuFFT plans)."""
    return 1 << max(0, n - 1).bit_length()


def log_mel_many(waveforms: list[np.ndarray], dynamic: list[bool], n_mels: int = N_MELS,
                 device: str | torch.device | None = None, staging: HostStaging | None = None,
                 reserve_samples: int = 0) -> list[torch.Tensor]:
    """``log_mel(waveforms[i], dynamic[i])`` of several buffers in one batch: [n_mels, len_i // 160] each.

    Every buffer goes up into one flat device tensor (with the row table: one upload through ``staging``
    where given), a gather builds each row's reflect-padded signal, zero-padded to the longest's frame
    bucket (each kept frame reads the samples it reads alone, as in ``_bucketed_stft``), and the STFT,
    the mel bank, the log and each row's floor run once for all rows (padded to ``batch_rows``). A
    duplex second of 16 conversations made ~200 launches one buffer at a time. On a CUDA device the
    first batch of a row count runs the math at every bucket first (``_warmed_rows``: plans and kernels).
    ``reserve_samples``: the most samples a batch of the caller's holds, so that the pinned slot grows once
    (growing page-locks new host memory, milliseconds for tens of MiB, see ``staging``)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if len(waveforms) != len(dynamic) or not waveforms:
        raise ValueError(f"log_mel_many: {len(waveforms)} waveforms and {len(dynamic)} floor choices; give one "
                         "choice per waveform, at least one")
    waves = [np.asarray(w, dtype=np.float32).reshape(-1) for w in waveforms]
    lens = [int(w.shape[0]) for w in waves]
    for i, n in enumerate(lens):
        if n < N_FFT:
            raise ValueError(f"log_mel_many: waveform {i} has {n} samples; each needs at least {N_FFT}")
    B, rows, half = len(waves), batch_rows(len(waves)), N_FFT // 2
    if device.type == "cuda":
        _warmed_rows(device, rows, n_mels)
    frames = [1 + n // HOP for n in lens]
    bucket = frame_bucket(max(frames))
    width = batch_width(bucket)
    offsets = np.concatenate([[0], np.cumsum(lens[:-1])]).astype(np.int64)
    # per row: offset, length, kept frames, dynamic floor; padding rows repeat row 0 (their output is dropped)
    meta = [[int(offsets[i]), lens[i], frames[i] - 1, int(dynamic[i])] for i in range(B)]
    meta = np.asarray(meta + [meta[0]] * (rows - B), dtype=np.int64)
    samples = sum(lens)
    if staging is not None and device.type == "cuda":
        # the buffers and the row table in one pinned slot and one copy: the table went up from pageable memory
        # until session 51, which syncs the stream first, so the batch waited for the vision encoder queued
        # before it (test_cuda_process_many_never_waits_for_queued_work); one slot also spares the ring
        # the second's frames share
        def table_at(n: int) -> int:     # the row table's byte offset after n samples, 8-byte aligned
            return -(-4 * n // 8) * 8

        meta_at = table_at(samples)
        reserve = table_at(max(samples, reserve_samples)) + meta.nbytes
        packed = staging.upload_packed([*waves, meta], [4 * int(o) for o in offsets] + [meta_at],
                                       meta_at + meta.nbytes, reserve)
        flat = packed[:4 * samples].view(torch.float32)
        meta = packed[meta_at:].view(torch.int64).view(rows, 4)
    else:
        flat = torch.from_numpy(np.concatenate(waves)).to(device)     # a copy: buffers are read-only arrays
        meta = torch.from_numpy(meta).to(device)
    off, n, kept, dyn = (meta[:, k:k + 1] for k in range(4))
    p = torch.arange(width, device=device)[None] - half          # each padded sample's place in its buffer
    src = p.abs()                                                 # the left reflection: -k reads k
    src = torch.where(src >= n, 2 * (n - 1) - src, src)           # the right one: n - 1 + k reads n - 1 - k
    signal = torch.where(p < n + half, flat[(off + src.clamp(min=0)).clamp(max=flat.numel() - 1)], 0.0)
    out = _mel_rows(signal, bucket, kept, dyn, n_mels)
    return [out[i, :, :frames[i] - 1] for i in range(B)]


def _mel_rows(signal: torch.Tensor, bucket: int, kept: torch.Tensor, dyn: torch.Tensor,
              n_mels: int) -> torch.Tensor:
    """``log_mel_many`` from its padded rows ([rows, batch_width(bucket)] samples): [rows, n_mels, bucket - 1],
    each row's floor (``dyn`` [rows, 1] nonzero: dynamic) from its first ``kept`` [rows, 1] frames only."""
    device = signal.device
    stft = torch.stft(signal, N_FFT, HOP, window=_window_on(device), center=False, return_complex=True)
    power = (stft[..., :bucket - 1].abs() ** 2).contiguous()      # [rows, freq, bucket - 1]
    spec = torch.clamp(_filters_on(n_mels, device) @ power, min=1e-10).log10()
    valid = torch.arange(bucket - 1, device=device)[None] < kept  # [rows, frames]
    top = spec.masked_fill(~valid[:, None], float("-inf")).amax(dim=(1, 2))
    floor = torch.where(dyn[:, 0].bool(), top - DYNAMIC_RANGE_DB, torch.full_like(top, FIXED_FLOOR_DB))
    return (torch.maximum(spec, floor[:, None, None]) + 4.0) / 4.0


def log_mel(waveform: np.ndarray | torch.Tensor, dynamic: bool, n_mels: int = N_MELS,
            device: str | torch.device | None = None, staging: HostStaging | None = None) -> torch.Tensor:
    """Whisper log-mel of a mono 16 kHz waveform: [n_mels, len // 160] float32.

    ``dynamic`` selects the max-8 floor (upstream from 5 s of buffer on) instead of -10.
    ``device`` (default CPU, upstream's path) may name an accelerator: the result then
    differs from the CPU one only by FFT rounding, and a 30-s buffer costs well under a
    millisecond instead of tens of milliseconds. ``staging`` uploads a numpy waveform without
    waiting for the device (see ``staging.HostStaging``).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if torch.is_tensor(waveform):
        wave = waveform.detach().to(device=device, dtype=torch.float32)
    elif staging is not None and device.type != "cpu":
        wave = staging.upload(np.asarray(waveform, dtype=np.float32))
    else:
        # A copy: buffers are read-only numpy arrays, which torch cannot wrap safely.
        wave = torch.tensor(np.asarray(waveform, dtype=np.float32), device=device)
    if wave.numel() < N_FFT:
        raise ValueError(f"log_mel needs at least {N_FFT} samples, got {wave.numel()}")
    kept = wave.numel() // HOP            # the frames of the centred STFT less the last one, as upstream
    if device.type == "cpu":
        stft = torch.stft(wave, N_FFT, HOP, window=torch.hann_window(N_FFT), return_complex=True)
        bank = mel_filters(n_mels)
    else:
        # every step at the frame bucket's width, cut to the kept frames at the end: the ops' shapes (the
        # GEMM's kernel among them) are then those ``warm_mel`` ran, whatever the buffer's length
        stft = _stft_of_bucket(wave)
        bank = _filters_on(n_mels, device)
    return _floored_mel(stft, bank, kept, dynamic)


def _floored_mel(stft: torch.Tensor, bank: torch.Tensor, kept: int, dynamic: bool) -> torch.Tensor:
    """``log_mel`` from a centred STFT of at least ``kept`` + 1 frames: the mel of its first ``kept``
    frames; the dynamic floor is taken from those frames only (later ones may read the zero padding)."""
    power = (stft[..., :-1].abs() ** 2).contiguous()
    spec = torch.clamp(bank @ power, min=1e-10).log10()
    if dynamic:
        floored = torch.maximum(spec, spec[:, :kept].max() - DYNAMIC_RANGE_DB)
    else:    # the fixed floor as a clamp (equal to a maximum with a -10 tensor, without uploading one)
        floored = spec.clamp(min=FIXED_FLOOR_DB)
    return ((floored + 4.0) / 4.0)[:, :kept]


def uses_dynamic_floor(buffer_len: int, sample_rate: int = SAMPLE_RATE) -> bool:
    return buffer_len >= DYNAMIC_FROM_SECONDS * sample_rate


@dataclass(frozen=True)
class MelState:
    """Everything the streaming mel processor remembers (upstream's snapshot fields).

    ``buffer`` is read-only: processing replaces it rather than writing into it, so a
    state value can be kept as a snapshot without copying.
    """

    buffer: np.ndarray
    chunk_count: int = 0
    last_emitted_T: int = 0  # global index of the next core frame to emit
    total_samples_processed: int = 0
    base_T: int = 0  # global frame index of the buffer's first frame
    left_samples_dropped: int = 0
    is_first: bool = True

    @functools.cached_property
    def buffer_sha1(self) -> str:
        # The buffer is read-only, so one hash per state value: a restored snapshot state (the
        # same object) is not hashed again (up to 1.9 MB of buffer per fingerprint otherwise).
        return hashlib.sha1(np.ascontiguousarray(self.buffer).data).hexdigest()  # no bytes copy

    def digest(self) -> tuple:
        """Counters plus a SHA-1 of the buffer bytes (for fingerprints)."""
        return (self.chunk_count, self.last_emitted_T, self.total_samples_processed, self.base_T,
                self.left_samples_dropped, self.is_first, int(self.buffer.shape[0]), self.buffer_sha1)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def empty_state() -> MelState:
    return MelState(buffer=_frozen(np.zeros(0, dtype=np.float32)))


@dataclass(frozen=True)
class MelChunk:
    """Frames emitted by one call, with their global frame range.

    ``core_start..core_end`` is the new content; ``start..end`` adds the CNN redundancy
    frames that were available. prefix/suffix_extra are what the audio encoder cuts.
    """

    features: torch.Tensor  # [n_mels, end - start]
    start: int
    end: int
    core_start: int
    core_end: int

    @property
    def prefix_extra(self) -> int:
        return self.core_start - self.start

    @property
    def suffix_extra(self) -> int:
        return max(0, self.end - self.core_end)

    @property
    def n_frames(self) -> int:
        return int(self.features.shape[-1])


class StreamingMel:
    """Upstream's exact streaming mel processor (duplex configuration by default)."""

    def __init__(self, chunk_ms: int = 1000, first_chunk_ms: int = 1035, cnn_redundancy_ms: int = 20,
                 sample_rate: int = SAMPLE_RATE, sliding_window: bool = True, slide_trigger_seconds: float = 30.0,
                 slide_stride_seconds: float = 10.0, n_mels: int = N_MELS,
                 device: str | torch.device | None = None, staging: HostStaging | None = None):
        self.device = device  # where the mel is computed (None: CPU, as upstream)
        self.staging = staging  # uploads of the waveform buffer that do not wait for the device
        self.sample_rate = sample_rate
        self.n_mels = n_mels
        self.chunk_samples = int(round(chunk_ms * sample_rate / 1000))
        self.chunk_frames = self.chunk_samples // HOP
        raw_first = int(round(first_chunk_ms * sample_rate / 1000))
        self.first_chunk_samples = max(HOP, (raw_first // HOP) * HOP)  # 1035 ms -> 16480
        self.redundancy_frames = max(0, int(cnn_redundancy_ms * sample_rate / 1000) // HOP)
        self.sliding_window = sliding_window
        self.trigger_samples = int(slide_trigger_seconds * sample_rate)
        self.stride_samples = int(slide_stride_seconds * sample_rate)
        self.state = empty_state()

    @property
    def largest_upload(self) -> int:
        """Bytes of the largest waveform buffer ``process`` uploads: a sliding buffer stays under its trigger
        (30 s, ~1.9 MB; it slides before the mel is computed); without the slide there is no bound (0)."""
        return 4 * self.trigger_samples if self.sliding_window else 0

    # -- state ------------------------------------------------------------------------------
    def reset(self) -> None:
        self.state = empty_state()

    def snapshot(self) -> MelState:
        return self.state

    def restore(self, state: MelState) -> None:
        self.state = state

    def chunk_size(self) -> int:
        """Samples the next native chunk consumes (16480 first, then 16000)."""
        return self.first_chunk_samples if self.state.is_first else self.chunk_samples

    # -- processing ----------------------------------------------------------------------------
    def _slide(self, st: MelState) -> MelState:
        """At 30 s of buffer drop 10 s from the left (hop-aligned), keeping >= 1 s."""
        n = int(st.buffer.shape[0])
        if not self.sliding_window or n < self.trigger_samples:
            return st
        guard = min(self.sample_rate, n - self.stride_samples)
        drop = min(self.stride_samples, max(0, n - guard))
        drop = (drop // HOP) * HOP
        if drop <= 0:
            return st
        return replace(st, buffer=_frozen(st.buffer[drop:]), left_samples_dropped=st.left_samples_dropped + drop,
                       base_T=st.base_T + drop // HOP)

    def stable_frames(self, buffer_len: int) -> int:
        half = N_FFT // 2
        if buffer_len < half:
            return 0
        return max(0, (buffer_len - half) // HOP + 1)

    def process(self, audio: np.ndarray, last_chunk: bool = False) -> MelChunk:
        """Append ``audio`` (float32 mono 16 kHz) and emit the next core chunk's frames.

        Emits nothing (an empty chunk) until the core plus its right redundancy is
        stable, unless ``last_chunk``: then whatever part of the core the buffer has is
        emitted (frames near the end use the STFT's reflect padding, as upstream).
        """
        st, samples = self._appended(audio)
        n = int(st.buffer.shape[0])
        mel = log_mel(st.buffer, uses_dynamic_floor(n, self.sample_rate), self.n_mels, self.device, self.staging)
        return self._emit(st, mel, samples, last_chunk)

    def _appended(self, audio: np.ndarray) -> tuple[MelState, int]:
        """The state with ``audio`` appended (and slid), not yet kept, and the samples appended."""
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        st = self.state
        buf = _frozen(np.concatenate([st.buffer, audio]) if st.buffer.size else audio.copy())
        return self._slide(replace(st, buffer=buf, chunk_count=st.chunk_count + 1)), int(audio.shape[0])

    def _emit(self, st: MelState, mel: torch.Tensor, samples: int, last_chunk: bool) -> MelChunk:
        """``process``'s frames out of ``mel``, the log-mel of ``st``'s buffer; keeps the new state."""
        n = int(st.buffer.shape[0])
        t_full = int(mel.shape[-1])
        stable_global = st.base_T + min(t_full, self.stable_frames(n))
        core_start = st.last_emitted_T
        core_end = core_start + self.chunk_frames
        if stable_global >= core_end + self.redundancy_frames or last_chunk:
            start_g = max(0, core_start - self.redundancy_frames)
            end_g = core_end + self.redundancy_frames
            lo = max(0, min(start_g - st.base_T, t_full))
            hi = max(lo, min(end_g - st.base_T, t_full))
            out = MelChunk(mel[:, lo:hi], st.base_T + lo, st.base_T + hi, core_start, core_end)
            st = replace(st, last_emitted_T=core_end)
        else:
            out = MelChunk(mel[:, 0:0], core_start, core_start, core_start, core_start)
        self.state = replace(st, total_samples_processed=st.total_samples_processed + samples, is_first=False)
        return out

    def flush(self) -> torch.Tensor:
        """Every frame not yet emitted (end of stream), as upstream's ``flush``."""
        st = self.state
        n = int(st.buffer.shape[0])
        if n == 0:
            return torch.zeros(self.n_mels, 0, device=self.device)
        mel = log_mel(st.buffer, uses_dynamic_floor(n, self.sample_rate), self.n_mels, self.device, self.staging)
        t_global = st.base_T + int(mel.shape[-1])
        if st.last_emitted_T >= t_global:
            return mel[:, 0:0]
        tail = mel[:, max(0, st.last_emitted_T - st.base_T):]
        self.state = replace(st, last_emitted_T=t_global)
        return tail


def process_many(procs: "list[StreamingMel]", audios: list[np.ndarray], last_chunk: bool = False,
                 batched: bool | None = None) -> list[MelChunk]:
    """``procs[i].process(audios[i], last_chunk)`` for each, their log-mels in one ``log_mel_many`` batch.
    ``batched`` None: batch where every processor computes on one CUDA device with the same settings (the CPU
    keeps upstream's own path, one buffer at a time); True: batch on any device. If the batch fails, no
    processor's state has changed (one at a time, those before the failing one have moved on)."""
    if len(procs) != len(audios):
        raise ValueError(f"process_many: {len(procs)} processors and {len(audios)} audio chunks")
    if not procs:
        return []
    first = procs[0]
    where = torch.device(first.device or "cpu")
    alike = all(torch.device(p.device or "cpu") == where and (p.n_mels, p.sample_rate) ==
                (first.n_mels, first.sample_rate) for p in procs)
    if batched is None:
        batched = alike and len(procs) > 1 and where.type == "cuda"
    if not batched:
        return [p.process(a, last_chunk) for p, a in zip(procs, audios)]
    if not alike:
        raise ValueError("process_many: batched processors must share their device, n_mels and sample rate")
    appended = [p._appended(a) for p, a in zip(procs, audios)]
    floors = [uses_dynamic_floor(int(st.buffer.shape[0]), p.sample_rate) for p, (st, _) in zip(procs, appended)]
    # a sliding buffer stays under its trigger: the batch's largest upload, reserved on the first
    most = sum(p.largest_upload for p in procs) // 4 if all(p.largest_upload for p in procs) else 0
    mels = log_mel_many([st.buffer for st, _ in appended], floors, first.n_mels, first.device, first.staging,
                        reserve_samples=most)
    return [p._emit(st, mel, samples, last_chunk) for p, (st, samples), mel in zip(procs, appended, mels)]


def check_audio(audio, sample_rate: int, where: str) -> np.ndarray:
    """Audio as the Thinker takes it: a 1-D float array (a [1, N] or [N, 1] one is flattened), finite,
    resampled to 16 kHz when ``sample_rate`` differs -> float32 samples; anything else is refused naming
    ``where``."""
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().cpu().numpy()
    if not isinstance(audio, np.ndarray):
        raise InputError(f"{where}: audio must be a numpy array of 16 kHz mono float samples, got "
                         f"{type(audio).__name__}")
    if audio.ndim == 2 and 1 in audio.shape:
        audio = audio.reshape(-1)
    if audio.ndim != 1:
        raise InputError(f"{where}: audio of shape {list(audio.shape)} is not mono; mix it down to one channel")
    if not np.issubdtype(audio.dtype, np.floating):
        raise InputError(f"{where}: audio dtype {audio.dtype} is not floating point; pass float32 samples in "
                         "[-1, 1] (e.g. int16 / 32768)")
    if audio.size == 0:
        raise InputError(f"{where}: empty audio; pass at least one sample ({SAMPLE_RATE} a second)")
    if not np.isfinite(audio).all():
        raise InputError(f"{where}: audio holds NaN or infinite samples")
    if int(sample_rate) <= 0:
        raise InputError(f"{where}: sample_rate must be positive, got {sample_rate}")
    audio = audio.astype(np.float32, copy=False)
    if int(sample_rate) != SAMPLE_RATE:
        from math import gcd

        from scipy.signal import resample_poly

        g = gcd(int(sample_rate), SAMPLE_RATE)
        audio = resample_poly(audio, SAMPLE_RATE // g, int(sample_rate) // g).astype(np.float32)
        if audio.size == 0:
            raise InputError(f"{where}: audio is empty after resampling {sample_rate} Hz to {SAMPLE_RATE} Hz")
    return audio
