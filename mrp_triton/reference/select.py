"""Reference commit rule of one denoising step (static top-n and dynamic threshold), in place.

Defined behaviour (shared with :mod:`mrp_triton.select`):

* candidates = positions with ``block == mask_token_id`` whose proposed token is a real token
  (``tokens >= 0`` and ``tokens != mask_token_id``; ``confidence`` returns -1 for rows with no
  finite candidate, and the mask token is never committed);
* NaN confidence ranks as ``-inf``; ties go to the lowest position index;
* ``n`` (int or [B]) is clipped to [0, #candidates]; ``n <= 0`` means the row is inactive;
* static (``threshold is None``): commit the n most confident candidates;
  dynamic: commit every candidate with ``conf > threshold`` (compared in fp32); if fewer than n pass, the top n;
* entropy-bounded (``entropy`` [B, L] and ``entropy_bound`` given; the EB-sampler of Ben-Hamu et al. 2025, "Accelerated
  Sampling from Masked Diffusion Models via Entropy Bounded Unmasking"): the candidates ranked by entropy, lowest
  first (NaN as +inf; ties lowest index), commit each whose better-ranked candidates' entropies sum (fp32) to at most
  ``entropy_bound``: the longest run whose sum, its largest entropy left out, stays within the bound, so at least
  one; or the first n when that is more (conf is not read).
"""

from __future__ import annotations

import torch


def _n_per_row(n, B: int, device) -> torch.Tensor:
    if isinstance(n, torch.Tensor):
        return n.to(device=device, dtype=torch.int64).reshape(B)
    return torch.full((B,), int(n), dtype=torch.int64, device=device)


def candidates_before(score: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """bool [B, L, L]: ``[b, i, j]`` when candidate j (``cand`` [B, L]) ranks before position i by descending score
    [B, L] (ties: the lower index first); summed over j, the rank of position i among the candidates."""
    idx = torch.arange(score.shape[-1], device=score.device)
    si, sj = score[:, :, None], score[:, None, :]
    return ((sj > si) | ((sj == si) & (idx[None, None, :] < idx[None, :, None]))) & cand[:, None, :]


def select_commit(block, tokens, conf, *, mask_token_id, n, threshold=None, entropy=None, entropy_bound=None):
    """block: int64 [B, L] (updated in place), tokens: int64 [B, L], conf: float32 [B, L];
    n: int or int tensor [B]; threshold: None (static) or in (0, 1] (dynamic; a float or a 0-d tensor);
    entropy: float [B, L] with entropy_bound (>= 0; a float or a 0-d tensor): the entropy-bounded rule.
    Returns committed: bool [B, L]."""
    B, L = block.shape
    cand = (block == mask_token_id) & (tokens >= 0) & (tokens != mask_token_id)
    if entropy is not None:
        h = entropy.float().nan_to_num(nan=float("inf"), posinf=float("inf"))  # (NaN ties with +inf, kept as it is)
        c = -h
    else:
        c = conf.float()
        c = torch.where(torch.isnan(c), torch.full_like(c, float("-inf")), c)
    n_row = _n_per_row(n, B, block.device)
    n_eff = torch.minimum(n_row.clamp(min=0), cand.sum(-1))
    before = candidates_before(c, cand)
    commit = cand & (before.sum(-1) < n_eff[:, None])
    if entropy is not None:
        ahead = torch.where(before, h[:, None, :], torch.zeros_like(h)[:, None, :]).sum(-1)
        commit = commit | (cand & (ahead <= entropy_bound))
    if threshold is not None:
        passed = cand & (c > threshold)  # a float or a 0-d tensor
        commit = torch.where((passed.sum(-1) >= n_eff)[:, None], passed, commit)
    commit = commit & (n_row > 0)[:, None]
    block.copy_(torch.where(commit, tokens, block))
    return commit
