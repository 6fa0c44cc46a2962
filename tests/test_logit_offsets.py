"""Presence and frequency penalties (OpenAI's) and a logit bias (transformers' ``sequence_bias``): the ops' additive
``logit_offsets`` and ``logit_bias`` (kernel and reference) and generate() for every strategy, against the uncached
oracle running transformers' processors; float64."""

from __future__ import annotations

import pytest
import torch

import mrp_triton as mt
from hf_integration.generation_settings import GenerationSettings
from mrp_triton.reference.confidence import penalties_applied
from tiny_models import (DRAFTS, STRATEGIES, assert_rows_decode_as_alone, assert_speculative_is_static,
                         naive_static_decode, padded_batch, random_prompts, tiny_model)

from kernel_utils import DEV

# presence and frequency penalties, a bias, all three, and a bias beside a repetition penalty (the oracle's names:
# bias is token id -> bias)
OFFSETS = [dict(presence_penalty=1.5), dict(frequency_penalty=0.8), dict(bias={0: -3.0, 48: -2.0, 11: 2.5}),
           dict(presence_penalty=-0.5, frequency_penalty=0.9, bias={5: 1.0}),
           dict(repetition_penalty=1.8, bias={0: 2.0, 48: -1.0}, frequency_penalty=0.3)]


def as_generate(kw: dict) -> dict:
    """The oracle's keywords as generate()'s: the bias as transformers' sequence_bias."""
    kw = dict(kw)
    if "bias" in kw:
        kw["sequence_bias"] = {(token,): b for token, b in kw.pop("bias").items()}
    return kw


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("penalty", [None, 1.7], ids=["offsets and bias", "with a repetition penalty"])
def test_ops_add_the_bias_and_each_rows_offsets_before_the_temperature(backend, penalty):
    """The confidence op, the fused LM-head pick and the listed-token pick with a logit bias and logit offsets (rows
    reading shared rows of the table through seen_rows; alone, or with a repetition penalty between the two) pick as
    the op does on logits they were applied to, greedy and sampled, with the same probabilities; they change picks."""
    g = torch.Generator().manual_seed(3)
    N, V, H = 6, 97, 16
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    logits = hidden @ weight.T
    rows = torch.tensor([0, 1, 2, 0, 2, 1])
    offsets, bias = torch.randn(3, V, generator=g) * 2, torch.randn(V, generator=g)
    offsets[rows, logits.argmax(-1)] -= 100.0  # every row's best token pushed down
    on = dict(logit_offsets=offsets, seen_rows=rows, logit_bias=bias)
    if penalty is not None:
        on.update(repetition_penalty=penalty, seen_tokens=torch.rand(3, V, generator=g) < 0.3)
    shifted = penalties_applied(logits, **on)
    on = {name: value.to(DEV) if torch.is_tensor(value) else value for name, value in on.items()}
    sampled = dict(do_sample=True, seed=4, noise_keys=torch.randint(0, 99, (N, 3), generator=g).to(DEV))
    with mt.use_backend(backend):
        for kw in ({}, sampled):
            got = mt.confidence(logits.to(DEV), temperature=0.7, **on, **kw)
            want = mt.confidence(shifted.to(DEV), temperature=0.7, **kw)
            assert torch.equal(got[0], want[0]) and (got[0].cpu() != logits.argmax(-1)).all()
            torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
        fused = mt.lm_head_confidence(hidden.to(DEV), weight.to(DEV), temperature=0.7, **on)
        assert torch.equal(fused[0].cpu(), shifted.argmax(-1))
        ids = torch.stack([torch.randperm(V, generator=g)[:8] for _ in range(N)])
        ids[:, 0] = logits.argmax(-1)  # each row lists its best token, which the offsets push down
        listed = mt.candidate_confidence(hidden.to(DEV), weight.to(DEV), ids.to(DEV), torch.zeros(N, device=DEV),
                                         seed_hidden=hidden.to(DEV), vocab_mean=weight.mean(0).to(DEV), **on)[0]
        assert torch.equal(listed.cpu(), ids.gather(1, shifted.gather(1, ids).argmax(-1, keepdim=True))[:, 0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(logit_offsets=torch.zeros(2, 10, dtype=torch.float64)), "logit_offsets must be a float32 tensor \\[C, 10\\]"),
    (dict(logit_offsets=torch.zeros(2, 9)), "logit_offsets must be a float32 tensor \\[C, 10\\]"),
    (dict(logit_offsets=torch.zeros(3, 10)), "logit_offsets has 3 rows but logits 2: pass seen_rows"),
    (dict(logit_offsets=torch.zeros(3, 10), seen_rows=torch.zeros(2)), "seen_rows must be an int64 tensor"),
    (dict(seen_rows=torch.zeros(2, dtype=torch.int64)), "pass one of them too"),
    (dict(logit_bias=torch.zeros(9)), "logit_bias must be a float32 tensor \\[10\\]"),
    (dict(logit_bias=torch.zeros(1, 10)), "logit_bias must be a float32 tensor \\[10\\]"),
    (dict(logit_offsets=torch.zeros(3, 10), repetition_penalty=1.2, seen_tokens=torch.zeros(2, 10, dtype=torch.bool),
          seen_rows=torch.zeros(2, dtype=torch.int64)), "seen_tokens has 2 rows but logit_offsets 3"),
])
def test_ops_refuse_offsets_they_cannot_read(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mt.confidence(torch.zeros(2, 10), **kwargs)


@pytest.mark.parametrize("offsets", OFFSETS, ids=lambda kw: ",".join(kw))
@pytest.mark.parametrize("rule", [{}, dict(leftmost=True), dict(entropy_bound=3.0)],
                         ids=["static", "sequential", "entropy_bounded"])
def test_generate_is_the_oracle_that_offsets_every_step(model, offsets, rule):
    """Static, sequential and entropy-bounded decoding with presence / frequency penalties or a bias give the tokens
    (and confidences) of the uncached oracle that offsets the logits at each step by the new tokens the sequence
    holds (its finished blocks' and those committed in its block so far, never the prompt's), which differ from the
    free run's."""
    prompt_len = 5
    prompt = random_prompts(1, prompt_len, seed=7)[0]
    strategy = dict(strategy="sequential") if rule.get("leftmost") else \
        dict(strategy="entropy_bounded", entropy_bound=rule["entropy_bound"]) if rule else {}
    conf = torch.zeros(prompt_len + 14, dtype=torch.float64)
    oracle = naive_static_decode(model, prompt, 14, model.config.block_size, confidences=conf, **offsets, **rule)
    out = model.generate(prompt[None], max_new_tokens=14, eos_token_id=[], return_dict_in_generate=True,
                         output_confidences=True, **strategy, **as_generate(offsets))
    assert torch.equal(out.sequences[0], oracle)
    torch.testing.assert_close(out.confidences[0, prompt_len:], conf[prompt_len:].float(), rtol=1e-5, atol=1e-7)
    assert not torch.equal(model.generate(prompt[None], max_new_tokens=14, eos_token_id=[], **strategy)[0], oracle)


@pytest.mark.parametrize("drafts", DRAFTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_speculative_decoding_stays_lossless(model, drafts, sampled):
    """Speculative decoding under presence / frequency penalties and a bias commits the tokens static decoding
    commits: each candidate state of a verify forward counts the drafts before it, as static decoding counts them
    once committed."""
    assert_speculative_is_static(model, drafts, sampled, presence_penalty=0.6, frequency_penalty=0.9,
                                 sequence_bias={(4,): 1.5})


def test_each_row_counts_its_own_new_tokens(model):
    """In a left-padded batch each row is offset by its own new tokens only (not its prompt, not the padding): every
    row decodes as it does alone, also with rows finishing early and leaving the batch (an EOS), with per-row blocks,
    and with CUDA graphs' recorded steps (replayed on a CPU)."""
    assert_rows_decode_as_alone(model, max_new_tokens=12, frequency_penalty=1.2, presence_penalty=0.5,
                                strategy="dynamic", threshold=0.3)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_every_strategy_reads_the_penalties_on_the_device(model, strategy):
    """Every strategy applies the penalties and the bias (its output changes) and reads the penalties from the
    engine's buffer and the bias from its table: one step key serves every value (the captured steps, replayed on a
    CPU, give what eager decoding gives), and 0 is no penalty, with the key of none."""
    ids = random_prompts(2, 6, seed=41)
    kw = dict(max_new_tokens=12, eos_token_id=[], **strategy)
    plain = model.generate(ids, **kw)
    for offsets in (dict(presence_penalty=2.0, frequency_penalty=1.0, sequence_bias={(9,): 3.0}),
                    dict(frequency_penalty=-0.5, sequence_bias={(2,): -2.0, (9,): 1.0})):
        graphed = model.generate(ids, cuda_graphs=True, **offsets, **kw)
        assert torch.equal(graphed, model.generate(ids, cuda_graphs=False, **offsets, **kw))
        assert not torch.equal(graphed, plain), offsets
    assert torch.equal(model.generate(ids, presence_penalty=0, frequency_penalty=0.0, **kw), plain)
    key = GenerationSettings.resolve(model, None, dict(kw, presence_penalty=1.0, sequence_bias={(1,): 2.0}),
                                     6).step_key()
    assert key == GenerationSettings.resolve(model, None, dict(kw, presence_penalty=-3.0,
                                                               sequence_bias=[[[5], -1.0]]), 6).step_key()
    assert GenerationSettings.resolve(model, None, dict(kw, presence_penalty=0), 6).step_key() == \
        GenerationSettings.resolve(model, None, kw, 6).step_key()


def test_a_bias_of_minus_inf_never_decodes_its_token(model):
    """sequence_bias -inf leaves its token out (as suppress_tokens does); a later pair for an id overrides an earlier
    one in the list form, as transformers' dict would keep one."""
    ids = random_prompts(2, 6, seed=5)
    kw = dict(max_new_tokens=12, eos_token_id=[])
    plain = model.generate(ids, **kw)[:, 6:]
    common = int(plain.flatten().mode().values)
    out = model.generate(ids, sequence_bias=[[[common], 2.0], [[common], float("-inf")]], **kw)
    assert torch.equal(out, model.generate(ids, suppress_tokens=[common], **kw))
    assert not (out[:, 6:] == common).any()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(presence_penalty=float("nan")), ValueError, "presence_penalty=nan must be a finite number"),
    (dict(frequency_penalty=float("inf")), ValueError, "frequency_penalty=inf must be a finite number"),
    (dict(frequency_penalty="1"), TypeError, "frequency_penalty must be a number"),
    (dict(sequence_bias={(3, 4): 1.0}), ValueError, "sequence_bias key \\(3, 4\\) is not a single token"),
    (dict(sequence_bias={(3,): float("nan")}), ValueError, "sequence_bias nan for token 3 must be a finite number"),
    (dict(sequence_bias={(10**6,): 1.0}), ValueError, "sequence_bias"),
    (dict(sequence_bias="3"), TypeError, "sequence_bias must be a dict"),
])
def test_bad_values_are_refused_naming_them(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        model.generate(random_prompts(1, 4, seed=1), max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("penalty", [{}, dict(frequency_penalty=0.5)], ids=["bias alone", "with a penalty"])
@pytest.mark.parametrize("draft_vocab", [30, [0, 1, *range(3, 40)]], ids=["ids below 30", "listed ids"])
def test_draft_vocabulary_picks_read_the_offsets_by_column(draft_vocab, penalty):
    """A draft over a draft vocabulary picks under the bias of its own tokens: the fused pick reads the offsets by
    draft column (column c is token ids[c] for listed ids), so a large bias on one token makes every draft pick it
    (the bias alone: one row of offsets every pick reads; with a penalty: a row a state)."""
    from hf_integration.decoding import BlockDecoder
    from hf_integration.prompts import PromptBatch

    model = tiny_model(seed=5, block_size=8)
    kwargs = dict(max_new_tokens=8, strategy="speculative", draft_vocab=draft_vocab, sequence_bias={(3,): 60.0},
                  **penalty)
    dec = BlockDecoder(model, PromptBatch.from_inputs(model.config, random_prompts(2, 5, seed=1), None),
                       GenerationSettings.resolve(model, None, kwargs, prompt_width=5))
    hidden = torch.randn(2, 8, model.config.hidden_size, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
    block = torch.full((2, 8), model.config.mask_token_id)
    tok = dec.pick_hidden(hidden, torch.arange(8, 16).expand(2, -1), torch.ones(2, 8, dtype=torch.bool), None,
                          dec.draft, seen=dec.penalties(block))[0]
    assert (tok == 3).all()


@pytest.mark.parametrize("penalty", [{}, dict(frequency_penalty=0.7, presence_penalty=0.4)],
                         ids=["bias alone", "with penalties"])
def test_remasks_tau_score_is_the_offset_softmax_probability(penalty):
    """Remask's tau score of a revealed token is its probability under the softmax the reveal's pick saw: the
    corrected logits with the state's offsets (bias and penalties at the token too, not in the normaliser only)."""
    from hf_integration.decoding import BlockDecoder
    from hf_integration.mrp_decoding import _token_scores
    from hf_integration.prompts import PromptBatch

    model = tiny_model(seed=5, block_size=8)
    kwargs = dict(max_new_tokens=8, strategy="remask", sequence_bias={(3,): 2.0, (5,): -1.0}, **penalty)
    dec = BlockDecoder(model, PromptBatch.from_inputs(model.config, random_prompts(2, 5, seed=1), None),
                       GenerationSettings.resolve(model, None, kwargs, prompt_width=5))
    g = torch.Generator().manual_seed(0)
    V, mask = model.config.vocab_size, model.config.mask_token_id
    block = torch.tensor([[3, 3, 5, mask, mask, 9, mask, mask], [mask, 3, mask, 3, 7, mask, mask, mask]])
    dec.engine.starts.zero_()  # every position of the block is a new token
    seen = dec.penalties(block)
    corrected = torch.randn(2, 8, V, generator=g, dtype=torch.float64)
    revealed = block == mask
    positions = torch.arange(8, 16).expand(2, -1)
    z = penalties_applied(corrected.float().reshape(16, V), **seen)
    z[:, mask] = float("-inf")
    tokens = z.argmax(-1).view(2, 8)
    want = z.softmax(-1).gather(1, tokens.reshape(16, 1)).view(2, 8)
    got = _token_scores(dec, None, corrected, tokens, revealed, positions, seen)
    torch.testing.assert_close(got[revealed].float(), want[revealed], rtol=1e-5, atol=1e-7)


def test_a_generation_config_sets_them_as_the_keywords_do(model):
    """presence_penalty and frequency_penalty in a GenerationConfig (transformers keeps fields it does not know) and
    its sequence_bias, in either of transformers' forms, apply as the keywords do."""
    from transformers import GenerationConfig

    ids = random_prompts(1, 5, seed=1)
    kw = dict(max_new_tokens=12, eos_token_id=[])
    want = model.generate(ids, presence_penalty=1.5, frequency_penalty=0.5, sequence_bias={(0,): -3.0}, **kw)
    assert not torch.equal(want, model.generate(ids, **kw))
    for bias in ({(0,): -3.0}, [[[0], -3.0]]):
        config = GenerationConfig(presence_penalty=1.5, frequency_penalty=0.5, sequence_bias=bias)
        assert torch.equal(model.generate(ids, generation_config=config, **kw), want)


@pytest.mark.parametrize("kw", [dict(strategy="static"), dict(strategy="speculative", mrp_steps=3),
                                dict(strategy="dynamic", threshold=0.3, do_sample=True, seed=[1, 2, 3])],
                         ids=["static", "speculative", "dynamic sampled"])
def test_penalties_per_prompt_decode_each_prompt_as_alone(model, kw):
    """presence_penalty and frequency_penalty given one a prompt (None or 0: none) decode each prompt of a left-padded
    batch as it decodes alone with its own values (read per row on the device: captured steps give the same), and one
    step key serves every list."""
    rows = [random_prompts(1, n, seed=20 + n)[0] for n in (3, 7, 5)]
    ids, mask = padded_batch(rows, "left")
    presence, frequency = [0.0, 1.5, None], [0.8, None, -0.5]
    for graphs in (False, True):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], presence_penalty=presence,
                             frequency_penalty=frequency, cuda_graphs=graphs, **kw)[:, ids.shape[1]:]
        for i, row in enumerate(rows):
            own = dict(kw, seed=[kw["seed"][i]]) if "seed" in kw else kw
            alone = model.generate(row[None], max_new_tokens=12, eos_token_id=[], presence_penalty=presence[i],
                                   frequency_penalty=frequency[i], **own)[0, len(row):]
            assert torch.equal(out[i], alone), (graphs, i)
    keys = {GenerationSettings.resolve(model, None, dict(kw, presence_penalty=p, max_new_tokens=12), 7, 3).step_key()
            for p in ([0.0, 1.5, None], [2.0, -1.0, 0.5])}
    assert len(keys) == 1


@pytest.mark.parametrize("value,match", [([1.0, 2.0], "2 values for 3 prompts"),
                                         ([1.0, float("nan"), 0.0], "must hold finite numbers")])
def test_bad_penalty_lists_are_refused(model, value, match):
    with pytest.raises(ValueError, match=match):
        model.generate(random_prompts(3, 4, seed=1), max_new_tokens=4, frequency_penalty=value)
