"""confidence: Triton kernel (interpreter on CPU, real kernel on CUDA) vs the torch reference."""

from __future__ import annotations

import importlib
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mrp_triton as mt
from mrp_triton.confidence import confidence_triton
from mrp_triton.reference.confidence import effective_logits, gumbel_uniform, kept_by_cut, seed_hash, sampling_cut
from mrp_triton.reference.confidence import confidence as confidence_ref

from kernel_utils import DEV, DTYPES

warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy inf - inf inside the interpreter


def _poisoned(N, entropy=False):
    """Outputs for ``out=``, filled with values no result has (tokens, probs, lse, and with ``entropy`` the entropy)."""
    return (torch.full((N,), -7777, dtype=torch.int64, device=DEV),
            *(torch.full((N,), float("nan"), dtype=torch.float32, device=DEV) for _ in range(3 if entropy else 2)))


def _check(got, exp):
    assert len(got) == len(exp)
    tok, prob, lse = got[:3]
    etok, eprob, else_ = exp[:3]
    assert torch.equal(tok.cpu(), etok.cpu()), (tok, etok)
    torch.testing.assert_close(prob.cpu(), eprob.cpu(), atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(lse.cpu(), else_.cpu(), atol=2e-5, rtol=2e-5)
    if len(got) == 4:  # the entropy
        torch.testing.assert_close(got[3].cpu(), exp[3].cpu(), atol=1e-4, rtol=1e-4)


def _drawn_ban(draw, g: torch.Generator, N: int, V: int):
    """(banned_tokens [V] or None, ban_rows [N] or None): none; some tokens (a fraction of them, or all) as bools, in
    every row or in drawn rows; or three classes of ban as uint8 bits, in every row or drawn classes in each row."""
    p_ban = draw(st.sampled_from([None, 0.05, 0.3, 1.0]))
    if p_ban is None:
        return None, None
    every_row = draw(st.booleans())
    if draw(st.booleans()):
        return torch.rand(V, generator=g) < p_ban, None if every_row else torch.rand(N, generator=g) < 0.5
    classes = sum((torch.rand(V, generator=g) < p_ban).to(torch.uint8) << bit for bit in range(3))
    return classes, None if every_row else torch.randint(0, 8, (N,), generator=g).to(torch.uint8)


def _drawn_penalty(draw, g: torch.Generator, N: int, V: int) -> dict:
    """No repetition penalty, or one (below or above 1) with the tokens seen: a fraction of the vocabulary (or all of
    it) in each of C rows that the N rows read by seen_rows, or in N rows (seen_rows None); and no logit offsets, or
    C (or N) rows of them (normal, a few at -100 or +100), alone or beside the penalty; and no logit bias, or one
    (normal, a few at -inf, as a ban by bias sets them)."""
    penalty = draw(st.sampled_from([None, 0.5, 1.3, 3.0]))
    offsets = draw(st.booleans())
    kw = {}
    if draw(st.booleans()):
        bias = torch.randn(V, generator=g)
        kw["logit_bias"] = bias.masked_fill(torch.rand(V, generator=g) < 0.05, float("-inf"))
    if penalty is None and not offsets:
        return kw
    C = draw(st.sampled_from([None, 1, 3]))
    kw["seen_rows"] = None if C is None else torch.randint(0, C, (N,), generator=g)
    if penalty is not None:
        seen = torch.rand(N if C is None else C, V, generator=g) < draw(st.sampled_from([0.1, 0.5, 1.0]))
        kw.update(repetition_penalty=penalty, seen_tokens=seen if draw(st.booleans()) else seen.to(torch.uint8))
    if offsets:
        table = torch.randn(N if C is None else C, V, generator=g) * 2
        special = torch.rand(table.shape, generator=g)
        kw["logit_offsets"] = table.masked_fill(special < 0.05, -100.0).masked_fill(special > 0.98, 100.0)
    return kw


@st.composite
def _cases(draw):
    N = draw(st.integers(1, 64))
    V = draw(st.sampled_from([1, 2, 7, 33, 255, 1000, 2999]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    if draw(st.booleans()):  # exact ties
        logits = torch.randint(-3, 3, (N, V), generator=g).float()
    else:
        logits = torch.randn(N, V, generator=g) * 3
    special = torch.rand(N, V, generator=g)
    p_inf, p_nan = draw(st.sampled_from([(0, 0), (0.1, 0.05), (0.9, 0.1), (1.0, 0.0)]))
    logits[special < p_inf] = float("-inf")
    logits[(special >= p_inf) & (special < p_inf + p_nan)] = float("nan")
    res_kind = draw(st.sampled_from(["none", "2d", "3d"]))
    residual = None
    if res_kind == "2d":
        residual = torch.randn(N, V, generator=g).to(draw(st.sampled_from(DTYPES)))
    elif res_kind == "3d":
        residual = torch.randn(draw(st.integers(1, 3)), N, V, generator=g).to(dtype)
    skip = torch.rand(N, generator=g) < 0.3 if draw(st.booleans()) else None
    banned, ban_rows = _drawn_ban(draw, g, N, V)
    kw = dict(**_drawn_penalty(draw, g, N, V),
        scale=draw(st.sampled_from([1.0, 0.5, -2.0])),
        temperature=draw(st.sampled_from([1.0, 0.7, 2.5]) |  # or one a row
                         st.just(torch.tensor([0.7, 1.0, 2.5, 0.3], dtype=torch.float64)[torch.randint(0, 4, (N,),
                                                                                                    generator=g)])),
        skip_rows=skip,
        mask_token_id=draw(st.sampled_from([None, 0, V - 1, V + 5])),
        banned_tokens=banned,
        ban_rows=ban_rows,
        do_sample=draw(st.booleans() | st.just(torch.rand(N, generator=g) < 0.5)),  # or the rows that sample
        seed=draw(st.integers(0, 2**40)),
        noise_keys=torch.randint(-5, 2**33, (N, 3), generator=g),
        top_k=draw(st.none() | st.integers(1, 40)),  # greedy picks ignore them (the best token is always kept)
        top_p=draw(st.none() | st.floats(0.05, 1.0) |  # or one a row
                   st.just((torch.rand(N, generator=g, dtype=torch.float64) * 0.95 + 0.05))),
        min_p=draw(st.none() | st.sampled_from([0.0, 1.0]) | st.floats(0.001, 0.5)),
        epsilon_cutoff=draw(st.none() | st.sampled_from([0.0, 1.0]) | st.floats(1e-4, 0.5)),
        eta_cutoff=draw(st.none() | st.sampled_from([0.0, 1.0]) | st.floats(1e-4, 0.5)),
        top_h=draw(st.none() | st.just(1.0) | st.floats(0.05, 0.95)),
        typical_p=draw(st.none() | st.just(1.0) | st.floats(0.05, 0.95)),
        entropy=draw(st.booleans()),
    )
    top_k_max = draw(st.sampled_from([None, 0, 64]))  # with a top_k tensor: none, top_k itself, or above it
    return (logits.to(dtype), residual, kw, draw(st.sampled_from([1, 3, 16])), draw(st.sampled_from([64, 512])),
            draw(st.booleans()), draw(st.booleans()), top_k_max)


@given(_cases())
def test_kernel_matches_reference(case):
    """The kernel against the reference (tiles loaded one ahead or as processed, sampling among the tokens top-h /
    top-k / top-p / min-p / typical / epsilon / eta keep, the entropy asked for or not, a repetition penalty at the
    tokens each row has seen, one temperature and top-p or one a row, every row sampling or some); a temperature, the
    filters and the penalty given to the kernel as float64 0-d tensors (read on the device) scale, filter and sample
    exactly as the numbers do, top_k with or without a top_k_max."""
    logits, residual, kw, splits, block_v, on_device, prefetch, top_k_max = case
    dev_kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    if on_device:
        for name in ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                     "repetition_penalty"):
            if kw.get(name) is not None and not isinstance(kw[name], torch.Tensor):
                dev_kw[name] = torch.tensor(float(kw[name]), dtype=torch.float64, device=DEV)
        if kw["top_k"] is not None and top_k_max is not None:
            dev_kw["top_k_max"] = top_k_max or kw["top_k"]
    L = logits.to(DEV)
    R = residual.to(DEV) if residual is not None else None
    got = confidence_triton(L, R, splits=splits, block_v=block_v, prefetch=prefetch,
                            out=_poisoned(L.shape[0], kw["entropy"]), **dev_kw)
    _check(got, confidence_ref(logits, residual, **kw))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_banned_tokens_count_as_minus_infinity_in_their_rows(backend, do_sample):
    """A banned token in a banning row is excluded as if its logit were -inf (never picked, not in the softmax), and
    the other rows are untouched: the op on the logits equals the op on them with -inf written in (the most likely
    token of the first rows is banned, so the ban changes their picks)."""
    torch.manual_seed(0)
    L = torch.randn(5, 97, device=DEV)
    banned = torch.zeros(97, dtype=torch.bool, device=DEV)
    banned[L[:3].argmax(-1)] = True
    banned[11] = True
    ban_rows = torch.tensor([True, True, False, True, False], device=DEV)
    cleared = L.masked_fill(ban_rows[:, None] & banned, float("-inf"))
    kw = dict(do_sample=do_sample, seed=5, noise_keys=torch.randint(0, 99, (5, 3), device=DEV))
    with mt.use_backend(backend):
        got = mt.confidence(L, banned_tokens=banned, ban_rows=ban_rows, **kw)
        _check(got, mt.confidence(cleared, **kw))
        assert not banned[got[0][ban_rows]].any()
        assert got[0][2] == mt.confidence(L, **kw)[0][2]  # the ban does not apply there
        _check(mt.confidence(L, banned_tokens=banned, **kw),  # no ban_rows: every row bans
               mt.confidence(L.masked_fill(banned, float("-inf")), **kw))
        # classes as uint8 bits: token 11 in class 1, the first row's best in class 2; a row excludes its classes
        classes = torch.zeros(97, dtype=torch.uint8, device=DEV)
        classes[11], classes[L[0].argmax()] = 1, 2
        bits = torch.tensor([2, 1, 3, 0, 2], dtype=torch.uint8, device=DEV)
        _check(mt.confidence(L, banned_tokens=classes, ban_rows=bits, **kw),
               mt.confidence(L.masked_fill((bits[:, None] & classes) != 0, float("-inf")), **kw))


def test_greedy_exact_cases():
    V = 300
    L = torch.zeros(6, V)
    L[0, 10] = L[0, 74] = L[0, 250] = 5.0          # ties in one lane of two tiles, across splits: lowest index
    L[1, :] = float("-inf")                        # no finite candidate
    L[2, :] = float("nan")                         # NaN == -inf
    L[3, 7] = 9.0                                  # mask token is the max: excluded
    L[3, 8] = 1.0
    L[4, 299] = float("inf")                       # +inf clamps to FLT_MAX, stays the argmax
    L[5, 3] = 2.0                                  # skipped row
    skip = torch.tensor([False, False, False, False, False, True])
    for splits in (1, 4):
        tok, prob, lse = confidence_triton(L.to(DEV), mask_token_id=7, skip_rows=skip.to(DEV), splits=splits,
                                           block_v=64, out=_poisoned(6))
        assert tok.tolist() == [10, -1, -1, 8, 299, -1]
        assert prob[1:3].tolist() == [0.0, 0.0] and prob[5].item() == 0.0
        assert torch.isinf(lse[[1, 2, 5]]).all() and (lse[[1, 2, 5]] < 0).all()
        z = L[0].clone()
        z[7] = float("-inf")  # the mask column is excluded in every row
        assert prob[0].item() == pytest.approx(math.exp(5.0 - torch.logsumexp(z, 0).item()), rel=1e-5)
        z3 = L[3].clone()
        z3[7] = float("-inf")
        assert lse[3].item() == pytest.approx(torch.logsumexp(z3, 0).item(), rel=1e-6)
        assert prob[4].item() == pytest.approx(1.0)
        _check((tok, prob, lse), confidence_ref(L.to(DEV), mask_token_id=7, skip_rows=skip.to(DEV)))


@pytest.mark.parametrize("splits", [1, 4])
def test_entropy_is_the_categorical_entropy_of_the_full_softmax(splits):
    """The entropy (nats) equals torch.distributions.Categorical's over the effective logits (temperature applied;
    the mask column and banned tokens excluded; the sampling filters not applied), also where +inf logits tie (two
    at the largest fp32: log 2) or one dominates (0); +inf where the row has nothing to pick or is skipped."""
    g = torch.Generator().manual_seed(5)
    L = torch.randn(6, 300, generator=g) * 4
    L[1, :] = float("-inf")
    L[2, 4], L[2, 9] = float("inf"), float("inf")
    L[3, 8] = float("inf")
    L[4, 11] = 50.0  # almost all the mass on one token
    skip = torch.tensor([False, False, False, False, False, True])
    banned = torch.zeros(300, dtype=torch.bool)
    banned[::7] = True
    kw = dict(temperature=0.7, mask_token_id=5, banned_tokens=banned.to(DEV), skip_rows=skip.to(DEV), do_sample=True,
              noise_keys=torch.zeros(6, 3, dtype=torch.long, device=DEV), top_k=3, entropy=True)
    *_, ent = confidence_triton(L.to(DEV), splits=splits, block_v=64, out=_poisoned(6, entropy=True), **kw)
    z = effective_logits(L.double(), temperature=0.7, mask_token_id=5, banned_tokens=banned)
    z = torch.where(z > 1e30, 1e4, z)  # +inf (the largest fp32 in z): a value whose softmax float64 resolves
    expected = torch.distributions.Categorical(logits=z[[0, 2, 3, 4]]).entropy()
    torch.testing.assert_close(ent[[0, 2, 3, 4]].cpu().double(), expected, atol=1e-5, rtol=1e-5)
    assert ent[2].item() == pytest.approx(math.log(2)) and ent[3].item() == 0.0
    assert ent[[1, 5]].tolist() == [float("inf")] * 2


def test_residual_sum_and_temperature():
    g = torch.Generator().manual_seed(1)
    L = torch.randn(3, 500, generator=g).bfloat16()
    R = torch.randn(2, 3, 500, generator=g).bfloat16()
    tok, prob, lse = confidence_triton(L.to(DEV), R.to(DEV), scale=0.5, temperature=0.8, out=_poisoned(3))
    z = (L.float() + 0.5 * (R[0].float() + R[1].float())) / 0.8
    assert torch.equal(tok.cpu(), z.argmax(-1))
    torch.testing.assert_close(lse.cpu(), torch.logsumexp(z, -1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(prob.cpu(), torch.softmax(z, -1).max(-1).values, atol=1e-6, rtol=1e-4)


def test_three_residuals_and_a_strided_skip_row_view():
    """R = 3 residual tensors (the kernel steps from one to the next by their stride) and skip rows given as a
    strided view (the launcher makes them contiguous before the kernel reads skip + row)."""
    g = torch.Generator().manual_seed(2)
    L = torch.randn(4, 300, generator=g)
    R = torch.randn(3, 4, 300, generator=g)
    skip = torch.tensor([[True, False], [False, False], [True, True], [False, True]])[:, 0]
    assert not skip.is_contiguous()
    got = confidence_triton(L.to(DEV), R.to(DEV), scale=0.5, skip_rows=skip.to(DEV), out=_poisoned(4))
    expected = confidence_ref(L, R, scale=0.5, skip_rows=skip.contiguous())
    assert torch.equal(got[0].cpu(), expected[0]) and got[0][0].item() == -1 and got[0][1].item() >= 0
    for a, b in zip(got[1:], expected[1:]):
        torch.testing.assert_close(a.cpu(), b, atol=1e-6, rtol=1e-5)


def test_the_sampled_cut_is_the_same_computed_a_few_rows_at_a_time(monkeypatch):
    """A sampled launch computes its top-k / top-p cut in chunks of rows (CUT_CHUNK logits): the same picks."""
    conf = importlib.import_module("mrp_triton.confidence")  # the module: mrp_triton.confidence is also the op

    g = torch.Generator().manual_seed(3)
    L, R = torch.randn(7, 90, generator=g), torch.randn(2, 7, 90, generator=g)
    keys = torch.stack([torch.arange(7), torch.arange(7) + 10, torch.zeros(7, dtype=torch.long)], 1)
    kw = dict(scale=0.5, temperature=0.9, do_sample=True, seed=4, noise_keys=keys.to(DEV), top_p=0.6, top_k=20,
              mask_token_id=5)
    whole = confidence_triton(L.to(DEV), R.to(DEV), **kw)
    monkeypatch.setattr(conf, "CUT_CHUNK", 200)  # two rows a chunk
    chunked = confidence_triton(L.to(DEV), R.to(DEV), **kw)
    expected = confidence_ref(L, R, **dict(kw, noise_keys=keys))
    for a, b, c in zip(chunked, whole, expected):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.cpu(), c, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk", [None, 300])  # the rows' cuts in one piece, or a row at a time
def test_a_temperature_a_row_picks_as_each_row_with_its_own(chunk, monkeypatch):
    """Rows at temperatures 0.3, 1, 2.5, ... in one launch (a float64 tensor [N] on the device): each row's token,
    probability and log-sum-exp are bit-identical to a launch with its own temperature as a 0-d tensor, greedy and
    sampled (top-p then cuts each row at its own temperature; then each row at its own top-p, min-p, typical-p,
    epsilon, eta, top-k or top-h too, a neutral value, a top-k of V or more or a top-h above 1 cutting nothing in its
    row; top-k with and without a bound), kernel and reference alike."""
    if chunk is not None:
        monkeypatch.setattr(importlib.import_module("mrp_triton.confidence"), "CUT_CHUNK", chunk)
    g = torch.Generator().manual_seed(21)
    N, V = 6, 300
    L = (torch.randn(N, V, generator=g) * 3).to(DEV)
    keys = torch.randint(0, 1000, (N, 3), generator=g).to(DEV)
    temperatures = torch.tensor([0.3, 1.0, 2.5, 0.7, 1.0, 4.0], dtype=torch.float64, device=DEV)
    top_ps = torch.tensor([0.8, 1.0, 0.3, 0.95, 0.5, 0.6], dtype=torch.float64, device=DEV)

    def per_row(*values):
        return torch.tensor(values, dtype=torch.float64, device=DEV)

    for sampled in (dict(do_sample=False), dict(do_sample=True, seed=3, noise_keys=keys),
                    dict(do_sample=True, seed=3, noise_keys=keys, top_p=0.8),
                    dict(do_sample=True, seed=3, noise_keys=keys, top_p=top_ps, min_p=0.01),
                    dict(do_sample=True, seed=3, noise_keys=keys, min_p=per_row(0.2, 0, 0.05, 0.5, 0, 0.01),
                         typical_p=per_row(0.9, 1, 0.5, 0.3, 0.95, 1)),
                    dict(do_sample=True, seed=3, noise_keys=keys, epsilon_cutoff=per_row(0.01, 0, 0.1, 0.02, 0, 0.3),
                         eta_cutoff=per_row(0, 0.05, 0.01, 0, 0.2, 0.001)),
                    dict(do_sample=True, seed=3, noise_keys=keys, top_k=per_row(2, 300, 40, 1, 2**31 - 1, 5),
                         top_p=top_ps),
                    dict(do_sample=True, seed=3, noise_keys=keys, top_k=per_row(2, 64, 40, 1, 7, 5), top_k_max=64,
                         min_p=0.01),
                    dict(do_sample=True, seed=3, noise_keys=keys, top_h=per_row(0.5, 2, 1, 0.1, 0.9, 2), top_p=top_ps),
                    dict(do_sample=True, seed=3, noise_keys=keys, top_h=per_row(2, 0.3, 0.7, 2, 1, 0.05),
                         top_k=per_row(3, 2**31 - 1, 50, 1, 2**31 - 1, 8))):
        for op, extra in ((confidence_triton, dict(splits=2, block_v=64)), (confidence_ref, {})):
            together = op(L, temperature=temperatures, entropy=True, **sampled, **extra)
            for n in range(N):
                alone = op(L[n:n + 1], temperature=temperatures[n], entropy=True,
                           **{k: (v[n:n + 1] if isinstance(v, torch.Tensor) else v) for k, v in sampled.items()},
                           **extra)
                for a, b in zip(together, alone):
                    assert torch.equal(a[n:n + 1], b), (op.__name__, sampled, n)
        ref = confidence_ref(L.cpu(), temperature=temperatures.cpu(), **{
            k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in sampled.items()})
        _check(confidence_triton(L, temperature=temperatures, **sampled), ref)


@pytest.mark.parametrize("cut", [{}, dict(top_p=0.5), dict(typical_p=0.3, top_k=4)])
def test_the_rows_that_sample_draw_as_sampled_launches_and_the_others_pick_greedily(cut):
    """``do_sample`` one a row: each sampled row's token, probability and log-sum-exp are bit-identical to a sampled
    launch of it, each other row's to a greedy launch (no noise, no cut: typical-p, which may cut the most likely
    token, leaves a greedy row alone), kernel (the vocabulary in one piece and in splits) and reference alike."""
    g = torch.Generator().manual_seed(5)
    N, V = 7, 300
    L = (torch.randn(N, V, generator=g) * 2).to(DEV)
    L[3, 10:13] = L[3].max() + 1  # a three-way tie for the greedy pick of a row that does not sample
    keys = torch.randint(0, 1000, (N, 3), generator=g).to(DEV)
    rows = torch.tensor([True, False, True, False, False, True, True], device=DEV)
    temperatures = torch.tensor([0.7, 1.0, 1.3, 1.0, 1.0, 2.0, 0.5], dtype=torch.float64, device=DEV)
    for op, extra in ((confidence_triton, dict(splits=1)), (confidence_triton, dict(splits=3, block_v=64)),
                      (confidence_ref, {})):
        together = op(L, temperature=temperatures, do_sample=rows, seed=9, noise_keys=keys, entropy=True, **cut,
                      **extra)
        for n in range(N):
            sampled = dict(do_sample=True, seed=9, noise_keys=keys[n:n + 1], **cut) if rows[n] else {}
            alone = op(L[n:n + 1], temperature=temperatures[n], entropy=True, **sampled, **extra)
            for a, b in zip(together, alone):
                assert torch.equal(a[n:n + 1], b), (op.__name__, extra, n)
    assert together[0][3] == 10
    assert not torch.equal(together[0], confidence_ref(L, temperature=temperatures)[0])  # the sampled rows drew


@pytest.mark.parametrize("temperature", [0.7, 0.3, 1.7, 2.5, 0.013])
def test_temperature_tensor_scales_exactly_as_the_float(temperature):
    """The kernel turns a temperature tensor into 1 / t (float64 division, rounded to fp32) as the launcher does
    a float: bit-identical outputs, sampled or greedy (1 ulp off in 1 / t would move the logsumexp)."""
    g = torch.Generator().manual_seed(11)
    L = (torch.randn(6, 300, generator=g) * 4).to(DEV)
    keys = torch.randint(0, 1000, (6, 3), generator=g).to(DEV)
    for do_sample in (False, True):
        kw = dict(do_sample=do_sample, noise_keys=keys, seed=3, splits=2, block_v=64)
        from_float = confidence_triton(L, temperature=temperature, **kw)
        from_tensor = confidence_triton(L, temperature=torch.tensor(temperature, dtype=torch.float64, device=DEV),
                                        **kw)
        for a, b in zip(from_float, from_tensor):
            assert torch.equal(a, b), (temperature, do_sample)


def test_sampling_independent_of_batch_composition():
    g = torch.Generator().manual_seed(2)
    N, V = 8, 777
    L = torch.randn(N, V, generator=g)
    keys = torch.stack([torch.arange(N), 100 + torch.arange(N), torch.full((N,), 3)], 1)
    full = confidence_triton(L.to(DEV), do_sample=True, seed=11, noise_keys=keys.to(DEV), splits=2, block_v=128)
    perm = torch.randperm(N, generator=g)
    part = confidence_triton(L[perm].to(DEV), do_sample=True, seed=11, noise_keys=keys[perm].to(DEV))
    assert torch.equal(full[0][perm].cpu(), part[0].cpu())
    sub = confidence_triton(L[2:5].to(DEV), do_sample=True, seed=11, noise_keys=keys[2:5].to(DEV))
    assert torch.equal(full[0][2:5].cpu(), sub[0].cpu())
    ref = confidence_ref(L, do_sample=True, seed=11, noise_keys=keys)
    assert torch.equal(full[0].cpu(), ref[0])
    other = confidence_ref(L, do_sample=True, seed=12, noise_keys=keys)
    assert not torch.equal(other[0], ref[0])  # the seed matters


def test_uniforms_open_interval_and_hash_spread():
    keys = torch.tensor([[0, 0, 0], [1, 2, 3], [-1, 2**40, 7]])
    u = gumbel_uniform(0, keys, 4096)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.02
    assert ((u.double() * 2**23) % 1 == 0.5).all()  # bin centres (h + 0.5) / 2**23: never 0, whatever the hash


def test_every_bit_of_a_64_bit_seed_changes_the_noise():
    hashes = {seed_hash(s) for s in [0] + [2**k for k in range(64)]}
    assert len(hashes) == 65


def test_gumbel_matches_softmax_empirically():
    """Chi-square of 20000 Gumbel-max draws (reference hash) against softmax, loose bound; the
    kernel draws the same tokens on a 300-row slice (the hash is bit-identical)."""
    V, N = 6, 20000
    logit_row = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -3.0])
    L = logit_row.expand(N, V).contiguous()
    keys = torch.stack([torch.arange(N) % 37, torch.arange(N) // 37, torch.full((N,), 5)], 1)
    tok, _, _ = confidence_ref(L, do_sample=True, seed=1234, noise_keys=keys, temperature=1.3)
    counts = torch.bincount(tok, minlength=V).double()
    expected = torch.softmax(logit_row / 1.3, 0).double() * N
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 30.0, (counts, expected, chi2)  # df = 5: p(chi2 > 30) ~ 1.5e-5
    ktok, _, _ = confidence_triton(L[:300].to(DEV), do_sample=True, seed=1234, noise_keys=keys[:300].to(DEV),
                                   temperature=1.3)
    assert torch.equal(ktok.cpu(), tok[:300])


@pytest.mark.parametrize("top_k,top_p,on_device", [(3, None, False), (None, 0.5, False), (5, 0.8, False),
                                                   (3, None, True), (None, 0.5, True), (5, 0.8, True),
                                                   (None, 1.0, True)])
def test_top_k_top_p(top_k, top_p, on_device):
    """The filtered pick against the reference (top_k, top_p and the temperature given to the kernel as numbers
    or as 0-d float64 tensors on the device, as the decode engine passes them: the same picks)."""
    g = torch.Generator().manual_seed(3)
    N, V = 16, 200
    L = torch.randn(N, V, generator=g) * 2
    keys = torch.randint(0, 1000, (N, 3), generator=g)
    given = (lambda x: torch.tensor(x, dtype=torch.float64, device=DEV)) if on_device else (lambda x: x)
    got = confidence_triton(L.to(DEV), do_sample=True, seed=5, noise_keys=keys.to(DEV),
                            top_k=None if top_k is None else given(top_k),
                            top_p=None if top_p is None else given(top_p), mask_token_id=0, temperature=given(0.7))
    exp = confidence_ref(L, do_sample=True, seed=5, noise_keys=keys, top_k=top_k, top_p=top_p, mask_token_id=0,
                         temperature=0.7)
    _check(got, exp)
    z = effective_logits(L, temperature=0.7, mask_token_id=0)
    kept = kept_by_cut(z, sampling_cut(z, top_k, top_p))
    assert kept.gather(1, got[0].cpu()[:, None]).all()
    if top_k is not None:
        assert (kept.sum(1) <= top_k).all()
    full_p = torch.softmax(z, -1).gather(1, got[0].cpu()[:, None])[:, 0]
    torch.testing.assert_close(got[1].cpu(), full_p, atol=1e-6, rtol=1e-5)  # full-softmax prob


def test_top_p_keeps_the_fewest_tokens_whose_mass_reaches_it():
    """As transformers' top-p: the smallest set of most likely tokens whose probability sums to at least top_p."""
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]])  # probabilities 0.64, 0.24, 0.09, 0.03
    assert kept_by_cut(z, sampling_cut(z, top_p=0.7)).tolist() == [[True, True, False, False]]
    z = torch.tensor([[math.log(2), 0.0, 0.0]], dtype=torch.float64)  # exactly 0.5, 0.25, 0.25
    assert kept_by_cut(z, sampling_cut(z, top_p=0.5)).tolist() == [[True, False, False]]  # 0.5 reaches 0.5
    assert kept_by_cut(z, sampling_cut(z, top_p=0.5001)).tolist() == [[True, True, True]]  # the tied pair


def test_a_rows_top_k_past_the_vocabulary_or_top_h_above_1_keeps_every_token():
    """top_k and top_h one a row (float64 [N], as decoding reads them): a row at top-k 2**31 - 1 or top-h 2 (decoding's
    "no cut" for a prompt) keeps its whole vocabulary, past the 100 candidates top-h chooses among too; every other
    row's cut is the one it gets alone (with top-p and a bound on top-k beside them too)."""
    randn = torch.randn(4, 300, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    no_cut = 2.0**31 - 1
    for filters, bound in ((dict(top_h=[2.0, 0.5, 1.0, 2.0]), None),
                           (dict(top_k=[no_cut, 5, 120, no_cut], top_p=[1.0, 0.9, 0.8, 0.6]), None),
                           (dict(top_h=[2.0, 0.3, 2.0, 0.9], top_k=[7, no_cut, no_cut, 3]), None),
                           (dict(top_h=[2.0, 0.8, 0.95, 0.9], top_k=[7, 64, 64, 3]), 64)):
        z = randn * (0.1 if bound else 3)  # flat rows: top-h's choice among its 100 candidates reaches past 64
        rows = {name: torch.tensor(values, dtype=torch.float64) for name, values in filters.items()}
        kept = kept_by_cut(z, sampling_cut(z, **rows, top_k_max=bound))
        for n in range(4):
            alone = {name: float(values[n]) for name, values in filters.items()
                     if not (name == "top_k" and values[n] == no_cut or name == "top_h" and values[n] > 1)}
            alone = {name: int(v) if name == "top_k" else v for name, v in alone.items()}
            assert torch.equal(kept[n], kept_by_cut(z[n:n + 1], sampling_cut(z[n:n + 1], **alone))[0]), (filters, n)
        assert kept[0].all() or "top_k" in filters and filters["top_k"][0] != no_cut
    z, top_h = randn, torch.tensor([2.0, 1.0, 2.0, 1.0], dtype=torch.float64)  # 1: all of the 100 candidates, no more
    assert kept_by_cut(z, sampling_cut(z, top_h=top_h)).sum(1).tolist() == [300, 100, 300, 100]


ONES, ZEROS = list(range(0, 21, 3)), list(range(1, 21, 3))


@pytest.mark.parametrize("top_k,top_p,allowed", [(2, None, ONES), (9, None, sorted(ONES + ZEROS)),
                                                (None, 0.2, ONES), (9, 0.9, ONES), (9, 0.99, sorted(ONES + ZEROS))])
def test_filters_keep_every_token_tied_with_the_cut(top_k, top_p, allowed):
    """Where the cut falls inside a group of equal logits, the whole group is kept (whatever the token ids), and the
    kernel draws from each of its tokens and from nothing below. Logits 1, 0, -1, 1, 0, -1, ... over V = 21 (the
    mass of a 1 is 0.095: top_p 0.2 stops at the third 1; over the top 9 values, 7 ones and 2 zeros, the ones hold
    0.905); 400 rows of other noise keys, tiles and splits that cut through the groups."""
    N, V = 400, 21
    L = torch.tensor([1.0, 0.0, -1.0] * (V // 3)).expand(N, V).contiguous()
    keys = torch.stack([torch.arange(N), torch.arange(N) * 7, torch.full((N,), 2)], 1)
    kw = dict(do_sample=True, seed=9, top_k=top_k, top_p=top_p)
    exp = confidence_ref(L, noise_keys=keys, **kw)
    got = confidence_triton(L.to(DEV), noise_keys=keys.to(DEV), splits=3, block_v=16, out=_poisoned(N), **kw)
    _check(got, exp)
    assert sorted(set(got[0].tolist())) == allowed


@pytest.mark.parametrize("top_k,top_p,top_k_max", [
    (None, 1.0, None), (None, torch.tensor(1.0, dtype=torch.float64), None), (None, torch.tensor(1.0), None),
    (50, None, None), (torch.tensor(50.0), None, None), (torch.tensor(80), 1.0, None), (torch.tensor(50.0), None, 64),
    (torch.tensor(49), None, 49)])
def test_filters_that_keep_every_token(top_k, top_p, top_k_max):
    """top_k >= V and top_p = 1 filter nothing, as numbers or tensors (with or without a top_k_max); top_p = 1 even
    where the fp32 mass before the tail already rounds to 1 (one dominant token); nor does top_k = 49 where the
    49th value ties with the 50th. V = 50."""
    z = torch.zeros(2, 50)
    z[:, 0] = 40.0
    assert kept_by_cut(z, sampling_cut(z, top_k, top_p, top_k_max)).all()


def _kept_by_the_filters(z, top_k=None, top_p=None):
    """bool [N, V]: the tokens of z [N, V] that top-k, then top-p keep, decided token by token (the oracle of the
    cut): top-k keeps a token unless top_k values of its row are larger (transformers' TopKLogitsWarper: the ties
    of the k-th value all kept); top-p then keeps it unless the values larger than it among the row's top_k
    largest (all V without top-k) hold top_p of their softmax mass."""
    k = z.shape[-1] if top_k is None else min(top_k, z.shape[-1])
    top = torch.topk(z, k, dim=-1).values  # the k largest values of each row, in any order among equals
    kept = z >= top.amin(-1, keepdim=True)
    if top_p is not None and top_p < 1.0:
        p = torch.softmax(top, dim=-1).nan_to_num(nan=0.0)
        kept &= (p[:, None, :] * (top[:, None, :] > z[:, :, None])).sum(-1) < top_p
    return kept


@given(N=st.integers(1, 6), V=st.integers(1, 40), ties=st.booleans(), p_inf=st.sampled_from([0.0, 0.3, 1.0]),
       top_k=st.none() | st.integers(1, 45), top_p=st.none() | st.floats(0.01, 1.0),
       given_as=st.sampled_from(["numbers", "tensors", "tensors with top_k_max"]), seed=st.integers(0, 2**31))
def test_sampling_cut_keeps_what_the_two_filters_keep(N, V, ties, p_inf, top_k, top_p, given_as, seed):
    """The cut (one value per row) keeps exactly the finite tokens that top-k then top-p keep, ties with the cut all
    kept, -inf rows and filters larger than the row included; top_k / top_p as numbers or as the 0-d float64 tensors
    the decode engine passes (top_k selected by torch.topk with a top_k_max, else the row sorted)."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randint(-2, 3, (N, V), generator=g).float() if ties else torch.randn(N, V, generator=g) * 3)
    z[torch.rand(N, V, generator=g) < p_inf] = float("-inf")
    given_k, given_p, top_k_max = top_k, top_p, None
    if given_as != "numbers":
        given_k, given_p = (None if x is None else torch.tensor(float(x), dtype=torch.float64) for x in (top_k, top_p))
        top_k_max = top_k if given_as == "tensors with top_k_max" else None
    kept = kept_by_cut(z, sampling_cut(z, given_k, given_p, top_k_max))
    finite = z > float("-inf")
    assert torch.equal(kept & finite, _kept_by_the_filters(z, top_k, top_p) & finite)
    assert kept.any(-1).all()  # the first ranked token is always kept (a greedy pick needs no filter)


@settings(max_examples=40)
@given(N=st.integers(1, 6), V=st.integers(1, 60), p_inf=st.sampled_from([0.0, 0.3, 1.0]),
       top_k=st.none() | st.integers(1, 45), top_p=st.none() | st.floats(0.01, 1.0),
       min_p=st.sampled_from([0.0, 1.0]) | st.floats(1e-4, 0.9), as_tensor=st.booleans(), seed=st.integers(0, 2**31))
def test_min_p_cuts_after_top_k_and_top_p_as_transformers_warper_does(N, V, p_inf, top_k, top_p, min_p, as_tensor,
                                                                     seed):
    """min-p keeps what transformers' MinPLogitsWarper keeps of what top-k and top-p kept (the tokens at least min_p
    times as likely as the most likely one; min_p = 1 keeps the most likely alone, 0 every one), given as a number
    or as the 0-d float64 tensor the decode engine passes."""
    from transformers.generation.logits_process import MinPLogitsWarper

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, V, generator=g) * 3
    z[torch.rand(N, V, generator=g) < p_inf] = float("-inf")
    given = torch.tensor(min_p, dtype=torch.float64) if as_tensor else min_p
    kept = kept_by_cut(z, sampling_cut(z, top_k, top_p, None, given))
    before = z.masked_fill(~_kept_by_the_filters(z, top_k, top_p), float("-inf"))
    hf = MinPLogitsWarper(min_p=min_p, min_tokens_to_keep=1)(None, before) > float("-inf")
    finite = z > float("-inf")
    assert torch.equal(kept & finite, hf & finite)
    assert (kept & finite).any(-1).equal(finite.any(-1))  # the most likely token stays


def _warped_by_transformers(z: torch.Tensor, warpers) -> torch.Tensor:
    """bool [N, V]: the finite tokens of z [N, V] that transformers' warpers ``(class, value)`` keep, applied in turn
    (a value None: not applied), in the rows with a finite token (the eta warper's entropy fails on the others)."""
    finite = z > float("-inf")
    rows = finite.any(-1)
    kept = torch.zeros_like(finite)
    if rows.any():
        out = z[rows]
        for warper, value in warpers:
            if value is not None:
                out = warper(value)(None, out)  # min_tokens_to_keep: 1 by default
        kept[rows] = out > float("-inf")
    return kept & finite


@settings(max_examples=40)
@given(N=st.integers(1, 64), V=st.integers(2, 60), spread=st.sampled_from([0.3, 1.0, 3.0]),
       p_inf=st.sampled_from([0.0, 0.3]), epsilon=st.none() | st.floats(1e-4, 0.5),
       eta=st.none() | st.floats(1e-4, 0.5), as_tensor=st.booleans(), seed=st.integers(0, 2**31))
def test_epsilon_and_eta_keep_what_transformers_warpers_keep(N, V, spread, p_inf, epsilon, eta, as_tensor, seed):
    """Epsilon and eta sampling keep what transformers' EpsilonLogitsWarper and EtaLogitsWarper keep (eta after
    epsilon, under the softmax over what epsilon kept; the most likely token always), given as numbers or as the 0-d
    float64 tensors the decode engine passes, on rows spread a little or much (flat or peaked softmaxes: eta's floor
    moves with the entropy)."""
    from transformers.generation.logits_process import EpsilonLogitsWarper, EtaLogitsWarper

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, V, generator=g) * spread
    z[torch.rand(N, V, generator=g) < p_inf] = float("-inf")
    given = {name: None if x is None else torch.tensor(x, dtype=torch.float64) if as_tensor else x
             for name, x in (("epsilon_cutoff", epsilon), ("eta_cutoff", eta))}
    kept = kept_by_cut(z, sampling_cut(z, **given)) & (z > float("-inf"))
    assert torch.equal(kept, _warped_by_transformers(z, ((EpsilonLogitsWarper, epsilon), (EtaLogitsWarper, eta))))
    assert kept.any(-1).equal((z > float("-inf")).any(-1))  # the most likely token stays


@settings(max_examples=40)
@given(N=st.integers(1, 32), V=st.integers(2, 60), spread=st.sampled_from([0.3, 1.0, 3.0]),
       p_inf=st.sampled_from([0.0, 0.3]),
       before=st.sampled_from([dict(top_k=3), dict(top_k=12), dict(top_p=0.5), dict(top_p=0.9), dict(min_p=0.05),
                               dict(min_p=0.3), dict(top_k=10, top_p=0.8, min_p=0.02)]),
       epsilon=st.none() | st.floats(1e-3, 0.3), eta=st.none() | st.floats(1e-3, 0.3), seed=st.integers(0, 2**31))
def test_epsilon_and_eta_cut_after_the_others_as_transformers_warpers_do(N, V, spread, p_inf, before, epsilon, eta,
                                                                         seed):
    """After top-k, top-p and min-p, epsilon and eta keep what transformers' warpers keep of what those kept (their
    probabilities and entropy under the softmax over the tokens still kept)."""
    from transformers.generation.logits_process import EpsilonLogitsWarper, EtaLogitsWarper, MinPLogitsWarper

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, V, generator=g) * spread
    z[torch.rand(N, V, generator=g) < p_inf] = float("-inf")
    kept = kept_by_cut(z, sampling_cut(z, **before, epsilon_cutoff=epsilon, eta_cutoff=eta)) & (z > float("-inf"))
    cut = z.masked_fill(~_kept_by_the_filters(z, before.get("top_k"), before.get("top_p")), float("-inf"))
    want = _warped_by_transformers(cut, ((MinPLogitsWarper, before.get("min_p")), (EpsilonLogitsWarper, epsilon),
                                         (EtaLogitsWarper, eta)))
    assert torch.equal(kept, want)


@settings(max_examples=40)
@given(N=st.integers(1, 16), V=st.integers(1, 250), spread=st.sampled_from([0.3, 1.0, 3.0]),
       p_inf=st.sampled_from([0.0, 0.3, 1.0]), top_h=st.floats(0.05, 0.95), top_k=st.none() | st.integers(1, 120),
       top_p=st.none() | st.floats(0.05, 1.0), as_tensor=st.booleans(), seed=st.integers(0, 2**31))
def test_top_h_keeps_what_transformers_warper_keeps_before_top_k_and_top_p(N, V, spread, p_inf, top_h, top_k, top_p,
                                                                           as_tensor, seed):
    """top-h keeps what transformers' TopHLogitsWarper keeps (among the 100 most likely tokens, the most likely ones
    whose entropy terms take at most top_h of their entropy; the most likely always), before top-k and top-p as
    transformers applies them (they cut what top-h kept), given as a number or as the 0-d float64 tensor the decode
    engine passes; vocabularies below and above the 100."""
    from transformers.generation.logits_process import TopHLogitsWarper

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, V, generator=g) * spread
    z[torch.rand(N, V, generator=g) < p_inf] = float("-inf")
    given = torch.tensor(top_h, dtype=torch.float64) if as_tensor else top_h
    kept = kept_by_cut(z, sampling_cut(z, top_k, top_p, top_h=given)) & (z > float("-inf"))
    by_top_h = _warped_by_transformers(z, ((TopHLogitsWarper, top_h),))
    want = _kept_by_the_filters(z.masked_fill(~by_top_h, float("-inf")), top_k, top_p) & by_top_h
    assert torch.equal(kept, want)
    all_of_them = kept_by_cut(z, sampling_cut(z, top_h=1.0)) & (z > float("-inf"))  # top_h 1: the 100 most likely
    assert torch.equal(all_of_them, _kept_by_the_filters(z, min(V, 100)) & (z > float("-inf")))


@settings(max_examples=60)
@given(N=st.integers(1, 16), V=st.integers(1, 120), values=st.sampled_from(["spread 0.3", "spread 1", "spread 4",
                                                                           "integers"]),
       p_inf=st.sampled_from([0.0, 0.3, 1.0]), typical_p=st.floats(0.01, 0.99),
       before=st.sampled_from([{}, dict(top_k=5), dict(top_p=0.7), dict(min_p=0.1)]),
       after=st.sampled_from([{}, dict(epsilon_cutoff=0.02), dict(eta_cutoff=0.05)]), as_tensor=st.booleans(),
       seed=st.integers(0, 2**31))
def test_typical_p_keeps_what_transformers_warper_keeps_between_min_p_and_epsilon(N, V, values, p_inf, typical_p,
                                                                                  before, after, as_tensor, seed):
    """Typical sampling keeps what transformers' TypicalLogitsWarper keeps of what top-k, top-p and min-p kept (the
    tokens nearest the entropy in surprise, under the softmax over those, up to typical_p of its mass; ties with the
    last one all kept), and epsilon and eta then cut what it kept (the most likely of those always stays), given as a
    number or as the 0-d float64 tensor the decode engine passes; logits spread a little or much, or small integers
    (tied surprises on both sides of the entropy)."""
    from transformers.generation.logits_process import (EpsilonLogitsWarper, EtaLogitsWarper, MinPLogitsWarper,
                                                        TypicalLogitsWarper)

    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-3, 3, (N, V), generator=g).float() if values == "integers" else \
        torch.randn(N, V, generator=g) * float(values.split()[1])
    z[torch.rand(N, V, generator=g) < p_inf] = float("-inf")
    given = torch.tensor(typical_p, dtype=torch.float64) if as_tensor else typical_p
    kept = kept_by_cut(z, sampling_cut(z, **before, typical_p=given, **after)) & (z > float("-inf"))
    cut = z.masked_fill(~_kept_by_the_filters(z, before.get("top_k"), before.get("top_p")), float("-inf"))
    want = _warped_by_transformers(cut, ((MinPLogitsWarper, before.get("min_p")), (TypicalLogitsWarper, typical_p),
                                         (EpsilonLogitsWarper, after.get("epsilon_cutoff")),
                                         (EtaLogitsWarper, after.get("eta_cutoff"))))
    assert torch.equal(kept, want)
    assert kept.any(-1).equal((z > float("-inf")).any(-1))  # something stays in every row with a finite token
    every = kept_by_cut(z, sampling_cut(z, **before, typical_p=1.0)) & (z > float("-inf"))  # 1: nothing cut
    assert torch.equal(every, kept_by_cut(z, sampling_cut(z, **before)) & (z > float("-inf")))


def test_typical_p_can_leave_out_the_most_likely_token():
    """Typical sampling keeps the tokens whose surprise is nearest the entropy: with probabilities 0.4, 0.3, 0.3 the
    entropy is 1.09 nats, the two 0.3 tokens' surprises (1.20) lie nearer it than the most likely one's (0.92), so
    typical_p 0.5 keeps the two (their mass, 0.6, reaches it at the second) and leaves out the most likely. Epsilon
    0.6 then finds both below its floor (0.5 each under the softmax over the two) and keeps the most likely of what
    typical kept, both as they tie: its floor never reaches above them to the row's most likely."""
    z = torch.log(torch.tensor([[0.4, 0.3, 0.3]], dtype=torch.float64))
    assert kept_by_cut(z, sampling_cut(z, typical_p=0.5)).tolist() == [[False, True, True]]
    assert kept_by_cut(z, sampling_cut(z, typical_p=0.5, epsilon_cutoff=0.6)).tolist() == [[False, True, True]]
    assert kept_by_cut(z, sampling_cut(z, typical_p=0.2)).tolist() == [[False, True, True]]  # tied: both kept
    assert kept_by_cut(z, sampling_cut(z, typical_p=0.7)).tolist() == [[True, True, True]]


def test_typical_p_stops_where_the_mass_reaches_it_and_1_cuts_nothing():
    """As transformers' warper, typical sampling keeps tokens until the cumulative mass reaches typical_p (equal to it
    stops): probabilities 0.5, 0.25, 0.125, 0.125 rank the 0.25 token first (surprise nearest the entropy, 1.75 bits),
    and a typical_p equal to its mass (as the fp32 softmax rounds it) keeps it alone. typical_p 1 keeps every token,
    also where the mass rounds to 1 before the tail (one dominant token)."""
    from transformers.generation.logits_process import TypicalLogitsWarper

    z = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    first = float(torch.softmax(z[:, [1, 0, 2, 3]], dim=-1)[0, 0])  # the mass of the first-ranked token
    kept = kept_by_cut(z, sampling_cut(z, typical_p=first))
    assert kept.tolist() == [[False, True, False, False]]
    assert torch.equal(kept, TypicalLogitsWarper(first)(None, z.clone()) > float("-inf"))
    peaked = torch.tensor([[0.0, -40.0, -40.0]])
    assert kept_by_cut(peaked, sampling_cut(peaked, typical_p=1.0)).all()


@pytest.mark.parametrize("cut", [dict(top_h=0.5), dict(top_k=4), dict(top_p=0.6), dict(min_p=0.2),
                                 dict(typical_p=0.4), dict(epsilon_cutoff=0.02), dict(eta_cutoff=0.05)],
                         ids=lambda c: next(iter(c)))
def test_kernel_samples_among_what_each_filter_alone_keeps(cut):
    """Each filter alone reaches the kernel (the launcher computes its cut for every one of them): the kernel's
    samples equal the reference's, and at a hot temperature differ from unfiltered sampling, over 64 rows of a
    200-token vocabulary, as a number and as a 0-d float64 tensor."""
    g = torch.Generator().manual_seed(3)
    L = (torch.randn(64, 200, generator=g) * 2).to(DEV)
    kw = dict(do_sample=True, seed=5, temperature=2.0, noise_keys=torch.randint(0, 2**40, (64, 3), generator=g).to(DEV))
    want = confidence_ref(L.cpu(), **{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}, **cut)
    name, value = next(iter(cut.items()))
    for given in (value, torch.tensor(float(value), dtype=torch.float64, device=DEV)):
        _check(confidence_triton(L, out=_poisoned(64), **kw, **{name: given}), want)
    assert not torch.equal(want[0], confidence_triton(L, **kw)[0].cpu())


@pytest.mark.triton
def test_public_function_dispatches_to_kernel():
    g = torch.Generator().manual_seed(4)
    L = torch.randn(3, 100, generator=g).to(DEV)
    _check(mt.confidence(L, mask_token_id=5), confidence_ref(L.cpu(), mask_token_id=5))


def test_reference_backend_on_cpu_matches():
    L = torch.randn(4, 50)
    with mt.use_backend("reference"):
        _check(mt.confidence(L), confidence_ref(L))


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(do_sample=True), "noise_keys"),
    (dict(do_sample=torch.ones(2, dtype=torch.bool)), "noise_keys"),
    (dict(do_sample=torch.ones(3, dtype=torch.bool)), r"do_sample must be a bool tensor of shape \[2\] .*or a bool"),
    (dict(do_sample=torch.ones(2)), r"do_sample must be a bool tensor of shape \[2\]"),
    (dict(do_sample=torch.ones(2, dtype=torch.bool, device="meta")), "do_sample is on meta"),
    (dict(residual=torch.zeros(2, 9)), "residual"),
    (dict(skip_rows=torch.zeros(2)), "skip_rows"),
    (dict(skip_rows=torch.zeros(2, dtype=torch.bool, device="meta")), "skip_rows is on meta"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(temperature=torch.ones(3)), r"temperature must be a number or a 0-d real tensor \(or one a row, \[2\]\)"),
    (dict(top_p=torch.tensor(True)), "top_p must be a number or a 0-d real tensor"),
    (dict(temperature=torch.tensor(1 + 0j)), "temperature must be a number or a 0-d real tensor"),
    (dict(top_k=torch.tensor([3])), "top_k must be a number or a 0-d real tensor"),
    (dict(temperature=torch.tensor(1.0, device="meta")), "temperature is on meta"),
    (dict(top_k=5, top_k_max=0), "top_k_max must be a positive int"),
    (dict(top_k=torch.tensor(5.0), top_k_max=4.5), "top_k_max must be a positive int"),
    (dict(top_k=70, top_k_max=64), "top_k=70 exceeds top_k_max=64"),
    (dict(min_p=1.5), "min_p must be in \\[0, 1\\]"),
    (dict(min_p=-0.1), "min_p must be in \\[0, 1\\]"),
    (dict(min_p=True), "min_p must be in \\[0, 1\\]"),
    (dict(min_p=torch.ones(3)), r"min_p must be a number or a 0-d real tensor \(or one a row, \[2\]\)"),
    (dict(epsilon_cutoff=1.5), "epsilon_cutoff must be in \\[0, 1\\]"),
    (dict(top_h=0.0), "top_h must be in \\(0, 1\\]"),
    (dict(top_h=True), "top_h must be in \\(0, 1\\]"),
    (dict(typical_p=0.0), "typical_p must be in \\(0, 1\\]"),
    (dict(typical_p=1.5), "typical_p must be in \\(0, 1\\]"),
    (dict(eta_cutoff=-0.1), "eta_cutoff must be in \\[0, 1\\]"),
    (dict(eta_cutoff=torch.ones(3)), "eta_cutoff must be a number or a 0-d real tensor"),
    (dict(banned_tokens=torch.zeros(9, dtype=torch.bool)), "banned_tokens must be a bool or uint8 tensor of shape "
                                                           "\\[10\\]"),
    (dict(banned_tokens=torch.zeros(10, dtype=torch.long)), "banned_tokens must be a bool or uint8 tensor"),
    (dict(banned_tokens=torch.zeros(10, dtype=torch.bool, device="meta")), "banned_tokens is on meta"),
    (dict(ban_rows=torch.ones(2, dtype=torch.bool)), "pass banned_tokens too"),
    (dict(banned_tokens=torch.zeros(10, dtype=torch.bool), ban_rows=torch.ones(3, dtype=torch.bool)),
     "ban_rows must be a bool or uint8 tensor of shape \\[2\\]"),
])
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mt.confidence(torch.zeros(2, 10), **kwargs)


def test_dtype_errors():
    with pytest.raises(TypeError, match="logits"):
        mt.confidence(torch.zeros(2, 10, dtype=torch.int64))
    with pytest.raises(ValueError, match="logits"):
        mt.confidence(torch.zeros(10))
