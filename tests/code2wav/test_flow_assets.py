"""flow.yaml + flow.pt assets: tiny writer, strict loading, registry/manifest, input errors."""

from __future__ import annotations

import pytest
import torch

from minicpmo_rt.code2wav.flow import load_flow, write_tiny_flow
from minicpmo_rt.code2wav.flow_config import TINY, read_flow_yaml
from minicpmo_rt.errors import CheckpointError, InputError, StrictLoadError



@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("token2wav")
    write_tiny_flow(d, seed=3)
    return d


def test_tiny_writer_and_strict_load(tiny_assets):
    assert read_flow_yaml(tiny_assets / "flow.yaml") == TINY
    state = torch.load(tiny_assets / "flow.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in state.values())
    flow = load_flow(tiny_assets)
    for k, v in flow.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert flow.decoder.rand_noise.shape == (1, 80, 30000) and flow.decoder.rand_noise.device.type == "cpu"
    # The noise is deterministic across processes/builds (seeded, not from the global RNG).
    torch.manual_seed(999)
    assert torch.equal(load_flow(tiny_assets).decoder.rand_noise, flow.decoder.rand_noise)


def test_rejects_missing_extra_and_mismatched_keys_listing_all(tiny_assets, tmp_path):
    (tmp_path / "flow.yaml").write_text((tiny_assets / "flow.yaml").read_text())
    state = torch.load(tiny_assets / "flow.pt", weights_only=True)
    del state["encoder.after_norm.bias"]
    del state["decoder.estimator.blocks.1.attn.to_q.weight"]
    state["decoder.estimator.extra.weight"] = torch.zeros(3)
    state["encoder_proj.weight"] = torch.zeros(80, 7)
    torch.save(state, tmp_path / "flow.pt")
    with pytest.raises(StrictLoadError) as exc:
        load_flow(tmp_path)
    msg = str(exc.value)
    assert str(tmp_path / "flow.pt") in msg
    for key in ("encoder.after_norm.bias", "decoder.estimator.blocks.1.attn.to_q.weight",
                "decoder.estimator.extra.weight", "encoder_proj.weight"):
        assert key in msg, key
    assert "2 missing, 1 unexpected, 1 shape-mismatched" in msg


@pytest.mark.parametrize("absent", ["flow.yaml", "flow.pt"])
def test_missing_asset_file_is_named(tiny_assets, tmp_path, absent):
    for name in ("flow.yaml", "flow.pt"):
        if name != absent:
            (tmp_path / name).write_bytes((tiny_assets / name).read_bytes())
    with pytest.raises(CheckpointError, match=f"{absent}: not found"):
        load_flow(tmp_path)


def test_manifest_check_passes_for_flow(shared_dir):
    from minicpmo_rt.snapshot_tools import check_manifest

    result = check_manifest(shared_dir / "config.json", shared_dir / "token2wav_manifest.json")
    report = result.reports["flow.pt"]
    assert report.ok and report.matched == 605, report.details()


def test_bad_inputs_are_named(tiny_assets):
    flow = load_flow(tiny_assets)
    spk = torch.randn(1, 192)
    prompt = torch.randint(0, 6561, (1, 8))
    with pytest.raises(InputError, match="0..6560"):
        flow.inference(torch.tensor([[5, 6561]]), prompt, torch.randn(1, 16, 80), spk, n_timesteps=2)
    with pytest.raises(InputError, match="empty"):
        flow.inference(torch.zeros(1, 0, dtype=torch.long), prompt, torch.randn(1, 16, 80), spk, n_timesteps=2)
    with pytest.raises(InputError, match="prompt mel"):
        flow.setup_cache(torch.cat([prompt, prompt[:, :3]], 1), torch.randn(1, 15, 80), spk, n_timesteps=2)
    cache = flow.setup_cache(torch.cat([prompt, prompt[:, :3]], 1), torch.randn(1, 16, 80), spk, n_timesteps=2)
    with pytest.raises(InputError, match="lookahead"):
        flow.inference_chunk(torch.tensor([[1, 2, 3]]), spk, cache)
    with pytest.raises(InputError, match="set up with 2 steps"):
        flow.inference_chunk(torch.tensor([[1, 2, 3, 4]]), spk, cache, n_timesteps=3)
    with pytest.raises(InputError, match="speaker embedding"):
        flow.inference_chunk(torch.tensor([[1, 2, 3, 4]]), torch.randn(1, 80), cache)
    mel, nxt = flow.inference_chunk(torch.tensor([[1, 2, 3, 4]]), spk, cache)
    assert mel.shape == (1, 80, 2) and torch.isfinite(mel).all() and nxt.estimator_frames == 18
    mel, _ = flow.inference_chunk(torch.tensor([[1, 2, 3, 4]]), spk, nxt, last_chunk=True)
    assert mel.shape == (1, 80, 8)


def test_batched_stream_matches_rows(tiny_assets):
    """Streams of two voices batched together give each voice's single-stream result."""
    from conftest import rel_err

    flow = load_flow(tiny_assets)
    gen = torch.Generator().manual_seed(11)
    prompts = torch.randint(0, 6561, (2, 10), generator=gen)
    mels, spks = torch.randn(2, 20, 80, generator=gen), torch.randn(2, 192, generator=gen)
    codes = torch.randint(0, 6561, (2, 31), generator=gen)
    setup = torch.cat([prompts, torch.full((2, 3), 4218)], 1)

    def run(rows):
        cache = flow.setup_cache(setup[rows], mels[rows], spks[rows], n_timesteps=3)
        out = []
        for a, b, last in ((0, 18, False), (15, 31, True)):
            mel, cache = flow.inference_chunk(codes[rows, a:b], spks[rows], cache, last_chunk=last)
            out.append(mel)
        return torch.cat(out, dim=2)

    both = run(slice(0, 2))
    assert both.shape == (2, 80, 62)
    for i in range(2):
        assert rel_err(both[i:i + 1], run(slice(i, i + 1))) <= 1e-5
