"""Flow parity with upstream (minicpmo-utils 1.0.7 ``stepaudio2.cosyvoice2``), fp32 on CPU, tiny dims.

The same random state_dict loads strictly into ours and into upstream's classes; the noise
buffer is copied across. Measured errors are printed (``pytest -s``) and kept in ``ERRORS``.
Tolerance 1e-5: both sides run the same fp32 ops, differences are reduction-order rounding.
"""

from __future__ import annotations

import types
from types import SimpleNamespace

import pytest
import torch

from conftest import rel_err
from minicpmo_rt.checkpoint.tiny import randomize_
from minicpmo_rt.code2wav.flow import Flow, FlowCache
from minicpmo_rt.code2wav.flow_config import TINY

from upstream import import_upstream, upstream_function

TOL = 1e-5
STEPS = 10
ERRORS: dict[str, float] = {}


def check(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape, f"{name}: shape {tuple(ours.shape)} vs upstream {tuple(theirs.shape)}"
    err = rel_err(ours, theirs)
    ERRORS[name] = err
    print(f"parity {name}: rel_err={err:.3e}")
    assert err <= TOL, f"{name}: rel_err {err:.3e} > {TOL}"


def build_upstream(cfg, state: dict, noise: torch.Tensor, max_frames: int = 400):
    """Upstream flow for ``cfg`` holding ``state``; its fixed-size CUDA-oriented scratch buffers
    (sized for the full model: ~2 GB) are replaced by ones of the tiny model's shape."""
    flow_m = import_upstream("stepaudio2.cosyvoice2.flow.flow")
    cfm_m = import_upstream("stepaudio2.cosyvoice2.flow.flow_matching")
    dit_m = import_upstream("stepaudio2.cosyvoice2.flow.decoder_dit")
    enc_m = import_upstream("stepaudio2.cosyvoice2.transformer.upsample_encoder_v2")
    e, d = cfg.encoder, cfg.dit
    with torch.device("meta"):
        encoder = enc_m.UpsampleConformerEncoderV2(
            input_size=e.input_size, output_size=e.output_size, input_layer=e.input_layer,
            pre_lookahead_len=e.pre_lookahead_len, num_blocks=e.num_blocks, num_up_blocks=e.num_up_blocks,
            up_stride=e.up_stride, up_scale_factor=e.up_scale_factor, attention_heads=e.attention_heads,
            key_bias=e.key_bias, linear_units=e.linear_units, dropout_rate=e.dropout_rate,
            positional_dropout_rate=e.positional_dropout_rate, attention_dropout_rate=e.attention_dropout_rate,
            normalize_before=e.normalize_before)
        dit = dit_m.DiT(in_channels=d.in_channels, out_channels=d.out_channels, mlp_ratio=d.mlp_ratio, depth=d.depth,
                        num_heads=d.num_heads, head_dim=d.head_dim, hidden_size=d.hidden_size)
        cfm = cfm_m.CausalConditionalCFM(dit, inference_cfg_rate=cfg.decoder.inference_cfg_rate)
        flow = flow_m.CausalMaskedDiffWithXvec(input_size=cfg.input_size, output_size=cfg.output_size,
                                               spk_embed_dim=cfg.spk_embed_dim, vocab_size=cfg.vocab_size,
                                               encoder=encoder, decoder=cfm)
    flow.load_state_dict(state, strict=True, assign=True)
    for embed in (encoder.embed, encoder.up_embed):  # its rel-pos table was built on meta
        embed.pos_enc.pe = None
        embed.pos_enc.extend_pe(torch.zeros(1, 5000))
    cfm.rand_noise = noise.clone()
    dit.cnn_cache_buffer = torch.zeros(d.depth, 2, 2 * d.hidden_size, 2)
    dit.att_cache_buffer = torch.zeros(d.depth, 2, d.num_heads, max_frames, 2 * d.head_dim)
    cfm.cnn_cache_buffer = torch.zeros(STEPS, d.depth, 2, 2 * d.hidden_size, 2)
    cfm.att_cache_buffer = torch.zeros(STEPS, d.depth, 2, d.num_heads, max_frames, 2 * d.head_dim)
    # forward_chunk is wrapped in torch.compile(backend="eager") (same math, ~40 s of tracing): call it plainly.
    plain = type(encoder).forward_chunk
    plain = getattr(plain, "_torchdynamo_orig_callable", plain)
    encoder.forward_chunk = types.MethodType(plain, encoder)
    return flow.eval()


    if ERRORS:
        worst = max(ERRORS, key=ERRORS.get)
        print(f"\nflow parity: {len(ERRORS)} comparisons, max rel_err {ERRORS[worst]:.3e} ({worst})")


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    ours = Flow(TINY, noise_seed=1234).eval()
    randomize_(ours, seed=7)
    state = ours.state_dict()
    theirs = build_upstream(TINY, state, ours.decoder.rand_noise)
    return ours, theirs


def test_same_state_dict_loads_strictly_into_both(pair):
    ours, theirs = pair
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict(), strict=True)


def test_encoder_whole_and_chunked(pair):
    ours, theirs = pair
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 23, TINY.input_size, generator=gen)
    with torch.no_grad():
        check("encoder.forward", ours.encoder(x), theirs.encoder(x, torch.tensor([23]))[0])
        cache, up_cnn, up_att = None, None, None
        for i, (a, b, last) in enumerate(((0, 13, False), (10, 21, False), (18, 23, True))):
            h, cache = ours.encoder.forward_chunk(x[:, a:b], last, cache)
            h_up, up_cnn, up_att = theirs.encoder.forward_chunk(x[:, a:b], last, up_cnn, up_att)
            check(f"encoder.forward_chunk[{i}]", h, h_up)
            check(f"encoder.att_cache[{i}]", cache.att, up_att)
            check(f"encoder.cnn_cache[{i}]", cache.cnn, up_cnn)


def test_dit_forward_and_forward_chunk(pair):
    ours, theirs = pair
    gen = torch.Generator().manual_seed(2)
    est, est_up = ours.decoder.estimator, theirs.decoder.estimator

    def inputs(frames):
        return [torch.randn(2, 80, frames, generator=gen) for _ in range(3)]

    spk, t = torch.randn(2, 80, generator=gen), torch.tensor([0.37, 0.37])
    with torch.no_grad():
        x, mu, cond = inputs(31)
        check("dit.forward", est(x, None, mu, t, spk, cond), est_up(x, torch.ones(2, 1, 31), mu, t, spk, cond))
        cnn = att = cnn_up = att_up = None
        for i, frames in enumerate((24, 12, 7)):
            x, mu, cond = inputs(frames)
            v, cnn, att = est.forward_chunk(x, mu, t, spk, cond, cnn, att)
            v_up, cnn_up, att_up = est_up.forward_chunk(x, mu, t, spk, cond, cnn_up, att_up)
            cnn_up, att_up = cnn_up.clone(), att_up.clone()  # upstream returns views of its scratch buffers
            check(f"dit.forward_chunk[{i}]", v, v_up)
            check(f"dit.att_cache[{i}]", att, att_up)
            check(f"dit.cnn_cache[{i}]", cnn, cnn_up)


def test_cfm_full_solve_same_noise(pair):
    ours, theirs = pair
    gen = torch.Generator().manual_seed(3)
    mu, cond = torch.randn(1, 80, 44, generator=gen), torch.randn(1, 80, 44, generator=gen)
    cond[:, :, 20:] = 0
    spk = torch.randn(1, 80, generator=gen)
    with torch.no_grad():
        ours_mel = ours.decoder(mu, None, spk, cond, n_timesteps=STEPS)
        theirs_mel = theirs.decoder(mu, torch.ones(1, 1, 44), spk, cond, n_timesteps=STEPS)
    check("cfm.forward(10 steps)", ours_mel, theirs_mel)


def test_flow_inference_whole_utterance(pair):
    ours, theirs = pair
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 6561, (1, 15), generator=gen)
    tokens = torch.randint(0, 6561, (1, 22), generator=gen)
    prompt_mel = torch.randn(1, 30, 80, generator=gen)
    spk = torch.randn(1, 192, generator=gen)
    mel = ours.inference(tokens, prompt, prompt_mel, spk, n_timesteps=STEPS)
    mel_up = theirs.inference(tokens.int(), torch.tensor([22]), prompt.int(), torch.tensor([15]), prompt_mel,
                              torch.tensor([30]), spk, n_timesteps=STEPS)
    assert mel.shape == (1, 80, 44)
    check("flow.inference", mel, mel_up)


def _upstream_trimmers():
    trim_est = upstream_function("token2wav.py", "Token2wav._trim_estimator_cache", {"torch": torch})
    trim_conf = upstream_function("token2wav.py", "Token2wav._trim_conformer_cache", {"torch": torch})
    return trim_est, trim_conf


def test_setup_cache_and_three_chunk_stream_with_trimming(pair):
    ours, theirs = pair
    trim_est, trim_conf = _upstream_trimmers()
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 6561, (1, 20), generator=gen)
    prompt_mel = torch.randn(1, 40, 80, generator=gen)
    spk = torch.randn(1, 192, generator=gen)
    codes = torch.randint(0, 6561, (1, 90), generator=gen)
    setup_tokens = torch.cat([prompt, prompt[:, :3]], dim=1)  # upstream Token2wav.set_stream_cache

    cache = ours.setup_cache(setup_tokens, prompt_mel, spk, n_timesteps=STEPS)
    up_cache = theirs.setup_cache(setup_tokens.int(), prompt_mel, spk, n_timesteps=STEPS)
    up_cache = {k: v.clone() for k, v in up_cache.items()}
    host = SimpleNamespace(stream_cache=up_cache, flow=theirs, CONFORMER_HISTORY_FRAMES=100)
    _compare_cache("setup", cache, host.stream_cache)

    # 40 new tokens + 3 lookahead per chunk: after chunk 2 the caches pass prompt+100 = 140
    # frames and are trimmed, so chunk 3 runs on trimmed caches.
    chunks = ((0, 43, False), (40, 83, False), (80, 90, True))
    trimmed = False
    for i, (a, b, last) in enumerate(chunks):
        mel, cache = ours.inference_chunk(codes[:, a:b], spk, cache, last_chunk=last)
        mel_up, host.stream_cache = theirs.inference_chunk(codes[:, a:b].int(), spk, host.stream_cache,
                                                           last_chunk=last, n_timesteps=STEPS)
        host.stream_cache = {k: v.clone() for k, v in host.stream_cache.items()}
        trim_est(host, prompt_mel.shape[1])
        trim_conf(host, prompt_mel.shape[1])
        check(f"stream.mel[{i}]", mel, mel_up)
        _compare_cache(f"stream[{i}]", cache, host.stream_cache)
        trimmed |= cache.estimator_frames == 140
    assert trimmed and cache.conformer_att.shape[3] == 140, "the stream never exercised cache trimming"


def _compare_cache(where: str, cache: FlowCache, up: dict) -> None:
    check(f"{where}.conformer_cnn", cache.conformer_cnn, up["conformer_cnn_cache"])
    check(f"{where}.conformer_att", cache.conformer_att, up["conformer_att_cache"])
    check(f"{where}.estimator_cnn", cache.estimator_cnn, up["estimator_cnn_cache"])
    check(f"{where}.estimator_att", cache.estimator_att, up["estimator_att_cache"])


def test_prompt_cache_is_shareable(pair):
    """One setup_cache seeds several streams: a stream never mutates the cache it was given."""
    ours, _ = pair
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 6561, (1, 12), generator=gen)
    spk = torch.randn(1, 192, generator=gen)
    cache = ours.setup_cache(torch.cat([prompt, prompt[:, :3]], 1), torch.randn(1, 24, 80, generator=gen), spk,
                             n_timesteps=3)
    before = cache.clone()
    codes = torch.randint(0, 6561, (1, 28), generator=gen)
    first, _ = ours.inference_chunk(codes, spk, cache)
    second, _ = ours.inference_chunk(codes, spk, cache)
    assert torch.equal(first, second) and first.shape == (1, 80, 50)
    for name in ("conformer_cnn", "conformer_att", "estimator_cnn", "estimator_att"):
        assert torch.equal(getattr(cache, name), getattr(before, name)), name
