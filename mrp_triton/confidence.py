"""Fused confidence over the vocabulary: token, full-softmax probability and logsumexp per row.

``z = (logits + scale * sum_r residual[r]) / temperature`` (fp32), then per row: the argmax (greedy)
or Gumbel-max sample of ``z``, the probability of that token under the *full* softmax of ``z`` and
``lse = logsumexp(z)``. Exact semantics (NaN, mask column, banned tokens, skipped rows, hash) are defined in
:mod:`mrp_triton.reference.confidence`, which is also the CPU path and the test oracle.

Cost model (N rows, V vocab, R residual slices, b bytes per element):
  read N*V*b (logits) + R*N*V*b (residual) (+ N*V with a repetition penalty's seen table, + 4*N*V with
  logit_offsets, + 4*V with a logit_bias); write 16*N bytes (+ 20*N*S bytes of partials when
  the vocabulary is split in S pieces; with the entropy 4 more of each). ~6 FLOPs and one exp per element (plus a
  2x32-bit integer hash and two logs per element when sampling; 3 more FLOPs with the entropy). Memory-bound: the
  floor is (1 + R) * N * V * b / copy_bandwidth, e.g. N = 256, V = 151936, bf16, R = 1: 156 MB -> 36 us on an
  H200 (4.28 TB/s measured copy). The probabilities are never materialised: one streaming pass
  over V in BLOCK_V tiles keeps a running max m, a rescaled sum d and the running argmax (lowest
  index on ties; tiles are visited in increasing order and only a strictly larger score replaces).

Memory-level parallelism: each thread loads 8 consecutive elements (one 16-byte vector) of a tile and issues
the next tile's loads before it works on the current one, so two tiles a thread are in flight: the register
budget that per-lane softmax state leaves allows 3-4 programs of 8 warps per SM, and one tile each (16 KiB
per SM) would leave HBM mostly waiting (about 23 KiB per SM must be in flight to cover ~0.7 us of latency at
4.3 TB/s). Untimed on a GPU so far; the benchmark's sweep times it off too.

Parallelism: rows x S vocabulary splits, S chosen so that about 4 programs per SM are in flight
(small N -> many splits; N >= 2 * SMs -> S = 1). With S = 1 one launch writes the outputs; with
S > 1 a first launch writes (m, d, best score, best index, z at best) per (row, split) and a tiny
second launch merges them (two launches, no atomics, deterministic).

Sampling: Gumbel-max with ``g = -log(-log(u))``, ``u`` from a counter-based 32-bit hash of
(seed, noise_keys[n, 0..2], v) that is bit-identical to the reference (int64 arithmetic on values
< 2**32 with multipliers < 2**31, so nothing ever overflows). The filters (top_h / top_k / top_p / min_p /
typical_p / epsilon_cutoff / eta_cutoff; sampling only: a greedy pick reads none, and a greedy row of a sampled launch
(``do_sample`` one a row) neither its noise nor its band) need a row's largest values
or its softmax: the launcher materialises z [N, V] in fp32 with torch ops and finds where the filters cut them
(``reference.confidence.sampling_cut``: a band of values per row, from ``torch.topk`` of top_k (or ``top_k_max``, or
with top_h 100) values, or a sort of the row for top-p alone and for typical_p; min_p needs only the row's max,
epsilon and eta a logsumexp (and eta an entropy) over what the filters before them kept); the kernel then draws only
among the tokens inside the band, with the same in-kernel noise, and prob stays the full-softmax probability.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from ._checks import (ban_operands, check_banned, check_device_scalar, check_kernel_device, check_penalty,
                      check_row_flags, check_skip_rows, penalty_args, penalty_operands, sample_operands,
                      temperature_operands, wide)
from .backend import interpreter_on, num_sms, select_backend
from .reference.confidence import confidence as confidence_reference
from .reference.confidence import cuts_anything, effective_logits, may_sample, row_slice, sampling_cut, seed_hash

FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def comparable(z):
    """z with NaN -> -inf and +inf -> FLT_MAX (reference: :func:`.reference.confidence.comparable`)."""
    return tl.where(z == z, tl.minimum(z, FLT_MAX), float("-inf"))


@triton.jit
def penalty_factors(pen_ptr):
    """(penalty, 1 / penalty) in fp32 from the 0-d float64 penalty, each rounded once (reference:
    :func:`.reference.confidence.penalty_factors`)."""
    pen64 = tl.load(pen_ptr).to(tl.float64)
    return pen64.to(tl.float32), (1.0 / pen64).to(tl.float32)


@triton.jit
def penalized(z, seen, pen, inv_pen):
    """z with the repetition penalty where ``seen`` is nonzero: a negative logit times ``pen``, any other times
    ``inv_pen`` (reference: :func:`.reference.confidence.penalized`). Any matching shapes."""
    return tl.where(seen != 0, tl.where(z < 0, z * pen, z * inv_pen), z)


@triton.jit
def _mix32(x):
    # x: int64 in [0, 2**32). Same steps as reference.confidence.mix32.
    M = tl.full([], 0xFFFFFFFF, tl.int64)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & M
    x = x ^ (x >> 16)
    return x


@triton.jit
def rescaled_terms(t, d, m, m_new):
    """Entropy sums t = sum exp(z - m) (z - m) (with their d = sum exp(z - m)) moved to a max m_new >= m:
    exp(m - m_new) * (t + (m - m_new) * d); 0 where that factor is (no finite z yet, or m too far below m_new, where
    (m - m_new) * d could overflow). Any matching shapes."""
    scale = tl.exp(m - m_new)
    return tl.where(scale > 0, scale * (t + (m - m_new) * d), 0.0)


@triton.jit
def entropy_terms(t, d, m, m_new, e, z):
    """t after a tile: the sums so far (:func:`rescaled_terms`) plus the tile's e * (z - m_new), e = exp(z - m_new)
    (0 where e is: -inf z)."""
    return rescaled_terms(t, d, m, m_new) + tl.where(e > 0, e * (z - m_new), 0.0)


@triton.jit
def softmax_entropy(d, t, valid):
    """The entropy log d - t / d of a row's softmax from its final sums (reference:
    :func:`.reference.confidence.softmax_entropy`); +inf where not ``valid``."""
    return tl.where(valid, tl.log(tl.maximum(d, 1e-38)) - t / tl.maximum(d, 1e-38), float("inf"))


@triton.jit
def _tile_loads(logits_row, res_row, offs, hi, HAS_RES: tl.constexpr):
    """The raw (not yet converted) loads of one tile at ``offs`` (those < hi): the logits and the first residual
    slice (the logits again without a residual), so a caller can hold them in flight while it works."""
    x = tl.load(logits_row + offs, mask=offs < hi, other=0.0)
    r = x
    if HAS_RES:
        r = tl.load(res_row + offs, mask=offs < hi, other=0.0)
    return x, r


@triton.jit(do_not_specialize=["R", "tiles", "S", "mask_id", "seed_h"])
def _conf_partial_kernel(
    logits_ptr, stride_ln, res_ptr, stride_rr, stride_rn, R, skip_ptr, keys_ptr, cut_ptr, ban_tok_ptr, ban_rows_ptr,
    sample_ptr, seen_ptr, off_ptr, bias_ptr, seen_rows_ptr, pen_ptr, part_ptr, part_idx_ptr, tok_ptr, prob_ptr,
    lse_ptr, ent_ptr,
    V, tiles, S, scale, inv_t, t_ptr, t_stride, mask_id, seed_h,
    HAS_RES: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_BAN: tl.constexpr, HAS_PENALTY: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, HAS_BIAS: tl.constexpr, DO_SAMPLE: tl.constexpr, SAMPLE_ROWS: tl.constexpr,
    HAS_CUT: tl.constexpr, ENTROPY: tl.constexpr,
    FINAL: tl.constexpr, T_TENSOR: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    # A split covers `tiles` whole tiles (not specialised: every split count shares a compile). Its bounds are
    # then multiples of BLOCK_V, and of 16 where V is (as real vocabularies are), so each thread's loads are
    # 16-byte vectors; with bounds of unknown alignment every element would be a load of its own.
    chunk = tiles * BLOCK_V
    lo = split * chunk  # int32 vocabulary offsets (V < 2**31)
    hi = tl.minimum(lo + chunk, V)
    if HAS_SKIP:
        skip = tl.load(skip_ptr + row)
        hi = tl.where(skip != 0, lo, hi)
    if T_TENSOR:  # the temperature read on the device (one graph serves every value): 1 / t as the reference
        inv_t = (1.0 / tl.load(t_ptr + row * t_stride).to(tl.float64)).to(tl.float32)
    M32 = tl.full([], 0xFFFFFFFF, tl.int64)
    h = tl.full([], 0, tl.int64)
    if SAMPLE_ROWS:  # whether this row samples (else it picks greedily)
        sampled = tl.load(sample_ptr + row) != 0
    if DO_SAMPLE:
        h = seed_h.to(tl.int64)
        for j in tl.static_range(3):
            k = tl.load(keys_ptr + row * 3 + j)
            h = _mix32(h ^ (k & M32))
            h = _mix32(h ^ ((k >> 32) & M32))
    if HAS_CUT:  # the sampling filters: draw among the tokens inside the row's band low <= z <= high
        low = tl.load(cut_ptr + row * 2)
        high = tl.load(cut_ptr + row * 2 + 1)
    if HAS_PENALTY:  # the repetition penalty at the tokens this row has seen (its row of the seen table)
        seen_row = seen_ptr + tl.load(seen_rows_ptr + row) * V
        pen, inv_pen = penalty_factors(pen_ptr)
    if HAS_OFFSETS:  # an additive term a token (this row's row of the offsets: presence / frequency penalties)
        off_row = off_ptr + tl.load(seen_rows_ptr + row) * V
    if HAS_BAN:  # token v is excluded where banned_tokens[v] & this row's ban classes (uint8 bits) is nonzero: the
        ban_bits = tl.load(ban_rows_ptr + row)  # table is read below ban_hi (nowhere in a row with no class)
        ban_hi = tl.where(ban_bits != 0, hi, 0)
    # One cross-warp reduction per tile (the running max m); the rescaled sum and the argmax are
    # kept per lane (lane i sees offsets i, i + BLOCK_V, ... in increasing order, and only a strictly
    # larger score replaces, so each lane holds its earliest maximum) and reduced once at the end.
    m = tl.full([], float("-inf"), tl.float32)
    d_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
    t_vec = tl.zeros([BLOCK_V], dtype=tl.float32)  # with ENTROPY: sum of exp(x - m) * (x - m), rescaled as d_vec
    best_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
    z_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
    idx_vec = tl.full([BLOCK_V], -1, tl.int32)
    ar = tl.arange(0, BLOCK_V)
    logits_row = logits_ptr + row * stride_ln
    res_row = res_ptr + row * stride_rn
    if PREFETCH:
        x_next, r_next = _tile_loads(logits_row, res_row, lo + ar, hi, HAS_RES)
    for start in range(lo, hi, BLOCK_V):
        offs = start + ar
        msk = offs < hi
        if PREFETCH:  # issue the next tile's loads before this tile's work: two tiles in flight per thread
            x_raw, r_raw = x_next, r_next
            x_next, r_next = _tile_loads(logits_row, res_row, offs + BLOCK_V, hi, HAS_RES)
        else:
            x_raw, r_raw = _tile_loads(logits_row, res_row, offs, hi, HAS_RES)
        x = x_raw.to(tl.float32)
        if HAS_RES:
            acc = r_raw.to(tl.float32)
            res_r = res_row  # stepped by the stride: r * stride_rr would be an int32 product, past 2**31 at
            for _ in range(1, R):  # R * N * V of a real vocabulary
                res_r += stride_rr
                acc += tl.load(res_r + offs, mask=msk, other=0.0).to(tl.float32)
            x = x + scale * acc
        if HAS_BIAS:  # a bias by token id (the same in every row), before the penalty
            x = x + tl.load(bias_ptr + offs, mask=msk, other=0.0)
        if HAS_PENALTY:
            x = penalized(x, tl.load(seen_row + offs, mask=msk, other=0), pen, inv_pen)
        if HAS_OFFSETS:
            x = x + tl.load(off_row + offs, mask=msk, other=0.0)
        x = x * inv_t
        x = comparable(x)
        x = tl.where(msk & (offs != mask_id), x, float("-inf"))
        if HAS_BAN:
            x = tl.where((tl.load(ban_tok_ptr + offs, mask=offs < ban_hi, other=0) & ban_bits) != 0, float("-inf"), x)
        m_new = tl.maximum(m, tl.max(x, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        ex = tl.exp(x - m_safe)
        if ENTROPY:  # moving the sums to the new max adds (m - m_new) * d to t (nothing while m is -inf)
            t_vec = entropy_terms(t_vec, d_vec, m, m_safe, ex, x)
        d_vec = d_vec * tl.exp(m - m_safe) + ex
        m = m_new
        if DO_SAMPLE:
            e = _mix32(h ^ offs.to(tl.int64))
            e = _mix32((e + 0x9E3779B9) & M32)
            u = ((e >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            sc = x + (-tl.log(-tl.log(u)))
            if HAS_CUT:
                sc = tl.where((x >= low) & (x <= high), sc, float("-inf"))
            if SAMPLE_ROWS:  # a greedy row scores z itself: no noise, no cut
                sc = tl.where(sampled, sc, x)
            upd = sc > best_vec
            best_vec = tl.where(upd, sc, best_vec)
            z_vec = tl.where(upd, x, z_vec)
        else:
            upd = x > best_vec
            best_vec = tl.where(upd, x, best_vec)
        idx_vec = tl.where(upd, offs, idx_vec)
    d = tl.sum(d_vec, 0)
    t = tl.sum(t_vec, 0)
    best = tl.max(best_vec, 0)
    cand = (best_vec == best) & (idx_vec >= 0)
    best_i = tl.min(tl.where(cand, idx_vec, 0x7FFFFFFF), 0)
    found = (best > float("-inf")) & (best_i < 0x7FFFFFFF)
    best_idx = tl.where(found, best_i, -1).to(tl.int64)
    if DO_SAMPLE:
        best_z = tl.max(tl.where(idx_vec == best_i, z_vec, float("-inf")), 0)
    else:
        best_z = best
    best_z = tl.where(found, best_z, float("-inf"))
    best = tl.where(found, best, float("-inf"))
    split = split.to(tl.int64)
    if FINAL:
        valid = best_idx >= 0
        lse = tl.where(valid, m + tl.log(tl.maximum(d, 1e-38)), float("-inf"))
        prob = tl.where(valid, tl.exp(best_z - lse), 0.0)
        tl.store(tok_ptr + row, best_idx)
        tl.store(prob_ptr + row, prob)
        tl.store(lse_ptr + row, lse)
        if ENTROPY:
            tl.store(ent_ptr + row, softmax_entropy(d, t, valid))
    else:
        base = (row * S + split) * (5 if ENTROPY else 4)
        tl.store(part_ptr + base + 0, m)
        tl.store(part_ptr + base + 1, d)
        tl.store(part_ptr + base + 2, best)
        tl.store(part_ptr + base + 3, best_z)
        if ENTROPY:
            tl.store(part_ptr + base + 4, t)
        tl.store(part_idx_ptr + row * S + split, best_idx)


@triton.jit(do_not_specialize=["S"])
def _conf_merge_kernel(part_ptr, part_idx_ptr, tok_ptr, prob_ptr, lse_ptr, ent_ptr, S, ENTROPY: tl.constexpr,
                       BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_S)
    msk = offs < S
    base = (row * S + offs) * (5 if ENTROPY else 4)
    m_s = tl.load(part_ptr + base + 0, mask=msk, other=float("-inf"))
    d_s = tl.load(part_ptr + base + 1, mask=msk, other=0.0)
    b_s = tl.load(part_ptr + base + 2, mask=msk, other=float("-inf"))
    z_s = tl.load(part_ptr + base + 3, mask=msk, other=float("-inf"))
    i_s = tl.load(part_idx_ptr + row * S + offs, mask=msk, other=-1)
    m = tl.max(m_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    d = tl.sum(d_s * tl.exp(m_s - m_safe), 0)
    if ENTROPY:
        t_s = tl.load(part_ptr + base + 4, mask=msk, other=0.0)
        t = tl.sum(rescaled_terms(t_s, d_s, m_s, m_safe), 0)
    best = tl.max(b_s, 0)
    cand = (b_s == best) & (i_s >= 0)
    idx = tl.min(tl.where(cand, i_s, 0x7FFFFFFFFFFFFFFF), 0)
    valid = (best > float("-inf")) & (idx < 0x7FFFFFFFFFFFFFFF)
    idx = tl.where(valid, idx, -1)
    bz = tl.max(tl.where(cand & (i_s == idx), z_s, float("-inf")), 0)
    lse = tl.where(valid, m + tl.log(tl.maximum(d, 1e-38)), float("-inf"))
    prob = tl.where(valid, tl.exp(bz - lse), 0.0)
    tl.store(tok_ptr + row, idx)
    tl.store(prob_ptr + row, prob)
    tl.store(lse_ptr + row, lse)
    if ENTROPY:
        tl.store(ent_ptr + row, softmax_entropy(d, t, valid))


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _pick_config(N: int, V: int, device: torch.device, splits=None, block_v=None, num_warps=None):
    """Small table instead of autotune (the interpreter cannot autotune).

    CUDA: aim at ~4 programs per SM; rows with a long chunk stream 2048-wide tiles with 8 warps
    (8 elements a thread, one 16-byte load per tensor and tile: 60-80 registers with the per-lane state, 3-4
    programs per SM, by ``benchmarks/sm90_kernels.py``), short chunks (many splits, small N) use 1024-wide
    tiles with 4 warps.
    Untuned on hardware so far: ``benchmarks/bench_decode_kernels.py --sweep`` times the alternatives.
    Interpreter: wide tiles (numpy is faster on big vectors), S = 1 unless the caller forces ``splits``.
    """
    if interpreter_on() and device.type != "cuda":
        bv = block_v or min(4096, triton.next_power_of_2(max(V, 16)))
        s = splits or 1
        return max(1, min(s, triton.cdiv(V, bv))), bv, num_warps or 4
    target = 4 * num_sms(device)
    s = splits or (1 if N >= target // 2 else triton.cdiv(target, N))
    if block_v is None:
        per_prog = triton.cdiv(V, s)
        block_v = 2048 if per_prog >= 16384 else 1024
    s = max(1, min(s, triton.cdiv(V, block_v)))
    nw = num_warps or (8 if block_v >= 2048 else 4)
    return s, block_v, nw


TEMPERATURES = (1e-20, 1e20)  # the temperatures the kernels take (see check_temperature)


def check_temperature(temperature: float) -> None:
    """A temperature the kernels can use: in :data:`TEMPERATURES`, where ``logits / temperature`` stays a finite,
    nonzero fp32 number for logits up to 1e18 in magnitude (below 1e-20 the largest logits would all saturate to
    the largest float and tie; above 1e20 they would all round towards 0, and tie)."""
    low, high = TEMPERATURES
    if not low <= float(temperature) <= high:
        raise ValueError(f"temperature must be a finite float in [{low:g}, {high:g}], got {temperature}; "
                         "use do_sample=False for greedy decoding")


def _check_args(logits, residual, scale, temperature, skip_rows, mask_token_id, banned_tokens, ban_rows, do_sample,
                noise_keys, cuts: dict, penalty: dict):
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D tensor [N, V], got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits)}")
    if logits.dtype not in _FLOAT_DTYPES + (torch.float64,):
        raise TypeError(f"logits must be float32, float16 or bfloat16 (float64: reference only), got {logits.dtype}")
    N, V = logits.shape
    if V == 0:
        raise ValueError("logits has an empty vocabulary (V == 0)")
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.dim() not in (2, 3) or \
                tuple(residual.shape[-2:]) != (N, V):
            raise ValueError(f"residual must be None, [N, V] or [R, N, V] with N, V = {N}, {V}; got "
                             f"{tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual)}")
        if residual.dtype not in _FLOAT_DTYPES + (torch.float64,):
            raise TypeError(f"residual must be float32, float16 or bfloat16 (float64: reference only), got "
                            f"{residual.dtype}")
        if residual.device != logits.device:
            raise ValueError(f"residual is on {residual.device} but logits on {logits.device}; move them together")
        if residual.dim() == 3 and residual.shape[0] == 0:
            raise ValueError("residual has R == 0 slices; pass residual=None instead")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    check_skip_rows(skip_rows, N, logits.device, "logits")
    if mask_token_id is not None and (isinstance(mask_token_id, bool) or
                                      not isinstance(mask_token_id, numbers.Integral)):
        raise TypeError(f"mask_token_id must be an int or None, got {type(mask_token_id).__name__}")
    check_banned(banned_tokens, ban_rows, N, V, logits.device, "logits")
    check_penalty(**penalty, rows=N, vocab=V, device=logits.device, data="logits")
    check_sampling(N, logits.device, "logits", temperature, do_sample, noise_keys, **cuts)


def check_sampling(rows: int, device: torch.device, data: str, temperature, do_sample, noise_keys, top_k,
                   top_p, top_k_max=None, min_p=None, epsilon_cutoff=None, eta_cutoff=None, top_h=None,
                   typical_p=None) -> None:
    """The sampling settings of an op over ``rows`` rows of ``data`` on ``device``: a usable temperature (number, or
    device tensor: 0-d or one a row), do_sample a bool or a bool tensor [rows] on the device (the rows that sample),
    noise keys int64 [rows, 3] when sampling, top_k >= 1, top_p, top_h and
    typical_p in (0, 1] and min_p, epsilon_cutoff and eta_cutoff in [0, 1] (or None), and top_k_max an int >= 1 not
    below an int top_k (or None)."""
    if not check_device_scalar("temperature", temperature, device, rows=rows):
        check_temperature(temperature)
    if isinstance(do_sample, torch.Tensor):
        check_row_flags("do_sample", do_sample, rows, device, data, "or a bool for every row")
    if may_sample(do_sample):
        if not isinstance(noise_keys, torch.Tensor) or noise_keys.dtype != torch.int64 or \
                tuple(noise_keys.shape) != (rows, 3):
            raise ValueError(f"sampling (do_sample) needs noise_keys: int64 [{rows}, 3] = (sequence id, absolute "
                             "position, step) per row")
        if noise_keys.device != device:
            raise ValueError(f"noise_keys is on {noise_keys.device} but {data} on {device}")
    if top_k is not None and not check_device_scalar("top_k", top_k, device, rows=rows) and \
            (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    for name, value, per_row in (("top_p", top_p, rows), ("top_h", top_h, rows), ("typical_p", typical_p, rows)):
        if value is not None and not check_device_scalar(name, value, device, rows=per_row) and \
                (isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < float(value) <= 1.0):
            raise ValueError(f"{name} must be in (0, 1] or None, got {value!r}")
    for name, value in (("min_p", min_p), ("epsilon_cutoff", epsilon_cutoff), ("eta_cutoff", eta_cutoff)):
        if value is not None and not check_device_scalar(name, value, device, rows=rows) and \
                (isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0):
            raise ValueError(f"{name} must be in [0, 1] or None, got {value!r}")
    if top_k_max is not None:
        if isinstance(top_k_max, bool) or not isinstance(top_k_max, int) or top_k_max < 1:
            raise ValueError(f"top_k_max must be a positive int or None, got {top_k_max!r}")
        if isinstance(top_k, int) and top_k > top_k_max:
            raise ValueError(f"top_k={top_k} exceeds top_k_max={top_k_max}; raise top_k_max or leave it None")


CUT_CHUNK = 1 << 24  # logits the sampling cut of a sampled launch handles at once (about 64 MB in fp32)


def _cut_by_row_chunks(logits, residual, scale, temperature, mask_token_id, banned_tokens, ban_rows, penalty: dict,
                       **cuts) -> torch.Tensor:
    """[N, 2]: each row's cut by the filters ``cuts`` (keyword arguments of :func:`sampling_cut`), a chunk of rows at
    a time: top-p alone sorts whole rows, and all rows of a 152k vocabulary at once would take gigabytes of [N, V]
    temporaries."""
    N, V = logits.shape
    step = max(1, CUT_CHUNK // max(1, V))
    bands = []
    for i in range(0, N, step):
        res = None if residual is None else residual[..., i:i + step, :]
        z = effective_logits(logits[i:i + step], res, scale=scale, temperature=row_slice(temperature, i, step),
                             mask_token_id=mask_token_id, banned_tokens=banned_tokens,
                             ban_rows=None if ban_rows is None else ban_rows[i:i + step],
                             **_penalty_rows(penalty, slice(i, i + step)))
        bands.append(sampling_cut(z, **{name: row_slice(value, i, step) for name, value in cuts.items()}))
    return torch.cat(bands) if len(bands) > 1 else bands[0]


def _penalty_rows(penalty: dict, rows: slice) -> dict:
    """The penalties' arguments (:func:`check_penalty`) of a slice of the rows."""
    if penalty["seen_rows"] is not None:
        return dict(penalty, seen_rows=penalty["seen_rows"][rows])
    return {name: value[rows] if name in ("seen_tokens", "logit_offsets") and value is not None else value
            for name, value in penalty.items()}


def confidence_triton(logits, residual=None, *, scale=1.0, temperature=1.0, skip_rows=None, mask_token_id=None,
                      banned_tokens=None, ban_rows=None, repetition_penalty=None, seen_tokens=None, seen_rows=None,
                      logit_offsets=None, logit_bias=None, do_sample=False, seed=0, noise_keys=None, top_k=None,
                      top_p=None, top_k_max=None, min_p=None, epsilon_cutoff=None, eta_cutoff=None, top_h=None,
                      typical_p=None,
                      entropy=False, splits=None,
                      block_v=None, num_warps=None, prefetch=True, out=None):
    """Triton launcher (always the kernel, also on CPU under TRITON_INTERPRET=1).

    ``splits`` / ``block_v`` / ``num_warps`` override the config table (tests, benchmarks); ``prefetch=False``
    loads each tile when it is processed instead of one tile ahead (tests, the benchmark's sweep);
    ``out = (tokens, probs, lse)`` (with ``entropy``, ``(tokens, probs, lse, entropy)``) preallocated outputs (tests
    poison them).
    """
    cuts = dict(top_k=top_k, top_p=top_p, top_k_max=top_k_max, min_p=min_p, epsilon_cutoff=epsilon_cutoff,
                eta_cutoff=eta_cutoff, top_h=top_h, typical_p=typical_p)
    penalty = penalty_args(repetition_penalty, seen_tokens, seen_rows, logit_offsets, logit_bias)
    _check_args(logits, residual, scale, temperature, skip_rows, mask_token_id, banned_tokens, ban_rows, do_sample,
                noise_keys, cuts, penalty)
    check_kernel_device(logits.device, "confidence")
    N, V = logits.shape
    dev = logits.device
    if out is None:
        out = (torch.empty(N, dtype=torch.int64, device=dev),
               *(torch.empty(N, dtype=torch.float32, device=dev) for _ in range(3 if entropy else 2)))
    tok, prob, lse = out[:3]
    ent = out[3] if entropy else prob  # a dummy pointer without entropy
    if N == 0:
        return out
    sample, sample_rows, per_row = sample_operands(do_sample, tok)
    cut = None
    if sample and cuts_anything(cuts):
        cut = _cut_by_row_chunks(logits, residual, scale, temperature, mask_token_id, banned_tokens, ban_rows, penalty,
                                 **cuts)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    res = residual
    if res is not None:
        if res.dim() == 2:
            res = res.unsqueeze(0)
        if res.stride(-1) != 1:
            res = res.contiguous()
    S, BLOCK_V, nw = _pick_config(N, V, dev, splits, block_v, num_warps)
    chunk = triton.cdiv(triton.cdiv(V, S), BLOCK_V) * BLOCK_V
    S = triton.cdiv(V, chunk)
    dummy = tok
    skip = skip_rows.contiguous().view(torch.uint8) if skip_rows is not None else dummy  # read at skip + row
    keys = noise_keys.contiguous() if sample else dummy
    ban_tok, ban_flags = ban_operands(banned_tokens, ban_rows, N, dummy)
    seen, offsets, bias, seen_at, pen = penalty_operands(N, dummy, **penalty)
    seed_h = seed_hash(seed) if sample else 0
    mask_id = -1 if mask_token_id is None else int(mask_token_id)
    inv_t, t, t_stride, t_tensor = temperature_operands(temperature, dummy)
    if S > 1:
        part = torch.empty(N * S * (5 if entropy else 4), dtype=torch.float32, device=dev)
        part_idx = torch.empty(N * S, dtype=torch.int64, device=dev)
    else:
        part, part_idx = prob, tok
    _conf_partial_kernel[(N, S)](
        logits, logits.stride(0),
        res if res is not None else logits, res.stride(0) if res is not None else 0,
        res.stride(1) if res is not None else 0, res.shape[0] if res is not None else 0,
        skip, keys, cut if cut is not None else prob, ban_tok, ban_flags, sample_rows, seen, offsets, bias, seen_at,
        pen,
        part, part_idx, tok, prob, lse, ent,
        V, chunk // BLOCK_V, S, float(scale), inv_t, t, t_stride, mask_id, seed_h,
        HAS_RES=res is not None, HAS_SKIP=skip_rows is not None, HAS_BAN=banned_tokens is not None,
        HAS_PENALTY=repetition_penalty is not None, HAS_OFFSETS=logit_offsets is not None,
        HAS_BIAS=logit_bias is not None, DO_SAMPLE=sample,
        SAMPLE_ROWS=per_row,
        HAS_CUT=cut is not None, ENTROPY=bool(entropy),
        FINAL=S == 1,
        T_TENSOR=t_tensor, PREFETCH=bool(prefetch), BLOCK_V=BLOCK_V, num_warps=nw,
        enable_fp_fusion=False,  # no FMA: same rounding as the reference
    )
    if S > 1:
        _conf_merge_kernel[(N,)](part, part_idx, tok, prob, lse, ent, S, ENTROPY=bool(entropy),
                                 BLOCK_S=max(16, triton.next_power_of_2(S)), num_warps=1)
    return out


def confidence(logits, residual=None, *, scale=1.0, temperature=1.0, skip_rows=None, mask_token_id=None,
               banned_tokens=None, ban_rows=None, repetition_penalty=None, seen_tokens=None, seen_rows=None,
               logit_offsets=None, logit_bias=None, do_sample=False, seed=0, noise_keys=None, top_k=None, top_p=None,
               top_k_max=None, min_p=None, epsilon_cutoff=None, eta_cutoff=None, top_h=None, typical_p=None,
               entropy=False):
    """Per-row token, full-softmax probability and logsumexp of the effective logits (and its entropy).

    logits: [N, V] bf16/fp16/fp32 (fp64: always the reference); residual: None, [N, V] or [R, N, V] (summed over R);
    skip_rows: bool [N] (True -> token -1, prob 0, lse -inf); banned_tokens: bool or uint8 [V] and ban_rows: bool or
    uint8 [N] (token v excluded like the mask column in row n when ``banned_tokens[v] & ban_rows[n]`` is nonzero: each
    bit a class of ban; ban_rows None: every class in every row); ``repetition_penalty`` (a number > 0 or a 0-d tensor)
    with seen_tokens: bool or uint8 [C, V] and seen_rows: int64 [N] in [0, C) (None: C = N, row n reads row n):
    transformers' repetition penalty on the logits (plus residual) of the tokens row n has seen, those nonzero in
    ``seen_tokens[seen_rows[n]]``, before the temperature (:func:`.reference.confidence.penalized`); logit_offsets:
    float32 [C, V] read at the same rows (None: C = N), an additive term (presence / frequency penalties) after the
    penalty, before the temperature; logit_bias: float32 [V], a bias by token id every row adds before the penalty
    (:func:`.reference.confidence.penalties_applied`); noise_keys: int64
    [N, 3] = (sequence id, absolute position, step), required when ``do_sample``: True, or a bool tensor [N] on the
    logits' device, the rows that sample (the others pick greedily in the same launch: no noise, no filter).
    ``temperature``, ``top_k``, ``top_p``, ``min_p`` (sampling among the tokens at least ``min_p`` times as likely as
    the most likely), ``typical_p`` (typical sampling: the tokens whose surprise is nearest the entropy, up to that
    mass), ``epsilon_cutoff`` and ``eta_cutoff`` (epsilon and eta sampling, as transformers' warpers:
    :func:`.reference.confidence.sampling_cut`) and ``top_h`` (transformers' top-h: among the 100 most likely, those
    whose entropy terms take at most top_h of the entropy) are numbers or 0-d tensors on the logits' device (read there,
    so a captured CUDA graph serves every value; the caller checks such a tensor's value: > 0, >= 1, in (0, 1], in
    [0, 1]), each also one a row ([N] on that device: rows of different temperatures and filters in one launch; a
    row's top_k of V or more, or top_h above 1, cuts nothing); ``top_k_max`` (an int) is the largest value a
    ``top_k`` tensor holds: the top-k cut then selects that many of each row's largest logits instead of sorting the
    row (the caller guarantees the bound; ignored without ``top_k``).
    Returns ``(tokens int64 [N], probs float32 [N], lse float32 [N])``; token -1 (prob 0, lse -inf)
    for a row with no finite candidate. With ``entropy`` also the entropy (nats) of each row's full softmax, float32
    [N] (+inf where the token is -1), from the same pass (one more running sum).
    Dispatches with :func:`mrp_triton.backend.select_backend`.
    """
    cuts = dict(top_k=top_k, top_p=top_p, top_k_max=top_k_max, min_p=min_p, epsilon_cutoff=epsilon_cutoff,
                eta_cutoff=eta_cutoff, top_h=top_h, typical_p=typical_p)
    penalty = penalty_args(repetition_penalty, seen_tokens, seen_rows, logit_offsets, logit_bias)
    kw = dict(scale=scale, temperature=temperature, skip_rows=skip_rows, mask_token_id=mask_token_id,
              banned_tokens=banned_tokens, ban_rows=ban_rows, do_sample=do_sample, seed=seed, noise_keys=noise_keys,
              entropy=entropy, **cuts, **penalty)
    # float64 (exact-comparison tests) is computed by the reference on any device: the kernel works in fp32.
    if not wide(logits) and select_backend(logits.device, logits, residual) == "triton":
        return confidence_triton(logits, residual, **kw)
    _check_args(logits, residual, scale, temperature, skip_rows, mask_token_id, banned_tokens, ban_rows, do_sample,
                noise_keys, cuts, penalty)
    return confidence_reference(logits, residual, **kw)
