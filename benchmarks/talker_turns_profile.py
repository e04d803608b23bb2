"""Where a duplex Talker unit's time goes: ``TalkerTurns.generate_units`` for N seats (full-size random
Talker in bf16), split into the per-seat condition prefills, the batched draw forwards (graph replays)
and the draws, with torch.profiler's top GPU kernels of one call (``--profile``), per draw-forward kernel
set (``--kernels``: ``torch``, transformers' modules over the live bucket, one graph per bucket; ``triton``,
the Talker engine's fused kernels, one graph), side by side in one process.

    python benchmarks/talker_turns_profile.py OUT --seats 1,8,16 --kernels torch,triton   # GPU
    python benchmarks/talker_turns_profile.py OUT --tiny --seats 1,2 --kernels torch      # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, reference_config, tiny_config
from minicpmo_rt.talker import chunked
from minicpmo_rt.talker.chunked import SeatUnit, TalkerTurns
from minicpmo_rt.talker.model import MiniCPMTTS, rebuild_rotary_

from code2wav_pipeline_bench import device_label, parse_batches
from duplex_bench import sync


def build_tts(tiny: bool, dev: torch.device, dtype: torch.dtype) -> MiniCPMTTS:
    cfg = MiniCPMOConfig.from_dict(tiny_config() if tiny else reference_config())
    with torch.device("meta"):
        tts = MiniCPMTTS(cfg.tts)
    tts = tts.to_empty(device=dev)
    randomize_(tts, seed=0, prefix="tts.")
    return rebuild_rotary_(tts.to(dtype).eval())


def units_for(n: int, dev, llm_dim: int, turn_pos: int) -> list[SeatUnit]:
    g = torch.Generator().manual_seed(n)
    return [SeatUnit(i, tuple(torch.randint(1000, 5000, (8,), generator=g).tolist()),
                     torch.randn(8, llm_dim, generator=g).to(dev), False) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--seats", default="1,16")
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--kernels", default="torch,triton", help="draw-forward kernel sets, compared per seat count")
    ap.add_argument("--profile", action="store_true", help="torch.profiler's top GPU kernels of one call (CUDA)")
    args = ap.parse_args()
    kernel_sets = [k for k in args.kernels.split(",") if k]
    if not kernel_sets or set(kernel_sets) - {"torch", "triton"}:
        ap.error(f"--kernels: choose from torch, triton (got {args.kernels!r})")
    if args.calls < 3:
        ap.error("--calls must be >= 3 (the first two are warm-up)")
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tts = build_tts(args.tiny, dev, dtype)
    llm_dim = tts.cfg.llm_dim
    res = {"gpu": device_label(dev), "torch": torch.__version__, "runs": []}
    for n, kernels in [(n, k) for n in parse_batches(ap, args.seats) for k in kernel_sets]:
        turns = TalkerTurns(tts, n, seeds=list(range(n)), kernels=kernels)
        ms = {"prefill": [], "replay": [], "draw": [], "call": []}
        # before session 47 the draws ran on the host through chunked.draw_codes (timed here); since then
        # they are the ``_draw`` graph's replays (timed alone below)
        device_draws = hasattr(turns, "_draw")
        real = {"prefill": turns._prefill, "draw": chunked.draw_codes}

        def timed(name, fn):
            def run(*a, **k):
                sync(dev)
                t0 = time.perf_counter()
                out = fn(*a, **k)
                sync(dev)
                acc[name] += (time.perf_counter() - t0) * 1e3
                return out
            return run

        acc = {"prefill": 0.0, "draw": 0.0}
        turns._prefill = timed("prefill", real["prefill"])
        chunked.draw_codes = timed("draw", real["draw"])
        for k in range(args.calls):
            acc.update(prefill=0.0, draw=0.0)
            sync(dev)
            t0 = time.perf_counter()
            out = turns.generate_units(units_for(n, dev, llm_dim, k))
            sync(dev)
            call = (time.perf_counter() - t0) * 1e3
            if k >= 2:
                ms["call"].append(call)
                ms["prefill"].append(acc["prefill"])
                ms["draw"].append(acc["draw"])
            if k == args.calls - 1:
                for s in range(n):
                    turns.reset(s)
        turns._prefill = real["prefill"]
        chunked.draw_codes = real["draw"]
        # the batched forward alone, over the first bucket (the torch step's shortest; the fused step's one graph)
        kv_len = turns.max_len if turns.fused else turns.buckets[0]
        reps = 50

        def per_call(fn) -> float:
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync(dev)
            return (time.perf_counter() - t0) * 1e3 / reps

        graph = turns._graphs.get(kv_len)
        graph = graph[0] if isinstance(graph, tuple) else graph     # (graph, logits) before session 47
        replay = per_call(graph.replay if graph is not None else lambda: turns._step(kv_len))
        if device_draws:     # a unit's draws alone (the draw graph replayed), every seat idle
            turns._live.zero_()
            draw = turns._draw_graph.replay if turns._draw_graph is not None else turns._draw

            def unit_draws():
                turns._t.zero_()     # a unit draws at most max_new_codes times
                for _ in range(turns.sampling.max_new_codes):
                    draw()

            reps //= 5
            ms["draw"] = [per_call(unit_draws)]
        prof_top = []
        if dev.type == "cuda" and args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                turns.generate_units(units_for(n, dev, llm_dim, 0))
                sync(dev)
            table = p.key_averages().table(sort_by="cuda_time_total", row_limit=25)
            prof_top = table.splitlines()
            # the host's side too: at one seat the launches and syncs, not the GPU, set a unit's time
            table += "\n\nBy host time:\n" + p.key_averages().table(sort_by="cpu_time_total", row_limit=40)
            (args.out / f"profile_seats{n}_{kernels}.txt").parent.mkdir(parents=True, exist_ok=True)
            (args.out / f"profile_seats{n}_{kernels}.txt").write_text(table)
        row = {"seats": n, "kernels": turns.engine.kernels, "codes": len(out[0].codes),
               "call_ms": statistics.median(ms["call"]), "prefill_ms": statistics.median(ms["prefill"]),
               "draw_ms": statistics.median(ms["draw"]), "forward_ms": replay, "graphs": turns.graphs,
               "device_draws": device_draws}
        row["rest_ms"] = row["call_ms"] - row["prefill_ms"] - row["draw_ms"]
        res["runs"].append(row)
        print(row, flush=True)
        print("\n".join(prof_top[:30]), flush=True)
        del turns
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "talker_turns_profile.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Duplex Talker unit per draw-forward kernel set ({res['gpu']}, torch {res['torch']})", "",
             "`TalkerTurns.generate_units` for N seats, one mid-turn unit each (25 codes); medians over the calls "
             "after two warm-up calls. `forward`: one batched draw forward alone (its graph replayed). `draws`: the "
             "unit's 26 draws, timed inside the calls on the host-side loop (`draws on` host), or 26 times one "
             "draw graph's replay alone (`device`).", "",
             "| seats | kernels | draws on | call ms | prefill ms | draws ms | forward ms | graphs |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['seats']} | {r['kernels']} | {'device' if r['device_draws'] else 'host'} | {r['call_ms']:.2f} | "
              f"{r['prefill_ms']:.2f} | {r['draw_ms']:.2f} | {r['forward_ms']:.3f} | {r['graphs']} |" for r in res["runs"]]
    (args.out / "talker_turns_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
