"""Reference greedy token, confidence and log-normaliser of ``lm_head(hidden) [+ base_logits]`` (and its top m)."""

from __future__ import annotations

import torch

from .confidence import comparable, exclude_banned, mark_skipped, penalties_applied, softmax_entropy


def lm_head_confidence(hidden: torch.Tensor, weight: torch.Tensor, *, base_logits: torch.Tensor | None = None,
                       mask_token_id: int | None = None, banned_tokens: torch.Tensor | None = None,
                       ban_rows: torch.Tensor | None = None, temperature: float = 1.0,
                       skip_rows: torch.Tensor | None = None, top_m: int = 0, entropy: bool = False,
                       repetition_penalty=None, seen_tokens: torch.Tensor | None = None,
                       seen_rows: torch.Tensor | None = None, logit_offsets: torch.Tensor | None = None,
                       logit_bias: torch.Tensor | None = None):
    """Per row: the argmax of ``z = (penalized(hidden @ weight.T [+ base_logits] + bias) + offsets) / temperature``
    (``bias``: ``logit_bias``, float32 [V]; ``penalized``: with a ``repetition_penalty``, at the columns row n has seen,
    :func:`.confidence.penalized`; ``offsets``: row n's row of ``logit_offsets``, float32 [C, V] read at
    ``seen_rows[n]``: :func:`.confidence.penalties_applied`) and its
    probability under the full softmax of z, the ``mask_token_id`` column excluded from both, and so is column v in
    row n when ``banned_tokens[v] & ban_rows[n]`` is nonzero (:func:`.confidence.exclude_banned`).
    NaN in z counts as -inf and +inf as the largest fp32; rows in ``skip_rows`` (bool [N]) and rows with no finite z
    give token -1, prob 0, lse -inf (all as in ``confidence``).

    hidden: [N, H] (cast to weight's dtype before the matmul, which runs with fp32 accumulation),
    weight: [V, H], base_logits: [N, V] or None (any float dtype, added in fp32; fp64 weights: all in fp64).
    Returns (tokens int64 [N], probs float32 [N], lse float32 [N]) with ``lse = logsumexp(z)``
    and ``probs = exp(max z - lse)``; with ``entropy``, the entropy float32 [N] of the softmax of z fourth
    (:func:`.confidence.softmax_entropy`; +inf where the token is -1). Ties: the lowest vocabulary index wins. With
    ``top_m`` > 0 also
    (top_logits float32 [N, top_m], top_ids int64 [N, top_m]): the top_m largest z of each row, largest first,
    ties to the lowest index (:func:`top_by_value`); the mask column and skipped rows give -inf / -1.
    Builds the [N, V] fp32 logits (this is the oracle and the CPU path, not the fast path).
    """
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    z = hidden.to(weight.dtype).to(acc) @ weight.to(acc).T
    if base_logits is not None:
        z = z + base_logits.to(acc)
    z = comparable(penalties_applied(z, repetition_penalty, seen_tokens, seen_rows, logit_offsets, logit_bias)
                   / temperature)
    if mask_token_id is not None:
        z[:, mask_token_id] = float("-inf")
    z = exclude_banned(z, banned_tokens, ban_rows)
    lse = torch.logsumexp(z, dim=-1)
    tokens = torch.argmax(z, dim=-1)  # documented: first maximal index
    zmax = z.gather(1, tokens[:, None]).squeeze(1)
    no_finite = zmax == float("-inf")
    skip_rows = no_finite if skip_rows is None else skip_rows | no_finite
    picks = mark_skipped(tokens, torch.exp(zmax - lse).float(), lse.float(), skip_rows,
                         softmax_entropy(z) if entropy else None)
    if not top_m:
        return picks
    if skip_rows is not None:
        z = z.masked_fill(skip_rows[:, None], float("-inf"))
    top, ids = top_by_value(z.float(), top_m)
    return (*picks, top, ids.masked_fill(top == float("-inf"), -1))


def top_by_value(values: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The m largest of ``values`` float32 [N, L] per row (m <= L), largest first, equal values in increasing column:
    (values [N, m], columns int64 [N, m]). One ``topk`` over distinct int64 keys (no full sort): the value's bits
    mapped to an order-preserving int32 (negative floats have their magnitude bits flipped; -0.0 is made +0.0
    first) in the high half, the column reversed in the low half."""
    bits = (values + 0.0).view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    column = torch.arange(values.shape[1], device=values.device)
    _, at = ((ordered << 32) | (0xFFFFFFFF - column)).topk(m, dim=1)
    return values.gather(1, at), at
