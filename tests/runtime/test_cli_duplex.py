"""``minicpmo-rt duplex`` on the tiny checkpoint."""

import json

import numpy as np
import pytest
import soundfile as sf
from typer.testing import CliRunner

from minicpmo_rt.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def user_wav(tmp_path_factory):
    path = tmp_path_factory.mktemp("duplex") / "user.wav"
    t = np.arange(int(2.5 * 22050)) / 22050            # 2.5 s at 22.05 kHz: resampled, last second padded
    sf.write(path, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 22050)
    return path


def _run(tiny_ckpt, voice, user_wav, out, *extra):
    return runner.invoke(app, ["duplex", "--model", str(tiny_ckpt), "--input", str(user_wav), "--voice", str(voice),
                               "--output", str(out), "--n-timesteps", "2", *extra])


def test_duplex_writes_the_models_track_and_a_record_per_unit(tiny_ckpt, voice, user_wav, tmp_path):
    out, rec = tmp_path / "reply.wav", tmp_path / "units.json"
    res = _run(tiny_ckpt, voice, user_wav, out, "--transcript", str(rec), "--force-listen-units", "1")
    assert res.exit_code == 0, res.output
    units = json.loads(rec.read_text())["units"]
    assert [u["unit"] for u in units] == [0, 1, 2]                 # ceil(2.5 s)
    assert units[0]["listen"] and units[0]["terminator"] == "<|listen|>" and units[0]["codes"] == 0
    wav, sr = sf.read(out, dtype="float32")
    spoken = sum(u["audio_s"] for u in units if not u["listen"])
    assert sr == 24000 and wav.shape[0] >= round((sum(u["listen"] for u in units) + spoken) * 24000)
    assert "random-weight" in res.output and "3 units" in res.output and "float32)" in res.output
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize("extra, msg", [
    (["--decode", "beam"], "decode mode 'beam'"),
    (["--profile", "minicpmo_4_5_turn_mrv2"], "pass a duplex profile"),
    (["--max-units", "0"], "--max-units must be >= 1"),
    (["--n-timesteps", "0"], "--n-timesteps must be >= 1"),
    (["--dtype", "float64"], "--dtype 'float64'"),
])
def test_bad_flags_are_named_and_write_nothing(tiny_ckpt, voice, user_wav, tmp_path, extra, msg):
    out = tmp_path / "reply.wav"
    res = _run(tiny_ckpt, voice, user_wav, out, *extra)
    assert res.exit_code == 2 and msg in res.output and not out.exists()


def test_missing_input_is_named(tiny_ckpt, voice, tmp_path):
    res = _run(tiny_ckpt, voice, tmp_path / "nope.wav", tmp_path / "reply.wav")
    assert res.exit_code == 2 and "--input" in res.output and "not found" in res.output


def _video(path, seconds, fps=10, size=(48, 64)):
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as c:
        st = c.add_stream("libx264", rate=fps)
        st.height, st.width = size
        st.pix_fmt = "yuv420p"
        for i in range(int(seconds * fps)):
            img = np.full(size + (3,), (i * 255) // int(seconds * fps), np.uint8)   # brightness = time
            for packet in st.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(packet)
        for packet in st.encode():
            c.mux(packet)
    return path


def test_video_frames_are_the_last_shown_when_each_second_ends(tmp_path):
    from minicpmo_rt.runtime.jobs import video_frames_per_second

    frames = video_frames_per_second(_video(tmp_path / "cam.mp4", 2.0), 3)
    assert len(frames) == 3 and all(f.shape == (48, 64, 3) for f in frames)
    level = [float(f.mean()) for f in frames]
    # frame i shows (i * 255) // 20: the frame at t = 1.0 s is i = 10, the last one (t = 1.9 s) is i = 19
    assert abs(level[0] - 127) < 6 and abs(level[1] - 242) < 6 and level[2] == level[1]


def test_duplex_with_video_feeds_a_frame_per_unit(tiny_ckpt, voice, user_wav, tmp_path):
    out, rec = tmp_path / "reply.wav", tmp_path / "units.json"
    cam = _video(tmp_path / "cam.mp4", 3.0)
    res = _run(tiny_ckpt, voice, user_wav, out, "--video", str(cam), "--transcript", str(rec))
    assert res.exit_code == 0, res.output
    assert json.loads(rec.read_text())["frames"] == 3 and "(3 with a frame)" in res.output


def test_unreadable_video_is_named(tiny_ckpt, voice, user_wav, tmp_path):
    pytest.importorskip("av")
    bad = tmp_path / "cam.mp4"
    bad.write_bytes(b"not a video")
    res = _run(tiny_ckpt, voice, user_wav, tmp_path / "reply.wav", "--video", str(bad))
    assert res.exit_code == 2 and "--video" in res.output and "cannot be opened as a video" in res.output


def test_duplex_batch_says_what_each_duplex_run_says(tiny_ckpt, voice, user_wav, shared_dir, tmp_path):
    """``duplex-batch`` with two inputs of different lengths (2.5 s and 1 s: the short one stops stepping while
    the other goes on), a voice each: each conversation's transcript equals ``duplex`` on that input with
    seed + i, and its track matches within 1e-5 (the batch solves the flow for the streams in step)."""
    short = tmp_path / "short.wav"
    sf.write(short, (0.2 * np.sin(2 * np.pi * 330 * np.arange(16000) / 16000)).astype(np.float32), 16000)
    voices = [voice, shared_dir / "media" / "ref_minicpm_signature.wav"]
    outs, rec = [tmp_path / "a.wav", tmp_path / "b.wav"], tmp_path / "batch.json"
    res = runner.invoke(app, ["duplex-batch", "--model", str(tiny_ckpt), "--input", str(user_wav), "--input", str(short),
                              "--voice", str(voices[0]), "--voice", str(voices[1]), "--output", str(outs[0]),
                              "--output", str(outs[1]), "--transcript", str(rec), "--n-timesteps", "2", "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert "2 conversations" in res.output
    convs = json.loads(rec.read_text())["conversations"]
    assert [len(c["units"]) for c in convs] == [3, 1] and [c["seed"] for c in convs] == [3, 4]
    for i, (inp, v) in enumerate(((user_wav, voices[0]), (short, voices[1]))):
        one, one_rec = tmp_path / f"one{i}.wav", tmp_path / f"one{i}.json"
        r = runner.invoke(app, ["duplex", "--model", str(tiny_ckpt), "--input", str(inp), "--voice", str(v),
                                "--output", str(one), "--transcript", str(one_rec), "--n-timesteps", "2",
                                "--seed", str(3 + i)])
        assert r.exit_code == 0, r.output
        assert json.loads(one_rec.read_text())["units"] == convs[i]["units"]
        got, want = sf.read(outs[i], dtype="float32")[0], sf.read(one, dtype="float32")[0]
        assert got.shape == want.shape
        assert np.linalg.norm(got - want) <= 1e-5 * max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("args, msg", [
    (["--output", "x.wav", "--output", "y.wav"], "--output: 2 given for 1 --input"),
    (["--output", "x.wav", "--voice", "VOICE"], "--voice: 2 given for 1 --input"),
])
def test_duplex_batch_names_mismatched_flags_and_writes_nothing(tiny_ckpt, voice, user_wav, tmp_path, args, msg):
    args = [str(tmp_path / a) if a.endswith(".wav") else (str(voice) if a == "VOICE" else a) for a in args]
    res = runner.invoke(app, ["duplex-batch", "--model", str(tiny_ckpt), "--input", str(user_wav), "--voice",
                              str(voice), *args])
    assert res.exit_code == 2 and msg in res.output, res.output
    assert not list(tmp_path.glob("*.wav"))
