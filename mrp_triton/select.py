"""Commit rule of one denoising step, fused: rank, threshold, fallback and in-place write.

One program per row (grid [B]); the row (L <= 8192 positions, a block is 4..64 in practice) lives in
registers. Rank of every candidate = number of candidates that beat it (higher confidence, or equal
confidence and lower index): an L x L comparison in [L, 16] tiles, no sort. Static: commit rank < n. Dynamic: commit
conf > threshold, or rank < n when fewer than n pass. All decisions stay on the device (no
``.item()``), one launch.

Cost model: read 8 + 8 + 4 bytes per position (block, tokens, conf), write <= 9 (block, committed);
L**2 comparisons per row. Launch-bound at decode sizes (B * L ~ 100..1000 positions): ~ a few us.
Semantics: :mod:`mrp_triton.reference.select`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (check_block, check_block_shaped, check_contiguous_block, check_device_scalar,
                      check_kernel_device, check_on_block_device, check_token_id)
from .backend import select_backend
from .reference.select import select_commit as select_commit_reference

MAX_L = 8192


@triton.jit(do_not_specialize=["n_scalar", "mask_id"])
def _select_kernel(block_ptr, tok_ptr, conf_ptr, n_ptr, out_ptr, L, n_scalar, mask_id, thr, thr_ptr,
                   N_TENSOR: tl.constexpr, DYNAMIC: tl.constexpr, THR_TENSOR: tl.constexpr, BLOCK_L: tl.constexpr,
                   JB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_L)
    msk = offs < L
    blk = tl.load(block_ptr + row * L + offs, mask=msk, other=0)
    tok = tl.load(tok_ptr + row * L + offs, mask=msk, other=-1)
    c = tl.load(conf_ptr + row * L + offs, mask=msk, other=float("-inf")).to(tl.float32)
    c = tl.where(c != c, float("-inf"), c)
    if N_TENSOR:
        n = tl.load(n_ptr + row).to(tl.int64)
    else:
        n = n_scalar.to(tl.int64)
    cand = msk & (blk == mask_id) & (tok >= 0) & (tok != mask_id)
    n_cand = tl.sum(cand.to(tl.int64), 0)
    n_eff = tl.minimum(tl.maximum(n, 0), n_cand)
    # rank_i = #candidates j beating i, in [BLOCK_L, JB] tiles (registers stay O(BLOCK_L * JB))
    rank = tl.zeros([BLOCK_L], dtype=tl.int32)
    jr = tl.arange(0, JB)
    for j0 in range(0, L, JB):
        oj = j0 + jr
        mj = oj < L
        bj = tl.load(block_ptr + row * L + oj, mask=mj, other=0)
        tj = tl.load(tok_ptr + row * L + oj, mask=mj, other=-1)
        cj = tl.load(conf_ptr + row * L + oj, mask=mj, other=float("-inf")).to(tl.float32)
        cj = tl.where(cj != cj, float("-inf"), cj)
        cand_j = mj & (bj == mask_id) & (tj >= 0) & (tj != mask_id)
        beats = ((cj[None, :] > c[:, None]) | ((cj[None, :] == c[:, None]) & (oj[None, :] < offs[:, None])))
        rank += tl.sum((beats & cand_j[None, :]).to(tl.int32), 1)
    commit = cand & (rank < n_eff)
    if DYNAMIC:
        if THR_TENSOR:  # read on the device: one captured graph serves every threshold
            thr = tl.load(thr_ptr).to(tl.float32)
        passed = cand & (c > thr)
        n_pass = tl.sum(passed.to(tl.int64), 0)
        commit = tl.where(n_pass >= n_eff, passed, commit)
    commit = (commit & (n > 0)).to(tl.int32) != 0
    tl.store(block_ptr + row * L + offs, tok, mask=msk & commit)
    tl.store(out_ptr + row * L + offs, commit.to(tl.uint8), mask=msk)


def _check_args(block, tokens, conf, mask_token_id, n, threshold):
    B, L = check_block(block)
    check_block_shaped("tokens", tokens, (B, L), torch.int64)
    check_block_shaped("conf", conf, (B, L))
    check_on_block_device(block, tokens=tokens, conf=conf)
    check_token_id(mask_token_id)
    if isinstance(n, torch.Tensor):
        if n.dtype.is_floating_point or n.dtype == torch.bool or n.numel() != B:
            raise ValueError(f"n must be an int or an integer tensor [B] = [{B}], got {n.dtype} {tuple(n.shape)}")
        if n.device != block.device:
            raise ValueError(f"n is on {n.device} but block on {block.device}")
    elif isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int or an integer tensor [B], got {type(n).__name__}")
    if threshold is not None and not check_device_scalar("threshold", threshold, block.device) and \
            not (0.0 < float(threshold) <= 1.0):
        raise ValueError(f"threshold must be None (static rule) or a float in (0, 1] (dynamic rule), "
                         f"got {threshold!r}")


def select_commit_triton(block, tokens, conf, *, mask_token_id, n, threshold=None, out=None):
    """Triton launcher; ``out``: optional preallocated bool [B, L] (tests poison it)."""
    _check_args(block, tokens, conf, mask_token_id, n, threshold)
    check_kernel_device(block.device, "select_commit")
    B, L = block.shape
    if L > MAX_L:
        raise ValueError(f"block length L={L} > {MAX_L} is not supported by the Triton select kernel; "
                         "use the reference backend (MRP_TRITON_BACKEND=reference)")
    check_contiguous_block(block)
    committed = torch.empty(B, L, dtype=torch.bool, device=block.device) if out is None else out
    if B == 0 or L == 0:
        committed.zero_()
        return committed
    n_t = n.reshape(B).contiguous() if isinstance(n, torch.Tensor) else block
    thr_tensor = isinstance(threshold, torch.Tensor)
    _select_kernel[(B,)](
        block, tokens.contiguous(), conf.contiguous(), n_t, committed.view(torch.uint8), L,
        0 if isinstance(n, torch.Tensor) else int(n), int(mask_token_id),
        0.0 if threshold is None or thr_tensor else float(threshold), threshold if thr_tensor else conf,
        N_TENSOR=isinstance(n, torch.Tensor), DYNAMIC=threshold is not None, THR_TENSOR=thr_tensor,
        BLOCK_L=max(16, triton.next_power_of_2(L)), JB=16, num_warps=4,
    )
    return committed


def select_commit(block, tokens, conf, *, mask_token_id, n, threshold=None):
    """Commit masked positions of ``block`` in place; returns committed bool [B, L].

    block: int64 [B, L] (masked = ``mask_token_id``), tokens: int64 [B, L], conf: float32 [B, L],
    n: int or int tensor [B] (0 = row inactive), threshold: None (static: the n most confident)
    or in (0, 1] (dynamic: every conf > threshold, else the top n), a float or a 0-d tensor on the block's device
    (read there, so a captured CUDA graph serves every value; its value is the caller's to check). Ties: lowest
    index; conf and threshold compare in fp32.
    """
    if select_backend(block.device) == "triton":
        return select_commit_triton(block, tokens, conf, mask_token_id=mask_token_id, n=n, threshold=threshold)
    _check_args(block, tokens, conf, mask_token_id, n, threshold)
    return select_commit_reference(block, tokens, conf, mask_token_id=mask_token_id, n=n, threshold=threshold)
