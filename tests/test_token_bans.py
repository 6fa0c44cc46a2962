"""Token bans in generate(): EOS held back at each row's first new tokens (min_new_tokens, min_length), tokens never
decoded (suppress_tokens, bad_words_ids of one token) or not as a row's first new token (begin_suppress_tokens);
float64."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from hf_integration.decoding import BlockDecoder
from hf_integration.generation_settings import GenerationSettings
from tiny_models import MASK_ID, STRATEGIES, naive_static_decode, padded_batch, random_prompts, tiny_model

DRAFTS = [dict(mrp_steps=3), dict(mrp_steps=2, draft_schedule="authors"), dict(mrp_steps=3, draft_vocab=20),
          dict(mrp_steps=3, draft_vocab=[0, 1, *range(3, MASK_ID)]),  # listed ids: draft column c is not token c
          dict(mrp_steps=3, draft_candidates=4)]
SAMPLED = dict(do_sample=True, temperature=0.9, top_k=30, seed=7)
PAD = MASK_ID - 1


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def _batch(lens=(5, 2, 9), seed=3):
    rows = [random_prompts(1, n, seed=seed + i)[0] for i, n in enumerate(lens)]
    return rows, *padded_batch(rows, "left")


def _early_tokens(model, ids, mask, count: int = 2) -> list[int]:
    """The ``count`` tokens the rows' free (greedy, EOS-less) runs give most often among their first 4 new tokens:
    as EOS ids, they end the rows early unless held back."""
    free = model.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[])[:, ids.shape[1]:]
    return [t for t, _ in Counter(free.flatten().tolist()).most_common(count)]


def _kept_new_tokens(out, width: int) -> list[list[int]]:
    return [out.sequences[b, width : width + n].tolist() for b, n in enumerate(out.new_tokens.tolist())]


@pytest.mark.parametrize("prompt_len,min_new", [(3, 2), (5, 4), (2, 7), (6, 9), (4, 1)])
def test_static_decoding_equals_the_oracle_that_sets_eos_logits_to_minus_infinity(model, prompt_len, min_new):
    """The uncached one-token-a-step oracle, its EOS logits set to -inf at the first ``min_new`` new tokens (as
    transformers' processor sets them), gives the tokens up to its first EOS; the output ends there. The EOS ids are
    tokens the free run gives before ``min_new``, so without the ban the output would end sooner. The tokens'
    confidences are the oracle's."""
    prompt = random_prompts(1, prompt_len, seed=prompt_len)[0]
    free = model.generate(prompt[None], max_new_tokens=12, eos_token_id=[])[0, prompt_len:].tolist()
    eos = sorted({free[0], free[(min_new - 1) // 2]})
    conf = torch.zeros(prompt_len + 12, dtype=torch.float64)
    oracle = naive_static_decode(model, prompt, 12, model.config.block_size, confidences=conf, eos_ids=tuple(eos),
                                 min_new=min_new)
    new = oracle[prompt_len:].tolist()
    k = next((i for i, token in enumerate(new) if token in eos), 11)  # the oracle's first EOS (or its last token)
    assert k >= min_new
    out = model.generate(prompt[None], max_new_tokens=12, eos_token_id=eos, min_new_tokens=min_new, pad_token_id=PAD,
                         return_dict_in_generate=True, output_confidences=True)
    assert out.new_tokens.tolist() == [k + 1]
    end = prompt_len + k + 1
    assert torch.equal(out.sequences[0, :end], oracle[:end])
    # the tokens' probabilities with the EOS ids out of the softmax where held back; 0 at the padding after the EOS
    torch.testing.assert_close(out.confidences[0, :end].double(), conf[:end], rtol=1e-5, atol=0)
    assert not out.confidences[0, end:].any()
    unbanned = model.generate(prompt[None], max_new_tokens=12, eos_token_id=eos, return_dict_in_generate=True)
    assert unbanned.new_tokens.tolist() == [1]  # free[0] is an EOS


@pytest.mark.parametrize("sampled", [{}, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafts", DRAFTS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_speculative_decoding_stays_lossless_with_eos_held_back(model, drafts, sampled):
    """Drafts (from the whole vocabulary, a draft vocabulary or the seed's candidate lists) and the verify forward's
    targets hold EOS back at the same positions, so speculative decoding commits what static decoding commits, greedy
    or sampled (shared noise), in a batch whose rows reach ``min_new_tokens`` at different positions."""
    rows, ids, mask = _batch()
    eos = _early_tokens(model, ids, mask)
    for min_new in (3, 8):
        common = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=eos, min_new_tokens=min_new,
                      pad_token_id=PAD, return_dict_in_generate=True, **sampled)
        static = model.generate(ids, strategy="static", **common)
        spec = model.generate(ids, strategy="speculative", **drafts, **common)
        assert torch.equal(spec.sequences, static.sequences), min_new
        assert all(n > min_new for n in static.new_tokens.tolist()), static.new_tokens  # no row ends before it
        assert not any(set(row[:min_new]) & set(eos) for row in _kept_new_tokens(static, ids.shape[1]))


def _spy_on_picks(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """From now on, (positions [B, T], tokens [B, T, ...]) of every pick: the tokens picked, and with ``top_m`` the
    candidate lists a pick makes for the next round's drafts."""
    seen = []

    def spy(name: str, at: int):
        method = getattr(BlockDecoder, name)

        def recorded(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            seen.append((args[at].clone(), out[0].clone()))  # the decoder moves its position buffers on
            if len(out) == 5:
                seen.append((args[at].clone(), out[4].clone()))
            return out

        monkeypatch.setattr(BlockDecoder, name, recorded)

    for name, at in (("pick", 1), ("pick_hidden", 1), ("pick_listed", 2)):  # where each takes the positions
        spy(name, at)
    return seen


@pytest.mark.parametrize("kwargs", STRATEGIES + [dict(strategy="speculative", **d) for d in DRAFTS] + [
    dict(strategy="speculative", draft_candidates=4, **SAMPLED), dict(strategy="direct", **SAMPLED)],
    ids=lambda k: "-".join(str(v) for v in k.values()))
def test_no_pick_nor_draft_candidate_is_a_banned_token(model, monkeypatch, kwargs):
    """Every pick (the backbone's, each draft's) and every candidate list for the next round's drafts holds EOS
    back before the minimum, and a suppressed token everywhere: a draft proposing one there would only be rejected
    (the output stays lossless), so this is what keeps the drafts' acceptance."""
    prompt = random_prompts(1, 5, seed=13)
    eos = _early_tokens(model, prompt, None, count=3)
    assert max(eos) > 2  # in the listed draft vocabulary, an EOS whose draft column is not its id
    seen = _spy_on_picks(monkeypatch)
    out = model.generate(prompt, max_new_tokens=12, eos_token_id=eos, min_new_tokens=7, pad_token_id=PAD,
                         return_dict_in_generate=True, **kwargs)
    assert out.new_tokens.item() > 7
    banned = 0
    for positions, tokens in seen:
        before = (positions < 5 + 7).view(*positions.shape, *[1] * (tokens.dim() - 2)).expand_as(tokens)
        assert not torch.isin(tokens[before], torch.tensor(eos)).any(), (positions, tokens)
        banned += int(before.sum())
    assert banned > 0
    seen.clear()
    model.generate(prompt, max_new_tokens=12, eos_token_id=[], suppress_tokens=eos, **kwargs)
    assert seen and not any(torch.isin(tokens, torch.tensor(eos)).any() for _, tokens in seen)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 13), min_size=1, max_size=4), kwargs=st.sampled_from(STRATEGIES + [
           dict(strategy="speculative", mrp_steps=2, **SAMPLED), dict(strategy="dynamic", threshold=0.3, **SAMPLED)]),
       max_new=st.integers(1, 13), min_new=st.integers(0, 15), suppress=st.booleans(), graphs=st.booleans(),
       loop=st.booleans(), seed=st.integers(0, 10**4))
def test_any_batch_holds_banned_tokens_back(model, lens, kwargs, max_new, min_new, suppress, graphs, loop, seed):
    """Drawn prompt lengths, strategy, new tokens, minimum (EOS ids: tokens the rows' free runs give early) and
    suppressed tokens (drawn: another early token everywhere, the first EOS at the first new token): no row keeps an
    EOS among its first ``min_new_tokens`` new tokens, so none ends before them (or its last new token), nor a
    suppressed token; steps replayed or not (with or without a device loop) give the same output; with greedy
    decoding each row of the left-padded batch gives exactly what it gives alone."""
    rows, ids, mask = _batch(lens, seed)
    early = _early_tokens(model, ids, mask, count=3)
    eos, suppressed = early[:2], early[2:] if suppress else []
    bans = dict(suppress_tokens=suppressed or None, begin_suppress_tokens=eos[:1] if suppress else None)
    common = dict(max_new_tokens=max_new, eos_token_id=eos, min_new_tokens=min_new, pad_token_id=PAD,
                  return_dict_in_generate=True, **bans, **kwargs)
    out = model.generate(ids, attention_mask=mask, cuda_graphs=graphs, device_loop=graphs and loop, **common)
    other = model.generate(ids, attention_mask=mask, cuda_graphs=not graphs, device_loop=not graphs and loop, **common)
    assert torch.equal(out.sequences, other.sequences)
    for row in _kept_new_tokens(out, ids.shape[1]):
        assert len(row) >= min(min_new + 1, max_new), row
        assert not set(row[:min_new]) & set(eos) and not set(row) & set(suppressed), row
        assert not suppress or row[0] != eos[0], row
    if kwargs.get("do_sample"):
        return
    for b, r in enumerate(rows):
        alone = model.generate(r[None], **common)
        assert torch.equal(out.sequences[b, ids.shape[1] - len(r):], alone.sequences[0]), b


def test_min_length_counts_the_inputs_width(model):
    """``min_length`` is ``min_new_tokens`` plus the width of ``input_ids`` (padding included, as in transformers);
    both given, the larger holds; one at or below the width asks nothing; a GenerationConfig carries either."""
    rows, ids, mask = _batch()
    W = ids.shape[1]
    eos = _early_tokens(model, ids, mask)

    def run(**kwargs):
        return model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=PAD,
                              **kwargs)

    five = run(min_new_tokens=5)
    assert not torch.equal(five, run())
    for kwargs in (dict(min_length=W + 5), dict(min_length=W + 5, min_new_tokens=2),
                   dict(min_length=W + 2, min_new_tokens=5),
                   dict(generation_config=GenerationConfig(min_new_tokens=5, max_new_tokens=12)),
                   dict(generation_config=GenerationConfig(min_length=W + 5, max_new_tokens=12))):
        assert torch.equal(run(**kwargs), five), kwargs
    assert torch.equal(run(min_length=W), run())
    assert torch.equal(run(min_new_tokens=0), run())


def test_one_set_of_graphed_steps_serves_every_minimum(model):
    """The minimum is read on the device: calls with other values reuse the graphed engine and its steps (one
    step key), and give what eager decoding gives; a call without one runs steps that read no ban."""
    rows, ids, mask = _batch()
    eos = _early_tokens(model, ids, mask)
    keys = {GenerationSettings.resolve(model, None, dict(min_new_tokens=n, eos_token_id=eos), ids.shape[1]).step_key()
            for n in (2, 6, 9)}
    assert len(keys) == 1
    unbanned = {GenerationSettings.resolve(model, None, dict(min_new_tokens=n, eos_token_id=eos), ids.shape[1])
                .step_key() for n in (None, 0)}  # 0 asks nothing: the steps read no ban
    assert len(unbanned) == 1 and keys != unbanned
    engines = set()
    for min_new in (2, 6, None, 9):
        common = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=eos, min_new_tokens=min_new,
                      pad_token_id=PAD, strategy="speculative")
        graphed = model.generate(ids, cuda_graphs=True, **common)
        engines.add(id(model._decode_engine[1]))
        assert torch.equal(graphed, model.generate(ids, cuda_graphs=False, **common)), min_new
    assert len(engines) == 1


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(min_new_tokens=-1), ValueError, "min_new_tokens=-1 must be >= 0"),
    (dict(min_new_tokens=2.5), TypeError, "min_new_tokens must be an int"),
    (dict(min_new_tokens=True), TypeError, "min_new_tokens must be an int"),
    (dict(min_length=-3), ValueError, "min_length=-3 must be >= 0"),
    (dict(min_length="9"), TypeError, "min_length must be an int"),
    (dict(min_length=20, min_new_tokens="2"), TypeError, "min_new_tokens must be an int"),
    (dict(min_new_tokens=3, eos_token_id=[]), ValueError, "min_new_tokens=3 holds back EOS, but this call has no "
                                                          "eos_token_id"),
])
def test_bad_minimums_are_refused_by_name(model, kwargs, error, message):
    with pytest.raises(error, match=message):
        model.generate(random_prompts(1, 4), max_new_tokens=8, **{"eos_token_id": 3, **kwargs})


def test_a_checkpoints_minimum_waits_for_calls_with_an_eos(model):
    """A minimum in the checkpoint's generation config holds EOS back in the calls that have one, and is set aside
    in a call without EOS ids (which it would refuse if the call asked for it)."""
    rows, ids, mask = _batch()
    eos = _early_tokens(model, ids, mask)
    common = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=PAD)
    held, plain = model.generate(ids, min_new_tokens=5, **common), model.generate(ids, **common)
    assert not torch.equal(held, plain)
    shipped = model.generation_config
    try:
        model.generation_config = GenerationConfig(min_new_tokens=5)
        assert torch.equal(model.generate(ids, **common), held)
        assert torch.equal(model.generate(ids, **dict(common, min_new_tokens=0)), plain)  # the call's value wins
        model.generate(ids, **dict(common, eos_token_id=[]))  # no EOS: nothing to hold back, nothing refused
    finally:
        model.generation_config = shipped


@pytest.mark.parametrize("prompt_len", [3, 4, 6])
def test_static_decoding_with_suppressed_tokens_equals_the_oracle(model, prompt_len):
    """suppress_tokens (the free run's most frequent tokens) and begin_suppress_tokens (the first token decoding
    without it gives) give the oracle's tokens and confidences with their logits set to -inf (everywhere, and at the
    first new token); bad_words_ids of one token each are suppressed tokens, also from a GenerationConfig."""
    prompt = random_prompts(1, prompt_len, seed=20 + prompt_len)[0]
    common = dict(max_new_tokens=12, eos_token_id=[])
    free = model.generate(prompt[None], **common)[0, prompt_len:].tolist()
    suppress = tuple(sorted({t for t, _ in Counter(free).most_common(2)} | {48}))[:2]
    begin = (int(model.generate(prompt[None], suppress_tokens=list(suppress), **common)[0, prompt_len]),)
    conf = torch.zeros(prompt_len + 12, dtype=torch.float64)
    oracle = naive_static_decode(model, prompt, 12, model.config.block_size, confidences=conf, suppress=suppress,
                                 begin_suppress=begin)
    out = model.generate(prompt[None], suppress_tokens=list(suppress), begin_suppress_tokens=list(begin),
                         return_dict_in_generate=True, output_confidences=True, **common)
    assert torch.equal(out.sequences[0], oracle)
    # each token's probability under the softmax without the banned tokens
    torch.testing.assert_close(out.confidences[0].double(), conf, rtol=1e-5, atol=0)
    new = oracle[prompt_len:].tolist()
    assert not set(new) & set(suppress) and new[0] not in begin
    words = model.generate(prompt[None], bad_words_ids=[[t] for t in suppress], begin_suppress_tokens=list(begin),
                           **common)
    assert torch.equal(words[0], oracle)
    config = GenerationConfig(bad_words_ids=[[suppress[0]]], suppress_tokens=[suppress[1]], max_new_tokens=12)
    assert torch.equal(model.generate(prompt[None], generation_config=config, begin_suppress_tokens=list(begin),
                                      eos_token_id=[])[0], oracle)


@pytest.mark.parametrize("sampled", [{}, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafts", DRAFTS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_speculative_decoding_stays_lossless_with_suppressed_tokens(model, drafts, sampled):
    """Drafts and targets exclude the same tokens at the same positions (every ban at once: EOS before the minimum,
    suppressed tokens, and the first new token's), so speculative decoding commits what static decoding commits."""
    rows, ids, mask = _batch()
    early = _early_tokens(model, ids, mask, count=3)
    common = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=early[0], min_new_tokens=5,
                  suppress_tokens=[early[1]], begin_suppress_tokens=[early[2]], pad_token_id=PAD,
                  return_dict_in_generate=True, **sampled)
    static = model.generate(ids, strategy="static", **common)
    spec = model.generate(ids, strategy="speculative", **drafts, **common)
    assert torch.equal(spec.sequences, static.sequences)
    for row in _kept_new_tokens(static, ids.shape[1]):
        assert early[1] not in row and row[0] != early[2] and early[0] not in row[:5], row


def test_one_set_of_graphed_steps_serves_every_suppressed_list(model):
    """The bans reach the steps through the engine's ban table: calls suppressing other tokens reuse the graphed
    engine and its steps (one step key) and give what eager decoding gives."""
    rows, ids, mask = _batch()
    early = _early_tokens(model, ids, mask, count=3)
    lists = ([early[0]], [early[1], early[2]], [early[2]])
    keys = {GenerationSettings.resolve(model, None, dict(suppress_tokens=s), ids.shape[1]).step_key() for s in lists}
    assert len(keys) == 1
    engines = set()
    for suppress in lists:
        common = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=[], suppress_tokens=suppress,
                      strategy="speculative")
        graphed = model.generate(ids, cuda_graphs=True, **common)
        engines.add(id(model._decode_engine[1]))
        assert torch.equal(graphed, model.generate(ids, cuda_graphs=False, **common)), suppress
        assert not torch.isin(graphed[:, ids.shape[1]:], torch.tensor(suppress)).any()
    assert len(engines) == 1


def test_a_ban_of_all_tokens_but_one_decodes_that_one(model):
    """The bans may leave a single token (the mask token is never decoded): every new token is that one."""
    out = model.generate(random_prompts(1, 4), max_new_tokens=6, eos_token_id=[], suppress_tokens=list(range(65)))
    assert out[0, 4:].tolist() == [65] * 6


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(bad_words_ids=[[3, 4]]), ValueError, "bad_words_ids \\[\\[3, 4\\]\\] are not single tokens"),
    (dict(bad_words_ids=[[]]), ValueError, "are not single tokens"),
    (dict(suppress_tokens=[70]), ValueError, "suppress_tokens 70 is not a token id of the vocabulary"),
    (dict(begin_suppress_tokens=[-1]), ValueError, "begin_suppress_tokens -1 is not a token id"),
    (dict(suppress_tokens=5), TypeError, "suppress_tokens must be a list of token ids, got int"),
    (dict(bad_words_ids="ab"), TypeError, "bad_words_ids must be a list of token ids lists, got str"),
    (dict(bad_words_ids=[5, 6]), TypeError, r"bad_words_ids must be a list of token id lists \(\[\[id\], ...\]"),
    (dict(suppress_tokens=list(range(66))), ValueError, r"^suppress_tokens leave no token of the vocabulary \(67 ids"),
    (dict(suppress_tokens=list(range(60)), begin_suppress_tokens=list(range(60, 66))), ValueError,
     "^suppress_tokens and begin_suppress_tokens leave no token"),
    (dict(bad_words_ids=[[i] for i in range(1, 66)], sequence_bias={(0,): float("-inf")}), ValueError,
     "^suppress_tokens and sequence_bias leave no token"),
    (dict(suppress_tokens=list(range(1, 66)), eos_token_id=0, min_new_tokens=1), ValueError,
     "^suppress_tokens and min_new_tokens leave no token"),
])
def test_bad_bans_are_refused_by_name(model, kwargs, error, message):
    with pytest.raises(error, match=message):
        model.generate(random_prompts(1, 4), max_new_tokens=8, **kwargs)
