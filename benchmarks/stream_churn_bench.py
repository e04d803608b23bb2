"""Concurrent streams that come and go: what batch buckets and a warm-up at every bucket buy a server.

Full-size random weights, fp32 on CUDA, the knobs' default fast path (fused CFM body, Whole-Euler graphs,
TF32 scoped to the DiT; encoder and causal HiFT from per-shape graphs), a 6-s voice prompt. ``--slots``
(default 16) request slots each run utterances back to back: an utterance lasts 3-10 chunks (1 s of audio
each: 3 context + 25 codes; its last payload is final, 3 + 10 codes, or 3 + a count drawn from ``--final-codes``
LO..HI), then the slot idles 0-2 rounds. The
schedule is drawn once from a seeded RNG (every variant replays the same one). A round pushes one payload
into every active stream through ``Code2Wav.push_many``; streams at the same point of their utterance share
a solve, so the batch sizes the encoder and HiFT graph sets see wander over 1..16 from round to round.

Variants (each on a fresh ``Code2Wav``, so no graph carries over; ``prepare(voice)`` before the first round,
timed apart):
  * ``before``: the graph sets as they were (encoder and HiFT keyed by exact row count, encoder budget 8,
    the warm-up stream alone; the CFM arena regrows for a wider solve, dropping every graph; no final-chunk
    keys precaptured);
  * ``+ arena kept``: ``GraphConfig.keep_arena`` (a masked final chunk of several streams solves in row
    groups that fit the arena) and the final-chunk keys precaptured;
  * ``+ batch buckets``: encoder and HiFT rows pad to ``ROW_BUCKETS`` (their budgets as now);
  * ``+ warm-up at every bucket``: ``prepare`` warms 1, 2, 4, 8, 16 streams, not one;
  * ``+ arena sized for 4 final rows``: ``GraphConfig.final_batch`` = 4 (the rows above it, 0: only the
    final keys that fit the steady arena, batch 1);
  * ``+ final chunks join the steady solve (default)``: ``Code2Wav.join_finals`` (a final chunk's rows join the
    steady solve of the streams that go on, padded, attending their own frames only; the rows above it solve
    final chunks apart);
  * ``default + slot pool, row-offset merging (opt-in)``: the knobs ``cfm_slot_pool`` (one slot per request
    slot) and ``cfm_row_offset_merge``: streams at different points of their utterances share one CFM solve
    (``--no-slot-pool`` leaves this row out).

``--carry`` runs instead the default against the default with carried HiFT decoding (``Vocoder.stream_carry``,
the ``hift_carry`` knob, opt-in). ``--starts`` runs the default against streams' first and second chunks joining
the steady solve (``cfm_join_starts``, opt-in), and that with ``hift_carry`` as well. ``--joins`` runs instead final chunks solving apart against joining the steady solve (``Code2Wav.join_finals``,
the default) and joining with the arena sized for no more final rows (``final_batch`` 0). ``--finals`` runs
instead the default with ``final_batch`` 0, 2, 4 and 8 (what sizing the arena for more final
rows buys, and costs in memory); ``--grids --prompt-frames 280`` a voice whose prompt is not 6 s with the
offset grid anchored at a 6-s prompt's steady length (masked steady chunks) or at its own
(``GraphConfig.anchor_at_trim``); ``--only`` keeps the variants whose labels hold one of its substrings.

Per variant: ``prepare`` time, every round's host time with a device synchronisation (median, 90th
percentile, max, total), and what the encoder and HiFT graph sets did during the rounds (eager calls,
captures) plus the CFM graphs captured mid-run. Run order: one discarded run of the default (Triton's JIT,
cuDNN's autotuning), then the variants alternating, ``--runs`` each. Writes JSON + Markdown to --out
(after every run, so a cut-off run keeps its numbers), and a plot of every round's time (PNG; ``--replot JSON``
draws it again from a results file). ``--tiny --device cpu`` is a smoke run of the script.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Optional
from pathlib import Path

import numpy as np
import torch

from code2wav_pipeline_bench import bench_device, bench_models, device_label
from first_chunk_bench import _sync, release
from minicpmo_rt.atomic import atomic_write, save_png
from minicpmo_rt.code2wav.encoder_graph import EncoderGraphs
from minicpmo_rt.code2wav.frontend import PromptFeatures
from minicpmo_rt.code2wav.pipeline import Code2Wav
from minicpmo_rt.code2wav.vocoder import CAUSAL, Vocoder, VocoderSet

@dataclass(frozen=True)
class Variant:
    label: str
    buckets: bool                      # encoder and HiFT rows pad to ROW_BUCKETS
    warm: tuple[int, ...] | None       # prepare's warm-up batches (None: its default, every bucket)
    keep_arena: bool                   # GraphConfig.keep_arena, and the final chunks' keys precaptured
    pool: bool = False                 # cfm_slot_pool (one slot per request slot) + cfm_row_offset_merge
    final_batch: int | None = None     # GraphConfig.final_batch (None: the default)
    anchor_at_trim: bool | None = None  # GraphConfig.anchor_at_trim (None: Code2Wav's default, on)
    join_finals: bool = True           # Code2Wav.join_finals: final chunks join the steady solve
    carry: bool = False                # Vocoder.stream_carry (the hift_carry knob): carried HiFT decoding
    join_starts: bool = False          # cfm_join_starts: first and second chunks join the steady solve


VARIANTS = (Variant("before", False, (1,), False, final_batch=0, join_finals=False),
            Variant("+ arena kept", False, (1,), True, final_batch=0, join_finals=False),
            Variant("+ batch buckets", True, (1,), True, final_batch=0, join_finals=False),
            Variant("+ warm-up at every bucket", True, None, True, final_batch=0, join_finals=False),
            Variant("+ arena sized for 4 final rows", True, None, True, join_finals=False),
            Variant("+ final chunks join the steady solve (default)", True, None, True))
POOLED = Variant("default + slot pool, row-offset merging (opt-in)", True, None, True, pool=True)
# what sizing the arena for more final rows buys (GraphConfig.final_batch)
FINALS = tuple(Variant(f"default, final keys to batch {b}", True, None, True, final_batch=b) for b in (0, 2, 4, 8))
# final chunks in a solve of their own, or joining the steady one (Code2Wav.join_finals), and whether the arena
# sized for 4 final rows (GraphConfig.final_batch) still pays once they join
JOINS = (Variant("final chunks solve apart (before)", True, None, True, join_finals=False),
         Variant("final chunks join the steady solve (default)", True, None, True),
         Variant("final chunks join, final keys to batch 0 only", True, None, True, final_batch=0))
# a prompt that is not 6 s (--prompt-frames): the offset grid at the 6-s prompt's steady length, or at its own
GRIDS = (Variant("grid anchored at a 6-s prompt's steady length (before)", True, None, True, anchor_at_trim=False),
         Variant("grid anchored at each call's prompt + 100 (default)", True, None, True))
# the stream vocoder re-decoding its history (default) or carrying its convs' context (hift_carry, opt-in)
CARRY = (Variant("final chunks join the steady solve (default)", True, None, True),
         Variant("default + carried HiFT decoding (hift_carry, opt-in)", True, None, True, carry=True))
# first and second chunks in solves of their own cache length (default) or joining the steady solve
# (cfm_join_starts, opt-in), and with carried HiFT decoding as well
STARTS = (Variant("final chunks join the steady solve (default)", True, None, True),
          Variant("default + first and second chunks join (cfm_join_starts, opt-in)", True, None, True,
                  join_starts=True),
          Variant("default + cfm_join_starts + hift_carry (opt-ins)", True, None, True, join_starts=True, carry=True))
SILENCE = 4218


def schedule(slots: int, rounds: int, seed: int) -> list[list[tuple[int, int, bool]]]:
    """Per round, the active slots as (slot, chunk index in its utterance, final)."""
    rng = random.Random(seed)
    plan: list[list[tuple[int, int, bool]]] = [[] for _ in range(rounds)]
    for slot in range(slots):
        r = rng.randrange(0, 4)                   # staggered first arrivals
        while r < rounds:
            n = rng.randint(3, 10)
            for k in range(n):
                if r + k < rounds:
                    plan[r + k].append((slot, k, k == n - 1))
            r += n + rng.randint(0, 2)
    return plan


def payload(g: np.random.Generator, final: bool, final_new: int = 10) -> list[int]:
    return [SILENCE] * 3 + g.integers(0, 6561, final_new if final else 25).tolist()


def final_lengths(plan: list, lo: int, hi: int, seed: int) -> list[dict[int, int]]:
    """Per round, slot -> the new codes of its final payload, drawn uniformly from lo..hi (``--final-codes``), from
    an RNG of its own: the same for every variant, and the payloads' codes stay as drawn without it."""
    rng = random.Random(seed + 1)
    return [{slot: rng.randint(lo, hi) for slot, _, final in active if final} for active in plan]


def push_round(c2w: Code2Wav, feats, streams: dict, active, g: np.random.Generator,
               final_new: Optional[dict] = None) -> int:
    """One round of the schedule: a stream opens in each slot whose utterance starts, then every active slot
    pushes its payload (one ``push_many``) -> the streams pushed. ``final_new``: slot -> the new codes of its
    final payload (default 10)."""
    items = []
    for slot, k, final in active:
        if k == 0:
            streams[slot] = c2w.open_stream(feats)
        items.append((streams[slot], payload(g, final, (final_new or {}).get(slot, 10)), final))
    if items:
        c2w.push_many(items)
    return len(items)


def build(flow, gen, v: Variant, slots: int) -> Code2Wav:
    """A fresh instance on the shared weights, its graph sets configured as ``v`` says."""
    voc = Vocoder(gen, CAUSAL, stream_carry=v.carry, **({} if v.buckets else {"batch_buckets": ()}))
    c2w = Code2Wav(flow, VocoderSet(voc, voc), frontend=None, n_timesteps=10)
    c2w.configure_fast_path({**({"cfm_slot_pool": slots, "cfm_row_offset_merge": True} if v.pool else {}),
                             **({"cfm_join_starts": True} if v.join_starts else {})})
    c2w.join_finals = v.join_finals
    if c2w.flow.encoder_graphs is not None and not v.buckets:
        c2w.flow.encoder_graphs = EncoderGraphs(c2w.flow, max_graphs=8, batch_buckets=())    # as before
    solver = c2w.flow.chunk_solver
    if v.final_batch is not None and solver is not None:
        solver.config = replace(solver.config, final_batch=v.final_batch)
    if v.anchor_at_trim is not None and solver is not None:
        solver.config = replace(solver.config, anchor_at_trim=v.anchor_at_trim)
    if not v.keep_arena and solver is not None:
        solver.config = replace(solver.config, keep_arena=False)
        plan = c2w.precapture_plan
        c2w.precapture_plan = lambda prompt_frames: {**plan(prompt_frames), "final": False}
    return c2w


def _counts(c2w: Code2Wav) -> dict:
    out = {k: {"eager": g.eager_calls, "captures": g.captures, "held": len(g.graphs)}
           for k, g in c2w.stream_graph_sets().items()}
    solver = c2w.flow.chunk_solver
    graphs = solver is not None and hasattr(solver, "graphs")
    out["CFM"] = {"held": len(solver.graphs()) if graphs else 0, "captures": solver.captures if graphs else 0,
                  "arena_regrowths": solver.arena_regrowths if graphs else 0}
    if c2w.slot_solver is not None:     # the pooled streams' solves (a WholeEulerSolver of its own)
        out["CFM"]["captures"] += c2w.slot_solver.captures
        out["CFM"]["arena_regrowths"] += c2w.slot_solver.arena_regrowths
    return out


def _shape_key(key: tuple) -> str:
    """An encoder / HiFT graph key (input shapes and dtypes, then static arguments) as a short string."""
    return " ".join("x".join(map(str, k[0])) if isinstance(k, tuple) and len(k) == 2 and isinstance(k[0], tuple)
                    else str(k) for k in key)


def _count_solves(c2w: Code2Wav, log: list) -> bool:
    """Note every CFM solve call (the dense solver's ``solve``, the slot solver's ``solve_slots``) in ``log`` as
    [rows, mel frames, replays or eager programs it ran] (a dense solve runs more than one where its rows split
    into groups: past the largest bucket, or to fit the arena, ``keep_arena``), through instance attributes of
    this run's own solvers. False: no such solver (the reference path off CUDA)."""
    found = False
    for solver, name in ((c2w.flow.chunk_solver, "solve"), (c2w.slot_solver, "solve_slots")):
        if solver is None or not hasattr(solver, name):
            continue
        inner, depth = getattr(solver, name), [0]

        def counted(*a, _inner=inner, _depth=depth, _mu_at=1 if name == "solve_slots" else 0, **k):
            mu = a[_mu_at] if len(a) > _mu_at else k["mu"]
            if _depth[0] == 0:
                log.append([int(mu.shape[0]), int(mu.shape[-1]), 0])
            before = len(log) and log[-1][2]
            _depth[0] += 1
            try:
                return _inner(*a, **k)
            finally:
                _depth[0] -= 1
                if log[-1][2] == before:    # no group below this call: it ran one program itself
                    log[-1][2] += 1
        setattr(solver, name, counted)
        found = True
    return found


def _count_hift_calls(c2w: Code2Wav, log: list):
    """Note every HiFT stage call of the stream vocoder's runner (F0, excitation, decode; a batched call once)
    in ``log`` as (op, rows), through instance attributes of the runner; returns what removes them (an eager
    runner is the model, which later runs share)."""
    runner = c2w.vocoders.stream.runner
    ops = [op for op in ("f0", "excite", "decode") if hasattr(runner, "run_" + op)]
    for op in ops:
        inner = getattr(runner, "run_" + op)

        def counted(*a, _inner=inner, _op=op, **k):
            log.append((_op, int(a[0].shape[0])))
            return _inner(*a, **k)
        setattr(runner, "run_" + op, counted)

    def undo():
        for op in ops:
            delattr(runner, "run_" + op)
    return undo


STAGES = ("encoder", "CFM", "vocoder")


def _time_stages(c2w: Code2Wav, dev, spent: dict) -> None:
    """Add the host time (device synchronised before and after) of every encoder call, CFM solve and vocoding
    round of this instance into ``spent`` (by stage), through instance attributes; nested calls count once.
    The synchronisations cost a little themselves, so a breakdown run's rounds are a bit slower."""
    targets = [(c2w.flow, "encode_chunk", "encoder"), (c2w.flow.chunk_solver, "solve", "CFM"),
               (c2w.slot_solver, "solve_slots", "CFM"), (c2w.vocoders.stream, "push_many", "vocoder")]
    depth = [0]
    for obj, name, stage in targets:
        if obj is None or not hasattr(obj, name):
            continue
        inner = getattr(obj, name)

        def timed(*a, _inner=inner, _stage=stage, **k):
            if depth[0]:
                return _inner(*a, **k)
            _sync(dev)
            t = time.perf_counter()
            depth[0] += 1
            try:
                return _inner(*a, **k)
            finally:
                depth[0] -= 1
                _sync(dev)
                spent[_stage] = spent.get(_stage, 0.0) + 1000 * (time.perf_counter() - t)
        setattr(obj, name, timed)


def one_run(flow, gen, feats, dev, v: Variant, plan, seed: int, slots: int, breakdown: bool = False,
            final_codes: Optional[list] = None) -> dict:
    c2w = build(flow, gen, v, slots)
    _sync(dev)
    t = time.perf_counter()
    c2w.prepare(feats, batches=v.warm)
    _sync(dev)
    prepare_ms = 1000 * (time.perf_counter() - t)
    before = _counts(c2w)
    solver = c2w.flow.chunk_solver
    held = lambda: set(solver.graphs()) if hasattr(solver, "graphs") else set()  # noqa: E731  (as _counts)
    keys_before = held()
    sets_before = {name: set(g.graphs) for name, g in c2w.stream_graph_sets().items()}
    arena = getattr(solver, "_arena", None)
    arena_gib = 0.0 if arena is None else arena.numel() * arena.element_size() / 2**30
    solves: list[tuple[int, int]] = []
    counting = _count_solves(c2w, solves)
    hift_log: list[tuple[str, int]] = []
    uncount = _count_hift_calls(c2w, hift_log)
    spent: dict = {}
    stages = []
    if breakdown:
        _time_stages(c2w, dev, spent)
    g = np.random.default_rng(seed)
    streams: dict[int, object] = {}
    rounds, batches, per_round, finals, hift_calls = [], [], [], [], []
    for active in plan:
        solves.clear()
        hift_log.clear()
        spent.clear()
        t = time.perf_counter()
        pushed = push_round(c2w, feats, streams, active, g, final_codes[len(rounds)] if final_codes else None)
        _sync(dev)
        rounds.append(1000 * (time.perf_counter() - t))
        batches.append(pushed)
        finals.append(sum(final for _, _, final in active))
        stages.append(dict(spent))
        per_round.append(list(solves))
        hift_calls.append(list(hift_log))
    uncount()
    after = _counts(c2w)
    during = {k: {m: after[k][m] - before[k].get(m, 0) for m in after[k]} for k in after}
    out = {"prepare_ms": prepare_ms, "arena_gib": arena_gib, "round_ms": rounds, "streams_per_round": batches,
           "finals_per_round": finals, "during_rounds": during, "stages_per_round": stages if breakdown else None,
           "held_after": {k: v["held"] for k, v in after.items()}, "choice": c2w.choice.describe(),
           "cfm_solves": per_round if counting else None, "hift_calls": hift_calls,
           "cfm_keys_captured": sorted(map(str, held() - keys_before)),     # mid-serving: what prepare missed
           "set_keys_captured": {name: sorted(_shape_key(k) for k in set(g.graphs) - sets_before.get(name, set()))
                                 for name, g in c2w.stream_graph_sets().items()}}
    del c2w, streams
    release(dev)
    return out


def summary(r: dict) -> dict:
    ms = sorted(r["round_ms"])
    return {"prepare_ms": r["prepare_ms"], "arena_gib": r.get("arena_gib", float("nan")), "median": statistics.median(ms), "p90": ms[int(0.9 * (len(ms) - 1))],
            "max": ms[-1], "total": sum(ms),
            "eager": sum(v["eager"] for k, v in r["during_rounds"].items() if k != "CFM"),
            "captures": sum(v["captures"] for k, v in r["during_rounds"].items() if k != "CFM"),
            "cfm_captures": r["during_rounds"]["CFM"]["captures"],
            "cfm_regrowths": r["during_rounds"]["CFM"]["arena_regrowths"],
            **_solve_stats(r.get("cfm_solves")), **_final_stats(r), **_stage_stats(r), **_hift_stats(r)}


def _hift_stats(r: dict) -> dict:
    """HiFT stage calls per round (median; a batched call counts once) and rows per call (mean) of a run (results
    of older runs lack them)."""
    per = r.get("hift_calls")
    if not per:
        return {}
    calls = [c for rnd in per for c in rnd]
    return {"hift_calls_per_round": statistics.median(len(rnd) for rnd in per),
            "rows_per_hift_call": sum(rows for _, rows in calls) / max(len(calls), 1)}


def _stage_stats(r: dict) -> dict:
    """Per stage, the median over rounds of its time in a round (``--breakdown``), and of the rest of the round
    (host work outside the three stages: payload checks, grouping, cache commits, PCM copies)."""
    per = r.get("stages_per_round")
    if not per:
        return {}
    out = {f"stage_{k}": statistics.median(p.get(k, 0.0) for p in per) for k in STAGES}
    out["stage_rest"] = statistics.median(t - sum(p.values()) for t, p in zip(r["round_ms"], per))
    return out


def _final_stats(r: dict) -> dict:
    """Median time of the rounds with final chunks and of those without (results of older runs lack them)."""
    if "finals_per_round" not in r:
        return {}
    w = [t for t, n in zip(r["round_ms"], r["finals_per_round"]) if n]
    wo = [t for t, n in zip(r["round_ms"], r["finals_per_round"]) if not n]
    return {"with_finals": statistics.median(w) if w else float("nan"),
            "without_finals": statistics.median(wo) if wo else float("nan")}


def _solve_stats(per_round: list | None) -> dict:
    """CFM solve programs (replays or eager runs) per round (median) and rows per program (mean) of a run
    (results of older runs lack them)."""
    if not per_round:
        return {}
    return {"solves_per_round": statistics.median(sum(c[2] for c in rnd) for rnd in per_round),
            "rows_per_solve": sum(c[0] for rnd in per_round for c in rnd)
            / max(sum(c[2] for rnd in per_round for c in rnd), 1)}


def _write(path: Path, text: str) -> None:
    """Replace ``path`` whole or not at all (a run cut off mid-write keeps the previous file)."""
    atomic_write(path, lambda f: f.write(text.encode()))


def plot(res: dict, path: Path) -> None:
    """Every round's time (last run of each variant, log scale) over the streams active in it."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (ax, nx) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for label, runs in res["runs"].items():
        if runs:
            ax.plot(range(1, len(runs[-1]["round_ms"]) + 1), runs[-1]["round_ms"], label=label, lw=1.2)
    ax.set_yscale("log")
    ax.set_ylabel("round time, ms (log)")
    ax.axhline(1000, color="grey", ls=":", lw=1)
    ax.set_title(f"Code2Wav, {res['slots']} request slots whose streams come and go ({res['gpu']})")
    ax.legend(fontsize=8)
    nx.bar(range(1, len(res["streams_per_round"]) + 1), res["streams_per_round"], color="grey")
    nx.set_ylabel("streams")
    nx.set_xlabel("round (1 s of audio per active stream)")
    save_png(fig, path)


def _code_range(text: str) -> tuple[int, int]:
    """``--final-codes`` LO,HI (or one number) -> (lo, hi), 1 <= lo <= hi <= 25."""
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1] <= 25:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO,HI with 1 <= LO <= HI <= 25 (a final payload's "
                                         "new codes), e.g. 1,25")
    return parts[0], parts[1]


def _range_text(r) -> str:
    return f"{r[0]}" if r[0] == r[1] else f"{r[0]}-{r[1]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--runs", type=int, default=2, help="runs per variant (after one discarded run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny flow/HiFT sizes (smoke run of the script)")
    ap.add_argument("--no-slot-pool", action="store_true", help="leave out the opt-in slot pool's row")
    sets = ap.add_mutually_exclusive_group()
    sets.add_argument("--finals", action="store_true", help="instead: the default with its arena sized for final "
                    "chunks of 0 (the default), 2, 4 and 8 streams (GraphConfig.final_batch)")
    sets.add_argument("--joins", action="store_true", help="instead: final chunks solving apart, joining the "
                      "steady solve (Code2Wav.join_finals, the default), and joining with the arena sized for "
                      "no final rows beyond batch 1 (GraphConfig.final_batch 0)")
    sets.add_argument("--starts", action="store_true", help="instead: the default against first and second chunks "
                      "joining the steady solve (cfm_join_starts), and that with carried HiFT decoding")
    sets.add_argument("--carry", action="store_true", help="instead: the default against the default with the "
                      "stream vocoder carrying its convs' context (Vocoder.stream_carry, the hift_carry knob)")
    sets.add_argument("--grids", action="store_true", help="instead: the default with the CFM offset grid anchored "
                    "at a 6-s prompt's steady length or at each call's own (GraphConfig.anchor_at_trim); with "
                    "--prompt-frames other than 300 the two differ")
    ap.add_argument("--prompt-frames", type=int, default=300, help="the voice prompt's mel frames (even, 2-300; "
                    "default 300: the frontend's 6 s), cut from the same random prompt")
    ap.add_argument("--final-codes", type=_code_range, default=(10, 10), metavar="LO,HI",
                    help="new codes of each final payload, drawn uniformly from LO..HI (1-25; default 10,10: all 10)")
    ap.add_argument("--only", default="", help="'|'-separated substrings: only the variants whose labels hold "
                    "one (the first one kept is the 'vs' column's base), e.g. 'default'")
    ap.add_argument("--replot", type=Path, help="only draw the plot of a results JSON into --out")
    ap.add_argument("--breakdown", action="store_true", help="also time each round's encoder calls, CFM solves and "
                    "vocoding (synchronised before and after each: the rounds run a little slower)")
    args = ap.parse_args()
    if args.replot is not None:
        if not args.replot.is_file():
            ap.error(f"--replot {args.replot}: no such file; pass a stream_churn_bench JSON")
        args.out.mkdir(parents=True, exist_ok=True)
        plot(json.loads(args.replot.read_text()), args.out / "stream_churn_bench.png")
        return
    for name in ("slots", "rounds", "runs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not (2 <= args.prompt_frames <= 300 and args.prompt_frames % 2 == 0):
        ap.error(f"--prompt-frames must be even and in 2..300 (two mel frames per prompt token), "
                 f"got {args.prompt_frames}")
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("minicpmo_rt.code2wav.pipeline").setLevel(logging.INFO)
    dev = bench_device("stream_churn_bench", args.device)
    flow, gen, feats, _ = bench_models(args.tiny, dev)
    if args.prompt_frames != feats.mel_frames:    # the same random prompt, cut (tokens at half the mel rate)
        n = args.prompt_frames
        feats = PromptFeatures(feats.tokens[:, :n // 2], feats.spk_embedding, feats.mel[:, :n], n, f"bench-{n}")
    plan = schedule(args.slots, args.rounds, args.seed)
    lo, hi = args.final_codes
    final_codes = final_lengths(plan, lo, hi, args.seed) if (lo, hi) != (10, 10) else None
    variants = VARIANTS if args.no_slot_pool else VARIANTS + (POOLED,)
    if args.finals:
        variants = FINALS
    if args.grids:
        variants = GRIDS
    if args.carry:
        variants = CARRY
    if args.starts:
        variants = STARTS
    if args.joins:
        variants = JOINS
    if args.only:
        want = [w.strip() for w in args.only.split("|") if w.strip()]
        variants = tuple(v for v in variants if any(w in v.label for w in want))
        if not variants:
            ap.error(f"--only {args.only!r} matches no variant; labels: "
                     + "; ".join(v.label for v in VARIANTS + (POOLED,) + FINALS + GRIDS + JOINS + CARRY + STARTS))
    sizes = [len(a) for a in plan]
    gpu = device_label(dev)
    res = {"gpu": gpu, "torch": torch.__version__, "slots": args.slots, "rounds": args.rounds, "seed": args.seed,
           "prompt_frames": args.prompt_frames, "final_codes": list(args.final_codes),
           "streams_per_round": sizes, "runs": {v.label: [] for v in variants}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "stream_churn_bench.json"
    res["discarded_run"] = summary(one_run(flow, gen, feats, dev, variants[-1], plan, args.seed, args.slots,
                                           final_codes=final_codes))
    print("discarded run (JIT, autotuning)", res["discarded_run"], flush=True)
    for variant in [v for _ in range(args.runs) for v in variants]:
        r = one_run(flow, gen, feats, dev, variant, plan, args.seed, args.slots, args.breakdown, final_codes)
        res["runs"][variant.label].append(r)
        print(variant.label, summary(r), flush=True)
        _write(path, json.dumps(res, indent=2))

    med = {}
    for label in (v.label for v in variants):
        s = [summary(r) for r in res["runs"][label]]
        med[label] = {k: statistics.median(x[k] for x in s) for k in s[0]}
    res["medians"] = med
    _write(path, json.dumps(res, indent=2))
    base = med[variants[0].label]
    lines = [f"# Streams that come and go ({gpu}, torch {res['torch']})", "",
             f"{args.slots} request slots over {args.rounds} rounds (1 s of audio per stream per round), a voice "
             f"prompt of {args.prompt_frames} mel frames, utterances "
             f"of 3-10 chunks with 0-2 idle rounds between them, final payloads of 3 + {_range_text(args.final_codes)} "
             f"codes, seed {args.seed}: {min(sizes)}-{max(sizes)} "
             f"active streams per round (median {statistics.median(sizes):g}). Host time of a round with a device "
             f"synchronisation, ms; medians over {args.runs} run(s) per variant after one discarded run. "
             "Eager / captures: calls of the encoder and HiFT graph sets during the rounds that did not replay "
             "(summed over the sets); CFM: Whole-Euler graphs captured during the rounds, and arena growths that "
             "dropped the graphs held; arena: its size after prepare. CFM solves: graph replays (or eager "
             "programs) per round, a group of streams splitting into several where its rows outgrow the arena "
             "(final chunks, GraphConfig.keep_arena). With / without finals: the median of the rounds in which "
             "some stream sent its final chunk, and of the others. HiFT calls: the stream vocoder's stage calls "
             "(F0, excitation, decode) per round, a batched call counted once.", "",
             "| variant | prepare (ms) | round median | round p90 | round max | all rounds | vs first row | "
             "rounds with finals | without | "
             "eager calls | captures | CFM captures | CFM arena regrowths | CFM arena (GiB) | CFM solves per round | "
             "rows per solve | HiFT calls per round | rows per HiFT call |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label in (v.label for v in variants):
        m = med[label]
        lines.append(f"| {label} | {m['prepare_ms']:.0f} | {m['median']:.1f} | {m['p90']:.1f} | {m['max']:.1f} | "
                     f"{m['total']:.0f} | {base['total'] / m['total']:.2f}x | {m.get('with_finals', float('nan')):.1f} | "
                     f"{m.get('without_finals', float('nan')):.1f} | {m['eager']:.0f} | "
                     f"{m['captures']:.0f} | {m['cfm_captures']:.0f} | {m['cfm_regrowths']:.0f} | "
                     f"{m['arena_gib']:.2f} | {format(m['solves_per_round'], 'g') if 'solves_per_round' in m else '-'} | "
                     f"{format(m['rows_per_solve'], '.1f') if 'rows_per_solve' in m else '-'} | "
                     f"{format(m['hift_calls_per_round'], 'g') if 'hift_calls_per_round' in m else '-'} | "
                     f"{format(m['rows_per_hift_call'], '.1f') if 'rows_per_hift_call' in m else '-'} |")
    last = {v.label: res["runs"][v.label][-1] for v in variants}
    sets = list(dict.fromkeys(k for r in last.values() for k in r["during_rounds"]))     # a variant's own sets too
    lines += ["", "Per graph set, last run of each variant (eager calls / captures during the rounds; graphs held "
                  "after them; - where the variant has no such set):", "",
              "| variant | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
    for label, r in last.items():
        cells = []
        for k in sets:
            v, held = r["during_rounds"].get(k), r["held_after"].get(k)
            cells.append("-" if v is None else f"{v['captures']} captures; {held} held" if k == "CFM"
                         else f"{v['eager']} / {v['captures']}; {held} held")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    missed = {label: r.get("cfm_keys_captured") for label, r in last.items() if r.get("cfm_keys_captured")}
    if missed:
        lines += ["", "Whole-Euler graphs captured during the rounds (keys `prepare` did not take), last run:", ""]
        lines += [f"- {label}: " + ", ".join(f"`{k}`" for k in keys) for label, keys in missed.items()]
    shapes = {label: {n: ks for n, ks in (r.get("set_keys_captured") or {}).items() if ks} for label, r in last.items()}
    if any(shapes.values()):
        lines += ["", "Encoder / HiFT graphs captured during the rounds (input shapes, then static arguments), last "
                      "run:", ""]
        lines += [f"- {label}, {n}: " + ", ".join(f"`{k}`" for k in ks)
                  for label, sets in shapes.items() for n, ks in sets.items()]
    if args.breakdown:
        lines += ["", "Where a round's time goes (`--breakdown`: the device synchronised around every encoder call, CFM "
                      "solve and vocoding round; medians over rounds, then over runs; ms):", "",
                  "| variant | encoder | CFM | vocoder | rest (host) |", "|---|---:|---:|---:|---:|"]
        for label in (v.label for v in variants):
            m = med[label]
            lines.append(f"| {label} | " + " | ".join(f"{m.get('stage_' + k, float('nan')):.1f}"
                                                    for k in STAGES + ("rest",)) + " |")
    _write(args.out / "stream_churn_bench.md", "\n".join(lines) + "\n")
    plot(res, args.out / "stream_churn_bench.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
