"""Extractor alignment, audits and failure handling against the contract-honouring ToySession."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from minicpmo_rt.errors import InputError
from minicpmo_rt.features import extract as ex
from minicpmo_rt.features.artifact import load_artifact
from minicpmo_rt.features.easycom import EasyComSession, SAMPLE_RATE
from minicpmo_rt.features.synthetic import make_session

from features_toy_session import ToySession


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    return make_session(tmp_path_factory.mktemp("x"), 4, width=32, height=32, segment_seconds=2, seed=1)


def opts(syn, out, mode, **kw):
    o = ex.ExtractOptions(easycom_session_dir=syn, mode=mode, output=out, progress=False, **kw)
    return o


def test_native_alignment_and_audits(syn, tmp_path):
    out = tmp_path / "n.pt"
    art = ex.run(opts(syn, out, "native-1hz-hold"), factory=ToySession, model_info={"model_id": "toy"},
                 echo=lambda s: None)
    assert art.mode == "causal-prefix" and not art.partial_tail_admissible
    assert art.times[:6].tolist() == [0.2, 0.4, 0.6, 0.8, 1.0, 1.2]
    assert art.state_source_times[:10].tolist() == [0.0] * 4 + [1.0] * 5 + [2.0]
    assert art.initialization_mask.tolist() == [True] * 4 + [False] * 16
    assert torch.count_nonzero(art.states[:4]) == 0
    # held: rows 1.0-1.8 identical, 2.0 new
    assert all(torch.equal(art.states[4], art.states[k]) for k in range(5, 9))
    assert not torch.equal(art.states[8], art.states[9])
    v = art.verification
    assert v["all_passed"] and v["clean_replay"]["runs"] == 1 and v["future_intervention"]["runs"] == 1
    assert v["clean_replay"]["checks"][0]["t"] == 2.0
    assert load_artifact(out).extractor_mode == "native-1hz-hold"


def test_partial_alignment_and_every_row_audits(syn, tmp_path):
    out = tmp_path / "p.pt"
    art = ex.run(opts(syn, out, "cached-partial-5hz", verify_every=1, future_intervention_every=1),
                 factory=ToySession, model_info={}, echo=lambda s: None)
    assert art.mode == "causal-prefix" and art.partial_tail_admissible
    assert torch.equal(art.state_source_times, art.times)
    v = art.verification
    assert v["boundary"]["runs"] == 4 and v["snapshot_restoration"]["runs"] == 20
    # every non-boundary row from 1.2 s on: 1.2,1.4,1.6,1.8,2.2,...,3.8 = 12
    assert v["clean_replay"]["runs"] == 12 and v["future_intervention"]["runs"] == 12
    assert v["boundary"]["max_abs_diff"] == 0.0 and v["clean_replay"]["max_abs_diff"] == 0.0
    # partial rows at whole seconds equal the native held states
    native = ex.run(opts(syn, tmp_path / "n.pt", "native-1hz-hold"), factory=ToySession, model_info={},
                    echo=lambda s: None)
    for k in (4, 9, 14, 19):
        assert torch.equal(art.states[k], native.states[k])
    assert not torch.equal(art.states[5], art.states[4])  # the tail moves the state


def test_default_cadence_runs_first_only_then_periodic(syn, tmp_path):
    art = ex.run(opts(syn, tmp_path / "a.pt", "cached-partial-5hz"), factory=ToySession, model_info={},
                 echo=lambda s: None)
    assert art.verification["clean_replay"]["runs"] == 1
    assert art.verification["clean_replay"]["checks"][0]["t"] == 1.2
    art = ex.run(opts(syn, tmp_path / "b.pt", "cached-partial-5hz", verify_every=10, future_intervention_every=7),
                 factory=ToySession, model_info={}, echo=lambda s: None)
    # rows: first 5 (1.2 s), then first non-boundary row at/after 10 (10 -> 2.2 s), 20 (none)
    assert [c["row"] for c in art.verification["clean_replay"]["checks"]] == [5, 10]
    # intervention: 5, then >=7 -> 7, >=14 -> 15 (row 14 is a boundary)
    assert [c["row"] for c in art.verification["future_intervention"]["checks"]] == [5, 7, 15]


def test_broken_restore_is_caught_and_nothing_saved(syn, tmp_path):
    out = tmp_path / "p.pt"
    with pytest.raises(ex.VerificationError, match="nothing was saved"):
        ex.run(opts(syn, out, "cached-partial-5hz"), factory=lambda: ToySession(broken_restore=True),
               model_info={}, echo=lambda s: None)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_nondeterministic_replay_fails_and_unverified_saves_when_allowed(syn, tmp_path):
    out = tmp_path / "p.pt"
    o = opts(syn, out, "cached-partial-5hz", allow_unverified_partial_tail=True)
    art = ex.run(o, factory=lambda: ToySession(nondeterministic=True), model_info={}, echo=lambda s: None)
    assert art.mode == "minicpmo-unverified-partial-tail" and not art.partial_tail_admissible
    assert not art.verification["clean_replay"]["passed"]
    with pytest.raises(InputError, match="--allow-unverified-partial-tail"):
        load_artifact(out)


def test_future_leak_in_reader_is_caught(syn, tmp_path, monkeypatch):
    real = ex.Inputs.audio

    def leaky(self, start, end):  # a reader bug: 50 ms of look-ahead
        return real(self, start, min(self.end, end + 0.05))
    monkeypatch.setattr(ex.Inputs, "audio", leaky)
    o = opts(syn, tmp_path / "p.pt", "cached-partial-5hz", allow_unverified_partial_tail=True)
    art = ex.run(o, factory=ToySession, model_info={}, echo=lambda s: None)
    fut = art.verification["future_intervention"]
    assert not fut["passed"] and fut["max_abs_diff"] > 0


def test_too_short_is_not_verified(syn, tmp_path):
    o = opts(syn, tmp_path / "p.pt", "cached-partial-5hz", end=1.0)
    with pytest.raises(ex.VerificationError, match="too short"):
        ex.run(o, factory=ToySession, model_info={}, echo=lambda s: None)
    assert not (tmp_path / "p.pt").exists()


def test_pruning_rows_recorded_and_boundary_still_compared(syn, tmp_path):
    art = ex.run(opts(syn, tmp_path / "p.pt", "cached-partial-5hz"), factory=lambda: ToySession(window_high=2),
                 model_info={}, echo=lambda s: None)
    assert art.window["high_tokens"] == 2
    assert [p["row"] for p in art.pruning] == [14]  # third commit (3.0 s) exceeds 2 chunks
    b = art.verification["boundary"]
    assert b["runs"] == 4 and [c["pruned"] for c in b["checks"]] == [False, False, True, False]
    assert art.verification["all_passed"]


def test_perturbation_changes_only_the_future(syn):
    with EasyComSession(syn) as media:
        inp = ex.Inputs(media, 4.0)
        pert = inp.perturbed_after(1.4)
        k = int(1.4 * SAMPLE_RATE)
        np.testing.assert_array_equal(inp.audio(0, 1.4), pert.audio(0, 1.4))
        assert np.abs(inp.audio(1.4, 4.0) - pert.audio(1.4, 4.0)).max() > 0.1
        np.testing.assert_array_equal(inp.frame_at(1.4), pert.frame_at(1.4))  # frame 27 starts at 1.35 s
        assert not np.array_equal(inp.frame_at(1.45), pert.frame_at(1.45))  # frame 28 starts at 1.40 s
        assert pert.perturbed_samples == 64000 - k


@pytest.mark.parametrize("kw, msg", [
    ({"end": 9.0}, "beyond the session"),
    ({"end": 0.1}, "shorter than one"),
    ({"verify_every": -1}, ">= 0"),
])
def test_bad_options_named_before_model(syn, tmp_path, kw, msg):
    def no_model():
        raise AssertionError("model must not be loaded")
    with pytest.raises(InputError, match=msg):
        ex.run(opts(syn, tmp_path / "p.pt", "native-1hz-hold", **kw), factory=no_model, echo=lambda s: None)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("n, ok", [(19, True), (20, True), (21, True), (22, False), (18, False)])
def test_target_alignment_policy(syn, tmp_path, n, ok):
    tgt = tmp_path / "t.npy"
    np.save(tgt, np.arange(n * 3).reshape(n, 3))
    out = tmp_path / "p.pt"
    o = opts(syn, out, "native-1hz-hold", target=tgt)
    if not ok:
        with pytest.raises(InputError, match="off-by-one"):
            ex.run(o, factory=ToySession, model_info={}, echo=lambda s: None)
        assert not out.exists()
        return
    art = ex.run(o, factory=ToySession, model_info={}, echo=lambda s: None)
    rows = min(n, 20)
    assert art.num_rows == rows and art.targets.shape == (rows, 3)
    assert art.targets[:, 0].tolist() == [3 * j for j in range(rows)]
    assert art.target_info["target_rows"] == n and art.provenance["target_shape"] == [n, 3]


def test_output_dir_missing_named(syn, tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        ex.run(opts(syn, tmp_path / "no" / "p.pt", "native-1hz-hold"), factory=ToySession, echo=lambda s: None)


def test_paired_replays_decode_each_frame_once(syn):
    with EasyComSession(syn, frame_cache_size=32) as media:
        inp = ex.Inputs(media, 4.0)
        clean, pert = ex.replay_states(ToySession, [inp, inp.perturbed_after(3.6)], 17)  # t = 3.6 s
        # frames 19, 39, 59 (commits) and 71 (tail): decoded once each, served twice
        assert media.stats.frames_decoded_requests == 4 and media.stats.cache_hits == 4
        assert torch.equal(clean, pert)
        assert torch.equal(clean, ex.replay_state(ToySession, inp, 17))


def test_structured_targets_stored_as_matrix(syn, tmp_path):
    rec = np.zeros(20, dtype=[("time", "f8"), ("valid", "?"), ("event", "i1")])
    rec["time"] = np.arange(1, 21) * 0.2
    rec["valid"][::2] = True
    rec["event"] = -1
    tgt = tmp_path / "t.npy"
    np.save(tgt, rec)
    art = ex.run(opts(syn, tmp_path / "p.pt", "native-1hz-hold", target=tgt), factory=ToySession, model_info={},
                 echo=lambda s: None)
    assert art.target_info["columns"] == ["time", "valid", "event"] and art.targets.shape == (20, 3)
    assert art.targets[:, 0].tolist() == pytest.approx(art.times.tolist())
    assert art.targets[:2, 1].tolist() == [1.0, 0.0] and art.provenance["target_shape"] == [20]


class _Embedder:
    """Stands in for StreamingSession.embed_frames: records each batch of frames it embeds."""

    def __init__(self):
        self.batches: list[int] = []

    def embed_frames(self, frames):
        self.batches.append(len(frames))
        return [("emb", int(np.asarray(f, dtype=np.int64).sum())) for f in frames]


def test_frame_groups_embed_each_group_once_and_views_apart(syn, monkeypatch):
    assert ex.native_frame_group(6.0, 7.0) == [5.0, 6.0, 7.0]
    assert ex.native_frame_group(4.0, 60.0) == [1.0, 2.0, 3.0, 4.0]
    assert ex.partial_frame_group(1.4, 4.0) == [1.2, 1.4, 1.6, 1.8, 2.0]
    assert ex.partial_frame_group(2.0, 4.0) == [1.2, 1.4, 1.6, 1.8, 2.0]
    with EasyComSession(syn, frame_cache_size=32) as media:
        inp = ex.Inputs(media, 4.0, frame_group=ex.partial_frame_group)
        s = _Embedder()
        got = {t: inp.frame_for(s, t) for t in (1.2, 1.4, 1.6, 1.8, 2.0)}
        assert s.batches == [5]  # one batch for the whole second
        assert got[1.4] == ("emb", int(inp.frame_at(1.4).astype(np.int64).sum()))
        pert = inp.perturbed_after(1.4)
        assert pert.frame_for(s, 1.2) == got[1.2] and s.batches == [5, 5]  # its own batch, same value
        assert pert.frame_for(s, 1.6) != got[1.6]  # a changed (future) frame
        # evicted groups are recomputed from the same group (identical batches)
        monkeypatch.setattr(ex, "EMBEDDED_FRAMES_KEPT", 5)
        inp.frame_for(s, 2.2)
        assert inp.frame_for(s, 1.4) == got[1.4] and s.batches == [5, 5, 5, 5]
        assert inp.frame_for(ToySession(), 1.4).shape == inp.frame_at(1.4).shape  # no embed_frames: raw


@pytest.mark.parametrize("mode", ["native-1hz-hold", "cached-partial-5hz"])
def test_every_session_opened_is_closed(syn, tmp_path, mode):
    """Pooled resources go back: every session is closed where it is opened, the main one
    included (no reference to it is kept here)."""
    made, closed = [0], set()

    class Closing(ToySession):
        def __init__(self, serial):
            super().__init__()
            self.serial = serial

        def close(self):
            closed.add(self.serial)

    def factory():
        made[0] += 1
        return Closing(made[0])

    ex.run(opts(syn, tmp_path / "p.pt", mode), factory=factory, model_info={}, echo=lambda s: None)
    assert made[0] >= 3 and closed == set(range(1, made[0] + 1))


def test_tail_rows_are_the_seconds_non_boundary_rows():
    assert ex.tail_rows(0, 20) == [0, 1, 2, 3] and ex.tail_rows(3, 20) == [0, 1, 2, 3]
    assert ex.tail_rows(4, 20) == [0, 1, 2, 3]          # a boundary row belongs to its second too
    assert ex.tail_rows(7, 9) == [5, 6, 7, 8]
    assert ex.tail_rows(12, 13) == [10, 11, 12]        # the session's last, partial second
    assert ex.tail_rows(14, 15) == [10, 11, 12, 13]


def test_deferred_audit_checks_equal_immediate_ones():
    """compare_later / restoration_later judge exactly as compare / record would, in order,
    once resolved (the extractor defers them so the host never waits for the device)."""
    from dataclasses import dataclass

    now, later = ex.Audit("x", False, 1e-3), ex.Audit("x", False, 1e-3)
    ref = torch.linspace(1, 2, 16)
    cases = [(ref.clone(), 1), (ref * (1 + 1e-4), 2), (ref * 1.1, 3), (ref + float("nan"), 4)]
    for got, row in cases:
        now.compare(row, 0.2 * row, got, ref)
        later.compare_later(row, 0.2 * row, got, ref)
    assert later.runs == 0  # nothing judged yet
    assert json.dumps(later.to_dict()) == json.dumps(now.to_dict())  # (NaN != NaN in a dict compare)
    assert later.failed == 2 and not later.passed
    assert ex.Audit("y", True, 0.0).compare(0, 0.0, ref, ref) is True

    @dataclass(frozen=True)
    class FP:
        llm_checksum: object
        n: int

    restore = ex.Audit("snapshot_restoration", True, 0.0)
    last = []
    restore.restoration_later(1, 0.2, FP(torch.tensor(1.5, dtype=torch.float64), 3), FP(1.5, 3), done=last.append)
    restore.restoration_later(2, 0.4, FP(torch.tensor(1.5, dtype=torch.float64), 3),
                              FP(torch.tensor(1.5 + 1e-12, dtype=torch.float64), 3), done=last.append)
    restore.restoration_later(3, 0.6, FP(2.0, 3), FP(2.0, 4), done=last.append)
    d = restore.to_dict()
    assert (d["runs"], d["failed"]) == (3, 2)
    assert [c.get("changed") for c in d["checks"]] == [None, ["llm_checksum"], ["n"]]
    assert last[-1] == {"llm_checksum": 2.0, "n": 4} and last[1]["llm_checksum"] == 1.5 + 1e-12
