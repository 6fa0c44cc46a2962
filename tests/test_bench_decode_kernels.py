"""The decode-kernel benchmark runs end to end (tiny --smoke mode through the interpreter on CPU)."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="smoke mode is the CPU path; the GPU run is the real bench")
def test_smoke_run_writes_results(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode_kernels.py"), "--smoke",
                        "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(tmp_path / "decode_kernels_smoke.csv")))
    kernels = {row["kernel"] for row in rows}
    assert {"confidence_res", "confidence_nores", "confidence_topkp", "confidence_minp", "confidence_epsilon_eta",
            "confidence_toph", "confidence_typical", "confidence_ban", "confidence_penalty", "confidence_offsets",
            "confidence_entropy",
            "select_static", "select_entropy", "verify", "remask_tau", "remask_delta"} <= kernels
    assert all(row["gpu"] and row["torch"] and row["triton"] for row in rows)


def test_without_cuda_exits_with_message():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode_kernels.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA device" in r.stderr
