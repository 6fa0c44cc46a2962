"""Every Triton kernel variant of mrp_triton compiles for a real GPU (sm_90, H100/H200) even on a machine without
one, and the compiled code keeps the properties its speed rests on.

The interpreter accepts things the CUDA lowering rejects (and vice versa), so this test compiles every variant
of ``benchmarks/sm90_kernels.py`` (as a launch at real shapes specialises it) to a cubin with Triton's bundled
ptxas, in a subprocess with the interpreter off, and reads what ``sm90_kernels.report`` finds: the streaming
kernels load their rows as 16-byte vectors (a 2-byte load per element would cap them far below the memory
bandwidth), the fused LM-head tiles are pipelined into wgmma (through TMA where their config asks), and nothing
spills.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# one pass over their rows: bandwidth is their speed (the backward kernels of the first four too)
STREAMING = ("confidence bf16", "confidence fp16", "confidence fp32", "rms_norm", "swiglu", "mrp_input",
             "qk_norm_rope", "candidate_confidence", "softmax_kl")  # candidate_confidence: the gathered lm_head rows


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_every_variant_compiles_for_sm90(reports):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sm90_kernels

    assert sorted(reports) == sorted(v.name for v in sm90_kernels.variants())
    assert {name.split()[0] for name in reports} == {
        "confidence", "select", "verify", "remask", "settle_rows", "cached_attention", "lm_head_confidence",
        "rms_norm", "swiglu", "qk_norm_rope", "mrp_input", "candidate_confidence", "rms_norm_backward",
        "swiglu_backward", "qk_norm_rope_backward", "softmax_kl_stats", "softmax_kl"}
    assert all(r["spill_bytes"] == 0 for r in reports.values()), {n: r["spill_bytes"] for n, r in reports.items()}


def test_streaming_kernels_load_16_byte_vectors(reports):
    streaming = {name: r["loads"] for name, r in reports.items() if name.startswith(STREAMING)}
    assert len(streaming) == 44
    for name, loads in streaming.items():
        assert "16" in loads and "2" not in loads, (name, loads)  # 16-byte vectors (bf16: 8 elements), never 1


def test_confidence_loads_the_next_tile_ahead_without_losing_occupancy(reports):
    """Greedy 2048-wide tiles on 8 warps: with prefetch the loop holds the first tile's load and the next one's
    (two 16-byte loads in the code) and still fits as many programs per SM as without."""
    ahead, alone = (reports[f"confidence bf16 res=False sample=False prefetch={p} 2048"] for p in (True, False))
    assert (ahead["loads"]["16"], alone["loads"]["16"]) == (2, 1)
    assert ahead["programs_per_sm"] == alone["programs_per_sm"] >= 3


def test_lm_head_tiles_are_pipelined_into_wgmma(reports):
    tiles = {name: r for name, r in reports.items() if name.startswith("lm_head_confidence bf16")}
    assert len(tiles) == 7  # with the verify forward's call that also lists each row's top 16
    assert all(r["pipelined"] and r["wgmma"] for r in tiles.values()), tiles
    # the weight tiles come through the TMA copy engine exactly where the config asks for it
    partials = {name: r for name, r in reports.items() if name.startswith("lm_head_confidence") and "tma=" in name}
    assert len(partials) == 8
    assert all(r["tma"] == ("tma=True" in name) for name, r in partials.items()), partials


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sm90_kernels

    found = {v.name: sm90_kernels.report(v, sm90_kernels.compile_variant(v)) for v in sm90_kernels.variants()}
    print(json.dumps(found))
