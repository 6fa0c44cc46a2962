"""MRP eh_proj input. (Triton kernel: pending, see issue 5; reference for now.)"""

from __future__ import annotations

import torch

from .reference.mrp_input import mrp_input as mrp_input_reference


def mrp_input(ids: torch.Tensor, embed_weight: torch.Tensor, hidden: torch.Tensor,
              enorm_weight: torch.Tensor, hnorm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ids: [N], embed_weight: [V, H], hidden: [N, H] -> [N, 2H]."""
    return mrp_input_reference(ids, embed_weight, hidden, enorm_weight, hnorm_weight, eps)
