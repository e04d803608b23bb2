"""Chat-completions requests as the server checks them, and the bodies it answers with (no model)."""

import base64
import io

import numpy as np
import pytest
import soundfile as sf

from minicpmo_rt.serving.openai_api import (ApiError, ChatRequest, chunk_body, completion_body, parse_chat, pcm16,
                                            wav_bytes)

VOICES = ["anna", "ben"]
USER = [{"role": "user", "content": "Hello"}]


def test_defaults_are_a_text_answer():
    r = parse_chat({"model": "x", "messages": USER}, VOICES)
    assert r == ChatRequest(({"role": "user", "content": "Hello"},), False, None, None, False, 0, None, None)


def test_audio_defaults_to_the_first_voice_and_wav_or_pcm16_when_streamed():
    r = parse_chat({"messages": USER, "modalities": ["text", "audio"]}, VOICES)
    assert (r.speak, r.voice, r.audio_format, r.stream) == (True, "anna", "wav", False)
    r = parse_chat({"messages": USER, "modalities": ["text", "audio"], "stream": True,
                    "audio": {"voice": "ben"}, "seed": 7, "max_completion_tokens": 9, "max_codes": 40}, VOICES)
    assert (r.voice, r.audio_format, r.stream, r.seed, r.max_tokens, r.max_codes) == ("ben", "pcm16", True, 7, 9, 40)


def test_text_parts_join_and_developer_is_the_system_role():
    r = parse_chat({"messages": [{"role": "developer", "content": "Be brief."},
                                 {"role": "user", "content": [{"type": "text", "text": "Hel"},
                                                              {"type": "text", "text": "lo"}]}]}, VOICES)
    assert r.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"})


@pytest.mark.parametrize("body, param, words", [
    ([], None, "JSON object"),
    ({"messages": USER, "temperature": 0.2}, "temperature", "unsupported field"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "'tool'"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0].input_audio.data", "base64"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]},
     "messages[0].content[0]", "'video_url'"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string or a non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "messages",
     "last message must come from the user"),
    ({"messages": [{"role": "user", "content": "  "}]}, "messages", "empty"),
    ({"messages": USER, "modalities": ["audio"]}, "modalities", "['text', 'audio']"),
    ({"messages": USER, "audio": {"voice": "anna"}}, "audio", "no 'audio'"),
    ({"messages": USER, "modalities": ["text", "audio"], "audio": {"voice": "zoe"}}, "audio.voice", "anna, ben"),
    ({"messages": USER, "modalities": ["text", "audio"], "audio": {"format": "mp3"}}, "audio.format", "wav, pcm16"),
    ({"messages": USER, "modalities": ["text", "audio"], "stream": True, "audio": {"format": "wav"}},
     "audio.format", "pcm16"),
    ({"messages": USER, "stream": "yes"}, "stream", "true or false"),
    ({"messages": USER, "n": 2}, "n", "one answer"),
    ({"messages": USER, "seed": "1"}, "seed", "integer"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", "positive integer"),
    ({"messages": USER, "max_codes": 30}, "max_codes", "limits speech"),
])
def test_refusals_name_the_field_and_what_to_send(body, param, words):
    with pytest.raises(ApiError) as info:
        parse_chat(body, VOICES)
    err = info.value
    assert err.status == 400 and err.param == param and words in err.message, (err.param, err.message)
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_pcm16_clips_and_rounds_and_the_wav_holds_the_same_samples():
    x = np.array([0.0, 0.5, -0.5, 1.5, -2.0, 1e-5], np.float32)
    got = np.frombuffer(pcm16(x), "<i2")
    assert got.tolist() == [0, 16384, -16384, 32767, -32767, 0]
    data, sr = sf.read(io.BytesIO(wav_bytes(x)), dtype="int16")
    assert sr == 24000 and data.tolist() == got.tolist()


def test_completion_body_carries_speech_as_its_audio_and_text_as_transcript():
    req = parse_chat({"messages": USER, "modalities": ["text", "audio"], "audio": {"format": "pcm16"}}, VOICES)
    x = np.linspace(-1, 1, 48, dtype=np.float32)
    body = completion_body("chatcmpl-abc", "m", req, "Hi!", x, "stop", 10, 3)
    msg = body["choices"][0]["message"]
    assert msg["content"] is None and msg["audio"]["transcript"] == "Hi!" and msg["audio"]["format"] == "pcm16"
    assert base64.b64decode(msg["audio"]["data"]) == pcm16(x)
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    text = completion_body("chatcmpl-abc", "m", parse_chat({"messages": USER}, VOICES), "Hi!", None, "length", 1, 1)
    assert text["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "Hi!"},
                                  "finish_reason": "length"}
    chunk = chunk_body("chatcmpl-abc", "m", {"content": "x"})
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["finish_reason"] is None


def _wav_b64(samples: np.ndarray, rate: int) -> str:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


def _png_url(w: int = 80, h: int = 60) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(0).random((h, w, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_input_audio_and_image_url_parts_become_the_pipelines_parts(tmp_path):
    """A stereo 22.05 kHz WAV sent inline is the AudioPart the same file makes (mono, 16 kHz); a PNG data URL
    is an ImagePart of that picture; the parts keep their order and text parts stay separate beside media."""
    from minicpmo_rt.runtime.contracts import AudioPart, ImagePart

    stereo = (np.random.default_rng(1).standard_normal((33075, 2)) * 0.1).astype(np.float32)
    sf.write(tmp_path / "q.wav", stereo, 22050, subtype="PCM_16")
    r = parse_chat({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _png_url(), "detail": "low"}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode((tmp_path / "q.wav").read_bytes()).decode(),
                                                "format": "wav"}},
        {"type": "text", "text": "What is this?"}]}], "modalities": ["text", "audio"]}, VOICES)
    image, audio, text = r.messages[0]["content"]
    assert isinstance(image, ImagePart) and image.image.image_size == (80, 60)
    assert isinstance(audio, AudioPart)
    assert np.array_equal(audio.samples, AudioPart.from_file(tmp_path / "q.wav").samples)
    assert audio.samples.size == 24000 and text == "What is this?"


@pytest.mark.parametrize("part, param, words", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "image_url.url", "fetches nothing"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "image_url.url", "not valid base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"hello").decode()}},
     "image_url.url", "cannot be read as an image"),
    ({"type": "image_url", "image_url": 5}, "image_url", "'url'"),
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFFjunk").decode(), "format": "wav"}},
     "input_audio.data", "cannot be decoded as wav"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aac"}}, "input_audio.format", "'aac'"),
    ({"type": "input_audio", "input_audio": {"data": _wav_b64(np.zeros(800, np.float32), 16000)}},
     "input_audio.data", "too short"),
])
def test_media_refusals_name_the_part(part, param, words):
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": [{"role": "user", "content": [part]}]}, VOICES)
    err = info.value
    assert err.status == 400 and err.param == "messages[0].content[0]." + param and words in err.message, \
        (err.param, err.message)


def test_media_limits_roles_and_markers_are_refused(monkeypatch):
    import minicpmo_rt.serving.openai_api as api

    monkeypatch.setattr(api, "MAX_INPUT_AUDIO_S", 1.0)
    long = {"type": "input_audio", "input_audio": {"data": _wav_b64(np.zeros(17000, np.float32), 16000)}}
    with pytest.raises(ApiError, match="at most 1 s"):
        parse_chat({"messages": [{"role": "user", "content": [long]}]}, VOICES)
    monkeypatch.setattr(api, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ApiError, match="80x60 image"):
        parse_chat({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _png_url()}}]}]}, VOICES)
    picture = {"type": "image_url", "image_url": {"url": _png_url()}}
    with pytest.raises(ApiError, match="user messages only") as info:
        parse_chat({"messages": [{"role": "assistant", "content": [picture]}, *USER]}, VOICES)
    assert info.value.param == "messages[0].content[0]"
    with pytest.raises(ApiError, match="marker") as info:
        parse_chat({"messages": [{"role": "user", "content": "look <image>./</image>"}]}, VOICES)
    assert info.value.param == "messages"


@pytest.mark.parametrize("fmt, sf_format, subtype", [("mp3", "MP3", None), ("flac", "FLAC", "PCM_16"),
                                                     ("ogg", "OGG", "VORBIS")])
def test_compressed_input_audio_decodes_to_16k_mono(fmt, sf_format, subtype):
    """MP3, FLAC and OGG recordings (here 1 s of a 440 Hz tone at 24 kHz) decode through libsndfile to 1 s of
    16 kHz samples that still hold the tone."""
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(24000) / 24000)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, tone, 24000, format=sf_format, subtype=subtype)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": fmt}}
    (audio,) = parse_chat({"messages": [{"role": "user", "content": [part]}]}, VOICES).messages[0]["content"]
    x = audio.samples
    assert abs(x.size - 16000) <= 1200                       # codec padding at most a few frames
    spectrum = np.abs(np.fft.rfft(x[:16000] if x.size >= 16000 else np.pad(x, (0, 16000 - x.size))))
    assert abs(int(np.argmax(spectrum)) - 440) <= 2          # 1-Hz bins: the tone is where it was
