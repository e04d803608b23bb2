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
     "messages[0].content", "'input_audio'"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string or a list"),
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
