from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from minicpmo_rt.checkpoint.tokenizer import load_tokenizer, vendored_tokenizer_dir
from minicpmo_rt.errors import InputError
from minicpmo_rt.thinker import image_processor as ip

# (width, height, max_slice_nums) -> (grid, tgt_sizes). Worked by hand from the upstream rules
# and cross-checked once against upstream's MiniCPMVImageProcessor (identical sizes and pixels).
CASES = [
    ((448, 448, 9), (None, [[32, 32]])),
    ((100, 50, 9), (None, [[23, 45]])),                       # small: upscaled to ~448^2
    ((2000, 1000, 1), (None, [[23, 45]])),                    # streaming: never sliced
    ((1000, 500, 9), ((2, 1), [[23, 45], [32, 32], [32, 32]])),
    ((300, 1200, 9), ((1, 3), [[64, 16], [37, 28], [37, 28], [37, 28]])),
    ((640, 480, 9), ((2, 1), [[28, 37], [39, 26], [39, 26]])),
    ((1920, 1080, 9), ((4, 2), [[24, 43]] + [[34, 30]] * 8)),
    ((1500, 1500, 9), ((3, 3), [[32, 32]] * 10)),
    ((3000, 200, 9), ((4, 1), [[8, 123]] + [[16, 62]] * 4)),
    ((37, 1900, 9), (None, [[229, 4]])),
]


def _img(w, h, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("args,want", CASES, ids=[f"{a[0]}x{a[1]}m{a[2]}" for a, _ in CASES])
def test_slicing_grid_and_sizes(args, want):
    w, h, m = args
    out = ip.process_image(_img(w, h), max_slice_nums=m)
    assert out.grid == want[0]
    assert out.tgt_sizes.tolist() == want[1]
    assert out.image_size == (w, h)
    for p, (th, tw) in zip(out.patches, out.tgt_sizes.tolist()):
        assert p.shape == (3, 14, th * tw * 14) and p.dtype == torch.float32


def test_grid_rule_prefers_nearest_log_aspect():
    # ratio 2.49 -> multiple 3 -> candidates 2, 3, 4: [2, 1] matches log(2) exactly.
    assert ip.get_sliced_grid((1000, 500), 9) == (2, 1)
    # 1.79 -> multiple 2 -> candidates 2, 3: aspect 1/4 is nearest 1 x 3.
    assert ip.get_sliced_grid((300, 1200), 9) == (1, 3)
    assert ip.get_sliced_grid((300, 1200), 2) == (1, 2)
    assert ip.get_sliced_grid((1000, 500), 9, never_split=True) is None
    assert ip.ensure_divide(7) == 14 and ip.ensure_divide(21) == 28 and ip.ensure_divide(35) == 28  # half-even


def test_normalise_and_patch_strip_layout():
    arr = np.random.default_rng(1).integers(0, 256, (28, 42, 3), dtype=np.uint8)
    norm = ip.normalize(Image.fromarray(arr))
    assert np.allclose(norm, (arr.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5, atol=1e-6)
    strip = ip.reshape_by_patch(norm)
    assert strip.shape == (3, 14, 6 * 14)
    for r in range(2):
        for c in range(3):
            k = r * 3 + c
            assert torch.equal(strip[:, :, k * 14:(k + 1) * 14],
                               torch.from_numpy(norm[:, r * 14:(r + 1) * 14, c * 14:(c + 1) * 14]))


def test_slices_are_row_major_crops_of_refined_image():
    img = _img(1000, 500, seed=3)
    out = ip.process_image(img, max_slice_nums=9)
    refine = img.resize((896, 448), resample=Image.Resampling.BICUBIC)
    for k, box in enumerate([(0, 0, 448, 448), (448, 0, 896, 448)]):
        want = ip.reshape_by_patch(ip.normalize(refine.crop(box)))
        assert torch.equal(out.patches[1 + k], want)


def test_input_kinds_agree():
    arr = np.random.default_rng(2).integers(0, 256, (60, 90, 3), dtype=np.uint8)
    ref = ip.process_image(Image.fromarray(arr))
    for other in (arr.transpose(2, 0, 1), torch.from_numpy(arr), arr.astype(np.float32) / 255.0):
        got = ip.process_image(other)
        assert got.tgt_sizes.tolist() == ref.tgt_sizes.tolist()
        assert torch.allclose(got.patches[0], ref.patches[0], atol=2 / 255 * 2)
    gray = ip.process_image(arr[..., 0])
    assert gray.patches[0].shape == ref.patches[0].shape


@pytest.mark.parametrize("bad,msg", [
    (np.zeros((0, 5, 3), np.uint8), "zero-size"),
    (np.zeros((5, 0, 3), np.uint8), "zero-size"),
    (Image.new("RGB", (0, 4)), "zero-size"),
    (np.zeros((4, 5, 7), np.uint8), "not an image"),
    (np.zeros((2, 4, 5, 3), np.uint8), "not an image"),
    (np.array(["a", "b"]), "not an image"),
    (np.zeros((4, 4, 3), bool), "not an image"),
    (np.full((4, 4, 3), 200.0, np.float32), r"\[0, 1\]"),
    (np.full((4, 4, 3), np.nan, np.float32), "NaN"),
    ("frame.png", "not an image"),
    (None, "not an image"),
])
def test_bad_images_raise_input_error(bad, msg):
    with pytest.raises(InputError, match=msg):
        ip.process_image(bad, where="frame")


def test_pack_patches_pads_and_masks():
    a = ip.process_image(_img(1000, 500), max_slice_nums=9)
    b = ip.process_image(_img(60, 90))
    batch = ip.pack_patches([a, b])
    lens = [h * w for h, w in batch.tgt_sizes.tolist()]
    assert batch.pixel_values.shape == (4, 3, 14, max(lens) * 14)
    assert batch.patch_attention_mask.sum(-1).flatten().tolist() == lens
    assert torch.equal(batch.pixel_values[3, :, :, : lens[3] * 14], b.patches[0])
    assert batch.pixel_values[3, :, :, lens[3] * 14:].abs().sum() == 0


def test_placeholders_and_ids():
    tok = load_tokenizer(vendored_tokenizer_dir())
    s = tok.special
    assert ip.image_placeholder(None) == "<image>" + "<unk>" * 64 + "</image>"
    ids = ip.image_placeholder_ids(tok, (2, 2), image_idx=0)
    img_block = [s.image_start] + [s.unk] * 64 + [s.image_end]
    slice_block = [s.slice_start] + [s.unk] * 64 + [s.slice_end]
    nl = tok.encode("\n")
    id_prefix = tok.encode("<image_id>0</image_id>")
    assert ids == id_prefix + img_block + slice_block * 2 + nl + slice_block * 2
    assert ids.count(s.unk) == 64 * 5
