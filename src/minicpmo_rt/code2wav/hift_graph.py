"""HiFT vocoding from CUDA graphs keyed by mel length, in IEEE FP32.

``GraphedHiFT(model)`` has the contract of ``HiFTGenerator.forward`` (mel, cache_source,
generator -> wav, source) and splits it at the random excitation:

1. ``f0_predictor(mel)``                      graph keyed by (batch, mel frames)
2. ``excitation(f0, generator)``             eager: it draws random phases and noise from
                                              the caller's generator, so the RNG stream, and
                                              hence every sample, matches the eager model
3. ``decode(mel, source)`` (source STFT, trunk, iSTFT, clamp)   graph keyed by
                                              (batch, mel frames, cached source samples)

``decode`` is capture-safe as written: its STFT window is a device buffer of the model (no
host-to-device copy) and its iSTFT is ``hift.istft``, which drops ``torch.istft``'s per-call
host read-back of the window-envelope check (checked once at build time instead).

A steady 1-s stream chunk (8 cached + 50 new mel frames, 3840 cached excitation samples)
therefore costs two replays plus the excitation's few kernels; batch rows of equal length run
together. Matmuls run with TF32 off (``precision.ieee_fp32``) during capture and replay; cuDNN's
own flag is left to the process, as the precision policy requires. A capture failure or a
spent graph budget falls back to the eager model (logged once).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, ContextManager, Optional

import torch

from .precision import ieee_fp32

__all__ = ["ShapeGraphs", "GraphedHiFT"]

log = logging.getLogger(__name__)


class ShapeGraphs:
    """Capture ``fn(*tensors) -> tensor | tuple`` once per input-shape key and replay it."""

    def __init__(self, fn: Callable, name: str, max_graphs: int = 8, warmups: int = 2,
                 capture_context: Callable[[], ContextManager] = contextlib.nullcontext):
        self.fn, self.name, self.max_graphs, self.warmups = fn, name, max_graphs, warmups
        self.capture_context = capture_context
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], object]] = {}
        self.off: str | None = None
        self._logged: set[str] = set()
        self._pool = None

    def _log_once(self, what: str, msg: str) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(msg)

    def __call__(self, *xs: torch.Tensor):
        if self.off or not xs[0].is_cuda:
            return self.fn(*xs)
        key = tuple((tuple(x.shape), x.dtype) for x in xs)
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= self.max_graphs:
                self._log_once("budget", f"{self.name}: graph budget ({self.max_graphs}) spent; new lengths run eagerly")
                return self.fn(*xs)
            try:
                entry = self._capture(xs)
            except Exception as exc:  # noqa: BLE001 - any capture failure: eager from now on
                self.off = f"capture failed: {exc}"
                self._log_once("capture", f"{self.name}: CUDA graph capture failed ({exc}); running eagerly")
                return self.fn(*xs)
            self.graphs[key] = entry
        graph, static_in, static_out = entry
        for s, x in zip(static_in, xs):
            s.copy_(x)
        graph.replay()
        return static_out

    def _capture(self, xs):
        with self.capture_context():
            return self._capture_now(xs)

    def _capture_now(self, xs):
        static_in = [x.detach().clone() for x in xs]
        stream = torch.cuda.Stream(device=xs[0].device)
        stream.wait_stream(torch.cuda.current_stream(xs[0].device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmups):
                self.fn(*static_in)
        torch.cuda.current_stream(xs[0].device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            out = self.fn(*static_in)
        return g, static_in, out


class GraphedHiFT:
    """``HiFTGenerator.forward`` with its deterministic parts replayed from CUDA graphs."""

    def __init__(self, model, max_graphs: int = 8):
        self.model = model
        self.f0 = ShapeGraphs(model.f0_predictor, "HiFT f0", max_graphs)
        self.decode = ShapeGraphs(model.decode, "HiFT decode", max_graphs)

    @torch.inference_mode()
    def __call__(self, mel: torch.Tensor, cache_source: Optional[torch.Tensor] = None,
                 generator: Optional[torch.Generator] = None, copy_out: bool = True):
        with ieee_fp32():
            f0 = self.f0(mel.contiguous())
            source = self.model.excitation(f0, generator)
            if cache_source is not None and cache_source.shape[2]:
                source[:, :, :cache_source.shape[2]] = cache_source
            wav = self.decode(mel.contiguous(), source)
        return (wav.clone() if copy_out else wav), source

    forward = __call__
