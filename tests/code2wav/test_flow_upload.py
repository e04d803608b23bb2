"""Codes reach the flow's device without stopping the host: ``Flow.to_device`` and ``encode_chunk`` taking
host codes (checked on the host, uploaded through pinned staging)."""

import time

import pytest
import torch

from conftest import requires_cuda
from minicpmo_rt.checkpoint.tiny import randomize_
from minicpmo_rt.code2wav.flow import Flow
from minicpmo_rt.code2wav.flow_config import TINY
from minicpmo_rt.errors import InputError


def tiny_flow(device="cpu"):
    flow = Flow(TINY, noise_seed=3)
    randomize_(flow, 5)
    return flow.to(device).eval()


def test_host_codes_are_checked_on_the_host_and_encode_like_device_codes():
    """On a CPU model a host tensor is passed through as it is; codes out of range are refused by name before
    anything runs, wherever the codes are."""
    flow = tiny_flow()
    tok = torch.randint(0, TINY.vocab_size, (1, 8))
    assert flow.to_device(tok) is tok
    cache = flow.setup_cache(torch.randint(0, TINY.vocab_size, (1, 15)), torch.randn(1, 24, 80),
                             torch.randn(1, TINY.spk_embed_dim), n_timesteps=2)
    spk = torch.randn(1, TINY.spk_embed_dim)
    with pytest.raises(InputError, match="codes must lie in"):
        flow.encode_chunk(torch.full((1, 8), TINY.vocab_size), spk, cache.encoder)


@requires_cuda
def test_cuda_host_codes_go_up_without_waiting_for_the_device():
    """With a long kernel queued, uploading host codes returns before it ends (a copy from pageable memory
    would wait for it), and the codes arrive intact; ``encode_chunk`` on host codes equals it on device codes
    bit for bit."""
    flow = tiny_flow("cuda")
    tok = torch.randint(0, TINY.vocab_size, (4, 28))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)        # ~1 s of spinning on the device
    t0 = time.perf_counter()
    up = flow.to_device(tok)
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert host_s < 0.2, host_s
    assert up.device.type == "cuda" and torch.equal(up.cpu(), tok)
    with torch.inference_mode():
        cache = flow.setup_cache(torch.randint(0, TINY.vocab_size, (1, 15)).cuda(), torch.randn(1, 24, 80).cuda(),
                                 torch.randn(1, TINY.spk_embed_dim).cuda(), n_timesteps=2)
        spk = torch.randn(1, TINY.spk_embed_dim).cuda()
        a = flow.encode_chunk(tok[:1], spk, cache.encoder)
        b = flow.encode_chunk(tok[:1].cuda(), spk, cache.encoder)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2].att, b[2].att)
