"""Acceptance of K one-token drafts against the backbone's picks (lossless speculative MRP), fused.

One program per row (grid [B]); the candidate state C(k) lives in registers. For k = 0..K-1 the
kernel recomputes the backbone's static one-token pick on C(k) (most confident masked position,
ties lowest index) from ``target_conf[:, k]`` / ``target_tok[:, k]``, compares it with draft k+1
and, while everything matched, writes the draft into the state; then it writes the bonus (the pick
on C(a)) and stores the row back into ``block``. Per-row acceptance (no batch-wide straggler stop),
one launch, no host synchronisation.

Cost model: read (K+1) * L * 12 + K * 16 + L * 8 bytes per row, write L * 8 + 12: launch-bound
(~ a few us) at decode sizes (B <= 64, L = 16, K <= 8). Semantics: :mod:`mrp_triton.reference.verify`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_block, check_contiguous_block, check_kernel_device, check_on_block_device, check_token_id
from .backend import select_backend
from .reference.verify import verify_drafts as verify_drafts_reference


@triton.jit
def _static_pick(cur, conf_row_ptr, tok_row_ptr, offs, msk, mask_id, BLOCK_L: tl.constexpr):
    c = tl.load(conf_row_ptr + offs, mask=msk, other=float("-inf")).to(tl.float32)
    c = tl.where(c != c, float("-inf"), c)
    masked = msk & (cur == mask_id)
    score = tl.where(masked, c, float("-inf"))
    mx = tl.max(score, 0)
    pos = tl.min(tl.where(masked & (score == mx), offs, BLOCK_L), 0)
    any_masked = tl.sum(masked.to(tl.int32), 0) > 0
    t = tl.load(tok_row_ptr + tl.minimum(pos, BLOCK_L - 1), mask=any_masked, other=-1)
    pos = tl.where(any_masked, pos, -1)
    return pos, t


@triton.jit(do_not_specialize=["K", "mask_id"])
def _verify_kernel(block_ptr, dpos_ptr, dtok_ptr, ttok_ptr, tconf_ptr, acc_ptr, bonus_ptr,
                   L, K, mask_id, BLOCK_L: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_L)
    msk = offs < L
    cur = tl.load(block_ptr + row * L + offs, mask=msk, other=0)
    alive = tl.full([], 1, tl.int32) != 0
    a = tl.full([], 0, tl.int64)
    for k in range(0, K):
        t_base = (row * (K + 1) + k) * L
        pos, t = _static_pick(cur, tconf_ptr + t_base, ttok_ptr + t_base, offs, msk, mask_id, BLOCK_L)
        dp = tl.load(dpos_ptr + row * K + k)
        dt = tl.load(dtok_ptr + row * K + k)
        ok = alive & (pos >= 0) & (dp == pos) & (dt == t) & (dt >= 0) & (dt != mask_id)
        cur = tl.where(ok & (offs == pos), dt, cur)
        a += ok.to(tl.int64)
        alive = alive & ok
    t_base = (row * (K + 1) + a) * L
    pos, t = _static_pick(cur, tconf_ptr + t_base, ttok_ptr + t_base, offs, msk, mask_id, BLOCK_L)
    valid = (pos >= 0) & (t >= 0) & (t != mask_id)
    cur = tl.where(valid & (offs == pos), t, cur)
    tl.store(block_ptr + row * L + offs, cur, mask=msk)
    tl.store(acc_ptr + row, a.to(tl.int32))
    tl.store(bonus_ptr + row, tl.where(valid, pos, -1).to(tl.int64))


def _check_args(block, draft_pos, draft_tok, target_tok, target_conf, mask_token_id):
    B, L = check_block(block, "[B, L] = state C(0)")
    if not isinstance(draft_pos, torch.Tensor) or draft_pos.dim() != 2 or draft_pos.dtype != torch.int64 \
            or draft_pos.shape[0] != B:
        raise ValueError(f"draft_pos must be an int64 tensor [B, K] with B = {B} (-1 = no draft)")
    K = draft_pos.shape[1]
    if K < 1:
        raise ValueError("draft_pos must have K >= 1 columns; pass a column of -1 for an empty draft")
    if not isinstance(draft_tok, torch.Tensor) or draft_tok.dtype != torch.int64 or tuple(draft_tok.shape) != (B, K):
        raise ValueError(f"draft_tok must be an int64 tensor [B, K] = [{B}, {K}] like draft_pos")
    if not isinstance(target_tok, torch.Tensor) or target_tok.dtype != torch.int64 or \
            tuple(target_tok.shape) != (B, K + 1, L):
        raise ValueError(f"target_tok must be an int64 tensor [B, K+1, L] = [{B}, {K + 1}, {L}]: the backbone's "
                         "per-position picks on C(0)..C(K)")
    if not isinstance(target_conf, torch.Tensor) or not target_conf.is_floating_point() or \
            tuple(target_conf.shape) != (B, K + 1, L):
        raise ValueError(f"target_conf must be a float tensor [B, K+1, L] = [{B}, {K + 1}, {L}]")
    check_on_block_device(block, draft_pos=draft_pos, draft_tok=draft_tok, target_tok=target_tok,
                          target_conf=target_conf)
    check_token_id(mask_token_id)


def verify_drafts_triton(block, draft_pos, draft_tok, target_tok, target_conf, *, mask_token_id, out=None):
    """Triton launcher; ``out = (accepted, bonus_pos)`` optional preallocated outputs (tests poison them)."""
    _check_args(block, draft_pos, draft_tok, target_tok, target_conf, mask_token_id)
    check_kernel_device(block.device, "verify_drafts")
    check_contiguous_block(block)
    B, L = block.shape
    K = draft_pos.shape[1]
    if out is None:
        acc = torch.empty(B, dtype=torch.int32, device=block.device)
        bonus = torch.empty(B, dtype=torch.int64, device=block.device)
    else:
        acc, bonus = out
    if B == 0:
        return acc, bonus
    if L == 0:
        acc.zero_()
        bonus.fill_(-1)
        return acc, bonus
    _verify_kernel[(B,)](block, draft_pos.contiguous(), draft_tok.contiguous(), target_tok.contiguous(),
                         target_conf.contiguous(), acc, bonus, L, K, int(mask_token_id),
                         BLOCK_L=max(16, triton.next_power_of_2(L)), num_warps=1)
    return acc, bonus


def verify_drafts(block, draft_pos, draft_tok, target_tok, target_conf, *, mask_token_id):
    """Accept the longest matching draft prefix plus one bonus token, in place.

    block: int64 [B, L] = C(0); draft_pos, draft_tok: int64 [B, K] (-1 = no draft from there on);
    target_tok: int64 [B, K+1, L], target_conf: float32 [B, K+1, L] (backbone on C(0)..C(K)).
    Returns ``(accepted int32 [B], bonus_pos int64 [B])`` (bonus_pos -1: no bonus).
    """
    if select_backend(block.device) == "triton":
        return verify_drafts_triton(block, draft_pos, draft_tok, target_tok, target_conf,
                                    mask_token_id=mask_token_id)
    _check_args(block, draft_pos, draft_tok, target_tok, target_conf, mask_token_id)
    return verify_drafts_reference(block, draft_pos, draft_tok, target_tok, target_conf,
                                   mask_token_id=mask_token_id)
