"""RMSNorm over the last dim with an optional fused residual add (Qwen3 semantics).

Cost model, per row of H elements of b bytes (b = 2 for bf16/fp16, 4 for fp32):
    no residual:   read x (H*b) + weight (H*b, L2-resident across rows), write y (H*b)
                   -> 2*N*H*b bytes of HBM traffic, ~4 FLOPs per element.
    with residual: read x and residual, write y and s = x + residual
                   -> 4*N*H*b bytes (the unfused pair add + norm moves 6*N*H*b).
The floor is that traffic at copy bandwidth; at decode shapes (N <= a few hundred rows) the op
is launch-bound (~3-5 us), which is why the add and the norm are one launch.

One program normalises one row, held in registers (BLOCK = next_power_of_2(H), H <= 65536).
Everything is computed in fp32; the rounding points of the reference are kept: s = x + residual is
rounded to their promoted dtype (x's, when they match) before it is normalised, and the normalised row
is rounded to that dtype before the weight multiply (``weight * norm(s).to(s.dtype)``, as Qwen3 /
Hugging Face do). Mixed dtypes are what an autocast forward gives (a bf16 layer output added to an
fp32 residual stream).

Backward (:func:`rms_norm_backward`, when autograd differentiates the op): per row read s (the normalised input,
saved by the forward), dy and, with a residual, the gradient of s itself; write ds (3-4*H*b). The row's rstd is
recomputed rather than saved. A few programs per SM each loop over a run of rows and keep their share of the
weight gradient in fp32 registers ([programs, H] partials, summed after), so no atomics and no [N, H] temporary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import as_rows, check_float, check_kernel_device, wide
from .backend import differentiated, num_sms, select_backend
from .reference.rms_norm import rms_norm as rms_norm_reference

MAX_FUSED_BLOCK = 65536


def row_settings(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a kernel that holds one row of ``n`` elements in registers."""
    block = triton.next_power_of_2(max(int(n), 1))
    if block > MAX_FUSED_BLOCK:
        raise ValueError(f"rows of {n} elements exceed the single-block limit of {MAX_FUSED_BLOCK}")
    if block >= 32768:
        num_warps = 32
    elif block >= 8192:
        num_warps = 16
    elif block >= 2048:
        num_warps = 8
    else:
        num_warps = 4
    return block, num_warps


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, n_cols, eps,
                     stride_x, stride_r, stride_y, stride_s,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    if HAS_RESIDUAL:  # rounded to the dtype of the row it normalises (Qwen3's input_dtype)
        xn = (x * rstd).to(s_ptr.dtype.element_ty).to(tl.float32)
    else:
        xn = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (xn * w).to(y_ptr.dtype.element_ty), mask=mask)


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """:func:`rms_norm`'s argument checks, run on either backend (the reference would broadcast a weight or residual
    of another shape)."""
    check_float("x", x)
    check_float("weight", weight)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dim, got shape {tuple(x.shape)}")
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"weight must have shape ({H},) to match x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if residual is not None:
        check_float("residual", residual)
        if residual.shape != x.shape or residual.device != x.device:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)} and device {x.device}, got "
                             f"{tuple(residual.shape)} on {residual.device}")


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    """Triton launcher of :func:`rms_norm` (same arguments and results)."""
    _check_args(x, weight, residual)
    check_kernel_device(x.device, "rms_norm")
    H = x.shape[-1]
    BLOCK, num_warps = row_settings(H)
    x2 = as_rows(x)
    w = weight.contiguous()
    M = x2.shape[0]
    s_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)  # as x + residual
    y = torch.empty(x.shape, dtype=torch.promote_types(s_dtype, weight.dtype), device=x.device)
    y2 = y.view(-1, H)
    if residual is not None:
        r2 = as_rows(residual)
        s = torch.empty(x.shape, dtype=s_dtype, device=x.device)
        s2 = s.view(-1, H)
    else:
        r2, s, s2 = x2, None, y2  # unused pointers (HAS_RESIDUAL=False)
    if M > 0:
        _rms_norm_kernel[(M,)](x2, r2, w, y2, s2, H, float(eps),
                               x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0),
                               HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=num_warps)
    return y if residual is None else (y, s)


def backward_grid(rows: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows per program) of a backward kernel that loops over ``rows`` rows and keeps a weight-gradient
    partial per program: a few programs per SM, so the partials stay small ([programs, H] fp32, summed after; no
    programs for no rows, whose sum is zero)."""
    if rows == 0:
        return 0, 0
    per_program = triton.cdiv(rows, min(rows, 4 * num_sms(device)))
    return triton.cdiv(rows, per_program), per_program


@triton.jit
def _rms_norm_backward_kernel(s_ptr, w_ptr, dy_ptr, ds_ptr, dx_ptr, dw_ptr, n_rows, n_cols, eps,
                              stride_s, stride_dy, stride_ds, rows_per_program,
                              HAS_DS: tl.constexpr, WANT_DX: tl.constexpr, BLOCK: tl.constexpr):
    """Rows [pid * rows_per_program, ...) of dx = d rms_norm(s) / ds (plus the incoming gradient of s itself; only
    with WANT_DX) and this program's partial of dw = sum_rows dy * s_hat (rounding points: straight through, as
    autograd's)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, n_rows)):
        s = tl.load(s_ptr + row * stride_s + cols, mask=col_mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / n_cols + eps)
        s_hat = s * rstd
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw += dy * s_hat
        if WANT_DX:
            g = dy * w
            dx = rstd * (g - s_hat * (tl.sum(g * s_hat, axis=0) / n_cols))
            if HAS_DS:
                dx += tl.load(ds_ptr + row * stride_ds + cols, mask=col_mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=col_mask)
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=col_mask)


def rms_norm_backward(s: torch.Tensor, weight: torch.Tensor, eps: float, dy: torch.Tensor,
                      ds: torch.Tensor | None = None, want_dx: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Gradients of ``y = rms_norm(s)`` (no residual) given dy [..., H]: (ds_total [..., H] in s's dtype: dy through
    the norm plus ``ds``, the gradient s receives elsewhere (the residual stream's), or None; None without
    ``want_dx``, which then is neither computed nor written; dw [H] in weight's dtype). One kernel over the rows;
    the weight gradient is summed from one fp32 partial per program."""
    H = s.shape[-1]
    s2, dy2 = as_rows(s), as_rows(dy)
    ds2 = as_rows(ds) if ds is not None else dy2  # unused pointer (HAS_DS=False)
    M = s2.shape[0]
    dx = torch.empty(s.shape if want_dx else (0,), dtype=s.dtype, device=s.device)
    BLOCK, num_warps = row_settings(H)
    programs, per_program = backward_grid(M, s.device)
    dw = torch.empty((programs, H), dtype=torch.float32, device=s.device)
    if programs > 0:
        _rms_norm_backward_kernel[(programs,)](s2, weight.contiguous(), dy2, ds2, dx, dw, M, H, float(eps),
                                               s2.stride(0), dy2.stride(0), ds2.stride(0), per_program,
                                               HAS_DS=ds is not None, WANT_DX=want_dx, BLOCK=BLOCK,
                                               num_warps=num_warps)
    return dx if want_dx else None, dw.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    """:func:`rms_norm_triton` with :func:`rms_norm_backward`; saves the normalised input (x, or s = x + residual)."""

    @staticmethod
    def forward(ctx, x, weight, eps, residual):
        out = rms_norm_triton(x, weight, eps, residual)
        ctx.eps, ctx.x_dtype, ctx.residual_dtype = eps, x.dtype, None if residual is None else residual.dtype
        ctx.save_for_backward(out[1] if residual is not None else x, weight)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # its kernels have no backward of their own
    def backward(ctx, dy, ds=None):
        s, weight = ctx.saved_tensors
        d, dw = rms_norm_backward(s, weight, ctx.eps, dy, ds)
        return d.to(ctx.x_dtype), dw, None, None if ctx.residual_dtype is None else d.to(ctx.residual_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim, optionally after adding ``residual``.

    x: [..., H], weight: [H], residual: [..., H] or None.
    Returns y [..., H] (dtype promote(x, weight)) when ``residual`` is None, else ``(y, s)`` with
    ``s = x + residual`` [..., H] (dtype promote(x, residual), the new residual stream) and ``y = rms_norm(s)``
    (dtype promote(s, weight)).
    """
    if not wide(x, weight, residual) and select_backend(x.device, x, weight, residual, backward=True) == "triton":
        if differentiated(x, weight, residual):
            return _RMSNorm.apply(x, weight, eps, residual)
        return rms_norm_triton(x, weight, eps, residual)
    _check_args(x, weight, residual)
    return rms_norm_reference(x, weight, eps, residual)
