"""SwiGLU activation ``silu(gate) * up`` (the Qwen3 MLP's elementwise part).

Cost model for M elements of b bytes: read gate and up (2*M*b), write the product (M*b)
-> 3*M*b bytes, ~5 FLOPs and one exp per element. Unfused eager torch moves 5*M*b (silu writes
and re-reads a temporary). At decode shapes (M = tokens x ffn, e.g. 128 x 12288) the op is
launch-bound; the kernel is one launch, a program per BLOCK elements of a row. Rows are read in
place at any row stride (each row contiguous): the gate and up halves of one fused gate/up
projection output need no copy.

Computed in fp32; silu(gate) is rounded to the input dtype before the multiply, as eager
``F.silu(gate) * up`` does. Backward (when autograd differentiates the op): one kernel of the same layout reads
gate, up and the output gradient (3*M*b) and writes both input gradients (2*M*b); eager autograd recomputes
silu and its derivative in ~6 launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import as_rows, check_float, check_kernel_device, check_matches, wide
from .backend import differentiated, select_backend
from .reference.swiglu import swiglu as swiglu_reference

_BLOCK = 2048
_NUM_WARPS = 8


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, o_ptr, F, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + row * F + cols, (act * u).to(o_ptr.dtype.element_ty), mask=mask)


def _launch(kernel, rows: int, F: int, *args) -> None:
    """One program per (row, BLOCK columns) of a [rows, F] elementwise kernel."""
    block = min(_BLOCK, triton.next_power_of_2(F))
    kernel[(rows, triton.cdiv(F, block))](*args, BLOCK=block, num_warps=min(_NUM_WARPS, max(1, block // 256)))


def _check_args(gate: torch.Tensor, up: torch.Tensor) -> None:
    """:func:`swiglu`'s argument checks, run on either backend (the reference would broadcast or promote)."""
    check_float("gate", gate)
    check_matches("gate", gate, "up", up)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton launcher of :func:`swiglu` (same arguments and result)."""
    _check_args(gate, up)
    check_kernel_device(gate.device, "swiglu")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() > 0:
        g, u = as_rows(gate), as_rows(up)
        _launch(_swiglu_kernel, g.shape[0], g.shape[1], g, u, out, g.shape[1], g.stride(0), u.stride(0))
    return out


@triton.jit
def _swiglu_backward_kernel(g_ptr, u_ptr, do_ptr, dg_ptr, du_ptr, F, stride_g, stride_u, stride_do,
                            BLOCK: tl.constexpr):
    """d/dgate = do * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))), d/dup = do * silu(g), for one tile of a row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + row * stride_do + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    tl.store(dg_ptr + row * F + cols, (do * u * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * F + cols, (do * g * sig).to(du_ptr.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    """:func:`swiglu_triton` with its backward kernel; saves gate and up (views of a packed projection stay views)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_triton(gate, up)

    @staticmethod
    @torch.autograd.function.once_differentiable  # its kernels have no backward of their own
    def backward(ctx, d_out):
        gate, up = ctx.saved_tensors
        g, u, do = as_rows(gate), as_rows(up), as_rows(d_out)
        d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
        if d_gate.numel() > 0:
            F = g.shape[1]
            _launch(_swiglu_backward_kernel, g.shape[0], F, g, u, do, d_gate, d_up, F,
                    g.stride(0), u.stride(0), do.stride(0))
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; gate, up: [..., F] (same dtype) -> [..., F] (same dtype)."""
    if not wide(gate, up) and select_backend(gate.device, gate, up, backward=True) == "triton":
        return _SwiGLU.apply(gate, up) if differentiated(gate, up) else swiglu_triton(gate, up)
    _check_args(gate, up)
    return swiglu_reference(gate, up)
