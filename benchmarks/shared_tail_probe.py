"""GPU probe: the staged direct solve reading each stream's last 100 old frames from its voice's prompt cache
(``WholeEulerSolver.share_tail``, ``solve(tails=)``) against reading every frame from the stream's own cache, and
with that, each successor written into a retired cache of the voice (``solve(reuse=)``), which holds those 100
frames already, so they are not written either.

A steady stream's estimator cache is [its 300 newest frames | the prompt's last 100] (the trim keeps the
first 300 stored frames, newest first, and the last 100, which are the prompt's), so a quarter of what the
direct attention reads per row is the same for every stream of a voice: read from one shared copy it comes
from L2 instead of HBM; with reused successors a quarter of the successor writes goes too (the flow does not
reuse caches yet: this measures whether it should). Per batch (default 4, 8, 16): B per-stream caches (steps,
depth, 2, heads, 400, 2D) ending with one prompt cache's last 100 frames, the solve as the flow calls it
(trimmed, direct), variants alternating A B C A B C (a solver each); replay and solve as called, median of 15;
the outputs (mel, CNN cache, two streams' successors) must equal the first variant's bit for bit.

    python benchmarks/shared_tail_probe.py --out DIR [--batches 4,8,16] [--gemm-operands fp16|fp32]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from code2wav_bench import L, S, T, _triton_version, chunk_inputs, randomize_, timed  # noqa: E402
from code2wav_gemm_probe import _vs_first, vs_first_table  # noqa: E402

from minicpmo_rt.code2wav.euler_graph import GraphConfig, WholeEulerSolver  # noqa: E402
from minicpmo_rt.code2wav.flow import HISTORY_FRAMES, Flow  # noqa: E402
from minicpmo_rt.code2wav.flow_config import FULL_SIZE  # noqa: E402

PROMPT = L - HISTORY_FRAMES     # the 6-s prompt's 300 frames


def stream_caches(sv: WholeEulerSolver, B: int, seed: int, device) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(B steady per-stream caches, the voice's prompt cache) with each cache ending in the prompt's last 100
    frames, as every stream of a voice does once trimmed."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (sv.S, sv.depth, 2, sv.H)
    prompt = torch.randn(*shape, PROMPT, 2 * sv.D, generator=g, device=device)
    caches = []
    for _ in range(B):
        c = torch.randn(*shape, L, 2 * sv.D, generator=g, device=device)
        c[..., L - HISTORY_FRAMES:, :] = prompt[..., PROMPT - HISTORY_FRAMES:, :]
        caches.append(c)
    return caches, prompt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="4,8,16")
    ap.add_argument("--gemm-operands", choices=("fp32", "fp16"), default="fp16",
                    help="the solver's GEMM operands (fp16: the knobs' default where the range certificate fits)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    dev = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": _triton_version(),
           "gemm_operands": args.gemm_operands, "rows": []}

    def save():
        (args.out / "shared_tail_probe.json").write_text(json.dumps(res, indent=1))

    record = _vs_first(res, "rows", save, value_key="form", label="tail")  # form: 0 own, 1 shared, 2 + reused
    flow = Flow(FULL_SIZE)
    randomize_(flow, 0)
    cfm = flow.to(dev).eval().decoder
    forms = (("own frames", False, False), ("share_tail", True, False), ("share_tail + reused successors", True, True))
    variants = [(name + (" (again)" if rep else ""), share, reused) for rep in (0, 1) for name, share, reused in forms]
    for B in [int(b) for b in args.batches.split(",")]:
        cnn, _, mu, spk, cond = chunk_inputs(B, dev)
        cfg = GraphConfig(batch_buckets=(B,), query_buckets=(T,), offset_bucket=50, offset_anchor=L, max_graphs=4)
        caches = prompt = None
        for name, share, reused in variants:
            sv = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S,
                                  config=cfg, gemm_operands=args.gemm_operands)
            sv.share_tail = share
            if caches is None:
                caches, prompt = stream_caches(sv, B, 10 + B, dev)
            # retired caches of the voice: copies of the streams' own (the successors' shape at the steady length)
            kw = dict(copy_out=False, trim=(PROMPT, HISTORY_FRAMES), tails=[prompt] * B,
                      reuse=[c.clone() for c in caches] if reused else None)
            last = [sv.solve(mu, spk, cond, cnn, caches, **kw)]
            st = next(iter(sv._statics.values()))
            if st.key.direct is None or st.key.tail != share or st.graph is None:
                raise RuntimeError(f"B={B} {name}: solved under {st.key} (graph {st.graph is not None}); expected "
                                   f"a direct key with tail={share} from a CUDA graph")
            called = statistics.median(timed(lambda: last.__setitem__(0, sv.solve(mu, spk, cond, cnn, caches, **kw)),
                                             min_reps=15, max_reps=15))
            mel, new_cnn, atts = last[0]
            # two streams' successors stand for all (the same kernel wrote each); all 16 kept would add ~34 GB
            got = [mel.clone(), new_cnn.clone()] + [a.clone() for a in atts[:2]]
            replay = statistics.median(timed(st.graph.replay, min_reps=15, max_reps=15))
            record(B, (name, int(share) + int(reused)), got, replay, called_ms=called)
            del sv, st, last, got, mel, new_cnn, atts, kw
            gc.collect()
            torch.cuda.empty_cache()
        del caches, prompt
        gc.collect()
        torch.cuda.empty_cache()
    lines = [f"# Shared prompt tails in the staged direct solve ({res['gpu']})", "",
             f"torch {res['torch']}, triton {res['triton']}; the solve as the flow calls it (trimmed, direct; "
             f"{args.gemm_operands} GEMM operands) per steady 1-s chunk, median of 15; each stream's last "
             f"{HISTORY_FRAMES} of {L} old frames read from its own cache or from the voice's prompt cache "
             "(share_tail), and then each successor written into a retired cache of the voice, all but those frames "
             "(reused successors).", ""] + vs_first_table(res["rows"])
    (args.out / "shared_tail_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
