import torch

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
from minicpmo_rt.thinker.decode import StaticDecoder
from minicpmo_rt.thinker.llm import build_llm
from tests.conftest import rel_err


def test_static_decoder_matches_transformers_forward():
    """Prefill 7 positions then decode 5 tokens on the static cache vs transformers' Qwen3
    over the whole sequence: final-norm hidden and logits, fp32."""
    cfg = MiniCPMOConfig.from_dict(tiny_config())
    llm = build_llm(cfg)
    randomize_(llm, seed=11, prefix="llm.")
    llm.eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, 7, cfg.llm.hidden_size, generator=g)
    toks = torch.randint(0, 151000, (5,), generator=g)
    dec = StaticDecoder(llm, max_len=32)
    with torch.no_grad():
        hs = [dec.prefill(prompt, 0)[0]]
        logits = []
        for i, t in enumerate(toks):
            lg, h = dec.decode(t.view(1), torch.tensor([7 + i]), kv_len=32)
            hs.append(h)
            logits.append(lg[0])
        full = torch.cat([prompt, llm.model.embed_tokens(toks)[None]], 1)
        out = llm.model(inputs_embeds=full, use_cache=False)
        ref_h = out.last_hidden_state[0]
        ref_logits = llm.lm_head(ref_h[7:]).float()
    got_h = torch.cat([hs[0], torch.cat(hs[1:])])
    assert rel_err(got_h, ref_h) < 1e-5
    assert rel_err(torch.stack(logits), ref_logits) < 1e-5
