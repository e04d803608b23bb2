"""Voice-prompt frontend: a reference recording -> what the flow is conditioned on.

    frontend = VoiceFrontend(asset_dir)             # loads the two ONNX models once
    prompt = frontend("ref.wav")                     # PromptFeatures (tokens, spk_embedding, mel)

Steps (upstream ``Token2wav._prepare_prompt`` after vLLM-Omni's ``_normalize_reference``):
1. read any soundfile-readable file, mix to mono, resample to 24 kHz (polyphase,
   scipy) and trim / zero-pad to exactly ``ref_seconds`` (6.0 s), so every voice
   gives the same prompt length (150 tokens, 300 mel frames) and streams share
   one cache origin;
2. 16 kHz branch (resampled from that 24 kHz signal): the S3 tokenizer v2 log-mel
   (128 bins) -> ``speech_tokenizer_v2_25hz.onnx`` -> 25 Hz speech tokens; the
   80-bin kaldi fbank (mean-subtracted) -> ``campplus.onnx`` -> 192-d speaker embedding;
3. 24 kHz branch: the 80-bin log mel of the vocoder (n_fft/win 1920, hop 480,
   fmax 8000, reflect-padded, ``center=False``), replicate-padded or cut to 2 x tokens.

The DSP is numpy/torch (no torchaudio, no librosa): the Slaney mel filterbank,
kaldi's mel banks and povey window are computed here from their definitions.
Resampling is scipy's polyphase filter where upstream used torchaudio's sinc
resampler, so features of a resampled file differ slightly from upstream's.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import CheckpointError, InputError

SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2_25hz.onnx"
CAMPPLUS_FILE = "campplus.onnx"
PROMPT_SR = 24000
TOKENIZER_SR = 16000
REF_SECONDS = 6.0  # vLLM-Omni ref_audio_max_seconds
MIN_REF_SECONDS = 0.5  # shorter references carry too little voice to condition on
N_CODES = 6561
SPK_DIM = 192
TOKEN_MEL_RATIO = 2


@dataclass(frozen=True)
class PromptFeatures:
    """One voice's prompt, ready for the flow (shapes as upstream ``_prepare_prompt`` returns them).

    tokens: [1, n] int64 speech codes 0..6560 at 25 Hz (n = 150 for 6 s)
    spk_embedding: [1, 192] float32 campplus x-vector (not normalised; the flow L2-normalises)
    mel: [1, 2n, 80] float32 log mel at 50 Hz, frame-major as the flow takes it
    mel_frames: frames of ``mel`` computed from audio before the replicate padding / cut
    key: content hash of the normalised reference (a cache key for prompt solves)
    """

    tokens: torch.Tensor
    spk_embedding: torch.Tensor
    mel: torch.Tensor
    mel_frames: int
    key: str


# ----------------------------------------------------------------------------- audio I/O

def read_audio(path: Union[str, Path], what: str = "reference audio") -> tuple[np.ndarray, int]:
    """Any soundfile-readable file -> (mono float32 samples, sample rate). Channels are averaged; ``what`` names
    the recording in errors."""
    import soundfile as sf

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: {what} not found")
    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:  # noqa: BLE001 - libsndfile raises several types for bad files
        raise InputError(f"{path}: cannot be read as audio ({exc}); use WAV/FLAC/OGG") from None
    if data.shape[0] == 0:
        raise InputError(f"{path}: the {what} is empty")
    return data.mean(axis=1).astype(np.float32), int(sr)


def resample(x: np.ndarray, sr_from: int, sr_to: int) -> np.ndarray:
    """Polyphase resampling (scipy ``resample_poly``, Kaiser-windowed FIR), float32 out."""
    if sr_from == sr_to:
        return x.astype(np.float32, copy=False)
    from scipy.signal import resample_poly

    g = math.gcd(int(sr_from), int(sr_to))
    return resample_poly(x.astype(np.float64), sr_to // g, sr_from // g).astype(np.float32)


def normalize_reference(x: np.ndarray, sr: int, seconds: float = REF_SECONDS,
                        min_seconds: float = MIN_REF_SECONDS, where: str = "reference audio") -> np.ndarray:
    """Mono samples at ``sr`` -> 24 kHz, trimmed or zero-padded at the end to exactly ``seconds``."""
    if x.ndim != 1:
        raise InputError(f"{where}: expected mono samples [N], got shape {list(x.shape)}")
    if sr <= 0:
        raise InputError(f"{where}: sample rate must be positive, got {sr}")
    duration = x.shape[0] / sr
    if duration < min_seconds:
        raise InputError(f"{where}: {duration:.3f} s is too short; a voice reference needs at least "
                         f"{min_seconds} s (ideally {seconds} s) of speech")
    if not np.isfinite(x).all():
        raise InputError(f"{where}: contains NaN or infinite samples")
    y = resample(x, sr, PROMPT_SR)
    n = int(round(seconds * PROMPT_SR))
    return np.pad(y[:n], (0, max(0, n - y.shape[0]))).astype(np.float32)


# ----------------------------------------------------------------------------- filterbanks

def _hz_to_mel_slaney(f: np.ndarray) -> np.ndarray:
    f = np.asanyarray(f, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    logstep = math.log(6.4) / 27.0
    lin = f / f_sp
    return np.where(f >= min_log_hz, min_log_hz / f_sp + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep, lin)


def _mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    m = np.asanyarray(m, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


@functools.lru_cache(maxsize=8)
def slaney_mel_filters(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: Optional[float] = None) -> np.ndarray:
    """[n_mels, n_fft//2 + 1] float32 triangular filters on the Slaney mel scale with Slaney
    area normalisation (the definition behind ``librosa.filters.mel`` defaults)."""
    fmax = sr / 2 if fmax is None else fmax
    fft_freqs = np.linspace(0, sr / 2, 1 + n_fft // 2)
    mel_pts = _mel_to_hz_slaney(np.linspace(_hz_to_mel_slaney(fmin), _hz_to_mel_slaney(fmax), n_mels + 2))
    widths = np.diff(mel_pts)
    offsets = mel_pts[:, None] - fft_freqs[None, :]
    rise = -offsets[:-2] / widths[:-1, None]
    fall = offsets[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rise, fall))
    weights *= (2.0 / (mel_pts[2:] - mel_pts[:-2]))[:, None]
    return weights.astype(np.float32)


@functools.lru_cache(maxsize=4)
def kaldi_mel_banks(n_bins: int, padded: int, sr: int, low: float = 20.0, high: float = 0.0) -> torch.Tensor:
    """[n_bins, padded//2 + 1] kaldi mel banks (mel = 1127 ln(1 + f/700), triangles in mel,
    unnormalised; the Nyquist column is zero, as kaldi/torchaudio)."""
    nyquist = sr / 2
    high = high + nyquist if high <= 0 else high
    mel = lambda f: 1127.0 * np.log1p(np.asarray(f, dtype=np.float64) / 700.0)  # noqa: E731
    lo, hi = mel(low), mel(high)
    delta = (hi - lo) / (n_bins + 1)
    b = np.arange(n_bins, dtype=np.float64)[:, None]
    left, center, right = lo + b * delta, lo + (b + 1) * delta, lo + (b + 2) * delta
    bins = mel((sr / padded) * np.arange(padded // 2, dtype=np.float64))[None, :]
    up = (bins - left) / (center - left)
    down = (right - bins) / (right - center)
    banks = np.maximum(0.0, np.minimum(up, down))
    return torch.from_numpy(np.pad(banks, ((0, 0), (0, 1))).astype(np.float32))


# ----------------------------------------------------------------------------- features

def s3_log_mel(audio16k: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """S3 tokenizer v2 input (Whisper-style): [N] 16 kHz -> [n_mels, N//160] log10 mel,
    floored 8 below the peak and scaled to about [-1, 1]."""
    window = torch.hann_window(400, device=audio16k.device)
    spec = torch.stft(audio16k, 400, 160, window=window, return_complex=True)
    power = spec[..., :-1].abs() ** 2
    filters = torch.from_numpy(slaney_mel_filters(TOKENIZER_SR, 400, n_mels)).to(audio16k.device)
    log_spec = torch.clamp(filters @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def kaldi_fbank(audio16k: torch.Tensor, num_mel_bins: int = 80, sample_rate: int = TOKENIZER_SR) -> torch.Tensor:
    """Kaldi fbank with torchaudio.compliance.kaldi.fbank's defaults and dither 0:
    25 ms povey-windowed frames every 10 ms (snip edges), DC removal, pre-emphasis 0.97,
    512-point power spectrum, log mel energies floored at float32 eps. [N] -> [frames, bins]."""
    frame, shift, padded = int(sample_rate * 0.025), int(sample_rate * 0.010), 512
    x = audio16k.float()
    if x.shape[0] < frame:
        raise InputError(f"kaldi fbank: {x.shape[0]} samples is shorter than one {frame}-sample frame")
    frames = x.unfold(0, frame, shift)  # [T, 400]
    frames = frames - frames.mean(dim=1, keepdim=True)
    prev = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - 0.97 * prev
    povey = torch.hann_window(frame, periodic=False, dtype=torch.float64).pow(0.85).float()
    frames = F.pad(frames * povey, (0, padded - frame))
    power = torch.fft.rfft(frames).abs().pow(2)
    mel = power @ kaldi_mel_banks(num_mel_bins, padded, sample_rate).T
    return torch.clamp(mel, min=torch.finfo(torch.float32).eps).log()


def prompt_mel(audio24k: torch.Tensor, n_fft: int = 1920, hop: int = 480, win: int = 1920, n_mels: int = 80,
               fmin: float = 0.0, fmax: float = 8000.0) -> torch.Tensor:
    """The vocoder's mel (upstream ``mel_spectrogram``): [N] 24 kHz -> [n_mels, frames] natural-log
    magnitude mel, reflect-padded by (n_fft - hop)/2 each side, ``center=False``."""
    pad = (n_fft - hop) // 2
    y = F.pad(audio24k[None, None], (pad, pad), mode="reflect")[0]
    spec = torch.stft(y, n_fft, hop_length=hop, win_length=win, window=torch.hann_window(win, device=y.device),
                      center=False, normalized=False, onesided=True, return_complex=True)
    spec = torch.view_as_real(spec)
    mag = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    filters = torch.from_numpy(slaney_mel_filters(PROMPT_SR, n_fft, n_mels, fmin, fmax)).to(y.device)
    return torch.clamp(filters @ mag, min=1e-5).log()[0]


# ----------------------------------------------------------------------------- the frontend

def _onnx_session(path: Path, threads: int):
    import onnxruntime as ort

    if not path.is_file():
        raise CheckpointError(f"{path}: not found; a snapshot's assets/token2wav/ must hold {SPEECH_TOKENIZER_FILE} "
                              f"and {CAMPPLUS_FILE} (the voice-prompt models)")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise CheckpointError(f"{path}: onnxruntime cannot load it ({exc})") from None


class VoiceFrontend:
    """Reference audio -> ``PromptFeatures``. The ONNX models run on CPU (onnxruntime), as upstream's campplus."""

    def __init__(self, asset_dir: Union[str, Path], ref_seconds: float = REF_SECONDS,
                 min_seconds: float = MIN_REF_SECONDS, threads: int = 1):
        asset_dir = Path(asset_dir)
        self.ref_seconds, self.min_seconds = ref_seconds, min_seconds
        self.tokenizer_path = asset_dir / SPEECH_TOKENIZER_FILE
        self.campplus_path = asset_dir / CAMPPLUS_FILE
        self.tokenizer = _onnx_session(self.tokenizer_path, threads)
        self.campplus = _onnx_session(self.campplus_path, threads)

    def speech_tokens(self, audio16k: torch.Tensor) -> torch.Tensor:
        """[N] 16 kHz -> [1, n] int64 codes (25 Hz)."""
        feats = s3_log_mel(audio16k)[None].numpy().astype(np.float32)
        inputs = self.tokenizer.get_inputs()
        out = self.tokenizer.run(None, {inputs[0].name: feats,
                                        inputs[1].name: np.array([feats.shape[2]], dtype=np.int32)})[0]
        tokens = torch.from_numpy(np.asarray(out)).long().reshape(1, -1)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= N_CODES):
            raise CheckpointError(f"{self.tokenizer_path}: produced codes outside 0..{N_CODES - 1}")
        return tokens

    def speaker_embedding(self, audio16k: torch.Tensor) -> torch.Tensor:
        """[N] 16 kHz -> [1, 192] float32."""
        fb = kaldi_fbank(audio16k)
        fb = fb - fb.mean(dim=0, keepdim=True)
        inp = self.campplus.get_inputs()[0].name
        emb = np.asarray(self.campplus.run(None, {inp: fb[None].numpy().astype(np.float32)})[0], dtype=np.float32)
        if emb.size != SPK_DIM:
            raise CheckpointError(f"{self.campplus_path}: returned {list(emb.shape)}, expected [1, {SPK_DIM}]")
        return torch.from_numpy(emb.reshape(1, SPK_DIM))

    def features(self, audio: np.ndarray, sample_rate: int, where: str = "reference audio") -> PromptFeatures:
        """Mono samples at any rate -> ``PromptFeatures``."""
        ref24 = normalize_reference(np.asarray(audio, dtype=np.float32), sample_rate, self.ref_seconds,
                                    self.min_seconds, where)
        ref16 = torch.from_numpy(resample(ref24, PROMPT_SR, TOKENIZER_SR))
        tokens = self.speech_tokens(ref16)
        spk = self.speaker_embedding(ref16)
        mel = prompt_mel(torch.from_numpy(ref24)).T[None]  # [1, frames, 80]
        frames = mel.shape[1]
        target = tokens.shape[1] * TOKEN_MEL_RATIO
        mel = mel[:, :target] if frames >= target else F.pad(mel, (0, 0, 0, target - frames), mode="replicate")
        key = hashlib.sha256(ref24.tobytes()).hexdigest()[:16]
        return PromptFeatures(tokens, spk, mel.contiguous(), frames, key)

    def __call__(self, path: Union[str, Path]) -> PromptFeatures:
        audio, sr = read_audio(path)
        return self.features(audio, sr, where=str(path))


# ----------------------------------------------------------------------------- tiny ONNX models

def _tiny_graphs(seed: int):
    """Small deterministic graphs with the real models' input/output signatures."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def init(name: str, arr: np.ndarray):
        return numpy_helper.from_array(arr.astype(arr.dtype), name)

    # S3 tokenizer: feats [1,128,T] f32, feats_length [1] i32 -> tokens [1, ceil(T/4)] i64 in 0..6560.
    # conv1x1 -> tanh -> maxpool(4, ceil) over time -> conv1x1 -> |x| * 1e4 -> int -> mod 6561.
    s3_nodes = [
        helper.make_node("Conv", ["feats", "w1"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["h2"]),
        helper.make_node("MaxPool", ["h2"], ["h3"], kernel_shape=[4], strides=[4], ceil_mode=1),
        helper.make_node("Conv", ["h3", "w2"], ["h4"]),
        # feats_length enters as a zero term, so the input is consumed as in the real graph
        helper.make_node("Cast", ["feats_length"], ["len_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["len_f", "zero"], ["len0"]),
        helper.make_node("Add", ["h4", "len0"], ["h5"]),
        helper.make_node("Abs", ["h5"], ["h6"]),
        helper.make_node("Mul", ["h6", "scale"], ["h7"]),
        helper.make_node("Cast", ["h7"], ["h8"], to=TensorProto.INT64),
        helper.make_node("Mod", ["h8", "ncodes"], ["h9"], fmod=0),
        helper.make_node("Squeeze", ["h9", "axis1"], ["tokens"]),
    ]
    s3_inits = [init("w1", rng.standard_normal((16, 128, 1)).astype(np.float32) / 8),
                init("w2", rng.standard_normal((1, 16, 1)).astype(np.float32)),
                init("zero", np.zeros(1, np.float32)), init("scale", np.full(1, 1e4, np.float32)),
                init("ncodes", np.full(1, N_CODES, np.int64)), init("axis1", np.array([1], np.int64))]
    s3 = helper.make_graph(
        s3_nodes, "tiny_speech_tokenizer_v2",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, "L"])], s3_inits)

    # campplus: input [1, T, 80] f32 -> embedding [1, 192] f32 (mean over time -> linear -> tanh).
    cp_nodes = [helper.make_node("ReduceMean", ["input", "axis1"], ["m"], keepdims=0),
                helper.make_node("MatMul", ["m", "w"], ["p"]),
                helper.make_node("Add", ["p", "b"], ["q"]),
                helper.make_node("Tanh", ["q"], ["embedding"])]
    cp_inits = [init("axis1", np.array([1], np.int64)),
                init("w", rng.standard_normal((80, SPK_DIM)).astype(np.float32) / 9),
                init("b", rng.standard_normal(SPK_DIM).astype(np.float32) * 0.1)]
    cp = helper.make_graph(
        cp_nodes, "tiny_campplus",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, SPK_DIM])], cp_inits)

    def model(graph):
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="minicpmo-rt")
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m

    return model(s3), model(cp)


def write_tiny_frontend(asset_dir: Path, seed: int) -> None:
    """Tiny ``speech_tokenizer_v2_25hz.onnx`` and ``campplus.onnx`` (real signatures, random weights)."""
    import onnx

    s3, cp = _tiny_graphs(seed)
    onnx.save(s3, str(Path(asset_dir) / SPEECH_TOKENIZER_FILE))
    onnx.save(cp, str(Path(asset_dir) / CAMPPLUS_FILE))
