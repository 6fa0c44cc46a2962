"""Reference confidence over the vocabulary (the oracle and the CPU path of :mod:`mrp_triton.confidence`).

Defined behaviour (shared with the Triton kernel):

* effective logits ``z = (penalized(logits + scale * sum_r residual[r] + bias) + offsets) / temperature`` in fp32
  (fp64 for fp64 logits; the residual is summed in fp32 in order r = 0..R-1; ``bias``: ``logit_bias``, a term by token
  id every row adds; ``penalized``: transformers' repetition penalty at the tokens a row has seen, :func:`penalized`;
  ``offsets``: the row's row of ``logit_offsets``, an additive term such as presence / frequency penalties,
  :func:`offset`: :func:`penalties_applied`; the division is a multiplication by ``1 / temperature``
  rounded to fp32, exactly as the kernel does it; ``temperature`` and the filters may be 0-d tensors on the
  device, so a captured CUDA graph serves every value, ``top_k_max`` then bounding ``top_k``; each also one a row,
  [N]);
* NaN in ``z`` counts as ``-inf``; ``+inf`` is clamped to the largest fp32 (so it stays comparable);
* the ``mask_token_id`` column is excluded (never chosen, not in the softmax), and so is token v in row n when
  ``banned_tokens[v] & ban_rows[n]`` is nonzero (bool or uint8, each bit a class of ban; ``ban_rows`` None: every
  class in every row; :func:`exclude_banned`: how decoding holds EOS back before ``min_new_tokens`` and suppresses
  tokens);
* greedy: ``token = argmax z`` (lowest index on ties); sampling: Gumbel-max
  ``argmax(z_v + g_v)`` with ``g_v = -log(-log(u_v))`` and ``u_v`` from :func:`gumbel_uniform`,
  a counter-based hash of ``(seed, noise_keys[n], v)`` (independent of batch shape and order), among the tokens
  top-h / top-k / top-p / min-p / typical / epsilon / eta keep (:func:`sampling_cut`: a band of values per row,
  ties at its bounds all kept);
* ``prob`` = full-softmax probability of ``token`` under ``z`` (before the filters), ``lse`` =
  logsumexp of ``z`` over the non-excluded vocabulary; with ``entropy=True`` also the entropy (nats) of that full
  softmax, ``log d - t / d`` with ``d = sum exp(z - max z)`` and ``t = sum exp(z - max z) (z - max z)``
  (:func:`softmax_entropy`: the form the kernel accumulates, exact where ``lse`` rounds away its terms);
* skipped rows and rows with no finite candidate: ``token = -1, prob = 0, lse = -inf`` (entropy ``+inf``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D  # multipliers < 2**31, so (x < 2**32) * M never overflows int64
_M2 = 0x2C1B3C6D
_GOLDEN = 0x9E3779B9
FLT_MAX = 3.4028234663852886e38
NOISE_CHUNK = 1 << 18  # Gumbel noise elements a sampled pick hashes at once (pick_tokens)
# the filters sampling_cut applies, in order
CUTS = ("top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
TOP_H_CANDIDATES = 100  # the most likely tokens top-h chooses among (transformers' TopHLogitsWarper.top_n)


def mix32(x):
    """32-bit integer mixer on values in [0, 2**32); works on Python ints and int64 tensors, a tensor in place (pass
    one of your own: one temporary a shift instead of one an operation, for the hash of every token of a sampled pick
    is most of its time on a CPU).

    Bit-identical to ``mrp_triton.confidence._mix32`` (same wrapping-free int64 arithmetic).
    """
    x ^= x >> 16
    x *= _M1
    x &= MASK32
    x ^= x >> 15
    x *= _M2
    x &= MASK32
    x ^= x >> 16
    return x


def seed_hash(seed: int) -> int:
    """Host-side part of the noise hash: folds a Python int seed (any size) into 32 bits."""
    seed = int(seed)
    h = mix32((seed & MASK32) ^ _GOLDEN)
    return mix32(h ^ ((seed >> 32) & MASK32))


def row_hash(seed: int, noise_keys: torch.Tensor) -> torch.Tensor:
    """noise_keys: [N, 3] int64 -> [N] int64 in [0, 2**32): hash of (seed, key0, key1, key2)."""
    k = noise_keys.to(torch.int64)
    h = torch.full_like(k[:, 0], seed_hash(seed))
    for j in range(3):
        h = mix32(h ^ (k[:, j] & MASK32))
        h = mix32(h ^ ((k[:, j] >> 32) & MASK32))
    return h


def gumbel_uniform(seed: int, noise_keys: torch.Tensor, V: int) -> torch.Tensor:
    """[N, V] float32 uniforms in (0, 1), never 0 or 1, of every token id below V: :func:`gumbel_uniform_at`."""
    ids = torch.arange(V, device=noise_keys.device, dtype=torch.int64)
    return gumbel_uniform_at(seed, noise_keys, ids.expand(noise_keys.shape[0], V))


def gumbel_uniform_at(seed: int, noise_keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1), never 0 or 1, of token ``ids`` int64 [N, M] (ids >= 0) under the keys
    [N, 3]: ``((h >> 9) + 0.5) / 2**23`` with h the hash of the row's key and the id."""
    x = mix32(row_hash(seed, noise_keys)[:, None] ^ ids)
    x = mix32(x.add_(_GOLDEN).bitwise_and_(MASK32))
    return x.bitwise_right_shift_(9).to(torch.float32).add_(0.5).mul_(1.0 / 8388608.0)


def gumbel_noise(seed: int, noise_keys: torch.Tensor, V: int) -> torch.Tensor:
    """[N, V] float32 standard Gumbel noise ``-log(-log(u))``."""
    return gumbel_noise_at(seed, noise_keys, torch.arange(V, device=noise_keys.device).expand(noise_keys.shape[0], V))


def gumbel_noise_at(seed: int, noise_keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The noise :func:`gumbel_noise` gives token ``ids`` int64 [N, M] (ids >= 0) under the keys [N, 3]: [N, M]."""
    return gumbel_uniform_at(seed, noise_keys, ids).log_().neg_().log_().neg_()


def inverse_temperature(temperature) -> torch.Tensor:
    """float32 ``1 / temperature``: divided in float64 and rounded to fp32 once, as the kernel multiplies by it.
    ``temperature``: a float, a 0-d tensor (0-d results), or one a row [N] (an [N, 1] result, which scales the rows
    of [N, V] logits); a tensor's result stays on its device (float64 gives exactly the float's result)."""
    if isinstance(temperature, torch.Tensor):
        inverse = (1.0 / temperature.double()).float()
        return inverse[:, None] if inverse.dim() else inverse
    return torch.tensor(1.0 / temperature, dtype=torch.float32)


def penalty_factors(repetition_penalty, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d ``(penalty, 1 / penalty)`` in ``dtype``, each rounded once from float64 (the kernel does the same from a
    number or a 0-d tensor, whose device they keep)."""
    p = torch.as_tensor(repetition_penalty, dtype=torch.float64)
    return p.to(dtype), (1.0 / p).to(dtype)


def penalized(z: torch.Tensor, repetition_penalty, seen_tokens: torch.Tensor,
              seen_rows: torch.Tensor | None = None) -> torch.Tensor:
    """z [N, V] with transformers' repetition penalty (Keskar et al. 2019) at the tokens row n has seen, those
    with ``seen_tokens[seen_rows[n], v]`` nonzero (bool or uint8 [C, V]; ``seen_rows`` int64 [N], None: row n reads
    row n): a negative logit multiplied by the penalty, any other by its inverse (:func:`penalty_factors`; a
    multiplication where transformers divides, so the kernel rounds the same), NaN left NaN."""
    seen = seen_tokens if seen_rows is None else seen_tokens[seen_rows]
    pen, inv = penalty_factors(repetition_penalty, z.dtype)
    pen, inv = pen.to(z.device), inv.to(z.device)
    return torch.where(seen != 0, torch.where(z < 0, z * pen, z * inv), z)


def offset(z: torch.Tensor, logit_offsets: torch.Tensor | None, seen_rows: torch.Tensor | None = None) -> torch.Tensor:
    """z [N, V] plus row n's additive term ``logit_offsets[seen_rows[n]]`` (float32 [C, V]; ``seen_rows`` int64 [N],
    None: row n reads row n; ``logit_offsets`` None: z itself)."""
    if logit_offsets is None:
        return z
    return z + (logit_offsets if seen_rows is None else logit_offsets[seen_rows]).to(z.dtype)


def penalties_applied(z: torch.Tensor, repetition_penalty=None, seen_tokens: torch.Tensor | None = None,
                      seen_rows: torch.Tensor | None = None, logit_offsets: torch.Tensor | None = None,
                      logit_bias: torch.Tensor | None = None) -> torch.Tensor:
    """z [N, V] as the ops see it before the temperature: plus ``logit_bias`` [V] (as transformers' sequence bias
    and vLLM's logit bias come first), the repetition penalty at the seen tokens (:func:`penalized`, with a
    ``repetition_penalty``), then the offsets (:func:`offset`)."""
    if logit_bias is not None:
        z = z + logit_bias.to(z.dtype)
    if repetition_penalty is not None:
        z = penalized(z, repetition_penalty, seen_tokens, seen_rows)
    return offset(z, logit_offsets, seen_rows)


def comparable(z: torch.Tensor) -> torch.Tensor:
    """z (any shape) with NaN -> -inf and +inf -> the largest fp32, so every entry orders against the others."""
    return torch.nan_to_num(z, nan=float("-inf"), posinf=FLT_MAX, neginf=float("-inf"))


def effective_logits(logits, residual=None, *, scale=1.0, temperature=1.0, mask_token_id=None, banned_tokens=None,
                     ban_rows=None, repetition_penalty=None, seen_tokens=None, seen_rows=None, logit_offsets=None,
                     logit_bias=None):
    """z: [N, V] float32 with NaN -> -inf, +inf -> FLT_MAX, mask column and banned tokens -> -inf (the repetition
    bias, the penalty at the seen tokens and the offsets, :func:`penalties_applied`, before the temperature)."""
    z = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    if residual is not None:
        res = residual if residual.dim() == 3 else residual.unsqueeze(0)
        acc = res[0].to(z.dtype)
        for r in range(1, res.shape[0]):
            acc = acc + res[r].to(z.dtype)
        z = z + torch.tensor(scale, dtype=torch.float32) * acc
    z = penalties_applied(z, repetition_penalty, seen_tokens, seen_rows, logit_offsets, logit_bias)
    z = z * inverse_temperature(temperature)
    z = comparable(z)
    if mask_token_id is not None and 0 <= mask_token_id < z.shape[-1]:
        z[:, mask_token_id] = float("-inf")
    return exclude_banned(z, banned_tokens, ban_rows)


def exclude_banned(z: torch.Tensor, banned_tokens: torch.Tensor | None, ban_rows: torch.Tensor | None) -> torch.Tensor:
    """z [N, V] with -inf where ``banned_tokens[v] & ban_rows[n]`` is nonzero (bool or uint8 [V] and [N], each bit
    a class of ban; ``banned_tokens`` None: no ban; ``ban_rows`` None: every class in every row): excluded as the
    mask column is, from the pick and the softmax."""
    if banned_tokens is None:
        return z
    if ban_rows is None:
        return z.masked_fill(banned_tokens[None, :] != 0, float("-inf"))
    classes = ban_rows.to(torch.uint8)[:, None] & banned_tokens.to(torch.uint8)[None, :]
    return z.masked_fill(classes != 0, float("-inf"))


def sampling_cut(z: torch.Tensor, top_k=None, top_p=None, top_k_max: int | None = None, min_p=None,
                 epsilon_cutoff=None, eta_cutoff=None, top_h=None, typical_p=None) -> torch.Tensor:
    """Where top-h, then top-k, top-p, min-p, typical, epsilon and eta (transformers' order) cut each row of z [N, V]:
    ``cut`` [N, 2] float (z's dtype), the band ``low <= z <= high`` of the logits they keep (:func:`kept_by_cut`).

    ``low`` is the value of the r-th largest entry of the row, r = top_k (at most V), or sooner the rank top-h keeps
    (:func:`_top_h_ranks`), or sooner still the first rank >= 1 at which the probability mass ranked before it, under
    the softmax over the values ranked before r, reaches ``top_p`` (a ``top_p`` of 1 keeps every token); then at
    least ``max z + log(min_p)``: min-p keeps the tokens whose probability
    is at least ``min_p`` times the most likely one's, a ratio no normalisation changes, so it cuts after the other
    two by raising low (log(min_p) computed in float64, rounded to z's dtype, whether min_p is a number or a tensor).
    Typical sampling (Meister et al. 2022, :func:`_typical_band`) then keeps a band of the tokens kept so far around
    the entropy, which may leave out the most likely ones: the only filter that lowers ``high`` (+inf without it).
    Epsilon sampling (Hewitt et al. 2022) then keeps the tokens whose probability under the softmax over what the
    cuts before it kept is at least ``epsilon_cutoff``, and eta sampling those at least ``min(eta_cutoff,
    sqrt(eta_cutoff) * exp(-H))``, H the entropy (nats) of the softmax over what the cuts before it kept: each raises
    low to ``lse + log(floor)`` over the tokens kept so far, never above the most likely of them (which stays, as
    transformers' warpers keep ``min_tokens_to_keep = 1``). Every token equal to a bound is kept (ties all kept, as
    transformers' top-k keeps them), so which tokens a cut keeps never depends on their ids, and a kernel applies it
    with two comparisons in its pass over the vocabulary.

    r depends on the row's sorted values only: with ``top_k`` it lies among the first top_k of them, with ``top_h``
    among the first :data:`TOP_H_CANDIDATES`, found by ``torch.topk`` (a partial selection); only top-p alone (and
    typical sampling) sorts the whole row. Every setting may be a 0-d tensor
    (read on the device, so a captured CUDA graph serves every value) or one a row [N] (a row's ``top_k`` of V or
    more, or ``top_h`` above 1, cuts nothing; with top_h one a row every row is sorted whole); ``top_k_max`` (a host
    int) is the largest value such a ``top_k`` tensor holds, which the selection then needs (without it the whole row
    is sorted; an int ``top_k`` is its own)."""
    N, V = z.shape
    low = z.new_full((N,), float("-inf")) if top_k is None and top_p is None and top_h is None else \
        _rank_cut(z, top_k, top_p, top_k_max, top_h)
    cut = torch.stack([low, z.new_full((N,), float("inf"))], dim=-1)
    if min_p is None and typical_p is None and epsilon_cutoff is None and eta_cutoff is None:
        return cut
    top = z.amax(-1)  # the row's most likely token, which min-p never cuts
    if min_p is not None:
        cut[:, 0] = torch.maximum(cut[:, 0], top + _log64(min_p, z))
    if typical_p is not None:
        cut = _typical_band(z, cut, typical_p)
        top = torch.minimum(top, cut[:, 1])  # the most likely token typical sampling kept
    if epsilon_cutoff is not None:
        cut[:, 0] = _floor_cut(top, cut[:, 0], _kept_logits(z, cut), _log64(epsilon_cutoff, z))
    if eta_cutoff is not None:
        kept = _kept_logits(z, cut)
        eta = torch.as_tensor(eta_cutoff, dtype=torch.float64, device=z.device)
        floor = torch.minimum(eta, eta.sqrt() * torch.exp(-softmax_entropy(kept).double()))
        cut[:, 0] = _floor_cut(top, cut[:, 0], kept, torch.log(floor).to(z.dtype))
    return cut


def _typical_band(z: torch.Tensor, cut: torch.Tensor, typical_p) -> torch.Tensor:
    """The cut [N, 2] narrowed by typical sampling (as transformers' TypicalLogitsWarper): under the softmax over the
    tokens ``cut`` keeps, with H its entropy, rank them by ``|-log p - H|`` (lowest first) and keep those ranked no
    worse than the first whose cumulative probability reaches ``typical_p`` (ties with it all kept; ``typical_p``
    1: every token). ``|-log p - H|`` falls then rises with z, so what it keeps is the band from its least to its
    most likely token, which the new cut's bounds are (a row with nothing kept gets low = +inf, high = -inf)."""
    kept = _kept_logits(z, cut)
    log_p = torch.log_softmax(kept, dim=-1)
    entropy = -(log_p * log_p.exp()).nansum(-1, keepdim=True)
    distance = (-log_p - entropy).abs()  # +inf (or NaN in a row with nothing kept) at the tokens cut before
    ranked, order = torch.sort(distance, dim=-1)
    mass = torch.softmax(kept.gather(-1, order), dim=-1).cumsum(-1)
    mass_p = torch.as_tensor(typical_p, device=z.device)
    if mass_p.dim():  # one a row
        mass_p = mass_p[:, None]
    last = (mass < mass_p.to(mass.dtype)).sum(-1, keepdim=True).clamp(max=z.shape[-1] - 1)
    bound = torch.where(mass_p >= 1, float("inf"), ranked.gather(-1, last))
    inside = (distance <= bound) & (kept > float("-inf"))
    least = kept.masked_fill(~inside, float("inf")).amin(-1)
    return torch.stack([least, kept.masked_fill(~inside, float("-inf")).amax(-1)], dim=-1)


def _log64(x, z: torch.Tensor) -> torch.Tensor:
    """log(x) (a number or a 0-d tensor) computed in float64 on z's device, rounded to z's dtype."""
    return torch.log(torch.as_tensor(x, dtype=torch.float64, device=z.device)).to(z.dtype)


def _kept_logits(z: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """z [N, V] with -inf at the tokens the cut [N, 2] drops."""
    return z.masked_fill(~kept_by_cut(z, cut), float("-inf"))


def _floor_cut(top: torch.Tensor, low: torch.Tensor, kept: torch.Tensor, log_floor: torch.Tensor) -> torch.Tensor:
    """A cut's low bound [N] raised so as to keep, of the tokens the cut keeps (``kept`` [N, V]: :func:`_kept_logits`),
    those whose probability under the softmax over them is at least ``exp(log_floor)`` (0-d or [N], the logits'
    dtype), and the most likely of them (``top`` [N], its logit) whatever the floor."""
    return torch.maximum(low, torch.minimum(top, torch.logsumexp(kept, dim=-1) + log_floor))


def _rank_cut(z: torch.Tensor, top_k, top_p, top_k_max: int | None, top_h=None) -> torch.Tensor:
    """The top-h / top-k / top-p part of :func:`sampling_cut`: [N], the value of the last rank they keep."""
    N, V = z.shape
    width = V  # how many of each row's largest values the cut may need
    h_a_row = isinstance(top_h, torch.Tensor) and top_h.dim() > 0
    if h_a_row:  # a row above 1 keeps all V (no cut): every row sorted whole
        width = V
    elif top_h is not None:  # top-h keeps at most TOP_H_CANDIDATES, and needs them all
        width = min(V, TOP_H_CANDIDATES)
    elif isinstance(top_k, torch.Tensor):
        width = min(V, top_k_max or V)
    elif top_k is not None:
        width = min(V, top_k)
    sz = torch.topk(z, width, dim=-1).values if width < V else torch.sort(z, dim=-1, descending=True).values
    ranks = torch.arange(width, device=z.device)
    kept = torch.full((N,), width, dtype=torch.int64, device=z.device)
    if top_h is not None:
        kept = _top_h_ranks(sz[:, :TOP_H_CANDIDATES], top_h)
        if h_a_row:
            kept = torch.where(top_h > 1, width, kept)
    if top_k is not None:
        kept = torch.minimum(kept, top_k.to(torch.int64)) if isinstance(top_k, torch.Tensor) else kept.clamp(max=top_k)
    if top_p is not None:
        p = torch.softmax(sz.masked_fill(ranks >= kept[:, None], float("-inf")), dim=-1).nan_to_num(nan=0.0)
        before = torch.cumsum(p, dim=-1) - p  # mass ranked strictly before each value
        if isinstance(top_p, torch.Tensor) and top_p.dim():  # one a row
            top_p = top_p[:, None]
        reached = (before >= top_p) & (ranks >= 1) & (top_p < 1.0)
        kept = torch.minimum(kept, torch.where(reached, ranks, width).amin(-1))
    return sz.gather(1, (kept - 1)[:, None])[:, 0]


def _top_h_ranks(sz: torch.Tensor, top_h) -> torch.Tensor:
    """int64 [N]: how many of the largest values sz [N, W] (each row sorted, descending: its W =
    ``min(V, TOP_H_CANDIDATES)`` most likely tokens) top-h keeps (Potraghloo et al. 2025, as transformers'
    TopHLogitsWarper): under the softmax over the W, the longest run from the most likely whose entropy terms
    ``-p log p`` sum to at most ``top_h`` (a number, 0-d or one a row) times their total (the W's entropy), at least
    one (``top_h`` 1: all W)."""
    p = torch.softmax(sz, dim=-1).nan_to_num(nan=0.0)
    terms = torch.where(p > 0, -p * torch.log(p), torch.zeros_like(p))
    spent = torch.cumsum(terms, dim=-1)
    h = torch.as_tensor(top_h, device=sz.device).to(sz.dtype)
    budget = spent[:, -1:] * (h[:, None] if h.dim() else h)
    return (spent <= budget).sum(-1).clamp(min=1)


def kept_by_cut(z: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """bool [N, V]: the tokens of z [N, V] a :func:`sampling_cut` cut [N, 2] keeps (``low <= z <= high``)."""
    return (z >= cut[:, :1]) & (z <= cut[:, 1:])


def cuts_anything(cuts: dict) -> bool:
    """Whether ``cuts`` (keyword arguments of :func:`sampling_cut`) set a filter (``top_k_max`` only bounds one)."""
    return any(cuts.get(name) is not None for name in CUTS)


def drop_filtered(score: torch.Tensor, z: torch.Tensor, **cuts) -> torch.Tensor:
    """``score`` [N, V] with -inf at the tokens of z [N, V] that the filters ``cuts`` (keyword arguments of
    :func:`sampling_cut`) drop; as it is when none is set."""
    if not cuts_anything(cuts):
        return score
    return score.masked_fill(~kept_by_cut(z, sampling_cut(z, **cuts)), float("-inf"))


def pick_tokens(z: torch.Tensor, *, do_sample=False, seed=0, noise_keys=None, **cuts):
    """Token per row of effective logits z [N, V]: -1 where no finite candidate. Sampling draws among the tokens
    the filters ``cuts`` keep (keyword arguments of :func:`sampling_cut`); a greedy pick reads no filter.
    ``do_sample``: a bool, or a bool tensor [N] (the rows that sample; the others pick greedily, :func:`sampled_score`).
    The noise is hashed a few rows at a time (about NOISE_CHUNK elements): on a CPU its int64 temporaries then stay
    in cache, which makes a pick over a large vocabulary several times faster than one [N, V] pass."""
    if not may_sample(do_sample):
        best, tok = z.max(dim=-1)  # torch returns the first maximal index
    else:
        step = max(1, NOISE_CHUNK // max(1, z.shape[-1]))
        picks = []
        for i in range(0, max(1, z.shape[0]), step):  # one (empty) chunk for N = 0
            zi = z[i:i + step]  # the cut is a row's own: cut chunk by chunk
            keys = noise_keys[i:i + step]
            score = sampled_score(zi, lambda rows: gumbel_noise(seed, taken(keys, rows), z.shape[-1]),
                                  row_slice(do_sample, i, step), **{k: row_slice(v, i, step) for k, v in cuts.items()})
            picks.append(score.max(dim=-1))
        best, tok = (torch.cat(x) for x in zip(*picks)) if len(picks) > 1 else picks[0]
    return torch.where(best == float("-inf"), torch.full_like(tok, -1), tok)


def may_sample(do_sample) -> bool:
    """Whether a pick given ``do_sample`` (a bool, or a bool tensor of the rows that sample) reads noise."""
    return isinstance(do_sample, torch.Tensor) or bool(do_sample)


def sampled_score(z: torch.Tensor, noise: Callable[[torch.Tensor | None], torch.Tensor], do_sample,
                  **cuts) -> torch.Tensor:
    """What a sampled pick maximises over logits z [N, M]: z plus the Gumbel noise at the tokens the filters ``cuts``
    keep, -inf elsewhere (``noise(rows)``: the noise [n, M] of the rows ``rows``, int64 [n], or of every row for
    None); with ``do_sample`` a bool tensor [N], z itself in the rows that do not sample (a greedy pick), whose noise
    and cut are never computed (on a CPU the noise's hash is most of a sampled pick's cost)."""
    if not isinstance(do_sample, torch.Tensor):
        return drop_filtered(z + noise(None), z, **cuts)
    rows = do_sample.nonzero()[:, 0]
    sampled, score = z[rows], z.clone()
    score[rows] = drop_filtered(sampled + noise(rows), sampled, **{name: taken(value, rows)
                                                                   for name, value in cuts.items()})
    return score


def taken(value, rows: torch.Tensor | None):
    """Rows ``rows`` (int64 [n]; None: all) of a tensor given one a row; any other value as it is."""
    return value[rows] if rows is not None and isinstance(value, torch.Tensor) and value.dim() else value


def row_slice(value, start: int, count: int):
    """Rows start .. start + count - 1 of a setting given one a row (a tensor [N]); any other value as it is."""
    return value[start:start + count] if isinstance(value, torch.Tensor) and value.dim() else value


def softmax_entropy(z: torch.Tensor) -> torch.Tensor:
    """[N] float32: the entropy (nats) of each row's softmax over z [N, V] (-inf entries excluded), as ``log d - t / d``
    with ``d = sum exp(z - m)``, ``t = sum exp(z - m) (z - m)`` and m the row's max; +inf for a row with no finite
    entry."""
    m = z.amax(-1, keepdim=True)
    shifted = z - torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.exp(shifted)
    d = e.sum(-1)
    t = torch.where(e > 0, e * shifted, torch.zeros_like(e)).sum(-1)
    return torch.where(d > 0, torch.log(d) - t / d, torch.full_like(d, float("inf"))).float()


def confidence(logits, residual=None, *, scale=1.0, temperature=1.0, skip_rows=None, mask_token_id=None,
               banned_tokens=None, ban_rows=None, repetition_penalty=None, seen_tokens=None, seen_rows=None,
               logit_offsets=None, logit_bias=None, do_sample=False, seed=0, noise_keys=None, top_k=None, top_p=None,
               top_k_max=None, min_p=None, epsilon_cutoff=None, eta_cutoff=None, top_h=None, typical_p=None,
               entropy=False):
    """logits: [N, V]; residual: None, [N, V] or [R, N, V]; skip_rows: bool [N]; banned_tokens: bool [V];
    ban_rows: bool [N]; seen_tokens: bool [C, V], logit_offsets: float32 [C, V] and seen_rows: int64 [N], logit_bias:
    float32 [V] (:func:`penalties_applied`); noise_keys: int64 [N, 3].

    Returns ``(tokens int64 [N], probs float32 [N], lse float32 [N])``, with ``entropy`` also the entropy float32 [N]
    (see the module docstring). Argument checking lives in :func:`mrp_triton.confidence.confidence`.
    """
    z = effective_logits(logits, residual, scale=scale, temperature=temperature, mask_token_id=mask_token_id,
                         banned_tokens=banned_tokens, ban_rows=ban_rows, repetition_penalty=repetition_penalty,
                         seen_tokens=seen_tokens, seen_rows=seen_rows, logit_offsets=logit_offsets,
                         logit_bias=logit_bias)
    lse = torch.logsumexp(z, dim=-1)
    tok = pick_tokens(z, do_sample=do_sample, seed=seed, noise_keys=noise_keys, top_k=top_k, top_p=top_p,
                      top_k_max=top_k_max, min_p=min_p, epsilon_cutoff=epsilon_cutoff, eta_cutoff=eta_cutoff,
                      top_h=top_h, typical_p=typical_p)
    valid = tok >= 0
    zt = z.gather(1, tok.clamp(min=0)[:, None])[:, 0]
    prob = torch.where(valid, torch.exp(zt - lse), torch.zeros_like(lse))
    lse = torch.where(valid, lse, torch.full_like(lse, float("-inf")))
    return mark_skipped(tok, prob.float(), lse.float(), skip_rows, softmax_entropy(z) if entropy else None)


def mark_skipped(tokens: torch.Tensor, probs: torch.Tensor, lse: torch.Tensor, skip_rows: torch.Tensor | None,
                 entropy: torch.Tensor | None = None) -> tuple:
    """The results of a row in ``skip_rows`` (bool [N], or None): token -1, prob 0, lse -inf (the ops' rule), and of
    ``entropy`` (given: returned fourth), +inf."""
    out = (tokens, probs, lse) + (() if entropy is None else (entropy,))
    if skip_rows is None:
        return out
    fills = (-1, 0.0, float("-inf"), float("inf"))
    return tuple(x.masked_fill(skip_rows, fill) for x, fill in zip(out, fills))
