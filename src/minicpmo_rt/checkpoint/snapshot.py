"""Find a snapshot on disk and give it an immutable revision. Never touches the network.

Accepted forms of ``model``:
- a snapshot directory (holds ``config.json``);
- a Hugging Face cache repo directory ``.../models--openbmb--MiniCPM-o-4_5`` (``refs/main``
  names the snapshot under ``snapshots/``) or one of its ``snapshots/<rev>`` directories;
- a hub id ``org/name``, looked up only in the local Hugging Face cache.

The revision recorded is the explicit ``--revision``, else the cache's snapshot hash,
else a content hash of the index and weight files (``sha256:`` prefix).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

_HEX40 = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Snapshot:
    path: Path
    revision: str
    revision_source: str  # "explicit" | "hf-cache" | "content-hash"
    model_id: str

    def file(self, name: str) -> Path:
        return self.path / name


def hf_cache_root() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


def _resolve_repo_dir(repo: Path, revision: str | None) -> tuple[Path, str]:
    snaps = repo / "snapshots"
    if revision and (snaps / revision).is_dir():
        return snaps / revision, revision
    ref = repo / "refs" / (revision or "main")
    if ref.is_file():
        commit = ref.read_text().strip()
        if (snaps / commit).is_dir():
            return snaps / commit, commit
        raise CheckpointError(f"{ref}: names snapshot {commit}, which is not under {snaps}")
    if revision:
        matches = sorted(p for p in snaps.glob(f"{revision}*") if p.is_dir()) if snaps.is_dir() else []
        if len(matches) == 1:
            return matches[0], matches[0].name
        raise CheckpointError(f"{repo}: revision {revision!r} is not in the local cache (no refs/{revision}, "
                              f"no snapshots/{revision}); nothing is downloaded, fetch it first")
    found = sorted(p for p in snaps.iterdir() if p.is_dir()) if snaps.is_dir() else []
    if len(found) == 1:
        return found[0], found[0].name
    raise CheckpointError(f"{repo}: no refs/main and {len(found)} snapshots; pass --revision to choose one")


def content_hash(path: Path) -> str:
    """sha256 over the index and every weight file (name + size + bytes)."""
    h = hashlib.sha256()
    names = sorted(p for p in path.iterdir()
                   if p.is_file() and (p.suffix == ".safetensors" or p.name == "model.safetensors.index.json"))
    if not names:
        raise CheckpointError(f"{path}: no *.safetensors files to hash; is this a MiniCPM-o snapshot?")
    for p in names:
        h.update(p.name.encode())
        h.update(str(p.stat().st_size).encode())
        with p.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return "sha256:" + h.hexdigest()


def resolve_snapshot(model: str | os.PathLike, revision: str | None = None) -> Snapshot:
    text = str(model)
    path = Path(text).expanduser()
    model_id = text
    if not path.exists():
        if re.fullmatch(r"[\w.-]+/[\w.-]+", text):
            repo = hf_cache_root() / ("models--" + text.replace("/", "--"))
            if not repo.is_dir():
                raise CheckpointError(
                    f"{text}: not a directory and not in the local Hugging Face cache ({repo} does not exist); "
                    "minicpmo-rt never downloads: pass a local snapshot directory")
            path = repo
        else:
            raise CheckpointError(f"{text}: no such directory")
    path = path.resolve()
    cache_rev = None
    if path.name.startswith("models--") and (path / "snapshots").is_dir():
        model_id = path.name[len("models--"):].replace("--", "/")
        path, cache_rev = _resolve_repo_dir(path, revision)
    elif path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        model_id = path.parent.parent.name[len("models--"):].replace("--", "/")
        cache_rev = path.name
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; point at a MiniCPM-o 4.5 snapshot directory")
    if revision:
        return Snapshot(path, revision, "explicit", model_id)
    if cache_rev:
        return Snapshot(path, cache_rev, "hf-cache", model_id)
    return Snapshot(path, content_hash(path), "content-hash", model_id)
