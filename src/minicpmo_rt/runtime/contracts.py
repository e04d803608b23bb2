"""Typed, frozen records that cross a stage boundary in turn mode (DESIGN 'Stage contracts').

    TurnRequest --Thinker--> ThinkerStep* --collect--> TalkerInput --Talker--> CodecChunk*
                --Code2Wav--> PcmChunk*

A stage only reads these records, never another stage's internals, so stages can be run
sequentially (as ``turn.TurnPipeline`` does) or on separate workers without changing them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence, Union

import numpy as np
import torch

from ..errors import InputError
from ..talker.engine import CodecChunk as _TalkerCodecChunk
from ..talker.engine import TalkerRequest
from ..thinker.image_processor import ProcessedImage

# Turn terminators: <|tts_eos|> and <|im_end|> (DESIGN); the Thinker's generation loop also
# stops on "</s>" (128247) as upstream's streaming generate does.
TTS_EOS_ID = 151704
IM_END_ID = 151645
SAMPLE_RATE = 24000

# Talker -> Code2Wav: the Talker's own record (3 left-context codes + window, final flag).
CodecChunk = _TalkerCodecChunk

# {"role": "system" | "user" | "assistant", "content": str | tuple[str | AudioPart | ImagePart, ...]}
Message = dict
# placeholder markers: in a text part they would open embedding slots that no audio or image fills
MEDIA_MARKERS = ("<image>", "</image>", "<slice>", "</slice>", "<|audio_start|>", "<|audio_end|>")


@dataclass(frozen=True, eq=False)
class AudioPart:
    """Sound in a user message (their spoken words, a clip to talk about): mono float32 at 16 kHz, read-only.
    The Thinker encodes it whole (Whisper with full attention, as upstream's turn-mode ``streaming_prefill`` with
    ``stream_input=False``): 10 positions a second."""

    samples: np.ndarray = field(repr=False)

    def __post_init__(self) -> None:
        from ..thinker.prompt import audio_piece_counts

        s = np.array(self.samples, dtype=np.float32)     # a copy the caller cannot change
        if s.ndim != 1 or not s.size:
            raise InputError(f"audio of shape {list(s.shape)}: pass mono 16 kHz samples [N]")
        s.setflags(write=False)
        object.__setattr__(self, "samples", s)
        if not audio_piece_counts(s.size):
            raise InputError(f"audio of {s.size} samples ({s.size / 16000:.3f} s) is too short to hear; "
                             "send at least 0.1 s at 16 kHz")

    @classmethod
    def from_samples(cls, samples, sample_rate: int = 16000, where: str = "audio") -> "AudioPart":
        """Any mono float waveform (numpy or torch) at ``sample_rate``, resampled to 16 kHz."""
        from ..thinker.mel import check_audio

        return cls(check_audio(samples, sample_rate, where))

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> "AudioPart":
        """A soundfile-readable recording (WAV/FLAC/OGG), mixed to mono and resampled to 16 kHz."""
        from ..code2wav.frontend import read_audio, resample

        x, sr = read_audio(path, "audio")
        return cls(resample(x, sr, 16000))

    @property
    def seconds(self) -> float:
        return self.samples.size / 16000


@dataclass(frozen=True, eq=False)
class ImagePart:
    """A picture in a user message, preprocessed as upstream's turn-mode prefill does by default
    (``max_slice_nums`` 1: the whole image at about 448x448, 64 positions; each slice adds 64 more)."""

    image: ProcessedImage

    @classmethod
    def from_image(cls, image, max_slice_nums: int = 1, where: str = "image") -> "ImagePart":
        """A PIL image, an HxWx3 uint8 array or an image file's path."""
        from ..thinker.image_processor import process_image

        if isinstance(image, (str, Path)):
            image = _open_image(Path(image), where)
        return cls(process_image(image, max_slice_nums, where=where))


def _open_image(path: Path, where: str):
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise InputError(f"{where} {path}: file not found")
    try:
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except (UnidentifiedImageError, OSError) as exc:
        raise InputError(f"{where} {path}: cannot be read as an image ({exc}); use PNG or JPEG") from None


def _part(p, where: str):
    """One content part as the pipeline holds it: text, AudioPart or ImagePart."""
    if isinstance(p, (str, AudioPart, ImagePart)):
        return p
    if isinstance(p, ProcessedImage):
        return ImagePart(p)
    if isinstance(p, (np.ndarray, torch.Tensor)):
        return AudioPart.from_samples(p, 16000, where)
    if type(p).__module__.startswith("PIL."):
        return ImagePart.from_image(p, where=where)
    raise InputError(f"{where}: a part of type {type(p).__name__} is not text, audio (16 kHz samples or an "
                     "AudioPart) or an image (a PIL image or an ImagePart)")


def _message(m, i: int, where: str) -> Message:
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
        raise InputError(f"{where}: messages[{i}] must be a dict with role system, user or assistant")
    content = m.get("content")
    if isinstance(content, str):
        return dict(m)
    if not isinstance(content, (list, tuple)) or not content:
        raise InputError(f"{where}: messages[{i}].content must be text or a non-empty list of parts (text, audio, "
                         "images)")
    parts = tuple(_part(p, f"{where}: messages[{i}].content[{j}]") for j, p in enumerate(content))
    if m["role"] != "user" and not all(isinstance(p, str) for p in parts):
        raise InputError(f"{where}: messages[{i}] ({m['role']}) holds audio or images; only user messages may")
    return {**m, "content": parts}


@dataclass(frozen=True)
class TurnRequest:
    """One spoken turn to answer: the conversation so far (last message from the user)."""

    request_id: str
    messages: tuple[Message, ...]
    voice: Union[str, Path, None] = None     # reference recording for Code2Wav (None: codes only)
    seed: int = 0
    max_new_tokens: int | None = None        # Thinker tokens with a hidden row
    max_codes: int | None = None             # Talker codes (EOS excluded)

    @classmethod
    def make(cls, request_id: str, text_or_messages: Union[str, Sequence[Message]], voice=None, seed: int = 0,
             max_new_tokens: int | None = None, max_codes: int | None = None) -> "TurnRequest":
        """``text_or_messages``: the user's words, or the conversation. A message's content is text or a list of
        parts in order: text, audio (an ``AudioPart``, or 16 kHz mono float samples) and images (an
        ``ImagePart``, or a PIL image); media go in user messages only."""
        if not isinstance(request_id, str) or not request_id:
            raise InputError(f"request id {request_id!r}: pass a non-empty string")
        where = f"request {request_id!r}"
        if isinstance(text_or_messages, str):
            messages: tuple[Message, ...] = ({"role": "user", "content": text_or_messages},)
        else:
            messages = tuple(_message(m, i, where) for i, m in enumerate(text_or_messages))
        check_messages(messages, where)
        for name, v in (("max_new_tokens", max_new_tokens), ("max_codes", max_codes)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise InputError(f"{where}: {name} must be a positive integer, got {v!r}")
        return cls(request_id, messages, voice, int(seed), max_new_tokens, max_codes)


def check_messages(messages: Sequence[Message], where: str) -> None:
    if not messages:
        raise InputError(f"{where}: no messages; pass the user's text")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise InputError(f"{where}: messages[{i}] must be a dict with role system, user or assistant")
        content = m.get("content")
        parts = (content,) if isinstance(content, str) else content
        if not isinstance(parts, tuple) or not parts or \
                not all(isinstance(p, (str, AudioPart, ImagePart)) for p in parts):
            raise InputError(f"{where}: messages[{i}].content must be text or a tuple of text, AudioPart and "
                             "ImagePart parts (TurnRequest.make converts lists, waveforms and PIL images)")
        if m["role"] != "user" and not all(isinstance(p, str) for p in parts):
            raise InputError(f"{where}: messages[{i}] ({m['role']}) holds audio or images; only user messages may")
        for p in parts:
            if isinstance(p, str) and any(mark in p for mark in MEDIA_MARKERS):
                raise InputError(f"{where}: messages[{i}] text contains an audio/image marker (<|audio_start|>, "
                                 "<image>...); send audio and images as parts, not as placeholder text")
    if messages[-1]["role"] != "user":
        raise InputError(f"{where}: the last message must come from the user (got {messages[-1]['role']!r})")
    last = messages[-1]["content"]
    if not any(not isinstance(p, str) or p.strip() for p in ((last,) if isinstance(last, str) else last)):
        raise InputError(f"{where}: the user text is empty; pass something to answer")


@dataclass(frozen=True)
class ThinkerStep:
    """Thinker -> Talker, one sampled token.

    ``hidden`` is the final-norm hidden row at the token's own position (float32, on the Thinker's
    device, copied out of any static buffer: the Talker reads it on its own device, so on CUDA it
    never crosses to the host; duplex mode's ``UnitGeneration`` keeps host rows, which ride along
    with each step's logits). A terminator is sampled but never fed, so it has no row
    (``hidden is None``) and is never forwarded to the Talker.
    """

    request_id: str
    position: int
    token_id: int
    text: str
    hidden: torch.Tensor | None
    is_terminator: bool

    def __post_init__(self) -> None:
        if self.is_terminator != (self.hidden is None):
            raise ValueError(f"ThinkerStep {self.request_id}@{self.position}: a terminator carries no hidden row "
                             "and every other token carries one")
        if self.hidden is not None and self.hidden.ndim != 1:
            raise ValueError(f"ThinkerStep {self.request_id}@{self.position}: hidden must be one row [H]")


@dataclass(frozen=True)
class TalkerInput:
    """Everything the Talker conditions one request on: the text tokens after <|tts_bos|>
    and their hidden rows, terminator excluded."""

    request_id: str
    token_ids: tuple[int, ...]
    hidden: torch.Tensor          # [n, H] float32, on the Thinker's device
    text: str
    terminator: int | None        # the id that ended the text; None = the token limit did

    @classmethod
    def from_steps(cls, request_id: str, steps: Iterable[ThinkerStep]) -> "TalkerInput":
        """Collect the steps of one request; everything at and after a terminator is dropped."""
        ids: list[int] = []
        rows: list[torch.Tensor] = []
        text: list[str] = []
        terminator = None
        for s in steps:
            if s.request_id != request_id:
                raise ValueError(f"TalkerInput {request_id!r}: got a step of request {s.request_id!r}")
            if s.is_terminator:
                terminator = s.token_id
                break
            ids.append(s.token_id)
            rows.append(s.hidden)
            text.append(s.text)
        if not ids:
            raise InputError(f"request {request_id!r}: the Thinker produced no text before "
                             f"{'terminator ' + str(terminator) if terminator is not None else 'its limit'}; "
                             "there is nothing to speak (rephrase the input or change the seed)")
        return cls(request_id, tuple(ids), torch.stack(rows).float(), "".join(text), terminator)

    def to_request(self, seed: int, max_codes: int | None = None) -> TalkerRequest:
        return TalkerRequest(self.request_id, torch.tensor(self.token_ids, dtype=torch.long), self.hidden,
                             seed=seed, max_codes=max_codes, text_finished=True)


@dataclass(frozen=True)
class PcmChunk:
    """Code2Wav -> client: 24 kHz mono float32 samples of one request, in ``seq`` order."""

    request_id: str
    seq: int
    samples: np.ndarray = field(repr=False)
    final: bool
    sample_rate: int = SAMPLE_RATE

    def __post_init__(self) -> None:
        s = np.asarray(self.samples, dtype=np.float32)
        if s.ndim != 1:
            raise ValueError(f"PcmChunk {self.request_id}#{self.seq}: samples must be 1-D, got {s.shape}")
        if s.flags.writeable:
            s = s.copy()
            s.setflags(write=False)  # immutable like the record that holds it
        object.__setattr__(self, "samples", s)

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate
