"""Triton kernels of the Code2Wav fast path.

Each kernel module imports Triton lazily-safe: ``AVAILABLE`` is False when Triton
is missing, and callers then use the torch formulation beside each kernel.
Kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``
(set before the first import of these modules: tests/conftest.py does on a machine without CUDA).
"""

from __future__ import annotations

import os

try:  # pragma: no cover - exercised through AVAILABLE
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    AVAILABLE = True
except ImportError:  # pragma: no cover
    AVAILABLE = False


def interpreting() -> bool:
    """Kernels were decorated for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def usable_on(t) -> bool:
    """A Triton kernel can run on tensor ``t``'s device in this process."""
    if not AVAILABLE:
        return False
    return t.device.type == "cuda" or (t.device.type == "cpu" and interpreting())
