"""Where the time of the persistent DiT block kernel goes (GPU), batch 1 with CFG at full size.

For each launch configuration: program 0's clock at every grid barrier of one launch over all 16
blocks (per-phase time incl. the wait at the barrier, median over blocks 1-15), the block as one
launch and as one launch per phase (each replayed from a CUDA graph), and the compiled kernel's
registers / spills.

    PYTHONPATH=src:benchmarks python benchmarks/dit_block_profile.py OUT_DIR \
        [--default-only | --key-tiles | --stages | --tiles | --prefetch | --combine] [--fp16]

``--fp16``: FP16 GEMM operands and weights (``FusedDiT(gemm_operands="fp16")``, the flow's default where the
weights' range certificate fits) instead of FP32 ones.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from code2wav_bench import L, T, randomize_  # noqa: E402

from minicpmo_rt.code2wav.flow import Flow  # noqa: E402
from minicpmo_rt.code2wav.flow_config import FULL_SIZE  # noqa: E402
from minicpmo_rt.code2wav.fused_dit import FusedDiT  # noqa: E402
from minicpmo_rt.code2wav.kernels import dit_block  # noqa: E402
from minicpmo_rt.code2wav.kernels.tiled_attention import key_splits  # noqa: E402
from minicpmo_rt.code2wav.precision import matmul_tf32  # noqa: E402

PHASES = ["QKV GEMM", "q/k head LN + cache write", "attention", "split combine", "out-proj GEMM",
          "residual + LN -> conv1 history", "conv1 taps GEMM", "tap sum + LN + Mish", "conv2 taps GEMM",
          "tap sum + residual + LN", "fc1 GEMM + GELU", "fc2 GEMM", "residual + next LN"]


def graph_us(fn, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ts = []
    for _ in range(reps):
        ev[0].record()
        g.replay()
        ev[1].record()
        torch.cuda.synchronize()
        ts.append(ev[0].elapsed_time(ev[1]) * 1e3)
    return statistics.median(ts)


def per_program_profile(block, names, depth, nprog, dev, reps: int = 10) -> dict:
    """Every program's clock at each barrier arrival and departure, over all blocks in one launch:
    per phase (medians over blocks 1-14 and ``reps`` launches) the slowest and the median program's
    work (departure from the previous barrier to arrival), the wait from the last arrival until the
    median program leaves (the barrier's own latency), and the phase's span between departures."""
    n = len(names)
    P = n * depth
    t = torch.zeros(2 * (P + 1), nprog, dtype=torch.int64, device=dev)
    rows = []
    for _ in range(reps):
        t.zero_()
        block(times=t, n=depth, per_program=True)
        torch.cuda.synchronize()
        x = t.double().cpu() / 1e3
        dep, arr = x[0:2 * P - 2:2], x[1:2 * P - 2:2]     # (P-1, nprog): around phases 0..P-2
        leave = x[2:2 * P - 1:2].median(1).values          # median departure after each of them
        work = arr - dep
        stats = torch.stack([work.max(1).values, work.median(1).values, leave - arr.max(1).values,
                             leave - dep.median(1).values], 1)
        rows.append(stats[n:(depth - 1) * n].reshape(depth - 2, n, 4))
    med = torch.cat(rows).median(0).values
    keys = ("work_max_us", "work_median_us", "last_arrival_to_leave_us", "span_us")
    return {name: dict(zip(keys, [round(v, 3) for v in med[i].tolist()])) for i, name in enumerate(names)}


def main(out_dir: str, configs=None, fp16: bool = False) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = "cuda"
    flow = Flow(FULL_SIZE)
    randomize_(flow, 0)
    dit = flow.decoder.estimator.to(dev).eval()
    R = 2
    res = {"gpu": torch.cuda.get_device_name(), "rows": R * T, "cache": L, "operands": "fp16" if fp16 else "fp32",
           "configs": []}
    configs = configs or [{"num_warps": 8}, {"num_warps": 8, "att_splits": 1}]
    with torch.inference_mode(), matmul_tf32(True):
        fused = FusedDiT(dit, attention="triton-tf32", block_kernel=True, gemm_operands="fp16" if fp16 else "fp32")
        xin = torch.randn(R, T, 320, device=dev)
        kv = torch.randn(16, R, 8, T + L, 128, device=dev)
        hist = fused.new_hist(R, T, dev).zero_()     # in the workspace's operand dtype
        ws = fused.workspace(R, T, dev)
        out_t = torch.empty(R, T, 80, device=dev)
        mod = fused.modulation(torch.full((1,), 0.5, device=dev))
        fused.body(xin, mod, hist, kv, None, ws, out_t)      # compile + fill the buffers
        nprog = dit_block.programs(torch.device(dev))

        for cfg in configs:
            saved = dict(dit_block.TILES)
            saved_att = (dit_block.ATT_BM, dit_block.ATT_BN, dit_block.BLOCK_STAGES, dit_block.PREFETCH,
                         dit_block.BULK_PREFETCH, dit_block.LAST_COMBINE)
            dit_block.TILES.update(cfg.get("tiles", {}))
            dit_block.ATT_BM = cfg.get("att_bm", saved_att[0])
            dit_block.ATT_BN = cfg.get("att_bn", saved_att[1])
            dit_block.BLOCK_STAGES = cfg.get("stages", saved_att[2])
            dit_block.PREFETCH = cfg.get("prefetch", saved_att[3])
            dit_block.BULK_PREFETCH = cfg.get("bulk", saved_att[4])
            dit_block.LAST_COMBINE = cfg.get("last_combine", saved_att[5])
            a_splits, per_split = dit_block.attention_splits(R, 8, T, T + L, nprog)
            if "att_splits" in cfg:          # forced key splits (1: no combine phase)
                a_splits, per_split = key_splits(T + L, cfg["att_splits"], dit_block.ATT_BN)
            names = [p for p in PHASES if a_splits > 1 and not dit_block.LAST_COMBINE or p != "split combine"]
            nw = cfg.get("num_warps", 4)
            ws = fused.workspace(R, T, dev)          # split counts follow the tiles
            ws.h.normal_()
            ws.norm.normal_()

            weights = fused._gemm_weights(fp16, True)      # what FusedDiT.blocks passes

            def block(i=0, times=None, phase_by_phase=False, zero=True, n=1, j=0, per_program=False):
                if zero:
                    ws.ctr.zero_()
                return dit_block.dit_blocks(
                    h=ws.h, norm=ws.norm, qkv=ws.qkv, q=ws.q, kv=kv, mask=None, o=ws.o, attn_acc=ws.attn_acc,
                    attn_ml=ws.attn_ml, y=ws.y, hist=hist, taps=ws.taps, mlp=ws.mlp, y2=ws.y2,
                    ctr=ws.ctr[j:j + 1], w=weights, mod_chain=mod.chain, first=i, n_blocks=n, eps=1e-6,
                    qk_eps=1e-6, conv_eps=1e-5, attn_splits=a_splits, keys_per_split=per_split, nprog=nprog,
                    phase_by_phase=phase_by_phase, num_warps=nw, times=times, per_program=per_program,
                    tile_ctr=ws.att_ctr, pv16=fused.attn_pv16, k_step_scale=fused.block_k_step_scale)

            try:
                k = block()
                # stamps of all 16 blocks in one launch, as an evaluation runs them (each block's
                # weights cold in L2, 18 MB a block); medians over blocks 1-15 and 15 launches
                depth = kv.shape[0]
                times = torch.zeros(len(names) * depth + 1, dtype=torch.int64, device=dev)
                per_phase = []
                for _ in range(15):
                    block(times=times, n=depth)
                    torch.cuda.synchronize()
                    per_phase.append(((times[1:] - times[:-1]).double().cpu() / 1e3).view(depth, -1)[1:])
                med = torch.cat(per_phase).median(0).values.tolist()
                one = graph_us(lambda: (ws.ctr.zero_(), [block(i, zero=False, j=i) for i in range(16)])) / 16
                whole = graph_us(lambda: block(0, n=16)) / 16
                staged = graph_us(lambda: [block(i, phase_by_phase=True, zero=False) for i in range(16)]) / 16
                programs = per_program_profile(block, names, depth, nprog, dev)
                row = {"config": {k_: v for k_, v in cfg.items() if k_ != "tiles"} | {"tiles": dict(dit_block.TILES)},
                       "stages": dit_block.BLOCK_STAGES, "prefetch": dit_block.PREFETCH,
                       "bulk_prefetch": dit_block.BULK_PREFETCH, "last_combine": dit_block.LAST_COMBINE,
                       "attention": {"block_m": dit_block.ATT_BM, "block_n": dit_block.ATT_BN, "splits": a_splits},
                       "regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
                       "block_us_one_launch": one, "block_us_all_blocks_one_launch": whole,
                       "block_us_launch_per_phase": staged,
                       "phase_us": dict(zip(names, med)), "phase_sum_us": sum(med), "per_program": programs}
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported
                row = {"config": str(cfg), "error": repr(exc)[:300]}
            finally:
                dit_block.TILES.clear()
                dit_block.TILES.update(saved)
                dit_block.ATT_BM, dit_block.ATT_BN, dit_block.BLOCK_STAGES, dit_block.PREFETCH, \
                    dit_block.BULK_PREFETCH, dit_block.LAST_COMBINE = saved_att
            res["configs"].append(row)
            print(json.dumps(row, indent=1), flush=True)
    (out / "dit_block_profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a not in ("--default-only", "--fp16")]
    configs = None
    if "--default-only" in sys.argv:
        configs = [{"num_warps": 8}]
    elif "--key-tiles" in sys.argv:     # the attention phase's key tile (and query block) sizes
        configs = [{"num_warps": 8}, {"num_warps": 8, "att_bn": 128}, {"num_warps": 8, "att_bn": 256},
                   {"num_warps": 8, "att_bm": 32, "att_bn": 128}]
    elif "--stages" in sys.argv:        # the K loops' pipelining depth
        configs = [{"num_warps": 8, "stages": s} for s in (3, 4, 5, 6)]
    elif "--tiles" in sys.argv:         # GEMM phase K steps under the default stages
        configs = [{"num_warps": 8}, {"num_warps": 8, "tiles": {"fc1": (64, 32, 1, 32)}},
                   {"num_warps": 8, "tiles": {"qkv": (128, 64, 4, 64), "conv": (128, 64, 4, 64)}},
                   {"num_warps": 8, "tiles": {"fc2": (64, 64, 8, 32)}},
                   {"num_warps": 8, "tiles": {"fc2": (64, 64, 4, 64), "proj": (64, 32, 2, 32)}}]
    elif "--prefetch" in sys.argv:      # L2 prefetch schedules (dit_block.PREFETCH)
        configs = [{"num_warps": 8, "prefetch": p} for p in (1, 11)] + [
            {"num_warps": 8, "prefetch": 11, "bulk": False}]
    elif "--combine" in sys.argv:       # key-split partials: a combine phase, or the last split's combine
        configs = [{"num_warps": 8, "last_combine": False}, {"num_warps": 8, "last_combine": True}]
    args = [a for a in args if a not in ("--key-tiles", "--stages", "--tiles", "--prefetch", "--combine")]
    main(args[0] if args else "/tmp/dit_block_profile", configs, fp16="--fp16" in sys.argv)
