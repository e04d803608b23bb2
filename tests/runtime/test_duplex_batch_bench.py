"""benchmarks/duplex_batch_bench.py end to end on tiny random weights on the CPU (a check of the script; its
numbers mean nothing here): the table, the JSON, and the cProfile run with its Thinker split by part."""

import json
import os

from conftest import run_benchmark


def test_smoke_run_writes_the_table_and_a_profile_split_by_part(tmp_path):
    r = run_benchmark("duplex_batch_bench.py", tmp_path, "--tiny", "--conversations", "2", "--sequential", "",
                      "--batch-kinds", "batch-rows,batch-rows-each", "--units", "2", "--warm", "1", "--cprofile", "2",
                      one_thread=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "duplex_batch_bench.json").read_text())
    assert [(x["kind"], x["n"]) for x in res["runs"]] == [("batch-rows", 2), ("batch-rows-each", 2)]
    assert all(x["summary"]["codes"] > 0 for x in res["runs"])
    assert "| 2 | batch-rows | greedy |" in (tmp_path / "duplex_batch_bench.md").read_text()
    prof = (tmp_path / "duplex_batch_bench_cprofile_2.txt").read_text()
    head = prof.splitlines()[1]
    for part in ("vision", "commit", "rows step", "host copy", "the rest of the Thinker"):
        assert part in head, head
    assert "cumulative" in prof


def test_a_warm_up_that_leaves_no_second_is_refused(tmp_path):
    r = run_benchmark("duplex_batch_bench.py", tmp_path, "--tiny", "--units", "2", "--warm", "2", timeout=300)
    assert r.returncode == 2 and "leaves no measured second" in r.stderr, r.stderr[-2000:]


def test_clock_restores_what_each_wrap_replaced_also_a_module_function(monkeypatch):
    """``Clock.restore`` unwinds newest first: an object's wrapped method goes back to the class's (a wrap over
    a patch included), and a wrapped module function (the split's ``session.process_many``) is put back, not
    deleted; the wrapped calls were timed under their phase."""
    import types

    import torch
    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))     # the benchmarks import their siblings by name
    from duplex_batch_bench import Clock

    class Obj:
        def f(self):
            return 1

    mod = types.ModuleType("m")
    mod.g = lambda: 2
    g, obj, clock = mod.g, Obj(), Clock(torch.device("cpu"))
    clock.patch(obj, "f", lambda: 10)
    clock.wrap(obj, "f", "a")
    clock.wrap(mod, "g", "b")
    assert obj.f() == 10 and mod.g() == 2 and [p for p, _ in clock.calls] == ["a", "b"]
    clock.restore()
    assert "f" not in obj.__dict__ and obj.f() == 1 and mod.g is g


def test_audio_only_units_and_the_per_second_diagnostics(tmp_path):
    """``--no-frame`` gives the units no frame (the JSON and the table say so) and ``--diag`` records each second's
    machine state (on the CPU: the collections only, and no CUDA counters)."""
    r = run_benchmark("duplex_batch_bench.py", tmp_path, "--tiny", "--conversations", "2", "--sequential", "",
                      "--batch-kinds", "batch-rows-mel", "--units", "2", "--warm", "1", "--no-frame", "--diag",
                      one_thread=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "duplex_batch_bench.json").read_text())
    assert res["frame"] is False and "no frame (audio only)" in (tmp_path / "duplex_batch_bench.md").read_text()
    rows = res["runs"][0]["rows"]
    assert all(set(row["state"]) == {"gc_collections"} and row["state"]["gc_collections"] >= 0 for row in rows)
    assert "gc_collections:" in r.stdout
    assert all(row["captures"] == {} for row in rows)     # no CUDA graphs on the CPU
    assert all(row["tokens"] > 0 for row in rows) and "tokens:" in r.stdout


def test_queued_wait_probe_times_each_stage_once_and_puts_every_stage_back(tmp_path, monkeypatch):
    """``queued_wait_probe.Probe`` on a class's method and on a module's function: only the first call is timed
    (on the CPU nothing is queued), later calls run plain, and ``undo`` restores the attribute exactly (the class
    its own method, the module its function)."""
    import types

    import torch
    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from queued_wait_probe import Probe

    class Owner:
        def work(self, x):
            return x + 1

    original = Owner.work
    mod = types.ModuleType("m")
    made = [0]      # a counter the stage moves, as cudaMalloc calls move the allocator's

    def f(x):
        made[0] += 2
        return 2 * x

    mod.f = f
    cpu = torch.device("cpu")
    on_class, on_module = Probe(Owner, "work", cpu), Probe(mod, "f", cpu, causes=lambda: {"made": made[0]})
    assert Owner().work(1) == 2 and on_class.host_s is not None
    first = on_class.host_s
    assert Owner().work(2) == 3 and on_class.host_s == first      # a later call is not timed again
    assert mod.f(3) == 6 and on_module.host_s is not None and on_module.counts == {"made": 2}
    assert mod.f(3) == 6 and on_module.counts == {"made": 2} and on_class.counts == {}
    on_class.undo()
    on_module.undo()
    assert Owner.work is original and mod.f is f


def test_queued_wait_probe_smoke_run_lists_every_stage(tmp_path):
    """benchmarks/queued_wait_probe.py on tiny random weights on the CPU (a check of the script: nothing is queued
    there, so no stage waits): every stage of a duplex second is called and reported, in the JSON and the table."""
    r = run_benchmark("queued_wait_probe.py", tmp_path, "--tiny", "--conversations", "2", "--warm", "1",
                      one_thread=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "queued_wait_probe.json").read_text())
    assert len(res["stages"]) == 11 and all(s["called"] and not s["waits"] for s in res["stages"])
    table = (tmp_path / "queued_wait_probe.md").read_text()
    assert "| prefill (StaticRows.feed_many) |" in table and "| Code2Wav (Code2Wav.push_many) |" in table


def test_calls_recorded_names_the_project_code_that_called_and_puts_the_method_back(monkeypatch):
    """``--diag``'s graph-capture census (it wraps ``torch.cuda.CUDAGraph.capture_begin``, which needs CUDA, so
    here a plain class stands in): each call records the innermost caller inside ``src/minicpmo_rt`` as
    ``path:function``, runs the original with its arguments, and the method is put back after the block, also
    when the block raises."""
    import pytest
    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from duplex_batch_bench import calls_recorded

    from minicpmo_rt.thinker.staging import upload_ints

    class Target:     # upload_ints calls its ring's upload: a call made from inside the project
        def upload(self, x, scale=1):
            return x * scale

    sites: list[str] = []
    original = Target.__dict__["upload"]
    with calls_recorded(Target, "upload", sites):
        assert Target().upload(3, scale=2) == 6      # called from this test: no project frame
        assert upload_ints(Target(), [1, 2], "cpu").tolist() == [1, 2]
    assert sites == ["?", "thinker/staging.py:upload_ints"]
    assert Target.__dict__["upload"] is original
    with pytest.raises(RuntimeError):
        with calls_recorded(Target, "upload", sites):
            raise RuntimeError("the block fails")
    assert Target.__dict__["upload"] is original


def test_seconds_plot_draws_each_run_and_names_a_bad_input(tmp_path):
    """``duplex_seconds_plot.py`` draws a PNG of each run's seconds (marking those that allocated) and refuses a
    file that is not a ``duplex_batch_bench.py`` JSON or an output that is not a PNG, writing nothing."""
    rows = [{"second": k, "ms": 240.0 + k, "state": {"num_device_alloc": int(k == 1), "host_allocs": int(k == 2)}}
            for k in range(4)]
    good = tmp_path / "run.json"
    good.write_text(json.dumps({"gpu": "test", "runs": [{"rows": rows}, {"rows": rows[:2]}]}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    out = tmp_path / "plot" / "seconds.png"
    r = run_benchmark("duplex_seconds_plot.py", out, f"a={good}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for args, message in (((tmp_path / "b.png", f"a={bad}"), "not a duplex_batch_bench.py JSON"),
                          ((tmp_path / "c.png", str(good)), "LABEL=PATH"),
                          ((tmp_path / "d.svg", f"a={good}"), "name the output *.png")):
        r = run_benchmark("duplex_seconds_plot.py", *args)
        assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
        assert not args[0].exists()


def test_segment_sites_sum_each_new_segment_by_the_project_code_that_asked():
    """``--alloc-sites`` reads the allocator's history (``torch.cuda.memory._snapshot()``'s device traces, whose
    entries are built here as that function returns them: the history needs CUDA). Only segment events count,
    each under its innermost project frame, or its innermost frame when the project has none."""
    import duplex_batch_bench as bench

    ours = {"filename": f"{os.sep}x{os.sep}src{os.sep}minicpmo_rt{os.sep}thinker{os.sep}audio.py", "line": 12,
            "name": "encode"}
    torch_frame = {"filename": f"{os.sep}site-packages{os.sep}torch{os.sep}nn{os.sep}functional.py", "line": 5,
                   "name": "conv1d"}
    mib = 2**20
    events = [{"action": "segment_alloc", "size": 500 * mib, "frames": [torch_frame, ours]},
              {"action": "segment_map", "size": 20 * mib, "frames": [ours]},
              {"action": "alloc", "size": 900 * mib, "frames": [ours]},     # a block from a held segment: not new
              {"action": "segment_alloc", "size": 2 * mib, "frames": [torch_frame]},
              {"action": "segment_free", "size": 64 * mib, "frames": [ours]}]
    assert bench.segment_sites(events) == {"thinker/audio.py:12:encode": 520.0,
                                           f"{os.sep}site-packages{os.sep}torch{os.sep}nn{os.sep}functional.py"
                                           ":5:conv1d": 2.0}
    assert bench.segment_sites([]) == {}
