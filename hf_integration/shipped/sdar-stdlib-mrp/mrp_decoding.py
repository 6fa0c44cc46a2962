"""Decoding with the MRP head (method.md section 5): direct, lossless speculative, and remask.

Conventions shared by all three (section 3): the MRP head reads ``ids`` = the block *after* the
newest commit and ``h`` = the backbone's post-norm hidden state from the state *before* it. Chained
steps (mode ``logits_sum``) feed ``h_A + s * sum h_p`` and score ``lm_head(h_A + s * sum h_p)``
(= A + s * sum C, lm_head being linear); mode ``none`` (direct-distillation heads) scores
``lm_head(h_p)`` and feeds ``h_p`` on. The head always reads its own prefix cache.
"""

from __future__ import annotations

import torch

import mrp_triton
from mrp_triton.reference.confidence import inverse_temperature, penalties_applied

from .decoding import BlockDecoder, Strategy, by_token, denoising_step
from .draft_candidates import rest_mass


class MRPChain:
    """K chained MRP steps from one backbone forward. h_A: [B, T, H] (post-norm). ``carry`` [B, T, H] is the chain's
    state: the residual sum so far (``logits_sum``; zeros at the start) or the last h_p (``none``; h_A at the start).
    Each step feeds the head ``h_A + s * carry`` (``logits_sum``) or ``carry``, the hidden state the step before
    returned (computed once: a launch per step fewer on a GPU)."""

    def __init__(self, dec: BlockDecoder, h_a: torch.Tensor, positions: torch.Tensor,
                 carry: torch.Tensor | None = None):
        self.dec, self.h_a, self.positions = dec, h_a, positions
        self.scale = dec.settings.mrp_scale
        self.summed = dec.settings.mrp_mix == "logits_sum"
        self._carry = carry  # None: the start of a chain
        self._fed = h_a if carry is None else self._corrected()

    @property
    def carry(self) -> torch.Tensor:
        if self._carry is None:
            return torch.zeros_like(self.h_a) if self.summed else self.h_a
        return self._carry

    def _corrected(self) -> torch.Tensor:
        return torch.add(self.h_a, self._carry, alpha=self.scale) if self.summed else self._carry

    def step(self, ids: torch.Tensor, committing_rows_discard: bool = False) -> torch.Tensor:
        """ids: [B, T] (state after the newest commit) -> the hidden state whose lm_head gives the
        corrected logits, [B, T, H] (``committing_rows_discard``: see :meth:`BlockDecoder.mrp`)."""
        h_p = self.dec.mrp(ids, self._fed, self.positions, committing_rows_discard=committing_rows_discard)
        self._carry = self._carry + h_p if self.summed and self._carry is not None else h_p
        self._fed = self._corrected()
        return self._fed


def _one_each(masked: torch.Tensor) -> torch.Tensor:
    """Quota of one token for every row that still has a masked position. masked: bool [B, T] -> [B]."""
    return masked.any(-1).long()


def _drafted(states: torch.Tensor, iota: torch.Tensor):
    """The position each draft step committed and its token, from the candidate states C(0..K) [B, K+1, T] (a draft
    step commits one token, which changes its state at that position): draft_pos, draft_tok [B, K], -1 where a step
    committed nothing. iota: int64 0, 1, 2, ... (at least T of them; the engine's)."""
    T = states.shape[-1]
    after = states[:, 1:]
    pos = torch.where(after != states[:, :-1], iota[:T], T).amin(-1)
    none = pos == T
    tok = after.gather(2, pos.clamp(max=T - 1)[..., None])[..., 0]
    return pos.masked_fill(none, -1), tok.masked_fill(none, -1)


def verified_commits(draft_pos: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor,
                     *targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What a verify round committed and, of each of the backbone's ``targets`` on the candidate states C(0..K)
    ([B, K+1, T, ...]: its confidences, its top log-probabilities ...), the committed tokens' values, from the drafts'
    positions draft_pos [B, K] (-1: none), the accepted lengths [B] and the bonus positions [B] (-1: none): accepted
    draft k at its position under C(k), the bonus under C(accepted) (what ``verify_drafts`` compares and commits).
    Returns committed (bool [B, T]) and each target's values [B, T, ...] (0 where nothing was committed)."""
    B, copies, T = targets[0].shape[:3]
    K = copies - 1
    steps = torch.arange(K, device=draft_pos.device).expand(B, K)
    where = torch.cat([draft_pos, bonus[:, None]], 1)  # [B, K+1]: the positions committed, in order
    ok = torch.cat([steps < accepted[:, None], bonus[:, None] >= 0], 1)
    copy = torch.cat([steps, accepted[:, None]], 1)  # the candidate state each was verified on
    rows = torch.arange(B, device=draft_pos.device)[:, None]
    slot = torch.where(ok, where, T)  # a spare column T takes what was not committed
    committed = ok.new_zeros((B, T + 1)).scatter_(1, slot, ok)
    values = []
    for target in targets:
        value = target.new_zeros((B, T + 1, *target.shape[3:]))
        value[rows, slot] = target[rows, copy, where.clamp(min=0)]  # (what lands on the spare column is dropped)
        values.append(value[:, :T])
    return committed[:, :T], *values


def direct_steps(dec: BlockDecoder) -> tuple:
    """The two kinds of direct step, each ``(block [B, T], positions [B, T], h_A [B, T, H], carry [B, T, H]) ->
    None``, updating the block and the chain's state (h_A, carry) in place: ``backbone`` commits the backbone's
    pick per row and starts a chain from its h_A; ``mrp`` runs the chain's next MRP step from h_A and the carry and
    commits its most confident pick per row."""
    backbone_step = denoising_step(dec)

    def backbone(block: torch.Tensor, positions: torch.Tensor, h_a: torch.Tensor, carry: torch.Tensor) -> None:
        h_a.copy_(backbone_step(block, positions, _one_each(dec.masked(block))))
        carry.copy_(MRPChain(dec, h_a, positions).carry)

    def mrp(block: torch.Tensor, positions: torch.Tensor, h_a: torch.Tensor, carry: torch.Tensor) -> None:
        chain = MRPChain(dec, h_a, positions, carry)
        # one token a row: a row without masks has no picks (token -1), so it commits nothing
        dec.commit_picks(block, chain.step(block), positions, dec.masked(block), 1, mrp=True)
        carry.copy_(chain.carry)

    return ("denoise", backbone), ("direct_mrp", mrp)


def decode_direct(dec: BlockDecoder, block: torch.Tensor, positions: torch.Tensor, steps: int) -> None:
    """One backbone forward commits its pick, then K MRP steps commit one token each (not lossless).

    Every step commits exactly one token per row that has a mask, and the rows start their blocks together
    (an MRP step needs the backbone forward of its row's block): ``steps`` (the most masks of any row)
    fill every block, one host synchronisation per block, as static decoding (and a check where a row's last
    block ends before the block does, or after the first step when an EOS may settle a row: the chain, h_A and
    its carry in ``row_state``, goes on over it; with ``device_loop`` the steps after it run in one graph)."""
    K, state = dec.settings.mrp_steps, dec.row_state
    backbone, mrp = direct_steps(dec)
    if "h_a" not in state:  # every row opens its block with a backbone step, which sets both
        B, T = block.shape
        state["h_a"] = block.new_zeros((B, T, dec.model.config.hidden_size), dtype=dec.model.lm_head.weight.dtype)
        state["carry"] = torch.zeros_like(state["h_a"])
    dec.steps((backbone, *[mrp] * K), block, positions, state["h_a"], state["carry"], count=steps,
              mutated=(0, 2, 3), phase=dec.block_steps % (K + 1))


def _draft(dec: BlockDecoder, block: torch.Tensor, positions: torch.Tensor, seed: tuple, fresh: torch.Tensor):
    """K one-token drafts from the current state C(0) = block and the round's ``seed`` (h_seed [B, T, H], with
    ``draft_candidates`` also its listed ids [B, T, M] and rest mass [B, T]); rows at the start of a block
    (``fresh``, bool [B]: no seed forward yet) draft nothing.

    Returns draft_pos, draft_tok [B, K] (-1 = no draft), the candidate states [B, K+1, T] and their masked
    positions (bool [B, K+1, T])."""
    K, authors = dec.settings.mrp_steps, dec.settings.draft_schedule == "authors"
    seed_h = seed[0]
    drafting = ~fresh[:, None]
    state, states = block.clone(), [block]
    chain = MRPChain(dec, seed_h, positions)
    for k in range(K):
        masked = dec.masked(state) & drafting
        # the authors' first draft is the backbone's own (stale) pick from the seed forward
        hidden = seed_h if k == 0 and authors else chain.step(state, committing_rows_discard=True)
        seen = dec.penalties(state)
        if len(seed) > 1:
            tok, conf = dec.pick_listed(hidden, seed, positions, masked, dec.noise_counter(k), seen)
        else:
            tok, conf, _ = dec.pick_hidden(hidden, positions, masked, dec.noise_counter(k), dec.draft, seen=seen)
        # one token a row: rows with nothing masked (or not drafting) have no picks (token -1) and commit nothing
        mrp_triton.select_commit(state, tok, conf, mask_token_id=dec.mask_id, n=1)
        states.append(state.clone() if k < K - 1 else state)
    states = torch.stack(states, 1)
    candidates = states == dec.mask_id
    # an MRP forward for every row that had a mask to draft at (committing rows are fresh)
    dec.count("mrp_forwards", (candidates[:, int(authors):K].any(-1) & drafting).sum(-1))
    return (*_drafted(states, dec.engine.iota), states, candidates)


def seed_of(h: torch.Tensor, picks: tuple, at=lambda x: x) -> tuple:
    """The seed of the next round from its forward's hidden states h [B, T, H] and picks (:meth:`pick_hidden`
    with ``top_m``: tokens, conf, lse, top logits, ids): (h,), with draft candidates (h, ids, rest mass); ``at``
    selects each tensor's part that seeds (a verify forward's accepted copy), only of the tensors used."""
    if len(picks) == 3:
        return (at(h),)
    _, _, lse, top, ids = picks
    return at(h), at(ids), rest_mass(at(top), at(lse))


def opening_step(dec: BlockDecoder):
    """The step ``(block [B, T], positions [B, T], quota [B]) -> the seed`` (see :func:`seed_of`) of rows opening their
    blocks together: one backbone forward commits each row's quota of its own picks into ``block`` in place."""
    top_m = dec.settings.draft_candidates or 0

    def step(block: torch.Tensor, positions: torch.Tensor, quota: torch.Tensor) -> tuple:
        masked = dec.masked(block)
        hidden = dec.backbone(block, positions)
        return seed_of(hidden, dec.commit_picks(block, hidden, positions, masked, quota, top_m=top_m))

    return step


def speculation_round(dec: BlockDecoder):
    """The verify round ``(block [B, T], positions [B, T], seed_h [B, T, H], fresh [B], *lists) -> the next seed``
    (``lists``: with draft candidates the seed's ids and rest mass; see :func:`seed_of`): K drafts from the block,
    one backbone forward over the K+1 candidate states, and per row the longest draft prefix the backbone agrees
    with plus its bonus token committed into ``block`` in place. A row at the start of its block (``fresh``,
    cleared in place) drafts nothing: its round is the opening forward, which commits the backbone's own pick
    and seeds the next round."""
    K, top_m = dec.settings.mrp_steps, dec.settings.draft_candidates or 0
    copy = dec.engine.copy_index(K + 1, dec.block)  # [(K+1) T]: the copy of each position of the verify forward

    def round_(block: torch.Tensor, positions: torch.Tensor, seed_h: torch.Tensor, fresh: torch.Tensor,
               *lists: torch.Tensor) -> tuple:
        B, T = block.shape
        draft_pos, draft_tok, states, candidates = _draft(dec, block, positions, (seed_h, *lists), fresh)
        live = candidates[:, 0].any(-1)  # C(0) is the block
        flat_positions = positions.repeat(1, K + 1)
        h_all = dec.backbone(states.reshape(B, (K + 1) * T), flat_positions, copy)
        picks, top = dec.split_top(dec.pick_hidden(h_all, flat_positions, candidates.reshape(B, -1),
                                                   dec.noise_counter(copy), top_m=dec.top_lists(top_m),
                                                   seen=dec.penalties(states)), top_m)
        target_tok, target_conf = (x.view(B, K + 1, T) for x in picks[:2])
        accepted, bonus = mrp_triton.verify_drafts(block, draft_pos, draft_tok, target_tok, target_conf,
                                                   mask_token_id=dec.mask_id)
        accepted = accepted.long()
        dec.record(live, accepted + (bonus >= 0))  # a row without masks accepts nothing and has no bonus
        if dec.settings.output_confidences or top is not None:
            targets = (target_conf, *(x.view(B, K + 1, T, -1) for x in top or ()))
            committed, conf, *verified_top = verified_commits(draft_pos, accepted, bonus, *targets)
            dec.note_confidences(positions, committed, conf, tuple(verified_top) or None)
        dec.stats.accepted_lengths.index_put_((dec.rows, accepted), (live > fresh).long(), accumulate=True)
        fresh.zero_()
        # the accepted candidate's slice of the forward (and of its picks) seeds the next round
        rows = dec.engine.iota[:B]
        return seed_of(h_all, picks, lambda x: x.view(B, K + 1, T, *x.shape[2:])[rows, accepted])

    return round_


def decode_speculative(dec: BlockDecoder, block: torch.Tensor, positions: torch.Tensor, steps: int) -> None:
    """Lossless speculative decoding: an opening forward commits the backbone's exact pick (a verify round
    with no drafts), then verify rounds until the block is full (each graphed as one step). When every row
    opens a block the opening is a plain forward; a row that opens its block while others are mid-block
    opens it inside their verify round. Each row's seed (``row_state["seed_h"]``) carries over the checks.

    A round commits at most K+1 tokens per row, so with m masks left the next ceil(m / (K+1)) rounds
    surely have work: the decoder runs them back to back and checks the host after them (at batch 1 on the
    shipped model one check per 1.6 rounds at K = 3, per 2.9 at K = 1), never a round without work; with
    ``device_loop`` the rounds that may have work follow in the same graph, so one check per block."""
    state = dec.row_state
    names = ("seed_h", "seed_ids", "seed_rest") if dec.settings.draft_candidates else ("seed_h",)
    if dec.all_fresh:
        seed = dec.step("open", opening_step(dec), block, positions, _one_each(dec.masked(block)), mutated=(0,))
        state.update(zip(names, seed))
        state["fresh"].zero_()
        steps -= 1
    dec.steps((("speculate", speculation_round(dec)),), block, positions, state["seed_h"], state["fresh"],
              *(state[name] for name in names[1:]), count=steps, mutated=(0, 3), carry=(2, 4, 5)[: len(names)])


def _token_scores(dec: BlockDecoder, h_a: torch.Tensor, corrected: torch.Tensor, tokens: torch.Tensor,
                  revealed: torch.Tensor, positions: torch.Tensor, seen: dict) -> torch.Tensor:
    """Per revealed position [B, T]: the corrected confidence of its token (rule "tau"; under a repetition penalty,
    ``seen``, the reveal's own arguments: the tokens seen before it, as the pick saw them) or the residual
    magnitude |C[pos, token]| with C = corrected - A, A = lm_head(h_A) (rule "delta")."""
    t = tokens.clamp(min=0)[..., None]
    if dec.settings.remask_rule == "delta":
        logits = dec.model.lm_head(h_a)
        return (corrected.float().gather(-1, t) - logits.float().gather(-1, t))[..., 0].abs()
    _, _, lse = dec.pick(corrected, positions, revealed, dec.noise_counter(), seen=seen)
    z = corrected.float().gather(-1, t)[..., 0]
    if seen:  # the token's logit as the pick's softmax saw it (one state a row: its tables' row is the row's)
        at = t[..., 0]
        z = penalties_applied(z, **by_token({name: value for name, value in seen.items() if name != "seen_rows"},
                                            lambda table: table.gather(1, at), lambda bias: bias[at]))
    return torch.exp(z * inverse_temperature(dec.temperature) - lse)  # as confidence scales


def remask_step(dec: BlockDecoder):
    """The step ``(block [B, T], positions [B, T], quota_base [B], quota_extra [B], steps_taken [B]) -> None``: reveal
    as dynamic decoding does (every masked position above tau, else the scheduled top n: at least one per row, the
    paper's rule, by default, where S = T gives n = 1; ``steps_taken`` is incremented in place), then one MRP pass
    vetoes reveals by the remask rule, all in ``block`` in place."""
    rule, head = dec.settings.remask_rule, dec.model.lm_head
    threshold = dec.on_device("threshold")
    limit = threshold if rule == "tau" else dec.on_device("residual_delta")

    def step(block: torch.Tensor, positions: torch.Tensor, quota_base: torch.Tensor, quota_extra: torch.Tensor,
             steps_taken: torch.Tensor) -> None:
        masked = dec.masked(block)
        live = masked.any(-1)
        h_a = dec.backbone(block, positions)
        seen = dec.penalties(block)  # the reveal's and its tau score's
        (tok, conf, _), top = dec.split_top(dec.pick_hidden(h_a, positions, masked, dec.noise_counter(), seen=seen,
                                                            top_m=dec.top_lists()), 0)
        before = block.clone()
        quota = dec.scheduled_quota(quota_base, quota_extra, steps_taken) * live  # >= 1: T // S, S <= T
        revealed = mrp_triton.select_commit(block, tok, conf, mask_token_id=dec.mask_id, n=quota,
                                            threshold=threshold)
        corrected = head(MRPChain(dec, h_a, positions).step(block if rule == "tau" else before))
        score = _token_scores(dec, h_a, corrected, tok, revealed, positions, seen)
        remasked = mrp_triton.remask(block, revealed, score, limit, mask_token_id=dec.mask_id, rule=rule)
        dec.record(live, revealed & ~remasked)
        dec.note_confidences(positions, revealed & ~remasked, conf, top)
        dec.count("mrp_forwards", live)
        dec.count("tokens_remasked", remasked.sum(-1))

    return step


def decode_remask(dec: BlockDecoder, block: torch.Tensor, positions: torch.Tensor, steps: int) -> None:
    """Dynamic reveal (confidence > tau, at least one), then one MRP pass vetoes reveals: rule "tau"
    (post-reveal ids: remask when the corrected confidence falls below tau) or "delta" (pre-reveal
    ids: remask when |C[pos, token]| > residual_delta). Each row keeps at least one reveal per step."""
    state = dec.row_state
    dec.steps((("remask", remask_step(dec)),), block, positions, state["quota_base"], state["quota_extra"],
              state["steps_taken"], count=steps, mutated=(0, 4))


MRP_DECODING = {
    "direct": Strategy(decode_direct, most_per_step=lambda dec: 1, synchronous=True),
    "speculative": Strategy(decode_speculative, most_per_step=lambda dec: dec.settings.mrp_steps + 1),
    "remask": Strategy(decode_remask),  # a step may fill the block
}
