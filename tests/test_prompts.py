"""The output's assembly from a decoded layout (hf_integration.prompts.PromptBatch): the new tokens each row keeps,
and the rows laid out on their padding side."""

from __future__ import annotations

import pytest
import torch

from hf_integration.prompts import PromptBatch

MASK, PAD = 99, 0


def _batch() -> tuple[PromptBatch, torch.Tensor]:
    """Three prompts (lengths 2, 3, 1; the first and last left-padded, the middle right-padded) in an input 4 wide,
    and a decoded layout x [4, 10] (a fourth, padding row after them) holding each prompt, then new tokens 10, 11,
    ... (row b's i-th new token is 10 * (b + 1) + i)."""
    lens = [2, 3, 1]
    ids = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]])
    x = torch.full((4, 10), MASK)
    for b, n in enumerate(lens):
        x[b, :n] = ids[b, :n]
        x[b, n:] = 10 * (b + 1) + torch.arange(10 - n)
    return PromptBatch(ids=ids, lens=lens, left_padded=[True, False, True], width=4), x


def test_kept_counts_stop_at_the_first_eos_the_cut_or_max_new_tokens():
    prompts, x = _batch()
    assert prompts.kept_counts(x, 5, (), MASK, {}) == [5, 5, 5]
    assert prompts.kept_counts(x, 5, (12, 31), MASK, {}) == [3, 5, 2]  # row 0's EOS 12 is its third new token
    assert prompts.kept_counts(x, 5, (12, 31), MASK, {0: 2, 1: 4, 2: 9}) == [2, 4, 2]  # a cut before the EOS wins
    assert prompts.kept_counts(x, 2, (12,), MASK, {}) == [2, 2, 2]  # an EOS past max_new_tokens is not kept


def test_a_kept_mask_token_is_an_error_naming_the_row_and_one_past_the_cut_is_not():
    prompts, x = _batch()
    x[1, 3 + 2] = MASK  # row 1's third new token
    assert prompts.kept_counts(x, 5, (), MASK, {1: 2}) == [5, 2, 5]
    with pytest.raises(RuntimeError, match="row 1 still holds mask tokens"):
        prompts.kept_counts(x, 5, (), MASK, {})


def test_lay_out_puts_each_row_on_its_padding_side():
    prompts, x = _batch()
    out, kept = prompts.assemble(x, 3, (12,), PAD, MASK, {2: 1})
    assert kept == [3, 3, 1]
    assert out.tolist() == [[0, 0, 1, 2, 10, 11, 12],
                            [3, 4, 5, 20, 21, 22, 0],
                            [0, 0, 0, 6, 30, 0, 0]]
    # 7 new tokens: the right-padded row's last output column lies past x's width (the input is wider than its
    # longest prompt), which no kept token reaches
    assert prompts.lay_out(x, [7] * 3, 7, PAD)[1].tolist() == [3, 4, 5, 20, 21, 22, 23, 24, 25, 26, 0]
    assert prompts.lay_out(x, kept, 3, pad=-1, prompt=False).tolist() == [[-1, -1, -1, -1, 10, 11, 12],
                                                                          [-1, -1, -1, 20, 21, 22, -1],
                                                                          [-1, -1, -1, -1, 30, -1, -1]]
