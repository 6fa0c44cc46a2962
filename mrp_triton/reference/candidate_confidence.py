"""Reference pick among listed tokens (the oracle and the CPU path of :mod:`mrp_triton.candidate_confidence`).

Defined behaviour (shared with the Triton kernel), per row n of N:

* listed logits ``z_j = (penalized(hidden_n . weight[ids_nj] + bias_j) + offset_nj) * (1 / temperature)`` for the
  listed ids (``ids_nj >= 0``; ``bias_j``: ``logit_bias`` at the listed token; ``penalized``: the repetition penalty
  at the listed tokens the row has seen, as :func:`.confidence.penalized`; ``offset_nj``: the row's ``logit_offsets``
  at the listed token, as :func:`.confidence.offset`),
  -inf past the list (id -1), computed in fp32 (fp64 for fp64 operands); ``1 / temperature`` rounded to fp32 as
  in :func:`.confidence.inverse_temperature`; NaN counts as -inf and +inf as the largest fp32
  (:func:`.confidence.comparable`);
* the softmax normaliser is estimated as ``lse = logaddexp(logsumexp_j z_j, rest_n + shift_n)``: ``rest`` is the
  log of the mass outside the list (in units of logits / temperature), ``shift_n = ((hidden_n - seed_hidden_n) .
  vocab_mean) / temperature`` moves it with the hidden state;
* greedy: the first listed token with the largest z; sampling: Gumbel-max ``argmax_j (z_j + g(ids_nj))`` with the
  noise :func:`.confidence.gumbel_noise_at` gives that token id under ``(seed, noise_keys[n])`` (the noise the
  full-vocabulary pick draws for it), after top-h / top-k / top-p / min-p / typical / epsilon / eta applied among
  the listed tokens (:func:`.confidence.sampling_cut`);
* ``prob = exp(z_token - lse)``; skipped rows and rows with nothing listed: token -1, prob 0.
"""

from __future__ import annotations

import torch

from .confidence import (comparable, gumbel_noise_at, inverse_temperature, may_sample, penalties_applied,
                         sampled_score, taken)


def listed_logits(hidden, weight, ids, rest, seed_hidden, vocab_mean, temperature=1.0, repetition_penalty=None,
                  seen_tokens=None, seen_rows=None, logit_offsets=None, logit_bias=None):
    """hidden, seed_hidden [N, H]; weight [V, H]; ids int64 [N, M]; rest [N]; vocab_mean [H] ->
    (z [N, M], lse [N]), float32 (float64 for float64 operands); with ``repetition_penalty``, the listed tokens row n
    has seen (``seen_tokens`` [C, V] read at row ``seen_rows[n]``, as :func:`.confidence.penalized`) penalized, then
    with ``logit_offsets`` (float32 [C, V], read at the same row) each listed token's offset added, before the
    temperature; with ``logit_bias`` (float32 [V]) each listed token's bias added before the penalty
    (:func:`.confidence.penalties_applied` at the listed tokens; the mass outside the list is as estimated)."""
    acc = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    inv_t = inverse_temperature(temperature).to(hidden.device, acc)
    listed, at = ids >= 0, ids.clamp(min=0)
    rows = weight[at].to(acc)  # [N, M, H]
    dots = torch.einsum("nh,nmh->nm", hidden.to(acc), rows)

    def at_listed(table):  # row n's row of a table [C, V] (or None) at its listed tokens: [N, M]
        return None if table is None else (table if seen_rows is None else table[seen_rows]).gather(1, at)

    dots = penalties_applied(dots, repetition_penalty, at_listed(seen_tokens), None, at_listed(logit_offsets),
                             None if logit_bias is None else logit_bias[at])
    z = comparable(dots * inv_t)
    z = z.masked_fill(~listed, float("-inf"))
    shift = (hidden.to(acc) - seed_hidden.to(acc)) @ vocab_mean.to(acc) * inv_t.reshape(-1)
    return z, torch.logaddexp(torch.logsumexp(z, dim=-1), rest.to(acc) + shift)


def pick_listed(z, lse, ids, *, skip_rows=None, do_sample=False, seed=0, noise_keys=None, **cuts):
    """The pick of :func:`candidate_confidence` from its listed logits z [N, M] and normaliser lse [N], sampling
    among what the filters ``cuts`` (keyword arguments of :func:`.confidence.sampling_cut`) keep of the listed
    tokens: (tokens int64 [N], probs float32 [N])."""
    score = z
    if may_sample(do_sample):
        listed = ids.clamp(min=0)
        score = sampled_score(z, lambda rows: gumbel_noise_at(seed, taken(noise_keys, rows), taken(listed, rows)).to(
            z.dtype), do_sample, **cuts)
    best, at = score.max(dim=-1)  # the first maximal column
    take = best > float("-inf")
    if skip_rows is not None:
        take = take & ~skip_rows
    tokens = torch.where(take, ids.gather(1, at[:, None])[:, 0], -1)
    probs = torch.where(take, torch.exp(z.gather(1, at[:, None])[:, 0] - lse), 0.0)
    return tokens, probs.float()


def candidate_confidence(hidden, weight, ids, rest, *, seed_hidden, vocab_mean, temperature=1.0, skip_rows=None,
                         do_sample=False, seed=0, noise_keys=None, top_k=None, top_p=None, min_p=None,
                         epsilon_cutoff=None, eta_cutoff=None, top_h=None, typical_p=None, repetition_penalty=None,
                         seen_tokens=None, seen_rows=None, logit_offsets=None, logit_bias=None):
    """Per row the pick among its listed token ids and its estimated full-softmax probability (module docstring).
    Argument checking lives in :func:`mrp_triton.candidate_confidence.candidate_confidence`."""
    z, lse = listed_logits(hidden, weight, ids, rest, seed_hidden, vocab_mean, temperature, repetition_penalty,
                           seen_tokens, seen_rows, logit_offsets, logit_bias)
    return pick_listed(z, lse, ids, skip_rows=skip_rows, do_sample=do_sample, seed=seed, noise_keys=noise_keys,
                       top_k=top_k, top_p=top_p, min_p=min_p, epsilon_cutoff=epsilon_cutoff, eta_cutoff=eta_cutoff,
                       top_h=top_h, typical_p=typical_p)
