"""How many compiles the Code2Wav fast path's launches ask Triton for, worked out on a CPU.

Run as a script (``test_kernel_specialization.py`` does, in a subprocess, because the test session imports the
kernels under ``TRITON_INTERPRET=1``). Like ``compile_gate.py`` it drives the Whole-Euler solves on CPU
tensors with ``JITFunction.run`` replaced, but compiles nothing: each launch goes through the binder Triton
builds for an SM90 target (``create_function_from_signature``), which gives the specialisation the launch
would be compiled under (per argument its type and whether it is 1 or a multiple of 16; constexpr values).
Two launches with different keys are two compiles.

The solves: the trimmed chunk solves a voice's first stream makes (cache lengths 300, 350 and 400 frames with
the flow's trim, as ``Code2Wav.precapture`` captures them) at batch 1 (block kernel, arena), 2 (block kernel,
direct phase), 4 and 16 (staged body, direct attention), and the opt-in slot pool's solves at batch 1, 4 and
16 over the same cache lengths, each over 2 Euler steps and 2 DiT layers, so the step and layer take the
values 0 and 1 that Triton would specialise. Prints one line per kernel and a JSON
summary; exit status 1 where a kernel's launches within one solve need more than one compile once their
constexprs are set aside (an integer that changes from launch to launch is specialised: on the H200 that made
the direct attention 81 compiles on a cold cache, ``triton_compile_census_session24_before_h200.md``), or
where the block kernel or the junction needs another compile for another cache length; 3 where this Triton's
internals differ from what the harness expects.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compile_gate  # noqa: E402

# kernels whose compiles must not depend on the cache length (their cache lengths are unspecialised)
LENGTH_FREE = ("_dit_block", "_euler_junction")


def _differing(keys: set[tuple]) -> list[str]:
    """The arguments whose specialisation differs among launch keys ((name, specialisation) tuples)."""
    values = defaultdict(set)
    for key in keys:
        for name, spec in key:
            values[name].add(spec)
    return sorted(n for n, v in values.items() if len(v) > 1)


def main() -> int:
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature
    except ImportError as exc:
        print(f"HARNESS: {exc!r}", flush=True)
        return 3
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders: dict[int, object] = {}
    launches: list[tuple[str, str, tuple, tuple]] = []     # (solve, kernel, runtime key, constexpr key)
    current = {"solve": None}

    def record(self, *args, grid, warmup, **kwargs):
        try:
            binder = binders.get(id(self))
            if binder is None:
                binder = binders[id(self)] = create_function_from_signature(self.signature, self.params, backend)
            _, spec, _ = binder(*args, **kwargs)
            runtime, consts = [], []
            for p, s in zip(self.params, spec):
                (consts if p.is_constexpr else runtime).append((p.name, repr(s)))
        except Exception as exc:  # noqa: BLE001 - this Triton's binder is not the one the gate knows
            raise compile_gate.HarnessError(f"{self.fn.__name__}: {exc!r}") from exc
        launches.append((current["solve"], self.fn.__name__, tuple(runtime), tuple(consts)))
        return None

    JITFunction.run = record
    try:
        drive(current)
    except compile_gate.HarnessError as exc:
        print(f"HARNESS: {exc}", flush=True)
        return 3

    per_solve: dict[tuple, set] = defaultdict(set)
    per_form: dict[tuple, set] = defaultdict(set)
    compiles: dict[str, set] = defaultdict(set)
    for solve, kernel, runtime, consts in launches:
        per_solve[solve, kernel, consts].add(runtime)
        per_form[solve[0], kernel, consts].add(runtime)       # solve = (batch, cache length)
        compiles[kernel].add((runtime, consts))
    problems = []
    for (solve, kernel, consts), keys in per_solve.items():
        if len(keys) > 1:
            problems.append(f"{kernel} needs {len(keys)} compiles within the solve at (batch, cache) {solve}: "
                            f"its launches differ in the specialisation of {_differing(keys)} (add them to its "
                            "do_not_specialize list)")
    for (batch, kernel, consts), keys in per_form.items():
        if kernel in LENGTH_FREE and len(keys) > 1:
            problems.append(f"{kernel} at batch {batch} needs {len(keys)} compiles over the cache lengths: "
                            f"{_differing(keys)} are specialised")
    summary = {k: len(v) for k, v in sorted(compiles.items())}
    for kernel, n in summary.items():
        print(f"kernel {kernel} {n} compile(s) over {sum(1 for x in launches if x[1] == kernel)} launches",
              flush=True)
    print("SUMMARY " + json.dumps(summary), flush=True)
    if problems:
        print("SPECIALISED:\n" + "\n".join(problems), flush=True)
        return 1
    return 0


def drive(current: dict) -> None:
    """The trimmed chunk solves of a voice's first stream (cache 300, 350, 400 frames; trim (300, 100)) at
    batch 1, 2, 4 and 16, and the slot pool's solves at batch 1, 4 and 16 over those lengths; 2 Euler steps over
    a depth-2 DiT, on CPU tensors (kernels only keyed)."""
    from minicpmo_rt.code2wav import fused_dit
    from minicpmo_rt.code2wav.euler_graph import GraphConfig, WholeEulerSolver
    from minicpmo_rt.code2wav.kernels import dit_block
    from minicpmo_rt.code2wav.precision import matmul_tf32
    from minicpmo_rt.code2wav.slot_pool import SlotPool, SlotSolver

    cfm, est, caches = compile_gate.cuda_paths_on_cpu()
    dit_block.programs = lambda device: 132
    fused_dit.dot_precision = lambda t: "tf32"
    fused_dit.device_tma = lambda device: True
    with torch.inference_mode(), matmul_tf32(True):
        for B in (1, 2, 4, 16):
            cfg = GraphConfig(enabled=False, batch_buckets=(B,), query_buckets=(50,), offset_anchor=400)
            solver = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=2,
                                      config=cfg, use_triton=True, wide_gemm=B >= 8,
                                      block_kernel=True if B <= 2 else None)     # CUDA's choice at batch 1-2
            for L in (300, 350, 400):
                current["solve"] = (B, L)
                solver.solve(torch.zeros(B, 80, 50), torch.zeros(B, 80), torch.zeros(B, 80, 50), *caches(B, L),
                             graph=False, trim=(300, 100))
        # the opt-in slot pool: each stream's cache resident in a slot, solved at its own length
        for B in (1, 4, 16):
            solver = SlotSolver(cfm, pool=None, attention="triton-tf32", tf32=True, n_timesteps=2,
                                config=GraphConfig(enabled=False, batch_buckets=(B,), query_buckets=(50,)),
                                use_triton=True, block_kernel=True if B == 1 else None, wide_gemm=B >= 8)
            solver.pool = SlotPool(solver, slots=B, frames=464, device="cpu")
            for L in (300, 350, 400):
                handles = [solver.pool.admit(*[c[:, :, [i, B + i]] for c in caches(B, L)], 300) for i in range(B)]
                current["solve"] = (f"slot pool {B}", L)
                solver.solve_slots(handles, torch.zeros(B, 80, 50), torch.zeros(B, 80), torch.zeros(B, 80, 50),
                                   graph=False)
                for h in handles:
                    h.release()


if __name__ == "__main__":
    sys.exit(main())
