"""settle_rows: Triton kernel vs the torch reference and a plain-Python oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mrp_triton as mt
from kernel_utils import DEV, draw_rows
from mrp_triton.reference.settle import settle_rows as settle_ref
from mrp_triton.settle import settle_rows_triton

M, FILLER, V = 9, 0, 12


def _oracle(block, positions, starts, ends, eos_ids):
    block, ends = block.clone(), ends.clone()
    for b in range(block.shape[0]):
        row, at = block[b].tolist(), positions[b].tolist()
        new_eos = [p for t, p in zip(row, at) if t in eos_ids and p >= starts[b]]
        if new_eos:
            ends[b] = min(int(ends[b]), min(new_eos) + 1)
        if not any(t == M and p < ends[b] for t, p in zip(row, at)):
            block[b] = torch.tensor([FILLER if t == M else t for t in row])
    return block, ends


@st.composite
def _cases(draw):
    B, L, g = draw_rows(draw, max_len=24)
    # tokens 0..M: masks (M) at a drawn rate (none, some, all), the rest ids that may be EOS
    block = torch.randint(0, M, (B, L), generator=g)
    block[torch.rand(B, L, generator=g) < draw(st.sampled_from([0.0, 0.4, 1.0]))] = M
    first = torch.randint(0, 40, (B, 1), generator=g) // 4 * 4
    positions = first + torch.arange(L)  # a block of positions per row
    starts = first[:, 0] + torch.randint(0, L + 1, (B,), generator=g)  # the prompt ends inside the block or after
    # the output ends before the block, inside it or past it
    ends = (first[:, 0] + torch.randint(-3, L + 2, (B,), generator=g)).clamp(min=0)
    eos_ids = draw(st.sets(st.integers(0, V - 1).filter(lambda i: i != M), max_size=3))
    return block, positions, starts, ends, eos_ids


@given(_cases())
def test_kernel_matches_reference_and_oracle(case):
    block, positions, starts, ends, eos_ids = case
    is_eos = torch.zeros(V, dtype=torch.bool)
    is_eos[list(eos_ids)] = True
    want_block, want_ends = _oracle(block, positions, starts, ends, eos_ids)
    b_ref, e_ref = block.clone(), ends.clone()
    settle_ref(b_ref, positions, starts, e_ref, is_eos, mask_token_id=M, filler=FILLER)
    assert torch.equal(b_ref, want_block) and torch.equal(e_ref, want_ends)
    b_k, e_k = block.to(DEV), ends.to(DEV)
    settle_rows_triton(b_k, positions.to(DEV), starts.to(DEV), e_k, is_eos.to(DEV), mask_token_id=M, filler=FILLER)
    assert torch.equal(b_k.cpu(), want_block) and torch.equal(e_k.cpu(), want_ends)


def test_exact_rows():
    """Block positions 8..11, new tokens from 9 (position 8 is the prompt's), EOS id 3, mask 9."""
    block = torch.tensor([[3, M, 5, M],    # EOS in the prompt: ends nothing, masks before the end stay
                          [1, 3, M, M],    # EOS at 9: settled, the masks behind it filled
                          [1, M, 3, M],    # EOS at 10 with a mask before it: not settled yet
                          [1, 2, 3, 3],    # two EOS: the first ends it
                          [1, 2, M, M],    # no EOS, the end at 10: settled
                          [3, 3, 3, 3]])   # EOS past an end before the block: the end stays
    positions = torch.arange(8, 12).expand(6, -1).contiguous()
    starts = torch.full((6,), 8)
    starts[:5] = 9
    ends = torch.tensor([12, 12, 12, 12, 10, 8])
    is_eos = torch.zeros(V, dtype=torch.bool)
    is_eos[3] = True
    for op in (settle_ref, settle_rows_triton):
        b, e = block.clone().to(DEV), ends.clone().to(DEV)
        op(b, positions.to(DEV), starts.to(DEV), e, is_eos.to(DEV), mask_token_id=M, filler=FILLER)
        assert e.tolist() == [12, 10, 11, 11, 10, 8]
        assert b.tolist() == [[3, M, 5, M], [1, 3, 0, 0], [1, M, 3, M], [1, 2, 3, 3], [1, 2, 0, 0], [3, 3, 3, 3]]


@pytest.mark.parametrize("fn", [settle_ref, settle_rows_triton], ids=["reference", "triton"])
@pytest.mark.parametrize("L", [16, 32])
def test_an_end_before_a_block_of_eos_stays(fn, L):
    """A full block (no padding lanes in the kernel) of new EOS tokens past the row's end leaves the end as it is."""
    is_eos = torch.zeros(V, dtype=torch.bool, device=DEV)
    is_eos[3] = True
    block = torch.full((1, L), 3, device=DEV)
    ends = torch.tensor([L], device=DEV)
    fn(block, torch.arange(L, 2 * L, device=DEV)[None], torch.tensor([L], device=DEV), ends, is_eos,
       mask_token_id=M, filler=FILLER)
    assert ends.tolist() == [L]


@pytest.mark.triton
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_public_op_runs_the_backend_asked_for(backend, monkeypatch):
    import mrp_triton.settle as settle_module

    ran = []
    for name in ("settle_rows_triton", "settle_rows_reference"):
        monkeypatch.setattr(settle_module, name, lambda *a, _name=name, **k: ran.append(_name))
    block = torch.tensor([[1, 3, M, M]], device=DEV)
    with mt.use_backend(backend):
        mt.settle_rows(block, torch.arange(4, device=DEV)[None], torch.zeros(1, dtype=torch.long, device=DEV),
                       torch.tensor([4], device=DEV), torch.arange(V, device=DEV) == 3, mask_token_id=M, filler=FILLER)
    assert ran == [f"settle_rows_{backend}"]


def test_the_kernel_refuses_a_strided_ends_it_would_write_through():
    ends = torch.tensor([[4, 100], [4, 100]])[:, 0]
    with pytest.raises(ValueError, match="ends must be contiguous"):
        settle_rows_triton(torch.tensor([[1, 3, M, M], [1, 2, M, M]]), torch.arange(4).expand(2, 4).contiguous(),
                           torch.zeros(2, dtype=torch.long), ends, torch.arange(V) == 3, mask_token_id=M, filler=FILLER)


@pytest.mark.parametrize("change, match", [
    (dict(positions=torch.zeros(2, 3, dtype=torch.long)), "positions must be an int64 tensor of block's shape"),
    (dict(starts=torch.zeros(3, dtype=torch.long)), r"starts must be an int64 tensor \[2\]"),
    (dict(ends=torch.zeros(2, dtype=torch.int32)), r"ends must be an int64 tensor \[2\]"),
    (dict(is_eos=torch.zeros(V, dtype=torch.long)), "is_eos must be a bool tensor"),
    (dict(filler=M), "filler must be a token id .* other than the mask token"),
])
def test_bad_arguments_are_named(change, match):
    args = dict(block=torch.zeros(2, 4, dtype=torch.long), positions=torch.zeros(2, 4, dtype=torch.long),
                starts=torch.zeros(2, dtype=torch.long), ends=torch.zeros(2, dtype=torch.long),
                is_eos=torch.zeros(V, dtype=torch.bool), filler=FILLER)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        mt.settle_rows(args.pop("block"), args.pop("positions"), args.pop("starts"), args.pop("ends"),
                       args.pop("is_eos"), mask_token_id=M, **args)
