"""H200 probe: can the arena fill (each stream's per-step attention cache copied behind the current
chunk's slot, 4.1 ms of a 27.4-ms batch-16 solve) hide behind the solve?

``WholeEulerSolver(overlap_fill=True)`` copies step s's piece on a side stream and the graph's step s
waits for it (external events). Variants, same machine, alternating, ms per ``solve`` (fill + replay
+ read; outputs checked bit-identical to the one-copy fill):

* the copy as torch's (SM) copy kernel, or as one ``cudaMemcpy2DAsync`` per piece (the arena's rows
  are one pitched 2-D array when the batch fills its bucket; the driver may run it on a copy engine,
  leaving the SMs to the solve);
* the solve launched on the current stream, or on a high-priority stream (the copy's blocks then only
  take what the solve leaves free).

    python benchmarks/fill_overlap_probe.py --out DIR [--batches 16,8]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import glob
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from code2wav_bench import L, S, T, _triton_version, chunk_inputs, randomize_, timed  # noqa: E402

from minicpmo_rt.code2wav import euler_graph  # noqa: E402
from minicpmo_rt.code2wav.euler_graph import GraphConfig, WholeEulerSolver  # noqa: E402
from minicpmo_rt.code2wav.flow import Flow  # noqa: E402
from minicpmo_rt.code2wav.flow_config import FULL_SIZE  # noqa: E402


def _cudart():
    """cudaMemcpy2DAsync of the CUDA runtime torch loaded (or one beside the nvidia wheels)."""
    torch.cuda.init()
    paths = [ln.split()[-1] for ln in open("/proc/self/maps") if "libcudart.so" in ln]
    if not paths:
        import site
        paths = sorted(glob.glob(os.path.join(site.getsitepackages()[0], "nvidia", "*", "lib", "libcudart.so*")))
    lib = ctypes.CDLL(paths[0])
    f = lib.cudaMemcpy2DAsync
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                  ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    f.restype = ctypes.c_int
    return f, paths[0]


def _rows_pitch(t: torch.Tensor, inner: int):
    """(rows, pitch elements) when t's leading dims collapse to one uniform stride and its last
    ``inner`` dims are contiguous; else None."""
    lead, tail = t.shape[:-inner], t.shape[-inner:]
    expect = 1
    for n, st in zip(reversed(tail), reversed(t.stride()[-inner:])):
        if n > 1 and st != expect:
            return None
        expect *= n
    strides = t.stride()[:-inner]
    for j in range(len(lead) - 1):
        if lead[j + 1] > 1 and strides[j] != strides[j + 1] * lead[j + 1]:
            return None
    rows = 1
    for n in lead:
        rows *= n
    return rows, (strides[-1] if lead else expect)


def make_memcpy2d_rows():
    memcpy2d, path = _cudart()

    def copy_rows(dst, src, B, Bb):
        a, b = _rows_pitch(dst, 2), _rows_pitch(src, 2)
        if B != Bb or a is None or b is None or a[0] != b[0] or dst.shape != src.shape:
            return plain(dst, src, B, Bb)
        width = dst.shape[-1] * dst.shape[-2] * dst.element_size()
        rc = memcpy2d(dst.data_ptr(), a[1] * dst.element_size(), src.data_ptr(), b[1] * src.element_size(), width,
                      a[0], 3, torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"cudaMemcpy2DAsync failed: {rc}")

    plain = euler_graph._copy_rows
    return copy_rows, path


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _trickle_copy(SRC, DST, n_rows, W, s_pitch, d_pitch, BLOCK: tl.constexpr):
    """Rows of W floats from SRC (pitch s_pitch) to DST (pitch d_pitch), a few programs each walking
    rows; streaming loads and stores (evict first) so the copy does not flush the solve's L2."""
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        r64 = tl.cast(r, tl.int64)      # rows x pitch passes 2**31
        s_row = SRC + r64 * s_pitch
        d_row = DST + r64 * d_pitch
        for c in range(0, W, BLOCK):
            o = c + tl.arange(0, BLOCK)
            v = tl.load(s_row + o, mask=o < W, eviction_policy="evict_first")
            tl.store(d_row + o, v, mask=o < W, eviction_policy="evict_first")


def make_trickle_rows(programs: int):
    """``_copy_rows`` as the few-program copy kernel (falls back to the plain copy off the 2-D form)."""
    plain = euler_graph._copy_rows

    def copy_rows(dst, src, B, Bb):
        a, b = _rows_pitch(dst, 2), _rows_pitch(src, 2)
        if B != Bb or a is None or b is None or a[0] != b[0] or dst.shape != src.shape:
            return plain(dst, src, B, Bb)
        W = dst.shape[-1] * dst.shape[-2]
        _trickle_copy[(programs,)](src, dst, a[0], W, b[1], a[1], BLOCK=4096, num_warps=4)

    return copy_rows


def mechanics(res: dict, cfm, dev, memcpy_rows, budget: float) -> None:
    """(1) Does a graph's external-event wait node hold back only what follows it, or the whole
    launch? A graph [sleep a | wait E | sleep b] against a side stream [sleep c | record E].
    (2) Can the fill overlap the solve at all? The batch-16 replay and an independent whole fill on two
    streams at once, against the two one after the other."""
    cyc = int(torch.cuda.get_device_properties(dev).clock_rate * 1e3 * 5e-3)   # ~5 ms of GPU sleep
    e = torch.cuda.Event(external=True)
    side, main = torch.cuda.Stream(), torch.cuda.Stream()
    e.record(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(main):
        torch.cuda._sleep(cyc)
        g.capture_begin()
        torch.cuda._sleep(cyc)
        e.wait(main)
        torch.cuda._sleep(cyc)
        g.capture_end()
    torch.cuda.synchronize()

    def run():
        side.wait_stream(torch.cuda.current_stream())
        main.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(cyc)
            e.record(side)
        with torch.cuda.stream(main):
            g.replay()
        torch.cuda.current_stream().wait_stream(main)
        torch.cuda.current_stream().wait_stream(side)

    ms = statistics.median(timed(run, budget))
    res["wait_node"] = {"sleep_ms_each": 5.0, "ms": ms, "note": "10 if the wait holds only the second sleep, "
                        "15 if it holds the whole graph launch"}
    print(f"wait node: graph [5 ms | wait | 5 ms] with the event after 5 ms on a side stream: {ms:.2f} ms", flush=True)

    B = 16
    cnn, att, mu, spk, cond = chunk_inputs(B, dev)
    cfg = GraphConfig(batch_buckets=(B,), query_buckets=(T,), offset_bucket=50, offset_anchor=L, max_graphs=4)
    sv = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S, config=cfg,
                          overlap_fill=False)
    sv.solve(mu, spk, cond, cnn, att, copy_out=False)
    st = next(iter(sv._statics.values()))
    spare = torch.empty_like(st.kv[..., T:T + L, :])        # an independent destination: no data race
    copiers = [("SM copy", euler_graph._copy_rows), ("memcpy2D", memcpy_rows)]
    copiers += [(f"{n}-program streaming copy", make_trickle_rows(n)) for n in (8, 16, 32, 66, 132)]
    for name, copier in copiers:
        def fill():
            copier(spare, att, B, B)

        def both():
            cur = torch.cuda.current_stream()
            main.wait_stream(cur)
            side.wait_stream(cur)
            with torch.cuda.stream(main):
                st.graph.replay()
            with torch.cuda.stream(side):
                fill()
            cur.wait_stream(main)
            cur.wait_stream(side)

        t_rep = statistics.median(timed(st.graph.replay, budget))
        t_fill = statistics.median(timed(fill, budget))
        t_both = statistics.median(timed(both, budget))
        res.setdefault("concurrency", []).append({"copy": name, "replay_ms": t_rep, "fill_ms": t_fill,
                                                  "side_by_side_ms": t_both})
        print(f"B=16 replay {t_rep:.2f} ms, fill ({name}) {t_fill:.2f} ms, side by side {t_both:.2f} ms "
              f"(serial sum {t_rep + t_fill:.2f})", flush=True)
    del sv, st, spare, att, cnn
    gc.collect()
    torch.cuda.empty_cache()


def mechanics_md(res: dict) -> list[str]:
    w = res["wait_node"]
    out = ["", "## Mechanics", "",
           f"A graph [5 ms sleep | external-event wait | 5 ms sleep], the event recorded after a 5-ms sleep on a side "
           f"stream: {w['ms']:.2f} ms (10: the wait holds only what follows it; 15: the whole launch).", "",
           "Batch-16 replay and an independent whole fill on two streams at once (ms):", "",
           "| copy | replay alone | fill alone | side by side | serial sum |", "|---|---:|---:|---:|---:|"]
    for r in res["concurrency"]:
        out.append(f"| {r['copy']} | {r['replay_ms']:.2f} | {r['fill_ms']:.2f} | {r['side_by_side_ms']:.2f} | "
                   f"{r['replay_ms'] + r['fill_ms']:.2f} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="16,8")
    ap.add_argument("--budget", type=float, default=0.4)
    ap.add_argument("--mechanics-only", action="store_true")
    ap.add_argument("--memcpy2d", action="store_true", help="also the solve rows with cudaMemcpy2DAsync copies")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": _triton_version(), "rows": []}
    flow = Flow(FULL_SIZE)
    randomize_(flow, 0)
    cfm = flow.to(dev).eval().decoder
    plain = euler_graph._copy_rows
    memcpy_rows, res["cudart"] = make_memcpy2d_rows()
    lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
    res["priority_range"] = [lo, hi]
    hi_stream = torch.cuda.Stream(priority=hi)

    def save():
        (args.out / "fill_overlap_probe.json").write_text(json.dumps(res, indent=1))

    mechanics(res, cfm, dev, memcpy_rows, args.budget)
    save()
    if args.mechanics_only:
        return 0
    for B in [int(b) for b in args.batches.split(",")]:
        cnn, att, mu, spk, cond = chunk_inputs(B, dev)
        cfg = GraphConfig(batch_buckets=(B,), query_buckets=(T,), offset_bucket=50, offset_anchor=L, max_graphs=4)
        solvers = {flag: WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S,
                                          config=cfg, overlap_fill=flag) for flag in (False, True)}
        ref = [t.clone() for t in solvers[False].solve(mu, spk, cond, cnn, att, copy_out=False)]

        # the copy alone: one whole fill, SM kernel vs memcpy2D
        arena = solvers[False]._statics[next(iter(solvers[False]._statics))].kv[..., T:T + L, :]
        for name, fn in (("SM copy", plain), ("memcpy2D", memcpy_rows), ("32-program streaming copy",
                                                                         make_trickle_rows(32))):
            ms = timed(lambda: fn(arena, att, B, B), args.budget)
            res["rows"].append({"batch": B, "variant": f"fill alone, {name}", "ms": statistics.median(ms),
                                "GBps": 2 * att.numel() * 4 / statistics.median(ms) / 1e6})
            print(f"B={B} fill alone {name}: {statistics.median(ms):.2f} ms", flush=True)

        variants = [("one copy before the solve (SM)", False, plain, False),
                    ("overlapped, SM copy", True, plain, False),
                    ("overlapped, SM copy, solve high priority", True, plain, True)]
        if args.memcpy2d:
            variants += [("one copy before the solve (memcpy2D)", False, memcpy_rows, False),
                         ("overlapped, memcpy2D", True, memcpy_rows, False),
                         ("overlapped, memcpy2D, solve high priority", True, memcpy_rows, True)]
        for n in (16, 32, 66):
            variants.append((f"overlapped, {n}-program streaming copy", True, make_trickle_rows(n), False))
        variants.append(("overlapped, 32-program streaming copy, solve high priority", True, make_trickle_rows(32),
                         True))
        times: dict[str, list[float]] = {v[0]: [] for v in variants}
        for rnd in range(3):       # alternate so drift does not favour one variant
            for name, flag, copier, prio in variants:
                euler_graph._copy_rows = copier
                sv = solvers[flag]

                def call():
                    if not prio:
                        return sv.solve(mu, spk, cond, cnn, att, copy_out=False)
                    cur = torch.cuda.current_stream()
                    hi_stream.wait_stream(cur)
                    with torch.cuda.stream(hi_stream):
                        out = sv.solve(mu, spk, cond, cnn, att, copy_out=False)
                    cur.wait_stream(hi_stream)
                    return out

                try:
                    got = call()
                    torch.cuda.synchronize()
                    same = all(torch.equal(a, b) for a, b in zip(got, ref))
                    times[name] += timed(call, args.budget / 3)
                finally:
                    euler_graph._copy_rows = plain
                if rnd == 0:
                    res["rows"].append({"batch": B, "variant": name, "bit_identical": same})
        for r in res["rows"]:
            if r["batch"] == B and r["variant"] in times:
                r["ms"] = statistics.median(times[r["variant"]])
                r["reps"] = len(times[r["variant"]])
                print(f"B={B} {r['variant']:45s} {r['ms']:.2f} ms  identical={r['bit_identical']}", flush=True)
        save()
        del solvers, cnn, att, ref, arena
        gc.collect()
        torch.cuda.empty_cache()

    md = [f"# Arena fill overlap probe ({res['gpu']})", "",
          f"torch {res['torch']}, triton {res['triton']}; ms per steady 1-s chunk solve (fill + replay + read), "
          "medians, variants alternating.", "", "| B | variant | ms | bit-identical to one SM copy |",
          "|---:|---|---:|---|"]
    for r in res["rows"]:
        md.append(f"| {r['batch']} | {r['variant']} | {r['ms']:.2f} | {r.get('bit_identical', '')} |")
    md += mechanics_md(res)
    (args.out / "fill_overlap_probe.md").write_text("\n".join(md) + "\n")
    save()
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
