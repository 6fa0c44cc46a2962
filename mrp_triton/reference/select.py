"""Reference commit rule of one denoising step (static top-n and dynamic threshold), in place.

Defined behaviour (shared with :mod:`mrp_triton.select`):

* candidates = positions with ``block == mask_token_id`` whose proposed token is a real token
  (``tokens >= 0`` and ``tokens != mask_token_id``; ``confidence`` returns -1 for rows with no
  finite candidate, and the mask token is never committed);
* NaN confidence ranks as ``-inf``; ties go to the lowest position index;
* ``n`` (int or [B]) is clipped to [0, #candidates]; ``n <= 0`` means the row is inactive;
* static (``threshold is None``): commit the n most confident candidates;
  dynamic: commit every candidate with ``conf > threshold`` (compared in fp32); if fewer than n pass, the top n.
"""

from __future__ import annotations

import torch


def _n_per_row(n, B: int, device) -> torch.Tensor:
    if isinstance(n, torch.Tensor):
        return n.to(device=device, dtype=torch.int64).reshape(B)
    return torch.full((B,), int(n), dtype=torch.int64, device=device)


def rank_desc(score: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """[B, L] rank of every position among the candidates by descending score, ties lowest index."""
    L = score.shape[-1]
    idx = torch.arange(L, device=score.device)
    si, sj = score[:, :, None], score[:, None, :]
    before = (sj > si) | ((sj == si) & (idx[None, None, :] < idx[None, :, None]))
    return (before & cand[:, None, :]).sum(-1)


def select_commit(block, tokens, conf, *, mask_token_id, n, threshold=None):
    """block: int64 [B, L] (updated in place), tokens: int64 [B, L], conf: float32 [B, L];
    n: int or int tensor [B]; threshold: None (static) or in (0, 1] (dynamic; a float or a 0-d tensor).
    Returns committed: bool [B, L]."""
    B, L = block.shape
    cand = (block == mask_token_id) & (tokens >= 0) & (tokens != mask_token_id)
    c = conf.float()
    c = torch.where(torch.isnan(c), torch.full_like(c, float("-inf")), c)
    n_row = _n_per_row(n, B, block.device)
    n_eff = torch.minimum(n_row.clamp(min=0), cand.sum(-1))
    commit = cand & (rank_desc(c, cand) < n_eff[:, None])
    if threshold is not None:
        passed = cand & (c > threshold)  # a float or a 0-d tensor
        commit = torch.where((passed.sum(-1) >= n_eff)[:, None], passed, commit)
    commit = commit & (n_row > 0)[:, None]
    block.copy_(torch.where(commit, tokens, block))
    return commit
