"""The FP16 range certificate (``operand_range``): every GEMM operand a solve produces lies within its bound,
whatever the input; weights that could overflow FP16 fail it; the solver's knobs take FP16 operands from it."""

import logging
import math

import pytest
import torch

from minicpmo_rt.code2wav.cfm import cosine_t_span
from minicpmo_rt.code2wav.dit import DiT
from minicpmo_rt.code2wav.flow_config import TINY
from minicpmo_rt.code2wav.operand_range import FP16_MAX, ROLES, operand_range

from conftest import ieee_cudnn, rel_err, requires_cuda
from test_euler_graph import GraphConfig, S, chunk, reference, tiny_cfm
from test_fused_dit import randomize


def _operands_seen(dit: DiT, scale: float, chunks: int = 3, frames: int = 7, steps: int = 4, seed: int = 0):
    """Largest |input| each GEMM role received over ``chunks`` streamed chunks of a ``steps``-step solve (caches
    per step, as the streaming solver keeps them), on inputs ``scale`` times a standard normal draw."""
    seen = dict.fromkeys(ROLES, 0.0)
    blk_mods = []
    for blk in dit.blocks:
        mods = {"qkv": blk.attn.to_v, "proj": blk.attn.proj, "conv1": blk.conv.block[1], "conv2": blk.conv.block[6],
                "fc1": blk.mlp.fc1, "fc2": blk.mlp.fc2}
        for role, m in mods.items():
            def hook(_m, args, role=role):
                seen[role] = max(seen[role], float(args[0].abs().max()))
            blk_mods.append(m.register_forward_pre_hook(hook))
    g = torch.Generator().manual_seed(seed)
    n = dit.out_channels
    t_span = cosine_t_span(steps, torch.device("cpu"), torch.float32)
    cnn, att = [None] * steps, [None] * steps
    spks = scale * torch.randn(1, n, generator=g)
    with torch.no_grad():
        for _ in range(chunks):
            mu, cond = scale * torch.randn(1, n, frames, generator=g), scale * torch.randn(1, n, frames, generator=g)
            for s in range(steps):
                x = scale * torch.randn(1, n, frames, generator=g)
                _, cnn[s], att[s] = dit.forward_chunk(x, mu, t_span[s:s + 1], spks, cond, cnn[s], att[s])
    for h in blk_mods:
        h.remove()
    return seen


@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_every_operand_stays_within_its_bound(scale):
    """Streamed chunks through the original body, inputs of any scale (the LayerNorms remove it): each role's
    largest operand is within the certificate's bound for that step count, and not absurdly below it (the
    bound is of the size the operands reach, so a certificate that fits is not fitting by luck)."""
    dit = randomize(DiT(TINY.decoder.estimator), seed=3)
    rng = operand_range(dit, n_timesteps=4)
    seen = _operands_seen(dit, scale)
    for role in ROLES:
        assert 0 < seen[role] <= rng.activations[role], (role, seen[role], rng.activations[role])
    assert seen["qkv"] > rng.activations["qkv"] / 20      # the LN's sqrt(C - 1) peak is not reached by chance
    assert rng.fits_fp16 and "fit FP16" in rng.describe()


@torch.no_grad()
def test_the_bound_is_reached_by_a_one_hot_frame():
    """A frame that is one channel (the LN's extreme case: sqrt(C - 1) in that channel) makes the QKV operand
    come within 1% of its bound at the step and channel where the modulation peaks: the LN part is tight."""
    dit = randomize(DiT(TINY.decoder.estimator), seed=5)
    for p in (dit.in_proj.weight, dit.in_proj.bias):
        p.data.zero_()
    rng = operand_range(dit, n_timesteps=1)
    blk = dit.blocks[0]
    C = dit.in_proj.out_features
    sh, sc = blk.adaLN_modulation(dit.t_embedder(torch.zeros(1))).chunk(9, -1)[:2]
    j = int((math.sqrt(C - 1) * (1 + sc).abs() + sh.abs()).argmax())
    sign = 1.0 if float((1 + sc)[0, j]) * float(sh[0, j]) >= 0 else -1.0
    x = torch.zeros(1, 1, C)
    x[0, 0, j] = sign
    got = float((blk.norm1(x) * (1 + sc) + sh).abs().max())
    assert got <= rng.activations["qkv"] and got > 0.99 * float((math.sqrt(C - 1) * (1 + sc).abs() + sh.abs()).max())


@pytest.mark.parametrize("where", ["modulation", "weight", "nan"])
def test_weights_that_could_overflow_fp16_fail_the_certificate(where):
    dit = randomize(DiT(TINY.decoder.estimator), seed=3)
    with torch.no_grad():
        if where == "modulation":     # a scale of ~1e4 times a normalised value of up to sqrt(C - 1)
            dit.blocks[1].adaLN_modulation[1].weight.mul_(1e4)
        elif where == "weight":
            dit.blocks[0].mlp.fc2.weight[0, 0] = 7e4
        else:
            dit.blocks[0].attn.to_v.weight[0, 0] = float("nan")
    rng = operand_range(dit, n_timesteps=10)
    assert not rng.fits_fp16 and "do not fit" in rng.describe()
    role, value = rng.largest
    assert value > FP16_MAX and role == {"modulation": role, "weight": "weights", "nan": "proj"}[where]


def test_bad_step_count_is_refused():
    with pytest.raises(ValueError, match="n_timesteps"):
        operand_range(randomize(DiT(TINY.decoder.estimator), seed=3), n_timesteps=0)


def test_no_certificate_off_cuda(caplog):
    """On the CPU no certificate is computed and the GEMM operands stay FP32 (the knob resolution with a
    certificate is tested in test_knobs.py through ``operands_fit_fp16``)."""
    from minicpmo_rt.code2wav.euler_graph import solver_from_knobs

    with caplog.at_level(logging.INFO):
        _, choice = solver_from_knobs(tiny_cfm(), {"cfm_fused_body": True}, "cpu", n_timesteps=S, env={})
    assert choice.gemm_operands == "fp32" and "FP16 (largest bound" not in caplog.text


@requires_cuda
def test_cuda_default_takes_fp16_operands_where_the_certificate_fits(caplog):
    """CUDA, no knobs: the tiny random DiT's certificate fits, so the solver's fused TF32 path stores its GEMM
    operands as FP16 (logged with the bound); ``cfm_fp16_operands: false`` keeps FP32. Both solves meet the
    TF32 tolerance against the IEEE reference, and they differ from each other by TF32-sized rounding only
    (the products are the same; the sums' order and FP16's subnormals are what may differ)."""
    from minicpmo_rt.code2wav.euler_graph import solver_from_knobs
    from minicpmo_rt.code2wav.precision import matmul_tf32

    cfm = tiny_cfm(seed=6, mild=True).cuda()
    cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(6,), offset_bucket=4, offset_anchor=8)
    kw = chunk(3, 5, 7, seed=10, device="cuda")
    with ieee_cudnn(), matmul_tf32(False):
        ref = reference(cfm, kw)
    got = {}
    for knob in (None, False):
        extra = {} if knob is None else {"cfm_fp16_operands": knob}
        with caplog.at_level(logging.INFO):
            solver, choice = solver_from_knobs(cfm, extra, "cuda", config=cfg, n_timesteps=S, env={})
        assert choice.gemm_operands == ("fp16" if knob is None else "fp32"), choice.reason
        got[knob] = solver.solve(**kw)
        assert max(rel_err(g, r) for g, r in zip(got[knob], ref)) <= 1e-3
    assert "GEMM operands fit FP16" in caplog.text
    assert max(rel_err(a, b) for a, b in zip(got[None], got[False])) <= 1e-3
