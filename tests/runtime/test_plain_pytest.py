"""A plain `pytest` on a machine without a GPU runs the Triton kernel tests, as CI does.

scripts/test.sh sets TRITON_INTERPRET=1. Run directly on a CPU machine, pytest failed 113 kernel tests with
Triton's "0 active drivers": each kernel test module then set the variable at its top, but in a whole-suite
run an earlier module (test_encoder_graph.py, say) had already imported the kernels as compiled ones.
tests/conftest.py now sets it, once, before any test module is imported. The child pytest here collects the two
modules in that order, with the variable removed from its environment, and runs one kernel test.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import rel_err

ROOT = Path(__file__).resolve().parents[2]

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    # module level: the interpreter resolves a nested @jit helper through the kernel's globals
    @triton.jit
    def _scaled(x, k):
        return x * k + tl.sqrt(tl.abs(x))

    @triton.jit
    def _kernel(X, Y, n, BLOCK: tl.constexpr, REPS: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n, other=0.0)
        acc = tl.zeros([BLOCK], tl.float32)
        for r in range(REPS):
            acc += _scaled(x, r + 1)
        tl.store(Y + offs, acc, mask=offs < n)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels run natively, not interpreted")
def test_kernel_tests_run_without_the_interpreter_variable():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])
    # both modules are collected (imported) in this order; -k runs the kernel test alone
    first, test = "tests/code2wav/test_encoder_graph.py", "tests/code2wav/test_euler_graph.py"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          first, test, "-k", "test_block_kernel_solver_with_masks_matches_reference"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="only the interpreter is sped up")
def test_interpreter_speedup_is_installed_and_keeps_the_semantics():
    """conftest installs ``interpreter_speedup`` (each triton.language module scanned once for its builtins,
    the int32 overflow sanitizer off as in compiled kernels): a kernel that calls a nested ``@jit`` helper
    in a loop, with integer index arithmetic and masked loads, still computes what torch does, and a second
    launch (the modules then known) gives the same result."""
    if triton is None:
        pytest.skip("needs Triton")
    from triton.runtime import interpreter as ti

    assert getattr(ti._patch_builtin, "_scan_once", False)
    assert ti.interpreter_builder.options.sanitize_overflow is False
    x = torch.randn(37)
    want = sum(x * k + x.abs().sqrt() for k in range(1, 4))
    for _ in range(2):
        y = torch.zeros(37)
        _kernel[(3,)](x, y, 37, BLOCK=16, REPS=3)
        assert rel_err(y, want) < 1e-6
