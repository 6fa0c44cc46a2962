"""Stream one prompt's completion block by block to a transformers-style streamer (``put``/``end``)."""

from __future__ import annotations

import torch


class BlockStream:
    """Sends ``prompt`` [P] first, then each finished block's new tokens: positions P .. P + max_new - 1,
    cut after the first EOS (kept, as ``generate`` keeps it), then ``end()`` once. Blocks of
    ``block_length`` come in order, the first one holding position P."""

    def __init__(self, streamer, prompt: torch.Tensor, max_new_tokens: int, eos_ids: tuple[int, ...],
                 block_length: int):
        self.streamer, self.eos_ids = streamer, set(eos_ids)
        self.start, self.stop = prompt.shape[0], prompt.shape[0] + max_new_tokens
        self.next_position = self.start // block_length * block_length
        self.done = False
        streamer.put(prompt.cpu())

    def cut(self, new_tokens: int) -> None:
        """Stream no more than the first ``new_tokens`` new tokens (a stop string or criterion ended the row)."""
        self.stop = min(self.stop, self.start + new_tokens)

    def block(self, tokens: torch.Tensor) -> None:
        """tokens: [T], the next finished block."""
        first_position = self.next_position
        self.next_position += tokens.shape[0]
        if self.done:
            return
        lo = max(self.start - first_position, 0)
        hi = min(self.stop - first_position, tokens.shape[0])
        new = tokens[lo:hi].tolist() if hi > lo else []
        for i, token in enumerate(new):
            if token in self.eos_ids:
                new, self.done = new[: i + 1], True
                break
        self.done = self.done or first_position + tokens.shape[0] >= self.stop
        if new:
            self.streamer.put(torch.tensor(new, dtype=torch.long))

    def end(self) -> None:
        self.streamer.end()
