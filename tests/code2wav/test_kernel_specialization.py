"""The fast path's launches do not multiply Triton compiles (no GPU needed).

Triton compiles a kernel once per combination of integer arguments that are 1 or a multiple of 16. On the
H200 a cold cache made the default voice's ``Code2Wav.prepare`` compile 141 kernels in 226 s: the direct
attention's Euler step and layer were specialised, so every step x layer class compiled again
(``benchmarks/results/triton_compile_census_session24_before_h200.md``; 54 compiles since). The gate
``specialization_gate.py`` drives a voice's first-stream solves on CPU tensors and keys every launch through
the binder Triton builds for SM90 (nothing is compiled); it fails where one solve's launches of a kernel need
more than one compile, or where the block kernel or the Euler junction needs another compile for another
cache length. Run in a subprocess, as ``test_kernel_compile.py``, because this session imports the kernels
under ``TRITON_INTERPRET=1``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minicpmo_rt.code2wav.kernels import AVAILABLE

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs triton")

GATE = Path(__file__).with_name("specialization_gate.py")

# The gate with the direct attention re-wrapped by a plain ``triton.jit`` (Triton's default specialisation, as
# before session 24). Written to a file: Triton reads a @jit function's source from the kernel's own module.
_SPECIALISED = """
import sys, triton
sys.path.insert(0, {gate_dir!r})
import specialization_gate
from minicpmo_rt.code2wav.kernels import tiled_attention
tiled_attention._attn_direct = triton.jit(tiled_attention._attn_direct.fn)
sys.exit(specialization_gate.main())
"""


def _run(args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode == 3:
        pytest.skip(f"this Triton's launch internals differ from the gate's: {r.stdout.strip()[-300:]}")
    return r


def test_a_solves_launches_need_one_compile_per_kernel_form():
    r = _run([str(GATE)])
    assert r.returncode == 0, (r.stdout[-3000:] + r.stderr[-3000:])
    summary = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("SUMMARY "))[8:])
    # every kernel of the batch 1-16 solves was launched, so none escaped the check
    assert {"_dit_block", "_attn_direct", "_euler_junction", "_residual_mod_ln", "_wide_gemm"} <= set(summary), summary


def test_gate_rejects_a_kernel_specialised_on_its_euler_step_and_layer(tmp_path):
    script = tmp_path / "drive.py"
    script.write_text(_SPECIALISED.format(gate_dir=str(GATE.parent)))
    r = _run([str(script)])
    assert r.returncode == 1, (r.stdout[-3000:] + r.stderr[-3000:])
    assert "_attn_direct needs 4 compiles within the solve" in r.stdout, r.stdout[-3000:]
    assert "['layer', 'step']" in r.stdout, r.stdout[-3000:]
