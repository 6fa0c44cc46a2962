"""Reference of settling decoded rows: where a row's output ends, and the masks it no longer decodes, in place.

Defined behaviour (shared with :mod:`mrp_triton.settle`), per row b of a block [B, L] of token ids at ``positions``:

* an EOS (``is_eos[token]``) at a position ``p >= starts[b]`` (a new token, not the prompt) ends the row's output:
  ``ends[b]`` becomes ``min(ends[b], p + 1)`` for the first such p (``ends``: past the last position the output
  keeps, so it only ever decreases);
* a row with no ``mask_token_id`` at a position before its (new) end is settled: every mask it still holds (past its
  end: positions the output drops) is replaced by ``filler``; other rows are left as they are.
"""

from __future__ import annotations

import torch


def settle_rows(block, positions, starts, ends, is_eos, *, mask_token_id, filler):
    """block: int64 [B, L] (in place), positions: int64 [B, L], starts: int64 [B], ends: int64 [B] (in place),
    is_eos: bool [V] (indexed by token id)."""
    if block.shape[1]:
        eos = is_eos.index_select(0, block.flatten()).view_as(block) & (positions >= starts[:, None])  # (-1 raises)
        ends.copy_(torch.minimum(ends, torch.where(eos, positions + 1, ends[:, None]).amin(-1)))
    masked = block == mask_token_id
    settled = ~(masked & (positions < ends[:, None])).any(-1, keepdim=True)
    block.masked_fill_(masked & settled, filler)
