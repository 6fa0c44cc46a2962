"""Commit rule of one denoising step, fused: rank, threshold, fallback and in-place write.

One program per row (grid [B]); the row (L <= 8192 positions, a block is 4..64 in practice) lives in
registers. Rank of every candidate = number of candidates that beat it (higher confidence, or equal
confidence and lower index): an L x L comparison in [L, 16] tiles, no sort. Static: commit rank < n. Dynamic: commit
conf > threshold, or rank < n when fewer than n pass. Entropy-bounded (the EB-sampler): candidates ranked by
entropy instead (lower first, ties lowest index), commit each whose better-ranked candidates' entropies sum to at
most the bound, or whose rank < n; the same L x L pass sums them. All decisions stay on the device (no
``.item()``), one launch.

Cost model: read 8 + 8 + 4 bytes per position (block, tokens, conf), write <= 9 (block, committed);
L**2 comparisons per row. Launch-bound at decode sizes (B * L ~ 100..1000 positions): ~ a few us.
Semantics: :mod:`mrp_triton.reference.select`.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from ._checks import (check_block, check_block_shaped, check_contiguous_block, check_device_scalar,
                      check_kernel_device, check_on_block_device, check_token_id)
from .backend import select_backend
from .reference.select import select_commit as select_commit_reference

MAX_L = 8192


@triton.jit
def _score(conf_ptr, offs, msk, BY_ENTROPY: tl.constexpr):
    """The ranking score of positions ``offs`` (those in ``msk``) and their entropy: conf (NaN as -inf), or with
    BY_ENTROPY -entropy (NaN entropy as +inf, read from conf_ptr) and the entropy."""
    x = tl.load(conf_ptr + offs, mask=msk, other=float("inf") if BY_ENTROPY else float("-inf")).to(tl.float32)
    if BY_ENTROPY:
        h = tl.where(x != x, float("inf"), x)
        return -h, h
    c = tl.where(x != x, float("-inf"), x)
    return c, c


@triton.jit(do_not_specialize=["n_scalar", "mask_id"])
def _select_kernel(block_ptr, tok_ptr, conf_ptr, n_ptr, out_ptr, L, n_scalar, mask_id, thr, thr_ptr,
                   N_TENSOR: tl.constexpr, DYNAMIC: tl.constexpr, BY_ENTROPY: tl.constexpr, THR_TENSOR: tl.constexpr,
                   BLOCK_L: tl.constexpr, JB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_L)
    msk = offs < L
    blk = tl.load(block_ptr + row * L + offs, mask=msk, other=0)
    tok = tl.load(tok_ptr + row * L + offs, mask=msk, other=-1)
    c, _ = _score(conf_ptr + row * L, offs, msk, BY_ENTROPY)
    if N_TENSOR:
        n = tl.load(n_ptr + row).to(tl.int64)
    else:
        n = n_scalar.to(tl.int64)
    cand = msk & (blk == mask_id) & (tok >= 0) & (tok != mask_id)
    n_cand = tl.sum(cand.to(tl.int64), 0)
    n_eff = tl.minimum(tl.maximum(n, 0), n_cand)
    # rank_i = #candidates j beating i, in [BLOCK_L, JB] tiles (registers stay O(BLOCK_L * JB))
    rank = tl.zeros([BLOCK_L], dtype=tl.int32)
    ahead = tl.zeros([BLOCK_L], dtype=tl.float32)  # BY_ENTROPY: the entropies of the candidates ranked before
    jr = tl.arange(0, JB)
    for j0 in range(0, L, JB):
        oj = j0 + jr
        mj = oj < L
        bj = tl.load(block_ptr + row * L + oj, mask=mj, other=0)
        tj = tl.load(tok_ptr + row * L + oj, mask=mj, other=-1)
        cj, hj = _score(conf_ptr + row * L, oj, mj, BY_ENTROPY)
        cand_j = mj & (bj == mask_id) & (tj >= 0) & (tj != mask_id)
        beats = ((cj[None, :] > c[:, None]) | ((cj[None, :] == c[:, None]) & (oj[None, :] < offs[:, None])))
        rank += tl.sum((beats & cand_j[None, :]).to(tl.int32), 1)
        if BY_ENTROPY:
            ahead += tl.sum(tl.where(beats & cand_j[None, :], hj[None, :], 0.0), 1)
    commit = cand & (rank < n_eff)
    if THR_TENSOR:  # read on the device: one captured graph serves every threshold (and entropy bound)
        thr = tl.load(thr_ptr).to(tl.float32)
    if BY_ENTROPY:
        commit = commit | (cand & (ahead <= thr))
    if DYNAMIC:
        passed = cand & (c > thr)
        n_pass = tl.sum(passed.to(tl.int64), 0)
        commit = tl.where(n_pass >= n_eff, passed, commit)
    commit = (commit & (n > 0)).to(tl.int32) != 0
    tl.store(block_ptr + row * L + offs, tok, mask=msk & commit)
    tl.store(out_ptr + row * L + offs, commit.to(tl.uint8), mask=msk)


def _check_args(block, tokens, conf, mask_token_id, n, threshold, entropy=None, entropy_bound=None):
    B, L = check_block(block)
    check_block_shaped("tokens", tokens, (B, L), torch.int64)
    check_block_shaped("conf", conf, (B, L))
    check_on_block_device(block, tokens=tokens, conf=conf)
    if (entropy is None) != (entropy_bound is None):
        raise ValueError("entropy and entropy_bound go together (the entropy-bounded rule); pass both or neither")
    if entropy is not None:
        if threshold is not None:
            raise ValueError("threshold (the dynamic rule) and entropy_bound (the entropy-bounded rule) exclude each "
                             "other; pass one")
        check_block_shaped("entropy", entropy, (B, L))
        check_on_block_device(block, entropy=entropy)
        if not check_device_scalar("entropy_bound", entropy_bound, block.device) and \
                (isinstance(entropy_bound, bool) or not isinstance(entropy_bound, numbers.Real)
                 or not 0.0 <= float(entropy_bound) < math.inf):
            raise ValueError(f"entropy_bound must be a finite number >= 0 (nats), got {entropy_bound!r}")
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


def select_commit_triton(block, tokens, conf, *, mask_token_id, n, threshold=None, entropy=None, entropy_bound=None,
                         out=None):
    """Triton launcher; ``out``: optional preallocated bool [B, L] (tests poison it)."""
    _check_args(block, tokens, conf, mask_token_id, n, threshold, entropy, entropy_bound)
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
    by_entropy = entropy is not None
    score = entropy if by_entropy else conf  # what the kernel ranks by (and with entropy_bound, sums)
    thr = entropy_bound if by_entropy else threshold
    thr_tensor = isinstance(thr, torch.Tensor)
    _select_kernel[(B,)](
        block, tokens.contiguous(), score.contiguous(), n_t, committed.view(torch.uint8), L,
        0 if isinstance(n, torch.Tensor) else int(n), int(mask_token_id),
        0.0 if thr is None or thr_tensor else float(thr), thr if thr_tensor else score,
        N_TENSOR=isinstance(n, torch.Tensor), DYNAMIC=threshold is not None, BY_ENTROPY=by_entropy,
        THR_TENSOR=thr_tensor, BLOCK_L=max(16, triton.next_power_of_2(L)), JB=16, num_warps=4,
    )
    return committed


def select_commit(block, tokens, conf, *, mask_token_id, n, threshold=None, entropy=None, entropy_bound=None):
    """Commit masked positions of ``block`` in place; returns committed bool [B, L].

    block: int64 [B, L] (masked = ``mask_token_id``), tokens: int64 [B, L], conf: float32 [B, L],
    n: int or int tensor [B] (0 = row inactive), threshold: None (static: the n most confident)
    or in (0, 1] (dynamic: every conf > threshold, else the top n), a float or a 0-d tensor on the block's device
    (read there, so a captured CUDA graph serves every value; its value is the caller's to check). Ties: lowest
    index; conf and threshold compare in fp32. ``entropy`` float [B, L] with ``entropy_bound`` (nats, >= 0; a float
    or a 0-d device tensor, as threshold) is the entropy-bounded rule (EB-sampler, Ben-Hamu et al. 2025) instead:
    rank the candidates by entropy, lowest first, and commit the longest run of them whose entropies, the last
    one's left out, sum to at most the bound (so at least one), or the first n when that is more (conf unread).
    """
    kw = dict(mask_token_id=mask_token_id, n=n, threshold=threshold, entropy=entropy, entropy_bound=entropy_bound)
    if select_backend(block.device) == "triton":
        return select_commit_triton(block, tokens, conf, **kw)
    _check_args(block, tokens, conf, mask_token_id, n, threshold, entropy, entropy_bound)
    return select_commit_reference(block, tokens, conf, **kw)
