"""generate(): layout, KV cache, batching, commit rules, EOS, statistics and bad input (float64, greedy)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
import types
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig, LogitsProcessorList

import mrp_triton
from hf_integration import SDARMRPForCausalLM, decode_engine, modeling_sdar
from hf_integration.generation_settings import READ_BY, GenerationSettings
from hf_integration.kv_cache import StaticKVCache
from tiny_models import (MASK_ID, STRATEGIES, VOCAB, LetterTokenizer, RecordingStreamer, naive_static_decode,
                         padded_batch, random_prompts, tiny_config, tiny_model)

# the strategies whose rows move on to their next block as soon as their own is full (per_row_blocks)
MOVING_ON = [k for k in STRATEGIES if k["strategy"] in READ_BY["per_row_blocks"]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


# one token a step by confidence (static) or position (sequential); entropy-bounded runs of one (bound 0) or more
ORACLE_RULES = [(dict(strategy="static"), {}), (dict(strategy="sequential"), dict(leftmost=True)),
                (dict(strategy="entropy_bounded", entropy_bound=0.0), dict(entropy_bound=0.0)),
                (dict(strategy="entropy_bounded", entropy_bound=6.0), dict(entropy_bound=6.0))]


@pytest.mark.parametrize("kwargs,rule", ORACLE_RULES, ids=lambda x: "-".join(map(str, x.values())))
@pytest.mark.parametrize("prompt_len,max_new", [(3, 9), (8, 5), (5, 12), (2, 7), (6, 1)])
def test_kv_cached_decoding_equals_full_recompute(model, prompt_len, max_new, kwargs, rule):
    """Tokens and backbone forwards (blocks of 4: the last block ending at the block's end, or 1-3 positions
    before it), committing the most confident masked position a step (static), the first (sequential), or the
    lowest-entropy run within the bound (entropy-bounded)."""
    prompt = random_prompts(1, prompt_len, seed=prompt_len)[0]
    out = model.generate(prompt[None], max_new_tokens=max_new, eos_token_id=[], return_dict_in_generate=True,
                         **kwargs)
    forwards = []
    assert torch.equal(out.sequences[0], naive_static_decode(model, prompt, max_new, model.config.block_size,
                                                             forwards, **rule))
    assert out.stats.backbone_forwards.tolist() == [len(forwards)]


@pytest.mark.parametrize("kwargs,rule", ORACLE_RULES, ids=lambda x: "-".join(map(str, x.values())))
@pytest.mark.parametrize("prompt_len,max_new", [(3, 9), (8, 5), (2, 7)])
def test_reveal_steps_and_confidences_are_the_oracles(model, prompt_len, max_new, kwargs, rule):
    """output_reveal_steps: the step that revealed each new token is the uncached oracle's (one token a step, the
    most confident masked position first, or with sequential decoding the first; entropy-bounded runs; the last
    block's positions past the last new token count steps but are not output); output_confidences: each new token's
    probability under the oracle's softmax at that step; prompt positions hold 0; output_top_logprobs: the 3 largest
    log-probabilities of that softmax, the committed token's first. Steps replayed (cuda_graphs on a CPU model) note
    the same."""
    prompt = random_prompts(1, prompt_len, seed=prompt_len)[0]
    expected = torch.zeros(prompt_len + max_new, dtype=torch.long)
    conf = torch.zeros(prompt_len + max_new, dtype=torch.float64)
    top = torch.full((prompt_len + max_new, 3), float("-inf"), dtype=torch.float64)
    tokens = naive_static_decode(model, prompt, max_new, model.config.block_size, reveal_steps=expected,
                                 confidences=conf, top_logprobs=top, **rule)
    if kwargs["strategy"] == "sequential":  # left to right
        assert expected[prompt_len:].tolist() == list(range(1, max_new + 1))
    if rule.get("entropy_bound"):  # some steps reveal several tokens
        assert expected.max() < max_new
    for graphs in (False, True):
        out = model.generate(prompt[None], max_new_tokens=max_new, eos_token_id=[], return_dict_in_generate=True,
                             output_reveal_steps=True, output_confidences=True, output_top_logprobs=3,
                             cuda_graphs=graphs, **kwargs)
        assert torch.equal(out.sequences[0], tokens)
        assert out.reveal_steps.tolist() == [expected.tolist()], graphs
        assert out.confidences.dtype == torch.float32 and (out.confidences[0, prompt_len:] > 0).all()
        torch.testing.assert_close(out.confidences[0].double(), conf, rtol=1e-5, atol=0)
        assert out.top_logprobs.shape == out.top_token_ids.shape == (1, prompt_len + max_new, 3)
        torch.testing.assert_close(out.top_logprobs[0].double(), top, rtol=1e-5, atol=1e-6)
        assert torch.equal(out.top_token_ids[0, prompt_len:, 0], tokens[prompt_len:])
        assert (out.top_token_ids[0, :prompt_len] == -1).all()


@pytest.mark.parametrize("kwargs", [
    dict(strategy="static", denoising_steps=2), dict(strategy="dynamic", threshold=0.3),
    dict(strategy="sequential", denoising_steps=2), dict(strategy="entropy_bounded", entropy_bound=3.0),
    dict(strategy="remask", threshold=0.4),
    dict(strategy="remask", threshold=0.2, remask_rule="delta", residual_delta=0.1),
    dict(strategy="dynamic", threshold=0.3, do_sample=True, temperature=1.7, top_k=3, seed=2),
    dict(strategy="static", do_sample=True, temperature=0.6, top_p=0.5, seed=3)],
                         ids=lambda k: "-".join(map(str, k.values())))
def test_confidences_are_the_committing_forwards_probabilities(model, kwargs):
    """Each new token's confidence is its probability under the softmax (the mask token out, at the call's
    temperature, before top-k / top-p cut it) of an uncached forward over the state before the step that revealed
    it (the prompt and the tokens revealed at earlier steps, masks elsewhere): several tokens a step (dynamic,
    entropy-bounded, two steps a block), positions remasked and revealed again (remask), sampled tokens. Whole
    blocks of a padded batch, 3 blocks of new tokens."""
    T = model.config.block_size
    ids = random_prompts(2, 2 * T, seed=11)
    mask = torch.ones_like(ids)
    mask[0, :T] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3 * T, eos_token_id=[], return_dict_in_generate=True,
                         output_reveal_steps=True, output_confidences=True, **kwargs)
    if kwargs.get("remask_rule"):
        assert (out.stats.tokens_remasked > 0).all()  # positions revealed again after their reveal was taken back
    inverse_temperature = 1.0 / kwargs.get("temperature", 1.0)
    for b in range(2):
        start = int((mask[b] == 0).sum())
        row, steps, conf = (t[b, start:] for t in (out.sequences, out.reveal_steps, out.confidences))
        P = 2 * T - start
        assert not conf[:P].any() and (conf[P:] > 0).all()
        for i in range(P, P + 3 * T):
            end = (i // T + 1) * T
            state = torch.where((steps[:end] < steps[i]) | (torch.arange(end) < P), row[:end], MASK_ID)
            logits = model(state[None]).logits[0, i].clone()
            logits[MASK_ID] = float("-inf")
            expected = (logits * inverse_temperature).softmax(-1)[row[i]]
            torch.testing.assert_close(conf[i].double(), expected, rtol=1e-5, atol=0, msg=f"row {b} position {i}")


REVEALING = [dict(strategy="static"), dict(strategy="dynamic", threshold=0.3), dict(strategy="direct", mrp_steps=2),
             dict(strategy="speculative", mrp_steps=3), dict(strategy="remask", threshold=0.4)]


@pytest.mark.parametrize("kwargs", REVEALING, ids=lambda k: k["strategy"])
def test_reveal_steps_count_every_step_and_follow_the_blocks(model, kwargs):
    """Whole blocks of new tokens (prompts of one and two blocks, 3 blocks of new tokens): each of a row's steps
    reveals at least one token for good, save remask's, whose reveals a later step may take back (its steps noted are
    among its forwards, the last one among them); each step lies in one block, so a block's steps all come after
    the block before's; every step runs one backbone forward (direct: or one MRP forward). Tokens and counts are
    those of the same call without reveal steps."""
    T = model.config.block_size
    ids = random_prompts(2, 2 * T, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :T] = 0
    common = dict(attention_mask=mask, max_new_tokens=3 * T, eos_token_id=[], return_dict_in_generate=True, **kwargs)
    out = model.generate(ids, output_reveal_steps=True, **common)
    plain = model.generate(ids, **common)
    assert torch.equal(out.sequences, plain.sequences) and plain.reveal_steps is None
    steps = out.stats.backbone_forwards + (out.stats.mrp_forwards if kwargs["strategy"] == "direct" else 0)
    for b in range(2):
        assert not out.reveal_steps[b, : 2 * T].any()  # prompt (and left padding)
        new = out.reveal_steps[b, 2 * T:].view(3, T)
        assert (new >= 1).all()
        assert all(new[i].max() < new[i + 1].min() for i in range(2))
        if kwargs["strategy"] == "remask":
            assert new.max() == steps[b] and set(new.flatten().tolist()) <= set(range(1, steps[b] + 1))
        else:
            assert sorted(set(new.flatten().tolist())) == list(range(1, steps[b] + 1))
        if kwargs["strategy"] == "static":
            assert sorted(new.flatten().tolist()) == list(range(1, 3 * T + 1))


def test_cached_denoising_forward_equals_uncached_logits(model):
    """Logits of the current block read over the cache equal a full forward of prefix + block."""
    from hf_integration.decoding import BlockDecoder
    from hf_integration.generation_settings import GenerationSettings
    from hf_integration.prompts import PromptBatch

    ids = random_prompts(2, 10, seed=7)
    settings = GenerationSettings.resolve(model, None, {"max_new_tokens": 6}, prompt_width=10)
    dec = BlockDecoder(model, PromptBatch.from_inputs(model.config, ids, None), settings)
    T = model.config.block_size
    pos = torch.arange(8).expand(2, -1)
    dec.commit(ids[:, :8], pos, None)
    block = torch.cat([ids[:, 8:10], torch.full((2, 2), MASK_ID)], dim=1)
    cached = model.lm_head(dec.backbone(block, torch.arange(8, 8 + T).expand(2, -1)))
    full = model(torch.cat([ids[:, :8], block], dim=1)).logits[:, 8:]
    torch.testing.assert_close(cached, full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kwargs", STRATEGIES, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_decoding_stops_at_the_last_new_token(model, kwargs):
    """``max_new_tokens`` ending inside a block gives the first tokens of that block decoded whole (its positions
    past the last new token are context either way), and decoding stops once they are committed: never more
    forwards than decoding the block whole, fewer where the block's last positions come after them."""
    saved = {}
    for n in (2, 3, 5, 6, 9, 11):
        prompt = random_prompts(1, n, seed=40 + n)
        whole = -(-(n + 7) // 4) * 4 - n  # blocks of 4
        cut, full = (model.generate(prompt, max_new_tokens=new, eos_token_id=[], return_dict_in_generate=True,
                                    **kwargs) for new in (7, whole))
        assert torch.equal(cut.sequences[0], full.sequences[0, : n + 7]), n
        for name in ("backbone_forwards", "mrp_forwards"):
            assert getattr(cut.stats, name) <= getattr(full.stats, name), (name, n)
        saved[n] = int(full.stats.backbone_forwards + full.stats.mrp_forwards
                       - cut.stats.backbone_forwards - cut.stats.mrp_forwards)
    assert saved[9] == 0 and sum(saved.values()) > 0, saved  # 9 + 7 ends with its block


@pytest.mark.parametrize("kwargs", STRATEGIES, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_decoding_stops_at_the_first_eos(model, kwargs):
    """A row whose first EOS is its new token k stops as it would with ``max_new_tokens=k`` (and no EOS): once
    the EOS and every new token before it are committed, however much of the EOS's block is still masked: the
    same tokens and the very same per-row counts, never more forwards than decoding that block whole (the rows
    of a batch stopped there before), fewer where its last positions would come after them. The EOS token in the
    prompt (its last token, in the first decoded block) ends nothing."""
    saved = 0
    for n in (3, 4, 9):
        prompt = random_prompts(1, n, seed=60 + n)
        common = dict(return_dict_in_generate=True, pad_token_id=0, **kwargs)
        free = model.generate(prompt, max_new_tokens=16, eos_token_id=[], **common).sequences[0, n:].tolist()
        firsts = {}  # new-token index of each token's first occurrence
        for k, token in enumerate(free):
            firsts.setdefault(token, k)
        eos_ids = [*list(firsts)[:4], int(prompt[0, -1])]
        for eos in eos_ids:
            k = firsts.get(eos, 15)
            ended = model.generate(prompt, max_new_tokens=16, eos_token_id=[eos], **common)
            cut, whole = (model.generate(prompt, max_new_tokens=new, eos_token_id=[], **common)
                          for new in (k + 1, -(-(n + k + 1) // 4) * 4 - n))  # blocks of 4
            assert torch.equal(ended.sequences[0, : n + k + 1], cut.sequences[0]), (n, k)
            assert (ended.sequences[0, n + k + 1 :] == 0).all()
            for name, value in vars(cut.stats).items():
                assert torch.equal(getattr(ended.stats, name), value), (name, n, k)
            assert ended.batch_steps == cut.batch_steps, (n, k)  # checked after every step: it stops at once
            spent = [int(out.stats.backbone_forwards + out.stats.mrp_forwards) for out in (ended, whole)]
            assert spent[0] <= spent[1], (n, k)
            saved += spent[1] - spent[0]
    assert saved > 0


@pytest.mark.parametrize("kwargs", STRATEGIES, ids=lambda k: "-".join(str(v) for v in k.values()))
@pytest.mark.parametrize("padding", ["right", "left"])
def test_batched_equals_one_by_one(model, kwargs, padding):
    lens = [3, 9, 6]
    rows = [random_prompts(1, n, seed=10 + n)[0] for n in lens]
    ids, mask = padded_batch(rows, padding)
    P = ids.shape[1]
    out = model.generate(ids, attention_mask=mask, max_new_tokens=7, return_dict_in_generate=True, **kwargs)
    for b, r in enumerate(rows):
        alone = model.generate(r[None], max_new_tokens=7, return_dict_in_generate=True, **kwargs)
        row = out.sequences[b]
        real = row[P - len(r):] if padding == "left" else row[: len(r) + 7]
        assert torch.equal(real, alone.sequences[0]), (b, kwargs)
        assert torch.equal(real[: len(r)], r)  # the prompt is never changed
        assert not (real == MASK_ID).any()
        for name in ("backbone_forwards", "mrp_forwards", "tokens_committed", "tokens_remasked"):
            assert getattr(out.stats, name)[b] == getattr(alone.stats, name)[0], (name, b)


def test_a_row_moved_up_the_batch_keeps_its_own_start(model):
    """Rows of other prompt lengths start their new tokens at other positions. Row 0 (a long prompt) ends at its
    first new token and leaves the batch; row 1 (a one-token prompt) moves to the front with its own start, so its
    EOS at a position before row 0's start still ends it: it decodes and counts what it does alone (with row 0's
    start left behind, that EOS would count as prompt and the row would decode on)."""
    rows = [random_prompts(1, 12, seed=4)[0], random_prompts(1, 1, seed=5)[0]]
    free = [model.generate(r[None], max_new_tokens=9, eos_token_id=[])[0, len(r):].tolist() for r in rows]
    eos = free[0][0]
    assert eos in free[1][3:] and eos not in free[1][:3], free  # row 1's EOS comes after its first block (of 4)
    ids, mask = padded_batch(rows, "right")
    common = dict(max_new_tokens=9, eos_token_id=eos, pad_token_id=eos + 1, return_dict_in_generate=True)
    for graphs in (False, True):
        out = model.generate(ids, attention_mask=mask, cuda_graphs=graphs, **common)
        for b, r in enumerate(rows):
            alone = model.generate(r[None], **common)
            assert torch.equal(out.sequences[b, : len(r) + 9], alone.sequences[0]), (graphs, b)
            for name, value in vars(alone.stats).items():
                assert torch.equal(getattr(out.stats, name)[b], value[0]), (graphs, b, name)


SAMPLING = [dict(strategy="speculative", mrp_steps=2, do_sample=True, temperature=0.8, top_k=20, seed=3),
            dict(strategy="dynamic", threshold=0.3, do_sample=True, top_p=0.9, seed=4),
            dict(strategy="entropy_bounded", entropy_bound=3.0, do_sample=True, temperature=0.9, min_p=0.05, seed=5),
            dict(strategy="sequential", do_sample=True, top_k=10, seed=6)]


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 13), min_size=2, max_size=4), kwargs=st.sampled_from(STRATEGIES + SAMPLING),
       max_new=st.lists(st.integers(1, 13), min_size=4, max_size=4), own=st.booleans(),
       eos=st.integers(0, MASK_ID - 4), graphs=st.booleans(), loop=st.booleans(), reveal=st.booleans(),
       seed=st.integers(0, 10**4))
def test_any_batch_gives_each_row_what_it_gives_alone(model, lens, kwargs, max_new, own, eos, graphs, loop, reveal,
                                                      seed):
    """Drawn prompt lengths, strategy, new tokens (drawn: one count for the call, or one per prompt) and EOS token
    (rows stop at different blocks): rows moving on per row (steps replayed or not) and rows starting blocks together
    (the other way; the replayed call with or without a device loop) give the same tokens, per-row counts and (drawn:
    ``output_reveal_steps``, ``output_confidences``) reveal steps and confidences, and with greedy decoding each row of
    the (left-padded) batch gives exactly what it gives alone (with its own count), padding after it. (With one seed
    for the call, sampling noise is keyed by the row's index in the batch, so a sampled row alone is another draw;
    with a seed per prompt, each prompt draws what it draws alone with its seed.)"""
    rows = [random_prompts(1, n, seed=seed + i)[0] for i, n in enumerate(lens)]
    ids, mask = padded_batch(rows, "left")
    P = ids.shape[1]
    limits = max_new[: len(rows)] if own else [max_new[0]] * len(rows)
    common = dict(max_new_tokens=limits if own else limits[0], eos_token_id=eos, pad_token_id=0,
                  return_dict_in_generate=True, output_reveal_steps=reveal, output_confidences=reveal, **kwargs)
    # static and direct rows start their blocks together anyway
    moving = kwargs["strategy"] in READ_BY["per_row_blocks"]
    out = model.generate(ids, attention_mask=mask, cuda_graphs=graphs, device_loop=graphs and loop, **common)
    together = model.generate(ids, attention_mask=mask, cuda_graphs=not graphs, per_row_blocks=not moving,
                              device_loop=not graphs and loop, **common)
    assert torch.equal(out.sequences, together.sequences)
    assert (out.reveal_steps is None) != reveal and (out.confidences is None) != reveal
    if reveal:
        assert torch.equal(out.reveal_steps, together.reveal_steps)
        torch.testing.assert_close(out.confidences, together.confidences, rtol=1e-6, atol=0)
    for name, value in vars(out.stats).items():
        assert torch.equal(getattr(together.stats, name), value), name
    assert out.sequences.shape[1] == P + max(limits)
    if kwargs.get("do_sample"):
        _each_prompt_draws_with_its_seed_what_it_draws_alone(model, rows, ids, mask, common, limits, seed, graphs)
        return
    for b, r in enumerate(rows):
        alone = model.generate(r[None], **dict(common, max_new_tokens=limits[b]))
        own_part, past = slice(P - len(r), P + limits[b]), slice(P + limits[b], None)
        assert torch.equal(out.sequences[b, own_part], alone.sequences[0]), b
        assert not out.sequences[b, past].any(), b  # padding (pad_token_id 0)
        if reveal:
            assert torch.equal(out.reveal_steps[b, own_part], alone.reveal_steps[0]), b
            torch.testing.assert_close(out.confidences[b, own_part], alone.confidences[0], rtol=1e-6, atol=0)
            assert not out.reveal_steps[b, past].any() and not out.confidences[b, past].any(), b
        for name in ("backbone_forwards", "mrp_forwards", "tokens_committed", "tokens_remasked"):
            assert getattr(out.stats, name)[b] == getattr(alone.stats, name)[0], (name, b)


def _each_prompt_draws_with_its_seed_what_it_draws_alone(model, rows, ids, mask, common, limits, seed, graphs):
    """With a seed and a temperature (and a top-p, where the call cuts by one) per prompt (two samples each; steps
    replayed or not), every prompt's rows of the (left-padded) batch are the samples it draws alone with its seed
    and temperature (and its new tokens, ``limits``): tokens, per-row counts, reveal steps and confidences."""
    P = ids.shape[1]
    lists = {"seed": [seed + 1000 * b for b in range(len(rows))],
             "temperature": [0.6 + 0.35 * b for b in range(len(rows))]}
    if common.get("top_p") is not None:
        lists["top_p"] = [0.5 + 0.15 * b for b in range(len(rows))]
    out = model.generate(ids, attention_mask=mask, cuda_graphs=graphs,
                         **dict(common, **lists, num_return_sequences=2))
    assert len({tuple(row) for row in out.sequences.tolist()}) > 1  # not one draw for all
    for b, r in enumerate(rows):
        alone = model.generate(r[None], **dict(common, **{name: values[b] for name, values in lists.items()},
                                               num_return_sequences=2, max_new_tokens=limits[b]))
        both, own_part = slice(2 * b, 2 * b + 2), slice(P - len(r), P + limits[b])
        assert torch.equal(out.sequences[both, own_part], alone.sequences), b
        assert not out.sequences[both, P + limits[b]:].any(), b
        if alone.reveal_steps is not None:
            assert torch.equal(out.reveal_steps[both, own_part], alone.reveal_steps), b
            torch.testing.assert_close(out.confidences[both, own_part], alone.confidences, rtol=1e-6, atol=0)
        for name, value in vars(alone.stats).items():
            assert torch.equal(getattr(out.stats, name)[both], value), (name, b)


def _spy_select(monkeypatch):
    """From now on, each select_commit call's (masked, tokens, conf, n, threshold, committed), in order."""
    calls = []
    original = mrp_triton.select_commit

    def spy(block, tokens, conf, *, mask_token_id, n, threshold=None, **rule):
        masked = (block == mask_token_id).clone()
        committed = original(block, tokens, conf, mask_token_id=mask_token_id, n=n, threshold=threshold, **rule)
        calls.append((masked, tokens.clone(), conf.clone(), torch.as_tensor(n).clone(), threshold, committed.clone()))
        return committed

    monkeypatch.setattr(mrp_triton, "select_commit", spy)
    return calls


@pytest.mark.parametrize("strategy", ["static", "sequential"])
@pytest.mark.parametrize("prompt_len", [4, 3, 6])
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_static_and_sequential_commit_exactly_the_scheduled_count(model, monkeypatch, steps, prompt_len, strategy):
    """SDAR's schedule, n = T // S a step (the first T % S steps one more), in every block: a first block holding
    the prompt's tail keeps it and so runs out of masks in fewer steps (SDAR's generate.py). Static commits the n
    most confident masked positions; sequential the first n, left to right, picking tokens at those only."""
    calls = _spy_select(monkeypatch)
    ids = random_prompts(2, prompt_len, seed=3)
    T = model.config.block_size
    out = model.generate(ids, max_new_tokens=3 * T - prompt_len, denoising_steps=steps, strategy=strategy,
                         return_dict_in_generate=True)
    schedule = [T // steps + (i < T % steps) for i in range(steps)]
    first_masks = T - prompt_len % T
    first_steps = next(k for k in range(1, steps + 1) if sum(schedule[:k]) >= first_masks)
    expected_n = (schedule[:first_steps] if prompt_len % T else []) + schedule * (3 - (prompt_len + T - 1) // T)
    assert [int(n[0]) for _, _, _, n, _, _ in calls] == expected_n  # the row's quota, step by step
    for masked, tokens, conf, n, _, committed in calls:
        assert torch.equal(committed.sum(-1), torch.minimum(n, masked.sum(-1)))
        for b in range(committed.shape[0]):
            if strategy == "sequential":  # the first n masked positions, and tokens picked there only
                leading = masked[b] & (masked[b].cumsum(0) <= n[b])
                assert torch.equal(committed[b], leading)
                assert torch.equal(tokens[b] >= 0, leading)
            elif committed[b].any() and (masked[b] & ~committed[b]).any():  # the most confident masked ones
                assert conf[b][committed[b]].min() >= conf[b][masked[b] & ~committed[b]].max()
    assert out.stats.backbone_forwards.tolist() == [len(expected_n)] * 2


@pytest.mark.parametrize("threshold", [0.05, 0.3, 0.9, 1.0])
def test_dynamic_commits_every_position_above_threshold_or_the_top_n(model, monkeypatch, threshold):
    calls = _spy_select(monkeypatch)
    model.generate(random_prompts(2, 5, seed=4), max_new_tokens=11, strategy="dynamic", threshold=threshold)
    for masked, _, conf, n, thr, committed in calls:
        above = masked & (conf > threshold)
        for b in range(masked.shape[0]):
            if above[b].sum() >= n[b]:
                assert torch.equal(committed[b], above[b])
            else:  # the n most confident masked positions
                assert committed[b].sum() == min(int(n[b]), int(masked[b].sum()))
                if (masked[b] & ~committed[b]).any():
                    assert conf[b][committed[b]].min() >= conf[b][masked[b] & ~committed[b]].max()


@pytest.mark.parametrize("left", [True, False])
def test_the_output_keeps_the_inputs_width(model, left):
    """Padded to a fixed length (padding="max_length"), the input has columns of padding in every row: the output is
    [B, W + max_new_tokens] still, as in transformers, so out[:, W:] are a left-padded batch's new tokens (and
    max_length counts W); the tokens are those of the tightly padded batch, with the extra padding kept."""
    tight, mask = padded_batch([random_prompts(1, n, seed=60 + b)[0] for b, n in enumerate((5, 3))],
                               "left" if left else "right")
    extra = torch.zeros((2, 3), dtype=torch.long)
    wide = torch.cat([extra, tight] if left else [tight, extra], 1)
    wide_mask = torch.cat([extra, mask] if left else [mask, extra], 1)
    common = dict(pad_token_id=0, eos_token_id=[], return_dict_in_generate=True, output_reveal_steps=True,
                  output_confidences=True)
    ref = model.generate(tight, attention_mask=mask, max_new_tokens=6, **common)
    out = model.generate(wide, attention_mask=wide_mask, max_new_tokens=6, **common)
    assert out.sequences.shape == out.reveal_steps.shape == out.confidences.shape == (2, 8 + 6)
    for field in ("sequences", "reveal_steps", "confidences"):
        got, want = getattr(out, field), getattr(ref, field)
        pad = torch.zeros_like(want[:, :3])
        expect = torch.cat([pad, want] if left else [want, pad], 1)
        assert torch.equal(got, expect), field
    assert model.generate(wide, attention_mask=wide_mask, max_length=14, eos_token_id=[]).shape == (2, 14)


def test_eos_cuts_rows_and_pads(model):
    ids = random_prompts(2, 5, seed=8)
    free = model.generate(ids, max_new_tokens=12)
    eos = int(free[0, 7])  # a token that row 0 produces as its 3rd new token
    out = model.generate(ids, max_new_tokens=12, eos_token_id=[eos], pad_token_id=0,
                         return_dict_in_generate=True)
    for b in range(2):
        new = out.sequences[b, 5:]
        hits = (free[b, 5:] == eos).nonzero()
        if len(hits):
            first = int(hits[0])
            assert torch.equal(new[: first + 1], free[b, 5 : 6 + first]) and (new[first + 1 :] == 0).all()
            assert out.new_tokens[b] == first + 1  # the completion's length, its EOS included
        else:
            assert torch.equal(new, free[b, 5:]) and out.new_tokens[b] == 12
    assert out.new_tokens.dtype == torch.long and out.new_tokens.device == out.sequences.device
    assert out.stats.tokens_committed[0] < 12  # row 0 stopped after the block holding its EOS
    for one_or_tuple in (eos, (eos,)):  # one id, or a tuple of them, as the list
        assert torch.equal(model.generate(ids, max_new_tokens=12, eos_token_id=one_or_tuple, pad_token_id=0),
                           out.sequences), one_or_tuple


def test_a_generation_configs_block_size_and_mask_token_id(model):
    """A passed generation config's block_size asks for blocks of that size (block_length; the stock SDAR config.json
    lacks one); its mask_token_id must be the model's (set at load), else it is refused, not ignored; the model's
    own generation config's copies of them (taken when it was saved) do not override the loaded config."""
    ids = random_prompts(1, 5, seed=0)
    eight = model.generate(ids, max_new_tokens=10, block_length=8)
    assert not torch.equal(eight, model.generate(ids, max_new_tokens=10))
    assert torch.equal(eight, model.generate(ids, max_new_tokens=10, generation_config=GenerationConfig(block_size=8)))
    assert torch.equal(model.generate(ids, max_new_tokens=10, block_length=4), model.generate(
        ids, max_new_tokens=10, generation_config=GenerationConfig(block_size=8, block_length=4)))
    same = GenerationConfig(block_size=model.config.block_size, mask_token_id=model.config.mask_token_id)
    assert torch.equal(model.generate(ids, max_new_tokens=10), model.generate(ids, max_new_tokens=10,
                                                                              generation_config=same))
    with pytest.raises(ValueError, match=r"generation_config sets mask_token_id=3, but the model decodes with "
                                         r"config.mask_token_id=\d+: load it with from_pretrained\(\.\.\., "
                                         r"mask_token_id=3\)"):
        model.generate(ids, generation_config=GenerationConfig(mask_token_id=3))
    saved = model.generation_config
    try:  # a checkpoint saved with blocks of 8 and loaded with block_size overridden to the config's 4
        model.generation_config = GenerationConfig(block_size=8, mask_token_id=3)
        assert torch.equal(model.generate(ids, max_new_tokens=10, block_length=4),
                           model.generate(ids, max_new_tokens=10))
        # nor do they when a pipeline passes a copy of that generation config: only what it changes asks for blocks
        copied = copy.deepcopy(model.generation_config)
        assert torch.equal(model.generate(ids, max_new_tokens=10, block_length=4),
                           model.generate(ids, max_new_tokens=10, generation_config=copied))
    finally:
        model.generation_config = saved


def test_generation_config_and_kwargs_precedence(model):
    ids = random_prompts(1, 4, seed=9)
    via_config = model.generate(ids, generation_config=GenerationConfig(max_new_tokens=6, strategy="dynamic",
                                                                        threshold=0.5))
    via_kwargs = model.generate(ids, max_new_tokens=6, strategy="dynamic", threshold=0.5)
    assert torch.equal(via_config, via_kwargs) and via_config.shape == (1, 10)
    overridden = model.generate(ids, generation_config=GenerationConfig(max_new_tokens=6), max_new_tokens=3)
    assert overridden.shape == (1, 7)
    # a keyword given as None passes nothing (transformers' convention): the config's value stays
    kept = model.generate(ids, generation_config=GenerationConfig(max_new_tokens=6, strategy="dynamic", threshold=0.5),
                          max_new_tokens=None, strategy=None, threshold=None)
    assert torch.equal(kept, via_config)
    # do_sample=False beside a config that samples (transformers 5.17's text-generation pipeline passes its sampling
    # defaults so): greedy, the config's sampling values waiting; a sampling keyword the call gives is refused still
    pipeline_like = GenerationConfig(do_sample=True, temperature=0.7, top_k=50, max_new_tokens=6)
    greedy = model.generate(ids, generation_config=pipeline_like, do_sample=False)
    assert torch.equal(greedy, model.generate(ids, max_new_tokens=6))
    with pytest.raises(ValueError, match="temperature=0.5 steers sampling"):
        model.generate(ids, generation_config=pipeline_like, do_sample=False, temperature=0.5)


def test_the_resolved_defaults(model):
    """What a call that sets nothing decodes with: 64 new tokens, the config's block, one token a step, tau 0.9
    (dynamic) or 0.5 (remask), K = 3."""
    for strategy, threshold in (("static", None), ("dynamic", 0.9), ("remask", 0.5)):
        s = GenerationSettings.resolve(model, None, {"strategy": strategy}, prompt_width=4)
        assert (s.max_new_tokens, s.block_length, s.denoising_steps, s.threshold, s.mrp_steps) == \
            (64, model.config.block_size, model.config.block_size, threshold, 3)


def test_a_checkpoint_sets_strategy_settings_for_the_strategies_that_read_them(model):
    """The model's own generation config may carry settings of several strategies (a threshold, mrp_steps):
    each call applies those its strategy reads (as the same values passed by the call would) and ignores the
    others; a call asking for one its strategy does not read (a keyword, or a passed generation_config that
    differs from the model's) is refused."""
    ids = random_prompts(1, 4, seed=9)
    shipped = model.generation_config
    plain = {s: model.generate(ids, max_new_tokens=8, strategy=s) for s in ("static", "dynamic", "direct")}
    try:
        model.generation_config = GenerationConfig(threshold=0.1, mrp_steps=1, remask_rule="delta")
        assert torch.equal(model.generate(ids, max_new_tokens=8), plain["static"])
        dynamic = model.generate(ids, max_new_tokens=8, strategy="dynamic")
        direct = model.generate(ids, max_new_tokens=8, strategy="direct")
        with pytest.raises(ValueError, match="threshold=0.6 steers strategy 'dynamic' or 'remask', not 'static'"):
            model.generate(ids, generation_config=GenerationConfig(threshold=0.6), max_new_tokens=8)
        # a copy of the model's own config (what a pipeline passes) asks for nothing the model does not set
        copied = copy.deepcopy(model.generation_config)
        assert torch.equal(model.generate(ids, generation_config=copied, max_new_tokens=8), plain["static"])
        # nor do engine settings only some strategies read: a checkpoint's per_row_blocks leaves direct calls alone
        model.generation_config = GenerationConfig(per_row_blocks=False)
        assert torch.equal(model.generate(ids, max_new_tokens=8, strategy="direct"), plain["direct"])
    finally:
        model.generation_config = shipped
    assert torch.equal(dynamic, model.generate(ids, max_new_tokens=8, strategy="dynamic", threshold=0.1))
    assert torch.equal(direct, model.generate(ids, max_new_tokens=8, strategy="direct", mrp_steps=1))
    assert not torch.equal(dynamic, plain["dynamic"]) and not torch.equal(direct, plain["direct"])


def test_settings_of_other_strategies_at_their_defaults_ask_for_nothing(model):
    """Only a value other than its default asks for a setting: a call passing the settings only other strategies
    read at their defaults (generic code may pass mrp_steps=3, per_row_blocks=True, ...) is not refused, and
    decodes as without them."""
    ids = random_prompts(1, 4, seed=9)
    for strategy in ("static", "dynamic"):
        unread = {f.name: f.default for f in dataclasses.fields(GenerationSettings)
                  if f.name in READ_BY and strategy not in READ_BY[f.name] and f.default is not None}
        assert {"mrp_steps", "mrp_scale"} <= set(unread), unread
        assert torch.equal(model.generate(ids, max_new_tokens=6, strategy=strategy, **unread),
                           model.generate(ids, max_new_tokens=6, strategy=strategy)), strategy


def test_use_cache_is_accepted_and_unknown_keywords_are_refused(model):
    """transformers snippets pass use_cache: the tokens are those of the cached decoding either way (the cache
    is exact); a keyword generate() does not know is a TypeError naming it."""
    ids = random_prompts(1, 4, seed=9)
    plain = model.generate(ids, max_new_tokens=6)
    for use_cache in (True, False):
        assert torch.equal(model.generate(ids, max_new_tokens=6, use_cache=use_cache), plain)
    with pytest.raises(TypeError, match="use_cache must be a bool"):
        model.generate(ids, max_new_tokens=6, use_cache="yes")
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['outputs_scores'\]"):
        model.generate(ids, max_new_tokens=6, outputs_scores=None)


def test_transformers_keywords_that_ask_for_nothing_pass_and_others_are_refused(model):
    """Code written for transformers' generate passes its keywords at values that ask for nothing (num_beams=1,
    output_scores=False, logits_processor=None, ...): the tokens are those of a call without them. The same keywords
    at values that ask for something (beam search, scores, a logits processor) are a TypeError
    naming each with its value, the rest checked as a generation_config's fields are."""
    ids = random_prompts(1, 4, seed=9)
    plain = model.generate(ids, max_new_tokens=6)
    nothing = dict(num_beams=1, repetition_penalty=1.0, output_scores=False, logits_processor=None,
                   stopping_criteria=None, synced_gpus=False, min_new_tokens=None)
    assert torch.equal(model.generate(ids, max_new_tokens=6, **nothing), plain)
    # empty lists, and a guidance scale of 1 (transformers adds classifier-free guidance for another scale only)
    for empty in (dict(logits_processor=LogitsProcessorList()), dict(logits_processor=[], guidance_scale=1.0),
                  dict(guidance_scale=1)):
        assert torch.equal(model.generate(ids, max_new_tokens=6, **empty), plain), empty
    # what decoding does anyway (a static KV cache, no torch.compile), as code written for transformers may ask
    done = dict(cache_implementation="static", disable_compile=True)
    assert torch.equal(model.generate(ids, max_new_tokens=6, **done), plain)
    assert torch.equal(model.generate(ids, max_new_tokens=6, generation_config=GenerationConfig(**done)), plain)
    for other in (dict(cache_implementation="offloaded"), dict(cache_implementation="dynamic")):
        with pytest.raises(TypeError, match=f"got cache_implementation='{other['cache_implementation']}'"):
            model.generate(ids, max_new_tokens=6, **other)
    with pytest.raises(TypeError, match=r"generate\(\) got num_beams=2, output_scores=True, which block-diffusion "
                                        r"decoding does not support; drop them"):
        model.generate(ids, max_new_tokens=6, output_scores=True, num_beams=2)
    with pytest.raises(TypeError, match=r"for output_logits, output_confidences=True \(each new token's probability\)"):
        model.generate(ids, max_new_tokens=6, output_logits=True)
    with pytest.raises(TypeError, match=r"\]\); for output_scores, output_confidences=True"):
        model.generate(ids, generation_config=GenerationConfig(output_scores=True, max_new_tokens=6))
    with pytest.raises(TypeError, match=r"got logits_processor=\[<function .*; drop it \("):
        model.generate(ids, max_new_tokens=6, logits_processor=[lambda i, s: s])
    with pytest.raises(TypeError, match=r"got guidance_scale=1.5"):
        model.generate(ids, max_new_tokens=6, guidance_scale=1.5)
    with pytest.raises(TypeError, match=r"got num_beams=tensor\(1\)"):  # not compared: a tensor asks for something
        model.generate(ids, max_new_tokens=6, num_beams=torch.tensor(1))


def test_generation_config_fields_we_do_not_support_are_refused_or_flagged(model, caplog):
    """A generation_config the caller passes with e.g. beam search or an n-gram ban is refused (a silent drop would
    decode something else than asked); the same fields in the model's own generation config (as checkpoints ship
    them) are ignored with a warning."""
    ids = random_prompts(1, 4, seed=9)
    with pytest.raises(TypeError, match=r"generation_config sets \['no_repeat_ngram_size', 'num_beams'\]"):
        model.generate(ids, generation_config=GenerationConfig(max_new_tokens=4, num_beams=2, no_repeat_ngram_size=3))
    plain = model.generate(ids, max_new_tokens=4)
    shipped = model.generation_config
    try:
        model.generation_config = GenerationConfig(no_repeat_ngram_size=3, max_new_tokens=4)
        with caplog.at_level("WARNING"):
            assert torch.equal(model.generate(ids), plain)
    finally:
        model.generation_config = shipped
    assert "['no_repeat_ngram_size']" in caplog.text and "ignored" in caplog.text


def test_generation_config_filled_with_transformers_defaults_is_accepted(model):
    """transformers fills the fields nobody set with its own defaults (num_beams=1, repetition_penalty=1.0, ...;
    the text-generation pipeline of transformers 5.17 does so before calling generate): those ask for nothing,
    so they are not refused, and the call decodes as without them."""
    from hf_integration.generation_settings import FILLED_DEFAULTS

    ids = random_prompts(1, 4, seed=9)
    unsupported = {k: v for k, v in FILLED_DEFAULTS.items()
                   if k in ("num_beams", "length_penalty", "no_repeat_ngram_size")}
    assert len(unsupported) == 3, "transformers no longer fills these defaults: revisit FILLED_DEFAULTS"
    filled = GenerationConfig(max_new_tokens=4, **unsupported)
    assert torch.equal(model.generate(ids, generation_config=filled), model.generate(ids, max_new_tokens=4))


@pytest.mark.parametrize("strategy", ["static", "speculative"])
def test_decoding_forwards_read_rope_tables_built_once(model, monkeypatch, strategy):
    """The decoder's forwards read the RoPE tables the engine built once (positions 0 .. width + block - 1) instead
    of computing them; the tokens are those of the oracle, which computes them in every forward."""
    calls = []
    compute = modeling_sdar.rotary_cos_sin

    def counted(config, positions, *args):
        calls.append(tuple(positions.shape))
        return compute(config, positions, *args)

    for module in (modeling_sdar, decode_engine):
        monkeypatch.setattr(module, "rotary_cos_sin", counted)
    prompt = random_prompts(1, 5, seed=2)[0]
    out = model.generate(prompt[None], max_new_tokens=10, strategy=strategy)
    assert calls == [(1, 16 + model.config.block_size)]  # the layout: 5 + 10 tokens in blocks of 4
    monkeypatch.undo()
    assert torch.equal(out[0], naive_static_decode(model, prompt, 10, model.config.block_size))


def test_stats_report_tokens_per_forward(model):
    out = model.generate(random_prompts(1, 4, seed=1), max_new_tokens=8, denoising_steps=2,
                         return_dict_in_generate=True)
    s = out.stats.as_dict()
    assert s["tokens_committed"] == [8] and s["backbone_forwards"] == [4] and s["tokens_per_forward"] == [2.0]
    assert decode_engine.DecodeStats.zeros(2, 1, "cpu").as_dict()["tokens_per_forward"] == [0.0, 0.0]  # not 0 / 0


def test_block_length_other_than_config(model):
    """Blocks of 8 (the config's are 4) take one token a step by default too (denoising_steps = block_length): as
    many forwards as with the config's blocks, where 4 steps a block of 8 would take fewer."""
    assert model.config.block_size == 4
    ids = random_prompts(1, 5, seed=2)
    out = model.generate(ids, max_new_tokens=10, block_length=8, return_dict_in_generate=True)
    assert out.sequences.shape == (1, 15) and not (out.sequences == MASK_ID).any()
    forwards = out.stats.as_dict()["backbone_forwards"]
    assert forwards == model.generate(ids, max_new_tokens=10, return_dict_in_generate=True).stats.as_dict()[
        "backbone_forwards"]
    fewer = model.generate(ids, max_new_tokens=10, block_length=8, denoising_steps=4, return_dict_in_generate=True)
    assert fewer.stats.as_dict()["backbone_forwards"][0] < forwards[0]


def test_max_length_counts_the_prompt_width_and_yields_to_max_new_tokens(model, caplog):
    ids = random_prompts(2, 5, seed=3)
    assert torch.equal(model.generate(ids, max_length=12), model.generate(ids, max_new_tokens=7))
    with caplog.at_level(logging.WARNING):
        assert model.generate(ids, max_length=12, max_new_tokens=3).shape == (2, 8)  # as in transformers
    assert "both max_new_tokens=3 and max_length=12 were given: max_new_tokens wins" in caplog.text
    assert model.generate(ids).shape == (2, 5 + 64)  # neither given: 64 new tokens


@pytest.mark.parametrize("strategy", ["static", "speculative"])
def test_num_return_sequences_samples_each_prompt_that_many_times(model, strategy):
    """The copies of a prompt sit next to each other and are the rows of the repeated batch (so each draws its
    own noise)."""
    ids = random_prompts(2, 5, seed=4)
    kwargs = dict(max_new_tokens=12, do_sample=True, strategy=strategy, seed=5, return_dict_in_generate=True)
    out = model.generate(ids, num_return_sequences=3, **kwargs)
    repeated = model.generate(ids.repeat_interleave(3, 0), **kwargs)
    assert out.sequences.shape == (6, 17) and torch.equal(out.sequences, repeated.sequences)
    assert out.stats.as_dict() == repeated.stats.as_dict()
    assert len({tuple(row) for row in out.sequences[:3, 5:].tolist()}) > 1  # the copies differ


def test_sampled_calls_without_a_seed_draw_one_from_torchs_generator(model):
    """As in transformers: two sampled calls differ, torch.manual_seed repeats a call, and a seed fixes the draw
    whatever torch's generator holds; greedy calls draw nothing from it."""
    ids = random_prompts(4, 5, seed=4)
    kwargs = dict(max_new_tokens=12, do_sample=True, temperature=2.0)
    torch.manual_seed(0)
    first, second = model.generate(ids, **kwargs), model.generate(ids, **kwargs)
    assert not torch.equal(first, second)
    torch.manual_seed(0)
    assert torch.equal(first, model.generate(ids, **kwargs))
    fixed = model.generate(ids, seed=7, **kwargs)
    torch.rand(3)  # moves torch's generator on
    assert torch.equal(fixed, model.generate(ids, seed=7, **kwargs))
    state = torch.get_rng_state()
    model.generate(ids, max_new_tokens=4)
    assert torch.equal(state, torch.get_rng_state())


BAD_INPUTS = [
    (dict(input_ids=torch.tensor([[1, VOCAB]])), ValueError, "outside the vocabulary \\[0, 67\\) \\(min 1, max 67\\)"),
    (dict(input_ids=None, inputs_embeds=torch.zeros(1, 3, 8)), TypeError, "needs input_ids"),
    (dict(inputs=torch.tensor([[1, 2]])), TypeError, "prompt twice"),
    (dict(input_ids=torch.tensor([[1, 2, 99]])), ValueError, "outside the vocabulary"),
    (dict(input_ids=torch.tensor([[1, -1]])), ValueError, "outside the vocabulary"),
    (dict(input_ids=torch.zeros((1, 0), dtype=torch.long)), ValueError, "empty"),
    (dict(input_ids=torch.zeros((0, 3), dtype=torch.long)), ValueError, "input_ids is empty: give at least one"),
    (dict(input_ids=torch.tensor([[1, 2], [3, 4]]), attention_mask=torch.tensor([[1, 1], [0, 0]])), ValueError,
     "row 1 of the prompt is empty or all padding"),
    (dict(input_ids=torch.tensor([[1, 2]]), attention_mask=torch.tensor([[0, 0]])), ValueError, "all padding"),
    (dict(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 0, 1]])), ValueError, "contiguous"),
    (dict(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 2, 1]])), ValueError,
     r"attention_mask must hold 1 \(a token\) and 0 \(padding\) only, got \[2\]"),
    (dict(input_ids=torch.tensor([[1, MASK_ID]])), ValueError, "mask token"),
    (dict(input_ids=torch.tensor([[1.0, 2.0]])), ValueError, "integer tensor"),
    (dict(input_ids=[[1, 2]]), TypeError, "torch.Tensor"),
    (dict(input_ids=torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 3)), ValueError, "shape of input_ids"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=[2, 3]), ValueError, "max_new_tokens has 2 counts for 1 prompts: give one per row of"),
    (dict(max_new_tokens=[]), ValueError, "max_new_tokens has 0 counts for 1 prompts"),
    (dict(max_new_tokens=[0]), ValueError, "max_new_tokens=0 must be >= 1"),
    (dict(max_new_tokens=[2.0]), TypeError, "max_new_tokens must be an int, got float"),
    (dict(max_new_tokens=[600]), ValueError, "max_position_embeddings"),
    (dict(stop_strings=[["ab"], ["c"]], tokenizer=LetterTokenizer()), ValueError,
     r"stop_strings has 2 lists for 1 prompts: give one per row of input_ids \(an empty list: none for that row\)"),
    (dict(stop_strings=[["ab"], "c"], tokenizer=LetterTokenizer()), TypeError,
     "stop_strings must be a non-empty string, a list of them, or a list of one such list per prompt"),
    (dict(stop_strings=[[""]], tokenizer=LetterTokenizer()), TypeError, "stop_strings must be a non-empty string"),
    (dict(max_new_tokens=600), ValueError, "max_position_embeddings"),
    (dict(max_new_tokens=None, max_length=3), ValueError, r"max_length=3 must be >= 4 \(the input_ids are 3 wide"),
    (dict(max_new_tokens=None, max_length="8"), TypeError, "max_length"),
    (dict(num_return_sequences=2), ValueError, "num_return_sequences=2 without sampling.*do_sample=True"),
    (dict(num_return_sequences=0, do_sample=True), ValueError, "num_return_sequences=0 must be >= 1"),
    (dict(strategy="greedy"), ValueError, "strategy"),
    (dict(strategy="dynamic", threshold=0.0), ValueError, "threshold"),
    (dict(strategy="dynamic", threshold=1.5), ValueError, "threshold"),
    (dict(denoising_steps=0), ValueError, "denoising_steps"),
    (dict(block_length=0), ValueError, "block_length=0 must be >= 1"),
    (dict(block_length=4.0), TypeError, "block_length must be an int, got float"),
    (dict(denoising_steps=5), ValueError, "denoising_steps"),
    (dict(denoising_steps="2"), TypeError, "denoising_steps must be an int, got str"),
    (dict(denoising_steps=2.0), TypeError, "denoising_steps must be an int, got float"),
    (dict(denoising_steps=True), TypeError, "denoising_steps must be an int, got bool"),
    (dict(generation_config={"max_new_tokens": 3}), TypeError,
     "generation_config must be a transformers.GenerationConfig, got dict"),
    (dict(attention_mask=GenerationConfig(max_new_tokens=3)), TypeError,
     "attention_mask got a GenerationConfig: pass it as generation_config="),
    (dict(temperature=0.5), ValueError, "temperature=0.5 steers sampling, which this call does not do"),
    (dict(do_sample=True, temperature=0.0), ValueError, "temperature"),
    (dict(do_sample=True, temperature=float("inf")), ValueError, "temperature must be a finite float"),
    (dict(do_sample=True, temperature=1e-21), ValueError, r"temperature must be a finite float in \[1e-20, 1e\+20\]"),
    (dict(do_sample=True, temperature=1e21), ValueError, r"temperature must be a finite float in \[1e-20, 1e\+20\]"),
    (dict(do_sample=True, top_p=0.0), ValueError, "top_p"),
    (dict(do_sample=True, top_k=-1), ValueError, r"top_k=-1 must be >= 0 \(0 or None: no top-k cut\)"),
    (dict(do_sample=True, top_k=2.5), TypeError, "top_k must be an int"),
    # transformers' "no top-k cut" is the int 0 only: False and 0.0 equal 0 but are no top_k
    (dict(do_sample=True, top_k=False), TypeError, "top_k must be an int, got bool"),
    (dict(do_sample=True, top_k=0.0), TypeError, "top_k must be an int, got float"),
    (dict(eos_token_id=1000), ValueError, r"eos_token_id 1000 is not a token id of the vocabulary \[0, "),
    (dict(eos_token_id=[3, MASK_ID]), ValueError, f"eos_token_id {MASK_ID} is the mask token, which decoding never"),
    (dict(pad_token_id=-3), ValueError, r"pad_token_id -3 is not a token id of the vocabulary \[0, "),
    (dict(pad_token_id=1000), ValueError, "pad_token_id 1000 is not a token id"),
    (dict(pad_token_id=VOCAB), ValueError, f"pad_token_id {VOCAB} is not a token id"),
    (dict(eos_token_id=VOCAB), ValueError, f"eos_token_id {VOCAB} is not a token id"),
    (dict(strategy="speculative", mrp_steps=0), ValueError, "mrp_steps"),
    (dict(strategy="speculative", draft_schedule="eagle"), ValueError, "draft_schedule"),
    (dict(strategy="remask", remask_rule="maybe"), ValueError, "remask_rule"),
    (dict(strategy="remask", remask_rule="delta", residual_delta=0.0), ValueError, "residual_delta"),
    (dict(strategy="direct", mrp_mix="product"), ValueError, "mrp_mix"),
    (dict(strategy="speculative", mrp_steps=5), ValueError, r"mrp_steps=5 must be at most block_length \(4\)"),
    (dict(strategy="direct", mrp_steps=3, block_length=2), ValueError, r"mrp_steps=3 must be at most block_length"),
    (dict(strategy="direct", mrp_scale=float("nan")), ValueError, "mrp_scale=nan must be a finite float32 number"),
    (dict(strategy="direct", mrp_scale=1e39), ValueError, "mrp_scale=1e[+]39 must be a finite float32 number"),
    (dict(strategy="speculative", mrp_scale="1"), ValueError, "mrp_scale='1' must be a finite float32 number"),
    (dict(strategy="direct", mrp_scale=True), ValueError, "mrp_scale=True must be a finite float32 number"),
    (dict(strategy="speculative", denoising_steps=2), ValueError,
     "denoising_steps=2 steers strategy 'static' or 'dynamic' or 'sequential' or 'entropy_bounded' or 'remask', "
     "not 'speculative'"),
    (dict(entropy_bound=0.5), ValueError, "entropy_bound=0.5 steers strategy 'entropy_bounded', not 'static'"),
    (dict(strategy="entropy_bounded", entropy_bound=-0.1), ValueError, "entropy_bound=-0.1 must be a finite number"),
    (dict(strategy="entropy_bounded", entropy_bound=float("nan")), ValueError, "entropy_bound=nan must be a finite"),
    (dict(strategy="entropy_bounded", entropy_bound="0.5"), TypeError, "entropy_bound must be a number, got str"),
    (dict(strategy="entropy_bounded", threshold=0.5), ValueError, "threshold=0.5 steers strategy 'dynamic' or"),
    (dict(threshold=0.7), ValueError, "threshold=0.7 steers strategy 'dynamic' or 'remask', not 'static': drop it"),
    (dict(strategy="sequential", threshold=0.7), ValueError, "threshold=0.7 steers strategy 'dynamic' or 'remask', "
     "not 'sequential'"),
    (dict(strategy="sequential", per_row_blocks=False), ValueError, "per_row_blocks=False steers strategy 'dynamic'"),
    (dict(mrp_steps=2), ValueError, "mrp_steps=2 steers strategy 'direct' or 'speculative', not 'static'"),
    (dict(strategy="direct", draft_schedule="authors"), ValueError, "draft_schedule='authors' steers strategy"),
    (dict(strategy="dynamic", remask_rule="delta"), ValueError, "remask_rule='delta' steers strategy 'remask'"),
    (dict(strategy="speculative", residual_delta=0.5), ValueError, "residual_delta=0.5 steers strategy 'remask'"),
    (dict(strategy="dynamic", mrp_scale=0.5), ValueError, "mrp_scale=0.5 steers strategy 'direct' or"),
    (dict(mrp_mix="none"), ValueError, "mrp_mix='none' steers strategy"),
    (dict(strategy="direct", per_row_blocks=False), ValueError, "per_row_blocks=False steers strategy 'dynamic'"),
    (dict(frobnicate=True), TypeError, "frobnicate"),
    (dict(do_sample=1), TypeError, "do_sample must be a bool, got int"),
    (dict(strategy="dynamic", per_row_blocks="no"), TypeError, "per_row_blocks must be a bool, got str"),
    (dict(fuse_commit="no"), TypeError, "fuse_commit must be a bool"),
    (dict(return_dict_in_generate="yes"), TypeError, "return_dict_in_generate must be a bool"),
    (dict(progress=1), TypeError, "progress must be a bool"),
    (dict(cuda_graphs="yes"), TypeError, "cuda_graphs must be a bool or None"),
    (dict(do_sample=True, seed=1.5), TypeError, "seed must be an int, got float"),
    (dict(do_sample=True, seed=-1), ValueError, "seed=-1 must be >= 0"),
    (dict(do_sample=True, seed=2**64), ValueError, "must be below 2\\*\\*64"),
    (dict(do_sample=True, seed=[1, 2]), ValueError, "seed has 2 seeds for 1 prompts: give one per row of input_ids"),
    (dict(do_sample=True, seed=[]), ValueError, "seed has 0 seeds for 1 prompts"),
    (dict(do_sample=True, seed=[-3]), ValueError, "seed=-3 must be >= 0"),
    (dict(do_sample=True, seed=[2**64]), ValueError, "seed=18446744073709551616 must be below 2\\*\\*64"),
    (dict(do_sample=True, seed=["7"]), TypeError, "seed must be an int, got str"),
    (dict(do_sample=True, temperature=[0.5, 1.0]), ValueError, "temperature has 2 values for 1 prompts: give one "
                                                                "per row of input_ids"),
    (dict(do_sample=True, temperature=[]), ValueError, "temperature has 0 values"),
    (dict(do_sample=True, temperature=[0.0]), ValueError, "temperature must be a finite float in "),
    (dict(do_sample=True, temperature=["hot"]), TypeError, "temperature must be a number, got str"),
    (dict(temperature=[0.5]), ValueError, r"temperature=\[0.5\] steers sampling, which this call does not do"),
    (dict(do_sample=True, top_p=[0.5, 0.9]), ValueError, "top_p has 2 values for 1 prompts"),
    (dict(do_sample=True, top_p=[1.5]), ValueError, r"top_p=1.5 must be in \(0, 1\]"),
    (dict(do_sample=True, top_p=[None]), TypeError, "top_p must be a number, got NoneType"),
    (dict(top_p=[0.5]), ValueError, r"top_p=\[0.5\] steers sampling"),
    (dict(do_sample=True, min_p=[1.5]), ValueError, r"min_p=1.5 must be in \[0, 1\]"),
    (dict(do_sample=True, epsilon_cutoff=[1.0]), ValueError, r"epsilon_cutoff=1.0 must be in \[0, 1\)"),
    (dict(do_sample=True, typical_p=[0.0]), ValueError, r"typical_p=0.0 must be in \(0, 1\]"),
    (dict(do_sample=True, top_k=[-1]), ValueError, r"top_k=-1 must be >= 0 \(0 or None: no top-k cut\)"),
    (dict(do_sample=True, top_h=[1.5]), ValueError, r"top_h=1.5 must be in \(0, 1\]"),
    (dict(do_sample=True, top_h=["0.5"]), TypeError, "top_h must be a number, got str"),
    (dict(do_sample=True, top_k=[2.5]), TypeError, "top_k must be an int, got float"),
    (dict(do_sample=True, top_k=[5, 6]), ValueError, "top_k has 2 values for 1 prompts"),
    (dict(top_k=[5]), ValueError, r"top_k=\[5\] steers sampling"),
    (dict(do_sample=[True, False]), ValueError, "do_sample has 2 flags for 1 prompts: give one per row of input_ids"),
    (dict(do_sample=[]), ValueError, "do_sample has 0 flags"),
    (dict(do_sample=[1]), TypeError, "do_sample must be a bool, or a list of one bool per prompt; the list holds 1"),
    (dict(do_sample=[False], temperature=0.5), ValueError, "temperature=0.5 steers sampling"),
    (dict(strategy="dynamic", threshold="0.5"), TypeError, "threshold must be a number, got str"),
    (dict(strategy="dynamic", threshold=True), TypeError, "threshold must be a number, got bool"),
    (dict(do_sample=True, top_p="0.9"), TypeError, "top_p must be a number"),
    (dict(do_sample=True, temperature="0.7"), TypeError, "temperature must be a number"),
    (dict(strategy="remask", remask_rule="delta", residual_delta="1"), TypeError, "residual_delta must be a number"),
    (dict(eos_token_id=True), ValueError, "eos_token_id True is not a token id"),
    (dict(eos_token_id=[2, 3.0]), ValueError, "eos_token_id 3.0 is not a token id"),
    (dict(strategy="dynamic", device_loop="yes"), TypeError, "device_loop must be a bool"),
    (dict(packed_projections=1), TypeError, "packed_projections must be a bool"),
    (dict(draft_vocab=8), ValueError, "draft_vocab=8 steers strategy 'speculative', not 'static': drop it"),
    (dict(strategy="speculative", draft_vocab=1), ValueError, "draft_vocab=1 must be >= 2"),
    (dict(strategy="speculative", draft_vocab=1000), ValueError, "draft_vocab=1000 exceeds the vocabulary"),
    (dict(strategy="speculative", draft_vocab=8.0), TypeError, "draft_vocab must be an int"),
    (dict(strategy="speculative", draft_vocab=[3, 3, 4]), ValueError, "draft_vocab lists 1 token id"),
    (dict(strategy="speculative", draft_vocab=[3, 99]), ValueError, "draft_vocab holds ids outside"),
    (dict(strategy="dynamic", device_loop=True), ValueError, "device_loop=True .* needs cuda_graphs"),
    (dict(output_reveal_steps=True), ValueError, "output_reveal_steps=True .*: pass return_dict_in_generate=True"),
    (dict(output_top_logprobs=3), ValueError, r"output_top_logprobs=3 returns its values in the output's "
                                              r"\.top_logprobs: pass return_dict_in_generate=True"),
    (dict(output_top_logprobs=65, return_dict_in_generate=True), ValueError, "output_top_logprobs=65 must be at "
                                                                             "most 64"),
    (dict(output_top_logprobs=-1), ValueError, "output_top_logprobs=-1 must be >= 0"),
    (dict(output_top_logprobs=True), TypeError, "output_top_logprobs must be an int, got bool"),
    (dict(output_reveal_steps=1, return_dict_in_generate=True), TypeError, "output_reveal_steps must be a bool"),
    (dict(output_confidences=True), ValueError, "output_confidences=True .*: pass return_dict_in_generate=True"),
    (dict(output_confidences="yes", return_dict_in_generate=True), TypeError, "output_confidences must be a bool"),
    (dict(prefill_chunk_size=0), ValueError, r"prefill_chunk_size=0 must be >= 1 \(None: the whole prompt"),
    (dict(prefill_chunk_size=64.0), TypeError, "prefill_chunk_size must be an int"),
    (dict(prefill_chunk_size=True), TypeError, "prefill_chunk_size must be an int"),
]


@pytest.mark.parametrize("overrides,error,message", BAD_INPUTS, ids=lambda x: str(x)[:40])
def test_bad_input_is_rejected_with_a_clear_message(model, overrides, error, message):
    kwargs = dict(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    kwargs.update(overrides)
    with pytest.raises(error, match=message):
        model.generate(**kwargs)


@pytest.mark.parametrize("strategy", ["static", "speculative"])
def test_the_last_block_may_end_at_max_position_embeddings(strategy):
    """Prompt and new tokens, rounded up to whole blocks of 4, may fill the 16 positions exactly, not pass them."""
    small = tiny_model(max_position_embeddings=16)
    for n, fits, passes in ((4, 12, 13), (3, 10, 14)):
        prompt = random_prompts(1, n, seed=n)
        assert small.generate(prompt, max_new_tokens=fits, eos_token_id=[], strategy=strategy).shape == (1, n + fits)
        with pytest.raises(ValueError, match="need 20 positions .* max_position_embeddings=16"):
            small.generate(prompt, max_new_tokens=passes, strategy=strategy)


@pytest.mark.parametrize("kwargs", STRATEGIES, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_a_row_without_finite_logits_stops_decoding_with_an_error_naming_the_cause(kwargs):
    """Row 1's prompt holds a token whose embedding is NaN, so none of its positions gets a finite logit: no step can
    commit there, and decoding says why instead of returning mask tokens or looping."""
    poisoned = tiny_model(seed=0)
    ids = random_prompts(2, 5, seed=3)
    with torch.no_grad():
        poisoned.model.embed_tokens.weight[ids[1, 2]] = float("nan")
    assert ids[1, 2] not in ids[0]
    with pytest.raises(RuntimeError, match="no finite logit .* check the weights for NaN"):
        poisoned.generate(ids, max_new_tokens=8, eos_token_id=[], **kwargs)


def test_padding_may_hold_any_id_and_1d_input_ids_are_one_prompt(model):
    """Only the tokens the attention mask keeps are checked: padding that holds the mask token or ids outside the
    vocabulary (what some collators pad with) decodes as padding of 0 does; 1-D input_ids are one prompt, with a
    1-D attention mask its mask."""
    ids = random_prompts(2, 5, seed=11)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0
    want = model.generate(ids, attention_mask=mask, max_new_tokens=6)
    for pad in (MASK_ID, VOCAB, -100):
        ids[1, :2] = pad
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=6), want), pad
    assert torch.equal(model.generate(ids[0], max_new_tokens=6), want[:1])
    assert torch.equal(model.generate(ids[1], attention_mask=mask[1], max_new_tokens=6), want[1:])


def test_inputs_is_transformers_name_for_input_ids(model):
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model.generate(inputs=ids, max_new_tokens=4), model.generate(ids, max_new_tokens=4))


def test_device_mismatch_is_rejected(model):
    with pytest.raises(ValueError, match="attention_mask is on"):
        model.generate(torch.tensor([[1, 2]]), attention_mask=torch.ones((1, 2), dtype=torch.long, device="meta"))


def test_prompt_ids_on_another_device_than_the_model_are_refused(model):
    with pytest.raises(ValueError, match=r"input_ids are on meta but the model is on cpu; move them with .to\('cpu'\)"):
        model.generate(torch.tensor([[1, 2]], device="meta"), max_new_tokens=2)


def test_a_wholly_offloaded_model_is_refused():
    model = tiny_model(seed=0).to("meta")
    with pytest.raises(ValueError, match=r"one device, but its parameters are on \['meta'\]"):
        model.generate(torch.tensor([[1, 2]], device="meta"), max_new_tokens=2)


@pytest.mark.parametrize("part", ["model.layers.1", "mrp_modules.0", "lm_head"])
def test_a_model_split_over_devices_or_offloaded_is_refused(part):
    """A device_map may split a model or offload parts of it ("meta" parameters filled in by hooks); decoding's
    steps and KV cache run on one device, so generate refuses, naming the devices."""
    model = tiny_model(seed=0)
    model.get_submodule(part).to("meta")
    with pytest.raises(ValueError, match=r"one device, but its parameters are on \['cpu', 'meta'\]"):
        model.generate(torch.tensor([[1, 2]]), max_new_tokens=2)


def test_a_model_on_apples_mps_is_refused_with_the_way_out(monkeypatch):
    """MPS has no float64, which the decode engine keeps its settings in: refused before anything is allocated,
    naming the CPU as the device to decode on (parameters stand in for an MPS model on a machine without one)."""
    model = tiny_model(seed=0)
    monkeypatch.setattr(model, "parameters", lambda: iter([types.SimpleNamespace(device=torch.device("mps"))]))
    with pytest.raises(ValueError, match=r"does not run on Apple's MPS.*model\.to\('cpu'\)"):
        model.generate(torch.tensor([[1, 2]]), max_new_tokens=2)


def test_mrp_strategies_need_mrp_weights():
    plain = SDARMRPForCausalLM(tiny_config(num_nextn_predict_layers=0)).eval()
    for strategy in ("direct", "speculative", "remask"):
        with pytest.raises(ValueError, match="needs MRP weights"):
            plain.generate(torch.tensor([[1, 2]]), max_new_tokens=2, strategy=strategy)
    with pytest.raises(ValueError, match="needs MRP weights"):
        plain.mrp_forward(torch.tensor([[1]]), torch.zeros(1, 1, 32), torch.tensor([[0]]))


@pytest.mark.parametrize("kwargs", STRATEGIES, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_fused_commit_forward_gives_identical_output_with_fewer_forwards(model, kwargs):
    ids = random_prompts(3, 6, seed=12)
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    fused = model.generate(ids, attention_mask=mask, max_new_tokens=13, return_dict_in_generate=True, **kwargs)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=13, return_dict_in_generate=True,
                           fuse_commit=False, **kwargs)
    assert torch.equal(fused.sequences, plain.sequences)
    assert torch.equal(fused.stats.backbone_forwards, plain.stats.backbone_forwards)
    assert (fused.stats.commit_forwards == 0).all()
    assert (plain.stats.commit_forwards == 3).all()  # blocks 1..3 of 0..4 are committed on their own


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("kwargs", STRATEGIES, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_a_chunked_prefill_gives_the_output_of_one_prefill_forward(model, monkeypatch, kwargs, graphs):
    """prefill_chunk_size: the rows' full prompt blocks (7, 1 and 3 blocks of 4, left-padded; then rows of the same
    3) are written in forwards of at most that many positions (rounded down to whole blocks, at least one), each
    attending to the cache the ones before it wrote; the output and every count are those of one prefill forward,
    with CUDA-graph shaped steps too (a one-block chunk replays the commit forward's step)."""
    writes, original = [], model.model.forward

    def spy(input_ids, *args, attn=None, **kw):
        writes.append(attn.write_len)
        return original(input_ids, *args, attn=attn, **kw)

    monkeypatch.setattr(model.model, "forward", spy)
    staggered = padded_batch([random_prompts(1, n, seed=40 + n)[0] for n in (29, 6, 13)], "left")
    even = padded_batch([random_prompts(1, n, seed=50 + n)[0] for n in (13, 14, 15)], "left")
    for (ids, mask), blocks in ((staggered, 7), (even, 3)):
        kw = dict(attention_mask=mask, max_new_tokens=10, return_dict_in_generate=True, cuda_graphs=graphs, **kwargs)
        whole = model.generate(ids, **kw)
        assert writes[0] == 4 * blocks
        for chunk, widths in ((1, [4] * blocks), (9, [8] * (blocks // 2) + [4] * (blocks % 2)), (100, [4 * blocks])):
            writes.clear()
            chunked = model.generate(ids, prefill_chunk_size=chunk, **kw)
            assert writes[: len(widths)] == widths
            assert torch.equal(chunked.sequences, whole.sequences)
            for name, value in vars(whole.stats).items():
                assert torch.equal(getattr(chunked.stats, name), value), name
        writes.clear()


@pytest.mark.parametrize("graphs, chunk", [(False, None), (True, None), (False, 8)])
@pytest.mark.parametrize("kwargs", [dict(strategy="static"), dict(strategy="speculative", mrp_steps=2),
                                    dict(strategy="remask", threshold=0.4)], ids=lambda k: k["strategy"])
def test_the_copies_of_a_prompt_share_its_prefill(model, monkeypatch, kwargs, graphs, chunk):
    """num_return_sequences=3 of 2 prompts (9 and 14 tokens: 2 and 3 full blocks of 4): each prompt's full blocks are
    computed once, by its first copy (each prefill forward computes 2 rows' positions, not 6; with CUDA-graph shaped
    steps the graphed batch's 2 padding rows too), the later copies getting its keys and values; the output, counts
    included, is that of the prompts repeated in input_ids (whose rows the sampling noise keys alike: by the row's
    index in the batch), in whole or chunked prefill forwards."""
    computed, original = [], model.model.forward

    def spy(input_ids, *args, attn=None, **kw):
        if attn.write_len > 4:  # a prefill forward
            computed.append(input_ids.numel() // attn.write_len)
        return original(input_ids, *args, attn=attn, **kw)

    monkeypatch.setattr(model.model, "forward", spy)
    rows = [random_prompts(1, n, seed=60 + n)[0] for n in (9, 14)]
    common = dict(max_new_tokens=11, eos_token_id=5, pad_token_id=0, return_dict_in_generate=True, do_sample=True,
                  temperature=0.9, seed=7, cuda_graphs=graphs, prefill_chunk_size=chunk, **kwargs)
    out = model.generate(*padded_batch(rows, "left"), num_return_sequences=3, **common)
    assert computed == [4 if graphs else 2] * len(computed) and computed
    repeated = model.generate(*padded_batch([r for r in rows for _ in range(3)], "left"), **common)
    assert computed[-1] == 8 if graphs else 6
    assert torch.equal(out.sequences, repeated.sequences)
    for name, value in vars(repeated.stats).items():
        assert torch.equal(getattr(out.stats, name), value), name


def _forward_batch_sizes(model, monkeypatch) -> list[int]:
    """Record the batch size of every backbone forward."""
    sizes, original = [], model.model.forward

    def spy(input_ids, *args, **kwargs):
        sizes.append(input_ids.shape[0])
        return original(input_ids, *args, **kwargs)

    monkeypatch.setattr(model.model, "forward", spy)
    return sizes


def test_rows_progress_through_their_own_blocks(model, monkeypatch):
    """A 3-token and a 30-token prompt decode their blocks side by side (blocks 0-2 and 7-9 of 4 tokens):
    the batch costs, block by block, the forwards of the slower row alone plus one prefill, not a pass over
    blocks 0-9."""
    short, long = random_prompts(1, 3, seed=20)[0], random_prompts(1, 30, seed=21)[0]
    ids = torch.zeros((2, 30), dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0, 27:], mask[0, 27:] = short, 1
    ids[1], mask[1] = long, 1
    sizes = _forward_batch_sizes(model, monkeypatch)
    alone, forwards = [], []
    for row in (short, long):
        sizes.clear()
        alone.append(model.generate(row[None], max_new_tokens=8))
        forwards.append(len(sizes))
    # One token a step, up to each row's last new token (positions 11 and 38-39, in the last blocks, are context:
    # committed only if picked before it); the long row's prefill rides on its first.
    assert 1 + 4 + 3 <= forwards[0] <= 1 + 4 + 4 and 2 + 4 + 2 <= forwards[1] <= 2 + 4 + 4, forwards
    sizes.clear()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8)
    # + one prefill of its own (the rows' prompt blocks differ); static rows start their blocks together
    assert sizes == [2] * (1 + max(1, 2) + 4 + max(forwards[0] - 1 - 4, forwards[1] - 2 - 4))
    assert torch.equal(out[0, 27:], alone[0][0]) and torch.equal(out[1], alone[1][0])


@pytest.mark.parametrize("kwargs", MOVING_ON, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_rows_move_to_their_next_block_without_waiting(model, kwargs):
    """Rows whose blocks fill at different steps (prompts of 3, 9 and 6 tokens: 1, 3 and 2 masks in their
    first blocks of 4) each move on as soon as their own block is full: the batch takes as many steps as
    its slowest row takes alone, and no commit costs a forward of its own. With ``per_row_blocks=False``
    the rows start their blocks together: the same output in at least as many steps. (Static and direct
    decoding always start blocks together: every full block takes them the same steps, and an MRP step
    needs its row's backbone forward.)"""
    ids, mask = _staggered_prompts()
    alone = []
    for r, keep in zip(ids, mask.bool()):
        out = model.generate(r[keep][None], max_new_tokens=14, return_dict_in_generate=True, **kwargs)
        assert out.batch_steps == out.stats.backbone_forwards[0]  # one backbone forward a step
        alone.append(out.batch_steps)
    assert len(set(alone)) > 1, alone
    out = model.generate(ids, attention_mask=mask, max_new_tokens=14, return_dict_in_generate=True, **kwargs)
    assert out.batch_steps == max(alone), alone
    assert (out.stats.commit_forwards == 0).all()
    together = model.generate(ids, attention_mask=mask, max_new_tokens=14, return_dict_in_generate=True,
                              per_row_blocks=False, **kwargs)
    assert torch.equal(together.sequences, out.sequences)
    assert together.batch_steps >= out.batch_steps


def _staggered_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of 3, 9 and 6 tokens, left-padded: 1, 3 and 2 masks in their first blocks of 4, so the rows'
    blocks fill at different steps."""
    return padded_batch([random_prompts(1, n, seed=30 + n)[0] for n in (3, 9, 6)], "left")


def _left_padded(lens: tuple[int, ...], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of ``lens`` tokens, left-padded: ids and attention mask [len(lens), max(lens)]."""
    ids = random_prompts(len(lens), max(lens), seed=seed)
    mask = (torch.arange(max(lens)) >= max(lens) - torch.tensor(lens)[:, None]).long()
    return ids * mask, mask


def _steps_per_block(reveal_steps: torch.Tensor, prompt_len: int, block: int) -> list[int]:
    """A row's decoding steps in each of its blocks, from the steps that revealed its new tokens [n] (after a
    prompt of ``prompt_len``): the last reveal in a block minus the last in the block before."""
    n = len(reveal_steps)
    starts = range(prompt_len // block * block, prompt_len + n, block)
    ends = [int(reveal_steps[max(s - prompt_len, 0) : s + block - prompt_len].max()) for s in starts]
    return [b - a for a, b in zip([0, *ends], ends)]


@pytest.mark.parametrize("lens,new", [((9, 1, 6, 3), 6), ((2, 5, 11, 7), 6), ((4, 1, 8), 5)])
@pytest.mark.parametrize("kwargs", [*STRATEGIES, dict(strategy="direct")],
                         ids=lambda k: "-".join(str(v) for v in k.values()))
def test_rows_starting_blocks_together_wait_for_the_slowest(model, kwargs, lens, new):
    """Rows that start their blocks together (``per_row_blocks=False``; static and direct always do) take, for
    each round of blocks, as many steps as the row slowest in that round takes alone, and each row reveals its
    tokens at the steps it would alone; rows that run out of blocks drop out (their last blocks end at different
    places: a row must stop past its last new token, however many rows retired before it)."""
    T = model.config.block_size
    ids, mask = _left_padded(lens)
    common = dict(max_new_tokens=new, output_reveal_steps=True, return_dict_in_generate=True, **kwargs)
    together = dict(per_row_blocks=False) if kwargs["strategy"] in READ_BY["per_row_blocks"] else {}
    out = model.generate(ids, attention_mask=mask, **together, **common)
    rounds = []
    for b, n in enumerate(lens):
        alone = model.generate(ids[b : b + 1, max(lens) - n :], **common)
        assert torch.equal(alone.reveal_steps[0, n:], out.reveal_steps[b, max(lens) :]), b
        rounds.append(_steps_per_block(alone.reveal_steps[0, n:], n, T))
    slowest = [max(r[i] for r in rounds if i < len(r)) for i in range(max(map(len, rounds)))]
    assert out.batch_steps == sum(slowest), rounds


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("kwargs", MOVING_ON + [dict(strategy="speculative", mrp_steps=3, packed_projections=False)],
                         ids=lambda k: "-".join(str(v) for v in k.values()))
def test_a_riding_commit_computes_only_the_committing_rows_blocks(model, monkeypatch, kwargs, graphs):
    """Rows that move on at different steps: the forward that carries a finished block computes it for the
    committing rows only (a ragged forward over R * n + B * T positions; with CUDA graphs R is rounded up to a
    batch bucket), and gives exactly the output and per-row counts of the padded forward (every row's n
    positions computed, the old way), with the projections packed (the layers sharing one grid buffer) or not."""
    from hf_integration.decoding import BlockDecoder

    ids, mask = _staggered_prompts()
    kw = dict(attention_mask=mask, max_new_tokens=14, return_dict_in_generate=True, cuda_graphs=graphs, **kwargs)
    shapes, original = [], model.model.forward

    def spy(input_ids, *args, attn=None, **kw):
        shapes.append((tuple(input_ids.shape), attn is not None and attn.tokens is not None))
        return original(input_ids, *args, attn=attn, **kw)

    monkeypatch.setattr(model.model, "forward", spy)
    ragged = model.generate(ids, **kw)
    ragged_shapes = list(shapes)
    shapes.clear()
    monkeypatch.setattr(BlockDecoder, "_riders", lambda self, rows: torch.arange(len(rows)))
    padded = model.generate(ids, **kw)
    assert torch.equal(ragged.sequences, padded.sequences)
    for name, value in vars(ragged.stats).items():
        assert torch.equal(getattr(padded.stats, name), value), name
    assert len(ragged_shapes) == len(shapes) and not any(r for _, r in shapes)
    n, ragged_sizes = model.config.block_size, []
    for (shape, ragged_forward), (padded_shape, _) in zip(ragged_shapes, shapes):
        if not ragged_forward:
            assert shape == padded_shape
            continue
        rows, width = padded_shape  # [B', n + T]: the finished blocks in front of the step's T positions
        riders, left = divmod(shape[1] - rows * (width - n), n)
        assert shape[0] == 1 and left == 0 and 1 <= riders < rows
        ragged_sizes.append(riders)
    assert ragged_sizes  # the staggered rows commit one at a time at least once
    if graphs:
        assert set(ragged_sizes) <= {1, 2}  # batch buckets of 1 and 2 (4 rows, the graphed batch, ride padded)


def test_finished_rows_leave_the_batch(model, monkeypatch):
    ids = random_prompts(2, 5, seed=9)
    free = model.generate(ids, max_new_tokens=20)
    eos = int(free[0, 7])  # row 0's 3rd new token: row 0 finishes with its first decoded block
    assert eos not in free[1, 5:].tolist()
    sizes = _forward_batch_sizes(model, monkeypatch)
    out = model.generate(ids, max_new_tokens=20, eos_token_id=[eos], pad_token_id=0, return_dict_in_generate=True)
    assert torch.equal(out.sequences[1], free[1])
    # row 1 commits its 20 new tokens (5-24), and any of 25-27 (in its last block) that come before them
    assert out.stats.tokens_committed[0] == 3 and 20 <= out.stats.tokens_committed[1] <= 23
    # The first block (3 masks, one token a step) runs with both rows; every later forward with row 1 only.
    assert sizes == [2] * 3 + [1] * (len(sizes) - 3) and len(sizes) > 3
    assert out.stats.backbone_forwards[0] == 3


@pytest.mark.parametrize("strategy", ["static", "speculative"])
def test_an_eos_as_the_first_new_token_ends_the_row(model, strategy):
    """Prompt 7, block 4: the first decoded block holds one new token (position 7, its last slot). When that token
    is an EOS the row is done after that one forward: nothing more is decoded, the rest is padding."""
    ids = random_prompts(1, 7, seed=12)
    first = int(model.generate(ids, max_new_tokens=1)[0, 7])
    out = model.generate(ids, max_new_tokens=12, eos_token_id=[first], pad_token_id=0, strategy=strategy,
                         return_dict_in_generate=True)
    assert out.sequences[0, 7] == first and (out.sequences[0, 8:] == 0).all()
    assert out.stats.tokens_committed.tolist() == [1] and out.stats.backbone_forwards.tolist() == [1]


@pytest.mark.parametrize("kwargs", STRATEGIES, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_graph_shaped_forwards_give_identical_output(model, kwargs):
    """``cuda_graphs=True`` on a CPU model records each step (whole cache width, masked by per-row lengths;
    a block's first step with the previous block's commit) and replays it on the recorded buffers: same
    tokens and counts as the default path, here with rows in different blocks and a row that finishes early
    (its EOS) and leaves the batch."""
    ids, mask = padded_batch([random_prompts(1, n, seed=30 + n)[0] for n in (2, 11, 6)], "right")
    free = model.generate(ids, attention_mask=mask, max_new_tokens=10, **kwargs)
    eos = int(free[0, 2])  # row 0's first new token
    settings = dict(attention_mask=mask, max_new_tokens=10, eos_token_id=[eos], pad_token_id=0,
                    return_dict_in_generate=True, **kwargs)
    plain = model.generate(ids, cuda_graphs=False, **settings)
    graphed = model.generate(ids, cuda_graphs=True, **settings)
    assert plain.stats.tokens_committed[0] < plain.stats.tokens_committed.max()  # row 0 left the batch early
    assert torch.equal(graphed.sequences, plain.sequences)
    for name, value in vars(plain.stats).items():
        assert torch.equal(getattr(graphed.stats, name), value), name


@pytest.mark.parametrize("strategy", ["static", "speculative"])
def test_graphed_sampling_reads_seed_temperature_and_filters_from_buffers(model, strategy):
    """The seed, temperature, top-h, top-k, top-p, min-p, typical, epsilon and eta cutoffs reach the captured steps
    through the engine's buffers, not as baked-in arguments (a graph per value would capture again and pile up): each
    call samples what it samples without graphs, and with static decoding and no EOS (the same steps whatever is
    sampled) every call replays the first call's steps."""
    ids = random_prompts(2, 6, seed=41)
    kw = dict(max_new_tokens=10, do_sample=True, strategy=strategy, eos_token_id=[])
    outputs, keys = [], None
    first = dict(seed=0, temperature=2.0, top_h=0.99, top_k=30, top_p=0.9, min_p=0.01, typical_p=0.99,
                 epsilon_cutoff=1e-3, eta_cutoff=1e-3)
    for setting in (first, dict(first, seed=1), dict(first, seed=2**40 + 5), dict(first, temperature=0.5),
                    dict(first, top_k=3), dict(first, top_p=0.3), dict(first, min_p=0.3),
                    dict(first, typical_p=0.3), dict(first, epsilon_cutoff=0.1), dict(first, eta_cutoff=0.3),
                    dict(first, top_h=0.3)):
        graphed = model.generate(ids, cuda_graphs=True, **setting, **kw)
        assert torch.equal(graphed, model.generate(ids, cuda_graphs=False, **setting, **kw)), setting
        captured = set(model._decode_engine[1].graphs.graphs)
        if strategy == "static":
            assert captured == (keys or captured), setting
        keys = captured
        outputs.append(graphed)
    assert all(not torch.equal(outputs[0], other) for other in outputs[1:])


def test_greedy_calls_ignore_sampling_settings_in_the_graph_key(model):
    """A checkpoint's generation config may set top_k / top_p / temperature without sampling: a greedy call then
    computes what one without them does, and replays its graphs. A call that asks for them itself without
    do_sample is refused (they would change nothing)."""
    ids = random_prompts(2, 6, seed=41)
    kw = dict(max_new_tokens=10, eos_token_id=[], cuda_graphs=True)
    plain = model.generate(ids, **kw)
    captured = set(model._decode_engine[1].graphs.graphs)
    shipped = model.generation_config
    try:
        model.generation_config = GenerationConfig(top_k=5, top_p=0.5, temperature=0.3)
        assert torch.equal(model.generate(ids, **kw), plain)
    finally:
        model.generation_config = shipped
    assert set(model._decode_engine[1].graphs.graphs) == captured
    for sampling in (dict(top_k=5), dict(top_p=0.5, temperature=0.3)):
        with pytest.raises(ValueError, match=f"{next(iter(sampling))}=.* steers? sampling.*do_sample=True"):
            model.generate(ids, **sampling, **kw)
        with pytest.raises(ValueError, match="steers? sampling"):
            model.generate(ids, generation_config=GenerationConfig(**sampling), **kw)


def test_top_k_0_is_no_cut_as_in_transformers(model):
    """top_k=0 means no top-k cut, as transformers reads it (a checkpoint's generation config may carry it): greedy
    and sampled calls decode as without top_k, also when the model's generation config sets it."""
    ids = random_prompts(2, 6, seed=43)
    kw = dict(max_new_tokens=8, eos_token_id=[])
    sampled = dict(do_sample=True, seed=5, top_p=0.9, **kw)
    plain, plain_sampled = model.generate(ids, **kw), model.generate(ids, **sampled)
    assert not torch.equal(plain_sampled, model.generate(ids, top_k=2, **sampled))  # top_k cuts when set
    assert torch.equal(model.generate(ids, top_k=0, **sampled), plain_sampled)
    shipped = model.generation_config
    try:
        model.generation_config = GenerationConfig(top_k=0)
        assert torch.equal(model.generate(ids, **kw), plain)
        assert torch.equal(model.generate(ids, **sampled), plain_sampled)
    finally:
        model.generation_config = shipped


@pytest.mark.parametrize("cut", [dict(min_p=1.0), dict(epsilon_cutoff=0.999)], ids=lambda c: next(iter(c)))
@pytest.mark.parametrize("kwargs", STRATEGIES, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_min_p_1_and_epsilon_near_1_sample_the_most_likely_token_alone(model, kwargs, cut):
    """min-p keeps the tokens at least min_p times as likely as the most likely one, epsilon the tokens at least
    epsilon_cutoff likely: at 1 (or 0.999: no token but the most likely can reach it) only the most likely is left,
    so sampled decoding at temperature 1 commits greedy decoding's tokens (with the same full-softmax confidences,
    so at the same positions), for every strategy."""
    ids = random_prompts(3, 6, seed=44)
    common = dict(max_new_tokens=10, eos_token_id=[], **kwargs)
    greedy = model.generate(ids, **common)
    for seed in (0, 1):
        assert torch.equal(model.generate(ids, do_sample=True, **cut, seed=seed, **common), greedy), seed


@pytest.mark.parametrize("name,value,nothing,bounds,bad", [
    ("min_p", 0.2, 0.0, "\\[0, 1\\]", (1.5, -0.2)), ("epsilon_cutoff", 0.03, 0.0, "\\[0, 1\\)", (1.5, -0.2, 1.0)),
    ("eta_cutoff", 0.2, 0.0, "\\[0, 1\\)", (1.5, -0.2, 1.0)), ("typical_p", 0.3, 1.0, "\\(0, 1\\]", (1.5, -0.2, 0.0)),
    ("top_h", 0.3, 1.0, "\\(0, 1\\]", (1.5, -0.2, 0.0))])
def test_each_filter_cuts_the_tail_and_its_neutral_value_cuts_nothing(model, name, value, nothing, bounds, bad):
    """min_p / epsilon_cutoff / eta_cutoff / typical_p / top_h change what a hot temperature samples (they cut) and
    repeat, also from a GenerationConfig; their neutral value cuts nothing: 0 for the first three, 1 for typical_p
    (transformers' default), with the same step key as without them; top_h 1 keeps the 100 most likely tokens, here
    (67 tokens) every one. Out of range they are refused (epsilon and eta at 1 too, which transformers would
    ignore), and a greedy call asking for one too (it would change nothing)."""
    ids = random_prompts(2, 6, seed=45)
    kw = dict(max_new_tokens=10, eos_token_id=[], do_sample=True, temperature=3.0, seed=2)
    plain, cut = model.generate(ids, **kw), model.generate(ids, **{name: value}, **kw)
    assert not torch.equal(plain, cut) and torch.equal(cut, model.generate(ids, **{name: value}, **kw))
    assert torch.equal(model.generate(ids, generation_config=GenerationConfig(**{name: value}), **kw), cut)
    assert torch.equal(model.generate(ids, **{name: nothing}, **kw), plain)
    if name != "top_h":  # top_h 1 keeps the 100 most likely: a cut on a larger vocabulary
        keys = {GenerationSettings.resolve(model, None, dict(kw, **{name: p}), 6).step_key() for p in (None, nothing)}
        assert len(keys) == 1
    for x in bad:
        with pytest.raises(ValueError, match=f"{name}={x} must be in {bounds}"):
            model.generate(ids, **{name: x}, **kw)
    with pytest.raises(ValueError, match=f"{name}={value} steers sampling.*do_sample=True"):
        model.generate(ids, **{name: value}, max_new_tokens=4)


def test_top_k_reaches_the_steps_with_a_bound_of_a_few_sizes(model, monkeypatch):
    """A sampled step's confidence op gets top_k on the device with the bound its captured graphs are built for (the
    power of two at or above top_k, at least 64): calls with top_k up to 64 share the key, a larger top_k keys new
    steps, and a greedy call or one without top_k has no bound."""
    from hf_integration.generation_settings import GenerationSettings

    def key(**kw):
        return GenerationSettings(**kw).step_key()

    assert [GenerationSettings(top_k=k).top_k_max for k in (None, 1, 20, 64, 65, 128, 129)] == \
        [None, 64, 64, 64, 128, 128, 256]
    assert key(do_sample=True, top_k=3) == key(do_sample=True, top_k=64) != key(do_sample=True, top_k=65)
    assert key(top_k=3) == key(top_k=500) == key()
    bounds = []
    real = mrp_triton.confidence
    monkeypatch.setattr(mrp_triton, "confidence", lambda *a, **kw: bounds.append((kw["top_k"], kw["top_k_max"])) or
                        real(*a, **kw))
    model.generate(random_prompts(1, 5, seed=2), max_new_tokens=4, do_sample=True, top_k=100, cuda_graphs=False)
    assert bounds and all(isinstance(k, torch.Tensor) and k.item() == 100 and m == 128 for k, m in bounds)
    for ks, bound in (([3, 100], 128), ([3, None], None)):  # one a prompt: the largest's bound, none with no cut
        bounds.clear()
        model.generate(random_prompts(2, 5, seed=2), max_new_tokens=4, do_sample=True, top_k=ks, cuda_graphs=False)
        values = [3, 100] if bound else [3, 2**31 - 1]
        assert bounds and all(k.view(2, -1)[:, 0].tolist() == values and m == bound for k, m in bounds)


def test_extreme_sampling_settings_decode_as_their_limits():
    """The smallest temperature taken (1e-20: logits / temperature stays within fp32; 1e-38 was taken and every
    positive logit saturated to the largest float, tying them) samples the greedy tokens; a top_k past any
    vocabulary (sys.maxsize: its step bound overflowed int64) cuts nothing; a float64 model's top log-probabilities
    at a tiny temperature stay <= 0 (fp32 rounding of the top logits and the lse put them above 0)."""
    import sys

    model32 = tiny_model(seed=2, dtype=torch.float32)
    ids = random_prompts(2, 6, seed=4)
    greedy = model32.generate(ids, max_new_tokens=8, strategy="sequential")
    cold = model32.generate(ids, max_new_tokens=8, strategy="sequential", do_sample=True, seed=[1, 2],
                            temperature=1e-20)
    assert torch.equal(cold, greedy)
    sampled = dict(max_new_tokens=8, do_sample=True, seed=[1, 2])
    assert torch.equal(model32.generate(ids, top_k=sys.maxsize, **sampled), model32.generate(ids, **sampled))
    out = tiny_model(seed=2).generate(ids, temperature=1e-6, strategy="sequential", output_top_logprobs=2,
                                      return_dict_in_generate=True, **sampled)
    assert out.top_logprobs[:, 6:].max() <= 0 and (out.top_logprobs[:, 6:, 0] == 0).any()


def test_lists_of_temperatures_and_new_tokens_share_the_step_key(model):
    """Per-prompt temperatures, top-p and new-token counts reach the steps through buffers (each row's temperature
    and top-p, the rows' layout): calls with other lists share the captured steps, while a list of temperatures (or
    top-p) keys other steps than one value (they read it a row)."""
    def key(**kw):
        return GenerationSettings.resolve(model, None, {"do_sample": True, **kw}, 6, prompts=3).step_key()

    assert key(temperature=[0.5, 1.0, 2.0]) == key(temperature=[0.7, 0.7, 3.0]) != key(temperature=0.7)
    assert key(temperature=[0.7] * 3) == key(temperature=0.7)  # the same for all: one temperature
    assert key(max_new_tokens=[4, 8, 16]) == key(max_new_tokens=[5, 6, 7]) == key(max_new_tokens=16)
    assert key(top_p=[0.5, 1.0, 0.9]) == key(top_p=[0.1, 0.2, 0.3]) != key(top_p=0.5) != key()
    assert key(min_p=[0.1, 0.0, 0.2]) == key(min_p=[0.3, 0.1, 0.0]) != key(min_p=0.1)
    assert key(eta_cutoff=[0.1, 0.0, 0.2], typical_p=[0.5, 1.0, 1.0]) == \
        key(eta_cutoff=[0.3, 0.1, 0.0], typical_p=[0.2, 0.3, 0.9])
    assert key(do_sample=[True, False, True]) == key(do_sample=[False, False, True], temperature=[0.5, 1.0, 2.0]) \
        == key(temperature=[0.5, 1.0, 2.0], do_sample=[False, True, True]) != key(temperature=[0.5, 1.0, 2.0])
    assert key(do_sample=[True] * 3) == key()
    # top-k a prompt: one key a bound (a prompt without a cut: none, the rows sorted whole)
    assert key(top_k=[3, 20, 64]) == key(top_k=[1, 1, 2]) != key(top_k=[3, 20, 65]) != key(top_k=64)
    assert key(top_k=[3, None, 5]) == key(top_k=[0, 2, 500]) != key(top_k=[3, 20, 65])
    assert key(top_k=[0, None, 0]) == key()  # no cut for any
    assert key(top_h=[0.5, None, 0.9]) == key(top_h=[0.1, 0.2, 0.3]) != key(top_h=0.5) != key()
    assert key(top_h=[None] * 3) == key()


@pytest.mark.parametrize("strategy,name,values", [("dynamic", "threshold", (0.9, 0.3)),
                                                  ("remask", "threshold", (0.9, 0.3)),
                                                  ("remask", "residual_delta", (2.0, 0.05)),
                                                  ("entropy_bounded", "entropy_bound", (0.0, 8.0)),
                                                  ("static", "denoising_steps", (8, 2, 3))])
def test_graphed_steps_read_thresholds_from_buffers(strategy, name, values):
    """Dynamic and remask thresholds (and the entropy bound) reach the captured steps through the engine's buffers,
    the number of denoising
    steps through each row's quota (set when its block starts): every value decodes (tokens, stats, steps) as
    without graphs, the values decode differently, and another value captures nothing new (one row over several
    blocks: the same kinds of step whatever the value)."""
    model = tiny_model(seed=5, block_size=8)
    ids = random_prompts(1, 6, seed=3)
    kw = dict(max_new_tokens=15, strategy=strategy, eos_token_id=[], return_dict_in_generate=True,
              **(dict(remask_rule="delta", threshold=0.05) if name == "residual_delta" else {}))
    runs, keys = [], None
    for value in values:
        graphed = model.generate(ids, cuda_graphs=True, **{name: value}, **kw)
        plain = model.generate(ids, cuda_graphs=False, **{name: value}, **kw)
        assert graphed.batch_steps == plain.batch_steps and torch.equal(graphed.sequences, plain.sequences), value
        for counter, expected in vars(plain.stats).items():
            assert torch.equal(getattr(graphed.stats, counter), expected), (value, counter)
        captured = set(model._decode_engine[1].graphs.graphs)
        assert captured == (keys or captured), value
        keys = captured
        runs.append((plain.batch_steps, tuple(plain.stats.tokens_remasked.tolist())))
    assert len(set(runs)) == len(runs)


def test_a_graphed_engine_is_not_reused_after_the_rope_or_a_weight_changes():
    """A graphed engine holds RoPE tables built from the config, and on CUDA its captured steps hold the weights'
    addresses: once the config's rope_theta changes, or a weight is replaced by another tensor, the next graphed
    call builds another engine and decodes as an ungraphed call does."""
    model, ids = tiny_model(seed=0), random_prompts(2, 7, seed=40)
    before = model.generate(ids, max_new_tokens=9, cuda_graphs=True)

    def change(update):
        engine = model._decode_engine[1]
        update()
        graphed = model.generate(ids, max_new_tokens=9, cuda_graphs=True)
        assert model._decode_engine[1] is not engine, "the previous engine was reused"
        assert torch.equal(graphed, model.generate(ids, max_new_tokens=9, cuda_graphs=False))
        return graphed

    rope = change(lambda: setattr(model.config, "rope_parameters",
                                  dict(model.config.rope_parameters, rope_theta=50.0)))
    assert not torch.equal(rope, before)  # the tables matter
    change(lambda: setattr(model.lm_head, "weight", torch.nn.Parameter(model.lm_head.weight.detach().clone())))


def test_graphed_calls_reuse_one_engine(model):
    """Graphed calls of the same batch and cache width (the layout rounded up to 256 positions) reuse the
    cache (and graphs) of the previous call, reset; another shape replaces it; ``release_decode_engine`` frees
    it. Every call decodes as if from scratch."""
    ids = random_prompts(2, 7, seed=40)
    expected = model.generate(ids, max_new_tokens=9, cuda_graphs=False)
    first = model.generate(ids, max_new_tokens=9, cuda_graphs=True)
    engine = model._decode_engine
    again = model.generate(ids, max_new_tokens=9, cuda_graphs=True)
    assert model._decode_engine is engine
    assert torch.equal(first, expected) and torch.equal(again, expected)
    shorter = model.generate(ids[:, :4], max_new_tokens=13, cuda_graphs=True)  # another length, same width bucket
    assert model._decode_engine is engine
    assert torch.equal(shorter, model.generate(ids[:, :4], max_new_tokens=13, cuda_graphs=False))
    other = model.generate(ids[:1], max_new_tokens=9, cuda_graphs=True)
    assert model._decode_engine is not engine and torch.equal(other, expected[:1])
    engine = model._decode_engine[1]
    with mrp_triton.use_backend("triton"):  # steps launching other ops: another engine
        assert torch.equal(model.generate(ids[:1], max_new_tokens=9, cuda_graphs=True), other)
    assert model._decode_engine[1] is not engine
    # Released, the engine is freed at once (its recorded steps, which close over the decoder, go with it)
    released = weakref.ref(model._decode_engine[1])
    del engine
    model.release_decode_engine()
    assert model._decode_engine is None and released() is None


def test_a_reused_engine_forgets_the_previous_calls_eos_ids(model):
    """The engine's EOS table is this call's: a call without EOS after one with decodes its whole length."""
    ids = random_prompts(1, 4, seed=41)
    kw = dict(max_new_tokens=12, cuda_graphs=True, return_dict_in_generate=True)
    free = model.generate(ids, eos_token_id=[], **kw)
    eos = int(free.sequences[0, 6])  # the 3rd new token
    assert model.generate(ids, eos_token_id=eos, **kw).new_tokens.item() < 12
    again = model.generate(ids, eos_token_id=[], **kw)
    assert torch.equal(again.sequences, free.sequences) and again.new_tokens.tolist() == [12]


def test_an_enclosing_autocast_leaves_decoding_in_the_model_dtype():
    """Decoding runs in the model's dtype: under a bf16 autocast a float32 model decodes what it decodes without one
    (the autocast would run its projections in bf16 and hand the float32 KV cache bf16 keys)."""
    model = tiny_model(seed=0, dtype=torch.float32)
    ids = random_prompts(2, 5, seed=3)
    want = model.generate(ids, max_new_tokens=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model.generate(ids, max_new_tokens=8), want)


def test_a_call_inside_inference_mode_leaves_no_inference_tensors_behind():
    """generate under ``torch.inference_mode`` keeps nothing that later code may not update in place: the engine
    it keeps (KV cache, recorded steps) serves a call outside inference mode, and the weights it packs train.
    Gradients stay off inside the call either way."""
    model = tiny_model(seed=2, dtype=torch.float32)
    ids = random_prompts(2, 6, seed=7)
    grad_modes = []
    model.model.norm.register_forward_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
    for strategy in ("static", "speculative"):
        with torch.inference_mode():
            inside = model.generate(ids, max_new_tokens=8, strategy=strategy, cuda_graphs=True)
        assert torch.equal(model.generate(ids, max_new_tokens=8, strategy=strategy, cuda_graphs=True), inside)
    assert grad_modes and not any(grad_modes)
    assert not any(p.is_inference() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model.train()
    model(ids, labels=ids).loss.backward()
    optimizer.step()


@pytest.mark.triton
@pytest.mark.parametrize("candidates", [None, 4])
def test_decoding_on_the_triton_kernels_equals_the_reference(candidates):
    """Every op of a speculative decoding run on its Triton kernel (the interpreter on CPU): norms,
    q/k-norm + RoPE, SwiGLU, cached attention, MRP input, LM-head confidence (with draft candidates: listing
    each position's top 4, and the drafts' pick among them), select, verify. Same tokens and counts as on the
    reference ops."""
    kwargs = dict(strategy="speculative", mrp_steps=2, draft_candidates=candidates)
    model = tiny_model(seed=1, dtype=torch.float32)
    ids = random_prompts(2, 6, seed=50)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: the rows sit in different blocks
    args = dict(attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True, **kwargs)
    with mrp_triton.use_backend("reference"):
        expected = model.generate(ids, **args)
    with mrp_triton.use_backend("triton"):
        out = model.generate(ids, **args)
    assert torch.equal(out.sequences, expected.sequences)
    assert torch.equal(out.stats.backbone_forwards, expected.stats.backbone_forwards)
    assert torch.equal(out.stats.accepted_lengths, expected.stats.accepted_lengths)


def test_generate_calls_on_one_model_run_one_at_a_time(model):
    """Graphed calls share the model's engine (KV cache, per-row state, graphs). A second thread's call waits
    until the first returns instead of resetting the engine under it, and both give what they give alone; a
    call from inside a call (a streamer that generates) is refused, and the model stays usable."""
    kw = dict(max_new_tokens=12, cuda_graphs=True)
    ids_a, ids_b = random_prompts(1, 5, seed=21), random_prompts(1, 5, seed=22)
    alone = {"a": model.generate(ids_a, **kw), "b": model.generate(ids_b, **kw)}
    events, results, a_decoding = [], {}, threading.Event()

    class Stream:
        def __init__(self, name):
            self.name, self.puts = name, 0

        def put(self, ids):
            self.puts += 1
            events.append(f"{self.name} put")
            if self.name == "a" and self.puts == 2:  # A holds the engine mid-call (a finished block)
                a_decoding.set()
                time.sleep(1.0)

        def end(self):
            events.append(f"{self.name} end")

    def call(name, ids):
        results[name] = model.generate(ids, streamer=Stream(name), **kw)

    first = threading.Thread(target=call, args=("a", ids_a))
    first.start()
    assert a_decoding.wait(30)
    second = threading.Thread(target=call, args=("b", ids_b))
    second.start()
    first.join(60)
    second.join(60)
    assert events.index("a end") < events.index("b put"), events
    assert all(torch.equal(results[k], alone[k]) for k in alone)

    class Reentrant(Stream):
        def put(self, ids):
            model.generate(ids_b, **kw)

    with pytest.raises(RuntimeError, match="from inside its own generate"):
        model.generate(ids_a, streamer=Reentrant("c"), **kw)
    assert torch.equal(model.generate(ids_a, **kw), alone["a"])


@pytest.mark.parametrize("kwargs", [dict(strategy="static"), dict(strategy="speculative", mrp_steps=2)],
                         ids=lambda k: k["strategy"])
def test_streamer_gets_the_prompt_then_each_finished_block(model, kwargs):
    """Prompt of 6 in blocks of 4: the first block holds 2 new tokens, then whole blocks; the stream stops at
    the first EOS (kept) and ends once. Streaming changes neither the output nor the captured steps."""
    ids = random_prompts(1, 6, seed=70)
    free = model.generate(ids, max_new_tokens=16, **kwargs)
    new = free[0, 6:].tolist()
    streamer = RecordingStreamer()
    assert torch.equal(model.generate(ids, max_new_tokens=16, streamer=streamer, **kwargs), free)
    assert streamer.puts == [ids[0].tolist(), new[:2], new[2:6], new[6:10], new[10:14], new[14:]]
    assert streamer.ended == 1
    first = next(i for i in range(6, 16) if new[i] not in new[:i])  # a token whose first use is in block 3+
    streamer = RecordingStreamer()
    out = model.generate(ids, max_new_tokens=16, streamer=streamer, eos_token_id=new[first], pad_token_id=0,
                         **kwargs)
    cuts = [c for c in (2, 6, 10, 14) if c <= first] + [first + 1]
    assert streamer.puts == [ids[0].tolist()] + [new[a:b] for a, b in zip([0] + cuts, cuts)]
    assert streamer.ended == 1
    assert out[0, 6 : 7 + first].tolist() == new[: first + 1] and (out[0, 7 + first :] == 0).all()
    graphed = model.generate(ids, max_new_tokens=16, cuda_graphs=True, **kwargs)
    steps = set(model._decode_engine[1].graphs.graphs)
    again = model.generate(ids, max_new_tokens=16, cuda_graphs=True, streamer=RecordingStreamer(), **kwargs)
    assert torch.equal(graphed, free) and torch.equal(again, free)
    assert set(model._decode_engine[1].graphs.graphs) == steps  # the streamer is not part of any step's key
    model.release_decode_engine()


def test_the_stream_ends_at_the_first_of_two_eos_ids_in_a_block(model):
    """Two EOS ids (the later-listed one first) decoded side by side in one block: the stream ends with the first of
    them to come, as the output does, not at the other."""
    ids = random_prompts(1, 6, seed=64)  # a prompt whose completion has such a pair (past its first block)
    new = model.generate(ids, max_new_tokens=16)[0, 6:].tolist()
    # new tokens i and i + 1 in one block (of 4), neither decoded before
    i = next(i for i in range(15) if (i + 6) // 4 == (i + 7) // 4 and new[i] not in new[:i]
             and new[i + 1] not in new[: i + 1])
    streamer = RecordingStreamer()
    out = model.generate(ids, max_new_tokens=16, streamer=streamer, eos_token_id=[new[i + 1], new[i]], pad_token_id=0)
    assert sum(streamer.puts[1:], []) == new[: i + 1] == out[0, 6 : 7 + i].tolist(), (i, streamer.puts)


def test_streamer_refuses_batches_and_objects_without_put(model):
    with pytest.raises(ValueError, match="streamer streams one prompt"):
        model.generate(random_prompts(2, 5), max_new_tokens=4, streamer=RecordingStreamer())
    with pytest.raises(ValueError, match="streamer streams one prompt"):  # one prompt, sampled twice: two rows
        model.generate(random_prompts(1, 5), max_new_tokens=4, streamer=RecordingStreamer(), do_sample=True,
                       num_return_sequences=2)
    with pytest.raises(TypeError, match=r"streamer must have put\(ids\) and end\(\)"):
        model.generate(random_prompts(1, 5), max_new_tokens=4, streamer=object())

    class PutOnly:  # a streamer without end() would fail only once decoding is done
        def put(self, ids):
            pass

    with pytest.raises(TypeError, match=r"streamer must have put\(ids\) and end\(\) methods .*, got PutOnly"):
        model.generate(random_prompts(1, 5), max_new_tokens=4, streamer=PutOnly())


@pytest.mark.parametrize("kwargs", [dict(strategy="static"), dict(strategy="speculative", mrp_steps=2),
                                    dict(strategy="dynamic", threshold=0.3)], ids=lambda k: k["strategy"])
@pytest.mark.parametrize("graphs", [False, True])
def test_stop_strings_end_each_row_after_the_token_that_completes_one(model, kwargs, graphs):
    """Each row stops with the block in which its new text first holds a stop string: its tokens up to and with
    the one completing it are those of the free run, the rest padding; the rows' other counts stay those of
    the row decoded alone (the check runs as blocks fill, per row)."""
    tok = LetterTokenizer()
    lens = [4, 7, 2]
    ids, mask = padded_batch([random_prompts(1, n, seed=40 + b)[0] for b, n in enumerate(lens)], "left")
    common = dict(max_new_tokens=20, pad_token_id=0, eos_token_id=[], return_dict_in_generate=True, **kwargs)
    free_out = model.generate(ids, attention_mask=mask, **common)
    free = free_out.sequences[:, 7:]
    text = tok.decode(free[0].tolist())
    stops = [text[9:11], "zzzzzz"]  # from row 0's new text; the other can never be found
    out = model.generate(ids, attention_mask=mask, stop_strings=stops, tokenizer=tok, cuda_graphs=graphs, **common)
    for b in range(3):
        row = tok.decode(free[b].tolist())
        keep = row.find(stops[0]) + 2 if stops[0] in row else 20
        assert torch.equal(out.sequences[b, 7:][:keep], free[b][:keep]), b
        assert (out.sequences[b, 7 + keep:] == 0).all() and out.new_tokens[b] == keep, b
        assert out.stats.tokens_committed[b] <= free_out.stats.tokens_committed[b], b
        alone = model.generate(ids[b:b + 1, 7 - lens[b]:], stop_strings=stops, tokenizer=tok, **common)
        assert torch.equal(alone.sequences[0, lens[b]:], out.sequences[b, 7:]), b
        assert alone.stats.tokens_committed[0] == out.stats.tokens_committed[b], b
    assert out.stats.tokens_committed[0] < free_out.stats.tokens_committed[0]  # row 0 stopped blocks early


@pytest.mark.parametrize("kwargs", [dict(strategy="static"), dict(strategy="speculative", mrp_steps=2),
                                    dict(strategy="remask", threshold=0.4)], ids=lambda k: k["strategy"])
@pytest.mark.parametrize("graphs", [False, True])
def test_stop_strings_and_max_new_tokens_per_prompt_give_each_prompt_what_it_gives_alone(model, kwargs, graphs):
    """Stop strings and new tokens given per prompt (a list each; one prompt without stop strings, one whose string
    never shows, while the first one's string shows in every row's free text): each row is what its prompt gives
    alone with its own, padding after it, with the same counts; the row whose stop string shows stops there."""
    tok = LetterTokenizer()
    prompts = [random_prompts(1, n, seed=40 + b)[0] for b, n in enumerate([4, 7, 2])]
    ids, mask = padded_batch(prompts, "left")
    common = dict(pad_token_id=0, eos_token_id=[], return_dict_in_generate=True, tokenizer=tok, **kwargs)
    free = [tok.decode(model.generate(r[None], max_new_tokens=20, **common).sequences[0, len(r):].tolist())
            for r in prompts]
    shared = next(letter for letter in free[0][:7] if all(letter in text[:4] for text in free[1:]))
    stops, limits = [[shared, "zzzzzz"], [], ["zzzzzz"]], [20, 9, 14]
    out = model.generate(ids, attention_mask=mask, stop_strings=stops, max_new_tokens=limits, cuda_graphs=graphs,
                         **common)
    assert out.sequences.shape[1] == 7 + 20
    for b, r in enumerate(prompts):
        alone = model.generate(r[None], max_new_tokens=limits[b], **common,
                               **(dict(stop_strings=stops[b]) if stops[b] else {}))
        assert torch.equal(out.sequences[b, 7 - len(r): 7 + limits[b]], alone.sequences[0]), b
        assert not out.sequences[b, 7 + limits[b]:].any() and out.new_tokens[b] == alone.new_tokens[0], b
        for name, value in vars(alone.stats).items():
            assert torch.equal(getattr(out.stats, name)[b], value[0]), (b, name)
    assert out.new_tokens.tolist()[1:] == [9, 14] and out.new_tokens[0] <= 7


@pytest.mark.parametrize("kwargs", [dict(strategy="static"), dict(strategy="direct", mrp_steps=2),
                                    dict(strategy="remask", threshold=0.4),
                                    dict(strategy="speculative", mrp_steps=2, draft_candidates=4, top_p=0.9),
                                    dict(strategy="static", top_p=[0.6, 1.0, 0.2], min_p=0.02),
                                    dict(strategy="speculative", mrp_steps=2, draft_candidates=4,
                                         top_p=[0.5, 0.9, 0.95]),
                                    dict(strategy="static", min_p=[0.05, 0.0, 0.2], typical_p=[0.9, 1.0, 0.5]),
                                    dict(strategy="speculative", mrp_steps=2, draft_candidates=4,
                                         epsilon_cutoff=[0.01, 0.0, 0.05], eta_cutoff=[0.0, 0.02, 0.01]),
                                    dict(strategy="static", top_k=[2, None, 100], top_p=0.9),
                                    dict(strategy="dynamic", top_k=[3, 100, 1], top_p=[0.8, 0.95, 1.0]),
                                    dict(strategy="speculative", mrp_steps=2, draft_candidates=4, top_k=[2, 0, 3]),
                                    dict(strategy="static", top_h=[0.5, None, 0.9]),
                                    dict(strategy="speculative", mrp_steps=2, draft_candidates=4,
                                         top_h=[None, 0.3, 1.0], top_k=[5, None, 2])],
                         ids=lambda k: k["strategy"] + "".join(f" {name} list" for name, value in k.items()
                                                               if isinstance(value, list)))
@pytest.mark.parametrize("graphs", [False, True])
def test_a_temperature_per_prompt_gives_each_prompt_what_it_draws_alone_at_it(model, kwargs, graphs):
    """Sampled with a seed and a temperature per prompt (remask's confidences of its MRP pass, listed draft
    candidates and their top-p cut all read each row's), and a top-p, min-p, typical-p, epsilon or eta per prompt too
    (0 or 1, neutral, for one prompt), and a top-k and top-h per prompt (None, or a top-k of 0: no cut; a top-k past
    the bound another prompt's alone would select): each row is what its prompt draws alone at its temperature (and
    filters) with
    its seed (tokens, confidences, stats), then with the temperatures in another order (graphed: replaying the steps
    the first call recorded), and the confidences differ from one temperature for all."""
    prompts = [random_prompts(1, n, seed=60 + b)[0] for b, n in enumerate([4, 7, 2])]
    ids, mask = padded_batch(prompts, "left")
    temperatures, seeds = [0.3, 1.0, 2.5], [11, 12, 13]
    common = dict(max_new_tokens=12, do_sample=True, pad_token_id=0, eos_token_id=[], return_dict_in_generate=True,
                  output_confidences=True, **kwargs)
    for order in (1, -1):  # then other temperatures: a graphed engine replays the steps it recorded (same key)
        out = model.generate(ids, attention_mask=mask, seed=seeds, temperature=temperatures[::order],
                             cuda_graphs=graphs, **common)
        for b, r in enumerate(prompts):
            own = {name: value[b] for name, value in kwargs.items() if isinstance(value, list)}
            alone = model.generate(r[None], seed=seeds[b], temperature=temperatures[::order][b], **{**common, **own})
            assert torch.equal(out.sequences[b, 7 - len(r):], alone.sequences[0]), (order, b)
            torch.testing.assert_close(out.confidences[b, 7 - len(r):], alone.confidences[0], rtol=1e-6, atol=0)
            for name, value in vars(alone.stats).items():
                assert torch.equal(getattr(out.stats, name)[b], value[0]), (order, b, name)
    out = model.generate(ids, attention_mask=mask, seed=seeds, temperature=temperatures, **common)
    one = model.generate(ids, attention_mask=mask, seed=seeds, temperature=1.0, **common)
    assert not torch.equal(one.confidences[0], out.confidences[0]) and not torch.equal(one.confidences[2],
                                                                                       out.confidences[2])


@pytest.mark.parametrize("kwargs", [dict(strategy="static"), dict(strategy="direct", mrp_steps=2),
                                    dict(strategy="remask", threshold=0.4),
                                    dict(strategy="speculative", mrp_steps=2, draft_candidates=4, top_p=0.9),
                                    dict(strategy="speculative", mrp_steps=2, typical_p=0.3),
                                    dict(strategy="entropy_bounded", typical_p=0.3, top_k=3)],
                         ids=lambda k: "-".join(map(str, k.values())))
@pytest.mark.parametrize("graphs", [False, True])
def test_do_sample_per_prompt_gives_the_greedy_prompts_their_greedy_decoding(model, kwargs, graphs):
    """``do_sample=[True, False, True]``: the sampled prompts draw what they draw alone (at their temperatures, with
    their seeds), the other picks what it picks alone with ``do_sample=False`` (tokens, confidences, stats; its
    temperature unread, its picks neither noised nor cut: typical-p may cut the most likely token), draft candidates
    and remask's MRP pass included; sampling that prompt too changes it."""
    prompts = [random_prompts(1, n, seed=60 + b)[0] for b, n in enumerate([4, 7, 2])]
    ids, mask = padded_batch(prompts, "left")
    sampling, temperatures, seeds = [True, False, True], [0.7, 2.0, 1.3], [11, 12, 13]
    common = dict(max_new_tokens=12, pad_token_id=0, eos_token_id=[], return_dict_in_generate=True,
                  output_confidences=True, cuda_graphs=graphs)
    out = model.generate(ids, attention_mask=mask, do_sample=sampling, seed=seeds, temperature=temperatures,
                         **common, **kwargs)
    for b, r in enumerate(prompts):
        if sampling[b]:
            alone = model.generate(r[None], do_sample=True, seed=seeds[b], temperature=temperatures[b], **common,
                                   **kwargs)
        else:
            alone = model.generate(r[None], **common,
                                   **{k: v for k, v in kwargs.items() if k not in ("top_p", "typical_p", "top_k")})
        assert torch.equal(out.sequences[b, 7 - len(r):], alone.sequences[0]), b
        assert torch.equal(out.confidences[b, 7 - len(r):], alone.confidences[0]), b
        for name, value in vars(alone.stats).items():
            assert torch.equal(getattr(out.stats, name)[b], value[0]), (b, name)
    every = model.generate(ids, attention_mask=mask, do_sample=True, seed=seeds, temperature=temperatures, **common,
                           **kwargs)
    assert torch.equal(every.sequences[0::2], out.sequences[0::2])
    assert not torch.equal(every.confidences[1], out.confidences[1])
    with pytest.raises(ValueError, match="num_return_sequences=2 gives identical copies of the prompts whose "
                                         "do_sample is False"):
        model.generate(ids, attention_mask=mask, do_sample=sampling, num_return_sequences=2)
    with pytest.raises(TypeError, match="temperature must be a number, got str"):
        model.generate(ids, attention_mask=mask, do_sample=sampling, temperature="hot")


@pytest.mark.parametrize("kwargs", [dict(strategy="dynamic", threshold=0.3), dict(strategy="direct", mrp_steps=2),
                                    dict(strategy="remask", threshold=0.4),
                                    dict(strategy="speculative", mrp_steps=2, draft_candidates=4),
                                    dict(strategy="static", do_sample=True, seed=[1, 2, 3], temperature=0.8),
                                    dict(strategy="speculative", mrp_steps=2, draft_candidates=4, do_sample=True,
                                         seed=[1, 2, 3], top_p=0.9),
                                    dict(strategy="remask", threshold=0.4, do_sample=[True, False, True], seed=4)],
                         ids=lambda k: "-".join(map(str, k.values())))
@pytest.mark.parametrize("graphs", [False, True])
def test_top_logprobs_leave_decoding_as_it_is_and_rank_the_softmax_that_committed_each_token(model, kwargs, graphs):
    """output_top_logprobs=k (fewer and more than a speculative call's 4 draft candidates, which the same lists
    feed): tokens, confidences and stats as without; at each new token the k largest log-probabilities, in order, of
    the softmax whose probability ``confidences`` gives: a greedy pick's token first, a sampled token at its
    confidence's log-probability where it is among the k, below the k-th where not; -inf / -1 elsewhere."""
    prompts = [random_prompts(1, n, seed=70 + b)[0] for b, n in enumerate([4, 7, 2])]
    ids, mask = padded_batch(prompts, "left")
    common = dict(max_new_tokens=12, pad_token_id=0, eos_token_id=[], return_dict_in_generate=True,
                  output_confidences=True, cuda_graphs=graphs, **kwargs)
    base = model.generate(ids, attention_mask=mask, **common)
    do_sample = kwargs.get("do_sample", False)
    sampled = torch.tensor(do_sample if isinstance(do_sample, list) else [do_sample] * 3)[:, None]
    for k in (2, 6):
        out = model.generate(ids, attention_mask=mask, output_top_logprobs=k, **common)
        assert torch.equal(out.sequences, base.sequences) and torch.equal(out.confidences, base.confidences)
        for name, value in vars(base.stats).items():
            assert torch.equal(getattr(out.stats, name), value), name
        tokens, top, top_ids = out.sequences[:, 7:], out.top_logprobs[:, 7:], out.top_token_ids[:, 7:]
        assert top.shape == (3, 12, k) and (top[..., :-1] >= top[..., 1:]).all() and (top_ids >= 0).all()
        assert (out.top_logprobs[:, :7] == float("-inf")).all() and (out.top_token_ids[:, :7] == -1).all()
        chosen = top_ids == tokens[..., None]
        logprob = base.confidences[:, 7:].log()
        torch.testing.assert_close(top[chosen], logprob[chosen.any(-1)], rtol=1e-5, atol=1e-6)
        assert (chosen[..., 0] | sampled).all() and (logprob[~chosen.any(-1)] <= top[~chosen.any(-1)][:, -1]).all()
        assert sampled.any() or chosen[..., 0].all()


def test_stop_strings_cut_the_stream_too(model):
    tok = LetterTokenizer()
    ids = random_prompts(1, 4, seed=41)
    free = model.generate(ids, max_new_tokens=16, eos_token_id=[])[0, 4:].tolist()
    stop = tok.decode(free[5:7])
    keep = tok.decode(free).find(stop) + 2
    streamer = RecordingStreamer()
    pad = next(t for t in range(MASK_ID) if t not in free)  # a token the model does not write: the cut shows
    out = model.generate(ids, max_new_tokens=16, eos_token_id=[], pad_token_id=pad, stop_strings=stop, tokenizer=tok,
                         streamer=streamer)
    assert sum(streamer.puts[1:], []) == free[:keep] == out[0, 4:4 + keep].tolist()
    assert (out[0, 4 + keep:] == pad).all() and keep < 16


def test_an_eos_after_a_stop_string_cut_does_not_lengthen_the_row(model):
    """The stop string completes at the first new token; the block goes on to write the EOS next: the row keeps the
    first token only (an EOS is looked for among the tokens the stop string left)."""
    tok = LetterTokenizer()
    ids = random_prompts(1, 4, seed=40)
    free = model.generate(ids, max_new_tokens=16, eos_token_id=[])[0, 4:].tolist()
    assert free[1] != free[0]  # the EOS below is not in the stop string's text
    pad = next(t for t in range(MASK_ID) if t not in free)
    out = model.generate(ids, max_new_tokens=16, eos_token_id=free[1], pad_token_id=pad,
                         stop_strings=tok.decode(free[:1]), tokenizer=tok, return_dict_in_generate=True)
    assert out.sequences[0, 4:].tolist() == free[:1] + [pad] * 15 and out.new_tokens.tolist() == [1]


@pytest.mark.parametrize("prompt_length", [2, 3])
def test_a_stop_string_in_the_first_new_token_of_a_block_the_prompt_began(model, prompt_length):
    """The prompt fills part of the first block (its text is not searched): a stop string that the first new token
    completes keeps that token alone."""
    tok = LetterTokenizer()
    ids = random_prompts(1, prompt_length, seed=40)
    free = model.generate(ids, max_new_tokens=8, eos_token_id=[])[0, prompt_length:].tolist()
    pad = next(t for t in range(MASK_ID) if t not in free)
    out = model.generate(ids, max_new_tokens=8, eos_token_id=[], pad_token_id=pad, stop_strings=tok.decode(free[:1]),
                         tokenizer=tok, return_dict_in_generate=True)
    assert out.sequences[0, prompt_length:].tolist() == free[:1] + [pad] * 7 and out.new_tokens.tolist() == [1]


def test_a_stop_string_cut_pads_with_the_mask_token_when_the_model_has_no_pad_or_eos(model):
    """Without a pad or EOS id (the tiny config has neither) padding falls back to the mask token: a row a stop
    string cut is padded with it, not mistaken for a row left undecoded."""
    tok = LetterTokenizer()
    ids = random_prompts(1, 4, seed=41)
    free = model.generate(ids, max_new_tokens=16)[0, 4:].tolist()
    keep = tok.decode(free).find(tok.decode(free[5:7])) + 2
    out = model.generate(ids, max_new_tokens=16, stop_strings=tok.decode(free[5:7]), tokenizer=tok)
    assert out[0, 4:4 + keep].tolist() == free[:keep] and (out[0, 4 + keep:] == MASK_ID).all()


def test_the_kv_cache_refuses_writes_past_its_length():
    cache = StaticKVCache(1, 2, 4, 1, 2, torch.float32, "cpu")
    assert cache.write_offsets(4).tolist() == [[0, 1, 2, 3]] * 2
    with pytest.raises(RuntimeError, match="KV cache overflow: 0 \\+ 5 > max_len 4"):
        cache.write_offsets(5)


def test_the_kv_cache_commits_some_rows_and_keeps_rows_at_the_front():
    """advance(rows=...) commits only those rows; keep_rows moves the kept rows' keys, values and lengths to the
    front, and ``length`` (the width forwards read) becomes the largest committed length of the rows kept, not of
    the rows dropped (outputs cannot show a stale width: the slots past a row's length are masked out; it only
    costs work)."""
    cache = StaticKVCache(1, 3, 8, 1, 2, torch.float64, "cpu")
    keys = torch.arange(3 * 4 * 2, dtype=torch.float64).view(3, 1, 4, 2)
    cache.write(0, keys, -keys, cache.write_offsets(4))
    cache.advance(4)
    cache.write(0, keys[:, :, :2] + 100, -keys[:, :, :2], cache.write_offsets(2))
    cache.advance(2, torch.tensor([False, False, True]))
    assert cache.lengths.tolist() == [4, 4, 6] and cache.length == 6
    cache.keep_rows(torch.tensor([0, 2]))
    k, v = cache.prefix(0)
    assert cache.lengths.tolist() == [4, 6] and cache.length == 6 and k.shape[2] == 6
    assert torch.equal(k[0, :, :4], keys[0]) and torch.equal(k[1], torch.cat([keys[2], keys[2, :, :2] + 100], 1))
    assert torch.equal(v[1, :, :4], -keys[2])
    cache.keep_rows(torch.tensor([0]))
    assert cache.lengths.tolist() == [4] and cache.length == 4 and cache.prefix(0)[0].shape == (1, 1, 4, 2)


def test_top_p_one_keeps_every_token_and_pad_falls_back_to_the_first_eos(model):
    ids = random_prompts(2, 5, seed=3)
    kw = dict(max_new_tokens=6, do_sample=True, seed=5)
    assert torch.equal(model.generate(ids, top_p=1.0, **kw), model.generate(ids, **kw))
    free = model.generate(ids, max_new_tokens=12)
    first = int(free[0, 6])  # row 0's 2nd new token
    other = next(t for t in range(MASK_ID) if t not in free[0].tolist())
    assert model.config.pad_token_id is None and model.generation_config.pad_token_id is None
    out = model.generate(ids[:1], max_new_tokens=12, eos_token_id=[other, first])
    assert out[0, 6] == first and (out[0, 7:] == other).all()  # no pad id anywhere: padded with the first EOS id


def test_eos_and_pad_come_from_the_model_config_when_no_generation_config_sets_them(model):
    """A model whose generation config sets no EOS or pad id (one without generation_config.json) decodes with its
    config's: the row ends at the config's EOS and is padded with the config's pad id, not the EOS id (that is the
    fallback when there is no pad id), as when the call passes both."""
    ids = random_prompts(1, 5, seed=8)
    free = model.generate(ids, max_new_tokens=12)[0, 5:].tolist()
    eos, pad = free[2], next(t for t in range(MASK_ID) if t not in free)
    configured = tiny_model(seed=0, eos_token_id=eos, pad_token_id=pad)  # the module model's weights
    configured.generation_config = GenerationConfig()
    out = configured.generate(ids, max_new_tokens=12)
    assert torch.equal(out, model.generate(ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=pad))
    assert out[0, -1] == pad != eos and free.index(eos) < 11  # the row was cut and padded


@pytest.mark.parametrize("overrides,error,message", [
    (dict(stop_strings="ab"), ValueError, "pass tokenizer="),
    (dict(stop_strings=[""], tokenizer=LetterTokenizer()), TypeError, "stop_strings must be"),
    (dict(stop_strings=5, tokenizer=LetterTokenizer()), TypeError, "stop_strings must be"),
    (dict(stop_strings=[], tokenizer=LetterTokenizer()), TypeError, r"stop_strings must be .*, got \(\)"),
    (dict(stop_strings=["ab", 3], tokenizer=LetterTokenizer()), TypeError, r"stop_strings must be .*, got \('ab', 3\)"),
    (dict(stop_strings="ab", tokenizer="gpt2"), ValueError, "pass tokenizer="),  # a name, not a tokenizer object
])
def test_bad_stop_strings_are_rejected(model, overrides, error, message):
    with pytest.raises(error, match=message):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, **overrides)
