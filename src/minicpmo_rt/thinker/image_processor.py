"""Image preprocessing as upstream's MiniCPMVImageProcessor: slicing grid, resizes, normalisation,
patch-strip layout, target sizes, and the matching placeholder text.

One image becomes a *source* sub-image (the whole picture resized to about
``scale_resolution``^2 pixels, sides multiples of 14) plus, when the picture is
large enough and ``max_slice_nums`` > 1, a cols x rows grid of *slices* cut
row-major from a refined resize. Each sub-image is laid out as a strip of 14x14
patches ([3, 14, L*14], see ``reshape_by_patch``) with target size (h, w) in patches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from ..errors import InputError

if TYPE_CHECKING:
    from .staging import HostStaging

PATCH = 14
SCALE_RESOLUTION = 448
MEAN = 0.5
STD = 0.5
IMAGE_FEATURE_SIZE = 64  # resampler queries per sub-image


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the vision tower."""

    patches: list[torch.Tensor]          # per sub-image [3, 14, L_i*14] float32; source first, then slices
    tgt_sizes: torch.Tensor              # [n_sub, 2] long: (h, w) in patches
    grid: tuple[int, int] | None         # (cols, rows) of slices, None when not sliced
    image_size: tuple[int, int]          # original (width, height)

    @property
    def num_sub_images(self) -> int:
        return len(self.patches)


@dataclass(frozen=True)
class PatchBatch:
    """Sub-images padded into one vision-tower batch (upstream get_vision_embedding layout)."""

    pixel_values: torch.Tensor           # [B, 3, 14, L_max*14]
    patch_attention_mask: torch.Tensor   # [B, 1, L_max] bool
    tgt_sizes: torch.Tensor              # [B, 2] long


# ---------------------------------------------------------------- input checks

def to_rgb_image(image, where: str = "image") -> Image.Image:
    """PIL image, HxWx{1,3,4} / HxW / CxHxW ndarray or tensor -> RGB PIL image (upstream to_pil_image)."""
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    if isinstance(image, np.ndarray):
        arr = image
        if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise InputError(f"{where}: array of dtype {arr.dtype} is not an image; pass uint8 HxWx3 "
                             "(or float in [0, 1]) pixels or a PIL image")
        if arr.ndim == 3 and arr.shape[0] in (1, 3) and arr.shape[-1] not in (1, 3, 4):
            arr = arr.transpose(1, 2, 0)  # channels-first -> last, as upstream
        if arr.ndim == 3 and arr.shape[-1] == 1:
            arr = arr[..., 0]
        if not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[-1] in (3, 4))):
            raise InputError(f"{where}: array of shape {list(image.shape)} is not an image; expected HxWx3 "
                             "(HxW, HxWx1, HxWx4 and 3xHxW are also accepted)")
        if arr.shape[0] == 0 or arr.shape[1] == 0:
            raise InputError(f"{where}: zero-size image {list(image.shape)}; pass a frame with pixels")
        if np.issubdtype(arr.dtype, np.floating):
            if not np.isfinite(arr).all():
                raise InputError(f"{where}: image holds NaN or infinite values")
            if arr.min() < 0 or arr.max() > 1:
                # Upstream would scale by 255 and wrap around uint8 silently.
                raise InputError(f"{where}: float pixels must lie in [0, 1] (found {arr.min():.3g}..{arr.max():.3g}); "
                                 "pass uint8 0..255 or divide by 255")
            arr = arr * 255  # floats are taken as [0, 1], as upstream
        image = Image.fromarray(arr.astype(np.uint8))
    if not isinstance(image, Image.Image):
        raise InputError(f"{where}: {type(image).__name__} is not an image; pass a PIL image or an HxWx3 uint8 array")
    if image.width == 0 or image.height == 0:
        raise InputError(f"{where}: zero-size image ({image.width}x{image.height}); pass a frame with pixels")
    return image.convert("RGB")


# ---------------------------------------------------------------- geometry (upstream rules)

def ensure_divide(length: float, patch_size: int = PATCH) -> int:
    """Nearest multiple of ``patch_size`` (Python's round: half to even), at least one patch."""
    return max(round(length / patch_size) * patch_size, patch_size)


def find_best_resize(size: tuple[float, float], scale_resolution: int = SCALE_RESOLUTION,
                     patch_size: int = PATCH, allow_upscale: bool = False) -> tuple[int, int]:
    """(width, height) near ``scale_resolution``^2 area at the same aspect, sides multiples of 14;
    only shrinks unless ``allow_upscale``."""
    width, height = size
    if width * height > scale_resolution * scale_resolution or allow_upscale:
        r = width / height
        height = int(scale_resolution / math.sqrt(r))
        width = int(height * r)
    return ensure_divide(width, patch_size), ensure_divide(height, patch_size)


def get_refine_size(size: tuple[int, int], grid: tuple[int, int], scale_resolution: int = SCALE_RESOLUTION,
                    patch_size: int = PATCH, allow_upscale: bool = False) -> tuple[int, int]:
    width, height = size
    cols, rows = grid
    cell = (ensure_divide(width, cols) / cols, ensure_divide(height, rows) / rows)
    best = find_best_resize(cell, scale_resolution, patch_size, allow_upscale=allow_upscale)
    return best[0] * cols, best[1] * rows


def get_sliced_grid(size: tuple[int, int], max_slice_nums: int,
                    scale_resolution: int = SCALE_RESOLUTION, never_split: bool = False) -> tuple[int, int] | None:
    """(cols, rows) of slices, or None for no slicing.

    multiple = min(ceil(area / 448^2), max); candidate counts multiple-1..multiple+1 (not 1, not
    above max); every factorisation c x r of a candidate is tried and the one whose log aspect
    is nearest the image's wins (first found on ties).
    """
    width, height = size
    log_ratio = math.log(width / height)
    multiple = min(math.ceil(width * height / (scale_resolution * scale_resolution)), max_slice_nums)
    if multiple <= 1 or never_split:
        return None
    best, best_err = (1, 1), float("inf")
    for n in (multiple - 1, multiple, multiple + 1):
        if n == 1 or n > max_slice_nums:
            continue
        for cols in range(1, n + 1):
            if n % cols:
                continue
            err = abs(log_ratio - math.log(cols / (n // cols)))
            if err < best_err:
                best, best_err = (cols, n // cols), err
    return best


def split_to_patches(image: Image.Image, grid: tuple[int, int]) -> list[list[Image.Image]]:
    """Cut ``image`` into rows x cols crops, row-major."""
    width, height = image.size
    cell_w, cell_h = int(width / grid[0]), int(height / grid[1])
    return [[image.crop((x, y, x + cell_w, y + cell_h)) for x in range(0, width, cell_w)]
            for y in range(0, height, cell_h)]


def slice_image(image: Image.Image, max_slice_nums: int = 9, scale_resolution: int = SCALE_RESOLUTION,
                patch_size: int = PATCH, never_split: bool = False):
    """(source image, rows of slice images, grid)."""
    grid = get_sliced_grid(image.size, max_slice_nums, scale_resolution, never_split)
    if grid is None:
        size = find_best_resize(image.size, scale_resolution, patch_size, allow_upscale=True)
        return image.resize(size, resample=Image.Resampling.BICUBIC), [], None
    source = image.resize(find_best_resize(image.size, scale_resolution, patch_size),
                          resample=Image.Resampling.BICUBIC)
    refine = image.resize(get_refine_size(image.size, grid, scale_resolution, patch_size, allow_upscale=True),
                          resample=Image.Resampling.BICUBIC)
    return source, split_to_patches(refine, grid), grid


# ---------------------------------------------------------------- pixels

def normalize(image: Image.Image) -> np.ndarray:
    """RGB PIL -> [3, H, W] float32 in [-1, 1] ((x/255 - 0.5) / 0.5)."""
    arr = np.asarray(image, dtype=np.uint8).astype(np.float32) / 255
    arr = (arr - np.float32(MEAN)) / np.float32(STD)
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def reshape_by_patch(image: np.ndarray | torch.Tensor, patch_size: int = PATCH) -> torch.Tensor:
    """[C, h*p, w*p] -> [C, p, h*w*p]: the row-major patches placed side by side, so that a
    stride-p convolution over the strip visits them in order."""
    x = torch.as_tensor(image)
    c = x.shape[0]
    cols = torch.nn.functional.unfold(x[None], (patch_size, patch_size), stride=(patch_size, patch_size))[0]
    return cols.reshape(c, patch_size, patch_size, -1).permute(0, 1, 3, 2).reshape(c, patch_size, -1)


def process_image(image, max_slice_nums: int = 1, scale_resolution: int = SCALE_RESOLUTION,
                  patch_size: int = PATCH, where: str = "image") -> ProcessedImage:
    """Upstream preprocess for one image. ``max_slice_nums`` is 9 in chat and 1 in streaming/duplex."""
    if int(max_slice_nums) < 1:
        raise InputError(f"max_slice_nums must be >= 1, got {max_slice_nums}")
    pil = to_rgb_image(image, where)
    source, rows, grid = slice_image(pil, int(max_slice_nums), scale_resolution, patch_size)
    subs = [source] + [im for row in rows for im in row]
    patches, sizes = [], []
    for sub in subs:
        arr = normalize(sub)
        patches.append(reshape_by_patch(arr, patch_size))
        sizes.append((arr.shape[1] // patch_size, arr.shape[2] // patch_size))
    return ProcessedImage(patches, torch.tensor(sizes, dtype=torch.long), grid, pil.size)


def process_frame_torch(image, device: str | torch.device | None = None, scale_resolution: int = SCALE_RESOLUTION,
                        patch_size: int = PATCH, where: str = "image",
                        staging: HostStaging | None = None) -> ProcessedImage:
    """The streaming preprocess (``max_slice_nums=1``: one unsliced source image) in torch, on
    ``device`` (the fast path beside ``process_image``; opt-in, PIL stays the reference).

    The resize is ``F.interpolate(bicubic, antialias=True)``, whose filter is PIL's (a = -0.5,
    support widened by the scale), run as PIL runs it (horizontal pass, 8-bit rounding,
    vertical pass) but with float weights instead of PIL's fixed-point ones, so pixels
    differ from PIL by one or two levels; ``tests/thinker/test_image_torch.py`` measures
    the pixel and feature cost.
    A uint8 HxWx3 array or tensor goes to the device as is (no PIL copy); anything else
    passes through ``to_rgb_image`` first. ``staging`` uploads a numpy frame without waiting for
    the device (``staging.HostStaging``).
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    x = image
    fast = isinstance(x, (np.ndarray, torch.Tensor)) and x.dtype in (np.uint8, torch.uint8) and x.ndim == 3 \
        and x.shape[-1] == 3 and x.shape[0] > 0 and x.shape[1] > 0
    if not fast:
        x = np.array(to_rgb_image(image, where), dtype=np.uint8)  # a writable copy of the PIL buffer
    height, width = int(x.shape[0]), int(x.shape[1])
    w, h = find_best_resize((width, height), scale_resolution, patch_size, allow_upscale=True)
    if isinstance(x, np.ndarray) and staging is not None and dev.type == "cuda":
        x = staging.upload(np.ascontiguousarray(x))
    else:
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(np.ascontiguousarray(x))
        x = x.to(dev, non_blocking=True)
    x = x.permute(2, 0, 1)[None].float()
    # Two passes, horizontal first, each rounded to 8 bits: PIL's order and intermediate
    # rounding (a single 2-D pass differs by up to ~20 levels where bicubic overshoot clips).
    for size in ((height, w), (h, w)):
        if tuple(x.shape[-2:]) != size:
            x = torch.nn.functional.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False)
            x = x.round_().clamp_(0, 255)
    x = (x[0] / 255 - MEAN) / STD
    strip = reshape_by_patch(x, patch_size)
    return ProcessedImage([strip], torch.tensor([(h // patch_size, w // patch_size)], dtype=torch.long), None,
                          (width, height))


def pack_patches(images: list[ProcessedImage] | ProcessedImage) -> PatchBatch:
    """Pad every sub-image of ``images`` into one batch, in order (source, slices, next image...)."""
    if isinstance(images, ProcessedImage):
        images = [images]
    strips = [p for im in images for p in im.patches]
    if not strips:
        raise InputError("pack_patches: no sub-images to pack")
    tgt = torch.cat([im.tgt_sizes for im in images])
    lens = (tgt[:, 0] * tgt[:, 1]).tolist()
    patch = strips[0].shape[1]
    width = max(lens) * patch
    pixel = strips[0].new_zeros(len(strips), strips[0].shape[0], patch, width)
    mask = torch.zeros(len(strips), 1, max(lens), dtype=torch.bool)
    for i, (s, n) in enumerate(zip(strips, lens)):
        pixel[i, :, :, : s.shape[-1]] = s
        mask[i, 0, :n] = True
    return PatchBatch(pixel, mask, tgt)


# ---------------------------------------------------------------- placeholders

def image_placeholder(grid: tuple[int, int] | None = None, image_idx: int | None = None,
                      feature_size: int = IMAGE_FEATURE_SIZE) -> str:
    """Placeholder text for one processed image.

    Optional ``<image_id>i</image_id>`` (when ``image_idx`` is given, i.e. use_image_id), then
    ``<image>`` + 64 ``<unk>`` + ``</image>``, then one line per slice row of ``<slice>`` + 64
    ``<unk>`` + ``</slice>`` per column, rows joined by "\\n". The ``<unk>`` positions receive the
    resampler outputs in sub-image order.
    """
    text = "" if image_idx is None else f"<image_id>{image_idx}</image_id>"
    text += "<image>" + "<unk>" * feature_size + "</image>"
    if grid is not None:
        cols, rows = grid
        row = ("<slice>" + "<unk>" * feature_size + "</slice>") * cols
        text += "\n".join([row] * rows)
    return text


def image_placeholder_ids(tokenizer, grid: tuple[int, int] | None = None, image_idx: int | None = None,
                          feature_size: int = IMAGE_FEATURE_SIZE) -> list[int]:
    return tokenizer.encode(image_placeholder(grid, image_idx, feature_size))
