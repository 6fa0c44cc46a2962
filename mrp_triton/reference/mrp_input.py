"""Reference input of the MRP module's ``eh_proj``: [enorm(E[ids]) | hnorm(h)]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .rms_norm import rms_norm


def mrp_input(ids: torch.Tensor, embed_weight: torch.Tensor, hidden: torch.Tensor,
              enorm_weight: torch.Tensor, hnorm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ids: [N] int64 or int32, embed_weight: [V, H], hidden: [N, H], norms: [H] -> [N, 2H].

    The embedding half comes first (DeepSeek-V3 MTP layout); the embedding rows are cast to hidden's dtype. Each
    half is :func:`rms_norm`'s output (dtype ``promote(hidden, its weight)``), and the cat promotes both halves to
    the promoted dtype of ``hidden`` and both weights.
    """
    e = F.embedding(ids, embed_weight).to(hidden.dtype)  # (an id outside the table raises, -1 too)
    return torch.cat([rms_norm(e, enorm_weight, eps), rms_norm(hidden, hnorm_weight, eps)], dim=-1)
