"""The on-device batched sampler against a plain per-row reference built from
transformers' own top-p/top-k warpers and the official penalty formula."""

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from minicpmo_rt.talker.sampler import (SamplingParams, SlotState, penalize, process_logits, sample_step,
                                        uniform)

V, EOS = 6562, 6561


def reference_process(logits, history, step, params):
    x = logits.float() / params.temperature
    if step > 0:
        hist = [h for h in history if h >= 0][-params.window:]
        if hist:
            freq = torch.nn.functional.one_hot(torch.tensor(hist), V).sum(0).float()
            alpha = params.repetition_penalty ** freq
            x = torch.where(x < 0, x * alpha, x / alpha)
        x = TopPLogitsWarper(params.top_p, min_tokens_to_keep=params.min_keep)(None, x[None])[0]
        x = TopKLogitsWarper(params.top_k, min_tokens_to_keep=params.min_keep)(None, x[None])[0]
    if step < params.min_codes:
        x[EOS] = float("-inf")
    return x


@pytest.mark.parametrize("step", [0, 1, 7, 60])
def test_process_matches_reference(step):
    params = SamplingParams(min_codes=50)
    g = torch.Generator().manual_seed(step)
    B = 4
    logits = torch.randn(B, V, generator=g) * 3
    st = SlotState(B, params.window)
    for b in range(B):
        st.admit(b, seed=b, limit=100, min_codes=params.min_codes)
    st.step.fill_(step)
    hist = torch.randint(0, 50, (B, params.window), generator=g)  # repeats, so the penalty matters
    hist[:, : max(0, params.window - step)] = -1
    st.history.copy_(hist)
    got = process_logits(logits, st, params, EOS)
    for b in range(B):
        ref = reference_process(logits[b], hist[b].tolist(), step, params)
        assert torch.equal(torch.isinf(got[b]), torch.isinf(ref))
        fin = torch.isfinite(ref)
        assert torch.allclose(got[b][fin], ref[fin], rtol=1e-6, atol=1e-6)
    if step > 0:
        assert int(torch.isfinite(got[0]).sum()) <= params.top_k


def test_penalty_formula():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    hist = torch.tensor([[0, 0, 1, -1]])
    out = penalize(logits, hist, 1.5)
    assert torch.allclose(out, torch.tensor([[2.0 / 2.25, -3.0, 1.0, 0.5]]))


def test_draw_distribution_matches_probabilities():
    """Gumbel draws from the counter RNG follow softmax(logits) (chi-square-ish check)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    n = 4000
    u = uniform(torch.arange(n), torch.zeros(n, dtype=torch.long), 4)
    draws = torch.argmax(logits[None].double() - torch.log(-torch.log(u)), -1)
    freq = torch.bincount(draws, minlength=4).double() / n
    assert torch.allclose(freq, probs.double(), atol=0.03), freq


def test_eos_rules_and_slots_finishing_at_different_steps():
    params = SamplingParams(min_codes=3, max_codes=100, top_k=25)
    B = 3
    st = SlotState(B, params.window)
    st.admit(0, seed=1, limit=100, min_codes=3)
    st.admit(1, seed=2, limit=5, min_codes=3)  # stops by its limit
    st.admit(2, seed=3, limit=100, min_codes=3)  # EOS made overwhelmingly likely -> stops at step 3
    logits = torch.zeros(B, V)
    logits[2, EOS] = 50.0
    seen = []
    for t in range(8):
        codes = sample_step(logits, st, params, EOS)
        seen.append(codes.tolist())
        if t < 3:
            assert (codes != EOS).all(), "EOS must be masked before min_codes"
    assert seen[3][2] == EOS and st.finished[2]
    assert int(st.step[1]) == 5 and st.finished[1] and seen[5][1] == EOS  # idle after finishing
    assert not st.finished[0] and int(st.step[0]) == 8
    assert all(row[2] == EOS for row in seen[4:])


def test_reproducible_per_seed_and_independent_of_batch():
    params = SamplingParams(min_codes=0)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0))

    def run(batch_seeds):
        st = SlotState(len(batch_seeds), params.window)
        for i, s in enumerate(batch_seeds):
            st.admit(i, seed=s, limit=50, min_codes=0)
        out = [sample_step(logits.expand(len(batch_seeds), V), st, params, EOS) for _ in range(10)]
        return torch.stack(out, 1)

    a = run([11])
    b = run([5, 11, 7])
    assert torch.equal(a[0], b[1])
    assert not torch.equal(b[0], b[1])


def test_admit_many_resets_only_its_slots_as_admit_does():
    """``SlotState.admit_many`` (one admission's requests together, the engine's path) leaves the same state as
    ``admit`` per slot, on rows that have run and finished, and touches no other row; seeds are masked to 32
    bits as ``admit`` masks them."""
    params = SamplingParams(min_codes=0, max_codes=100)
    one, many = SlotState(4, params.window), SlotState(4, params.window)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    for st in (one, many):
        for slot in range(4):
            st.admit(slot, seed=slot, limit=3, min_codes=0)
        for _ in range(5):
            sample_step(logits, st, params, EOS)
    before = {k: getattr(many, k).clone() for k in ("step", "finished", "limit", "min_codes", "seed", "history")}
    seeds, limits = [7, (1 << 40) + 5], [50, 9]
    for slot, seed, limit in zip((3, 1), seeds, limits):
        one.admit(slot, seed, limit, min_codes=4)
    many.admit_many([3, 1], seeds, limits, min_codes=4)
    for k, was in before.items():
        a, b = getattr(one, k), getattr(many, k)
        assert torch.equal(a, b), k
        assert torch.equal(b[[0, 2]], was[[0, 2]]), k
    assert many.seed[1] == 5 and many.limit[3] == 50 and not many.finished[[1, 3]].any()
    assert (many.history[[1, 3]] == -1).all() and (many.step[[1, 3]] == 0).all()
