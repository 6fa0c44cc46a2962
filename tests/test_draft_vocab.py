"""Draft vocabularies of speculative decoding (hf_integration.draft_vocab, training.draft_vocab, the CLIs)."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mrp_triton
from hf_integration.draft_vocab import draft_head, normalize_draft_vocab
from tiny_models import MASK_ID, VOCAB, random_prompts, spy_on_drafts, tiny_model
from training.config import ConfigError
from training.draft_vocab import coverage, most_frequent_ids

ODD_IDS = tuple(range(1, VOCAB, 2))  # without the mask token (66)
EVEN_IDS = tuple(range(0, VOCAB, 2))  # with it


def test_normalized_forms():
    assert normalize_draft_vocab(7, 10) == 7
    assert normalize_draft_vocab([4, 1, 3], 10) == (1, 3, 4)
    assert normalize_draft_vocab(torch.tensor([2, 0, 1]), 10) == 3  # the ids below 3, given one by one
    assert normalize_draft_vocab((9, 5), 10) == (5, 9)


@pytest.mark.parametrize("value,error,message", [
    (1, ValueError, "draft_vocab=1 must be >= 2"),
    (11, ValueError, "exceeds the vocabulary"),
    (True, TypeError, "must be an int"),
    ("12", TypeError, "must be an int"),
    ([1, 2.0], TypeError, "must be an int"),
    ([True, 2], TypeError, "must be an int"),  # a bool is no token id, in a list as on its own
    ([3, 3, 4], ValueError, "more than once"),
    ([4], ValueError, "at least 2 token ids"),
    ([-1, 4], ValueError, "outside the vocabulary"),
    ([4, 10], ValueError, "outside the vocabulary"),
    (torch.tensor([[1, 2]]), TypeError, "1-D integer"),
    (torch.tensor([1.0, 2.0]), TypeError, "1-D integer"),
    (torch.tensor([True, False]), TypeError, "1-D integer"),
    (torch.tensor([1 + 0j, 2 + 0j]), TypeError, "1-D integer"),
])
def test_bad_draft_vocab_is_refused_with_its_name(value, error, message):
    with pytest.raises(error, match=message):
        normalize_draft_vocab(value, 10)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_draft_head_picks_the_argmax_among_its_ids(data):
    """lm_head_confidence over the draft rows, mapped back to token ids, is the argmax and full-softmax
    probability of the logits restricted to the draft ids (the mask token excluded; ties: the lowest id)."""
    V = data.draw(st.integers(3, 60), label="V")
    ids = data.draw(st.lists(st.integers(0, V - 1), min_size=2, max_size=V, unique=True), label="ids")
    mask = data.draw(st.integers(0, V - 1), label="mask")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 999), label="seed"))
    weight = torch.randint(-3, 4, (V, 5), generator=g).double()  # integer logits: exact ties
    hidden = torch.randint(-2, 3, (7, 5), generator=g).double()
    head = draft_head(weight, normalize_draft_vocab(ids, V), mask, {})
    columns, conf, _ = mrp_triton.lm_head_confidence(hidden, head.weight, mask_token_id=head.mask_column)
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[ids] = True
    allowed[mask] = False
    z = (hidden @ weight.T).masked_fill(~allowed, float("-inf"))
    assert torch.equal(head.tokens(columns), z.argmax(-1))  # first maximal index
    torch.testing.assert_close(conf.double(), z.softmax(-1).max(-1).values, rtol=1e-5, atol=1e-6)
    full = head.full_logits(hidden @ head.weight.T, V)  # [7, V]; the ids below N stay [7, N]: columns are ids
    width = len(ids) if head.ids is None else V
    assert full.shape == (7, width)
    listed = torch.isin(torch.arange(width), torch.tensor(ids))
    assert torch.equal(full[:, listed], (hidden @ weight.T)[:, :width][:, listed])
    assert torch.isneginf(full[:, ~listed]).all()


@pytest.mark.parametrize("vocab", [5, (1, 4, 7, 30)])
def test_a_table_by_token_id_is_read_by_draft_column(vocab):
    """``columns`` turns a table by token id (which tokens are EOS) into one by draft column: column c is token c
    below N, and the c-th listed id otherwise."""
    weight = torch.randn(VOCAB, 8)
    head = draft_head(weight, vocab, MASK_ID, {})
    table = torch.arange(VOCAB) * 10
    ids = list(range(vocab)) if isinstance(vocab, int) else list(vocab)
    assert head.columns(table).tolist() == [10 * i for i in ids]


def test_listed_rows_live_in_one_buffer_refreshed_from_the_weights_at_every_call():
    weight = torch.randn(12, 4)
    buffers: dict = {}
    first = draft_head(weight, (2, 5, 7), 0, buffers)
    assert torch.equal(first.weight, weight[[2, 5, 7]])
    weight[5] += 1.0  # the lm_head changed in place (same storage): the next call must see it
    second = draft_head(weight, (2, 5, 7), 0, buffers)
    assert second.weight.data_ptr() == first.weight.data_ptr()  # captured steps read one address
    assert torch.equal(second.weight, weight[[2, 5, 7]])
    third = draft_head(weight, (1, 3), 3, buffers)
    assert third.mask_column == 1
    again = draft_head(weight, (2, 5, 7), 0, buffers)  # steps captured for the first vocabulary still read this
    assert again.weight.data_ptr() == first.weight.data_ptr() and list(buffers) == [(2, 5, 7), (1, 3)]


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 3), k=st.integers(1, 4), max_new=st.integers(1, 16),
       ids=st.sampled_from([ODD_IDS, EVEN_IDS, (3, 5, 60)]), do_sample=st.booleans())
def test_speculative_with_listed_draft_ids_equals_static(seed, batch, k, max_new, ids, do_sample):
    """Lossless with any listed draft vocabulary, greedy and sampled (draft and target share the noise)."""
    model = tiny_model(seed=seed % 5, block_size=8)
    prompts = random_prompts(batch, 6, seed=seed)
    sampling = dict(temperature=1.2) if do_sample else {}
    kwargs = dict(max_new_tokens=max_new, do_sample=do_sample, seed=seed, **sampling)
    static = model.generate(prompts, **kwargs)
    spec = model.generate(prompts, strategy="speculative", mrp_steps=k, draft_vocab=list(ids), **kwargs)
    assert torch.equal(spec, static)


@pytest.mark.parametrize("draft_vocab", [MASK_ID, MASK_ID + 1], ids=["every-id-below-the-mask", "whole-vocabulary"])
def test_draft_vocab_up_to_the_mask_token_equals_static(draft_vocab):
    """``draft_vocab=N`` at the mask token's edge: N = mask id leaves exactly the mask token out, N = mask id + 1
    takes it in (its column then masked out of the drafts)."""
    model = tiny_model(seed=2, block_size=8)
    prompts = random_prompts(2, 6, seed=1)
    spec = model.generate(prompts, max_new_tokens=12, strategy="speculative", mrp_steps=3, draft_vocab=draft_vocab)
    assert torch.equal(spec, model.generate(prompts, max_new_tokens=12))


@pytest.mark.parametrize("do_sample", [False, True])
def test_drafts_are_among_the_listed_ids(monkeypatch, do_sample):
    """Drafts choose among the listed ids only; listing the tokens static decoding commits (and two more) gets
    drafts accepted."""
    model = tiny_model(seed=3, block_size=8)
    prompts = random_prompts(2, 5, seed=1)
    kwargs = dict(max_new_tokens=16, do_sample=do_sample, seed=2)
    listed = sorted(set(model.generate(prompts, **kwargs)[:, 5:].flatten().tolist()) | {1, 2})
    drafts = spy_on_drafts(monkeypatch)
    out = model.generate(prompts, strategy="speculative", draft_vocab=torch.tensor(listed),
                         return_dict_in_generate=True, **kwargs)
    drafted = torch.cat([d.flatten() for d in drafts])
    drafted = drafted[drafted >= 0]
    assert len(drafted) and torch.isin(drafted, torch.tensor(listed)).all()
    assert out.stats.accepted_lengths[:, 1:].sum() > 0


def test_graphed_calls_draft_from_the_current_weights(monkeypatch):
    """With the replayed steps (cuda_graphs=True) the draft rows sit in the engine's buffer across calls, one per
    vocabulary (steps captured for a vocabulary read its buffer when it comes back after another); after the
    lm_head changes in place a call drafts what a fresh engine drafts."""
    drafts = spy_on_drafts(monkeypatch)
    model = tiny_model(seed=4, block_size=8)
    prompts = random_prompts(1, 5, seed=2)
    kwargs = dict(max_new_tokens=16, strategy="speculative", draft_vocab=list(ODD_IDS), cuda_graphs=True)
    model.generate(prompts, **kwargs)
    model.generate(prompts, **{**kwargs, "draft_vocab": list(EVEN_IDS)})
    with torch.no_grad():
        model.lm_head.weight[1::2].mul_(-1.0)  # flips which odd ids the drafts prefer
    del drafts[:]
    kept = model.generate(prompts, **kwargs)
    kept_drafts = torch.cat([d.flatten() for d in drafts])
    model.release_decode_engine()
    del drafts[:]
    fresh = model.generate(prompts, **kwargs)
    assert torch.equal(kept, fresh) and torch.equal(kept_drafts, torch.cat([d.flatten() for d in drafts]))


def test_most_frequent_ids():
    counts = Counter({5: 10, 2: 10, 9: 3, 7: 1, 0: 4})
    assert most_frequent_ids(counts, 3, 12) == [0, 2, 5]  # 5 and 2 tie: both in; then 0
    assert most_frequent_ids(counts, 3, 12, exclude=[2]) == [0, 5, 9]
    assert most_frequent_ids(counts, 7, 12) == [0, 1, 2, 3, 5, 7, 9]  # unseen ids fill up, lowest first
    assert most_frequent_ids(counts, 7, 12, exclude=[1]) == [0, 2, 3, 4, 5, 7, 9]  # never with an excluded id
    assert most_frequent_ids(counts, 2, 12, exclude=[0]) == [2, 5]  # a tie at the cut: the lower ids
    assert most_frequent_ids(Counter({8: 2, 3: 2, 6: 2}), 2, 12) == [3, 6]
    assert coverage(counts, [5, 2]) == pytest.approx(20 / 28)
    assert most_frequent_ids(Counter({5: 10, 12: 99, -1: 99}), 2, 12) == [0, 5]  # ids outside the vocabulary skipped
    for size in (1, 13):
        with pytest.raises(ValueError, match="--size"):
            most_frequent_ids(counts, size, 12)


def test_draft_vocab_command_feeds_mrp_generate(tmp_path, capsys):
    """mrp-train draft-vocab on text files writes the ids mrp-generate --draft-vocab FILE decodes with."""
    from hf_integration import cli as generate_cli
    from hf_integration.cli import SHIPPED_MODEL
    from training import cli as train_cli

    corpus = tmp_path / "code.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 50)
    out = tmp_path / "draft_vocab.json"
    result = train_cli.run_draft_vocab(train_cli.build_parser().parse_args(
        ["draft-vocab", "--model", str(SHIPPED_MODEL), "--data", str(corpus), "--size", "64", "--out", str(out)]))
    ids = json.loads(out.read_text())
    assert len(ids) == 64 == result["size"] and ids == sorted(set(ids))
    # the text has fewer than 64 distinct tokens, so the lowest ids fill up, but never the mask token, which no
    # draft may propose
    mask_id = json.loads((SHIPPED_MODEL / "config.json").read_text())["mask_token_id"]
    assert mask_id < max(ids) and mask_id not in ids
    assert result["coverage"] == 1.0 > result["coverage_ids_below_size"]  # every token of this text is among them
    assert generate_cli.main(["def f(x):", "--max-new-tokens", "8", "--draft-vocab", str(out)]) == 0
    assert "[speculative]" in capsys.readouterr().err
    assert generate_cli.draft_vocab_arg(str(out)) == ids and generate_cli.draft_vocab_arg("20") == 20
    (tmp_path / "not_a_list.json").write_text('{"ids": [1, 2]}')
    with pytest.raises(argparse.ArgumentTypeError, match="must hold a JSON list of token ids, got dict"):
        generate_cli.draft_vocab_arg(str(tmp_path / "not_a_list.json"))
    with pytest.raises(argparse.ArgumentTypeError, match="neither a number of ids nor a readable JSON list"):
        generate_cli.draft_vocab_arg("-5")
    # refused before the data is counted, naming the flag: an --out in no folder, a --model that is no model folder
    (tmp_path / "tokenizer_only").mkdir()
    for flags, message in ((["--model", str(SHIPPED_MODEL), "--out", str(tmp_path / "no" / "ids.json")],
                            "--out .*ids.json: its folder does not exist"),
                           (["--model", str(tmp_path / "tokenizer_only"), "--out", str(out)],
                            "--model: .*tokenizer_only' is not a model folder")):
        with pytest.raises(ConfigError, match=message):
            train_cli.run_draft_vocab(train_cli.build_parser().parse_args(
                ["draft-vocab", *flags, "--data", str(corpus), "--size", "64"]))


def test_a_checkpoint_carries_its_draft_vocabulary(tmp_path, monkeypatch):
    """mrp-train draft-vocab --into-generation-config: the model's speculative calls draft among the ids by default,
    its other strategies ignore them, and a call's own draft_vocab wins."""
    import copy
    import shutil

    from hf_integration import SDARMRPForCausalLM
    from hf_integration.cli import SHIPPED_MODEL
    from training import cli as train_cli

    model_dir = tmp_path / "model"
    shutil.copytree(SHIPPED_MODEL, model_dir)
    corpus = tmp_path / "code.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 50)
    with pytest.raises(train_cli.ConfigError, match="writes into a model folder"):
        train_cli.run_draft_vocab(train_cli.build_parser().parse_args(
            ["draft-vocab", "--model", "someone/sdar-mrp", "--data", str(corpus), "--size", "64",
             "--into-generation-config"]))
    with pytest.raises(train_cli.ConfigError, match="say where the ids go"):
        train_cli.run_draft_vocab(train_cli.build_parser().parse_args(
            ["draft-vocab", "--model", str(model_dir), "--data", str(corpus), "--size", "64"]))
    train_cli.run_draft_vocab(train_cli.build_parser().parse_args(
        ["draft-vocab", "--model", str(model_dir), "--data", str(corpus), "--size", "64",
         "--into-generation-config"]))
    ids = json.loads((model_dir / "generation_config.json").read_text())["draft_vocab"]
    assert len(ids) == 64
    model = SDARMRPForCausalLM.from_pretrained(model_dir)
    prompt = torch.tensor([[5, 6, 7, 8]])
    static = model.generate(prompt, max_new_tokens=16)  # not refused: the checkpoint's draft_vocab is not asked for
    assert torch.equal(model.generate(prompt, max_new_tokens=16, draft_vocab=None), static)  # as mrp-generate passes
    pipeline_style = copy.deepcopy(model.generation_config)  # what transformers' pipeline hands generate
    assert torch.equal(model.generate(prompt, generation_config=pipeline_style, max_new_tokens=16), static)
    drafts = spy_on_drafts(monkeypatch)
    assert torch.equal(model.generate(prompt, max_new_tokens=16, strategy="speculative"), static)
    drafted = torch.cat([d.flatten() for d in drafts])
    assert (drafted >= 0).any() and torch.isin(drafted[drafted >= 0], torch.tensor(ids)).all()
    del drafts[:]
    model.generate(prompt, max_new_tokens=16, strategy="speculative", draft_vocab=model.config.vocab_size)
    drafted = torch.cat([d.flatten() for d in drafts])
    assert not torch.isin(drafted[drafted >= 0], torch.tensor(ids)).all()  # the whole vocabulary drafted
    with pytest.raises(ValueError, match="draft_vocab=.* steers strategy 'speculative', not 'static'"):
        model.generate(prompt, max_new_tokens=4, draft_vocab=ids)  # asked for, with static decoding
