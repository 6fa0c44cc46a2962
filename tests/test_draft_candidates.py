"""Per-position draft candidates of speculative decoding (``draft_candidates``, hf_integration.draft_candidates)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mrp_triton
from hf_integration.draft_candidates import refresh_vocab_mean, rest_mass
from tiny_models import random_prompts, spy_on_drafts, tiny_model

MASK = 32  # a tiny vocabulary of 33, so that every token fits in a list of at most 64


def small_vocab_model(seed: int):
    return tiny_model(seed=seed, block_size=8, vocab_size=MASK + 1, mask_token_id=MASK)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 3), k=st.integers(1, 4), max_new=st.integers(1, 20),
       m=st.sampled_from((1, 3, 16, 64)), do_sample=st.booleans(),
       filters=st.sampled_from(({}, dict(top_k=3), dict(top_p=0.8), dict(top_k=5, top_p=0.9), dict(min_p=0.1),
                                dict(top_k=6, top_p=0.95, min_p=0.02), dict(epsilon_cutoff=0.05),
                                dict(top_p=0.9, eta_cutoff=0.1), dict(top_h=0.6), dict(typical_p=0.5))),
       schedule=st.sampled_from(("mrp", "authors")), mix=st.sampled_from(("logits_sum", "none")))
def test_speculative_with_draft_candidates_equals_static(seed, batch, k, max_new, m, do_sample, filters, schedule,
                                                         mix):
    """Lossless whatever the candidates: greedy and sampled (draft and target share the noise; top-k / top-p /
    min-p / epsilon / eta / top-h are applied among the listed tokens by the drafts and exactly by the verification)."""
    model = tiny_model(seed=seed % 5, block_size=8)
    prompts = random_prompts(batch, 6, seed=seed)
    sampling = dict(temperature=1.2, **filters) if do_sample else {}
    kwargs = dict(max_new_tokens=max_new, do_sample=do_sample, seed=seed, **sampling)
    static = model.generate(prompts, **kwargs)
    spec = model.generate(prompts, strategy="speculative", mrp_steps=k, draft_candidates=m, draft_schedule=schedule,
                          mrp_mix=mix, **kwargs)
    assert torch.equal(spec, static)


@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize("schedule", ["mrp", "authors"])
def test_listing_every_token_drafts_what_the_whole_vocabulary_drafts(monkeypatch, cuda_graphs, schedule):
    """With every token listed, nothing is left outside the list (rest mass -inf up to rounding), so the drafts and
    their acceptance are those of drafting from the whole vocabulary (also through the replayed steps)."""
    model = small_vocab_model(seed=2)
    prompts = torch.randint(0, MASK, (3, 5), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=24, strategy="speculative", mrp_steps=3, draft_schedule=schedule,
                  return_dict_in_generate=True, cuda_graphs=cuda_graphs)
    drafts = spy_on_drafts(monkeypatch)
    whole = model.generate(prompts, **kwargs)
    whole_drafts, drafts[:] = list(drafts), []
    listed = model.generate(prompts, draft_candidates=MASK, **kwargs)
    assert torch.equal(listed.sequences, whole.sequences)
    assert all(torch.equal(a, b) for a, b in zip(drafts, whole_drafts)) and len(drafts) == len(whole_drafts)
    assert torch.equal(listed.stats.accepted_lengths, whole.stats.accepted_lengths)
    assert whole.stats.accepted_lengths[:, 1:].sum() > 0


def test_a_sampled_list_leaves_out_the_mask_token(monkeypatch):
    """Sampling, the seed forward lists each position's candidates from the logits it builds: never the mask token
    (no draft may pick it), so a list as long as the vocabulary without it holds every other token."""
    model = small_vocab_model(seed=2)
    prompts = torch.randint(0, MASK, (2, 5), generator=torch.Generator().manual_seed(7))
    listed = []
    pick = mrp_triton.candidate_confidence
    monkeypatch.setattr(mrp_triton, "candidate_confidence",
                        lambda *a, **k: (listed.append(a[2].clone()), pick(*a, **k))[1])  # a[2]: the ids [N, M]
    model.generate(prompts, max_new_tokens=16, strategy="speculative", mrp_steps=2, draft_candidates=MASK,
                   do_sample=True, seed=3)
    rows = torch.cat(listed)
    rows = rows[(rows >= 0).all(-1)]  # the positions the seed forward scored
    assert rows.shape[0] > 0
    assert torch.equal(rows.sort(-1).values, torch.arange(MASK).expand_as(rows))


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_lists_rest_is_the_mass_its_seed_forward_leaves_outside_it(monkeypatch, do_sample):
    """What the drafts get as a position's rest (the log of the unnormalised softmax mass outside its list: the
    log-sum-exp of the logits left out) is that of the seed forward's logits at the call's temperature (sampling:
    the listed logits and the log-normaliser on one scale), the mask token left out."""
    model = small_vocab_model(seed=2)
    prompts = torch.randint(0, MASK, (2, 5), generator=torch.Generator().manual_seed(7))
    seen = []
    pick = mrp_triton.candidate_confidence
    monkeypatch.setattr(mrp_triton, "candidate_confidence",
                        lambda *a, **k: (seen.append((a[2].clone(), a[3].clone(), k["seed_hidden"].clone())),
                                         pick(*a, **k))[1])  # a[2], a[3]: the ids [N, M] and rest [N]
    temperature = 1.7 if do_sample else 1.0
    model.generate(prompts, max_new_tokens=16, strategy="speculative", mrp_steps=2, draft_candidates=3,
                   do_sample=do_sample, temperature=temperature, seed=3)
    ids, rest, seed_h = (torch.cat(x) for x in zip(*seen))
    scored = (ids >= 0).all(-1)
    assert scored.sum() > 4
    z = (seed_h[scored] @ model.lm_head.weight.T) / temperature
    z[:, MASK] = float("-inf")
    outside = z.scatter(-1, ids[scored], float("-inf")).logsumexp(-1)
    torch.testing.assert_close(rest[scored].double(), outside, rtol=1e-5, atol=1e-5)  # rest: float32
    assert ((outside - z.logsumexp(-1)).exp() > 1e-3).any()  # lists that leave a share out


def test_each_round_drafts_among_its_seed_forwards_list(monkeypatch):
    """With one candidate, a round's drafts choose among (list) exactly the tokens the forward that seeded it picked:
    a block's opening forward, or the verify forward's slice of the accepted candidate state (greedy: its picks
    are its top-1 tokens; -1 at the positions it did not score)."""
    K, T = 2, 8
    model = tiny_model(seed=1, block_size=T)
    prompts = random_prompts(1, 5, seed=3)
    events = []
    forward, verify, pick = mrp_triton.lm_head_confidence, mrp_triton.verify_drafts, mrp_triton.candidate_confidence

    def spy_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs.get("top_m"):
            events.append(("forward", out[0].clone().view(1, -1, T)))
        return out

    def spy_verify(*args, **kwargs):
        accepted, bonus = verify(*args, **kwargs)
        events.append(("verify", accepted.clone().long()))
        return accepted, bonus

    def spy_pick(hidden, weight, ids, *args, **kwargs):
        events.append(("draft", ids[:, 0].clone().view(1, T)))  # the seed's lists are carried over in place: copy
        return pick(hidden, weight, ids, *args, **kwargs)

    monkeypatch.setattr(mrp_triton, "lm_head_confidence", spy_forward)
    monkeypatch.setattr(mrp_triton, "verify_drafts", spy_verify)
    monkeypatch.setattr(mrp_triton, "candidate_confidence", spy_pick)
    out = model.generate(prompts, max_new_tokens=24, strategy="speculative", mrp_steps=K, draft_candidates=1,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(prompts, max_new_tokens=24))
    seed, drafts = None, 0
    for i, (kind, value) in enumerate(events):
        if kind == "draft":
            assert torch.equal(value, seed)
            drafts += 1
        elif kind == "verify":
            seed = events[i - 1][1][0, value]  # the accepted copy's picks [1, T]
        elif i + 1 == len(events) or events[i + 1][0] != "verify":
            seed = value[0]  # an opening forward: one copy
    assert drafts >= 3 and out.stats.accepted_lengths[:, 1:].sum() > 0


@settings(max_examples=30, deadline=None)
@given(N=st.integers(1, 6), V=st.integers(2, 40), m=st.integers(1, 40), seed=st.integers(0, 999))
def test_rest_mass_is_the_softmax_mass_outside_the_list(N, V, m, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, V, generator=g, dtype=torch.float64) * 3
    m = min(m, V)
    top, ids = z.topk(m, dim=-1)
    outside = z.scatter(1, ids, float("-inf"))
    want = torch.logsumexp(outside, -1)
    got = rest_mass(top, torch.logsumexp(z, -1))
    if m == V:  # nothing outside: -inf, or a remainder at the rounding level of the normaliser
        assert (got - torch.logsumexp(z, -1) < -30).all()
    else:
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * V)
    unscored = rest_mass(torch.full((2, m), float("-inf")), torch.full((2,), float("-inf")))
    assert torch.isneginf(unscored).all()


def test_the_vocab_mean_buffer_is_refreshed_in_place():
    weight = torch.randn(9, 4)
    buffer = refresh_vocab_mean(weight, None)
    assert buffer.dtype == torch.float32 and refresh_vocab_mean(weight.double(), None).dtype == torch.float64
    weight[3] += 9.0
    again = refresh_vocab_mean(weight, buffer)
    assert again.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(again, weight.mean(0))


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(draft_candidates=0), ValueError, "draft_candidates=0 must be >= 1"),
    (dict(draft_candidates=65), ValueError, "draft_candidates=65 must be at most 64"),
    (dict(draft_candidates=True), TypeError, "draft_candidates must be an int"),
    (dict(draft_candidates=2.0), TypeError, "draft_candidates must be an int"),
    (dict(draft_candidates=4, draft_vocab=20), ValueError, "give one of them"),
    (dict(draft_candidates=4, strategy="static"), ValueError, "draft_candidates=4 steers strategy 'speculative', not"),
])
def test_bad_draft_candidates_are_refused_with_their_name(kwargs, error, message):
    model = tiny_model(seed=0)
    with pytest.raises(error, match=message):
        model.generate(random_prompts(1, 4), **{"strategy": "speculative", **kwargs})
    with pytest.raises(ValueError, match=f"must be at most {MASK}"):
        small_vocab_model(seed=0).generate(torch.zeros(1, 4, dtype=torch.long), strategy="speculative",
                                           draft_candidates=MASK + 1)


def test_a_checkpoint_may_set_draft_candidates_for_its_speculative_calls(monkeypatch):
    """A generation config carrying draft_candidates: its speculative calls draft among the candidates (the op
    runs), its static calls are not refused and never list them; a call's own None does not ask for anything."""
    model = tiny_model(seed=3, block_size=8)
    model.generation_config.draft_candidates = 4
    prompts = random_prompts(1, 5, seed=1)
    calls = []
    pick = mrp_triton.candidate_confidence
    monkeypatch.setattr(mrp_triton, "candidate_confidence",
                        lambda *a, **k: (calls.append(a[2].shape), pick(*a, **k))[1])  # a[2]: the ids [N, M]
    static = model.generate(prompts, max_new_tokens=12, draft_candidates=None)
    assert not calls
    assert torch.equal(model.generate(prompts, max_new_tokens=12, strategy="speculative"), static)
    assert calls and all(shape[1] == 4 for shape in calls)


def test_a_calls_draft_choice_overrides_the_checkpoints_other_one(monkeypatch):
    """draft_vocab and draft_candidates exclude each other: a call asking for one sets the checkpoint's other aside
    (a checkpoint carrying a draft vocabulary, as mrp-train draft-vocab --into-generation-config writes it, used to
    refuse every call asking for draft_candidates); both set by the checkpoint alone is refused."""
    model = tiny_model(seed=3, block_size=8)
    prompts = random_prompts(1, 5, seed=1)
    calls = []
    pick = mrp_triton.candidate_confidence
    monkeypatch.setattr(mrp_triton, "candidate_confidence",
                        lambda *a, **k: (calls.append(a[2].shape), pick(*a, **k))[1])
    kw = dict(max_new_tokens=12, strategy="speculative")
    static = model.generate(prompts, max_new_tokens=12)
    model.generation_config.draft_vocab = list(range(MASK))
    assert torch.equal(model.generate(prompts, draft_candidates=4, **kw), static)
    assert calls and all(shape[1] == 4 for shape in calls)
    model.generation_config.draft_vocab, model.generation_config.draft_candidates = None, 4
    calls.clear()
    assert torch.equal(model.generate(prompts, draft_vocab=MASK, **kw), static) and not calls
    model.generation_config.draft_vocab = MASK
    with pytest.raises(ValueError, match="give one of them"):
        model.generate(prompts, **kw)
