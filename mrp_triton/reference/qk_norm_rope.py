"""Reference per-head RMSNorm of q and k followed by rotary embedding (Qwen3 attention)."""

from __future__ import annotations

import torch

from .rms_norm import rms_norm


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, D]; cos, sin: [B, T, D] -> [B, T, heads, D] (x's dtype)."""
    cos = cos.unsqueeze(2).to(x.dtype)
    sin = sin.unsqueeze(2).to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float):
    """RMSNorm over head_dim of q and k, then RoPE (rotate-half convention).

    q: [B, T, Hq, D], k: [B, T, Hkv, D], q_weight, k_weight: [D], cos, sin: [B, T, D].
    Returns (q [B, T, Hq, D], k [B, T, Hkv, D]) of dtypes ``promote(q, q_weight)`` and ``promote(k, k_weight)``.
    """
    q = apply_rope(rms_norm(q, q_weight, eps), cos, sin)
    k = apply_rope(rms_norm(k, k_weight, eps), cos, sin)
    return q, k
