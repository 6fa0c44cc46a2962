"""The KD-loss benchmark runs end to end (tiny shapes; it measures PyTorch code, so it runs on any device)."""

import csv
import subprocess
import sys
from pathlib import Path

from training_fixtures import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_run_writes_every_provider(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kd_loss.py"), "--rows", "3,17",
                        "--hidden", "8", "--vocab", "301", "--reps", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (results,) = tmp_path.glob("kd_loss_*.csv")  # kd_loss_cpu.csv or kd_loss_cuda.csv
    rows = list(csv.DictReader(open(results)))
    providers = ["dense", "chunked", "chunked_tf32", "chunked_bf16", "chunked_tf32_torch_kl"]
    assert [(row["rows"], row["provider"]) for row in rows] == [(n, p) for n in ("3", "17") for p in providers]
    assert all(float(row["median_ms"]) > 0 and row["torch"] for row in rows)
    errors = {(row["rows"], row["provider"]): (float(row["loss_rel_err"]), float(row["grad_rel_err"])) for row in rows}
    for n in ("3", "17"):  # gradients against fp64: fp32 close, bf16 inputs measurably rounded
        assert errors[n, "dense"][1] < 1e-4 and errors[n, "chunked"][1] < 1e-4
        assert errors[n, "chunked_tf32_torch_kl"][1] < 1e-4  # off CUDA tf32 is fp32; the KL step in torch ops
        assert 10 * errors[n, "chunked"][1] < errors[n, "chunked_bf16"][1] < 0.1


def test_rows_of_the_shipped_model(tmp_path):
    """``--model``: the rows an MRP training step of the shipped model's head scores, at every precision."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kd_loss.py"), "--model",
                        str(ROOT / "hf_integration" / "shipped" / "sdar-stdlib-mrp"), "--batches", "1", "--reps", "1",
                        "--tag", "shipped", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env=subprocess_env(str(ROOT)))  # the model on the reference ops, not the interpreter
    assert r.returncode == 0, r.stderr
    (results,) = tmp_path.glob("kd_loss_*_shipped.csv")
    rows = {row["provider"]: row for row in csv.DictReader(open(results))}
    assert list(rows) == ["dense", "chunked", "chunked_tf32", "chunked_bf16", "chunked_tf32_torch_kl"]
    assert len({row["rows"] for row in rows.values()}) == 1 and int(rows["dense"]["rows"]) > 100
    assert (rows["dense"]["hidden"], rows["dense"]["vocab"]) == ("128", "2048")
    assert float(rows["chunked"]["grad_rel_err"]) * 10 < float(rows["chunked_bf16"]["grad_rel_err"])
