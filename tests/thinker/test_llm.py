from __future__ import annotations

import torch

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.manifest import compare_prefix, load_manifest, shapes_of
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
from minicpmo_rt.checkpoint.weights import module_shapes
from minicpmo_rt.thinker.llm import build_llm, final_norm_hidden

from conftest import rel_err


def tiny_llm(seed: int = 0):
    cfg = MiniCPMOConfig.from_dict(tiny_config())
    return randomize_(build_llm(cfg), seed, prefix="llm."), cfg


def test_llm_keys_match_manifest(shared_dir):
    from minicpmo_rt.checkpoint.config import load_config as _load

    cfg = _load(shared_dir / "config.json")
    with torch.device("meta"):
        model = build_llm(cfg)
    rep = compare_prefix(shapes_of(load_manifest(shared_dir / "state_dict_manifest.json")["keys"]),
                         module_shapes(model, "llm."), "llm.")
    assert rep.ok, rep.details()
    assert rep.matched == 399
    c = model.config
    assert (c.vocab_size, c.head_dim, c.rms_norm_eps, c.tie_word_embeddings) == (151748, 128, 1e-6, False)
    assert c.rope_parameters["rope_theta"] == 1e6
    assert model.config._attn_implementation == "sdpa"


def test_llm_untied_and_final_norm_hidden():
    model, cfg = tiny_llm()
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[151644, 872, 198, 9707, 151645]])
    emb = model.model.embed_tokens(ids)
    with torch.no_grad():
        h, cache = final_norm_hidden(model, emb)
        full = model(inputs_embeds=emb, output_hidden_states=True)
    assert h.shape == (1, 5, cfg.llm.hidden_size)
    # hidden_states[-1] of transformers' Qwen3 is norm(last layer output): the read-out state.
    assert rel_err(h, full.hidden_states[-1]) < 1e-6
    assert rel_err(model.lm_head(h), full.logits) < 1e-6
    assert cache.get_seq_length() == 5


def test_check_manifest_reports_thinker_core_parts_clean(shared_dir):
    from minicpmo_rt.snapshot_tools import check_manifest

    result = check_manifest(shared_dir / "config.json", shared_dir / "state_dict_manifest.json")
    for name, n_keys in (("llm", 399), ("vpm", 437), ("resampler", 13)):
        rep = result.reports[name]
        assert rep.ok and rep.matched == n_keys, rep.details()
