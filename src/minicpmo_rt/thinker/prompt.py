"""Prompt text and token layouts: the chat template, turn-mode streaming segments, duplex units
and the system prompts, as upstream builds them.

A ``PromptPiece`` is what one prefill feeds: token ids plus the ``EmbedSlot`` spans whose
positions are filled by encoder outputs instead of token embeddings (their ids are
``<unk>``, which upstream overwrites the same way). Turn-mode pieces are built as upstream
does: the whole segment text (with ``<image>``/``<|audio_start|>`` placeholders) is tokenized
at once, ``<|listen|>`` ids are removed, and the slots are the spans between the markers.
Duplex pieces are fed token by token upstream and are assembled directly from special ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

from ..errors import InputError
from .image_processor import IMAGE_FEATURE_SIZE, ProcessedImage, image_placeholder

# Documented ids of the real tokenizer (spec section 2); tests check each against the
# tokenizer files. Code paths that have a tokenizer read ``tokenizer.special`` instead.
IM_START_ID = 151644
IM_END_ID = 151645
ENDOFTEXT_ID = 151643
UNK_ID = 128244
TTS_BOS_ID = 151703
TTS_EOS_ID = 151704
LISTEN_ID = 151705
TURN_EOS_ID = 151717
CHUNK_EOS_ID = 151718
CHUNK_TTS_EOS_ID = 151721
EOS_S_ID = 128247  # "</s>": a plain added token of this vocabulary, upstream's third turn terminator

# Turn-streaming generation stops on upstream's "<|tts_eos|>", "<|im_end|>" and "</s>".
TURN_TERMINATORS = (TTS_EOS_ID, IM_END_ID, EOS_S_ID)

THINK_EMPTY = "<think>\n\n</think>\n\n"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. You can accept audio and text input and output voice and text."
DUPLEX_DEFAULT_SYSTEM_TEXT = "Streaming Omni Conversation."


@dataclass(frozen=True)
class EmbedSlot:
    kind: Literal["image", "audio"]
    start: int    # position within the piece
    length: int


@dataclass(frozen=True)
class PromptPiece:
    """Token ids for one prefill; slot positions hold ``<unk>`` and are replaced by embeddings."""

    ids: tuple[int, ...]
    slots: tuple[EmbedSlot, ...] = ()
    text: str = ""

    def __len__(self) -> int:
        return len(self.ids)

    def __add__(self, other: "PromptPiece") -> "PromptPiece":
        n = len(self.ids)
        moved = tuple(EmbedSlot(s.kind, s.start + n, s.length) for s in other.slots)
        return PromptPiece(self.ids + other.ids, self.slots + moved, self.text + other.text)

    def slot_lengths(self, kind: str) -> list[int]:
        return [s.length for s in self.slots if s.kind == kind]


# ---------------------------------------------------------------- counts

def audio_embed_count(num_samples: int, hop_length: int = 160, pool_step: int = 5) -> int:
    """LLM positions for ``num_samples`` of 16 kHz audio: mel frames ceil(n/160), conv stride 2,
    then AvgPool(5): 16000 -> 10, 16480 -> 10."""
    if num_samples <= 0:
        raise InputError(f"audio: {num_samples} samples; pass a non-empty 16 kHz waveform")
    frames = math.ceil(num_samples / hop_length)
    frames = (frames - 1) // 2 + 1
    return (frames - pool_step) // pool_step + 1


AUDIO_PIECE_SAMPLES = 30 * 16000   # the feature extractor's 30-s window; longer audio is encoded piece by piece


def audio_piece_counts(num_samples: int) -> list[int]:
    """LLM positions of each 30-s piece of a whole recording, as ``Thinker.embed_audio`` encodes it (a tail
    too short for one pooled embedding gives none and is left out)."""
    if num_samples <= 0:
        raise InputError(f"audio: {num_samples} samples; pass a non-empty 16 kHz waveform")
    counts = (audio_embed_count(min(AUDIO_PIECE_SAMPLES, num_samples - start))
              for start in range(0, num_samples, AUDIO_PIECE_SAMPLES))
    return [c for c in counts if c > 0]


def audio_placeholder(num_samples: int, chunk_input: bool = False, chunk_length: float = 1.0,
                      hop_length: int = 160, pool_step: int = 5) -> str:
    """Upstream get_audio_placeholder. Turn-mode streaming calls it with chunk_input False: one
    ``<|audio_start|>`` + N ``<unk>`` + ``<|audio_end|>`` block; chunk_input True splits it per second."""
    total = audio_embed_count(num_samples, hop_length, pool_step)
    if not chunk_input:
        return "<|audio_start|>" + "<unk>" * total + "<|audio_end|>"
    per_chunk = ((int(chunk_length * 100) - 1) // 2 + 1 - pool_step) // pool_step + 1
    out, done = "", 0
    while done < total:
        n = min(per_chunk, total - done)
        out += "<|audio_start|>" + "<unk>" * n + "<|audio_end|>"
        done += n
    return out


# ---------------------------------------------------------------- chat template

def _message_content(msg: dict, where: str) -> str:
    content = msg.get("content")
    if not isinstance(content, str):
        raise InputError(f"{where}: content must be a string here (got {type(content).__name__}); "
                         "replace audio/images by their placeholder text first")
    return content


def apply_chat_template(messages: Sequence[dict], add_generation_prompt: bool = False,
                        enable_thinking: bool | None = None, use_tts_template: bool = False) -> str:
    """The tokenizer_config chat template (without tools), rendered in Python.

    ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message; assistant turns after the last
    user query keep a ``<think>`` block when they carry reasoning (or are last); the generation
    prompt adds ``<|im_start|>assistant\\n``, then ``<think>\\n\\n</think>\\n\\n`` when
    ``enable_thinking is False``, then ``<|tts_bos|>`` when ``use_tts_template``.
    """
    if not messages and not add_generation_prompt:
        return ""
    out = []
    if messages and messages[0].get("role") == "system":
        out.append("<|im_start|>system\n" + _message_content(messages[0], "messages[0]") + "<|im_end|>\n")
    last_query = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        c = m.get("content") if isinstance(m.get("content"), str) else ""
        if m.get("role") == "user" and not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
            last_query = i
            break
    for i, m in enumerate(messages):
        role = m.get("role")
        where = f"messages[{i}]"
        if role == "user" or (role == "system" and i > 0):
            out.append(f"<|im_start|>{role}\n" + _message_content(m, where) + "<|im_end|>\n")
        elif role == "assistant":
            content = _message_content(m, where)
            reasoning = m.get("reasoning_content")
            if reasoning is None:
                reasoning = ""
                if "</think>" in content:
                    head, content = content.split("</think>")[0], content.split("</think>")[-1].lstrip("\n")
                    reasoning = head.rstrip("\n").split("<think>")[-1].lstrip("\n")
            if i > last_query and (i == len(messages) - 1 or reasoning):
                out.append(f"<|im_start|>{role}\n<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"
                           + content.lstrip("\n"))
            else:
                out.append(f"<|im_start|>{role}\n" + content)
            out.append("<|im_end|>\n")
        elif role == "tool":
            prev_tool = i > 0 and messages[i - 1].get("role") == "tool"
            next_tool = i + 1 < len(messages) and messages[i + 1].get("role") == "tool"
            out.append(("" if prev_tool else "<|im_start|>user") + "\n<tool_response>\n"
                       + _message_content(m, where) + "\n</tool_response>" + ("" if next_tool else "<|im_end|>\n"))
        elif role != "system":
            raise InputError(f"{where}: unknown role {role!r}; use system, user, assistant or tool")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        if enable_thinking is False:
            out.append(THINK_EMPTY)
        if use_tts_template:
            out.append("<|tts_bos|>")
    return "".join(out)


# ---------------------------------------------------------------- system prompts

def system_prompt_parts(mode: str = "default", language: str = "en",
                        has_ref_audio: bool = False) -> tuple[str, str | None]:
    """(text before the reference audio, text after it or None) of upstream get_sys_prompt.

    With ``has_ref_audio`` the system content is ``before + <audio> + after``; without it the
    upstream fallbacks are returned (``after`` may still be set, joined with no separator).
    """
    zh = language == "zh"
    if mode == "omni":
        if zh:
            pre, post = "模仿音频样本的音色并生成新的内容。", ("请用这种声音风格来为用户提供帮助。 请认真、高质量地回复用户的问题。 "
                                                  "请用高自然度的方式和用户聊天。")
        else:
            pre, post = "Clone the voice in the provided audio prompt.", \
                "As an assistant, you will speak using this voice style."
        return (pre, post) if has_ref_audio else ("", None)
    if mode in ("audio_assistant", "audio_roleplay"):
        if mode == "audio_assistant":
            pre, post = (("模仿音频样本的音色并生成新的内容。",
                          "你的任务是用这种声音模式来当一个助手。请认真、高质量地回复用户的问题。请用高自然度的方式和用户聊天。"
                          "你是由面壁智能开发的人工智能助手：面壁小钢炮。") if zh else
                         ("Use the voice in the audio prompt to synthesize new content.",
                          "You are a helpful assistant with the above voice style."))
        else:
            pre, post = (("模仿输入音频中的声音特征。", "假装你是上述音频中的人物，与我进行对话。") if zh else
                         ("Clone the voice in the provided audio prompt.",
                          "Try to role-play the character based on the audio prompt above."))
        return (pre, post) if has_ref_audio else ("Use the <reserved_53> voice.", post)
    if mode == "voice_cloning":
        if not has_ref_audio:
            raise InputError("voice_cloning system prompt needs a reference audio (ref_audio)")
        return ("模仿输入音频中的声音特征。" if zh else "Clone the voice in the provided audio prompt.", None)
    return DEFAULT_SYSTEM_PROMPT, None


# ---------------------------------------------------------------- piece builder

class PromptBuilder:
    """Builds ``PromptPiece``s with a MiniCPMOTokenizer (ids always read from the tokenizer)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.sp = tokenizer.special

    # -- generic
    def text(self, text: str) -> PromptPiece:
        return PromptPiece(tuple(self.tok.encode(text)), (), text)

    def from_text(self, text: str) -> PromptPiece:
        """Tokenize a whole segment as upstream's processor ``_convert`` does: drop ``<|listen|>``,
        then the image slots are the spans after ``<image>``/``<slice>`` up to ``</image>``/``</slice>``
        and the audio slots the spans between ``<|audio_start|>`` and ``<|audio_end|>``."""
        ids = [t for t in self.tok.encode(text) if t != self.sp.listen]
        slots: list[EmbedSlot] = []
        open_at: dict[str, int] = {}
        starts = {self.sp.image_start: "image", self.sp.slice_start: "image", self.sp.audio_start: "audio"}
        ends = {self.sp.image_end: "image", self.sp.slice_end: "image", self.sp.audio_end: "audio"}
        for pos, t in enumerate(ids):
            if t in starts:
                open_at[starts[t]] = pos + 1
            elif t in ends and ends[t] in open_at:
                kind = ends[t]
                start = open_at.pop(kind)
                if pos > start:
                    slots.append(EmbedSlot(kind, start, pos - start))
        slots.sort(key=lambda s: s.start)
        return PromptPiece(tuple(ids), tuple(slots), text)

    # -- turn mode (MiniCPMO.streaming_prefill / streaming_generate)
    @staticmethod
    def user_prefix(first_of_turn: bool = True, after_generation: bool = False,
                    generation_completed: bool = False) -> str:
        """Text that opens a user segment. The first user segment of a turn starts
        ``<|im_start|>user\\n`` (never closed by ``<|im_end|>`` until the assistant bos); after an
        assistant reply it is preceded by ``<|tts_eos|><|im_end|>\\n`` (``<|im_end|>\\n`` if that
        reply already completed). Later segments of the same turn have no prefix."""
        if not first_of_turn:
            return ""
        if after_generation:
            return ("<|im_end|>\n" if generation_completed else "<|tts_eos|><|im_end|>\n") + "<|im_start|>user\n"
        return "<|im_start|>user\n"

    def user_segment(self, items: Sequence[str | ProcessedImage | int], first_of_turn: bool = True,
                     after_generation: bool = False, generation_completed: bool = False) -> PromptPiece:
        """One turn-mode user prefill. ``items`` in order: text, a ProcessedImage (placeholder
        with its slices, no image id), or an int = number of audio samples of one audio item
        (placeholder ``<|audio_start|>`` + N ``<unk>`` + ``<|audio_end|>``, N = 10 per second)."""
        text = self.user_prefix(first_of_turn, after_generation, generation_completed)
        text += "".join(self._item_text(it) for it in items)
        return self.from_text(text)

    def _item_text(self, item) -> str:
        if isinstance(item, str):
            return item
        if isinstance(item, ProcessedImage):
            return image_placeholder(item.grid)
        if isinstance(item, int) and not isinstance(item, bool):
            return audio_placeholder(item)
        raise InputError(f"prompt item {type(item).__name__} is not text, a ProcessedImage or an audio length")

    def system_turn(self, before: str, ref_audio_samples: int | None = None, after: str | None = None) -> PromptPiece:
        """Upstream system prefill: content = before [+ ref-audio placeholder] [+ after], through
        the chat template (``<|im_start|>system\\n...<|im_end|>\\n``)."""
        content = before
        if ref_audio_samples is not None:
            content += audio_placeholder(ref_audio_samples)
        if after:
            content += after
        return self.from_text(apply_chat_template([{"role": "system", "content": content}]))

    def assistant_bos(self, enable_thinking: bool = False, use_tts_template: bool = True) -> PromptPiece:
        """The generation prefill: ``<|im_end|>\\n<|im_start|>assistant\\n`` + empty think block (unless
        thinking) + ``<|tts_bos|>`` (when speaking)."""
        text = "<|im_end|>\n<|im_start|>assistant\n" + ("" if enable_thinking else THINK_EMPTY)
        text += "<|tts_bos|>" if use_tts_template else ""
        return self.text(text)

    # -- duplex (DuplexCapability.prepare / streaming_prefill / finalize_unit)
    def duplex_system(self, text: str | None = None, ref_audio_embeds: int = 0) -> PromptPiece:
        """``<|im_start|>system\\n{text}\\n<|audio_start|>`` + reference-audio embeddings +
        ``<|audio_end|><|im_end|>`` (no newline after it, as upstream)."""
        text = DUPLEX_DEFAULT_SYSTEM_TEXT if text is None else text
        prefix = self.text(f"<|im_start|>system\n{text}\n<|audio_start|>")
        audio = self._slot("audio", ref_audio_embeds)
        return prefix + audio + self.text("<|audio_end|><|im_end|>")

    def duplex_unit(self, images: Sequence[ProcessedImage | int] = (), audio_embeds: int = 10) -> PromptPiece:
        """One duplex unit's prefill: ``<unit>``, then per frame ``<image>`` + 64 + ``</image>`` and,
        per slice, ``<slice>`` + 64 + ``</slice>`` (no newlines), then the audio embeddings with no
        markers. An int frame entry means that many sub-images (1 = unsliced)."""
        sp = self.sp
        piece = PromptPiece((sp.unit_start,), (), "<unit>")
        for frame in images:
            n_sub = frame.num_sub_images if isinstance(frame, ProcessedImage) else int(frame)
            for k in range(n_sub):
                a, b = (sp.image_start, sp.image_end) if k == 0 else (sp.slice_start, sp.slice_end)
                piece = piece + PromptPiece((a,)) + self._slot("image", IMAGE_FEATURE_SIZE) + PromptPiece((b,))
        if audio_embeds:
            piece = piece + self._slot("audio", audio_embeds)
        return piece

    def duplex_unit_end(self, terminator_id: int | None) -> PromptPiece:
        """finalize_unit: the unit terminator (when one ended the unit) then ``</unit>``."""
        ids = ((terminator_id,) if terminator_id is not None else ()) + (self.sp.unit_end,)
        return PromptPiece(ids, (), self.tok.decode(ids))

    def _slot(self, kind: Literal["image", "audio"], n: int) -> PromptPiece:
        if n == 0:
            return PromptPiece(())
        return PromptPiece((self.sp.unk,) * n, (EmbedSlot(kind, 0, n),), "<unk>" * n)
