"""scripts/setup.sh refuses to start a fresh environment on a disk too full to hold it.

A CI run once died in pip with ENOSPC half-way through installing; the check names the folder, the free and
the needed space, and leaves no half-made .venv behind.
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("df") is None, reason="needs bash and df")
def test_setup_refuses_a_full_disk_before_making_the_venv(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    env = dict(os.environ, MINICPMO_SETUP_NEED_MB=str(10 ** 12))
    run = subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1
    assert "MB free" in run.stderr and str(tmp_path) in run.stderr and "Free disk space" in run.stderr
    assert not (tmp_path / ".venv").exists()
