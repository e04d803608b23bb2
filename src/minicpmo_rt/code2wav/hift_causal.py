"""The CosyVoice3 causal HiFT (what minicpmo-utils 1.0.7 ships as ``hift.pt``) and its
bounded streaming vocoder.

Differences from the original HiFT (``hift.py``), all for streaming:
- every conv is causal (left-padded) except two with a fixed look-ahead: the F0
  predictor's first conv (k 4, 3 frames right) and ``conv_pre`` (k 5, 4 frames
  right). Upsampling is nearest-repeat + causal conv instead of a transposed conv.
- the oscillator has no per-call randomness: a fixed initial-phase vector and a
  fixed uniform noise table (upstream draws both from torch's global RNG when the
  module is built; here from ``noise_seed``, or copied in with ``set_noise_tables``),
  and the integrated phase is repeated (nearest), not interpolated, back to samples.
- the F0 predictor runs in float64 (upstream: "precision is crucial for causal
  inference"), since pitch errors integrate into phase drift. Its convs run as im2col +
  DGEMM (``conv1d_gemm``): cuDNN has no fast float64 convolution.

``BoundedStream`` is upstream ``BoundedVocoder``: it keeps only the mel/excitation
history the receptive field needs, carries the harmonic phase in float64 modulo 1,
and emits audio 8 frames (3 F0 + 4 conv_pre + 1 iSTFT) behind its input.
Parameter names follow upstream ``CausalHiFTGenerator`` so ``hift.pt`` loads strictly.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Any, Generator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from .hift import (DECODE, DECODE_FIRST, DECODE_NEXT, EXCITE, F0, FULL_SIZE, MEL_BINS, Conv1d, HiFTConfig,
                   PaddedConv1d, SourceModule, StageCall, StageRunner, Steps, _HiFTBody, _kernels, causal_padding,
                   drive, frozen, fused_kernels_for)

# Upstream's noise tables cover 300 s of 24 kHz audio; positions wrap beyond that.
NOISE_TABLE_SECONDS = 300


def _weight_norm_weight(conv: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A weight-normed conv's weight computed in ``dtype`` from g and v (as a module cast to it would).

    After ``fuse_weight_norm`` the float64 weight computed at fusion time is used; after
    ``freeze_weight_norm`` the one computed at freezing (same op, same inputs as per call)."""
    w = frozen(conv, ("weight", dtype))
    if w is not None:
        return w
    fused = getattr(conv, "weight64", None)
    if fused is not None and fused.dtype == dtype:
        return fused
    if not hasattr(conv, "parametrizations"):
        return conv.weight.to(dtype)
    p = conv.parametrizations.weight
    return torch._weight_norm(p.original1.to(dtype), p.original0.to(dtype), 0)


def _cast(m: nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Parameter ``name`` of ``m`` in ``dtype``: its frozen copy while valid, else cast now."""
    t = frozen(m, (name, dtype))
    return getattr(m, name).to(dtype) if t is None else t


def _freeze_float64(m: nn.Module, table: dict) -> None:
    """``freeze_weight_norm`` hook of the float64 F0 layers: the float64 weight and bias they
    compute per call (``_weight_norm_weight`` / ``.to``), computed once."""
    if not getattr(m, "float64_weight", False):
        return
    f64 = torch.float64
    table[("weight", f64)] = _weight_norm_weight(m, f64)
    if m.bias is not None:
        table[("bias", f64)] = m.bias.to(f64)


@functools.lru_cache(maxsize=2)
def _seeded_noise_tables(seed: int, harmonics: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Same draw order and distributions as upstream's constructor (rand_ini, then the table).
    # Cached because the table is large (259 MB at full length) and never written.
    g = torch.Generator().manual_seed(seed)
    rand_ini = torch.rand(1, harmonics, generator=g)
    rand_ini[:, 0] = 0
    return rand_ini, torch.rand(1, length, harmonics, generator=g)


def conv1d_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], left: int = 0,
                right: int = 0) -> torch.Tensor:
    """Stride-1, dilation-1 ``conv1d`` of a time-major input x [B, T, Cin] zero-padded by ``left`` /
    ``right`` frames, as one GEMM: the padded input's k-frame windows (im2col) [B*T', Cin*k] times
    the weight [Cout, Cin, k] flattened -> time-major [B, T', Cout], T' = T + left + right - k + 1.
    The same products as the convolution, summed in the GEMM's order (float64: ~1e-16 apart)."""
    if left or right:
        x = F.pad(x, (0, 0, left, right))
    b, _, cin = x.shape
    cout, _, k = weight.shape
    cols = x.unfold(1, k, 1)  # [B, T', Cin, k]: window t, channel c, tap j = x[t + j, c]
    t_out = cols.shape[1]
    w = weight.reshape(cout, cin * k).t()
    y = torch.mm(cols.reshape(b * t_out, cin * k), w) if bias is None else torch.addmm(
        bias, cols.reshape(b * t_out, cin * k), w)
    return y.view(b, t_out, cout)


class _Float64Linear(nn.Linear):
    _freeze_extra = _freeze_float64


class _Float64PaddedConv1d(PaddedConv1d):
    _freeze_extra = _freeze_float64


class CausalF0Predictor(nn.Module):
    """``CausalConvRNNF0Predictor``: conv k4 with 3 frames look-ahead, 4 x causal conv k3, ELU, Linear, |.|."""

    def __init__(self, in_channels: int = MEL_BINS, cond_channels: int = 512):
        super().__init__()
        layers: list[nn.Module] = [
            weight_norm(_Float64PaddedConv1d(in_channels, cond_channels, 4, right=causal_padding(4))), nn.ELU()]
        for _ in range(4):
            layers += [weight_norm(_Float64PaddedConv1d(cond_channels, cond_channels, 3, left=causal_padding(3))),
                       nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = _Float64Linear(cond_channels, 1)
        # tells fuse_weight_norm (float64 weight) and freeze_weight_norm (float64 weight and bias)
        # to keep float64 copies
        for m in (*self.condnet[0::2], self.classifier):
            m.float64_weight = True

    @property
    def look_ahead(self) -> int:
        return self.condnet[0].right

    @property
    def history(self) -> int:
        return sum(m.left for m in self.condnet[2::2])

    def forward(self, mel: torch.Tensor, finalize: bool = True, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """mel [B, 80, T] -> F0 [B, T] (finalize: zero look-ahead) or [B, T-3] (the last 3 frames are look-ahead only).

        Computed in ``dtype`` (float64 as upstream), returned in ``dtype``. In float64 the convs
        run as GEMMs (``conv1d_gemm``; cuDNN's float64 convolution is a slow generic kernel),
        other dtypes through ``F.conv1d`` (``forward_conv``, also the float64 reference).
        """
        if dtype != torch.float64:
            return self.forward_conv(mel, finalize, dtype)
        x = mel.transpose(1, 2).to(dtype)  # time-major [B, T, C] throughout
        for i, conv in enumerate(self.condnet[0::2]):
            right = 0 if i == 0 and not finalize else conv.right  # look-ahead frames are real frames
            x = F.elu(conv1d_gemm(x, _weight_norm_weight(conv, dtype), _cast(conv, "bias", dtype), conv.left, right))
        c = self.classifier
        return F.linear(x, _weight_norm_weight(c, dtype), _cast(c, "bias", dtype)).squeeze(-1).abs()

    def forward_conv(self, mel: torch.Tensor, finalize: bool = True, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``forward`` through ``F.conv1d`` (upstream's formulation)."""
        x = mel.to(dtype)
        for i, conv in enumerate(self.condnet[0::2]):
            w = _weight_norm_weight(conv, dtype)
            b = _cast(conv, "bias", dtype)
            if i == 0 and not finalize:
                x = F.conv1d(x, w, b)  # the right "padding" is the real look-ahead frames
            else:
                x = F.conv1d(F.pad(x, (conv.left, conv.right)), w, b)
            x = F.elu(x)
        h = x.transpose(1, 2)
        c = self.classifier
        return F.linear(h, _weight_norm_weight(c, dtype), _cast(c, "bias", dtype)).squeeze(-1).abs()


class UpsampleConv1d(Conv1d):
    """Nearest-repeat by ``stride``, then a causal conv (upstream ``CausalConv1dUpsample``)."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int):
        super().__init__(cin, cout, kernel_size, 1, padding=0)
        self.stride_up = stride
        self.left = kernel_size - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.repeat_interleave(self.stride_up, dim=2)
        return self.conv_padded(F.pad(x, (self.left, 0)))

    def act_forward(self, x: torch.Tensor, slope: float) -> torch.Tensor:
        """``self(F.leaky_relu(x, slope))``; on the fused path LeakyReLU, the repeat and the
        padding are one kernel that writes the conv's input (in x's layout)."""
        if fused_kernels_for(x):
            return self.conv_padded(_kernels().act_pad(x, "leaky", slope=slope, left=self.left,
                                                       repeat=self.stride_up))
        return self(F.leaky_relu(x, slope))


class DownsampleConv1d(Conv1d):
    """Strided conv left-padded by stride-1 (upstream ``CausalConv1dDownSample``)."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int):
        super().__init__(cin, cout, kernel_size, stride, padding=0)
        self.left = stride - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_padded(F.pad(x, (self.left, 0)))


class CausalHiFTGenerator(_HiFTBody):
    """CosyVoice3 ``CausalHiFTGenerator`` (24 kHz, 480 samples per mel frame).

    ``forward(mel[B,80,T], finalize=True) -> (wav, source)``: with ``finalize`` the
    whole utterance, ``wav`` [B, T*480]; without, the last 8 frames are treated as
    look-ahead only and ``wav`` is [B, (T-8)*480] (upstream ``inference``).
    """

    def __init__(self, cfg: HiFTConfig = FULL_SIZE, noise_seed: int = 0):
        super().__init__()
        self.cfg = cfg
        base = cfg.base_channels
        self.m_source = SourceModule(cfg.nb_harmonics)
        self.conv_pre = weight_norm(PaddedConv1d(cfg.in_channels, base, cfg.conv_pre_look_right + 1,
                                                 right=cfg.conv_pre_look_right))
        self.ups = nn.ModuleList(
            weight_norm(UpsampleConv1d(base // 2 ** i, base // 2 ** (i + 1), k, u))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)))
        self.source_downs = nn.ModuleList()
        for i, u in enumerate(self._source_down_rates()):
            ch = base // 2 ** (i + 1)
            self.source_downs.append(PaddedConv1d(cfg.n_fft + 2, ch, 1) if u == 1
                                     else DownsampleConv1d(cfg.n_fft + 2, ch, u * 2, u))
        self._build_resblocks(cfg, causal=True)
        ch = base // 2 ** len(cfg.upsample_rates)
        self.conv_post = weight_norm(PaddedConv1d(ch, cfg.n_fft + 2, 7, left=causal_padding(7)))
        self.f0_predictor = CausalF0Predictor(cfg.in_channels, cfg.f0_channels)
        self.noise_seed = noise_seed
        self._rand_ini: Optional[torch.Tensor] = None
        self._noise_table: Optional[torch.Tensor] = None
        # The table's copy on the model's accelerator: streams read a block of rows per call,
        # and a pageable host-to-device copy per block would synchronize the host each time.
        self._device_table: Optional[torch.Tensor] = None

    # -- fixed noise ---------------------------------------------------------------------------
    def set_noise_tables(self, rand_ini: torch.Tensor, noise_table: torch.Tensor) -> None:
        """Install the oscillator's initial phases [1, H] and uniform noise table [1, N, H]."""
        h = self.cfg.nb_harmonics + 1
        if rand_ini.shape != (1, h) or noise_table.ndim != 3 or noise_table.shape[0] != 1 or noise_table.shape[2] != h:
            raise ValueError(f"noise tables must be [1, {h}] and [1, N, {h}]; got {list(rand_ini.shape)}, "
                             f"{list(noise_table.shape)}")
        self._rand_ini, self._noise_table = rand_ini.float(), noise_table.float()
        self._device_table = None

    def noise_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(initial phases [1, H], uniform noise table [1, N, H]); read-only, shared per seed."""
        if self._noise_table is None:
            self._rand_ini, self._noise_table = _seeded_noise_tables(
                self.noise_seed, self.cfg.nb_harmonics + 1, NOISE_TABLE_SECONDS * self.cfg.sampling_rate)
        return self._rand_ini, self._noise_table

    def table_noise(self, start: int, length: int, device: torch.device) -> torch.Tensor:
        """Noise table rows [start, start+length) (wrapping), [1, length, H]."""
        table = self.noise_tables()[1]
        dev = torch.device(device)
        if dev.type != "cpu":
            held = self._device_table
            # "cuda" (no index) means the current device: a table already on a cuda:N is reused
            if held is None or held.device.type != dev.type or dev.index not in (None, held.device.index):
                self._device_table = table.to(dev)  # same values, copied once
            table = self._device_table
        n = table.shape[1]
        if start + length <= n:
            rows = table[:, start:start + length]
        else:
            rows = table[:, torch.arange(start, start + length, device=table.device) % n]
        return rows.to(device)

    # -- excitation ------------------------------------------------------------------------------
    def _harmonic_mult(self, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.arange(1, self.cfg.nb_harmonics + 2, device=device, dtype=dtype)

    def excitation(self, f0: torch.Tensor) -> torch.Tensor:
        """Whole-utterance F0 [B, T] -> excitation [B, 1, T*hop] (upstream causal SineGen2)."""
        c = self.cfg
        hop = c.hop
        f0_up = f0[:, None].repeat_interleave(hop, dim=2).transpose(1, 2)  # [B, L, 1]
        rad = (f0_up * self._harmonic_mult(f0.device) / c.sampling_rate) % 1
        rad[:, 0, :] = rad[:, 0, :] + self.noise_tables()[0].to(f0.device)
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / hop, mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi
        phase = F.interpolate(phase.transpose(1, 2) * hop, scale_factor=hop, mode="nearest").transpose(1, 2)
        sines = torch.sin(phase) * c.nsf_alpha
        uv = (f0_up > c.nsf_voiced_threshold).float()
        noise_amp = uv * c.nsf_sigma + (1 - uv) * c.nsf_alpha / 3
        harmonics = sines * uv + noise_amp * self.table_noise(0, sines.shape[1], f0.device)
        return self.m_source(harmonics).transpose(1, 2)

    # -- decoding -------------------------------------------------------------------------------
    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel [B,80,T] + excitation -> wav. Without ``finalize`` conv_pre's look-ahead
        comes from the last 4 mel frames and the last frame of audio (whose iSTFT
        overlap is incomplete) is dropped: [B, (T-5)*hop]."""
        c = self.cfg
        x, s_stft, margin = self.decode_inputs(mel, source, finalize)
        wav = self.trunk(x, s_stft, margin)
        if not finalize:
            wav = wav[:, :-c.hop]
        return wav.clamp(-c.audio_limit, c.audio_limit)

    def decode_inputs(self, mel: torch.Tensor, source: torch.Tensor,
                      finalize: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``decode``'s trunk inputs: (conv_pre's output, the excitation STFT cut to match it, its margin)."""
        c = self.cfg
        tm = self.time_major()
        margin = self.stft_margin(tm)
        s_stft = self.source_stft(source, margin, tm)
        if finalize:
            return self.conv_pre(mel), s_stft, margin
        # the last r frames are conv_pre's look-ahead: its right "padding" is real frames
        # (== self.conv_pre(mel[..., :-r], right_context=mel[..., -r:]), without the cat)
        r = c.conv_pre_look_right
        pre = self.conv_pre
        x = pre.conv_padded(F.pad(mel, (pre.left, 0)) if pre.left else mel)
        return x, s_stft[:, :, :-int(math.prod(c.upsample_rates)) * r], margin

    # -- the stages a stream runner calls (``hift.StageCall``) -----------------------------------
    def run_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        return self.f0_predictor(mel, finalize=finalize)

    def run_decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        return self.decode(mel, source, finalize)

    def run_decode_first(self, mel: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An utterance's first look-ahead decode, keeping the carried state (``hift_carry.decode_first``)."""
        from . import hift_carry
        return hift_carry.decode_first(self, mel, source)

    def run_decode_next(self, mel: torch.Tensor, source: torch.Tensor,
                        state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A later look-ahead decode of new frames only (``hift_carry.decode_next``)."""
        from . import hift_carry
        return hift_carry.decode_next(self, mel, source, state)

    def run_excite(self, f0: torch.Tensor, phase: torch.Tensor,
                   noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A stream block's excitation: F0 [B, n] (Hz), harmonic phase [B, 1, H] (float64 cycles,
        carried across blocks) and the block's noise-table rows [B, n*hop, H] ->
        (excitation [B, 1, n*hop], the phase after the block). Row-independent, no randomness."""
        c = self.cfg
        hop = c.hop
        inc = (f0[:, :, None] * self._harmonic_mult(f0.device, f0.dtype) / c.sampling_rate).remainder(1)
        cycles = inc.double().cumsum(dim=1) * hop + phase
        phase = cycles[:, -1:].remainder(1).clone()
        # Frame-rate phase repeated per sample == upstream's nearest upsampling of the
        # midpoint-sampled phase; the random initial offset of sample 0 does not survive it.
        sine = torch.sin(cycles.remainder(1) * (2 * math.pi)).to(f0).repeat_interleave(hop, dim=1)
        voiced = (f0[:, :, None] > c.nsf_voiced_threshold).to(f0).repeat_interleave(hop, dim=1)
        noise_amp = voiced * c.nsf_sigma + (1 - voiced) * c.nsf_alpha / 3
        harmonics = sine * c.nsf_alpha * voiced + noise_amp * noise
        return self.m_source(harmonics).transpose(1, 2), phase

    @torch.inference_mode()
    def forward(self, mel: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        f0 = self.f0_predictor(mel, finalize=finalize).to(mel.dtype)
        source = self.excitation(f0)
        if not finalize:
            mel = mel[:, :, :-self.f0_predictor.look_ahead]
        return self.decode(mel, source, finalize), source

    # -- receptive field ------------------------------------------------------------------------
    @property
    def delay_frames(self) -> int:
        """Frames of look-ahead before audio can be final: F0 (3) + conv_pre (4) + iSTFT (1)."""
        return self.f0_predictor.look_ahead + self.cfg.conv_pre_look_right + 1

    def history_frames(self) -> int:
        """Mel/excitation frames of left context the decoder needs (upstream ``context_sizes``).

        Walks the stages at their own rates: each upsampler's causal conv, the
        excitation branch (STFT window, strided conv, its resblock) and the slowest
        resblock per stage, then conv_post and the iSTFT; two extra frames cover
        grid alignment at the resampling boundaries.
        """
        c = self.cfg
        rate = int(math.prod(c.upsample_rates))
        stft_span = Fraction(c.n_fft, rate * c.hop_len)
        history, scale = Fraction(0), 1
        n = len(c.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            scale *= c.upsample_rates[i]
            history += Fraction(up.left, scale)
            down = self.source_downs[i]
            source_history = (stft_span + Fraction((down.kernel_size[0] - 1) * down.dilation[0], rate)
                              + Fraction(self.source_resblocks[i].history(), scale))
            slowest = max(r.history() for r in self.resblocks[i * n:(i + 1) * n])
            history = max(history, source_history) + Fraction(slowest, scale)
        history += Fraction(self.conv_post.left + 1, rate) + stft_span
        return int(math.ceil(history)) + 2


class BoundedStream:
    """Streaming with bounded memory (upstream ``BoundedVocoder``), batch 1.

    ``push(mel[1,80,t], last)`` accepts only new mel frames and returns the newly
    final samples [1, n]. Internally mel is consumed in ``block_frames`` blocks:
    F0 is predicted once a frame's 3-frame look-ahead has arrived, its excitation
    generated with a float64 phase accumulator carried across blocks, and audio is
    decoded once conv_pre's 4-frame look-ahead (+1 frame of iSTFT overlap) is in.
    ``last`` flushes everything (zero look-ahead). Total output = 480 x frames.

    ``lead_silence`` (default on, as minicpmo-utils 1.0.7 ``Token2wav.stream``)
    prefixes the first non-empty output of a non-final push with 8 frames (3840
    samples) of zeros, so audio time matches mel time.

    ``runner`` runs the generator stages (F0, block excitation, decode): the model itself by
    default; a ``GraphedHiFT`` replays F0 and decode from CUDA graphs. Per block that is one F0,
    one excitation and one decode call; ``drive_many`` batches them across streams.
    """

    def __init__(self, model: CausalHiFTGenerator, block_frames: int = 16, lead_silence: bool = True,
                 runner: Optional[StageRunner] = None, carry: bool = False):
        if model.cfg.hop != 480 or model.cfg.sampling_rate != 24000:
            raise ValueError("BoundedStream needs the 24 kHz, 480-samples-per-frame causal HiFT")
        if block_frames < 1:
            raise ValueError(f"block_frames must be >= 1, got {block_frames}")
        self.model = model
        self.runner = model if runner is None else runner
        self.hop = model.cfg.hop
        self.block_frames = block_frames
        self.lead_silence = lead_silence
        self.f0_left = model.f0_predictor.history
        self.f0_right = model.f0_predictor.look_ahead
        self.history = model.history_frames()
        self.decoder_right = model.cfg.conv_pre_look_right + 1
        # carry: look-ahead decodes after the first take the convs' left context from the call before
        # (``hift_carry``) instead of re-decoding the history; the final decode stays bounded
        self.carry = carry
        self.reset()

    def reset(self) -> None:
        p = self.model.conv_pre.bias  # exists with or without fused weight norm
        self.mel = p.new_zeros(1, self.model.cfg.in_channels, 0)  # frames [mel_offset, received)
        self.source = p.new_zeros(1, 1, 0)  # excitation frames [source_offset, source_end)
        self.phase = torch.zeros(1, 1, self.model.cfg.nb_harmonics + 1, dtype=torch.float64, device=p.device)
        self.mel_offset = self.source_offset = self.source_end = self.emitted = 0
        self.finished = False
        self.started = False
        self.carried: Optional[torch.Tensor] = None

    _STATE = ("mel", "source", "phase", "mel_offset", "source_offset", "source_end", "emitted", "finished", "started",
              "carried")

    def snapshot(self) -> dict:
        """The stream's state (tensors are replaced, never mutated in place, so sharing is safe)."""
        return {k: getattr(self, k) for k in self._STATE}

    def restore(self, snap: dict) -> None:
        for k in self._STATE:
            setattr(self, k, snap[k])

    @property
    def delay_samples(self) -> int:
        return self.model.delay_frames * self.hop

    def _excitation_block(self, f0: torch.Tensor, frame_offset: int,
                          pad_to: int = 0) -> Generator[StageCall, Any, torch.Tensor]:
        """F0 [1, n] of frames [frame_offset, +n) -> excitation [1, 1, n*hop], phase carried in float64.

        ``pad_to``: a shorter block runs padded with zero-F0 frames to that many (and their noise rows), its
        excitation cut back. Exact: each sample's excitation depends on its own frame's F0 and noise and on the
        phase before it, and a zero F0 advances no phase, so even the phase after the block is the same. A block of
        any length (an utterance's first, or those of its final push) then replays the steady blocks' graph."""
        n = f0.shape[1]
        if pad_to > n:
            f0 = F.pad(f0, (0, pad_to - n))
        noise = self.model.table_noise(frame_offset * self.hop, f0.shape[1] * self.hop, f0.device).to(f0)
        source, self.phase = yield StageCall(EXCITE, (f0, self.phase, noise))
        return source[:, :, :n * self.hop] if pad_to > n else source

    def _advance(self, finalize: bool) -> Generator[StageCall, Any, torch.Tensor]:
        received = self.mel_offset + self.mel.shape[2]
        # 1. excitation for every frame whose F0 look-ahead is available
        f0_ready = max(0, received - (0 if finalize else self.f0_right))
        if f0_ready > self.source_end:
            start = max(0, self.source_end - self.f0_left)
            feats = self.mel[:, :, start - self.mel_offset:]
            # look-ahead calls are causal beyond their own frames: they may run padded with longer ones
            f0 = (yield StageCall(F0, (feats,), finalize, None if finalize else (1, 1))
                  ).to(feats)[:, self.source_end - start:]
            parts = [self.source]
            # a short block (a first or final chunk's) pads to a whole one where the runner replays graphs
            pad_to = self.block_frames if getattr(self.runner, "pads_excitation_blocks", False) else 0
            for block in f0.split(self.block_frames, dim=1):
                parts.append((yield from self._excitation_block(block, self.source_end, pad_to)))
                self.source_end += block.shape[1]
            self.source = torch.cat(parts, dim=2)
        # 2. audio for every frame whose conv_pre look-ahead (+1 iSTFT frame) is available
        speech_ready = max(0, self.source_end - (0 if finalize else self.decoder_right))
        speech = self.mel.new_zeros(1, 0)
        if speech_ready > self.emitted and self.carry and not finalize:
            speech = yield from self._carried_decode(speech_ready)
        elif speech_ready > self.emitted:
            start = max(0, self.emitted - self.history)
            feats = self.mel[:, :, start - self.mel_offset:self.source_end - self.mel_offset]
            source = self.source[:, :, (start - self.source_offset) * self.hop:]
            speech = (yield StageCall(DECODE, (feats, source), finalize,
                                      None if finalize else (1, self.hop, self.hop)))[:, (self.emitted - start) * self.hop:]
            if speech.shape[1] != (speech_ready - self.emitted) * self.hop:
                raise RuntimeError(f"BoundedStream: decoded {speech.shape[1]} samples, expected "
                                   f"{(speech_ready - self.emitted) * self.hop}")
            self.emitted = speech_ready
        # 3. drop history no later step can need
        keep_mel = max(0, min(self.emitted - self.history, self.source_end - self.f0_left))
        keep_source = max(0, self.emitted - self.history)
        self.mel = self.mel[:, :, keep_mel - self.mel_offset:].clone()
        self.source = self.source[:, :, (keep_source - self.source_offset) * self.hop:].clone()
        self.mel_offset, self.source_offset = keep_mel, keep_source
        return speech

    def _carried_decode(self, speech_ready: int) -> Generator[StageCall, Any, torch.Tensor]:
        """Audio frames [emitted, speech_ready) through the carried decode (``hift_carry``): the first one of an
        utterance decodes from frame 0 and keeps the state, later ones decode new trunk frames only."""
        hop = self.hop
        if self.carried is None:
            if self.emitted or self.mel_offset or self.source_offset:
                raise RuntimeError("BoundedStream: a carried decode must start with the utterance")
            feats = self.mel[:, :, :self.source_end]
            speech, self.carried = yield StageCall(DECODE_FIRST, (feats, self.source))
        else:
            c0, c1 = self.emitted + 1, speech_ready + 1
            right = self.model.cfg.conv_pre_look_right
            feats = self.mel[:, :, c0 - self.mel_offset:c1 + right - self.mel_offset]
            n_fft, hop_len = self.model.stft_window.shape[0], self.model.cfg.hop_len
            base = self.source_offset * hop
            source = self.source[:, :, c0 * hop - (n_fft // 2 - hop_len) - base:c1 * hop + n_fft // 2 - base]
            speech, self.carried = yield StageCall(DECODE_NEXT, (feats, source, self.carried))
        if speech.shape[1] != (speech_ready - self.emitted) * hop:
            raise RuntimeError(f"BoundedStream: carried decode gave {speech.shape[1]} samples, expected "
                               f"{(speech_ready - self.emitted) * hop}")
        self.emitted = speech_ready
        return speech

    def push(self, mel: torch.Tensor, last: bool = False) -> torch.Tensor:
        """mel [1, 80, t] (t >= 0, new frames only) -> new 24 kHz samples [1, n] float32."""
        return drive(self.steps(mel, last), self.runner)

    def steps(self, mel: torch.Tensor, last: bool = False) -> Steps:
        """``push`` as stage calls (for ``drive_many``); the input is checked now, the state
        changes only as the steps run."""
        if self.finished:
            if mel.shape[-1] or not last:
                raise RuntimeError("BoundedStream: push after the last chunk; call reset() for a new utterance")
        elif mel.ndim != 3 or mel.shape[0] != 1 or mel.shape[1] != self.model.cfg.in_channels:
            raise ValueError(f"BoundedStream.push: mel must be [1, {self.model.cfg.in_channels}, t], "
                             f"got {list(mel.shape)}")
        return self._steps(mel, last)

    def _steps(self, mel: torch.Tensor, last: bool) -> Steps:
        if self.finished:  # an empty final push after the final one: nothing more to say
            return self.mel.new_zeros(1, 0)
        out = []
        for block in mel.split(self.block_frames, dim=2):
            if block.shape[2]:
                self.mel = torch.cat([self.mel, block.to(self.mel)], dim=2)
                out.append((yield from self._advance(False)))
        if last:
            out.append((yield from self._advance(True)))
            self.finished = True
        speech = torch.cat(out, dim=1) if out else self.mel.new_zeros(1, 0)
        if speech.shape[1] and not self.started:
            self.started = True
            if self.lead_silence and not last:
                speech = torch.cat([speech.new_zeros(1, self.delay_samples), speech], dim=1)
        return speech
