"""The duplex decode policy (upstream StreamDecoder.decode) on constructed logits, rule by rule."""

import pytest
import torch

from minicpmo_rt.errors import InputError
from minicpmo_rt.thinker.duplex import DuplexDecodeConfig, DuplexDecoder, decode_many, top_k_top_p

V = 151748   # the real vocabulary (tiny checkpoints keep it)
A, B = 1000, 2000


def _logits(**vals) -> torch.Tensor:
    x = torch.full((V,), -20.0)
    for k, v in vals.items():
        x[int(k[1:])] = v
    return x


def _greedy(tok, **kw) -> DuplexDecoder:
    return DuplexDecoder(tok, DuplexDecodeConfig(mode="greedy", **kw))


def test_raw_chunk_eos_wins_before_any_rule(tok):
    d = _greedy(tok)
    ce = tok.special.chunk_eos
    assert d.decode(_logits(**{f"t{ce}": 5.0, f"t{A}": 4.9})) == ce
    assert d.history == []     # upstream returns before recording it


def test_forbidden_ids_and_chunk_eos_are_masked_after_the_raw_draw(tok):
    d = _greedy(tok)
    sp = tok.special
    bad = tok.bad_token_ids[0]
    x = _logits(**{f"t{sp.tts_pad}": 9.0, f"t{sp.chunk_eos}": 8.0, f"t{bad}": 7.0, f"t{A}": 1.0})
    assert d.decode(x) == A
    assert d.history == [A]


def test_repetition_penalty_divides_every_recent_logit_whatever_its_sign(tok):
    """Upstream divides a negative logit too, which raises it: a repeated id with -1.0 beats a
    fresh id at -0.96 after the penalty (-1/1.05 = -0.952)."""
    d = _greedy(tok, length_penalty=1.0)
    d.history = [A]
    assert d.decode(_logits(**{f"t{A}": -1.0, f"t{B}": -0.96})) == A
    d2 = _greedy(tok, length_penalty=1.0, repetition_penalty=1.0)
    d2.history = [A]
    assert d2.decode(_logits(**{f"t{A}": -1.0, f"t{B}": -0.96})) == B
    d3 = _greedy(tok, length_penalty=1.0)
    d3.history = [A]
    assert d3.decode(_logits(**{f"t{A}": 1.0, f"t{B}": 0.96})) == B      # 1/1.05 = 0.952 < 0.96


def test_repetition_window_counts_only_the_last_ids(tok):
    d = _greedy(tok, length_penalty=1.0, repetition_window=2)
    d.history = [A, B, B]          # A fell out of the 2-id window
    assert d.decode(_logits(**{f"t{A}": 1.0, f"t{B}": 1.0 * 1.04})) == A


@pytest.mark.parametrize("value,expect", [(2.0, 2.0 / 1.1), (-2.0, -2.0 * 1.1)])
def test_length_penalty_always_suppresses_turn_eos(tok, value, expect):
    te = tok.special.turn_eos
    just_below, just_above = expect - 1e-3, expect + 1e-3
    assert _greedy(tok).decode(_logits(**{f"t{te}": value, f"t{A}": just_below})) == te
    assert _greedy(tok).decode(_logits(**{f"t{te}": value, f"t{B}": just_above})) == B


def test_listen_rules_act_on_the_tokenizers_eos_token_as_upstream(tok):
    d = _greedy(tok, listen_top_k=3)
    im_end = tok.special.im_end
    assert d.listen_rule_id == im_end
    got = d.decode(_logits(**{f"t{A}": 3.0, f"t{B}": 2.0, f"t{im_end}": 1.0}))
    assert got == im_end and d.history == []     # in the top 3: returned at once, not recorded
    d = _greedy(tok, listen_prob_scale=10.0)
    assert d.decode(_logits(**{f"t{A}": 3.0, f"t{im_end}": 1.0})) == im_end


def test_top_k_top_p_keeps_the_nucleus_and_the_crossing_token():
    x = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    p = torch.softmax(x, 0)
    kept = torch.isfinite(top_k_top_p(x, 0, float(p[0] + p[1] - 1e-4)))
    assert kept.tolist() == [True, True, False, False, False]
    assert torch.isfinite(top_k_top_p(x, 3, 1.0)).tolist() == [True, True, True, False, False]
    assert torch.isfinite(top_k_top_p(x, 0, 1.0)).all()


def test_sampling_is_reproducible_and_stays_in_the_top_k(tok):
    x = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 3
    top = set(torch.topk(x, 20).indices.tolist())

    def run(seed):
        d = DuplexDecoder(tok, DuplexDecodeConfig(), torch.Generator().manual_seed(seed))
        return [d.decode(x) for _ in range(30)]

    a, b = run(1), run(1)
    assert a == b and len(set(a)) > 1
    # every draw past the raw chunk_eos check is one of the 20 best (after the penalties)
    assert all(t in top or t == tok.special.chunk_eos for t in a)


@pytest.mark.parametrize("kw,match", [({"mode": "beam"}, "mode"), ({"temperature": 0.0}, "temperature"),
                                      ({"top_p": 0.0}, "top_p"), ({"max_steps": 0}, "max_steps"),
                                      ({"force_listen_units": -1}, "force_listen_units")])
def test_bad_configs_are_named(kw, match):
    with pytest.raises(InputError, match=match):
        DuplexDecodeConfig(**kw)


def test_nucleus_sorts_only_the_top_k_and_keeps_ties_with_the_kth():
    """The top-k fast path (only the kept values sorted) keeps what sorting the whole vector keeps: the
    k best plus any tie with the k-th value, then the top-p prefix, by descending value."""
    from minicpmo_rt.thinker.duplex import nucleus

    x = torch.tensor([0.5, 3.0, 2.0, 2.0, -1.0, 2.0, float("-inf")])
    ids, vals = nucleus(x, 2, 1.0)
    assert ids.tolist()[0] == 1 and sorted(ids.tolist()) == [1, 2, 3, 5] and vals.tolist() == [3.0, 2.0, 2.0, 2.0]
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        y = torch.randn(500, generator=g) * 2
        for k, p in ((20, 0.8), (0, 0.8), (7, 0.3), (500, 1.0)):
            ids, vals = nucleus(y, k, p)
            ref = y.clone()
            if k:
                ref[ref < torch.topk(ref, k).values[-1]] = float("-inf")
            sv, order = torch.sort(ref, descending=True)
            cum = torch.cumsum(torch.softmax(sv, 0), 0)
            n_keep = int((cum <= p).sum()) + 1 if p < 1.0 else int(torch.isfinite(sv).sum())
            assert ids.tolist() == order[:min(n_keep, int(torch.isfinite(sv).sum()))].tolist()
            assert torch.equal(vals, y[ids])


def test_sampling_draws_follow_the_nucleus_and_the_raw_chunk_eos_odds(tok):
    """Sampling draws with the distribution upstream's draws have: the raw draw stops at <|chunk_eos|> at
    its softmax probability (here 0.25), and the rest follow the softmax of the temperature-scaled
    nucleus. 1200 draws; the bounds are 5 standard errors."""
    ce = tok.special.chunk_eos
    others = [A, B, 3000, 4000]
    x = torch.linspace(-80.0, -60.0, V)     # distinct: no tie with the 20th value (ties would all be kept)
    x[ce] = 0.0
    x[others] = torch.log(torch.tensor([1.0, 1.0, 0.5, 0.5]))   # chunk_eos: 1 / (1 + 3) of the raw mass
    d = DuplexDecoder(tok, DuplexDecodeConfig(temperature=1.0, top_k=20, top_p=1.0, repetition_penalty=1.0,
                                              length_penalty=1.0), torch.Generator().manual_seed(5))
    n = 1200
    got = torch.tensor([d.decode(x) for _ in range(n)])
    assert abs(float((got == ce).float().mean()) - 0.25) < 5 * (0.25 * 0.75 / n) ** 0.5
    rest = got[got != ce]
    want = torch.tensor([1.0, 1.0, 0.5, 0.5]) / 3.0
    freq = torch.stack([(rest == t).float().mean() for t in others])
    assert set(rest.tolist()) <= set(others)
    assert (freq - want).abs().max() < 5 * (1 / 3 * 2 / 3 / len(rest)) ** 0.5


# ---- decode_many: every conversation's policy in one pass ------------------------------------------------

def _steps_logits(seed: int, n: int, tok, device="cpu") -> list[torch.Tensor]:
    """n rows of LM-head-like logits, rounded through bf16 as the model's head is (so many values tie), some
    rows with the raw draw's <|chunk_eos|> or the listen rule's eos near the top."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, V, generator=g) * 3).to(torch.bfloat16).float()
    ce = tok.special.chunk_eos
    x[0, ce] = x[0].max() + 0.5          # row 0's raw argmax
    x[1, A] = x[1].max() + 0.02          # row 1's best, unless its history's penalty pulls it down
    x[1, ce] = torch.logsumexp(x[1], 0) + (0.4 if seed % 2 else -0.4)    # sampling's raw draw: p ~0.6 / ~0.4
    if n > 2:
        x[2, tok.special.im_end] = x[2].max()                  # the listen rule's id, tied with the best
        x[2, tok.special.chunk_eos] = x[2].max() - 1.0          # likely in sampling's raw draw
    if n > 3:
        x[3, tok.special.turn_eos] = x[3].max() + 0.05         # the best unless the length penalty acts
    return [r.to(device) for r in x]


def _twins(tok, configs, seeds):
    mk = lambda: [DuplexDecoder(tok, c, torch.Generator().manual_seed(s)) for c, s in zip(configs, seeds)]  # noqa: E731
    return mk(), mk()


CONFIGS = [DuplexDecodeConfig(mode="greedy"), DuplexDecodeConfig(),
           DuplexDecodeConfig(mode="greedy", repetition_penalty=0.9, length_penalty=0.8, listen_prob_scale=1.3),
           DuplexDecodeConfig(temperature=1.3, top_k=5, top_p=0.95, repetition_penalty=1.2, listen_top_k=3,
                              repetition_window=4),
           DuplexDecodeConfig(mode="greedy", listen_top_k=2, repetition_penalty=1.0, length_penalty=1.0),
           DuplexDecodeConfig(top_k=0, top_p=0.5)]


@pytest.mark.parametrize("config", CONFIGS, ids=["greedy", "sampling", "greedy-penalties-below-1",
                                                 "sampling-topk5-listen", "greedy-listen-topk", "sampling-topk0"])
def test_decode_many_gives_each_decoders_own_tokens_histories_and_draws(tok, config):
    """Four conversations over 12 steps: ``decode_many`` returns ``decode``'s token for every row, leaves the
    same history and the same generator state (so the next draws agree too), bit for bit on the CPU. The
    rows start with different histories, one of them empty."""
    seeds = [3, 4, 5, 6]
    batch, alone = _twins(tok, [config] * 4, seeds)
    for b, a, h in zip(batch, alone, ([], [A], [A, B, 7, 7], list(range(100, 140)))):
        b.history, a.history = list(h), list(h)
    seen = set()
    for step in range(12):
        rows = _steps_logits(step, 4, tok)
        got = decode_many(batch, rows)
        want = [d.decode(r) for d, r in zip(alone, rows)]
        assert got == want, step
        seen.update(want)
        for b, a in zip(batch, alone):
            assert b.history == a.history
            assert torch.equal(b.generator.get_state(), a.generator.get_state())
    assert len(seen) >= 3    # the steps exercised several outcomes


def test_decode_many_groups_rows_of_different_settings(tok):
    """Rows of several configs in one call: each goes through its own settings, in the callers' order. Decoders
    built apart (each with its own forbidden-id tensor) share a pass when their settings are equal, and a
    decoder whose forbidden ids differ gets a pass of its own."""
    from minicpmo_rt.thinker.duplex import policy_groups

    configs = CONFIGS[:4] + CONFIGS[:2]
    batch, alone = _twins(tok, configs, range(len(configs)))
    assert sorted(policy_groups(batch)) == [[0, 4], [1, 5], [2], [3]]
    odd = DuplexDecoder(tok, CONFIGS[0])
    odd.forbidden = odd.forbidden[:-1]
    assert sorted(policy_groups(batch[:1] + [odd] + batch[4:5])) == [[0, 2], [1]]
    for step in range(6):
        rows = _steps_logits(50 + step, len(configs), tok)
        assert decode_many(batch, rows) == [d.decode(r) for d, r in zip(alone, rows)], step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", CONFIGS[:4], ids=["greedy", "sampling", "greedy-penalties-below-1",
                                                     "sampling-topk5-listen"])
def test_decode_many_on_cuda_gives_the_host_decoders_tokens(tok, config):
    """The same rows on the GPU: every operation is the host's IEEE one (divisions by device tensors), so the
    tokens and histories equal ``decode``'s on the host. Sampling's raw draw takes the device's log-sum-exp,
    which may differ in its last bits: a Bernoulli draw within that of its probability would flip (odds
    ~1e-7 per draw; 48 draws here)."""
    batch, alone = _twins(tok, [config] * 4, [11, 12, 13, 14])
    for step in range(12):
        rows = _steps_logits(100 + step, 4, tok)
        assert decode_many(batch, [r.cuda() for r in rows]) == [d.decode(r) for d, r in zip(alone, rows)], step
        assert [b.history for b in batch] == [a.history for a in alone]
