"""benchmarks/serve_bench.py on the CPU at tiny sizes (a check of the script, not of speed): both paths answer,
the server in one batch of N (the script raises otherwise), and the JSON and table come out."""
import json

from conftest import run_benchmark


def test_smoke_run_writes_both_paths_and_the_table(tmp_path):
    run = run_benchmark("serve_bench.py", tmp_path, "--tiny", "--requests", "2", "--tokens", "3", "--codes", "26",
                        "--repeat", "1", one_thread=True)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "serve_bench.json").read_text())
    assert [(r["n"], r["path"]) for r in res["rows"]] == [(2, "direct"), (2, "http")]
    for r in res["rows"]:
        assert 0 < r["ttfa_ms_first"] <= r["ttfa_ms_median"] <= r["ttfa_ms_last"] < r["wall_ms"]
    table = (tmp_path / "serve_bench.md").read_text()
    assert "| 2 | direct |" in table and "| 2 | http |" in table and "cpu (smoke run)" in table


def test_more_requests_than_one_batch_are_refused(tmp_path):
    run = run_benchmark("serve_bench.py", tmp_path, "--tiny", "--requests", "17", "--profile",
                        "minicpmo_4_5_turn_mrv2_h200", one_thread=True)
    assert run.returncode == 2 and "exceeds the profile's Talker capacity 16" in run.stderr
