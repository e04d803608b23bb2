"""The torch frame preprocess (the fast path beside PIL): same geometry, pixels within two
8-bit levels of PIL, and the measured cost on the vision features (resampler output)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
from minicpmo_rt.errors import InputError
from minicpmo_rt.thinker.image_processor import process_frame_torch, process_image
from minicpmo_rt.thinker.model import Thinker

from conftest import rel_err


def _smooth_frame(h: int, w: int, seed: int) -> np.ndarray:
    """A camera-like frame: smooth gradients and blobs plus mild noise (not white noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    img = np.stack([np.sin(6 * x + 3 * rng.random()) * np.cos(4 * y), np.cos(5 * x * y * 8), x - y], -1)
    img = 127.5 + 100 * img + 8 * rng.standard_normal((h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("h,w", [(1080, 1920), (72, 128), (300, 200)])  # down, up, portrait
def test_pixels_within_two_levels_of_pil(h, w):
    frame = _smooth_frame(h, w, seed=h)
    ref, got = process_image(frame, 1), process_frame_torch(frame)
    assert torch.equal(got.tgt_sizes, ref.tgt_sizes) and got.image_size == ref.image_size and got.grid is None
    diff = (got.patches[0] - ref.patches[0]).abs() * 127.5  # back to 8-bit levels
    assert diff.max() <= 2.01 and diff.mean() < 0.5
    # noise frames too (worst case for overshoot clipping)
    noise = (np.random.default_rng(w).random((h, w, 3)) * 255).astype(np.uint8)
    assert ((process_frame_torch(noise).patches[0] - process_image(noise, 1).patches[0]).abs() * 127.5).max() <= 2.01


def test_feature_cost_and_session_option():
    """Resampler output with torch-preprocessed pixels vs PIL-preprocessed ones (tiny random
    model, fp32): the measured relative error is the price of the fast path."""
    t = Thinker(MiniCPMOConfig.from_dict(tiny_config()))
    randomize_(t, seed=11)
    t.float().rebuild_buffers()
    frame = _smooth_frame(1080, 1920, seed=3)
    ref = t.embed_image(process_image(frame, 1))
    got = t.embed_image(process_frame_torch(frame, device=t.device))
    err = rel_err(got, ref)
    print(f"resampler output rel err, torch vs PIL preprocessing: {err:.2e}")
    assert 0 < err <= 1e-3  # measured 3.7e-5
    # other inputs go through the same checks as the PIL path
    with pytest.raises(InputError, match="zero-size"):
        process_frame_torch(np.zeros((0, 10, 3), np.uint8))
    pil_like = process_frame_torch(frame.astype(np.float32) / 255)
    assert torch.equal(pil_like.tgt_sizes, ref.new_tensor([[24, 43]], dtype=torch.long))
    # ...and as a session option: same layout, nearly the same read-out
    from minicpmo_rt.checkpoint.tokenizer import load_tokenizer, vendored_tokenizer_dir
    from minicpmo_rt.thinker.session import StreamingSession

    tok = load_tokenizer(vendored_tokenizer_dir())
    audio = (0.1 * np.sin(np.arange(16000) / 16000 * 2 * np.pi * 200)).astype(np.float32)
    a, b = StreamingSession(t, tok), StreamingSession(t, tok, image_preprocess="torch")
    small = _smooth_frame(72, 128, seed=4)
    a.commit(audio, small)
    b.commit(audio, small)
    assert a.cache_len == b.cache_len and rel_err(b.read_state(), a.read_state()) <= 1e-3
    with pytest.raises(InputError, match="image_preprocess"):
        StreamingSession(t, tok, image_preprocess="cv2")


def test_vision_graph_body_equals_embed_image_and_session_option():
    """The captured body (host work hoisted out) is the eager forward exactly; on CPU the
    VisionGraphs wrapper runs it eagerly."""
    from minicpmo_rt.thinker.vision_graph import VisionGraphs

    t = Thinker(MiniCPMOConfig.from_dict(tiny_config()))
    randomize_(t, seed=12)
    t.float().rebuild_buffers()
    for frame in (_smooth_frame(72, 128, seed=5), _smooth_frame(300, 200, seed=6)):
        p = process_image(frame, 1)
        assert torch.equal(VisionGraphs(t)(p), t.embed_image(p))
    sliced = process_image(_smooth_frame(900, 1600, seed=7), 4)  # padded batch: exercises the key mask
    assert sliced.num_sub_images > 1
    assert torch.equal(VisionGraphs(t)(sliced), t.embed_image(sliced))
