import numpy as np
import pytest
import torch

from minicpmo_rt.errors import InputError
from minicpmo_rt.runtime.contracts import (IM_END_ID, TTS_EOS_ID, CodecChunk, PcmChunk, TalkerInput, ThinkerStep,
                                           TurnRequest)
from minicpmo_rt.talker.engine import CodecChunk as EngineChunk


def _steps(rid, n, terminator=None, after=0):
    rows = torch.randn(n + after, 8)
    steps = [ThinkerStep(rid, 10 + i, 100 + i, f"t{i}", rows[i], False) for i in range(n)]
    if terminator is not None:
        steps.append(ThinkerStep(rid, 10 + n, terminator, "", None, True))
    steps += [ThinkerStep(rid, 11 + n + j, 200 + j, "x", rows[n + j], False) for j in range(after)]
    return steps, rows


@pytest.mark.parametrize("terminator", [TTS_EOS_ID, IM_END_ID])
def test_talker_input_stops_at_the_terminator(terminator):
    steps, rows = _steps("a", 4, terminator, after=2)
    ti = TalkerInput.from_steps("a", steps)
    assert ti.token_ids == (100, 101, 102, 103) and ti.terminator == terminator
    assert torch.equal(ti.hidden, rows[:4]) and ti.text == "t0t1t2t3"
    req = ti.to_request(seed=5, max_codes=30)
    assert req.text_ids.tolist() == [100, 101, 102, 103] and req.hidden.shape == (4, 8)
    assert req.seed == 5 and req.max_codes == 30


def test_talker_input_errors():
    steps, _ = _steps("a", 0, TTS_EOS_ID)
    with pytest.raises(InputError, match="no text before terminator"):
        TalkerInput.from_steps("a", steps)
    steps, _ = _steps("b", 2)
    with pytest.raises(ValueError, match="request 'b'"):
        TalkerInput.from_steps("a", steps)


def test_step_and_chunk_records():
    with pytest.raises(ValueError, match="terminator carries no hidden"):
        ThinkerStep("a", 0, TTS_EOS_ID, "", torch.zeros(4), True)
    with pytest.raises(ValueError, match="terminator carries no hidden"):
        ThinkerStep("a", 0, 5, "", None, False)
    assert CodecChunk is EngineChunk
    src = np.arange(4, dtype=np.float64)
    pcm = PcmChunk("a", 0, src, True)
    assert pcm.samples.dtype == np.float32 and not pcm.samples.flags.writeable
    src[0] = 9  # the record holds its own copy
    assert pcm.samples[0] == 0
    with pytest.raises(ValueError):
        pcm.samples[0] = 1


@pytest.mark.parametrize("arg, msg", [("", "user text is empty"), ("   ", "user text is empty"),
                                      ([], "no messages"),
                                      ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                       "last message must come from the user"),
                                      ([{"role": "robot", "content": "hi"}], "role")])
def test_turn_request_rejects_bad_messages(arg, msg):
    with pytest.raises(InputError, match=msg):
        TurnRequest.make("r", arg)


def test_turn_request_limits():
    with pytest.raises(InputError, match="max_codes"):
        TurnRequest.make("r", "hi", max_codes=0)
    with pytest.raises(InputError, match="request id"):
        TurnRequest.make("", "hi")


def test_turn_request_parts_are_typed_and_frozen(tmp_path):
    """Lists, 16 kHz waveforms and PIL images become a tuple of text, AudioPart and ImagePart; the audio is a
    read-only copy (changing the caller's array changes nothing); files load through from_file / from_image."""
    import soundfile as sf
    from PIL import Image

    from minicpmo_rt.runtime.contracts import AudioPart, ImagePart

    wave = np.linspace(-0.5, 0.5, 16000, dtype=np.float32)
    img = Image.new("RGB", (64, 48), (10, 200, 30))
    req = TurnRequest.make("r", [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": [img, wave, "What is this?"]}])
    parts = req.messages[1]["content"]
    assert isinstance(parts, tuple) and [type(p) for p in parts] == [ImagePart, AudioPart, str]
    wave[:] = 0
    assert parts[1].samples[-1] == pytest.approx(0.5) and not parts[1].samples.flags.writeable
    assert parts[0].image.image_size == (64, 48) and parts[0].image.num_sub_images == 1
    sf.write(tmp_path / "q.wav", np.full(8000, 0.25, np.float32), 8000)       # 1 s at 8 kHz -> 16000 samples
    assert AudioPart.from_file(tmp_path / "q.wav").samples.size == 16000
    img.save(tmp_path / "p.png")
    assert ImagePart.from_image(tmp_path / "p.png").image.image_size == (64, 48)
    # audio alone is a whole question
    assert TurnRequest.make("s", [{"role": "user", "content": [np.zeros(16000, np.float32)]}]).messages


@pytest.mark.parametrize("content,role,match", [
    ([np.zeros(800, np.float32)], "user", "too short"),
    ([np.zeros((2, 16000), np.float32)], "user", "not mono"),
    ([np.zeros(16000, np.int16)], "user", "not floating"),
    ([np.full(16000, np.nan, np.float32)], "user", "NaN"),
    ([{"type": "image_url"}], "user", "not text, audio"),
    (["  ", ""], "user", "empty"),
    ([], "user", "non-empty list"),
    (["look <image>./</image>"], "user", "marker"),
    ("<|audio_start|><unk><|audio_end|>", "user", "marker"),
])
def test_bad_parts_are_refused_by_name(content, role, match):
    with pytest.raises(InputError, match=match):
        TurnRequest.make("bad", [{"role": role, "content": content}])


def test_media_only_in_user_messages_and_unreadable_files_named(tmp_path):
    from minicpmo_rt.runtime.contracts import AudioPart, ImagePart

    with pytest.raises(InputError, match=r"messages\[0\] \(assistant\) holds audio"):
        TurnRequest.make("x", [{"role": "assistant", "content": [np.zeros(16000, np.float32)]},
                               {"role": "user", "content": "And?"}])
    (tmp_path / "not.png").write_text("hello")
    with pytest.raises(InputError, match="cannot be read as an image"):
        ImagePart.from_image(tmp_path / "not.png")
    with pytest.raises(InputError, match="not found"):
        ImagePart.from_image(tmp_path / "missing.png")
    with pytest.raises(InputError, match="not found"):
        AudioPart.from_file(tmp_path / "missing.wav")
