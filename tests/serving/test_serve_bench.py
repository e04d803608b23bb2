"""benchmarks/serve_bench.py on the CPU at tiny sizes (a check of the script, not of speed): both paths answer,
the server in one batch of N (the script raises otherwise), and the JSON and table come out."""
import json
from pathlib import Path

import pytest

from conftest import run_benchmark


def test_smoke_run_writes_both_paths_and_the_table(tmp_path):
    run = run_benchmark("serve_bench.py", tmp_path, "--tiny", "--requests", "2", "--tokens", "3", "--codes", "26",
                        "--repeat", "1", one_thread=True)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "serve_bench.json").read_text())
    assert [(r["n"], r["path"]) for r in res["rows"]] == [(2, "direct"), (2, "http")]
    for r in res["rows"]:
        assert 0 < r["ttfa_ms_first"] <= r["ttfa_ms_median"] <= r["ttfa_ms_last"] < r["wall_ms"]
    assert 1 <= res["rows"][1]["runs"] <= 2 and res["rows"][1]["joined"] <= 1   # a late one joins, or runs next
    table = (tmp_path / "serve_bench.md").read_text()
    assert "| 2 | direct |" in table and "| 2 | http |" in table and "cpu (smoke run)" in table


def test_more_requests_than_one_batch_are_refused(tmp_path):
    run = run_benchmark("serve_bench.py", tmp_path, "--tiny", "--requests", "17", "--profile",
                        "minicpmo_4_5_turn_mrv2_h200", one_thread=True)
    assert run.returncode == 2 and "exceeds the profile's Talker capacity 16" in run.stderr


def test_staggered_arrivals_compare_joining_with_batches(tmp_path):
    """--stagger-ms: the server with mid-batch joining (with and without the Talker's lead) against the server
    without, each answering every request; joining never takes more pipeline runs than batching."""
    run = run_benchmark("serve_bench.py", tmp_path, "--tiny", "--requests", "2", "--tokens", "3", "--codes", "26",
                        "--repeat", "1", "--stagger-ms", "150", "--paths", "http-batched,http,http-lead-side",
                        one_thread=True)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "serve_bench.json").read_text())
    rows = {r["path"]: r for r in res["rows"]}
    assert list(rows) == ["http-batched", "http", "http-lead-side"] and res["stagger_ms"] == 150
    assert res["lead_s"] == 1.0
    for joining in ("http", "http-lead-side"):
        assert 1 <= rows[joining]["runs"] <= rows["http-batched"]["runs"] <= 2
        assert rows[joining]["runs"] + rows[joining]["joined"] == 2 and rows["http-batched"]["joined"] == 0
    assert all(r["stall_ms_max"] >= 0 and 0 <= r["stalled"] <= 2 for r in rows.values())
    table = (tmp_path / "serve_bench.md").read_text()
    assert "Mid-batch admission" in table and "| 2 | http-lead-side |" in table and "x http-batched" in table
    assert "stall max ms (stalled)" in table


def test_unknown_or_repeated_paths_are_refused(tmp_path):
    for paths in ("http,http-fast", "http,http"):
        run = run_benchmark("serve_bench.py", tmp_path, "--tiny", "--stagger-ms", "50", "--paths", paths)
        assert run.returncode == 2 and "name each of http-batched, http, http-lead" in run.stderr, run.stderr


def test_stall_is_the_wait_of_a_real_time_playback(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from serve_bench import stall_s

    second = 24_000
    assert stall_s([]) == 0.0 and stall_s([(5.0, second)]) == 0.0
    # 1 s of audio at t=0 plays to 1.0; the next second arrives at 1.5 (0.5 s stall) and plays to 2.5; the third,
    # arriving at 2.0, is early and plays to 3.5; the fourth arrives at 4.0 (0.5 s more)
    assert stall_s([(0.0, second), (1.5, second), (2.0, second), (4.0, second)]) == pytest.approx(1.0)
    assert stall_s([(0.0, 2 * second), (1.0, second), (1.5, second)]) == 0.0     # always ahead
