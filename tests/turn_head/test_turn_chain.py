"""The tiny chain: synthetic EasyCom sessions -> extractor on the tiny checkpoint -> make-targets
-> train-turn-head (random weights: only the plumbing and the alignment are checked)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from minicpmo_rt.features import extract as ex
from minicpmo_rt.features.synthetic import make_session
from minicpmo_rt.turn_head import data as D
from minicpmo_rt.turn_head import labels as L
from minicpmo_rt.turn_head.train import main as train_main


@pytest.mark.slow
def test_tiny_chain(tiny_ckpt, tmp_path, capsys):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ec, feat, troot = tmp_path / "ec", tmp_path / "feat", tmp_path / "targets"
        feat.mkdir()
        troot.mkdir()
        for n in (1, 2, 3):
            vdir = make_session(ec, 6, session=n, width=48, height=32, seed=n, segment_seconds=2, gap_seconds=30)
            L.make_targets(ec, n, troot / f"Session_{n}.npy")
            L.make_targets(ec, n, tmp_path / f"m{n}.npy", matrix=True)
            assert ex.main(["--model-id", str(tiny_ckpt), "--easycom-session-dir", str(vdir),
                            "--mode", "native-1hz-hold", "--dtype", "float32", "--device", "cpu",
                            "--decoder", "pyav", "--target", str(tmp_path / f"m{n}.npy"),
                            "--output", str(feat / f"Session_{n}.pt")]) == 0
        # the extractor stored the matrix rows; they decode to the same labels as the records
        stored, rooted = D.load_sessions(feat), D.load_sessions(feat, troot)
        for a, b in zip(stored, rooted):
            assert a.target_source == "artifact" and a.states.shape[0] == 30
            np.testing.assert_array_equal(a.y, b.y)
            np.testing.assert_array_equal(a.mask, b.mask)
            assert not a.mask[:4].any()  # native initialisation rows
        # the labels line up with the audio the extractor reads on its media axis (across the
        # cut and the 37 ms name drift): every fully spoken row is louder than every silent row
        from minicpmo_rt.features.easycom import EasyComSession

        for s in stored:
            audio = EasyComSession(ec / "Video_Compressed" / s.name)
            rms = np.array([np.sqrt(np.mean(audio.audio(t - 0.2, t) ** 2)) for t in s.times])
            frac = s.targets["wearer_frac"] + s.targets["partner_frac"]
            spoken = (s.targets["wearer_frac"] >= 0.999) | (s.targets["partner_frac"] >= 0.999)
            assert spoken.sum() >= 5 and (frac == 0).sum() >= 3
            assert rms[spoken].min() > rms[frac == 0].max(), s.name
        out = tmp_path / "run"
        assert train_main(["--feature-root", str(feat), "--out", str(out), "--split", "val=2;test=3",
                           "--model", "tcn", "--epochs", "3", "--min-steps", "2", "--no-progress"]) == 0
        m = json.loads((out / "metrics.json").read_text())
        assert m["extractor_modes"] == ["native-1hz-hold"] and m["feature_dim"] == stored[0].dim
        assert m["sessions"] == {"train": ["Session_1"], "val": ["Session_2"], "test": ["Session_3"]}
        assert (out / "timeline_Session_3.png").is_file() and "wearer_f0" in capsys.readouterr().out
    finally:
        torch.set_num_threads(old)
