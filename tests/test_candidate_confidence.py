"""A draft's pick among listed tokens (``mrp_triton.candidate_confidence``): the kernel (interpreter on CPU, real
kernel on CUDA) vs the reference, and the reference vs its definition.

Exactness: hidden states and weights are small integers, so every listed logit is an exact integer whatever the
summation order, ties are frequent and the token must match exactly.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_utils import DEV, DTYPES, LAUNCHER_RAN, forbid_triton_launcher, poisoned_allocations
from mrp_triton import candidate_confidence
from mrp_triton.candidate_confidence import candidate_confidence_triton
from mrp_triton.reference import candidate_confidence as candidate_confidence_reference
from mrp_triton.reference.confidence import confidence as confidence_reference


def _ints(shape, lo, hi, dtype, g):
    return torch.randint(lo, hi + 1, shape, generator=g).to(DEV, dtype)


def _inputs(N, H, V, M, dtype, g, listed=0.8):
    hidden, seed_hidden = _ints((N, H), -2, 2, dtype, g), _ints((N, H), -2, 2, dtype, g)
    weight = _ints((V, H), -2, 2, dtype, g)
    ids = torch.randint(0, V, (N, M), generator=g)
    ids = ids.masked_fill(torch.rand(N, M, generator=g) > listed, -1).to(DEV)  # some positions list fewer tokens
    rest = (torch.randn(N, generator=g) * 3).to(DEV)
    rest[torch.rand(N, generator=g) < 0.2] = float("-inf")  # nothing outside the list
    return hidden, weight, ids, rest, seed_hidden, weight.float().mean(0)


def _drawn_penalty(penalty, offsets: bool, N: int, V: int, g: torch.Generator) -> dict:
    """No repetition penalty (``penalty`` None), or one (a number, or 1.5 as a 0-d float64 tensor) with 3 rows of
    seen tokens (a third of the vocabulary each) that the N rows read; with ``offsets``, 3 rows of logit offsets
    read at the same rows and a logit bias."""
    kw = {}
    if offsets:
        kw["logit_bias"] = torch.randn(V, generator=g).to(DEV)
    if penalty is not None:
        kw.update(repetition_penalty=torch.tensor(1.5, dtype=torch.float64, device=DEV) if penalty == "tensor" else
                  penalty, seen_tokens=(torch.rand(3, V, generator=g) < 0.3).to(DEV))
    if offsets:
        kw["logit_offsets"] = (torch.randn(3, V, generator=g) * 2).to(DEV)
    if kw:
        kw["seen_rows"] = torch.randint(0, 3, (N,), generator=g).to(DEV)
    return kw


@settings(max_examples=25)
@given(N=st.integers(1, 12), H=st.integers(1, 70), V=st.integers(1, 90), M=st.integers(1, 64),
       dtype=st.sampled_from(DTYPES), temperature=st.sampled_from((1.0, 0.5, 2.0, "tensor", "rows")),
       skip=st.booleans(), block_h=st.sampled_from((None, 16)), penalty=st.sampled_from((None, 0.5, 2.0, "tensor")),
       offsets=st.booleans(), seed=st.integers(0, 2**16))
def test_greedy_kernel_matches_reference(N, H, V, M, dtype, temperature, skip, block_h, penalty, offsets, seed):
    """The greedy pick against the reference (a temperature and a repetition penalty given as numbers or as the 0-d
    float64 tensors the decode engine passes, the temperature also one a row; the penalty at the listed tokens each
    row has seen, rows reading shared rows of the seen table; logit offsets at the listed tokens, alone or beside the
    penalty)."""
    g = torch.Generator().manual_seed(seed)
    hidden, weight, ids, rest, seed_hidden, mean = _inputs(N, H, V, M, dtype, g)
    if temperature == "tensor":  # read on the device, as captured decoding steps pass it
        temperature = torch.tensor(0.8, dtype=torch.float64, device=DEV)
    elif temperature == "rows":
        temperature = (torch.rand(N, generator=g, dtype=torch.float64) * 2 + 0.2).to(DEV)
    skip_rows = (torch.rand(N, generator=g) < 0.3).to(DEV) if skip else None
    kw = dict(seed_hidden=seed_hidden, vocab_mean=mean, temperature=temperature, skip_rows=skip_rows,
              **_drawn_penalty(penalty, offsets, N, V, g))
    with poisoned_allocations():
        tok, prob = candidate_confidence_triton(hidden, weight, ids, rest, block_h=block_h, **kw)
    want_tok, want_prob = candidate_confidence_reference(hidden, weight, ids, rest, **kw)
    assert torch.equal(tok, want_tok), (tok, want_tok)
    # the shift's dot product over H is summed in another order: the normaliser agrees to fp32 rounding
    torch.testing.assert_close(prob, want_prob, rtol=2e-5, atol=1e-6)
    if skip_rows is not None:
        assert (tok[skip_rows] == -1).all() and (prob[skip_rows] == 0).all()
    nothing = (ids < 0).all(-1)
    assert (tok[nothing] == -1).all() and (prob[nothing] == 0).all()


@settings(max_examples=15)
@given(N=st.integers(1, 8), H=st.integers(1, 40), V=st.integers(2, 60), M=st.integers(1, 20),
       filters=st.sampled_from(({}, dict(top_k=2), dict(top_p=0.7), dict(top_k=3, top_p=0.9), dict(min_p=0.2),
                                dict(top_k=4, top_p=0.8, min_p=0.05), dict(epsilon_cutoff=0.05),
                                dict(top_p=0.9, eta_cutoff=0.02),
                                dict(min_p=0.01, epsilon_cutoff=0.02, eta_cutoff=0.1), dict(top_h=0.5),
                                dict(top_h=0.8, top_k=5), dict(typical_p=0.5), dict(min_p=0.05, typical_p=0.3,
                                                                                    epsilon_cutoff=0.05))),
       per_row=st.booleans(), seed=st.integers(0, 2**16))
def test_sampled_kernel_matches_reference(N, H, V, M, filters, per_row, seed):
    """The sampled pick against the reference under each filter, at one temperature (and top-p, top-k) or one a row
    (then some rows sampling, the others picking greedily)."""
    g = torch.Generator().manual_seed(seed)
    hidden, weight, ids, rest, seed_hidden, mean = _inputs(N, H, V, M, torch.float32, g)
    keys = torch.randint(0, 2**40, (N, 3), generator=g).to(DEV)
    temperature = (torch.rand(N, generator=g, dtype=torch.float64) * 2 + 0.2).to(DEV) if per_row else 0.7
    if per_row and "top_p" in filters:
        filters = dict(filters, top_p=(torch.rand(N, generator=g, dtype=torch.float64) * 0.9 + 0.1).to(DEV))
    if per_row and "top_k" in filters:  # one a row, some at "no cut" (more than M)
        filters = dict(filters, top_k=torch.randint(1, M + 3, (N,), generator=g).double().to(DEV))
    do_sample = (torch.rand(N, generator=g) < 0.5).to(DEV) if per_row else True
    kw = dict(seed_hidden=seed_hidden, vocab_mean=mean, temperature=temperature, do_sample=do_sample, seed=seed,
              noise_keys=keys, **filters)
    with poisoned_allocations():
        tok, prob = candidate_confidence_triton(hidden, weight, ids, rest, **kw)
    want_tok, want_prob = candidate_confidence_reference(hidden, weight, ids, rest, **kw)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(prob, want_prob, rtol=2e-5, atol=1e-6)


@settings(max_examples=30)
@given(V=st.integers(3, 50), H=st.integers(1, 8), do_sample=st.sampled_from((False, True, "some rows")),
       temperature=st.sampled_from((1.0, 0.7)),
       filters=st.sampled_from(({}, dict(min_p=0.3), dict(min_p=1.0), dict(epsilon_cutoff=0.1),
                                dict(eta_cutoff=0.05), dict(min_p=0.1, epsilon_cutoff=0.05, eta_cutoff=0.5),
                                dict(top_h=0.4), dict(typical_p=0.4), dict(typical_p=0.6, eta_cutoff=0.1))),
       penalty=st.sampled_from((None, 0.5, 2.0)), seed=st.integers(0, 999))
def test_every_token_listed_is_the_full_vocabulary_pick(V, H, do_sample, temperature, filters, penalty, seed):
    """With every token listed and nothing outside (rest -inf), the pick is the confidence op's on the whole logits:
    the same token (the same Gumbel noise per token id when sampling, among the same tokens min-p, typical, epsilon,
    eta and top-h keep, under the same repetition penalty; greedy where only some rows sample) and full-softmax
    probability."""
    g = torch.Generator().manual_seed(seed)
    N = 6
    if do_sample == "some rows":
        do_sample = torch.tensor([True, False, False, True, True, False])
    weight = torch.randint(-3, 4, (V, H), generator=g).double()  # integer logits: exact ties
    hidden = torch.randint(-2, 3, (N, H), generator=g).double()
    skip = torch.rand(N, generator=g) < 0.3
    mask = int(torch.randint(0, V, (1,), generator=g))
    ids = torch.tensor([v for v in range(V) if v != mask]).expand(N, V - 1)
    keys = torch.randint(0, 2**40, (N, 3), generator=g)
    seen = {} if penalty is None else dict(repetition_penalty=penalty, seen_tokens=torch.rand(2, V, generator=g) < 0.4,
                                           seen_rows=torch.randint(0, 2, (N,), generator=g))
    tok, prob = candidate_confidence(hidden, weight, ids, torch.full((N,), float("-inf")), seed_hidden=hidden,
                                     vocab_mean=weight.mean(0), temperature=temperature, skip_rows=skip,
                                     do_sample=do_sample, seed=seed,
                                     noise_keys=keys if do_sample is not False else None,
                                     **filters, **seen)
    want_tok, want_prob, _ = confidence_reference(hidden @ weight.T, temperature=temperature, mask_token_id=mask,
                                                  do_sample=do_sample, seed=seed, noise_keys=keys, skip_rows=skip,
                                                  **filters, **seen)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(prob, want_prob, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("op", [candidate_confidence, candidate_confidence_triton])
def test_the_normaliser_ignores_a_constant_added_to_every_logit(op):
    """A hidden-state change that adds the same amount to every logit (along a column of the lm_head that is
    constant) changes no softmax probability: the estimate of the mass outside the list moves with it. And at the
    seed's own hidden state the estimate is exact: the full-softmax probability of the token."""
    g = torch.Generator().manual_seed(0)
    V, H, N = 30, 6, 4
    weight = torch.randn(V, H, generator=g).to(DEV)
    weight[:, 0] = 1.0
    seed_hidden = torch.randn(N, H, generator=g).to(DEV)
    z = seed_hidden @ weight.T
    top, ids = z.topk(5, dim=-1)
    inside = torch.logsumexp(top, -1)
    lse = torch.logsumexp(z, -1)
    rest = lse + torch.log(-torch.expm1(inside - lse))
    moved = seed_hidden.clone()
    moved[:, 0] += 7.0
    kw = dict(seed_hidden=seed_hidden, vocab_mean=weight.mean(0))
    same, shifted = op(seed_hidden, weight, ids, rest, **kw), op(moved, weight, ids, rest, **kw)
    assert torch.equal(same[0], shifted[0]) and torch.equal(same[0], ids[:, 0])
    torch.testing.assert_close(same[1], shifted[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(same[1], torch.softmax(z, -1).max(-1).values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("op", [candidate_confidence, candidate_confidence_triton])
def test_nan_is_never_picked_and_inf_is_the_largest_float(op, do_sample):
    """Listed logits follow ``confidence``'s rule: NaN counts as -inf, +inf as the largest fp32; a row that lists only
    NaN picks nothing (-1, prob 0)."""
    weight = torch.tensor([[1.0, 0.0], [float("nan"), 0.0], [float("inf"), 0.0], [5.0, 0.0]], device=DEV)
    hidden = torch.tensor([[1.0, 0.0]] * 3, device=DEV)
    ids = torch.tensor([[1, 3, 0], [1, 2, 3], [1, -1, -1]], device=DEV)
    rest = torch.full((3,), float("-inf"), device=DEV)
    keys = torch.arange(9, device=DEV).view(3, 3) if do_sample else None
    tok, prob = op(hidden, weight, ids, rest, seed_hidden=hidden, vocab_mean=torch.zeros(2, device=DEV),
                   do_sample=do_sample, noise_keys=keys)
    assert tok.tolist()[1:] == [2, -1] and prob[1:].tolist() == [1.0, 0.0]
    assert tok[0] in (3, 0) and (tok[0] == 3 or do_sample)
    assert not prob.isnan().any()


@pytest.mark.parametrize("operand", ["hidden", "seed_hidden", "weight", "ids", "rest", "vocab_mean", "skip_rows"])
def test_strided_operands_match_reference(operand):
    """Each operand as a view the kernel cannot read with its unit strides (a transposed copy's view, every other
    element of a longer vector): the launcher copies it first, and the picks are the reference's."""
    g = torch.Generator().manual_seed(8)
    hidden, weight, ids, rest, seed_hidden, mean = _inputs(5, 24, 40, 8, torch.float32, g)
    args = dict(hidden=hidden, weight=weight, ids=ids, rest=rest, seed_hidden=seed_hidden, vocab_mean=mean,
                skip_rows=torch.tensor([False, True, False, False, True], device=DEV))
    x = args[operand]
    args[operand] = x.T.contiguous().T if x.dim() == 2 else x.repeat_interleave(2)[::2]
    assert args[operand].stride(-1) != 1
    positional = [args.pop(name) for name in ("hidden", "weight", "ids", "rest")]
    tok, prob = candidate_confidence_triton(*positional, temperature=0.7, **args)
    want_tok, want_prob = candidate_confidence_reference(*positional, temperature=0.7, **args)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(prob, want_prob, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("op", [candidate_confidence, candidate_confidence_triton])
def test_sampling_with_top_k_1_picks_the_greedy_token(op):
    """top-k cuts the listed logits z, not z plus the noise: with top_k = 1 only each row's best listed token is
    left, so a sampled pick is the greedy one whatever the noise (which does change picks without the cut)."""
    g = torch.Generator().manual_seed(9)
    N, H, V, M = 16, 8, 60, 12
    hidden, weight = torch.randn(N, H, generator=g).to(DEV), torch.randn(V, H, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(V, generator=g)[:M] for _ in range(N)]).to(DEV)
    kw = dict(seed_hidden=hidden, vocab_mean=weight.mean(0), temperature=2.0)
    sample = dict(do_sample=True, seed=3, noise_keys=torch.randint(0, 2**40, (N, 3), generator=g).to(DEV))
    rest = torch.zeros(N, device=DEV)
    greedy = op(hidden, weight, ids, rest, **kw)
    assert not torch.equal(op(hidden, weight, ids, rest, **kw, **sample)[0], greedy[0])
    tok, prob = op(hidden, weight, ids, rest, **kw, **sample, top_k=1)
    assert torch.equal(tok, greedy[0])
    torch.testing.assert_close(prob, greedy[1], rtol=2e-5, atol=1e-6)


def test_a_temperature_tensor_scores_bit_for_bit_as_the_float_does():
    """The kernel reads a temperature tensor and takes 1 / t in float64, rounded to fp32 once, as the float path
    does on the host: at t = 0.503, where fp32(1 / fp32(t)) is one ulp off, the probabilities are identical (a
    logit of 128, a power of 2 that keeps that ulp in z, against a rest of about the same size makes them
    sensitive to it) and the definition's up to fp32 rounding."""
    t = 0.503
    inv = torch.tensor(1.0 / t, dtype=torch.float32)
    assert 1.0 / torch.tensor(t, dtype=torch.float32) != inv
    hidden, weight = torch.tensor([[128.0]], device=DEV), torch.tensor([[1.0], [0.0]], device=DEV)
    ids, rest = torch.tensor([[0, 1]], device=DEV), torch.tensor([255.0], device=DEV)
    kw = dict(seed_hidden=hidden, vocab_mean=torch.zeros(1, device=DEV))
    tok, prob = candidate_confidence_triton(hidden, weight, ids, rest, temperature=t, **kw)
    tok_t, prob_t = candidate_confidence_triton(hidden, weight, ids, rest, **kw,
                                                temperature=torch.tensor(t, dtype=torch.float64, device=DEV))
    assert tok.tolist() == tok_t.tolist() == [0] and torch.equal(prob, prob_t)
    z = torch.tensor([128 * inv.double(), 0.0], dtype=torch.float64)
    expect = torch.exp(z[0] - torch.logaddexp(torch.logsumexp(z, 0), torch.tensor(255.0, dtype=torch.float64)))
    torch.testing.assert_close(prob.cpu(), expect.float()[None], rtol=1e-4, atol=0)


@pytest.mark.triton
def test_float64_runs_the_reference_in_float64(monkeypatch):
    """float64 operands go to the reference even where the backend is Triton, and are scored in float64 with
    1 / temperature rounded to fp32: raw logits 100 and 100 + 1e-7 (equal in fp32, where the first listed would
    win) pick the second, with prob = exp(z - lse) for z = logit * fp32(1 / 0.7). float32 reaches the kernel."""
    forbid_triton_launcher(monkeypatch, "candidate_confidence")
    hidden = torch.tensor([[100.0, 100.0]], dtype=torch.float64)
    weight = torch.tensor([[1.0, 0.0], [1.0, 1e-9], [0.5, 0.0]], dtype=torch.float64)
    ids = torch.tensor([[0, 1, 2]])
    z = hidden @ weight.T * float(torch.tensor(1 / 0.7, dtype=torch.float32))
    rest = z[:, 1].clone()  # the listed tokens hold about 2/3 of the mass: prob about 1/3
    kw = dict(seed_hidden=hidden, vocab_mean=torch.zeros(2, dtype=torch.float64), temperature=0.7)
    tok, prob = candidate_confidence(hidden, weight, ids, rest, **kw)
    assert tok.tolist() == [1]
    expect = torch.exp(z[:, 1] - torch.logaddexp(torch.logsumexp(z, -1), rest))
    torch.testing.assert_close(prob, expect.float(), rtol=2e-7, atol=0)
    with pytest.raises(AssertionError, match=LAUNCHER_RAN):
        candidate_confidence(hidden.float(), weight.float(), ids, rest.float(), **dict(
            kw, seed_hidden=hidden.float(), vocab_mean=torch.zeros(2)))


def test_errors():
    h, w, ids, rest = torch.randn(2, 8), torch.randn(10, 8), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2)
    kw = dict(seed_hidden=h, vocab_mean=w.mean(0))
    for op in (candidate_confidence, candidate_confidence_triton):
        with pytest.raises(ValueError, match="weight must be a floating-point tensor \\[V, H=8\\]"):
            op(h, w[:, :7], ids, rest, **kw)
        with pytest.raises(ValueError, match="ids must be an int64 tensor \\[N=2, M\\] with 1 <= M <= 64"):
            op(h, w, ids.int(), rest, **kw)
        with pytest.raises(ValueError, match="ids must be"):
            op(h, w, torch.zeros(2, 65, dtype=torch.long), rest, **kw)
        with pytest.raises(ValueError, match="rest must be a floating-point tensor \\[2\\]"):
            op(h, w, ids, rest[:1], **kw)
        with pytest.raises(ValueError, match="vocab_mean must be"):
            op(h, w, ids, rest, seed_hidden=h, vocab_mean=torch.zeros(7))
        with pytest.raises(ValueError, match="sampling \\(do_sample\\) needs noise_keys"):
            op(h, w, ids, rest, do_sample=True, **kw)
        with pytest.raises(ValueError, match="do_sample must be a bool tensor of shape \\[2\\]"):
            op(h, w, ids, rest, do_sample=torch.ones(2, dtype=torch.int64), **kw)
        with pytest.raises(ValueError, match="temperature"):
            op(h, w, ids, rest, temperature=0.0, **kw)
        with pytest.raises(ValueError, match="skip_rows must be a bool tensor of shape \\[2\\]"):
            op(h, w, ids, rest, skip_rows=torch.zeros(3, dtype=torch.bool), **kw)
        with pytest.raises(ValueError, match="hidden must be a floating-point tensor \\[N, H\\]"):
            op(h.long(), w, ids, rest, **kw)
        with pytest.raises(ValueError, match="hidden must be a floating-point tensor \\[N, H\\]"):
            op(h[0], w, ids, rest, **kw)
        with pytest.raises(ValueError, match="weight must be a floating-point tensor"):
            op(h, w.long(), ids, rest, **kw)
        with pytest.raises(ValueError, match="ids must be an int64 tensor \\[N=2, M\\] with 1 <= M"):
            op(h, w, ids[:1], rest, **kw)
        with pytest.raises(ValueError, match="ids must be an int64 tensor \\[N=2, M\\] with 1 <= M"):
            op(h, w, ids[:, :0], rest, **kw)
        with pytest.raises(ValueError, match="rest must be a floating-point tensor \\[2\\]"):
            op(h, w, ids, rest.long(), **kw)
        with pytest.raises(ValueError, match="seed_hidden must be a floating-point tensor \\[2, 8\\]"):
            op(h, w, ids, rest, seed_hidden=h[:, :7], vocab_mean=w.mean(0))
        with pytest.raises(ValueError, match="rest is on meta"):
            op(h, w, ids, rest.to("meta"), **kw)
    tok, prob = candidate_confidence_triton(h[:0], w, ids[:0], rest[:0], seed_hidden=h[:0], vocab_mean=w.mean(0))
    assert tok.shape == prob.shape == (0,)


def test_a_temperature_tensor_steers_sampled_picks_as_the_float_does():
    """Captured decoding steps pass the temperature as a 0-d tensor on the device: sampled picks read it too."""
    g = torch.Generator().manual_seed(7)
    hidden, weight, ids, rest, seed_hidden, mean = _inputs(5, 12, 40, 8, torch.float32, g)
    kw = dict(seed_hidden=seed_hidden, vocab_mean=mean, do_sample=True, seed=3,
              noise_keys=torch.randint(0, 2**40, (5, 3), generator=g).to(DEV))
    tok, prob = candidate_confidence_triton(hidden, weight, ids, rest,
                                            temperature=torch.tensor(0.4, dtype=torch.float64, device=DEV), **kw)
    want_tok, want_prob = candidate_confidence_reference(hidden, weight, ids, rest, temperature=0.4, **kw)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(prob, want_prob, rtol=2e-5, atol=1e-6)
