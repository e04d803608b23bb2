"""Safetensors loading (single file or sharded) and the strict key check."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors import safe_open

from ..atomic import plain_mode
from ..errors import CheckpointError, StrictLoadError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from the index or the single file."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        files = {name: directory / shard for name, shard in mapping.items()}
        absent = sorted({str(p) for p in files.values() if not p.is_file()})
        if absent:
            raise CheckpointError(f"{index}: names shard file(s) that are missing: {', '.join(absent)}")
        return files
    single = directory / SINGLE_NAME
    if single.is_file():
        with safe_open(str(single), framework="pt") as fh:
            return {name: single for name in fh.keys()}
    raise CheckpointError(f"{directory}: neither {INDEX_NAME} nor {SINGLE_NAME} is present")


def read_shapes(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype string) without reading tensor data."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in weight_map(directory).items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as fh:
            for name in names:
                sl = fh.get_slice(name)
                out[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def load_tensors(directory: Path, prefixes: Iterable[str] | None = None,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Load every tensor (or those under ``prefixes``) into memory."""
    prefixes = tuple(prefixes) if prefixes is not None else None
    by_file: dict[Path, list[str]] = {}
    for name, path in weight_map(directory).items():
        if prefixes is None or name.startswith(prefixes):
            by_file.setdefault(path, []).append(name)
    out = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device=str(device)) as fh:
            for name in names:
                out[name] = fh.get_tensor(name)
    return out


@dataclass
class KeyReport:
    """Every difference between expected and found keys (not just the first)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    matched: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def merge(self, other: "KeyReport") -> "KeyReport":
        return KeyReport(self.missing + other.missing, self.unexpected + other.unexpected,
                         self.mismatched + other.mismatched, self.matched + other.matched)

    def summary(self) -> str:
        return (f"{self.matched} matched, {len(self.missing)} missing, {len(self.unexpected)} unexpected, "
                f"{len(self.mismatched)} shape-mismatched")

    def details(self) -> str:
        lines = [self.summary()]
        lines += [f"  missing:    {k}" for k in self.missing]
        lines += [f"  unexpected: {k}" for k in self.unexpected]
        lines += [f"  mismatched: {k} expected {list(e)} found {list(f)}" for k, e, f in self.mismatched]
        return "\n".join(lines)

    def raise_if_bad(self, where: str) -> None:
        if not self.ok:
            raise StrictLoadError(f"{where}: weights do not match the model strictly: {self.details()}")


def compare_keys(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]]) -> KeyReport:
    rep = KeyReport()
    for name in sorted(expected):
        if name not in found:
            rep.missing.append(name)
        elif tuple(found[name]) != tuple(expected[name]):
            rep.mismatched.append((name, tuple(expected[name]), tuple(found[name])))
        else:
            rep.matched += 1
    rep.unexpected = sorted(set(found) - set(expected))
    return rep


def module_shapes(module: torch.nn.Module, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Persistent state_dict keys and shapes of a module (works on the meta device)."""
    return {prefix + k: tuple(v.shape) for k, v in module.state_dict().items()}


def load_strict(module: torch.nn.Module, state: Mapping[str, torch.Tensor], where: str,
                prefix: str = "", aliases: Mapping[str, str] | None = None) -> None:
    """Load ``state`` (keys under ``prefix``) into ``module`` after a full strict check.

    ``aliases`` maps legacy key names to the module's names (e.g. weight-norm
    ``weight_g``/``weight_v`` -> ``parametrizations.weight.original0/1``).
    """
    sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if aliases:
        sub = {aliases.get(k, k): v for k, v in sub.items()}
    compare_keys(module_shapes(module), {k: tuple(v.shape) for k, v in sub.items()}).raise_if_bad(where)
    module.load_state_dict(sub, strict=True, assign=any(p.is_meta for p in module.parameters()))


def save_sharded(tensors: Mapping[str, torch.Tensor], directory: Path, max_shard_bytes: int,
                 metadata: dict[str, str] | None = None) -> list[Path]:
    """Write ``tensors`` as HF-style shards plus ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    n = len(shards)
    paths, mapping, total = [], {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt", **(metadata or {})})
        os.chmod(directory / fname, plain_mode())      # safetensors leaves 0o600
        paths.append(directory / fname)
        for name, t in shard.items():
            mapping[name] = fname
            total += t.numel() * t.element_size()
    (directory / INDEX_NAME).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": mapping}, indent=2, sort_keys=True))
    return paths
