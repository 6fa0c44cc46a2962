"""Reference RMSNorm with an optional fused residual add (Qwen3 semantics)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm over the last dim, computed in fp32, scaled by ``weight`` in the normalised row's dtype.

    x: [..., H], weight: [H], residual: [..., H] or None.
    Returns y [..., H] when ``residual`` is None, else ``(y, s)`` with ``s = x + residual``
    (the new residual stream, in their promoted dtype) and ``y = rms_norm(s)``.
    """
    s = x if residual is None else x + residual
    var = s.float().pow(2).mean(-1, keepdim=True)
    y = weight * (s.float() * torch.rsqrt(var + eps)).to(s.dtype)
    return y if residual is None else (y, s)
