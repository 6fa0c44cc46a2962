"""``SDARMRPForCausalLM.forward``: scoring whole sequences as transformers' causal LMs are called (padded batches,
``inputs_embeds``, ``logits_to_keep``, ``output_hidden_states``, ``return_dict``, ``labels``) and its refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_integration.attention_masks import block_causal_mask, padded_block_causal_mask
from tiny_models import VOCAB, random_prompts, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 11), min_size=1, max_size=4), left=st.booleans(), seed=st.integers(0, 99))
def test_a_padded_batch_scores_each_row_as_alone(model, lengths, left, seed):
    """A padding mask [B, T] (left or right padding) gives each row's real tokens the logits the row has alone:
    positions count its real tokens from 0, so its blocks are its own."""
    width = max(lengths)
    ids = random_prompts(len(lengths), width, seed=seed)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        real = slice(width - n, None) if left else slice(0, n)
        mask[row, real] = 1
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        for row, n in enumerate(lengths):
            real = mask[row].bool()
            alone = model(ids[row, real][None]).logits[0]
            torch.testing.assert_close(logits[row, real], alone, rtol=1e-9, atol=1e-9)


def test_padding_keys_are_hidden_and_no_query_is_left_without_keys():
    """Real queries never see padding keys, and every query sees at least itself: no mask row is empty, not even an
    all-padding row's (a softmax over no keys is NaN on some SDPA backends; the CPU one returns 0, so the forward
    tests alone would not notice)."""
    real = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    mask, positions = padded_block_causal_mask(real, None, block_size=2)
    assert mask.shape == (3, 1, 5, 5) and mask.any(-1).all()
    assert positions.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 0, 0, 0, 0]]
    sees_padding = mask[:, 0] & ~real.bool()[:, None, :]  # [row, query, key]
    assert not sees_padding[real.bool()].any()


def test_position_ids_given_with_a_padding_mask_are_kept(model):
    """Explicit position_ids win over the ones a padding mask implies (as in transformers)."""
    ids = random_prompts(2, 7, seed=6)
    pos = torch.arange(3, 10)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=torch.ones_like(ids), position_ids=pos).logits,
                                   model(ids, position_ids=pos).logits, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(model(ids, position_ids=pos).logits, model(ids).logits)


def test_inputs_embeds_logits_to_keep_and_tuples_give_the_same_scores(model):
    ids = random_prompts(2, 9, seed=4)
    with torch.no_grad():
        full = model(ids).logits
        assert torch.equal(model(inputs_embeds=model.get_input_embeddings()(ids)).logits, full)
        assert torch.equal(model(ids, logits_to_keep=3).logits, full[:, -3:])
        assert torch.equal(model(ids, logits_to_keep=torch.tensor([0, 5])).logits, full[:, [0, 5]])
        assert torch.equal(model(ids, logits_to_keep=0).logits, full)
        labels = ids.masked_fill(torch.rand(ids.shape, generator=torch.Generator().manual_seed(0)) < 0.5, -100)
        as_tuple = model(ids, labels=labels, output_hidden_states=True, return_dict=False)
    loss = torch.nn.functional.cross_entropy(full.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert len(as_tuple) == 3 and torch.equal(as_tuple[0], loss) and torch.equal(as_tuple[1], full)
    assert len(as_tuple[2]) == model.config.num_hidden_layers + 1


def test_hidden_states_and_return_dict_follow_the_config_defaults(model):
    ids = random_prompts(1, 5)
    model.config.output_hidden_states = True
    try:
        assert len(model(ids).hidden_states) == model.config.num_hidden_layers + 1
        assert model(ids, output_hidden_states=False).hidden_states is None
    finally:
        model.config.output_hidden_states = False
    assert model(ids).hidden_states is None
    model.config.return_dict = False
    try:
        assert isinstance(model(ids), tuple) and not isinstance(model(ids, return_dict=True), tuple)
    finally:
        model.config.return_dict = True
    assert not isinstance(model(ids), tuple)


@pytest.mark.parametrize("rows", [1, 2])
def test_a_bool_mask_per_row_or_broadcast_is_the_attention_it_says(model, rows):
    """A 4-D bool mask [B or 1, 1, T, T] (True = attend): the block-causal mask of positions 0..T-1 gives the scores
    of no mask; a causal triangle gives other scores (it hides the later keys of a query's own block)."""
    ids = random_prompts(2, 9, seed=3)
    pos = torch.arange(9)[None].expand(rows, 9)
    block_causal = block_causal_mask(pos, pos, model.config.block_size)
    causal = torch.ones(9, 9, dtype=torch.bool).tril().expand(rows, 1, 9, 9)
    with torch.no_grad():
        plain = model(ids).logits
        assert torch.equal(model(ids, attention_mask=block_causal).logits, plain)
        assert not torch.allclose(model(ids, attention_mask=causal).logits, plain)


def test_a_bf16_model_computes_its_labels_loss_in_fp32():
    model = tiny_model(seed=2, dtype=torch.bfloat16)
    ids = random_prompts(2, 9, seed=5)
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    assert torch.equal(out.loss, torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), ids.flatten()))


def test_transformers_gradient_checkpointing_gives_the_same_loss_and_gradients():
    """transformers' activation checkpointing API (what its Trainer calls with ``gradient_checkpointing=True``)
    checkpoints each decoder layer: the layer runs again in the backward pass, and a padded batch's labels loss and
    every gradient are those without it."""
    import warnings

    ids, mask = random_prompts(2, 9, seed=3), torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    results = []
    for checkpointing in (False, True):
        model = tiny_model(seed=4).train()
        runs = []
        model.model.layers[1].self_attn.q_proj.register_forward_pre_hook(lambda *_: runs.append(1))
        if checkpointing:
            with warnings.catch_warnings():  # newer transformers name it activation_checkpointing_enable
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_enable()
        loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}, len(runs)))
    (want, want_grads, plain), (got, got_grads, checkpointed) = results
    assert (plain, checkpointed) == (1, 2) and torch.equal(got, want)
    assert all(torch.equal(got_grads[n], g) for n, g in want_grads.items() if g is not None)
    assert {n for n, g in got_grads.items() if g is not None} == {n for n, g in want_grads.items() if g is not None}


IDS = random_prompts(2, 6)
BAD_FORWARD_INPUTS = [
    (dict(), ValueError, "exactly one"),
    (dict(input_ids=IDS, inputs_embeds=torch.zeros(2, 6, 32, dtype=torch.float64)), ValueError, "exactly one"),
    (dict(input_ids=IDS[0]), ValueError, "input_ids must be an integer tensor"),
    (dict(input_ids=IDS.double()), ValueError, "input_ids must be an integer tensor"),
    (dict(input_ids=IDS.tolist()), ValueError, "input_ids must be an integer tensor"),
    (dict(input_ids=IDS + VOCAB), ValueError, "input_ids contain ids outside the vocabulary"),
    (dict(input_ids=IDS - 100), ValueError, "input_ids contain ids outside the vocabulary"),
    (dict(input_ids=IDS[:, :0]), ValueError, "empty batch"),
    (dict(inputs_embeds=torch.zeros(2, 6, 31)), ValueError, "inputs_embeds must be a float tensor"),
    (dict(inputs_embeds=torch.zeros(2, 6, 32, dtype=torch.long)), ValueError, "inputs_embeds must be a float"),
    (dict(input_ids=IDS, attention_mask=torch.ones(2, 5)), ValueError, "attention_mask \\[batch, seq_len\\] must"),
    (dict(input_ids=IDS, attention_mask=torch.full((2, 6), 2)), ValueError,
     r"attention_mask must hold 1 \(a token\) and 0 \(padding\) only, got \[2\]"),
    (dict(input_ids=IDS, attention_mask=torch.ones(2, 1, 6)), ValueError, "attention_mask must be a padding mask"),
    (dict(input_ids=IDS, attention_mask=torch.ones(2, 1, 6, 6)), ValueError, "bool mask"),
    (dict(input_ids=IDS, attention_mask=torch.ones(3, 1, 6, 6, dtype=torch.bool)), ValueError, "bool mask"),
    (dict(input_ids=IDS, attention_mask=[[1] * 6] * 2), ValueError, "attention_mask must be a tensor"),
    (dict(input_ids=IDS, position_ids=torch.arange(5)[None]), ValueError, "position_ids must be"),
    (dict(input_ids=IDS, position_ids=torch.arange(6.0)[None]), ValueError, "position_ids must be"),
    (dict(input_ids=IDS, position_ids=torch.arange(6)[None].expand(3, 6)), ValueError, "position_ids must be"),
    (dict(input_ids=IDS, labels=IDS[:, :5]), ValueError, "labels must be an integer tensor"),
    (dict(input_ids=IDS, labels=IDS.double()), ValueError, "labels must be an integer tensor"),
    (dict(input_ids=IDS, labels=IDS + VOCAB), ValueError, "labels contain ids outside the vocabulary"),
    (dict(input_ids=IDS, labels=IDS.masked_fill(IDS == IDS[0, 0], -1)), ValueError,
     r"labels contain ids outside the vocabulary \[0, 67\) \(min -1, .*\); -100 marks a position without loss"),
    (dict(input_ids=IDS, logits_to_keep=-1), ValueError, "logits_to_keep must be"),
    (dict(input_ids=IDS, logits_to_keep=True), ValueError, "logits_to_keep must be"),
    (dict(input_ids=IDS, logits_to_keep=torch.tensor([[1]])), ValueError, "logits_to_keep must be"),
    (dict(input_ids=IDS, labels=IDS, logits_to_keep=1), ValueError, "drop logits_to_keep"),
    (dict(input_ids=IDS, past_key_values=object()), ValueError, "takes no past_key_values"),
    (dict(input_ids=IDS, output_attentions=True), ValueError, "output_attentions=True is not supported"),
    (dict(input_ids=IDS, output_hidden_states=[0, -1]), TypeError, "output_hidden_states must be True, False"),
    (dict(input_ids=IDS, return_dict="no"), TypeError, "return_dict must be True, False or None"),
    (dict(input_ids=IDS, token_type_ids=torch.zeros_like(IDS)), TypeError, "token_type_ids"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_FORWARD_INPUTS)
def test_bad_forward_input_is_refused_naming_the_argument(model, kwargs, error, message):
    with pytest.raises(error, match=message):
        model(**kwargs)
