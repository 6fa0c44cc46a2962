"""The repetition penalty (transformers' RepetitionPenaltyLogitsProcessor): in the confidence op (kernel and
reference) and in generate() for every strategy, against transformers' processor and the uncached oracle; float64."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import mrp_triton as mt
from hf_integration.generation_settings import GenerationSettings
from tiny_models import (DRAFTS, STRATEGIES, assert_rows_decode_as_alone, assert_speculative_is_static,
                         naive_static_decode, random_prompts, tiny_model)

from kernel_utils import DEV


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("penalty", [0.6, 1.7, torch.tensor(2.5, dtype=torch.float64)], ids=["0.6", "1.7", "tensor"])
def test_op_penalizes_as_transformers_processor(backend, penalty):
    """The confidence op with a repetition penalty picks as the op does on the logits transformers' processor
    penalized (per row the ids it has seen; rows reading shared rows of the seen table through seen_rows), greedy
    and sampled, with the same probabilities; a penalty above 1 changes the picks of rows whose best token was
    seen."""
    g = torch.Generator().manual_seed(2)
    N, V = 6, 97
    L = torch.randn(N, V, generator=g) * 3
    ids = [L[0].argmax()[None], torch.tensor([3, 3, 50]), L[2].topk(3).indices]  # rows of the seen table
    seen = torch.zeros(3, V, dtype=torch.bool)
    for c, row in enumerate(ids):
        seen[c, row] = True
    seen_rows = torch.tensor([0, 1, 2, 0, 2, 1])
    value = float(penalty)
    hf = torch.stack([RepetitionPenaltyLogitsProcessor(value)(ids[c][None], L[n : n + 1].clone())[0]
                      for n, c in enumerate(seen_rows.tolist())])
    given = penalty.to(DEV) if isinstance(penalty, torch.Tensor) else penalty
    for kw in (dict(), dict(do_sample=True, seed=4, noise_keys=torch.randint(0, 99, (N, 3), generator=g).to(DEV))):
        with mt.use_backend(backend):
            got = mt.confidence(L.to(DEV), repetition_penalty=given, seen_tokens=seen.to(DEV),
                                seen_rows=seen_rows.to(DEV), **kw)
            want = mt.confidence(hf.to(DEV), **kw)
        assert torch.equal(got[0].cpu(), want[0].cpu())
        torch.testing.assert_close(got[1].cpu(), want[1].cpu(), rtol=1e-5, atol=1e-7)
    if value > 1:
        assert got[0][0] != L[0].argmax() and got[0][2] != L[2].argmax()


@pytest.mark.parametrize("kwargs,match", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=True), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=1.2), "repetition_penalty needs seen_tokens"),
    (dict(repetition_penalty=1.2, seen_tokens=torch.zeros(2, 9, dtype=torch.bool)), "needs seen_tokens: a bool or "
                                                                                   "uint8 tensor \\[C, 10\\]"),
    (dict(repetition_penalty=1.2, seen_tokens=torch.zeros(3, 10, dtype=torch.bool)), "pass seen_rows"),
    (dict(repetition_penalty=1.2, seen_tokens=torch.zeros(3, 10, dtype=torch.bool), seen_rows=torch.zeros(2)),
     "seen_rows must be an int64 tensor of shape \\[2\\]"),
    (dict(seen_tokens=torch.zeros(2, 10, dtype=torch.bool)), "pass repetition_penalty too"),
    (dict(repetition_penalty=torch.ones(2), seen_tokens=torch.zeros(2, 10, dtype=torch.bool)),
     "repetition_penalty must be a number or a 0-d real tensor"),
])
def test_op_refuses_a_penalty_without_what_it_reads(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mt.confidence(torch.zeros(2, 10), **kwargs)


@pytest.mark.parametrize("prompt_len,penalty,rule", [(3, 1.8, {}), (6, 0.7, {}), (9, 3.0, {}),
                                                     (5, 2.0, dict(leftmost=True)),
                                                     (4, 1.5, dict(entropy_bound=3.0))])
def test_generate_is_the_oracle_that_penalizes_every_step(model, prompt_len, penalty, rule):
    """Static, sequential and entropy-bounded decoding with a repetition penalty give the tokens (and confidences)
    of the uncached oracle that runs transformers' processor over the tokens the sequence holds at each step (its
    prompt, its finished blocks and the tokens committed in its block so far), which differ from the free run's."""
    prompt = random_prompts(1, prompt_len, seed=prompt_len)[0]
    strategy = dict(strategy="sequential") if rule.get("leftmost") else \
        dict(strategy="entropy_bounded", entropy_bound=rule["entropy_bound"]) if rule else {}
    conf = torch.zeros(prompt_len + 14, dtype=torch.float64)
    oracle = naive_static_decode(model, prompt, 14, model.config.block_size, confidences=conf,
                                 repetition_penalty=penalty, **rule)
    out = model.generate(prompt[None], max_new_tokens=14, repetition_penalty=penalty, eos_token_id=[],
                         return_dict_in_generate=True, output_confidences=True, **strategy)
    assert torch.equal(out.sequences[0], oracle)
    torch.testing.assert_close(out.confidences[0, prompt_len:], conf[prompt_len:].float(), rtol=1e-5, atol=1e-7)
    free = model.generate(prompt[None], max_new_tokens=14, eos_token_id=[], **strategy)
    assert not torch.equal(free[0], oracle)


@pytest.mark.parametrize("drafts", DRAFTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_speculative_decoding_stays_lossless(model, drafts, sampled):
    """Speculative decoding under a repetition penalty commits the tokens static decoding commits: each candidate
    state of a verify forward sees the drafts before it, as static decoding sees them once committed."""
    assert_speculative_is_static(model, drafts, sampled, repetition_penalty=1.9)


def test_each_row_sees_its_own_tokens_not_the_padding(model):
    """In a left-padded batch each row is penalized for its own prompt and tokens only (not the padding, which
    transformers' processor would count): every row decodes as it does alone, also with rows finishing early and
    leaving the batch (an EOS) and with CUDA graphs' recorded steps (replayed on a CPU)."""
    assert_rows_decode_as_alone(model, max_new_tokens=12, repetition_penalty=2.2, strategy="dynamic", threshold=0.3)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_every_strategy_reads_the_penalty_on_the_device(model, strategy):
    """Every strategy applies the penalty (its output changes) and reads it from the engine's buffer: one step key
    serves every value (the captured steps, replayed on a CPU, give what eager decoding gives), and 1 (transformers'
    default) is no penalty, with the key of none."""
    ids = random_prompts(2, 6, seed=41)
    kw = dict(max_new_tokens=12, eos_token_id=[], **strategy)
    plain = model.generate(ids, **kw)
    for penalty in (2.5, 0.4):
        graphed = model.generate(ids, repetition_penalty=penalty, cuda_graphs=True, **kw)
        assert torch.equal(graphed, model.generate(ids, repetition_penalty=penalty, cuda_graphs=False, **kw))
        assert not torch.equal(graphed, plain), penalty
    assert torch.equal(model.generate(ids, repetition_penalty=1.0, **kw), plain)
    for same in ((2.5, 0.4), (None, 1.0)):
        keys = {GenerationSettings.resolve(model, None, dict(kw, repetition_penalty=p), 6).step_key() for p in same}
        assert len(keys) == 1, same


def test_generation_config_and_bad_values(model):
    """A GenerationConfig's repetition_penalty applies as the keyword does (a checkpoint's file too); a value that
    is not a finite number > 0 is refused, naming it."""
    ids = random_prompts(1, 5, seed=8)
    kw = dict(max_new_tokens=8, eos_token_id=[])
    want = model.generate(ids, repetition_penalty=1.6, **kw)
    assert torch.equal(model.generate(ids, generation_config=GenerationConfig(repetition_penalty=1.6), **kw), want)
    shipped = model.generation_config
    try:
        model.generation_config = GenerationConfig(repetition_penalty=1.6)
        assert torch.equal(model.generate(ids, **kw), want)
    finally:
        model.generation_config = shipped
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=f"repetition_penalty={bad} must be a finite number > 0"):
            model.generate(ids, repetition_penalty=bad, **kw)


@pytest.mark.parametrize("drafts", [{}, dict(draft_candidates=4)], ids=["full vocabulary", "draft_candidates=4"])
def test_each_draft_sees_the_drafts_before_it(model, monkeypatch, drafts):
    """A speculative round's k-th draft picks under the penalty of the state it drafts from (the block with the k
    drafts before it committed): the candidate state k the verify forward then checks, so drafts do not repeat what
    the drafts before them committed (which only the verification would catch)."""
    from hf_integration.decoding import BlockDecoder

    calls = []
    penalties = BlockDecoder.penalties

    def spy(self, states):
        calls.append(states.clone())
        return penalties(self, states)

    monkeypatch.setattr(BlockDecoder, "penalties", spy)
    model.generate(random_prompts(2, 5, seed=3), max_new_tokens=12, strategy="speculative", mrp_steps=3,
                   repetition_penalty=1.9, eos_token_id=[], **drafts)
    rounds = [i for i, states in enumerate(calls) if states.dim() == 3]
    assert len(rounds) >= 3
    for i in rounds:
        drafts, verify = calls[i - 3 : i], calls[i]
        assert all(torch.equal(d, verify[:, k]) for k, d in enumerate(drafts))
        assert not torch.equal(verify[:, 0], verify[:, 2])  # the drafts committed something


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_remasks_tau_score_reads_the_tokens_seen_before_the_reveal(model, monkeypatch, sampled):
    """Remask (rule tau) scores each reveal under the penalty its pick saw: the table of the block before the reveal,
    not one that counts the revealed tokens as seen already (which would lower every reveal's score)."""
    from hf_integration import mrp_decoding
    from hf_integration.decoding import BlockDecoder

    picked, scored = [], []
    pick_hidden, token_scores = BlockDecoder.pick_hidden, mrp_decoding._token_scores

    def pick_spy(self, *args, seen=None, **kwargs):
        picked.append(seen["seen_tokens"].clone())
        return pick_hidden(self, *args, seen=seen, **kwargs)

    def score_spy(dec, h_a, corrected, tokens, revealed, positions, seen):
        scored.append((picked[-1], seen["seen_tokens"].clone(), revealed.clone()))
        return token_scores(dec, h_a, corrected, tokens, revealed, positions, seen)

    monkeypatch.setattr(BlockDecoder, "pick_hidden", pick_spy)
    monkeypatch.setattr(mrp_decoding, "_token_scores", score_spy)
    model.generate(random_prompts(2, 5, seed=3), max_new_tokens=12, strategy="remask", threshold=0.4,
                   repetition_penalty=1.9, eos_token_id=[], do_sample=sampled, **(dict(seed=2) if sampled else {}))
    assert scored and all(torch.equal(pick, score) for pick, score, _ in scored)
    assert any(revealed.any() for _, _, revealed in scored)


def test_draft_candidate_lists_rank_the_penalized_logits():
    """The lists a round's seed forward gives the next round's drafts (draft_candidates) are the most likely tokens
    under the penalty the picks saw (transformers' processor over the block's tokens), not under the raw logits."""
    from hf_integration.decoding import BlockDecoder
    from hf_integration.prompts import PromptBatch

    model = tiny_model(seed=5, block_size=8)
    ids = random_prompts(2, 5, seed=1)
    kwargs = dict(max_new_tokens=8, strategy="speculative", draft_candidates=4, repetition_penalty=3.0)
    dec = BlockDecoder(model, PromptBatch.from_inputs(model.config, ids, None),
                       GenerationSettings.resolve(model, None, kwargs, prompt_width=5))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 8, model.config.hidden_size, generator=g, dtype=torch.float64)
    logits = model.lm_head(hidden).detach()
    block = logits.topk(2, dim=-1).indices[:, :, 1]  # the block holds each position's second most likely token
    picks = dec.pick_hidden(hidden, torch.arange(8, 16).expand(2, -1), torch.ones(2, 8, dtype=torch.bool), None,
                            top_m=4, seen=dec.penalties(block))
    want = torch.stack([RepetitionPenaltyLogitsProcessor(3.0)(block[b].expand(8, -1), logits[b]) for b in range(2)])
    want[..., model.config.mask_token_id] = float("-inf")
    torch.testing.assert_close(picks[3].double(), want.topk(4, dim=-1).values, rtol=1e-6, atol=1e-6)
    assert not torch.equal(picks[4], logits.topk(4, dim=-1).indices)


@pytest.mark.parametrize("draft_vocab", [30, [0, 1, *range(3, 40)]], ids=["ids below 30", "listed ids"])
def test_draft_vocabulary_picks_read_the_seen_table_by_column(draft_vocab):
    """A draft over a draft vocabulary picks under the penalty of its own tokens: the fused pick reads the seen table
    by draft column (column c is token ids[c] for listed ids), as transformers' processor over the block's tokens
    penalizes the draft's logits."""
    from hf_integration.decoding import BlockDecoder
    from hf_integration.prompts import PromptBatch

    model = tiny_model(seed=5, block_size=8)
    kwargs = dict(max_new_tokens=8, strategy="speculative", draft_vocab=draft_vocab, repetition_penalty=4.0)
    dec = BlockDecoder(model, PromptBatch.from_inputs(model.config, random_prompts(2, 5, seed=1), None),
                       GenerationSettings.resolve(model, None, kwargs, prompt_width=5))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 8, model.config.hidden_size, generator=g, dtype=torch.float64)
    ids = torch.arange(30) if isinstance(draft_vocab, int) else torch.tensor(draft_vocab)
    logits = model.lm_head(hidden).detach()[..., ids]  # the draft's columns
    block = ids[logits.argmax(-1)]  # the block holds each position's most likely draft token
    tok = dec.pick_hidden(hidden, torch.arange(8, 16).expand(2, -1), torch.ones(2, 8, dtype=torch.bool), None,
                          dec.draft, seen=dec.penalties(block))[0]
    penalized = torch.stack([RepetitionPenaltyLogitsProcessor(4.0)(block[b].expand(8, -1), model.lm_head(hidden[b])
                                                                   .detach())[:, ids] for b in range(2)])
    assert torch.equal(tok, ids[penalized.argmax(-1)])
    assert not torch.equal(tok, block)
