"""Feature-extractor throughput (session-seconds per second) for both modes.

A synthetic EasyCom session (default 60 s, 1920x1080, 20 fps, H.264, 6-ch 48 kHz WAVs) is
extracted with full-size random Thinker weights in bf16 on the GPU, at the default audit
cadence (first clean replay / future intervention only; every boundary and restoration
check) and at --verify-every 250 --future-intervention-every 250. Prints a table and writes
features_bench.json / features_bench.md to OUT.

    python benchmarks/features_bench.py OUT                 # GPU, full size
    python benchmarks/features_bench.py OUT --tiny          # CPU smoke test at tiny size

Goals (issue 5): native >= 60x real time, cached-partial >= 20x real time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import zlib
from pathlib import Path

import torch

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import reference_config
from minicpmo_rt.checkpoint.tokenizer import load_tokenizer, vendored_tokenizer_dir
from minicpmo_rt.features import extract as ex
from minicpmo_rt.features.synthetic import make_session

GOALS = {"native-1hz-hold": 60.0, "cached-partial-5hz": 20.0}


def randomize_on_device_(module: torch.nn.Module, seed: int = 0) -> None:
    """The tiny checkpoint's init rules (norm scales ~1, small biases, N(0, 1/fan_in) weights),
    drawn on the module's device so full-size weights take seconds, not minutes."""
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=True).items():
            if not t.is_floating_point():
                continue
            g = torch.Generator(device=t.device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            leaf, lname = name.rsplit(".", 1)[-1], name.lower()
            is_norm = any(k in lname for k in ("norm", "ln_", ".ln", "layernorm"))
            r = torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32)
            if t.ndim <= 1 and is_norm and leaf in ("weight", "gamma", "scale"):
                r = 1.0 + 0.1 * r
            elif leaf in ("bias", "beta") or t.ndim <= 1:
                r = 0.02 * r
            else:
                fan_in = t[0].numel() if t.ndim > 1 else 1
                r = r / max(fan_in, 1) ** 0.5
            t.copy_(r.to(t.dtype))


def build_factory(tiny: bool, out: Path, device: torch.device, dtype: torch.dtype, fast: bool | None = None):
    from minicpmo_rt.thinker.model import Thinker

    if tiny:
        from minicpmo_rt.snapshot_tools import make_tiny

        ckpt = out / "tiny_ckpt"
        if not (ckpt / "config.json").is_file():
            make_tiny(ckpt, seed=0, force=True)
        thinker = Thinker.from_snapshot(ckpt, dtype=dtype, device=device)
        tok = load_tokenizer(ckpt)
        name = "tiny random"
    else:
        cfg = MiniCPMOConfig.from_dict(reference_config())
        with torch.device(device):
            thinker = Thinker(cfg)  # built in place so non-persistent buffers are computed, not garbage
        randomize_on_device_(thinker)
        thinker = thinker.to(device=device, dtype=dtype).eval()
        thinker.rebuild_buffers()  # fp32 RoPE frequencies after the cast
        tok = load_tokenizer(vendored_tokenizer_dir())
        name = "full-size random"
    info = {"model_id": f"{name} weights (benchmark)", "model_path": None, "revision": "random",
            "revision_source": "benchmark", "dtype": str(dtype).replace("torch.", ""), "device": str(device),
            "attention": "sdpa"}
    # the extractor's own session factory: on CUDA every fast path, shared by all sessions of the run
    factory, used = ex.session_factory(thinker, tok, fast=fast)
    info["session_fast_paths"] = used
    return factory, info, sum(p.numel() for p in thinker.parameters())


def write_torch_profile(prof, path: Path, wall_s: float) -> None:
    """Named ranges (wall time on the host, kernel time under them) and the top kernels."""
    ev = prof.key_averages()
    dev = lambda e: getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)  # noqa: E731
    named = [e for e in ev if e.key.split(".")[0] in ("session", "partial", "native", "audit", "inputs")]
    kernels = [e for e in ev if getattr(e, "device_type", None) is not None and "cuda" in str(e.device_type).lower()
               and dev(e) > 0 and e.key not in {n.key for n in named}]
    busy = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) for e in kernels)
    lines = [f"run wall {wall_s:.3f} s (profiled); GPU kernel busy {busy / 1e6:.3f} s", "",
             "| range | calls | host ms total | host ms/call | GPU ms under it |", "|---|---:|---:|---:|---:|"]
    for e in sorted(named, key=lambda e: -e.cpu_time_total):
        lines.append(f"| {e.key} | {e.count} | {e.cpu_time_total / 1e3:.1f} | {e.cpu_time_total / 1e3 / e.count:.2f} "
                     f"| {dev(e) / 1e3:.1f} |")
    lines += ["", "| kernel | calls | GPU ms |", "|---|---:|---:|"]
    for e in sorted(kernels, key=lambda e: -(getattr(e, "self_device_time_total", 0) or 0))[:40]:
        lines.append(f"| `{e.key[:160]}` | {e.count} | {(getattr(e, 'self_device_time_total', 0) or 0) / 1e3:.1f} |")
    lines += kernels_by_range(prof)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:30]), flush=True)


def kernels_by_range(prof, top: int = 12) -> list[str]:
    """The top kernels launched under each named range, so a kernel name says which stage spends
    it. Kernels replayed from a CUDA graph are not attributed (torch 2.11's profiler does not tie
    them to the graph launch): they appear in the run's kernel totals only, and
    ``stage_ops_profile.py`` names them by running the graphed bodies eagerly."""
    per: dict[str, dict[str, list[float]]] = {}

    def walk(evt, into):
        for k in getattr(evt, "kernels", []) or []:
            slot = into.setdefault(k.name, [0, 0.0])
            slot[0] += 1
            slot[1] += k.duration
        for c in evt.cpu_children:
            walk(c, into)

    for evt in prof.events():
        if evt.name.split(".")[0] in ("session", "partial", "native", "audit", "inputs"):
            walk(evt, per.setdefault(evt.name, {}))
    lines = []
    for name, ks in sorted(per.items(), key=lambda kv: -sum(v[1] for v in kv[1].values())):
        total = sum(v[1] for v in ks.values())
        if total <= 0:
            continue
        lines += ["", f"### kernels under {name}: {total / 1e3:.1f} GPU ms", "",
                  "| kernel | calls | GPU ms |", "|---|---:|---:|"]
        for k, (n, us) in sorted(ks.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"| `{k[:160]}` | {n} | {us / 1e3:.1f} |")
    return lines


class SyncCensus:
    """Counts host-device synchronisations by call site (``torch.cuda.set_sync_debug_mode``).

    Each synchronising call raises a warning; the hook keys it by the innermost frames inside
    this project, so the table says which line of ours waited for the GPU and how often."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.sites: dict[tuple[str, ...], int] = {}

    def __enter__(self) -> "SyncCensus":
        if not self.enabled:
            return self
        import traceback
        import warnings

        self._old_mode = torch.cuda.get_sync_debug_mode()
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")

        def hook(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return
            frames = [f for f in traceback.extract_stack()[:-1] if "minicpmo_rt" in f.filename][-3:]
            key = tuple(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames)) or ("(outside)",)
            self.sites[key] = self.sites.get(key, 0) + 1

        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            torch.cuda.set_sync_debug_mode(self._old_mode)
            self._catch.__exit__(*exc)

    def write(self, path: Path, seconds: float) -> None:
        total = sum(self.sites.values())
        lines = [f"host-device synchronisations: {total} in {seconds:.0f} session s ({total / seconds:.1f} per s)", "",
                 "| count | per session s | call site (innermost first) |", "|---:|---:|---|"]
        for key, n in sorted(self.sites.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {n} | {n / seconds:.2f} | {' <- '.join(key)} |")
        path.write_text("\n".join(lines) + "\n")
        print("\n".join(lines[:25]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny checkpoint, 4-s 64x48 session, CPU")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--decoder", default="pyav", choices=("pyav", "decord"))
    ap.add_argument("--decoder-threads", type=int, default=0,
                    help="decoder threads (0: FFmpeg's choice, all cores; the seed's commands use 1)")
    ap.add_argument("--periodic", type=int, default=250, help="N of the periodic-audit configuration")
    ap.add_argument("--plain", action="store_true", help="the plain reference session even on CUDA (the "
                    "extractor's default there is every fast path: static-cache Triton prefill from graphs, GPU "
                    "frame preprocessing, vision and audio graphs, pooled decoders)")
    ap.add_argument("--profile", action="store_true", help="cProfile each timed run; top functions to OUT/profile_*.txt")
    ap.add_argument("--torch-profile", action="store_true",
                    help="torch.profiler (CPU + CUDA) around each timed run; the named stage ranges "
                    "(session.*, partial.*, native.*) and top kernels to OUT/torch_profile_*.txt")
    ap.add_argument("--sync-census", action="store_true",
                    help="torch.cuda sync debug mode around each timed run: every host-device synchronisation "
                    "counted by its call site to OUT/sync_census_*.txt (slows the run; a diagnostic)")
    ap.add_argument("--modes", default="native-1hz-hold,cached-partial-5hz")
    ap.add_argument("--cadences", default=None, help="comma list; 0 = default cadence, N = --verify-every N ... "
                    "(default: 0 and --periodic)")
    args = ap.parse_args()
    tiny = args.tiny
    seconds = args.seconds or (4.0 if tiny else 60.0)
    width, height = args.width or (64 if tiny else 1920), args.height or (48 if tiny else 1080)
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() and not tiny else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.out.mkdir(parents=True, exist_ok=True)

    root = args.out / f"session_{int(seconds)}s_{width}x{height}"
    vdir = root / "Video_Compressed" / "Session_1"
    t0 = time.perf_counter()
    if not vdir.is_dir() or not any(vdir.glob("*.mp4")):
        make_session(root, seconds, width=width, height=height, segment_seconds=min(20.0, seconds), seed=0)
    print(f"session {vdir} ({seconds:.0f} s, {width}x{height}) ready in {time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    factory, info, n_params = build_factory(tiny, args.out, device, dtype, fast=False if args.plain else None)
    print(f"Thinker {info['model_id']}: {n_params / 1e9:.3f} B params, {info['dtype']} on {device}, "
          f"built in {time.perf_counter() - t0:.1f}s")

    def opts(mode: str, every: int, end: float | None, output: Path) -> ex.ExtractOptions:
        return ex.ExtractOptions(easycom_session_dir=vdir, mode=mode, end=end, output=output, decoder=args.decoder,
                                 decoder_threads=args.decoder_threads,
                                 verify_every=every, future_intervention_every=every, progress=False,
                                 frame_cache_size=32, dtype=info["dtype"], device=str(device),
                                 command_line="benchmarks/features_bench.py")

    # warm-up of both modes outside the timings (allocator, Triton compiles, one CUDA-graph capture
    # per chunk/prefill shape: one-time costs of a process, reported as warmup_s)
    t0 = time.perf_counter()
    for mode in ("native-1hz-hold", "cached-partial-5hz"):
        ex.run(opts(mode, 0, min(6.0, seconds), args.out / "warmup.pt"), factory=factory,
               model_info=info, echo=lambda s: None)
    warmup_s = time.perf_counter() - t0
    print(f"warm-up (both modes, 6 s each): {warmup_s:.1f}s", flush=True)
    rows = []
    for mode in args.modes.split(","):
        for every in (int(c) for c in (args.cadences or f"0,{args.periodic}").split(",")):
            label = "default" if every == 0 else f"--verify-every {every} --future-intervention-every {every}"
            out = args.out / f"{mode}_{'default' if every == 0 else every}.pt"
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            if args.profile:
                import cProfile
                import io
                import pstats
                prof = cProfile.Profile()
                prof.enable()
            census = getattr(factory, "census", lambda: None)
            before = census()
            tprof = None
            if args.torch_profile:
                from torch.profiler import ProfilerActivity, profile
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                tprof = profile(activities=acts)
                tprof.__enter__()
            with SyncCensus(args.sync_census and device.type == "cuda") as syncs:
                art = ex.run(opts(mode, every, None, out), factory=factory, model_info=info, echo=print)
            if syncs.enabled:
                syncs.write(args.out / f"sync_census_{mode}_{every}.txt", art.num_rows / 5)
            if tprof is not None:
                tprof.__exit__(None, None, None)
                write_torch_profile(tprof, args.out / f"torch_profile_{mode}_{every}.txt", art.provenance["wall_time_s"])
            if args.profile:
                prof.disable()
                buf = io.StringIO()
                st = pstats.Stats(prof, stream=buf)
                st.sort_stats("tottime").print_stats(35)
                st.sort_stats("cumulative").print_stats(45)
                (args.out / f"profile_{mode}_{every}.txt").write_text(buf.getvalue())
            after = census()
            if before is not None:
                print(f"graphs before: {before}\ngraphs after:  {after}", flush=True)
            wall = art.provenance["wall_time_s"]
            v = art.verification
            rows.append({
                "mode": mode, "cadence": label, "session_seconds": art.num_rows / 5, "wall_s": wall,
                "x_realtime": round(art.num_rows / 5 / wall, 2), "goal_x": GOALS[mode],
                "meets_goal": art.num_rows / 5 / wall >= GOALS[mode],
                "artifact_mode": art.mode, "all_audits_passed": v["all_passed"],
                "audits": {k: {kk: v[k].get(kk) for kk in ("passed", "runs", "failed", "max_abs_diff", "max_rel_err")}
                           for k in ("boundary", "clean_replay", "future_intervention", "snapshot_restoration")},
                "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
                "pruning_events": len(art.pruning),
                "graphs_before_after": [before, after],
                "prefetch_workers": art.provenance.get("reader_stats", {}).get("prefetch_workers"),
                "prefetch_chunks": art.provenance.get("reader_stats", {}).get("prefetch_chunks"),
            })
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "dtype": info["dtype"], "weights": info["model_id"], "params": n_params,
           "session": {"seconds": seconds, "width": width, "height": height, "fps": 20}, "decoder": args.decoder,
           "decoder_threads": args.decoder_threads, "tiny": tiny,
           "session_fast_paths": info.get("session_fast_paths"), "cpus": os.cpu_count(), "warmup_s": round(warmup_s, 2),
           "prefetch_workers": rows[-1].get("prefetch_workers") if rows else None}
    (args.out / "features_bench.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    lines = [f"# Feature extractor benchmark ({env['device']}, {env['weights']}, {env['dtype']})", "",
             f"Synthetic {seconds:.0f}-s {width}x{height} 20 fps session; decoder {args.decoder} "
             f"(threads {args.decoder_threads or 'auto'}); torch {torch.__version__}; session fast paths "
             f"{'on' if info.get('session_fast_paths') else 'off'}; prefetch workers "
             f"{env.get('prefetch_workers', '?')}; one-time warm-up (both modes, 6 s each, graph captures "
             f"included) {warmup_s:.1f} s, outside the timings.",
             "", "| mode | audit cadence | session s | wall s | x real time | goal | audits | peak GPU GiB |",
             "|---|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['cadence']} | {r['session_seconds']:.1f} | {r['wall_s']:.2f} | "
                     f"{r['x_realtime']:.2f} | {r['goal_x']:.0f}x {'met' if r['meets_goal'] else 'NOT met'} | "
                     f"{'all passed' if r['all_audits_passed'] else 'FAILED'} | {r['peak_gpu_gib'] or '-'} |")
    md = "\n".join(lines) + "\n"
    (args.out / "features_bench.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
