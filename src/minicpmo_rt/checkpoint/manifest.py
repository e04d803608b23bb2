"""Compare module keys/shapes with the reference manifests in ``shared/minicpmo45``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from ..errors import InputError
from .weights import KeyReport, compare_keys


def load_manifest(path: str | Path) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: manifest file not found") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None


def manifest_kind(manifest: dict) -> str:
    """'state_dict' (model.safetensors keys) or 'token2wav' (per-file asset keys)."""
    if "keys" in manifest:
        return "state_dict"
    if "files" in manifest:
        return "token2wav"
    raise InputError("manifest has neither 'keys' (state_dict manifest) nor 'files' (token2wav manifest)")


def shapes_of(entries: Mapping[str, dict]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v["shape"]) for k, v in entries.items()}


def compare_prefix(expected_all: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]],
                   prefix: str) -> KeyReport:
    """Compare only the manifest keys under ``prefix`` with ``found`` (already prefixed)."""
    expected = {k: v for k, v in expected_all.items() if k.startswith(prefix)}
    return compare_keys(expected, found)
