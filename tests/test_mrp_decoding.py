"""MRP decoding modes: speculative is lossless, an oracle MRP reaches the maximum, direct and remask behave."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiny_models import MASK_ID, random_prompts, spy_on_drafts, tiny_model


def install_oracle_mrp(model, monkeypatch):
    """Replace the MRP head by a test double whose residual is the exact next-step difference.

    For ids = the state after a commit and hidden = what the chain feeds, the double returns h_p such
    that the corrected hidden equals the backbone's own hidden state on ids: (h_B - hidden) / s for the
    residual mode, h_B itself for mode "none". Cache writes (prefix fills) are no-ops."""
    scale = {"value": 1.0, "mix": "logits_sum"}

    def oracle(input_ids, hidden_states, position_ids, attention_mask=None, attn=None):
        if attn.write_len:
            return torch.zeros_like(hidden_states)
        h_b = model.model(input_ids, position_ids, attn=dataclasses.replace(attn, write_len=0))
        if scale["mix"] == "none":
            return h_b
        return (h_b - hidden_states) / scale["value"]

    monkeypatch.setattr(model, "mrp_forward", oracle)
    return scale


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 4), k=st.integers(1, 4), block=st.sampled_from([4, 8, 16]),
       schedule=st.sampled_from(["mrp", "authors"]), max_new=st.integers(1, 20),
       drafts=st.sampled_from([{}, dict(draft_vocab=2), dict(draft_vocab=20), dict(draft_vocab=MASK_ID + 1),
                               dict(draft_candidates=1), dict(draft_candidates=5)]))
def test_speculative_greedy_equals_static_one_token_per_step(seed, batch, k, block, schedule, max_new, drafts):
    """Lossless whatever the drafts (the tokens and their confidences): also when they may choose among the first
    ``draft_vocab`` token ids only
    (2: the drafts are nearly always wrong; MASK_ID + 1: the whole vocabulary, the mask token among it), or among
    each position's few most likely tokens in the round's seed forward (``draft_candidates``); prompts of
    different lengths, so rows sit in different blocks."""
    model = tiny_model(seed=seed % 7, block_size=block)
    lens = torch.randint(1, 12, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
    ids = random_prompts(batch, max(lens), seed=seed)
    mask = (torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]).long()
    common = dict(attention_mask=mask, max_new_tokens=max_new, return_dict_in_generate=True, output_confidences=True)
    static = model.generate(ids, **common)
    spec = model.generate(ids, strategy="speculative", mrp_steps=k, draft_schedule=schedule, **common, **drafts)
    assert torch.equal(spec.sequences, static.sequences)
    # each token's confidence is the verify forward's on the very state static decoding committed it in
    torch.testing.assert_close(spec.confidences, static.confidences, rtol=1e-5, atol=0)
    assert (spec.stats.tokens_per_forward >= 1.0).all()
    # The same tokens in the same order: static stops once the last new token is committed (a last block's later
    # positions are context), the verify round that commits it at most K tokens after it.
    extra = spec.stats.tokens_committed - static.stats.tokens_committed
    assert ((0 <= extra) & (extra <= k)).all(), extra


@pytest.mark.parametrize("sampling", [{}, dict(do_sample=True, temperature=1.3, seed=4),
                                      dict(do_sample=True, temperature=1.3, seed=4, draft_candidates=64),
                                      dict(do_sample=True, temperature=2.0, seed=4, min_p=0.05, draft_candidates=64)],
                         ids=["greedy", "sampled", "sampled-candidates", "sampled-min-p-candidates"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_oracle_mrp_reaches_k_plus_one_tokens_per_verify_forward(monkeypatch, k, sampling):
    """Sampled too: each draft step draws the noise the verify forward draws at that state, so an exact MRP's
    sampled drafts are the backbone's own samples (with ``draft_candidates``, among the 64 most likely of the 66
    tokens: the two left out have a negligible share of this model's sharpened softmax)."""
    model = tiny_model(seed=2, block_size=8)
    install_oracle_mrp(model, monkeypatch)
    ids = random_prompts(2, 8, seed=5)  # whole prompt blocks: every decoded block starts fully masked
    out = model.generate(ids, max_new_tokens=24, strategy="speculative", mrp_steps=k, return_dict_in_generate=True,
                         **sampling)
    static = model.generate(ids, max_new_tokens=24, **{n: v for n, v in sampling.items() if n != "draft_candidates"})
    assert torch.equal(out.sequences, static)
    # Each decoded block (3 of them): an opening forward commits 1 token, then every verify round with r
    # masks left accepts min(K, r) drafts and commits min(K + 1, r) tokens.
    expected = torch.zeros(k + 1, dtype=torch.long)
    left, forwards = model.config.block_size - 1, 1
    while left:
        expected[min(k, left)] += 1
        left -= min(k + 1, left)
        forwards += 1
    assert out.stats.backbone_forwards.tolist() == [3 * forwards] * 2
    assert out.stats.accepted_lengths.tolist() == [(3 * expected).tolist()] * 2


@pytest.mark.parametrize("mix", ["logits_sum", "none"])
@pytest.mark.parametrize("k", [1, 3])
def test_oracle_direct_decoding_equals_static(monkeypatch, mix, k):
    model = tiny_model(seed=4, block_size=8)
    install_oracle_mrp(model, monkeypatch)["mix"] = mix
    ids = random_prompts(3, 5, seed=6)
    common = dict(max_new_tokens=19, return_dict_in_generate=True, output_confidences=True)
    out = model.generate(ids, strategy="direct", mrp_steps=k, mrp_mix=mix, **common)
    static = model.generate(ids, **common)
    assert torch.equal(out.sequences, static.sequences)
    # the MRP steps' tokens get the corrected logits' probabilities: here the backbone's own on the state
    torch.testing.assert_close(out.confidences, static.confidences, rtol=1e-5, atol=0)
    assert (out.stats.tokens_per_forward > 1.0).all()


def test_oracle_mrp_scale_is_respected(monkeypatch):
    model = tiny_model(seed=4, block_size=8)
    install_oracle_mrp(model, monkeypatch)["value"] = 0.5
    ids = random_prompts(1, 8, seed=1)
    out = model.generate(ids, max_new_tokens=8, strategy="speculative", mrp_steps=3, mrp_scale=0.5,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=8))
    assert out.stats.backbone_forwards.tolist() == [3]  # 1 opening + 2 rounds of 4 (then 3)


@pytest.mark.parametrize("mix", ["logits_sum", "none"])
def test_direct_chains_start_from_the_backbone_hidden_state(monkeypatch, mix):
    """Each chain of direct decoding feeds its first MRP step h_A, the hidden state of the backbone forward before
    it (the residual sum starts at zero; mode "none" feeds h_A and then each h_p), and chains a step's output on
    (``logits_sum``: h_A + s * (h_p1 + ...)), whatever host checks fall between its steps; a block's first step is
    a backbone forward over it (no chain goes on into the next block)."""
    model = tiny_model(seed=3, block_size=8)
    events = []
    backbone, head = model.model.forward, model.mrp_forward

    def spy_backbone(input_ids, position_ids, **kwargs):
        hidden = backbone(input_ids, position_ids, **kwargs)
        # the block's positions (a finished block may ride in front)
        events.append(("backbone", hidden[:, -8:].clone(), position_ids[:, -8:].clone()))
        return hidden

    def spy_head(input_ids, hidden_states, position_ids, *args, attn=None, **kwargs):
        out = head(input_ids, hidden_states, position_ids, *args, attn=attn, **kwargs)
        if not attn.write_len:  # a chain step, not a commit's cache write
            events.append(("head", hidden_states.clone(), out.clone(), position_ids.clone()))
        return out

    monkeypatch.setattr(model.model, "forward", spy_backbone)
    monkeypatch.setattr(model, "mrp_forward", spy_head)
    model.generate(random_prompts(1, 3, seed=2), max_new_tokens=19, strategy="direct", mrp_steps=3, mrp_mix=mix,
                   mrp_scale=0.5)
    chains = 0
    for event, previous in zip(events[1:], events):
        if event[0] != "head":
            continue
        if previous[0] == "backbone":
            (_, h_a, block), residuals = previous, 0
            chains += 1
            expected = h_a
        else:
            residuals = residuals + previous[2]
            expected = h_a + 0.5 * residuals if mix == "logits_sum" else previous[2]
        assert torch.equal(event[3], block)  # the block of the chain's backbone forward
        torch.testing.assert_close(event[1], expected, rtol=1e-12, atol=1e-12)
    assert chains >= 4


def test_direct_decoding_is_bounded_and_counts_mrp_forwards():
    model = tiny_model(seed=3, block_size=8)
    out = model.generate(random_prompts(2, 3, seed=2), max_new_tokens=13, strategy="direct", mrp_steps=2,
                         return_dict_in_generate=True)
    stats = out.stats
    assert not (out.sequences == MASK_ID).any()
    assert (stats.tokens_committed >= 13).all()
    assert (stats.tokens_committed <= stats.backbone_forwards * 3).all()
    assert (stats.mrp_forwards <= stats.backbone_forwards * 2).all() and (stats.mrp_forwards > 0).all()


@pytest.mark.parametrize("rule", ["tau", "delta"])
@pytest.mark.parametrize("threshold", [0.05, 0.5, 0.95])
def test_remask_terminates_without_masks(rule, threshold):
    model = tiny_model(seed=5, block_size=8)
    out = model.generate(random_prompts(3, 6, seed=3), max_new_tokens=15, strategy="remask", threshold=threshold,
                         remask_rule=rule, residual_delta=0.2, return_dict_in_generate=True)
    assert not (out.sequences == MASK_ID).any()
    stats = out.stats
    assert (stats.mrp_forwards == stats.backbone_forwards).all()
    assert (stats.backbone_forwards <= 24 - 6).all()  # at most one step per masked position (blocks to 24)


def test_the_authors_first_draft_is_the_accepted_candidates_stale_pick(monkeypatch):
    """With the authors' schedule a round's first draft is the backbone's pick on the candidate state the previous
    round accepted (read from that copy of the verify forward, the bonus position now filled): the next round is
    seeded by the accepted copy, not by another."""
    import mrp_triton

    model = tiny_model(seed=3, block_size=16)
    rounds, verify = [], mrp_triton.verify_drafts

    def spy(block, draft_pos, draft_tok, target_tok, target_conf, **kwargs):
        before = block.clone()
        accepted, bonus = verify(block, draft_pos, draft_tok, target_tok, target_conf, **kwargs)
        rounds.append((before, draft_pos.clone(), draft_tok.clone(), target_tok.clone(), target_conf.clone(),
                       block.clone(), accepted.clone()))
        return accepted, bonus

    monkeypatch.setattr(mrp_triton, "verify_drafts", spy)
    model.generate(random_prompts(1, 16, seed=4), max_new_tokens=32, strategy="speculative", mrp_steps=3,
                   draft_schedule="authors")
    checked = 0
    for previous, this in zip(rounds, rounds[1:]):
        *_, target_tok, target_conf, after, accepted = previous
        if not torch.equal(this[0], after) or not (after == MASK_ID).any():
            continue  # the next round opens another block
        copy = int(accepted[0])
        conf = target_conf[0, copy].masked_fill(after[0] != MASK_ID, float("-inf"))
        pos = int(conf.argmax())  # lowest index among ties
        assert (int(this[1][0, 0]), int(this[2][0, 0])) == (pos, int(target_tok[0, copy, pos]))
        checked += copy > 0
    assert checked >= 2  # rounds seeded by a copy other than C(0)


@pytest.mark.parametrize("rule", ["tau", "delta"])
def test_remask_feeds_the_head_the_ids_its_rule_reads(monkeypatch, rule):
    """Rule "tau" scores the reveals on the state after them (the head reads the revealed tokens), rule "delta" on
    the state before them (the revealed positions still masked): each MRP pass's ids, seen from the remask op."""
    import mrp_triton

    model = tiny_model(seed=5, block_size=8)
    events = []
    head, remask = model.mrp_forward, mrp_triton.remask

    def spy_head(input_ids, *args, attn=None, **kwargs):
        if not attn.write_len:
            events.append(("head", input_ids.clone()))
        return head(input_ids, *args, attn=attn, **kwargs)

    def spy_remask(block, revealed, *args, **kwargs):
        events.append(("remask", block.clone(), revealed.clone()))
        return remask(block, revealed, *args, **kwargs)

    monkeypatch.setattr(model, "mrp_forward", spy_head)
    monkeypatch.setattr(mrp_triton, "remask", spy_remask)
    model.generate(random_prompts(1, 6, seed=3), max_new_tokens=10, strategy="remask", threshold=0.3,
                   remask_rule=rule, residual_delta=0.2)
    checked = 0
    for seen, event in zip(events, events[1:]):
        if event[0] == "remask":
            assert seen[0] == "head"
            block, revealed = event[1:]
            expected = block if rule == "tau" else block.masked_fill(revealed, MASK_ID)
            assert torch.equal(seen[1], expected)
            checked += int(revealed.any())
    assert checked >= 2


@pytest.mark.parametrize("rule,penalty", [("tau", None), ("delta", None), ("tau", 1.7)])
def test_remask_scores_follow_their_rule(rule, penalty):
    """Rule "tau" scores a revealed token by its probability under the full softmax (mask token left out) of the
    corrected logits at the temperature the picks use (with a repetition penalty, transformers' processor over the
    tokens the block held before the reveal, as the pick saw them); rule "delta" by |C[pos, token]|, C = corrected -
    lm_head(h_A): a residual that lowers the token's logit counts as much as one that raises it."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from hf_integration.decoding import BlockDecoder
    from hf_integration.generation_settings import GenerationSettings
    from hf_integration.mrp_decoding import _token_scores
    from hf_integration.prompts import PromptBatch

    model = tiny_model(seed=5, block_size=8)
    ids = random_prompts(2, 5, seed=1)
    kwargs = dict(max_new_tokens=8, strategy="remask", remask_rule=rule, do_sample=True, temperature=0.5, seed=1,
                  repetition_penalty=penalty)
    dec = BlockDecoder(model, PromptBatch.from_inputs(model.config, ids, None),
                       GenerationSettings.resolve(model, None, kwargs, prompt_width=5))
    g = torch.Generator().manual_seed(0)
    B, T, V = 2, 8, model.config.vocab_size
    h_a = torch.randn(B, T, model.config.hidden_size, generator=g, dtype=torch.float64)
    corrected = 3 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, MASK_ID, (B, T), generator=g)
    revealed = torch.rand(B, T, generator=g) < 0.6
    before = torch.where(torch.rand(B, T, generator=g) < 0.5, tokens, MASK_ID)  # some revealed tokens seen before
    score = _token_scores(dec, h_a, corrected, tokens, revealed, torch.arange(8, 16).expand(B, -1),
                          dec.penalties(before))
    if rule == "tau":
        if penalty is not None:
            corrected = torch.stack([RepetitionPenaltyLogitsProcessor(penalty)(before[b].expand(T, -1), corrected[b])
                                     for b in range(B)])
        expected = (corrected / 0.5).index_fill(-1, torch.tensor([MASK_ID]), float("-inf")).softmax(-1)
    else:
        expected = corrected - model.lm_head(h_a)
        assert (expected.gather(-1, tokens[..., None])[revealed] < 0).any()  # residuals that lower the token
        expected = expected.abs()
    expected = expected.gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(score[revealed].double(), expected[revealed], rtol=1e-5, atol=1e-7)


def test_remask_actually_remasks_with_a_strict_threshold():
    """A remasked reveal is not committed: each row commits its 18 new tokens (to 24, the end of its last block)
    once, however often its reveals were vetoed."""
    model = tiny_model(seed=5, block_size=8)
    out = model.generate(random_prompts(2, 6, seed=3), max_new_tokens=18, strategy="remask", threshold=0.05,
                         remask_rule="delta", residual_delta=1e-6, eos_token_id=[], return_dict_in_generate=True)
    assert (out.stats.tokens_remasked > 0).all()
    assert out.stats.tokens_committed.tolist() == [18, 18]


def test_remask_with_infinite_delta_equals_dynamic():
    model = tiny_model(seed=6, block_size=8)
    ids = random_prompts(2, 4, seed=4)
    for tau in (0.2, 0.6):
        dynamic = model.generate(ids, max_new_tokens=12, strategy="dynamic", threshold=tau)
        remask = model.generate(ids, max_new_tokens=12, strategy="remask", threshold=tau, remask_rule="delta",
                                residual_delta=float("inf"), return_dict_in_generate=True)
        assert torch.equal(remask.sequences, dynamic)
        assert (remask.stats.tokens_remasked == 0).all()


@pytest.mark.parametrize("schedule,drafts", [("mrp", {}), ("authors", {}), ("mrp", dict(draft_vocab=30)),
                                             ("mrp", dict(draft_candidates=3)), ("authors", dict(draft_candidates=3))])
def test_speculative_sampling_commits_exact_backbone_samples(schedule, drafts):
    """Draft and target share Gumbel noise per (row, position, state): with the same seed, speculative
    sampling commits exactly the tokens that static one-token-a-step sampling commits (min-p, typical, epsilon, eta
    and top-h too: the drafts cut their own tails, the verification exactly)."""
    model = tiny_model(seed=7, block_size=8)
    ids = random_prompts(3, 5, seed=9)
    for seed, cuts in ((0, {}), (1, {}), (2, dict(min_p=0.05)), (3, dict(epsilon_cutoff=0.02, eta_cutoff=0.05)),
                       (4, dict(top_h=0.6, top_k=20)), (5, dict(typical_p=0.6, min_p=0.02))):
        kwargs = dict(max_new_tokens=14, do_sample=True, temperature=1.3, seed=seed, **cuts,
                      return_dict_in_generate=True, output_confidences=True)
        static = model.generate(ids, **kwargs)
        spec = model.generate(ids, strategy="speculative", mrp_steps=3, draft_schedule=schedule, **drafts, **kwargs)
        assert torch.equal(spec.sequences, static.sequences)
        torch.testing.assert_close(spec.confidences, static.confidences, rtol=1e-5, atol=0)
    assert not torch.equal(model.generate(ids, max_new_tokens=14, do_sample=True, seed=0),
                           model.generate(ids, max_new_tokens=14, do_sample=True, seed=1))


@pytest.mark.parametrize("do_sample", [False, True])
def test_drafts_choose_among_the_first_draft_vocab_ids(monkeypatch, do_sample):
    """With draft_vocab=F every draft token is an id below F (and the drafts still get accepted sometimes)."""
    drafts = spy_on_drafts(monkeypatch)
    model = tiny_model(seed=3, block_size=8)
    out = model.generate(random_prompts(2, 5, seed=1), max_new_tokens=16, strategy="speculative", draft_vocab=40,
                         do_sample=do_sample, return_dict_in_generate=True)
    drafted = torch.cat([d.flatten() for d in drafts])
    assert (drafted >= 0).any() and (drafted < 40).all()
    assert out.stats.accepted_lengths[:, 1:].sum() > 0


def test_sampling_with_top_k_and_top_p_is_reproducible():
    model = tiny_model(seed=7, block_size=4)
    ids = random_prompts(2, 3, seed=1)
    kwargs = dict(max_new_tokens=8, do_sample=True, top_k=5, top_p=0.8, seed=3)
    assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, **kwargs))
    greedy_top1 = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=1, seed=3)
    assert torch.equal(greedy_top1, model.generate(ids, max_new_tokens=8))


def _host_syncs(monkeypatch) -> dict:
    """Count host synchronisations (a tensor read as a Python bool, int, number or list) from now on."""
    seen = {"n": 0}
    for name in ("__bool__", "__int__", "item", "tolist"):
        def counted(tensor, *args, _original=getattr(torch.Tensor, name), **kwargs):
            seen["n"] += 1
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


@pytest.mark.parametrize("k", [1, 3])
def test_mrp_strategies_check_the_block_from_the_host_rarely(monkeypatch, k):
    """Direct decoding knows a block's step count when it starts: as many host synchronisations as static
    decoding. Speculative decoding runs rounds that all have work back to back and checks after them:
    fewer checks than rounds, and never a round in which no row has work."""
    from hf_integration.decoding import BlockDecoder

    model = tiny_model(seed=2, block_size=16)
    ids = random_prompts(1, 16, seed=5)
    settings = dict(max_new_tokens=48, return_dict_in_generate=True, cuda_graphs=True)
    model.generate(ids, **settings)  # the first call records its steps
    rounds = []
    step = BlockDecoder.step

    def named_step(dec, name, *args, **kwargs):
        rounds.append(name)
        return step(dec, name, *args, **kwargs)

    monkeypatch.setattr(BlockDecoder, "step", named_step)
    syncs = _host_syncs(monkeypatch)

    def count(**kwargs):
        model.generate(ids, **settings, **kwargs)  # records this strategy's steps
        rounds.clear()
        before = syncs["n"]
        out = model.generate(ids, **settings, **kwargs)
        return syncs["n"] - before, out.stats

    static, _ = count()
    direct, _ = count(strategy="direct", mrp_steps=k)
    assert direct == static
    spec, stats = count(strategy="speculative", mrp_steps=k)
    verify_rounds = rounds.count("speculate")
    assert verify_rounds == int(stats.accepted_lengths.sum())  # every round had a row with work
    assert spec - static < verify_rounds, (spec, static, verify_rounds)


@pytest.mark.parametrize("schedule", ["mrp", "authors"])
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_counts_an_mrp_forward_for_each_draft_it_made(monkeypatch, schedule, k):
    """``stats.mrp_forwards`` of speculative decoding is the number of drafts the rounds made (a draft of -1: the
    row had no mask left, or starts its block with the backbone), less the authors' first drafts, which are the
    backbone's own picks; prompts of different lengths, so some rows are fresh while others draft."""
    drafts = spy_on_drafts(monkeypatch)
    model = tiny_model(seed=2, block_size=8)
    ids = random_prompts(3, 11, seed=4)
    mask = (torch.arange(11) >= torch.tensor([[0], [6], [9]])).long()
    out = model.generate(ids * mask, attention_mask=mask, max_new_tokens=13, strategy="speculative", mrp_steps=k,
                         draft_schedule=schedule, return_dict_in_generate=True)
    made = sum(int((d[:, int(schedule == "authors"):] >= 0).sum()) for d in drafts)
    assert int(out.stats.mrp_forwards.sum()) == made
    assert (made > 0) == (schedule == "mrp" or k > 1)  # the authors' single draft is the backbone's
    assert any((d < 0).any() for d in drafts)  # some rounds had rows without a draft
