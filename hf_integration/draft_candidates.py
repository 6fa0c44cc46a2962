"""Per-position draft candidates of speculative decoding (``draft_candidates=M``).

A draft step scores the corrected logits ``lm_head(h)`` of the block's masked positions; over the whole vocabulary
that is most of its weights at a large vocabulary (1.7B shape: 0.62 of 0.94 GB). But the forward that seeds a
round (the verify forward over the K+1 candidate states, or a block's opening forward) has scored every masked
position over the whole vocabulary already, and the MRP residual mostly reorders the seed's own likely tokens. So
with ``draft_candidates=M`` that forward's fused LM-head confidence also lists each position's M most likely tokens
(``top_m``: same read of the weight), and the round's drafts score only those, ``W[ids] . h`` (M rows of the lm_head
per position instead of V). Verification still scores the whole vocabulary: the output stays lossless; only the
acceptance may drop.

A draft's confidence, which decides the position it takes, needs the softmax normaliser over the whole vocabulary.
It is estimated as the candidates' mass plus the seed's mass outside them (``rest``: log of the seed's softmax
mass outside the list, from its log-normaliser), shifted by the mean over the vocabulary of what the draft's hidden
state changes in a logit: ``rest + w_mean . (h - h_seed)`` with ``w_mean`` the mean lm_head row. The shift makes
the estimate invariant to a constant added to every logit (which a residual may carry and a softmax ignores). On
the shipped model (K = 3, bench_e2e's 24 held-out prompts in 3 batches of 8, tokens per backbone forward averaged
over the batches) it recovers most of the acceptance a fixed ``rest`` loses: 2.09 with the whole vocabulary; with
16 candidates 1.93 for a fixed rest, 2.04 shifted, 2.07 with the exact normaliser (computed from the whole logits,
as a check only).
"""

from __future__ import annotations

import torch

from mrp_triton.reference.confidence import filter_top_k_top_p, gumbel_noise_at, inverse_temperature


def rest_mass(top_logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """log of the softmax mass outside a position's listed tokens: top_logits [..., M] (-inf past the list) and the
    log-normaliser lse [...] of the same logits (-inf: the position was not scored) -> [...] (-inf, or a remainder at
    the rounding level of lse, when the list holds all of it)."""
    inside = torch.logsumexp(top_logits, dim=-1)
    gap = torch.where(lse == float("-inf"), 0.0, (inside - lse).clamp(max=0.0))
    return torch.where(lse == float("-inf"), float("-inf"), lse + torch.log(-torch.expm1(gap)))


@torch.no_grad()
def refresh_vocab_mean(lm_head_weight: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    """The mean lm_head row float32 [H] (of ``lm_head_weight`` [V, H]) written into ``buffer`` (the decode engine's,
    at a fixed address for its captured steps; allocated on first use) and returned; recomputed at every call, so
    weights changed in place are seen."""
    if buffer is None:
        buffer = torch.empty(lm_head_weight.shape[1], dtype=torch.float32, device=lm_head_weight.device)
    return torch.mean(lm_head_weight, dim=0, dtype=torch.float32, out=buffer)


def candidate_pick(lm_head_weight: torch.Tensor, vocab_mean: torch.Tensor, hidden: torch.Tensor,
                   seed_hidden: torch.Tensor, ids: torch.Tensor, rest: torch.Tensor, scored: torch.Tensor, *,
                   temperature=1.0, noise_keys: torch.Tensor | None = None, top_k=None, top_p=None):
    """A draft pick per position among its listed tokens.

    lm_head_weight [V, H]; vocab_mean float32 [H] (:func:`refresh_vocab_mean`); hidden, seed_hidden [B, T, H] (the
    draft's hidden state and the seed's); ids int64 [B, T, M] (-1 past a position's list) and rest float32 [B, T]
    (:func:`rest_mass`), both in units of logits / temperature; scored: bool [B, T] (the positions to pick at);
    temperature: float or 0-d tensor. Sampling (``noise_keys`` int64 [B, T, 3]) adds the Gumbel noise the
    backbone's pick draws for the same token and key (``mrp_triton.confidence``), after top-k / top-p applied
    among the listed tokens. Returns tokens int64 [B, T] (-1 where not scored or nothing listed) and confidences
    float32 [B, T] (0 there): ``exp(z_token - lse)`` with z the listed tokens' logits / temperature and lse their
    log-sum-exp together with ``rest + vocab_mean . (hidden - seed_hidden) / temperature``.
    """
    B, T, M = ids.shape
    listed = ids >= 0
    acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 for fp64 models (exact tests)
    rows = lm_head_weight[ids.clamp(min=0)].to(acc)  # [B, T, M, H]
    inv_t = inverse_temperature(temperature).to(hidden.device)
    z = torch.einsum("bth,btmh->btm", hidden.to(acc), rows) * inv_t
    z = z.masked_fill(~listed, float("-inf"))
    shift = (hidden.to(acc) - seed_hidden.to(acc)) @ vocab_mean.to(acc) * inv_t
    lse = torch.logaddexp(torch.logsumexp(z, dim=-1), rest + shift)
    score = z
    if noise_keys is not None:
        flat = z.reshape(B * T, M)
        if top_k is not None or top_p is not None:
            flat = filter_top_k_top_p(flat, top_k, top_p)
        score = (flat + gumbel_noise_at(0, noise_keys.reshape(B * T, 3), ids.clamp(min=0).reshape(B * T, M))).view(
            B, T, M)
    best, at = score.max(dim=-1)  # the first maximal column
    take = scored & (best > float("-inf"))
    tokens = torch.where(take, ids.gather(-1, at[..., None])[..., 0], -1)
    conf = torch.where(take, torch.exp(z.gather(-1, at[..., None])[..., 0] - lse), 0.0)
    return tokens, conf
