"""Honest learning tests: a planted signal is learned, pure noise is not; named errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from minicpmo_rt.errors import InputError
from minicpmo_rt.turn_head import data as D
from minicpmo_rt.turn_head.train import TrainConfig, run
from turn_synth import write_root

SESSIONS = [1, 2, 3, 4, 5, 6]
SPLIT = "val=5;test=6"
FAST = dict(epochs=12, patience=4, crop=128, min_steps=10, lr=1e-2, progress=False, split=SPLIT)


def _aucs(metrics, system, split="test"):
    return {k: v["roc_auc"] for k, v in metrics["results"][split][system].items()}


@pytest.mark.parametrize("model", ["linear", "tcn"])
def test_planted_signal_is_learned(tmp_path, model):
    write_root(tmp_path / "feat", SESSIONS, native=SESSIONS if model == "tcn" else (), signal=3.0)
    m = run(tmp_path / "feat", tmp_path / "out", TrainConfig(model=model, plots=(model == "linear"), **FAST),
            echo=lambda s: None)
    aucs = _aucs(m, model)
    assert m["results"]["test"][model]["shift"]["n"] >= 8  # events exist and are scored
    assert all(a > 0.9 for a in aucs.values()), aucs
    ba = m["results"]["test"][model]["wearer_f1"]["balanced_accuracy"]
    assert ba > 0.85
    # majority is constant (AUC 0.5 exactly); last speaker cannot see the planted features
    assert all(a == 0.5 for a in _aucs(m, "majority").values() if a is not None)
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["sessions"]["test"] == ["Session_6"]
    if model == "linear":
        for name in ("roc_val.png", "pr_test.png", "timeline_Session_6.png", "table.txt", "head.pt"):
            assert (tmp_path / "out" / name).stat().st_size > 1000, name


def test_pure_noise_is_not_learned(tmp_path):
    write_root(tmp_path / "feat", SESSIONS, signal=0.0, rows=800)
    m = run(tmp_path / "feat", tmp_path / "out", TrainConfig(model="tcn", plots=False, **FAST), echo=lambda s: None)
    for name, r in m["results"]["test"]["tcn"].items():
        if name == "shift":
            continue  # a few dozen events: too few rows for a +-0.1 bound to be a fair test
        assert r["n"] > 500 and abs(r["roc_auc"] - 0.5) < 0.1, (name, r)
    # the labels themselves carry signal: the VAD-only head does learn the future bins
    assert m["results"]["test"]["vad_head"]["partner_f0"]["roc_auc"] > 0.8


def test_targets_root_matches_stored_targets(tmp_path):
    write_root(tmp_path / "a", [1, 2], store_targets=True, seed=3)
    write_root(tmp_path / "b", [1, 2], store_targets=False, targets_root=tmp_path / "t", seed=3)
    sa, sb = D.load_sessions(tmp_path / "a"), D.load_sessions(tmp_path / "b", tmp_path / "t")
    for x, y in zip(sa, sb):
        np.testing.assert_array_equal(x.y, y.y)
        np.testing.assert_array_equal(x.mask, y.mask)
        assert x.target_source == "artifact" and y.target_source.endswith(f"{y.name}.npy")


def test_init_rows_are_masked(tmp_path):
    write_root(tmp_path / "f", [1, 2], native=(1, 2))
    s = D.load_sessions(tmp_path / "f")[0]
    assert s.init_mask[:4].all() and not s.init_mask[4:].any()
    assert not s.mask[:4].any() and s.mask[4:, 0].all()


def test_named_errors(tmp_path):
    write_root(tmp_path / "dim", [1, 2, 3], dims={2: 17})
    with pytest.raises(D.FeatureDimensionMismatch, match="Session_2.pt: 17"):
        D.load_sessions(tmp_path / "dim")
    write_root(tmp_path / "nt", [1, 2], store_targets=False)
    with pytest.raises(D.MissingTargetsError, match="--targets-root"):
        D.load_sessions(tmp_path / "nt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(D.MissingTargetsError, match="Session_1.npy does not exist"):
        D.load_sessions(tmp_path / "nt", tmp_path / "empty")
    write_root(tmp_path / "mixed", [1, 2], native=(2,))
    with pytest.raises(D.MixedExtractionError, match="Session_2.pt: native-1hz-hold"):
        D.load_sessions(tmp_path / "mixed")
    write_root(tmp_path / "unv", [1, 2], unverified=(2,))
    with pytest.raises(InputError, match="minicpmo-unverified-partial-tail"):
        D.load_sessions(tmp_path / "unv")
    with pytest.raises(InputError, match="minicpmo-unverified-partial-tail"):
        run(tmp_path / "unv", tmp_path / "out", TrainConfig(progress=False, split="val=1"))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_splits(tmp_path):
    write_root(tmp_path / "f", list(range(1, 13)), rows=20)
    ss = D.load_sessions(tmp_path / "f")
    p = D.split_sessions(ss, "named")
    assert [s.name for s in p["val"]] == ["Session_4", "Session_12"]
    assert [s.name for s in p["test"]] == ["Session_10", "Session_11"]
    assert len(p["train"]) == 8
    folds = [D.split_sessions(ss, f"kfold:4:{f}") for f in range(4)]
    assert sorted(s.name for f in folds for s in f["test"]) == sorted(s.name for s in ss)
    for f in folds:
        names = [{s.name for s in f[k]} for k in ("train", "val", "test")]
        assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    with pytest.raises(D.SplitError, match="Session_13|'13'"):
        D.split_sessions(ss, "val=13")
    with pytest.raises(D.SplitError):
        D.split_sessions(ss[:2], "kfold:3:0")


def test_cli_and_shim(tmp_path, capsys):
    import subprocess
    import sys

    from minicpmo_rt.turn_head.train import main

    write_root(tmp_path / "f", [1, 2, 3], rows=100, signal=3.0)
    argv = ["--feature-root", str(tmp_path / "f"), "--out", str(tmp_path / "o"), "--split", "val=2;test=3",
            "--model", "gru", "--epochs", "2", "--min-steps", "2", "--no-plots", "--no-progress"]
    assert main(argv) == 0
    m = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert m["head"]["kind"] == "gru" and set(m["results"]["test"]) == {"gru", "vad_head", "last_speaker", "majority"}
    assert "partner_f3" in capsys.readouterr().out  # the printed table
    assert main(argv) == 2 and "--force" in capsys.readouterr().err  # no silent overwrite
    # the repository-root shim parses the same flags
    shim = D.__file__.split("/src/")[0] + "/train_turn_head.py"
    r = subprocess.run([sys.executable, shim, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--targets-root" in r.stdout


def test_all_folds(tmp_path):
    write_root(tmp_path / "f", [1, 2, 3], rows=100, signal=3.0)
    said: list[str] = []
    m = run(tmp_path / "f", tmp_path / "o", TrainConfig(model="linear", split="kfold:3", epochs=5, min_steps=5,
                                                        lr=1e-2, progress=False, plots=False), echo=said.append)
    assert sorted(f["test"][0] for f in m["folds"]) == ["Session_1", "Session_2", "Session_3"]
    # the fold table names how many folds a mean AUC rests on wherever some fold had none (one class only)
    table = said[-1].splitlines()
    for name, stats in m["test_mean_std"]["linear"].items():
        line = next(x for x in table if x.split()[0] == name)
        n = stats["roc_auc"]["folds"]
        assert (f"(AUC from {n} of 3 folds)" in line) == (n < 3), line
    assert any(s["roc_auc"]["folds"] < 3 for s in m["test_mean_std"]["linear"].values()), "no fold lacked an AUC"
    per_fold = [json.loads((tmp_path / "o" / f"fold_{f}" / "metrics.json").read_text())
                ["results"]["test"]["linear"]["wearer"]["roc_auc"] for f in range(3)]
    r = m["test_mean_std"]["linear"]["wearer"]["roc_auc"]
    assert r["folds"] == 3 and r["mean"] == pytest.approx(np.mean(per_fold)) and r["std"] == pytest.approx(np.std(per_fold))
    assert r["mean"] > 0.8


def test_misaligned_targets(tmp_path):
    from minicpmo_rt.turn_head import labels as L

    write_root(tmp_path / "f", [1], rows=50, store_targets=False, targets_root=tmp_path / "t")
    arr = L.load_targets(tmp_path / "t" / "Session_1.npy")
    L.save_targets(tmp_path / "t" / "Session_1.npy", arr[:48])  # two rows short: beyond the +-1 policy
    with pytest.raises(D.TargetAlignmentError, match="targets end at row 48"):
        D.load_sessions(tmp_path / "f", tmp_path / "t")
    L.save_targets(tmp_path / "t" / "Session_1.npy", arr[:49])  # one row short: accepted, last row masked
    (s,) = D.load_sessions(tmp_path / "f", tmp_path / "t")
    assert not s.mask[49].any() and s.mask[48, 0]


def test_progress_bar_counts_the_epochs(tmp_path, monkeypatch, capsys):
    """Each redraw of the training bar that shows an epoch's losses also shows that epoch's count. The bar used
    to wrap the epoch range, whose count tqdm syncs lazily: the demo's fast VAD head showed '0/5' beside the
    fifth epoch's losses (and with every redraw allowed, each epoch's losses beside the previous count).
    mininterval=0 makes tqdm redraw on every update, so every epoch is seen."""
    import tqdm

    from minicpmo_rt.turn_head.train import fit_head

    init = tqdm.tqdm.__init__

    def eager_init(self, *args, **kwargs):
        kwargs.setdefault("mininterval", 0)
        init(self, *args, **kwargs)

    monkeypatch.setattr(tqdm.tqdm, "__init__", eager_init)
    write_root(tmp_path / "f", [1, 2], rows=60)
    ss = D.load_sessions(tmp_path / "f")
    cfg = TrainConfig(model="linear", epochs=4, patience=10, min_steps=1, progress=True)
    _, history, _ = fit_head(ss[:1], ss[1:], cfg, desc="probe")
    err = capsys.readouterr().err
    shown = [seg for seg in err.replace("\n", "\r").split("\r") if "val=" in seg]
    assert len(shown) >= len(history) == 4
    for seg in shown:
        done = int(seg.split("|")[2].split("/")[0])
        assert 1 <= done <= 4, seg
        assert f"val={history[done - 1]['val_loss']:.4f}" in seg, (seg, history)


@pytest.mark.parametrize("flag, value, msg", [
    ("--epochs", "0", "an integer >= 1"), ("--crop", "0", "an integer >= 1"), ("--batch-size", "0", "an integer >= 1"),
    ("--hidden", "0", "an integer >= 1"), ("--layers", "0", "an integer >= 1"), ("--patience", "-1", "an integer >= 1"),
    ("--vad-history", "-2", "an integer >= 1"), ("--min-steps", "-1", "an integer >= 0"),
    ("--lr", "-1", "a positive number"), ("--lr", "nan", "a positive number"),
    ("--weight-decay", "-1", "a number >= 0"), ("--dropout", "1.5", "in [0, 1)"),
])
def test_bad_hyperparameters_are_named_before_any_data_is_read(tmp_path, capsys, flag, value, msg):
    """Each of these ended in a traceback (torch's ValueError, a ZeroDivisionError, range()'s ValueError) or,
    for --epochs 0 and --layers 0, silently wrote an untrained or degenerate head."""
    from minicpmo_rt.turn_head.train import main

    argv = ["--feature-root", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}" in err and msg in err and "missing" not in err, err
    assert not (tmp_path / "o").exists()
