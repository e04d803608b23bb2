"""make-tiny, inspect and the manifest check, built on the part registry."""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint.config import MiniCPMOConfig, load_config
from .checkpoint.manifest import compare_prefix, load_manifest, manifest_kind, shapes_of
from .checkpoint.snapshot import resolve_snapshot
from .checkpoint.tiny import (TINY_NOTE, TINY_SHARD_BYTES, atomic_directory, randomize_, tiny_config,
                              write_tokenizer_files)
from .checkpoint.weights import KeyReport, compare_keys, module_shapes, read_shapes, save_sharded
from .parts import ALL_PREFIXES, asset_parts, tiny_asset_writers, weight_parts

DEFAULT_VOICE = Path(__file__).parent / "code2wav" / "data" / "ref_minicpm_signature.wav"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def make_tiny(out: Path, seed: int = 0, force: bool = False) -> Path:
    """Write the tiny checkpoint to ``out`` atomically."""
    cfg_dict = tiny_config()
    config = MiniCPMOConfig.from_dict(cfg_dict, where="tiny config")
    dtype = _DTYPES[config.torch_dtype]

    def build(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
        write_tokenizer_files(tmp)
        (tmp / "README.md").write_text(TINY_NOTE)
        tensors: dict[str, torch.Tensor] = {}
        for part in weight_parts():
            module = part.build(config)
            randomize_(module, seed, prefix=part.prefix)
            for k, v in module.state_dict().items():
                tensors[part.prefix + k] = v.detach().to(dtype).contiguous()
        if tensors:
            save_sharded(tensors, tmp, TINY_SHARD_BYTES, metadata={"minicpmo_rt_tiny_seed": str(seed)})
        asset_dir = tmp / "assets" / "token2wav"
        writers = tiny_asset_writers()
        if writers:
            asset_dir.mkdir(parents=True)
        for write in writers:
            write(asset_dir, seed)
        # A real snapshot keeps its default voice at assets/HT_ref_audio.wav.
        shutil.copyfile(DEFAULT_VOICE, tmp / "assets" / "HT_ref_audio.wav")

    return atomic_directory(Path(out), build, force=force)


@dataclass
class ManifestCheck:
    reports: "OrderedDict[str, KeyReport]" = field(default_factory=OrderedDict)
    skipped: list[str] = field(default_factory=list)

    @property
    def total(self) -> KeyReport:
        out = KeyReport()
        for r in self.reports.values():
            out = out.merge(r)
        return out

    @property
    def ok(self) -> bool:
        return bool(self.reports) and self.total.ok


def check_manifest(config_path: Path, manifest_path: Path) -> ManifestCheck:
    """Build the implemented parts on the meta device and compare with a manifest."""
    manifest = load_manifest(manifest_path)
    kind = manifest_kind(manifest)
    result = ManifestCheck()
    if kind == "state_dict":
        config = load_config(config_path)
        expected = shapes_of(manifest["keys"])
        parts = {p.prefix: p for p in weight_parts()}
        for prefix in ALL_PREFIXES:
            part = parts.get(prefix)
            if part is None:
                result.skipped.append(prefix)
                continue
            with torch.device("meta"):
                module = part.build(config)
            result.reports[part.name] = compare_prefix(expected, module_shapes(module, prefix), prefix)
    else:
        files = manifest["files"]
        parts = {p.file: p for p in asset_parts()}
        for fname, entry in files.items():
            part = parts.get(fname)
            if part is None:
                result.skipped.append(fname)
                continue
            with torch.device("meta"):
                module = part.build(None)
            result.reports[fname] = compare_keys(shapes_of(entry["keys"]), module_shapes(module))
    return result


def inspect_snapshot(model: str, revision: str | None = None, extra: dict | None = None) -> dict:
    """Parts present, parameter counts per top-level prefix, dtypes and revision."""
    snap = resolve_snapshot(model, revision)
    config = load_config(snap.path)
    shapes = read_shapes(snap.path)
    per_prefix: "OrderedDict[str, dict]" = OrderedDict()
    for name, (shape, dtype) in sorted(shapes.items()):
        top = name.split(".", 1)[0] + "."
        entry = per_prefix.setdefault(top, {"keys": 0, "parameters": 0, "dtypes": set()})
        n = 1
        for d in shape:
            n *= d
        entry["keys"] += 1
        entry["parameters"] += n
        entry["dtypes"].add(dtype)
    for entry in per_prefix.values():
        entry["dtypes"] = sorted(entry["dtypes"])
    asset_dir = snap.path / "assets" / "token2wav"
    assets = sorted(p.name for p in asset_dir.iterdir()) if asset_dir.is_dir() else []
    has_flow = (asset_dir / "flow.yaml").is_file()
    choices = code2wav_choices(asset_dir, extra) if has_flow else {}
    graphs = {}
    if has_flow:    # the CFM solver's Whole-Euler graphs on CUDA (cfm_max_graphs / cfm_graph_precapture)
        from .code2wav.knobs import graph_budget, graph_precapture
        graphs = {"max_graphs": graph_budget(extra), "precapture": graph_precapture(extra)}
    return {
        "path": str(snap.path),
        "model_id": snap.model_id,
        "revision": snap.revision,
        "revision_source": snap.revision_source,
        "version": config.version,
        "torch_dtype": config.torch_dtype,
        "parts": {k: v for k, v in per_prefix.items()},
        "total_parameters": sum(v["parameters"] for v in per_prefix.values()),
        "token2wav_assets": assets,
        "code2wav_choice": choices,
        "code2wav_graphs": graphs,
        "talker_choice": talker_choices(),
    }


def talker_choices() -> dict[str, str]:
    """What the Talker's decode step runs by default (``kernels="auto"``), per device kind available here."""
    from .talker.engine import describe_kernels, resolve_kernels

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return {d: describe_kernels(resolve_kernels("auto", d)) for d in devices}


def code2wav_choices(asset_dir: Path, extra: dict | None = None) -> dict[str, str]:
    """The Code2Wav CFM body / attention / TF32 the knobs pick for this snapshot's DiT, per
    device kind available here (CPU always; CUDA when present)."""
    from .code2wav.flow import Flow
    from .code2wav.flow_config import read_flow_yaml
    from .code2wav.fused_dit import supports_fused_body
    from .code2wav.knobs import device_facts, resolve_code2wav

    with torch.device("meta"):
        flow = Flow(read_flow_yaml(asset_dir / "flow.yaml"))
    ok, _ = supports_fused_body(flow.decoder.estimator)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return {d: resolve_code2wav(extra, device_facts(d, layout_supported=ok)).describe() for d in devices}
