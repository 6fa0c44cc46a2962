"""Reference acceptance of K one-token drafts against the backbone's picks (speculative MRP), in place.

Defined behaviour (shared with :mod:`mrp_triton.verify`):

* the backbone's pick on candidate state C(k) is the static one-token rule: the most confident
  position still masked in C(k) (NaN confidence counts as -inf; ties lowest index) and
  ``target_tok[:, k]`` there;
* draft k+1 is accepted iff the pick on C(k) has the same position and token (a draft token that
  is negative or the mask id is never accepted; ``draft_pos == -1`` means no draft); the walk
  stops at the first mismatch;
* the bonus is the pick on C(a) (a = accepted count); it is written unless C(a) has no masked
  position or its token is negative / the mask id, in which case ``bonus_pos = -1``.
"""

from __future__ import annotations

import torch


def static_pick(state: torch.Tensor, conf: torch.Tensor, tok: torch.Tensor, mask_token_id: int):
    """Pick of the one-token static rule on ``state`` [B, L]: (pos [B] (-1 if none masked), token [B])."""
    B, L = state.shape
    idx = torch.arange(L, device=state.device)
    masked = state == mask_token_id
    c = conf.float()
    c = torch.where(torch.isnan(c), torch.full_like(c, float("-inf")), c)
    score = torch.where(masked, c, torch.full_like(c, float("-inf")))
    mx = score.max(-1, keepdim=True).values
    pos = torch.where(masked & (score == mx), idx, L).min(-1).values
    any_masked = masked.any(-1)
    t = tok.gather(1, pos.clamp(max=L - 1)[:, None])[:, 0]
    pos = torch.where(any_masked, pos, torch.full_like(pos, -1))
    return pos, t


def verify_drafts(block, draft_pos, draft_tok, target_tok, target_conf, *, mask_token_id):
    """block: int64 [B, L] = C(0) (updated in place); draft_pos, draft_tok: int64 [B, K];
    target_tok: int64 [B, K+1, L]; target_conf: float32 [B, K+1, L].
    Returns (accepted int32 [B], bonus_pos int64 [B])."""
    B, L = block.shape
    K = draft_pos.shape[1]
    idx = torch.arange(L, device=block.device)
    cur = block.clone()
    alive = torch.ones(B, dtype=torch.bool, device=block.device)
    acc = torch.zeros(B, dtype=torch.int64, device=block.device)
    for k in range(K):
        pos, t = static_pick(cur, target_conf[:, k], target_tok[:, k], mask_token_id)
        dp, dt = draft_pos[:, k], draft_tok[:, k]
        ok = alive & (pos >= 0) & (dp == pos) & (dt == t) & (dt >= 0) & (dt != mask_token_id)
        cur = torch.where(ok[:, None] & (idx[None, :] == pos[:, None]), dt[:, None], cur)
        acc = acc + ok.to(torch.int64)
        alive = alive & ok
    rows = torch.arange(B, device=block.device)
    pos, t = static_pick(cur, target_conf[rows, acc], target_tok[rows, acc], mask_token_id)
    valid = (pos >= 0) & (t >= 0) & (t != mask_token_id)
    cur = torch.where(valid[:, None] & (idx[None, :] == pos[:, None]), t[:, None], cur)
    block.copy_(cur)
    return acc.to(torch.int32), torch.where(valid, pos, torch.full_like(pos, -1))
