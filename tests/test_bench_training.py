"""The training benchmark runs both modes end to end (a few tiny steps on the CPU), and a loss that is not finite
fails it."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from training_fixtures import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_training.py"


@pytest.mark.slow
def test_both_modes_train_and_report_their_setup_losses_and_speed(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--steps", "3", "--warmup", "1", "--seq-len", "32",
                        "--micro-batch-size", "2", "--activation-checkpointing", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=subprocess_env(str(ROOT)), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "training_cpu.json").read_text())
    rows = {row["mode"]: row for row in result["rows"]}
    assert list(rows) == ["mrp", "backbone"] and result["meta"]["torch"]
    for mode, row in rows.items():
        assert row["steps"] == 3 and row["device"] == "cpu" and row["attention"] == "sdpa", mode
        assert row["activation_checkpointing"] is True, mode
        assert row["tokens_per_s"] > 0 and 0 < row["first_step_s"] < row["wall_s"], mode
        assert all(math.isfinite(row[k]) for k in ("loss_first", "loss_last", "eval_loss")), mode
        lines = (tmp_path / f"training_cpu_{mode}_metrics.jsonl").read_text().splitlines()
        assert "setup" in json.loads(lines[0]), mode
    # the backbone starts from random weights: about ln(V) nats a masked token; the head from the shipped one's
    assert abs(rows["backbone"]["loss_first"] - math.log(2048)) < 1.0
    assert rows["mrp"]["loss_first"] < 0.5 and len(rows["mrp"]["eval_pick_agreement"]) >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["training_cpu.csv", "training_cpu.json", "training_cpu_mrp_metrics.jsonl",
         "training_cpu_backbone_metrics.jsonl"])  # the runs' exports are not kept


def test_a_loss_that_is_not_finite_fails_the_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_training", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(["--steps", "3", "--warmup", "1"])
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "setup": {"device": "cpu", "ops": "reference", "attention": "sdpa", "bf16_autocast": False,
                                   "activation_checkpointing": False}},
             *({"step": i, "loss": loss, "lr": 1e-3, "tokens_per_s": 10.0, "elapsed_s": i} for i, loss in
               enumerate([2.0, float("nan"), 1.0], 1)),
             {"step": 3, "eval_loss": 1.5}]
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(SystemExit, match="backbone: a loss is not finite"):
        bench.summarise("backbone", args, metrics, 1.0, None)
    lines[2]["loss"] = 1.5
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    row = bench.summarise("backbone", args, metrics, 1.0, None)
    assert (row["loss_first"], row["loss_last"], row["tokens_per_s"]) == (2.0, 1.0, 10.0)


def test_each_finished_mode_is_saved_before_the_next_one_runs(tmp_path, monkeypatch):
    """A run stopped in its second mode (a time limit on the GPU) keeps the first mode's row."""
    import training.cli

    spec = importlib.util.spec_from_file_location("bench_training", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    setup = {"device": "cpu", "ops": "reference", "attention": "sdpa", "bf16_autocast": False,
             "activation_checkpointing": False}
    lines = [{"step": 0, "setup": setup}, *({"step": i, "loss": 2.0 / i, "lr": 1e-3, "tokens_per_s": 10.0,
                                             "elapsed_s": i} for i in (1, 2, 3)), {"step": 3, "eval_loss": 1.5}]

    def fake_train(argv):
        if argv[0] == "backbone":
            raise KeyboardInterrupt("the time limit")
        out = Path(argv[argv.index("--out") + 1])
        (out / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    monkeypatch.setattr(training.cli, "main", fake_train)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--steps", "3", "--warmup", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "training_cpu.json").read_text())["rows"]
    assert [row["mode"] for row in rows] == ["mrp"] and rows[0]["loss_last"] == 2.0 / 3
    assert (tmp_path / "training_cpu.csv").read_text().count("\n") == 2
