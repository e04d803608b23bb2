"""``assets/token2wav/config.yaml``: the causal vocoder's hyper-parameters in upstream form.

minicpmo-utils 1.0.7 reads this hyperpyyaml file (CosyVoice3 style) with two
nodes it uses: ``hift`` (``!new:cosyvoice.hifigan.generator.CausalHiFTGenerator``
with a ``CausalConvRNNF0Predictor``) and ``feat_extractor`` (``!name:...mel_spectrogram``
with the 24 kHz mel settings, which it checks). Other top-level nodes (a real file
may carry training sections) are ignored. We parse it with a plain YAML loader that
imports nothing, and write the same form so upstream's loader builds what we write.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import CheckpointError
from .flow_config import _Loader, _New, _resolve
from .hift import FULL_SIZE, HiFTConfig

HIFT_TAG = "cosyvoice.hifigan.generator.CausalHiFTGenerator"
F0_TAG = "cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor"
MEL_TAG = "matcha.utils.audio.mel_spectrogram"


@dataclass(frozen=True)
class MelConfig:
    """``feat_extractor`` arguments; upstream refuses any other values for this vocoder."""

    n_fft: int = 1920
    num_mels: int = 80
    sampling_rate: int = 24000
    hop_size: int = 480
    win_size: int = 1920
    fmin: int = 0
    fmax: int = 8000
    center: bool = False


STEP_AUDIO2_MEL = MelConfig()


@dataclass(frozen=True)
class VocoderYaml:
    hift: HiFTConfig
    mel: MelConfig


class _OpaqueLoader(_Loader):
    """Also accepts hyperpyyaml tags we do not interpret (``!tuple``, ``!module:``...) as opaque values."""


def _opaque(loader: yaml.Loader, suffix: str, node: yaml.Node) -> Any:
    return _New("other", suffix, None)


_OpaqueLoader.add_multi_constructor("!", _opaque)


def _tagged(node: Any, tag: str, path: str, where: str, kind: str = "new") -> dict:
    short = tag.rsplit(".", 1)[-1]
    if not isinstance(node, _New) or node.kind != kind or node.target.rsplit(".", 1)[-1] != short:
        found = f"!{node.kind}:{node.target}" if isinstance(node, _New) else type(node).__name__
        raise CheckpointError(f"{where}: '{path}' must be a '!{kind}:{tag}' node, found {found}")
    if node.args is not None and not isinstance(node.args, dict):
        raise CheckpointError(f"{where}: '{path}' must be a mapping")
    return dict(node.args or {})


def _hift_config(args: dict, where: str) -> HiFTConfig:
    f0 = _tagged(args.pop("f0_predictor", None), F0_TAG, "hift.f0_predictor", where)
    istft = args.pop("istft_params", {"n_fft": 16, "hop_len": 4})
    kw: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(HiFTConfig)} - {"n_fft", "hop_len", "f0_channels"}
    unknown = sorted(set(args) - names)
    if unknown:
        raise CheckpointError(f"{where}: 'hift' has unknown field(s) {unknown}")
    for name, value in args.items():
        kw[name] = tuple(tuple(v) if isinstance(v, list) else v for v in value) if isinstance(value, list) else value
    try:
        kw["n_fft"], kw["hop_len"] = int(istft["n_fft"]), int(istft["hop_len"])
    except (TypeError, KeyError):
        raise CheckpointError(f"{where}: 'hift.istft_params' must map n_fft and hop_len") from None
    if int(f0.get("num_class", 1)) != 1:
        raise CheckpointError(f"{where}: 'hift.f0_predictor.num_class' must be 1")
    in_channels = int(kw.get("in_channels", FULL_SIZE.in_channels))
    if int(f0.get("in_channels", 80)) != in_channels:
        raise CheckpointError(f"{where}: f0_predictor.in_channels {f0.get('in_channels')} != hift.in_channels {in_channels}")
    kw["f0_channels"] = int(f0.get("cond_channels", 512))
    # Upstream CausalHiFTGenerator's own defaults differ from the Step-Audio2 values
    # (22.05 kHz, rates [8, 8]); the file must state what it means, as the released one does.
    for required in ("sampling_rate", "upsample_rates", "upsample_kernel_sizes"):
        if required not in kw:
            raise CheckpointError(f"{where}: 'hift' lacks '{required}' (the upstream default is not the 24 kHz vocoder)")
    return HiFTConfig(**kw).validate(where)


def parse_vocoder_yaml(text: str, where: str = "config.yaml") -> VocoderYaml:
    try:
        doc = yaml.load(text, Loader=_OpaqueLoader)
    except yaml.YAMLError as exc:
        raise CheckpointError(f"{where}: not valid YAML ({exc})") from None
    if not isinstance(doc, dict) or "hift" not in doc or "feat_extractor" not in doc:
        raise CheckpointError(f"{where}: needs top-level 'hift' (!new:{HIFT_TAG}) and 'feat_extractor' "
                              f"(!name:{MEL_TAG}) nodes")
    hift = _hift_config(_tagged(_resolve(doc["hift"], doc, where), HIFT_TAG, "hift", where), where)
    mel_args = _tagged(_resolve(doc["feat_extractor"], doc, where), MEL_TAG, "feat_extractor", where, kind="name")
    mel = dataclasses.replace(STEP_AUDIO2_MEL, **{k: v for k, v in mel_args.items()
                                                 if k in {f.name for f in dataclasses.fields(MelConfig)}})
    if mel != STEP_AUDIO2_MEL:
        raise CheckpointError(f"{where}: feat_extractor must be the Step-Audio2 mel {dataclasses.asdict(STEP_AUDIO2_MEL)}, "
                              f"found {dataclasses.asdict(mel)}")
    return VocoderYaml(hift, mel)


def read_vocoder_yaml(path: str | Path) -> VocoderYaml:
    """Read ``config.yaml`` (upstream hyperpyyaml form) without importing upstream classes."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: config.yaml not found (it describes the causal vocoder in hift.pt)") from None
    return parse_vocoder_yaml(text, str(path))


def _flow(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    return repr(value) if isinstance(value, float) else str(value)


def vocoder_yaml_text(cfg: HiFTConfig, mel: MelConfig = STEP_AUDIO2_MEL) -> str:
    c = cfg
    lines = [
        "# Causal HiFT vocoder (CosyVoice3 CausalHiFTGenerator) and the mel it expects, in the",
        "# upstream hyperpyyaml form of assets/token2wav/config.yaml (written by minicpmo-rt).",
        f"sample_rate: {c.sampling_rate}",
        "",
        f"hift: !new:{HIFT_TAG}",
    ]
    fields = [("in_channels", c.in_channels), ("base_channels", c.base_channels), ("nb_harmonics", c.nb_harmonics),
              ("sampling_rate", "!ref <sample_rate>"), ("nsf_alpha", c.nsf_alpha), ("nsf_sigma", c.nsf_sigma),
              ("nsf_voiced_threshold", c.nsf_voiced_threshold), ("upsample_rates", c.upsample_rates),
              ("upsample_kernel_sizes", c.upsample_kernel_sizes)]
    lines += [f"    {k}: {v if isinstance(v, str) else _flow(v)}" for k, v in fields]
    lines += ["    istft_params:", f"        n_fft: {c.n_fft}", f"        hop_len: {c.hop_len}"]
    fields = [("resblock_kernel_sizes", c.resblock_kernel_sizes), ("resblock_dilation_sizes", c.resblock_dilation_sizes),
              ("source_resblock_kernel_sizes", c.source_resblock_kernel_sizes),
              ("source_resblock_dilation_sizes", c.source_resblock_dilation_sizes),
              ("lrelu_slope", c.lrelu_slope), ("audio_limit", c.audio_limit),
              ("conv_pre_look_right", c.conv_pre_look_right)]
    lines += [f"    {k}: {_flow(v)}" for k, v in fields]
    lines += [f"    f0_predictor: !new:{F0_TAG}", "        num_class: 1", f"        in_channels: {c.in_channels}",
              f"        cond_channels: {c.f0_channels}", "", f"feat_extractor: !name:{MEL_TAG}"]
    for f in dataclasses.fields(MelConfig):
        v = getattr(mel, f.name)
        lines.append(f"    {f.name}: {'!ref <sample_rate>' if f.name == 'sampling_rate' else _flow(v)}")
    return "\n".join(lines) + "\n"


def write_vocoder_yaml(cfg: HiFTConfig, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(vocoder_yaml_text(cfg))
    return path
