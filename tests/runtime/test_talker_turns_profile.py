"""benchmarks/talker_turns_profile.py on the CPU at tiny sizes (a check of the script, not of speed): a row per
seat count and kernel set, the JSON and the table; a bad kernel set is refused before any model is built."""
import json

from conftest import run_benchmark


def _run(*args):
    return run_benchmark("talker_turns_profile.py", *args, one_thread=True)


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
