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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import as_rows, check_float
from .backend import select_backend
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


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    """Triton launcher of :func:`rms_norm` (same arguments and results)."""
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim, optionally after adding ``residual``.

    x: [..., H], weight: [H], residual: [..., H] or None.
    Returns y [..., H] (dtype promote(x, weight)) when ``residual`` is None, else ``(y, s)`` with
    ``s = x + residual`` [..., H] (dtype promote(x, residual), the new residual stream) and ``y = rms_norm(s)``
    (dtype promote(s, weight)).
    """
    if select_backend(x.device, x, weight, residual) == "triton":
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)
