"""The MRP-head benchmark runs end to end in its --smoke mode (Triton interpreter, tiny shapes), with a tile sweep
at one N (every config checked against the logits, then timed)."""

import importlib.util
import json
from pathlib import Path


def test_bench_mrp_head_smoke(tmp_path):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_mrp_head.py"
    spec = importlib.util.spec_from_file_location("bench_mrp_head", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--smoke", "--no-compile", "--sweep", "--sweep-rows", "5", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "mrp_head_smoke.json").read_text())
    assert not data["failures"]
    kernels = {r["kernel"] for r in data["rows"]}
    swept = {(r["shape"], r["provider"]) for r in data["rows"] if r["provider"].startswith("sweep_")}
    assert swept == {("N=5 H=64 V=1000", f"sweep_{i}") for i in range(len(mod.SWEEP))}  # each checked, then timed
    assert {"candidate_confidence", "lm_head_confidence", "rms_norm", "qk_norm_rope", "swiglu", "mrp_input"} <= kernels
    trained = {(r["kernel"], r["provider"]) for r in data["rows"] if r["kernel"].endswith("fwd+bwd")}
    assert trained == {(f"{op} fwd+bwd", p) for op in ("rms_norm+residual", "qk_norm_rope", "swiglu", "mrp_input")
                       for p in ("torch_eager", "triton")}
    attention = {(r["kernel"], r["provider"]) for r in data["rows"] if r["kernel"].startswith("attention")}
    assert attention == {("attention fwd", "sdpa_dense_mask"), ("attention fwd", "flex_block_mask")}
    assert (tmp_path / "mrp_head_smoke.csv").read_text().startswith("kernel,shape,provider,median_us")
