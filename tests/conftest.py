import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels can run only in Triton's CPU interpreter, which `triton.jit` picks when a
# kernel is decorated: set it here, before any test imports one, so a plain `pytest` on a CPU machine runs
# what CI runs (scripts/test.sh sets it too). Without it, kernel tests failed with "0 active drivers".
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_speedup      # the interpreter's per-call scans of triton.language, done once

    interpreter_speedup.install()

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "minicpmo45"


def run_benchmark(script: str, *args, timeout: int = 600, one_thread: bool = False) -> subprocess.CompletedProcess:
    """``benchmarks/<script>`` in a fresh interpreter with the repo's src, tests and benchmarks importable (the
    benchmarks' smoke tests); ``one_thread``: one intra-op thread, as the tests themselves run (two contend on
    the 2-CPU CI box)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(REPO / d) for d in ("src", "tests", "benchmarks")))
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a = a.detach().double().cpu()
    b = b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny models are launch-bound: on the 2-CPU CI box, two intra-op threads make small
    matmuls many times slower (contention), so every test runs on one and the setting is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} (the project's shared reference data) is not beside this checkout")
    return SHARED


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """One tiny checkpoint per test session (the same one the README demo writes)."""
    from minicpmo_rt.snapshot_tools import make_tiny

    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    return make_tiny(out, seed=0)


@pytest.fixture(scope="session")
def voice(shared_dir) -> Path:
    """A real reference voice (22.05 kHz, so resampling is exercised too)."""
    return shared_dir / "media" / "ref_en_dlc_1.wav"


@pytest.fixture(scope="session")
def tok():
    """The real MiniCPM-o 4.5 tokenizer (vendored files); loaded once per test session."""
    from minicpmo_rt.checkpoint.tokenizer import load_tokenizer, vendored_tokenizer_dir

    return load_tokenizer(vendored_tokenizer_dir())


def make_tiny_thinker(seed: int):
    """The tiny-config Thinker with ``randomize_`` weights, fp32, buffers rebuilt."""
    from minicpmo_rt.checkpoint.config import MiniCPMOConfig
    from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
    from minicpmo_rt.thinker.model import Thinker

    t = Thinker(MiniCPMOConfig.from_dict(tiny_config()))
    randomize_(t, seed=seed)
    t.float().rebuild_buffers()
    return t


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def behind_queued_work(fn):
    """(fn(), the host seconds fn took) with ~1 s of device work queued ahead of it (``torch.cuda._sleep``): a call
    that syncs the stream on the way (a copy from pageable memory, a host read) takes about that second, one that
    only queues work returns in milliseconds. CUDA only."""
    import time

    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    t0 = time.perf_counter()
    out = fn()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    return out, host_s


@contextlib.contextmanager
def ieee_cudnn():
    """IEEE references on CUDA: convolutions run in cuDNN, whose own TF32 default is on (the
    precision policy leaves that flag to the process, so only tests and benchmarks set it)."""
    prev = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = prev
