"""The engine benchmark runs end to end in its --smoke mode (tiny float32 model, CPU, reference ops)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_engine.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="smoke mode is the CPU path; the GPU run is the real bench")
def test_bench_engine_smoke(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_engine", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    counts = {"output_tokens": 100, "backbone_forwards": 50, "verify_rounds": 42, "mrp_forwards": 120, "tpf": 2.0}
    static = {"mode": "static", "output_tokens": 100, "backbone_forwards": 100}
    files = [tmp_path / "e2e.json", tmp_path / "e2e_candidates.json"]  # each mode read from the file that has it
    for path, mode in zip(files, (mod.SPEC_MODE, mod.CANDIDATES_MODE)):
        path.write_text(json.dumps({"rows": [static, {"mode": mode, **counts}]}))
    assert mod.main(["--smoke", "--out", str(tmp_path), "--e2e", *map(str, files), "--decode-reps", "1"]) == 0

    rows = json.loads((tmp_path / "engine_smoke.json").read_text())["rows"]
    kinds = {(r["kernel"], r["provider"]) for r in rows}
    assert kinds == {("step", "eager"), ("step", "cuda_graph"), ("whole_step", "eager"), ("whole_step", "cuda_graph"),
                     ("step", "unpacked"), ("whole_step", "unpacked"), ("whole_step", "draft_vocab=16"),
                     ("whole_step", "draft_candidates=16"), ("speculative_estimate", "draft_candidates=16"),
                     ("decode", "eager"), ("decode", "cuda_graph"), ("decode", "cuda_graph, first call"),
                     ("speculative_estimate", "cuda_graph"),
                     ("host_checks", "cuda_graph"), ("host_checks", "cuda_graph, device_loop"),
                     ("host_checks", "cuda_graph, lagged reads"),
                     ("attention", "sdpa_cat"), ("attention", "triton"), ("attention", "triton_one_split"),
                     ("prefill", "chunk=none"), ("prefill", "chunk=16")}
    prefill = [r for r in rows if r["kernel"] == "prefill"]
    assert [r["shape"] for r in prefill] == [f"tiny B={b} prompt {mod.SMOKE_PREFILL_TOKENS}" for b in (1, 1, 2, 2)]
    assert [r["ratio"] for r in prefill[::2]] == [1.0, 1.0] and all(r["ratio"] > 0 for r in prefill)
    for batch in (1, 2):
        shapes = {r["shape"] for r in rows if r["kernel"] in ("step", "whole_step") and r["provider"] == "cuda_graph"}
        assert {f"tiny B={batch} plain q=16", f"tiny B={batch} verify copies=4", f"tiny B={batch} mrp D=3",
                f"tiny B={batch} static step", f"tiny B={batch} speculative round K=3"} <= shapes
        riding = {f"tiny B={batch} static step + commit", f"tiny B={batch} speculative round K=3 + commit"}
        if batch > 1:  # and the ragged forward, one row's finished block in front
            riding |= {f"tiny B={batch} static step + commit of one row",
                       f"tiny B={batch} speculative round K=3 + commit of one row"}
        assert riding <= shapes
        unpacked = {r["shape"]: r for r in rows if r["provider"] == "unpacked"}
        assert {f"tiny B={batch} plain q=16", f"tiny B={batch} static step"} <= unpacked.keys()
        assert all(r["ratio"] > 0 and r["ratio_to"] == "packed (cuda_graph)" for r in unpacked.values())
    for r in rows:
        assert r["median_us"] > 0
        if r["kernel"] == "decode":
            assert r["tokens_per_s"] > 0
        if r["kernel"] == "speculative_estimate":
            assert r["ratio"] > 0


def test_the_speculative_estimate_compares_with_static_decodings_own_steps(tmp_path):
    """Lossless speculative decoding gives static's output, so its speedup is static's time (its own forwards, from
    the same file) over the rounds' and openings' time; a file of an older run (no output_tokens) is passed over."""
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_engine", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps({"rows": [{"mode": "static", "backbone_forwards": 1}, {"mode": mod.SPEC_MODE}]}))
    new.write_text(json.dumps({"rows": [
        {"mode": "static", "output_tokens": 1650, "backbone_forwards": 1658},
        {"mode": mod.SPEC_MODE, "output_tokens": 1650, "tokens": 1667, "backbone_forwards": 806, "verify_rounds": 686,
         "mrp_forwards": 1932, "tpf": 2.07}]}))
    counts = mod._spec_counts([old, new])
    assert counts["source"] == "new.json" and counts["static_forwards"] == 1658
    rows = []
    mod._estimate_row(lambda *a, **kw: rows.append((a, kw)), "1.7B B=1 K=3", "cuda_graph", counts, 3000.0, 2000.0)
    (_, _, _, q), kw = rows[0]
    spent = 686 * 3000.0 + 120 * 2000.0
    assert kw["ratio"] == pytest.approx(1658 * 2000.0 / spent) and q[0] == pytest.approx(spent / 1650)
    assert mod._spec_counts([old]) is None
