from __future__ import annotations

import pytest
import torch

from conftest import rel_err
from minicpmo_rt.checkpoint.config import MiniCPMOConfig, load_config
from minicpmo_rt.checkpoint.manifest import compare_prefix, load_manifest, shapes_of
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
from minicpmo_rt.checkpoint.weights import module_shapes
from minicpmo_rt.errors import InputError
from minicpmo_rt.thinker.vision import SiglipVisionTransformer, build_vision


def _tiny(seed=0):
    cfg = MiniCPMOConfig.from_dict(tiny_config())
    return randomize_(build_vision(cfg), seed, prefix="vpm.").eval(), cfg


def _strip(img: torch.Tensor, p: int = 14) -> torch.Tensor:
    """[3, h*p, w*p] -> [3, p, h*w*p]: patches row-major side by side (upstream reshape_by_patch)."""
    c = img.shape[0]
    cols = torch.nn.functional.unfold(img[None], (p, p), stride=(p, p))[0]      # [c*p*p, L]
    return cols.reshape(c, p, p, -1).permute(0, 1, 3, 2).reshape(c, p, -1)


def _idefics2_reference(model: SiglipVisionTransformer):
    """transformers' Idefics2 vision tower: the same NaViT SigLIP (bucketized 2-D positions,
    patch mask) written independently, taking images in their natural 2-D layout."""
    from transformers.models.idefics2.configuration_idefics2 import Idefics2VisionConfig
    from transformers.models.idefics2.modeling_idefics2 import Idefics2VisionTransformer

    c = model.config
    rc = Idefics2VisionConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                              num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                              num_channels=c.num_channels, image_size=c.image_size, patch_size=c.patch_size,
                              hidden_act=c.hidden_act, layer_norm_eps=c.layer_norm_eps)
    rc._attn_implementation = "eager"
    ref = Idefics2VisionTransformer(rc).eval()
    ref.load_state_dict(model.state_dict(), strict=True)
    return ref


def test_vision_keys_match_manifest(shared_dir):
    cfg = load_config(shared_dir / "config.json")
    with torch.device("meta"):
        model = build_vision(cfg)
    rep = compare_prefix(shapes_of(load_manifest(shared_dir / "state_dict_manifest.json")["keys"]),
                         module_shapes(model, "vpm."), "vpm.")
    assert rep.ok, rep.details()
    assert len(model.encoder.layers) == 27
    assert model.embeddings.position_embedding.weight.shape == (4900, 1152)


def test_drop_last_layer():
    cfg = MiniCPMOConfig.from_dict({**tiny_config(), "drop_vision_last_layer": True})
    assert len(build_vision(cfg).encoder.layers) == cfg.vision.num_hidden_layers - 1


def test_vision_matches_idefics2_per_image_and_batched():
    torch.manual_seed(0)
    model, _ = _tiny()
    ref = _idefics2_reference(model)
    grids = [(3, 5), (4, 2), (1, 7)]
    images = [torch.randn(3, h * 14, w * 14) for h, w in grids]
    strips = [_strip(im) for im in images]
    lens = [h * w for h, w in grids]
    L = max(lens)
    pixel = torch.zeros(len(grids), 3, 14, L * 14)
    mask = torch.zeros(len(grids), 1, L, dtype=torch.bool)
    for i, s in enumerate(strips):
        pixel[i, :, :, : s.shape[-1]] = s
        mask[i, 0, : lens[i]] = True
    tgt = torch.tensor(grids)
    with torch.no_grad():
        batched = model(pixel, mask, tgt)
        assert batched.shape == (3, L, model.embed_dim)
        for i, (h, w) in enumerate(grids):
            want = ref(images[i][None], patch_attention_mask=torch.ones(1, h, w, dtype=torch.bool)).last_hidden_state
            single = model(strips[i][None], torch.ones(1, 1, lens[i], dtype=torch.bool), tgt[i:i + 1])
            assert rel_err(single, want) < 1e-5
            assert rel_err(batched[i, : lens[i]], want[0]) < 1e-5


def test_vision_positions_bucketize_onto_70x70():
    model, _ = _tiny()
    emb = model.embeddings
    mask = torch.ones(1, 1, 70 * 70, dtype=torch.bool)
    assert torch.equal(emb.position_ids(mask, torch.tensor([[70, 70]]))[0], torch.arange(4900))
    # A 2x2 grid lands on the corners of the four quadrants.
    pos = emb.position_ids(torch.ones(1, 1, 4, dtype=torch.bool), torch.tensor([[2, 2]]))[0]
    assert pos.tolist() == [0, 35, 35 * 70, 35 * 70 + 35]


def test_vision_rejects_bad_pixels():
    model, _ = _tiny()
    with pytest.raises(InputError, match="pixel_values"):
        model(torch.zeros(1, 14, 14))
