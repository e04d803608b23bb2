"""The tiny checkpoint: real layout, real key names, real tokenizer, small dimensions.

Everything that is not a dimension (token ids, vocabulary sizes, rates, codec
sizes) keeps its real value, so the tiny model exercises the same code paths as
the real one. Its weights are random: its text is gibberish and its audio noise.
"""

from __future__ import annotations

import copy
import json
import shutil
import zlib
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..atomic import check_output_path, temp_dir_beside
from ..errors import InputError
from .tokenizer import vendored_tokenizer_dir

# Dimension overrides applied to the real (reconstructed) config.json.
TINY_OVERRIDES: dict = {
    "torch_dtype": "bfloat16",
    # LLM: the resampler uses hidden // 128 heads, so hidden must stay >= 128.
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_window_layers": 2,
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 2},
    # Whisper: the projection's input is encoder_ffn_dim // 4, which must equal d_model.
    "audio_config": {"d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 2,
                     "encoder_ffn_dim": 256, "decoder_layers": 2, "decoder_attention_heads": 2,
                     "decoder_ffn_dim": 256, "num_hidden_layers": 2},
    "tts_config": {"llm_dim": 128, "hidden_size": 64, "intermediate_size": 128,
                   "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2},
}

TINY_SHARD_BYTES = 32 * 1024 * 1024
TOKENIZER_FILES = ("vocab.json", "merges.txt", "added_tokens.json", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json", "preprocessor_config.json")

TINY_NOTE = """# Tiny MiniCPM-o 4.5 checkpoint (random weights)

Written by `minicpmo-rt make-tiny`. Same file layout, key names and tokenizer as a
real MiniCPM-o 4.5 snapshot, with small dimensions and RANDOM weights: any text it
generates is gibberish and any audio it produces is noise. It exists to test the
plumbing, never to judge quality.
"""


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def reference_config() -> dict:
    return json.loads((vendored_tokenizer_dir() / "reference_config.json").read_text())


def tiny_config() -> dict:
    return _merge(reference_config(), TINY_OVERRIDES)


def _name_generator(seed: int, name: str) -> torch.Generator:
    # Per-tensor seeds keep each tensor's values independent of which other parts exist.
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def random_tensor(name: str, shape: Iterable[int], seed: int) -> torch.Tensor:
    """A deterministic random value for parameter ``name`` that keeps activations O(1).

    Norm scales are near 1, biases small, weights ~ N(0, 1/fan_in) so deep stacks stay finite.
    """
    shape = tuple(shape)
    gen = _name_generator(seed, name)
    leaf = name.rsplit(".", 1)[-1]
    lname = name.lower()
    is_norm = any(t in lname for t in ("norm", "ln_", ".ln", "layernorm")) or lname.startswith("ln")
    if len(shape) <= 1 and is_norm and leaf in ("weight", "gamma", "scale"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if leaf in ("bias", "beta") or len(shape) <= 1:
        return 0.02 * torch.randn(shape, generator=gen)
    if leaf == "original0":  # weight-norm magnitude g
        return 0.5 + torch.rand(shape, generator=gen)
    fan_in = 1
    for d in shape[1:]:
        fan_in *= d
    return torch.randn(shape, generator=gen) / max(fan_in, 1) ** 0.5


def randomize_(module: torch.nn.Module, seed: int, prefix: str = "") -> torch.nn.Module:
    """Fill every persistent tensor of ``module`` with ``random_tensor`` values (in place)."""
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=True).items():
            t.copy_(random_tensor(prefix + name, t.shape, seed).to(t.dtype))
    return module


def write_tokenizer_files(out: Path) -> None:
    src = vendored_tokenizer_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, out / name)


def atomic_directory(out: Path, build: Callable[[Path], None], force: bool = False) -> Path:
    """Run ``build(tmp)`` in a sibling temp dir, then move it to ``out``.

    A failure leaves nothing at ``out``; an existing non-empty ``out`` is kept
    unless ``force``.
    """
    out = check_output_path(out, "OUT", directory=True)
    if out.exists() and any(out.iterdir()):
        if not force:
            raise InputError(f"{out}: already exists and is not empty; choose another path or pass --force")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_beside(out, prefix=f".{out.name}.tmp-")
    try:
        build(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
