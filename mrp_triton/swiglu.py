"""SwiGLU activation ``silu(gate) * up`` (the Qwen3 MLP's elementwise part).

Cost model for M elements of b bytes: read gate and up (2*M*b), write the product (M*b)
-> 3*M*b bytes, ~5 FLOPs and one exp per element. Unfused eager torch moves 5*M*b (silu writes
and re-reads a temporary). At decode shapes (M = tokens x ffn, e.g. 128 x 12288) the op is
launch-bound; the kernel is one launch, a program per BLOCK elements of a row. Rows are read in
place at any row stride (each row contiguous): the gate and up halves of one fused gate/up
projection output need no copy.

Computed in fp32; silu(gate) is rounded to the input dtype before the multiply, as eager
``F.silu(gate) * up`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import as_rows, check_float, check_matches
from .backend import select_backend
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


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton launcher of :func:`swiglu` (same arguments and result)."""
    check_float("gate", gate)
    check_matches("gate", gate, "up", up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() > 0:
        g, u = as_rows(gate), as_rows(up)
        F = g.shape[1]
        block = min(_BLOCK, triton.next_power_of_2(F))
        _swiglu_kernel[(g.shape[0], triton.cdiv(F, block))](g, u, out, F, g.stride(0), u.stride(0), BLOCK=block,
                                                           num_warps=min(_NUM_WARPS, max(1, block // 256)))
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; gate, up: [..., F] (same dtype) -> [..., F] (same dtype)."""
    if select_backend(gate.device, gate, up) == "triton":
        return swiglu_triton(gate, up)
    return swiglu_reference(gate, up)
