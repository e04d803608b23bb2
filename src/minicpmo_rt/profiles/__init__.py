"""Deploy profiles: YAML files shipped in this package, a loader and the override rules.

Precedence, lowest first: the profile file, then ``--extra key=value`` overrides of the
connector ``extra`` mapping, then the environment (``MINICPMO_CODE2WAV_TF32=off`` wins over
any TF32 setting; see ``code2wav.knobs``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..errors import InputError

_DIR = Path(__file__).parent
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_EXTRA_KEYS = {"token2wav_allow_tf32", "code2wav_allow_tf32", "cfm_fused_body", "cfm_slot_pool",
               "cfm_row_offset_merge", "cfm_fp16_operands", "cfm_max_graphs", "cfm_graph_precapture", "enable_hift_graph",
               "hift_carry", "cfm_join_starts"}


def parse_size(value: Any, where: str) -> int:
    if isinstance(value, int) and value > 0:
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise InputError(f"{where}: {value!r} is not a size; write e.g. 2GiB, 512MiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(frozen=True)
class TalkerProfile:
    capacity: int
    kv_cache_bytes: int
    window: int = 25
    first_window: int = 25


@dataclass(frozen=True)
class Code2WavProfile:
    n_timesteps: int = 10
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeployProfile:
    name: str
    mode: str  # "turn" | "duplex"
    talker: TalkerProfile
    code2wav: Code2WavProfile
    source: str = ""


def available_profiles() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.yaml"))


def _check_keys(data: Mapping, allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise InputError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")


def load_profile(name_or_path: str | Path, extra_overrides: Mapping[str, Any] | None = None) -> DeployProfile:
    path = Path(name_or_path)
    if not path.is_file():
        path = _DIR / f"{str(name_or_path).removesuffix('.yaml')}.yaml"
    if not path.is_file():
        raise InputError(f"profile {name_or_path!r}: no such file and not a shipped profile "
                         f"({', '.join(available_profiles())})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML ({exc})") from None
    _check_keys(data, {"name", "mode", "talker", "code2wav"}, str(path))
    if data.get("mode") not in ("turn", "duplex"):
        raise InputError(f"{path}: mode must be 'turn' or 'duplex', found {data.get('mode')!r}")
    t = data.get("talker") or {}
    _check_keys(t, {"capacity", "kv_cache", "window", "first_window"}, f"{path} talker")
    if not isinstance(t.get("capacity"), int) or t["capacity"] < 1:
        raise InputError(f"{path}: talker.capacity must be a positive integer")
    talker = TalkerProfile(t["capacity"], parse_size(t.get("kv_cache"), f"{path} talker.kv_cache"),
                           int(t.get("window", 25)), int(t.get("first_window", t.get("window", 25))))
    c = data.get("code2wav") or {}
    _check_keys(c, {"n_timesteps", "extra"}, f"{path} code2wav")
    extra = dict(c.get("extra") or {})
    extra.update(extra_overrides or {})
    _check_keys(extra, _EXTRA_KEYS, f"{path} code2wav.extra")
    return DeployProfile(str(data.get("name", path.stem)), data["mode"], talker,
                         Code2WavProfile(int(c.get("n_timesteps", 10)), extra), str(path))


def parse_extra_overrides(items: list[str]) -> dict[str, Any]:
    """``key=value`` strings from the command line; values parsed as YAML scalars."""
    out = {}
    for item in items:
        if "=" not in item:
            raise InputError(f"--extra {item!r}: expected key=value")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out
