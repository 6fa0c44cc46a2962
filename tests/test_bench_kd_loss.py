"""The KD-loss benchmark runs end to end (tiny shapes; it measures PyTorch code, so it runs on any device)."""

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_run_writes_both_providers(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kd_loss.py"), "--rows", "3,17",
                        "--hidden", "8", "--vocab", "301", "--reps", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (results,) = tmp_path.glob("kd_loss_*.csv")  # kd_loss_cpu.csv or kd_loss_cuda.csv
    rows = list(csv.DictReader(open(results)))
    assert [(row["rows"], row["provider"]) for row in rows] == [
        ("3", "dense"), ("3", "chunked"), ("17", "dense"), ("17", "chunked")]
    assert all(float(row["median_ms"]) > 0 and row["torch"] for row in rows)
