"""benchmarks/thinker_step_profile.py runs end to end on the tiny config on the CPU (a check of the script; its
numbers mean nothing here) and writes the table and JSON it promises."""

import json

from conftest import run_benchmark


def test_smoke_run_writes_rows_gemm_shapes_and_kernels(tmp_path):
    r = run_benchmark("thinker_step_profile.py", tmp_path, "--tiny", "--device", "cpu", "--rows", "1,2",
                      "--reps", "3", "--context", "20", one_thread=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "thinker_step_profile.json").read_text())
    assert [x["rows"] for x in res["rows"]] == [1, 2]
    for x in res["rows"]:
        assert x["step_ms"] > 0 and x["gemm_ms_sum"] > 0
        assert set(x["gemms"]) == {"qkv", "o_proj", "gate_up", "down", "lm_head"}
        assert x["gemms"]["qkv"]["calls_per_step"] == res["layers"]
        assert x["kernels"] and all(k["us_per_call"] >= 0 for k in x["kernels"])
        assert set(x["logits_pipeline_ms"]) == {"greedy", "sampling"}
    md = (tmp_path / "thinker_step_profile.md").read_text()
    assert "| rows | BLAS | step ms |" in md and "cpu (smoke run)" in md
