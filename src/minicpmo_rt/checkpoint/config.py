"""Typed view of a MiniCPM-o 4.5 ``config.json``.

The LLM fields sit at the top level (upstream's config extends Qwen3Config);
vision, audio, TTS and slicing have their own sub-dicts. Each dataclass keeps
only what the runtime reads; ``MiniCPMOConfig.raw`` keeps the whole file so that
sub-configs can be handed to transformers unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

SUPPORTED_VERSION = "4.5"


@dataclass(frozen=True)
class LLMConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    attention_dropout: float = 0.0


@dataclass(frozen=True)
class AudioConfig:
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    num_mel_bins: int
    max_source_positions: int
    activation_function: str = "gelu"


@dataclass(frozen=True)
class TTSConfig:
    llm_dim: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    num_key_value_heads: int
    max_position_embeddings: int
    num_audio_tokens: int
    num_text_tokens: int
    num_vq: int = 1
    audio_bos_token_id: int = 151687
    text_eos_token_id: int = 151692
    tts_bos_token_id: int = 151703
    tts_eos_token_id: int = 151704
    normalize_projected_hidden: bool = True
    projector_type: str = "mlp"
    hidden_act: str = "silu"
    attention_type: str = "full_attention"
    s3_stream_chunk_size: int = 25
    s3_stream_n_timesteps: int = 10
    s3_stream_prelook_size: int = 3
    top_p: float = 0.85
    top_k: int = 25
    repetition_penalty: float = 1.05
    temperature: float = 0.8
    backbone_vocab_size: int = 32000  # LlamaConfig default; the unused tts.model.embed_tokens


@dataclass(frozen=True)
class SliceConfig:
    patch_size: int = 14
    max_slice_nums: int = 9
    scale_resolution: int = 448


@dataclass(frozen=True)
class MiniCPMOConfig:
    version: str
    llm: LLMConfig
    vision: VisionConfig
    audio: AudioConfig
    tts: TTSConfig
    slicing: SliceConfig
    query_num: int = 64
    image_size: int = 448
    patch_size: int = 14
    drop_vision_last_layer: bool = False
    audio_pool_step: int = 5
    audio_chunk_length: float = 1.0
    torch_dtype: str = "bfloat16"
    init_vision: bool = True
    init_audio: bool = True
    init_tts: bool = True
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config.json") -> "MiniCPMOConfig":
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: expected a JSON object, found {type(data).__name__}")
        version = data.get("version")
        if version is None or str(version) != SUPPORTED_VERSION:
            raise CheckpointError(
                f"{where}: config version {version!r} is not supported; minicpmo-rt implements "
                f"MiniCPM-o {SUPPORTED_VERSION} only (expected \"version\": {SUPPORTED_VERSION})"
            )
        for sub in ("vision_config", "audio_config", "tts_config"):
            if not isinstance(data.get(sub), dict):
                raise CheckpointError(f"{where}: missing the '{sub}' object")
        top = {k: data[k] for k in (
            "query_num", "image_size", "patch_size", "drop_vision_last_layer", "audio_pool_step",
            "audio_chunk_length", "torch_dtype", "init_vision", "init_audio", "init_tts",
        ) if k in data}
        tts = dict(data["tts_config"])
        return cls(
            version=str(version),
            llm=_build(LLMConfig, data, f"{where} (top-level LLM fields)"),
            vision=_build(VisionConfig, data["vision_config"], f"{where} vision_config"),
            audio=_build(AudioConfig, data["audio_config"], f"{where} audio_config"),
            tts=_build(TTSConfig, tts, f"{where} tts_config"),
            slicing=_build(SliceConfig, data.get("slice_config") or {}, f"{where} slice_config"),
            raw=data,
            **top,
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(self.raw)


def _build(cls, data: dict[str, Any], where: str):
    names = {f.name for f in fields(cls)}
    required = [f.name for f in fields(cls)
                if f.default.__class__.__name__ == "_MISSING_TYPE"
                and f.default_factory.__class__.__name__ == "_MISSING_TYPE"]
    missing = [n for n in required if n not in data]
    if missing:
        raise CheckpointError(f"{where}: missing required field(s) {', '.join(missing)}")
    return cls(**{k: v for k, v in data.items() if k in names})


def load_config(path: str | Path) -> MiniCPMOConfig:
    """Read and validate ``config.json`` (a file, or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json here; point at a MiniCPM-o 4.5 snapshot directory")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    return MiniCPMOConfig.from_dict(data, where=str(path))
