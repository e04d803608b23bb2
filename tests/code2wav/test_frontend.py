"""Voice-prompt frontend: DSP parity with independent references, tiny ONNX models, resampling, bad input."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from conftest import rel_err
from minicpmo_rt.code2wav import frontend as fe
from minicpmo_rt.errors import CheckpointError, InputError

TOL = 1e-5


@pytest.fixture(scope="module")
def ref_wav(shared_dir) -> Path:
    path = shared_dir / "media" / "ref_en_dlc_1.wav"
    if not path.is_file():
        pytest.skip(f"{path} missing")
    return path


@pytest.fixture(scope="module")
def ref16(ref_wav) -> torch.Tensor:
    audio, sr = fe.read_audio(ref_wav)
    return torch.from_numpy(fe.resample(fe.normalize_reference(audio, sr), 24000, 16000))


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("frontend")
    fe.write_tiny_frontend(d, seed=0)
    return d


def test_slaney_filters_match_librosa():
    librosa = pytest.importorskip("librosa")
    for sr, n_fft, n_mels, fmax in ((16000, 400, 128, None), (24000, 1920, 80, 8000)):
        ours = fe.slaney_mel_filters(sr, n_fft, n_mels, 0.0, fmax)
        ref = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=0, fmax=fmax)
        assert rel_err(torch.from_numpy(ours), torch.from_numpy(ref)) <= TOL


def test_kaldi_fbank_matches_kaldi_native_fbank(ref16):
    knf = pytest.importorskip("kaldi_native_fbank")
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.frame_opts.samp_freq = 16000
    opts.mel_opts.num_bins = 80
    online = knf.OnlineFbank(opts)
    online.accept_waveform(16000, ref16.tolist())
    online.input_finished()
    ref = torch.tensor(np.stack([online.get_frame(i) for i in range(online.num_frames_ready)]))
    ours = fe.kaldi_fbank(ref16)
    assert ours.shape == ref.shape == (598, 80)
    assert rel_err(ours, ref) <= TOL


def _s3tokenizer_utils():
    """s3tokenizer's utils module (from minicpmo-utils); its torchaudio import serves only load_audio."""
    spec = importlib.util.find_spec("s3tokenizer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("s3tokenizer (minicpmo-utils) not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "utils.py"
    had = "torchaudio" in sys.modules
    if not had:
        sys.modules["torchaudio"] = types.ModuleType("torchaudio")
    try:
        mod_spec = importlib.util.spec_from_file_location("_s3tokenizer_utils", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
    finally:
        if not had:
            del sys.modules["torchaudio"]
    return mod


def test_s3_log_mel_matches_s3tokenizer(ref16):
    ref = _s3tokenizer_utils().log_mel_spectrogram(ref16)
    ours = fe.s3_log_mel(ref16)
    assert ours.shape == ref.shape == (128, 600)
    assert rel_err(ours, ref) <= TOL


def test_prompt_mel_matches_upstream(ref_wav):
    pytest.importorskip("librosa")
    from upstream import import_upstream

    audio_mod = import_upstream("stepaudio2.flashcosyvoice.utils.audio")
    audio, sr = fe.read_audio(ref_wav)
    ref24 = torch.from_numpy(fe.normalize_reference(audio, sr))
    ref = audio_mod.mel_spectrogram(ref24[None])[0]
    ours = fe.prompt_mel(ref24)
    assert ours.shape == ref.shape == (80, 300)
    assert rel_err(ours, ref) <= TOL


def test_tiny_onnx_models_signatures(tiny_assets):
    import onnxruntime as ort

    s3 = ort.InferenceSession(str(tiny_assets / fe.SPEECH_TOKENIZER_FILE), providers=["CPUExecutionProvider"])
    assert [i.name for i in s3.get_inputs()] == ["feats", "feats_length"]
    rng = np.random.default_rng(0)
    for t in (1, 7, 8, 9, 600):
        out = s3.run(None, {"feats": rng.standard_normal((1, 128, t)).astype(np.float32),
                            "feats_length": np.array([t], np.int32)})[0]
        assert out.shape == (1, -(-t // 4)) and out.dtype == np.int64
        assert out.min() >= 0 and out.max() <= 6560
    cp = ort.InferenceSession(str(tiny_assets / fe.CAMPPLUS_FILE), providers=["CPUExecutionProvider"])
    emb = cp.run(None, {cp.get_inputs()[0].name: rng.standard_normal((1, 37, 80)).astype(np.float32)})[0]
    assert emb.shape == (1, 192) and np.isfinite(emb).all()
    # deterministic per seed
    other = tiny_assets / "again"
    other.mkdir()
    fe.write_tiny_frontend(other, seed=0)
    assert (other / fe.CAMPPLUS_FILE).read_bytes() == (tiny_assets / fe.CAMPPLUS_FILE).read_bytes()


def test_frontend_on_22k_reference(tiny_assets, ref_wav):
    prompt = fe.VoiceFrontend(tiny_assets)(ref_wav)
    assert prompt.tokens.shape == (1, 150) and prompt.tokens.dtype == torch.int64
    assert int(prompt.tokens.min()) >= 0 and int(prompt.tokens.max()) <= 6560
    assert prompt.spk_embedding.shape == (1, 192) and prompt.spk_embedding.dtype == torch.float32
    assert prompt.mel.shape == (1, 300, 80) and prompt.mel_frames == 300
    assert len(prompt.key) == 16


def test_stereo_44k_short_file_padded_and_resampled(tiny_assets, tmp_path):
    sr = 44100
    t = np.arange(int(2.5 * sr)) / sr
    left = 0.3 * np.sin(2 * np.pi * 220 * t)
    stereo = np.stack([left, 0.5 * left], axis=1).astype(np.float32)
    path = tmp_path / "voice.wav"
    sf.write(path, stereo, sr, subtype="FLOAT")  # lossless, so the mono comparison below is exact
    front = fe.VoiceFrontend(tiny_assets)
    prompt = front(path)
    assert prompt.tokens.shape == (1, 150) and prompt.mel.shape == (1, 300, 80)
    # same audio as mono 24 kHz gives the same prompt (mixing + resampling + padding are the only steps)
    mono = stereo.mean(axis=1)
    again = front.features(mono, sr)
    assert again.key == prompt.key and torch.equal(again.tokens, prompt.tokens)
    # a longer (7.5 s) reference is cut to its first 6 s (after resampling to 24 kHz)
    long = np.concatenate([mono] * 3)
    cut = fe.normalize_reference(long, sr)
    assert cut.shape == (6 * 24000,) and np.array_equal(cut, fe.resample(long, sr, 24000)[: 6 * 24000])


def test_resampling_22050_is_accurate():
    sr = 22050
    t = np.arange(sr) / sr
    x = (0.5 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 3000 * t)).astype(np.float32)
    for target in (24000, 16000):
        y = fe.resample(x, sr, target)
        assert y.shape == (target,) and y.dtype == np.float32
        tt = np.arange(target) / target
        expect = 0.5 * np.sin(2 * np.pi * 440 * tt) + 0.2 * np.sin(2 * np.pi * 3000 * tt)
        core = slice(target // 20, -target // 20)  # away from the filter's edge transients
        assert rel_err(torch.from_numpy(y[core]), torch.from_numpy(expect[core])) < 1e-3
    ref24 = fe.normalize_reference(x, sr)
    assert ref24.shape == (6 * 24000,) and np.all(ref24[24000 + 100:] == 0)


def test_bad_inputs(tiny_assets, tmp_path):
    front = fe.VoiceFrontend(tiny_assets)
    with pytest.raises(InputError, match="nope.wav: reference audio not found"):
        front(tmp_path / "nope.wav")
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"RIFF....WAVEjunk")
    with pytest.raises(InputError, match="junk.wav: cannot be read as audio"):
        front(junk)
    short = tmp_path / "short.wav"
    sf.write(short, np.zeros(1600, np.float32), 16000)
    with pytest.raises(InputError, match=r"short.wav: 0.100 s is too short.*at least 0.5 s"):
        front(short)
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, np.float32), 16000)
    with pytest.raises(InputError, match="empty"):
        front(empty)
    with pytest.raises(InputError, match="NaN"):
        front.features(np.full(16000, np.nan, np.float32), 16000)
    with pytest.raises(CheckpointError, match="speech_tokenizer_v2_25hz.onnx: not found"):
        fe.VoiceFrontend(tmp_path)
    (tmp_path / fe.SPEECH_TOKENIZER_FILE).write_bytes((tiny_assets / fe.SPEECH_TOKENIZER_FILE).read_bytes())
    with pytest.raises(CheckpointError, match="campplus.onnx: not found"):
        fe.VoiceFrontend(tmp_path)
    (tmp_path / fe.CAMPPLUS_FILE).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="campplus.onnx: onnxruntime cannot load it"):
        fe.VoiceFrontend(tmp_path)
