"""Duplex generation inside one unit: upstream's ``StreamDecoder.decode`` policy and the
per-unit loop of ``DuplexCapability.streaming_generate`` (official MiniCPM-o 4.5 code,
``MiniCPMO45/utils.py`` and ``modeling_minicpmo_unified.py``; re-implemented here).

After a unit's prefill (``StreamingSession.commit``) the logits at its last position decide
what the model does during the next second. Per step ``j`` of at most ``max_steps`` (20):

- at ``j == max_steps - 1`` a ``<|chunk_eos|>`` is taken without decoding;
- a forced-listen unit takes ``<|listen|>``; otherwise ``DuplexDecoder.decode`` picks a token,
  and ``<|listen|>`` while the model's turn is still open becomes ``<|tts_bos|>``;
- a unit terminator (``<|listen|>``, ``<|chunk_eos|>``, ``<|chunk_tts_eos|>``) ends the loop
  unfed: it is fed with ``</unit>`` before the next unit (``StreamingSession.end_unit``);
- any other token opens (or continues) the turn. From ``j = 1`` on, a token whose unit text
  (special tokens skipped) would reach ``max_unit_chars`` (28) characters is dropped unfed
  and the unit ends with ``<|chunk_eos|>``;
- the token is fed; from ``j = 1`` on it and its final-norm hidden row go to the Talker;
  ``<|turn_eos|>`` (fed) closes the turn.

The decode policy: a first draw on the raw logits (argmax, or a sample of their softmax)
returns ``<|chunk_eos|>`` at once if it lands there. Otherwise the forbidden ids
(``<|tts_pad|>``, the tokenizer's ``bad_token_ids`` and ``<|chunk_eos|>``) go to -inf; every
id decoded in this session (not only fed ones) within the last ``repetition_window`` (512)
has its logit divided by the penalty (1.05) whatever its sign; ``<|turn_eos|>``'s logit is
divided by ``length_penalty`` (1.1) when positive, multiplied when not; then argmax, or
temperature 0.7 -> top-k 20 -> top-p 0.8 -> a sample. Upstream's ``listen_prob_scale`` and
``listen_top_k`` act on the tokenizer's eos token (``<|im_end|>``), not on ``<|listen|>``; both
are kept, with upstream's defaults (off), and with that same target.

Sampling draws from the same distributions as upstream's ``torch.multinomial`` over the whole
vocabulary, but not the same random stream: the raw draw is a Bernoulli at ``<|chunk_eos|>``'s
probability and the final draw runs over the nucleus's ids only (a seed reproduces our draws, never
upstream's; its parity fixtures are greedy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import InputError
from .generate import _top_p_drop, edit_rows


@dataclass(frozen=True)
class DuplexDecodeConfig:
    mode: str = "sampling"          # "sampling" (streaming_generate's default) or "greedy"
    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    repetition_penalty: float = 1.05
    repetition_window: int = 512
    length_penalty: float = 1.1     # on <|turn_eos|>: > 1 makes turns longer
    listen_prob_scale: float = 1.0  # upstream applies it to the tokenizer's eos token (see module docstring)
    listen_top_k: int | None = None
    max_steps: int = 20             # per unit; the last one is a forced <|chunk_eos|>
    max_unit_chars: int = 28
    force_listen_units: int = 0     # the first N units listen without decoding

    def __post_init__(self) -> None:
        if self.mode not in ("sampling", "greedy"):
            raise InputError(f"duplex decode mode {self.mode!r}: choose 'sampling' or 'greedy'")
        if self.mode == "sampling" and not self.temperature > 0:
            raise InputError(f"duplex temperature must be > 0 (got {self.temperature}); use mode='greedy' for argmax")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise InputError(f"duplex top_p must be in (0, 1] and top_k >= 0 (got {self.top_p}, {self.top_k})")
        if self.max_steps < 1 or self.max_unit_chars < 1 or self.repetition_window < 1:
            raise InputError("duplex max_steps, max_unit_chars and repetition_window must be >= 1")
        if self.force_listen_units < 0:
            raise InputError(f"duplex force_listen_units must be >= 0 (got {self.force_listen_units})")


def nucleus(logits: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[V] -> (ids, values) that top-k then top-p keep, by descending value: the top ``top_k`` (0 = all;
    ties with the k-th value are kept too), then the smallest prefix whose probability passes ``top_p``
    (the token that crosses it is kept). With a top-k only those few values are sorted: sorting the whole
    vocabulary took ~12 ms per draw on one CPU thread, per conversation and step."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        ids = torch.nonzero(logits >= kth).view(-1)
        vals, order = torch.sort(logits[ids], descending=True)
        ids = ids[order]
    else:
        vals, ids = torch.sort(logits, descending=True)
    if top_p > 0.0:
        keep = ~_top_p_drop(vals, top_p)
        ids, vals = ids[keep], vals[keep]
    return ids, vals


def top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[V] -> [V]: ``nucleus``'s ids keep their logits, every other id is -inf."""
    ids, vals = nucleus(logits, top_k, top_p)
    out = torch.full_like(logits, float("-inf"))
    out[ids] = vals
    return out


class DuplexDecoder:
    """The decode policy and its history (upstream keeps one per session, reset at prepare)."""

    def __init__(self, tokenizer, config: DuplexDecodeConfig = DuplexDecodeConfig(),
                 generator: torch.Generator | None = None):
        sp = tokenizer.special
        self.config, self.generator = config, generator
        self.chunk_eos, self.turn_eos = sp.chunk_eos, sp.turn_eos
        # an index tensor made once: the bad ids alone are ~7000
        self.forbidden = torch.tensor(sorted({sp.tts_pad, *getattr(tokenizer, "bad_token_ids", ()), sp.chunk_eos}))
        # decoders of one tokenizer share decode_many's passes: their forbidden ids compare by this key
        self.forbidden_key = (len(self.forbidden), hash(tuple(self.forbidden.tolist())))
        eos = tokenizer.token_to_id(getattr(tokenizer, "eos_token", "<|im_end|>"))
        self.listen_rule_id = sp.im_end if eos is None else eos
        self.history: list[int] = []   # every id decode() returned past its first draw

    def _raw_draw_is(self, logits: torch.Tensor, token: int) -> bool:
        """Does the first draw, on the raw logits, land on ``token``? Greedy: is it the argmax. Sampling:
        a Bernoulli draw at its softmax probability, the odds of a draw over the whole vocabulary
        without a multinomial over 151k ids (~5 ms on one CPU thread)."""
        if self.config.mode == "greedy":
            return int(torch.argmax(logits)) == token
        p = torch.exp(logits[token] - torch.logsumexp(logits, 0))
        return bool(torch.rand((), generator=self.generator) < p)

    def _sample(self, scaled: torch.Tensor) -> int:
        """The final draw, over the ids the nucleus keeps (their softmax)."""
        ids, vals = nucleus(scaled, self.config.top_k, self.config.top_p)
        return int(ids[torch.multinomial(F.softmax(vals, dim=-1), 1, generator=self.generator)])

    @torch.no_grad()
    def decode(self, logits: torch.Tensor) -> int:
        """One token from [V] logits (see the module docstring for the order of the rules)."""
        cfg = self.config
        logits = logits.detach().float().reshape(-1).cpu()
        if self._raw_draw_is(logits, self.chunk_eos):
            return self.chunk_eos
        logits = logits.clone()
        logits[self.forbidden] = float("-inf")
        if cfg.repetition_penalty != 1.0 and self.history:
            recent = torch.tensor(sorted(set(self.history[-cfg.repetition_window:])), dtype=torch.long)
            recent = recent[recent < logits.numel()]
            factor = cfg.repetition_penalty if cfg.repetition_penalty > 1.0 else 1.0 / cfg.repetition_penalty
            logits[recent] = logits[recent] / factor if cfg.repetition_penalty > 1.0 else logits[recent] * factor
        if cfg.length_penalty != 1.0:
            v = logits[self.turn_eos]
            logits[self.turn_eos] = v / cfg.length_penalty if v > 0 else v * cfg.length_penalty
        rule = self.listen_rule_id
        if cfg.listen_prob_scale != 1.0:
            logits[rule] = logits[rule] * cfg.listen_prob_scale
        if cfg.listen_top_k is not None and int((logits > logits[rule]).sum()) < cfg.listen_top_k:
            return rule   # upstream returns without recording it in the history
        if cfg.mode == "greedy":
            token = int(torch.argmax(logits))
        else:
            token = self._sample(logits / cfg.temperature)
        self.history.append(token)
        return token


@dataclass(frozen=True)
class DecodeRequest:
    """What ``unit_steps`` yields when it needs the decode policy's token: send back
    ``DuplexDecoder.decode(logits)`` (or ``decode_many``'s token for these logits)."""

    logits: torch.Tensor


def _recent_ids(d: DuplexDecoder, V: int) -> list[int]:
    """The ids ``d.decode`` penalises next (its recent history, distinct, ascending, inside the vocabulary)."""
    cfg = d.config
    if cfg.repetition_penalty == 1.0 or not d.history:
        return []
    return [t for t in sorted(set(d.history[-cfg.repetition_window:])) if t < V]


def policy_groups(decoders: Sequence[DuplexDecoder]) -> list[list[int]]:
    """The decoders' indices grouped by the settings ``decode_many`` runs in one pass: config, special ids and
    forbidden ids (equal ones, not only the same tensor: each conversation's decoder builds its own)."""
    groups: dict[tuple, list[int]] = {}
    for i, d in enumerate(decoders):
        key = (d.config, d.chunk_eos, d.turn_eos, d.listen_rule_id, d.forbidden_key)
        idx = groups.setdefault(key, [])
        if idx and not torch.equal(decoders[idx[0]].forbidden, d.forbidden):
            idx = groups.setdefault(key + (i,), [])     # a hash collision: a group of its own
        idx.append(i)
    return list(groups.values())


@torch.no_grad()
def decode_many(decoders: Sequence[DuplexDecoder], logits: Sequence[torch.Tensor]) -> list[int]:
    """``[d.decode(l) for d, l in zip(decoders, logits)]``, in that order, with the same histories and the same
    draws from each decoder's generator; but every pass over the vocabulary (raw draw, forbidden ids,
    penalties, the listen rule, argmax or top-k) runs once for all rows on the logits' device, and only
    tokens, probabilities and the top-k's survivors reach the host. ``decode`` copies each row to the host
    and makes ~6 passes over its 151k logits there: at 16 conversations that was ~100 ms of every second
    (``duplex_batch_bench --cprofile``).

    On the CPU it computes what ``decode`` computes, bit for bit (``test_duplex_decode``). On a GPU every
    operation is the same IEEE one (divisions by device tensors, which CUDA does not turn into a multiply by
    the reciprocal, as it does for a host scalar), except the raw draw's log-sum-exp in sampling mode: the
    device sums in its own order, so that probability may differ from the host's in its last bits.
    ``top_k=0`` (a sort of the whole vocabulary, whose ties a GPU orders its own way) runs ``decode`` per row."""
    out: list[int | None] = [None] * len(decoders)
    for idx in policy_groups(decoders):
        d0 = decoders[idx[0]]
        cfg = d0.config
        if cfg.mode == "sampling" and cfg.top_k == 0:
            for i in idx:
                out[i] = decoders[i].decode(logits[i])
            continue
        dev = logits[idx[0]].device
        L = torch.stack([logits[i].detach().float().reshape(-1).to(dev) for i in idx])     # [n, V]
        n, V = L.shape
        scalar = lambda x: torch.tensor(x, dtype=torch.float32, device=dev)    # noqa: E731  (true division)
        if cfg.mode == "greedy":
            raw = torch.argmax(L, dim=1).tolist()
        else:   # one log-sum-exp per row, as decode takes it over its 1-D row
            lse = torch.stack([torch.logsumexp(L[r], 0) for r in range(n)])
            raw = torch.exp(L[:, d0.chunk_eos] - lse).cpu()
        M = L.clone()
        M.index_fill_(1, d0.forbidden.to(dev), float("-inf"))
        pen = cfg.repetition_penalty
        edit_rows(M, [_recent_ids(decoders[i], V) for i in idx],
                  (lambda vals: vals / scalar(pen)) if pen > 1.0 else (lambda vals: vals * (1.0 / pen)))
        if cfg.length_penalty != 1.0:
            v = M[:, d0.turn_eos]
            M[:, d0.turn_eos] = torch.where(v > 0, v / scalar(cfg.length_penalty), v * cfg.length_penalty)
        rule = d0.listen_rule_id
        if cfg.listen_prob_scale != 1.0:
            M[:, rule] = M[:, rule] * cfg.listen_prob_scale
        listen = ((M > M[:, rule:rule + 1]).sum(1) < cfg.listen_top_k).tolist() if cfg.listen_top_k is not None \
            else [False] * n
        if cfg.mode == "greedy":
            final = torch.argmax(M, dim=1).tolist()
        else:   # the top-k's survivors (ties with the k-th value included), each row's ids ascending as decode's
            S = M / scalar(cfg.temperature)
            kth = torch.topk(S, min(cfg.top_k, V), dim=1).values[:, -1:]
            keep = S >= kth
            where = torch.nonzero(keep).cpu()
            kept = S[keep].cpu()
            counts = keep.sum(1).tolist()
            bounds = [0]
            for c in counts:
                bounds.append(bounds[-1] + c)
        for r, i in enumerate(idx):
            d = decoders[i]
            if cfg.mode == "greedy":
                hit = raw[r] == d.chunk_eos
            else:
                hit = bool(torch.rand((), generator=d.generator) < raw[r])
            if hit:
                out[i] = d.chunk_eos
                continue
            if listen[r]:
                out[i] = rule     # upstream returns without recording it in the history
                continue
            if cfg.mode == "greedy":
                token = int(final[r])
            else:
                ids, vals = where[bounds[r]:bounds[r + 1], 1], kept[bounds[r]:bounds[r + 1]]
                vals, order = torch.sort(vals, descending=True)
                ids = ids[order]
                if cfg.top_p > 0.0:
                    k = ~_top_p_drop(vals, cfg.top_p)
                    ids, vals = ids[k], vals[k]
                token = int(ids[torch.multinomial(F.softmax(vals, dim=-1), 1, generator=d.generator)])
            d.history.append(token)
            out[i] = token
    return out


@dataclass(frozen=True)
class UnitGeneration:
    """What the model did during one unit."""

    decoded: tuple[int, ...]            # upstream's total_ids of the unit: each step's id and the terminator
                                        # (a token dropped by the character limit is not in it)
    fed: tuple[int, ...]                # ids fed to the LLM (step 0's included)
    talker_ids: tuple[int, ...]         # fed ids from step 1 on: the Talker's text tokens
    talker_hidden: torch.Tensor         # [len(talker_ids), H] their final-norm hidden rows (float32, CPU)
    terminator: int                     # fed with </unit> before the next unit
    listen: bool                        # the unit ended with <|listen|>
    turn_end: bool                      # <|turn_eos|> was fed in this unit
    text: str                           # the Talker tokens' text, special tokens skipped
    interrupted: bool = False           # a forced listen closed the open turn first (<|turn_eos|> fed)


@dataclass
class TurnState:
    """Whether the model is in the middle of its turn (upstream's ``current_turn_ended``)."""

    open: bool = False
    units: int = field(default=0)   # units generated so far (for force_listen_units)


@torch.no_grad()
def generate_unit(session, decoder: DuplexDecoder, tokenizer, turn: TurnState,
                  force_listen: bool = False) -> UnitGeneration:
    """Run one unit's generation on ``session`` (a ``StreamingSession`` right after ``commit``)
    and end the unit; ``turn`` is updated in place.

    ``force_listen`` is upstream's ``force_listen_override`` (a client's barge-in): the unit
    listens, and an open turn is first closed by feeding ``<|turn_eos|>`` (not a Talker token).
    The first ``force_listen_units`` units of a session listen too, without that closing."""
    steps = unit_steps(session, decoder, tokenizer, turn, force_listen)
    try:
        ask = next(steps)
        while True:
            ask = steps.send(decoder.decode(ask.logits) if isinstance(ask, DecodeRequest)
                             else session.feed_token(ask))
    except StopIteration as done:
        return done.value


def unit_steps(session, decoder: DuplexDecoder, tokenizer, turn: TurnState, force_listen: bool = False):
    """``generate_unit`` as a generator, so that a caller can run several sessions' steps together. It
    yields two kinds of requests: a ``DecodeRequest``, answered by sending back the policy's token for its
    logits (``decoder.decode``; ``decode_many`` for several sessions at once), and a token to feed, answered
    by that token's final-norm hidden row once ``session`` holds it (``session.feed_token``'s result; one
    forward for several sessions). It returns the UnitGeneration."""
    cfg = decoder.config
    sp = tokenizer.special
    terminators = (sp.listen, sp.chunk_eos, sp.chunk_tts_eos)
    interrupted = False
    if force_listen and turn.open:
        yield sp.turn_eos
        turn.open, interrupted = False, True
    force_listen = force_listen or turn.units < cfg.force_listen_units
    turn.units += 1
    logits = session.logits()
    decoded: list[int] = [sp.turn_eos] if interrupted else []
    fed: list[int] = []
    ids: list[int] = []
    rows: list[torch.Tensor] = []
    terminator, turn_end = None, False
    for j in range(cfg.max_steps):
        if j == cfg.max_steps - 1:
            terminator = sp.chunk_eos
            decoded.append(terminator)
            break
        if force_listen:
            token = sp.listen
        else:
            token = yield DecodeRequest(logits)
            if token == sp.listen and turn.open:
                token = sp.tts_bos
        decoded.append(token)
        if token in terminators:
            terminator = token
            break
        turn.open = True
        if j != 0 and len(tokenizer.decode(ids + [token], skip_special_tokens=True)) >= cfg.max_unit_chars:
            terminator = sp.chunk_eos
            decoded[-1] = terminator
            break
        hidden = yield token
        logits = session.logits()
        fed.append(token)
        if token == sp.turn_eos:
            turn.open, turn_end = False, True
        if j != 0:
            ids.append(token)
            rows.append(hidden.detach().float().cpu())
    session.end_unit(terminator)
    hidden = torch.stack(rows) if rows else torch.zeros(0, session.thinker.hidden_size)
    return UnitGeneration(tuple(decoded), tuple(fed), tuple(ids), hidden, terminator, terminator == sp.listen,
                          turn_end, tokenizer.decode(ids, skip_special_tokens=True) if ids else "", interrupted)
