from __future__ import annotations

import pytest
import torch

from conftest import rel_err, requires_cuda
from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
from minicpmo_rt.errors import InputError
from minicpmo_rt.thinker import generate as G
from minicpmo_rt.thinker.llm import build_llm, final_norm_hidden
from minicpmo_rt.thinker.prompt import IM_END_ID, TTS_EOS_ID, PromptBuilder



@pytest.fixture(scope="module")
def llm():
    cfg = MiniCPMOConfig.from_dict(tiny_config())
    return randomize_(build_llm(cfg), 0, prefix="llm.").eval()


def _prompt_ids(tok):
    b = PromptBuilder(tok)
    return list(b.user_segment(["Hello there, how are you?"]).ids + b.assistant_bos().ids)


def _prefill(llm, ids):
    emb = llm.model.embed_tokens(torch.tensor([ids]))
    with torch.no_grad():
        h, cache = final_norm_hidden(llm, emb)
        return cache, llm.lm_head(h[:, -1])


def _run(llm, tok, cfg, **kw):
    cache, logits = _prefill(llm, _prompt_ids(tok))
    return G.generate(llm, cache, logits, cfg, tokenizer=tok, **kw)


def test_hidden_rows_align_with_full_forward(llm, tok):
    cfg = G.SamplingConfig(max_new_tokens=12, chunk_size=5)
    out = _run(llm, tok, cfg, seed=3)
    prompt = _prompt_ids(tok)
    assert out.hidden.shape == (len(out.token_ids), llm.config.hidden_size) == (12, 128)
    assert out.hidden.dtype == torch.float32 and out.terminator is None
    assert out.past_key_values.get_seq_length() == len(prompt) + 12
    emb = llm.model.embed_tokens(torch.tensor([prompt + out.token_ids]))
    with torch.no_grad():
        full, _ = final_norm_hidden(llm, emb)
    # Row i is the final-norm hidden at token i's own position (fed after being sampled).
    assert rel_err(out.hidden, full[0, len(prompt):]) < 1e-5
    assert out.text == tok.decode(out.token_ids)


def test_seeded_sampling_is_reproducible(llm, tok):
    cfg = G.SamplingConfig(max_new_tokens=5)
    a, b = _run(llm, tok, cfg, seed=7), _run(llm, tok, cfg, seed=7)
    assert a.token_ids == b.token_ids and torch.equal(a.hidden, b.hidden)
    assert _run(llm, tok, cfg, seed=8).token_ids != a.token_ids
    g1 = torch.Generator().manual_seed(7)
    assert _run(llm, tok, cfg, generator=g1).token_ids == a.token_ids


@pytest.mark.parametrize("terminator", [TTS_EOS_ID, IM_END_ID])
def test_stops_on_real_terminators_without_their_row(llm, tok, terminator):
    cfg = G.SamplingConfig(max_new_tokens=10, greedy=True)
    free = _run(llm, tok, cfg)
    assert free.terminator is None and len(free.token_ids) == 10
    # Make the terminator win the greedy choice exactly where free.token_ids[4] won: copy its
    # lm_head row, scaled up so its (positive, winning) logit grows.
    k = 4
    target = free.token_ids[k]
    w = llm.lm_head.weight
    saved = w[terminator].clone()
    try:
        with torch.no_grad():
            w[terminator] = w[target] * 1.5
        cache, logits = _prefill(llm, _prompt_ids(tok))
        assert logits[0, target] > 0 or k > 0
        out = G.generate(llm, cache, logits, cfg, tokenizer=tok)
    finally:
        with torch.no_grad():
            w[terminator] = saved
    assert out.terminator == terminator and out.finished
    n = len(out.token_ids)
    assert n <= k and out.token_ids == free.token_ids[:n]
    assert terminator not in out.token_ids and out.hidden.shape[0] == n
    assert rel_err(out.hidden, free.hidden[:n]) < 1e-6
    assert out.past_key_values.get_seq_length() == len(_prompt_ids(tok)) + n  # terminator never fed


def test_custom_terminator_and_chunks(llm, tok):
    cfg = G.SamplingConfig(max_new_tokens=9, greedy=True, chunk_size=4)
    free = _run(llm, tok, cfg)
    stop = free.token_ids[6]
    first = free.token_ids.index(stop)
    cache, logits = _prefill(llm, _prompt_ids(tok))
    chunks = list(G.iter_generate(llm, cache, logits, cfg, terminators=(stop,)))
    assert [len(c.token_ids) for c in chunks][:-1] == [4] * (len(chunks) - 1)
    assert sum((c.token_ids for c in chunks), []) == free.token_ids[:first]
    assert chunks[-1].finished and chunks[-1].terminator == stop
    assert all(not c.finished for c in chunks[:-1])


def test_process_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    torch.manual_seed(0)
    V = 500
    logits = torch.randn(1, V) * 3
    history = torch.tensor([3, 7, 7, 11, 400])
    cfg = G.SamplingConfig(temperature=0.7, top_k=100, top_p=0.8, repetition_penalty=1.3)
    got = G.process_logits(logits.clone(), history, cfg, torch.tensor([0]), None)
    ids = history[None]
    ref = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    ref = TemperatureLogitsWarper(0.7)(ids, ref)
    ref = TopKLogitsWarper(100)(ids, ref)
    ref = TopPLogitsWarper(0.8)(ids, ref)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    keep = ~torch.isinf(ref)
    assert torch.allclose(got[keep], ref[keep], rtol=1e-6)


def test_forbidden_and_length_penalty():
    V = 50
    logits = torch.zeros(1, V)
    logits[0, 5] = 4.0
    logits[0, 9] = 3.0
    logits[0, 2] = -1.0
    cfg = G.SamplingConfig(greedy=True, repetition_penalty=1.0, length_penalty=2.0)
    out = G.process_logits(logits.clone(), torch.tensor([], dtype=torch.long), cfg, torch.tensor([9, 2]),
                           torch.tensor([5]))
    assert out[0, 5] == float("-inf") and out[0, 9] == 1.5 and out[0, 2] == -2.0
    assert G.sample_next(logits.clone(), torch.tensor([], dtype=torch.long), cfg, torch.tensor([9]),
                         torch.tensor([5]), None) == 9


def test_forbidden_ids_resolve_like_upstream(tok):
    ids = G.forbidden_token_ids(tok)
    for s in (":", "#", "@", "*", "(", ")", "[", "]", "&", "/", "$"):
        assert tok.token_to_id(s) in ids
    assert tok.special.unk in ids          # the non-ASCII strings resolve to <unk> upstream
    assert set(tok.bad_token_ids) <= set(ids)


def test_bad_arguments(llm, tok):
    with pytest.raises(InputError, match="temperature"):
        G.SamplingConfig(temperature=0)
    with pytest.raises(InputError, match="last_logits"):
        next(G.iter_generate(llm, None, torch.zeros(2, 10)))


def test_top_p_without_top_k_matches_transformers():
    from transformers.generation.logits_process import TopPLogitsWarper

    torch.manual_seed(1)
    logits = torch.randn(1, 300) * 2
    cfg = G.SamplingConfig(temperature=1.0, top_k=0, top_p=0.6, repetition_penalty=1.0)
    got = G.process_logits(logits.clone(), torch.tensor([], dtype=torch.long), cfg, torch.tensor([0]), None)
    ref = TopPLogitsWarper(0.6)(torch.zeros(1, 1, dtype=torch.long), logits.clone())
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and torch.isinf(got).sum() > 0


def _static_run(llm, tok, cfg, device="cpu", use_graph=False, **kw):
    from minicpmo_rt.thinker.decode import StaticDecoder

    cache, logits = _prefill(llm, _prompt_ids(tok))
    dec = StaticDecoder(llm, max_len=64)
    n = G.load_dynamic_cache(dec, cache)
    stepper = G.StaticStepper(dec, n, use_graph=use_graph, bucket=16)
    return G.generate(llm, None, logits.to(device), cfg, tokenizer=tok, stepper=stepper, **kw)


def test_static_kv_path_matches_plain_path(llm, tok):
    cfg = G.SamplingConfig(max_new_tokens=10, greedy=True)
    plain = _run(llm, tok, cfg)
    fast = _static_run(llm, tok, cfg)
    assert fast.token_ids == plain.token_ids
    assert rel_err(fast.hidden, plain.hidden) < 1e-5
    sampled = G.SamplingConfig(max_new_tokens=6)
    assert _static_run(llm, tok, sampled, seed=5).token_ids == _run(llm, tok, sampled, seed=5).token_ids


def test_static_stepper_rejects_full_decoder(llm):
    from minicpmo_rt.thinker.decode import StaticDecoder

    with pytest.raises(InputError, match="static decoder"):
        G.StaticStepper(StaticDecoder(llm, max_len=4), 4)


@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_path_matches_plain_path_on_gpu(tok):
    cfg_m = MiniCPMOConfig.from_dict(tiny_config())
    llm = randomize_(build_llm(cfg_m), 0, prefix="llm.").eval().cuda()
    ids = _prompt_ids(tok)
    cfg = G.SamplingConfig(max_new_tokens=20, greedy=True)
    emb = llm.model.embed_tokens(torch.tensor([ids], device="cuda"))
    with torch.no_grad():
        h, cache = final_norm_hidden(llm, emb)
        logits = llm.lm_head(h[:, -1])
    plain = G.generate(llm, cache, logits, cfg)
    from minicpmo_rt.thinker.decode import StaticDecoder

    with torch.no_grad():
        h, cache = final_norm_hidden(llm, emb)
    dec = StaticDecoder(llm, max_len=128)
    stepper = G.StaticStepper(dec, G.load_dynamic_cache(dec, cache), use_graph=True, bucket=16)
    fast = G.generate(llm, None, logits, cfg, stepper=stepper)
    assert fast.token_ids == plain.token_ids
    assert rel_err(fast.hidden, plain.hidden) < 1e-4


class _Head:
    """Generation only reads ``llm.model.norm.weight`` (to shape an empty chunk); no model runs here."""

    def __init__(self, hidden: int, device):
        self.model = type("M", (), {"norm": type("N", (), {"weight": torch.ones(hidden, device=device)})()})()


_CONFIGS = [G.SamplingConfig(repetition_penalty=1.5, chunk_size=3, repetition_window=4),
            G.SamplingConfig(temperature=1.3, top_k=0, top_p=0.7, repetition_penalty=2.0, chunk_size=4),
            G.SamplingConfig(greedy=True, repetition_penalty=3.0, length_penalty=0.5),
            G.SamplingConfig(top_k=5, top_p=1.0, repetition_penalty=1.0, max_new_tokens=6)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_draw_many_draws_what_each_generation_draws_alone(device):
    """Rows of four settings (two rows each, one group per setting), their own seeds and repetition
    histories, fed the same logits step after step: every batched draw equals the draw of a twin
    generation drawing alone, until each ends (a terminator or its token limit)."""
    torch.manual_seed(0)
    V, H, n = 64, 8, 8
    terms, forb = (60, 61), [5, 6]
    starts = torch.randn(n, V, device=device) * 3

    def make(i):
        cfg = _CONFIGS[i % len(_CONFIGS)]
        return G.Generation(_Head(H, device), starts[i:i + 1], cfg, terminators=terms, forbidden_ids=forb,
                            generator=torch.Generator(device=device).manual_seed(100 + i))

    batched, alone = [make(i) for i in range(n)], [make(i) for i in range(n)]
    torch.manual_seed(1)
    ends, steps = 0, 0
    while any(not g.done for g in batched):
        live = [i for i in range(n) if not batched[i].done]
        got = G.draw_many([batched[i] for i in live])
        for i, tok in zip(live, got):
            want = alone[i].draw()
            if isinstance(want, G.GenerationChunk):
                assert isinstance(tok, G.GenerationChunk) and tok.terminator == want.terminator
                assert tok.token_ids == want.token_ids
                ends += 1
                continue
            assert tok == want, (i, steps)
            # low logits on the repeated ids make the histories matter; terminators rise late on
            logits = torch.randn(1, V, device=device) * 3
            logits[0, list(terms)] += 0.3 * steps
            for g in (batched[i], alone[i]):
                g.feed(tok, torch.zeros(1, H, device=device), logits.clone())
        steps += 1
    assert ends >= 1 and steps > 6
    assert all(a.sampled == b.sampled for a, b in zip(batched, alone))
    assert len({tuple(g.sampled) for g in batched}) == n        # the rows really differ
    with pytest.raises(InputError, match="past its last chunk"):
        G.draw_many(batched[:1])


def test_penalize_rows_equals_the_penalty_row_by_row():
    torch.manual_seed(2)
    logits = torch.randn(4, 40)
    rows = [[3, 7, 11], [], [0], [39, 1]]
    got = logits.clone()
    G._penalize_rows(got, rows, 1.7)
    for i, r in enumerate(rows):
        want = logits[i:i + 1].clone()
        G._penalize(want, torch.tensor(r, dtype=torch.long), 1.7)
        assert torch.equal(got[i:i + 1], want)
    assert not torch.equal(got, logits)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_exponential_noise_draws_what_torch_multinomial_draws(device):
    """``argmax(p / exponential_noise(p, gens))`` is the sample ``torch.multinomial(p[i:i+1], 1, generator=
    gens[i])`` takes, row by row, on peaked and flat rows alike (the sampler relies on it to keep the random
    stream of ``torch.multinomial`` without its waiting check); a PyTorch that changes its sampler fails here."""
    torch.manual_seed(5)
    V, n = 3000, 6
    for trial in range(20):
        probs = torch.softmax(torch.randn(n, V, device=device) * (0.5 + trial), dim=-1)
        seeds = [1000 * trial + i for i in range(n)]
        noise = G.exponential_noise(probs, [torch.Generator(device=device).manual_seed(s) for s in seeds])
        got = torch.argmax(probs / noise, dim=-1).tolist()
        want = [int(torch.multinomial(probs[i:i + 1], 1, generator=torch.Generator(device=device).manual_seed(s)))
                for i, s in enumerate(seeds)]
        assert got == want
