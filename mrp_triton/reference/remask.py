"""Reference MRP remask of freshly revealed tokens (rules "tau" and "delta"), in place.

Defined behaviour (shared with :mod:`mrp_triton.remask`):

* "tau": keep a revealed token iff ``score >= threshold`` (score = MRP-corrected confidence; compared in fp32,
  the threshold a float or a 0-d tensor);
  "delta": keep iff ``score <= threshold`` (score = |C[pos, token]|). A NaN score is never kept
  by the rule;
* progress guard: a row that revealed at least one token keeps at least one, the best by score
  (max for tau, min for delta; NaN worst; ties lowest index);
* every revealed token not kept gets ``mask_token_id`` written back.
"""

from __future__ import annotations

import torch

RULES = ("tau", "delta")


def remask(block, revealed, score, threshold, *, mask_token_id, rule="tau"):
    """block: int64 [B, L] (in place), revealed: bool [B, L], score: float32 [B, L].
    Returns remasked: bool [B, L]."""
    B, L = block.shape
    s = score.float()
    idx = torch.arange(L, device=block.device)
    if rule == "tau":
        keep = revealed & (s >= threshold)
        key = torch.where(torch.isnan(s), torch.full_like(s, float("-inf")), s)
    else:
        keep = revealed & (s <= threshold)
        key = torch.where(torch.isnan(s), torch.full_like(s, float("-inf")), -s)
    key = torch.where(revealed, key, torch.full_like(key, float("-inf")))
    mx = key.max(-1, keepdim=True).values
    best = torch.where(revealed & (key == mx), idx, L).min(-1).values
    guard = revealed.any(-1) & ~keep.any(-1)
    keep = keep | (guard[:, None] & (idx[None, :] == best[:, None]))
    out = revealed & ~keep
    block.masked_fill_(out, mask_token_id)
    return out
