"""Fused lm_head + online softmax (interpreter on CPU, real kernel on CUDA) vs the PyTorch reference and vs
``softmax(h @ W.T).max(-1)``.

Exactness: hidden, weight and base logits are small integers, so every logit is an exact
integer whatever the summation order, ties are frequent, and the token must match exactly.
"""

from __future__ import annotations

from math import inf

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_utils import DEV, DTYPES, LAUNCHER_RAN, forbid_triton_launcher, poisoned_allocations, refused_alike
from mrp_triton import lm_head_confidence
from mrp_triton.lm_head_confidence import _config, _kept_first_kernel, _table, lm_head_confidence_triton
from mrp_triton.reference import lm_head_confidence as lm_head_confidence_reference
from mrp_triton.reference.lm_head_confidence import top_by_value

# the weight tiles come through TMA where the device has it (Hopper or newer; the interpreter on CPU)
HAS_TMA = DEV == "cpu" or torch.cuda.get_device_capability()[0] >= 9
# tiny tiles, so that small vocabularies still span several tiles, splits and H chunks
configs = st.fixed_dictionaries(dict(
    BLOCK_N=st.sampled_from((16, 32)), BLOCK_V=st.sampled_from((16, 32)), BLOCK_K=st.sampled_from((16, 32)),
    tiles_per_split=st.integers(1, 3), BLOCK_S=st.sampled_from((None, 2, 4)), rows_major=st.booleans(),
    tma=st.booleans() if HAS_TMA else st.just(False), flatten=st.booleans(),
))


def _ints(shape, lo, hi, dtype, g):
    return torch.randint(lo, hi + 1, shape, generator=g).to(DEV, dtype)


def _row_strided(x: torch.Tensor) -> torch.Tensor:
    """x [N, W] as a view of rows 5 elements longer, their tails 100 (a kernel that took the rows as contiguous
    would read them)."""
    wide = torch.full((x.shape[0], x.shape[1] + 5), 100, dtype=x.dtype, device=x.device)
    wide[:, : x.shape[1]] = x
    return wide[:, : x.shape[1]]


def _drawn_ban(ban: str | None, N: int, V: int, g: torch.Generator) -> dict:
    """banned_tokens (about a third of the vocabulary) and ban_rows: none, in every row, or in some rows; or three
    classes of ban (uint8 bits), each row excluding drawn classes."""
    if ban is None:
        return {}
    if ban == "classes":
        classes = sum((torch.rand(V, generator=g) < 0.3).to(torch.uint8) << bit for bit in range(3))
        return dict(banned_tokens=classes.to(DEV), ban_rows=torch.randint(0, 8, (N,), generator=g).to(DEV, torch.uint8))
    return dict(banned_tokens=(torch.rand(V, generator=g) < 0.3).to(DEV),
                ban_rows=None if ban == "every row" else (torch.rand(N, generator=g) < 0.5).to(DEV))


def _check(out, expect, exact_tokens=True, prob_tol=1e-5, entropy=False):
    """The op's results ``out`` against ``expect``: (tokens, probs, lse), then with ``entropy`` the entropy, then with
    top_m the top logits and ids."""
    assert len(out) == len(expect)
    if entropy:
        assert out[3].dtype == torch.float32
        torch.testing.assert_close(out[3], expect[3], atol=1e-4, rtol=1e-4)
    if len(out) - entropy == 5:  # with top_m: exact (integer logits)
        top, ids = out[-2:]
        assert top.dtype == torch.float32 and ids.dtype == torch.int64
        assert torch.equal(top, expect[-2]) and torch.equal(ids, expect[-1]), (out[-2:], expect[-2:])
    tok, prob, lse = out[:3]
    assert tok.dtype == torch.int64 and prob.dtype == torch.float32 and lse.dtype == torch.float32
    if exact_tokens:
        assert torch.equal(tok, expect[0]), (tok, expect[0])
    torch.testing.assert_close(prob, expect[1], atol=prob_tol, rtol=1e-4)
    torch.testing.assert_close(lse, expect[2], atol=1e-4, rtol=1e-5)


@settings(max_examples=25)
@given(N=st.integers(1, 20), H=st.integers(1, 40), V=st.integers(2, 300), dtype=st.sampled_from(DTYPES),
       base=st.sampled_from((None, torch.float32, torch.bfloat16)), use_mask=st.booleans(),
       temperature=st.sampled_from((1.0, 0.5, 2.0)), cfg=configs, top_m=st.integers(0, 8), strided=st.booleans(),
       ban=st.sampled_from((None, "every row", "some rows", "classes")), entropy=st.booleans(),
       seed=st.integers(0, 2**16))
def test_exact_integer_logits_match_reference(N, H, V, dtype, base, use_mask, temperature, cfg, top_m, strided,
                                              ban, entropy, seed):
    """Every tile layout, with and without the top_m list (which makes every split one tile), banned tokens (in
    every row or some) and the entropy; hidden states and base logits also as row-strided views."""
    if cfg["tma"]:
        H = -(-H // 8) * 8  # TMA needs 16-byte aligned weight rows
    g = torch.Generator().manual_seed(seed)
    hidden = _ints((N, H), -2, 2, dtype, g)
    weight = _ints((V, H), -2, 2, dtype, g)
    base_logits = _ints((N, V), -4, 4, base, g) if base is not None else None
    if strided:
        hidden, base_logits = _row_strided(hidden), base_logits if base is None else _row_strided(base_logits)
    mask = int(torch.randint(0, V, (1,), generator=g)) if use_mask else None
    kw = dict(base_logits=base_logits, mask_token_id=mask, temperature=temperature, top_m=min(top_m, V),
              entropy=entropy, **_drawn_ban(ban, N, V, g))
    with poisoned_allocations():
        out = lm_head_confidence_triton(hidden, weight, config=cfg, **kw)
    expect = lm_head_confidence_reference(hidden, weight, **kw)
    _check(out, expect, entropy=entropy)
    if mask is not None:
        assert not (out[0] == mask).any()


@settings(max_examples=20)
@given(N=st.integers(1, 40), H=st.integers(1, 24), V=st.integers(2, 120), dtype=st.sampled_from(DTYPES),
       skip=st.sampled_from(("none", "all", "first", "last", "random")), with_base=st.booleans(),
       block_n=st.sampled_from((16, 32)), rows_major=st.booleans(), top_m=st.sampled_from((0, 1, 5)),
       ban=st.sampled_from((None, "every row", "some rows", "classes")), entropy=st.booleans(),
       penalty=st.sampled_from((None, 2.0, 0.5, "tensor")), offsets=st.booleans(), seed=st.integers(0, 2**16))
def test_skipped_rows_match_reference(N, H, V, dtype, skip, with_base, block_n, rows_major, top_m, ban, entropy,
                                      penalty, offsets, seed):
    """Skipped rows give (-1, 0, -inf; entropy +inf); the kept rows, gathered to the front on the device, give what they
    give unskipped, whichever row blocks they end up in; with a repetition penalty (a number, or 2 as a 0-d float64
    tensor) at the columns each row has seen (rows reading shared rows of the seen table), scaled in the tile; with
    logit offsets (rows of them read as the seen table's rows, alone or beside the penalty) and a logit bias added in
    the tile."""
    g = torch.Generator().manual_seed(seed)
    hidden = _ints((N, H), -2, 2, dtype, g)
    weight = _ints((V, H), -2, 2, dtype, g)
    base_logits = _ints((N, V), -4, 4, torch.float32, g) if with_base else None
    skip_rows = {"none": torch.zeros(N, dtype=torch.bool), "all": torch.ones(N, dtype=torch.bool),
                 "first": torch.arange(N) < N // 2, "last": torch.arange(N) >= N // 2,
                 "random": torch.rand(N, generator=g) < 0.5}[skip].to(DEV)
    bans = _drawn_ban(ban, N, V, g)
    if penalty is not None:  # small integers scaled by 2 or 0.5: still exact
        bans.update(repetition_penalty=torch.tensor(2.0, dtype=torch.float64, device=DEV) if penalty == "tensor" else
                    penalty, seen_tokens=(torch.rand(3, V, generator=g) < 0.4).to(DEV),
                    seen_rows=torch.randint(0, 3, (N,), generator=g).to(DEV))
    if offsets:  # small integers: still exact
        bans.update(logit_offsets=_ints((3, V), -3, 3, torch.float32, g),
                    logit_bias=_ints((V,), -2, 2, torch.float32, g),
                    seen_rows=bans.get("seen_rows", torch.randint(0, 3, (N,), generator=g).to(DEV)))
    kw = dict(base_logits=base_logits, mask_token_id=V - 1, skip_rows=skip_rows, top_m=min(top_m, V), entropy=entropy,
              **bans)
    with poisoned_allocations():
        cfg = dict(BLOCK_N=block_n, BLOCK_V=32, BLOCK_K=16, rows_major=rows_major)
        out = lm_head_confidence_triton(hidden, weight, config=cfg, **kw)
    expect = lm_head_confidence_reference(hidden, weight, **kw)
    _check(out, expect, entropy=entropy)
    assert (out[0][skip_rows] == -1).all() and (out[1][skip_rows] == 0).all() and (out[2][skip_rows] == -inf).all()
    if entropy:
        assert (out[3][skip_rows] == inf).all()
    if top_m:
        assert (out[-2][skip_rows] == -inf).all() and (out[-1][skip_rows] == -1).all()
    unskipped = lm_head_confidence_reference(hidden, weight, base_logits=base_logits, mask_token_id=V - 1, **bans)
    assert torch.equal(out[0][~skip_rows], unskipped[0][~skip_rows])


@settings(max_examples=15)
@given(N=st.integers(1, 100), block=st.sampled_from((16, 32, 1024)), density=st.sampled_from((0.0, 0.3, 0.9, 1.0)),
       seed=st.integers(0, 2**16))
def test_kept_rows_are_listed_first_in_order(N, block, density, seed):
    """The compaction behind skip_rows, over one or several chunks of BLOCK rows."""
    skip = (torch.rand(N, generator=torch.Generator().manual_seed(seed)) < density).to(DEV)
    order = torch.full((N,), -7, dtype=torch.int64, device=DEV)
    kept = torch.full((1,), -7, dtype=torch.int64, device=DEV)
    _kept_first_kernel[(1,)](skip.view(torch.uint8), order, kept, N, BLOCK=block)
    rows = torch.arange(N, device=DEV)
    assert order.tolist() == torch.cat([rows[~skip], rows[skip]]).tolist()
    assert kept.item() == int((~skip).sum())


def test_equals_softmax_max_with_default_tiles():
    g = torch.Generator().manual_seed(0)
    hidden = _ints((5, 64), -2, 2, torch.float32, g)
    weight = _ints((1500, 64), -2, 2, torch.float32, g)
    with poisoned_allocations():
        tok, prob, lse = lm_head_confidence_triton(hidden, weight)
    logits = hidden @ weight.T
    p, _ = torch.softmax(logits, dim=-1).max(-1)
    first_max = (logits == logits.max(-1, keepdim=True).values).int().argmax(-1)  # lowest index
    assert torch.equal(tok, first_max)
    torch.testing.assert_close(prob, p, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("layout", [{}, dict(rows_major=True),
                                    pytest.param(dict(tma=True, flatten=True), marks=pytest.mark.skipif(
                                        not HAS_TMA, reason="TMA needs sm_90 or newer"))])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [dict(tiles_per_split=2), dict(tiles_per_split=1, BLOCK_S=2)],
                         ids=["2-tile-splits", "1-tile-splits-merged-2-at-a-time"])
def test_constructed_ties_across_tiles_and_splits(dtype, layout, splits):
    # V = 200 with 16-wide tiles, 2 tiles per split: copies of the best row sit in the same tile
    # (5, 9), in a later tile of the same split (20), in later splits (70, 197); with 1-tile splits merged
    # BLOCK_S at a time, the copies sit in several merge chunks
    V, H = 200, 24
    g = torch.Generator().manual_seed(1)
    weight = _ints((V, H), -1, 1, dtype, g)
    for j in (5, 9, 20, 70, 197):
        weight[j] = 2
    hidden = torch.ones(3, H, dtype=dtype, device=DEV)
    cfg = dict(BLOCK_V=16, BLOCK_K=16, **splits, **layout)
    for mask, want in ((None, 5), (5, 9), (9, 5), (197, 5)):
        tok, prob, _ = lm_head_confidence_triton(hidden, weight, mask_token_id=mask, config=cfg)
        assert tok.tolist() == [want] * 3, (mask, tok)
        _check((tok, prob, _), lm_head_confidence_reference(hidden, weight, mask_token_id=mask))
    # the top-m list orders the tied copies by id across tiles and splits (each split one tile with top_m)
    *_, top, ids = lm_head_confidence_triton(hidden, weight, mask_token_id=9, top_m=5, config=cfg)
    assert ids.tolist() == [[5, 20, 70, 197, ids[0, 4].item()]] * 3 and (top[:, :4] == 2.0 * H).all()
    _check(lm_head_confidence_triton(hidden, weight, top_m=6, config=cfg),
           lm_head_confidence_reference(hidden, weight, top_m=6))
    # only the last copies survive once earlier ones are masked out via base logits
    base = torch.zeros(3, V, device=DEV)
    base[:, [5, 9, 20]] = -1.0
    tok, _, _ = lm_head_confidence_triton(hidden, weight, base_logits=base, config=cfg)
    assert tok.tolist() == [70] * 3


@settings(max_examples=20)
@given(N=st.integers(1, 6), V=st.integers(1, 60), top_m=st.integers(1, 64), spread=st.sampled_from((1, 3, 100)),
       use_mask=st.booleans(), seed=st.integers(0, 2**16))
def test_reference_top_m_is_the_sorted_prefix(N, V, top_m, spread, use_mask, seed):
    """The reference's top_m list, from its definition: the logits sorted by (value descending, id ascending),
    the mask token left out, -inf / -1 once a row runs out of tokens (few distinct values: many ties)."""
    top_m = min(top_m, V)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.ones(N, 1)
    weight = torch.randint(-spread, spread + 1, (V, 1), generator=g).float()
    mask = int(torch.randint(0, V, (1,), generator=g)) if use_mask and V > 1 else None
    *_, values, ids = lm_head_confidence_reference(hidden, weight, mask_token_id=mask, top_m=top_m)
    ranked = sorted((-float(weight[v, 0]), v) for v in range(V) if v != mask)[:top_m]
    want_ids = [v for _, v in ranked] + [-1] * (top_m - len(ranked))
    want_values = [-x for x, _ in ranked] + [-inf] * (top_m - len(ranked))
    assert ids.tolist() == [want_ids] * N and values.tolist() == [want_values] * N


def test_top_by_value_ties_minus_zero_with_zero():
    """-0.0 and 0.0 are equal logits: listed in increasing id, as every other tie (their bits differ)."""
    values, ids = top_by_value(torch.tensor([[-0.0, 0.0, 1.0, -0.0, -1.0]]), 5)
    assert ids.tolist() == [[2, 0, 1, 3, 4]] and values.tolist() == [[1.0, 0.0, 0.0, 0.0, -1.0]]


@pytest.mark.parametrize("mask", [None, 2])
def test_top_m_of_more_tokens_than_a_row_can_score_ends_with_minus_one(mask):
    """top_m = V with the mask token left out (or a row all -inf but its first tokens): the kernel lists the
    tokens it can score, then id -1 and value -inf, as the reference does."""
    hidden = torch.ones(2, 4, device=DEV)
    weight = torch.tensor([[1.0] * 4, [2.0] * 4, [3.0] * 4], device=DEV)
    base = torch.tensor([[0.0, 0.0, 0.0], [0.0, -inf, -inf]], device=DEV)
    for kw in (dict(mask_token_id=mask), dict(mask_token_id=mask, base_logits=base)):
        with poisoned_allocations():
            out = lm_head_confidence_triton(hidden, weight, top_m=3, **kw)
        expect = lm_head_confidence_reference(hidden, weight, top_m=3, **kw)
        _check(out, expect)
        assert (out[4] == -1).any() == (mask is not None or "base_logits" in kw)


@pytest.mark.parametrize("top_m", [0, 2])
@pytest.mark.parametrize("rows_major", [False, True])
def test_non_finite_logits_follow_confidences_rule(top_m, rows_major):
    """NaN counts as -inf (never chosen), +inf as the largest fp32 (ties to the lowest id), and a row with no finite
    logit gives token -1, prob 0, lse -inf (entropy +inf), as ``confidence`` defines it: through a NaN hidden state, an
    inf base logit, and base logits that leave nothing finite (the mask column is the row's only finite logit); two
    +inf logits share the mass (entropy log 2)."""
    hidden = torch.tensor([[1.0, 0.0], [float("nan"), 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 1.0]], device=DEV)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [1.0, -1.0]], device=DEV)
    base = torch.zeros(5, 4, device=DEV)
    base[0, 1] = float("nan")  # row 0: token 1 would win without the NaN
    base[0, 3] = 5.0
    base[2, [1, 3]] = inf  # row 2: two +inf logits, the lower id wins
    base[3, [0, 1, 3]] = -inf  # row 3: only the mask column (2) is finite
    base[4] = float("nan")  # row 4: nothing finite
    cfg = dict(BLOCK_N=16, BLOCK_V=16, BLOCK_K=16, tiles_per_split=1, rows_major=rows_major)
    with poisoned_allocations():
        out = lm_head_confidence_triton(hidden, weight, base_logits=base, mask_token_id=2, top_m=top_m, entropy=True,
                                        config=cfg)
    expect = lm_head_confidence_reference(hidden, weight, base_logits=base, mask_token_id=2, top_m=top_m, entropy=True)
    _check(out, expect, entropy=True)
    assert out[0].tolist() == [3, -1, 1, -1, -1] and out[1][[1, 3, 4]].tolist() == [0.0] * 3
    assert (out[2][[1, 3, 4]] == -inf).all() and torch.isfinite(out[1]).all()
    assert out[3][[1, 3, 4]].tolist() == [inf] * 3 and out[3][2].item() == pytest.approx(0.6931472)


@settings(max_examples=10)
@given(N=st.integers(1, 6), H=st.integers(1, 70), V=st.integers(2, 700), dtype=st.sampled_from(DTYPES),
       with_base=st.booleans(), seed=st.integers(0, 2**16))
def test_random_logits_close_to_reference(N, H, V, dtype, with_base, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(DEV, dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(DEV, dtype)
    base_logits = (torch.randn(N, V, generator=g) * 2).to(DEV) if with_base else None
    out = lm_head_confidence_triton(hidden, weight, base_logits=base_logits, mask_token_id=V // 2, entropy=True,
                                    config=dict(BLOCK_V=32, tiles_per_split=2))
    expect = lm_head_confidence_reference(hidden, weight, base_logits=base_logits, mask_token_id=V // 2, entropy=True)
    _check(out, expect, exact_tokens=False, prob_tol=1e-4, entropy=True)
    # the token may differ only on a near-tie: its reference logit must be the max within 1e-4
    z = hidden.to(weight.dtype).float() @ weight.float().T + (base_logits if with_base else 0)
    z[:, V // 2] = float("-inf")
    # the entropy is the categorical entropy of the softmax (an oracle other than the reference's formula)
    entropy = torch.distributions.Categorical(logits=z.double()).entropy()
    torch.testing.assert_close(out[3].double(), entropy, atol=2e-4, rtol=1e-4)
    picked = z.gather(1, out[0][:, None]).squeeze(1)
    torch.testing.assert_close(picked, z.max(-1).values, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("block_k", [32, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiles_fitted_to_a_small_shared_memory_match_reference(block_k, dtype):
    """Where a GPU's shared memory holds less than the table's tiles, ``_config`` halves the K tile (here down to
    ``block_k``, at a limit that holds just that): those tiles give the reference's picks too (odd sizes; K tiles
    that do not divide the hidden size)."""
    N, H, V = 13, 45, 301
    table = _table(N, V, H, dtype)
    assert table["num_stages"] == 1 and table["BLOCK_K"] > block_k  # the interpreter's table: one stage
    limit = (table["BLOCK_N"] + table["BLOCK_V"]) * block_k * dtype.itemsize + 4096
    config = _config(N, V, H, dtype, limit)
    assert config["BLOCK_K"] == block_k
    g = torch.Generator().manual_seed(block_k)
    hidden, weight = _ints((N, H), -2, 2, dtype, g), _ints((V, H), -2, 2, dtype, g)
    skip = torch.arange(N, device=DEV) % 3 == 1
    for top_m in (0, 5):
        kw = dict(mask_token_id=7, skip_rows=skip, top_m=top_m)
        with poisoned_allocations():
            out = lm_head_confidence_triton(hidden, weight, config=config, **kw)
        _check(out, lm_head_confidence_reference(hidden, weight, **kw))


@pytest.mark.triton
def test_public_dispatch_fp16_with_base_and_mask():
    g = torch.Generator().manual_seed(3)
    hidden = _ints((4, 33), -2, 2, torch.float16, g)
    weight = _ints((517, 33), -2, 2, torch.float16, g)
    base = _ints((4, 517), -3, 3, torch.bfloat16, g)
    kw = dict(base_logits=base, mask_token_id=100, temperature=0.5)
    with poisoned_allocations():
        out = lm_head_confidence(hidden, weight, **kw)
    _check(out, lm_head_confidence_reference(hidden, weight, **kw))


@pytest.mark.parametrize("operand", ["hidden", "weight", "base_logits"])
def test_column_strided_operands_match_reference(operand):
    """An operand whose columns are not adjacent (a transposed copy's view): the kernel reads rows with unit column
    stride, so the launcher must copy it first; the result is the reference's on the same values."""
    g = torch.Generator().manual_seed(11)
    args = dict(hidden=_ints((5, 24), -2, 2, torch.float32, g), weight=_ints((70, 24), -2, 2, torch.float32, g),
                base_logits=_ints((5, 70), -4, 4, torch.float32, g))
    args[operand] = args[operand].T.contiguous().T
    assert args[operand].stride(1) != 1
    hidden, weight = args.pop("hidden"), args.pop("weight")
    kw = dict(args, mask_token_id=3, top_m=4)
    out = lm_head_confidence_triton(hidden, weight, config=dict(BLOCK_V=32, BLOCK_K=16), **kw)
    _check(out, lm_head_confidence_reference(hidden, weight, **kw))


@pytest.mark.parametrize("op", [lm_head_confidence, lm_head_confidence_triton], ids=["reference", "triton"])
def test_hidden_is_cast_to_the_weight_dtype(op):
    """fp32 hidden states with a bf16 lm_head: the matmul runs on hidden rounded to bf16 (+-(1 + 2**-8) -> +-1, by
    any rounding), as ``F.linear`` in bf16 would, not on the fp32 values."""
    g = torch.Generator().manual_seed(12)
    hidden = ((torch.randint(0, 2, (3, 16), generator=g) * 2 - 1) * (1 + 2.0 ** -8)).to(DEV)
    weight = _ints((40, 16), -2, 2, torch.bfloat16, g)
    z = hidden.to(torch.bfloat16).float() @ weight.float().T
    assert (torch.logsumexp(hidden @ weight.float().T, -1) - torch.logsumexp(z, -1)).abs().min() > 1e-3
    tok, prob, lse = op(hidden, weight)
    assert torch.equal(tok, z.argmax(-1))
    torch.testing.assert_close(prob, z.softmax(-1).max(-1).values, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(z, -1), atol=1e-5, rtol=1e-6)


@pytest.mark.triton
def test_float64_runs_the_reference_in_float64(monkeypatch):
    """float64 weights go to the reference even where the backend is Triton, and are scored in float64: logits
    1 and 1 + 1e-9 (equal in fp32, where the lower id would win) pick the second. float32 reaches the kernel."""
    forbid_triton_launcher(monkeypatch, "lm_head_confidence")
    hidden = torch.ones(2, 2, dtype=torch.float64)
    weight = torch.tensor([[1.0, 0.0], [1.0, 1e-9], [0.5, 0.0]], dtype=torch.float64)
    z = hidden @ weight.T
    tok, prob, lse = lm_head_confidence(hidden, weight)
    assert tok.tolist() == [1, 1]
    torch.testing.assert_close(prob, z.softmax(-1).max(-1).values.float())
    torch.testing.assert_close(lse, torch.logsumexp(z, -1).float())
    with pytest.raises(AssertionError, match=LAUNCHER_RAN):
        lm_head_confidence(hidden.float(), weight.float())


@pytest.mark.parametrize("case", ["base_logits [V]", "weight [V, H + 1]", "hidden [1, N, H]", "empty vocabulary",
                                  "temperature 0", "mask_token_id V"])
def test_the_public_op_refuses_on_the_reference_path_what_its_kernel_refuses(case):
    """The reference (the CPU path) would broadcast base_logits [V] over the rows, a hidden [1, N, H] over the
    weight, score an empty vocabulary or divide by a zero temperature; the public op runs the launcher's checks
    first."""
    h, w = torch.randn(2, 8, device=DEV), torch.randn(10, 8, device=DEV)
    args, kwargs = {"base_logits [V]": ((h, w), dict(base_logits=torch.zeros(10, device=DEV))),
                    "weight [V, H + 1]": ((h, torch.randn(10, 9, device=DEV)), {}),
                    "hidden [1, N, H]": ((h[None], w), {}),
                    "empty vocabulary": ((h, w[:0]), {}),
                    "temperature 0": ((h, w), dict(temperature=0.0)),
                    "mask_token_id V": ((h, w), dict(mask_token_id=10))}[case]
    refused_alike(lm_head_confidence, lm_head_confidence_triton, *args, **kwargs)


@pytest.mark.parametrize("op", [lm_head_confidence, lm_head_confidence_triton])
@pytest.mark.parametrize("ban_rows", [None, [True, False, True, True]])
def test_banned_tokens_count_as_minus_infinity_base_logits(op, ban_rows):
    """A banned token in a banning row is excluded as a base logit of -inf would exclude it (never picked, not in
    the softmax, not listed in top_m); the most likely token of each row is banned, so every banning row changes."""
    torch.manual_seed(0)
    # quarters: every logit is exact in float32 whatever order its products are summed in (the top_m logits compare
    # exactly, and the kernel sums in tiles)
    hidden, weight = ((torch.randn(shape) * 4).round().div(4).to(DEV) for shape in ((4, 16), (50, 16)))
    banned = torch.zeros(50, dtype=torch.bool, device=DEV)
    banned[(hidden @ weight.T).argmax(-1)] = True
    rows = torch.ones(4, dtype=torch.bool, device=DEV) if ban_rows is None else torch.tensor(ban_rows, device=DEV)
    base = torch.zeros(4, 50, device=DEV).masked_fill(rows[:, None] & banned, -inf)
    out = op(hidden, weight, banned_tokens=banned, ban_rows=None if ban_rows is None else rows, top_m=5)
    _check(out, lm_head_confidence_reference(hidden, weight, base_logits=base, top_m=5), prob_tol=1e-6)
    assert not banned[out[0][rows]].any() and not banned[out[4][rows]].any()


@pytest.mark.parametrize("op", [lm_head_confidence, lm_head_confidence_triton])
def test_penalty_picks_as_the_confidence_op(op):
    """Under a repetition penalty and logit offsets the fused pick (and its top 5) is the confidence op's on the
    penalized logits: the penalty at the seen columns, then the offsets, before the temperature, each row reading its
    row of the seen table and of the offsets; the most likely token of every row is seen, so every row's pick
    changes."""
    from mrp_triton.reference.confidence import confidence as confidence_reference
    from mrp_triton.reference.confidence import offset, penalized

    torch.manual_seed(1)
    hidden, weight = torch.randn(6, 16, device=DEV), torch.randn(50, 16, device=DEV)
    logits = hidden @ weight.T
    seen = torch.zeros(3, 50, dtype=torch.bool, device=DEV)
    rows = torch.tensor([0, 1, 2, 0, 1, 2], device=DEV)
    seen[rows, logits.argmax(-1)] = True
    offsets = torch.randn(3, 50, device=DEV)
    kw = dict(repetition_penalty=3.0, seen_tokens=seen, seen_rows=rows, logit_offsets=offsets)
    out = op(hidden, weight, temperature=0.7, top_m=5, **kw)
    want = confidence_reference(logits.cpu(), temperature=0.7, **{k: v.cpu() if torch.is_tensor(v) else v
                                                                  for k, v in kw.items()})
    assert torch.equal(out[0].cpu(), want[0]) and (out[0] != logits.argmax(-1)).all()
    torch.testing.assert_close(out[1].cpu(), want[1], rtol=1e-5, atol=1e-6)
    top = (offset(penalized(logits, 3.0, seen, rows), offsets, rows) / 0.7).topk(5, dim=-1).values
    torch.testing.assert_close(out[3], top, rtol=1e-5, atol=1e-5)


def test_errors():
    h, w = torch.randn(2, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="hidden must be"):
        lm_head_confidence_triton(h[:, :7], w)
    with pytest.raises(ValueError, match="base_logits must be"):
        lm_head_confidence_triton(h, w, base_logits=torch.zeros(2, 9))
    with pytest.raises(ValueError, match="mask_token_id"):
        lm_head_confidence_triton(h, w, mask_token_id=10)
    with pytest.raises(ValueError, match="temperature"):
        lm_head_confidence_triton(h, w, temperature=0.0)
    with pytest.raises(ValueError, match="only the mask token"):
        lm_head_confidence_triton(h, w[:1], mask_token_id=0)
    for bad in (torch.zeros(3, dtype=torch.bool), torch.zeros(2), [False, True]):
        for op in (lm_head_confidence_triton, lm_head_confidence):
            with pytest.raises(ValueError, match="skip_rows must be a bool tensor of shape \\[2\\]"):
                op(h, w, skip_rows=bad)
    with pytest.raises(ValueError, match="tma=True needs 16-byte aligned weight rows, got rows of 20 bytes"):
        lm_head_confidence_triton(h[:, :5], w[:, :5].contiguous(), config=dict(tma=True))
    for bad in (-1, 65, 11, 2.0, True):
        for op in (lm_head_confidence_triton, lm_head_confidence):
            with pytest.raises(ValueError, match="top_m must be an int in \\[0, 10\\]"):
                op(h, w, top_m=bad)
    with pytest.raises(TypeError, match="weight must be fp32, fp16 or bf16"):
        lm_head_confidence_triton(h.double(), w.double())
    with pytest.raises(ValueError, match="hidden must be \\[N, H\\]"):
        lm_head_confidence_triton(h[:, :, None], w)
    with pytest.raises(ValueError, match="weight is on meta"):
        lm_head_confidence_triton(h, w.to("meta"))
    with pytest.raises(ValueError, match="empty vocabulary or hidden size"):
        lm_head_confidence_triton(h, w[:0])
    for op in (lm_head_confidence_triton, lm_head_confidence):
        with pytest.raises(ValueError, match="banned_tokens must be a bool or uint8 tensor of shape \\[10\\]"):
            op(h, w, banned_tokens=torch.zeros(9, dtype=torch.bool))
        with pytest.raises(ValueError, match="ban_rows must be a bool or uint8 tensor of shape \\[2\\]"):
            op(h, w, banned_tokens=torch.zeros(10, dtype=torch.bool), ban_rows=torch.ones(3, dtype=torch.bool))
        with pytest.raises(ValueError, match="pass banned_tokens too"):
            op(h, w, ban_rows=torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="empty vocabulary or hidden size"):
        lm_head_confidence_triton(h[:, :0], w[:, :0])
    with pytest.raises(TypeError, match="base_logits must be floating point"):
        lm_head_confidence_triton(h, w, base_logits=torch.zeros(2, 10, dtype=torch.int64))
    with pytest.raises(ValueError, match="base_logits is on meta"):
        lm_head_confidence_triton(h, w, base_logits=torch.zeros(2, 10, device="meta"))
    with pytest.raises(ValueError, match="mask_token_id -1 is outside"):
        lm_head_confidence_triton(h, w, mask_token_id=-1)
    with pytest.raises(ValueError, match="temperature must be a finite float in .*got nan"):
        lm_head_confidence_triton(h, w, temperature=float("nan"))
    tok, prob, lse = lm_head_confidence_triton(h[:0], w)
    assert tok.shape == prob.shape == lse.shape == (0,)
    *_, top, ids = lm_head_confidence_triton(h[:0], w, top_m=3)
    assert top.shape == ids.shape == (0, 3)
