"""Pitched device-to-device copies through the CUDA runtime's ``cudaMemcpy2DAsync``, which the driver may run
on a copy engine instead of the SMs, so a copy enqueued on a side stream can run under kernels that keep
every SM busy (an SM copy kernel on a second stream only takes turns with them: fill_overlap_probe_session12).

torch exposes no 2-D copy, so the function is looked up in the CUDA runtime library torch itself loaded
(found in /proc/self/maps), never a second copy of it. ``available()`` says whether that worked.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_D2D = 3        # cudaMemcpyDeviceToDevice


@functools.lru_cache(maxsize=None)
def _memcpy2d():
    """cudaMemcpy2DAsync of the runtime this process loaded, or None (no CUDA, or no runtime found)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({ln.split()[-1] for ln in maps if "libcudart.so" in ln})
    except OSError:
        return None
    for path in paths:
        try:
            fn = ctypes.CDLL(path).cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        return fn
    return None


def available() -> bool:
    return _memcpy2d() is not None


def pitched_rows(t: torch.Tensor, name: str = "tensor") -> tuple[int, int, int]:
    """(pitch, width, height) in bytes and rows of ``t`` as one pitched 2-D array: its last dim contiguous
    (a row), every other dim stepping uniformly over rows (row index = a flat index over them), e.g. the
    frames [a, b) of every (step, layer, row, head) block of a cache, flattened over (frames, 2D).
    ValueError otherwise."""
    if t.dim() < 2 or t.stride(-1) != 1:
        raise ValueError(f"copy_engine: {name}'s rows must be contiguous, got shape {tuple(t.shape)} strides "
                         f"{t.stride()}")
    pitch = expect = t.stride(-2)
    for d in range(t.dim() - 2, -1, -1):
        if t.shape[d] > 1 and t.stride(d) != expect:
            raise ValueError(f"copy_engine: {name} {tuple(t.shape)} with strides {t.stride()} is not one pitched "
                             "array of rows (its leading dims must step uniformly over them)")
        expect *= t.shape[d]
    return pitch * t.element_size(), t.shape[-1] * t.element_size(), t.numel() // max(t.shape[-1], 1)


def copy_rows(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
    """dst[...] = src[...] for two CUDA views of one shape and dtype, each one pitched array of rows
    (``pitched_rows``), as one ``cudaMemcpy2DAsync`` on ``stream`` (default: the current one)."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy_engine.copy_rows: dst {tuple(dst.shape)} {dst.dtype} and src {tuple(src.shape)} "
                         f"{src.dtype} must have one shape and dtype")
    dpitch, width, height = pitched_rows(dst, "dst")
    spitch, _, _ = pitched_rows(src, "src")
    fn = _memcpy2d()
    if fn is None or not (dst.is_cuda and src.is_cuda):
        raise RuntimeError("copy_engine.copy_rows: needs CUDA tensors and a CUDA runtime with cudaMemcpy2DAsync "
                           "in this process (check copy_engine.available() first)")
    if height == 0 or width == 0:
        return
    s = stream if stream is not None else torch.cuda.current_stream(dst.device)
    rc = fn(dst.data_ptr(), dpitch, src.data_ptr(), spitch, width, height, _D2D, ctypes.c_void_p(s.cuda_stream))
    if rc != 0:
        raise RuntimeError(f"copy_engine.copy_rows: cudaMemcpy2DAsync returned CUDA error {rc} "
                           f"(dst {tuple(dst.shape)}, src {tuple(src.shape)})")
