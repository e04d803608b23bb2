"""The feature artifact: one ``.pt`` file per session (DESIGN.md, "Feature artifact contract").

The payload is a plain dict so that ``torch.load(path, weights_only=False)`` (the seed's
inspection snippet) reads it without this package. Keys:

- ``format`` / ``format_version``: ``"minicpmo-rt-features"`` / 1.
- ``mode``: ``"causal-prefix"`` (every mandatory audit passed, or native mode, which has no
  partial tail) or ``"minicpmo-unverified-partial-tail"`` (saved only with
  ``--allow-unverified-partial-tail``; the default loader rejects it).
- ``extractor_mode``: ``"native-1hz-hold"`` | ``"cached-partial-5hz"``.
- ``states`` float32 [T, D]; ``times`` float64 [T] = 0.2, 0.4, ... (row k ends at 0.2*(k+1) s).
- ``state_source_times`` float64 [T]: the session time of the input prefix the row's state has
  seen (native: the newest completed second, 0.0 for the zero-initialised rows; partial: the
  row time itself).
- ``native_update_mask`` bool [T]: the row holds a freshly committed native chunk's state.
- ``initialization_mask`` bool [T]: the row is the all-zero initialisation (native 0.2-0.8 s);
  heads must mask these rows.
- ``partial_tail_admissible`` bool: True only for a cached-partial artifact whose audits all
  passed. Native artifacts contain no partial tail and carry False (nothing to admit).
- ``verification``: dict, one entry per audit with ``passed`` and the figures it measured.
- ``provenance``: dict (model id/path, revision, dtype, attention, device, decoder, session
  dir, end, target path/shape, package version, command line, ...).
- ``session``: the session name (``Session_4``), used by heads to split by session.
- ``window``: the streaming-window policy dict; ``pruning``: list of dicts, one per destructive
  pruning event, with the 5 Hz ``row`` at which it happened.
- ``targets`` (tensor [T, ...] or None) and ``target_info`` (dict or None): the ``--target``
  rows aligned to ``times`` and how they were aligned.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from ..atomic import atomic_write
from ..errors import InputError

FORMAT = "minicpmo-rt-features"
FORMAT_VERSION = 1
MODE_VERIFIED = "causal-prefix"
MODE_UNVERIFIED = "minicpmo-unverified-partial-tail"
MODES = (MODE_VERIFIED, MODE_UNVERIFIED)
EXTRACTOR_MODES = ("native-1hz-hold", "cached-partial-5hz")
GRID_STEP = 0.2
GRID_HZ = 5
UNVERIFIED_FLAG = "--allow-unverified-partial-tail"

REQUIRED_KEYS = ("format", "format_version", "mode", "extractor_mode", "states", "times",
                 "state_source_times", "native_update_mask", "initialization_mask",
                 "partial_tail_admissible", "verification", "provenance", "session", "window",
                 "pruning", "targets", "target_info")


def grid_times(n_rows: int) -> torch.Tensor:
    """Row end times 0.2, 0.4, ... as float64, rounded so ``tolist()`` prints 0.6 not 0.6000000000000001."""
    return torch.tensor([round(GRID_STEP * (k + 1), 9) for k in range(n_rows)], dtype=torch.float64)


@dataclass
class FeatureArtifact:
    """Typed view of one artifact; ``to_payload`` gives the dict that is saved."""

    mode: str
    extractor_mode: str
    states: torch.Tensor
    times: torch.Tensor
    state_source_times: torch.Tensor
    native_update_mask: torch.Tensor
    initialization_mask: torch.Tensor
    partial_tail_admissible: bool
    verification: dict[str, Any]
    provenance: dict[str, Any]
    session: str
    window: dict[str, Any] = field(default_factory=dict)
    pruning: list[dict[str, Any]] = field(default_factory=list)
    targets: torch.Tensor | None = None
    target_info: dict[str, Any] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.states.shape[0])

    @property
    def dim(self) -> int:
        return int(self.states.shape[1])

    def to_payload(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "mode": self.mode, "extractor_mode": self.extractor_mode,
            "states": self.states, "times": self.times,
            "state_source_times": self.state_source_times,
            "native_update_mask": self.native_update_mask,
            "initialization_mask": self.initialization_mask,
            "partial_tail_admissible": bool(self.partial_tail_admissible),
            "verification": self.verification, "provenance": self.provenance,
            "session": self.session, "window": self.window, "pruning": self.pruning,
            "targets": self.targets, "target_info": self.target_info,
        }

    @classmethod
    def from_payload(cls, payload: dict[str, Any], where: str = "<payload>") -> "FeatureArtifact":
        validate_payload(payload, where)
        return cls(**{k: payload[k] for k in REQUIRED_KEYS if k not in ("format", "format_version")})


def _bad(where: str, what: str) -> InputError:
    return InputError(f"{where}: not a valid feature artifact: {what}; re-extract it with "
                      f"`minicpmo-rt features` (or streaming_minicpmo_features_directly.py)")


def validate_payload(payload: Any, where: str = "<payload>") -> None:
    """Check every key, dtype and shape of the contract; raise InputError naming the first fault."""
    if not isinstance(payload, dict):
        raise _bad(where, f"top level is {type(payload).__name__}, expected dict")
    missing = [k for k in REQUIRED_KEYS if k not in payload]
    if missing:
        raise _bad(where, f"missing keys {missing}")
    if payload["format"] != FORMAT:
        raise _bad(where, f"format is {payload['format']!r}, expected {FORMAT!r}")
    if payload["format_version"] != FORMAT_VERSION:
        raise _bad(where, f"format_version {payload['format_version']!r}; this reader knows {FORMAT_VERSION}")
    if payload["mode"] not in MODES:
        raise _bad(where, f"mode {payload['mode']!r} is not one of {MODES}")
    if payload["extractor_mode"] not in EXTRACTOR_MODES:
        raise _bad(where, f"extractor_mode {payload['extractor_mode']!r} is not one of {EXTRACTOR_MODES}")
    states = payload["states"]
    if not isinstance(states, torch.Tensor) or states.ndim != 2 or not states.is_floating_point():
        raise _bad(where, "states must be a floating tensor [T, D]")
    t = int(states.shape[0])
    if t == 0 or states.shape[1] == 0:
        raise _bad(where, f"states has shape {tuple(states.shape)}; an artifact needs >= 1 row and >= 1 feature")
    if not bool(torch.isfinite(states).all()):
        raise _bad(where, "states hold NaN or Inf values")
    for key, want_bool in (("times", False), ("state_source_times", False),
                           ("native_update_mask", True), ("initialization_mask", True)):
        v = payload[key]
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != (t,):
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise _bad(where, f"{key} must be a tensor of shape ({t},), got {shape}")
        if want_bool != (v.dtype == torch.bool):
            raise _bad(where, f"{key} has dtype {v.dtype}, expected {'bool' if want_bool else 'float'}")
    times = payload["times"].double()
    if not torch.allclose(times, grid_times(t), rtol=0, atol=1e-6):
        raise _bad(where, f"times must be the 0.2 s grid starting at 0.2 s, got {times[:4].tolist()}...")
    src = payload["state_source_times"].double()
    if bool((src > times + 1e-6).any()):
        k = int(torch.nonzero(src > times + 1e-6)[0])
        raise _bad(where, f"row {k} (t={times[k]:.1f}s) has a state from the future (source {src[k]:.3f}s)")
    if bool((payload["initialization_mask"] & payload["native_update_mask"]).any()):
        raise _bad(where, "a row is both an initialisation row and a native update")
    if not isinstance(payload["partial_tail_admissible"], bool):
        raise _bad(where, "partial_tail_admissible must be a bool")
    if payload["mode"] == MODE_UNVERIFIED and payload["partial_tail_admissible"]:
        raise _bad(where, "an unverified artifact cannot be partial_tail_admissible")
    for key in ("verification", "provenance", "window"):
        if not isinstance(payload[key], dict):
            raise _bad(where, f"{key} must be a dict")
    if not isinstance(payload["session"], str) or not payload["session"]:
        raise _bad(where, "session must be a non-empty string")
    if not isinstance(payload["pruning"], list):
        raise _bad(where, "pruning must be a list")
    targets = payload["targets"]
    if targets is not None:
        if not isinstance(targets, torch.Tensor) or targets.ndim < 1 or targets.shape[0] != t:
            shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
            raise _bad(where, f"targets must be a tensor with {t} rows, got {shape}")
        if not isinstance(payload["target_info"], dict):
            raise _bad(where, "targets are present but target_info is not a dict")


def save_artifact(path: str | os.PathLike, payload: dict[str, Any] | FeatureArtifact) -> Path:
    """Validate, then write atomically: a temp file in the same directory, fsync, os.replace.

    Any failure (invalid payload, full disk, interrupted pickling) removes the temp file and
    leaves an existing artifact at ``path`` untouched.
    """
    if isinstance(payload, FeatureArtifact):
        payload = payload.to_payload()
    path = Path(path)
    validate_payload(payload, str(path))
    if not path.parent.is_dir():
        raise InputError(f"{path}: output directory {path.parent} does not exist; create it first")
    return atomic_write(path, lambda fh: torch.save(payload, fh))


def load_artifact(path: str | os.PathLike, allow_unverified: bool = False) -> FeatureArtifact:
    """The default head loader: validates the schema and rejects unverified artifacts."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: feature artifact not found")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated or foreign file
        raise InputError(f"{path}: cannot be read as a feature artifact ({type(exc).__name__}: {exc}); "
                         f"re-extract it") from exc
    if isinstance(payload, dict) and payload.get("mode") == MODE_UNVERIFIED and not allow_unverified:
        raise InputError(
            f"{path}: mode is {MODE_UNVERIFIED!r}: it was saved with {UNVERIFIED_FLAG} after a failed or "
            f"too-short audit and is not a causal-prefix artifact. The default loader rejects it; "
            f"re-extract without {UNVERIFIED_FLAG} (diagnose the failed audit in its 'verification'), "
            f"or pass allow_unverified=True for diagnostics only")
    if isinstance(payload, dict) and payload.get("mode") not in MODES:
        raise InputError(f"{path}: mode {payload.get('mode')!r} is not {MODE_VERIFIED!r}; only causal-prefix "
                         f"artifacts load (unverified ones need {UNVERIFIED_FLAG} at extraction and "
                         f"allow_unverified=True here)")
    return FeatureArtifact.from_payload(payload, str(path))


def iter_feature_root(root: str | os.PathLike, allow_unverified: bool = False,
                      pattern: str = "*.pt") -> Iterator[tuple[Path, FeatureArtifact]]:
    """Every artifact under ``root`` (recursive, sorted by path) through the default loader.

    Temp files of interrupted writes (``.name.*.tmp``) never match ``*.pt``.
    """
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{root}: feature root is not a directory")
    paths = sorted(p for p in root.rglob(pattern) if p.is_file() and not p.name.startswith("."))
    if not paths:
        raise InputError(f"{root}: no {pattern} feature artifacts under it; run `minicpmo-rt features` first")
    for p in paths:
        yield p, load_artifact(p, allow_unverified=allow_unverified)


def held_alignment(n_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source times, native-update and initialisation masks of native-1hz-hold on the 5 Hz grid.

    Row k ends at 0.2*(k+1) s; it holds the newest second completed by then (floor of the row
    time), and rows before 1.0 s hold the zero initialisation (source 0.0).
    """
    times = grid_times(n_rows)
    src = torch.tensor([float(math.floor(x + 1e-9)) for x in times.tolist()], dtype=torch.float64)
    native = torch.tensor([(k + 1) % GRID_HZ == 0 for k in range(n_rows)], dtype=torch.bool)
    init = src == 0.0
    return src, native, init
