"""q/k head RMSNorm + RoPE. (Triton kernel: pending, see issue 5; reference for now.)"""

from __future__ import annotations

import torch

from .reference.qk_norm_rope import qk_norm_rope as qk_norm_rope_reference


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float):
    """q: [B, T, Hq, D], k: [B, T, Hkv, D], weights: [D], cos/sin: [B, T, D] -> (q, k)."""
    return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps)
