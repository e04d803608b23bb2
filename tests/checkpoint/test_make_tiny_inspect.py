import json

import pytest
import torch
from typer.testing import CliRunner

from minicpmo_rt.checkpoint.weights import load_tensors
from minicpmo_rt.cli import app
from minicpmo_rt.errors import InputError
from minicpmo_rt.snapshot_tools import make_tiny

runner = CliRunner()


def test_tiny_layout(tiny_ckpt):
    names = {p.name for p in tiny_ckpt.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "vocab.json", "merges.txt", "added_tokens.json",
            "tokenizer_config.json", "README.md"} <= names
    assert len(list(tiny_ckpt.glob("model-*-of-*.safetensors"))) >= 2  # sharded like the real snapshot
    assets = {p.name for p in (tiny_ckpt / "assets" / "token2wav").iterdir()}
    assert assets == {"flow.yaml", "flow.pt", "hift.pt", "hift_original.pt", "config.yaml",
                      "speech_tokenizer_v2_25hz.onnx", "campplus.onnx"}
    assert (tiny_ckpt / "assets" / "HT_ref_audio.wav").is_file()
    assert "RANDOM" in (tiny_ckpt / "README.md").read_text()


def test_make_tiny_refuses_nonempty_and_is_deterministic(tiny_ckpt, tmp_path):
    with pytest.raises(InputError, match="already exists"):
        make_tiny(tiny_ckpt)
    res = runner.invoke(app, ["make-tiny", str(tiny_ckpt)])
    assert res.exit_code == 2 and "already exists" in res.output
    again = make_tiny(tmp_path / "again", seed=0)
    a = load_tensors(tiny_ckpt, prefixes=["tts.emb_code", "llm.model.layers.0.mlp"])
    b = load_tensors(again, prefixes=["tts.emb_code", "llm.model.layers.0.mlp"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(torch.load(tiny_ckpt / "assets/token2wav/flow.pt")["encoder_proj.weight"],
                       torch.load(again / "assets/token2wav/flow.pt")["encoder_proj.weight"])


def test_inspect_json(tiny_ckpt):
    res = runner.invoke(app, ["inspect", "--model", str(tiny_ckpt), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert set(info["parts"]) == {"llm.", "vpm.", "resampler.", "apm.", "audio_projection_layer.", "tts."}
    assert info["revision_source"] == "content-hash" and info["version"] == "4.5"
    assert info["parts"]["tts."]["dtypes"] == ["BF16"]
    assert "original" in info["code2wav_choice"]["cpu"]  # auto: not CUDA -> original body
    assert info["code2wav_graphs"] == {"max_graphs": 32, "precapture": True}   # the knobs' defaults
    assert "transformers' Llama modules" in info["talker_choice"]["cpu"]      # auto: not CUDA -> torch
    text = runner.invoke(app, ["inspect", "--model", str(tiny_ckpt)])
    assert text.exit_code == 0 and "at most 32 Whole-Euler graphs" in text.output, text.output
    assert "talker on cpu: decode step on transformers' Llama modules" in text.output
    from minicpmo_rt.snapshot_tools import inspect_snapshot
    duplex = inspect_snapshot(str(tiny_ckpt), extra={"cfm_max_graphs": 128, "cfm_graph_precapture": False})
    assert duplex["code2wav_graphs"] == {"max_graphs": 128, "precapture": False}


@pytest.mark.parametrize("manifest", ["state_dict_manifest.json", "token2wav_manifest.json"])
def test_manifest_check_passes_for_every_part(shared_dir, manifest):
    res = runner.invoke(app, ["inspect", "--config", str(shared_dir / "config.json"), "--meta",
                              "--check-manifest", str(shared_dir / manifest)])
    assert res.exit_code == 0, res.output
    assert "missing 0  unexpected 0  mismatched 0" in res.output
    assert "skipped" not in res.output


def test_manifest_check_fails_on_a_wrong_manifest(shared_dir, tmp_path):
    m = json.loads((shared_dir / "state_dict_manifest.json").read_text())
    m["keys"]["llm.lm_head.weight"]["shape"] = [1, 1]
    m["keys"]["tts.extra.weight"] = {"shape": [3], "dtype": "BF16"}
    del m["keys"]["apm.conv1.bias"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(m))
    res = runner.invoke(app, ["inspect", "--config", str(shared_dir / "config.json"), "--meta",
                              "--check-manifest", str(bad)])
    assert res.exit_code == 1
    # expected-from-manifest vs built: the module has a key the manifest lacks -> "unexpected"
    assert "missing 1  unexpected 1  mismatched 1" in res.output
    for name in ("llm.lm_head.weight", "tts.extra.weight", "apm.conv1.bias"):
        assert name in res.output
