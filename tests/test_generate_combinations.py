"""generate() under drawn combinations of settings (float64): every strategy with sampling, its filters, the
repetition, presence and frequency penalties, a logit bias, token bans and min_new_tokens together, on padded batches;
the engine options that must not change the output (graph-shaped steps, the fused commit, rows moving on per row, a
chunked prefill) are checked against each other, and speculative decoding against static decoding, where each
feature's own tests check it alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_integration.generation_settings import READ_BY
from tiny_models import MASK_ID, padded_batch, random_prompts, tiny_model

DRAFTING = ("mrp_steps", "draft_schedule", "draft_candidates", "draft_vocab")
CALLS = [dict(strategy="static"), dict(strategy="static", denoising_steps=2), dict(strategy="dynamic", threshold=0.3),
         dict(strategy="sequential"), dict(strategy="entropy_bounded", entropy_bound=2.0),
         dict(strategy="direct", mrp_steps=2), dict(strategy="speculative", mrp_steps=3),
         dict(strategy="speculative", mrp_steps=2, draft_schedule="authors"),
         dict(strategy="speculative", mrp_steps=2, draft_candidates=5),
         dict(strategy="speculative", mrp_steps=2, draft_vocab=40),
         dict(strategy="remask", threshold=0.4), dict(strategy="remask", threshold=0.4, remask_rule="delta")]
FILTERS = {"top_k": [3, 10], "top_p": [0.8, 0.95], "min_p": [0.05], "typical_p": [0.9], "epsilon_cutoff": [3e-3],
           "eta_cutoff": [2e-3], "top_h": [0.9]}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@st.composite
def calls(draw) -> dict:
    """A strategy, greedy or sampled (each filter drawn one time in five), with or without a repetition penalty,
    presence and frequency penalties, a sequence bias (not beside a repetition penalty), min_new_tokens,
    suppress_tokens and begin_suppress_tokens."""
    kw = dict(draw(st.sampled_from(CALLS)))
    if draw(st.booleans()):
        kw.update(do_sample=True, seed=draw(st.integers(0, 999)), temperature=draw(st.sampled_from([0.7, 1.0, 1.3])))
        kw.update({name: draw(st.sampled_from(values)) for name, values in FILTERS.items()
                   if draw(st.integers(0, 4)) == 0})
    if draw(st.booleans()):
        kw["repetition_penalty"] = draw(st.sampled_from([0.8, 1.3, 2.0]))
    for name, values in (("presence_penalty", [-0.5, 1.0]), ("frequency_penalty", [0.4, 1.5])):
        if draw(st.integers(0, 2)) == 0:
            kw[name] = draw(st.sampled_from(values))
    if "repetition_penalty" not in kw and draw(st.integers(0, 2)) == 0:
        kw["sequence_bias"] = {(token,): bias for token, bias in draw(st.dictionaries(
            st.integers(0, MASK_ID - 1), st.sampled_from([-3.0, 2.0, float("-inf")]), min_size=1, max_size=4)).items()}
    if draw(st.booleans()):
        kw["min_new_tokens"] = draw(st.integers(1, 8))
    for name, most in (("suppress_tokens", 4), ("begin_suppress_tokens", 3)):
        if draw(st.booleans()):
            kw[name] = draw(st.lists(st.integers(2, MASK_ID - 4), min_size=1, max_size=most, unique=True))
    return kw


@settings(max_examples=30, deadline=None)
@given(kw=calls(), lens=st.lists(st.integers(1, 19), min_size=1, max_size=3), max_new=st.integers(1, 14),
       eos=st.integers(0, MASK_ID - 4), side=st.sampled_from(["left", "right"]), seed=st.integers(0, 10**4),
       chunk=st.sampled_from([None, 1, 5, 8]), graphs=st.booleans())
def test_engine_options_strategies_and_settings_agree_in_any_combination(model, kw, lens, max_new, eos, side, seed,
                                                                        chunk, graphs):
    """Graph-shaped steps, the fused commit off, a chunked prefill and rows starting their blocks together give the
    tokens, reveal steps, confidences and counts of the plain call (commit forwards aside, which fuse_commit=False
    counts); the output never holds the mask token, a suppressed token, a begin-suppressed first new token or an EOS
    before min_new_tokens; speculative decoding gives static decoding's tokens (greedy or sampled); a greedy row of a
    left-padded batch gives what it gives alone."""
    rows = [random_prompts(1, n, seed=seed + i)[0] for i, n in enumerate(lens)]
    ids, mask = padded_batch(rows, side)
    common = dict(attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0, **kw)
    out = model.generate(ids, return_dict_in_generate=True, output_confidences=True, output_reveal_steps=True,
                         **common)
    variants = [dict(cuda_graphs=graphs, prefill_chunk_size=chunk, fuse_commit=not graphs)]
    if kw["strategy"] in READ_BY["per_row_blocks"]:
        variants.append(dict(per_row_blocks=False, cuda_graphs=not graphs, prefill_chunk_size=chunk))
    for variant in variants:
        other = model.generate(ids, return_dict_in_generate=True, output_confidences=True, output_reveal_steps=True,
                               **common, **variant)
        assert torch.equal(out.sequences, other.sequences), variant
        assert torch.equal(out.reveal_steps, other.reveal_steps), variant
        torch.testing.assert_close(out.confidences, other.confidences, rtol=1e-6, atol=0)
        for name, value in vars(out.stats).items():
            if name != "commit_forwards" or variant.get("fuse_commit", True):
                assert torch.equal(getattr(other.stats, name), value), (name, variant)
    W = ids.shape[1]
    for b, row in enumerate(rows):
        start = W if side == "left" else len(row)
        new = out.sequences[b, start : start + int(out.new_tokens[b])].tolist()
        assert MASK_ID not in new
        assert not set(new) & set(kw.get("suppress_tokens", ())), new
        assert not new or new[0] not in kw.get("begin_suppress_tokens", ()), new
        assert eos not in new[: kw.get("min_new_tokens", 0)], new
    if kw["strategy"] == "speculative":
        static = {k: v for k, v in common.items() if k not in DRAFTING}
        assert torch.equal(model.generate(ids, **{**static, "strategy": "static"}), out.sequences)
    if not kw.get("do_sample") and side == "left" and len(rows) > 1:
        for b, row in enumerate(rows):
            alone = model.generate(row[None], **{k: v for k, v in common.items() if k != "attention_mask"})
            assert torch.equal(out.sequences[b, W - len(row):], alone[0]), b
