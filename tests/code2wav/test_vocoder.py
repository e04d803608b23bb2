"""Vocoder loading: variant detection, legacy keys, strict errors, config.yaml round trip."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from minicpmo_rt.code2wav.hift import TINY
from minicpmo_rt.code2wav.vocoder import (CAUSAL, ORIGINAL, STREAM_FILE, WHOLE_FILE, load_vocoder, load_vocoders,
                                          write_tiny_hift)
from minicpmo_rt.code2wav.vocoder_config import parse_vocoder_yaml, read_vocoder_yaml
from minicpmo_rt.errors import CheckpointError, InputError, StrictLoadError


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("t2w")
    write_tiny_hift(d, seed=0)
    return d


def test_tiny_assets_load_and_vocode(assets):
    voc = load_vocoders(assets)
    assert voc.stream.variant == CAUSAL and voc.whole.variant == ORIGINAL
    mel = torch.randn(2, 80, 12) - 5
    for v in (voc.stream, voc.whole):
        wav = v.vocode(mel, generator=torch.Generator().manual_seed(0))
        assert wav.shape == (2, 12 * 480) and wav.dtype == torch.float32 and torch.isfinite(wav).all()
    # the interface both streams satisfy: new samples only, total = frames x 480
    for v in (voc.stream, voc.whole):
        st = v.open_stream(lead_silence=False)
        n = sum(st.push(mel[:1, :, i:i + 5], last=i + 5 >= 12).shape[1] for i in range(0, 12, 5))
        assert n == 12 * 480
    with pytest.raises(InputError, match="mel"):
        voc.whole.vocode(torch.zeros(1, 81, 4))


def test_hift_pt_alone_is_used_for_both(assets, tmp_path):
    shutil.copy(assets / WHOLE_FILE, tmp_path / STREAM_FILE)  # a 0.1.1 / vLLM-Omni asset set
    voc = load_vocoders(tmp_path)
    assert voc.stream.variant == voc.whole.variant == ORIGINAL and voc.stream is voc.whole


def test_legacy_keys_and_generator_prefix(assets, tmp_path):
    state = torch.load(assets / WHOLE_FILE, weights_only=True)
    legacy = {}
    for k, v in state.items():
        k = k.replace("parametrizations.weight.original0", "weight_g").replace("parametrizations.weight.original1",
                                                                               "weight_v")
        legacy["generator." + k] = v
    torch.save(legacy, tmp_path / "old.pt")
    a = load_vocoder(tmp_path / "old.pt")
    b = load_vocoder(assets / WHOLE_FILE)
    for (ka, va), (kb, vb) in zip(sorted(a.model.state_dict().items()), sorted(b.model.state_dict().items())):
        assert ka == kb and torch.equal(va, vb)


def test_errors_name_the_file(assets, tmp_path):
    with pytest.raises(CheckpointError, match=r"hift\.pt: not found"):
        load_vocoders(tmp_path)
    state = torch.load(assets / WHOLE_FILE, weights_only=True)
    del state["conv_post.bias"]
    state["extra.weight"] = torch.zeros(1)
    state["resblocks.0.convs1.0.bias"] = torch.zeros(3)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(StrictLoadError) as info:
        load_vocoder(tmp_path / "bad.pt")
    msg = str(info.value)
    assert "bad.pt" in msg and "missing:    conv_post.bias" in msg and "unexpected: extra.weight" in msg
    assert "mismatched: resblocks.0.convs1.0.bias" in msg
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pt: cannot be read"):
        load_vocoder(tmp_path / "junk.pt")


def test_config_yaml_parse_and_refusals(assets):
    cfg = read_vocoder_yaml(assets / "config.yaml")
    assert cfg.hift == TINY and cfg.mel.n_fft == 1920 and cfg.mel.fmax == 8000 and cfg.mel.center is False
    text = (assets / "config.yaml").read_text()
    # extra top-level sections (as a real training config has) are ignored
    extra = text + "\nhifigan: !new:cosyvoice.hifigan.hifigan.HiFiGan\n    generator: !ref <hift>\n" \
                   "llm: !new:some.Class\n    x: !tuple (1, 2)\n"
    assert parse_vocoder_yaml(extra).hift == TINY
    with pytest.raises(CheckpointError, match="feat_extractor must be the Step-Audio2 mel"):
        parse_vocoder_yaml(text.replace("fmax: 8000", "fmax: 12000"))
    with pytest.raises(CheckpointError, match="hop 600"):
        parse_vocoder_yaml(text.replace("upsample_rates: [8, 5, 3]", "upsample_rates: [8, 5, 3.75]").replace(
            "hop_len: 4", "hop_len: 5").replace("[8, 5, 3.75]", "[8, 5, 3]"))


def test_config_yaml_builds_upstream_and_hift_pt_loads_strict(assets):
    """Upstream's hyperpyyaml builds the CausalHiFTGenerator our config.yaml describes, and our hift.pt loads strictly."""
    hyperpyyaml = pytest.importorskip("hyperpyyaml")
    from upstream import import_upstream

    import_upstream("stepaudio2.causal_vocoder.generator")
    import_upstream("stepaudio2.causal_vocoder.f0_predictor")
    import_upstream("stepaudio2.flashcosyvoice.utils.audio")
    text = (assets / "config.yaml").read_text()
    text = (text.replace("cosyvoice.hifigan.generator.", "stepaudio2.causal_vocoder.generator.")
            .replace("cosyvoice.hifigan.f0_predictor.", "stepaudio2.causal_vocoder.f0_predictor.")
            .replace("matcha.utils.audio.", "stepaudio2.flashcosyvoice.utils.audio."))
    conf = hyperpyyaml.load_hyperpyyaml(text, overrides={"hifigan": None}, overrides_must_match=False)
    model = conf["hift"]
    assert type(model).__name__ == "CausalHiFTGenerator"
    assert model.f0_predictor.condnet[0].causal_padding + model.conv_pre_look_right + 1 == 8
    model.load_state_dict(torch.load(assets / STREAM_FILE, weights_only=True), strict=True)
    assert conf["feat_extractor"].keywords["n_fft"] == 1920


def test_fused_weight_norm_matches(assets):
    mel = torch.randn(1, 80, 24) - 5
    for name in (STREAM_FILE, WHOLE_FILE):
        plain = load_vocoder(assets / name, fuse=False)
        fused = load_vocoder(assets / name, fuse=True)
        assert not any("parametrizations" in k for k in fused.model.state_dict())
        g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
        assert torch.allclose(fused.vocode(mel, generator=g()), plain.vocode(mel, generator=g()), rtol=0, atol=1e-5)
        a, b = fused.open_stream(generator=g()), plain.open_stream(generator=g())
        wa = torch.cat([a.push(mel[:, :, :16]), a.push(mel[:, :, 16:], last=True)], dim=1)
        wb = torch.cat([b.push(mel[:, :, :16]), b.push(mel[:, :, 16:], last=True)], dim=1)
        assert wa.shape == wb.shape and torch.allclose(wa, wb, rtol=0, atol=1e-5)


def test_make_tiny_writes_the_1_0_7_asset_set(tiny_ckpt):
    """make-tiny's assets/token2wav holds all 7 files minicpmo-utils 1.0.7 requires, and they load."""
    from minicpmo_rt.code2wav.frontend import VoiceFrontend

    d = tiny_ckpt / "assets" / "token2wav"
    for name in ("speech_tokenizer_v2_25hz.onnx", "campplus.onnx", "flow.yaml", "flow.pt", "config.yaml",
                 STREAM_FILE, WHOLE_FILE):
        assert (d / name).is_file(), name
    voc = load_vocoders(d)
    assert (voc.stream.variant, voc.whole.variant) == (CAUSAL, ORIGINAL)
    assert read_vocoder_yaml(d / "config.yaml").hift == voc.stream.model.cfg == TINY
    VoiceFrontend(d)


def test_stream_snapshot_restore_replays(assets):
    mel = torch.randn(1, 80, 40) - 5
    for v in load_vocoders(assets).stream, load_vocoder(assets / WHOLE_FILE):
        st = v.open_stream(generator=torch.Generator().manual_seed(1))
        st.push(mel[:, :, :16])
        snap = st.snapshot()
        first = [st.push(mel[:, :, 16:30]), st.push(mel[:, :, 30:], last=True)]
        st.restore(snap)
        again = [st.push(mel[:, :, 16:30]), st.push(mel[:, :, 30:], last=True)]
        for a, b in zip(first, again):
            assert a.shape == b.shape and torch.equal(a, b)


def test_detect_variant_on_the_real_manifests(shared_dir):
    """The released layouts (token2wav_manifest.json) are told apart by their shapes alone."""
    import json

    from minicpmo_rt.code2wav.vocoder import config_from_state, detect_variant

    files = json.loads((shared_dir / "token2wav_manifest.json").read_text())["files"]
    for name, variant in (("hift.pt", CAUSAL), ("hift_original.pt", ORIGINAL)):
        state = {k: torch.empty(v["shape"], device="meta") for k, v in files[name]["keys"].items()}
        assert detect_variant(state, name) == variant
        cfg = config_from_state(state, variant)
        assert (cfg.base_channels, cfg.f0_channels, cfg.hop) == (512, 512, 480)
        assert cfg.conv_pre_look_right == 4
    bad = {k: torch.empty(v["shape"], device="meta") for k, v in files["hift.pt"]["keys"].items()}
    bad["f0_predictor.condnet.0.parametrizations.weight.original1"] = torch.empty(512, 80, 3, device="meta")
    with pytest.raises(CheckpointError, match="match neither HiFT variant"):
        detect_variant(bad, "mixed.pt")
