"""Preallocated key/value cache for block-diffusion decoding.

One buffer per attention layer (the backbone's layers first, then the MRP head's layers, which keep
their own keys/values for the same committed prefix). Only committed blocks are ever written: a
denoising forward reads the prefix and leaves the cache untouched; a commit forward appends the
finished block. Buffers never move or grow, so decode steps can be captured in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class StaticKVCache:
    """Keys/values ``[num_slots, batch, kv_heads, max_len, head_dim]`` plus per-row lengths ``[batch]``.

    ``length`` is the number of committed positions (shared block boundaries: every row of a batch
    has committed the same number of positions; ``lengths`` keeps it per row for the attention mask).
    """

    def __init__(self, num_slots: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_slots, batch_size, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = 0
        self.max_len = max_len

    def prefix(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed keys and values of one layer: ``[batch, kv_heads, length, head_dim]`` each."""
        return self.keys[slot, :, :, : self.length], self.values[slot, :, :, : self.length]

    def write(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``keys``/``values`` ``[batch, kv_heads, n, head_dim]`` after the committed prefix of
        one layer. ``advance`` makes them visible once every layer has written."""
        n = keys.shape[2]
        if self.length + n > self.max_len:
            raise RuntimeError(f"KV cache overflow: {self.length} + {n} > max_len {self.max_len}")
        self.keys[slot, :, :, self.length : self.length + n] = keys
        self.values[slot, :, :, self.length : self.length + n] = values

    def advance(self, n: int) -> None:
        """Mark ``n`` more positions of every row as committed."""
        self.length += n
        self.lengths += n


@dataclass
class AttentionInputs:
    """What every attention layer of one forward needs besides its hidden states.

    mask: bool ``[B or 1, 1, T, prefix + T]`` (True = may attend) over the cached prefix followed by
    the T new positions. cache: the KV cache or None. write_len: how many leading new positions
    each layer appends to the cache (0 for a denoising forward).
    """

    mask: torch.Tensor | None
    cache: StaticKVCache | None = None
    write_len: int = 0
