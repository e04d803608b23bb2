"""H200 probe for the batch 8-16 Code2Wav solve: (1) the DiT's GEMMs at 400-1664 rows, cuBLAS TF32
against the Triton tile GEMM (``kernels/wide_gemm.py``) over tile shapes, pointer and TMA loads (the
conv as cuBLAS's taps GEMM, M x 3C x C, against Triton's implicit conv, M x C x 3C: same FLOPs);
(2) "lanes": a batch-16 chunk as several smaller Whole-Euler graphs replayed side by side on their
own streams, against one batch-16 replay (do the small graphs' idle SMs and gaps fill each other?).

    python benchmarks/code2wav_gemm_probe.py --out DIR [--skip gemm,lanes,solve] [--gemm-batches 16,8]

(3) "solve": the whole Whole-Euler replay per tile table of the Triton GEMMs (``TABLES``), against
cuBLAS GEMMs, in one run: the GEMMs in place, with cold weights and their real neighbours.
(4) "qkv", "fp16", "ieee": the same whole-solve replays per QKV epilogue tile, per FP16-operand table,
and per IEEE tile (TF32 off with the tile GEMMs) against cuBLAS IEEE.

Every time is the GPU time of CUDA-graph replays (no launch overhead), median of several, in us or ms.
Writes DIR/code2wav_gemm_probe.json and .md after every section.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from code2wav_bench import L, S, T, _triton_version, chunk_inputs, randomize_, timed  # noqa: E402

from minicpmo_rt.code2wav.euler_graph import GraphConfig, WholeEulerSolver  # noqa: E402
from minicpmo_rt.code2wav.flow import Flow  # noqa: E402
from minicpmo_rt.code2wav.flow_config import FULL_SIZE  # noqa: E402
from minicpmo_rt.code2wav.kernels.wide_gemm import wide_gemm  # noqa: E402
from minicpmo_rt.code2wav.precision import matmul_tf32  # noqa: E402

CONFIGS = [(128, 128, 32, 8, 3), (128, 128, 32, 4, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4),
           (64, 64, 32, 4, 4), (128, 256, 32, 8, 3), (64, 256, 32, 8, 3), (128, 128, 64, 8, 2),
           (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (64, 64, 64, 4, 4), (256, 128, 32, 8, 3)]
C, MLP, TAPS = 512, 2048, 3


def graph_us(fn, calls: int = 20, reps: int = 7) -> float:
    """GPU us per call: ``calls`` calls captured in one graph, replayed ``reps`` times (median)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / calls)
    del g
    return statistics.median(out)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def gemm_section(res: dict, save, batches=(16, 8)) -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = []
    for B in batches:
        R = 2 * B
        # conv: cuBLAS runs the taps GEMM (M x 3C x C, summed later); Triton the implicit conv (M x C x 3C)
        shapes += [(B, "qkv", R * T, 3 * C, C, False, True, 1), (B, "proj", R * T, C, C, False, True, 1),
                   (B, "conv", R * (T + TAPS - 1), C, C, False, False, TAPS),
                   (B, "fc1", R * T, MLP, C, True, True, 1), (B, "fc2", R * T, C, MLP, False, True, 1)]
    rows = res.setdefault("gemm", [])
    for B, role, M, N, K, gelu, bias, taps in shapes:
        x = torch.randn(M, K, device=dev, generator=g)
        w = torch.randn(taps * N, K, device=dev, generator=g) / K ** 0.5
        b = 0.02 * torch.randn(N, device=dev, generator=g) if bias else None
        out = torch.empty(M, N, device=dev)
        out_taps = torch.empty(M, taps * N, device=dev)
        with matmul_tf32(False):
            ref = torch.addmm(b, x, w.t()) if bias else x @ w.t()
            if taps > 1:    # out[m] = sum_j x[m + j] @ w_j.T
                ref = sum(torch.cat([ref[j:, j * N:(j + 1) * N], ref.new_zeros(j, N)]) for j in range(taps))
        if gelu:
            ref = torch.nn.functional.gelu(ref, approximate="tanh")
        flop = 2 * M * N * K * taps

        def cublas():
            if taps > 1:
                torch.mm(x, w.t(), out=out_taps)
            elif gelu:
                torch._addmm_activation(b, x, w.t(), use_gelu=True, out=out)
            elif bias:
                torch.addmm(b, x, w.t(), out=out)
            else:
                torch.mm(x, w.t(), out=out)

        with matmul_tf32(True):
            us = graph_us(cublas)
            cublas()
            cub_err = float("nan") if taps > 1 else rel(out, ref)
            r = {"batch": B, "role": role, "M": M, "N": N, "K": K, "taps": taps, "gelu": gelu, "cublas_us": us,
                 "cublas_tflops": flop / us / 1e6, "cublas_err": cub_err, "triton": []}
            best = None
            for tma in (True, False):
                for cfg in CONFIGS:
                    if K % cfg[2]:
                        continue
                    fn = lambda: wide_gemm(x, w, b, out, gelu=gelu, taps=taps, tma=tma, tile=cfg)  # noqa: E731
                    try:
                        out.zero_()
                        fn()
                        err = rel(out, ref)
                        t = graph_us(fn)
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
                        r["triton"].append({"tile": cfg, "tma": tma, "error": repr(exc)[:200]})
                        continue
                    r["triton"].append({"tile": cfg, "tma": tma, "us": t, "err": err})
                    if best is None or t < best["us"]:
                        best = {"tile": cfg, "tma": tma, "us": t, "err": err}
            r["best"] = best
        rows.append(r)
        print(f"B={B:2d} {role:5s} {M}x{N}x{K}: cuBLAS {us:7.2f} us ({r['cublas_tflops']:.0f} TFLOP/s)"
              + (f", Triton best {best['us']:7.2f} us {best['tile']} tma={best['tma']} err {best['err']:.1e}"
                 if best else ""), flush=True)
        save()
        del x, w, b, out, ref


def lanes_section(res: dict, save) -> None:
    dev = torch.device("cuda")
    flow = Flow(FULL_SIZE)
    randomize_(flow, 0)
    flow = flow.to(dev).eval()
    cfm = flow.decoder
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8, 16), query_buckets=(T,), offset_bucket=50, offset_anchor=L,
                      max_graphs=32)
    rows = res.setdefault("lanes", [])
    for total, lanes in ((16, 1), (16, 2), (16, 4), (8, 1), (8, 2)):
        b = total // lanes
        cnn, att, mu, spk, cond = chunk_inputs(b, dev)
        solvers, graphs = [], []
        for _ in range(lanes):
            sv = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S, config=cfg)
            sv.solve(mu, spk, cond, cnn, att, copy_out=False)
            st = next(iter(sv._statics.values()))
            solvers.append(sv)
            graphs.append(st.graph)
        streams = [torch.cuda.Stream() for _ in graphs]

        def seq():
            for gr in graphs:
                gr.replay()

        def side_by_side():
            cur = torch.cuda.current_stream()
            for gr, s in zip(graphs, streams):
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    gr.replay()
            for s in streams:
                cur.wait_stream(s)

        r = {"batch": total, "lanes": lanes}
        for name, fn in (("sequential_ms", seq), ("side_by_side_ms", side_by_side)):
            r[name] = statistics.median(timed(fn, min_reps=15, max_reps=15))
        rows.append(r)
        print(f"batch {total} as {lanes} lane(s) of {b}: sequential {r['sequential_ms']:.2f} ms, "
              f"side by side {r['side_by_side_ms']:.2f} ms", flush=True)
        save()
        del solvers, graphs, cnn, att
        gc.collect()
        torch.cuda.empty_cache()


# Tile tables for the in-solve sweep: (qkv, proj, fc1, conv) tiles, (BM, BN, BK, warps, stages)
TABLES = {
    "A": ((64, 128, 32, 4, 4), (64, 128, 64, 4, 3), (128, 128, 32, 8, 3), (64, 128, 32, 4, 4)),
    "B": ((128, 128, 32, 8, 3), (64, 64, 64, 4, 4), (128, 256, 32, 8, 3), (64, 128, 64, 4, 3)),
    "C": ((128, 256, 32, 8, 3), (64, 128, 32, 4, 4), (64, 128, 32, 4, 4), (128, 128, 32, 8, 3)),
    "D": ((128, 128, 32, 8, 3),) * 4,
    "E": ((64, 128, 32, 4, 4),) * 4,
    "F": ((64, 64, 32, 4, 4), (64, 64, 64, 4, 4), (64, 128, 32, 4, 4), (64, 64, 64, 4, 4)),
    # the isolated best at batch 4 (400 rows; session 10 run 2)
    "G": ((64, 128, 64, 4, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (64, 64, 64, 4, 4)),
    "H": ((64, 64, 64, 4, 4), (64, 32, 64, 4, 4), (64, 64, 64, 4, 4), (64, 32, 64, 4, 4)),
}


@contextlib.contextmanager
def _tile_tables():
    """``wide_gemm`` with its tile tables (and IEEE_TILE) restored after a sweep that edits them."""
    from minicpmo_rt.code2wav.kernels import wide_gemm as wg
    tables = (wg.TILES, wg.QKV_TILES, wg.TILES16, wg.QKV_TILES16)
    saved, ieee_tile = [dict(t) for t in tables], wg.IEEE_TILE
    try:
        yield wg
    finally:
        for table, old in zip(tables, saved):
            table.clear()
            table.update(old)
        wg.IEEE_TILE = ieee_tile


def _in_solve_sweep(batches, variants, setup, record, gemm_operands: str = "fp32", tf32: bool = True,
                    trim: bool = False, direct: bool | None = None, called: bool = False) -> None:
    """Whole-solve replays (the GEMMs in place: cold weights, real neighbours), same machine: for each
    batch and variant, ``setup(wg, B, big, variant)`` edits the tile tables and returns the solver's
    ``wide_gemm`` (None: the solver's default) and a function applied to its FusedDiT (or None); ``record(B, variant, outputs,
    replay_ms)`` keeps the row. ``tf32=False``: IEEE GEMMs (the attention stays TF32). ``trim``: solved as the
    flow calls it (trimmed successor; the direct path where it applies). ``direct``: the solver's ``direct``
    (True: the block kernel's direct phase too). ``called``: also time the whole ``solve`` call (median of 15,
    staging and copies included), passed to ``record`` as ``called_ms``."""
    dev = torch.device("cuda")
    flow = Flow(FULL_SIZE)
    randomize_(flow, 0)
    cfm = flow.to(dev).eval().decoder
    with _tile_tables() as wg:
        for B in batches:
            cnn, att, mu, spk, cond = chunk_inputs(B, dev)
            cfg = GraphConfig(batch_buckets=(B,), query_buckets=(T,), offset_bucket=50, offset_anchor=L, max_graphs=4)
            for variant in variants:
                wide, tune = setup(wg, B, 2 * B * T >= (wg.BIG_M16 if gemm_operands == "fp16" else wg.BIG_M), variant)
                sv = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=tf32, n_timesteps=S,
                                      config=cfg, wide_gemm=wide, gemm_operands=gemm_operands, direct=direct)
                if tune is not None:
                    tune(sv.fused)
                kw = dict(copy_out=False, trim=(L - 100, 100) if trim else None)
                got = sv.solve(mu, spk, cond, cnn, att, **kw)
                st = next(iter(sv._statics.values()))
                assert wide is None or st.ws.wide == wide
                extra = {}
                if called:      # a direct replay writes into the last successor: keep it alive
                    last = [got]
                    extra["called_ms"] = statistics.median(timed(
                        lambda: last.__setitem__(0, sv.solve(mu, spk, cond, cnn, att, **kw)), min_reps=15, max_reps=15))
                    got = [t.clone() for t in last[0]]
                record(B, variant, got, statistics.median(timed(st.graph.replay, min_reps=15, max_reps=15)), **extra)
                del sv, st, got
                gc.collect()
                torch.cuda.empty_cache()


def solve_section(res: dict, save, batches=(16, 8)) -> None:
    """The whole solve's replay per tile table against cuBLAS GEMMs."""
    rows = res.setdefault("solve", [])
    roles = ((1536, 512, 1), (512, 512, 1), (2048, 512, 1), (512, 512, 3))

    def setup(wg, B, big, name):
        if name != "cuBLAS":   # every role of this row class, so no earlier table's tile stays in use
            wg.TILES.update({(big, *role): tile for role, tile in zip(roles, TABLES[name])})
            wg.QKV_TILES[big] = TABLES[name][0]      # the QKV GEMM runs as wide_qkv (head LNs in its epilogue)
        return name != "cuBLAS", None

    def record(B, name, got, ms):
        rows.append({"batch": B, "table": name, "tiles": None if name == "cuBLAS" else TABLES[name], "replay_ms": ms})
        print(f"solve B={B} {name:6s}: replay {ms:.2f} ms", flush=True)
        save()

    _in_solve_sweep(batches, ["cuBLAS"] + list(TABLES), setup, record)


# FP16-operand tile tables (gemm_operands="fp16"): qkv (wide_qkv), proj, fc1, conv, fc2
TABLES16 = {
    "probe": ((128, 64, 64, 4, 4), (64, 64, 128, 4, 3), (64, 128, 64, 4, 4), (64, 64, 128, 4, 3), (64, 128, 64, 4, 4)),
    "bk128": ((64, 64, 128, 4, 3), (64, 64, 128, 4, 3), (64, 64, 128, 4, 3), (64, 64, 128, 4, 3), (64, 64, 128, 4, 3)),
    "t128": ((128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (128, 64, 64, 4, 4)),
    "n128": ((64, 128, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 4, 4)),
    "wide": ((64, 128, 128, 4, 3), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3)),
}
ROLES16 = ((512, 512, 1), (2048, 512, 1), (512, 512, 3), (512, 2048, 1))      # after qkv


def fp16_section(res: dict, save, batches=(16, 8)) -> None:
    """The whole solve's replay with FP16 operands per tile table (``TABLES16``), same machine."""
    rows = res.setdefault("fp16_solve", [])

    def setup(wg, B, big, name):
        t = TABLES16[name]
        wg.QKV_TILES16[big] = t[0]
        wg.TILES16.update({(big, 1536, 512, 1): t[0], **{(big, *r): tile for r, tile in zip(ROLES16, t[1:])}})
        return True, None

    def record(B, name, got, ms):
        rows.append({"batch": B, "table": name, "tiles": TABLES16[name], "replay_ms": ms})
        print(f"fp16 solve B={B} {name:6s}: replay {ms:.2f} ms", flush=True)
        save()

    _in_solve_sweep(batches, list(TABLES16), setup, record, gemm_operands="fp16")


# QKV with the q/k head LNs in its epilogue (``wide_qkv``), per tile, against the GEMM + separate LN stage
QKV_VARIANTS = (("GEMM + LN stage", None), ("epilogue 128x128 bk32 w8 s3", (128, 128, 32, 8, 3)),
                ("epilogue 64x128 bk32 w4 s4", (64, 128, 32, 4, 4)), ("epilogue 64x64 bk32 w4 s4", (64, 64, 32, 4, 4)),
                ("epilogue 128x64 bk32 w4 s4", (128, 64, 32, 4, 4)), ("epilogue 64x128 bk64 w4 s3", (64, 128, 64, 4, 3)),
                ("epilogue 64x64 bk64 w4 s4", (64, 64, 64, 4, 4)),
                # the default tile on 8 warps: on 4 its epilogue spills (ptxas, Triton 3.9: 480 bytes per thread)
                ("epilogue 64x128 bk32 w8 s4", (64, 128, 32, 8, 4)), ("epilogue 64x128 bk32 w8 s3", (64, 128, 32, 8, 3)))


def qkv_section(res: dict, save, batches=(16,)) -> None:
    """The QKV GEMM's head-LN epilogue at each candidate tile against the separate LN stage (the first
    variant, whose outputs the others are compared with)."""
    def setup(wg, B, big, variant):
        tile = variant[1]
        wg.QKV_TILES.clear()
        if tile is not None:
            wg.QKV_TILES[big] = tile

        def tune(fused):
            fused.wide_qkv_ln_max_rows = None if tile is not None else 0
        return True, tune

    _in_solve_sweep(batches, QKV_VARIANTS, setup, _vs_first(res, "qkv", save))


def _vs_first(res: dict, key: str, save, value_key: str = "tile", label: str | None = None):
    """A sweep's ``record`` for (name, value, ...) variants: each row's outputs against the batch's first
    variant's (only one batch's reference kept), into ``res[key]`` (the variant's value under ``value_key``;
    further timings ``record`` is given, e.g. ``called_ms``, kept as they are)."""
    rows = res.setdefault(key, [])
    ref = {}

    def record(B, variant, got, ms, **extra):
        if B not in ref:
            ref.clear()
            ref[B] = [t.clone() for t in got]
        err = max(rel(a, b) for a, b in zip(got, ref[B]))
        rows.append({"batch": B, "variant": variant[0], value_key: variant[1], "max_rel_diff_vs_first": err,
                     "replay_ms": ms, **extra})
        more = "".join(f", {k} {v:.3f}" for k, v in extra.items())
        print(f"{label or key} B={B} {variant[0]:28s}: replay {ms:.3f} ms{more} (vs first {err:.1e})", flush=True)
        save()
    return record


def vs_first_table(rows: list[dict]) -> list[str]:
    """A ``_vs_first`` sweep's rows as a Markdown table: replay and (where timed, else '-') solve as called, ms,
    and each row's max relative difference from its batch's first variant."""
    lines = ["| batch | variant | replay ms | solve as called ms | max rel diff vs first |",
             "|---:|---|---:|---:|---:|"]
    return lines + [f"| {r['batch']} | {r['variant']} | {r['replay_ms']:.3f} | "
                    f"{format(r['called_ms'], '.3f') if 'called_ms' in r else '-'} | {r['max_rel_diff_vs_first']:.1e} |"
                    for r in rows]


# IEEE dots (TF32 off, wide_gemm=True): the tile GEMMs' IEEE launch (``wide_gemm.IEEE_TILE``, pointer loads),
# per candidate, against cuBLAS IEEE (what TF32 off picks by default) and the TF32 tables' tiles with TMA (what
# an IEEE launch took before session 17, spilling 4-26 KB per thread); (name, IEEE_TILE, wide_gemm)
IEEE_VARIANTS = (("cuBLAS IEEE", None, False), ("TF32 tables + TMA (before)", None, True),
                 ("64x128 bk32 w8 s3", (64, 128, 32, 8, 3), True), ("128x64 bk32 w8 s3", (128, 64, 32, 8, 3), True),
                 ("128x128 bk16 w8 s2", (128, 128, 16, 8, 2), True), ("64x64 bk64 w8 s3", (64, 64, 64, 8, 3), True),
                 ("64x64 bk32 w4 s3", (64, 64, 32, 4, 3), True), ("64x128 bk16 w8 s3", (64, 128, 16, 8, 3), True))


def ieee_section(res: dict, save, batches=(16,)) -> None:
    """Whole-solve replays with TF32 off (IEEE GEMMs, TF32 attention as the benchmark's "TF32 off" row):
    each ``IEEE_VARIANTS`` entry, outputs compared with the first (cuBLAS IEEE)."""
    def setup(wg, B, big, variant):
        wg.IEEE_TILE = variant[1]
        return variant[2], None

    _in_solve_sweep(batches, IEEE_VARIANTS, setup, _vs_first(res, "ieee", save), tf32=False)


def markdown(res: dict) -> str:
    out = [f"# Code2Wav GEMM and lanes probe ({res['gpu']})", "",
           f"torch {res['torch']}, triton {res['triton']}; GPU time of graph replays.", ""]
    if res.get("gemm"):
        out += ["## DiT GEMMs, cuBLAS TF32 vs Triton tile GEMM (us per call)", "",
                "conv: cuBLAS runs the taps GEMM (M x 3C x C, its tap sum left to the next stage), Triton the "
                "implicit conv (M x C x 3C, taps summed in the GEMM); same FLOPs. err: vs FP64 on unrounded "
                "operands (Triton truncates them; the fused body stores them rounded).", "",
                "| B | role | M x N x K | cuBLAS us | TFLOP/s | best Triton us | tile (BM,BN,BK,warps,stages) | TMA | "
                "Triton / cuBLAS | err cuBLAS | err Triton |", "|---|---|---|---:|---:|---:|---|---|---:|---:|---:|"]
        for r in res["gemm"]:
            b = r.get("best") or {}
            out.append(f"| {r['batch']} | {r['role']} | {r['M']}x{r['N']}x{r['K']} | {r['cublas_us']:.2f} | "
                       f"{r['cublas_tflops']:.0f} | {b.get('us', float('nan')):.2f} | {b.get('tile')} | {b.get('tma')} | "
                       f"{b.get('us', float('nan')) / r['cublas_us']:.2f} | {r['cublas_err']:.1e} | "
                       f"{b.get('err', float('nan')):.1e} |")
        out.append("")
    for key, what in (("solve", "tiles: qkv, proj, fc1, conv"), ("fp16_solve", "FP16 operands; tiles: qkv, proj, "
                                                                            "fc1, conv, fc2")):
        if res.get(key):
            out += [f"## Whole-Euler solve replay per tile table (ms per chunk; {what})", "",
                    "| batch | GEMMs | replay ms | tiles |", "|---:|---|---:|---|"]
            for r in res[key]:
                out.append(f"| {r['batch']} | {r['table']} | {r['replay_ms']:.2f} | {r['tiles'] or ''} |")
            out.append("")
    for key, title in (("qkv", "QKV head LNs in the GEMM epilogue vs a separate LN stage"),
                       ("ieee", "TF32 off with the tile GEMMs: IEEE launch per tile")):
        if res.get(key):
            out += [f"## {title} (whole-solve replay, ms per chunk)", "",
                    "| batch | variant | replay ms | max rel diff vs first row |", "|---:|---|---:|---:|"]
            for r in res[key]:
                out.append(f"| {r['batch']} | {r['variant']} | {r['replay_ms']:.2f} | {r['max_rel_diff_vs_first']:.1e} |")
            out.append("")
    if res.get("lanes"):
        out += ["## One chunk's Whole-Euler solve as lanes (ms per chunk, replay only)", "",
                "| batch | lanes | sequential | side by side |", "|---:|---:|---:|---:|"]
        for r in res["lanes"]:
            out.append(f"| {r['batch']} | {r['lanes']} | {r['sequential_ms']:.2f} | {r['side_by_side_ms']:.2f} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--skip", default="", help="comma list: gemm, lanes, solve, qkv, fp16, ieee")
    ap.add_argument("--gemm-batches", default="16,8", help="batches whose GEMM shapes to probe")
    args = ap.parse_args(argv)
    skip = {w.strip() for w in args.skip.split(",") if w.strip()}
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": _triton_version()}

    def save():
        (args.out / "code2wav_gemm_probe.json").write_text(json.dumps(res, indent=1))
        (args.out / "code2wav_gemm_probe.md").write_text(markdown(res))

    if "lanes" not in skip:
        lanes_section(res, save)
    if "solve" not in skip:
        solve_section(res, save, [int(b) for b in args.gemm_batches.split(",")])
    if "qkv" not in skip:
        qkv_section(res, save, [int(b) for b in args.gemm_batches.split(",")])
    if "fp16" not in skip:
        fp16_section(res, save, [int(b) for b in args.gemm_batches.split(",")])
    if "ieee" not in skip:
        ieee_section(res, save, [int(b) for b in args.gemm_batches.split(",")])
    if "gemm" not in skip:
        gemm_section(res, save, [int(b) for b in args.gemm_batches.split(",")])
    save()
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
