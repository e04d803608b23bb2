"""Code2Wav CFM fast-path benchmark (one steady 1-s chunk).

Per chunk: query width 50 mel frames, 10 Euler steps with CFG (2B rows), estimator cache
at its steady length prompt + 100 = 400 frames, batch 1, 4, 8, 16. Rows:

  original eager            reference ``CausalConditionalCFM.forward_chunk`` (IEEE FP32)
  original + graph          Whole-Euler graph over the original body (IEEE FP32)
  fused + graph TF32 on     fused body, TF32 GEMMs, Triton tiled TF32 attention
  fused + graph TF32 on, staged body
                            the same without the persistent block kernel (kernels/dit_block.py,
                            the default up to 256 rows, i.e. batch 1-2): ~14 kernels per block
  fused + graph TF32 on, torch step glue
                            the default with the ~12 torch ops between evaluations instead of
                            the two Euler-step kernels (kernels/euler_step.py)
  fused + graph TF32 on, pointer-load attention
                            the default with the staged body's attention always on pointer loads
                            (``attn_tma=False``; by default, on Hopper with batch >= 8, K/V tiles
                            arrive through TMA descriptors with 64-query blocks and 3 stages)
  fused + graph TF32 on, trimmed, arena / ..., trimmed, direct
                            the solve as the flow calls it, new cache trimmed to prompt + 100 and in
                            memory of its own (``solve(trim=...)``): through the arena (copy in, trim
                            copy out) and on the direct path (each stream's cache read in place, the
                            attention writes the trimmed successor; the default from batch 4, where the
                            staged body runs); also with FP16 operands; "direct everywhere" (direct=True)
                            also at batch 1-2, in the persistent block kernel's attention phase;
                            "direct, pointer loads": the direct attention without the TMA descriptors it
                            builds per (row, head) on Hopper (``FusedDiT.direct_tma = False``)
  fused + graph TF32 off    IEEE GEMMs; attention per the knobs (explicit fused => triton-tf32)
  fused + graph IEEE        IEEE GEMMs and IEEE Triton attention (the <=1e-5 configuration)
  upstream inference_chunk  minicpmo-utils 1.0.7 flow (encoder + CFM, batch 1 only: its
                            buffers hold 2 rows), FP32 and TF32, same weights
  ours flow.inference_chunk reference flow (encoder + CFM, eager), batch 1
  fused + graph TF32 on, slot pool
                            opt-in slot pool (caches resident, prompt 300 + keep 100), all
                            streams at the steady length 400
  fused + graph TF32 on, row merging
                            the slot pool with B streams at DIFFERENT cache lengths (prompt 300
                            + keep 60..100; B=1: one stream at 360) in one merged replay

Graph rows report ``solve`` (input staging + cache copy into the arena + replay) and the
replay alone. Weights are random (timings do not depend on values). The slot-pool rows report
errors (mel, cnn, att) vs per-stream original-body IEEE solves with the dense trim, and the
merged row also vs separate per-stream solves of the same fused path and, for its IEEE twin
(triton-ieee, TF32 off; untimed), vs the IEEE reference. Writes ``code2wav_bench.json`` and
``code2wav_bench.md`` into --out, and ``code2wav_bench.png`` (ms per chunk against batch, with the goals);
``--plot RESULTS.json`` draws only the PNG from an earlier run's JSON, on any machine.

    PYTHONPATH=src python benchmarks/code2wav_bench.py --out benchmarks/results [--upstream DIR]
    PYTHONPATH=src python benchmarks/code2wav_bench.py --out DIR --only slot,merge
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import statistics
import sys
import time
import types
from pathlib import Path

import torch

from minicpmo_rt.atomic import atomic_write, save_png
from minicpmo_rt.code2wav.euler_graph import GraphConfig, WholeEulerSolver
from minicpmo_rt.code2wav.flow import Flow, trim_estimator_att
from minicpmo_rt.code2wav.flow_config import FULL_SIZE
from minicpmo_rt.code2wav.fused_dit import FusedDiT
from minicpmo_rt.code2wav.operand_range import operand_range
from minicpmo_rt.code2wav.precision import matmul_tf32

S, T, L = 10, 50, 400


def randomize_(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))


def timed(fn, budget_s: float = 2.0, max_reps: int = 30, min_reps: int = 3, before=None) -> list[float]:
    """Milliseconds per call (CUDA events), after warm-up; reps fit the time budget.

    ``before`` (untimed) runs before every call, e.g. to rewind state the call advances.
    """
    before = before or (lambda: None)
    before()
    fn()
    torch.cuda.synchronize()
    before()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    reps = int(max(min_reps, min(max_reps, budget_s / max(one, 1e-4))))
    out = []
    for _ in range(reps):
        before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def chunk_flops(B: int, C=512, H=8, D=64, mlp=2048, K=3, n_in=320, n_out=80) -> float:
    R, N = 2 * B, 2 * B * T
    gemm = 2 * N * (C * 3 * H * D + H * D * C + C * mlp + mlp * C) + 2 * 2 * R * (T + K - 1) * C * K * C
    attn = 4 * R * H * T * (T + L) * D
    per_eval = 16 * (gemm + attn) + 2 * N * (n_in * C + C * n_out)
    return S * per_eval


def peak_tflops(tf32: bool) -> float:
    n = 8192
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    with matmul_tf32(tf32):
        ms = statistics.median(timed(lambda: a @ b, budget_s=1.0, max_reps=10))
    return 2 * n ** 3 / ms / 1e9


def count_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def caches(B: int, g: torch.Generator):
    cnn = torch.randn(S, 16, 2 * B, 1024, 2, generator=g).cuda()
    att = torch.randn(S, 16, 2 * B, 8, L, 128, generator=g).cuda()
    return cnn, att


def chunk_inputs(B: int, device="cuda"):
    """One steady chunk's solver inputs at batch B, seeded by B: (cnn, att caches, mu, projected spk, cond)."""
    g = torch.Generator().manual_seed(10 + B)
    cnn, att = caches(B, g)
    mu = torch.randn(B, 80, T, generator=g).to(device)
    spk = torch.randn(B, 80, generator=g).to(device)
    return cnn, att, mu, spk, torch.zeros(B, 80, T, device=device)


def import_upstream(root: Path):
    """Register empty parent packages so stepaudio2's package __init__ (torchaudio, s3tokenizer) never runs."""
    for pkg, rel in (("stepaudio2", ""), ("stepaudio2.cosyvoice2", "cosyvoice2"),
                     ("stepaudio2.cosyvoice2.flow", "cosyvoice2/flow"),
                     ("stepaudio2.cosyvoice2.transformer", "cosyvoice2/transformer"),
                     ("stepaudio2.cosyvoice2.utils", "cosyvoice2/utils")):
        if pkg not in sys.modules:
            m = types.ModuleType(pkg)
            m.__path__ = [str(root / "stepaudio2" / rel)]
            sys.modules[pkg] = m
    import importlib
    return (importlib.import_module("stepaudio2.cosyvoice2.flow.flow"),
            importlib.import_module("stepaudio2.cosyvoice2.flow.flow_matching"),
            importlib.import_module("stepaudio2.cosyvoice2.flow.decoder_dit"),
            importlib.import_module("stepaudio2.cosyvoice2.transformer.upsample_encoder_v2"))


def upstream_flow(root: Path, ours: Flow):
    fl, fm, dd, enc = import_upstream(root)
    c = FULL_SIZE
    e = c.encoder
    encoder = enc.UpsampleConformerEncoderV2(
        input_size=e.input_size, output_size=e.output_size, input_layer=e.input_layer,
        pre_lookahead_len=e.pre_lookahead_len, num_blocks=e.num_blocks, num_up_blocks=e.num_up_blocks,
        up_stride=e.up_stride, up_scale_factor=e.up_scale_factor, attention_heads=e.attention_heads,
        pos_enc_layer_type=e.pos_enc_layer_type, selfattention_layer_type=e.selfattention_layer_type,
        key_bias=e.key_bias, linear_units=e.linear_units, dropout_rate=e.dropout_rate,
        positional_dropout_rate=e.positional_dropout_rate, attention_dropout_rate=e.attention_dropout_rate,
        normalize_before=e.normalize_before)
    d = c.dit
    dit = dd.DiT(in_channels=d.in_channels, out_channels=d.out_channels, mlp_ratio=d.mlp_ratio, depth=d.depth,
                 num_heads=d.num_heads, head_dim=d.head_dim, hidden_size=d.hidden_size)
    cfm = fm.CausalConditionalCFM(dit, inference_cfg_rate=c.decoder.inference_cfg_rate)
    flow = fl.CausalMaskedDiffWithXvec(input_size=c.input_size, output_size=c.output_size,
                                       spk_embed_dim=c.spk_embed_dim, output_type="mel", vocab_size=c.vocab_size,
                                       encoder=encoder, decoder=cfm)
    flow.load_state_dict(ours.state_dict(), strict=True)
    flow.decoder.rand_noise.copy_(ours.decoder.rand_noise)     # same noise frames as ours
    return flow.cuda().eval()


def kernel_profile(fn, top: int = 14) -> list[dict]:
    """CUDA kernels of one call: name, count and total microseconds, largest first."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg.setdefault(e.name[:90], [0, 0.0])
            a[0] += 1
            a[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    rows = [{"kernel": k, "count": int(v[0]), "total_us": v[1]} for k, v in agg.items()]
    return sorted(rows, key=lambda r: -r["total_us"])[:top]


def attention_micro() -> dict:
    """One block's attention (50 queries over 450 keys, 8 heads x 64) at 2 and 32 rows."""
    from minicpmo_rt.code2wav.kernels.tiled_attention import tiled_attention
    out = {}
    for R in (2, 32):
        q = torch.randn(R, 8, T, 64, device="cuda")
        kv = torch.randn(R, 8, T + L, 128, device="cuda")
        k, v = kv[..., :64], kv[..., 64:]
        for bm in (32, 64):
            fn = lambda: tiled_attention(q, k, v, None, precision="tf32", block_m=bm)  # noqa: E731
            out[f"R{R}_tiled_tf32_bm{bm}"] = 1e3 * statistics.median(timed(fn, 0.2, 50))
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
        out[f"R{R}_sdpa"] = 1e3 * statistics.median(timed(fn, 0.2, 50))
    return out


class ieee_cudnn:
    """Bench-local IEEE reference: the original body's Conv1d runs in cuDNN (TF32 by default)."""

    def __enter__(self):
        self.prev = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cudnn.allow_tf32 = self.prev


SLOT_ROW = "fused + graph TF32 on, slot pool"
SLOT_PTR_ROW = "fused + graph TF32 on, slot pool, pointer-load attention"
SLOT16_ROW = "fused + graph TF32 on, slot pool, FP16 operands"
MERGE_ROW = "fused + graph TF32 on, row merging"


def _stream(cache: torch.Tensor, i: int, B: int) -> torch.Tensor:
    """Stream i's (cond, uncond) rows of a (S, depth, 2B, ...) cache: (S, depth, 2, ...)."""
    return torch.cat([cache[:, :, i:i + 1], cache[:, :, B + i:B + i + 1]], 2)


class _Errs:
    """Relative L2 over all streams (sqrt(sum |a-b|^2 / sum |b|^2)) and the largest per-stream one."""

    def __init__(self):
        self.num, self.den, self.worst = {}, {}, {}

    def add(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.shape != want.shape:
            raise ValueError(f"{name}: shape {tuple(got.shape)} vs reference {tuple(want.shape)}")
        d, w = (got.double() - want.double()).norm() ** 2, want.double().norm() ** 2
        self.num[name] = self.num.get(name, 0.0) + float(d)
        self.den[name] = self.den.get(name, 0.0) + float(w)
        self.worst[name] = max(self.worst.get(name, 0.0), math.sqrt(float(d) / max(float(w), 1e-30)))

    def result(self) -> dict:
        out = {k: math.sqrt(self.num[k] / max(self.den[k], 1e-30)) for k in self.num}
        out["max_stream"] = dict(self.worst)
        return out


def merge_lengths(B: int, prompt: int, keep: int) -> list[int]:
    """Cache lengths of the merged row: prompt + keep spread over [0.6 keep, keep] (B=1: 0.6 keep)."""
    lo = keep * 6 // 10
    if B == 1:
        return [prompt + lo]
    return [prompt + lo + round((keep - lo) * i / (B - 1)) for i in range(B)]


def _slot_solver(cfm, cfg, n_steps: int, slots: int, prompt: int, keep: int, query: int, device,
                 attention: str, tf32: bool, use_triton=None, attn_tma=None, gemm_operands="fp32"):
    from minicpmo_rt.code2wav.slot_pool import SlotPool, SlotSolver, default_pool_frames
    solver = SlotSolver(cfm, pool=None, attention=attention, tf32=tf32, n_timesteps=n_steps, config=cfg,
                        use_triton=use_triton, attn_tma=attn_tma, gemm_operands=gemm_operands)
    solver.pool = SlotPool(solver, slots=slots, frames=default_pool_frames(prompt, keep, query), keep=keep,
                           device=device)
    return solver


def slot_row(cfm, cfg, B, cnn, att, mu, spk, cond, ref, row, budget, prompt, keep=100, timer=timed,
             attention="triton-tf32", tf32=True, use_triton=None, attn_tma=None, name=SLOT_ROW,
             gemm_operands="fp32"):
    """Slot pool, all B streams at the bench's cache length (att.shape[4]); errors vs the batched
    IEEE reference ``ref`` (mel, cnn, untrimmed att) with the dense trim applied per stream."""
    solver = _slot_solver(cfm, cfg, cnn.shape[0], B, prompt, keep, mu.shape[2], mu.device, attention, tf32,
                          use_triton, attn_tma, gemm_operands)
    pool = solver.pool
    handles = [pool.admit(_stream(cnn, i, B), _stream(att, i, B), prompt) for i in range(B)]
    mel = solver.solve_slots(handles, mu, spk, cond)
    errs = _Errs()
    errs.add("mel", mel, ref[0])
    for i, h in enumerate(handles):
        c, a = h.dense()
        errs.add("cnn", c, _stream(ref[1], i, B))
        errs.add("att", a, trim_estimator_att(_stream(ref[2], i, B), prompt, keep))
    ms = timer(lambda: solver.solve_slots(handles, mu, spk, cond), budget)
    st = next(iter(solver._statics.values()))
    rep = timer(st.graph.replay, budget) if st.graph is not None else None
    row(name, B, ms, rep, {"rel_err_vs_original_ieee": errs.result(), "graph": st.graph is not None,
                               "pool_frames": pool.frames, "lengths": [att.shape[4]] * B})


def merge_row(cfm, cfg, B, cnn, att, mu, spk, cond, row, budget, prompt, keep=100, timer=timed,
              attention="triton-tf32", tf32=True, use_triton=None, ieee_attention="triton-ieee"):
    """Row merging: B streams whose caches differ in length (``merge_lengths``; the first frames of
    ``att``) solved in ONE replay per chunk, timed at those lengths (before every call the frame lists
    are rewound, untimed; a chunk only writes frames outside them, so the rewound caches are intact).

    Errors (mel, cnn, att; relative L2 over all streams and the worst stream) vs per-stream
    original-body IEEE solves with the dense trim, vs separate per-stream solves of the same fused
    path (a one-slot pool, batch 1), and of the merged IEEE twin (``ieee_attention``, TF32 off;
    untimed; None skips it) vs the IEEE reference.
    """
    n, T, dev = cnn.shape[0], mu.shape[2], mu.device
    lengths = merge_lengths(B, prompt, keep)
    if max(lengths) > att.shape[4]:
        raise ValueError(f"merged row needs caches of {max(lengths)} frames, the bench has {att.shape[4]}")
    dense = lambda i: (_stream(cnn, i, B), _stream(att, i, B)[..., :lengths[i], :])  # noqa: E731
    paths = {"tf32": (attention, tf32)}
    if ieee_attention:
        paths["ieee"] = (ieee_attention, False)
    solvers, handles, mels, admitted = {}, {}, {}, None
    for k, (attn, tf) in paths.items():
        solvers[k] = sv = _slot_solver(cfm, cfg, n, B, prompt, keep, T, dev, attn, tf, use_triton)
        handles[k] = [sv.pool.admit(*dense(i), prompt) for i in range(B)]
        if k == "tf32":   # the admitted frame lists (and their numpy mirrors) to rewind to
            admitted = [(h.frames, h._frames_array()) for h in handles[k]]
        mels[k] = sv.solve_slots(handles[k], mu, spk, cond)
        assert [h.length for h in handles[k]] == [min(L + T, prompt + keep) for L in lengths]
    sep = _slot_solver(cfm, cfg, n, 1, prompt, keep, T, dev, attention, tf32, use_triton)
    vs_ieee, vs_sep, twin = _Errs(), _Errs(), _Errs()
    for i in range(B):
        c0, a0 = dense(i)
        with torch.inference_mode(), matmul_tf32(False), ieee_cudnn():
            r_mel, r_cnn, r_att = cfm.forward_chunk(mu[i:i + 1], spk[i:i + 1], cond[i:i + 1], n_timesteps=n,
                                                    cnn_cache=c0, att_cache=a0)
        ref = (r_mel, r_cnn, trim_estimator_att(r_att, prompt, keep))
        hs = sep.pool.admit(c0, a0, prompt)
        alone = (sep.solve_slots([hs], mu[i:i + 1], spk[i:i + 1], cond[i:i + 1]), *hs.dense())
        hs.release()
        for k, pairs in (("tf32", ((vs_ieee, ref), (vs_sep, alone))), ("ieee", ((twin, ref),))):
            if k not in handles:
                continue
            got = (mels[k][i:i + 1], *handles[k][i].dense())
            for errs, want in pairs:
                for name, g, w in zip(("mel", "cnn", "att"), got, want):
                    errs.add(name, g, w)
        del c0, a0, r_att, ref, alone, got
    del sep
    solvers.pop("ieee", None)
    handles.pop("ieee", None)
    solver, hs_ = solvers["tf32"], handles["tf32"]

    def rewind():   # the handles' numpy mirrors too, so the timed call does not rebuild them
        for h, (f, arr) in zip(hs_, admitted):
            h.frames, h._arr, h._arr_of = f, arr, f

    ms = timer(lambda: solver.solve_slots(hs_, mu, spk, cond), budget, before=rewind)
    st = next(iter(solver._statics.values()))
    rep = timer(st.graph.replay, budget) if st.graph is not None else None
    extra = {"rel_err_vs_original_ieee": vs_ieee.result(), "rel_err_vs_separate_fused": vs_sep.result(),
             "graph": st.graph is not None, "pool_frames": solver.pool.frames, "lengths": lengths}
    if ieee_attention:
        extra["rel_err_ieee_merged_vs_original_ieee"] = twin.result()
    row(MERGE_ROW, B, ms, rep, extra)


def row_selected(name: str, spec: str) -> bool:
    """``--rows``: '|'-separated words; a word matches a row name it is part of, '=word' only the name itself."""
    return any(name == w[1:] if w.startswith("=") else w in name for w in spec.split("|") if w)


GLUE_ROW = "fused + graph TF32 on, torch step glue"
PTR_ROW = "fused + graph TF32 on, pointer-load attention"
CUBLAS_ROW = "fused + graph TF32 on, cuBLAS GEMMs"     # no Triton tile GEMMs (session 9's default)
FP16_ROW = "fused + graph TF32 on, FP16 operands"      # opt-in gemm_operands="fp16" (tile GEMMs' rows)
FP16_TF32PV_ROW = "fused + graph TF32 on, FP16 operands, TF32 P@V"   # the same with P @ V kept in TF32 (A/B)
FP16_BK1_ROW = "fused + graph TF32 on, FP16 operands, block kernel FP32 K steps"   # k_step_scale 1 (A/B)
TRIM_ARENA_ROW = "fused + graph TF32 on, trimmed, arena"         # solve(trim=...) with direct=False
DIRECT_ROW = "fused + graph TF32 on, trimmed, direct"            # solve(trim=...), FP32 operands
DIRECT16_ROW = "fused + graph TF32 on, FP16 operands, trimmed, direct"   # the flow's default where FP16 fits


def flow_row(res: dict) -> str:
    """The row the flow's own path takes: FP16 operands where the weights' range certificate fits (runs from
    before the certificate, whose JSON has none, took FP32 operands)."""
    return DIRECT16_ROW if res.get("operand_range", {}).get("fits_fp16") else DIRECT_ROW


DIRECT_S2_ROW = "fused + graph TF32 on, trimmed, direct, 2 key splits"    # launch-shape A/B
DIRECT_ALL_ROW = "fused + graph TF32 on, trimmed, direct everywhere"   # direct=True: the block kernel's too (B=1-2)
DIRECT_PTR_ROW = "fused + graph TF32 on, trimmed, direct, pointer loads"   # direct_tma=False (A/B of the TMA loads)
DIRECT16_ALL_ROW = "fused + graph TF32 on, FP16 operands, trimmed, direct everywhere"   # DIRECT_ALL_ROW, FP16 operands
TRIMMED_ROWS = (TRIM_ARENA_ROW, DIRECT_ROW, DIRECT16_ROW, DIRECT_S2_ROW, DIRECT_ALL_ROW, DIRECT_PTR_ROW, DIRECT16_ALL_ROW)
ROW_GROUPS = ("kernels", "original", "graphs", "slot", "merge", "flow", "hift")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,16,4,8")
    ap.add_argument("--upstream", type=Path, default=None, help="folder holding the stepaudio2 package source")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of timing per cell")
    ap.add_argument("--only", default="", help="comma list of row groups to run (default: all): "
                    + ", ".join(ROW_GROUPS) + "; e.g. --only slot,merge")
    ap.add_argument("--rows", default="", help="'|'-separated substrings: only the graph rows whose names "
                    "hold one (default: all), e.g. 'TF32 on|TMA'; '=NAME' matches that whole name only, "
                    "e.g. '=fused + graph TF32 on|TMA'")
    ap.add_argument("--plot", type=Path, default=None, metavar="JSON",
                    help="only draw code2wav_bench.png into --out from a results JSON this script wrote (no GPU)")
    args = ap.parse_args(argv)
    if args.plot is not None:
        return plot_file(args.plot, args.out)
    batches = [int(b) for b in args.batches.split(",")]
    only = {w.strip() for w in args.only.split(",") if w.strip()}
    if only - set(ROW_GROUPS):
        ap.error(f"unknown row group(s) {sorted(only - set(ROW_GROUPS))}; choose from {', '.join(ROW_GROUPS)}")
    on = lambda group: not only or group in only  # noqa: E731
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)
    flow = Flow(FULL_SIZE)
    randomize_(flow, 0)
    flow = flow.to(dev).eval()
    cfm = flow.decoder
    res = {"gpu": gpu, "torch": torch.__version__, "triton": _triton_version(), "query": T, "steps": S,
           "cache": L, "cfg": True, "rows": [], "notes": []}
    rng = operand_range(cfm.estimator, S)     # decides the flow's GEMM operands (knobs: cfm_fp16_operands unset)
    res["operand_range"] = {"fits_fp16": rng.fits_fp16, "describe": rng.describe(), "activations": rng.activations,
                            "weights": rng.weights}
    args.out.mkdir(parents=True, exist_ok=True)

    def save():   # after every row, so a cut-off run still leaves its numbers (each file whole, never torn)
        atomic_write(args.out / "code2wav_bench.json", lambda f: f.write(json.dumps(res, indent=1).encode()))
        atomic_write(args.out / "code2wav_bench.md", lambda f: f.write(markdown(res).encode()))

    res["peak_tf32_tflops"] = peak_tflops(True)
    res["peak_fp32_tflops"] = peak_tflops(False)
    print(f"{gpu}: TF32 mm peak {res['peak_tf32_tflops']:.0f} TFLOP/s, FP32 {res['peak_fp32_tflops']:.0f}", flush=True)

    if on("kernels"):
        # kernels per block: one estimator evaluation at batch 1, divided by depth
        g = torch.Generator().manual_seed(1)
        cnn, att = caches(1, g)
        x = torch.randn(2, 80, T, device=dev)
        mu, spk, cond = torch.randn(2, 80, T, device=dev), torch.randn(2, 80, device=dev), torch.zeros(2, 80, T, device=dev)
        tt = torch.full((2,), 0.5, device=dev)
        with torch.inference_mode():
            k_orig = count_kernels(lambda: cfm.estimator.forward_chunk(x, mu, tt, spk, cond, cnn[0], att[0]))
            fused = FusedDiT(cfm.estimator, attention="triton-tf32")
            xin = torch.cat([x, mu, spk[:, :, None].expand(-1, -1, T), cond], 1).transpose(1, 2).contiguous()
            kv = torch.empty(16, 2, 8, T + L, 128, device=dev)
            kv[:, :, :, T:] = att[0]
            hist = fused.new_hist(2, T, dev).zero_()
            ws = fused.workspace(2, T, dev)
            out = torch.empty(2, T, 80, device=dev)
            with matmul_tf32(True):
                mod = fused.modulation(tt[:1])
                body = lambda: fused.body(xin, mod, hist, kv, None, ws, out)  # noqa: E731
                k_fused = count_kernels(body)
                res["fused_eval_kernels_b1_tf32"] = kernel_profile(body)
            res["original_eval_kernels_b1"] = kernel_profile(
                lambda: cfm.estimator.forward_chunk(x, mu, tt, spk, cond, cnn[0], att[0]))
        res["kernels_per_block"] = {"original": k_orig / 16, "fused": k_fused / 16,
                                    "note": "CUDA kernels (incl. copies) of one estimator evaluation / depth"}
        print(f"kernels per block: original {k_orig / 16:.1f}, fused {k_fused / 16:.1f}", flush=True)
        for r in res["fused_eval_kernels_b1_tf32"]:
            print(f"    {r['count']:4d} {r['total_us']:9.1f} us  {r['kernel']}", flush=True)
        del kv, hist, ws, fused
        res["attention_us"] = attention_micro()
        print(f"attention micro-bench (us): {res['attention_us']}", flush=True)
    save()

    def row(name, B, ms, replay=None, extra=None):
        r = {"row": name, "batch": B, "median_ms": statistics.median(ms), "reps": len(ms),
             "min_ms": min(ms)}
        if replay is not None:
            r["replay_median_ms"] = statistics.median(replay)
        r["tf32_peak_fraction"] = chunk_flops(B) / (r["median_ms"] * 1e9) / res["peak_tf32_tflops"]
        r.update(extra or {})
        res["rows"].append(r)
        save()
        print(f"  {name:32s} B={B:2d} {r['median_ms']:9.2f} ms" +
              (f"  (replay {r['replay_median_ms']:.2f} ms)" if replay else ""), flush=True)

    cfg = GraphConfig(batch_buckets=tuple(sorted(set(batches))), query_buckets=(T,), offset_bucket=50,
                      offset_anchor=L, max_graphs=32)
    variants = [("original + graph", dict(body="original", tf32=False)),
                ("fused + graph TF32 on", dict(body="fused", attention="triton-tf32", tf32=True)),
                ("fused + graph TF32 on, staged body", dict(body="fused", attention="triton-tf32", tf32=True,
                                                            block_kernel=False)),
                (GLUE_ROW, dict(body="fused", attention="triton-tf32", tf32=True, step_kernels=False)),
                (PTR_ROW, dict(body="fused", attention="triton-tf32", tf32=True, attn_tma=False)),
                (CUBLAS_ROW, dict(body="fused", attention="triton-tf32", tf32=True, wide_gemm=False)),
                (FP16_ROW, dict(body="fused", attention="triton-tf32", tf32=True, gemm_operands="fp16")),
                (FP16_TF32PV_ROW, dict(body="fused", attention="triton-tf32", tf32=True, gemm_operands="fp16")),
                (FP16_BK1_ROW, dict(body="fused", attention="triton-tf32", tf32=True, gemm_operands="fp16")),
                (TRIM_ARENA_ROW, dict(body="fused", attention="triton-tf32", tf32=True, direct=False)),
                (DIRECT_ROW, dict(body="fused", attention="triton-tf32", tf32=True)),
                (DIRECT16_ROW, dict(body="fused", attention="triton-tf32", tf32=True, gemm_operands="fp16")),
                (DIRECT_S2_ROW, dict(body="fused", attention="triton-tf32", tf32=True, attn_splits=2)),
                (DIRECT_ALL_ROW, dict(body="fused", attention="triton-tf32", tf32=True, direct=True)),
                (DIRECT16_ALL_ROW, dict(body="fused", attention="triton-tf32", tf32=True, direct=True,
                                        gemm_operands="fp16")),
                (DIRECT_PTR_ROW, dict(body="fused", attention="triton-tf32", tf32=True)),
                ("fused + graph TF32 off", dict(body="fused", attention="triton-tf32", tf32=False)),
                ("fused + graph IEEE", dict(body="fused", attention="triton-ieee", tf32=False))]

    def cfm_rows(B):
        cnn, att, mu, spk, cond = chunk_inputs(B, dev)
        eager = lambda: cfm.forward_chunk(mu, spk, cond, n_timesteps=S, cnn_cache=cnn, att_cache=att)  # noqa: E731
        ref = None
        if on("graphs") or on("slot"):
            with matmul_tf32(False), ieee_cudnn():
                ref = eager()
        if on("original"):
            with matmul_tf32(False):
                row("original eager", B, timed(eager, args.budget))
            if B == 1:
                with matmul_tf32(True):
                    row("original eager TF32", B, timed(eager, args.budget))
        for name, kw in (variants if on("graphs") else []):
            if args.rows and not row_selected(name, args.rows):
                continue
            solver = WholeEulerSolver(cfm, n_timesteps=S, config=cfg, **kw)
            if name == FP16_TF32PV_ROW:
                solver.fused.attn_pv16 = False
            if name == FP16_BK1_ROW:
                solver.fused.block_k_step_scale = 1
            if name == DIRECT_PTR_ROW:
                solver.fused.direct_tma = False
            trim = (L - 100, 100) if name in TRIMMED_ROWS else None
            last = [solver.solve(mu, spk, cond, cnn, att, copy_out=False, trim=trim)]
            want = ref if trim is None else (ref[0], ref[1], trim_estimator_att(ref[2], *trim))
            errs = [_rel(a, b) for a, b in zip(last[0], want)]
            st = next(iter(solver._statics.values()))

            def call():     # the last result stays alive: a direct replay writes into its successor
                last[0] = solver.solve(mu, spk, cond, cnn, att, copy_out=False, trim=trim)

            ms = timed(call, args.budget)
            rep = timed(st.graph.replay, args.budget) if st.graph is not None else None
            extra = {"rel_err_vs_original_ieee": {"mel": errs[0], "cnn": errs[1], "att": errs[2]},
                     "graph": st.graph is not None, "direct": bool(st.key.direct)}
            if B == 1 and kw["body"] == "fused":   # what one graph replay launches (the eager solve's kernels)
                with matmul_tf32(kw["tf32"]):
                    extra["kernels_per_chunk"] = count_kernels(
                        lambda: solver.solve(mu, spk, cond, cnn, att, graph=False, copy_out=False, trim=trim))
            row(name, B, ms, rep, extra)
            del solver, st, last
            gc.collect()
            torch.cuda.empty_cache()
        # opt-in slot pool (prompt 300 + keep 100): equal lengths, then merged different lengths
        slot_ptr = functools.partial(slot_row, attn_tma=False, name=SLOT_PTR_ROW)
        slot16 = functools.partial(slot_row, gemm_operands="fp16", name=SLOT16_ROW)
        for group, what, fn, args_ in (("slot", "slot pool", slot_row, (ref,)),
                                       ("slot", "slot pool, pointer loads", slot_ptr, (ref,)),
                                       ("slot", "slot pool, FP16 operands", slot16, (ref,)),
                                       ("merge", "row merging", merge_row, ())):
            if not on(group):
                continue
            try:
                fn(cfm, cfg, B, cnn, att, mu, spk, cond, *args_, row, args.budget, L - 100)
            except Exception as exc:  # noqa: BLE001 - opt-in rows
                res["notes"].append(f"{what} row B={B} failed: {exc!r}")
                print(f"{what} row B={B} failed: {exc!r}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
        del cnn, att, ref
        gc.collect()
        torch.cuda.empty_cache()

    cfm_rows(batches[0])

    if on("flow"):
        # whole flow chunk (encoder + CFM), batch 1: upstream's inference_chunk vs ours (eager)
        g = torch.Generator().manual_seed(99)
        prompt = torch.randint(0, 6561, (1, L // 2 + 3), generator=g).cuda()
        pmel = torch.randn(1, L, 80, generator=g).cuda()
        spk192 = torch.randn(1, 192, generator=g).cuda()
        toks = torch.randint(0, 6561, (1, 28), generator=g).cuda()
        with matmul_tf32(False):
            cache = flow.setup_cache(prompt, pmel, spk192)
            row("ours flow.inference_chunk eager", 1, timed(lambda: flow.inference_chunk(toks, spk192, cache), args.budget))
        if args.upstream is not None:
            try:
                up = upstream_flow(args.upstream, flow)
                with matmul_tf32(False):   # parity first: its caches are views of buffers each call rewrites
                    ucache = {k: v.clone() for k, v in up.setup_cache(prompt, pmel, spk192).items()}
                    m_up, _ = up.inference_chunk(toks, spk192, ucache)
                    m_ours, _ = flow.inference_chunk(toks, spk192, cache)
                res["notes"].append(f"upstream vs ours flow chunk mel rel err {_rel(m_ours, m_up):.2e} (same weights, "
                                    "same noise, matmul IEEE)")
                for tf32 in (False, True):
                    with matmul_tf32(tf32):
                        ucache = up.setup_cache(prompt, pmel, spk192)
                        row(f"upstream inference_chunk {'TF32' if tf32 else 'FP32'}", 1,
                            timed(lambda: up.inference_chunk(toks, spk192, ucache), args.budget))
                del up, ucache
                gc.collect()
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - the baseline row is optional
                res["notes"].append(f"upstream baseline failed: {exc!r}")
                print(f"upstream baseline failed: {exc!r}", flush=True)
            save()

    if on("hift"):
        hift_rows(res, row, args.budget)
    for B in batches[1:]:
        cfm_rows(B)
    if plottable(res["rows"]):     # once, at the end (--plot draws a cut-off run's from its JSON)
        plot(res, args.out / "code2wav_bench.png")
    print(markdown(res))
    return 0


def hift_rows(res, row, budget) -> None:
    """HiFT at a steady stream chunk: 8 cached + 50 new mel frames, 3840 cached excitation samples."""
    try:
        from minicpmo_rt.code2wav.hift import FULL_SIZE as HIFT_FULL, HiFTGenerator
        from minicpmo_rt.code2wav.hift_graph import GraphedHiFT
        from minicpmo_rt.code2wav.precision import ieee_fp32
        model = HiFTGenerator(HIFT_FULL)
        randomize_(model, 3)
        model = model.cuda().eval()
        graphed = GraphedHiFT(model)
        for B in (1, 16):
            mel = torch.randn(B, 80, 58, device="cuda")
            src = 0.01 * torch.randn(B, 1, 3840, device="cuda")
            with ieee_fp32(), torch.inference_mode():
                gen = torch.Generator(device="cuda").manual_seed(0)
                want = model(mel, src, generator=gen)[0]
                row("HiFT eager (58 mel, cached source)", B, timed(lambda: model(mel, src), budget))
            got = graphed(mel, src, generator=torch.Generator(device="cuda").manual_seed(0))[0]
            row("HiFT graphs (58 mel, cached source)", B, timed(lambda: graphed(mel, src, copy_out=False), budget),
                extra={"rel_err_vs_eager": _rel(got, want)})
    except Exception as exc:  # noqa: BLE001
        res["notes"].append(f"HiFT rows failed: {exc!r}")
        print(f"HiFT rows failed: {exc!r}", flush=True)


def _rel(a, b, chunk: int = 1 << 26) -> float:
    """||a - b|| / ||b|| in FP64, a slice of at most ``chunk`` elements at a time (a batch-16 cache is 8.4 GB in
    FP32: whole FP64 copies of it did not fit beside the solver on an 80-GB H100)."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    num = den = 0.0
    for i in range(0, b.numel(), chunk):
        x, y = a[i:i + chunk].double(), b[i:i + chunk].double()
        num += float(((x - y) ** 2).sum())
        den += float((y ** 2).sum())
    return (num ** 0.5) / max(den ** 0.5, 1e-30)


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "absent"


# The rows drawn by ``plot`` (those with several batches), the flow's own path first, and the goals.
PLOT_ROWS = (DIRECT_ROW, "original eager", "original + graph", "fused + graph TF32 off", "fused + graph IEEE",
             SLOT_ROW, MERGE_ROW, DIRECT16_ROW, SLOT16_ROW)
GOALS_MS = {1: 5.0, 16: 15.0}
UPSTREAM_H100_MS = {1: 17.7, 16: 39.9}      # upstream's published Whole-Euler figures (vllm-omni, H100)


def plottable(rows: list[dict]) -> bool:
    """Does one of ``PLOT_ROWS`` have two batches or more (a line to draw)?"""
    return any(len({r["batch"] for r in rows if r["row"] == name}) > 1 for name in PLOT_ROWS)


def plot(res: dict, path: Path) -> None:
    """ms per steady chunk against batch (both axes log) for the rows of ``PLOT_ROWS`` the run has, with the
    issue's goals and upstream's published H100 figures as points; written whole or not at all."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5.5))
    for name in PLOT_ROWS:
        pts = sorted((r["batch"], r["median_ms"]) for r in res["rows"] if r["row"] == name)
        if len(pts) < 2:
            continue
        ours = name == flow_row(res)
        ax.plot(*zip(*pts), marker="o", ms=4, lw=2.6 if ours else 1.1, zorder=3 if ours else 2,
                label=name + (" (the flow's path)" if ours else ""))
    ax.scatter(list(GOALS_MS), list(GOALS_MS.values()), marker="*", s=180, color="red", zorder=4,
               label="goal (issue #7)")
    ax.scatter(list(UPSTREAM_H100_MS), list(UPSTREAM_H100_MS.values()), marker="s", s=40, color="black", zorder=4,
               label="upstream's published figure (H100)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    batches = sorted({r["batch"] for r in res["rows"]})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch (streams; 2 rows each with CFG)")
    ax.set_ylabel("ms per steady 1-s chunk (log), as called")
    ax.set_title(f"Code2Wav CFM, {res['steps']} Euler steps, query {res['query']}, cache {res['cache']} ({res['gpu']})",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_png(fig, path)


def plot_file(results: Path, out: Path) -> int:
    """``--plot``: draw ``out``/code2wav_bench.png from a results JSON."""
    try:
        res = json.loads(results.read_text())
        rows = res["rows"]
        for key in ("gpu", "steps", "query", "cache"):     # the title's
            res[key]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"--plot {results}: not a results JSON of this script ({exc}); pass a code2wav_bench*.json",
              file=sys.stderr)
        return 2
    if not plottable(rows):
        print(f"--plot {results}: no row of {PLOT_ROWS[0]!r} and the others at two batches or more; nothing to draw",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    plot(res, out / "code2wav_bench.png")
    print(f"wrote {out / 'code2wav_bench.png'}")
    return 0


def markdown(res: dict) -> str:
    lines = [f"# Code2Wav CFM chunk benchmark on {res['gpu']}", "",
             f"torch {res['torch']}, triton {res['triton']}; per steady 1-s chunk: query {res['query']} mel frames, "
             f"{res['steps']} Euler steps with CFG, estimator cache {res['cache']} frames. Medians of CUDA-event timings.",
             f"Measured matmul peak: TF32 {res['peak_tf32_tflops']:.0f} TFLOP/s, FP32 {res['peak_fp32_tflops']:.0f} TFLOP/s."]
    if "operand_range" in res:
        lines.append(f"The weights' FP16 range certificate: {res['operand_range']['describe']}; the flow's own path "
                     f"is the row '{flow_row(res)}'.")
    if "kernels_per_block" in res:
        lines.append(f"Kernels per DiT block: original {res['kernels_per_block']['original']:.1f}, "
                     f"fused {res['kernels_per_block']['fused']:.1f}.")
    lines.append("")
    batches = sorted({r["batch"] for r in res["rows"]})
    names = list(dict.fromkeys(r["row"] for r in res["rows"]))
    cell = {(r["row"], r["batch"]): r for r in res["rows"]}
    lines.append("| row | " + " | ".join(f"B={b} ms" for b in batches) + " | x vs original eager (B=1) |")
    lines.append("|---|" + "---|" * (len(batches) + 1))
    base = cell.get(("original eager", 1))
    for n in names:
        vals = []
        for b in batches:
            r = cell.get((n, b))
            if r is None:
                vals.append("—")
            else:
                s = f"{r['median_ms']:.2f}"
                if "replay_median_ms" in r:
                    s += f" (replay {r['replay_median_ms']:.2f})"
                vals.append(s)
        r1 = cell.get((n, 1))
        ratio = f"{base['median_ms'] / r1['median_ms']:.1f}x" if base and r1 and not n.startswith("HiFT") else "—"
        lines.append(f"| {n} | " + " | ".join(vals) + f" | {ratio} |")
    lines += ["", "Errors vs the original body in IEEE FP32 (relative L2; mel, cnn cache, att cache), per batch:", ""]
    by_row: dict[str, list[str]] = {}
    for r in res["rows"]:
        if "rel_err_vs_original_ieee" in r:
            e = r["rel_err_vs_original_ieee"]
            by_row.setdefault(r["row"], []).append(f"B={r['batch']} {e['mel']:.1e}, {e['cnn']:.1e}, {e['att']:.1e}")
    lines += [f"- {row}: " + "; ".join(errs) for row, errs in by_row.items()]
    counted = [r for r in res["rows"] if "kernels_per_chunk" in r]
    if counted:
        lines += ["", "CUDA kernels one chunk's solve launches (eager, batch 1; a replay runs the same kernels):", ""]
        lines += [f"- {r['row']}: {r['kernels_per_chunk']}" for r in counted]
    pooled = [r for r in res["rows"] if r["row"] in (SLOT_ROW, SLOT_PTR_ROW, SLOT16_ROW, MERGE_ROW)]
    if pooled:
        lines += ["", "Slot pool / row merging, every batch (relative L2 over all streams, worst stream in "
                  "brackets; mel, cnn cache, att cache after the trim):", ""]
        fmt = lambda e: ", ".join(f"{e[k]:.1e} [{e['max_stream'][k]:.1e}]" for k in ("mel", "cnn", "att"))  # noqa: E731
        for r in pooled:
            ls = r.get("lengths") or [0]
            span = f"{min(ls)}" if min(ls) == max(ls) else f"{min(ls)}..{max(ls)}"
            lines.append(f"- {r['row']} B={r['batch']} (cache {span} frames, slot {r.get('pool_frames')}): "
                         f"vs original IEEE {fmt(r['rel_err_vs_original_ieee'])}")
            if "rel_err_vs_separate_fused" in r:
                lines.append(f"  - merged vs separate per-stream solves (same fused TF32 path): "
                             f"{fmt(r['rel_err_vs_separate_fused'])}")
            if "rel_err_ieee_merged_vs_original_ieee" in r:
                lines.append(f"  - IEEE twin (triton-ieee, TF32 off), merged vs original IEEE: "
                             f"{fmt(r['rel_err_ieee_merged_vs_original_ieee'])}")
    lines += ["", "Fraction of the measured TF32 matmul peak (useful FLOPs / time):", ""]
    for r in res["rows"]:
        if r["row"].startswith("fused + graph TF32 on"):
            lines.append(f"- {r['row']} B={r['batch']}: {100 * r['tf32_peak_fraction']:.2f}% "
                         f"({chunk_flops(r['batch']) / 1e9:.1f} GFLOP per chunk)")
    for key, title in (("fused_eval_kernels_b1_tf32", "fused body, TF32"),
                       ("original_eval_kernels_b1", "original body")):
        if key in res:
            lines += ["", f"Kernels of one estimator evaluation (16 blocks, batch 1, {title}), by total time:", "",
                      "| kernel | count | total us |", "|---|---|---|"]
            lines += [f"| `{r['kernel']}` | {r['count']} | {r['total_us']:.1f} |" for r in res[key]]
    lines.append("")
    for r in res["rows"]:
        if "rel_err_vs_eager" in r:
            lines.append(f"- {r['row']} B={r['batch']}: rel err vs eager {r['rel_err_vs_eager']:.1e}")
    if res["notes"]:
        lines += ["", *[f"- {n}" for n in res["notes"]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
