"""The host-text benchmark runs end to end (a short row; it times the tokenizer's work, on any machine)."""

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_run_times_each_method(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_host_text.py"), "--tokens", "40",
                        "--blocks", "4,16", "--reps", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(tmp_path / "host_text_cpu.csv")))
    assert [(row["block"], row["method"]) for row in rows] == [
        ("4", "whole_decode"), ("4", "stop_strings"), ("16", "whole_decode"), ("16", "stop_strings"),
        ("", "token_offsets")]
    assert all(float(row["median_ms"]) > 0 and row["tokens"] == "40" for row in rows)
    assert [bool(row["ratio_to_whole_decode"]) for row in rows] == [False, True, False, True, False]
