"""Launch-shape sweeps for the Code2Wav DiT's GEMMs and attention, and the Whole-Euler solve
with each fast stage switched on and off, side by side in one run (CUDA only).

* GEMM: every DiT GEMM shape (rows = CFG-doubled batch x 50 query frames, or x 52 history
  frames for the causal convs) under TF32: cuBLAS ``addmm`` vs the few-row Triton kernel
  (``kernels.small_gemm``) over a grid of tile shapes and split-K.
* attention: 50 queries over 450 keys, 8 heads x 64, at 2 and 32 rows: query/key tiles,
  warps, stages and key splits.
* attention over HBM: the same at 32 rows over 16 distinct caches (one evaluation's, ~1 GB), per
  block, against the read bandwidth of a torch reduction over the same bytes.
* solve: one steady 1-s chunk (10 Euler steps, CFG, cache 400) from the Whole-Euler graph,
  fused body, TF32, with {cuBLAS, few-row GEMM, cuBLAS split-K} x {one program per query block, key splits};
  plus the kernel profile of one estimator evaluation.

Times are medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``), so they
include the gaps between kernels that a captured solve has. Writes kernels_bench.json/.md.

    PYTHONPATH=src python benchmarks/code2wav_kernels_bench.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from code2wav_bench import S, T, L, chunk_inputs, kernel_profile, randomize_, timed  # noqa: E402

from minicpmo_rt.code2wav.euler_graph import GraphConfig, WholeEulerSolver  # noqa: E402
from minicpmo_rt.code2wav.flow import Flow  # noqa: E402
from minicpmo_rt.code2wav.flow_config import FULL_SIZE  # noqa: E402
from minicpmo_rt.code2wav.kernels import dit_block  # noqa: E402
from minicpmo_rt.code2wav.kernels.small_gemm import GemmConfig, default_config, small_gemm  # noqa: E402
from minicpmo_rt.code2wav.kernels.tiled_attention import tiled_attention  # noqa: E402
from minicpmo_rt.code2wav.precision import matmul_tf32  # noqa: E402

C, MLP, TAPS = 512, 2048, 3
SHAPES = {"qkv": (3 * C, C), "proj": (C, C), "conv": (TAPS * C, C), "fc1": (MLP, C), "fc2": (C, MLP)}


def bench_us(fn) -> float:
    import triton.testing
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=30)


def gemm_sweep(batches: list[int], quick: bool) -> list[dict]:
    rows = []
    for B, (name, (N, K)) in itertools.product(batches, SHAPES.items()):
        M = 2 * B * (T + TAPS - 1 if name == "conv" else T)
        x = torch.randn(M, K, device="cuda")
        w = torch.randn(N, K, device="cuda") / K ** 0.5
        b = torch.randn(N, device="cuda")
        out = torch.empty(M, N, device="cuda")
        gelu = name == "fc1"
        with matmul_tf32(True):
            if gelu:
                cub = bench_us(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True, out=out))
            else:
                cub = bench_us(lambda: torch.addmm(b, x, w.t(), out=out))
            ref = out.clone()
            best = None
            bms = [128] if M <= 128 else ([64, 128] if quick else [32, 64, 128])
            for bm, bn, bk, split, warps, stages in itertools.product(
                    bms, [16, 32, 64], [32, 64], [1, 2, 4] if not gelu else [1], [4] if quick else [4, 8], [3]):
                if split > 1 and K // split < bk:
                    continue
                cfg = GemmConfig(bm, bn, bk, split, warps, stages)
                try:
                    small_gemm(x, w, b, out, gelu=gelu, config=cfg)
                    err = float((out - ref).norm() / ref.norm())
                    us = bench_us(lambda: small_gemm(x, w, b, out, gelu=gelu, config=cfg))
                except Exception as exc:  # noqa: BLE001 - a shape Triton rejects is just not a candidate
                    print(f"  {name} M={M} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg, err)
            dflt = default_config(M, N, K)
            d_us = bench_us(lambda: small_gemm(x, w, b, out, gelu=gelu, config=dflt))
        r = {"B": B, "gemm": name, "M": M, "N": N, "K": K, "cublas_us": cub, "default_us": d_us,
             "default": dflt.__dict__, "best_us": best[0] if best else None,
             "best": best[1].__dict__ if best else None, "best_rel_err_vs_cublas": best[2] if best else None}
        rows.append(r)
        print(f"  gemm B={B:2d} {name:4s} M={M:5d}: cuBLAS {cub:6.1f} us, default {d_us:6.1f} us, "
              f"best {r['best_us']:6.1f} us {r['best']}", flush=True)
        x = w = b = out = ref = None  # free before the next shape
    return rows


def attention_sweep(quick: bool) -> list[dict]:
    rows = []
    for R in (2, 32):
        q = torch.randn(R, 8, T, 64, device="cuda")
        kv = torch.randn(R, 8, T + L, 128, device="cuda")
        k, v = kv[..., :64], kv[..., 64:]
        o = torch.empty(R, T, 8, 64, device="cuda").transpose(1, 2)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        res = []
        for bm, bn, warps, stages, splits in itertools.product(
                [16, 32, 64], [32, 64] if quick else [32, 64, 128], [4] if quick else [2, 4], [2, 3],
                [1, 2, 4, 8]):
            fn = lambda: tiled_attention(q, k, v, None, precision="tf32", out=o, block_m=bm,  # noqa: E731
                                         block_n=bn, num_warps=warps, num_stages=stages, splits=splits)
            try:
                fn()
                err = float((o - ref).norm() / ref.norm())
                us = bench_us(fn)
            except Exception as exc:  # noqa: BLE001
                print(f"  attn R={R} bm{bm} bn{bn} w{warps} s{stages} x{splits}: {type(exc).__name__}", flush=True)
                continue
            res.append({"R": R, "block_m": bm, "block_n": bn, "warps": warps, "stages": stages, "splits": splits,
                        "us": us, "rel_err_vs_sdpa": err})
        res.sort(key=lambda r: r["us"])
        base = next(r for r in res if (r["block_m"], r["block_n"], r["warps"], r["stages"], r["splits"])
                    == (32, 64, 4, 2, 1))
        print(f"  attn R={R}: old config {base['us']:.1f} us; best 5: " +
              "; ".join(f"bm{r['block_m']} bn{r['block_n']} w{r['warps']} s{r['stages']} x{r['splits']} "
                        f"{r['us']:.1f}" for r in res[:5]), flush=True)
        rows += [dict(r, old_config=r is base) for r in res]
    return rows


# bm, bn, warps, stages, splits, TMA descriptor loads
HBM_CONFIGS = ([c + (False,) for c in itertools.product([32, 64], [64, 128], [4, 8], [2, 3], [1, 2])]
               + [c + (1, True) for c in itertools.product([32, 64], [64, 128], [4, 8], [2, 3])])


def attention_hbm_sweep(R: int = 32, depth: int = 16, configs=HBM_CONFIGS, device="cuda") -> dict:
    """Attention as one evaluation meets it: ``depth`` distinct [k|v] caches (one per block, ~1 GB at
    R=32, far beyond L2), each attended once per replay, against the read bandwidth a torch
    reduction reaches over the same bytes (what streaming them from HBM can cost at least)."""
    q = torch.randn(R, 8, T, 64, device=device)
    kv = torch.randn(depth, R, 8, T + L, 128, device=device)
    o = torch.empty(R, T, 8, 64, device=device).transpose(1, 2)
    kv_bytes = kv.numel() * 4
    sink = torch.empty(depth, 128, device=device)
    read_us = bench_us(lambda: torch.sum(kv.view(depth, -1, 128), dim=1, out=sink))
    ref = torch.nn.functional.scaled_dot_product_attention(q, kv[-1, ..., :64], kv[-1, ..., 64:])   # o's last
    rows = []
    for bm, bn, warps, stages, splits, tma in configs:
        def fn():
            for i in range(depth):
                tiled_attention(q, kv[i, ..., :64], kv[i, ..., 64:], None, precision="tf32", out=o, block_m=bm,
                                block_n=bn, num_warps=warps, num_stages=stages, splits=splits, tma=tma)
        try:
            fn()
            err = float((o - ref).norm() / ref.norm())
            us = bench_us(fn) / depth
        except Exception as exc:  # noqa: BLE001 - a shape Triton rejects is just not a candidate
            print(f"  attn-hbm bm{bm} bn{bn} w{warps} s{stages} x{splits} tma={tma}: {exc!r}"[:300], flush=True)
            continue
        rows.append({"block_m": bm, "block_n": bn, "warps": warps, "stages": stages, "splits": splits, "tma": tma,
                     "us_per_block": us, "tb_s": kv_bytes / depth / us / 1e6, "rel_err_vs_sdpa": err,
                     "default": (bm, bn, warps, stages, splits, tma) == (32, 64, 4, 2, 1, False)})
    rows.sort(key=lambda r: r["us_per_block"])
    out = {"R": R, "depth": depth, "cache_mb_per_block": kv_bytes / depth / 1e6,
           "torch_sum_read_tb_s": kv_bytes / read_us / 1e6, "torch_sum_us_per_block": read_us / depth, "rows": rows}
    print(f"  attn-hbm R={R}: torch read {out['torch_sum_read_tb_s']:.2f} TB/s ({out['torch_sum_us_per_block']:.1f} us "
          f"per block); best 6: " + "; ".join(f"bm{r['block_m']} bn{r['block_n']} w{r['warps']} s{r['stages']} "
                                            f"x{r['splits']}{' TMA' if r['tma'] else ''} {r['us_per_block']:.1f} us "
                                            f"{r['tb_s']:.2f} TB/s"
                                            for r in rows[:6]), flush=True)
    return out


def attention_mask_probe(R: int = 32, depth: int = 16, device="cuda") -> list[dict]:
    """The HBM setup of ``attention_hbm_sweep`` with the masks the solvers pass: none (the steady arena
    solve), one key row per batch row as a stride-0 view (the slot pool's) read as full tiles (the default)
    or as one key vector per tile (``key_mask=True``), the same mask materialised per query, and pooled caches (rows
    read through ``kv_rows`` from a pool with a scratch row, 464 frames as ``default_pool_frames(300)``).
    Launch shapes: the staged body's at batch 16 with pointer loads and with TMA, and at batch 4."""
    F = 464
    q = torch.randn(R, 8, T, 64, device=device)
    o = torch.empty(R, T, 8, 64, device=device).transpose(1, 2)
    kv = torch.randn(depth, R, 8, T + L, 128, device=device)
    pool = torch.randn(depth, R + 2, 8, F, 128, device=device)
    keys = torch.zeros(R, T + L, dtype=torch.bool, device=device)
    keys[:, :T] = True
    keys[:, T:T + L] = torch.rand(R, L, device=device) > 0.05
    pkeys = torch.zeros(R, F, dtype=torch.bool, device=device)
    pkeys[:, :T + L] = keys
    rows = torch.randperm(R + 2, device=device)[:R].to(torch.int32)
    view, pview = keys[:, None].expand(R, T, T + L), pkeys[:, None].expand(R, T, F)
    # (name, cache, mask, kv_rows, key_mask): key_mask True reads a stride-0 view as one key vector per tile
    cases = [("no mask", kv, None, None, False), ("key mask view, key vectors", kv, view, None, True),
             ("key mask view, full tiles", kv, view, None, False),
             ("same mask materialised", kv, view.contiguous(), None, False),
             ("pooled, key mask view, key vectors", pool, pview, rows, True),
             ("pooled, key mask view, full tiles", pool, pview, rows, False),
             ("pooled, mask materialised", pool, pview.contiguous(), rows, False)]
    shapes = {"bm32 s2": dict(block_m=32, num_stages=2), "bm64 s3 TMA": dict(block_m=64, num_stages=3, tma=True),
              "8 rows bm16 x2 splits": dict(block_m=16, num_stages=2, splits=2)}
    out = []
    for (name, cache, mask, kvr, key_mask), (shape, kw) in itertools.product(cases, shapes.items()):
        r = 8 if shape.startswith("8 rows") else R      # batch 4's staged grid: 8 rows, keys split 2 ways
        m = None if mask is None else mask[:r]
        rr = None if kvr is None else kvr[:r]

        def fn():
            for i in range(depth):
                tiled_attention(q[:r], cache[i, ..., :64], cache[i, ..., 64:], m, kv_rows=rr, precision="tf32",
                                out=o[:r], key_mask=key_mask, **kw)
        try:
            us = bench_us(fn) / depth
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"  attn-mask {name} {shape}: {exc!r}"[:300], flush=True)
            continue
        out.append({"case": name, "shape": shape, "us_per_block": us})
        print(f"  attn-mask {name:36s} {shape:22s}: {us:6.1f} us per block", flush=True)
    return out


def solve_rows(cfm, batches: list[int], budget: float, keys=()) -> tuple[list[dict], dict]:
    """``keys``: substrings selecting variants by name (empty: all)."""
    rows, profiles = [], {}
    variants = [("cuBLAS GEMMs, attention bm32 unsplit (session-1 fast path)",
                 dict(gemm="cublas", attn_splits=1, attn_block_m=32)),
                ("cuBLAS GEMMs, attention by grid fill", dict(gemm="cublas")),
                ("few-row Triton GEMMs, attention by grid fill", dict(gemm="triton")),
                ("cuBLAS split-K GEMMs (partials summed in the fused stages), attention by grid fill (staged default)",
                 dict(gemm="cublas-split")),
                ("cuBLAS split-K GEMMs, 2 partials each", dict(gemm="cublas-split", split_k=2)),
                ("cuBLAS split-K GEMMs, 8 partials each", dict(gemm="cublas-split", split_k=8)),
                ("persistent block kernel (one launch per evaluation, <= 256 rows; the default)",
                 dict(block_kernel=True)),
                ("persistent block kernel up to 512 rows", dict(block_kernel=True, _max_rows=512))]
    # the staged variants stay staged at every batch (the default would take the block kernel at B <= 2)
    variants = [(n, kw if "block_kernel" in kw else dict(kw, block_kernel=False)) for n, kw in variants]
    variants = [(n, kw) for n, kw in variants if not keys or any(k in n for k in keys)]
    for B in batches:
        cnn, att, mu, spk, cond = chunk_inputs(B)
        cfg = GraphConfig(batch_buckets=(B,), query_buckets=(T,), offset_bucket=50, offset_anchor=L, max_graphs=4)
        ref = None
        for name, kw in variants:
            if "partials each" in name and B > 4:
                continue   # fixed splits: a sweep for the few-row batches only
            kw = dict(kw)
            dit_block.MAX_ROWS = kw.pop("_max_rows", 256)     # a sweep knob of this script only
            solver = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S,
                                      config=cfg, **kw)
            got = solver.solve(mu, spk, cond, cnn, att, copy_out=False)
            got = [t.clone() for t in got]
            if ref is None:
                ref = got
            err = max(float((a - b).norm() / b.norm()) for a, b in zip(got, ref))
            st = next(iter(solver._statics.values()))
            ms = timed(lambda: solver.solve(mu, spk, cond, cnn, att, copy_out=False), budget)
            rep = timed(st.graph.replay, budget) if st.graph is not None else ms
            r = {"B": B, "variant": name, "solve_ms": statistics.median(ms), "replay_ms": statistics.median(rep),
                 "graph": st.graph is not None, "rel_err_vs_first_variant": err}
            rows.append(r)
            print(f"  solve B={B:2d} {name:60s} {r['solve_ms']:7.2f} ms (replay {r['replay_ms']:7.2f}) "
                  f"err {err:.1e}", flush=True)
            if "(staged default)" in name or "session-1" in name or "<= 256" in name:
                fused = solver.fused
                R = 2 * B
                xin = torch.randn(R, T, 320, device="cuda")
                kv = torch.zeros(16, R, 8, T + L, 128, device="cuda")
                hist = fused.new_hist(R, T, "cuda").zero_()
                ws = fused.workspace(R, T, "cuda")
                out = torch.empty(R, T, 80, device="cuda")
                with matmul_tf32(True), torch.inference_mode():
                    mod = fused.modulation(torch.full((1,), 0.5, device="cuda"))
                    profiles[f"B={B} {name}"] = kernel_profile(lambda: fused.body(xin, mod, hist, kv, None, ws, out))
                del xin, kv, hist, ws, out
            solver = st = got = None
            gc.collect()
            torch.cuda.empty_cache()
    return rows, profiles


def markdown(res: dict) -> str:
    out = [f"# Code2Wav DiT kernel sweeps on {res['gpu']}", "",
           f"torch {res['torch']}, triton {res['triton']}; medians of CUDA-graph replays."]
    if res.get("solve"):   # each part's table only where it ran (--skip)
        out += ["", "## Whole-Euler solve per steady 1-s chunk (fused body, TF32, graph)", "",
                "| B | variant | solve ms | replay ms | max rel err vs first row |", "|---|---|---:|---:|---:|"]
    for r in res.get("solve", []):
        out.append(f"| {r['B']} | {r['variant']} | {r['solve_ms']:.2f} | {r['replay_ms']:.2f} | "
                   f"{r['rel_err_vs_first_variant']:.1e} |")
    if res.get("gemm"):
        out += ["", "## GEMMs under TF32 (us per call)", "",
                "| B | GEMM | M x N x K | cuBLAS | few-row default | few-row best | best config |",
                "|---|---|---|---:|---:|---:|---|"]
    for r in res.get("gemm", []):
        b = r["best"] or {}
        out.append(f"| {r['B']} | {r['gemm']} | {r['M']}x{r['N']}x{r['K']} | {r['cublas_us']:.1f} | "
                   f"{r['default_us']:.1f} | {r['best_us']:.1f} | bm{b.get('block_m')} bn{b.get('block_n')} "
                   f"bk{b.get('block_k')} split{b.get('split_k')} w{b.get('num_warps')} |")
    if res.get("attention"):
        out += ["", "## Attention (us per call), 50 queries x 450 keys, 8 x 64", "",
                "| rows | config | us |", "|---|---|---:|"]
    for R in (2, 32):
        rs = [r for r in res.get("attention", []) if r["R"] == R]
        for r in rs[:5] + [r for r in rs if r.get("old_config")]:
            out.append(f"| {R} | bm{r['block_m']} bn{r['block_n']} w{r['warps']} s{r['stages']} splits{r['splits']}"
                       f"{' (session-1 config)' if r.get('old_config') else ''} | {r['us']:.1f} |")
    hbm = res.get("attention_hbm")
    if hbm:
        out += ["", f"## Attention over HBM: {hbm['R']} rows, {hbm['depth']} distinct caches "
                f"({hbm['cache_mb_per_block']:.0f} MB each), us per block", "",
                f"A torch sum over the same caches reads {hbm['torch_sum_read_tb_s']:.2f} TB/s "
                f"({hbm['torch_sum_us_per_block']:.1f} us per block).", "",
                "| config | us per block | TB/s | rel err vs SDPA |", "|---|---:|---:|---:|"]
        rs = hbm["rows"]
        best_tma = [r for r in rs[8:] if r.get("tma")][:1]
        shown = rs if len(rs) <= 20 else rs[:8] + [r for r in rs[8:] if r["default"]] + best_tma
        for r in shown:
            out.append(f"| bm{r['block_m']} bn{r['block_n']} w{r['warps']} s{r['stages']} splits{r['splits']}"
                       f"{' TMA' if r.get('tma') else ''}{' (default)' if r['default'] else ''} | "
                       f"{r['us_per_block']:.1f} | {r['tb_s']:.2f} | "
                       f"{r['rel_err_vs_sdpa']:.1e} |")
    if res.get("attention_mask"):
        shapes = list(dict.fromkeys(r["shape"] for r in res["attention_mask"]))
        out += ["", "## Attention masks and pooled caches: 16 distinct caches, us per block (32 rows unless "
                "the launch says 8)", "", "| case | " + " | ".join(shapes) + " |", "|---|" + "---:|" * len(shapes)]
        for c in dict.fromkeys(r["case"] for r in res["attention_mask"]):
            us = {r["shape"]: f"{r['us_per_block']:.1f}" for r in res["attention_mask"] if r["case"] == c}
            out.append(f"| {c} | " + " | ".join(us.get(s, "—") for s in shapes) + " |")
    for name, prof in res.get("profiles", {}).items():
        out += ["", f"Kernels of one estimator evaluation, {name}:", "", "| kernel | count | total us |",
                "|---|---:|---:|"]
        out += [f"| `{p['kernel'][:80]}` | {p['count']} | {p['total_us']:.1f} |" for p in prof]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    import triton
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--quick", action="store_true", help="smaller sweeps")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: "
                    "gemm,attention,attention-hbm,attention-mask,solve")
    ap.add_argument("--hbm-configs", default="", help="';'-separated attention configs for the HBM sweep, each "
                    "'bm,bn,warps,stages,splits,tma' (tma 0/1), e.g. '64,64,4,3,1,1;64,32,4,4,1,1' (default: its grid)")
    ap.add_argument("--variants", default="", help="'|'-separated substrings of solve variant names to run "
                    "(default: all), e.g. 'default|persistent'")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}

    def save():
        (args.out / "kernels_bench.json").write_text(json.dumps(res, indent=1))
        (args.out / "kernels_bench.md").write_text(markdown(res))

    t0 = time.time()
    flow = Flow(FULL_SIZE)
    randomize_(flow, 0)
    cfm = flow.to("cuda").eval().decoder
    if "solve" not in skip:
        with torch.inference_mode():
            res["solve"], res["profiles"] = solve_rows(cfm, batches, args.budget,
                                                       tuple(filter(None, args.variants.split("|"))))
        save()
        print(f"solve rows done at {time.time() - t0:.0f}s", flush=True)
    if "attention" not in skip:
        res["attention"] = attention_sweep(args.quick)
        save()
        print(f"attention sweep done at {time.time() - t0:.0f}s", flush=True)
    if "attention-hbm" not in skip:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.hbm_configs.split(";") if c.strip()]
        if any(len(c) != 6 for c in configs):
            ap.error("--hbm-configs: each config is 'bm,bn,warps,stages,splits,tma'")
        res["attention_hbm"] = attention_hbm_sweep(configs=[c[:5] + (bool(c[5]),) for c in configs] or HBM_CONFIGS)
        save()
        print(f"attention HBM sweep done at {time.time() - t0:.0f}s", flush=True)
    if "attention-mask" not in skip:
        res["attention_mask"] = attention_mask_probe()
        save()
        print(f"attention mask probe done at {time.time() - t0:.0f}s", flush=True)
    if "gemm" not in skip:
        res["gemm"] = gemm_sweep(batches, args.quick)
        save()
        print(f"gemm sweep done at {time.time() - t0:.0f}s", flush=True)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
