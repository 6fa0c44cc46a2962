"""Greedy token + full-softmax confidence of ``lm_head(hidden) [+ base_logits]`` without logits (and its top m).

For each of N rows: ``z = (hidden @ weight.T [+ base_logits]) / temperature`` over the vocabulary
V, the argmax token (lowest index on ties), its probability ``exp(max z - logsumexp z)`` and
``lse = logsumexp z``, with the ``mask_token_id`` column excluded from all three, and so is column v in row n when
``banned_tokens[v] & ban_rows[n]`` is nonzero (how decoding holds EOS back and suppresses tokens). As
in ``confidence``, NaN in z counts as -inf, +inf as the largest fp32, and a row with no finite z gives token -1, prob 0,
lse -inf. The [N, V] logits are never written. Rows in ``skip_rows`` give token -1, prob 0, lse -inf and cost nothing:
a one-program kernel lists the kept rows first (prefix sums on the device, no host synchronisation,
so the op stays capturable in a CUDA graph) and row blocks past the kept count return at once.
With ``top_m`` it also gives each row's ``top_m`` largest z and their token ids (largest first, ties to the
lowest id): what speculative drafts score instead of the whole vocabulary (``draft_candidates``), from the
same read of the weight.

Cost model (b bytes per weight element, N <= 128 rows, one row block):
    reads  V*H*b (the lm_head weight, once) + N*H*b per V tile (L2-resident)
           [+ N*V*b_base when base_logits is given]
    writes 3 * N * n_splits partials (12 bytes each; 16 with the entropy) and 3*N results (4*N with it)
    FLOPs  2*N*V*H.
At decode sizes the weight read dominates: V=151936, H=2048, bf16 is 622 MB, 145 us at the
4.28 TB/s copy ceiling of an H200; H=4096 doubles it. Materialising the logits instead would
add N*V*(write + read) bytes and a softmax launch. Rows above BLOCK_N = 128 re-read the weight
once per row block (adjacent programs share a V tile, so the re-read is mostly served by L2);
there the MMA work dominates, and skipping rows (a decoding step scores only its masked
positions, typically half of them) saves whole row blocks.

Two launches (three with ``skip_rows``: ``_kept_first_kernel`` first):
1. ``_partials_kernel``, grid (row blocks, splits) over the (kept-first) row slots: split s owns the vocabulary slice
   [s*v_per_split, (s+1)*v_per_split) and walks it in BLOCK_V tiles. Each tile is a
   ``tl.dot(W_tile [BLOCK_V, BLOCK_K], hidden_tile^T [BLOCK_K, BLOCK_N])`` accumulated over H in
   fp32 (V is the MMA's M side, so a handful of rows still fills the tensor cores), then an online
   softmax per row: running max m, rescaled sum d, and the argmax (one max-with-index reduction per
   tile; a later tile only wins with a strictly larger max, so the lowest index is kept). It writes
   (m, d, argmax) per (row, split). ``rows_major`` (a config key) swaps the operands,
   ``tl.dot(hidden_tile, W_tile^T)`` -> [BLOCK_N, BLOCK_V]: rows on the M side (64 or more rows fill it),
   so the softmax's reductions over V run within each warp instead of across warps through shared memory
   (``benchmarks/sm90_kernels.py --lm-head-sweep``, Triton 3.6 for sm_90: a 128-row x 128-V tile on 8 warps takes 192
   registers a thread instead of 255); which layout is faster at N = 64-128 is for
   ``benchmarks/bench_mrp_head.py --sweep`` on the GPU to say.
   With ``top_m`` every split is one tile, and after its softmax step the tile gives up its ``top_m`` largest z per
   row (``top_m`` max-with-index reductions, each taking the winner out), written with their ids per (row, split):
   ``top_m * 8`` bytes per row and split (V = 151936 in 128-wide tiles, top_m = 16: 152 KB a row).
   Two more config keys, also for the sweep to judge (neither is in the default table yet): ``tma`` has the copy
   engine fetch the weight tiles through a TMA descriptor (sm_90 or newer, weight rows a multiple of 16 bytes;
   it zero-fills past V and H, so the tile needs no mask and no per-thread address arithmetic), and ``flatten``
   pipelines a split's tile loop and the K loop inside it as one loop, so the next tile's copies are in flight
   while this tile's softmax runs (without it each tile starts with its pipeline empty); it pays with several
   tiles per split.
2. ``_merge_kernel``, grid (N,) row slots: M = max_s m_s, d = sum_s d_s exp(m_s - M), the token of the
   first split reaching M (splits are in vocabulary order, so ties still go to the lowest
   index), lse = M + log d, prob = exp(M - lse), written to the slot's row (skipped slots write
   the skip values).
3. With ``top_m``, ``reference.lm_head_confidence.top_by_value`` merges the splits' lists per row (one ``topk``
   over int64 keys): the largest values first and among equal values the earliest list position, which is the lowest id
   (splits and each split's list are in id order).

dtypes: the matmul runs in weight's dtype (hidden is cast to it, as ``F.linear`` would need);
fp32 weights use IEEE fp32 products (no TF32). Under TRITON_INTERPRET=1, tl.dot on bf16 is
broken, so the tiles are cast to fp32 before the dot there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._checks import (ban_operands, check_banned, check_kernel_device, check_penalty, check_skip_rows, check_token_id,
                      check_top_m, penalty_args, penalty_operands, wide)
from .backend import fit_stages, interpreter_on, select_backend, shared_memory_limit
from .confidence import check_temperature, comparable, penalized, penalty_factors, rescaled_terms, softmax_entropy
from .reference.lm_head_confidence import lm_head_confidence as lm_head_confidence_reference
from .reference.lm_head_confidence import top_by_value


@triton.jit(do_not_specialize=["N"])
def _kept_first_kernel(skip_ptr, order_ptr, kept_ptr, N, BLOCK: tl.constexpr):
    """One program: order[:kept] = the rows not skipped and order[kept:] = the skipped ones, each in
    increasing order (int64), and kept_ptr[0] = kept. skip_ptr: uint8 [N] (nonzero = skipped)."""
    offs = tl.arange(0, BLOCK)
    kept = 0
    for start in range(0, N, BLOCK):
        rows = start + offs
        kept += tl.sum((tl.load(skip_ptr + rows, mask=rows < N, other=1) == 0).to(tl.int32), axis=0)
    kept_before = 0
    skipped_before = 0
    for start in range(0, N, BLOCK):
        rows = start + offs
        inside = rows < N
        keep = tl.load(skip_ptr + rows, mask=inside, other=1) == 0
        k = keep.to(tl.int32)
        s = (inside & ~keep).to(tl.int32)
        slot = tl.where(keep, kept_before + tl.cumsum(k, axis=0) - 1, kept + skipped_before + tl.cumsum(s, axis=0) - 1)
        tl.store(order_ptr + slot, rows.to(tl.int64), mask=inside)
        kept_before += tl.sum(k, axis=0)
        skipped_before += tl.sum(s, axis=0)
    tl.store(kept_ptr, kept.to(tl.int64))


@triton.jit(do_not_specialize=["N", "mask_token"])  # runtime values: no recompile when N == 1 etc.
def _partials_kernel(h_ptr, w_ptr, w_desc, base_ptr, order_ptr, kept_ptr, ban_tok_ptr, ban_rows_ptr,
                     seen_ptr, off_ptr, bias_ptr, seen_rows_ptr, pen_ptr, m_ptr, d_ptr, t_ptr, idx_ptr, topv_ptr,
                     topi_ptr,
                     N, V, H, stride_h, stride_w, stride_base, inv_temp, mask_token,
                     v_per_split, n_splits,
                     HAS_BASE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_BAN: tl.constexpr,
                     HAS_PENALTY: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
                     ROWS_MAJOR: tl.constexpr, W_TMA: tl.constexpr, FLATTEN: tl.constexpr, TOP_M: tl.constexpr,
                     ENTROPY: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    slots = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_SKIP:  # slots [0, kept) hold the kept rows, in order_ptr; the rest are skipped
        n_live = tl.load(kept_ptr)
        if pid_n * BLOCK_N >= n_live:
            return
        row_mask = slots < n_live
        rows64 = tl.load(order_ptr + slots, mask=row_mask, other=0)
    else:
        row_mask = slots < N
        rows64 = slots.to(tl.int64)
    # the logits tile z: [BLOCK_V, BLOCK_N] (the vocabulary on the MMA's M side, filled by a handful of rows),
    # or with ROWS_MAJOR [BLOCK_N, BLOCK_V] (rows on M: the softmax reductions over V stay within each warp)
    V_AXIS: tl.constexpr = 1 if ROWS_MAJOR else 0
    PRECISION: tl.constexpr = "ieee" if IEEE else None
    v_start = pid_s * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)

    if HAS_BAN:  # column v is excluded in a row where banned_tokens[v] & the row's ban classes (uint8 bits) != 0
        ban_bits = tl.expand_dims(tl.load(ban_rows_ptr + rows64, mask=row_mask, other=0), V_AXIS)
    if HAS_PENALTY or HAS_OFFSETS:  # each row's row of the seen table and of the offsets
        seen_at = tl.expand_dims(tl.load(seen_rows_ptr + rows64, mask=row_mask, other=0) * V, V_AXIS)
    if HAS_PENALTY:  # the repetition penalty at the columns each row has seen
        pen, inv_pen = penalty_factors(pen_ptr)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    d = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)  # with ENTROPY: sum of exp(z - m) * (z - m)
    best = tl.zeros([BLOCK_N], tl.int32) + v_start
    for v0 in tl.range(v_start, v_end, BLOCK_V, flatten=FLATTEN):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_end
        cols64 = cols.to(tl.int64)
        acc = tl.zeros([BLOCK_N, BLOCK_V] if ROWS_MAJOR else [BLOCK_V, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < H
            if W_TMA:  # the copy engine fetches the tile; it fills zeros past V and H
                w = w_desc.load([v0, k0])
            else:
                w = tl.load(w_ptr + cols64[:, None] * stride_w + ks[None, :],
                            mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            h = tl.load(h_ptr + rows64[:, None] * stride_h + ks[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            h = h.to(w_ptr.dtype.element_ty)
            if DOT_FP32:
                w = w.to(tl.float32)
                h = h.to(tl.float32)
            if ROWS_MAJOR:
                acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(w, tl.trans(h), acc, input_precision=PRECISION)
        z = acc
        if HAS_BASE:
            b = tl.load(base_ptr + tl.expand_dims(rows64, V_AXIS) * stride_base + tl.expand_dims(cols64, 1 - V_AXIS),
                        mask=tl.expand_dims(row_mask, V_AXIS) & tl.expand_dims(col_mask, 1 - V_AXIS), other=0.0)
            z = z + b.to(tl.float32)
        if HAS_BIAS:  # a bias by column (the same in every row), before the penalty
            z = z + tl.expand_dims(tl.load(bias_ptr + cols64, mask=col_mask, other=0.0), 1 - V_AXIS)
        if HAS_PENALTY:
            seen = tl.load(seen_ptr + seen_at + tl.expand_dims(cols64, 1 - V_AXIS),
                           mask=tl.expand_dims(row_mask, V_AXIS) & tl.expand_dims(col_mask, 1 - V_AXIS), other=0)
            z = penalized(z, seen, pen, inv_pen)
        if HAS_OFFSETS:  # an additive term a column (presence / frequency penalties)
            z = z + tl.load(off_ptr + seen_at + tl.expand_dims(cols64, 1 - V_AXIS),
                            mask=tl.expand_dims(row_mask, V_AXIS) & tl.expand_dims(col_mask, 1 - V_AXIS), other=0.0)
        z = z * inv_temp
        z = comparable(z)
        valid = col_mask
        if HAS_MASK:
            valid = valid & (cols != mask_token)
        z = tl.where(tl.expand_dims(valid, 1 - V_AXIS), z, float("-inf"))
        if HAS_BAN:
            banned = tl.expand_dims(tl.load(ban_tok_ptr + cols, mask=col_mask, other=0), 1 - V_AXIS)
            z = tl.where((banned & ban_bits) != 0, float("-inf"), z)
        tile_max, tile_arg = tl.max(z, axis=V_AXIS, return_indices=True, return_indices_tie_break_left=True)
        best = tl.where(tile_max > m, v0 + tile_arg.to(tl.int32), best)
        new_m = tl.maximum(m, tile_max)
        safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
        shifted = z - tl.expand_dims(safe_m, V_AXIS)
        p = tl.exp(shifted)
        if ENTROPY:
            t = rescaled_terms(t, d, m, safe_m) + tl.sum(tl.where(p > 0, p * shifted, 0.0), axis=V_AXIS)
        d = d * tl.exp(m - safe_m) + tl.sum(p, axis=V_AXIS)
        m = new_m
        if TOP_M > 0:  # the split's only tile (the launcher's rule): its top_m per row, each winner taken out
            in_tile = tl.expand_dims(tl.arange(0, BLOCK_V), 1 - V_AXIS)
            top_at = (slots.to(tl.int64) * n_splits + pid_s) * TOP_M
            for j in tl.static_range(TOP_M):
                top, top_arg = tl.max(z, axis=V_AXIS, return_indices=True, return_indices_tie_break_left=True)
                tl.store(topv_ptr + top_at + j, top, mask=row_mask)
                tl.store(topi_ptr + top_at + j, tl.where(top == float("-inf"), -1, v0 + top_arg.to(tl.int32)),
                         mask=row_mask)
                z = tl.where(in_tile == tl.expand_dims(top_arg, V_AXIS), float("-inf"), z)
    out = slots.to(tl.int64) * n_splits + pid_s
    tl.store(m_ptr + out, m, mask=row_mask)
    tl.store(d_ptr + out, d, mask=row_mask)
    if ENTROPY:
        tl.store(t_ptr + out, t, mask=row_mask)
    tl.store(idx_ptr + out, best, mask=row_mask)


@triton.jit
def _merge_kernel(m_ptr, d_ptr, t_ptr, idx_ptr, order_ptr, kept_ptr, tok_ptr, prob_ptr, lse_ptr, ent_ptr, n_splits,
                  HAS_SKIP: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_S: tl.constexpr):
    slot = tl.program_id(0).to(tl.int64)
    row = slot
    if HAS_SKIP:
        row = tl.load(order_ptr + slot)
        if slot >= tl.load(kept_ptr):
            tl.store(tok_ptr + row, -1)
            tl.store(lse_ptr + row, float("-inf"))
            tl.store(prob_ptr + row, 0.0)
            if ENTROPY:
                tl.store(ent_ptr + row, float("inf"))
            return
    base = slot * n_splits
    offs = tl.arange(0, BLOCK_S)
    # pass 1, lane-wise over chunks of splits: the max and the token of the first split reaching it
    m_vec = tl.full([BLOCK_S], float("-inf"), tl.float32)
    t_vec = tl.zeros([BLOCK_S], tl.int64)
    for s0 in range(0, n_splits, BLOCK_S):
        mask = s0 + offs < n_splits
        ms = tl.load(m_ptr + base + s0 + offs, mask=mask, other=float("-inf"))
        ts = tl.load(idx_ptr + base + s0 + offs, mask=mask, other=0).to(tl.int64)
        t_vec = tl.where(ms > m_vec, ts, t_vec)
        m_vec = tl.maximum(m_vec, ms)
    M = tl.max(m_vec, axis=0)
    # tokens grow with the split index, so the smallest token among the lanes at M is the first
    tok = tl.min(tl.where(m_vec == M, t_vec, 9223372036854775807), axis=0)
    # pass 2: the rescaled sum (no finite z in the row: token -1, prob 0, lse -inf, as for a skipped row)
    found = M > float("-inf")
    safe_M = tl.where(found, M, 0.0)
    d_vec = tl.zeros([BLOCK_S], tl.float32)
    t_vec = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        mask = s0 + offs < n_splits
        ms = tl.load(m_ptr + base + s0 + offs, mask=mask, other=float("-inf"))
        ds = tl.load(d_ptr + base + s0 + offs, mask=mask, other=0.0)
        if ENTROPY:
            t_vec += rescaled_terms(tl.load(t_ptr + base + s0 + offs, mask=mask, other=0.0), ds, ms, safe_M)
        d_vec += ds * tl.exp(ms - safe_M)
    d = tl.sum(d_vec, axis=0)
    lse = safe_M + tl.log(d)
    tl.store(tok_ptr + row, tl.where(found, tok, -1))
    tl.store(lse_ptr + row, tl.where(found, lse, float("-inf")))
    tl.store(prob_ptr + row, tl.where(found, tl.exp(M - lse), 0.0))
    if ENTROPY:
        tl.store(ent_ptr + row, softmax_entropy(d, tl.sum(t_vec, axis=0), found))


def _config(N: int, V: int, H: int, dtype: torch.dtype, shared_limit: int | None = None) -> dict:
    """Tile sizes: {BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages, tiles_per_split}
    (an override may also set BLOCK_S, the merge kernel's chunk of splits, rows_major, tma and flatten).
    ``shared_limit``: the GPU's shared memory a program (:func:`~mrp_triton.backend.shared_memory_limit`); the table's
    stages (tuned on an H200) are cut to what it holds, and where two do not fit, the K tile is halved first."""
    config = _table(N, V, H, dtype)
    elem = dtype.itemsize
    while True:
        stage_bytes = (config["BLOCK_N"] + config["BLOCK_V"]) * config["BLOCK_K"] * elem  # a row tile, a weight tile
        stages = fit_stages(config["num_stages"], stage_bytes, 0, shared_limit)
        if (stages or 0) >= min(2, config["num_stages"]) or config["BLOCK_K"] <= 16:
            return {**config, "num_stages": stages or 1}
        config["BLOCK_K"] //= 2


def _table(N: int, V: int, H: int, dtype: torch.dtype) -> dict:
    """The tile table: interpreter, fp32, and the configs measured on an H200 for bf16 / fp16."""
    block_n = min(max(16, triton.next_power_of_2(N)), 128)
    if interpreter_on():
        # the interpreter runs one numpy call per op per program: few, large programs
        return dict(BLOCK_N=block_n, BLOCK_V=128, BLOCK_K=64, num_warps=4, num_stages=1, tiles_per_split=8)
    if dtype == torch.float32:
        return dict(BLOCK_N=min(block_n, 64), BLOCK_V=64, BLOCK_K=32, num_warps=4, num_stages=3,
                    tiles_per_split=4)
    # measured on an H200 (benchmarks/bench_mrp_head.py --sweep, V=151936, H=2048/4096, bf16):
    # N <= 64 reach 1.0-1.3x the weight-read time with 128x128 tiles, one tile per program
    # (162-189 us at H=2048, 298-320 us at H=4096; the weight read alone is 148 / 297 us).
    # N = 128 is MMA-bound in this kernel (~350 TFLOP/s): 255 us / 452 us, 1.7x / 1.5x the read.
    if block_n <= 64:
        return dict(BLOCK_N=block_n, BLOCK_V=128, BLOCK_K=128, num_warps=4, num_stages=4, tiles_per_split=1)
    if H <= 2048:  # two 64-row blocks, adjacent programs: the second weight read hits L2
        return dict(BLOCK_N=64, BLOCK_V=256, BLOCK_K=64, num_warps=8, num_stages=3, tiles_per_split=1)
    return dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=4, tiles_per_split=2)


def _weight_descriptor(w: torch.Tensor, block_v: int, block_k: int) -> TensorDescriptor:
    """The TMA descriptor of the lm_head weight w [V, H] in [block_v, block_k] tiles (config key ``tma``)."""
    if w.device.type == "cuda" and (torch.version.hip or torch.cuda.get_device_capability(w.device)[0] < 9):
        raise ValueError("config tma=True needs an NVIDIA GPU with TMA (sm_90 or newer), got "
                         f"{torch.cuda.get_device_name(w.device)}; drop the tma key")
    row_bytes = w.stride(0) * w.element_size()
    if row_bytes % 16 or w.data_ptr() % 16:
        raise ValueError(f"config tma=True needs 16-byte aligned weight rows, got rows of {row_bytes} bytes at address "
                         f"{w.data_ptr():#x}; drop the tma key for this weight")
    return TensorDescriptor.from_tensor(w, [block_v, block_k])


def _check_args(hidden: torch.Tensor, weight: torch.Tensor, base_logits: torch.Tensor | None, mask_token_id,
                banned_tokens, ban_rows, temperature, skip_rows: torch.Tensor | None, top_m: int,
                penalty: dict) -> None:
    """:func:`lm_head_confidence`'s argument checks, run on either backend (the reference would broadcast
    ``base_logits`` of another shape and score an empty vocabulary)."""
    if not hidden.dtype.is_floating_point or not weight.dtype.is_floating_point:
        raise TypeError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.device != hidden.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    (N, H), V = hidden.shape, weight.shape[0]
    if V == 0 or H == 0:
        raise ValueError(f"empty vocabulary or hidden size: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if base_logits is not None:
        if base_logits.shape != (N, V):
            raise ValueError(f"base_logits must be [N={N}, V={V}], got {tuple(base_logits.shape)}")
        if not base_logits.dtype.is_floating_point:
            raise TypeError(f"base_logits must be floating point, got {base_logits.dtype}")
        if base_logits.device != hidden.device:
            raise ValueError(f"hidden is on {hidden.device} but base_logits is on {base_logits.device}")
    if mask_token_id is not None:
        check_token_id(mask_token_id)
        if not 0 <= int(mask_token_id) < V:
            raise ValueError(f"mask_token_id {int(mask_token_id)} is outside the vocabulary [0, {V})")
        if V == 1:
            raise ValueError("the vocabulary has only the mask token: nothing left to pick")
    check_temperature(temperature)
    check_banned(banned_tokens, ban_rows, N, V, hidden.device, "hidden")
    check_penalty(**penalty, rows=N, vocab=V, device=hidden.device, data="hidden")
    check_skip_rows(skip_rows, N, hidden.device, "hidden")
    check_top_m(top_m, V)


def lm_head_confidence_triton(hidden: torch.Tensor, weight: torch.Tensor, *, base_logits: torch.Tensor | None = None,
                              mask_token_id: int | None = None, banned_tokens: torch.Tensor | None = None,
                              ban_rows: torch.Tensor | None = None, temperature: float = 1.0,
                              skip_rows: torch.Tensor | None = None, top_m: int = 0, entropy: bool = False,
                              repetition_penalty=None, seen_tokens: torch.Tensor | None = None,
                              seen_rows: torch.Tensor | None = None, logit_offsets: torch.Tensor | None = None,
                              logit_bias: torch.Tensor | None = None, config: dict | None = None):
    """Triton launcher of :func:`lm_head_confidence` (same arguments and results).

    ``config`` overrides the tile table (keys of :func:`_config`; used by the benchmark's sweep).
    """
    penalty = penalty_args(repetition_penalty, seen_tokens, seen_rows, logit_offsets, logit_bias)
    _check_args(hidden, weight, base_logits, mask_token_id, banned_tokens, ban_rows, temperature, skip_rows, top_m,
                penalty)
    check_kernel_device(hidden.device, "lm_head_confidence")
    if weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"weight must be fp32, fp16 or bf16, got {weight.dtype}")
    (N, H), V = hidden.shape, weight.shape[0]
    if base_logits is not None and base_logits.stride(1) != 1:
        base_logits = base_logits.contiguous()
    mask_token_id = None if mask_token_id is None else int(mask_token_id)
    temperature = float(temperature)

    tokens = torch.empty(N, dtype=torch.int64, device=hidden.device)
    probs = torch.empty(N, dtype=torch.float32, device=hidden.device)
    lse = torch.empty(N, dtype=torch.float32, device=hidden.device)
    ent = torch.empty(N, dtype=torch.float32, device=hidden.device) if entropy else lse  # (a dummy pointer)
    picks = (tokens, probs, lse, ent) if entropy else (tokens, probs, lse)
    if top_m:
        top_logits = torch.empty((N, top_m), dtype=torch.float32, device=hidden.device)
        top_ids = torch.empty((N, top_m), dtype=torch.int64, device=hidden.device)
    if N == 0:
        return (*picks, top_logits, top_ids) if top_m else picks
    cfg = _config(N, V, H, weight.dtype, shared_memory_limit(hidden.device))
    if config:
        cfg.update(config)
    if top_m:
        cfg["tiles_per_split"] = 1  # each split lists its tile's top_m (see the module docstring)
    h = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    v_per_split = cfg["BLOCK_V"] * cfg["tiles_per_split"]
    n_splits = triton.cdiv(V, v_per_split)
    m_part = torch.empty((N, n_splits), dtype=torch.float32, device=hidden.device)
    d_part = torch.empty_like(m_part)
    t_part = torch.empty_like(m_part) if entropy else m_part  # (a dummy pointer without entropy)
    i_part = torch.empty((N, n_splits), dtype=torch.int32, device=hidden.device)
    # per (row slot, split): the tile's top_m values and ids (dummy pointers without top_m)
    topv_part = torch.empty((N, n_splits * top_m), dtype=torch.float32, device=hidden.device) if top_m else m_part
    topi_part = torch.empty((N, n_splits * top_m), dtype=torch.int32, device=hidden.device) if top_m else i_part
    base = base_logits if base_logits is not None else m_part  # dummy pointer when HAS_BASE=False
    w_desc = _weight_descriptor(w, cfg["BLOCK_V"], cfg["BLOCK_K"]) if cfg.get("tma") else w
    order = kept = tokens  # dummy pointers when HAS_SKIP=False
    if skip_rows is not None:
        order = torch.empty(N, dtype=torch.int64, device=hidden.device)
        kept = torch.empty(1, dtype=torch.int64, device=hidden.device)
        _kept_first_kernel[(1,)](skip_rows.contiguous().view(torch.uint8), order, kept, N,
                                 BLOCK=min(triton.next_power_of_2(N), 1024), num_warps=4)
    ban_tok, ban_flags = ban_operands(banned_tokens, ban_rows, N, tokens)
    seen, offsets, bias, seen_at, pen = penalty_operands(N, tokens, **penalty)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), n_splits)
    _partials_kernel[grid](
        h, w, w_desc, base, order, kept, ban_tok, ban_flags, seen, offsets, bias, seen_at, pen, m_part, d_part, t_part,
        i_part, topv_part, topi_part,
        N, V, H, h.stride(0), w.stride(0), base.stride(0), 1.0 / temperature,
        mask_token_id if mask_token_id is not None else -1, v_per_split, n_splits,
        HAS_BASE=base_logits is not None, HAS_MASK=mask_token_id is not None, HAS_SKIP=skip_rows is not None,
        HAS_BAN=banned_tokens is not None, HAS_PENALTY=repetition_penalty is not None,
        HAS_OFFSETS=logit_offsets is not None, HAS_BIAS=logit_bias is not None,
        DOT_FP32=interpreter_on() and w.dtype != torch.float32,
        IEEE=w.dtype == torch.float32,
        ROWS_MAJOR=cfg.get("rows_major", False), W_TMA=bool(cfg.get("tma")), FLATTEN=bool(cfg.get("flatten")),
        TOP_M=top_m, ENTROPY=bool(entropy), BLOCK_N=cfg["BLOCK_N"], BLOCK_V=cfg["BLOCK_V"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    block_s = cfg.get("BLOCK_S") or min(triton.next_power_of_2(n_splits), 1024)
    _merge_kernel[(N,)](m_part, d_part, t_part, i_part, order, kept, tokens, probs, lse, ent, n_splits,
                        HAS_SKIP=skip_rows is not None, ENTROPY=bool(entropy), BLOCK_S=block_s, num_warps=4)
    if not top_m:
        return picks
    # slot s holds row order[s] (with skip_rows); slots past the kept count were never written
    top, at = top_by_value(topv_part, top_m)
    ids = topi_part.gather(1, at).long()
    if skip_rows is not None:
        top_logits.index_copy_(0, order, top)
        top_ids.index_copy_(0, order, ids)
        top_logits.masked_fill_(skip_rows[:, None], float("-inf"))
        top_ids.masked_fill_(skip_rows[:, None], -1)
    else:
        top_logits.copy_(top)
        top_ids.copy_(ids)
    return (*picks, top_logits, top_ids)


def lm_head_confidence(hidden: torch.Tensor, weight: torch.Tensor, *, base_logits: torch.Tensor | None = None,
                       mask_token_id: int | None = None, banned_tokens: torch.Tensor | None = None,
                       ban_rows: torch.Tensor | None = None, temperature: float = 1.0,
                       skip_rows: torch.Tensor | None = None, top_m: int = 0, entropy: bool = False,
                       repetition_penalty=None, seen_tokens: torch.Tensor | None = None,
                       seen_rows: torch.Tensor | None = None, logit_offsets: torch.Tensor | None = None,
                       logit_bias: torch.Tensor | None = None):
    """Greedy pick and its full-softmax confidence (and entropy), never materialising the logits.

    hidden: [N, H], weight: [V, H] (the lm_head), base_logits: [N, V] or None,
    mask_token_id: a column excluded from the argmax and the softmax, banned_tokens: bool or uint8 [V] and ban_rows:
    bool or uint8 [N] (column v excluded so in row n when ``banned_tokens[v] & ban_rows[n]`` is nonzero; ban_rows
    None: in every row), temperature > 0,
    skip_rows: bool [N] or None (rows not to score: token -1, prob 0, lse -inf; on the GPU they cost nothing),
    repetition_penalty (a number > 0 or a 0-d tensor) with seen_tokens: bool or uint8 [C, V] and seen_rows: int64 [N]
    (as :func:`.confidence.confidence`: the penalty at the columns row n has seen, before the temperature),
    logit_offsets: float32 [C, V] read at the same rows (an additive term after the penalty), logit_bias: float32 [V]
    (a bias by column every row adds before the penalty).
    Returns (tokens int64 [N], probs float32 [N], lse float32 [N]) for
    ``z = (penalized(hidden @ weight.T [+ base_logits] + bias) + offsets) / temperature``; ties go to the lowest index.
    With ``entropy`` the entropy (nats) of each row's softmax of z, float32 [N], comes fourth (+inf where the token is
    -1; one more running sum in the same pass). With ``top_m`` (0 to
    64) also (top_logits float32 [N, top_m], top_ids int64 [N, top_m]): each row's top_m largest z, largest first,
    ties to the lowest id (-inf / -1 past the row's scored tokens and in skipped rows).
    """
    penalty = penalty_args(repetition_penalty, seen_tokens, seen_rows, logit_offsets, logit_bias)
    kw = dict(base_logits=base_logits, mask_token_id=mask_token_id, banned_tokens=banned_tokens, ban_rows=ban_rows,
              temperature=temperature, skip_rows=skip_rows, top_m=top_m, entropy=entropy, **penalty)
    # float64 (exact-comparison tests) is computed by the reference on any device.
    if not wide(weight) and select_backend(hidden.device, hidden, weight, base_logits) == "triton":
        return lm_head_confidence_triton(hidden, weight, **kw)
    _check_args(hidden, weight, base_logits, mask_token_id, banned_tokens, ban_rows, temperature, skip_rows, top_m,
                penalty)
    return lm_head_confidence_reference(hidden, weight, **kw)
