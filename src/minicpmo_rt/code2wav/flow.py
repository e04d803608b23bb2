"""The flow (speech tokens -> 80-bin mel at 50 Hz): upstream ``CausalMaskedDiffWithXvec``.

token embedding (6561 codes) -> UpsampleConformerEncoderV2 -> ``encoder_proj`` (-> mu, 80 ch)
-> CausalConditionalCFM (DiT estimator) conditioned on the L2-normalised 192-d speaker
embedding (``spk_embed_affine_layer`` 192 -> 80) and, for prompt frames, the prompt mel.

API (stable; the Code2Wav pipeline builds on it):
  * ``Flow.inference(token, prompt_token, prompt_feat, embedding, n_timesteps)``: whole utterance;
  * ``Flow.setup_cache(prompt_tokens_plus_lookahead, prompt_mel, spk, n_timesteps) -> FlowCache``:
    encode and solve the prompt once (shareable by every stream of a voice: nothing mutates it);
  * ``Flow.inference_chunk(tokens, spk, cache, last_chunk, n_timesteps) -> (mel, FlowCache)``:
    one streamed chunk (its last 3 tokens are lookahead unless ``last_chunk``), returning a new,
    trimmed cache; ``Flow.inference_chunk_many`` the same for several streams' own caches at once
    (``stack_flow_caches`` / ``split_flow_cache`` batch and unbatch caches);
  * ``load_flow(asset_dir, device)``: build from ``flow.yaml`` and load ``flow.pt`` strictly.
Tensors are batch-first; mels are (b, 80, frames) like upstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.weights import load_strict
from ..errors import CheckpointError, InputError
from ..thinker.staging import HostStaging
from . import bulk_copy
from .cfm import CausalConditionalCFM
from .encoder import EncoderCache, UpsampleConformerEncoderV2
from .euler_graph import trim_frames
from .flow_config import FlowConfig, read_flow_yaml

# Frames of history (beyond the prompt) kept in the streaming caches, as upstream Token2wav.
HISTORY_FRAMES = 100


def steady_token_frames(prompt_frames: int) -> int:
    """Token frames of a stream's encoder cache at its steady (trimmed) length: the prompt's plus
    ``HISTORY_FRAMES`` mel frames, two per token; the length the padded encoder calls pad the caches to."""
    return (prompt_frames + HISTORY_FRAMES) // 2


@dataclass(frozen=True)
class FlowCache:
    """Streaming state of one flow stream (immutable: every call returns a new one).

    conformer_cnn (b, d, 2+2*stride); conformer_att (enc layers, b, heads, 2*t, 2*d_k) packed as
    in ``encoder``; estimator_cnn (steps, depth, 2b, 2*hidden, 2); estimator_att
    (steps, depth, 2b, heads, L, 2*head_dim), newest frame first. ``prompt_frames`` is the
    prompt's mel length, which trimming always keeps.

    ``prompt_att``: the voice prompt estimator cache (steps, depth, 2, heads, prompt_frames, 2*head_dim) that
    every row descends from (the ``estimator_att`` of a one-stream ``setup_cache`` state), or None. The trim
    drops frames from the middle and new frames go in front, so each row's estimator cache ends with the
    prompt's last min(prompt_frames, 100) frames, bit for bit: the fast path's solver can read those from this
    one copy that all of a voice's streams share (``WholeEulerSolver.share_tail``).
    """

    conformer_cnn: torch.Tensor
    conformer_att: torch.Tensor
    estimator_cnn: torch.Tensor
    estimator_att: torch.Tensor
    prompt_frames: int
    prompt_att: torch.Tensor | None = None

    @property
    def n_timesteps(self) -> int:
        return self.estimator_att.shape[0]

    @property
    def estimator_frames(self) -> int:
        """Estimator cache length: also the noise offset of the next chunk."""
        return self.estimator_att.shape[4]

    @property
    def encoder(self) -> EncoderCache:
        return EncoderCache(self.conformer_cnn, self.conformer_att)

    def clone(self) -> "FlowCache":
        att = self.estimator_att.clone()     # the prompt cache is read-only: shared, not cloned
        prompt = att if self.prompt_att is self.estimator_att else self.prompt_att
        return FlowCache(self.conformer_cnn.clone(), self.conformer_att.clone(), self.estimator_cnn.clone(),
                         att, self.prompt_frames, prompt)

    def to(self, device: torch.device | str) -> "FlowCache":
        att = self.estimator_att.to(device)
        if self.prompt_att is None or self.prompt_att is self.estimator_att:
            prompt = None if self.prompt_att is None else att
        else:
            prompt = self.prompt_att.to(device)
        return FlowCache(self.conformer_cnn.to(device), self.conformer_att.to(device),
                         self.estimator_cnn.to(device), att, self.prompt_frames, prompt)


def stack_encoder_caches(encs: Sequence[EncoderCache]) -> EncoderCache:
    """Encoder caches batched: cnn is batch-first, att has the batch on axis 1 (after the layers)."""
    return EncoderCache(bulk_copy.cat([e.cnn for e in encs], 0), bulk_copy.cat([e.att for e in encs], 1))


def pad_encoder_caches(encs: Sequence[EncoderCache], n_token_layers: int,
                       pad_to: int | None = None) -> tuple[EncoderCache, list[int]]:
    """Encoder caches of several lengths batched at the longest (or at ``pad_to`` token frames where that is
    longer): each shorter row padded at the front (the oldest end) with zeros, and how many token frames each
    row's padding holds (``forward_chunk(pad=)`` masks them). The token-rate layers are read from the first
    half of their packed length only, so only that half is written."""
    past = max([e.token_frames for e in encs] + [pad_to or 0])
    a0 = encs[0].att
    att = torch.zeros(a0.shape[0], len(encs), a0.shape[2], 2 * past, a0.shape[4], dtype=a0.dtype, device=a0.device)
    pads = []
    for r, e in enumerate(encs):
        n, d = e.token_frames, past - e.token_frames
        bulk_copy.copy_(att[:n_token_layers, r:r + 1, :, d:past], e.att[:n_token_layers, :, :, :n])
        bulk_copy.copy_(att[n_token_layers:, r:r + 1, :, 2 * d:], e.att[n_token_layers:])
        pads.append(d)
    return EncoderCache(bulk_copy.cat([e.cnn for e in encs], 0), att), pads


def split_encoder_cache(enc: EncoderCache, sizes: Sequence[int]) -> list[EncoderCache]:
    """Inverse of ``stack_encoder_caches``: caches of ``sizes`` rows each, in their own memory."""
    out, i = [], 0
    for n in sizes:
        out.append(EncoderCache(bulk_copy.clone(enc.cnn[i:i + n]), bulk_copy.clone(enc.att[:, i:i + n])))
        i += n
    return out


def _stack_cfg(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Estimator caches (steps, depth, 2b_k, ...), each ``[cond rows | uncond rows]`` on axis 2, as one
    such cache: every cond half ahead of every uncond half."""
    halves = [(t[:, :, :t.shape[2] // 2], t[:, :, t.shape[2] // 2:]) for t in ts]
    return bulk_copy.cat([h[0] for h in halves] + [h[1] for h in halves], 2)


def _cfg_rows(t: torch.Tensor, i: int, j: int) -> torch.Tensor:
    """Batch rows [i, j) of a ``[cond rows | uncond rows]`` estimator cache, in their own memory."""
    b = t.shape[2] // 2
    return bulk_copy.cat([t[:, :, i:j], t[:, :, b + i:b + j]], 2)


def stack_flow_caches(caches: Sequence[FlowCache]) -> FlowCache:
    """One FlowCache whose batch rows are the given caches' rows, in order (the estimator caches'
    cond halves stacked ahead of their uncond halves, keeping the ``[cond | uncond]`` layout). The caches'
    ``prompt_att`` is kept where they all have the same one (one voice), else None."""
    enc = stack_encoder_caches([c.encoder for c in caches])
    prompt = caches[0].prompt_att
    return FlowCache(enc.cnn, enc.att, _stack_cfg([c.estimator_cnn for c in caches]),
                     _stack_cfg([c.estimator_att for c in caches]), caches[0].prompt_frames,
                     prompt if all(c.prompt_att is prompt for c in caches) else None)


def split_flow_cache(cache: FlowCache, sizes: Sequence[int]) -> list[FlowCache]:
    """Inverse of ``stack_flow_caches``: per-stream caches of ``sizes`` rows each (own memory,
    so a stream never keeps the whole batch's tensors alive)."""
    out, i = [], 0
    for n, enc in zip(sizes, split_encoder_cache(cache.encoder, sizes)):
        out.append(FlowCache(enc.cnn, enc.att, _cfg_rows(cache.estimator_cnn, i, i + n),
                             _cfg_rows(cache.estimator_att, i, i + n), cache.prompt_frames, cache.prompt_att))
        i += n
    return out


@dataclass(frozen=True)
class ChunkPart:
    """Streams whose payloads have one length and final flag, in ``Flow.inference_chunks_joined``: token
    (b, n), spk (b, 192), their b caches in row order, and whether the payloads are final."""

    token: torch.Tensor
    spk: torch.Tensor
    caches: Sequence[FlowCache]
    last: bool = False


def check_joint_caches(caches: Sequence[FlowCache], who: str) -> None:
    """Caches solved in one batch must agree in every shape and in their prompt frames (the trim)."""
    names = ("conformer_cnn", "conformer_att", "estimator_cnn", "estimator_att")
    for i, c in enumerate(caches[1:], 1):
        for name in names:
            if getattr(c, name).shape != getattr(caches[0], name).shape:
                raise InputError(f"{who}: cache {i}'s {name} has shape {tuple(getattr(c, name).shape)}, cache 0's "
                                 f"{tuple(getattr(caches[0], name).shape)}; streams solved together need equal cache "
                                 "shapes (solve the others apart)")
    if any(c.prompt_frames != caches[0].prompt_frames for c in caches):     # every stream is trimmed at one p
        raise InputError(f"{who}: the caches' prompt frames differ ({sorted({c.prompt_frames for c in caches})}); "
                         "solve those streams apart")


def check_steps(caches: Sequence[FlowCache], n_timesteps: int) -> None:
    """Caches solved with ``n_timesteps`` Euler steps must have been set up with that many."""
    if any(c.n_timesteps != n_timesteps for c in caches):
        raise InputError(f"n_timesteps={n_timesteps} but a cache was set up with another step count "
                         f"({sorted({c.n_timesteps for c in caches})})")


def trim_estimator_att(att: torch.Tensor, prompt_frames: int, keep: int = HISTORY_FRAMES) -> torch.Tensor:
    """Past ``prompt_frames + keep`` frames, keep the first ``prompt_frames`` and the last ``keep``
    along the frame axis (upstream's rule, applied to its newest-first layout as it is)."""
    return trim_frames(att, prompt_frames, keep)


def trim_conformer_att(att: torch.Tensor, prompt_frames: int, n_token_layers: int,
                       keep: int = HISTORY_FRAMES) -> torch.Tensor:
    """Trim the packed conformer cache to the prompt + ``keep`` mel frames (upstream 1.0.7).

    The token-rate layers (stored twice along time) keep prompt//2 + keep//2 token frames,
    the mel-rate layers prompt + keep frames; then the cache is repacked.
    """
    frames = att.shape[3]
    if frames <= prompt_frames + keep:
        return att
    tok = att[:n_token_layers, :, :, :frames // 2]
    tok = bulk_copy.cat([tok[:, :, :, :prompt_frames // 2], tok[:, :, :, tok.shape[3] - keep // 2:]], dim=3)
    mel = att[n_token_layers:]
    mel = bulk_copy.cat([mel[:, :, :, :prompt_frames], mel[:, :, :, frames - keep:]], dim=3)
    return bulk_copy.cat([tok.repeat(1, 1, 1, 2, 1), mel], dim=0)


def trim_split_conformer_att(att: torch.Tensor, prompt_frames: Sequence[int], n_token_layers: int,
                             keep: int = HISTORY_FRAMES, pads: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Each batch row of a packed conformer cache (layers, b, heads, frames, 2*d_k), trimmed as
    ``trim_conformer_att`` trims it at that row's prompt frames, in memory of its own: one copy of each kept
    frame range straight into the row's new cache (``split_encoder_cache(trim_conformer_att(...))`` copies the
    batch ~4 times: the trim's three concatenations and the split). ``pads``: each row's front padding in token
    frames (``pad_encoder_caches``), left out."""
    frames = att.shape[3]
    half = frames // 2
    out = []
    for i, p in enumerate(prompt_frames):
        row = att[:, i:i + 1]
        d = 0 if pads is None else int(pads[i])
        fr = frames - 2 * d                                  # the row's own packed length
        tok_src, mel_src = row[:n_token_layers, :, :, d:half], row[n_token_layers:, :, :, 2 * d:]
        if fr <= p + keep:
            if not d:
                out.append(bulk_copy.clone(row))
                continue
            new = torch.empty(att.shape[0], 1, att.shape[2], fr, att.shape[4], dtype=att.dtype, device=att.device)
            tok = new[:n_token_layers]
            bulk_copy.copy_(tok[..., :fr // 2, :], tok_src)
            bulk_copy.copy_(tok[..., fr // 2:, :], tok_src)           # stored twice along time, as packed
            bulk_copy.copy_(new[n_token_layers:], mel_src)
            out.append(new)
            continue
        if p % 2 or keep % 2:
            raise ValueError(f"trim_split_conformer_att: prompt frames {p} and kept frames {keep} must be even "
                             "(two mel frames per token)")
        nt = p // 2 + keep // 2                              # token-rate frames kept
        new = torch.empty(att.shape[0], 1, att.shape[2], p + keep, att.shape[4], dtype=att.dtype, device=att.device)
        tok, mel = new[:n_token_layers], new[n_token_layers:]
        bulk_copy.copy_(tok[..., :p // 2, :], tok_src[..., :p // 2, :])
        bulk_copy.copy_(tok[..., p // 2:nt, :], tok_src[..., fr // 2 - keep // 2:, :])
        bulk_copy.copy_(tok[..., nt:, :], tok[..., :nt, :])      # stored twice along time, as packed
        bulk_copy.copy_(mel[..., :p, :], mel_src[..., :p, :])
        bulk_copy.copy_(mel[..., p:, :], mel_src[..., fr - keep:, :])
        out.append(new)
    return out


class Flow(nn.Module):
    """``CausalMaskedDiffWithXvec`` (see module docstring). Parameter names are upstream's."""

    def __init__(self, cfg: FlowConfig, noise_seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoderV2(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = CausalConditionalCFM(cfg.decoder, noise_seed=noise_seed)
        # Optional fast path for streamed chunks (code2wav.euler_graph.WholeEulerSolver); the
        # reference ``decoder.forward_chunk`` runs when it is None.
        self.chunk_solver = None
        # Optional CUDA graphs of the encoder half (code2wav.encoder_graph.EncoderGraphs); eager when None.
        self.encoder_graphs = None
        self._uploads = None     # HostStaging for host tensors (to_device)

    @property
    def pre_lookahead_len(self) -> int:
        return self.encoder.pre_lookahead_len

    @property
    def up_rate(self) -> int:
        return self.encoder.up_rate

    # ------------------------------------------------------------------ helpers
    def _check_tokens(self, token: torch.Tensor, name: str) -> None:
        if token.dim() != 2 or token.dtype.is_floating_point:
            raise InputError(f"{name}: expected integer codes of shape (batch, frames), got "
                             f"{tuple(token.shape)} {token.dtype}")
        if token.numel():
            lo, hi = int(token.min()), int(token.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise InputError(f"{name}: codes must lie in 0..{self.cfg.vocab_size - 1}; found {lo}..{hi}")

    def to_device(self, token: torch.Tensor) -> torch.Tensor:
        """A tensor (codes, row indices) on the model's device. A host tensor goes up through pinned staging
        without waiting: a copy from pageable memory (``.to(device)``) waits for every kernel queued before
        it, so a round of concurrent streams would stop the host at each group's encoder call instead of
        queueing ahead."""
        dev = self.input_embedding.weight.device
        if token.device == dev:
            return token
        if token.device.type == "cpu" and dev.type == "cuda":
            if self._uploads is None or self._uploads.device != dev:
                self._uploads = HostStaging(dev, slots=32)
            return self._uploads.upload(token)
        return token.to(dev)

    def _speaker(self, spk: torch.Tensor) -> torch.Tensor:
        if spk.dim() != 2 or spk.shape[1] != self.cfg.spk_embed_dim:
            raise InputError(f"speaker embedding: expected (batch, {self.cfg.spk_embed_dim}), got {tuple(spk.shape)}")
        return self.spk_embed_affine_layer(F.normalize(spk, dim=1))

    # ------------------------------------------------------------------ whole utterance
    @torch.inference_mode()
    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, n_timesteps: int = 10) -> torch.Tensor:
        """Mel for ``token`` (1, T) spoken in the prompt's voice -> (1, 80, up_rate*T).

        prompt_token (1, Tp); prompt_feat (1, up_rate*Tp, 80) the prompt mel; embedding (1, 192).
        The prompt's frames condition the solve and are cut from the result.
        """
        if token.shape[0] != 1 or prompt_token.shape[0] != 1:
            raise InputError(f"inference runs one utterance: batch {token.shape[0]} given")
        if token.shape[1] == 0:
            raise InputError("inference: empty token list")
        self._check_tokens(token, "tokens")
        self._check_tokens(prompt_token, "prompt tokens")
        spk = self._speaker(embedding)
        h = self.encoder(self.input_embedding(torch.cat([prompt_token, token], dim=1).long()))
        h = self.encoder_proj(h)
        n_prompt = prompt_feat.shape[1]
        if n_prompt > h.shape[1]:
            raise InputError(f"prompt mel has {n_prompt} frames, more than the {h.shape[1]} the tokens give")
        cond = torch.zeros_like(h)
        cond[:, :n_prompt] = prompt_feat
        mel = self.decoder(h.transpose(1, 2).contiguous(), None, spk, cond.transpose(1, 2).contiguous(),
                           n_timesteps=n_timesteps)
        return mel[:, :, n_prompt:]

    # ------------------------------------------------------------------ streaming
    @torch.inference_mode()
    def setup_cache(self, token: torch.Tensor, mel: torch.Tensor, spk: torch.Tensor,
                    n_timesteps: int = 10) -> FlowCache:
        """Encode and solve the voice prompt once.

        token (b, Tp + 3): the prompt tokens followed by 3 lookahead tokens (upstream appends
        the prompt's first 3; the vLLM-Omni protocol uses silence codes); mel (b, up_rate*Tp, 80)
        the prompt mel; spk (b, 192). The returned cache is never mutated, so one cache can seed
        any number of streams.
        """
        self._check_tokens(token, "prompt tokens")
        want = (token.shape[1] - self.pre_lookahead_len) * self.up_rate
        if mel.dim() != 3 or mel.shape[1] != want or mel.shape[2] != self.cfg.output_size:
            raise InputError(f"prompt mel: expected (b, {want}, {self.cfg.output_size}) for {token.shape[1]} tokens "
                             f"(incl. {self.pre_lookahead_len} lookahead), got {tuple(mel.shape)}")
        if n_timesteps < 1:
            raise InputError(f"n_timesteps must be >= 1, got {n_timesteps}")
        spk = self._speaker(spk)
        h, enc_cache = self.encoder.forward_chunk(self.input_embedding(token.long()), last_chunk=False)
        h = self.encoder_proj(h)
        _, est_cnn, est_att = self.decoder.forward_chunk(
            h.transpose(1, 2).contiguous(), spk, mel.transpose(1, 2).contiguous(), n_timesteps=n_timesteps)
        return FlowCache(enc_cache.cnn, enc_cache.att, est_cnn, est_att, prompt_frames=mel.shape[1],
                         prompt_att=est_att if token.shape[0] == 1 else None)

    @torch.inference_mode()
    def inference_chunk(self, token: torch.Tensor, spk: torch.Tensor, cache: FlowCache, last_chunk: bool = False,
                        n_timesteps: int | None = None) -> tuple[torch.Tensor, FlowCache]:
        """One streamed chunk -> (mel (b, 80, up_rate*m), next cache).

        token (b, n): a non-final chunk's last 3 tokens are lookahead (m = n - 3; they are sent
        again at the start of the next chunk); with ``last_chunk`` all n are decoded. The next
        cache is trimmed to prompt + 100 frames like upstream Token2wav.stream.
        """
        n_timesteps = cache.n_timesteps if n_timesteps is None else n_timesteps
        if n_timesteps != cache.n_timesteps:
            raise InputError(f"n_timesteps={n_timesteps} but the cache was set up with {cache.n_timesteps} steps")
        p = cache.prompt_frames
        if token.shape[0] == 1:     # one stream: its next encoder cache cut out trimmed, in one copy
            h, spk, (enc_cache,) = self.encode_streams(token, spk, [cache.encoder], last_chunk, [p])
        else:
            h, spk, enc_cache = self.encode_chunk(token, spk, cache.encoder, last_chunk)
            enc_cache = self.trim_encoder_cache(enc_cache, p)
        if self.chunk_solver is not None and self.chunk_solver.S == n_timesteps:
            # The fast path (fused body / Whole-Euler graphs): same contract as forward_chunk. The
            # solver trims: its steady solve reads the old cache in place and writes the successor,
            # else the trim is the one copy of the solver's views
            mel, est_cnn, est_att = self.chunk_solver.solve(h, spk, torch.zeros_like(h),
                                                            cache.estimator_cnn, cache.estimator_att,
                                                            copy_out=False, trim=(cache.prompt_frames, HISTORY_FRAMES))
            est_cnn = est_cnn.clone()
        else:
            mel, est_cnn, est_att = self.decoder.forward_chunk(
                h, spk, torch.zeros_like(h), n_timesteps=n_timesteps,
                cnn_cache=cache.estimator_cnn, att_cache=cache.estimator_att)
            est_att = trim_estimator_att(est_att, cache.prompt_frames)
        return mel, FlowCache(enc_cache.cnn, enc_cache.att, est_cnn, est_att, p, cache.prompt_att)

    @torch.inference_mode()
    def inference_chunk_many(self, token: torch.Tensor, spk: torch.Tensor, caches: Sequence[FlowCache],
                             last_chunk: bool = False, n_timesteps: int | None = None
                             ) -> tuple[torch.Tensor, list[FlowCache]]:
        """``inference_chunk`` for b streams at once, each with its own cache (token, spk: b rows in
        the caches' order; the caches' shapes and prompt frames agree) -> (mel (b, 80, frames), the
        b next caches, each in its own memory).

        The result is that of ``stack_flow_caches`` -> ``inference_chunk`` -> ``split_flow_cache``.
        On the fast path the largest state, the estimator's attention cache (8.4 GB at 16 streams),
        is read where each stream holds it and its trimmed successor written once (the solver's direct
        path; where that does not apply, into the solver's rows and the successor straight out of them).
        """
        if not caches or token.shape[0] != len(caches) or spk.shape[0] != len(caches):
            raise InputError(f"inference_chunk_many: {len(caches)} caches for {token.shape[0]} token rows and "
                             f"{spk.shape[0]} speaker rows; pass one cache per row")
        check_joint_caches(caches, "inference_chunk_many")
        p = caches[0].prompt_frames
        if len(caches) == 1:
            mel, new = self.inference_chunk(token, spk, caches[0], last_chunk, n_timesteps)
            return mel, [new]
        n_timesteps = caches[0].n_timesteps if n_timesteps is None else n_timesteps
        if self.chunk_solver is None or self.chunk_solver.S != n_timesteps:
            mel, new = self.inference_chunk(token, spk, stack_flow_caches(caches), last_chunk, n_timesteps)
            return mel, split_flow_cache(new, [1] * len(caches))
        check_steps(caches, n_timesteps)
        h, spk, encs = self.encode_streams(token, spk, [c.encoder for c in caches], last_chunk, [p] * len(caches))
        mel, cnn, atts = self.chunk_solver.solve(h, spk, torch.zeros_like(h), _stack_cfg([c.estimator_cnn for c in caches]),
                                                 [c.estimator_att for c in caches], copy_out=False,
                                                 trim=(p, HISTORY_FRAMES), tails=[c.prompt_att for c in caches])
        return mel, [FlowCache(enc.cnn, enc.att, _cfg_rows(cnn, i, i + 1), att, p, c.prompt_att)
                     for i, (enc, att, c) in enumerate(zip(encs, atts, caches))]

    def chunk_frames(self, n_tokens: int, last: bool) -> int:
        """Mel frames a chunk of ``n_tokens`` decodes: all of a final one's, else all but the lookahead."""
        return (n_tokens if last else n_tokens - self.pre_lookahead_len) * self.up_rate

    def joins_widths(self, n_timesteps: int) -> bool:
        """Can ``inference_chunks_joined`` run its parts as one CFM solve (the chunk solver with the fused
        body, rows of their own widths) rather than one solve per part?"""
        sv = self.chunk_solver
        return sv is not None and sv.S == n_timesteps and sv.body == "fused"

    def _joins_lengths(self, parts: Sequence[ChunkPart], caches: Sequence[FlowCache], T: int,
                       n_timesteps: int) -> bool:
        """Can parts whose caches differ in length solve as one (``inference_chunks_joined``)?"""
        if not self.joins_widths(n_timesteps) or any(c.n_timesteps != n_timesteps for c in caches):
            return False
        p = caches[0].prompt_frames
        mu = torch.empty(1, self.cfg.output_size, T, device=caches[0].estimator_att.device)
        ragged = any(self.chunk_frames(part.token.shape[1], part.last) < T for part in parts)
        return self.chunk_solver.joins_lengths(T, [c.estimator_att for c in caches], mu, (p, HISTORY_FRAMES), ragged)

    @torch.inference_mode()
    def inference_chunks_joined(self, parts: Sequence[ChunkPart], n_timesteps: int | None = None,
                                final_tokens: int | None = None
                                ) -> list[tuple[torch.Tensor, list[FlowCache] | None]]:
        """``inference_chunk_many`` for several payload shapes of streams whose caches agree, in ONE CFM solve:
        each payload shape's encoder half runs as its own call (the final parts' as one), then every row solves
        together at the widest part's width, a narrower part's rows (which must be final chunks: their streams
        end) padded and attending their own frames only (``WholeEulerSolver.solve(widths=)``). So the final
        chunks of streams ending in a round join the steady chunks of the others instead of a solve of their own.

        Parts may also differ in cache length (each part's caches agree; the prompt frames agree across
        parts): a stream's first and second chunks (estimator caches of prompt and prompt + 50 frames) then
        join the steady chunks where the solver reads each row's cache in place (``WholeEulerSolver.
        joins_lengths``: each row its own noise offset and trim); elsewhere each cache length solves apart.

        The final parts' encoder halves run as one call whatever their lengths (``encode_ends``, tokens padded at
        the back to at least ``final_tokens``, the steady payload's, on the graph path), also for a final part
        alone.

        Returns per part (mel (b, 80, its frames), its b next caches; None for a final part: its streams end).
        Where the solver cannot take rows of their own widths (``joins_widths``), each part solves apart, with
        the same results (and next caches for the final parts too)."""
        if not parts:
            raise InputError("inference_chunks_joined: no parts")
        caches = [c for part in parts for c in part.caches]
        for i, part in enumerate(parts):
            b = len(part.caches)
            if not b or part.token.shape[0] != b or part.spk.shape[0] != b:
                raise InputError(f"inference_chunks_joined: part {i} has {b} caches for {part.token.shape[0]} token "
                                 f"rows and {part.spk.shape[0]} speaker rows; pass one cache per row")
            check_joint_caches(part.caches, f"inference_chunks_joined (part {i})")
        lengths = {c.estimator_frames for c in caches}
        if len(lengths) == 1 or len({c.prompt_frames for c in caches}) > 1:     # the latter raises, naming them
            check_joint_caches(caches, "inference_chunks_joined")
        frames = [self.chunk_frames(part.token.shape[1], part.last) for part in parts]
        T = max(frames)
        for i, (part, f) in enumerate(zip(parts, frames)):
            if f < T and not part.last:
                raise InputError(f"inference_chunks_joined: part {i} decodes {f} frames, fewer than the widest "
                                 f"part's {T}, and is not final; only a stream's final chunk may solve narrower "
                                 "(its cache would lack the padding frames)")
        n_timesteps = caches[0].n_timesteps if n_timesteps is None else n_timesteps
        if len(lengths) > 1 and not self._joins_lengths(parts, caches, T, n_timesteps):
            by_length: dict[int, list[int]] = {}        # each cache length apart, in its parts' order
            for i, part in enumerate(parts):
                by_length.setdefault(part.caches[0].estimator_frames, []).append(i)
            out: list = [None] * len(parts)
            for idx in by_length.values():
                for i, res in zip(idx, self.inference_chunks_joined([parts[i] for i in idx], n_timesteps,
                                                                    final_tokens)):
                    out[i] = res
            return out
        if not self.joins_widths(n_timesteps) or (len(parts) == 1 and not parts[0].last):
            out = []
            for part in parts:
                mel, new = self.inference_chunk_many(part.token, part.spk, list(part.caches), part.last, n_timesteps)
                out.append((mel, None if part.last else new))
            return out
        check_steps(caches, n_timesteps)
        p = caches[0].prompt_frames
        # parts of one payload shape share an encoder call whatever their cache lengths (the shorter caches
        # padded at the front and masked); the final parts all share one (their streams end: no next caches)
        encoded: list = [None] * len(parts)
        steady = steady_token_frames(p)
        ends = [i for i, part in enumerate(parts) if part.last]
        if ends:
            hs, sp = self.encode_ends([parts[i].token for i in ends], torch.cat([parts[i].spk for i in ends]),
                                      [c.encoder for i in ends for c in parts[i].caches], final_tokens, steady)
            r = 0
            for i, h in zip(ends, hs):
                b = len(parts[i].caches)
                encoded[i] = (h, sp[r:r + b], None)
                r += b
        by_payload: dict[int, list[int]] = {}
        for i, part in enumerate(parts):
            if not part.last:
                by_payload.setdefault(part.token.shape[1], []).append(i)
        for idx in by_payload.values():
            encoders = [c.encoder for i in idx for c in parts[i].caches]
            h, sp, enc = self.encode_streams(torch.cat([parts[i].token for i in idx]),
                                             torch.cat([parts[i].spk for i in idx]), encoders, False,
                                             [p] * len(encoders), steady)
            r = 0
            for i in idx:
                b = len(parts[i].caches)
                encoded[i] = (h[r:r + b], sp[r:r + b], None if enc is None else enc[r:r + b])
                r += b
        mus, spks, encs, widths = [], [], [], []
        for part, f, (h, sp, enc) in zip(parts, frames, encoded):
            mus.append(F.pad(h, (0, T - f)))
            spks.append(sp)
            encs.append(enc)
            widths += [f] * len(part.caches)
        mu = torch.cat(mus, 0)
        mel, cnn, atts = self.chunk_solver.solve(mu, torch.cat(spks, 0), torch.zeros_like(mu),
                                                 _stack_cfg([c.estimator_cnn for c in caches]),
                                                 [c.estimator_att for c in caches], copy_out=False,
                                                 trim=(p, HISTORY_FRAMES), widths=widths,
                                                 tails=[c.prompt_att for c in caches])
        out, r = [], 0
        for part, f, enc in zip(parts, frames, encs):
            b = len(part.caches)
            news = None
            if not part.last:
                news = [FlowCache(e.cnn, e.att, _cfg_rows(cnn, r + j, r + j + 1), atts[r + j], p,
                                  part.caches[j].prompt_att) for j, e in enumerate(enc)]
            out.append((mel[r:r + b] if f == T else mel[r:r + b, :, :f].contiguous(), news))
            r += b
        return out

    @torch.inference_mode()
    def encode_streams(self, token: torch.Tensor, spk: torch.Tensor, encoders: Sequence[EncoderCache],
                       last_chunk: bool, prompt_frames: Sequence[int] | None, pad_to: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, list[EncoderCache] | None]:
        """The encoder half for b streams' own caches (token, spk: b rows in their order): (mu (b, 80, frames),
        projected speaker (b, 80), each stream's next encoder cache trimmed at its ``prompt_frames`` in memory of
        its own; None with ``prompt_frames`` None, when the streams end). The next caches are cut straight out
        of the encoder's output (``trim_split_conformer_att``: one copy of what each stream keeps). Caches of
        several lengths (a stream's first and second chunks among steady ones) run as one call, the shorter
        padded at the front and masked (``pad_encoder_caches``), to at least ``pad_to`` token frames: the steady
        length, so that starting streams alone take the shape ``warm_up`` captured."""
        pads = None
        if len(encoders) == 1:
            enc = encoders[0]
        elif len({e.att.shape[3] for e in encoders}) > 1:
            enc, pads = pad_encoder_caches(encoders, len(self.encoder.encoders), pad_to)
        else:
            enc = stack_encoder_caches(encoders)
        h, spk, new = self.encode_chunk(token, spk, enc, last_chunk, copy_out=False, pads=pads)
        if prompt_frames is None:
            return h, spk, None
        atts = trim_split_conformer_att(new.att, prompt_frames, len(self.encoder.encoders), pads=pads)
        return h, spk, [EncoderCache(bulk_copy.clone(new.cnn[i:i + 1]), a) for i, a in enumerate(atts)]

    @torch.inference_mode()
    def encode_ends(self, tokens: Sequence[torch.Tensor], spk: torch.Tensor, encoders: Sequence[EncoderCache],
                    tokens_to: int | None = None, pad_to: int | None = None
                    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The encoder half of final chunks of streams that end, in ONE call whatever their lengths: ``tokens``
        groups of rows (b_i, n_i), whose caches are ``encoders`` in row order; spk (b, 192) -> (mu per group
        (b_i, 80, up_rate * n_i), projected speaker (b, 80)). No next caches: the padding leaves them wrong.

        Each row's tokens are padded at the back to the longest and masked (``forward_chunk(valid=)``); caches
        of several lengths are padded at the front (``pad_encoder_caches``). On the graph path the tokens pad to
        at least ``tokens_to`` (the steady payload's) and the caches to at least ``pad_to`` token frames (the
        steady length's), so that the final chunks of every round, of any length, replay one graph per batch
        bucket (``EncoderGraphs.ended``, which ``Code2Wav.warm_up`` captures) instead of running eagerly,
        capturing, or evicting the steady chunks' graphs."""
        rows = sum(t.shape[0] for t in tokens)
        if not tokens or rows != len(encoders) or spk.shape[0] != rows:
            raise InputError(f"encode_ends: {len(encoders)} encoder caches and {spk.shape[0]} speaker rows for "
                             f"{rows} token rows; pass one cache and one speaker row per token row")
        graphed = self.encoder_graphs is not None
        lengths = [t.shape[1] for t in tokens]
        n = max(lengths + [(tokens_to or 0) if graphed else 0])
        token = torch.cat([F.pad(t.long(), (0, n - t.shape[1])) for t in tokens])
        valid = [t.shape[1] for t in tokens for _ in range(t.shape[0])]
        past = {e.token_frames for e in encoders}
        pads = None
        if len(past) > 1 or (graphed and pad_to and max(past) < pad_to):
            enc, pads = pad_encoder_caches(encoders, len(self.encoder.encoders), pad_to if graphed else None)
        else:
            enc = encoders[0] if len(encoders) == 1 else stack_encoder_caches(encoders)
        h, spk, _ = self.encode_chunk(token, spk, enc, True, copy_out=False, pads=pads, valid=valid)
        out, r = [], 0
        for t in tokens:
            out.append(h[r:r + t.shape[0], :, :self.chunk_frames(t.shape[1], True)])
            r += t.shape[0]
        return out, spk

    @torch.inference_mode()
    def encode_chunk(self, token: torch.Tensor, spk: torch.Tensor, encoder: EncoderCache, last_chunk: bool = False,
                     copy_out: bool = True, pads: Sequence[int] | None = None, valid: Sequence[int] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, EncoderCache]:
        """The encoder half of ``inference_chunk``: (mu (b, 80, frames), projected speaker (b, 80), next
        encoder cache, untrimmed: ``trim_encoder_cache``). The opt-in slot pool runs the CFM half itself.
        ``copy_out=False``: from CUDA graphs the next cache may be a view of a graph's output, valid until that
        graph replays again (``encode_streams`` copies what each stream keeps out of it at once). ``token`` may
        be on the host: checked there and uploaded without a device synchronisation (``to_device``); on the
        device its range check waits for the device. ``pads``: each row's front padding of a batch of caches of
        several lengths (``pad_encoder_caches``); the next cache keeps it. ``valid``: a final chunk's rows' own token
        counts, the rest padding at the back (``encode_ends``; the next cache is then not each row's own)."""
        self._check_tokens(token, "tokens")
        if token.shape[1] <= (0 if last_chunk else self.pre_lookahead_len):
            raise InputError(f"chunk of {token.shape[1]} tokens: a non-final chunk needs new tokens plus "
                             f"{self.pre_lookahead_len} lookahead, a final one at least 1")
        spk = self._speaker(spk)
        token = self.to_device(token.long())
        pad = None if pads is None else self.to_device(torch.tensor(pads, dtype=torch.long))
        ok = None if valid is None else self.to_device(torch.tensor(valid, dtype=torch.long))
        if self.encoder_graphs is None:
            h, enc_cache = self._encode(token, encoder, last_chunk, pad, ok)
        else:
            h, enc_cache = self.encoder_graphs.run(token, encoder, last_chunk, copy_out=copy_out, pad=pad, valid=ok)
        return h.transpose(1, 2).contiguous(), spk, enc_cache

    def _encode(self, token: torch.Tensor, encoder: EncoderCache, last_chunk: bool,
                pad: torch.Tensor | None = None, valid: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, EncoderCache]:
        """Embedding -> conformer chunk -> ``encoder_proj``: (h (b, frames, 80), next encoder cache), what
        ``encoder_graphs`` captures (``pad``: rows padded at the front, ``valid``: rows' own token counts of
        final chunks padded at the back, ``forward_chunk(pad=, valid=)``)."""
        h, enc_cache = self.encoder.forward_chunk(self.input_embedding(token), last_chunk, encoder, pad, valid)
        return self.encoder_proj(h), enc_cache

    def trim_encoder_cache(self, cache: EncoderCache, prompt_frames: int) -> EncoderCache:
        return EncoderCache(cache.cnn, trim_conformer_att(cache.att, prompt_frames, len(self.encoder.encoders)))


def load_flow(asset_dir: str | Path, device: str | torch.device = "cpu", noise_seed: int = 0) -> Flow:
    """Build the flow from ``asset_dir/flow.yaml`` and load ``asset_dir/flow.pt`` strictly (fp32)."""
    asset_dir = Path(asset_dir)
    yaml_path, weights = asset_dir / "flow.yaml", asset_dir / "flow.pt"
    for path in (yaml_path, weights):
        if not path.is_file():
            raise CheckpointError(f"{path}: not found; a snapshot's assets/token2wav/ must hold flow.yaml and "
                                  "flow.pt (point --model at a MiniCPM-o 4.5 snapshot or run make-tiny)")
    cfg = read_flow_yaml(yaml_path)
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise CheckpointError(f"{weights}: cannot be read as a torch state_dict ({exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{weights}: holds a {type(state).__name__}, expected a state_dict")
    with torch.device("meta"):
        flow = Flow(cfg, noise_seed=noise_seed)
    load_strict(flow, {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, str(weights))
    return flow.to(device).eval()



def build_flow_part(asset_dir: Path | None) -> Flow:
    """Registry builder: ``None`` -> the released full-size layout; else from ``asset_dir/flow.yaml``."""
    from .flow_config import FULL_SIZE

    return Flow(FULL_SIZE if asset_dir is None else read_flow_yaml(Path(asset_dir) / "flow.yaml"))


def write_tiny_flow(asset_dir: Path, seed: int) -> None:
    """Tiny ``flow.yaml`` (upstream form, TINY dims) and ``flow.pt`` (random fp32 weights)."""
    from ..checkpoint.tiny import randomize_
    from .flow_config import TINY, write_flow_yaml

    asset_dir = Path(asset_dir)
    write_flow_yaml(TINY, asset_dir / "flow.yaml")
    flow = randomize_(Flow(TINY), seed, prefix="flow.")
    torch.save({k: v.detach().float().contiguous() for k, v in flow.state_dict().items()}, asset_dir / "flow.pt")
