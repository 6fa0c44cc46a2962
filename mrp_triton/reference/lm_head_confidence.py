"""Reference greedy token, confidence and log-normaliser of ``lm_head(hidden) [+ base_logits]``."""

from __future__ import annotations

import torch

from .confidence import mark_skipped


def lm_head_confidence(hidden: torch.Tensor, weight: torch.Tensor, *, base_logits: torch.Tensor | None = None,
                       mask_token_id: int | None = None, temperature: float = 1.0,
                       skip_rows: torch.Tensor | None = None):
    """Per row: the argmax of ``z = (hidden @ weight.T [+ base_logits]) / temperature`` and its
    probability under the full softmax of z, the ``mask_token_id`` column excluded from both.
    Rows in ``skip_rows`` (bool [N]) give token -1, prob 0, lse -inf (as in ``confidence``).

    hidden: [N, H] (cast to weight's dtype before the matmul, which runs with fp32 accumulation),
    weight: [V, H], base_logits: [N, V] or None (any float dtype, added in fp32; fp64 weights: all in fp64).
    Returns (tokens int64 [N], probs float32 [N], lse float32 [N]) with ``lse = logsumexp(z)``
    and ``probs = exp(max z - lse)``. Ties: the lowest vocabulary index wins.
    Builds the [N, V] fp32 logits (this is the oracle and the CPU path, not the fast path).
    """
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    z = hidden.to(weight.dtype).to(acc) @ weight.to(acc).T
    if base_logits is not None:
        z = z + base_logits.to(acc)
    z = z / temperature
    if mask_token_id is not None:
        z[:, mask_token_id] = float("-inf")
    lse = torch.logsumexp(z, dim=-1)
    tokens = torch.argmax(z, dim=-1)  # documented: first maximal index
    zmax = z.gather(1, tokens[:, None]).squeeze(1)
    return mark_skipped(tokens, torch.exp(zmax - lse).float(), lse.float(), skip_rows)
