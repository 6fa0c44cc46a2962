"""remask: Triton kernel vs the torch reference and a plain-Python oracle."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mrp_triton as mt
from kernel_utils import DEV, draw_rows, draw_scores
from mrp_triton.reference.remask import remask as remask_ref
from mrp_triton.remask import remask_triton

M = 99


def _oracle(revealed, score, thr, rule):
    B, L = revealed.shape
    out = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        rev = [i for i in range(L) if revealed[b, i]]
        s = [float(x) for x in score[b]]
        keep = [i for i in rev if (s[i] >= thr if rule == "tau" else s[i] <= thr)]
        if rev and not keep:
            def key(i):
                v = s[i] if s[i] == s[i] else (float("-inf") if rule == "tau" else float("inf"))
                return (-v if rule == "tau" else v, i)
            keep = [min(rev, key=key)]
        for i in rev:
            out[b, i] = i not in keep
    return out


@st.composite
def _cases(draw):
    B, L, g = draw_rows(draw)
    block = torch.randint(0, 20, (B, L), generator=g)
    revealed = torch.rand(B, L, generator=g) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    rule = draw(st.sampled_from(["tau", "delta"]))
    score = draw_scores(draw, B, L, g)
    if rule == "delta":
        score = score * 3
    # thresholds the scores can equal (quarters; for delta three times them), so the rules' >= / <= are checked
    thr = draw(st.sampled_from([0.5, 1.0, 0.25] if rule == "tau" else [0.5, 0.75, 1.5, 2.0]))
    return block, revealed, score, thr, rule, draw(st.booleans()), draw(st.booleans())


@given(_cases())
def test_kernel_matches_reference_and_oracle(case):
    """A threshold given as a 0-d tensor (read on the device) decides as the float does."""
    block, revealed, score, thr, rule, poison, on_device = case
    as_given = (lambda dev: torch.tensor(thr, dtype=torch.float64, device=dev)) if on_device else (lambda dev: thr)
    b_ref = block.clone()
    exp = remask_ref(b_ref, revealed, score, as_given("cpu"), mask_token_id=M, rule=rule)
    assert torch.equal(exp, _oracle(revealed, score, thr, rule))
    b_k = block.to(DEV)
    out = torch.full(block.shape, poison, dtype=torch.bool, device=DEV)
    got = remask_triton(b_k, revealed.to(DEV), score.to(DEV), as_given(DEV), mask_token_id=M, rule=rule, out=out)
    assert torch.equal(got.cpu(), exp)
    assert torch.equal(b_k.cpu(), b_ref)
    assert (b_ref[exp] == M).all() and torch.equal(b_ref[~exp], block[~exp])


def test_exact_cases():
    block = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    rev = torch.tensor([[True, True, False, True], [True, True, False, False], [False] * 4])
    score = torch.tensor([[0.6, 0.2, 0.0, 0.4], [0.3, 0.3, 0.99, 0.0], [0.0] * 4])
    for fn in (remask_ref, remask_triton):
        b = block.clone().to(DEV)
        got = fn(b, rev.to(DEV), score.to(DEV), 0.5, mask_token_id=M)
        # row 0 keeps 0.6; row 1: none pass -> keeps the best (tie -> index 0); row 2: nothing revealed
        assert got.cpu().tolist() == [[False, True, False, True], [False, True, False, False], [False] * 4]
        assert b.cpu().tolist() == [[1, M, 3, M], [5, M, 7, 8], [9, 10, 11, 12]]
        b = block.clone().to(DEV)
        got = fn(b, rev.to(DEV), score.to(DEV), 0.25, mask_token_id=M, rule="delta")
        # delta: keep |C| <= 0.25 -> row 0 keeps index 1; row 1: none -> smallest (tie -> index 0)
        assert got.cpu().tolist() == [[True, False, False, True], [False, True, False, False], [False] * 4]
        # none passes, distinct scores: tau keeps the largest (index 1), delta the smallest residual (index 1)
        for rule, scores in (("tau", [0.2, 0.4]), ("delta", [2.0, 1.0])):
            b = torch.tensor([[1, 2]], device=DEV)
            got = fn(b, torch.ones(1, 2, dtype=torch.bool, device=DEV), torch.tensor([scores], device=DEV), 0.5,
                     mask_token_id=M, rule=rule)
            assert got.cpu().tolist() == [[True, False]] and b.cpu().tolist() == [[M, 2]], rule


@pytest.mark.parametrize("fn", [remask_ref, remask_triton], ids=["reference", "triton"])
def test_threshold_equality_and_all_nan_rows(fn):
    """A score equal to the threshold passes under both rules (tau: >=, delta: <=); a row whose revealed scores are
    all NaN keeps its first revealed position (NaN counts as the worst score), not one it did not reveal."""
    block = torch.tensor([[1, 2, 3], [4, 5, 6]], device=DEV)
    rev = torch.tensor([[True, True, False], [False, True, True]], device=DEV)
    nan = float("nan")
    for rule, thr, row0 in (("tau", 0.5, [0.5, 0.75, 0.0]), ("delta", 1.0, [1.0, 0.5, 9.0])):
        b = block.clone()
        got = fn(b, rev, torch.tensor([row0, [0.1, nan, nan]], device=DEV), thr, mask_token_id=M, rule=rule)
        assert got.cpu().tolist() == [[False, False, False], [False, False, True]], rule
        assert b.cpu().tolist() == [[1, 2, 3], [4, 5, M]], rule


@pytest.mark.parametrize("fn", [remask_ref, remask_triton], ids=["reference", "triton"])
def test_scores_compare_with_the_threshold_in_fp32(fn):
    """float64 scores are rounded to fp32 first: 0.49999 stays below a 0.5 threshold (fp16 would round it to 0.5),
    0.5 - 1e-12 rounds to 0.5 and passes."""
    for below, remasked in ((0.49999, [[True, False]]), (0.5 - 1e-12, [[False, False]])):
        b = torch.tensor([[1, 2]], device=DEV)
        got = fn(b, torch.ones(1, 2, dtype=torch.bool, device=DEV),
                 torch.tensor([[below, 0.9]], dtype=torch.float64, device=DEV), 0.5, mask_token_id=M)
        assert got.cpu().tolist() == remasked, below


@pytest.mark.triton
def test_public_function_dispatches():
    b = torch.tensor([[1, 2]]).to(DEV)
    got = mt.remask(b, torch.tensor([[True, True]]).to(DEV), torch.tensor([[0.9, 0.1]]).to(DEV), 0.5,
                    mask_token_id=M)
    assert got.cpu().tolist() == [[False, True]] and b.cpu().tolist() == [[1, M]]


def test_errors():
    b, r, s = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.bool), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="rule"):
        mt.remask(b, r, s, 0.5, mask_token_id=M, rule="gamma")
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        mt.remask(b, r, s, 1.5, mask_token_id=M)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        mt.remask(b, r, s, 0.0, mask_token_id=M)
    with pytest.raises(ValueError, match="> 0"):
        mt.remask(b, r, s, 0.0, mask_token_id=M, rule="delta")
    with pytest.raises(ValueError, match="revealed"):
        mt.remask(b, r.int(), s, 0.5, mask_token_id=M)
    with pytest.raises(ValueError, match="score"):
        mt.remask(b, r, s[:, :2], 0.5, mask_token_id=M)
    with pytest.raises(ValueError, match="threshold must be a number or a 0-d real tensor"):
        mt.remask(b, r, s, torch.full((2,), 0.5), mask_token_id=M)
    with pytest.raises(ValueError, match="threshold is on meta"):
        mt.remask(b, r, s, torch.tensor(0.5, device="meta"), mask_token_id=M)
    with pytest.raises(TypeError, match="threshold"):
        mt.remask(b, r, s, "0.5", mask_token_id=M)
