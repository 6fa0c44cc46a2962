"""The per-forward model benchmark runs end to end in its --smoke mode (tiny float32 model, CPU, reference ops).

``--no-compile`` keeps it to about a second: Dynamo's tracing of the MRP head alone takes several
seconds on CPU (``python benchmarks/bench_model_steps.py --smoke`` runs that part too)."""

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_model_steps.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_model_steps", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="smoke mode is the CPU path; the GPU run is the real bench")
def test_bench_model_steps_smoke(tmp_path):
    threads = torch.get_num_threads()
    assert _load().main(["--smoke", "--no-compile", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads and torch.get_default_dtype() == torch.float32

    data = json.loads((tmp_path / "model_steps_smoke.json").read_text())
    assert not data["failures"]
    rows = data["rows"]
    names = {(r["kernel"], r["provider"]) for r in rows}
    assert names == {("weight_read_floor", "copy_bw_floor"), ("backbone_denoise", "eager"),
                     ("backbone_verify", "eager"), ("mrp_head", "eager")}
    for batch in (1, 2):
        shapes = {r["shape"] for r in rows if f"B={batch} " in r["shape"]}
        assert {f"tiny B={batch} q={q} prefix=32" for q in (16, 64, 128)} <= shapes
        assert {f"tiny B={batch} copies={c} q={16 * c} prefix=32" for c in (2, 3, 4, 5)} <= shapes
        assert f"tiny B={batch} D=3 q=16 prefix=32" in shapes
    block = [r for r in rows if r["kernel"] == "backbone_denoise" and r["tokens"] == 16]
    assert len(block) == 2 and all(r["ratio"] == 1.0 for r in block)
    for r in rows:
        assert r["median_us"] > 0 and r["p20_us"] <= r["median_us"] <= r["p80_us"]
        assert r["gpu"] and r["torch"] and r["triton"] and r["commit"]
        if r["kernel"] in ("backbone_verify", "mrp_head"):
            assert r["ratio"] > 0 and r["ratio_to"].startswith("backbone_denoise q=16")
    # copy 0 of a verify forward is the plain block: the same hidden states
    checks = data["checks"]
    assert len(checks) == 8 and all(k.startswith("verify copy0") and v < 1e-4 for k, v in checks.items())

    with open(tmp_path / "model_steps_smoke.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    assert list(table[0])[:9] == ["kernel", "shape", "provider", "median_us", "p20_us", "p80_us", "ratio",
                                  "ratio_to", "x_weight_read"]


def test_without_cuda_exits_2_with_message():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", "/nonexistent"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "no CUDA device" in r.stderr and "--smoke" in r.stderr
