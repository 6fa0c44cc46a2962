"""What a decoding step launches on a GPU (``benchmarks/launch_counts.py``, counted on the CPU): each decoder layer
of a decoding forward is 4 GEMMs and 5 of our kernels and nothing else, in the backbone and in the MRP head, so the
glue between the ops (masks, gathers, counters) is paid once per step, not once per layer; and a finished block's
commit rides in the next step's forward instead of costing one of its own."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

from tiny_models import random_prompts, tiny_model

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "launch_counts.py"
LAYER = Counter({"mm": 4, "op:rms_norm": 2, "op:qk_norm_rope": 1, "op:cached_attention": 1, "op:swiglu": 1})


@pytest.fixture(scope="module")
def launch_counts():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("launch_counts", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _steps(launch_counts, layers: int = 2, mrp_layers: int = 2, **settings) -> dict[str, Counter]:
    model = tiny_model(seed=3, num_hidden_layers=layers, num_nextn_predict_layers=mrp_layers)
    return launch_counts.step_launches(model, random_prompts(1, 5, seed=1), max_new_tokens=12, **settings)


def _difference(more: Counter, fewer: Counter) -> Counter:
    more, fewer = Counter(more), Counter(fewer)
    assert not fewer - more, fewer - more  # nothing launched less often with more layers
    return more - fewer


@pytest.mark.parametrize("packed", [True, False])
def test_a_backbone_layer_is_four_gemms_and_five_kernels(launch_counts, packed):
    """One more layer adds exactly one layer's launches to a denoising step; unpacked, its q/k/v and gate/up
    projections are 7 GEMMs instead of 4."""
    two, three = (_steps(launch_counts, layers=n, packed_projections=packed)["denoise"] for n in (2, 3))
    assert _difference(three, two) == LAYER + Counter({"mm": 0 if packed else 3})


def test_an_mrp_layer_is_four_gemms_and_five_kernels(launch_counts):
    """Direct decoding's MRP step runs the head once: one more MRP layer adds one layer's launches."""
    one, two = (_steps(launch_counts, mrp_layers=n, strategy="direct", mrp_steps=2)["direct_mrp"] for n in (1, 2))
    assert _difference(two, one) == LAYER


def test_a_verify_round_pays_its_glue_once_per_round(launch_counts):
    """A speculative round (K MRP steps and the verify forward): one more backbone layer adds one layer's launches,
    one more MRP layer adds K of them (one per draft step); what is not an op or a GEMM stays as it is."""
    K = 3
    base = _steps(launch_counts, strategy="speculative", mrp_steps=K)["speculate"]
    deeper = _steps(launch_counts, layers=3, strategy="speculative", mrp_steps=K)["speculate"]
    assert _difference(deeper, base) == LAYER
    wider_head = _steps(launch_counts, mrp_layers=3, strategy="speculative", mrp_steps=K)["speculate"]
    assert _difference(wider_head, base) == Counter({k: K * n for k, n in LAYER.items()})


def test_the_commit_rides_in_the_next_steps_forward(launch_counts):
    """The step after a block filled runs the same forward (the same ops and GEMMs) with the finished block in front
    of it; only the cache writes are added: per layer one write of its keys and one of its values (their slots are
    computed once a forward). Without fuse_commit the commit is a forward of its own."""
    steps = _steps(launch_counts)
    plain, riding = (launch_counts.grouped(steps[name]) for name in ("denoise", "denoise+commit"))
    assert (riding["ops"], riding["gemms"]) == (plain["ops"], plain["gemms"])
    deeper = _steps(launch_counts, layers=3)["denoise+commit"]
    assert _difference(deeper, steps["denoise+commit"]) == LAYER + Counter({"scatter_": 2})
    assert "denoise+commit" not in _steps(launch_counts, fuse_commit=False)


def test_counts_come_from_the_steps_and_leave_the_ops_as_they_were(launch_counts):
    """Every graphed step of a call is counted (also replayed from CUDA graphs on CPU) and the ops are restored
    afterwards. A replayed step launches what the eager one does, less the eager cache's host read of its longest
    row after a commit (a graphed step reads the whole cache width instead: no host synchronisation)."""
    import mrp_triton

    before = {name: getattr(mrp_triton, name) for name in launch_counts.OPS}
    eager = _steps(launch_counts, strategy="speculative", mrp_steps=2, cuda_graphs=False)
    replayed = _steps(launch_counts, strategy="speculative", mrp_steps=2, cuda_graphs=True)
    assert {name: getattr(mrp_triton, name) for name in launch_counts.OPS} == before
    assert "speculate" in eager and any(name.startswith("open") for name in eager)
    host_read = Counter({"max": 1, "_local_scalar_dense": 1})
    assert all(count["_local_scalar_dense"] == 1 for name, count in eager.items() if "commit" in name)
    assert {name: count - host_read if "commit" in name else count for name, count in eager.items()} == replayed
    assert all("_local_scalar_dense" not in count for count in replayed.values())
    grouped = launch_counts.grouped(eager["speculate"])
    assert grouped["ops"] > 0 and grouped["gemms"] > 0
    assert grouped["total"] == grouped["ops"] + grouped["gemms"] + grouped["other"]
    assert not {"view", "_unsafe_view", "expand", "t"} & set(eager["speculate"])  # views launch nothing
