"""``minicpmo-rt talker`` and ``minicpmo-rt speak`` on the tiny checkpoint."""

import json

import pytest
import soundfile as sf
from typer.testing import CliRunner

from minicpmo_rt.cli import app

runner = CliRunner()
FAST = ["--capacity", "1", "--min-codes", "5"]




def _talker(tiny_ckpt, out, seed, *extra):
    res = runner.invoke(app, ["talker", "--model", str(tiny_ckpt), "--text", "Hello, how are you?", "--codes-out",
                              str(out), "--seed", str(seed), "--max-codes", "20", "--max-new-tokens", "6",
                              *FAST, *extra])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text()), res.output


def test_talker_writes_codes_deterministic_per_seed(tiny_ckpt, tmp_path):
    a, out = _talker(tiny_ckpt, tmp_path / "a.json", 4)
    b, _ = _talker(tiny_ckpt, tmp_path / "b.json", 4)
    c, _ = _talker(tiny_ckpt, tmp_path / "c.json", 5, "--profile", "minicpmo_4_5_turn_mrv2_h200")
    assert a == b
    assert a != c
    for codes in (a, c):
        assert 5 <= len(codes) <= 20 and all(isinstance(x, int) and 0 <= x < 6561 for x in codes)
    assert "random-weight" in out and f"{len(a)} codes" in out
    assert not list(tmp_path.glob(".*tmp"))  # no temporary left behind


def test_speak_writes_960_samples_per_code(tiny_ckpt, voice, tmp_path):
    wav_path, codes_path = tmp_path / "out.wav", tmp_path / "codes.json"
    res = runner.invoke(app, ["speak", "--model", str(tiny_ckpt), "--text", "Say something nice.", "--voice",
                              str(voice), "--output", str(wav_path), "--codes-out", str(codes_path), "--seed", "2",
                              "--max-new-tokens", "8", "--max-codes", "60", "--n-timesteps", "2", *FAST])
    assert res.exit_code == 0, res.output
    wav, sr = sf.read(wav_path, dtype="float32")
    codes = json.loads(codes_path.read_text())
    assert sr == 24000 and 5 <= len(codes) <= 60
    assert wav.shape == (len(codes) * 960,)
    assert "random-weight" in res.output and f"{len(codes)} codes" in res.output


@pytest.mark.parametrize("case, msg", [
    ("empty", "--text is empty"),
    ("voice", "reference audio not found"),
    ("profile", "no_such_profile"),
    ("duplex", "turn-mode profile"),
    ("model", "no such directory"),
])
def test_bad_inputs_are_named_and_write_nothing(tiny_ckpt, voice, tmp_path, case, msg):
    out = tmp_path / "out.wav"
    codes = tmp_path / "codes.json"
    args = {"text": "Hello", "voice": str(voice), "profile": "minicpmo_4_5_turn_mrv2", "model": str(tiny_ckpt)}
    if case == "empty":
        args["text"] = "  "
    elif case == "voice":
        args["voice"] = str(tmp_path / "missing.wav")
    elif case == "profile":
        args["profile"] = "no_such_profile"
    elif case == "duplex":
        args["profile"] = "minicpmo_4_5_duplex_h200"
    else:
        args["model"] = str(tmp_path / "no_model")
    common = ["--model", args["model"], "--text", args["text"], "--profile", args["profile"]]
    res = runner.invoke(app, ["speak", *common, "--voice", args["voice"], "--output", str(out)])
    assert res.exit_code == 2 and msg in res.output, res.output
    if case != "voice":
        res = runner.invoke(app, ["talker", *common, "--codes-out", str(codes)])
        assert res.exit_code == 2 and msg in res.output, res.output
    assert list(tmp_path.iterdir()) == []


def test_stage_bars_show_on_a_terminal_only(capsys):
    """``StageBars`` draws one tqdm bar per stage on stderr when enabled (what a terminal gets), counts every
    request's items, closes a stage's bar when the next starts; with tqdm's default rule (disable=None) and a
    captured, non-terminal stderr it prints nothing."""
    from minicpmo_rt.runtime.jobs import StageBars

    bars = StageBars(disable=False)
    for n in (2, 5):
        bars("thinker", "a", n)
    bars("thinker", "b", 3)
    assert bars.bars["thinker"].n == 8
    bars("talker", "a", 25)
    assert list(bars.bars) == ["talker"] and bars.bars["talker"].n == 25
    bars.close()
    err = capsys.readouterr().err
    assert "thinker: " in err and "talker: " in err and err.index("thinker") < err.index("talker")
    quiet = StageBars()
    quiet("thinker", "a", 4)
    quiet.close()
    assert capsys.readouterr().err == ""


def test_speak_answers_several_texts_at_once_as_each_alone(tiny_ckpt, voice, tmp_path):
    """Repeated --text/--output: one run shares the Thinker, the Talker's slots and Code2Wav's calls; text i
    samples with seed + i, so each WAV has the codes of that text spoken alone with that seed (audio within
    FP32 reordering of the batched Code2Wav calls)."""
    import numpy as np

    base = ["--model", str(tiny_ckpt), "--voice", str(voice), "--max-new-tokens", "6", "--max-codes", "30",
            "--n-timesteps", "2", "--min-codes", "5", "--capacity", "2"]
    texts = ["Say something nice.", "Name a colour."]
    outs = [tmp_path / "a.wav", tmp_path / "b.wav"]
    res = runner.invoke(app, ["speak", *base, "--seed", "3", "--text", texts[0], "--output", str(outs[0]),
                              "--text", texts[1], "--output", str(outs[1]), "--codes-out", str(tmp_path / "c.json")])
    assert res.exit_code == 0, res.output
    codes = json.loads((tmp_path / "c.json").read_text())
    assert len(codes) == 2 and res.output.count("wrote ") == 2 and "2 turn(s)" in res.output
    for i, (text, out) in enumerate(zip(texts, outs)):
        alone = tmp_path / f"alone{i}.wav"
        one = runner.invoke(app, ["speak", *base, "--seed", str(3 + i), "--text", text, "--output", str(alone),
                                  "--codes-out", str(tmp_path / f"alone{i}.json")])
        assert one.exit_code == 0, one.output
        assert json.loads((tmp_path / f"alone{i}.json").read_text()) == codes[i]
        got, want = sf.read(out, dtype="float32")[0], sf.read(alone, dtype="float32")[0]
        assert got.shape == want.shape == (len(codes[i]) * 960,)
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


@pytest.mark.parametrize("extra, msg", [
    (["--text", "Two."], "2 turns but 1 --output"),
    (["--text", "Two.", "--output", "OUT"], "the same file is given twice"),
])
def test_speak_refuses_unpaired_or_repeated_outputs(tiny_ckpt, voice, tmp_path, extra, msg):
    out = tmp_path / "out.wav"
    extra = [str(out) if e == "OUT" else e for e in extra]
    res = runner.invoke(app, ["speak", "--model", str(tiny_ckpt), "--voice", str(voice), "--text", "One.",
                              "--output", str(out), *extra])
    assert res.exit_code == 2 and msg in res.output, res.output
    assert list(tmp_path.iterdir()) == []


def test_speak_answers_a_spoken_question_about_a_picture(tiny_ckpt, voice, tmp_path):
    """--image, --audio and --text make one turn (a picture, a recording at 22.05 kHz, words): its codes are
    those of ``TurnPipeline.codes`` on the same parts built directly, and the WAV holds 960 samples a code."""
    import numpy as np
    from PIL import Image

    from minicpmo_rt.runtime.contracts import AudioPart, ImagePart, TurnRequest
    from minicpmo_rt.runtime.turn import TurnPipeline
    from minicpmo_rt.talker.sampler import SamplingParams

    rng = np.random.default_rng(5)
    Image.fromarray((rng.random((90, 140, 3)) * 255).astype(np.uint8)).save(tmp_path / "pic.png")
    sf.write(tmp_path / "q.wav", (rng.standard_normal(33075) * 0.1).astype(np.float32), 22050)
    out, codes_out = tmp_path / "a.wav", tmp_path / "c.json"
    res = runner.invoke(app, ["speak", "--model", str(tiny_ckpt), "--voice", str(voice), "--image",
                              str(tmp_path / "pic.png"), "--audio", str(tmp_path / "q.wav"), "--text", "What is it?",
                              "--output", str(out), "--codes-out", str(codes_out), "--seed", "4",
                              "--max-new-tokens", "6", "--max-codes", "30", "--n-timesteps", "2", *FAST])
    assert res.exit_code == 0, res.output
    codes = json.loads(codes_out.read_text())
    pipe = TurnPipeline.from_snapshot(tiny_ckpt, with_code2wav=False, capacity=1,
                                      talker_params=SamplingParams(min_codes=5))
    parts = [ImagePart.from_image(tmp_path / "pic.png"), AudioPart.from_file(tmp_path / "q.wav"), "What is it?"]
    assert parts[1].samples.size == 24000                       # 1.5 s resampled to 16 kHz
    req = TurnRequest.make("cli", [{"role": "user", "content": parts}], seed=4, max_new_tokens=6, max_codes=30)
    assert pipe.codes([req])["cli"] == codes
    assert sf.read(out, dtype="float32")[0].shape == (len(codes) * 960,)


@pytest.mark.parametrize("extra, msg", [
    ([], "nothing to answer"),
    (["--text", "One.", "--audio", "Q", "--audio", "Q"], "1 --text, 2 --audio"),
    (["--audio", "BAD"], "cannot be read as audio"),
    (["--image", "BAD"], "cannot be read as an image"),
    (["--audio", "MISSING"], "not found"),
])
def test_speak_refuses_bad_turns_by_name_and_writes_nothing(tiny_ckpt, voice, tmp_path, extra, msg):
    import numpy as np

    sf.write(tmp_path / "q.wav", np.zeros(16000, np.float32), 16000)
    (tmp_path / "bad.bin").write_text("not media")
    names = {"Q": tmp_path / "q.wav", "BAD": tmp_path / "bad.bin", "MISSING": tmp_path / "none.wav"}
    out = tmp_path / "out.wav"
    res = runner.invoke(app, ["speak", "--model", str(tiny_ckpt), "--voice", str(voice), "--output", str(out),
                              *[str(names.get(e, e)) for e in extra]])
    assert res.exit_code == 2 and msg in res.output, res.output
    assert not out.exists()


def test_talker_takes_a_recording_of_the_user(tiny_ckpt, tmp_path):
    """``talker --audio``: the codes of ``TurnPipeline.codes`` for the same recording as an AudioPart; nothing to
    answer is refused by name."""
    import numpy as np

    from minicpmo_rt.runtime.contracts import AudioPart, TurnRequest
    from minicpmo_rt.runtime.turn import TurnPipeline
    from minicpmo_rt.talker.sampler import SamplingParams

    sf.write(tmp_path / "q.wav", (np.random.default_rng(2).standard_normal(20000) * 0.1).astype(np.float32), 16000)
    out = tmp_path / "codes.json"
    res = runner.invoke(app, ["talker", "--model", str(tiny_ckpt), "--audio", str(tmp_path / "q.wav"), "--codes-out",
                              str(out), "--seed", "6", "--max-codes", "20", "--max-new-tokens", "5", *FAST])
    assert res.exit_code == 0, res.output
    pipe = TurnPipeline.from_snapshot(tiny_ckpt, with_code2wav=False, capacity=1,
                                      talker_params=SamplingParams(min_codes=5))
    req = TurnRequest.make("cli", [{"role": "user", "content": [AudioPart.from_file(tmp_path / "q.wav")]}], seed=6,
                           max_new_tokens=5, max_codes=20)
    assert pipe.codes([req])["cli"] == json.loads(out.read_text())
    res = runner.invoke(app, ["talker", "--model", str(tiny_ckpt), "--codes-out", str(tmp_path / "none.json")])
    assert res.exit_code == 2 and "nothing to answer" in res.output and not (tmp_path / "none.json").exists()
