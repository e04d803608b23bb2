"""Both modes end to end on the tiny checkpoint (random weights) and a synthetic session, on CPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from minicpmo_rt.errors import InputError
from minicpmo_rt.features import extract as ex
from minicpmo_rt.features.artifact import load_artifact
from minicpmo_rt.features.synthetic import make_session

REPO = Path(__file__).resolve().parents[2]
SEED_FLAGS = ["--model-id", "--revision", "--easycom-session-dir", "--end", "--target", "--mode", "--decoder",
              "--decoder-threads", "--max-open-readers", "--frame-cache-size", "--media-only", "--dtype",
              "--attention", "--device", "--output", "--verify-every", "--future-intervention-every",
              "--allow-unverified-partial-tail"]


@pytest.fixture(scope="module")
def session_dir(tmp_path_factory):
    return make_session(tmp_path_factory.mktemp("easycom"), 3, session=4, width=48, height=32, seed=7)


@pytest.fixture(scope="module")
def smoke(tiny_ckpt, session_dir, tmp_path_factory):
    """The seed's two extraction smoke commands (paths and model replaced), run in-process."""
    root = tmp_path_factory.mktemp("smoke")
    common = ["--model-id", str(tiny_ckpt), "--easycom-session-dir", str(session_dir), "--end", "3",
              "--dtype", "float32", "--attention", "sdpa", "--device", "cpu", "--decoder", "pyav",
              "--decoder-threads", "1", "--max-open-readers", "1"]
    assert ex.main(common + ["--mode", "native-1hz-hold", "--output", str(root / "Session_4_native_3s.pt")]) == 0
    assert ex.main(common + ["--mode", "cached-partial-5hz", "--verify-every", "1", "--future-intervention-every",
                             "1", "--output", str(root / "Session_4_partial_3s.pt")]) == 0
    return root


def test_help_lists_every_seed_flag():
    out = subprocess.run([sys.executable, str(REPO / "streaming_minicpmo_features_directly.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    missing = [f for f in SEED_FLAGS if f not in out]
    assert not missing, missing


def test_seed_inspection_snippet_verbatim(smoke):
    snippet = textwrap.dedent('''
        from pathlib import Path
        import torch

        root = Path("ROOT")
        for name in ("Session_4_native_3s.pt", "Session_4_partial_3s.pt"):
            payload = torch.load(root / name, map_location="cpu", weights_only=False)
            print(name)
            print(" mode:", payload["mode"], payload["extractor_mode"])
            print(" states:", tuple(payload["states"].shape))
            print(" times:", payload["times"][:6].tolist())
            print(" source times:", payload["state_source_times"][:6].tolist())
            print(" verified:", payload["partial_tail_admissible"])
            print(" checks:", payload["verification"])
        ''').replace("ROOT", str(smoke))
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, check=True).stdout
    assert " mode: causal-prefix native-1hz-hold" in out and " mode: causal-prefix cached-partial-5hz" in out
    assert out.count("\n times: [0.2, 0.4, 0.6, 0.8, 1.0, 1.2]") == 2
    assert " source times: [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]" in out
    assert " source times: [0.2, 0.4, 0.6, 0.8, 1.0, 1.2]" in out
    assert " verified: True" in out


def test_native_artifact(smoke, tiny_ckpt):
    art = load_artifact(smoke / "Session_4_native_3s.pt")
    assert art.states.shape == (15, 64) or art.states.shape[0] == 15
    assert torch.count_nonzero(art.states[:4]) == 0 and bool(torch.isfinite(art.states).all())
    assert art.native_update_mask.nonzero().flatten().tolist() == [4, 9, 14]
    assert all(torch.equal(art.states[4], art.states[k]) for k in range(5, 9))
    v = art.verification
    assert v["all_passed"] and v["clean_replay"]["passed"] and v["future_intervention"]["passed"]
    assert v["future_intervention"]["max_abs_diff"] == 0.0
    p = art.provenance
    assert p["model_path"] == str(tiny_ckpt) and p["revision"] and p["session"] == "Session_4"
    assert p["timeline"]["gaps"] and p["end"] == 3.0 and "--mode native-1hz-hold" in p["command_line"]
    assert art.window["name"] == "input-only"


def test_partial_artifact_all_four_audits(smoke):
    art = load_artifact(smoke / "Session_4_partial_3s.pt")
    native = load_artifact(smoke / "Session_4_native_3s.pt")
    assert art.partial_tail_admissible and torch.equal(art.state_source_times, art.times)
    v = art.verification
    for name in ("boundary", "clean_replay", "future_intervention", "snapshot_restoration"):
        assert v[name]["passed"] and v[name]["failed"] == 0, (name, v[name])
    # the real session forks each second's 4 tails off one state (one restoration check), then
    # checks its boundary in a transaction (another): two per second
    assert v["boundary"]["runs"] == 3 and v["snapshot_restoration"]["runs"] == 6
    assert v["clean_replay"]["runs"] == 8 and v["future_intervention"]["runs"] == 8  # rows 1.2-1.8, 2.2-2.8
    assert v["future_intervention"]["max_abs_diff"] == 0.0
    assert v["clean_replay"]["max_rel_err"] <= 1e-5 and v["boundary"]["max_rel_err"] <= 1e-5
    for k in (4, 9, 14):  # whole seconds: the same committed state as native mode
        assert ex.Audit("x", False, 1e-5).compare(k, 0.0, art.states[k], native.states[k])
    assert not torch.equal(art.states[5], art.states[4])


def test_cli_features_media_only(session_dir):
    r = subprocess.run([sys.executable, "-m", "minicpmo_rt.cli", "features", "--easycom-session-dir",
                        str(session_dir), "--end", "3", "--mode", "native-1hz-hold", "--decoder", "pyav",
                        "--media-only"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "gap after 00-00-000" in r.stdout and "media OK (no model loaded)" in r.stdout


def test_bad_inputs_leave_no_artifact(tiny_ckpt, session_dir, tmp_path):
    out = tmp_path / "x.pt"
    base = ["--model-id", str(tiny_ckpt), "--mode", "native-1hz-hold", "--device", "cpu", "--output", str(out)]
    tgt = tmp_path / "t.npy"
    np.save(tgt, np.zeros(40))
    cases = [
        (["--easycom-session-dir", str(tmp_path / "nope")], "not a directory"),
        (["--easycom-session-dir", str(session_dir), "--end", "30"], "beyond the session"),
        (["--easycom-session-dir", str(session_dir), "--target", str(tgt)], "off-by-one"),
        (["--easycom-session-dir", str(session_dir), "--model-id", str(tmp_path)], "config.json"),
    ]
    for extra, msg in cases:
        with pytest.raises(Exception, match=msg):
            ex.run(ex.parse_options(base + extra))
        assert not out.exists()
    assert ex.main(base + ["--easycom-session-dir", str(tmp_path / "nope")]) == 2
    # an artifact under another suffix would be invisible to every *.pt scan (train_turn_head, iter_feature_root)
    npy = tmp_path / "x.npy"
    with pytest.raises(Exception, match=r"name it <something>\.pt"):
        ex.run(ex.parse_options(base[:-1] + [str(npy), "--easycom-session-dir", str(session_dir)]))
    assert not npy.exists()


def test_hub_id_resolved_from_local_cache_only(tiny_ckpt, session_dir, tmp_path, monkeypatch):
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--openbmb--MiniCPM-o-4_5"
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in tiny_ckpt.iterdir():
        (snap / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "n.pt"
    assert ex.main(["--model-id", "openbmb/MiniCPM-o-4_5", "--easycom-session-dir", str(session_dir), "--end", "1",
                    "--mode", "native-1hz-hold", "--device", "cpu", "--output", str(out)]) == 0
    p = load_artifact(out).provenance
    assert p["model_id"] == "openbmb/MiniCPM-o-4_5" and p["revision"] == rev and p["revision_source"] == "hf-cache"
    assert ex.main(["--model-id", "openbmb/Not-Cached", "--easycom-session-dir", str(session_dir), "--end", "1",
                    "--mode", "native-1hz-hold", "--device", "cpu", "--output", str(tmp_path / "m.pt")]) == 2
    assert not (tmp_path / "m.pt").exists()


def test_partial_with_batched_forks_matches_transactions(smoke, tiny_ckpt, session_dir, tmp_path):
    """The fast path's forks (a static LLM cache: each second's rows prefilled as one batch on a
    fork of the cache) against the smoke run's one-transaction-per-row artifact."""
    from minicpmo_rt.checkpoint.tokenizer import load_tokenizer
    from minicpmo_rt.thinker.model import Thinker
    from minicpmo_rt.thinker.session import StreamingSession

    th = Thinker.from_snapshot(tiny_ckpt, dtype=torch.float32, device="cpu")
    tok = load_tokenizer(tiny_ckpt)
    opened = []

    def factory():
        opened.append(StreamingSession(th, tok, llm_cache="static", static_capacity=2048))
        return opened[-1]

    o = ex.ExtractOptions(easycom_session_dir=session_dir, mode="cached-partial-5hz", end=3.0,
                          output=tmp_path / "p.pt", progress=False, verify_every=1, future_intervention_every=1,
                          decoder="pyav", decoder_threads=1, max_open_readers=1)
    art = ex.run(o, factory=factory, model_info={}, echo=lambda s: None)
    ref = load_artifact(smoke / "Session_4_partial_3s.pt")
    assert opened[0].llm_cache.store is None and all(s.llm_cache.store is None for s in opened)  # all closed
    v = art.verification
    assert v["all_passed"] and v["future_intervention"]["max_abs_diff"] == 0.0
    assert v["snapshot_restoration"]["runs"] == 6 and v["boundary"]["runs"] == 3
    # the replays read their tail through the same fork batch: bit-identical to the cached rows
    assert v["clean_replay"]["max_abs_diff"] == 0.0 and v["boundary"]["max_abs_diff"] == 0.0
    err = ((art.states - ref.states).norm(dim=1) / ref.states.norm(dim=1)).max()
    assert err <= 1e-5, err
