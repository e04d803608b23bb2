"""The original (non-causal) CosyVoice2 HiFT vocoder and its cross-faded streaming wrapper.

HiFT = neural source filter + iSTFTNet: an F0 predictor turns the mel into a pitch
track, a harmonic oscillator turns the pitch into an excitation signal, and a
HiFi-GAN-style upsampler (fed the excitation's STFT at every scale) predicts
magnitude and phase of a small (n_fft 16, hop 4) inverse STFT at 24 kHz.

Module and parameter names follow upstream ``HiFTGenerator`` so its ``hift.pt``
(0.1.1 / vLLM-Omni) or ``hift_original.pt`` (minicpmo-utils 1.0.7) loads strictly.
Weight norm uses torch's parametrization API, so keys read
``<conv>.parametrizations.weight.original0`` (g) / ``original1`` (v).

The building blocks here (``HiFTConfig``, ``ResBlock``, ``Snake``, the STFT pair)
are shared with ``hift_causal``, and so is the stream-step protocol: a stream's ``push`` is
written as a coroutine (``steps``) that yields each deterministic generator stage it needs
(``StageCall``: F0, excitation of the causal HiFT, decode) and receives its result. ``drive``
runs one stream's steps with batch-1 calls; ``drive_many`` runs several streams' steps in
lockstep and batches calls of equal shapes into one generator call (rows = streams). Both run
the calls through a *runner*: the generator itself (eager) or a ``hift_graph.GraphedHiFT``.

Fast path (CUDA, FP32, grad off), same formulas: ``freeze_weight_norm`` computes each weight-normed
conv's weight once (``GraphedHiFT`` does it when built) and on CUDA keeps every conv weight
time-major, so cuDNN runs the 1-D convs as NHWC without converting layouts and the whole trunk
stays time-major; each Snake is one Triton kernel (``kernels.snake``) that also adds the bias of
the conv before it, the residual, and writes the next conv's zero padding; LeakyReLU + the causal
upsampler's repeat + padding are one kernel too. On the CPU the forward runs the plain torch ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Generator, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from .precision import ieee_fp32

SAMPLE_RATE = 24000
MEL_BINS = 80


@dataclass(frozen=True)
class HiFTConfig:
    """Constructor arguments shared by both HiFT variants (upstream names and defaults)."""

    in_channels: int = MEL_BINS
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = SAMPLE_RATE
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_channels: int = 512  # F0 predictor's cond_channels
    conv_pre_look_right: int = 4  # causal variant only

    @property
    def hop(self) -> int:
        """Output samples per mel frame (480 at 24 kHz)."""
        return int(math.prod(self.upsample_rates)) * self.hop_len

    def validate(self, where: str) -> "HiFTConfig":
        from ..errors import CheckpointError

        problems = []
        if self.sampling_rate != SAMPLE_RATE or self.hop != 480:
            problems.append(f"sampling_rate {self.sampling_rate} / hop {self.hop}: need 24000 Hz and 480 samples per frame")
        if self.sampling_rate == 22050:
            problems.append("the 22.05 kHz SineGen variant is not implemented")
        if not (len(self.upsample_rates) == len(self.upsample_kernel_sizes) == len(self.source_resblock_kernel_sizes)
                == len(self.source_resblock_dilation_sizes)):
            problems.append("upsample_rates, upsample_kernel_sizes and source_resblock_* must have equal lengths")
        if self.base_channels % (2 ** len(self.upsample_rates)):
            problems.append(f"base_channels {self.base_channels} not divisible by 2^{len(self.upsample_rates)}")
        if problems:
            raise CheckpointError(f"{where}: unsupported HiFT configuration: " + "; ".join(problems))
        return self


FULL_SIZE = HiFTConfig()
# Test size: small channels, but the real rates (24 kHz, 480 samples per frame, n_fft 16).
TINY = dataclasses.replace(FULL_SIZE, base_channels=16, f0_channels=16)


# Where the fused element-wise kernels of ``kernels.snake`` run (Snake, and the LeakyReLU, conv
# bias, residual add, nearest upsampling and zero padding around the convs, folded into single
# launches). Changed only through ``fused_kernels`` (which restores it). A ContextVar, not a module global:
# each thread (and asyncio task) sees only the modes its own ``with`` blocks set, so two streams decoding on
# different threads cannot switch each other's path.
_fused_mode: ContextVar[Optional[bool]] = ContextVar("hift_fused_mode", default=None)


@contextlib.contextmanager
def fused_kernels(mode: Optional[bool]):
    """Inside the block the HiFT forward takes the fused kernels: ``None`` (the default outside)
    on CUDA tensors when Triton is available; ``True`` wherever a Triton kernel can run (also on
    the CPU under TRITON_INTERPRET=1, for tests); ``False`` never (the torch reference ops).
    CUDA graphs keep the path that was active when they were captured."""
    token = _fused_mode.set(mode)
    try:
        yield
    finally:
        _fused_mode.reset(token)


def fused_kernels_for(x: torch.Tensor) -> bool:
    """Whether the HiFT forward on ``x`` takes the fused-kernel path (FP32, grad off: the kernels
    have no backward)."""
    mode = _fused_mode.get()
    if mode is False or x.dtype != torch.float32 or torch.is_grad_enabled():
        return False
    from .kernels import AVAILABLE, usable_on

    return AVAILABLE and (x.is_cuda if mode is None else usable_on(x))


def _kernels():
    from .kernels import snake as kernels

    return kernels


def snake_reference(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The Snake formula in torch ops, as upstream writes it (the reference for the kernel)."""
    a = alpha[None, :, None]
    return x + (1.0 / (a + 1e-9)) * torch.sin(x * a).pow(2)


def snake(x: torch.Tensor, alpha: torch.Tensor, left: int = 0, right: int = 0,
          residual: Optional[torch.Tensor] = None) -> Any:
    """Snake of ``x`` (or of ``x + residual``), then ``left`` / ``right`` zero frames of padding;
    with ``residual`` returns (activation, sum). One fused kernel where ``fused_kernels_for``
    allows (see ``kernels.snake``), else the same ops in torch."""
    if alpha.dtype == torch.float32 and fused_kernels_for(x):
        return _kernels().snake(x, alpha, left, right, residual)
    if residual is not None:
        x = x + residual
    y = snake_reference(x, alpha)
    if left or right:
        y = F.pad(y, (left, right))
    return y if residual is None else (y, x)


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, per channel (BigVGAN's periodic activation)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return snake(x, self.alpha)

    def padded(self, x: torch.Tensor, left: int, right: int, residual: Optional[torch.Tensor] = None) -> Any:
        """``F.pad(self(x [+ residual]), (left, right))`` [and the sum], fused on the kernel path."""
        return snake(x, self.alpha, left, right, residual)


def is_time_major(t: torch.Tensor) -> bool:
    """A 3-D tensor [N, C, T] whose channels are contiguous in memory ([N, T, C] order): how the
    convs' NHWC (channels-last) kernels read and write 1-D signals."""
    return t.ndim == 3 and t.shape[1] > 1 and t.stride(1) == 1 and (t.shape[2] == 1 or t.stride(2) == t.shape[1])


# Where a conv on a time-major input with a time-major weight runs as the 2-D conv of their [N, C, 1, T]
# views instead of through ``F.conv1d``. torch's 1-D convolution makes every 3-D input contiguous before it
# widens it to 2-D ("avoid accidentally going through NHWC"), then, the weight being channels-last, copies it
# back to NHWC for cuDNN: two transposing copies of the whole activation per conv, 158 per steady decode call,
# 6.6 of its 14.3 ms at batch 16 on the H200 (benchmarks/results/hift_decode_kernels_session29_h200.md). The
# 2-D call hands cuDNN the same NHWC operands without them. Changed only through ``conv1d_as_2d`` (which
# restores it; per thread, like ``_fused_mode``).
_conv_as_2d: ContextVar[Optional[bool]] = ContextVar("hift_conv_as_2d", default=None)


@contextlib.contextmanager
def conv1d_as_2d(mode: Optional[bool]):
    """Inside the block the HiFT's convs on time-major operands run as 2-D convs of their views: ``None`` (the
    default outside) on CUDA tensors; ``True`` on any device (CPU tests of the formulation); ``False`` never
    (``F.conv1d``, with the copies above; for comparisons). CUDA graphs keep the path that was active when
    they were captured."""
    token = _conv_as_2d.set(mode)
    try:
        yield
    finally:
        _conv_as_2d.reset(token)


def _as_2d(x: torch.Tensor, weight: torch.Tensor, m: nn.Module) -> bool:
    mode = _conv_as_2d.get()
    if mode is False or (mode is None and not x.is_cuda):
        return False
    return (m.padding_mode == "zeros" and not isinstance(m.padding, str) and is_time_major(x)
            and is_time_major(weight))


# The left context a carried decode call (``hift_carry``) gives each stride-1 causal conv: while set, a conv's
# left padding is overwritten with the stream's own earlier input and its input's last frames are kept for
# the next call (``Carry.splice``). Changed only through ``carrying`` (which restores it; per thread).
_carry: ContextVar[Any] = ContextVar("hift_carry", default=None)


@contextlib.contextmanager
def carrying(carry: Any):
    """Inside the block the stride-1 convs with left padding read and leave their left context in ``carry``
    (``hift_carry.Carry``). CUDA graphs keep the carry they were captured with: its tensors are the graph's."""
    token = _carry.set(carry)
    try:
        yield carry
    finally:
        _carry.reset(token)


def to_time_major(t: torch.Tensor) -> torch.Tensor:
    """The same values [N, C, T], laid out time-major."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def reflect_pad_left1(x: torch.Tensor) -> torch.Tensor:
    """``F.pad(x, (1, 0), mode="reflect")`` that keeps a time-major input time-major (torch's
    reflection pad returns a contiguous tensor, which the next conv would convert back)."""
    if not is_time_major(x) or x.shape[2] < 2:
        return F.pad(x, (1, 0), mode="reflect")
    b, c, t = x.shape
    out = x.new_empty(b, t + 1, c).transpose(1, 2)
    out[:, :, 1:].copy_(x)
    out[:, :, :1].copy_(x[:, :, 1:2])
    return out


# ----------------------------------------------------------------------------- frozen weights
#
# Weight norm (torch's parametrization) recomputes a conv's weight from g and v on every access,
# so every forward (and every CUDA-graph replay) launches one ``weight_norm`` kernel per conv.
# ``freeze_weight_norm`` computes each weight once, with the very op the parametrization runs
# (``torch._weight_norm`` on the same g and v), and keeps it beside the module, outside the
# state_dict; the forwards read it through ``frozen`` / ``conv_weight``. A frozen copy is used
# only while grad is off and while every parameter of its module is still the tensor it was
# computed from (same storage, dtype, device and in-place version): loading new weights,
# moving or casting the model, or editing a parameter in place makes the module compute its
# weights per call again until it is frozen anew, so a frozen model never serves stale weights.

_FROZEN = "_hift_frozen"


def _param_stamp(m: nn.Module) -> tuple:
    """What a module's frozen tensors were computed from: each parameter's identity and version."""
    return tuple((p.device, p.dtype, p.data_ptr(), -1 if p.is_inference() else p._version)
                 for p in m.parameters())


def frozen(m: nn.Module, key: Any) -> Optional[torch.Tensor]:
    """Module ``m``'s frozen tensor ``key`` if it has one that is still valid and grad is off."""
    entry = m.__dict__.get(_FROZEN)
    if entry is None or torch.is_grad_enabled() or entry[0] != _param_stamp(m):
        return None
    return entry[1].get(key)


def conv_weight(m: nn.Module) -> torch.Tensor:
    """The weight a conv's forward uses: its frozen copy while valid, else ``m.weight``."""
    w = frozen(m, "weight")
    return m.weight if w is None else w


def freeze_tensors(m: nn.Module, tensors: dict) -> None:
    """Keep ``tensors`` (computed now from ``m``'s parameters) as ``m``'s frozen tensors. A key
    frozen before with the same shape, dtype, device and layout is overwritten in place, so a
    CUDA graph captured while reading it reads the new values; a frozen tensor that is replaced
    (other layout or device) stays allocated with the module, so no captured graph ever reads
    freed memory."""
    entry = m.__dict__.get(_FROZEN)
    old, retired = (entry[1], entry[2]) if entry is not None else ({}, [])
    table = {}
    for k, t in tensors.items():
        t = t.detach()
        o = old.get(k)
        if o is not None and o is not t:
            if o.shape == t.shape and o.dtype == t.dtype and o.device == t.device and o.stride() == t.stride():
                o.copy_(t)
                t = o
            else:
                retired = retired + [o]
        table[k] = t
    object.__setattr__(m, _FROZEN, (_param_stamp(m), table, retired))


def freeze_weight_norm(model: nn.Module, channels_last: Optional[bool] = None) -> int:
    """Compute every weight-normed module's weight once and use it in forward (see above).

    The values are those ``torch._weight_norm`` gives per call (same op, same inputs, same
    device); the parametrization, hence the state_dict and strict loading, is unchanged. Modules
    may add more frozen tensors (``_freeze_extra(table)``, e.g. the causal F0 predictor's float64
    copies). Freeze again after changing the weights; returns the number of modules frozen.

    ``channels_last`` (default: for modules on CUDA) also keeps every conv's weight, weight-normed
    or not, time-major (``to_time_major``: same values, NHWC order). cuDNN then runs the convs on
    NHWC data without converting input, weight and output around each one, and every activation
    of the trunk stays time-major. Without it (the CPU default) outputs are bit-identical to the
    unfrozen model; with it, only cuDNN's choice of kernels (hence rounding) changes."""
    n = 0
    with torch.inference_mode(False), torch.no_grad():
        for m in model.modules():
            table: dict = {}
            if parametrize.is_parametrized(m, "weight"):
                table["weight"] = m.weight  # the parametrization's own forward, run once
            if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)):
                cl = m.bias.is_cuda if channels_last is None and m.bias is not None else bool(channels_last)
                if cl:
                    table["weight"] = to_time_major(table.get("weight", m.weight))
            extra = getattr(m, "_freeze_extra", None)
            if extra is not None:
                extra(table)
            if table:
                freeze_tensors(m, table)
                n += 1
    return n


def unfreeze_weight_norm(model: nn.Module) -> None:
    """Stop using frozen tensors: weights are computed per call again (the tensors stay allocated
    with their modules, for graphs captured while they were in use)."""
    for m in model.modules():
        entry = m.__dict__.get(_FROZEN)
        if entry is not None:
            object.__setattr__(m, _FROZEN, (None, {}, entry[2] + list(entry[1].values())))


class Conv1d(nn.Conv1d):
    """``nn.Conv1d`` that reads its frozen weight when it has one (``freeze_weight_norm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, conv_weight(self), self.bias)

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if _as_2d(x, weight, self):     # the [N, C, 1, T] views are channels-last: cuDNN reads them in place
            return F.conv2d(x.unsqueeze(2), weight.unsqueeze(2), bias, (1, self.stride[0]), (0, self.padding[0]),
                            (1, self.dilation[0]), self.groups).squeeze(2)
        return super()._conv_forward(x, weight, bias)

    def conv_padded(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """The conv on an input that already carries the module's explicit padding (the
        ``PaddedConv1d`` kind); ``bias=False`` leaves the bias to a fused kernel after it. While a carry is
        active (``carrying``) a stride-1 conv's left padding is the stream's own earlier input instead."""
        carry = _carry.get()
        if carry is not None and self.stride[0] == 1 and getattr(self, "left", 0):
            x = carry.splice(self, x, self.left)
        return self._conv_forward(x, conv_weight(self), self.bias if bias else None)

    def act_forward(self, x: torch.Tensor, slope: float) -> torch.Tensor:
        """``self(F.leaky_relu(x, slope))``."""
        return self(F.leaky_relu(x, slope))


class ConvTranspose1d(nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` that reads its frozen weight when it has one."""

    def forward(self, x: torch.Tensor, output_size: Optional[list[int]] = None) -> torch.Tensor:
        if output_size is not None:
            return super().forward(x, output_size)
        w = conv_weight(self)
        if _as_2d(x, w, self):      # as Conv1d: no transposing copies around cuDNN
            return F.conv_transpose2d(x.unsqueeze(2), w.unsqueeze(2), self.bias, (1, self.stride[0]),
                                      (0, self.padding[0]), (0, self.output_padding[0]), self.groups,
                                      (1, self.dilation[0])).squeeze(2)
        return F.conv_transpose1d(x, w, self.bias, self.stride, self.padding,
                                  self.output_padding, self.groups, self.dilation)

    def act_forward(self, x: torch.Tensor, slope: float) -> torch.Tensor:
        """``self(F.leaky_relu(x, slope))``."""
        return self(F.leaky_relu(x, slope))


def causal_padding(kernel_size: int, dilation: int = 1) -> int:
    """Upstream ``CausalConv1d.causal_padding`` (== (k-1)*d for the sizes in use)."""
    return (kernel_size * dilation - dilation) // 2 * 2 + (kernel_size + 1) % 2


class PaddedConv1d(Conv1d):
    """Stride-1 conv that pads ``left`` / ``right`` zeros itself.

    ``right_context`` replaces the right zeros with real future frames (causal
    streaming: the conv then only produces outputs whose look-ahead is known).
    ``conv_padded`` is the conv alone, on an input that already carries its padding.
    """

    def __init__(self, cin: int, cout: int, kernel_size: int, dilation: int = 1,
                 left: int = 0, right: int = 0):
        super().__init__(cin, cout, kernel_size, 1, padding=0, dilation=dilation)
        self.left, self.right = left, right

    def act_forward(self, x: torch.Tensor, slope: float) -> torch.Tensor:
        """``self(F.leaky_relu(x, slope))``; on the fused path the activation writes the padding."""
        if fused_kernels_for(x):
            return self.conv_padded(_kernels().act_pad(x, "leaky", slope=slope, left=self.left, right=self.right))
        return self(F.leaky_relu(x, slope))

    def forward(self, x: torch.Tensor, right_context: Optional[torch.Tensor] = None) -> torch.Tensor:
        if right_context is not None:
            x = torch.cat([x, right_context], dim=2)
            return self.conv_padded(F.pad(x, (self.left, 0)) if self.left else x)
        if self.left or self.right:
            x = F.pad(x, (self.left, self.right))
        return self.conv_padded(x)


class ResBlock(nn.Module):
    """Three (Snake -> dilated conv -> Snake -> conv) residual units.

    ``causal`` pads each conv entirely on the left (CosyVoice3 causal HiFT);
    otherwise symmetrically.
    """

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int], causal: bool = False):
        super().__init__()

        def conv(d: int) -> nn.Module:
            if causal:
                return weight_norm(PaddedConv1d(channels, channels, kernel_size, d, left=causal_padding(kernel_size, d)))
            pad = (kernel_size * d - d) // 2
            return weight_norm(PaddedConv1d(channels, channels, kernel_size, d, left=pad, right=pad))

        self.convs1 = nn.ModuleList([conv(d) for d in dilations])
        self.convs2 = nn.ModuleList([conv(1) for _ in dilations])
        self.activations1 = nn.ModuleList([Snake(channels) for _ in dilations])
        self.activations2 = nn.ModuleList([Snake(channels) for _ in dilations])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x = x + c2(a2(c1(a1(x)))) per unit, with each conv's zero padding written by the
        # activation before it and each residual add done by the next unit's first activation
        if fused_kernels_for(x):
            return self._forward_fused(x)
        h = None
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            if h is None:
                xp = a1.padded(x, c1.left, c1.right)
            else:
                xp, x = a1.padded(x, c1.left, c1.right, residual=h)
            h = c2.conv_padded(a2.padded(c1.conv_padded(xp), c2.left, c2.right))
        return x if h is None else x + h

    def _forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` as one kernel per activation and per conv: each Snake also adds the bias of
        the conv before it (run without bias), the residual, and writes the next conv's padding."""
        k = _kernels()
        h = hb = None
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            if h is None:
                xp = k.snake(x, a1.alpha, c1.left, c1.right)
            else:
                xp, x = k.snake(x, a1.alpha, c1.left, c1.right, residual=h, bias=hb)
            yp = k.snake(c1.conv_padded(xp, bias=False), a2.alpha, c2.left, c2.right, bias=c1.bias)
            h, hb = c2.conv_padded(yp, bias=False), c2.bias
        if h is None:
            return x
        return k.act_pad(x, "none", residual=h, bias=hb, return_sum=False)  # x + (h + bias)

    def history(self) -> int:
        """Left context (frames at this rate) one causal block needs."""
        return sum(c.left for c in (*self.convs1, *self.convs2))


class F0Predictor(nn.Module):
    """Original ``ConvRNNF0Predictor``: 5 x (conv k3 'same' + ELU), Linear, |.|."""

    def __init__(self, in_channels: int = MEL_BINS, cond_channels: int = 512):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [weight_norm(Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1)),
                       nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        h = self.condnet(mel).transpose(1, 2)
        return self.classifier(h).squeeze(-1).abs()  # [B, T] Hz


class SourceModule(nn.Module):
    """Holds the harmonic merge (``m_source.l_linear``); the oscillators live in the generators."""

    def __init__(self, nb_harmonics: int):
        super().__init__()
        self.l_linear = nn.Linear(nb_harmonics + 1, 1)

    def forward(self, harmonics: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l_linear(harmonics))


def hann_window(n_fft: int) -> torch.Tensor:
    """scipy.signal.get_window('hann', n, fftbins=True) == periodic Hann, cast to float32.

    Built on the CPU explicitly (real values even while a model is built on ``meta``); the
    models keep it as a buffer that moves with them, so no forward copies it to the device.
    """
    return torch.hann_window(n_fft, periodic=True, dtype=torch.float64, device="cpu").float()


def _overlap_add(frames: torch.Tensor, length: int, hop: int) -> torch.Tensor:
    """[B, n_frames, n] frames -> [B, length] with frame i added at sample i*hop (ATen's own OLA op,
    the one ``torch.istft`` uses, so the summation order and hence the rounding are istft's)."""
    return torch.ops.aten.unfold_backward(frames, [frames.shape[0], length], 1, frames.shape[2], hop)


def istft(spec: torch.Tensor, window: torch.Tensor, hop: int) -> torch.Tensor:
    """``torch.istft(spec, n, hop, n, window, center=True)`` for a one-sided complex [B, n/2+1, F].

    Same ops in the same order as ATen's istft (c2r FFT, window, overlap-add, trim n/2 each side,
    divide by the overlap-added squared window), minus its NOLA check: that check reads
    ``min(envelope) < 1e-11`` back to the host on every call, a device sync that invalidates a
    CUDA graph capture. The envelope depends only on the window, hop and frame count, never on
    the data, so ``check_nola`` verifies it once when the model is built.
    """
    y, envelope = istft_sums(spec, window, hop)
    half = window.shape[0] // 2
    return y[:, half:y.shape[1] - half] / envelope[:, half:y.shape[1] - half]


def istft_sums(spec: torch.Tensor, window: torch.Tensor, hop: int,
               envelope: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``istft``'s two overlap-added sums before the trim and the division: the windowed frames' [B, L] and
    (with ``envelope``) the squared window's [1, L], L = n + hop * (frames - 1) (``hift_carry`` carries the
    first one's tail)."""
    n = window.shape[0]
    n_frames = spec.shape[2]
    length = n + hop * (n_frames - 1)
    frames = torch.fft.irfft(spec.transpose(1, 2), n=n, dim=-1) * window.view(1, 1, n)
    env = _overlap_add(window.pow(2).expand(1, n_frames, n), length, hop) if envelope else None
    return _overlap_add(frames, length, hop), env


def check_nola(window: torch.Tensor, hop: int, where: str) -> None:
    """Raise unless every centred iSTFT output sample is covered by the window (the check
    ``torch.istft`` makes per call). Frames farther apart than the window do not interact, so
    2*ceil(n/hop)+1 frames show every envelope value any longer signal can have."""
    from ..errors import CheckpointError

    n = window.shape[0]
    n_frames = 2 * -(-n // hop) + 1
    length = n + hop * (n_frames - 1)
    envelope = _overlap_add(window.double().pow(2).expand(1, n_frames, n), length, hop)[:, n // 2:length - n // 2]
    if float(envelope.abs().min()) < 1e-11:
        raise CheckpointError(f"{where}: iSTFT window of {n} samples with hop {hop} leaves output samples "
                              "uncovered (NOLA violated); use hop_len <= n_fft / 2 with a Hann window")


class _HiFTBody(nn.Module):
    """What both variants share: the excitation STFT, the upsampling trunk and the iSTFT."""

    cfg: HiFTConfig
    conv_pre: nn.Module
    ups: nn.ModuleList
    source_downs: nn.ModuleList
    source_resblocks: nn.ModuleList
    resblocks: nn.ModuleList
    conv_post: nn.Module

    def _build_resblocks(self, cfg: HiFTConfig, causal: bool) -> None:
        self.source_resblocks = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i in range(len(cfg.upsample_rates)):
            ch = cfg.base_channels // 2 ** (i + 1)
            self.source_resblocks.append(ResBlock(ch, cfg.source_resblock_kernel_sizes[i],
                                                  cfg.source_resblock_dilation_sizes[i], causal))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes):
                self.resblocks.append(ResBlock(ch, k, d, causal))
        # Both variants build their resblocks here, so this is where the STFT window is made.
        self._build_stft_window(cfg)

    def _build_stft_window(self, cfg: HiFTConfig) -> None:
        window = hann_window(cfg.n_fft)
        check_nola(window, cfg.hop_len, type(self).__name__)
        # A non-persistent buffer: no state_dict key (checkpoints load strictly as before), and it
        # moves with ``.to(device)``, so the forward never copies a host window to the device (a
        # host-to-device copy cannot be captured into a CUDA graph).
        self.register_buffer("stft_window", window, persistent=False)

    def freeze_weight_norm(self, channels_last: Optional[bool] = None) -> int:
        """Compute the weight-normed weights once for every later forward (``freeze_weight_norm``;
        on CUDA also time-major conv weights); ``GraphedHiFT`` does this when it is built.
        Unchanged state_dict."""
        return freeze_weight_norm(self, channels_last)

    def unfreeze_weight_norm(self) -> None:
        unfreeze_weight_norm(self)

    def _source_down_rates(self) -> list[int]:
        """Excitation-STFT downsampling per stage: cumulative products of the reversed rates."""
        rates = [1] + list(self.cfg.upsample_rates[::-1][:-1])
        cum = [int(math.prod(rates[: i + 1])) for i in range(len(rates))]
        return cum[::-1]

    def time_major(self) -> bool:
        """Whether the convs run time-major (``freeze_weight_norm(channels_last=True)``, the CUDA
        default): then the excitation STFT is built time-major too."""
        w = frozen(self.conv_pre, "weight")
        return w is not None and is_time_major(w)

    def stft_margin(self, time_major: bool) -> int:
        """Zero frames the time-major excitation STFT carries on its left: the most any causal
        source downsampler pads, so each reads a view instead of padding a copy."""
        return max((getattr(d, "left", 0) for d in self.source_downs), default=0) if time_major else 0

    def source_stft(self, source: torch.Tensor, margin: int = 0, time_major: bool = False,
                    center: bool = True) -> torch.Tensor:
        """[B, 1, L] excitation -> [B, n_fft + 2, margin + L / hop_len + 1] (real | imag), after
        ``margin`` zero frames; time-major if asked (same values). ``center=False``: only the frames whose
        window lies inside the excitation, (L - n_fft) / hop_len + 1 of them (``hift_carry``)."""
        c = self.cfg
        spec = torch.stft(source.squeeze(1), c.n_fft, c.hop_len, c.n_fft, window=self.stft_window,
                          center=center, return_complex=True)
        spec = torch.view_as_real(spec)
        if not time_major:
            s_stft = torch.cat([spec[..., 0], spec[..., 1]], dim=1)
            return F.pad(s_stft, (margin, 0)) if margin else s_stft
        b, bins, frames, _ = spec.shape
        out = spec.new_empty(b, margin + frames, 2, bins)
        if margin:
            out[:, :margin].zero_()
        out[:, margin:].copy_(spec.permute(0, 2, 3, 1))
        return out.view(b, margin + frames, 2 * bins).transpose(1, 2)

    def _source_down(self, i: int, s_stft: torch.Tensor, margin: int) -> torch.Tensor:
        down = self.source_downs[i]
        if margin:  # the causal downsamplers' left padding is already in s_stft
            return down.conv_padded(s_stft[:, :, margin - down.left:])
        return down(s_stft)

    def trunk(self, x: torch.Tensor, s_stft: Optional[torch.Tensor], margin: int = 0,
              sources: Optional[Sequence[torch.Tensor]] = None, spectrum: bool = False) -> torch.Tensor:
        """conv_pre output + excitation STFT (after ``margin`` zero frames) -> waveform (before any
        trimming / clamp). ``sources``: each stage's downsampled excitation, given instead of the STFT, and
        then the last stage takes no reflection padding (a carried call continues a stream, ``hift_carry``);
        ``spectrum``: the one-sided spectrum the iSTFT would take, instead of the waveform."""
        c = self.cfg
        n = len(c.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up.act_forward(x, c.lrelu_slope)  # up(F.leaky_relu(x, slope))
            if i == len(self.ups) - 1 and sources is None:
                x = reflect_pad_left1(x)
            src = self._source_down(i, s_stft, margin) if sources is None else sources[i]
            x = x + self.source_resblocks[i](src)
            acc = self.resblocks[i * n](x)
            for j in range(1, n):
                acc = acc + self.resblocks[i * n + j](x)
            x = acc / n
        x = self.conv_post.act_forward(x, 0.01)  # F.leaky_relu's default slope, as upstream
        half = c.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :half]).clamp(max=1e2)
        phase = torch.sin(x[:, half:])  # upstream's sin() of the phase logits, kept for fidelity
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return spec if spectrum else istft(spec, self.stft_window, c.hop_len)


class HiFTGenerator(_HiFTBody):
    """Original CosyVoice2 HiFT (``stepaudio2.flashcosyvoice.modules.hifigan.HiFTGenerator``).

    ``forward(mel[B,80,T], cache_source[B,1,S]) -> (wav[B, T*480], source[B,1,T*480])``.
    The excitation's initial harmonic phases and its additive noise are random, as
    upstream: drawn from ``generator`` (or torch's global RNG, in upstream's order,
    so a shared seed reproduces upstream exactly). ``cache_source`` overwrites the
    start of the new excitation so consecutive stream chunks stay phase-continuous.
    """

    def __init__(self, cfg: HiFTConfig = FULL_SIZE):
        super().__init__()
        self.cfg = cfg
        base = cfg.base_channels
        self.m_source = SourceModule(cfg.nb_harmonics)
        self.conv_pre = weight_norm(Conv1d(cfg.in_channels, base, 7, 1, padding=3))
        self.ups = nn.ModuleList()
        for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)):
            self.ups.append(weight_norm(ConvTranspose1d(base // 2 ** i, base // 2 ** (i + 1), k, u,
                                                        padding=(k - u) // 2)))
        self.source_downs = nn.ModuleList()
        for i, u in enumerate(self._source_down_rates()):
            ch = base // 2 ** (i + 1)
            if u == 1:
                self.source_downs.append(Conv1d(cfg.n_fft + 2, ch, 1, 1))
            else:
                self.source_downs.append(Conv1d(cfg.n_fft + 2, ch, u * 2, u, padding=u // 2))
        self._build_resblocks(cfg, causal=False)
        ch = base // 2 ** len(cfg.upsample_rates)
        self.conv_post = weight_norm(Conv1d(ch, cfg.n_fft + 2, 7, 1, padding=3))
        self.f0_predictor = F0Predictor(cfg.in_channels, cfg.f0_channels)

    def excitation(self, f0: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """F0 [B, T] (Hz, frame rate) -> excitation [B, 1, T*hop] (upstream SineGen2, linear mode).

        Phase is integrated at frame rate (linear resampling down by hop, cumsum,
        linear resampling back up), which keeps the cumsum short and the pitch smooth.
        """
        c = self.cfg
        hop = c.hop
        b = f0.shape[0]
        f0_up = f0[:, None].repeat_interleave(hop, dim=2).transpose(1, 2)  # [B, L, 1] nearest upsampling
        mult = torch.arange(1, c.nb_harmonics + 2, device=f0.device, dtype=torch.float32)
        rad = (f0_up * mult / c.sampling_rate) % 1  # [B, L, H]
        init = torch.rand(b, c.nb_harmonics + 1, device=f0.device, generator=generator)
        init[:, 0] = 0  # fundamental starts at phase 0, overtones at random phases
        rad[:, 0, :] = rad[:, 0, :] + init
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / hop, mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi
        phase = F.interpolate(phase.transpose(1, 2) * hop, scale_factor=hop, mode="linear").transpose(1, 2)
        sines = torch.sin(phase) * c.nsf_alpha
        uv = (f0_up > c.nsf_voiced_threshold).float()
        noise_amp = uv * c.nsf_sigma + (1 - uv) * c.nsf_alpha / 3
        # normal_ into a tensor laid out like ``sines`` (channel-major), as upstream's
        # randn_like: the values drawn depend on that layout.
        noise = noise_amp * torch.empty_like(sines).normal_(generator=generator)
        harmonics = sines * uv + noise
        # Upstream also draws (and discards) a noise branch of shape uv; drawing it keeps
        # the RNG stream, hence multi-chunk results, identical to upstream's.
        torch.empty_like(uv).normal_(generator=generator)
        return self.m_source(harmonics).transpose(1, 2)

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        wav = self.trunk(self.conv_pre(mel), self.source_stft(source, 0, self.time_major()))
        return wav.clamp(-self.cfg.audio_limit, self.cfg.audio_limit)

    # The deterministic stages as a stream runner calls them (``StageCall``); ``finalize`` is
    # the causal variant's flag, accepted here so both generators take the same calls.
    def run_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        return self.f0_predictor(mel)

    def run_decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        return self.decode(mel, source)

    @torch.inference_mode()
    def forward(self, mel: torch.Tensor, cache_source: Optional[torch.Tensor] = None,
                generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
        f0 = self.f0_predictor(mel)
        source = self.excitation(f0, generator)
        if cache_source is not None and cache_source.shape[2]:
            source[:, :, :cache_source.shape[2]] = cache_source
        return self.decode(mel, source), source


def fuse_weight_norm(model: nn.Module) -> nn.Module:
    """Replace every weight-norm parametrization by its current weight (inference speed-up:
    the norm is otherwise recomputed on every forward). Values are unchanged; the
    state_dict then uses plain ``weight`` keys, so fuse only after loading. The causal F0
    predictor's float64 weights are computed from g and v first, keeping it exact."""
    from torch.nn.utils import parametrize

    with torch.no_grad():
        for m in model.modules():
            if not parametrize.is_parametrized(m, "weight"):
                continue
            if getattr(m, "float64_weight", False):
                p = m.parametrizations.weight
                m.register_buffer("weight64", torch._weight_norm(p.original1.double(), p.original0.double(), 0),
                                  persistent=False)
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
    return model


# ----------------------------------------------------------------------------- stream steps

F0, EXCITE, DECODE = "f0", "excite", "decode"
# the causal stream's carried look-ahead decodes (``hift_carry``): its first, which keeps the state, and the later
DECODE_FIRST, DECODE_NEXT = "decode_first", "decode_next"


@dataclass(frozen=True)
class StageCall:
    """One deterministic generator stage a stream step needs: ``runner.run_<op>(*args)`` (plus
    ``finalize=`` unless it is ``None``) on batch-1 tensors. Calls with equal ``key()`` from
    different streams can run as one batched call."""

    op: str
    args: tuple[torch.Tensor, ...]
    finalize: Optional[bool] = None
    # Set when the stage is causal to the right of its inputs: frames appended after a row's own (zeros) change
    # none of its output frames. Per argument, then for the output, the entries per frame along the last axis
    # (the causal HiFT's look-ahead calls: F0 (1, 1), decode (1, hop, hop)). Calls that agree on everything
    # but their frame counts may then run as one call, shorter rows padded (``ragged_key``).
    per_frame: Optional[tuple[int, ...]] = None

    def key(self) -> tuple:
        return (self.op, self.finalize) + tuple((tuple(a.shape), a.dtype, a.device) for a in self.args)

    def ragged_key(self) -> Optional[tuple]:
        """``key()`` without the frame counts, for calls that may pad (``per_frame``); else None."""
        if self.per_frame is None:
            return None
        return (self.op, self.finalize, self.per_frame) + tuple(
            (tuple(a.shape[:-1]), a.dtype, a.device) for a in self.args)

    @property
    def frames(self) -> int:
        """The call's frame count (``per_frame`` calls)."""
        return self.args[0].shape[-1] // self.per_frame[0]


# A stream's push as a coroutine: yields StageCalls, receives each one's (batch-1) result,
# returns the new samples [1, n].
Steps = Generator[StageCall, Any, torch.Tensor]


class StageRunner(Protocol):
    """Runs stream stages: a HiFT generator itself (eager) or ``hift_graph.GraphedHiFT``. The
    causal HiFT's runners also have ``run_excite(f0, phase, noise) -> (source, phase)``."""

    def run_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor: ...

    def run_decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor: ...


def run_stage(runner: StageRunner, calls: Sequence[StageCall]) -> list[Any]:
    """Equal-key calls as ONE call whose batch rows are the calls, in order -> per-row results.

    Calls of one ``ragged_key`` but fewer frames than the longest are padded with zero frames and
    their outputs cut back to their own frames: the same values as alone, up to the batched call's
    rounding. A runner with ``frames_to_graph`` (``GraphedHiFT``) may pad such a call further, to the frames of
    a graph it holds, instead of running it eagerly. Otherwise a single call runs on its own tensors as given
    (no copy), so a stream driven alone makes exactly the calls it always made. Tuple results (the causal
    excitation's (source, phase)) are split element-wise."""
    first = calls[0]
    short = [0] * len(calls)     # frames each row lacks against the longest
    if len(calls) == 1:
        args = first.args
    elif first.per_frame is not None and len({c.frames for c in calls}) > 1:
        longest = max(c.frames for c in calls)
        short = [longest - c.frames for c in calls]
        args = tuple(torch.cat([F.pad(c.args[k], (0, d * first.per_frame[k])) if d else c.args[k]
                                for c, d in zip(calls, short)]) for k in range(len(first.args)))
    else:
        args = tuple(torch.cat([c.args[k] for c in calls]) for k in range(len(first.args)))
    to_graph = getattr(runner, "frames_to_graph", None)
    if first.per_frame is not None and to_graph is not None:
        more = to_graph(first.op, args, first.per_frame[:len(args)], first.finalize)
        if more:
            args = tuple(F.pad(a, (0, more * per)) for a, per in zip(args, first.per_frame))
            short = [d + more for d in short]
    fn = getattr(runner, "run_" + first.op)
    out = fn(*args) if first.finalize is None else fn(*args, finalize=first.finalize)
    if isinstance(out, tuple):
        if any(short):
            raise TypeError(f"run_stage: {first.op} returned a tuple; only single-output stages may pad (per_frame)")
        return [out] if len(calls) == 1 else list(zip(*(o.split(1) for o in out)))
    if any(short):
        per = first.per_frame[-1]
        n = out.shape[-1]
        return [o.narrow(-1, 0, n - d * per) for o, d in zip(out.split(1), short)]
    return [out] if len(calls) == 1 else list(out.split(1))


def _plan_calls(waiting: dict[int, StageCall], cap: int, bucket: Optional[Callable[[int], int]],
                grow: int = 0) -> list[list[int]]:
    """The batched calls of one lockstep round: the waiting streams grouped by ``key()``, at most ``cap`` rows a
    call. With ``bucket`` (rows -> the rows a call of that many runs at, e.g. a graph's batch bucket), the rows a
    call would pad up to anyway take shorter calls of its ``ragged_key`` (longest first), which then need no
    call of their own: the padded call costs what it did, one call fewer runs. A call of fewer than ``grow`` rows
    may also grow past its bucket, up to ``grow`` rows, to take whole shorter calls along: where small calls cost
    about the same at any bucket (latency-bound), one call of two buckets' rows beats two calls."""
    groups: dict[tuple, list[int]] = {}
    for i, call in waiting.items():
        groups.setdefault(call.key(), []).append(i)
    plan = [rows[k:k + cap] for rows in groups.values() for k in range(0, len(rows), cap)]
    if bucket is None:
        return plan
    families: dict[tuple, list[list[int]]] = {}
    out = []
    for rows in plan:
        rk = waiting[rows[0]].ragged_key()
        if rk is None:
            out.append(rows)
        else:
            families.setdefault(rk, []).append(rows)
    for calls in families.values():
        # longest frames first; among equal frames the fuller call first (it keeps its rows)
        calls.sort(key=lambda rows: (-waiting[rows[0]].frames, -len(rows)))
        left = [list(rows) for rows in calls]
        limit = min(grow, cap)
        for k, rows in enumerate(left):
            if not rows:
                continue
            while True:
                room = min(bucket(len(rows)), cap) - len(rows)
                for later in left[k + 1:]:
                    if room <= 0:
                        break
                    moved, later[:] = later[:room], later[room:]
                    rows += moved
                    room -= len(moved)
                # past the bucket only whole calls move (a part left behind would still cost a call); the grown
                # call's new padding rows are then offered again
                nxt = next((later for later in left[k + 1:] if later and len(rows) + len(later) <= limit), None)
                if nxt is None:
                    break
                rows += nxt
                nxt.clear()
            out.append(rows)
    return out


def drive(steps: Steps, runner: StageRunner) -> torch.Tensor:
    """Run one stream's steps, each stage alone (batch 1), with IEEE FP32 matmuls."""
    with torch.inference_mode(), ieee_fp32():
        try:
            call = next(steps)
            while True:
                call = steps.send(run_stage(runner, [call])[0])
        except StopIteration as stop:
            return stop.value


def drive_many(steps: Sequence[Steps], runner: StageRunner,
               max_batch: Optional[int] = None) -> list[torch.Tensor]:
    """Run several streams' steps in lockstep -> each stream's new samples, in order.

    Each round, the calls the streams are waiting on are grouped by ``StageCall.key`` and each
    group runs as one batched call (at most ``max_batch`` rows); then the streams resume in
    item order. A runner with ``row_bucket`` (``GraphedHiFT``: calls pad to graph batch buckets)
    also fills a call's padding rows with shorter calls of its ``StageCall.ragged_key``, and one with
    ``grow_rows`` lets small calls grow past their bucket to take such calls along (``_plan_calls``).
    A stream's state and random draws stay its own: only the stage calls are shared, and those are
    row-independent. Streams that share one RNG (the original HiFT's global-RNG
    default) draw in item order, as pushing them one after another would, because each such
    stream draws once per push."""
    results: list[Optional[torch.Tensor]] = [None] * len(steps)
    waiting: dict[int, StageCall] = {}
    cap = max_batch or max(1, len(steps))
    bucket = getattr(runner, "row_bucket", None)
    grow = getattr(runner, "grow_rows", 0) if bucket is not None else 0

    def resume(i: int, value: Any) -> None:
        try:
            waiting[i] = steps[i].send(value)
        except StopIteration as stop:
            waiting.pop(i, None)
            results[i] = stop.value

    with torch.inference_mode(), ieee_fp32():
        for i in range(len(steps)):
            resume(i, None)
        while waiting:
            got: dict[int, Any] = {}
            for part in _plan_calls(waiting, cap, bucket, grow):
                got.update(zip(part, run_stage(runner, [waiting[i] for i in part])))
            for i in sorted(got):
                resume(i, got[i])
    return results  # type: ignore[return-value]


class HiFTStream:
    """Chunked vocoding with the original HiFT, as stepaudio2 0.1.1 / vLLM-Omni do it.

    Each ``push`` vocodes ``[last 8 mel frames | new mel]`` with the last 3840
    excitation samples forced to the previous chunk's (phase continuity); the first
    3840 output samples are cross-faded with the previous chunk's held-back tail
    by a ``hamming(7680)`` window; a non-final chunk holds its last 3840 samples
    back. So a steady 50-frame chunk emits exactly 24000 samples and the first one
    20160. Non-final chunks under 8 frames are buffered until 8 have arrived. With ``lead_silence`` a first non-final chunk is prefixed with 3840 zeros
    (the later upstream fix that keeps chunk lengths equal); default off, as 0.1.1.

    One stream = one utterance of batch 1; ``reset()`` starts a new one. ``runner`` runs the
    generator's F0 and decode stages (default: the model, eagerly; ``GraphedHiFT`` replays CUDA
    graphs); the random excitation is always drawn here, from ``generator`` (or torch's global
    RNG), so batching or graphing the stages never changes which random numbers a stream gets.
    """

    MEL_CACHE = 8

    def __init__(self, model: HiFTGenerator, lead_silence: bool = False,
                 generator: Optional[torch.Generator] = None, runner: Optional[StageRunner] = None):
        self.model = model
        self.runner = model if runner is None else runner
        self.lead_silence = lead_silence
        self.generator = generator
        self.tail = self.MEL_CACHE * model.cfg.hop  # 3840 samples
        # np.hamming (symmetric) in float64, as upstream; the blend is written back as fp32.
        self.window = torch.signal.windows.hamming(2 * self.tail, sym=True, dtype=torch.float64)
        self.reset()

    def reset(self) -> None:
        p = self.model.conv_pre.bias  # exists with or without fused weight norm
        self.mel_cache = p.new_zeros(1, self.model.cfg.in_channels, 0)
        self.source_cache = p.new_zeros(1, 1, 0)
        self.speech_cache = p.new_zeros(1, 0)
        self.pending = p.new_zeros(1, self.model.cfg.in_channels, 0)
        self.finished = False

    _STATE = ("mel_cache", "source_cache", "speech_cache", "pending", "finished")

    def snapshot(self) -> dict:
        """The stream's state (tensors shared, never mutated in place), plus the RNG state of
        its ``generator`` if it has one, so ``restore`` replays exactly (rollback)."""
        snap = {k: getattr(self, k) for k in self._STATE}
        if self.generator is not None:
            snap["rng"] = self.generator.get_state()
        return snap

    def restore(self, snap: dict) -> None:
        for k in self._STATE:
            setattr(self, k, snap[k])
        if self.generator is not None and "rng" in snap:
            self.generator.set_state(snap["rng"])

    def push(self, mel: torch.Tensor, last: bool = False) -> torch.Tensor:
        """mel [1, 80, t] (t >= 0) -> new 24 kHz samples [1, n] float32."""
        return drive(self.steps(mel, last), self.runner)

    def steps(self, mel: torch.Tensor, last: bool = False) -> Steps:
        """``push`` as stage calls (for ``drive_many``); the input is checked now, the state
        changes only as the steps run."""
        if self.finished:
            raise RuntimeError("HiFTStream: push after the last chunk; call reset() for a new utterance")
        if mel.ndim != 3 or mel.shape[0] != 1 or mel.shape[1] != self.model.cfg.in_channels:
            raise ValueError(f"HiFTStream.push: mel must be [1, {self.model.cfg.in_channels}, t], got {list(mel.shape)}")
        return self._steps(mel, last)

    def _steps(self, mel: torch.Tensor, last: bool) -> Steps:
        self.pending = torch.cat([self.pending, mel.to(self.pending)], dim=2)
        if not last and self.pending.shape[2] < self.MEL_CACHE:
            # Shorter chunks would make the held-back tail shorter than the cross-fade
            # (upstream fails there); wait for at least 8 new frames instead.
            return self.pending.new_zeros(1, 0)
        mel = torch.cat([self.mel_cache, self.pending], dim=2)
        self.pending = self.pending[:, :, :0]
        if mel.shape[2] == 0:
            self.finished = last
            return mel.new_zeros(1, 0)
        first = self.speech_cache.shape[1] == 0
        # HiFTGenerator.forward, split at its random excitation (drawn here, per stream)
        f0 = yield StageCall(F0, (mel,))
        source = self.model.excitation(f0, self.generator)
        if self.source_cache.shape[2]:
            source[:, :, :self.source_cache.shape[2]] = self.source_cache
        speech = yield StageCall(DECODE, (mel, source))
        if not first:
            n = self.tail
            w = self.window.to(speech.device)
            speech = speech.clone()
            speech[:, :n] = speech[:, :n] * w[:n] + self.speech_cache[:, -n:] * w[n:]
        self.mel_cache = mel[:, :, -self.MEL_CACHE:].clone()
        self.source_cache = source[:, :, -self.tail:].clone()
        self.speech_cache = speech[:, -self.tail:].clone()
        if last:
            self.finished = True
            return speech
        speech = speech[:, :-self.tail]
        if first and self.lead_silence:
            speech = torch.cat([speech.new_zeros(1, self.tail), speech], dim=1)
        return speech
