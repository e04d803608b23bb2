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

# Turn terminators: <|tts_eos|> and <|im_end|> (DESIGN); the Thinker's generation loop also
# stops on "</s>" (128247) as upstream's streaming generate does.
TTS_EOS_ID = 151704
IM_END_ID = 151645
SAMPLE_RATE = 24000

# Talker -> Code2Wav: the Talker's own record (3 left-context codes + window, final flag).
CodecChunk = _TalkerCodecChunk

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


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
        if not isinstance(request_id, str) or not request_id:
            raise InputError(f"request id {request_id!r}: pass a non-empty string")
        if isinstance(text_or_messages, str):
            messages: tuple[Message, ...] = ({"role": "user", "content": text_or_messages},)
        else:
            messages = tuple(dict(m) for m in text_or_messages)
        check_messages(messages, f"request {request_id!r}")
        for name, v in (("max_new_tokens", max_new_tokens), ("max_codes", max_codes)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise InputError(f"request {request_id!r}: {name} must be a positive integer, got {v!r}")
        return cls(request_id, messages, voice, int(seed), max_new_tokens, max_codes)


def check_messages(messages: Sequence[Message], where: str) -> None:
    if not messages:
        raise InputError(f"{where}: no messages; pass the user's text")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise InputError(f"{where}: messages[{i}] must be a dict with role system, user or assistant")
        if not isinstance(m.get("content"), str):
            raise InputError(f"{where}: messages[{i}].content must be text (turn mode here is text in, speech out)")
    if messages[-1]["role"] != "user":
        raise InputError(f"{where}: the last message must come from the user (got {messages[-1]['role']!r})")
    if not messages[-1]["content"].strip():
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
