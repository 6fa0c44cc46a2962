"""The draft vocabulary of speculative decoding: the lm_head rows a draft step scores.

At a large vocabulary the lm_head is most of a draft step's weights (1.7B shape: 0.62 of 0.94 GB), so drafts may
choose among a subset of the token ids (``draft_vocab``): an int N, the ids below N (BPE ids are in merge order,
so these are roughly the frequent tokens; the rows are a view of the lm_head), or the token ids themselves, such
as the N most frequent ones of the user's data (``mrp-train draft-vocab``; the rows are gathered into a buffer of
the decode engine, refreshed from the lm_head at every call); a checkpoint may carry them in its generation config
(``mrp-train draft-vocab --into-generation-config``), for its speculative calls only. Verification scores the whole
vocabulary, so the output stays lossless; only the acceptance depends on the choice.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import torch


def normalize_draft_vocab(value, vocab_size: int) -> int | tuple[int, ...]:
    """``draft_vocab`` as given -> N (the ids below N) or the sorted distinct token ids (a tuple; ids 0..N-1 given
    one by one become N). Accepts an int, a sequence of ints or a 1-D integer tensor; raises TypeError/ValueError
    naming ``draft_vocab`` and the fix otherwise."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"draft_vocab as a tensor must be 1-D integer token ids, got shape {tuple(value.shape)} "
                            f"dtype {value.dtype}")
        value = value.tolist()
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 2:
            raise ValueError(f"draft_vocab={value} must be >= 2")
        if value > vocab_size:
            raise ValueError(f"draft_vocab={value} exceeds the vocabulary ({vocab_size})")
        return value
    if not isinstance(value, Sequence) or isinstance(value, str) or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise TypeError(f"draft_vocab must be an int (the token ids below it) or a sequence of token ids, got "
                        f"{type(value).__name__}")
    ids = sorted(set(value))
    if len(ids) != len(value):
        raise ValueError(f"draft_vocab lists {len(value) - len(ids)} token id(s) more than once: give each once")
    if len(ids) < 2:
        raise ValueError(f"draft_vocab must hold at least 2 token ids, got {len(ids)}")
    if ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"draft_vocab holds ids outside the vocabulary [0, {vocab_size}) (min {ids[0]}, max "
                         f"{ids[-1]}); check the tokenizer they came from")
    return len(ids) if ids[-1] == len(ids) - 1 else tuple(ids)


class DraftHead:
    """The lm_head rows the drafts score: ``weight`` [N, H]; ``ids`` int64 [N], the token id of each column in
    increasing order (None: column c is token c, the ids below N); ``mask_column``, the mask token's column if
    it is among them (the picks exclude it)."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor | None, mask_column: int | None):
        self.weight, self.ids, self.mask_column = weight, ids, mask_column

    def tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """Picked columns (-1: none) -> token ids (-1: none), same shape."""
        if self.ids is None:
            return columns
        return torch.where(columns >= 0, self.ids[columns.clamp(min=0)], columns)

    def columns(self, by_token: torch.Tensor) -> torch.Tensor:
        """A table by token id [V, ...] (such as which tokens are EOS) -> by draft column [N, ...]."""
        return by_token[: self.weight.shape[0]] if self.ids is None else by_token[self.ids]

    def full_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """logits [..., N] over the draft columns -> [..., V] with -inf at the other ids: a column is its token id
        again, so sampled drafts draw the Gumbel noise the backbone's pick of the same token draws. The ids below N
        need no widening (columns are ids already)."""
        if self.ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, logits)


@torch.no_grad()
def draft_head(lm_head_weight: torch.Tensor, draft_vocab: int | tuple[int, ...], mask_id: int,
               buffers: dict) -> DraftHead:
    """The :class:`DraftHead` of a normalized ``draft_vocab`` (:func:`normalize_draft_vocab`). For listed ids the
    rows are gathered into ``buffers`` (the decode engine's, one buffer per vocabulary for the engine's life: its
    captured steps, keyed by the vocabulary, read them at a fixed address) and refreshed from ``lm_head_weight``
    [V, H] now, so weights changed in place since an earlier call are seen."""
    if isinstance(draft_vocab, int):
        return DraftHead(lm_head_weight[:draft_vocab], None, mask_id if mask_id < draft_vocab else None)
    if draft_vocab not in buffers:
        ids = torch.tensor(draft_vocab, dtype=torch.long, device=lm_head_weight.device)
        buffers[draft_vocab] = (ids, lm_head_weight.new_empty(len(draft_vocab), lm_head_weight.shape[1]))
    ids, rows = buffers[draft_vocab]
    torch.index_select(lm_head_weight, 0, ids, out=rows)
    at = bisect.bisect_left(draft_vocab, mask_id)
    return DraftHead(rows, ids, at if at < len(draft_vocab) and draft_vocab[at] == mask_id else None)
