"""Mel -> 24 kHz waveform: load whichever HiFT an asset set carries, behind one small interface.

Real asset sets differ (CONFIG_PROVENANCE.md §6):
- stepaudio2-minicpmo 0.1.1 / vLLM-Omni: ``hift.pt`` = the original HiFT, used for
  whole utterances and (with mel cache + cross-fade) for streaming;
- minicpmo-utils 1.0.7: ``hift.pt`` = the CosyVoice3 causal HiFT (streaming, with
  ``config.yaml``) and ``hift_original.pt`` = the original HiFT (whole utterances).
Both have the same 328 key names; eight shapes tell them apart (``detect_variant``).

API (stable; the Code2Wav pipeline builds on it)::

    voc = load_vocoders(asset_dir, device)     # VocoderSet(stream=..., whole=...)
    wav = voc.whole.vocode(mel)                # mel [B, 80, T] -> wav [B, T*480] float32
    st = voc.stream.open_stream()              # VocoderStream
    st.push(mel_chunk, last=False) -> wav [1, n]  (new samples only; float32, 24 kHz)
    st.reset()
    wavs = voc.stream.push_many([(st1, mel1, False), (st2, mel2, True)])   # batched across streams

On CUDA a ``Vocoder``'s streams run the generator's F0 and decode stages from CUDA graphs
(``hift_graph.GraphedHiFT``, one per ``Vocoder``, IEEE FP32; ``cuda_graphs=False`` turns them
off); on the CPU they run eagerly. ``push_many`` runs equal-shape stage calls of several streams
as one batched call; each stream keeps its own state and random excitation.

``load_vocoder(path)`` loads one file. Files may carry a ``generator.`` key prefix
and legacy ``weight_g``/``weight_v`` weight-norm keys; the strict check lists every
missing, unexpected and mis-shaped key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Protocol, Sequence, Union

import torch

from ..checkpoint.weights import load_strict
from ..errors import CheckpointError, InputError
from .hift import (FULL_SIZE, SAMPLE_RATE, HiFTConfig, HiFTGenerator, HiFTStream, StageRunner, Steps, drive_many,
                   fuse_weight_norm)
from .hift_causal import BoundedStream, CausalHiFTGenerator
from .hift_graph import ROW_BUCKETS, GraphedHiFT

ORIGINAL = "original"
CAUSAL = "causal"
STREAM_FILE = "hift.pt"
WHOLE_FILE = "hift_original.pt"
CONFIG_FILE = "config.yaml"

Generator = Union[HiFTGenerator, CausalHiFTGenerator]


class VocoderStream(Protocol):
    """One utterance of streaming vocoding (batch 1)."""

    model: Generator

    def push(self, mel: torch.Tensor, last: bool = False) -> torch.Tensor:
        """New mel frames [1, 80, t] -> newly final samples [1, n] (float32, 24 kHz)."""

    def steps(self, mel: torch.Tensor, last: bool = False) -> Steps:
        """``push`` as generator stage calls (``hift.StageCall``), for batching across streams."""

    def reset(self) -> None:
        """Forget the utterance; the next push starts a new one."""

    def snapshot(self) -> dict:
        """Opaque state for ``restore`` (turn rollback); cheap, shares tensors."""

    def restore(self, snap: dict) -> None:
        """Return to a ``snapshot``; later pushes then give what they gave after it."""


# ----------------------------------------------------------------------------- state dicts

def normalize_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip a ``generator.`` prefix and rename legacy weight-norm keys to the parametrization form."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith("generator."):
            key = key[len("generator."):]
        if key.endswith(".weight_g"):
            key = key[: -len("weight_g")] + "parametrizations.weight.original0"
        elif key.endswith(".weight_v"):
            key = key[: -len("weight_v")] + "parametrizations.weight.original1"
        out[key] = value
    return out


_VARIANT_KEYS = ("conv_pre.parametrizations.weight.original1",
                 "f0_predictor.condnet.0.parametrizations.weight.original1",
                 "ups.0.parametrizations.weight.original1")


def detect_variant(state: Mapping[str, torch.Tensor], where: str) -> str:
    """``ORIGINAL`` or ``CAUSAL`` from the F0 predictor's first kernel (3 vs 4) and the
    upsamplers' layout (ConvTranspose [in, out, k] vs Conv [out, in, k]); refuses files
    whose signals disagree."""
    missing = [k for k in _VARIANT_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{where}: not a HiFT state_dict (lacks {', '.join(missing)})")
    f0_kernel = state[_VARIANT_KEYS[1]].shape[-1]
    up = state[_VARIANT_KEYS[2]].shape
    base = state[_VARIANT_KEYS[0]].shape[0]
    votes = {ORIGINAL if f0_kernel == 3 else CAUSAL if f0_kernel == 4 else "?",
             ORIGINAL if up[0] == base else CAUSAL if up[1] == base else "?"}
    if len(votes) != 1 or "?" in votes:
        raise CheckpointError(f"{where}: shapes match neither HiFT variant (f0_predictor.condnet.0 kernel "
                              f"{f0_kernel}, ups.0 {list(up)}, conv_pre out {base})")
    return votes.pop()


def config_from_state(state: Mapping[str, torch.Tensor], variant: str) -> HiFTConfig:
    """Dimensions from the weights; rates and kernel sets are the released (24 kHz) values."""
    conv_pre = state["conv_pre.parametrizations.weight.original1"].shape
    cfg = dataclasses.replace(FULL_SIZE, in_channels=conv_pre[1], base_channels=conv_pre[0],
                              f0_channels=state["f0_predictor.classifier.weight"].shape[1],
                              nb_harmonics=state["m_source.l_linear.weight"].shape[1] - 1)
    if variant == CAUSAL:
        cfg = dataclasses.replace(cfg, conv_pre_look_right=conv_pre[2] - 1)
    return cfg


def build_generator(variant: str, cfg: HiFTConfig = FULL_SIZE) -> Generator:
    return CausalHiFTGenerator(cfg) if variant == CAUSAL else HiFTGenerator(cfg)


def read_state(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; a snapshot's assets/token2wav/ must hold the HiFT vocoder "
                              f"weights ({STREAM_FILE}; minicpmo-utils 1.0.7 sets also {WHOLE_FILE} and {CONFIG_FILE})")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise CheckpointError(f"{path}: cannot be read as a torch state_dict ({exc})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, expected a state_dict of tensors")
    return normalize_keys(state)


# ----------------------------------------------------------------------------- the interface

@dataclass
class Vocoder:
    """One loaded HiFT. ``vocode`` = whole utterance; ``open_stream`` = chunked; ``push_many`` =
    one chunk into each of several streams, batched.

    ``cuda_graphs`` (default on): when the model is on CUDA at construction, its streams run the
    generator stages through one shared ``GraphedHiFT`` (at most ``max_graphs`` F0 and as many
    decode graphs; a length is captured on its second call; ``push_many``'s batched calls pad their
    rows to ``batch_buckets``). Off, or off CUDA: eagerly.

    ``stream_block_frames`` is the causal streams' internal decode block. Default: 16 (as
    upstream) on the eager path; 50 with graphs, so a steady 1-s chunk (50 mel frames) is one F0,
    one excitation and one decode replay instead of four of each (each block re-decodes ~31
    frames of history). The block size changes only rounding (test_hift_parity)."""

    model: Generator
    variant: str
    source: Optional[Path] = None
    sample_rate: int = SAMPLE_RATE
    cuda_graphs: bool = True
    max_graphs: int = 32
    batch_buckets: tuple[int, ...] = ROW_BUCKETS
    stream_block_frames: Optional[int] = None
    # opt-in: causal streams decode only new frames after their first chunk, carrying each conv's left context
    # (``hift_carry``) instead of re-decoding ~31 frames of history per decode block
    stream_carry: bool = False
    runner: StageRunner = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        on_cuda = self.model.conv_pre.bias.device.type == "cuda"
        self.runner = (GraphedHiFT(self.model, self.max_graphs, capture_after=2,
                                   batch_buckets=self.batch_buckets) if self.cuda_graphs and on_cuda
                       else self.model)
        if self.stream_block_frames is None:
            self.stream_block_frames = 50 if isinstance(self.runner, GraphedHiFT) else 16
        if self.stream_block_frames < 1:
            raise ValueError(f"Vocoder: stream_block_frames must be >= 1, got {self.stream_block_frames}")

    def describe_stream_path(self) -> str:
        """Which path stream vocoding takes (for logs and benchmarks)."""
        block = f", decode blocks of {self.stream_block_frames} frames" if self.variant == CAUSAL else ""
        if self.variant == CAUSAL and self.stream_carry:
            block += ", carried context"
        if isinstance(self.runner, GraphedHiFT):
            return f"{self.variant} HiFT, {self.runner.describe()}{block}"
        return f"{self.variant} HiFT, eager{block}"

    @property
    def hop(self) -> int:
        return self.model.cfg.hop

    @property
    def device(self) -> torch.device:
        return self.model.conv_pre.bias.device

    def _check(self, mel: torch.Tensor, batch1: bool = False) -> torch.Tensor:
        c = self.model.cfg.in_channels
        if mel.ndim != 3 or mel.shape[1] != c or (batch1 and mel.shape[0] != 1):
            want = f"[1, {c}, T]" if batch1 else f"[B, {c}, T]"
            raise InputError(f"mel: expected shape {want}, got {list(mel.shape)}")
        return mel.to(self.device, torch.float32)

    @torch.inference_mode()
    def vocode(self, mel: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """mel [B, 80, T] -> wav [B, T*480] float32. ``generator`` seeds the original HiFT's
        random excitation (the causal one uses fixed noise tables)."""
        mel = self._check(mel)
        if mel.shape[2] == 0:
            return mel.new_zeros(mel.shape[0], 0)
        if self.variant == CAUSAL:
            return self.model(mel, finalize=True)[0]
        return self.model(mel, generator=generator)[0]

    def open_stream(self, lead_silence: Optional[bool] = None, generator: Optional[torch.Generator] = None,
                    block_frames: Optional[int] = None) -> VocoderStream:
        """A fresh stream. ``lead_silence`` defaults to each upstream's behaviour: on for the
        causal vocoder (1.0.7 prefixes its first chunk with 8 frames of zeros), off for the
        original (0.1.1: the first chunk is 3840 samples short). ``block_frames`` (causal only)
        is the internal decode block (default ``stream_block_frames``): 16 as upstream; 50 decodes a
        1-s chunk ~2.5x faster on CPU and ~3.5x on the H200 (each block re-decodes ~31 frames of
        history) with output equal to fp32 noise."""
        if block_frames is None:
            block_frames = self.stream_block_frames
        if self.variant == CAUSAL:
            return BoundedStream(self.model, block_frames=block_frames,
                                 lead_silence=True if lead_silence is None else lead_silence, runner=self.runner,
                                 carry=self.stream_carry)
        return HiFTStream(self.model, lead_silence=bool(lead_silence), generator=generator, runner=self.runner)

    def push_many(self, items: Sequence[tuple[VocoderStream, torch.Tensor, bool]],
                  max_batch: Optional[int] = None) -> list[torch.Tensor]:
        """Push ``(stream, mel [1, 80, t], last)`` for several streams of this vocoder -> each
        stream's new samples [1, n], in order.

        The streams step in lockstep; generator calls whose inputs have equal shapes (equal mel
        lengths and cache states: the steady state of concurrent streams) run as ONE batched call
        of at most ``max_batch`` rows, the rest alone. From graphs (rows padded to a batch bucket) the
        causal HiFT's shorter look-ahead calls (a stream's first or final chunk) fill a longer call's
        padding rows instead of running apart (``hift.drive_many``). Each stream draws its own excitation (its
        generator / phase state) exactly as alone, so the samples equal each stream pushed alone
        up to the batched call's rounding. If anything fails, every stream is restored to its
        state before the call (the global RNG, which generator-less original-HiFT streams
        share, is not rewound)."""
        streams = [it[0] for it in items]
        if len({id(s) for s in streams}) != len(streams):
            raise InputError("Vocoder.push_many: a stream appears more than once; push its chunks in separate calls")
        for i, s in enumerate(streams):
            if getattr(s, "model", None) is not self.model:
                raise InputError(f"Vocoder.push_many: item {i} is a stream of another vocoder; push it through "
                                 "the Vocoder that opened it")
        if max_batch is not None and max_batch < 1:
            raise InputError(f"Vocoder.push_many: max_batch must be >= 1 (or None for no cap), got {max_batch}")
        snaps = [s.snapshot() for s in streams]
        try:
            steps = [s.steps(mel, bool(last)) for s, mel, last in items]
            return drive_many(steps, self.runner, max_batch)
        except BaseException:
            for s, snap in zip(streams, snaps):
                s.restore(snap)
            raise


@dataclass
class VocoderSet:
    """What an asset dir offers: ``stream`` from hift.pt, ``whole`` from hift_original.pt if present, else hift.pt."""

    stream: Vocoder
    whole: Vocoder


def load_vocoder(path: str | Path, device: str | torch.device = "cpu",
                 config_yaml: str | Path | None = None, fuse: bool = True, cuda_graphs: bool = True) -> Vocoder:
    """Load one HiFT file strictly; the variant comes from its shapes. A causal file's
    hyper-parameters come from ``config_yaml`` (default: ``config.yaml`` beside it) when
    present, else from the weights' shapes. ``fuse`` folds weight norm into plain weights
    after loading (same values, no per-forward norm; the model's state_dict keys change).
    ``cuda_graphs``: see ``Vocoder``."""
    path = Path(path)
    state = read_state(path)
    variant = detect_variant(state, str(path))
    cfg = config_from_state(state, variant)
    if variant == CAUSAL:
        yaml_path = Path(config_yaml) if config_yaml is not None else path.parent / CONFIG_FILE
        if yaml_path.is_file():
            from .vocoder_config import read_vocoder_yaml

            cfg = read_vocoder_yaml(yaml_path).hift
    with torch.device("meta"):
        model = build_generator(variant, cfg)
    load_strict(model, {k: v.float() for k, v in state.items()}, str(path))
    if fuse:
        fuse_weight_norm(model)
    return Vocoder(model.to(device).eval(), variant, path, cuda_graphs=cuda_graphs)


def load_vocoders(asset_dir: str | Path, device: str | torch.device = "cpu", fuse: bool = True,
                  cuda_graphs: bool = True) -> VocoderSet:
    """The asset dir's stream and whole-utterance vocoders; ``cuda_graphs``: see ``Vocoder``."""
    asset_dir = Path(asset_dir)
    stream = load_vocoder(asset_dir / STREAM_FILE, device, fuse=fuse, cuda_graphs=cuda_graphs)
    whole_path = asset_dir / WHOLE_FILE
    if whole_path.is_file():
        whole = load_vocoder(whole_path, device, fuse=fuse, cuda_graphs=cuda_graphs)
        if whole.variant != ORIGINAL:
            raise CheckpointError(f"{whole_path}: holds the causal HiFT; this file is the original "
                                  "(whole-utterance) vocoder in minicpmo-utils 1.0.7 asset sets")
    else:
        whole = stream
    return VocoderSet(stream, whole)


# ----------------------------------------------------------------------------- registry hooks

def build_hift_part(asset_dir: Optional[Path]) -> Generator:
    """``hift.pt``: ``None`` -> the released 1.0.7 layout (causal CV3); else what the file holds."""
    if asset_dir is None:
        return CausalHiFTGenerator(FULL_SIZE)
    return _build_from_file(Path(asset_dir) / STREAM_FILE)


def build_hift_original_part(asset_dir: Optional[Path]) -> Generator:
    """``hift_original.pt``: the original HiFT."""
    if asset_dir is None:
        return HiFTGenerator(FULL_SIZE)
    return _build_from_file(Path(asset_dir) / WHOLE_FILE)


def _build_from_file(path: Path) -> Generator:
    state = read_state(path)
    variant = detect_variant(state, str(path))
    return build_generator(variant, config_from_state(state, variant))


def write_tiny_hift(asset_dir: Path, seed: int) -> None:
    """Tiny ``hift.pt`` (causal CV3), ``hift_original.pt`` (original) and ``config.yaml``:
    small channels, real rates (24 kHz, 480 samples per frame), random fp32 weights."""
    from ..checkpoint.tiny import randomize_
    from .hift import TINY
    from .vocoder_config import write_vocoder_yaml

    asset_dir = Path(asset_dir)
    write_vocoder_yaml(TINY, asset_dir / CONFIG_FILE)
    for name, model in ((STREAM_FILE, CausalHiFTGenerator(TINY)), (WHOLE_FILE, HiFTGenerator(TINY))):
        randomize_(model, seed, prefix=name + ":")
        torch.save({k: v.detach().float().contiguous() for k, v in model.state_dict().items()}, asset_dir / name)
