"""Small host -> device uploads that never make the host wait for the device.

A copy from pageable host memory blocks the host until everything queued before it has run, so a
host that stages the next solve's indices or address tables that way cannot work ahead of the
device (H200: one ``cudaStreamSynchronize`` per direct solve, ``benchmarks/solve_overhead_probe.py``).
``PinnedUpload`` fills two pinned host buffers in turn and copies each with one non-blocking copy; a
buffer is refilled only once the copy that read it has run (an event, normally long complete). On
the CPU the host buffer is the device tensor itself.
"""

from __future__ import annotations

import torch

__all__ = ["PinnedUpload"]


class PinnedUpload:
    """Uploads into the device tensor ``dev``: ``begin()`` gives the next host buffer (dev's shape and
    dtype) to fill, ``upload(n)`` copies it (its first n elements only, if given) and returns ``dev``;
    calling it with a tensor does both."""

    def __init__(self, dev: torch.Tensor):
        self.dev = dev
        self.cuda = dev.is_cuda
        if self.cuda:
            self.host = [torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True) for _ in range(2)]
            self.events = [torch.cuda.Event() for _ in range(2)]
        else:
            self.host = [dev]
        self.k = 0

    def begin(self) -> torch.Tensor:
        """The next host buffer, once the copy that last read it has run."""
        if self.cuda:
            self.k ^= 1
            self.events[self.k].synchronize()
        return self.host[self.k]

    def upload(self, n: int | None = None) -> torch.Tensor:
        """``dev`` after the buffer filled since ``begin`` is copied into it (flat elements [0, n) with n)."""
        if self.cuda:
            src, dst = self.host[self.k], self.dev
            if n is not None:
                src, dst = src.view(-1)[:n], dst.view(-1)[:n]
            dst.copy_(src, non_blocking=True)
            self.events[self.k].record()
        return self.dev

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        self.begin().copy_(value)
        return self.upload()
