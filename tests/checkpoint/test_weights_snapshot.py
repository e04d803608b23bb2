import json
import os

import pytest
import torch
from safetensors.torch import save_file

from minicpmo_rt.checkpoint.snapshot import resolve_snapshot
from minicpmo_rt.checkpoint.tiny import reference_config
from minicpmo_rt.checkpoint.weights import (compare_keys, load_strict, load_tensors, read_shapes,
                                            save_sharded)
from minicpmo_rt.errors import CheckpointError, StrictLoadError


def _write_snapshot(d, tensors, sharded=True):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(reference_config()))
    if sharded:
        save_sharded(tensors, d, max_shard_bytes=64)
    else:
        save_file(tensors, str(d / "model.safetensors"))
    return d


def test_sharded_and_single_load_the_same(tmp_path):
    t = {f"a.{i}.weight": torch.randn(4, 3) for i in range(5)}
    a = _write_snapshot(tmp_path / "a", t, sharded=True)
    b = _write_snapshot(tmp_path / "b", t, sharded=False)
    assert len(list(a.glob("model-*.safetensors"))) > 1
    la, lb = load_tensors(a), load_tensors(b)
    assert la.keys() == lb.keys() == t.keys()
    for k in t:
        assert torch.equal(la[k], t[k]) and torch.equal(lb[k], t[k])
    assert read_shapes(a)["a.0.weight"] == ((4, 3), "F32")
    assert set(load_tensors(a, prefixes=["a.1."])) == {"a.1.weight"}


def test_strict_check_lists_every_difference():
    expected = {"x.w": (2, 2), "x.b": (2,), "y.w": (3,), "z": (1,)}
    found = {"x.w": (2, 3), "x.b": (2,), "extra.1": (1,), "extra.2": (1,)}
    rep = compare_keys(expected, found)
    assert rep.missing == ["y.w", "z"]
    assert rep.unexpected == ["extra.1", "extra.2"]
    assert rep.mismatched == [("x.w", (2, 2), (2, 3))]
    with pytest.raises(StrictLoadError) as err:
        rep.raise_if_bad("ckpt")
    msg = str(err.value)
    for name in ("y.w", "z", "extra.1", "extra.2", "x.w"):
        assert name in msg


def test_load_strict_into_module():
    m = torch.nn.Linear(3, 2)
    state = {"p.weight": torch.randn(2, 3), "p.bias": torch.randn(2)}
    load_strict(m, state, "test", prefix="p.")
    assert torch.equal(m.weight, state["p.weight"])
    with pytest.raises(StrictLoadError, match="bias"):
        load_strict(torch.nn.Linear(3, 2), {"p.weight": torch.randn(2, 3)}, "test", prefix="p.")


def test_missing_shard_is_named(tmp_path):
    d = _write_snapshot(tmp_path / "s", {"a": torch.zeros(100), "b": torch.zeros(100)})
    victim = sorted(d.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_tensors(d)


def test_revision_sources(tmp_path, monkeypatch):
    t = {"a": torch.ones(2)}
    plain = _write_snapshot(tmp_path / "plain", t)
    s = resolve_snapshot(plain)
    assert s.revision_source == "content-hash" and s.revision.startswith("sha256:")
    assert resolve_snapshot(plain).revision == s.revision  # deterministic
    assert resolve_snapshot(plain, revision="abc").revision_source == "explicit"

    commit = "1f761131fa83f5ed3cd6f2f22b225c4501d154fa"
    repo = tmp_path / "hub" / "models--openbmb--MiniCPM-o-4_5"
    _write_snapshot(repo / "snapshots" / commit, t)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for arg in (repo, repo / "snapshots" / commit):
        got = resolve_snapshot(arg)
        assert got.revision == commit and got.revision_source == "hf-cache"
        assert got.model_id == "openbmb/MiniCPM-o-4_5"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_snapshot("openbmb/MiniCPM-o-4_5").path == repo / "snapshots" / commit
    with pytest.raises(CheckpointError, match="never downloads"):
        resolve_snapshot("openbmb/Other-Model")


def test_not_a_snapshot(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        resolve_snapshot(tmp_path)
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_snapshot(tmp_path / "nope" / "x" / "y")
