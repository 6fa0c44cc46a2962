"""Per-position draft candidates of speculative decoding (``draft_candidates=M``).

A draft step scores the corrected logits ``lm_head(h)`` of the block's masked positions; over the whole vocabulary
that is most of its weights at a large vocabulary (1.7B shape: 0.62 of 0.94 GB). But the forward that seeds a
round (the verify forward over the K+1 candidate states, or a block's opening forward) has scored every masked
position over the whole vocabulary already, and the MRP residual mostly reorders the seed's own likely tokens. So
with ``draft_candidates=M`` that forward's fused LM-head confidence also lists each position's M most likely tokens
(``top_m``: same read of the weight), and the round's drafts score only those, ``W[ids] . h`` (M rows of the lm_head
per position instead of V: ``mrp_triton.candidate_confidence``). Verification still scores the whole vocabulary:
the output stays lossless; only the acceptance may drop.

A draft's confidence, which decides the position it takes, needs the softmax normaliser over the whole vocabulary.
It is estimated as the candidates' mass plus the seed's mass outside them (``rest``: the log-sum-exp of the seed's
logits left out of the list, from its log-normaliser), shifted by the mean over the vocabulary of what the draft's
hidden state changes in a logit: ``rest + w_mean . (h - h_seed)`` with ``w_mean`` the mean lm_head row. The shift makes
the estimate invariant to a constant added to every logit (which a residual may carry and a softmax ignores). On
the shipped model (K = 3, bench_e2e's 24 held-out prompts in 3 batches of 8, tokens per backbone forward averaged
over the batches) it recovers most of the acceptance a fixed ``rest`` loses: 2.09 with the whole vocabulary; with
16 candidates 1.93 for a fixed rest, 2.04 shifted, 2.07 with the exact normaliser (computed from the whole logits,
as a check only).
"""

from __future__ import annotations

import torch


def rest_mass(top_logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """log of the unnormalised softmax mass outside a position's listed tokens (the log-sum-exp of the logits left
    out): top_logits [..., M] (-inf past the list) and the log-normaliser lse [...] of the same logits (-inf: the
    position was not scored) -> [...] (-inf, or a remainder at the rounding level of lse, when the list holds all
    of it)."""
    gap = (torch.logsumexp(top_logits, dim=-1) - lse).clamp(max=0.0)  # NaN where lse = -inf: replaced below
    return torch.where(lse == float("-inf"), float("-inf"), lse + torch.log(-torch.expm1(gap)))


@torch.no_grad()
def refresh_vocab_mean(lm_head_weight: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    """The mean lm_head row [H] (of ``lm_head_weight`` [V, H]; float32, float64 for a float64 weight) written into
    ``buffer`` (the decode engine's, at a fixed address for its captured steps; allocated on first use) and
    returned; recomputed at every call, so weights changed in place are seen. (A decode engine is kept for one
    weight dtype and device, so its buffer always fits.)"""
    dtype = torch.promote_types(lm_head_weight.dtype, torch.float32)
    if buffer is None:
        buffer = torch.empty(lm_head_weight.shape[1], dtype=dtype, device=lm_head_weight.device)
    return torch.mean(lm_head_weight, dim=0, dtype=dtype, out=buffer)
