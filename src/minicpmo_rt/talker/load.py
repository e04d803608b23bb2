"""Load the Talker (``tts.*``) from a snapshot directory with strict key matching."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.config import load_config
from ..checkpoint.weights import load_strict, load_tensors
from .model import LEGACY_ALIASES, MiniCPMTTS, rebuild_rotary_

PREFIX = "tts."


def load_talker(snapshot, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> MiniCPMTTS:
    """Build on the meta device, allocate on ``device`` and strictly load every ``tts.`` key.

    ``snapshot``: a directory or a ``checkpoint.snapshot.Snapshot``. Legacy weight-norm keys
    (``weight_g``/``weight_v``) load through ``LEGACY_ALIASES``. The rotary frequencies are
    non-persistent (not in the checkpoint), so they are recomputed in fp32 after the cast.
    """
    directory = Path(getattr(snapshot, "path", snapshot))
    config = load_config(directory)
    with torch.device("meta"):
        model = MiniCPMTTS(config.tts)
    model.to_empty(device=device)
    state = load_tensors(directory, (PREFIX,))
    load_strict(model, state, where=f"{directory} ({PREFIX}*)", prefix=PREFIX, aliases=LEGACY_ALIASES)
    del state
    model.to(dtype=dtype)
    rebuild_rotary_(model)
    return model.eval()
