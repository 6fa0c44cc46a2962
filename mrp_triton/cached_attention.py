"""Attention of a decoding forward: T new positions over each row's committed KV-cache prefix and themselves.

Cost model (B rows, Hq query / Hkv key-value heads, head dim D, row b with L_b committed slots, b bytes
per element): the committed keys and values are read once per key/value head, B*Hkv*mean(L)*2*D*b bytes
(the query heads of a group share one program), plus q, the new keys/values and the output (small: T is one
block or a few candidate copies of it), plus, when the slots are split, B*Hq*T*S*(D+2)*4 bytes of partials
written and read once. The eager path (the reference) first concatenates the cache prefix with the new
keys/values, a copy of the whole prefix in every layer of every forward, and attends over the widest row's
prefix for every row; this kernel reads the cache in place up to each row's own length, which also lets
CUDA-graph replays read the full-width cache views without paying for their unused slots.

Kernel: grid (cdiv(T, BLOCK_M), B * Hkv, S). A program holds BLOCK_M queries of each of the GROUP query heads
of one key/value head (so their shared keys and values are loaded once), streams its split of the row's
committed slots in BLOCK_N tiles (the bounds derive from L_b, read on the device: no host value), and split 0
also the new keys under the block-causal and segment mask, with an online softmax in fp32. Every query sees
at least its own key, so split 0 never has an empty softmax row. With S = 1 it writes the output; with S > 1
(flash-decoding: a batch of one has only Hkv programs per query tile, a few percent of the GPU's SMs, each
streaming the whole prefix) each split writes its unnormalised (acc, m, l) and ``_merge_splits_kernel``
combines them. S is a host choice from the cache's width (:func:`_splits`), so a captured graph keeps it; it is
a runtime argument (not specialised): one compile serves every S > 1.

Ragged forwards (``places``, RAGGED): q, k, v and the output hold only the L computed positions of the [B, T]
grid, one row of them; each program reads its queries' places (and each key tile's) from the map, leaves out
positions with none (neither queries nor keys) and returns at once when its query tile has none; the merge
writes by place. The decoder uses it for finished blocks riding in front of the rows' next forward, computed
only for the rows that finished one.

dtypes: bf16/fp16 dots accumulate in fp32 (the probabilities are cast to the value dtype for the second
dot, as flash attention does); fp32 uses IEEE products (no TF32). Under TRITON_INTERPRET=1, tl.dot on
bf16 is broken, so tiles are cast to fp32 there. float64 always runs the reference.
"""

from __future__ import annotations

import functools
import numbers

import torch
import triton
import triton.language as tl

from ._checks import check_ids_on_cpu, check_kernel_device, wide
from .backend import before_ampere, fit_stages, interpreter_on, num_sms, select_backend, shared_memory_limit
from .reference.cached_attention import cached_attention as cached_attention_reference

_BLOCK_M = 16
_BLOCK_N = 64
_NUM_WARPS = 4
_MIN_SPLIT_SLOTS = 128  # committed slots a split at least covers (two tiles): fewer would cost more to merge
_MAX_SPLITS = 16


@triton.jit
def _attend(q, kt, vt, valid, m_i, l_i, acc, scale, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax update of queries q [M, D] with keys kt / values vt [N, D] where ``valid`` [M, N]."""
    if DOT_FP32:
        q = q.to(tl.float32)
        kt = kt.to(tl.float32)
        vt = vt.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(kt), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kt))
    s = tl.where(valid, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p, vt, input_precision="ieee")
    else:
        pv = tl.dot(p.to(vt.dtype), vt)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _attend_new(q, k_ptr, v_ptr, pos_ptr, seg_ptr, place_ptr, sk_t, sv_t, sp_t, spl_t, t, row_mask, dims, dim_mask,
                T, block_size, m_i, l_i, acc, scale, HAS_SEG: tl.constexpr, RAGGED: tl.constexpr,
                DOT_FP32: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online-softmax updates of queries q (positions ``t``) with the T new keys/values of their row and
    key/value head (k_ptr, v_ptr, pos_ptr at them; RAGGED: key t lies at k_ptr's place place_ptr[t], none where
    it is -1): block-causal, within a segment or from a shared (negative) one. A tile of keys whose blocks all
    lie after every query's is skipped (half the tiles of a long prefill): its keys would add exp(-inf) = 0 to
    every sum, so the result is the same bit for bit."""
    q_block = tl.load(pos_ptr + t * sp_t, mask=row_mask, other=0) // block_size
    last_block = tl.max(tl.where(row_mask, q_block, -1), axis=0)
    if HAS_SEG:
        q_seg = tl.load(seg_ptr + t, mask=row_mask, other=-1)
    for start in range(0, T, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < T
        at = cols
        if RAGGED:
            at = tl.load(place_ptr + cols * spl_t, mask=col_mask, other=-1)  # int64: place * stride may pass 2**31
            col_mask = col_mask & (at >= 0)
        k_block = tl.load(pos_ptr + cols * sp_t, mask=col_mask, other=0) // block_size
        if tl.min(tl.where(col_mask, k_block, last_block + 1), axis=0) <= last_block:
            valid = col_mask[None, :] & (k_block[None, :] <= q_block[:, None])
            if HAS_SEG:
                k_seg = tl.load(seg_ptr + cols, mask=col_mask, other=0)
                valid = valid & ((k_seg[None, :] == q_seg[:, None]) | (k_seg[None, :] < 0))
            tile_mask = col_mask[:, None] & dim_mask[None, :]
            kt = tl.load(k_ptr + at[:, None] * sk_t + dims[None, :], mask=tile_mask, other=0.0)
            vt = tl.load(v_ptr + at[:, None] * sv_t + dims[None, :], mask=tile_mask, other=0.0)
            m_i, l_i, acc = _attend(q, kt, vt, valid, m_i, l_i, acc, scale, DOT_FP32, IEEE)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["splits"])
def _cached_attention_kernel(q_ptr, k_ptr, v_ptr, ck_ptr, cv_ptr, len_ptr, pos_ptr, seg_ptr, place_ptr, o_ptr,
                             part_ptr, ml_ptr, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sc_b, sc_h, sc_t,
                             sp_b, sp_t, spl_b, spl_t, so_b, so_h, so_t, T, Hq, Hkv, HEAD_DIM, block_size, scale,
                             splits, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, ONE_SPLIT: tl.constexpr,
                             HAS_SEG: tl.constexpr, RAGGED: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bh // Hkv).to(tl.int64)
    kvh = (pid_bh % Hkv).to(tl.int64)
    # rows: BLOCK_M positions of each of the GROUP query heads that share this key/value head
    r = tl.arange(0, GROUP_P2 * BLOCK_M)
    h = kvh * GROUP + r // BLOCK_M
    t = pid_m * BLOCK_M + r % BLOCK_M
    row_mask = (r // BLOCK_M < GROUP) & (t < T)
    at = t  # where query / output t lies in q and o (RAGGED: its place, -1 for none)
    if RAGGED:
        at = tl.load(place_ptr + b * spl_b + t * spl_t, mask=row_mask, other=-1)  # int64: place * stride may pass 2**31
        row_mask = row_mask & (at >= 0)
        if tl.max(row_mask.to(tl.int32), axis=0) == 0:  # no query here (a row whose finished block is not computed)
            return
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + at[:, None] * sq_t + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    m_i = tl.full([GROUP_P2 * BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2 * BLOCK_M], tl.float32)
    acc = tl.zeros([GROUP_P2 * BLOCK_M, BLOCK_D], tl.float32)

    # this split's share of the row's committed slots (whole tiles; all visible)
    length = tl.load(len_ptr + b)
    span = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
    lo = pid_s * span
    hi = tl.minimum(lo + span, length)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < hi
        tile = b * sc_b + kvh * sc_h + cols[:, None] * sc_t + dims[None, :]
        tile_mask = col_mask[:, None] & dim_mask[None, :]
        kt = tl.load(ck_ptr + tile, mask=tile_mask, other=0.0)
        vt = tl.load(cv_ptr + tile, mask=tile_mask, other=0.0)
        m_i, l_i, acc = _attend(q, kt, vt, col_mask[None, :], m_i, l_i, acc, scale, DOT_FP32, IEEE)

    if pid_s == 0:  # the new positions
        m_i, l_i, acc = _attend_new(q, k_ptr + b * sk_b + kvh * sk_h, v_ptr + b * sv_b + kvh * sv_h,
                                    pos_ptr + b * sp_b, seg_ptr, place_ptr + b * spl_b, sk_t, sv_t, sp_t, spl_t, t,
                                    row_mask, dims, dim_mask, T, block_size, m_i, l_i, acc, scale, HAS_SEG, RAGGED,
                                    DOT_FP32, IEEE, BLOCK_N)

    if ONE_SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i = 0 only on the tile's padding rows
        tl.store(o_ptr + b * so_b + h[:, None] * so_h + at[:, None] * so_t + dims[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])
    else:  # unnormalised partials of (b, h, t, split): acc [BLOCK_D] and (m, l), merged by _merge_splits_kernel
        slot = ((b * Hq + h) * T + t) * splits + pid_s
        tl.store(part_ptr + slot[:, None] * BLOCK_D + dims[None, :], acc, mask=row_mask[:, None])
        tl.store(ml_ptr + slot * 2, m_i, mask=row_mask)
        tl.store(ml_ptr + slot * 2 + 1, l_i, mask=row_mask)


@triton.jit(do_not_specialize=["splits"])
def _merge_splits_kernel(part_ptr, ml_ptr, place_ptr, o_ptr, spl_b, spl_t, so_b, so_h, so_t, T, Hq, HEAD_DIM, splits,
                         RAGGED: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (b, h, t): out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s (RAGGED: written at
    t's place; nothing where it is -1, whose partials were never written)."""
    i = tl.program_id(0).to(tl.int64)
    b, h, t = i // (Hq * T), (i // T) % Hq, i % T
    at = t
    if RAGGED:
        at = tl.load(place_ptr + b * spl_b + t * spl_t)
        if at < 0:
            return
    pieces = tl.arange(0, SPLITS_P2)
    dims = tl.arange(0, BLOCK_D)
    live = pieces < splits
    m = tl.load(ml_ptr + (i * splits + pieces) * 2, mask=live, other=float("-inf"))
    l = tl.load(ml_ptr + (i * splits + pieces) * 2 + 1, mask=live, other=0.0)
    acc = tl.load(part_ptr + (i * splits + pieces)[:, None] * BLOCK_D + dims[None, :], mask=live[:, None],
                  other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))  # split 0 saw the new keys: M is finite
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(o_ptr + b * so_b + h * so_h + at * so_t + dims, out.to(o_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def _check_args(q, k, v, cache_k, cache_v, lengths, positions, block_size, segments, places, rows=None) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if q.dim() != 4 or k.dim() != 4 or cache_k.dim() != 4:
        raise ValueError("q must be [B, Hq, T, D], k and v [B, Hkv, T, D], cache_k and cache_v [B, Hkv, W, D]")
    Bq, Hq, Tq, D = q.shape
    Hkv = k.shape[1]
    if k.shape != (Bq, Hkv, Tq, D) or v.shape != k.shape:
        raise ValueError(f"k and v must be [B, Hkv, T, D] = [{Bq}, Hkv, {Tq}, {D}], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    B, T = Bq, Tq
    if places is not None:
        if Bq != 1 or places.dim() != 2 or places.dtype != torch.int64 or places.device != q.device:
            raise ValueError(f"with places (a ragged forward) q must be [1, Hq, L, D] and places an int64 [B, T] "
                             f"tensor on q's device, got q {tuple(q.shape)} and places {tuple(places.shape)} "
                             f"{places.dtype} on {places.device}")
        B, T = places.shape
    if rows is not None and (places is None or rows.dim() != 1 or rows.dtype != torch.int64 or
                             rows.device != q.device):
        raise ValueError("rows (the grid rows holding a ragged forward's computed places) must be an int64 tensor [R] "
                         "on q's device, given with places")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if cache_k.shape[:2] != (B, Hkv) or cache_k.shape[3] != D or cache_v.shape != cache_k.shape:
        raise ValueError(f"cache_k and cache_v must be [{B}, {Hkv}, W, {D}], got {tuple(cache_k.shape)} and "
                         f"{tuple(cache_v.shape)}")
    if len({t.dtype for t in (q, k, v, cache_k, cache_v)}) != 1 or not q.dtype.is_floating_point:
        raise TypeError("q, k, v, cache_k and cache_v must share one floating dtype")
    if lengths.shape != (B,) or lengths.dtype != torch.int64:
        raise ValueError(f"lengths must be an int64 tensor [{B}]")
    if positions.shape != (B, T) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be an int64 tensor [{B}, {T}]")
    if segments is not None and segments.shape != (T,):
        raise ValueError(f"segments must be a tensor [{T}] (or None)")
    for name, t in (("k", k), ("v", v), ("cache_k", cache_k), ("cache_v", cache_v), ("lengths", lengths),
                    ("positions", positions)) + ((("segments", segments),) if segments is not None else ()):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q on {q.device}; move them together")


def cached_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                            cache_v: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor, block_size: int,
                            segments: torch.Tensor | None = None, places: torch.Tensor | None = None,
                            rows: torch.Tensor | None = None, splits: int | None = None,
                            shared_limit: int | None = None, async_copy: bool | None = None) -> torch.Tensor:
    """Triton launcher of :func:`cached_attention` (same arguments and result; ``rows`` is checked, and left unused:
    a program whose query tile holds no computed place returns at once). ``splits``: pieces each row's committed
    slots are cut into (default: :func:`_splits`; tests and benchmarks set it); ``shared_limit``: the shared memory
    a program may use, which the tiles are fitted to, and ``async_copy``: whether the GPU pipelines loads through it
    (defaults: the GPU's, :func:`~mrp_triton.backend.shared_memory_limit` and :func:`~mrp_triton.backend
    .before_ampere`; tests set them)."""
    _check_args(q, k, v, cache_k, cache_v, lengths, positions, block_size, segments, places, rows)
    check_ids_on_cpu("lengths", lengths, 0, cache_k.shape[2] + 1)  # (at most W: the reference clamps them there)
    check_kernel_device(q.device, "cached_attention")
    q, k, v, cache_k, cache_v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, cache_k, cache_v))
    if cache_v.stride() != cache_k.stride():
        cache_v = cache_v.contiguous()
        cache_k = cache_k.contiguous()
    _, Hq, L, D = q.shape
    Hkv = k.shape[1]
    B, T = positions.shape
    # [B, Hq, T, D] laid out as [B, T, Hq, D]: the output projection's "b t (h d)" view of it is free
    out = torch.empty((q.shape[0], L, Hq, D), dtype=q.dtype, device=q.device).transpose(1, 2)
    if out.numel() == 0:
        return out
    # ragged: q, k, v and out hold one row of L places, which every (b, t) of the grid finds in places
    row_strides = [0 if places is not None else t.stride(0) for t in (q, k, v, out)]
    group, block_d = Hq // Hkv, max(16, triton.next_power_of_2(D))
    block_m, block_n, stages = _tiles(q.dtype, block_d, triton.next_power_of_2(group),
                                      shared_limit if shared_limit is not None else shared_memory_limit(q.device),
                                      async_copy if async_copy is not None else before_ampere(q.device) is None)
    if splits is None:
        splits = _splits(B * Hkv * triton.cdiv(T, block_m), cache_k.shape[2], q.device)
    if not isinstance(splits, int) or isinstance(splits, bool) or splits < 1:
        raise ValueError(f"splits must be a positive int or None, got {splits!r}")
    seg = segments.to(torch.int64).contiguous() if segments is not None else lengths
    place = places if places is not None else lengths  # a dummy pointer when not ragged
    place_strides = places.stride() if places is not None else (0, 0)
    part = ml = out  # dummy pointers with one split
    if splits > 1:
        part = torch.empty((B * Hq * T * splits, block_d), dtype=torch.float32, device=q.device)
        ml = torch.empty((B * Hq * T * splits, 2), dtype=torch.float32, device=q.device)
    interp = interpreter_on()
    sq_b, sk_b, sv_b, so_b = row_strides
    _cached_attention_kernel[(triton.cdiv(T, block_m), B * Hkv, splits)](
        q, k, v, cache_k, cache_v, lengths.contiguous(), positions, seg, place, out, part, ml,
        sq_b, q.stride(1), q.stride(2), sk_b, k.stride(1), k.stride(2),
        sv_b, v.stride(1), v.stride(2), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        positions.stride(0), positions.stride(1), *place_strides, so_b, out.stride(1), out.stride(2),
        T, Hq, Hkv, D, block_size, D ** -0.5, splits,
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), ONE_SPLIT=splits == 1, HAS_SEG=segments is not None,
        RAGGED=places is not None, DOT_FP32=interp and q.dtype == torch.bfloat16, IEEE=q.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=_NUM_WARPS, num_stages=stages)
    if splits > 1:
        _merge_splits_kernel[(B * Hq * T,)](part, ml, place, out, *place_strides, so_b, out.stride(1), out.stride(2),
                                            T, Hq, D, splits, RAGGED=places is not None,
                                            SPLITS_P2=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=1)
    return out


@functools.cache  # called at every launch (each layer of each step), with a few distinct arguments
def _tiles(dtype: torch.dtype, block_d: int, group_p2: int, shared_limit: int | None,
           async_copy: bool = True) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_stages): _BLOCK_M positions of each query head of a group, and the key/value loop's
    _BLOCK_N slots a tile in Triton's default 3 stages, or, on a GPU whose shared memory a program
    (``shared_limit``) holds less, fewer stages, then narrower tiles (at least two stages while a tile of 16 slots
    allows it). With ``async_copy`` a program keeps in shared memory a stage's key and value tiles, its queries and
    their fp32 scores (group_p2 x BLOCK_M rows); without (before sm_80, :func:`~mrp_triton.backend.before_ampere`)
    what Triton converts there for the dots: the fp32 accumulator (rows x block_d) and, a key/value slot, the wider
    of a scores column (rows) and a key row (in fp32 for fp32 keys), which fewer query positions a program (a
    narrower BLOCK_M, at least 16 rows for the dots) bring under the limit (compiled for sm_75:
    ``tests/test_decode_kernels_compile.py``)."""
    elem = dtype.itemsize
    if not async_copy:
        return _unstaged_tiles(elem, block_d, group_p2, shared_limit)
    fallback = None  # the widest tile that fits one stage
    for block_n in (_BLOCK_N, _BLOCK_N // 2, _BLOCK_N // 4):
        stages = fit_stages(3, 2 * block_n * block_d * elem, group_p2 * _BLOCK_M * (block_d * elem + block_n * 4),
                            shared_limit)
        if stages is not None and stages >= 2:
            return _BLOCK_M, block_n, stages
        if stages is not None and fallback is None:
            fallback = (_BLOCK_M, block_n, stages)
    return fallback or (_BLOCK_M, _BLOCK_N // 4, 1)


def _unstaged_tiles(elem: int, block_d: int, group_p2: int, shared_limit: int | None) -> tuple[int, int, int]:
    """:func:`_tiles` on a GPU without asynchronous copies: the widest query tile, then key/value tile, whose dot
    conversions fit ``shared_limit`` with an 8 KiB margin for Triton's padding (stages keep nothing there)."""
    block_m = _BLOCK_M
    while True:
        rows = group_p2 * block_m
        narrowest = rows <= 16 or block_m == 1  # the dots need 16 rows: else the smallest tiles, over the limit
        for block_n in (_BLOCK_N, _BLOCK_N // 2, _BLOCK_N // 4):
            need = rows * block_d * 4 + block_n * max(4 * rows, (8 if elem == 4 else 4) * block_d) + 8192
            if shared_limit is None or need <= shared_limit or narrowest and block_n == _BLOCK_N // 4:
                return block_m, block_n, 2
        block_m //= 2


def _splits(programs: int, width: int, device: torch.device) -> int:
    """How many pieces each row's committed slots are cut into: enough for about two programs per SM when the
    rows, heads and query tiles alone give fewer, each piece at least _MIN_SPLIT_SLOTS of the cache's width
    (the width, not the rows' lengths: a host value, fixed for a captured graph). The interpreter keeps one."""
    if device.type != "cuda":
        return 1
    wanted = triton.cdiv(2 * num_sms(device), programs)
    return max(1, min(wanted, width // _MIN_SPLIT_SLOTS, _MAX_SPLITS))


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                     cache_v: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor, block_size: int,
                     segments: torch.Tensor | None = None, places: torch.Tensor | None = None,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention (scale 1/sqrt(D), grouped-query heads) of T new positions over each row's
    committed cache prefix and themselves.

    q: [B, Hq, T, D]; k, v: [B, Hkv, T, D] (the new positions); cache_k, cache_v: [B, Hkv, W, D] of which
    row b's first ``lengths[b]`` slots are committed (the rest is never read); lengths: int64 [B];
    positions: int64 [B, T] (absolute, past the row's prefix); segments: int [T] or None. A new position
    sees every committed slot of its row and the new keys of its own or an earlier block
    (position // block_size) in its own segment or in a negative (shared) one, which is how a finished
    block written in the same forward as K+1 candidate copies reaches every copy. Returns [B, Hq, T, D] in
    q's dtype (the Triton kernel's laid out as [B, T, Hq, D], so that its "b t (h d)" view costs no copy).

    A ragged forward computes only some positions of the [B, T] grid of ``positions``: ``places`` int64 [B, T]
    gives each one's index in q, k, v ([1, Hq or Hkv, L, D]), -1 for a position not computed (neither a query
    nor a key); the result is [1, Hq, L, D]. ``rows`` (ragged; int64 [R] or None): grid rows that hold every
    computed place, which the reference attends alone (the kernel skips empty query tiles anyway)."""
    args = (q, k, v, cache_k, cache_v, lengths, positions, block_size, segments, places, rows)
    if not wide(q) and select_backend(q.device, q, k, v, cache_k, cache_v) == "triton":
        return cached_attention_triton(*args)
    _check_args(*args)
    return cached_attention_reference(*args)
