"""SwiGLU activation. (Triton kernel: pending, see issue 5; reference for now.)"""

from __future__ import annotations

import torch

from .reference.swiglu import swiglu as swiglu_reference


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; gate, up: [..., F]."""
    return swiglu_reference(gate, up)
