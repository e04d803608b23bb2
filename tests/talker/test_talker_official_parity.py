"""Parity of minicpmo_rt.talker.MiniCPMTTS with the official MiniCPMTTS (fixtures).

The fixture (tests/fixtures/official/talker.npz, recipe in docs/parity_fixtures.md) holds
the official model's logits for a conditioning pass and 20 teacher-forced decode steps at
the tiny config, with every weight equal to ``random_tensor(key, shape, seed=0)``. Here the
same weights are regenerated with ``randomize_(tts, 0, "tts.")`` and the same inputs fed.
Tolerance 1e-4 (fp32; the official run used eager attention, ours sdpa: ~1e-6 apart).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import rel_err
from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config

talker_model = pytest.importorskip("minicpmo_rt.talker.model")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "official"
TOL = 1e-4


@pytest.fixture(scope="module")
def fx():
    data = dict(np.load(FIXTURES / "talker.npz"))
    meta = json.loads((FIXTURES / "talker.json").read_text())
    return {k: torch.from_numpy(v) for k, v in data.items()}, meta


@pytest.fixture(scope="module")
def tts():
    cfg = MiniCPMOConfig.from_dict(tiny_config())
    with torch.device("meta"):
        model = talker_model.MiniCPMTTS(cfg.tts)
    model = model.to_empty(device="cpu").float()
    randomize_(model, 0, "tts.")
    talker_model.rebuild_rotary_(model)
    return model.eval()


def test_fixture_matches_tiny_config(fx):
    data, meta = fx
    cfg = MiniCPMOConfig.from_dict(tiny_config())
    assert data["cond_logits"].shape[-1] == cfg.tts.num_audio_tokens
    assert data["hidden"].shape[-1] == cfg.tts.llm_dim
    assert meta["text_eos_token_id"] == cfg.tts.text_eos_token_id
    assert meta["audio_bos_token_id"] == cfg.tts.audio_bos_token_id
    assert meta["normalize_projected_hidden"] == cfg.tts.normalize_projected_hidden


@torch.no_grad()
def test_condition_rows_match_official(tts, fx):
    data, _ = fx
    cond = tts.condition(data["text_ids"], data["hidden"], text_finished=True)
    assert cond.shape == data["cond_embeds"].shape
    assert rel_err(cond, data["cond_embeds"]) <= TOL


@torch.no_grad()
def test_conditioning_and_teacher_forced_decode_logits(tts, fx):
    data, meta = fx
    cond = data["cond_embeds"][None]                     # the official condition rows, exactly
    n = cond.shape[1]
    hidden, cache = tts.forward_reference(cond, torch.arange(n)[None])
    cond_logits = tts.logits(hidden)[0]
    err = rel_err(cond_logits, data["cond_logits"])
    assert err <= TOL, f"conditioning pass logits rel err {err:.3e}"

    codes = data["codes"]
    assert codes.numel() == 20 and meta["position_ids"][1] == [n]
    errs = []
    for i in range(codes.numel()):
        emb = tts.embed_codes(codes[i].view(1, 1))
        hidden, cache = tts.forward_reference(emb, torch.tensor([[n + i]]), cache)
        errs.append(rel_err(tts.logits(hidden)[0, -1], data["decode_logits"][i]))
    assert max(errs) <= TOL, f"decode-step logits rel err per step {['%.1e' % e for e in errs]}"


@torch.no_grad()
def test_own_condition_end_to_end_argmax(tts, fx):
    """Our condition rows (not the official ones) lead to the same conditioning logits."""
    data, _ = fx
    cond = tts.condition(data["text_ids"], data["hidden"], text_finished=True)[None]
    hidden, _ = tts.forward_reference(cond, torch.arange(cond.shape[1])[None])
    logits = tts.logits(hidden)[0]
    assert rel_err(logits, data["cond_logits"]) <= TOL
    assert torch.equal(logits[-1].argmax(), data["cond_logits"][-1].argmax())


@torch.no_grad()
def test_engine_static_kv_fast_path_teacher_forced(tts, fx, monkeypatch):
    """The slot engine's static-KV path (the one the CUDA graph captures) against the official
    logits: its sampler still runs (state advances as usual) but the fed codes are forced to
    the official ones, and the logits each step samples from are recorded."""
    engine_mod = pytest.importorskip("minicpmo_rt.talker.engine")
    data, _ = fx
    codes = data["codes"]
    seen: list[torch.Tensor] = []
    real_sample_step = engine_mod.sample_step

    def forced(logits, state, params, eos):
        seen.append(logits[0].clone())
        real_sample_step(logits, state, params, eos)
        return torch.full_like(state.step, int(codes[len(seen) - 1]))

    monkeypatch.setattr(engine_mod, "sample_step", forced)
    engine = engine_mod.TalkerEngine(tts, capacity=1, kv_budget_bytes=1 << 20)
    engine.submit(engine_mod.TalkerRequest("parity", data["text_ids"], data["hidden"], seed=0, max_codes=100))
    for _ in range(codes.numel()):
        assert engine.step() == []          # no window is due before 25 codes
    assert len(seen) == codes.numel()
    ref = torch.cat([data["cond_logits"][-1:], data["decode_logits"]])     # [21, V]
    got = torch.stack(seen + [engine.first_logits[0].clone()])
    errs = [rel_err(g, r) for g, r in zip(got, ref)]
    assert max(errs) <= TOL, f"engine logits rel err per step {['%.1e' % e for e in errs]}"
