"""Scoped matmul precision for Code2Wav.

TF32 is an opt-in rounding change for the CFM DiT GEMMs only: it is switched on
for the duration of a Code2Wav forward or graph capture and the process's
previous ``torch.backends.cuda.matmul.allow_tf32`` is put back afterwards, also
when the body raises. cuDNN's TF32 flag (``torch.backends.cudnn.allow_tf32``)
belongs to other stages and is never read or written here. HiFT runs inside
``ieee_fp32()`` so a caller that left TF32 on process-wide cannot change the
vocoder's rounding.

A captured CUDA graph freezes the GEMM algorithms chosen at capture time, so a
graph keeps the precision that was active while it was captured; callers capture
inside the same scope they replay under (see ``euler_graph``).

The flag is torch's and process-wide, unlike this package's own switches (``hift.carrying`` and friends
are per-thread ContextVars): while one thread is inside ``matmul_tf32(True)``, eager cuBLAS GEMMs that
another thread launches at that moment also run in TF32. Graph replays are immune (their algorithms are
frozen), which is why the deploy path replays graphs; a server that runs other eager FP32 GEMMs on a
second thread at the same time should run Code2Wav with TF32 off or from graphs only.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import ContextManager, Iterator

import torch

__all__ = ["matmul_tf32", "ieee_fp32", "tf32_enabled"]


def tf32_enabled() -> bool:
    """The process's current matmul TF32 setting."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


@contextmanager
def matmul_tf32(enabled: bool) -> Iterator[bool]:
    """Set ``torch.backends.cuda.matmul.allow_tf32`` to ``enabled`` inside the block.

    Yields the value in force; restores the previous value on exit and on
    exceptions. Works without CUDA (the flag is a plain process setting).
    """
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = bool(enabled)
    try:
        yield bool(enabled)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def ieee_fp32() -> ContextManager[bool]:
    """IEEE FP32 matmuls inside the block (HiFT and every reference path)."""
    return matmul_tf32(False)
