"""Settling decoded rows, fused: a row's end at its first EOS, and the masks a settled row no longer decodes.

What every decoding step ends with. One program per row (grid [B]), the row in registers: look each token up in the
EOS table, lower the row's end to past its first new EOS, and fill the masks of a row with none left before its end.
No host synchronisation; in place.

Cost model: read 8 + 8 bytes per position (block, positions) and a table byte per token, write <= 8 per position
and 8 per row; launch-bound at decode sizes: one launch where the torch ops take about fifteen.
Semantics: :mod:`mrp_triton.reference.settle`.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from ._checks import (check_block, check_block_shaped, check_contiguous_block, check_ids_on_cpu, check_kernel_device,
                      check_on_block_device, check_token_id)
from .backend import select_backend
from .reference.settle import settle_rows as settle_rows_reference


@triton.jit(do_not_specialize=["mask_id", "filler"])
def _settle_kernel(block_ptr, pos_ptr, starts_ptr, ends_ptr, eos_ptr, L, mask_id, filler, BLOCK_L: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_L)
    msk = offs < L
    tok = tl.load(block_ptr + row * L + offs, mask=msk, other=mask_id)
    pos = tl.load(pos_ptr + row * L + offs, mask=msk, other=0)
    start = tl.load(starts_ptr + row)
    end = tl.load(ends_ptr + row)
    eos = (tl.load(eos_ptr + tok, mask=msk, other=0) != 0) & msk & (pos >= start)
    end = tl.minimum(end, tl.min(tl.where(eos, pos + 1, end), 0))
    tl.store(ends_ptr + row, end)
    masked = (tok == mask_id) & msk
    kept = tl.sum((masked & (pos < end)).to(tl.int32), 0)
    # the row's verdict (a scalar) joins the block mask as an int: the interpreter refuses a scalar bool there
    fill = (masked.to(tl.int32) * (kept == 0).to(tl.int32)) != 0
    tl.store(block_ptr + row * L + offs, tl.full([BLOCK_L], 0, tl.int64) + filler, mask=fill)


def _check_args(block, positions, starts, ends, is_eos, mask_token_id, filler):
    shape = check_block(block)
    check_block_shaped("positions", positions, shape, torch.int64)
    for name, t in (("starts", starts), ("ends", ends)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != shape[:1]:
            raise ValueError(f"{name} must be an int64 tensor [{shape[0]}], one per row of block")
    if not isinstance(is_eos, torch.Tensor) or is_eos.dtype != torch.bool or is_eos.dim() != 1:
        raise ValueError("is_eos must be a bool tensor [V], indexed by token id (True at the EOS ids)")
    check_on_block_device(block, positions=positions, starts=starts, ends=ends, is_eos=is_eos)
    check_token_id(mask_token_id)
    if isinstance(filler, bool) or not isinstance(filler, numbers.Integral) or filler == mask_token_id:
        raise ValueError(f"filler must be a token id (an int) other than the mask token {mask_token_id}, got "
                         f"{filler!r}")


def settle_rows_triton(block, positions, starts, ends, is_eos, *, mask_token_id, filler):
    """Triton launcher (see :func:`settle_rows`)."""
    _check_args(block, positions, starts, ends, is_eos, mask_token_id, filler)
    check_kernel_device(block.device, "settle_rows")
    check_ids_on_cpu("block", block, 0, is_eos.shape[0])  # (is_eos is read by token id; the reference's gather raises)
    check_contiguous_block(block)
    if not ends.is_contiguous():
        raise ValueError("ends must be contiguous (it is updated in place)")
    B, L = block.shape
    if B == 0 or L == 0:
        return
    _settle_kernel[(B,)](block, positions.contiguous(), starts.contiguous(), ends,
                         is_eos.contiguous().view(torch.uint8), L,
                         int(mask_token_id), int(filler), BLOCK_L=max(16, triton.next_power_of_2(L)), num_warps=1)


def settle_rows(block, positions, starts, ends, is_eos, *, mask_token_id, filler):
    """End each row's output at its first new EOS and fill the masks of a row that has none left before its end.

    block: int64 [B, L] of token ids in [0, V) (in place), positions: int64 [B, L] (each token's position),
    starts: int64 [B] (each row's first new position: an EOS before it, in the prompt, ends nothing), ends: int64 [B]
    (past the last position each row's output keeps; in place, lowered to past the row's first new EOS),
    is_eos: bool [V]; ``filler``: the token id a settled row's leftover masks become (not the mask token).
    """
    if select_backend(block.device) == "triton":
        return settle_rows_triton(block, positions, starts, ends, is_eos, mask_token_id=mask_token_id, filler=filler)
    _check_args(block, positions, starts, ends, is_eos, mask_token_id, filler)
    return settle_rows_reference(block, positions, starts, ends, is_eos, mask_token_id=mask_token_id, filler=filler)
