"""Which model parts exist and how to build them: the one registry that ``inspect``,
``make-tiny`` and the loaders share.

A *weight part* owns the ``model.safetensors`` keys under one prefix (``llm.``,
``vpm.``, ``tts.``...). An *asset part* owns one ``.pt`` file under
``assets/token2wav/``. Each model package contributes its parts here; this module
is a composition root (like ``cli``), so it may import every model package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from .checkpoint.config import MiniCPMOConfig


@dataclass(frozen=True)
class WeightPart:
    name: str
    prefix: str
    build: Callable[[MiniCPMOConfig], torch.nn.Module]  # keys of the result lack ``prefix``


@dataclass(frozen=True)
class AssetPart:
    name: str
    file: str  # file under assets/token2wav/ and key in token2wav_manifest["files"]
    # asset dir -> module; None builds the full-size upstream layout (for manifest checks)
    build: Callable[[Optional[Path]], torch.nn.Module]


# Prefixes a real snapshot holds, in manifest order; parts not yet implemented are
# reported as skipped by ``inspect --check-manifest``.
ALL_PREFIXES = ("llm.", "vpm.", "resampler.", "apm.", "audio_projection_layer.", "tts.")


def weight_parts() -> list[WeightPart]:
    parts: list[WeightPart] = []
    from .thinker.llm import build_llm
    parts.append(WeightPart("llm", "llm.", build_llm))
    from .thinker.resampler import build_resampler
    from .thinker.vision import build_vision
    parts.append(WeightPart("vpm", "vpm.", build_vision))
    parts.append(WeightPart("resampler", "resampler.", build_resampler))
    from .thinker.audio import build_audio_encoder, build_audio_projection
    parts.append(WeightPart("apm", "apm.", build_audio_encoder))
    parts.append(WeightPart("audio_projection_layer", "audio_projection_layer.", build_audio_projection))
    from .talker.model import build_tts
    parts.append(WeightPart("tts", "tts.", build_tts))
    return parts


def asset_parts() -> list[AssetPart]:
    parts: list[AssetPart] = []
    from .code2wav.flow import build_flow_part

    parts.append(AssetPart("flow", "flow.pt", build_flow_part))
    from .code2wav.vocoder import build_hift_original_part, build_hift_part

    parts.append(AssetPart("hift_original", "hift_original.pt", build_hift_original_part))
    parts.append(AssetPart("hift", "hift.pt", build_hift_part))
    return parts


def tiny_asset_writers() -> list[Callable[[Path, int], None]]:
    """Functions (asset_dir, seed) that write tiny assets (configs, .pt, ONNX)."""
    from .code2wav.flow import write_tiny_flow

    writers: list[Callable[[Path, int], None]] = [write_tiny_flow]
    from .code2wav.vocoder import write_tiny_hift

    writers.append(write_tiny_hift)
    from .code2wav.frontend import write_tiny_frontend

    writers.append(write_tiny_frontend)
    return writers
