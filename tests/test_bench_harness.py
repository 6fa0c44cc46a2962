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
