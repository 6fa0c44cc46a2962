"""Input of the MRP module's ``eh_proj``: ``[enorm(E[ids]) | hnorm(h)]`` in one launch.

Cost model per row (hidden size H, b bytes): gather one embedding row (H*b_E), read the hidden
row (H*b), the two norm weights (L2-resident), write 2*H*b. Eager torch needs a gather, two
norms (each reading its input twice) and a cat that re-copies both halves: ~3x the traffic in
~10 launches. At MRP shapes (one block of 16 tokens x batch) the op is launch-bound.

One program per row; the embedding half comes first (DeepSeek-V3 MTP layout). The embedding row
is rounded to hidden's dtype first (the reference's ``embed_weight[ids].to(hidden.dtype)``),
then both halves follow :mod:`mrp_triton.rms_norm`'s rounding points. With norm weights of two dtypes the output
has the wider one's; a half whose own weight keeps it in hidden's dtype is rounded to that first, as the reference's
per-half norm does before its cat.
Backward: the norm's backward kernel (:func:`mrp_triton.rms_norm.rms_norm_backward`) on each half, each half's
input gradient computed only when wanted (MRP training freezes the embedding: only enorm's weight gradient is
computed from that half); a gradient for the embedding is scattered back by id.
Token ids are not range-checked on CUDA (that would need a host sync): an out-of-range id reads
as a zero embedding row instead of out-of-bounds memory. With CPU tensors they are checked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_ids_on_cpu, check_kernel_device, wide
from .backend import differentiated, select_backend
from .reference.mrp_input import mrp_input as mrp_input_reference
from .rms_norm import rms_norm_backward, row_settings


@triton.jit
def _mrp_input_kernel(ids_ptr, e_ptr, h_ptr, ew_ptr, hw_ptr, o_ptr, V, H, eps,
                      stride_e, stride_h, stride_o, ROUND_E: tl.constexpr, ROUND_H: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    tok = tl.load(ids_ptr + row).to(tl.int64)
    tok_v = tok + tl.zeros([BLOCK], tl.int64)  # per-lane copy: a vector mask, also in the interpreter
    ok = (tok_v >= 0) & (tok_v < V)
    e = tl.load(e_ptr + tl.where(ok, tok_v, 0) * stride_e + cols, mask=mask & ok, other=0.0)
    e = e.to(h_ptr.dtype.element_ty).to(tl.float32)
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    e_rstd = 1.0 / tl.sqrt(tl.sum(e * e, axis=0) / H + eps)
    h_rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    ew = tl.load(ew_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    hw = tl.load(hw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    en = (e * e_rstd).to(h_ptr.dtype.element_ty).to(tl.float32) * ew
    hn = (h * h_rstd).to(h_ptr.dtype.element_ty).to(tl.float32) * hw
    if ROUND_E:  # the half's own dtype promote(hidden, weight) is hidden's (a no-op where the output's is too)
        en = en.to(h_ptr.dtype.element_ty).to(tl.float32)
    if ROUND_H:
        hn = hn.to(h_ptr.dtype.element_ty).to(tl.float32)
    out = o_ptr + row * stride_o
    tl.store(out + cols, en.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(out + H + cols, hn.to(o_ptr.dtype.element_ty), mask=mask)


def _in_hidden_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the half that ``weight`` scales is rounded to hidden's dtype, whatever the output's (the reference's
    per-half norm gives it dtype ``promote(hidden, weight)``, which the cat may widen)."""
    return torch.promote_types(hidden.dtype, weight.dtype) == hidden.dtype


def _check_args(ids: torch.Tensor, embed_weight: torch.Tensor, hidden: torch.Tensor, enorm_weight: torch.Tensor,
                hnorm_weight: torch.Tensor) -> None:
    """:func:`mrp_input`'s argument checks, run on either backend (the reference would broadcast a norm weight of
    another shape). Not the range of the ids: see :func:`mrp_input_triton`."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids must be int64 or int32, got {ids.dtype}")
    for name, t in (("embed_weight", embed_weight), ("hidden", hidden),
                    ("enorm_weight", enorm_weight), ("hnorm_weight", hnorm_weight)):
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    for name, t in (("ids", ids), ("embed_weight", embed_weight),
                    ("enorm_weight", enorm_weight), ("hnorm_weight", hnorm_weight)):
        if t.device != hidden.device:
            raise ValueError(f"hidden is on {hidden.device} but {name} is on {t.device}")
    if hidden.dim() != 2 or ids.dim() != 1 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"ids must be [N] and hidden [N, H], got {tuple(ids.shape)} and {tuple(hidden.shape)}")
    N, H = hidden.shape
    if embed_weight.dim() != 2 or embed_weight.shape[1] != H:
        raise ValueError(f"embed_weight must be [V, H={H}], got {tuple(embed_weight.shape)}")
    if enorm_weight.shape != (H,) or hnorm_weight.shape != (H,):
        raise ValueError(f"enorm_weight and hnorm_weight must have shape ({H},), got "
                         f"{tuple(enorm_weight.shape)} and {tuple(hnorm_weight.shape)}")


def mrp_input_triton(ids: torch.Tensor, embed_weight: torch.Tensor, hidden: torch.Tensor,
                     enorm_weight: torch.Tensor, hnorm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton launcher of :func:`mrp_input` (same arguments and result). CPU ids are range-checked here (the
    interpreter would read an out-of-range id as a zero row; the reference's gather raises on its own; on CUDA, and
    inside the decoder's steps, the check would need a host sync)."""
    _check_args(ids, embed_weight, hidden, enorm_weight, hnorm_weight)
    check_kernel_device(hidden.device, "mrp_input")
    check_ids_on_cpu("ids", ids, 0, embed_weight.shape[0])
    (N, H), V = hidden.shape, embed_weight.shape[0]
    out_dtype = torch.promote_types(hidden.dtype, torch.promote_types(enorm_weight.dtype, hnorm_weight.dtype))
    out = torch.empty((N, 2 * H), dtype=out_dtype, device=hidden.device)
    BLOCK, num_warps = row_settings(H)
    e = embed_weight if embed_weight.stride(1) == 1 else embed_weight.contiguous()
    h = hidden.contiguous()
    if N > 0:
        _mrp_input_kernel[(N,)](ids.contiguous(), e, h, enorm_weight.contiguous(), hnorm_weight.contiguous(),
                                out, V, H, float(eps), e.stride(0), h.stride(0), out.stride(0),
                                ROUND_E=_in_hidden_dtype(hidden, enorm_weight),
                                ROUND_H=_in_hidden_dtype(hidden, hnorm_weight),
                                BLOCK=BLOCK, num_warps=num_warps)
    return out


class _MRPInput(torch.autograd.Function):
    """:func:`mrp_input_triton`; backward: :func:`mrp_triton.rms_norm.rms_norm_backward` on each half (the embedding
    rows gathered again) and, when the embedding needs a gradient, its rows scattered back by id."""

    @staticmethod
    def forward(ctx, ids, embed_weight, hidden, enorm_weight, hnorm_weight, eps):
        ctx.eps = eps
        ctx.save_for_backward(ids, embed_weight, hidden, enorm_weight, hnorm_weight)
        return mrp_input_triton(ids, embed_weight, hidden, enorm_weight, hnorm_weight, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable  # its kernels have no backward of their own
    def backward(ctx, d_out):
        ids, embed_weight, hidden, enorm_weight, hnorm_weight = ctx.saved_tensors
        H = hidden.shape[1]
        _, needs_embed, needs_hidden, needs_enorm, needs_hnorm, _ = ctx.needs_input_grad
        d_embed = d_hidden = d_enorm = d_hnorm = None
        if needs_embed or needs_enorm:
            e = embed_weight[ids].to(hidden.dtype)
            d_e, d_enorm = rms_norm_backward(e, enorm_weight, ctx.eps, d_out[:, :H], want_dx=needs_embed)
            if needs_embed:
                d_embed = torch.zeros_like(embed_weight).index_add_(0, ids, d_e.to(embed_weight.dtype))
        if needs_hidden or needs_hnorm:
            d_hidden, d_hnorm = rms_norm_backward(hidden, hnorm_weight, ctx.eps, d_out[:, H:], want_dx=needs_hidden)
        return None, d_embed, d_hidden, d_enorm, d_hnorm, None


def mrp_input(ids: torch.Tensor, embed_weight: torch.Tensor, hidden: torch.Tensor,
              enorm_weight: torch.Tensor, hnorm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ids: [N] int64 or int32, embed_weight: [V, H], hidden: [N, H], norms: [H] -> [N, 2H].

    ``[enorm(embed_weight[ids]) | hnorm(hidden)]``, the embedding half first. The output's dtype is the promoted
    dtype of ``hidden`` and both norm weights; each half is rounded to its own ``promote(hidden, weight)`` first.
    """
    floats = (embed_weight, hidden, enorm_weight, hnorm_weight)
    if not wide(*floats) and select_backend(hidden.device, *floats, backward=True) == "triton":
        if differentiated(*floats):
            return _MRPInput.apply(ids, embed_weight, hidden, enorm_weight, hnorm_weight, eps)
        return mrp_input_triton(ids, embed_weight, hidden, enorm_weight, hnorm_weight, eps)
    _check_args(ids, embed_weight, hidden, enorm_weight, hnorm_weight)
    return mrp_input_reference(ids, embed_weight, hidden, enorm_weight, hnorm_weight, eps)
