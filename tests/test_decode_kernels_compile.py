"""Every Triton kernel variant of mrp_triton compiles for a real GPU (sm_90, H100/H200) even on a machine without
one, and the compiled code keeps the properties its speed rests on.

The interpreter accepts things the CUDA lowering rejects (and vice versa), so this test compiles every variant
of ``benchmarks/sm90_kernels.py`` (as a launch at real shapes specialises it) to a cubin with Triton's bundled
ptxas, in a subprocess with the interpreter off, and reads what ``sm90_kernels.report`` finds: the streaming
kernels load their rows as 16-byte vectors (a 2-byte load per element would cap them far below the memory
bandwidth), the fused LM-head tiles are pipelined into wgmma (through TMA where their config asks), and nothing
spills. Then the tiles the launchers fit to other GPUs' shared memory (sm_75, sm_80, sm_86 / sm_89, sm_100,
sm_120, AMD's MI300) compile within it, and every variant compiles for Turing (sm_75: T4), Blackwell (sm_100:
B200; sm_120: RTX 50xx) and an MI300 too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
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
    return _run_compiles()


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
    assert len(streaming) == 64
    for name, loads in streaming.items():
        assert "16" in loads and "2" not in loads, (name, loads)  # 16-byte vectors (bf16: 8 elements), never 1


def test_confidence_loads_the_next_tile_ahead_without_losing_occupancy(reports):
    """Greedy 2048-wide tiles on 8 warps: with prefetch the loop holds the first tile's load and the next one's
    (two 16-byte loads in the code) and still fits as many programs per SM as without."""
    ahead, alone = (reports[f"confidence bf16 res=False sample=False prefetch={p} 2048"] for p in (True, False))
    assert (ahead["loads"]["16"], alone["loads"]["16"]) == (2, 1)
    assert ahead["programs_per_sm"] == alone["programs_per_sm"] >= 3


def test_lm_head_tiles_are_pipelined_into_wgmma(reports):
    tiles = {name: r for name, r in reports.items()
             if name.startswith(("lm_head_confidence bf16", "lm_head_confidence fp16"))}
    assert len(tiles) == 12  # with the verify forward's call listing each row's top 16, a step banning EOS, one
    # computing the entropy, one under a repetition penalty, one adding logit offsets and a bias, and a float16
    # model's step
    assert all(r["pipelined"] and r["wgmma"] for r in tiles.values()), tiles
    # the weight tiles come through the TMA copy engine exactly where the config asks for it
    partials = {name: r for name, r in reports.items() if name.startswith("lm_head_confidence") and "tma=" in name}
    assert len(partials) == 8
    assert all(r["tma"] == ("tma=True" in name) for name, r in partials.items()), partials


# Shared memory a program may use (bytes; what Triton checks a launch against): sm_75 (Turing: T4, RTX 20xx; 64 KiB),
# sm_80 (A100), sm_86 / sm_89 (RTX 30xx / 40xx, A10, L4, L40S: the same 99 KiB), sm_90 (H100 / H200), sm_100
# (Blackwell: B200, as an H200), sm_120 (RTX 50xx, RTX PRO 6000: 99 KiB), and AMD's gfx942 (MI300: 64 KiB of LDS).
SHARED_LIMITS = {75: 65536, 80: 166912, 86: 101376, 90: 232448, 100: 232448, 120: 101376, "gfx942": 65536}


def _run_compiles(*args: str, backend: str = "nvidia") -> dict:
    """What this file run as a script with ``args`` prints: the compiles of one test, with the interpreter off (the
    timeout guards against a hang: a cold Triton cache on a 2-core machine, the other test worker running, took the
    fit test's compiles past 900 s)."""
    if importlib.util.find_spec(f"triton.backends.{backend}") is None:
        pytest.skip(f"triton without its {backend} backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=1800,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_the_tiles_a_launch_picks_fit_each_gpus_shared_memory():
    """lm_head_confidence and cached_attention fit their pipelined tiles to the GPU's shared memory: what they pick
    for each limit, compiled for that GPU, asks no more than it holds (the H200-tuned tables ask up to 192 KiB, which
    an sm_86 / sm_89 GPU or an MI300 would refuse to launch), and on an H200 they pick the tables' bf16 tiles
    unchanged."""
    fitted = _run_compiles("fit")
    assert len(fitted) >= 20
    over = {name: f for name, f in fitted.items() if f["shared"] > f["limit"]}
    assert not over, over
    assert all(f["stages"] >= 2 for f in fitted.values() if "bf16" in f["name"]), fitted


@pytest.mark.parametrize("arch, backend", [("75", "nvidia"), ("100", "nvidia"), ("120", "nvidia"), ("gfx942", "amd")],
                         ids=["sm_75", "sm_100", "sm_120", "mi300"])
def test_every_variant_compiles_for_other_gpus(arch, backend):
    """Every kernel variant compiles for a Turing GPU (sm_75, a T4: no bf16 tensor cores, so Triton converts bf16
    operands for its fp16 / fp32 units), for Blackwell (sm_100: B200; sm_120: RTX 50xx) and for AMD's backend
    (gfx942), but for the LM-head tiles that fetch the weight through NVIDIA's TMA copy engine (a config only a
    sweep sets) where the GPU has none (before sm_90, AMD's); and those whose tiles no launcher fits to the GPU (all
    but the LM-head and attention tiles, which the test above checks) fit its shared memory."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sm90_kernels

    compiled = _run_compiles("compile", arch, backend=backend)
    tma = arch.isdigit() and int(arch) >= 90
    assert sorted(compiled) == sorted(v.name for v in sm90_kernels.variants() if tma or "tma=True" not in v.name)
    limit = SHARED_LIMITS[int(arch) if arch.isdigit() else arch]
    over = {name: shared for name, shared in compiled.items()
            if shared > limit and not name.startswith(("lm_head_confidence", "cached_attention"))}
    assert not over, over


def _fitted_variants() -> list[tuple[int, object]]:
    """(arch, variant) of what the launchers pick at each of SHARED_LIMITS: the LM-head tiles of decoding's row counts
    at two hidden sizes (with a verify forward's top-16 lists: the most shared memory), the attention tiles of
    several head groups, bf16 and fp32 (one variant per distinct config and arch; sm_75's without asynchronous
    copies, :func:`mrp_triton.backend.before_ampere`)."""
    import torch

    import sm90_kernels
    from mrp_triton.cached_attention import _tiles
    from mrp_triton.lm_head_confidence import _config, _table

    out, seen = [], set()
    for arch, limit in SHARED_LIMITS.items():
        if isinstance(arch, str) and importlib.util.find_spec("triton.backends.amd") is None:
            continue  # a Triton built without AMD's backend
        for n in (16, 32, 64, 128):
            for h in (2048, 4096):
                config = _config(n, 151936, h, torch.bfloat16, limit)
                if arch == 90:
                    assert config == _table(n, 151936, h, torch.bfloat16), (n, h)
                key = ("lm_head", arch, tuple(sorted(config.items())))
                if key not in seen:
                    seen.add(key)
                    out.append((arch, sm90_kernels.lm_head_variant(
                        f"lm_head_confidence bf16 top_m=16 N={n} H={h} {arch}", {**config, "top_m": 16})))
        for dt, d, group in (("bf16", 128, 1), ("bf16", 128, 2), ("bf16", 128, 4), ("bf16", 128, 8), ("bf16", 64, 8),
                             ("fp32", 128, 2), ("fp32", 128, 8), ("fp32", 64, 8)):
            tiles = _tiles(getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dt]), d,
                           1 << (group - 1).bit_length(), limit, async_copy=not isinstance(arch, int) or arch >= 80)
            if arch == 90 and dt == "bf16":
                assert tiles == (16, 64, 3), (d, group)
            key = ("attention", arch, dt, d, group, *tiles)
            if key not in seen:
                seen.add(key)
                block_m, block_n, stages = tiles
                v = sm90_kernels.attention_variant(f"*{dt}", False, d, group, 1, False, block_n, stages, block_m)
                out.append((arch, dataclasses.replace(v, name=f"{v.name} {block_m}x{block_n}x{stages} {arch}")))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sm90_kernels

    if sys.argv[1:2] == ["compile"]:
        arch = int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2]
        tma = isinstance(arch, int) and arch >= 90
        found = {v.name: sm90_kernels.compile_variant(v, arch).metadata.shared
                 for v in sm90_kernels.variants() if tma or "tma=True" not in v.name}
        print(json.dumps(found))
    elif sys.argv[1:] == ["fit"]:
        found = {}
        for arch, v in _fitted_variants():
            compiled = sm90_kernels.compile_variant(v, arch)
            found[v.name] = {"name": v.name, "shared": compiled.metadata.shared, "limit": SHARED_LIMITS[arch],
                             "stages": v.num_stages}
        print(json.dumps(found))
    else:
        found = {v.name: sm90_kernels.report(v, sm90_kernels.compile_variant(v)) for v in sm90_kernels.variants()}
        print(json.dumps(found))
