"""The duplex Talker: codec ids one unit at a time, the TTS KV cache living through a turn.

Upstream's ``MiniCPMTTS.generate_chunk`` as driven by ``DuplexCapability.streaming_generate``
(official MiniCPM-o 4.5 code; re-implemented here). Per unit the condition is the unit's
Talker tokens, ``emb_text(id) + L2norm(projector_semantic(hidden))`` per token (normalised
whatever the config says), then ``emb_text(audio_bos)``; a unit without tokens is the audio-bos
row alone. It is fed at positions ``text_start_pos ..`` on top of the turn's cache, and codes
are drawn one per step, each fed back before the next draw:

- at most ``max_new_codes`` (26) draws; the last draw (EOS, or the 26th code) is never fed or
  returned, so a full unit yields 25 codes, one second of audio;
- EOS (``num_audio_tokens - 1``) is masked for the first ``min_new_codes`` draws: 26 (never stop)
  except on the turn's first unit and on the unit that ends the turn (0);
- logits / temperature (0.8), then from the second draw on the repetition penalty (1.05) over the
  codes already drawn in this unit (at most the last 16): ``alpha = penalty ** count``, negative
  logits times alpha, others divided; no top-k/top-p; then a categorical draw.

After a unit ``text_start_pos`` grows by the condition and the returned codes (exactly the rows
in the cache); the unit that ends the turn resets the cache and the position to 0.

Two back-ends compute the same forward: the plain reference (transformers' ``LlamaModel`` on a
DynamicCache, default) and ``static=True``: the Talker engine's static KV cache (one row of
``max_len`` positions; a position attends the rows at or before it, so rows left by an earlier turn
are never seen), where a draw's one-code forward replays a CUDA graph on CUDA (``graphs``, default on
CUDA). Per draw the host reads one code either way (it decides whether to stop).
Draws use ``sampler.uniform`` (counter-based: seed, draw index, code id) so a session's codes
do not depend on anything else running in the process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError
from .engine import TalkerEngine, kv_bytes_per_token
from .model import MiniCPMTTS
from .sampler import MASK32, penalize, uniform


@dataclass(frozen=True)
class ChunkSampling:
    temperature: float = 0.8
    repetition_penalty: float = 1.05
    window: int = 16
    max_new_codes: int = 26      # draws per unit; the last is not returned

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise InputError(f"talker temperature must be > 0 (got {self.temperature})")
        if self.max_new_codes < 1 or self.window < 1:
            raise InputError("talker max_new_codes and window must be >= 1")


@dataclass(frozen=True)
class UnitCodes:
    codes: tuple[int, ...]       # returned codec ids (the last draw excluded)
    eos: bool                    # the last draw was EOS
    start_pos: int               # text_start_pos before this unit
    turn_start: bool
    turn_end: bool


class TalkerTurn:
    """One duplex conversation's Talker state (a single stream; see the module docstring for the
    two back-ends)."""

    def __init__(self, tts: MiniCPMTTS, sampling: ChunkSampling = ChunkSampling(), seed: int = 0,
                 static: bool = False, max_len: int = 4096, graphs: bool | None = None):
        self.tts, self.sampling = tts.eval(), sampling
        p = next(tts.parameters())
        self.device = p.device
        self.seed = torch.tensor([seed & MASK32], dtype=torch.long, device=self.device)
        self.draws = 0             # draws over the whole conversation: the RNG counter
        self.engine = None
        self._graph = None
        if static:
            self.engine = TalkerEngine(tts, 1, kv_bytes_per_token(tts, p.dtype) * max_len)
            self.max_len = self.engine.max_len
            self._code = torch.zeros(1, dtype=torch.long, device=self.device)
            self._pos = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            if graphs if graphs is not None else self.device.type == "cuda":
                self._capture()
        self.reset()

    def reset(self) -> None:
        """Forget the turn (upstream does this when a turn ends or is interrupted)."""
        self.cache = None
        self.text_start_pos = 0

    def condition(self, text_ids, hidden: torch.Tensor) -> torch.Tensor:
        """[n + 1, H]: the unit's token rows, then the audio-bos row."""
        tts = self.tts
        bos = tts.emb_text(torch.tensor([tts.cfg.audio_bos_token_id], device=self.device))
        if len(text_ids) == 0:
            return bos
        ids = torch.as_tensor(list(text_ids), dtype=torch.long, device=self.device)
        if hidden.shape[0] != ids.shape[0]:
            raise InputError(f"talker unit: {ids.shape[0]} text ids but {hidden.shape[0]} hidden rows")
        proj = F.normalize(tts.projector_semantic(hidden.to(self.device, tts.emb_text.weight.dtype)), p=2, dim=-1)
        return torch.cat([tts.emb_text(ids) + proj, bos])

    @torch.no_grad()
    def _forward(self, rows: torch.Tensor, start: int) -> torch.Tensor:
        pos = torch.arange(start, start + rows.shape[0], device=self.device)[None]
        if self.engine is None:
            hidden, self.cache = self.tts.forward_reference(rows[None], pos, self.cache)
            return self.tts.logits(hidden[0, -1])
        if start + rows.shape[0] > self.max_len:
            raise InputError(f"talker turn: {start + rows.shape[0]} positions exceed the static cache's {self.max_len}; "
                             "build TalkerTurn with a larger max_len")
        hidden = self.engine._layers(rows[None], pos, slice(0, 1), self.max_len, pos)
        return self.tts.logits(hidden[0, -1])

    @torch.no_grad()
    def _code_step(self) -> torch.Tensor:
        """Feed ``self._code`` at ``self._pos`` on the static cache; the next draw's logits."""
        x = self.tts.embed_codes(self._code)[None]
        hidden = self.engine._layers(x, self._pos, slice(0, 1), self.max_len, self._pos)
        return self.tts.logits(hidden[0, -1])

    def _capture(self) -> None:
        """One graph of ``_code_step`` (its static inputs are ``_code`` and ``_pos``). Captured before
        any turn: the warm-up writes land at position 0, which a turn's condition overwrites first."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._code_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._logits = self._code_step()
        self._graph = graph

    def _feed_code(self, code: int, position: int) -> torch.Tensor:
        if self.engine is None:
            return self._forward(self.tts.embed_codes(torch.tensor([code], device=self.device)), position)
        if position >= self.max_len:
            raise InputError(f"talker turn: position {position} is past the static cache's {self.max_len}; "
                             "build TalkerTurn with a larger max_len")
        self._code.fill_(code)
        self._pos.fill_(position)
        if self._graph is None:
            return self._code_step()
        self._graph.replay()
        return self._logits

    def draw(self, logits: torch.Tensor, codes: list[int], mask_eos: bool) -> int:
        """One code from [V] logits: temperature, the penalty over ``codes`` (this unit's draws so
        far, when there are any), EOS masked if asked, then a categorical draw (Gumbel-max over the
        counter-based uniforms of draw number ``self.draws``)."""
        s = self.sampling
        x = (logits.float() / s.temperature)[None]
        if codes and s.repetition_penalty != 1.0:
            hist = torch.tensor(codes[-s.window:], dtype=torch.long, device=x.device)[None]
            x = penalize(x, hist, s.repetition_penalty)
        if mask_eos:
            x[0, self.tts.eos_code] = float("-inf")
        u = uniform(self.seed, torch.tensor([self.draws], device=x.device), x.shape[-1])
        self.draws += 1
        return int(torch.argmax(x.double() - torch.log(-torch.log(u))))

    @torch.no_grad()
    def generate_unit(self, text_ids, hidden: torch.Tensor, turn_end: bool) -> UnitCodes:
        s, tts = self.sampling, self.tts
        eos = tts.eos_code
        turn_start = self.text_start_pos == 0
        min_new = 0 if (turn_start or turn_end) else s.max_new_codes
        cond = self.condition(text_ids, hidden)
        start = self.text_start_pos
        logits = self._forward(cond, start)
        codes: list[int] = []
        drew_eos = False
        for t in range(s.max_new_codes):
            if t > 0:   # feed the previous draw, then draw again
                logits = self._feed_code(codes[-1], start + cond.shape[0] + t - 1)
            code = self.draw(logits, codes, mask_eos=t < min_new)
            if code == eos:
                drew_eos = True
                break
            if t == s.max_new_codes - 1:
                break      # the last draw is not returned (and was never fed)
            codes.append(code)
        out = UnitCodes(tuple(codes), drew_eos, start, turn_start, turn_end)
        if turn_end:
            self.reset()
        else:
            self.text_start_pos = start + cond.shape[0] + len(codes)
        return out
