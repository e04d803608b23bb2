"""OpenAI-style chat completions: what a request may hold, and the bodies sent back.

A request is checked in full before it reaches the model, and every refusal names the field, what was wrong
and what to send instead (``ApiError``, answered as OpenAI's error object). Only what the turn pipeline can
honour is accepted: text (system, user and assistant messages), and in user messages recordings (``input_audio``
parts) and pictures (``image_url`` parts with an inline ``data:`` URL; the server fetches nothing); the answer as
text, or as text and 24 kHz speech in one of the voices the server was started with. Sampling stays the deploy
profile's, so fields such as ``temperature`` are refused rather than silently ignored. A text-only answer is the
Thinker's text in the spoken-turn prompt layout (the words a spoken answer would say).
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import InputError
from ..runtime.contracts import SAMPLE_RATE, AudioPart, ImagePart, check_messages
from ..thinker.mel import SAMPLE_RATE as THINKER_RATE

AUDIO_FORMATS = ("wav", "pcm16")
INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")     # what libsndfile decodes
MAX_INPUT_AUDIO_S = 120.0       # per part: 10 prompt positions a second
MAX_IMAGE_PIXELS = 40_000_000
# accepted and not acted on: they change nothing about the answer
IGNORED_FIELDS = frozenset({"model", "user", "metadata", "store", "stream_options"})
FIELDS = frozenset({"messages", "modalities", "audio", "stream", "seed", "max_tokens", "max_completion_tokens", "n",
                    "max_codes"}) | IGNORED_FIELDS


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat-completions request, in the turn pipeline's terms."""

    messages: tuple[dict, ...]      # {"role": ..., "content": str, or a tuple of str, AudioPart and ImagePart}
    speak: bool                     # modalities include "audio"
    voice: str | None               # a registered voice name (speak only)
    audio_format: str | None        # "wav" | "pcm16" (speak only)
    stream: bool
    seed: int
    max_tokens: int | None          # the Thinker's text tokens
    max_codes: int | None           # the Talker's codes (an extension: not in OpenAI's API)


def _positive_int(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ApiError(f"{name} must be a positive integer, got {v!r}", name)
    return v


def _b64(data: Any, where: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise ApiError(f"{where} must be a non-empty base64 string", where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(f"{where} is not valid base64", where) from None


def _input_audio(part: dict, where: str) -> AudioPart:
    """``{"type": "input_audio", "input_audio": {"data": base64, "format": "wav" | "mp3" | ...}}``: the
    recording decoded (any rate and channel count), mixed to mono and resampled to 16 kHz."""
    import soundfile as sf

    from ..code2wav.frontend import resample

    spec = part.get("input_audio")
    if not isinstance(spec, dict):
        raise ApiError(f"{where}.input_audio must be an object {{'data': base64, 'format': ...}}",
                       f"{where}.input_audio")
    fmt = spec.get("format", "wav")
    if fmt not in INPUT_AUDIO_FORMATS:
        raise ApiError(f"{where}.input_audio.format {fmt!r}: send one of {', '.join(INPUT_AUDIO_FORMATS)}",
                       f"{where}.input_audio.format")
    raw = _b64(spec.get("data"), f"{where}.input_audio.data")
    try:
        data, sr = sf.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    except Exception as exc:  # noqa: BLE001 - libsndfile raises several types for bad data
        raise ApiError(f"{where}.input_audio.data cannot be decoded as {fmt} audio ({exc})",
                       f"{where}.input_audio.data") from None
    if data.shape[0] / sr > MAX_INPUT_AUDIO_S:
        raise ApiError(f"{where}: {data.shape[0] / sr:.1f} s of audio; send at most {MAX_INPUT_AUDIO_S:.0f} s a "
                       "request", f"{where}.input_audio.data")
    try:
        return AudioPart(resample(data.mean(axis=1), int(sr), THINKER_RATE))
    except InputError as exc:
        raise ApiError(f"{where}: {exc}", f"{where}.input_audio.data") from None


def _image_url(part: dict, where: str) -> ImagePart:
    """``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``: an inline PNG/JPEG/WebP.
    The server fetches nothing, so remote URLs are refused."""
    from PIL import Image, UnidentifiedImageError


    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise ApiError(f"{where}.image_url must be an object {{'url': 'data:image/...;base64,...'}}",
                       f"{where}.image_url")
    head, _, data = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64")):
        raise ApiError(f"{where}.image_url.url: this server fetches nothing; send the picture inline as "
                       "'data:image/png;base64,...' (or image/jpeg)", f"{where}.image_url.url")
    try:
        with Image.open(io.BytesIO(_b64(data, f"{where}.image_url.url"))) as im:
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise ApiError(f"{where}: a {im.width}x{im.height} image; send at most {MAX_IMAGE_PIXELS} pixels "
                               "(it is resized to about 448x448 anyway)", f"{where}.image_url.url")
            image = im.convert("RGB")
        return ImagePart.from_image(image, where=where)
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, InputError) as exc:
        raise ApiError(f"{where}.image_url.url cannot be read as an image ({exc})", f"{where}.image_url.url") from None


def _content(content: Any, where: str, role: str) -> str | tuple:
    """A message's content: a string, or a list of parts. Text parts alone are joined into one string; with
    audio or images the parts stay in order (the prompt lays them side by side, as upstream's turn mode does)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ApiError(f"{where} must be a string or a non-empty list of parts", where)
    parts: list = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}[{j}]"
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("input_audio", "image_url") and role != "user":
            raise ApiError(f"{at}: {kind} parts go in user messages only", at)
        elif kind == "input_audio":
            parts.append(_input_audio(part, at))
        elif kind == "image_url":
            parts.append(_image_url(part, at))
        else:
            raise ApiError(f"{at}: a part of type {kind!r} is not served here; send text ({{'type': 'text', "
                           "'text': ...}}), input_audio or image_url parts", at)
    if all(isinstance(p, str) for p in parts):
        return "".join(parts)
    return tuple(parts)


def _messages(raw: Any) -> tuple[dict, ...]:
    if not isinstance(raw, list) or not raw:
        raise ApiError("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} must be an object with role and content", where)
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant"):
            raise ApiError(f"{where}.role {m.get('role')!r} is not served here; use system, developer, user or "
                           "assistant", f"{where}.role")
        out.append({"role": role, "content": _content(m.get("content"), f"{where}.content", role)})
    if out[-1]["role"] != "user":
        raise ApiError(f"the last message must come from the user (got {out[-1]['role']!r}): it is what gets "
                       "answered", "messages")
    last = out[-1]["content"]
    if isinstance(last, str) and not last.strip():
        raise ApiError("the last user message is empty; send the words to answer", "messages")
    try:
        check_messages(out, "messages")
    except InputError as exc:
        raise ApiError(str(exc), "messages") from None
    return tuple(out)


def parse_chat(body: Any, voices: Sequence[str]) -> ChatRequest:
    """Check a chat-completions body against what the server serves; ``voices``: the registered voice names,
    the first of which is the default."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ApiError(f"unsupported field(s) {', '.join(unknown)}: this server takes {', '.join(sorted(FIELDS))} "
                       "(sampling follows the deploy profile)", unknown[0])
    messages = _messages(body.get("messages"))
    modalities = body.get("modalities", ["text"])
    if (not isinstance(modalities, list) or not set(modalities) <= {"text", "audio"} or "text" not in modalities):
        raise ApiError(f"modalities {modalities!r}: pass ['text'] or ['text', 'audio']", "modalities")
    speak = "audio" in modalities
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(f"stream must be true or false, got {stream!r}", "stream")
    voice = fmt = None
    audio = body.get("audio")
    if audio is not None and not speak:
        raise ApiError("audio options were given but modalities has no 'audio'; add it to get speech", "audio")
    if speak:
        audio = {} if audio is None else audio
        if not isinstance(audio, dict):
            raise ApiError("audio must be an object {'voice': ..., 'format': ...}", "audio")
        voice = audio.get("voice", voices[0])
        if voice not in voices:
            raise ApiError(f"voice {voice!r} is not one of this server's voices: {', '.join(voices)}", "audio.voice")
        fmt = audio.get("format", "pcm16" if stream else "wav")
        if fmt not in AUDIO_FORMATS:
            raise ApiError(f"audio.format {fmt!r}: pass one of {', '.join(AUDIO_FORMATS)}", "audio.format")
        if stream and fmt != "pcm16":
            raise ApiError("a stream sends raw 24 kHz 16-bit PCM chunks; pass audio.format 'pcm16' (or stream: false "
                           "for one WAV)", "audio.format")
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(f"n={n!r}: one answer per request is served (send several requests instead)", "n")
    seed = body.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ApiError(f"seed must be an integer, got {seed!r}", "seed")
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    max_codes = _positive_int(body, "max_codes")
    if max_codes is not None and not speak:
        raise ApiError("max_codes limits speech; add 'audio' to modalities or drop it", "max_codes")
    return ChatRequest(messages, speak, voice, fmt, stream, seed, max_tokens, max_codes)


# ---- what goes back ------------------------------------------------------------------------------------------


def new_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def pcm16(samples: np.ndarray) -> bytes:
    """float samples in [-1, 1] -> little-endian 16-bit PCM (clipped, rounded)."""
    s = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return np.round(s * 32767.0).astype("<i2").tobytes()


def wav_bytes(samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A 16-bit PCM WAV file in memory (the samples as ``pcm16`` stores them)."""
    import soundfile as sf

    buf = io.BytesIO()
    pcm = np.frombuffer(pcm16(samples), dtype="<i2")
    sf.write(buf, pcm, sample_rate, subtype="PCM_16", format="WAV")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, req: ChatRequest, text: str, samples: np.ndarray | None,
                    finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """The whole answer (``stream: false``). With speech, the text is the audio's transcript and ``content`` is
    null, as in OpenAI's audio output."""
    created = int(time.time())
    message: dict = {"role": "assistant", "content": text}
    if req.speak:
        data = wav_bytes(samples) if req.audio_format == "wav" else pcm16(samples)
        message = {"role": "assistant", "content": None,
                   "audio": {"id": "audio_" + rid.split("-", 1)[-1], "data": b64(data), "transcript": text,
                             "format": req.audio_format, "sample_rate": SAMPLE_RATE, "expires_at": created + 3600}}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(rid: str, model: str, delta: dict, finish_reason: str | None = None,
               usage_: dict | None = None) -> dict:
    """One server-sent event of a stream (``chat.completion.chunk``)."""
    out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
    if usage_ is not None:
        out["usage"] = usage_
    return out
