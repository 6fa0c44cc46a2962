"""Preallocated key/value cache for block-diffusion decoding.

One buffer per attention layer (the backbone's layers first, then the MRP head's layers, which keep
their own keys/values for the same committed prefix). Only committed blocks are ever written: a
denoising forward reads the prefix and leaves the cache untouched; a commit forward appends the
finished block. Buffers never move or grow, so decode steps can be captured in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import BlockMask


class StaticKVCache:
    """Keys/values ``[num_slots, batch, kv_heads, max_len, head_dim]`` plus per-row lengths ``[batch]``.

    Row b has committed ``lengths[b]`` positions; rows may differ (each row sits in its own block and
    commits it when it is done). Forwards read ``width`` positions: ``length`` (a host int, the largest
    committed length, read back after every commit), or with ``full_width`` the whole buffer. A full-width
    cache keeps no host length at all (what a captured CUDA graph needs: no host value that changes between
    steps; its owner sizes it to cover the layout). A row's slots past its own length are never attended
    (``mrp_triton.cached_attention``).
    ``keys``, ``values`` and ``lengths`` are views of the first ``batch`` rows of buffers that never move:
    finished rows are dropped by moving the kept ones to the front (:meth:`keep_rows`), and :meth:`reset`
    empties the cache for another ``generate`` call, so graphs captured over it stay valid.
    """

    def __init__(self, num_slots: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, full_width: bool = False):
        shape = (num_slots, batch_size, num_kv_heads, max_len, head_dim)
        self._keys = torch.zeros(shape, dtype=dtype, device=device)
        self._values = torch.zeros(shape, dtype=dtype, device=device)
        self._lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._heads = torch.arange(num_kv_heads, device=device)  # what a write of some rows indexes
        self.max_len = max_len
        self.full_width = full_width
        self.reset()

    def reset(self) -> None:
        """Every row back, nothing committed (stale entries stay but are masked out by the lengths)."""
        self._lengths.zero_()
        self.length = 0
        self._use_rows(self._lengths.shape[0])

    def _use_rows(self, n: int) -> None:
        self.keys, self.values, self.lengths = self._keys[:, :n], self._values[:, :n], self._lengths[:n]

    @property
    def width(self) -> int:
        return self.max_len if self.full_width else self.length

    def prefix(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer as forwards read them: ``[batch, kv_heads, width, head_dim]`` each."""
        return self.keys[slot, :, :, : self.width], self.values[slot, :, :, : self.width]

    def write_offsets(self, n: int) -> torch.Tensor:
        """[batch, n]: the slots of ``n`` positions appended after each row's committed prefix (the same in every
        layer until ``advance``)."""
        if not self.full_width and self.length + n > self.max_len:
            raise RuntimeError(f"KV cache overflow: {self.length} + {n} > max_len {self.max_len}")
        return self.lengths[:, None] + torch.arange(n, device=self.lengths.device)

    def write(self, slot: int, keys: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
              rows: torch.Tensor | None = None) -> None:
        """Put ``keys``/``values`` ``[batch, kv_heads, n, head_dim]`` of one layer in the slots ``offsets`` [batch, n]
        (:meth:`write_offsets`, computed once for all the layers of a forward); with ``rows`` (int64 [R]), keys and
        values [R, kv_heads, n, head_dim] of those rows only, offsets [R, n]. ``advance`` makes them visible once
        every layer has written."""
        if rows is None:
            index = offsets[:, None, :, None].expand_as(keys)
            self.keys[slot].scatter_(2, index, keys)
            self.values[slot].scatter_(2, index, values)
            return
        index = (rows[:, None, None], self._heads[None, :, None], offsets[:, None, :])
        self.keys[slot].index_put_(index, keys)
        self.values[slot].index_put_(index, values)

    def advance(self, n: int, rows: torch.Tensor | None = None) -> None:
        """Mark ``n`` more positions as committed: of every row, or of the rows where ``rows`` (bool [batch])
        is set (the others' freshly written slots stay past their length: never attended, overwritten by
        their own commit)."""
        self.lengths.add_(n if rows is None else n * rows.long())
        if not self.full_width:
            self.length = int(self.lengths.max())

    def copy_rows(self, sources: torch.Tensor, targets: torch.Tensor, n: int) -> None:
        """Every slot's keys and values of the first ``n`` positions of rows ``sources`` into rows ``targets`` (int64
        [R] each; the lengths are left as they are)."""
        self.keys[:, targets, :, :n] = self.keys[:, sources, :, :n]
        self.values[:, targets, :, :n] = self.values[:, sources, :, :n]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Shrink the batch to ``rows`` (int64 [B'], increasing): the other rows are finished and stop
        costing work. The kept rows move to the front of the same buffers."""
        n = rows.shape[0]
        self._keys[:, :n] = self.keys[:, rows]
        self._values[:, :n] = self.values[:, rows]
        self._lengths[:n] = self.lengths[rows]
        self._use_rows(n)
        if not self.full_width:
            self.length = int(self.lengths.max())


@dataclass
class AttentionInputs:
    """What every attention layer of one forward needs besides its hidden states.

    Without a cache: ``mask``, bool ``[B or 1, 1, T, T]`` (True = may attend) or a FlexAttention ``BlockMask``. With
    a ``cache``: the new positions ``[B, T]``, their segments ``[T]`` (candidate copies verified in one forward;
    None for one copy) and the block size, from which ``mrp_triton.cached_attention`` derives who sees what; and
    ``write_len``, how many leading new positions each layer appends to the cache (0 for a denoising forward).
    ``packed``: the layers' q/k/v and gate/up projections are packed (``modeling_sdar.pack_linears``; the decoder
    packs them), so each group runs as one GEMM (inference only). ``rope``: the cos and sin tables of positions
    0..P-1 side by side, ``[P, 2, head_dim]`` (``modeling_sdar.rotary_cos_sin``'s values), read by position (one
    gather a forward) instead of computed in every forward. Without a cache: ``kv_out``, a dict each layer puts its
    keys and values in under its layer index (``[B, kv_heads, T, head_dim]``, after the k-norm and RoPE); ``kv_in``,
    by layer index the keys and values of positions outside the forward, attended after the forward's own (the
    columns of ``mask`` are the forward's T positions, then these). Training runs the clean half of ``[noisy |
    clean]`` once and the later forwards over the noisy half only this way (``training.losses.mrp_loss_sum``).
    ``tokens``: with a cache, int64 ``[L]``, the places in the flattened ``[B, T]`` grid of ``positions`` that the
    forward computes (a ragged forward: the layers carry ``[1, L, ...]``, :meth:`from_grid` takes a grid tensor's
    computed places; None = every place), and ``riders``, int64 ``[R]``: the rows whose ``write_len`` leading
    positions are computed, the first ``R * write_len`` of the L, row by row (the only ones written to the cache).
    Attention finds each grid position's place through :meth:`places`. The caller leaves out only positions whose
    outputs nobody reads and whose keys nobody attends (positions past their row's current block).
    """

    mask: torch.Tensor | BlockMask | None = None
    cache: StaticKVCache | None = None
    write_len: int = 0
    positions: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    block_size: int = 0
    packed: bool = False
    rope: torch.Tensor | None = None
    kv_out: dict | None = None
    kv_in: dict | None = None
    tokens: torch.Tensor | None = None
    riders: torch.Tensor | None = None
    _write_offsets: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _places: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def write_offsets(self) -> torch.Tensor:
        """The cache slots of this forward's ``write_len`` leading positions, [B, write_len] ([R, write_len] of the
        ``riders`` when ragged): computed by its first layer, read by the others."""
        if self._write_offsets is None:
            offsets = self.cache.write_offsets(self.write_len)
            self._write_offsets = offsets if self.tokens is None else offsets[self.riders]
        return self._write_offsets

    def write(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the ``write_len`` leading positions' keys and values of one layer, [B or 1, kv_heads, T or L,
        head_dim] (ragged: the riders', the first R * write_len of the L places)."""
        n = self.write_len
        if self.tokens is None:
            self.cache.write(slot, keys[:, :, :n], values[:, :, :n], self.write_offsets())
            return
        R = self.riders.shape[0]
        keys, values = (x[0, :, : R * n].unflatten(1, (R, n)).transpose(0, 1) for x in (keys, values))
        self.cache.write(slot, keys, values, self.write_offsets(), rows=self.riders)

    def places(self) -> torch.Tensor | None:
        """Ragged: int64 [B, T], each grid position's index among the L computed ones, -1 where not computed (what
        ``mrp_triton.cached_attention`` reads); computed by the first layer. None when not ragged."""
        if self.tokens is None:
            return None
        if self._places is None:
            B, T = self.positions.shape
            computed = torch.arange(self.tokens.shape[0], device=self.tokens.device)
            self._places = self.tokens.new_full((B * T,), -1).index_copy_(0, self.tokens, computed).view(B, T)
        return self._places

    def computing_rows(self) -> torch.Tensor | None:
        """Ragged: the grid rows that hold every computed place, when those are the riders' written ones only (a
        finished block written in a forward of its own, the prefill's too: the other rows cost nothing, what the CPU
        reference attention exploits); else None (every row may compute places)."""
        if self.tokens is None or self.tokens.shape[0] != self.riders.shape[0] * self.write_len:
            return None
        return self.riders

    def from_grid(self, x: torch.Tensor) -> torch.Tensor:
        """The computed places of ``x`` [B, T, ...]: [1, L, ...] in the order of ``tokens``."""
        return x.flatten(0, 1).index_select(0, self.tokens)[None]
