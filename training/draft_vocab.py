"""A draft vocabulary for speculative decoding from token counts of your data (``mrp-train draft-vocab``).

``generate(strategy="speculative", draft_vocab=ids)`` lets the MRP drafts choose among ``ids`` only, each draft
step reading those rows of the lm_head (see ``hf_integration/draft_vocab.py``). The ids below N are BPE merge
order, a rough stand-in for frequency; the N most frequent tokens of the text a model will see cover more of it
(shipped model, 2048 ids, its training files, ``mrp-train draft-vocab --stdlib --size 512``: the 512 most
frequent ids cover 80% of the tokens, the ids below 512 cover 69%). The output stays lossless either way: only the
acceptance of the drafts changes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Iterable

from .data import encode, is_literal, record_to_segments


def token_counts(records: Iterable[dict], tokenizer, batch: int = 256) -> Counter:
    """How often each token id occurs in the records' texts (as the data pipeline segments them), tokenized
    ``batch`` texts at a time (a fast tokenizer encodes a batch in parallel)."""
    counts: Counter = Counter()
    texts = ((text, is_literal(rec)) for rec in records for text, _ in record_to_segments(rec, tokenizer))
    while chunk := list(itertools.islice(texts, batch)):
        for literal in (True, False):
            for ids in encode([text for text, lit in chunk if lit == literal], tokenizer, literal):
                counts.update(ids)
    return counts


def most_frequent_ids(counts: Counter, size: int, vocab_size: int, exclude: Iterable[int] = ()) -> list[int]:
    """The ``size`` most frequent token ids (ties: the lower id), without ``exclude`` (the mask token, which no
    draft may pick); when the data holds fewer distinct tokens, the lowest unseen ids fill the rest. Sorted."""
    if not 2 <= size <= vocab_size:
        raise ValueError(f"--size must be in 2..{vocab_size} (the vocabulary), got {size}")
    skip = set(exclude)
    seen = sorted((i for i in counts if i not in skip and 0 <= i < vocab_size), key=lambda i: (-counts[i], i))
    chosen = seen[:size]
    if len(chosen) < size:
        taken = set(chosen)
        chosen += [i for i in range(vocab_size) if i not in taken and i not in skip][: size - len(chosen)]
    return sorted(chosen)


def coverage(counts: Counter, ids: Iterable[int]) -> float:
    """The share of the counted tokens that ``ids`` holds."""
    total = sum(counts.values())
    return sum(counts[i] for i in set(ids)) / total if total else 0.0
