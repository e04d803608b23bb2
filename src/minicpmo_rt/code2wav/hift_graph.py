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

Building a ``GraphedHiFT`` freezes the model's weight norm (``hift.freeze_weight_norm``: each
conv's weight computed once instead of per forward and replay, time-major on CUDA so cuDNN runs
NHWC convs without layout conversions); on CUDA the forward's element-wise work around the convs
runs as fused Triton kernels (``kernels.snake``), in the graphs and eagerly alike.

A steady 1-s stream chunk (8 cached + 50 new mel frames, 3840 cached excitation samples)
therefore costs two replays plus the excitation's few kernels; batch rows of equal length run
together, padded to a batch bucket (``ROW_BUCKETS``) so a wandering batch size reuses few graphs.
Matmuls run with TF32 off (``precision.ieee_fp32``) during capture and replay; cuDNN's own flag is
left to the process, as the precision policy requires. A capture failure or a
spent graph budget falls back to the eager model (logged once).

Streams use it as their *runner* (``hift.StageCall``): ``run_f0`` / ``run_decode`` replay the
graphs for either HiFT variant (the causal one's look-ahead calls and its final call per utterance,
keyed by ``finalize``), ``run_excite`` replays the causal block excitation's graphs (deterministic:
its noise-table rows are an input). ``row_bucket`` lets ``hift.drive_many`` run shorter look-ahead
calls in the rows a batched call pads up to anyway, and ``grow_rows`` lets a small call grow past its
bucket to take them along.
One ``GraphedHiFT`` per model serves every stream of it; ``capture_after=2`` keeps one-off
lengths (a final chunk) from spending the graph budget.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable, ContextManager, Optional, Sequence, Union

import torch

from .hift import HiFTGenerator
from .hift_causal import CausalHiFTGenerator
from .keepalive import keepalive
from .precision import ieee_fp32

__all__ = ["ShapeGraphs", "GraphedHiFT", "ROW_BUCKETS"]

log = logging.getLogger(__name__)

# Batch buckets of the per-shape graph sets (encoder, HiFT stages): the CFM solver's default buckets,
# so one round of concurrent streams pads to the same sizes in every stage.
ROW_BUCKETS = (1, 2, 4, 8, 16)


class ShapeGraphs:
    """Capture ``fn(*tensors, **static) -> tensor | tuple`` once per key and replay it.

    The key is the tensors' shapes and dtypes, the ``static`` (non-tensor) arguments the graph bakes
    in, and ``key_extra()`` (process state a capture also bakes in, e.g. precision flags).
    A key is captured on its ``capture_after``-th call (earlier calls run eagerly), so shapes
    seen once never spend the ``max_graphs`` budget. With the budget spent, new keys run eagerly,
    or with ``evict`` replace the least recently replayed graph. ``copy_out=True`` returns a
    replay's outputs in fresh memory (the graph's own outputs are overwritten by its next replay).

    ``batch_buckets`` (ascending; empty = off): a call of ``b`` rows runs in the graph of the smallest
    bucket >= b, its inputs padded with copies of a real row along their ``batch_axes`` (default 0)
    and its outputs cut back to ``b`` rows along ``out_batch_axes`` (default 0). A server whose batch
    sizes wander over 1..16 then holds 5 graphs per shape instead of 16, and replays a size it met
    only once. Only for row-independent ``fn``s (the padded rows' outputs are dropped); rounding may
    differ from an unpadded call as between any two batch sizes. Beyond the largest bucket keys are
    exact. ``eager_calls`` and ``captures`` count the graphable calls that did not just replay."""

    SEEN_LIMIT = 256  # keys counted towards capture_after; older counts are forgotten
    # Eager calls on a side stream before each capture. One is enough (cuDNN's and cuBLAS's workspaces, Triton's
    # kernels): H200, Code2Wav.prepare with the encoder and HiFT sets at 2 / 1 (precapture_probe_session26_h200.md,
    # medians of 3): 6.60 / 6.02 s, the stream's PCM bit-identical, nothing captured mid-stream either way.
    WARMUPS = 1

    def __init__(self, fn: Callable, name: str, max_graphs: int = 8, warmups: int = WARMUPS,
                 capture_context: Callable[[], ContextManager] = contextlib.nullcontext,
                 capture_after: int = 1, key_extra: Callable[[], tuple] | None = None, evict: bool = False,
                 batch_buckets: Sequence[int] = (), batch_axes: Sequence[int] | None = None,
                 out_batch_axes: Sequence[int] | None = None):
        if capture_after < 1:
            raise ValueError(f"{name}: capture_after must be >= 1, got {capture_after}")
        buckets = tuple(int(b) for b in batch_buckets)
        if any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"{name}: batch_buckets must be distinct positive sizes in ascending order, "
                             f"got {tuple(batch_buckets)}")
        self.batch_buckets = buckets
        self.batch_axes = None if batch_axes is None else tuple(batch_axes)
        self.out_batch_axes = None if out_batch_axes is None else tuple(out_batch_axes)
        self.eager_calls = 0   # graphable calls that ran eagerly (first sight, budget spent, capture failed)
        self.captures = 0
        self.fn, self.name, self.max_graphs, self.warmups = fn, name, max_graphs, warmups
        self.capture_context = capture_context
        self.capture_after = capture_after
        self.key_extra, self.evict = key_extra, evict
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], object]] = {}
        self.replays = 0
        self.off: str | None = None
        self._seen: dict[tuple, int] = {}
        self._logged: set[str] = set()
        self._pool = None

    @contextlib.contextmanager
    def capturing_at_once(self):
        """Within: a key is captured at its first call (a warm-up stream calls each shape once or twice);
        ``capture_after`` is restored on exit."""
        before = self.capture_after
        self.capture_after = 1
        try:
            yield self
        finally:
            self.capture_after = before

    def _log_once(self, what: str, msg: str) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(msg)

    def _graphable(self, xs: tuple[torch.Tensor, ...]) -> bool:
        return not self.off and xs[0].is_cuda

    def _axes(self, axes: Optional[tuple[int, ...]], n: int, what: str) -> tuple[int, ...]:
        axes = axes or (0,) * n
        if len(axes) != n:
            raise ValueError(f"{self.name}: {n} {what} but {len(axes)} batch axes {axes}")
        return axes

    def _rows(self, xs: tuple[torch.Tensor, ...]) -> tuple[int, int, tuple[int, ...]]:
        """(rows of the call, rows of the graph it runs in, the inputs' batch axes): the rows are equal
        unless a batch bucket pads the call."""
        if not self.batch_buckets:
            return 0, 0, ()
        axes = self._axes(self.batch_axes, len(xs), "tensor inputs")
        rows = {x.shape[a] for x, a in zip(xs, axes)}
        if len(rows) != 1:
            raise ValueError(f"{self.name}: the inputs disagree on their batch size along axes {axes}: shapes "
                             f"{[tuple(x.shape) for x in xs]}")
        b = rows.pop()
        return b, next((k for k in self.batch_buckets if k >= b), b), axes

    @staticmethod
    def _pad(xs: tuple[torch.Tensor, ...], b: int, rows: int, axes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """``xs`` grown to ``rows`` along their batch ``axes`` by repeating their last real row."""
        out = []
        for x, a in zip(xs, axes):
            shape = list(x.shape)
            shape[a] = rows - b
            out.append(torch.cat([x, x.narrow(a, b - 1, 1).expand(shape)], a))
        return tuple(out)

    def _cut(self, out, b: int):
        """A padded replay's outputs cut back to the call's ``b`` rows (views of the graph's outputs)."""
        outs = out if isinstance(out, tuple) else (out,)
        cut = tuple(o.narrow(a, 0, b) for o, a in zip(outs, self._axes(self.out_batch_axes, len(outs), "outputs")))
        return cut if isinstance(out, tuple) else cut[0]

    def _key(self, xs: tuple[torch.Tensor, ...], b: int, rows: int, axes: tuple[int, ...], static: dict) -> tuple:
        if rows != b:       # keyed by the padded shapes: every row count of a bucket shares its graph
            key = tuple((tuple(x.shape[:a]) + (rows,) + tuple(x.shape[a + 1:]), x.dtype) for x, a in zip(xs, axes))
        else:
            key = tuple((tuple(x.shape), x.dtype) for x in xs)
        key += tuple(sorted(static.items()))
        if self.key_extra is not None:
            key += self.key_extra()
        return key

    def frames_to_held(self, xs: tuple[torch.Tensor, ...], per_frame: Sequence[int], **static) -> int:
        """For a call that is causal beyond its own frames (``hift.StageCall.per_frame``: each input's entries
        per frame along its last axis): how many zero frames to append so that it replays a graph this set
        holds, the fewest that do. 0 when its own shape has a graph, when no longer one of its kind is held, or
        when the set runs eagerly. A stream's final chunk has a length of its own: its look-ahead calls would
        run eagerly (the eager HiFT took 5.3x its graphs' time per chunk on the H200, ``hift_h200.md``) or spend
        the graph budget; padded, it replays a steady or first chunk's graph."""
        if not self.graphs or not self._graphable(xs):
            return 0
        b, rows, axes = self._rows(xs)
        key = self._key(xs, b, rows, axes, static)
        if key in self.graphs:
            return 0
        n = len(xs)
        best = 0
        for held in self.graphs:
            if len(held) != len(key) or held[n:] != key[n:]:
                continue
            extra = set()
            for (shape, dtype), (own, own_dtype), per in zip(held[:n], key[:n], per_frame):
                grow = shape[-1] - own[-1]
                if dtype != own_dtype or shape[:-1] != own[:-1] or grow <= 0 or grow % per:
                    break
                extra.add(grow // per)
            else:
                if len(extra) == 1 and (not best or min(extra) < best):
                    best = min(extra)
        return best

    def __call__(self, *xs: torch.Tensor, copy_out: bool = False, **static):
        fn = functools.partial(self.fn, **static) if static else self.fn
        if not self._graphable(xs):
            return fn(*xs)
        b, rows, axes = self._rows(xs)
        key = self._key(xs, b, rows, axes, static)
        entry = self.graphs.get(key)
        if entry is None:
            seen = self._seen.pop(key, 0) + 1
            if seen < self.capture_after:
                if len(self._seen) >= self.SEEN_LIMIT:
                    self._seen.pop(next(iter(self._seen)))
                self._seen[key] = seen
                self.eager_calls += 1
                return fn(*xs)
            if len(self.graphs) >= self.max_graphs:
                if not self.evict:
                    self._log_once("budget", f"{self.name}: graph budget ({self.max_graphs}) spent; new lengths run "
                                             "eagerly")
                    self.eager_calls += 1
                    return fn(*xs)
                del self.graphs[next(iter(self.graphs))]      # the least recently replayed
                if not self.graphs:   # a private pool nobody uses any more must not be captured into
                    self._pool = None
                self._log_once("evict", f"{self.name} graph budget ({self.max_graphs}) held: new shapes replace the "
                                        "least recently replayed graph (not logged again)")
            try:
                entry = self._capture(self._pad(xs, b, rows, axes) if rows != b else xs, fn)
            except Exception as exc:  # noqa: BLE001 - any capture failure: eager from now on
                self.off = f"capture failed: {exc}"
                self._log_once("capture", f"{self.name}: CUDA graph capture failed ({exc}); running eagerly")
                self.eager_calls += 1
                return fn(*xs)
            self.captures += 1
            self.graphs[key] = entry
        elif self.evict:
            self.graphs[key] = self.graphs.pop(key)           # now the most recently replayed
        graph, static_in, static_out, _ = entry
        if rows != b:
            # the real rows only: the padding keeps rows of an earlier call (finite; their outputs are dropped)
            for s, x, a in zip(static_in, xs, axes):
                s.narrow(a, 0, b).copy_(x)
        else:
            for s, x in zip(static_in, xs):
                s.copy_(x)
        graph.replay()
        self.replays += 1
        out = self._cut(static_out, b) if rows != b else static_out
        if not copy_out:
            return out
        # contiguous copies: a cut along a later axis is a strided view
        if isinstance(out, tuple):
            return tuple(o.clone(memory_format=torch.contiguous_format) for o in out)
        return out.clone(memory_format=torch.contiguous_format)

    def _capture(self, xs, fn):
        with self.capture_context():
            return self._capture_now(xs, fn)

    def _capture_now(self, xs, fn):
        static_in = [x.detach().clone() for x in xs]
        stream = torch.cuda.Stream(device=xs[0].device)
        stream.wait_stream(torch.cuda.current_stream(xs[0].device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmups):
                fn(*static_in)
        torch.cuda.current_stream(xs[0].device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with keepalive() as held, torch.cuda.graph(g, pool=self._pool):
            out = fn(*static_in)
        # the cached tensors the capture read (the encoder's position tables) live as long as the graph
        return g, static_in, out, held


class GraphedHiFT:
    """``HiFTGenerator.forward`` with its deterministic parts replayed from CUDA graphs; also the
    stage runner (``run_f0`` / ``run_excite`` / ``run_decode``) streams of either HiFT variant call.

    ``max_graphs`` bounds each of the F0 and decode graph sets (keys = batch bucket and lengths;
    ``batch_buckets``, default ``ROW_BUCKETS``, pads a call's rows up to the next bucket);
    ``capture_after`` is how often a key must be called before it is captured. A replay writes
    the graph's own buffers, so one caller at a time (as with the flow's graphs)."""

    def __init__(self, model: Union[HiFTGenerator, CausalHiFTGenerator], max_graphs: int = 8,
                 capture_after: int = 1, channels_last: Optional[bool] = None,
                 batch_buckets: Sequence[int] = ROW_BUCKETS):
        self.model = model
        self.causal = isinstance(model, CausalHiFTGenerator)
        # Weight norm computed once here instead of in every forward and replay (the state_dict is
        # unchanged; freeze the model again after loading other weights). On CUDA (by default)
        # the conv weights are kept time-major, so the convs run NHWC without layout conversions.
        model.freeze_weight_norm(channels_last)
        # every stage is row-independent with batch-first inputs and outputs: rows pad to batch buckets.
        # The causal HiFT's finalize flag is part of a graph's key (its look-ahead calls and the final call of an
        # utterance, whose lengths are those of the stream's steady history); the original ignores the flag.
        self.f0 = ShapeGraphs(model.run_f0, "HiFT f0", max_graphs, capture_after=capture_after,
                              batch_buckets=batch_buckets)
        self.decode = ShapeGraphs(model.run_decode, "HiFT decode", max_graphs, capture_after=capture_after,
                                  batch_buckets=batch_buckets)
        # the causal HiFT's block excitation has no randomness (fixed noise-table rows come in as
        # an input): graphed like F0 and decode, keyed by block length
        self.excite = (ShapeGraphs(model.run_excite, "HiFT excite", max_graphs, capture_after=capture_after,
                                   batch_buckets=batch_buckets)
                       if self.causal else None)
        # the causal streams' carried look-ahead decodes (hift_carry; opt-in per Vocoder): state in, state out
        self.decode_first = self.decode_next = None
        if self.causal:
            self.decode_first = ShapeGraphs(model.run_decode_first, "HiFT decode (first, carried)", max_graphs,
                                            capture_after=capture_after, batch_buckets=batch_buckets)
            self.decode_next = ShapeGraphs(model.run_decode_next, "HiFT decode (carried)", max_graphs,
                                           capture_after=capture_after, batch_buckets=batch_buckets)

    def shape_sets(self) -> dict[str, ShapeGraphs]:
        """The graph sets by stage name (``excite`` and the carried decodes only for the causal HiFT)."""
        sets = {"f0": self.f0, "decode": self.decode}
        if self.excite is not None:
            sets["excite"] = self.excite
            sets["decode_first"] = self.decode_first
            sets["decode_next"] = self.decode_next
        return sets

    def describe(self) -> str:
        """Which path ran, for logs and benchmarks."""
        d, f, e = self.decode, self.f0, self.excite
        sets = list(self.shape_sets().values())
        off = next((g.off for g in sets if g.off), None)
        state = f"off ({off})" if off else "on"
        excite = f" + {len(e.graphs)} excitation" if e is not None else ""
        carried = len(self.decode_first.graphs) + len(self.decode_next.graphs) if self.causal else 0
        carried_s = f" + {carried} carried decode" if carried else ""
        return (f"CUDA graphs {state}: {len(f.graphs)} F0{excite} + {len(d.graphs)} decode{carried_s} graphs, "
                f"{sum(g.replays for g in sets)} replays")

    # On CUDA a call may grow past its bucket, up to this many rows, to take whole shorter look-ahead calls along
    # (``hift._plan_calls``). Small graphed calls are latency-bound. Session 29 (before the convs' 2-D views) set
    # 4: growing to 2 or 4 rows beat two calls in every pairing, growing to 8 paid little or cost time (0.93-1.41
    # of two calls). After the views (benchmarks/results/hift_stage_probe_session31_h200.md, H200, as called) a
    # steady decode call takes 1.91 / 2.23 / 2.88 / 4.51 / 8.16 ms at buckets 1 / 2 / 4 / 8 / 16, and one call
    # grown to 8 rows costs 0.84-0.96 of a steady call plus a final chunk's look-ahead call (1.03 for 1 + 4 rows),
    # so growth now goes to 8; past 8 it cost 1.17-1.26. Off CUDA the calls are eager, their cost grows with the
    # rows, and the streams keep the batching the eager runner gives them.
    GROW_ROWS = 8

    @property
    def grow_rows(self) -> int:
        return self.GROW_ROWS if self.model.conv_pre.bias.device.type == "cuda" else 0

    @property
    def pads_excitation_blocks(self) -> bool:
        """Does a causal stream pad a short excitation block (an utterance's first, or those of its final push)
        to a whole one (``BoundedStream._excitation_block``, exact)? On CUDA: the steady blocks' graph per bucket
        instead of one per length (run eagerly or captured mid-serving; serving with final payloads of 1-25 codes
        met 22 lengths, ``stream_churn_excite_session32_h200.md``). Off CUDA the calls are eager and padding would
        only add work."""
        return self.causal and self.model.conv_pre.bias.device.type == "cuda"

    def frames_to_graph(self, op: str, args: tuple[torch.Tensor, ...], per_frame: Sequence[int],
                        finalize: Optional[bool] = None) -> int:
        """Zero frames to append to a look-ahead F0 or decode call (``hift.run_stage``) so that it replays a
        held graph of a longer call instead of running eagerly (``ShapeGraphs.frames_to_held``)."""
        sets = {"f0": self.f0, "decode": self.decode}
        if op not in sets:
            return 0
        return sets[op].frames_to_held(args, per_frame, **self._final(bool(finalize)))

    def row_bucket(self, rows: int) -> int:
        """The rows a stage call of ``rows`` rows runs at (its graph's batch bucket): ``hift.drive_many`` fills
        the padding with shorter look-ahead calls instead of running them apart."""
        return next((b for b in self.f0.batch_buckets if b >= rows), rows)

    def _final(self, finalize: bool) -> dict:
        # A causal utterance's final call (zero look-ahead) covers the steady history plus the look-ahead
        # frames, the same lengths for every stream that ends after a steady chunk: graphed like the others
        # (capture_after keeps the odd lengths of very short utterances eager).
        return {"finalize": bool(finalize)} if self.causal else {}

    @torch.inference_mode()
    def run_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        with ieee_fp32():
            return self.f0(mel, copy_out=True, **self._final(finalize))

    @torch.inference_mode()
    def run_decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        with ieee_fp32():
            return self.decode(mel, source, copy_out=True, **self._final(finalize))

    @torch.inference_mode()
    def run_decode_first(self, mel: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with ieee_fp32():
            return self.decode_first(mel, source, copy_out=True)

    @torch.inference_mode()
    def run_decode_next(self, mel: torch.Tensor, source: torch.Tensor,
                        state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with ieee_fp32():
            return self.decode_next(mel, source, state, copy_out=True)

    @torch.inference_mode()
    def run_excite(self, f0: torch.Tensor, phase: torch.Tensor,
                   noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.causal:
            raise TypeError("GraphedHiFT.run_excite: only the causal HiFT has a stage excitation; the original "
                            "HiFT draws its excitation from the stream's generator")
        with ieee_fp32():
            return self.excite(f0, phase, noise, copy_out=True)

    @torch.inference_mode()
    def __call__(self, mel: torch.Tensor, cache_source: Optional[torch.Tensor] = None,
                 generator: Optional[torch.Generator] = None, copy_out: bool = True):
        """The original HiFT's ``forward(mel, cache_source, generator) -> (wav, source)``."""
        if self.causal:
            raise TypeError("GraphedHiFT(...)(mel, cache_source, generator) is the original HiFT's forward; "
                            "drive the causal HiFT through BoundedStream (runner=GraphedHiFT) instead")
        with ieee_fp32():
            f0 = self.f0(mel.contiguous())
            source = self.model.excitation(f0, generator)
            if cache_source is not None and cache_source.shape[2]:
                source[:, :, :cache_source.shape[2]] = cache_source
            wav = self.decode(mel.contiguous(), source)
        return (wav.clone() if copy_out else wav), source

    forward = __call__
