from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from minicpmo_rt.errors import InputError
from minicpmo_rt.features.artifact import (MODE_UNVERIFIED, FeatureArtifact, grid_times, held_alignment,
                                           iter_feature_root, load_artifact, save_artifact)


def make_artifact(t: int = 10, d: int = 8, mode: str = "causal-prefix", targets: bool = False,
                  session: str = "Session_1") -> FeatureArtifact:
    src, native, init = held_alignment(t)
    states = torch.randn(t, d)
    states[init] = 0
    return FeatureArtifact(
        mode=mode, extractor_mode="native-1hz-hold", states=states, times=grid_times(t),
        state_source_times=src, native_update_mask=native, initialization_mask=init,
        partial_tail_admissible=False, verification={"note": "test"}, provenance={"model_id": "x"},
        session=session, window={"name": "none"}, pruning=[],
        targets=torch.zeros(t, dtype=torch.long) if targets else None,
        target_info={"path": "t.npy"} if targets else None)


def test_grid_and_held_alignment_match_seed():
    src, native, init = held_alignment(7)
    assert grid_times(7).tolist() == [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4]
    assert src.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert native.tolist() == [False, False, False, False, True, False, False]
    assert init.tolist() == [True, True, True, True, False, False, False]


def test_roundtrip_and_seed_snippet_keys(tmp_path):
    art = make_artifact(targets=True)
    p = save_artifact(tmp_path / "a.pt", art)
    payload = torch.load(p, map_location="cpu", weights_only=False)
    assert payload["mode"] == "causal-prefix" and tuple(payload["states"].shape) == (10, 8)
    assert payload["times"][:6].tolist() == [0.2, 0.4, 0.6, 0.8, 1.0, 1.2]
    back = load_artifact(p)
    assert torch.equal(back.states, art.states) and back.targets is not None and back.dim == 8
    assert not [q for q in tmp_path.iterdir() if q.name.endswith(".tmp")]


def test_unverified_rejected_by_default_with_flag_name(tmp_path):
    p = save_artifact(tmp_path / "u.pt", make_artifact(mode=MODE_UNVERIFIED))
    with pytest.raises(InputError, match="--allow-unverified-partial-tail"):
        load_artifact(p)
    assert load_artifact(p, allow_unverified=True).mode == MODE_UNVERIFIED


def test_other_mode_rejected(tmp_path):
    payload = make_artifact().to_payload()
    payload["mode"] = "something-else"
    p = tmp_path / "x.pt"
    torch.save(payload, p)
    with pytest.raises(InputError, match="allow-unverified-partial-tail"):
        load_artifact(p)


@pytest.mark.parametrize("mutate, msg", [
    (lambda p: p.pop("states"), "missing keys"),
    (lambda p: p.__setitem__("times", torch.arange(10, dtype=torch.float64)), "0.2 s grid"),
    (lambda p: p.__setitem__("initialization_mask", torch.zeros(9, dtype=torch.bool)), "shape"),
    (lambda p: p.__setitem__("state_source_times", grid_times(10) + 0.2), "future"),
    (lambda p: p.__setitem__("extractor_mode", "bogus"), "extractor_mode"),
    (lambda p: p.__setitem__("targets", torch.zeros(3)), "targets"),
    (lambda p: p["states"].__setitem__((0, 0), float("nan")), "NaN"),
])
def test_schema_faults_are_named_and_never_written(tmp_path, mutate, msg):
    good = save_artifact(tmp_path / "s.pt", make_artifact())
    before = good.read_bytes()
    payload = make_artifact().to_payload()
    mutate(payload)
    with pytest.raises(InputError, match=msg):
        save_artifact(good, payload)
    assert good.read_bytes() == before
    assert sorted(q.name for q in tmp_path.iterdir()) == ["s.pt"]


def test_failed_write_keeps_good_file(tmp_path, monkeypatch):
    good = save_artifact(tmp_path / "s.pt", make_artifact())
    before = good.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full (simulated)")
    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        save_artifact(good, make_artifact())
    assert good.read_bytes() == before
    assert sorted(q.name for q in tmp_path.iterdir()) == ["s.pt"]


def test_iter_feature_root(tmp_path):
    (tmp_path / "sub").mkdir()
    save_artifact(tmp_path / "b.pt", make_artifact(session="Session_2"))
    save_artifact(tmp_path / "sub" / "a.pt", make_artifact(session="Session_1"))
    (tmp_path / ".c.pt.123.tmp").write_bytes(b"partial")
    got = [(p.name, a.session) for p, a in iter_feature_root(tmp_path)]
    assert got == [("b.pt", "Session_2"), ("a.pt", "Session_1")]
    save_artifact(tmp_path / "u.pt", make_artifact(mode=MODE_UNVERIFIED))
    with pytest.raises(InputError, match="allow-unverified"):
        list(iter_feature_root(tmp_path))
    with pytest.raises(InputError, match="no \\*.pt"):
        list(iter_feature_root(_empty(tmp_path)))
    with pytest.raises(InputError, match="not a directory"):
        list(iter_feature_root(tmp_path / "nope"))


def _empty(tmp_path: Path) -> Path:
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_truncated_file_named(tmp_path):
    p = save_artifact(tmp_path / "s.pt", make_artifact())
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="cannot be read"):
        load_artifact(p)
    assert os.path.exists(p)
