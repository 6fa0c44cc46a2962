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
