"""select_commit: Triton kernel vs the torch reference and a plain-Python oracle."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mrp_triton as mt
from kernel_utils import DEV, draw_rows, draw_scores
from mrp_triton.reference.select import select_commit as select_ref
from mrp_triton.select import select_commit_triton

M = 50


def _oracle(block, tokens, conf, n, threshold, entropy=None, bound=None):
    """Plain-Python statement of the rule (one row at a time)."""
    B, L = block.shape
    out = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        nb = int(n[b]) if isinstance(n, torch.Tensor) else int(n)
        if nb <= 0:
            continue
        cands = [i for i in range(L) if block[b, i] == M and tokens[b, i] >= 0 and tokens[b, i] != M]
        if entropy is not None:  # lowest entropy first (NaN last), each while the entropies before sum to <= bound
            h = [float("inf") if entropy[b, i] != entropy[b, i] else float(entropy[b, i]) for i in range(L)]
            ranked = sorted(cands, key=lambda i: (h[i], i))
            within = [i for k, i in enumerate(ranked) if sum(h[j] for j in ranked[:k]) <= bound]
            out[b, sorted(set(within) | set(ranked[:nb]))] = True
            continue
        key = lambda i: (-(float("-inf") if conf[b, i] != conf[b, i] else float(conf[b, i])), i)  # noqa: E731
        top = sorted(cands, key=key)[:min(nb, len(cands))]
        chosen = top
        if threshold is not None:
            passed = [i for i in cands if conf[b, i] > threshold]
            if len(passed) >= min(nb, len(cands)):
                chosen = passed
        out[b, chosen] = True
    return out


@st.composite
def _cases(draw):
    B, L, g = draw_rows(draw)
    block = torch.randint(0, 10, (B, L), generator=g)
    block[torch.rand(B, L, generator=g) < draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))] = M
    tokens = torch.randint(-1, 12, (B, L), generator=g)
    tokens[torch.rand(B, L, generator=g) < 0.1] = M
    conf = draw_scores(draw, B, L, g)
    if draw(st.booleans()):
        n = draw(st.integers(0, 6))
    else:
        n = torch.randint(0, 6, (B,), generator=g)
    threshold = draw(st.sampled_from([None, 0.5, 1.0, 0.25, "entropy"]))
    entropy = bound = None
    if threshold == "entropy":  # multiples of 1/8: sums exact in any order, so kernel and oracle agree at the bound
        threshold = None
        entropy = torch.randint(0, 17, (B, L), generator=g).float() / 8
        entropy[torch.rand(B, L, generator=g) < 0.05] = float("nan")
        entropy[torch.rand(B, L, generator=g) < 0.05] = float("inf")  # ties with NaN (both rank last)
        bound = draw(st.sampled_from([0.0, 0.125, 0.5, 1.0, 3.0]))
    return block, tokens, conf, n, threshold, entropy, bound, draw(st.booleans()), draw(st.booleans())


@given(_cases())
def test_kernel_matches_reference_and_oracle(case):
    """Static, dynamic and entropy-bounded rules; a threshold or entropy bound given as a 0-d tensor (read on the
    device) decides as the float does."""
    block, tokens, conf, n, threshold, entropy, bound, poison, on_device = case
    name, value = ("entropy_bound", bound) if entropy is not None else ("threshold", threshold)
    as_given = (lambda dev: {name: torch.tensor(value, dtype=torch.float64, device=dev)}) if on_device and \
        value is not None else (lambda dev: {name: value})
    rule = (lambda dev: dict(entropy=entropy.to(dev), **as_given(dev))) if entropy is not None else as_given
    b_ref = block.clone()
    exp = select_ref(b_ref, tokens, conf, mask_token_id=M, n=n, **rule("cpu"))
    assert torch.equal(exp, _oracle(block, tokens, conf, n, threshold, entropy, bound))
    b_k = block.to(DEV)
    out = torch.full(block.shape, poison, dtype=torch.bool, device=DEV)
    nd = n.to(DEV) if isinstance(n, torch.Tensor) else n
    got = select_commit_triton(b_k, tokens.to(DEV), conf.to(DEV), mask_token_id=M, n=nd, **rule(DEV), out=out)
    assert torch.equal(got.cpu(), exp)
    assert torch.equal(b_k.cpu(), b_ref)
    assert torch.equal(b_ref[exp], tokens[exp])


def test_exact_cases():
    block = torch.tensor([[M, M, M, M, 1], [M, M, 2, M, M], [M, M, M, 3, 4], [5, 6, 7, 8, 9]])
    tokens = torch.tensor([[10, 11, 12, 13, 14]] * 4)
    conf = torch.tensor([[0.2, 0.9, 0.9, 0.1, 0.99],   # tie 0.9: lowest index first
                         [0.95, 0.97, 0.1, 0.2, 0.96],
                         [0.1, 0.3, 0.2, 0.9, 0.9],
                         [0.9, 0.9, 0.9, 0.9, 0.9]])
    for fn in (select_ref, select_commit_triton):
        b = block.clone().to(DEV)
        got = fn(b, tokens.to(DEV), conf.to(DEV), mask_token_id=M, n=torch.tensor([1, 1, 0, 2]).to(DEV))
        assert got.cpu().tolist() == [[False, True, False, False, False], [False, True, False, False, False],
                                      [False] * 5, [False] * 5]
        b = block.clone().to(DEV)
        got = fn(b, tokens.to(DEV), conf.to(DEV), mask_token_id=M, n=2, threshold=0.9)
        # row 0: none > 0.9 -> top 2; row 1: three pass; row 2: none -> top 2 (0.3, 0.2)
        assert got.cpu().tolist() == [[False, True, True, False, False], [True, True, False, False, True],
                                      [False, True, True, False, False], [False] * 5]
        assert b.cpu()[1].tolist() == [10, 11, 2, M, 14]


def test_exact_entropy_bounded_cases():
    """The EB rule by hand: rank by entropy (lowest first, ties lowest index), commit while the entropies ranked
    before sum to <= the bound (so the first always), or the first n when that is more; NaN entropy ranks last."""
    block = torch.tensor([[M, M, M, M, M], [M, M, 2, M, M], [M, M, M, M, M]])
    tokens = torch.tensor([[10, 11, 12, 13, 14]] * 3)
    entropy = torch.tensor([[0.5, 0.25, 1.0, 0.25, 2.0],   # ranked 1, 3, 0, 2, 4: sums before 0, .25, .5, 1, 2
                            [0.0, 0.0, 0.0, 3.0, 0.0],     # a committed position never counts
                            [float("nan"), 4.0, 4.0, 0.125, 0.125]])
    for fn in (select_ref, select_commit_triton):
        # row 1 at bound 0: entropy 3 ranks after three of 0, so the run (0, 0, 0, 3) has 0 without its largest
        for bound, rows in ((0.0, [[1], [0, 1, 3, 4], [3]]), (0.5, [[0, 1, 3], [0, 1, 3, 4], [1, 3, 4]]),
                            (1.0, [[0, 1, 2, 3], [0, 1, 3, 4], [1, 3, 4]]),
                            (100.0, [[0, 1, 2, 3, 4], [0, 1, 3, 4], [0, 1, 2, 3, 4]])):
            got = fn(block.clone().to(DEV), tokens.to(DEV), torch.zeros(3, 5, device=DEV), mask_token_id=M, n=1,
                     entropy=entropy.to(DEV), entropy_bound=bound)
            expected = torch.zeros(3, 5, dtype=torch.bool)
            for b, cols in enumerate(rows):
                expected[b, cols] = True
            assert torch.equal(got.cpu(), expected), (fn, bound, got)
        got = fn(block.clone().to(DEV), tokens.to(DEV), torch.zeros(3, 5, device=DEV), mask_token_id=M,
                 n=torch.tensor([3, 0, 1], device=DEV), entropy=entropy.to(DEV), entropy_bound=0.0)
        assert got.cpu().tolist() == [[True, True, False, True, False], [False] * 5,
                                      [False, False, False, True, False]]  # the first 3; inactive; the first


@pytest.mark.triton
def test_public_function_dispatches():
    block = torch.tensor([[M, M, 1]]).to(DEV)
    got = mt.select_commit(block, torch.tensor([[3, 4, 5]]).to(DEV), torch.tensor([[0.1, 0.5, 0.9]]).to(DEV),
                           mask_token_id=M, n=1)
    assert got.cpu().tolist() == [[False, True, False]] and block.cpu().tolist() == [[M, 4, 1]]


@pytest.mark.parametrize("fn", [select_ref, select_commit_triton])
def test_threshold_compares_in_fp32_as_float_or_tensor(fn):
    """conf = fp32(0.1) does not pass a threshold of 0.1, given as a float or as a float64 tensor (both rounded
    to fp32): the top n = 1 is committed; with 0.0999 both positions pass."""
    for threshold, committed in ((0.1, [[True, False]]), (0.0999, [[True, True]])):
        for value in (threshold, torch.tensor(threshold, dtype=torch.float64, device=DEV)):
            block = torch.full((1, 2), M, device=DEV)
            got = fn(block, torch.tensor([[3, 4]], device=DEV), torch.tensor([[0.1, 0.1]], device=DEV),
                     mask_token_id=M, n=1, threshold=value)
            assert got.cpu().tolist() == committed, (threshold, value)


@pytest.mark.parametrize("fn", [select_ref, select_commit_triton])
def test_confidences_rank_in_fp32(fn):
    """0.5 and 0.5001 differ in fp32 (though not in fp16): the higher one is committed, not the lower index; float64
    confidences closer than fp32 resolves tie, and the lower index wins."""
    for conf, committed in (([0.5, 0.5001], [[False, True]]), ([0.5, 0.5 + 1e-12], [[True, False]])):
        block = torch.full((1, 2), M, device=DEV)
        got = fn(block, torch.tensor([[3, 4]], device=DEV), torch.tensor([conf], dtype=torch.float64, device=DEV),
                 mask_token_id=M, n=1)
        assert got.cpu().tolist() == committed, conf


def test_errors():
    b, t, c = torch.full((2, 4), M), torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="threshold"):
        mt.select_commit(b, t, c, mask_token_id=M, n=1, threshold=0.0)
    with pytest.raises(ValueError, match="threshold"):
        mt.select_commit(b, t, c, mask_token_id=M, n=1, threshold=1.5)
    with pytest.raises(ValueError, match="threshold must be a number or a 0-d real tensor"):
        mt.select_commit(b, t, c, mask_token_id=M, n=1, threshold=torch.tensor([0.5]))
    with pytest.raises(ValueError, match="threshold must be a number or a 0-d real tensor"):
        mt.select_commit(b, t, c, mask_token_id=M, n=1, threshold=torch.tensor(True))
    with pytest.raises(ValueError, match="tokens"):
        mt.select_commit(b, t[:, :3], c, mask_token_id=M, n=1)
    with pytest.raises(ValueError, match="block"):
        mt.select_commit(b.int(), t, c, mask_token_id=M, n=1)
    with pytest.raises(ValueError, match="n must"):
        mt.select_commit(b, t, c, mask_token_id=M, n=torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="n must"):
        mt.select_commit(b, t, c, mask_token_id=M, n=1.0)
    with pytest.raises(ValueError, match=r"block must be an int64 tensor \[B, L\]"):
        mt.select_commit(b[None], t, c, mask_token_id=M, n=1)
    with pytest.raises(ValueError, match=r"conf must be a float tensor of block's shape \[2, 4\]"):
        mt.select_commit(b, t, t, mask_token_id=M, n=1)
    with pytest.raises(ValueError, match="tokens is on meta but block on cpu"):
        mt.select_commit(b, t.to("meta"), c, mask_token_id=M, n=1)
    with pytest.raises(TypeError, match="mask_token_id must be an int, got bool"):
        mt.select_commit(b, t, c, mask_token_id=True, n=1)
    with pytest.raises(ValueError, match="block must be contiguous"):
        select_commit_triton(torch.full((4, 2), M).t(), t, c, mask_token_id=M, n=1)
    with pytest.raises(ValueError, match="entropy and entropy_bound go together"):
        mt.select_commit(b, t, c, mask_token_id=M, n=1, entropy=c)
    with pytest.raises(ValueError, match="threshold .* and entropy_bound .* exclude each other"):
        mt.select_commit(b, t, c, mask_token_id=M, n=1, threshold=0.5, entropy=c, entropy_bound=0.5)
    for bound in (-0.1, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="entropy_bound must be a finite number >= 0"):
            mt.select_commit(b, t, c, mask_token_id=M, n=1, entropy=c, entropy_bound=bound)
    with pytest.raises(ValueError, match=r"entropy must be a float tensor of block's shape \[2, 4\]"):
        mt.select_commit(b, t, c, mask_token_id=M, n=1, entropy=c[:, :3], entropy_bound=0.5)
    with pytest.raises(ValueError, match="L=9000"):
        select_commit_triton(torch.full((1, 9000), M), torch.zeros(1, 9000, dtype=torch.int64), torch.zeros(1, 9000),
                             mask_token_id=M, n=1)


def test_long_row_matches_reference():
    g = torch.Generator().manual_seed(7)
    block = torch.full((2, 300), M)
    tokens = torch.randint(0, 9, (2, 300), generator=g)
    conf = (torch.rand(2, 300, generator=g) * 8).round() / 8
    b_ref, b_k = block.clone(), block.clone().to(DEV)
    exp = select_ref(b_ref, tokens, conf, mask_token_id=M, n=torch.tensor([5, 40]))
    got = select_commit_triton(b_k, tokens.to(DEV), conf.to(DEV), mask_token_id=M, n=torch.tensor([5, 40]).to(DEV))
    assert torch.equal(got.cpu(), exp) and torch.equal(b_k.cpu(), b_ref) and exp.sum().item() == 45
    entropy = (torch.rand(2, 300, generator=g) * 8).round() / 64  # 300 positions: sums over many [L, 16] tiles
    b_ref, b_k = block.clone(), block.clone().to(DEV)
    exp = select_ref(b_ref, tokens, conf, mask_token_id=M, n=1, entropy=entropy, entropy_bound=2.0)
    got = select_commit_triton(b_k, tokens.to(DEV), conf.to(DEV), mask_token_id=M, n=1, entropy=entropy.to(DEV),
                               entropy_bound=2.0)
    assert torch.equal(got.cpu(), exp) and torch.equal(b_k.cpu(), b_ref) and 1 < exp.sum().item() < 300
