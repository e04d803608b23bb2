"""Feature artifacts + 5 Hz targets -> per-session arrays, label masks and session splits.

Every artifact is read by ``features.artifact.iter_feature_root`` (the default loader), so an
unverified partial-tail artifact stops the run with the loader's own error. Targets come from
``--targets-root/<session>.npy`` when that flag is given (explicit wins), else from the rows
the extractor stored in the artifact (``--target`` at extraction time).

Head targets (``TARGET_NAMES``) and the rows each is scored on:

- ``wearer``, ``partner`` (now): rows that are ``valid_now`` and not initialisation rows;
- ``wearer_f0..3``, ``partner_f0..3`` (future bins): rows that are ``valid`` (2 s of future
  inside the session and outside gaps) and not initialisation rows;
- ``shift`` (1 shift / 0 hold): only the event rows (``event >= 0``), not initialisation rows.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import InputError
from . import labels as L

NOW_NAMES = ("wearer", "partner")
FUTURE_NAMES = tuple(f"{who}_f{k}" for who in ("wearer", "partner") for k in range(4))
TARGET_NAMES: tuple[str, ...] = NOW_NAMES + FUTURE_NAMES + ("shift",)
DEFAULT_SPLIT = "val=4,12;test=10,11"


class FeatureDimensionMismatch(InputError):
    """Artifacts under one feature root have different state widths."""


class MissingTargetsError(InputError):
    """An artifact has no stored targets and no matching file under --targets-root."""


class TargetAlignmentError(InputError):
    """Target rows do not line up with an artifact's 0.2 s grid."""


class MixedExtractionError(InputError):
    """One feature root holds artifacts of different extractor modes."""


class SplitError(InputError):
    """A session split is malformed or leaves a required part empty."""


@dataclass
class SessionData:
    name: str
    path: Path
    extractor_mode: str
    states: np.ndarray        # float32 [T, D]
    times: np.ndarray         # float64 [T]
    init_mask: np.ndarray     # bool [T]
    targets: np.ndarray       # labels.TARGET_DTYPE [T]
    y: np.ndarray             # float32 [T, C] in TARGET_NAMES order
    mask: np.ndarray          # bool [T, C]: the row counts for that target
    target_source: str

    @property
    def session_id(self) -> int | None:
        m = re.search(r"(?:^|_)(\d+)$", self.name)
        return int(m.group(1)) if m else None

    @property
    def dim(self) -> int:
        return int(self.states.shape[1])


def label_matrix(targets: np.ndarray, init_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y, mask) [T, C] for ``TARGET_NAMES``; masked entries of y are 0."""
    keep = ~init_mask
    cols, masks = [], []
    for name in NOW_NAMES:
        cols.append(targets[name])
        masks.append(targets["valid_now"] & keep)
    for name in FUTURE_NAMES:
        cols.append(targets[name])
        masks.append(targets["valid"] & keep)
    ev = targets["event"]
    cols.append(ev == 1)
    masks.append((ev >= 0) & keep)
    y = np.stack(cols, 1).astype(np.float32)
    mask = np.stack(masks, 1)
    return y * mask, mask


def _align(targets: np.ndarray, times: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Target rows for each artifact row; an artifact may run at most one row past the targets
    (the last bin's end rounding differently), and that row is masked. Returns (rows, present)."""
    idx = L.row_index(times)
    present = idx < targets.size
    if (~present).sum() > 1:
        raise TargetAlignmentError(
            f"{where}: the artifact has {times.size} rows up to {times[-1]:.1f} s but the targets end at "
            f"row {targets.size} ({targets.size * L.STEP:.1f} s); rebuild the targets for the same session "
            f"(make-targets) or extract with a matching --end")
    rows = targets[np.minimum(idx, targets.size - 1)].copy()
    if not np.allclose(rows["time"][present], times[present], atol=1e-4):
        raise TargetAlignmentError(f"{where}: target times do not match the artifact's 0.2 s grid")
    for c in ("valid_now", "valid"):
        rows[c] &= present
    rows["event"][~present] = -1
    return rows, present


def _load_one(path: Path, art, targets_root: Path | None) -> SessionData:
    times = art.times.double().numpy()
    init = art.initialization_mask.numpy().astype(bool)
    if targets_root is not None:
        tpath = targets_root / f"{art.session}.npy"
        if not tpath.is_file():
            raise MissingTargetsError(
                f"{path}: no targets for session {art.session!r}: {tpath} does not exist; run "
                f"`minicpmo-rt make-targets --session {art.session} --output {tpath}`")
        rows, _ = _align(L.load_targets(tpath), times, f"{path} vs {tpath}")
        source = str(tpath)
    elif art.targets is not None:
        rows = L.coerce_targets(art.targets, f"{path} (stored targets)")
        if rows.size != times.size:
            raise TargetAlignmentError(f"{path}: {rows.size} stored target rows for {times.size} states")
        if not np.allclose(rows["time"], times, atol=1e-4):
            raise TargetAlignmentError(f"{path}: the stored target rows' times do not match the artifact's "
                                       f"grid; re-extract with --target from make-targets --matrix")
        source = "artifact"
    else:
        raise MissingTargetsError(
            f"{path}: the artifact stores no targets (it was extracted without --target) and no "
            f"--targets-root was given; pass --targets-root DIR holding {art.session}.npy from make-targets")
    y, mask = label_matrix(rows, init)
    return SessionData(art.session, path, art.extractor_mode, art.states.float().numpy(), times, init,
                       rows, y, mask, source)


def load_sessions(feature_root: str | os.PathLike, targets_root: str | os.PathLike | None = None,
                  allow_unverified: bool = False) -> list[SessionData]:
    """Every artifact under ``feature_root`` with its targets, sorted by session."""
    from ..features.artifact import iter_feature_root

    troot = Path(targets_root) if targets_root is not None else None
    if troot is not None and not troot.is_dir():
        raise MissingTargetsError(f"{troot}: --targets-root is not a directory")
    sessions: list[SessionData] = []
    seen: dict[str, Path] = {}
    for path, art in iter_feature_root(feature_root, allow_unverified=allow_unverified):
        if art.session in seen:
            raise InputError(f"{path} and {seen[art.session]} are both {art.session}; point --feature-root "
                             f"at one extraction (e.g. the cached_partial_5hz directory)")
        seen[art.session] = path
        sessions.append(_load_one(path, art, troot))
    dims = {s.dim for s in sessions}
    if len(dims) > 1:
        listing = ", ".join(f"{s.path.name}: {s.dim}" for s in sessions)
        raise FeatureDimensionMismatch(
            f"{feature_root}: artifacts have different feature widths ({listing}); they come from "
            f"different models or layers -- keep one extraction per feature root")
    modes = {s.extractor_mode for s in sessions}
    if len(modes) > 1:
        listing = ", ".join(f"{s.path.name}: {s.extractor_mode}" for s in sessions)
        raise MixedExtractionError(
            f"{feature_root}: artifacts of different extractor modes ({listing}); native-1hz-hold and "
            f"cached-partial-5hz states mean different things -- keep one mode per feature root")
    return sorted(sessions, key=lambda s: (s.session_id is None, s.session_id or 0, s.name))


def _match(token: str, s: SessionData) -> bool:
    return s.name == token or (token.isdigit() and s.session_id == int(token))


def split_sessions(sessions: Sequence[SessionData], spec: str = DEFAULT_SPLIT) -> dict[str, list[SessionData]]:
    """``"val=4,12;test=10,11"`` (the rest trains; ``"named"``/``"default"`` is that split) or
    ``"kfold:K:F"`` (sessions sorted, session j in fold j % K; fold F tests, fold F+1 validates)."""
    spec = spec.strip()
    if spec in ("named", "default", ""):
        spec = DEFAULT_SPLIT
    names = [s.name for s in sessions]
    if spec.startswith("kfold:"):
        try:
            _, k, f = spec.split(":")
            k, f = int(k), int(f)
        except ValueError:
            raise SplitError(f"split {spec!r}: write kfold:K:F, e.g. kfold:4:0") from None
        if k < 3 or not 0 <= f < k or len(sessions) < k:
            raise SplitError(f"split {spec!r}: need K >= 3, 0 <= F < K and at least K sessions (have {len(sessions)})")
        fold = {s.name: j % k for j, s in enumerate(sessions)}
        parts = {"train": [s for s in sessions if fold[s.name] not in (f, (f + 1) % k)],
                 "val": [s for s in sessions if fold[s.name] == (f + 1) % k],
                 "test": [s for s in sessions if fold[s.name] == f]}
    else:
        chosen: dict[str, list[str]] = {}
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            key, _, vals = part.partition("=")
            if key.strip() not in ("val", "test") or not vals:
                raise SplitError(f"split {spec!r}: parts are val=...;test=... (session numbers or names)")
            chosen[key.strip()] = [v.strip() for v in vals.split(",") if v.strip()]
        parts = {"train": [], "val": [], "test": []}
        for key, tokens in chosen.items():
            for tok in tokens:
                hit = [s for s in sessions if _match(tok, s)]
                if not hit:
                    raise SplitError(f"split {spec!r}: {key} session {tok!r} is not under the feature root "
                                     f"(sessions: {', '.join(names)}); pass --split with sessions you have")
                parts[key].extend(hit)
        taken = {s.name for k in ("val", "test") for s in parts[k]}
        both = {s.name for s in parts["val"]} & {s.name for s in parts["test"]}
        if both:
            raise SplitError(f"split {spec!r}: {sorted(both)} are in both val and test")
        parts["train"] = [s for s in sessions if s.name not in taken]
    for key in ("train", "val"):
        if not parts[key]:
            raise SplitError(f"split {spec!r} leaves no {key} sessions (sessions: {', '.join(names)})")
    return parts
