"""Code2Wav fast-path knobs: connector ``extra`` + environment + device -> one choice.

Precedence (seed 000, DESIGN.md "Profiles and knobs"):

* TF32 for the CFM DiT GEMMs: ``MINICPMO_CODE2WAV_TF32=off`` wins; otherwise
  ``token2wav_allow_tf32``; otherwise the legacy ``code2wav_allow_tf32``;
  otherwise on. It only means something on CUDA.
* Body: ``cfm_fused_body: false`` keeps the original body. ``true`` asks for the
  fused body whatever the TF32 setting (and may use TF32 attention). Unset (auto)
  picks the fused body on CUDA when TF32 is allowed, so switching TF32 off by
  either switch also switches the default fusion off; other platforms keep the
  original body.
* Eligibility always applies: an unsupported DiT layout or a non-FP32 attention
  cache keeps the original body, whatever was asked.
* Attention inside the fused body: Triton tiled attention with TF32 dots on NVIDIA
  SM80+; the fused body's SDPA fallback elsewhere (older CUDA, HIP, CPU).
* GEMM operand storage (``cfm_fp16_operands``): where the fused body's Triton GEMMs run TF32 on CUDA
  SM80+, their operands are stored as FP16, which holds a TF32-rounded value exactly within FP16's
  range (the same 10-bit mantissa), so the arithmetic stays TF32's with half the bytes. Unset (auto):
  FP16 exactly when the weights' range certificate (``operand_range``) shows that no operand can
  leave FP16's range, else FP32; ``true`` forces FP16 (values beyond +-65504 would saturate);
  ``false`` keeps FP32. Anything but the fused TF32 Triton path keeps FP32 and says so in the choice.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import torch

from ..errors import InputError

__all__ = ["DeviceFacts", "Code2WavChoice", "resolve_code2wav", "device_facts", "TF32_ENV"]

TF32_ENV = "MINICPMO_CODE2WAV_TF32"
_OFF = {"off", "0", "false", "no"}
_ON = {"on", "1", "true", "yes", ""}

log = logging.getLogger(__name__)

Body = Literal["original", "fused"]
Attention = Literal["triton-tf32", "sdpa"]


@dataclass(frozen=True)
class DeviceFacts:
    """What the choice depends on besides the user's switches."""

    cuda: bool                      # the flow runs on a CUDA device
    sm_major: int = 0               # compute capability major (0 off CUDA)
    hip: bool = False               # ROCm build (Triton tiled attention not used there)
    att_cache_dtype: torch.dtype = torch.float32
    layout_supported: bool = True   # fused_dit.supports_fused_body(dit)
    # operand_range(dit, n_timesteps).fits_fp16 for the loaded weights; None: not known (no weights loaded)
    operands_fit_fp16: bool | None = None


@dataclass(frozen=True)
class Code2WavChoice:
    body: Body
    attention: Attention | None     # None with the original body
    tf32: bool                      # TF32 for the DiT GEMMs inside forward/capture
    reason: str
    gemm_operands: Literal["fp32", "fp16"] = "fp32"   # FusedDiT(gemm_operands=...)

    def describe(self) -> str:
        att = f", attention {self.attention}" if self.attention else ""
        gemm = ""
        if self.body == "fused":   # the GEMM kind the pipeline's FusedDiT runs with (its default)
            from .fused_dit import SPLIT_K_FEW_ROWS, SPLIT_MAX_ROWS, WIDE_MIN_ROWS
            from .kernels.dit_block import MAX_ROWS
            gemm = f", GEMMs cuBLAS ({SPLIT_K_FEW_ROWS} K-slice partials up to {SPLIT_MAX_ROWS} rows)"
            if self.tf32:
                rows = "every staged row count" if self.gemm_operands == "fp16" else f"{WIDE_MIN_ROWS} rows"
                gemm += f", Triton tile GEMMs from {rows} on CUDA"
            if self.tf32 and self.attention == "triton-tf32":
                gemm += f", one persistent Triton launch for all DiT blocks on CUDA up to {MAX_ROWS} rows"
            if self.gemm_operands == "fp16":
                from .fused_dit import CUBLAS16_ROLES
                roles = ", ".join(r for r in ("qkv", "proj", "conv", "fc1", "fc2") if r in CUBLAS16_ROLES)
                gemm += f", their operands FP16 (TF32-exact; the staged body's {roles} as cuBLAS FP16 GEMMs on CUDA)"
            if self.attention and self.attention != "sdpa":
                gemm += ", streams' estimator caches read in place by the staged body's steady solves on CUDA"
        return (f"Code2Wav CFM body {self.body}{att}{gemm}, DiT GEMM TF32 {'on' if self.tf32 else 'off'} "
                f"({self.reason})")


def _parse_bool(value: Any, key: str) -> bool | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("auto", "none", "unset"):
            return None
        if v in ("true", "1", "yes", "on"):
            return True
        if v in ("false", "0", "no", "off"):
            return False
    raise InputError(f"connector extra '{key}'={value!r} is not a boolean; use true, false or leave it unset")


def _tf32_allowed(extra: Mapping[str, Any], env: Mapping[str, str]) -> tuple[bool, str]:
    raw = env.get(TF32_ENV)
    if raw is not None:
        v = raw.strip().lower()
        if v in _OFF:
            return False, f"{TF32_ENV}={raw}"
        if v not in _ON:
            raise InputError(f"environment {TF32_ENV}={raw!r} is not understood; set it to 'off' or unset it")
    setting = _parse_bool(extra.get("token2wav_allow_tf32"), "token2wav_allow_tf32")
    if setting is not None:
        return setting, f"token2wav_allow_tf32={str(setting).lower()}"
    legacy = extra.get("code2wav_allow_tf32")
    if isinstance(legacy, str) and legacy.strip().lower() == "flow":
        legacy = True   # the old flow-only mode is what TF32 means here anyway
    legacy = _parse_bool(legacy, "code2wav_allow_tf32")
    if legacy is not None:
        return legacy, f"code2wav_allow_tf32={str(legacy).lower()}"
    return True, "TF32 default on"


# Slots of ``cfm_slot_pool: true``: upstream sizes the pool micro + max(2, micro // 8) for a micro-batch
# of ``micro`` streams; ours is the largest Whole-Euler batch bucket, 16.
DEFAULT_POOL_SLOTS = 16 + max(2, 16 // 8)


def slot_pool_slots(extra: Mapping[str, Any] | None) -> int:
    """Connector knob ``cfm_slot_pool`` (opt-in): false/0/unset off; true ``DEFAULT_POOL_SLOTS``
    resident stream slots; an integer that many."""
    raw = (extra or {}).get("cfm_slot_pool")
    if raw is None or raw is False:
        return 0
    if raw is True:
        return DEFAULT_POOL_SLOTS
    if isinstance(raw, str):
        v = raw.strip().lower()
        if v in ("", "off", "false", "no", "none", "unset"):
            return 0
        if v in ("on", "true", "yes"):
            return DEFAULT_POOL_SLOTS
    return _count(raw, "cfm_slot_pool", f"a number of stream slots; use true ({DEFAULT_POOL_SLOTS} slots), false, "
                                         "or an integer >= 0")


def _count(raw: Any, name: str, meaning: str) -> int:
    """A non-negative integer knob value: an int, an integral float or a digit string; bools, negatives,
    fractions and other text are refused, naming the knob and ``meaning`` (what it takes)."""
    n = -1
    if isinstance(raw, int) and not isinstance(raw, bool):
        n = raw
    elif isinstance(raw, float) and raw.is_integer():
        n = int(raw)
    elif isinstance(raw, str) and raw.strip().isdigit():
        n = int(raw)
    if n < 0:
        raise InputError(f"connector extra {name!r}={raw!r} is not {meaning}")
    return n


def row_offset_merge(extra: Mapping[str, Any] | None) -> bool:
    """Connector knob ``cfm_row_offset_merge`` (opt-in, needs the slot pool): pooled streams whose caches
    differ only in length solve in one replay instead of one per length."""
    return bool(_parse_bool((extra or {}).get("cfm_row_offset_merge"), "cfm_row_offset_merge"))


# Whole-Euler graphs kept at most (``cfm_max_graphs``): upstream's default, 128 in its duplex MRv2 profile.
DEFAULT_MAX_GRAPHS = 32


def graph_budget(extra: Mapping[str, Any] | None) -> int:
    """Connector knob ``cfm_max_graphs``: the most Whole-Euler graphs the CFM solver keeps (unset:
    ``DEFAULT_MAX_GRAPHS``; 0: every solve eager). Shapes past the budget run eagerly (logged once)."""
    raw = (extra or {}).get("cfm_max_graphs")
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "unset", "default")):
        return DEFAULT_MAX_GRAPHS
    return _count(raw, "cfm_max_graphs", f"a number of graphs; use an integer >= 0 (0: solve eagerly) or leave it "
                                          f"unset ({DEFAULT_MAX_GRAPHS})")


def graph_precapture(extra: Mapping[str, Any] | None) -> bool:
    """Connector knob ``cfm_graph_precapture`` (default on): when the first stream opens, capture the
    Whole-Euler graphs of its voice's streaming chunks at every batch bucket, then the encoder's and HiFT's
    graphs (``Code2Wav.prepare``), so no chunk waits for a capture."""
    setting = _parse_bool((extra or {}).get("cfm_graph_precapture"), "cfm_graph_precapture")
    return True if setting is None else setting


def hift_carry(extra: Mapping[str, Any] | None) -> bool:
    """Connector knob ``hift_carry`` (opt-in, default off): the causal vocoder's streams decode only each
    chunk's new frames after their first, carrying every causal conv's left context (``hift_carry``) instead
    of re-decoding ~31 frames of history per chunk. Same samples up to rounding."""
    return bool(_parse_bool((extra or {}).get("hift_carry"), "hift_carry"))


def cfm_join_starts(extra: Mapping[str, Any] | None) -> bool:
    """Connector knob ``cfm_join_starts`` (opt-in, default off): a stream's first and second chunks, whose
    estimator caches are shorter than the steady ones', join the steady CFM solve of the other streams where
    the solver reads each stream's cache in place (each row its own noise offset and trim), instead of a
    solve per cache length; their encoder halves join too (the shorter caches padded at the front and
    masked). Same mel up to summation order."""
    return bool(_parse_bool((extra or {}).get("cfm_join_starts"), "cfm_join_starts"))


def resolve_code2wav(extra: Mapping[str, Any] | None, facts: DeviceFacts,
                     env: Mapping[str, str] | None = None) -> Code2WavChoice:
    """Resolve the knobs; ``env`` defaults to ``os.environ``."""
    extra = extra or {}
    env = os.environ if env is None else env
    allowed, tf32_why = _tf32_allowed(extra, env)
    tf32 = allowed and facts.cuda
    fused = _parse_bool(extra.get("cfm_fused_body"), "cfm_fused_body")
    eligible = facts.layout_supported and facts.att_cache_dtype == torch.float32
    why_not = ("unsupported DiT layout" if not facts.layout_supported
               else f"attention cache {facts.att_cache_dtype} is not float32")

    if fused is False:
        body, why = "original", "cfm_fused_body=false"
    elif fused is True:
        body, why = ("fused", "cfm_fused_body=true") if eligible else ("original", f"cfm_fused_body=true but {why_not}")
    elif not facts.cuda:
        body, why = "original", "auto: not CUDA"
    elif not allowed:
        body, why = "original", "auto: TF32 disabled"
    elif not eligible:
        body, why = "original", f"auto: {why_not}"
    else:
        body, why = "fused", "auto: CUDA with TF32 allowed"

    attention: Attention | None = None
    if body == "fused":
        attention = "triton-tf32" if (facts.cuda and not facts.hip and facts.sm_major >= 8) else "sdpa"
    reason = f"{why}; {tf32_why}"
    operands, fit = "fp32", facts.operands_fit_fp16
    asked = _parse_bool(extra.get("cfm_fp16_operands"), "cfm_fp16_operands")
    triton_tf32 = body == "fused" and tf32 and attention == "triton-tf32"
    if asked and not triton_tf32:
        reason += "; cfm_fp16_operands ignored (needs the fused body's Triton GEMMs with TF32 on CUDA SM80+)"
    elif asked:
        operands, reason = "fp16", reason + "; cfm_fp16_operands=true" + (
            " although the weights' range certificate exceeds FP16 (such operands saturate)" if fit is False else "")
    elif asked is None and triton_tf32 and fit:
        operands, reason = "fp16", reason + "; auto: GEMM operands FP16, the weights' range certificate fits"
    elif asked is None and triton_tf32:
        reason += ("; auto: GEMM operands FP32, the weights' range certificate exceeds FP16" if fit is False else
                   "; auto: FP16 GEMM operands if the weights' range certificate fits (checked when they load)")
    return Code2WavChoice(body=body, attention=attention, tf32=tf32, reason=reason, gemm_operands=operands)


def device_facts(device: torch.device | str, att_cache_dtype: torch.dtype = torch.float32,
                 layout_supported: bool = True, operands_fit_fp16: bool | None = None) -> DeviceFacts:
    device = torch.device(device)
    model = dict(att_cache_dtype=att_cache_dtype, layout_supported=layout_supported,
                 operands_fit_fp16=operands_fit_fp16)
    if device.type != "cuda":
        return DeviceFacts(cuda=False, **model)
    major, _ = torch.cuda.get_device_capability(device)
    return DeviceFacts(cuda=True, sm_major=major, hip=torch.version.hip is not None, **model)


def log_choice(choice: Code2WavChoice) -> None:
    log.info(choice.describe())
