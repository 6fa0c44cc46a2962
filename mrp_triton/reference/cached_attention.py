"""Reference attention of a decoding forward: new positions over a committed KV-cache prefix and themselves."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                     cache_v: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor, block_size: int,
                     segments: torch.Tensor | None = None, places: torch.Tensor | None = None,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention (scale 1/sqrt(D), grouped-query heads) of T new positions.

    q: [B, Hq, T, D]; k, v: [B, Hkv, T, D] (the new positions); cache_k, cache_v: [B, Hkv, W, D] of
    which row b's first ``lengths[b]`` slots are committed (the rest is ignored, but must be finite here: SDPA
    weighs it by zero, and 0 x NaN is NaN; the static cache starts zeroed); lengths: int64 [B];
    positions: int64 [B, T] (absolute, past the row's committed prefix); segments: int [T] or None.
    A new position sees every committed slot of its row and the new keys of its own or an earlier
    block (block = position // block_size) in its own segment or in a negative (shared) one: a finished
    block written in the same forward as K+1 candidate copies is seen by every copy. Returns
    [B, Hq, T, D] in q's dtype.

    Ragged (``places`` int64 [B, T]): q, k, v are [1, H, L, D], grid position (b, t) of ``positions`` at index
    places[b, t] of L, or not computed where it is -1 (neither a query nor a key); returns [1, Hq, L, D]. ``rows``
    (ragged; int64 [R] or None): grid rows that hold every computed place, the only ones attended (a prefill that
    some rows compute costs theirs only)."""
    if places is not None:
        if rows is not None:
            places, positions, lengths = places[rows], positions[rows], lengths[rows]
            cache_k, cache_v = cache_k[rows], cache_v[rows]
        return _ragged(q, k, v, cache_k, cache_v, lengths, positions, block_size, segments, places)
    B, _, T, _ = q.shape
    W = cache_k.shape[2]
    committed = torch.arange(W, device=q.device)[None, :] < lengths[:, None]  # [B, W]
    blocks = positions // block_size
    new = blocks[:, None, :] <= blocks[:, :, None]  # [B, T (query), T (key)]
    if segments is not None:
        new = new & ((segments[:, None] == segments[None, :]) | (segments[None, :] < 0))
    mask = torch.cat([committed[:, None, :].expand(B, T, W), new], dim=-1)[:, None]
    return F.scaled_dot_product_attention(q, torch.cat([cache_k, k], dim=2), torch.cat([cache_v, v], dim=2),
                                          attn_mask=mask, enable_gqa=True)


def _ragged(q, k, v, cache_k, cache_v, lengths, positions, block_size, segments, places) -> torch.Tensor:
    """:func:`cached_attention` of a ragged forward: q, k, v put on the [B, T] grid (zeros where not computed, their
    positions moved past every block, so no computed query sees them), attended, the computed places taken back.
    Every shape is fixed by the inputs' (no boolean indexing): it runs inside a CUDA graph capture."""
    B, T = places.shape
    L = q.shape[2]
    flat = places.flatten()
    live = flat >= 0

    def grid(x: torch.Tensor) -> torch.Tensor:  # [1, H, L, D] -> [B, H, T, D]
        rows = x[0].transpose(0, 1).index_select(0, flat.clamp(min=0)).masked_fill(~live[:, None, None], 0)
        return rows.view(B, T, x.shape[1], x.shape[3]).transpose(1, 2)

    past = (positions.max() // block_size + 1) * block_size  # a block after every computed position's
    out = cached_attention(grid(q), grid(k), grid(v), cache_k, cache_v, lengths,
                           torch.where(places >= 0, positions, past), block_size, segments)
    rows = out.transpose(1, 2).reshape(B * T, q.shape[1], q.shape[3])
    # grid places not computed all go to a spare row L, dropped after
    taken = rows.new_zeros((L + 1, q.shape[1], q.shape[3])).index_copy_(0, torch.where(live, flat, L), rows)
    return taken[None, :L].transpose(1, 2)
