"""Every Triton kernel the Code2Wav fast path launches compiles for real GPU targets (no GPU needed).

The CPU tests run kernels through Triton's interpreter, which executes Python and so accepts code the
compiler rejects: on the H200 a helper returning from inside a ``constexpr`` branch failed to compile
although every interpreter test passed. ``compile_gate.py`` drives the Whole-Euler solves (staged body,
persistent block kernel, slot pool; TF32 and IEEE; masked, pooled, TMA) on CPU tensors and compiles each
launch through Triton's NVIDIA backend (to a cubin, through ptxas) for SM90, and the attention for SM80,
instead of running it. It also fails where an attention kernel or tile GEMM spills more than 512 bytes of
registers per thread for SM90 (IEEE launch shapes that did made IEEE solves 4-27x slower on the H200), and where
a kernel needs more shared memory per program than its target has (it would compile, then fail to load), and where
the persistent block kernel's L2 prefetches are missing from its PTX. It runs
in a subprocess because this session imports the kernels under ``TRITON_INTERPRET=1``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minicpmo_rt.code2wav.kernels import AVAILABLE

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs triton")

GATE = Path(__file__).with_name("compile_gate.py")


def test_fast_path_kernels_compile_for_sm90_and_sm80():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(GATE)], env=env, capture_output=True, text=True, timeout=900)
    if r.returncode == 3:
        pytest.skip(f"this Triton's launch internals differ from the gate's: {r.stdout.strip()[-300:]}")
    assert r.returncode == 0, (r.stdout[-2000:] + r.stderr[-4000:])
    kernels = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("compiled ")}
    assert {"_attn_fwd", "_attn_combine", "_dit_block", "_euler_junction", "_cnn_roll", "_qkv_head_ln",
            "_residual_mod_ln", "_taps_ln_mish"} <= kernels, kernels


# The gate driving one B=1 block-kernel solve (nothing else), after ``setup`` (code lines of drive()'s body,
# run before the solver is built, with dit_block imported). Written to a file: Triton reads a @jit function's
# source from it.
_GATE_B1 = """
import sys, torch, triton
sys.path.insert(0, {gate_dir!r})
import compile_gate

def drive():
    from minicpmo_rt.code2wav import fused_dit
    from minicpmo_rt.code2wav.euler_graph import GraphConfig, WholeEulerSolver
    from minicpmo_rt.code2wav.kernels import dit_block
    from minicpmo_rt.code2wav.precision import matmul_tf32
    cfm, est, caches = compile_gate.cuda_paths_on_cpu()
    dit_block.programs = lambda device: 132
{setup}
    solver = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=2,
                              config=GraphConfig(enabled=False, batch_buckets=(1,), query_buckets=(50,),
                                                 offset_anchor=400), use_triton=True, block_kernel=True)
    fused_dit.dot_precision = lambda t: "tf32"
    with torch.inference_mode(), matmul_tf32(True):
        solver.solve(torch.zeros(1, 80, 50), torch.zeros(1, 80), torch.zeros(1, 80, 50), *caches(1, 400),
                     graph=False)

compile_gate.drive = drive
sys.exit(compile_gate.main())
"""


def _gate_b1(tmp_path, setup: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "drive.py"
    script.write_text(_GATE_B1.format(gate_dir=str(GATE.parent), setup=setup))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode == 3:
        pytest.skip(f"this Triton's launch internals differ from the gate's: {r.stdout.strip()[-300:]}")
    return r


# The block kernel with a 256-key attention tile: it compiles for SM90 but asks for 283136 bytes of shared
# memory per program, more than the H200's 232448, and failed to load there (session 18). The gate drives
# just that launch and must reject it.
@pytest.mark.parametrize("att_bn, rc", [(64, 0), (256, 1)])
def test_gate_rejects_a_kernel_beyond_the_targets_shared_memory(att_bn, rc, tmp_path):
    r = _gate_b1(tmp_path, f"    dit_block.ATT_BN = {att_bn}")
    if " smem ?" in r.stdout:
        pytest.skip("this Triton's compiled kernels do not report their shared memory")
    assert r.returncode == rc, (r.stdout[-2000:] + r.stderr[-4000:])
    assert ("SHARED MEMORY" in r.stdout) == (rc == 1), r.stdout[-2000:]
    if rc:
        assert "_dit_block needs" in r.stdout and "on sm90 (the limit is 232448)" in r.stdout, r.stdout[-2000:]


# The block kernel's L2 prefetches are inline PTX whose result nobody reads: a hint the compiler may drop if it
# is ever marked pure. The gate checks they reach the PTX; here the same launch with the prefetch helper
# replaced by one that issues nothing must be rejected, and the real one must pass.
_DROP_PREFETCH = """    @triton.jit
    def _issues_nothing(P, n, pid, nprog, BULK: triton.language.constexpr):
        pass
    dit_block._prefetch_l2 = _issues_nothing"""


@pytest.mark.parametrize("drop, rc", [(False, 0), (True, 1)])
def test_gate_rejects_a_block_kernel_without_its_prefetches(drop, rc, tmp_path):
    r = _gate_b1(tmp_path, _DROP_PREFETCH if drop else "")
    assert r.returncode == rc, (r.stdout[-2000:] + r.stderr[-4000:])
    assert ("PREFETCH:\n" in r.stdout) == (rc == 1), r.stdout[-2000:]
    assert "compiled _dit_block" in r.stdout, r.stdout[-2000:]
