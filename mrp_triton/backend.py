"""Choose, per call, between a Triton kernel and its PyTorch reference.

Rule (in order):
1. ``use_backend("reference" | "triton")`` context manager, if active.
2. ``MRP_TRITON_BACKEND=reference|triton`` in the environment.
3. An op autograd must differentiate (grad mode on and an input that requires grad) and whose kernel has no
   backward -> reference: its output would silently cut the graph (a forced "triton" raises instead). The ops
   that training runs (rms_norm, swiglu, qk_norm_rope, mrp_input) have backward kernels and go on to rule 4.
4. CUDA tensors -> Triton; CPU tensors -> reference, unless ``TRITON_INTERPRET=1`` is set,
   in which case CPU tensors run the Triton kernel in Triton's interpreter.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

BACKENDS = ("reference", "triton")
_override: list[str] = []
_SM_COUNT: dict[int, int] = {}
_SHARED: dict[int, int] = {}
_BEFORE_AMPERE: dict[int, str | None] = {}


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}={name!r} is not a backend; use one of {BACKENDS}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force every op inside the ``with`` block onto ``name`` ("reference" or "triton")."""
    _override.append(_check(name, "backend"))
    try:
        yield
    finally:
        _override.pop()


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def differentiated(*operands: torch.Tensor | None) -> bool:
    """Whether autograd must differentiate an op of these inputs (None allowed): grad mode on and one requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in operands)


def select_backend(device: torch.device, *operands: torch.Tensor | None, backward: bool = False) -> str:
    """Return "triton" or "reference" for an op whose tensors live on ``device``; ``operands``: its floating inputs
    (None allowed), which decide whether autograd must differentiate it; ``backward``: whether the op's Triton
    path has a backward kernel."""
    cuts_graph = differentiated(*operands) and not backward  # a kernel output autograd could not reach
    if _override:
        name = _override[-1]
    elif os.environ.get("MRP_TRITON_BACKEND"):
        name = _check(os.environ["MRP_TRITON_BACKEND"], "MRP_TRITON_BACKEND")
    elif cuts_graph:
        name = "reference"
    elif device.type == "cuda" or interpreter_on():
        name = "triton"
    else:
        name = "reference"
    if name == "triton" and cuts_graph:
        raise RuntimeError("an input of this op requires grad, but its Triton kernel has no backward (its output "
                           "would not reach it); run it under torch.no_grad(), or on the reference backend "
                           "(use_backend('reference') or MRP_TRITON_BACKEND=reference, which the default dispatch "
                           "picks for such ops)")
    if name == "triton":
        if not triton_available():
            raise RuntimeError("the Triton backend was chosen but triton is not installed; "
                               "pip install triton, or set MRP_TRITON_BACKEND=reference")
        if device.type != "cuda" and not interpreter_on():
            raise RuntimeError(f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 "
                               "before importing mrp_triton to run them on CPU, or use the reference backend")
    return name


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached), what launchers size their grids by; 4 elsewhere (the
    interpreter: a stand-in that still exercises multi-program grids)."""
    if device.type != "cuda":
        return 4
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


def shared_memory_limit(device: torch.device) -> int | None:
    """Bytes of shared memory one program may use on a CUDA device (cached; what Triton checks a launch against);
    None elsewhere (the interpreter has no limit). Launchers with pipelined tiles fit their stages to it: a table
    tuned on an H200 (227 KiB a program) would ask more than an sm_86 / sm_89 GPU holds (99 KiB: RTX 30xx / 40xx,
    A10, L4, L40S) and fail to launch there."""
    if device.type != "cuda":
        return None
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SHARED:
        from triton.runtime import driver

        _SHARED[i] = driver.active.utils.get_device_properties(i)["max_shared_mem"]
    return _SHARED[i]


def before_ampere(device: torch.device) -> str | None:
    """``"sm_XY"`` for an NVIDIA GPU older than Ampere (sm_80: Turing's T4, RTX 20xx), None otherwise (Ampere and newer,
    AMD's GPUs, a CPU; cached per GPU). Such a GPU has no bf16 units, no FlexAttention kernel, and copies nothing
    asynchronously into shared memory (``cp.async``): Triton stages no loads there, but converts a dot's fp32
    operands and accumulator through it, so what a program keeps there grows with its tile's rows
    (:func:`mrp_triton.cached_attention._tiles`)."""
    if device.type != "cuda" or torch.version.hip:
        return None
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _BEFORE_AMPERE:  # (asked at every attention launch)
        major, minor = torch.cuda.get_device_capability(i)
        _BEFORE_AMPERE[i] = f"sm_{major}{minor}" if major < 8 else None
    return _BEFORE_AMPERE[i]


def fit_stages(wanted: int, stage_bytes: int, fixed_bytes: int, limit: int | None) -> int | None:
    """The most pipeline stages, at most ``wanted``, whose tiles fit ``limit`` bytes (None: no limit, ``wanted``):
    ``stage_bytes`` a stage's buffers, counted for every stage (Triton keeps one fewer before sm_90 and for loops it
    does not pipeline through TMA: an upper bound), plus ``fixed_bytes`` and a 4 KiB margin for what else the
    kernel keeps there. None when not even one stage fits."""
    if limit is None:
        return wanted
    for stages in range(wanted, 0, -1):
        if stages * stage_bytes + fixed_bytes + 4096 <= limit:
            return stages
    return None
