"""Helpers shared by the kernel tests: the device they run on, poisoned allocations, per-dtype tolerances,
and the row / score draws of the decode-op strategies."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
from unittest import mock

import torch
from hypothesis import strategies as st

# Triton's CPU interpreter truncates fp32 -> bf16 (round toward zero) where CUDA rounds to
# nearest even, so bf16 results may differ from torch by up to ~2 ulp (2^-6 relative).
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Where the kernel tests run the kernels: the GPU when there is one and Triton's interpreter is off (as in
# benchmarks/gpu_session.sh), else the CPU under the interpreter.
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def tol(dtype: torch.dtype) -> dict:
    return TOL[dtype]


# The norm ops' tests (forward and backward): an eps, and one that shows where a kernel drops it or uses another;
# input scales, rows of tiny or zero values among them, whose mean square eps dominates.
NORM_EPS = 1e-6
NORM_EPSILONS = (NORM_EPS, 0.05)
NORM_SCALES = (1.0, 1.0, 1e-4, 0.0)


def seeded_randn(shape, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """``scale`` * a standard normal tensor of ``shape`` drawn from ``seed`` (on the CPU, so the same values on
    every machine), on DEV in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(DEV, dtype)


@contextlib.contextmanager
def poisoned_allocations():
    """Make ``torch.empty``/``empty_like`` return NaN (floats) or -7 (ints) filled tensors, so
    any output element a kernel forgets to write fails the comparison."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-7)
        return t

    with mock.patch.object(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k))), \
            mock.patch.object(torch, "empty_like", lambda *a, **k: fill(real_empty_like(*a, **k))):
        yield


def backward_nodes(t: torch.Tensor) -> set[str]:
    """Class names of every node in the autograd graph that ends in ``t`` (e.g. ``_RMSNormBackward`` for an op run
    through its backward kernel)."""
    seen, names, stack = set(), set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


KERNEL_BACKWARDS = {"_RMSNormBackward", "_SwiGLUBackward", "_QKNormRopeBackward"}  # the ops every decoder layer runs


def draw_rows(draw, max_rows: int = 8, max_len: int = 40):
    """Inside an ``@st.composite``: draw B in [1, max_rows], L in [1, max_len] and a seeded
    ``torch.Generator`` (hypothesis picks the seed, torch makes the tensors)."""
    B, L = draw(st.integers(1, max_rows)), draw(st.integers(1, max_len))
    return B, L, torch.Generator().manual_seed(draw(st.integers(0, 2**31)))


def draw_scores(draw, B: int, L: int, g: torch.Generator) -> torch.Tensor:
    """float32 [B, L] scores in [0, 1]: either rounded to quarters (many ties, to check the
    lowest-index tie break) or continuous; about 5% NaN, and in some draws whole rows of NaN (so a row's every
    candidate may be NaN)."""
    score = (torch.rand(B, L, generator=g) * 4).round() / 4 if draw(st.booleans()) else torch.rand(B, L, generator=g)
    score[torch.rand(B, L, generator=g) < 0.05] = float("nan")
    score[torch.rand(B, generator=g) < draw(st.sampled_from([0.0, 0.3]))] = float("nan")
    return score


LAUNCHER_RAN = "the Triton launcher ran"


def forbid_triton_launcher(monkeypatch, op: str) -> None:
    """Replace ``mrp_triton.<op>.<op>_triton`` by a stub raising ``AssertionError(LAUNCHER_RAN)``: a test then sees
    whether the public op sent its inputs to the kernel or kept them on the reference."""
    def launcher(*args, **kwargs):
        raise AssertionError(LAUNCHER_RAN)

    monkeypatch.setattr(importlib.import_module(f"mrp_triton.{op}"), f"{op}_triton", launcher)


def refused_alike(public, launcher, *args, **kwargs) -> None:
    """``launcher(*args, **kwargs)`` refuses the call (TypeError or ValueError), and so does the public op on the
    reference backend (the CPU path), with the same error: a call refused on a GPU is refused on a CPU too."""
    import pytest

    import mrp_triton

    with pytest.raises((TypeError, ValueError)) as refused:
        launcher(*args, **kwargs)
    with mrp_triton.use_backend("reference"), \
            pytest.raises(type(refused.value), match=re.escape(str(refused.value))):
        public(*args, **kwargs)
