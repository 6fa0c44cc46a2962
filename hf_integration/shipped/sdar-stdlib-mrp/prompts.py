"""Turn ``input_ids`` + ``attention_mask`` into per-row prompts, validated, and back into outputs."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


INDEX_DTYPES = (torch.int64, torch.int32)  # what token ids and positions may come as


def check_vocabulary_ids(ids: torch.Tensor, vocab_size: int, name: str = "input_ids", ignored: int | None = None,
                         fix: str = "check the tokenizer") -> None:
    """Raise a ValueError naming ``name`` if any of the token ``ids`` (any shape) but ``ignored`` lies outside
    [0, vocab_size)."""
    ids = ids if ignored is None else ids[ids != ignored]
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name} contain ids outside the vocabulary [0, {vocab_size}) "
                         f"(min {int(ids.min())}, max {int(ids.max())}); {fix}")


def check_padding_mask(attention_mask: torch.Tensor) -> None:
    """Raise a ValueError naming attention_mask unless it holds only 1 (a token) and 0 (padding), bool or not."""
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must hold 1 (a token) and 0 (padding) only, got "
                         f"{sorted(set(attention_mask.unique().tolist()) - {0, 1})[:4]}")


@dataclass
class PromptBatch:
    """Rows' real prompt tokens, compacted to the left.

    ids: [B, P] (prompt b in ``ids[b, :lengths[b]]``, P = the longest), lengths: [B] int64 (host list in ``lens``),
    left_padded: [B] bool (whether row b's padding was on the left in the input), width: the input's width W >= P
    (padded to a fixed length, it may have columns of padding in every row), which the output keeps."""

    ids: torch.Tensor
    lens: list[int]
    left_padded: list[bool]
    width: int

    @classmethod
    def from_inputs(cls, config, input_ids, attention_mask) -> "PromptBatch":
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
        if input_ids.dim() == 1:  # one prompt, and its mask if that is 1-D too
            input_ids = input_ids.unsqueeze(0)
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 1:
                attention_mask = attention_mask.unsqueeze(0)
        if input_ids.dim() != 2 or input_ids.dtype not in INDEX_DTYPES:
            raise ValueError(f"input_ids must be an integer tensor [batch, prompt_len], got shape "
                             f"{tuple(input_ids.shape)} dtype {input_ids.dtype}")
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty: give at least one prompt token per row")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            shape = getattr(attention_mask, "shape", None)
            raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}")
        if attention_mask.device != input_ids.device:
            raise ValueError(f"attention_mask is on {attention_mask.device} but input_ids on {input_ids.device}")
        check_padding_mask(attention_mask)
        keep = attention_mask.to(torch.bool)
        lens = keep.sum(1).tolist()
        if min(lens) == 0:
            row = lens.index(0)
            raise ValueError(f"row {row} of the prompt is empty or all padding: every row needs at least one token")
        real = input_ids[keep]
        check_vocabulary_ids(real, config.vocab_size)
        if (real == config.mask_token_id).any():
            raise ValueError(f"input_ids contain the mask token {config.mask_token_id}: prompts must be "
                             "fully given (the mask token is reserved for the positions being decoded)")
        ids = torch.zeros((input_ids.shape[0], max(lens)), dtype=torch.long, device=input_ids.device)
        left = []
        for b, n in enumerate(lens):
            where = keep[b].nonzero().flatten()
            if int(where[-1] - where[0]) + 1 != n:
                raise ValueError(f"attention_mask row {b} is not contiguous: pad on the left or on the right only")
            ids[b, :n] = input_ids[b, where]
            left.append(bool(where[0] > 0))
        return cls(ids=ids, lens=lens, left_padded=left, width=input_ids.shape[1])

    def block_ends(self, new_tokens: list[int], block: int, max_position_embeddings: int) -> list[int]:
        """Per row, the end of its last block: its prompt and its ``new_tokens`` (the most it decodes, one count a
        row) rounded up to whole blocks. Raises a ValueError when a row's end passes ``max_position_embeddings``."""
        ends = [(n + new + block - 1) // block * block for n, new in zip(self.lens, new_tokens, strict=True)]
        if max(ends) > max_position_embeddings:
            raise ValueError(f"prompt + max_new_tokens need {max(ends)} positions (rounded up to whole blocks of "
                             f"{block}) but the model has max_position_embeddings={max_position_embeddings}; "
                             "shorten the prompt or lower max_new_tokens")
        return ends

    def with_padding_rows(self, rows: int) -> "PromptBatch":
        """This batch and ``rows`` more one-token rows (row 0's first token) after it."""
        if rows == 0:
            return self
        pad = torch.zeros((rows, self.ids.shape[1]), dtype=self.ids.dtype, device=self.ids.device)
        pad[:, 0] = self.ids[0, 0]
        return PromptBatch(ids=torch.cat([self.ids, pad]), lens=self.lens + [1] * rows,
                           left_padded=self.left_padded + [False] * rows, width=self.width)

    def repeat(self, copies: int) -> "PromptBatch":
        """Each row ``copies`` times, the copies of a row next to each other ([B * copies, P])."""
        if copies == 1:
            return self
        return PromptBatch(ids=self.ids.repeat_interleave(copies, 0),
                           lens=[n for n in self.lens for _ in range(copies)],
                           left_padded=[left for left in self.left_padded for _ in range(copies)], width=self.width)

    def assemble(self, x: torch.Tensor, max_new_tokens: int, eos_ids: tuple[int, ...], pad_id: int,
                 mask_id: int, new_tokens_kept: dict[int, int]) -> tuple[torch.Tensor, list[int]]:
        """Decoded layout x [B', total] (its first B rows the prompts', each holding its prompt, then its new tokens)
        -> output [B, W + max_new_tokens] (W: the input's width), and per row the new tokens it keeps
        (:meth:`kept_counts`). Row b keeps its padding side; the tokens it does not keep become ``pad_id``."""
        kept = self.kept_counts(x, max_new_tokens, eos_ids, mask_id, new_tokens_kept)
        return self.lay_out(x, kept, max_new_tokens, pad_id), kept

    def kept_counts(self, x: torch.Tensor, max_new_tokens: int, eos_ids: tuple[int, ...], mask_id: int,
                    new_tokens_kept: dict[int, int]) -> list[int]:
        """Per row of the decoded layout x [B', total], the new tokens it keeps: up to its first EOS, at most
        ``max_new_tokens`` and its first ``new_tokens_kept[b]`` where given (a stop string, a criterion or
        ``max_time`` ended it, or it has a ``max_new_tokens`` of its own).
        One host read; raises a RuntimeError if a kept token is still the mask token."""
        B, device = len(self.lens), x.device
        steps = torch.arange(max_new_tokens, device=device)
        # [B, max_new_tokens] (clamped: a row with a limit of its own may end before the layout does)
        new = x[:B].gather(1, (self._row_layout[0].to(device)[:, None] + steps).clamp(max=x.shape[1] - 1))
        count = torch.tensor([min(new_tokens_kept.get(b, max_new_tokens), max_new_tokens) for b in range(B)],
                             device=device)
        if eos_ids:
            is_eos = torch.isin(new, torch.tensor(eos_ids, device=device))
            count = torch.where(is_eos, steps + 1, count[:, None]).amin(1)  # through the first EOS before the cut
        unfilled = ((new == mask_id) & (steps < count[:, None])).any(1)
        host = torch.cat([count, unfilled.long()]).tolist()
        if any(host[B:]):
            raise RuntimeError(f"row {host[B:].index(1)} still holds mask tokens after decoding: the model produced no "
                               "finite logits for some position")
        return host[:B]

    @cached_property
    def _row_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 [B] each on the ids' device, made once (the stopping criteria lay the output out at every step):
        each row's prompt length, and the output column its prompt starts at (past its left padding)."""
        device = self.ids.device
        return (torch.tensor(self.lens, device=device),
                torch.tensor([self.width - n if left else 0 for n, left in zip(self.lens, self.left_padded)],
                             device=device))

    def lay_out(self, x: torch.Tensor, kept: list[int], max_new_tokens: int, pad: int,
                prompt: bool = True, appended: bool = False) -> torch.Tensor:
        """Per-position values of the decoded layout x [B', total, ...] (row b's prompt positions first, then its new
        ones) -> [B, W + max_new_tokens, ...] (W: the input's width), as the output lays out tokens: row b's prompt
        (``prompt``; else ``pad`` there too), then its first ``kept[b]`` new positions, ``pad`` elsewhere, on the row's
        padding side (as transformers does: ``out[:, W:]`` are the new tokens of a left-padded batch). ``appended``:
        every row's new positions from column W on, after its input as given (a right-padded row's padding before
        them), as transformers' generate lays out what it passes its stopping criteria, whatever the padding side."""
        device = x.device
        lens, start = (t.to(device) for t in self._row_layout)
        lens, kept = lens[:, None], torch.tensor(kept, device=device)[:, None]
        column = torch.arange(self.width + max_new_tokens, device=device)
        source = column - start[:, None]  # [B, W + new]: x's column
        if appended:
            new = column >= self.width
            source = torch.where(new, lens + column - self.width, source)
            shown = torch.where(new, column - self.width < kept, (source >= 0) & (source < lens) & prompt)
        else:
            shown = (source >= (0 if prompt else lens)) & (source < lens + kept)
        rows = torch.arange(len(self.lens), device=device)[:, None]
        values = x[rows, source.clamp(0, x.shape[1] - 1)]
        shown = shown[(...,) + (None,) * (x.dim() - 2)]
        return torch.where(shown, values, torch.tensor(pad, dtype=x.dtype, device=device))
