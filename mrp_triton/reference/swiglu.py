"""Reference SwiGLU activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; gate, up: [..., F] -> [..., F] (same dtype)."""
    return F.silu(gate) * up
