"""flow.yaml: our reader/writer against the upstream hyperpyyaml form and upstream's own loader."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minicpmo_rt.code2wav.flow_config import (FULL_SIZE, TINY, flow_yaml_text, parse_flow_yaml,
                                              read_flow_yaml, write_flow_yaml)
from minicpmo_rt.errors import CheckpointError

from upstream import import_upstream, upstream_function



def test_roundtrip_full_and_tiny(tmp_path):
    for cfg in (FULL_SIZE, TINY):
        path = write_flow_yaml(cfg, tmp_path / "flow.yaml")
        assert read_flow_yaml(path) == cfg


def test_reads_refs_defaults_and_package_prefixed_tags():
    text = """
hidden: 512
flow: !new:stepaudio2.cosyvoice2.flow.flow.CausalMaskedDiffWithXvec
    input_size: !ref <hidden>
    vocab_size: 6561
    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2
        input_size: !ref <hidden>
        output_size: !ref <hidden>
    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM
        estimator: !new:cosyvoice2.flow.decoder_dit.DiT
            in_channels: 320
            out_channels: 80
"""
    cfg = parse_flow_yaml(text)
    assert cfg.input_size == cfg.encoder.output_size == 512
    # Omitted fields take the upstream constructors' defaults, not the released sizes.
    assert cfg.encoder.attention_heads == 4 and cfg.encoder.attention_dropout_rate == 0.0
    assert cfg.dit.depth == 28 and cfg.dit.hidden_size == 256 and cfg.decoder.inference_cfg_rate == 0.7


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("    vocab_size: 6561\n", "    vocab_size: 6561\n    bogus: 1\n"), "unknown field(s) ['bogus']"),
    (lambda t: t.replace("!new:cosyvoice2.flow.decoder_dit.DiT", "!new:cosyvoice2.flow.decoder.ConditionalDecoder"),
     "flow.decoder.estimator' must be a '!new:cosyvoice2.flow.decoder_dit.DiT'"),
    (lambda t: t.replace("in_channels: 320", "in_channels: 240"), "estimator.in_channels 240"),
    (lambda t: t.replace("flow:", "flo:"), "no top-level 'flow'"),
])
def test_rejects_bad_yaml_naming_the_problem(edit, message):
    with pytest.raises(CheckpointError) as exc:
        parse_flow_yaml(edit(flow_yaml_text(FULL_SIZE)), "X/flow.yaml")
    assert message in str(exc.value) and "X/flow.yaml" in str(exc.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="flow.yaml not found"):
        read_flow_yaml(tmp_path / "flow.yaml")


def test_upstream_loader_builds_what_we_write(tmp_path):
    """upstream's Token2wav._load_config (hyperpyyaml) builds our YAML into its classes."""
    pytest.importorskip("hyperpyyaml")
    import yaml
    from hyperpyyaml import load_hyperpyyaml

    from minicpmo_rt.code2wav.flow import Flow

    ns = {"Path": __import__("pathlib").Path, "yaml": yaml, "load_hyperpyyaml": load_hyperpyyaml}
    ns["CausalMaskedDiffWithXvec"] = import_upstream("stepaudio2.cosyvoice2.flow.flow").CausalMaskedDiffWithXvec
    ns["CausalConditionalCFM"] = import_upstream("stepaudio2.cosyvoice2.flow.flow_matching").CausalConditionalCFM
    ns["DiT"] = import_upstream("stepaudio2.cosyvoice2.flow.decoder_dit").DiT
    ns["UpsampleConformerEncoderV2"] = import_upstream(
        "stepaudio2.cosyvoice2.transformer.upsample_encoder_v2").UpsampleConformerEncoderV2
    for absent in ("CausalHiFTGenerator", "CausalConvRNNF0Predictor", "mel_spectrogram"):
        ns[absent] = type(absent, (), {})  # vocoder targets: never matched by a flow.yaml tag
    load_config = upstream_function("token2wav.py", "_load_config", ns)
    for cfg in (TINY, dataclasses.replace(TINY, vocab_size=100)):
        path = write_flow_yaml(cfg, tmp_path / "flow.yaml")
        with torch.device("meta"):  # upstream allocates ~2 GB of cache buffers at construction
            theirs = load_config(path)["flow"]
        assert type(theirs).__name__ == "CausalMaskedDiffWithXvec"
        ours = {k: tuple(v.shape) for k, v in Flow(cfg).state_dict().items()}
        assert ours == {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
