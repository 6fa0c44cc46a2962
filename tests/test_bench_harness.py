"""benchmarks/_harness.py: what every benchmark's rows are stamped with (the commit) and measured against (eager)."""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _harness  # noqa: E402


def test_commit_marks_figures_of_a_tree_no_commit_holds(monkeypatch):
    out = {"rev-parse": "abc1234", "status": " M mrp_triton/confidence.py"}
    monkeypatch.setattr(_harness.subprocess, "run", lambda args, **kw: SimpleNamespace(stdout=out[args[1]]))
    assert _harness.commit() == "abc1234+changes"
    out["status"] = ""
    assert _harness.commit() == "abc1234"
    out["rev-parse"] = ""  # not a checkout
    monkeypatch.delenv("MRP_COMMIT", raising=False)
    assert _harness.commit() == "unknown"
    monkeypatch.setenv("MRP_COMMIT", "def5678")  # what the device run's launcher says it copied
    assert _harness.commit() == "def5678"
    out["rev-parse"] = "abc1234"  # a checkout's own hash wins
    assert _harness.commit() == "abc1234"


def test_triton_rows_carry_the_eager_median_they_are_compared_with(capsys):
    """Each triton<suffix> row is recorded with the median of its own torch_eager<suffix> row (the speedup), and a
    timing that fails is reported and skipped: the Triton row is still timed when the eager one cannot be."""
    rows = []
    timings = {"eager": [10.0, 9.0, 12.0], "triton": [2.0, 1.5, 2.5]}

    def bench(fn):
        return timings[fn()]

    def broken(fn):
        raise RuntimeError("cannot capture")

    def eager_broken(fn):
        return broken(fn) if fn() == "eager" else [1.0, 0.9, 1.1]

    eager = _harness.time_against_eager({"": bench, "_graph": broken, "_eager_broken": eager_broken},
                                        lambda: "eager", lambda: "triton", lambda *row: rows.append(row), "op")
    assert rows == [("torch_eager", [10.0, 9.0, 12.0], None), ("triton", [2.0, 1.5, 2.5], 10.0),
                    ("triton_eager_broken", [1.0, 0.9, 1.1], None)]
    assert eager == {"": 10.0}
    err = capsys.readouterr().err
    assert "op: timing torch_eager_graph failed" in err and "op: timing triton_graph failed" in err
    assert "op: timing torch_eager_eager_broken failed" in err


def test_commit_asks_git_about_tracked_files_only(monkeypatch):
    """An untracked file (a results folder the run writes) does not make the tree "+changes": git is asked with
    --untracked-files=no."""
    calls = []

    def run(args, **kw):
        calls.append(args)
        return SimpleNamespace(stdout="abc1234" if args[1] == "rev-parse" else "")

    monkeypatch.setattr(_harness.subprocess, "run", run)
    assert _harness.commit() == "abc1234"
    assert ["git", "status", "--porcelain", "--untracked-files=no"] in calls


def test_cpu_bench_reports_median_p20_p80_of_three_timed_calls(monkeypatch):
    """Off CUDA (--smoke): one warm-up call, then three timed ones, reported as [middle, fastest, slowest] in us."""
    clock = iter([0.0, 3e-6, 10.0, 10.000001, 20.0, 20.000002])  # three calls: 3 us, 1 us, 2 us
    monkeypatch.setattr(_harness.time, "perf_counter", lambda: next(clock))
    calls = []
    q = _harness.make_bench(False, warmup=1, rep=1)(lambda: calls.append(1))
    assert len(calls) == 4
    assert [round(x, 3) for x in q] == [2.0, 1.0, 3.0]


def test_cuda_or_smoke_needs_a_gpu_or_smoke_and_smoke_turns_the_interpreter_on(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _harness.cuda_or_smoke("bench_x", smoke=False) is None
    assert "bench_x: no CUDA device found" in capsys.readouterr().err and "TRITON_INTERPRET" not in _harness.os.environ
    assert _harness.cuda_or_smoke("bench_x", smoke=True) is False
    assert _harness.os.environ["TRITON_INTERPRET"] == "1"
    assert _harness.run_meta(False)["gpu"].startswith("cpu-interpreter")


def test_write_results_formats_floats_and_replaces_files_whole(tmp_path):
    out = tmp_path / "new" / "folder"
    rows = [{"kernel": "op", "median_us": 1.23456, "n": 3}]
    assert _harness.write_results(out, "bench", ["kernel", "median_us", "n"], rows, {"rows": rows}, ".2f") == out
    assert (out / "bench.csv").read_text().splitlines() == ["kernel,median_us,n", "op,1.23,3"]
    assert (out / "bench.json").read_text() == _harness.json.dumps({"rows": rows}, indent=1)  # the doc unformatted
    _harness.write_results(out, "bench", ["kernel", "median_us", "n"], rows, {"rows": []})
    assert (out / "bench.csv").read_text().splitlines()[1] == "op,1.23456,3"
    assert sorted(p.name for p in out.iterdir()) == ["bench.csv", "bench.json"]  # no temporary file left
