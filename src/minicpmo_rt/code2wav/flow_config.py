"""The flow's hyper-parameters and its ``flow.yaml`` in upstream (hyperpyyaml) form.

A real snapshot's ``assets/token2wav/flow.yaml`` is a hyperpyyaml document whose
only top-level key ``flow`` is built with ``!new:`` tags naming the upstream
classes (``cosyvoice2.flow.flow.CausalMaskedDiffWithXvec`` etc.). We read it with
a plain PyYAML loader that turns each tagged mapping into its fields (no class is
imported) and write the same form, so upstream's own loader builds what we write.

Dataclass defaults are the upstream constructors' defaults (what a YAML that
omits a field gets); ``FULL_SIZE`` is the released MiniCPM-o 4.5 flow and
``TINY`` the test-size one (mel 80, vocab 6561, speaker 192 kept).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from ..errors import CheckpointError

# Tag (class) names of each level, as upstream spells them; a tag matches when its
# last dotted component equals the class name (any package prefix is accepted).
FLOW_TAG = "cosyvoice2.flow.flow.CausalMaskedDiffWithXvec"
ENCODER_TAG = "cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2"
CFM_TAG = "cosyvoice2.flow.flow_matching.CausalConditionalCFM"
DIT_TAG = "cosyvoice2.flow.decoder_dit.DiT"


@dataclass(frozen=True)
class EncoderConfig:
    """``UpsampleConformerEncoderV2`` arguments."""

    input_size: int
    output_size: int = 256
    input_layer: str = "linear"
    pre_lookahead_len: int = 3
    num_blocks: int = 6
    num_up_blocks: int = 4
    up_stride: int = 2
    up_scale_factor: float = 2
    attention_heads: int = 4
    pos_enc_layer_type: str = "rel_pos_espnet"
    selfattention_layer_type: str = "rel_selfattn"
    key_bias: bool = True
    linear_units: int = 2048
    dropout_rate: float = 0.1
    positional_dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    normalize_before: bool = True
    activation_type: str = "swish"


@dataclass(frozen=True)
class DiTConfig:
    """``DiT`` (the CFM estimator) arguments."""

    in_channels: int
    out_channels: int
    mlp_ratio: float = 4.0
    depth: int = 28
    num_heads: int = 8
    head_dim: int = 64
    hidden_size: int = 256


@dataclass(frozen=True)
class CFMConfig:
    """``CausalConditionalCFM`` arguments."""

    estimator: DiTConfig
    inference_cfg_rate: float = 0.7


@dataclass(frozen=True)
class FlowConfig:
    """``CausalMaskedDiffWithXvec`` arguments (the whole ``flow:`` node)."""

    encoder: EncoderConfig
    decoder: CFMConfig
    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    output_type: str = "mel"
    vocab_size: int = 5121

    @property
    def dit(self) -> DiTConfig:
        return self.decoder.estimator

    def validate(self, where: str) -> "FlowConfig":
        """Refuse settings this implementation cannot honour (naming the field)."""
        e, d = self.encoder, self.dit
        problems = []
        if self.output_type != "mel":
            problems.append(f"flow.output_type={self.output_type!r} (only 'mel')")
        if not (e.input_size == e.output_size == self.input_size):
            problems.append(f"flow.input_size {self.input_size}, encoder.input_size {e.input_size} and "
                            f"encoder.output_size {e.output_size} must be equal (up_embed re-embeds the encoder output)")
        for name, value, allowed in (("input_layer", e.input_layer, "linear"),
                                     ("pos_enc_layer_type", e.pos_enc_layer_type, "rel_pos_espnet"),
                                     ("selfattention_layer_type", e.selfattention_layer_type, "rel_selfattn"),
                                     ("activation_type", e.activation_type, "swish")):
            if value != allowed:
                problems.append(f"encoder.{name}={value!r} (only {allowed!r})")
        if not e.normalize_before:
            problems.append("encoder.normalize_before=false (only pre-norm)")
        if e.up_stride != 2:
            problems.append(f"encoder.up_stride {e.up_stride} (only 2: the packed conformer cache stores "
                            "token-rate layers twice)")
        if float(e.up_scale_factor) != float(e.up_stride):
            problems.append(f"encoder.up_scale_factor {e.up_scale_factor} must equal up_stride {e.up_stride}")
        if e.output_size % e.attention_heads:
            problems.append(f"encoder.output_size {e.output_size} not divisible by attention_heads {e.attention_heads}")
        if e.pre_lookahead_len < 1:
            problems.append(f"encoder.pre_lookahead_len {e.pre_lookahead_len} must be >= 1")
        if d.in_channels != 4 * self.output_size:
            problems.append(f"estimator.in_channels {d.in_channels} must be 4 x flow.output_size "
                            f"({4 * self.output_size}: x, mu, speaker, cond)")
        if d.out_channels != self.output_size:
            problems.append(f"estimator.out_channels {d.out_channels} must equal flow.output_size {self.output_size}")
        if problems:
            raise CheckpointError(f"{where}: unsupported flow configuration: " + "; ".join(problems))
        return self


FULL_SIZE = FlowConfig(
    input_size=512, output_size=80, spk_embed_dim=192, output_type="mel", vocab_size=6561,
    encoder=EncoderConfig(
        input_size=512, output_size=512, input_layer="linear", pre_lookahead_len=3, num_blocks=6,
        num_up_blocks=4, up_stride=2, up_scale_factor=2, attention_heads=8,
        pos_enc_layer_type="rel_pos_espnet", selfattention_layer_type="rel_selfattn", key_bias=True,
        linear_units=2048, dropout_rate=0.1, positional_dropout_rate=0.1, attention_dropout_rate=0.1,
        normalize_before=True),
    decoder=CFMConfig(inference_cfg_rate=0.7, estimator=DiTConfig(
        in_channels=320, out_channels=80, mlp_ratio=4.0, depth=16, num_heads=8, head_dim=64, hidden_size=512)),
)

TINY = FlowConfig(
    input_size=64, output_size=80, spk_embed_dim=192, output_type="mel", vocab_size=6561,
    encoder=dataclasses.replace(FULL_SIZE.encoder, input_size=64, output_size=64, num_blocks=2,
                                num_up_blocks=2, attention_heads=2, linear_units=128),
    decoder=CFMConfig(inference_cfg_rate=0.7, estimator=DiTConfig(
        in_channels=320, out_channels=80, mlp_ratio=4.0, depth=2, num_heads=2, head_dim=32, hidden_size=64)),
)

# Fields written to flow.yaml, in order. ``activation_type`` is left out: the released
# file does not set it and vLLM-Omni's validator rejects unknown encoder fields.
_WRITTEN = {
    FlowConfig: ("input_size", "output_size", "spk_embed_dim", "output_type", "vocab_size"),
    EncoderConfig: tuple(f.name for f in fields(EncoderConfig) if f.name != "activation_type"),
    CFMConfig: ("inference_cfg_rate",),
    DiTConfig: tuple(f.name for f in fields(DiTConfig)),
}


# ----------------------------------------------------------------------------- reading
# _Loader, _New and _resolve are also used by vocoder_config (config.yaml has the same form).

@dataclass
class _New:
    """A ``!new:`` / ``!name:`` / ``!apply:`` node: the tag's target and its mapping."""

    kind: str
    target: str
    args: Any


@dataclass
class _Ref:
    expr: str


class _Loader(yaml.SafeLoader):
    pass


def _construct_tagged(kind: str):
    def construct(loader: _Loader, suffix: str, node: yaml.Node) -> _New:
        if isinstance(node, yaml.MappingNode):
            args: Any = loader.construct_mapping(node, deep=True)
        elif isinstance(node, yaml.SequenceNode):
            args = loader.construct_sequence(node, deep=True)
        else:
            args = loader.construct_scalar(node) or None
        return _New(kind, suffix, args)
    return construct


for _kind in ("new", "name", "apply"):
    _Loader.add_multi_constructor(f"!{_kind}:", _construct_tagged(_kind))
_Loader.add_constructor("!ref", lambda loader, node: _Ref(loader.construct_scalar(node)))

_REF_RE = re.compile(r"^<([^<>]+)>$")


def _resolve(value: Any, root: dict, where: str, depth: int = 0) -> Any:
    """Replace ``!ref <key>`` / ``!ref <key[sub]>`` nodes by the referenced values."""
    if depth > 32:
        raise CheckpointError(f"{where}: !ref references nest too deeply (a cycle?)")
    if isinstance(value, _Ref):
        m = _REF_RE.match(value.expr.strip())
        if not m:
            raise CheckpointError(f"{where}: unsupported !ref expression {value.expr!r} (only '<key>' or '<a[b]>')")
        node: Any = root
        for part in re.split(r"[\[\]]+", m.group(1)):
            if not part:
                continue
            if not isinstance(node, dict) or part not in node:
                raise CheckpointError(f"{where}: !ref {value.expr} names a key that does not exist")
            node = node[part]
        return _resolve(node, root, where, depth + 1)
    if isinstance(value, dict):
        return {k: _resolve(v, root, where, depth) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, root, where, depth) for v in value]
    if isinstance(value, _New):
        return _New(value.kind, value.target, _resolve(value.args, root, where, depth))
    return value


_NESTED: dict[type, dict[str, tuple[type, str]]] = {
    FlowConfig: {"encoder": (EncoderConfig, ENCODER_TAG), "decoder": (CFMConfig, CFM_TAG)},
    CFMConfig: {"estimator": (DiTConfig, DIT_TAG)},
}


def _build(cls: type, node: Any, tag: str, path: str, where: str) -> Any:
    cls_name = tag.rsplit(".", 1)[-1]
    if not isinstance(node, _New) or node.kind != "new" or node.target.rsplit(".", 1)[-1] != cls_name:
        found = f"!{node.kind}:{node.target}" if isinstance(node, _New) else type(node).__name__
        raise CheckpointError(f"{where}: '{path}' must be a '!new:{tag}' mapping, found {found}")
    args = dict(node.args or {})
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise CheckpointError(f"{where}: '{path}' ({cls_name}) has unknown field(s) {unknown}")
    kwargs = {}
    for name, f in known.items():
        if name in _NESTED.get(cls, {}):
            if name not in args:
                raise CheckpointError(f"{where}: '{path}' lacks its '{name}' node")
            sub_cls, sub_tag = _NESTED[cls][name]
            kwargs[name] = _build(sub_cls, args[name], sub_tag, f"{path}.{name}", where)
        elif name in args:
            kwargs[name] = args[name]
        elif f.default is dataclasses.MISSING:
            raise CheckpointError(f"{where}: '{path}' lacks the required field '{name}'")
    return cls(**kwargs)


def parse_flow_yaml(text: str, where: str = "flow.yaml") -> FlowConfig:
    """Parse upstream flow.yaml text (see ``read_flow_yaml``)."""
    try:
        doc = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise CheckpointError(f"{where}: not valid YAML ({exc})") from None
    if not isinstance(doc, dict) or "flow" not in doc:
        raise CheckpointError(f"{where}: has no top-level 'flow' node (expected '!new:{FLOW_TAG}')")
    flow = _resolve(doc["flow"], doc, where)
    return _build(FlowConfig, flow, FLOW_TAG, "flow", where).validate(where)


def read_flow_yaml(path: str | Path) -> FlowConfig:
    """Read ``flow.yaml`` in upstream hyperpyyaml form without importing upstream classes."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: flow.yaml not found; point --model at a snapshot whose "
                              "assets/token2wav/ holds flow.yaml and flow.pt") from None
    return parse_flow_yaml(text, str(path))


# ----------------------------------------------------------------------------- writing

def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _emit(obj: Any, tag: str, indent: int, lines: list[str], key: str) -> None:
    pad = "    " * indent
    lines.append(f"{pad}{key}: !new:{tag}")
    for name in _WRITTEN[type(obj)]:
        value = getattr(obj, name)
        if name == "up_scale_factor" and float(value).is_integer():
            value = int(value)  # vLLM-Omni's validator parses this field with int()
        lines.append(f"{pad}    {name}: {_scalar(value)}")
    for name, (_, sub_tag) in _NESTED.get(type(obj), {}).items():
        _emit(getattr(obj, name), sub_tag, indent + 1, lines, name)


def flow_yaml_text(cfg: FlowConfig) -> str:
    lines = ["# Flow (token -> mel) of Code2Wav, in the upstream hyperpyyaml form of",
             "# assets/token2wav/flow.yaml (written by minicpmo-rt).", ""]
    _emit(cfg, FLOW_TAG, 0, lines, "flow")
    return "\n".join(lines) + "\n"


def write_flow_yaml(cfg: FlowConfig, path: str | Path) -> Path:
    """Write ``cfg`` as upstream's flow.yaml (``stepaudio2.token2wav._load_config`` builds it)."""
    path = Path(path)
    path.write_text(flow_yaml_text(cfg))
    return path
