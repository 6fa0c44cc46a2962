"""Block-causal attention masks (True = may attend), built from positions, never from a causal triangle.

Blocks are aligned to absolute position 0: position p lies in block ``p // block_size``. A query
sees every key of an earlier or the same block; within a block attention is bidirectional.
Segments separate candidate copies of a block that are verified in one forward: a query sees the
shared prefix (segment -1) and keys of its own segment only.
"""

from __future__ import annotations

import torch


def block_causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, block_size: int,
                      query_segments: torch.Tensor | None = None,
                      key_segments: torch.Tensor | None = None) -> torch.Tensor:
    """query_positions: [B, T], key_positions: [B, S] (int64; -1 marks an invalid key),
    query_segments: [T] or None, key_segments: [S] or None (-1 = visible to every segment).
    Returns bool [B, 1, T, S]."""
    q_block = (query_positions // block_size).unsqueeze(-1)
    k_block = (key_positions // block_size).unsqueeze(-2)
    mask = (k_block <= q_block) & (key_positions >= 0).unsqueeze(-2)
    if query_segments is not None:
        same = (key_segments.unsqueeze(0) == query_segments.unsqueeze(1)) | (key_segments == -1).unsqueeze(0)
        mask = mask & same
    return mask.unsqueeze(1)


def cached_block_mask(query_positions: torch.Tensor, prefix_lengths: torch.Tensor, prefix_width: int,
                      block_size: int, query_segments: torch.Tensor | None = None) -> torch.Tensor:
    """Mask for T new positions attending a cached prefix and themselves. query_positions: [B, T];
    row b has committed ``prefix_lengths[b]`` positions (int64 [B]) of the ``prefix_width`` read from the
    cache (the rest of its width is not yet valid). Returns bool [B, 1, T, prefix_width + T]."""
    slots = torch.arange(prefix_width, device=query_positions.device)
    prefix = torch.where(slots < prefix_lengths[:, None], slots, -1)
    key_positions = torch.cat([prefix, query_positions], dim=1)
    key_segments = None
    if query_segments is not None:
        key_segments = torch.cat([torch.full((prefix_width,), -1, dtype=query_segments.dtype,
                                             device=query_segments.device), query_segments])
    return block_causal_mask(query_positions, key_positions, block_size, query_segments, key_segments)
