import pytest
import torch

from minicpmo_rt.code2wav.prompt_state import PromptStateCache, prompt_key


def solver(counter, value):
    def solve():
        counter.append(value)
        return {"att": torch.full((2, 3), float(value)), "frames": value}
    return solve


def test_solved_once_and_shared_by_every_stream():
    cache, calls = PromptStateCache(capacity=1, check=True), []
    k = prompt_key(torch.ones(16000), 16000, "default")
    leases = [cache.acquire(k, solver(calls, 1)) for _ in range(5)]
    assert calls == [1] and cache.solves == 1
    assert all(lease.state is leases[0].state for lease in leases)     # shared, not copied
    assert cache.verify(k)
    leases[0].state["att"].add_(1)                                       # a stream writing in place...
    assert not cache.verify(k)                                           # ...is caught
    for lease in leases:
        lease.release()


def test_lru_evicts_only_unleased_entries():
    cache, calls = PromptStateCache(capacity=2), []
    a, b, c = (prompt_key(torch.full((8,), float(i)), 24000) for i in range(3))
    la = cache.acquire(a, solver(calls, 1))
    with cache.acquire(b, solver(calls, 2)):
        pass
    with cache.acquire(c, solver(calls, 3)):
        pass
    assert a in cache and b not in cache and c in cache                 # b was the LRU unleased entry
    with cache.acquire(b, solver(calls, 2)):
        assert len(cache) == 2 and a in cache and c not in cache        # a is leased: c goes
    la.release()
    assert calls == [1, 2, 3, 2]


def test_overflows_rather_than_dropping_live_states():
    cache, calls = PromptStateCache(capacity=1), []
    l1 = cache.acquire("v1", solver(calls, 1))
    l2 = cache.acquire("v2", solver(calls, 2))
    assert len(cache) == 2
    l1.release()
    assert "v1" not in cache and len(cache) == 1
    l2.release()


def test_key_depends_on_content_rate_and_id():
    w = torch.randn(100)
    assert prompt_key(w, 16000) == prompt_key(w.clone(), 16000)
    assert prompt_key(w, 16000) != prompt_key(w, 24000)
    assert prompt_key(w, 16000, "a") != prompt_key(w, 16000, "b")
    assert prompt_key(w, 16000) != prompt_key(w + 1e-3, 16000)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        PromptStateCache(capacity=0)
