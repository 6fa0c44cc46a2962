"""verify_drafts: Triton kernel vs the torch reference, a plain-Python oracle and exact greedy cases
(in the style of vLLM's rejection-sampler tests)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mrp_triton as mt
from mrp_triton.reference.verify import verify_drafts as verify_ref
from mrp_triton.verify import verify_drafts_triton

from kernel_utils import DEV

M = 77


def _pick(state, conf, tok):
    masked = [i for i in range(len(state)) if state[i] == M]
    if not masked:
        return -1, None
    c = [float("-inf") if x != x else float(x) for x in conf]
    pos = min(masked, key=lambda i: (-c[i], i))
    return pos, int(tok[pos])


def _oracle(block, dpos, dtok, ttok, tconf):
    B, L = block.shape
    K = dpos.shape[1]
    out = block.clone()
    acc, bonus = [], []
    for b in range(B):
        state = block[b].tolist()
        a = 0
        for k in range(K):
            pos, t = _pick(state, tconf[b, k], ttok[b, k])
            if pos < 0 or int(dpos[b, k]) != pos or int(dtok[b, k]) != t or t < 0 or t == M:
                break
            state[pos] = t
            a += 1
        pos, t = _pick(state, tconf[b, a], ttok[b, a])
        if pos >= 0 and t >= 0 and t != M:
            state[pos] = t
        else:
            pos = -1
        out[b] = torch.tensor(state)
        acc.append(a)
        bonus.append(pos)
    return out, torch.tensor(acc, dtype=torch.int32), torch.tensor(bonus)


def _drafts_following_targets(block, ttok, tconf, p_good, g):
    """Drafts that copy the backbone's pick with probability p_good (else a wrong pos/token/-1)."""
    B, L = block.shape
    K = ttok.shape[1] - 1
    dpos = torch.full((B, K), -1, dtype=torch.int64)
    dtok = torch.zeros((B, K), dtype=torch.int64)
    for b in range(B):
        state = block[b].tolist()
        for k in range(K):
            pos, t = _pick(state, tconf[b, k], ttok[b, k])
            r = torch.rand(1, generator=g).item()
            if pos < 0 or r > p_good + (1 - p_good) * 0.75:
                break  # no more drafts (rest stay -1)
            if r < p_good:
                dpos[b, k], dtok[b, k] = pos, t
                state[pos] = t
            elif r < p_good + (1 - p_good) * 0.4:
                dpos[b, k], dtok[b, k] = pos, t + 1        # right position, wrong token
            else:
                dpos[b, k], dtok[b, k] = (pos + 1) % L, t  # wrong position
    return dpos, dtok


@st.composite
def _cases(draw):
    B, K, L = draw(st.integers(1, 8)), draw(st.integers(1, 8)), draw(st.integers(1, 24))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    block = torch.randint(0, 30, (B, L), generator=g)
    block[torch.rand(B, L, generator=g) < draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))] = M
    ttok = torch.randint(0, 5, (B, K + 1, L), generator=g)
    ttok[torch.rand(B, K + 1, L, generator=g) < 0.03] = -1
    ttok[torch.rand(B, K + 1, L, generator=g) < 0.05] = M  # the backbone's pick may be the mask token itself
    if draw(st.booleans()):
        tconf = (torch.rand(B, K + 1, L, generator=g) * 3).round() / 3  # ties
    else:
        tconf = torch.rand(B, K + 1, L, generator=g)
    tconf[torch.rand(B, K + 1, L, generator=g) < 0.03] = float("nan")
    tconf[torch.rand(B, K + 1, generator=g) < draw(st.sampled_from([0.0, 0.3]))] = float("nan")  # whole states
    dpos, dtok = _drafts_following_targets(block, ttok, tconf, draw(st.sampled_from([0.0, 0.6, 1.0])), g)
    return block, dpos, dtok, ttok, tconf


def _run(fn, block, dpos, dtok, ttok, tconf, **kw):
    b = block.clone().to(DEV)
    acc, bonus = fn(b, dpos.to(DEV), dtok.to(DEV), ttok.to(DEV), tconf.to(DEV), mask_token_id=M, **kw)
    return b.cpu(), acc.cpu(), bonus.cpu()


@given(_cases())
def test_kernel_matches_reference_and_oracle(case):
    block, dpos, dtok, ttok, tconf = case
    exp = _oracle(block, dpos, dtok, ttok, tconf)
    ref = _run(verify_ref, *case)
    poison = (torch.full((block.shape[0],), -7777, dtype=torch.int32, device=DEV),
              torch.full((block.shape[0],), -7777, dtype=torch.int64, device=DEV))
    got = _run(verify_drafts_triton, *case, out=poison)
    for e, r, k in zip(exp, ref, got):
        assert torch.equal(e, r) and torch.equal(e, k), (e, r, k)


def _greedy_setup():
    """B=4 rows, L=4, K=2; the backbone's picks are fixed: pos 1 <- 11, then pos 3 <- 13, then pos 0 <- 10."""
    B, K, L = 4, 2, 4
    block = torch.tensor([[M, M, 5, M]] * B)
    ttok = torch.tensor([[10, 11, 12, 13]]).expand(B, K + 1, L).contiguous()
    tconf = torch.tensor([[0.5, 0.9, 0.0, 0.1],     # C(0): pick pos 1
                          [0.5, 0.0, 0.0, 0.9],     # C(1): pick pos 3 (pos 1 no longer masked)
                          [0.5, 0.0, 0.0, 0.0]])    # C(2): pick pos 0
    return block, ttok, tconf.expand(B, K + 1, L).contiguous()


@pytest.mark.parametrize("fn", [verify_ref, verify_drafts_triton], ids=["reference", "triton"])
def test_exact_greedy_cases(fn):
    block, ttok, tconf = _greedy_setup()
    dpos = torch.tensor([[1, 3],     # perfect match: 2 accepted + bonus (pos 0 on C(2))
                         [3, 1],     # first-position mismatch: 0 accepted, bonus = pick on C(0)
                         [-1, -1],   # empty draft: bonus only
                         [1, 3]])    # second draft has the wrong token: 1 accepted, bonus on C(1)
    dtok = torch.tensor([[11, 13], [13, 11], [0, 0], [11, 99]])
    b, acc, bonus = _run(fn, block, dpos, dtok, ttok, tconf)
    assert acc.tolist() == [2, 0, 0, 1]
    assert bonus.tolist() == [0, 1, 1, 3]
    assert b.tolist() == [[10, 11, 5, 13], [M, 11, 5, M], [M, 11, 5, M], [M, 11, 5, 13]]


@pytest.mark.parametrize("fn", [verify_ref, verify_drafts_triton], ids=["reference", "triton"])
def test_block_end_and_decoded_rows(fn):
    ttok = torch.tensor([[[1, 2], [3, 4]], [[1, 2], [3, 4]]])
    tconf = torch.tensor([[[0.9, 0.1], [0.2, 0.8]], [[0.9, 0.1], [0.2, 0.8]]])
    block = torch.tensor([[M, 7], [6, 7]])      # row 0: one mask left; row 1: fully decoded
    dpos = torch.tensor([[0], [0]])
    dtok = torch.tensor([[1], [1]])
    b, acc, bonus = _run(fn, block, dpos, dtok, ttok, tconf)
    assert acc.tolist() == [1, 0]                # row 0: draft accepted, C(1) has no mask left
    assert bonus.tolist() == [-1, -1]            # no bonus on a full block
    assert b.tolist() == [[1, 7], [6, 7]]


@pytest.mark.parametrize("fn", [verify_ref, verify_drafts_triton], ids=["reference", "triton"])
def test_nan_confidence_at_every_masked_position_picks_the_first_masked(fn):
    """NaN counts as -inf: when every masked position's confidence is NaN, the pick is the first masked position,
    never a decoded one (whose confidence is finite)."""
    nan = float("nan")
    block = torch.tensor([[5, M, M]])
    ttok = torch.tensor([[[1, 2, 3], [1, 2, 3]]])
    tconf = torch.tensor([[[0.9, nan, nan], [0.9, nan, nan]]])
    b, acc, bonus = _run(fn, block, torch.tensor([[1]]), torch.tensor([[2]]), ttok, tconf)
    assert acc.tolist() == [1] and bonus.tolist() == [2] and b.tolist() == [[5, 2, 3]]


@pytest.mark.parametrize("fn", [verify_ref, verify_drafts_triton], ids=["reference", "triton"])
def test_the_mask_token_or_no_token_is_never_accepted_or_written(fn):
    """Row 0: the backbone picks the mask token at pos 0 and the draft agrees: neither the draft nor the bonus is
    written. Row 1: the draft (pos 0 <- 3) is accepted, then the backbone's next pick is the mask token: no bonus.
    Row 2: as row 0 with -1 (confidence's "no finite candidate") for the mask token."""
    block = torch.tensor([[M, M], [M, M], [M, M]])
    ttok = torch.tensor([[[M, 4], [5, 6]], [[3, 4], [5, M]], [[-1, 4], [5, 6]]])
    tconf = torch.tensor([[[0.9, 0.1], [0.2, 0.8]]] * 3)
    dpos, dtok = torch.tensor([[0], [0], [0]]), torch.tensor([[M], [3], [-1]])
    b, acc, bonus = _run(fn, block, dpos, dtok, ttok, tconf)
    assert acc.tolist() == [0, 1, 0] and bonus.tolist() == [-1, -1, -1]
    assert b.tolist() == [[M, M], [3, M], [M, M]]


@pytest.mark.triton
def test_public_function_dispatches():
    block, ttok, tconf = _greedy_setup()
    b = block[:1].clone().to(DEV)
    acc, bonus = mt.verify_drafts(b, torch.tensor([[1, 3]]).to(DEV), torch.tensor([[11, 13]]).to(DEV),
                                  ttok[:1].to(DEV), tconf[:1].to(DEV), mask_token_id=M)
    assert acc.tolist() == [2] and bonus.tolist() == [0] and acc.dtype == torch.int32


def test_errors():
    block, ttok, tconf = _greedy_setup()
    d = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="target_tok"):
        mt.verify_drafts(block, d, d, ttok[:, :2], tconf, mask_token_id=M)
    with pytest.raises(ValueError, match="target_conf"):
        mt.verify_drafts(block, d, d, ttok, tconf[:, :, :3], mask_token_id=M)
    with pytest.raises(ValueError, match="draft_tok"):
        mt.verify_drafts(block, d, d[:, :1], ttok, tconf, mask_token_id=M)
    with pytest.raises(ValueError, match="K >= 1"):
        mt.verify_drafts(block, d[:, :0], d[:, :0], ttok[:, :1], tconf[:, :1], mask_token_id=M)
