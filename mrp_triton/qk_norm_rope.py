"""Per-head RMSNorm of q and k over head_dim, then rotate-half RoPE (Qwen3 attention), fused.

Cost model per token (Hq q heads, Hkv k heads, head_dim D, b bytes per element):
read q and k ((Hq + Hkv)*D*b), cos and sin (2*D*b_cos), the two weights (L2-resident);
write q and k ((Hq + Hkv)*D*b). Eager torch moves each head ~8 times (norm: read, temp,
write; rope: two products, a cat and a sum) in ~12 launches; this is one launch.

One program per (batch, time) token holds all its q heads as two [BLOCK_HQ, BLOCK_HALF] tiles (the
first and second halves of each head) and all its k heads as two [BLOCK_HK, BLOCK_HALF] tiles. q and
k are read in place wherever each token's heads lie next to each other (any batch and time strides):
the q and k column slices of one fused q/k/v projection output need no copy. Rotate-half pairs
element d of one half with element d of the other, so the halves combine elementwise: no shuffle,
every load contiguous. cos/sin may be broadcast over the batch (stride 0). Computed in fp32; the
normalised heads are rounded to the output dtype before RoPE, and cos/sin are rounded to it, as the
reference does.

Backward (when autograd differentiates q, k or the weights): RoPE's transpose (the rotation by -angle) and the
norm's gradient in one kernel; per token read q, k, their output gradients and cos/sin, write dq and dk. A few
programs per SM each loop over a run of tokens and keep their share of the two weights' gradients in fp32
registers. The RoPE tables get no gradient (tables that require one run the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_float, check_kernel_device, wide
from .backend import differentiated, select_backend
from .rms_norm import backward_grid
from .reference.qk_norm_rope import qk_norm_rope as qk_norm_rope_reference


@triton.jit
def _heads_and_rstd(x_ptr, cols, col_mask, n_heads, D, eps, BLOCK_H: tl.constexpr):
    """One token's [n_heads, D] rows at x_ptr (heads D apart) as their two halves in fp32, with each head's rstd;
    also the offsets and mask of the first halves, for the stores."""
    half = D // 2
    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < n_heads) & col_mask[None, :]
    first = heads[:, None] * D + cols[None, :]
    x1 = tl.load(x_ptr + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + first + half, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
    return x1, x2, rstd, first, mask


@triton.jit
def _rope_halves(cos_row, sin_row, cols, col_mask, half, dt):
    """The token's cos and sin rows, each as its two halves, rounded to ``dt`` (the reference casts the tables to
    each output's dtype before the products), in fp32: (cos1, sin1, cos2, sin2)."""
    cos1 = tl.load(cos_row + cols, mask=col_mask, other=0.0).to(dt).to(tl.float32)
    sin1 = tl.load(sin_row + cols, mask=col_mask, other=0.0).to(dt).to(tl.float32)
    cos2 = tl.load(cos_row + half + cols, mask=col_mask, other=0.0).to(dt).to(tl.float32)
    sin2 = tl.load(sin_row + half + cols, mask=col_mask, other=0.0).to(dt).to(tl.float32)
    return cos1, sin1, cos2, sin2


@triton.jit
def _norm_rope_heads(x_ptr, o_ptr, w_ptr, cos_row, sin_row, cols, col_mask, n_heads, D, eps, BLOCK_H: tl.constexpr):
    """Normalise and rotate the [n_heads, D] rows starting at x_ptr (heads D apart) with the token's cos and sin
    rows; store at o_ptr. Each row is read as its two halves, so every load is contiguous."""
    half = D // 2
    dt = o_ptr.dtype.element_ty
    cos1, sin1, cos2, sin2 = _rope_halves(cos_row, sin_row, cols, col_mask, half, dt)
    x1, x2, rstd, first, mask = _heads_and_rstd(x_ptr, cols, col_mask, n_heads, D, eps, BLOCK_H)
    w1 = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + half + cols, mask=col_mask, other=0.0).to(tl.float32)
    # rms_norm rounding points: norm -> x dtype, * weight -> output dtype
    x1 = (x1 * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    x1 = (x1 * w1[None, :]).to(dt).to(tl.float32)
    x2 = (x2 * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    x2 = (x2 * w2[None, :]).to(dt).to(tl.float32)
    # rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
    tl.store(o_ptr + first, (x1 * cos1[None, :] - x2 * sin1[None, :]).to(dt), mask=mask)
    tl.store(o_ptr + first + half, (x2 * cos2[None, :] + x1 * sin2[None, :]).to(dt), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
                         T, Hq, Hkv, D, eps, stride_qb, stride_qt, stride_kb, stride_kt,
                         stride_cb, stride_ct, stride_sb, stride_st,
                         BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    b = tok // T
    t = tok % T
    half = D // 2
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    cos_row = cos_ptr + b * stride_cb + t * stride_ct
    sin_row = sin_ptr + b * stride_sb + t * stride_st
    _norm_rope_heads(q_ptr + b * stride_qb + t * stride_qt, qo_ptr + tok * Hq * D, qw_ptr, cos_row, sin_row,
                     cols, col_mask, Hq, D, eps, BLOCK_HQ)
    _norm_rope_heads(k_ptr + b * stride_kb + t * stride_kt, ko_ptr + tok * Hkv * D, kw_ptr, cos_row, sin_row,
                     cols, col_mask, Hkv, D, eps, BLOCK_HK)


def _rope_table(t: torch.Tensor, B: int, T: int, D: int) -> torch.Tensor:
    """A checked cos or sin table [B or 1, T, D] as the kernel reads it: [B, T, D], unit column stride."""
    t = t.expand(B, T, D)
    if t.stride(2) != 1:
        t = t.contiguous()
    return t


def _heads_packed(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D] as the kernel reads it: each token's heads next to each other (strides (., ., D, 1));
    any batch and time strides. A copy only when x is laid out otherwise."""
    heads, D = x.shape[2:]
    if x.stride(3) == 1 and (x.stride(2) == D or heads == 1):
        return x
    return x.contiguous()


def _tile_settings(Hq: int, Hkv: int, D: int) -> dict:
    """Block sizes and warps of a kernel holding one token's q heads and k heads, each as two half-head tiles."""
    BLOCK_HALF = triton.next_power_of_2(D // 2)
    BLOCK_HQ = triton.next_power_of_2(max(Hq, 1))
    BLOCK_HK = triton.next_power_of_2(max(Hkv, 1))
    tile = max(BLOCK_HQ, BLOCK_HK) * 2 * BLOCK_HALF
    return dict(BLOCK_HQ=BLOCK_HQ, BLOCK_HK=BLOCK_HK, BLOCK_HALF=BLOCK_HALF, num_warps=8 if tile >= 4096 else 4)


def _check_args(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> None:
    """:func:`qk_norm_rope`'s argument checks, run on either backend (the reference would broadcast a weight or
    table of another shape, and rotate an odd head_dim's halves of unequal size)."""
    def float_beside_q(name: str, t: torch.Tensor) -> None:
        check_float(name, t)
        if t.device != q.device:
            raise ValueError(f"q is on {q.device} but {name} is on {t.device}")

    for name, t in (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight)):
        float_beside_q(name, t)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, T, heads, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, _, D = q.shape
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in B, T or D")
    if D % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {D}")
    if q_weight.shape != (D,) or k_weight.shape != (D,):
        raise ValueError(f"q_weight and k_weight must have shape ({D},), got "
                         f"{tuple(q_weight.shape)} and {tuple(k_weight.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        float_beside_q(name, t)
        if t.dim() != 3 or t.shape[-1] != D or t.shape[1] != T or t.shape[0] not in (1, B):
            raise ValueError(f"{name} must have shape [B={B} (or 1), T={T}, D={D}], got {tuple(t.shape)}")


def qk_norm_rope_triton(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, eps: float):
    """Triton launcher of :func:`qk_norm_rope` (same arguments and results)."""
    _check_args(q, k, q_weight, k_weight, cos, sin)
    check_kernel_device(q.device, "qk_norm_rope")
    (B, T, Hq, D), Hkv = q.shape, k.shape[2]
    cos, sin = _rope_table(cos, B, T, D), _rope_table(sin, B, T, D)
    qc, kc = _heads_packed(q), _heads_packed(k)
    q_out = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, q_weight.dtype), device=q.device)
    k_out = torch.empty(k.shape, dtype=torch.promote_types(k.dtype, k_weight.dtype), device=k.device)
    if B * T > 0 and (Hq > 0 or Hkv > 0):
        _qk_norm_rope_kernel[(B * T,)](
            qc, kc, q_weight.contiguous(), k_weight.contiguous(), cos, sin, q_out, k_out,
            T, Hq, Hkv, D, float(eps), qc.stride(0), qc.stride(1), kc.stride(0), kc.stride(1),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), **_tile_settings(Hq, Hkv, D))
    return q_out, k_out


@triton.jit
def _norm_rope_heads_backward(x_ptr, do_ptr, dx_ptr, w1, w2, cos_row, sin_row, cols, col_mask, n_heads, D, eps,
                              BLOCK_H: tl.constexpr):
    """Gradient of one token's [n_heads, D] rows (heads D apart at x_ptr; do_ptr, dx_ptr contiguous) through
    norm + weight + RoPE; stores dx, returns this token's contributions to the weight's gradient (both halves)."""
    half = D // 2
    # the forward rounded cos / sin to this output's dtype, which its gradient has
    cos1, sin1, cos2, sin2 = _rope_halves(cos_row, sin_row, cols, col_mask, half, do_ptr.dtype.element_ty)
    x1, x2, rstd, first, mask = _heads_and_rstd(x_ptr, cols, col_mask, n_heads, D, eps, BLOCK_H)
    x1 = x1 * rstd[:, None]
    x2 = x2 * rstd[:, None]
    do1 = tl.load(do_ptr + first, mask=mask, other=0.0).to(tl.float32)
    do2 = tl.load(do_ptr + first + half, mask=mask, other=0.0).to(tl.float32)
    # RoPE's transpose: (o1, o2) = (a1 cos1 - a2 sin1, a2 cos2 + a1 sin2) -> da1, da2 of the normalised a = w * x_hat
    da1 = do1 * cos1[None, :] + do2 * sin2[None, :]
    da2 = do2 * cos2[None, :] - do1 * sin1[None, :]
    g1 = da1 * w1[None, :]
    g2 = da2 * w2[None, :]
    c = (tl.sum(g1 * x1, axis=1) + tl.sum(g2 * x2, axis=1)) / D
    dt = dx_ptr.dtype.element_ty
    tl.store(dx_ptr + first, (rstd[:, None] * (g1 - x1 * c[:, None])).to(dt), mask=mask)
    tl.store(dx_ptr + first + half, (rstd[:, None] * (g2 - x2 * c[:, None])).to(dt), mask=mask)
    return tl.sum(da1 * x1, axis=0), tl.sum(da2 * x2, axis=0)


@triton.jit
def _qk_norm_rope_backward_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, dqo_ptr, dko_ptr, dq_ptr, dk_ptr,
                                  dqw_ptr, dkw_ptr, n_tok, T, Hq, Hkv, D, eps, stride_qb, stride_qt, stride_kb,
                                  stride_kt, stride_cb, stride_ct, stride_sb, stride_st, tokens_per_program,
                                  BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Tokens [pid * tokens_per_program, ...): dq and dk, and this program's partials of the two weights' gradients
    (fp32 [2 * half] rows of dqw_ptr / dkw_ptr)."""
    pid = tl.program_id(0)
    half = D // 2
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    qw1 = tl.load(qw_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    qw2 = tl.load(qw_ptr + half + cols, mask=col_mask, other=0.0).to(tl.float32)
    kw1 = tl.load(kw_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    kw2 = tl.load(kw_ptr + half + cols, mask=col_mask, other=0.0).to(tl.float32)
    dqw1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    dqw2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    dkw1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    dkw2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    first = pid.to(tl.int64) * tokens_per_program
    for tok in range(first, tl.minimum(first + tokens_per_program, n_tok)):
        b = tok // T
        t = tok % T
        cos_row = cos_ptr + b * stride_cb + t * stride_ct
        sin_row = sin_ptr + b * stride_sb + t * stride_st
        a1, a2 = _norm_rope_heads_backward(q_ptr + b * stride_qb + t * stride_qt, dqo_ptr + tok * Hq * D,
                                           dq_ptr + tok * Hq * D, qw1, qw2, cos_row, sin_row, cols, col_mask,
                                           Hq, D, eps, BLOCK_HQ)
        dqw1 += a1
        dqw2 += a2
        a1, a2 = _norm_rope_heads_backward(k_ptr + b * stride_kb + t * stride_kt, dko_ptr + tok * Hkv * D,
                                           dk_ptr + tok * Hkv * D, kw1, kw2, cos_row, sin_row, cols, col_mask,
                                           Hkv, D, eps, BLOCK_HK)
        dkw1 += a1
        dkw2 += a2
    tl.store(dqw_ptr + pid * D + cols, dqw1, mask=col_mask)
    tl.store(dqw_ptr + pid * D + half + cols, dqw2, mask=col_mask)
    tl.store(dkw_ptr + pid * D + cols, dkw1, mask=col_mask)
    tl.store(dkw_ptr + pid * D + half + cols, dkw2, mask=col_mask)


class _QKNormRope(torch.autograd.Function):
    """:func:`qk_norm_rope_triton` with its backward kernel (gradients for q, k and the two weights; the RoPE tables
    get none: :func:`qk_norm_rope` sends tables that require grad to the reference)."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, eps):
        ctx.eps = eps
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        return qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable  # its kernels have no backward of their own
    def backward(ctx, dq_out, dk_out):
        q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        (B, T, Hq, D), Hkv = q.shape, k.shape[2]
        cos, sin = _rope_table(cos, B, T, D), _rope_table(sin, B, T, D)
        qc, kc = _heads_packed(q), _heads_packed(k)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        programs, per_program = backward_grid(B * T, q.device)
        dqw = torch.empty((programs, D), dtype=torch.float32, device=q.device)
        dkw = torch.empty((programs, D), dtype=torch.float32, device=q.device)
        if programs > 0:
            _qk_norm_rope_backward_kernel[(programs,)](
                qc, kc, q_weight.contiguous(), k_weight.contiguous(), cos, sin, dq_out.contiguous(),
                dk_out.contiguous(), dq, dk, dqw, dkw, B * T, T, Hq, Hkv, D, float(ctx.eps),
                qc.stride(0), qc.stride(1), kc.stride(0), kc.stride(1),
                cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), per_program,
                **_tile_settings(Hq, Hkv, D))
        return dq, dk, dqw.sum(0).to(q_weight.dtype), dkw.sum(0).to(k_weight.dtype), None, None, None


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float):
    """RMSNorm over head_dim of q and k, then RoPE (rotate-half convention).

    q: [B, T, Hq, D], k: [B, T, Hkv, D], q_weight, k_weight: [D], cos, sin: [B, T, D].
    Returns (q [B, T, Hq, D], k [B, T, Hkv, D]) of dtypes ``promote(q, q_weight)`` and ``promote(k, k_weight)``.
    """
    tables_differentiated = differentiated(cos, sin)
    operands = (q, k, q_weight, k_weight, cos, sin)
    if not wide(*operands) and select_backend(q.device, *operands, backward=not tables_differentiated) == "triton":
        if differentiated(q, k, q_weight, k_weight):
            return _QKNormRope.apply(q, k, q_weight, k_weight, cos, sin, eps)
        return qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps)
    _check_args(q, k, q_weight, k_weight, cos, sin)
    return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps)
