"""benchmarks/cfm_solve_plan.py (a model of the churn rounds' CFM solves): its default grouping reproduces the
solve count the GPU run measured (3 per round, 4.8 rows each: stream_churn_breakdown_session27_h200.md), and
joining never takes more solves or rows-time than grouping by cache length."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plan_matches_the_measured_solve_count_and_joining_never_costs_more(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(ROOT / d) for d in ("src", "tests", "benchmarks")))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cfm_solve_plan.py"), "--out", str(tmp_path),
                          "--slots", "16"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    res = json.loads((tmp_path / "cfm_solve_plan_slots16.json").read_text())
    default, joined = res["policies"].values()
    n = default["solves_per_round"]
    assert sorted(n)[len(n) // 2] == 3
    assert all(j <= d for j, d in zip(joined["solves_per_round"], n))
    assert all(j <= d + 1e-9 for j, d in zip(joined["cfm_ms"], default["cfm_ms"]))
    assert sum(joined["cfm_ms"]) < sum(default["cfm_ms"])
    assert "a model" in (tmp_path / "cfm_solve_plan_slots16.md").read_text()
