"""MRP remask of freshly revealed tokens, fused: rule, progress guard and in-place write, one launch.

One program per row (grid [B]), the row in registers. Rule "tau": keep iff score >= threshold
(score = MRP-corrected confidence); rule "delta": keep iff score <= threshold (score =
|C[pos, token]|). A row that revealed something keeps at least its best token (max score for tau,
min for delta, ties lowest index). No host synchronisation.

Cost model: read 8 + 1 + 4 bytes per position, write <= 9; launch-bound at decode sizes.
Semantics: :mod:`mrp_triton.reference.remask`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (check_block, check_block_shaped, check_contiguous_block, check_device_scalar,
                      check_kernel_device, check_on_block_device, check_token_id)
from .backend import select_backend
from .reference.remask import RULES
from .reference.remask import remask as remask_reference


@triton.jit(do_not_specialize=["mask_id"])
def _remask_kernel(block_ptr, rev_ptr, score_ptr, out_ptr, L, thr, thr_ptr, mask_id,
                   IS_TAU: tl.constexpr, THR_TENSOR: tl.constexpr, BLOCK_L: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_L)
    msk = offs < L
    rev = (tl.load(rev_ptr + row * L + offs, mask=msk, other=0) != 0) & msk
    s = tl.load(score_ptr + row * L + offs, mask=msk, other=0.0).to(tl.float32)
    isnan = s != s
    if THR_TENSOR:  # read on the device: one captured graph serves every threshold
        thr = tl.load(thr_ptr).to(tl.float32)
    if IS_TAU:
        keep = rev & (s >= thr)
        key = tl.where(isnan, float("-inf"), s)
    else:
        keep = rev & (s <= thr)
        key = tl.where(isnan, float("-inf"), -s)
    key = tl.where(rev, key, float("-inf"))
    mx = tl.max(key, 0)
    best = tl.min(tl.where(rev & (key == mx), offs, BLOCK_L), 0)
    n_rev = tl.sum(rev.to(tl.int32), 0)
    n_keep = tl.sum(keep.to(tl.int32), 0)
    guard = (n_rev > 0) & (n_keep == 0)
    keep = keep | (guard & (offs == best))
    out = (rev & (keep == 0)).to(tl.int32) != 0
    tl.store(block_ptr + row * L + offs, tl.full([BLOCK_L], 0, tl.int64) + mask_id, mask=msk & out)
    tl.store(out_ptr + row * L + offs, out.to(tl.uint8), mask=msk)


def _check_args(block, revealed, score, threshold, mask_token_id, rule):
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES} ('tau': keep score >= threshold, 'delta': keep "
                         f"|residual| <= threshold), got {rule!r}")
    shape = check_block(block)
    check_block_shaped("revealed", revealed, shape, torch.bool)
    check_block_shaped("score", score, shape)
    check_on_block_device(block, revealed=revealed, score=score)
    check_token_id(mask_token_id)
    if check_device_scalar("threshold", threshold, block.device):
        return
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise TypeError(f"threshold must be a float or a 0-d tensor, got {type(threshold).__name__}")
    if rule == "tau" and not (0.0 < threshold <= 1.0):
        raise ValueError(f"threshold for rule='tau' is a probability and must be in (0, 1], got {threshold}")
    if rule == "delta" and not (threshold > 0.0):
        raise ValueError(f"threshold for rule='delta' is a residual magnitude and must be > 0 "
                         f"(1.0 or 2.0 are the authors' defaults), got {threshold}")


def remask_triton(block, revealed, score, threshold, *, mask_token_id, rule="tau", out=None):
    """Triton launcher; ``out``: optional preallocated bool [B, L] (tests poison it)."""
    _check_args(block, revealed, score, threshold, mask_token_id, rule)
    check_kernel_device(block.device, "remask")
    check_contiguous_block(block)
    B, L = block.shape
    remasked = torch.empty(B, L, dtype=torch.bool, device=block.device) if out is None else out
    if B == 0 or L == 0:
        remasked.zero_()
        return remasked
    thr_tensor = isinstance(threshold, torch.Tensor)
    _remask_kernel[(B,)](block, revealed.contiguous().view(torch.uint8), score.contiguous(),
                         remasked.view(torch.uint8), L, 0.0 if thr_tensor else float(threshold),
                         threshold if thr_tensor else score, int(mask_token_id), IS_TAU=rule == "tau",
                         THR_TENSOR=thr_tensor, BLOCK_L=max(16, triton.next_power_of_2(L)), num_warps=1)
    return remasked


def remask(block, revealed, score, threshold, *, mask_token_id, rule="tau"):
    """Write ``mask_token_id`` back over revealed tokens that fail the rule; returns remasked bool [B, L].

    block: int64 [B, L] (in place), revealed: bool [B, L], score: float32 [B, L];
    rule "tau" (threshold in (0, 1]) or "delta" (threshold > 0); threshold: a float or a 0-d tensor on the
    block's device (read there, so a captured CUDA graph serves every value; its value is the caller's to check),
    compared with the score in fp32.
    """
    if select_backend(block.device) == "triton":
        return remask_triton(block, revealed, score, threshold, mask_token_id=mask_token_id, rule=rule)
    _check_args(block, revealed, score, threshold, mask_token_id, rule)
    return remask_reference(block, revealed, score, threshold, mask_token_id=mask_token_id, rule=rule)
