"""SwiGLU activation ``silu(gate) * up`` (the Qwen3 MLP's elementwise part).

Cost model for M elements of b bytes: read gate and up (2*M*b), write the product (M*b)
-> 3*M*b bytes, ~5 FLOPs and one exp per element. Unfused eager torch moves 5*M*b (silu writes
and re-reads a temporary). At decode shapes (M = tokens x ffn, e.g. 128 x 12288) the op is
launch-bound; the kernel is one launch over the flattened tensors, BLOCK elements per program.

Computed in fp32; silu(gate) is rounded to the input dtype before the multiply, as eager
``F.silu(gate) * up`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_float, check_matches
from .backend import select_backend
from .reference.swiglu import swiglu as swiglu_reference

_BLOCK = 2048
_NUM_WARPS = 8


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, o_ptr, n_elements, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + offs, (act * u).to(o_ptr.dtype.element_ty), mask=mask)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton launcher of :func:`swiglu` (same arguments and result)."""
    check_float("gate", gate)
    check_matches("gate", gate, "up", up)
    g = gate.contiguous()
    u = up.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = g.numel()
    if n > 0:
        _swiglu_kernel[(triton.cdiv(n, _BLOCK),)](g, u, out, n, BLOCK=_BLOCK, num_warps=_NUM_WARPS)
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; gate, up: [..., F] (same dtype) -> [..., F] (same dtype)."""
    if select_backend(gate.device) == "triton":
        return swiglu_triton(gate, up)
    return swiglu_reference(gate, up)
