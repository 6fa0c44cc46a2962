"""Block-causal attention masks (True = may attend), built from positions, never from a causal triangle.

Blocks are aligned to absolute position 0: position p lies in block ``p // block_size``. A query
sees every key of an earlier or the same block; within a block attention is bidirectional. (Decoding
over the KV cache derives the same rule inside ``mrp_triton.cached_attention``.)
"""

from __future__ import annotations

import torch


def block_causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """query_positions: [B, T], key_positions: [B, S] (int64; -1 marks an invalid key).
    Returns bool [B, 1, T, S]."""
    q_block = (query_positions // block_size).unsqueeze(-1)
    k_block = (key_positions // block_size).unsqueeze(-2)
    mask = (k_block <= q_block) & (key_positions >= 0).unsqueeze(-2)
    return mask.unsqueeze(1)


def padded_block_causal_mask(attention_mask: torch.Tensor, position_ids: torch.Tensor | None,
                             block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-causal mask of a padded batch: attention_mask [B, T] (1/True = a real token, 0 = padding, on
    either side) -> (bool mask [B, 1, T, T], position_ids [B, T]).

    Padding keys are hidden, and every query sees itself (so no row of the mask is empty, not even an all-padding
    row's: a softmax over no keys is NaN on some SDPA backends). Without
    ``position_ids`` each row's real tokens count from 0, so a row's blocks, and its scores, are those it has alone."""
    real = attention_mask.to(torch.bool)
    if position_ids is None:
        position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)
    mask = block_causal_mask(position_ids, position_ids.masked_fill(~real, -1), block_size)
    return mask | torch.eye(real.shape[1], dtype=torch.bool, device=real.device), position_ids
