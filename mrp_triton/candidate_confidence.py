"""A draft's pick among its position's listed tokens, with the full-softmax probability estimated (one kernel).

Per row n: the logits of its M listed token ids ``z_j = hidden_n . weight[ids_nj] / temperature``, the normaliser
estimate ``lse = logaddexp(logsumexp z, rest_n + (hidden_n - seed_hidden_n) . vocab_mean / temperature)`` and the
greedy pick (first largest z) with ``prob = exp(z_max - lse)``. Semantics (and sampling): :mod:`.reference
.candidate_confidence`. This is what a speculative draft step with ``draft_candidates`` runs instead of the fused
LM-head confidence over the whole vocabulary: M rows of the lm_head per position instead of V.

Cost model (N rows, M listed ids, H hidden, b bytes per element): reads N*M*H*b of gathered weight rows (rows
of one position are contiguous H-vectors: one 2*H-byte line each in bf16), 2*N*H*b of hidden states and 4*H of
the mean row; writes 4*N*M (the listed logits) + 20*N. At a draft step of the 1.7B shape (N = 16 positions, M =
16, H = 2048, bf16) that is 1.1 MB, where the fused LM-head confidence reads the 622 MB lm_head. One program per
row: the M gathered rows are read in BLOCK_H chunks, multiplied with the hidden chunk and summed over H in fp32
(the reduction the reference does with one einsum; the order differs, so results agree to rounding).

Sampling: the kernel writes the listed logits and the normaliser; the Gumbel-max pick (with the filters among
the listed tokens) runs as torch ops on those [N, M] logits (:func:`.reference.candidate_confidence.pick_listed`),
as small as the kernel's own output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (MAX_TOP_M, check_ids_on_cpu, check_kernel_device, check_penalty, check_skip_rows, penalty_args,
                      penalty_operands, temperature_operands, wide)
from .backend import select_backend
from .confidence import check_sampling, comparable, penalized, penalty_factors
from .reference.candidate_confidence import candidate_confidence as candidate_confidence_reference
from .reference.candidate_confidence import pick_listed
from .reference.confidence import may_sample


@triton.jit(do_not_specialize=["M"])  # H: one value a model (a loop bound)
def _listed_kernel(h_ptr, hs_ptr, w_ptr, mean_ptr, ids_ptr, rest_ptr, skip_ptr, inv_t, t_ptr, t_stride,
                   seen_ptr, off_ptr, bias_ptr, seen_rows_ptr, pen_ptr, z_ptr, lse_ptr, tok_ptr, prob_ptr,
                   M, H, V, stride_h, stride_hs, stride_w, stride_ids,
                   HAS_SKIP: tl.constexpr, GREEDY: tl.constexpr, T_TENSOR: tl.constexpr, HAS_PENALTY: tl.constexpr,
                   HAS_OFFSETS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + row * stride_ids + cols, mask=cols < M, other=-1)
    listed = ids >= 0
    w_rows = tl.where(listed, ids, 0)
    dots = tl.zeros([BLOCK_M], tl.float32)
    moved = tl.zeros([BLOCK_H], tl.float32)  # (hidden - seed_hidden) * vocab_mean, summed over H chunks
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_in = ks < H
        h = tl.load(h_ptr + row * stride_h + ks, mask=k_in, other=0.0).to(tl.float32)
        hs = tl.load(hs_ptr + row * stride_hs + ks, mask=k_in, other=0.0).to(tl.float32)
        mu = tl.load(mean_ptr + ks, mask=k_in, other=0.0)
        w = tl.load(w_ptr + w_rows[:, None] * stride_w + ks[None, :], mask=listed[:, None] & k_in[None, :],
                    other=0.0).to(tl.float32)
        dots += tl.sum(w * h[None, :], axis=1)
        moved += (h - hs) * mu
    if T_TENSOR:  # the temperature read on the device (one graph serves every value): 1 / t as the reference
        inv_t = (1.0 / tl.load(t_ptr + row * t_stride).to(tl.float64)).to(tl.float32)
    if HAS_BIAS:  # a bias by token id (the same in every row) at the listed tokens, before the penalty
        dots += tl.load(bias_ptr + w_rows, mask=listed, other=0.0)
    if HAS_PENALTY:  # the repetition penalty at the listed tokens this row has seen (its row of the seen table)
        pen, inv_pen = penalty_factors(pen_ptr)
        seen = tl.load(seen_ptr + tl.load(seen_rows_ptr + row) * V + w_rows, mask=listed, other=0)
        dots = penalized(dots, seen, pen, inv_pen)
    if HAS_OFFSETS:  # the additive term at the listed tokens (this row's row of the offsets)
        dots += tl.load(off_ptr + tl.load(seen_rows_ptr + row) * V + w_rows, mask=listed, other=0.0)
    z = tl.where(listed, comparable(dots * inv_t), float("-inf"))
    tl.store(z_ptr + row * M + cols, z, mask=cols < M)
    z_max, at = tl.max(z, axis=0, return_indices=True, return_indices_tie_break_left=True)
    # log-sum-exps: each sum is >= 1 unless every term is -inf, where the result is -inf (the clamp keeps log(0)
    # out of the arithmetic)
    safe_max = tl.where(z_max == float("-inf"), 0.0, z_max)
    inside = tl.where(z_max == float("-inf"), float("-inf"),
                      safe_max + tl.log(tl.maximum(tl.sum(tl.exp(z - safe_max), axis=0), 1e-30)))
    outside = tl.load(rest_ptr + row) + tl.sum(moved, axis=0) * inv_t
    top = tl.maximum(inside, outside)
    top = tl.where(outside != outside, outside, top)  # a NaN rest makes the normaliser NaN, as the reference's
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    lse = tl.where(top == float("-inf"), float("-inf"),
                   safe_top + tl.log(tl.maximum(tl.exp(inside - safe_top) + tl.exp(outside - safe_top), 1e-30)))
    tl.store(lse_ptr + row, lse)
    if GREEDY:
        take = z_max > float("-inf")
        if HAS_SKIP:
            take = take & (tl.load(skip_ptr + row) == 0)
        token = tl.sum(tl.where(cols == at, ids, 0), axis=0)
        tl.store(tok_ptr + row, tl.where(take, token, -1))
        # both -inf where nothing is listed: keep their difference (NaN) out of the arithmetic
        tl.store(prob_ptr + row, tl.where(take, tl.exp(tl.where(take, z_max, 0.0) - tl.where(take, lse, 0.0)), 0.0))


def _check_args(hidden, weight, ids, rest, seed_hidden, vocab_mean, skip_rows, temperature, do_sample, noise_keys,
                cuts: dict, penalty: dict) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or not hidden.dtype.is_floating_point:
        raise ValueError("hidden must be a floating-point tensor [N, H]")
    N, H = hidden.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != H or \
            not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be a floating-point tensor [V, H={H}] (the lm_head), got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != N or \
            not 1 <= ids.shape[1] <= MAX_TOP_M:
        raise ValueError(f"ids must be an int64 tensor [N={N}, M] with 1 <= M <= {MAX_TOP_M} (-1: nothing listed)")
    for name, t, shape in (("rest", rest, (N,)), ("seed_hidden", seed_hidden, (N, H)),
                           ("vocab_mean", vocab_mean, (H,))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor {list(shape)}")
    for name, t in (("weight", weight), ("ids", ids), ("rest", rest), ("seed_hidden", seed_hidden),
                    ("vocab_mean", vocab_mean)):
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    check_skip_rows(skip_rows, N, hidden.device, "hidden")
    check_sampling(N, hidden.device, "hidden", temperature, do_sample, noise_keys, **cuts)
    check_penalty(**penalty, rows=N, vocab=weight.shape[0], device=hidden.device, data="hidden")


def candidate_confidence_triton(hidden, weight, ids, rest, *, seed_hidden, vocab_mean, temperature=1.0,
                                skip_rows=None, do_sample=False, seed=0, noise_keys=None, top_k=None, top_p=None,
                                min_p=None, epsilon_cutoff=None, eta_cutoff=None, top_h=None, typical_p=None,
                                repetition_penalty=None, seen_tokens=None, seen_rows=None, logit_offsets=None,
                                logit_bias=None, block_h: int | None = None):
    """Triton launcher of :func:`candidate_confidence` (same arguments and results; ``block_h`` overrides the H
    chunk, for tests). Ids must lie in [-1, V): on CUDA the kernel gathers their rows unchecked (a host check would
    synchronise; CPU ids are checked here)."""
    cuts = dict(top_k=top_k, top_p=top_p, min_p=min_p, epsilon_cutoff=epsilon_cutoff, eta_cutoff=eta_cutoff,
                top_h=top_h, typical_p=typical_p)
    penalty = penalty_args(repetition_penalty, seen_tokens, seen_rows, logit_offsets, logit_bias)
    _check_args(hidden, weight, ids, rest, seed_hidden, vocab_mean, skip_rows, temperature, do_sample, noise_keys, cuts,
                penalty)
    check_kernel_device(hidden.device, "candidate_confidence")
    check_ids_on_cpu("ids", ids, -1, weight.shape[0])  # (the reference's gather raises on its own)
    N, H = hidden.shape
    M = ids.shape[1]
    dev = hidden.device
    z = torch.empty((N, M), dtype=torch.float32, device=dev)
    lse = torch.empty(N, dtype=torch.float32, device=dev)
    tok = torch.empty(N, dtype=torch.int64, device=dev)
    prob = torch.empty(N, dtype=torch.float32, device=dev)
    if N == 0:
        return tok, prob
    contiguous = [t if t.stride(-1) == 1 else t.contiguous() for t in (hidden, seed_hidden, weight, ids)]
    h, hs, w, i = contiguous
    inv_t, t, t_stride, t_tensor = temperature_operands(temperature, tok)
    mean = vocab_mean.float().contiguous()
    skip = skip_rows.contiguous().view(torch.uint8) if skip_rows is not None else tok  # read at skip + row
    seen, offsets, bias, seen_at, pen = penalty_operands(N, tok, **penalty)
    _listed_kernel[(N,)](
        h, hs, w, mean, i, rest.float().contiguous(), skip,
        inv_t, t, t_stride, seen, offsets, bias, seen_at, pen, z, lse, tok, prob, M, H, weight.shape[0],
        h.stride(0), hs.stride(0), w.stride(0), i.stride(0), HAS_SKIP=skip_rows is not None,
        GREEDY=not may_sample(do_sample),
        T_TENSOR=t_tensor, HAS_PENALTY=repetition_penalty is not None, HAS_OFFSETS=logit_offsets is not None,
        HAS_BIAS=logit_bias is not None, BLOCK_M=max(16, triton.next_power_of_2(M)),
        BLOCK_H=block_h or min(triton.next_power_of_2(H), 256), num_warps=4)
    if may_sample(do_sample):
        tok, prob = pick_listed(z, lse, ids, skip_rows=skip_rows, do_sample=do_sample, seed=seed,
                                noise_keys=noise_keys, **cuts)
    return tok, prob


def candidate_confidence(hidden, weight, ids, rest, *, seed_hidden, vocab_mean, temperature=1.0, skip_rows=None,
                         do_sample=False, seed=0, noise_keys=None, top_k=None, top_p=None, min_p=None,
                         epsilon_cutoff=None, eta_cutoff=None, top_h=None, typical_p=None, repetition_penalty=None,
                         seen_tokens=None, seen_rows=None, logit_offsets=None, logit_bias=None):
    """A pick per row among its listed token ids, with its full-softmax probability estimated.

    hidden, seed_hidden: [N, H] (the draft's hidden state and its round's seed's); weight: [V, H] (the lm_head);
    ids: int64 [N, M] (1 <= M <= 64; -1 past a row's list); rest: [N] (log of the seed's softmax mass outside the
    list, in units of logits / temperature); vocab_mean: [H] (the mean lm_head row); temperature: float, 0-d
    tensor or one a row [N]; skip_rows: bool [N] or None; ``do_sample``: a bool, or a bool tensor [N] (the rows that
    sample; the others pick greedily); sampling: ``noise_keys`` int64 [N, 3] and optional top_k /
    top_p / min_p / typical_p / epsilon_cutoff / eta_cutoff (each also one a row) / top_h (applied among the listed
    tokens: typical, epsilon, eta and top-h to their softmax over the listed tokens); ``repetition_penalty`` with
    ``seen_tokens`` [C, V] and ``seen_rows`` [N]: the penalty at the listed tokens each row has seen, and
    ``logit_offsets`` float32 [C, V] (read at the same rows) added after it, ``logit_bias`` float32 [V] added before
    it (as :func:`.confidence.confidence`).
    Returns (tokens int64 [N], probs float32 [N]); -1 / 0 for skipped rows and rows
    with nothing listed. Semantics: :mod:`mrp_triton.reference.candidate_confidence`.
    """
    cuts = dict(top_k=top_k, top_p=top_p, min_p=min_p, epsilon_cutoff=epsilon_cutoff, eta_cutoff=eta_cutoff,
                top_h=top_h, typical_p=typical_p)
    penalty = penalty_args(repetition_penalty, seen_tokens, seen_rows, logit_offsets, logit_bias)
    kw = dict(seed_hidden=seed_hidden, vocab_mean=vocab_mean, temperature=temperature, skip_rows=skip_rows,
              do_sample=do_sample, seed=seed, noise_keys=noise_keys, **cuts, **penalty)
    # float64 (exact-comparison tests) is computed by the reference on any device.
    if not wide(weight, hidden) and select_backend(hidden.device, hidden, weight, seed_hidden) == "triton":
        return candidate_confidence_triton(hidden, weight, ids, rest, **kw)
    _check_args(hidden, weight, ids, rest, seed_hidden, vocab_mean, skip_rows, temperature, do_sample, noise_keys, cuts,
                penalty)
    return candidate_confidence_reference(hidden, weight, ids, rest, **kw)
