"""benchmarks/talker_turns_profile.py on the CPU at tiny sizes (a check of the script, not of speed): a row per
seat count and kernel set, the JSON and the table; a bad kernel set is refused before any model is built."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "talker_turns_profile.py"


def _run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(ROOT / d) for d in ("src", "tests", "benchmarks")),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=600)


def test_smoke_run_writes_a_row_per_seat_count_and_the_table(tmp_path):
    run = _run(tmp_path, "--tiny", "--seats", "2", "--kernels", "torch", "--calls", "3")
    assert run.returncode == 0, run.stderr
    rows = json.loads((tmp_path / "talker_turns_profile.json").read_text())["runs"]
    assert [(r["seats"], r["kernels"], r["codes"]) for r in rows] == [(2, "torch", 25)]
    assert rows[0]["call_ms"] > rows[0]["draw_ms"] > 0 and rows[0]["forward_ms"] > 0
    assert "| 2 | torch |" in (tmp_path / "talker_turns_profile.md").read_text()


def test_a_bad_kernel_set_is_refused(tmp_path):
    run = _run(tmp_path, "--tiny", "--kernels", "cuda")
    assert run.returncode == 2 and "--kernels" in run.stderr
    assert not (tmp_path / "talker_turns_profile.json").exists()
