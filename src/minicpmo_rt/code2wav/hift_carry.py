"""Carried-context decoding for the causal HiFT's streams: a steady call decodes only its new frames.

``BoundedStream`` (upstream ``BoundedVocoder``) re-decodes 31 mel frames of history before every 50 new ones, so
each causal conv sees its left context again. Here each stride-1 causal conv instead keeps the last (k-1)*d
frames of its input from the call before (``Carry.splice``, through ``hift.carrying``), the strided source
downsamplers keep k - s STFT frames, and the iSTFT keeps its overlap-add tail. The first call of an utterance is
the bounded decode itself (its window starts at frame 0), recording those contexts. Its later calls take:

* mel frames [c0, c1 + 4): the trunk frames [c0, c1) and conv_pre's 4 look-ahead frames. The trunk runs one
  frame ahead of the audio (c0 = emitted + 1), since the iSTFT finishes a frame's samples only with the next
  frame's first spectral frames;
* excitation samples [480 c0 - 4, 480 c1 + 8): the new STFT frames (120 c0, 120 c1], each centred on its own
  sample 4j (``center=False`` framing of the samples around them is the same as the centred STFT's);
* the carried state, one flat tensor per stream row (``CarryLayout``), so streams batch as rows.

and return audio frames [c0 - 1, c1 - 1) plus the new state. The final call of an utterance stays the bounded
decode over the kept history. All of this computes what the bounded decode computes, in another summation
order (the bounded window covers the receptive field, so both equal the whole utterance's causal decode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from .hift import _overlap_add, carrying, istft_sums

if TYPE_CHECKING:
    from .hift_causal import CausalHiFTGenerator


class Carry:
    """The per-conv left contexts of one call: ``cache`` (module -> [B, C, L]; absent: the zeros of the
    utterance's start) goes into each conv's left padding, and the input's last L frames are collected in
    ``new`` (views of the conv inputs, which nothing writes after the conv)."""

    def __init__(self, cache: Optional[dict[nn.Module, torch.Tensor]] = None):
        self.cache = cache or {}
        self.new: dict[nn.Module, torch.Tensor] = {}

    def splice(self, m: nn.Module, xp: torch.Tensor, left: int) -> torch.Tensor:
        c = self.cache.get(m)
        if c is not None:
            xp[:, :, :left].copy_(c)    # xp is the activation kernel's fresh output: its padding is ours
        self.new[m] = xp[:, :, xp.shape[2] - left:]
        return xp


@dataclass(frozen=True)
class CarryLayout:
    """Where each carried context lives in a stream's flat state [B, size]: the stride-1 causal convs of the
    decode (``convs``: module, channels, frames), the strided source downsamplers' STFT frames (``downs``:
    stage, frames), then the iSTFT's overlap-add tail (``tail`` samples). Each block is stored frame-major
    ([frames, channels]), so its view is time-major like the activations."""

    convs: tuple[tuple[nn.Module, int, int], ...]
    downs: tuple[tuple[int, int], ...]
    stft_channels: int
    tail: int

    @property
    def size(self) -> int:
        return (sum(c * n for _, c, n in self.convs) + sum(n for _, n in self.downs) * self.stft_channels
                + self.tail)

    def unpack(self, state: torch.Tensor) -> tuple[dict, dict, torch.Tensor]:
        b, off = state.shape[0], 0
        convs, downs = {}, {}
        for m, c, n in self.convs:
            convs[m] = state[:, off:off + c * n].view(b, n, c).transpose(1, 2)
            off += c * n
        for i, n in self.downs:
            k = n * self.stft_channels
            downs[i] = state[:, off:off + k].view(b, n, self.stft_channels).transpose(1, 2)
            off += k
        return convs, downs, state[:, off:off + self.tail]

    def pack(self, convs: dict, downs: dict, tail: torch.Tensor) -> torch.Tensor:
        b = tail.shape[0]
        parts = [convs[m].transpose(1, 2).reshape(b, -1) for m, _, _ in self.convs]
        parts += [downs[i].transpose(1, 2).reshape(b, -1) for i, _ in self.downs]
        return torch.cat(parts + [tail], dim=1)


def layout(model: "CausalHiFTGenerator") -> CarryLayout:
    """The model's ``CarryLayout`` (cached on it; depends only on the architecture)."""
    got = model.__dict__.get("_carry_layout")
    if got is not None:
        return got
    convs = []
    for part in (*model.ups, *model.source_resblocks, *model.resblocks, model.conv_post):
        for m in part.modules():
            if isinstance(m, nn.Conv1d) and m.stride[0] == 1 and getattr(m, "left", 0):
                convs.append((m, m.in_channels, m.left))
    downs = tuple((i, d.kernel_size[0] - d.stride[0]) for i, d in enumerate(model.source_downs) if d.stride[0] > 1)
    c = model.cfg
    hop = c.hop // c.hop_len                    # spectral frames per mel frame
    lay = CarryLayout(tuple(convs), downs, c.n_fft + 2, hop * c.hop_len + c.n_fft // 2)
    object.__setattr__(model, "_carry_layout", lay)
    return lay


def _envelope(model: "CausalHiFTGenerator", like: torch.Tensor) -> torch.Tensor:
    """The iSTFT's squared-window overlap-add over the steady part: one period of hop_len values (the
    same sums the whole-signal iSTFT divides by away from its start). Kept per device and dtype."""
    key = ("_carry_envelope", like.device, like.dtype)
    env = model.__dict__.get(key)
    if env is None:
        w = model.stft_window.to(like)
        n, hop = w.shape[0], model.cfg.hop_len
        frames = 2 * (n // hop) + 1
        env = _overlap_add(w.pow(2).expand(1, frames, n), n + hop * (frames - 1), hop)[0, n:n + hop]
        model.__dict__[key] = env
    return env


def decode_first(model: "CausalHiFTGenerator", mel: torch.Tensor,
                 source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An utterance's first look-ahead decode (mel [B, 80, T] from frame 0, its excitation [B, 1, T*hop]) ->
    (``decode(mel, source, finalize=False)``'s audio [B, (T-5)*hop], the carried state [B, size])."""
    c = model.cfg
    lay = layout(model)
    x, s_stft, margin = model.decode_inputs(mel, source, finalize=False)
    # each strided downsampler's padded input ends with its last k - s STFT frames
    downs = {i: s_stft[:, :, s_stft.shape[2] - n:] for i, n in lay.downs}
    with carrying(Carry()) as carry:
        spec = model.trunk(x, s_stft, margin, spectrum=True)
    y, env = istft_sums(spec, model.stft_window, c.hop_len)
    half, length = model.stft_window.shape[0] // 2, y.shape[1]
    wav = (y[:, half:length - half] / env[:, half:length - half])[:, :-c.hop]
    state = lay.pack(carry.new, downs, y[:, length - lay.tail:])
    return wav.clamp(-c.audio_limit, c.audio_limit), state


def decode_next(model: "CausalHiFTGenerator", mel: torch.Tensor, source: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A later look-ahead decode: mel [B, 80, m + 4] (trunk frames [c0, c1), m = c1 - c0, then conv_pre's
    look-ahead), excitation samples [B, 1, m*hop + 12] ([hop*c0 - 4, hop*c1 + 8)), the state ->
    (audio frames [c0 - 1, c1 - 1): [B, m*hop], the new state)."""
    c = model.cfg
    lay = layout(model)
    convs, downs, tail = lay.unpack(state)
    m = mel.shape[2] - c.conv_pre_look_right
    n_fft, hop = model.stft_window.shape[0], c.hop_len
    if m < 1 or source.shape[2] != m * c.hop + n_fft - hop:
        raise ValueError(f"decode_next: mel [B, 80, m + {c.conv_pre_look_right}] with m >= 1 and excitation "
                         f"[B, 1, m*{c.hop} + {n_fft - hop}]; got {list(mel.shape)}, {list(source.shape)}")
    tm = model.time_major()
    s_new = model.source_stft(source, 0, tm, center=False)        # the new frames (120 c0, 120 c1]
    b, ch, n_frames = s_new.shape
    sources, new_downs = [], {}
    for i, down in enumerate(model.source_downs):
        if i in downs:
            k = downs[i].shape[2]
            inp = (s_new.new_empty(b, k + n_frames, ch).transpose(1, 2) if tm
                   else s_new.new_empty(b, ch, k + n_frames))
            inp[:, :, :k].copy_(downs[i])
            inp[:, :, k:].copy_(s_new)
            new_downs[i] = inp[:, :, inp.shape[2] - k:]
            sources.append(down.conv_padded(inp))
        else:
            sources.append(down.conv_padded(s_new))
    pre = model.conv_pre
    x = pre.conv_padded(mel)
    with carrying(Carry(convs)) as carry:
        spec = model.trunk(x, None, sources=sources, spectrum=True)
    new = istft_sums(spec, model.stft_window, hop, envelope=False)[0]    # steady: the kept envelope period
    length = new.shape[1]
    out_len = m * c.hop
    buf = new.new_zeros(b, out_len + lay.tail)
    buf[:, :lay.tail] = tail
    start = lay.tail - (n_fft - hop)                               # the first new frame's overlap-add position
    buf[:, start:start + length] += new
    env = _envelope(model, buf)
    wav = buf[:, :out_len] / env.repeat(out_len // hop)
    state = lay.pack(carry.new, new_downs, buf[:, out_len:])
    return wav.clamp(-c.audio_limit, c.audio_limit), state


def fused_available() -> bool:
    """Whether the fused activation kernels can run here (Triton importable)."""
    from .kernels import AVAILABLE
    return AVAILABLE
