"""benchmarks/code2wav_bench.py --plot: the issue's table drawn from a results JSON on any machine (no GPU), and a
clear refusal, with nothing written, for a file that is not one."""
import json
from pathlib import Path

from conftest import run_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    return run_benchmark("code2wav_bench.py", *args, timeout=300)


def test_plot_draws_the_committed_table_and_refuses_what_is_not_one(tmp_path):
    committed = ROOT / "benchmarks" / "results" / "code2wav_bench_session34_h200.json"
    run = _run("--out", tmp_path / "ok", "--plot", committed)
    assert run.returncode == 0, run.stderr
    png = (tmp_path / "ok" / "code2wav_bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    # a JSON of another script, and a results file whose rows have one batch each: exit 2, no PNG
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"policies": {}}))
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"gpu": "x", "steps": 10, "query": 50, "cache": 400,
                               "rows": [{"row": "original eager", "batch": 1, "median_ms": 250.0}]}))
    for bad in (other, one, ROOT / "README.md"):
        run = _run("--out", tmp_path / "bad", "--plot", bad)
        assert run.returncode == 2, (bad, run.stdout, run.stderr)
        assert str(bad) in run.stderr
        assert not (tmp_path / "bad" / "code2wav_bench.png").exists()
