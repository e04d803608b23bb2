"""The MiniCPM-o 4.5 tokenizer, built from a snapshot's own files.

Upstream's ``MiniCPMOTokenizerFast`` is a Qwen2 byte-level BPE with MiniCPM-o's
added tokens. It is rebuilt here with the ``tokenizers`` library directly from
``vocab.json``, ``merges.txt``, ``added_tokens.json`` and
``tokenizer_config.json``: no remote code, no network, and no dependence on
which tokenizer classes a given transformers release ships.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer as _HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from ..errors import CheckpointError

# Qwen2's pre-tokenizer split pattern (contractions, letters, single digits,
# punctuation runs, newlines, spaces).
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TOKENIZER_FILES = ("vocab.json", "merges.txt", "added_tokens.json", "tokenizer_config.json")


@dataclass(frozen=True)
class SpecialIds:
    """Token ids the runtime branches on (values read from the files, never hard-coded)."""

    endoftext: int
    im_start: int
    im_end: int
    unk: int
    image_start: int
    image_end: int
    slice_start: int
    slice_end: int
    unit_start: int
    unit_end: int
    audio_start: int
    audio_end: int
    tts_bos: int
    tts_eos: int
    listen: int
    speak: int
    turn_eos: int
    chunk_eos: int
    chunk_tts_eos: int
    tts_pad: int
    think_start: int
    think_end: int


_SPECIAL_NAMES = {
    "endoftext": "<|endoftext|>", "im_start": "<|im_start|>", "im_end": "<|im_end|>",
    "unk": "<unk>", "image_start": "<image>", "image_end": "</image>",
    "slice_start": "<slice>", "slice_end": "</slice>", "unit_start": "<unit>",
    "unit_end": "</unit>", "audio_start": "<|audio_start|>", "audio_end": "<|audio_end|>",
    "tts_bos": "<|tts_bos|>", "tts_eos": "<|tts_eos|>", "listen": "<|listen|>",
    "speak": "<|speak|>", "turn_eos": "<|turn_eos|>", "chunk_eos": "<|chunk_eos|>",
    "chunk_tts_eos": "<|chunk_tts_eos|>", "tts_pad": "<|tts_pad|>",
    "think_start": "<think>", "think_end": "</think>",
}


class MiniCPMOTokenizer:
    """Encode/decode text; ``special`` holds the ids of the control tokens."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        missing = [n for n in TOKENIZER_FILES if not (directory / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{directory}: tokenizer file(s) missing: {', '.join(missing)} "
                "(a MiniCPM-o 4.5 snapshot holds all of vocab.json, merges.txt, added_tokens.json, "
                "tokenizer_config.json)"
            )
        vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
        merges = []
        for line in (directory / "merges.txt").read_text(encoding="utf-8").splitlines():
            if line and not line.startswith("#version"):
                a, b = line.split(" ")
                merges.append((a, b))
        tok = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None,
                                      fuse_unk=False, byte_fallback=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()

        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        added = json.loads((directory / "added_tokens.json").read_text(encoding="utf-8"))
        decoder_table = config.get("added_tokens_decoder", {})
        entries = {int(i): spec for i, spec in decoder_table.items()}
        for content, idx in added.items():
            entries.setdefault(int(idx), {"content": content, "special": True})
        # Added tokens must be registered in id order so that each lands on its id.
        for idx in sorted(entries):
            spec = entries[idx]
            token = AddedToken(spec["content"], single_word=spec.get("single_word", False),
                               lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                               normalized=spec.get("normalized", False),
                               special=spec.get("special", True))
            tok.add_tokens([token]) if not spec.get("special", True) else tok.add_special_tokens([token])
            got = tok.token_to_id(spec["content"])
            if got != idx:
                raise CheckpointError(
                    f"{directory}/tokenizer_config.json: added token {spec['content']!r} resolves to id "
                    f"{got}, the file says {idx}")
        self._tok = tok
        self.directory = directory
        self.eos_token = config.get("eos_token", "<|im_end|>")
        self.bad_token_ids = tuple(config.get("bad_token_ids", ()))
        self.special = SpecialIds(**{k: self._require(v) for k, v in _SPECIAL_NAMES.items()})

    def _require(self, token: str) -> int:
        idx = self._tok.token_to_id(token)
        if idx is None:
            raise CheckpointError(f"{self.directory}: the tokenizer has no {token!r} token")
        return idx

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self._tok.id_to_token(idx)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(directory: str | Path) -> MiniCPMOTokenizer:
    return MiniCPMOTokenizer(directory)


def vendored_tokenizer_dir() -> Path:
    """The real tokenizer files shipped with the package (see data/PROVENANCE.md)."""
    return Path(__file__).with_name("data")
