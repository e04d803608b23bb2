"""benchmarks/cfm_solve_plan.py (a model of the churn rounds' CFM solves): its default grouping reproduces the
solve count the GPU run measured (3 per round, 4.8 rows each: stream_churn_breakdown_session27_h200.md), and
joining never takes more solves or rows-time than grouping by cache length."""
import json

from conftest import run_benchmark


def test_plan_matches_the_measured_solve_count_and_joining_never_costs_more(tmp_path):
    run = run_benchmark("cfm_solve_plan.py", "--out", tmp_path, "--slots", "16", timeout=300)
    assert run.returncode == 0, run.stderr
    res = json.loads((tmp_path / "cfm_solve_plan_slots16.json").read_text())
    default, joined = res["policies"].values()
    n = default["solves_per_round"]
    assert sorted(n)[len(n) // 2] == 3
    assert all(j <= d for j, d in zip(joined["solves_per_round"], n))
    assert all(j <= d + 1e-9 for j, d in zip(joined["cfm_ms"], default["cfm_ms"]))
    assert sum(joined["cfm_ms"]) < sum(default["cfm_ms"])
    assert "a model" in (tmp_path / "cfm_solve_plan_slots16.md").read_text()
