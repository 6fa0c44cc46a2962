"""RMSNorm with fused residual add. (Triton kernel: pending, see issue 5; reference for now.)"""

from __future__ import annotations

import torch

from .reference.rms_norm import rms_norm as rms_norm_reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """See :func:`mrp_triton.reference.rms_norm.rms_norm` (x: [..., H], weight: [H])."""
    return rms_norm_reference(x, weight, eps, residual)
