"""Turn-mode text generation with the per-token hidden state the Talker conditions on.

Mirrors upstream ``ChunkPrefillChunkGenerate.chunk_generate`` as driven by
``MiniCPMO.streaming_generate``: every sampled token is fed back one at a time and the
final-norm hidden state *at that token's own position* is recorded; a terminator is
sampled but never fed, so it has no row. The caller prefills the prompt (ending with the
assistant bos ``...<|tts_bos|>``) and passes the cache plus the logits at its last position.

Sampling per step, in upstream's order: float32 logits -> forbidden ids to -inf (when
speaking) -> repetition penalty over the ids generated so far (previous chunks' last 128 plus
the current chunk) -> length penalty on the terminators -> temperature -> top-k -> top-p ->
multinomial (or argmax when greedy; the multinomial is drawn as PyTorch draws one sample, without its
waiting validity check: ``exponential_noise``). Chunks are 11 samples for the first and 10 after, which
only matters for the repetition window.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from ..errors import InputError
from .llm import cache_kwarg
from .prompt import TURN_TERMINATORS

TERMINATORS = TURN_TERMINATORS  # <|tts_eos|> 151704, <|im_end|> 151645, </s> 128247

# Upstream suppresses these strings through convert_tokens_to_ids; only the ASCII ones are
# vocabulary entries, every other one resolves to the <unk> id, which is what gets masked.
FORBIDDEN_STRINGS = (":", "：", "；", "#", "“", "”", "‘", "’", "@", "*", "【", "】", "「", "」",
                     "(", ")", "（", "）", "[", "]", "&", "/", "$")


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.7
    top_k: int = 100
    top_p: float = 0.8
    repetition_penalty: float = 1.02
    repetition_window: int = 128
    length_penalty: float = 1.0
    greedy: bool = False
    max_new_tokens: int = 256      # tokens with a hidden row (fed tokens)
    chunk_size: int = 10

    def __post_init__(self) -> None:
        if self.temperature <= 0 and not self.greedy:
            raise InputError(f"temperature must be > 0 (got {self.temperature}); use greedy=True for argmax")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")


@dataclass
class TurnGeneration:
    """Generated text tokens and their final-norm hidden rows (row i belongs to token_ids[i])."""

    token_ids: list[int]
    text: str
    hidden: torch.Tensor                   # [n, H] float32 on CPU
    terminator: int | None                 # the id that stopped generation; None = length limit
    past_key_values: object = field(repr=False, default=None)   # cache holding prompt + token_ids

    @property
    def finished(self) -> bool:
        return self.terminator is not None


@dataclass(frozen=True)
class GenerationChunk:
    """Up to ``chunk_size`` consecutive fed tokens with their hidden rows (what the Talker eats)."""

    token_ids: list[int]
    hidden: torch.Tensor                   # [n, H] in the model's dtype, on its device
    finished: bool
    terminator: int | None = None


def forbidden_token_ids(tokenizer) -> list[int]:
    """Ids masked while speaking: upstream's punctuation list (as resolved by its tokenizer) + bad_token_ids."""
    unk = tokenizer.special.unk
    ids = [tokenizer.token_to_id(s) for s in FORBIDDEN_STRINGS]
    ids = [unk if i is None else i for i in ids]
    return sorted(set(ids) | set(getattr(tokenizer, "bad_token_ids", ())))


def _penalize(logits: torch.Tensor, ids: torch.Tensor, penalty: float) -> None:
    """Upstream's repetition-style penalty on columns ``ids`` (distinct) of every row, in place."""
    if penalty == 1.0 or ids.numel() == 0:
        return
    vals = logits.index_select(1, ids)
    logits.index_copy_(1, ids, torch.where(vals > 0, vals / penalty, vals * penalty))


def edit_rows(logits: torch.Tensor, rows: Sequence[Sequence[int]], fn) -> None:
    """``logits[i, rows[i]] = fn(logits[i, rows[i]])`` for every row i (distinct ids per row), in place, in one
    gather/scatter. Short rows are padded with their own first id (a repeated index writes the same value)
    and empty rows with id 0, written back unchanged. The index goes up from pageable memory, which syncs the
    stream first: its callers (the decode policies) have just read these logits on the host, so nothing is queued."""
    width = max((len(r) for r in rows), default=0)
    if width == 0:
        return
    idx = torch.tensor([list(r) + [r[0] if r else 0] * (width - len(r)) for r in rows], dtype=torch.long)
    idx = idx.to(logits.device, non_blocking=True)
    vals = logits.gather(1, idx)
    new = fn(vals)
    if not all(rows):
        live = torch.tensor([bool(r) for r in rows])[:, None].to(logits.device, non_blocking=True)
        new = torch.where(live, new, vals)
    logits.scatter_(1, idx, new)


def _penalize_rows(logits: torch.Tensor, rows: Sequence[Sequence[int]], penalty: float) -> None:
    """``_penalize`` with each row's own distinct ids (``edit_rows``)."""
    if penalty != 1.0:
        edit_rows(logits, rows, lambda vals: torch.where(vals > 0, vals / penalty, vals * penalty))


def process_logits(logits: torch.Tensor, history: torch.Tensor, cfg: SamplingConfig, terminators: torch.Tensor,
                   forbidden: torch.Tensor | None) -> torch.Tensor:
    """Upstream's logits pipeline on [1, V] float32 (modified in place); returns the logits that
    are argmax-ed (greedy) or soft-maxed and sampled."""
    if forbidden is not None and forbidden.numel():
        logits.index_fill_(1, forbidden, float("-inf"))    # (an indexed assignment of a number may wait)
    _penalize(logits, torch.unique(history), cfg.repetition_penalty)
    _penalize(logits, terminators, cfg.length_penalty)
    return _warp(logits, cfg)


def process_logits_rows(logits: torch.Tensor, histories: Sequence[Sequence[int]], cfg: SamplingConfig,
                        terminators: torch.Tensor, forbidden: torch.Tensor | None) -> torch.Tensor:
    """``process_logits`` on every row of [n, V] float32 at once, row i penalised over ``histories[i]``
    (distinct ids). Every operation is row-wise, so each row comes out as ``process_logits`` gives it alone."""
    if forbidden is not None and forbidden.numel():
        logits.index_fill_(1, forbidden, float("-inf"))    # (an indexed assignment of a number may wait)
    _penalize_rows(logits, histories, cfg.repetition_penalty)
    _penalize(logits, terminators, cfg.length_penalty)
    return _warp(logits, cfg)


def _warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k, top-p on [n, V] (row-wise), as upstream orders them; greedy skips them."""
    if cfg.greedy:
        return logits
    if cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    if cfg.top_k > 0:
        # Sorting only the k survivors equals upstream's full-vocabulary sort (the rest are -inf).
        vals, idx = torch.topk(logits, min(cfg.top_k, logits.shape[-1]))   # descending
        if cfg.top_p < 1.0:
            vals = vals.masked_fill(_top_p_drop(vals, cfg.top_p), float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter_(1, idx, vals)
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        drop = _top_p_drop(sorted_logits, cfg.top_p)
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def _top_p_drop(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask (in sorted order) of tokens past the nucleus; the token crossing ``top_p`` is kept."""
    cum = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    drop = cum > top_p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    return drop


def sample_next(logits: torch.Tensor, history: torch.Tensor, cfg: SamplingConfig, terminators: torch.Tensor,
                forbidden: torch.Tensor | None, generator: torch.Generator | None) -> int:
    """One upstream sampling step on ``logits`` [1, V] (float32, modified in place)."""
    logits = process_logits(logits, history, cfg, terminators, forbidden)
    if cfg.greedy:
        return int(torch.argmax(logits, dim=-1))
    probs = F.softmax(logits, dim=-1)
    return int(torch.argmax(probs / exponential_noise(probs, [generator]), dim=-1))


def exponential_noise(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise shaped like ``probs`` [n, V], row i drawn from ``generators[i]``: ``argmax(probs / noise)``
    is the token ``torch.multinomial(probs[i:i+1], 1, generator=generators[i])`` draws. That is PyTorch's own
    one-sample path (the Gumbel-max trick in exponential form), but multinomial first checks the probabilities
    with a read-back that waits on the device, once per row and step; the draw here never waits.
    ``test_generate`` holds the two equal, so a PyTorch that changes its sampler fails there, not silently."""
    noise = torch.empty_like(probs)
    for i, g in enumerate(generators):
        noise[i:i + 1].exponential_(1, generator=g)
    return noise


class DynamicStepper:
    """Plain path: feed one token through transformers' Qwen3 on a growing DynamicCache."""

    def __init__(self, llm, past_key_values):
        self.llm, self.cache = llm, past_key_values
        self.kwarg = cache_kwarg(type(llm.model))

    def __call__(self, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(final-norm hidden [1,H], logits [1,V] float32) at the token's own (next) position."""
        model = self.llm.model
        emb = model.embed_tokens(torch.tensor([[token]], device=model.embed_tokens.weight.device))
        out = model(inputs_embeds=emb, use_cache=True, **{self.kwarg: self.cache})
        h = out.last_hidden_state[:, -1]
        return h, self.llm.lm_head(h).float()


class StaticStepper:
    """Fast path beside the plain one: ``decode.StaticDecoder`` (preallocated KV, packed weights),
    optionally through its per-span CUDA graphs. Attention spans are bucketed so that a graph is
    captured once per ``bucket`` positions; rows past the current position are masked."""

    def __init__(self, decoder, position: int, use_graph: bool = False, bucket: int = 256):
        if position >= decoder.max_len:
            raise InputError(f"static decoder holds {decoder.max_len} positions; the prompt already fills {position}")
        self.decoder, self.position, self.use_graph, self.bucket = decoder, int(position), use_graph, bucket

    def __call__(self, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        dec = self.decoder
        if self.position >= dec.max_len:
            raise InputError(f"static decoder of {dec.max_len} positions is full; build it with a larger max_len")
        kv_len = min(dec.max_len, -(-(self.position + 1) // self.bucket) * self.bucket)
        tok = torch.tensor([token], device=dec.device)
        pos = torch.tensor([self.position], device=dec.device)
        run = dec.decode_graph if self.use_graph else dec.decode
        logits, h = run(tok, pos, kv_len)
        self.position += 1
        if self.use_graph:  # graph outputs are static buffers that the next replay overwrites
            logits, h = logits.clone(), h.clone()
        return h, logits


def load_dynamic_cache(decoder, cache) -> int:
    """Copy a transformers DynamicCache (batch 1) into ``decoder``'s static KV; returns its length."""
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]
    if len(layers) != decoder.k_cache.shape[0]:
        raise InputError(f"cache has {len(layers)} filled layers, the decoder {decoder.k_cache.shape[0]}")
    n = int(layers[0].keys.shape[-2])
    if n > decoder.max_len:
        raise InputError(f"cache holds {n} positions, the static decoder only {decoder.max_len}")
    with torch.no_grad():
        for li, layer in enumerate(layers):
            decoder.k_cache[li, :, :, :n] = layer.keys.to(decoder.dtype)
            decoder.v_cache[li, :, :, :n] = layer.values.to(decoder.dtype)
    return n


class Generation:
    """``iter_generate``'s state for one sequence, for callers that feed the tokens themselves (several
    sequences decoded in one batched forward): ``draw`` the next token, feed it however, hand the result
    to ``feed``. ``draw`` returns the last chunk instead of a token when a terminator is drawn; ``feed``
    returns a chunk when one is complete (``finished`` at ``max_new_tokens``), else None."""

    def __init__(self, llm, last_logits: torch.Tensor, sampling: SamplingConfig = SamplingConfig(), *,
                 terminators: Sequence[int] = TERMINATORS, forbidden_ids: Sequence[int] | None = None,
                 generator: torch.Generator | None = None):
        if last_logits.dim() == 1:
            last_logits = last_logits[None]
        if last_logits.dim() != 2 or last_logits.shape[0] != 1:
            raise InputError(f"last_logits: expected [V] or [1, V] for one sequence, got {list(last_logits.shape)}")
        device = last_logits.device
        self.llm, self.sampling, self.generator = llm, sampling, generator
        self.term = torch.tensor(sorted(set(terminators)), dtype=torch.long, device=device)
        self.term_set = set(int(t) for t in terminators)
        # what draw_many groups rows by: the settings the logits pipeline reads (not the per-row limits)
        self.group = (replace(sampling, max_new_tokens=1, repetition_window=0, chunk_size=1),
                      tuple(sorted(self.term_set)), None if forbidden_ids is None else tuple(forbidden_ids), device)
        self.forb = None if forbidden_ids is None else torch.tensor(list(forbidden_ids), dtype=torch.long,
                                                                      device=device)
        self.sampled: list[int] = []          # every non-terminator sample, in order
        self.chunk_ids: list[int] = []
        self.chunk_h: list[torch.Tensor] = []
        self.logits = last_logits.float().clone()
        self.fed = 0
        self.draws = 0
        self.done = False

    def history(self) -> list[int]:
        """The ids the next draw's repetition penalty covers: previous chunks' last ``repetition_window``
        samples + this chunk's (chunk 0 holds 11 samples)."""
        cfg = self.sampling
        chunk = max(0, (self.draws - 1) // cfg.chunk_size)
        chunk_start = 0 if chunk == 0 else 1 + chunk * cfg.chunk_size
        prev = self.sampled[:chunk_start][-cfg.repetition_window:] if cfg.repetition_window else []
        return prev + self.sampled[chunk_start:]

    @torch.no_grad()
    def draw(self) -> "int | GenerationChunk":
        if self.done:
            raise InputError("generation: draw() after the last chunk")
        history = torch.tensor(self.history(), dtype=torch.long, device=self.logits.device)
        return self.accept(sample_next(self.logits, history, self.sampling, self.term, self.forb, self.generator))

    def accept(self, tok: int) -> "int | GenerationChunk":
        """Record a token drawn from ``self.logits`` (``draw`` or ``draw_many``): the token to feed, or the
        last chunk when it is a terminator."""
        self.draws += 1
        if tok in self.term_set:
            self.done = True
            return GenerationChunk(self.chunk_ids, _stack(self.chunk_h, self.llm), True, tok)
        self.sampled.append(tok)
        return tok

    def feed(self, tok: int, hidden: torch.Tensor, logits: torch.Tensor) -> "GenerationChunk | None":
        """``tok`` (the last ``draw``) was fed: its final-norm hidden [1, H] and the next logits [1, V]."""
        self.logits = logits
        self.fed += 1
        self.chunk_ids.append(tok)
        self.chunk_h.append(hidden)
        if self.fed >= self.sampling.max_new_tokens:
            self.done = True
            return GenerationChunk(self.chunk_ids, _stack(self.chunk_h, self.llm), True, None)
        if len(self.chunk_ids) == self.sampling.chunk_size:
            out = GenerationChunk(self.chunk_ids, _stack(self.chunk_h, self.llm), False, None)
            self.chunk_ids, self.chunk_h = [], []
            return out
        return None


@torch.no_grad()
def draw_many(gens: Sequence[Generation]) -> list["int | GenerationChunk"]:
    """``Generation.draw`` for several sequences at once, with what ``draw`` would give each alone: the
    logits pipeline runs once on the stacked rows of each group of equal settings, every row's sample
    draws from its own generator (the same random stream as ``draw``), and the tokens reach the host in one
    transfer. ``draw`` waits on the device three times per sequence (its history upload, ``unique``, the
    token), which at 16 rows a step cost more than the batched decode step itself."""
    for g in gens:
        if g.done:
            raise InputError("generation: draw_many() with a generation past its last chunk")
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(gens):
        groups.setdefault(g.group, []).append(i)
    order: list[int] = []
    picked: list[torch.Tensor] = []
    for idx in groups.values():
        first = gens[idx[0]]
        cfg = first.sampling
        logits = torch.cat([gens[i].logits for i in idx])      # a copy: the pipeline edits it in place
        logits = process_logits_rows(logits, [sorted(set(gens[i].history())) for i in idx], cfg, first.term,
                                     first.forb)
        if not cfg.greedy:
            probs = F.softmax(logits, dim=-1)
            logits = probs / exponential_noise(probs, [gens[i].generator for i in idx])
        picked.append(torch.argmax(logits, dim=-1))
        order += idx
    toks = torch.cat(picked).tolist() if picked else []
    out: list = [None] * len(gens)
    for i, tok in zip(order, toks):
        out[i] = gens[i].accept(int(tok))
    return out


@torch.no_grad()
def iter_generate(llm, past_key_values, last_logits: torch.Tensor, sampling: SamplingConfig = SamplingConfig(),
                  *, terminators: Sequence[int] = TERMINATORS, forbidden_ids: Sequence[int] | None = None,
                  generator: torch.Generator | None = None, stepper=None) -> Iterator[GenerationChunk]:
    """Yield ``GenerationChunk``s of ``sampling.chunk_size`` fed tokens as they are produced.

    ``llm``: a Qwen3ForCausalLM (``build_llm``); ``past_key_values``: its cache after the prompt
    (mutated in place); ``last_logits``: [V] or [1, V] logits at the prompt's last position.
    ``forbidden_ids``: pass ``forbidden_token_ids(tokenizer)`` when speaking (upstream masks them
    only with audio on). ``generator`` drives multinomial (seeded -> reproducible).
    ``stepper``: how a token is fed (default ``DynamicStepper(llm, past_key_values)``; pass a
    ``StaticStepper`` for the static-KV / CUDA-graph path, with ``past_key_values`` None).
    """
    gen = Generation(llm, last_logits, sampling, terminators=terminators, forbidden_ids=forbidden_ids,
                     generator=generator)
    step = stepper if stepper is not None else DynamicStepper(llm, past_key_values)
    while True:
        tok = gen.draw()
        if isinstance(tok, GenerationChunk):
            yield tok
            return
        chunk = gen.feed(tok, *step(tok))
        if chunk is not None:
            yield chunk
            if gen.done:
                return


def _stack(rows: list[torch.Tensor], llm) -> torch.Tensor:
    if rows:
        return torch.cat(rows, dim=0)
    w = llm.model.norm.weight
    return w.new_zeros(0, w.shape[0])


def generate(llm, past_key_values, last_logits: torch.Tensor, sampling: SamplingConfig = SamplingConfig(),
             *, tokenizer=None, terminators: Sequence[int] = TERMINATORS, forbidden_ids: Sequence[int] | None = None,
             generator: torch.Generator | None = None, seed: int | None = None, stepper=None) -> TurnGeneration:
    """Run ``iter_generate`` to the end and collect a ``TurnGeneration`` (text needs ``tokenizer``).

    ``seed`` makes a fresh generator on the logits' device when ``generator`` is not given.
    """
    if generator is None and seed is not None:
        generator = torch.Generator(device=last_logits.device).manual_seed(int(seed))
    ids: list[int] = []
    rows: list[torch.Tensor] = []
    terminator = None
    for chunk in iter_generate(llm, past_key_values, last_logits, sampling, terminators=terminators,
                               forbidden_ids=forbidden_ids, generator=generator, stepper=stepper):
        ids += chunk.token_ids
        rows.append(chunk.hidden)
        terminator = chunk.terminator
    hidden = torch.cat(rows, 0).float().cpu()
    text = tokenizer.decode(ids) if tokenizer is not None else ""
    return TurnGeneration(ids, text, hidden, terminator, past_key_values)
