"""Turn ``input_ids`` + ``attention_mask`` into per-row prompts, validated, and back into outputs."""

from __future__ import annotations

from dataclasses import dataclass

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

    def block_ends(self, max_new_tokens: int, block: int, max_position_embeddings: int) -> list[int]:
        """Per row, the end of its last block: its prompt and ``max_new_tokens`` rounded up to whole blocks.
        Raises a ValueError when a row's end passes ``max_position_embeddings``."""
        ends = [(n + max_new_tokens + block - 1) // block * block for n in self.lens]
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
        """Decoded layout x [B, total] -> output [B, W + max_new_tokens] (W: the input's width), and per row the new
        tokens it keeps.

        Row b keeps its padding side; tokens after its first EOS, and after its first
        ``new_tokens_kept[b]`` new tokens (a stop string or criterion ended it), become ``pad_id``."""
        kept = []
        for b, n in enumerate(self.lens):
            new = x[b, n : n + max_new_tokens]
            count = min(new_tokens_kept.get(b, max_new_tokens), max_new_tokens)
            if eos_ids:
                is_eos = torch.isin(new[:count], torch.tensor(eos_ids, device=new.device))
                if is_eos.any():
                    count = int(is_eos.nonzero()[0]) + 1
            if (new[:count] == mask_id).any():
                raise RuntimeError(f"row {b} still holds mask tokens after decoding: the model produced no "
                                   "finite logits for some position")
            kept.append(count)
        return self.lay_out(x, kept, max_new_tokens, pad_id), kept

    def lay_out(self, x: torch.Tensor, kept: list[int], max_new_tokens: int, pad: int,
                prompt: bool = True) -> torch.Tensor:
        """Per-position values of the decoded layout x [B, total] -> [B, W + max_new_tokens] (W: the input's width), as
        the output lays out tokens: row b's prompt (``prompt``; else ``pad`` there too), then its first ``kept[b]`` new
        positions, ``pad`` elsewhere, on the row's padding side (as transformers does: ``out[:, W:]`` are the new
        tokens of a left-padded batch)."""
        B, P = self.ids.shape[0], self.width
        out = torch.full((B, P + max_new_tokens), pad, dtype=x.dtype, device=x.device)
        for b, (n, count) in enumerate(zip(self.lens, kept)):
            start = P - n if self.left_padded[b] else 0
            if prompt:
                out[b, start : start + n] = self.ids[b, :n]
            out[b, start + n : start + n + count] = x[b, n : n + count]
        return out
