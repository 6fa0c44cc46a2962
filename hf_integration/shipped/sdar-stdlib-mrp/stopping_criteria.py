"""transformers-style stopping criteria in block decoding: called as transformers' generate calls them, once after
each new token in order, as soon as every row has decoded that token for good (its block is full)."""

from __future__ import annotations

import torch

from .prompts import PromptBatch


class CriteriaCheck:
    """Calls each of ``criteria`` as ``criterion(input_ids, scores)`` for new-token steps t = 1, 2, ...: input_ids
    [B, W + t] is the batch as the output would lay it out had decoding stopped at t new tokens (rows that ended
    earlier, by an EOS, a stop string or a criterion, hold padding past their end, as in transformers), ``scores`` is
    None (a block-diffusion step has no next-token scores). A criterion whose ``takes_confidences`` attribute is true
    is also passed ``confidences=``: float32 [B, W + t] laid out as input_ids, each new token's probability (as
    ``output_confidences`` gives it, which the call then needs), 0 at prompt and padding positions. A row ends at the
    first step at which a criterion's verdict (a bool, or a bool tensor [B]) holds for it; the calls stop once every
    row has ended."""

    def __init__(self, criteria, prompts: PromptBatch, max_new_tokens: int, eos_ids: tuple[int, ...], pad_id: int,
                 mask_id: int):
        self.criteria, self.prompts = criteria, prompts
        self.max_new, self.eos_ids, self.pad_id, self.mask_id = max_new_tokens, eos_ids, pad_id, mask_id
        self.decoded = [0] * len(prompts.lens)  # per row: new tokens decoded for good (all of them once it ended)
        self.called = 0  # the steps the criteria were called for

    def row_decoded(self, row: int, new_tokens: int) -> None:
        """Row ``row`` has decoded its first ``new_tokens`` new tokens for good (``max_new_tokens`` once it ended; a
        row the criteria stopped counts as ended already)."""
        self.decoded[row] = max(self.decoded[row], min(new_tokens, self.max_new))

    def stopped_rows(self, x: torch.Tensor, new_tokens_kept: dict[int, int],
                     confidences: torch.Tensor | None = None) -> dict[int, int]:
        """Call the criteria for the steps every row has decoded since the last call (x: the decoded layout
        [B', total], its first B rows the prompts'; ``new_tokens_kept``: the rows that ended early, and how many
        new tokens each keeps; ``confidences``: each position's, laid out as x, for the criteria that take them).
        Returns the rows the criteria end, and how many new tokens each keeps."""
        stopped: dict[int, int] = {}
        while self.called < min(self.decoded):  # (a row stopped here waits for no later step: the others may go on)
            ready = min(self.decoded)
            kept = self.prompts.kept_counts(x, ready, self.eos_ids, self.mask_id, {**new_tokens_kept, **stopped})
            for t in range(self.called + 1, ready + 1):
                if max(kept) < t:  # every row ended before this step: transformers' loop is over
                    self.called = self.max_new
                    return stopped
                shown = [min(k, t) for k in kept]
                input_ids = self.prompts.lay_out(x, shown, t, self.pad_id)
                extra = {"confidences": self.prompts.lay_out(confidences, shown, t, 0, prompt=False)} \
                    if confidences is not None and any(map(takes_confidences, self.criteria)) else {}
                verdicts = [self._verdict(criterion(input_ids, None, **(extra if takes_confidences(criterion) else {})),
                                          len(kept)) for criterion in self.criteria]
                for b, done in enumerate(map(any, zip(*verdicts))):
                    if done and kept[b] >= t:
                        kept[b] = stopped[b] = t
                        self.decoded[b] = self.max_new  # its tokens are all there
            self.called = ready
        return stopped

    @staticmethod
    def _verdict(verdict, rows: int) -> list[bool]:
        """A criterion's verdict (a bool, or a bool tensor [rows] or [1]) as one bool per row."""
        done = torch.as_tensor(verdict)
        if done.dtype != torch.bool or done.dim() > 1 or done.numel() not in (1, rows):
            raise ValueError(f"stopping_criteria must return a bool or a bool tensor [batch={rows}] (as transformers' "
                             f"criteria do), got {done.dtype} of shape {tuple(done.shape)}")
        return done.expand(rows).tolist()


def takes_confidences(criterion) -> bool:
    """Whether a stopping criterion asks for each new token's confidence (its ``takes_confidences`` attribute)."""
    return getattr(criterion, "takes_confidences", False) is True
