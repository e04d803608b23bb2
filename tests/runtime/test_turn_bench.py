"""benchmarks/turn_bench.py on the CPU at tiny sizes (a check of the script, not of speed): each form asked for
answers N requests with the same audio, the JSON and table come out, and a bad option is refused before any
model is built."""
import json

from conftest import run_benchmark


def _run(*args):
    return run_benchmark("turn_bench.py", *args, one_thread=True)


def test_smoke_run_writes_the_forms_asked_for_and_the_table(tmp_path):
    run = _run(tmp_path, "--tiny", "--profiles", "minicpmo_4_5_turn_mrv2", "--requests", "2", "--tokens", "3",
               "--codes", "26", "--forms", "overlap", "--cprofile", "overlap", "--repeat", "2")
    assert run.returncode == 0, run.stderr
    res = json.loads((tmp_path / "turn_bench.json").read_text())
    assert [r["form"] for r in res["rows"]] == ["overlap"]
    for r in res["rows"]:
        assert len(r["wall_ms_runs"]) == 2 and r["wall_ms"] == max(r["wall_ms_runs"])    # median of 2: the upper
        assert r["n"] == 2 and r["capacity"] == 8 and abs(r["audio_s"] - 2 * 26 * 0.04) < 1e-9
        assert 0 < r["ttfa_ms_first"] <= r["ttfa_ms_last"] < r["wall_ms"]
        assert r["talker_ms"] > 0 and r["code2wav_ms"] > 0 and r["thinker_ms"] > 0
    table = (tmp_path / "turn_bench.md").read_text()
    assert "| minicpmo_4_5_turn_mrv2 | 8 / 2 GiB | 2 | overlap |" in table

    prof = (tmp_path / "turn_bench_cprofile_minicpmo_4_5_turn_mrv2_overlap.txt").read_text()
    assert prof.startswith("N=2: wall") and "draw_many" in prof     # the rows' batched draw ran, profiled

    again = _run(tmp_path / "re", "--table", tmp_path / "turn_bench.json")
    assert again.returncode == 0 and (tmp_path / "re" / "turn_bench.md").read_text() == table


def test_a_duplex_profile_is_refused(tmp_path):
    run = _run(tmp_path, "--tiny", "--profiles", "minicpmo_4_5_duplex_h200")
    assert run.returncode == 2 and "not a turn-mode profile" in run.stderr
    run = _run(tmp_path, "--tiny", "--forms", "before", "--cprofile", "overlap")
    assert run.returncode == 2 and "--cprofile" in run.stderr
    assert not (tmp_path / "turn_bench.json").exists()
