"""transformers-style stopping criteria in block decoding: called as transformers' generate calls them, once after
each new token in order, as soon as every row has decoded that token for good (its block is full)."""

from __future__ import annotations

import torch

from .prompts import PromptBatch


class CriteriaCheck:
    """Calls each of ``criteria`` as ``criterion(input_ids, scores)`` for new-token steps t = 1, 2, ...: input_ids
    [B, W + t] is the batch as transformers' generate would pass it had decoding stopped at t new tokens: the input as
    given (W wide, each row's padding where it was), then each row's t new tokens (rows that ended earlier, by an EOS,
    a stop string or a criterion, hold padding past their end, as in transformers), so a criterion that reads the
    last column (transformers' ``EosTokenCriteria``, ``StopStringCriteria``) reads each row's newest token on a
    right-padded batch too (where the output puts a row's new tokens right after its prompt); ``scores`` is None (a
    block-diffusion step has no next-token scores). A criterion whose ``takes_confidences`` attribute is true
    is also passed ``confidences=``: float32 [B, W + t] laid out as input_ids, each new token's probability (as
    ``output_confidences`` gives it, which the call then needs), 0 at prompt and padding positions; one whose
    ``takes_top_logprobs`` attribute is true ``top_logprobs=`` and ``top_token_ids=``: float32 and int64 [B, W + t, k]
    laid out as input_ids, each new token's k most likely tokens and their log-probabilities (as
    ``output_top_logprobs=k`` gives them, which the call then needs), -inf and -1 elsewhere. A row ends at the first
    step at which a criterion's verdict (a bool, or a bool tensor [B]) holds for it; the calls stop once every row has
    ended."""

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
                     notes: dict[str, tuple[torch.Tensor, float]] | None = None) -> dict[int, int]:
        """Call the criteria for the steps every row has decoded since the last call (x: the decoded layout
        [B', total], its first B rows the prompts'; ``new_tokens_kept``: the rows that ended early, and how many
        new tokens each keeps; ``notes``: by keyword (``confidences``, ``top_logprobs``, ``top_token_ids``), each
        position's values laid out as x [B', total, ...] and the value off the new tokens, for the criteria that take
        them). Returns the rows the criteria end, and how many new tokens each keeps."""
        stopped: dict[int, int] = {}
        while self.called < min(self.decoded):  # (a row stopped here waits for no later step: the others may go on)
            ready = min(self.decoded)
            kept = self.prompts.kept_counts(x, ready, self.eos_ids, self.mask_id, {**new_tokens_kept, **stopped})
            for t in range(self.called + 1, ready + 1):
                if max(kept) < t:  # every row ended before this step: transformers' loop is over
                    self.called = self.max_new
                    return stopped
                shown = [min(k, t) for k in kept]
                input_ids = self.prompts.lay_out(x, shown, t, self.pad_id, appended=True)
                asked = {name for criterion in self.criteria for name in notes_taken(criterion)}
                extra = {name: self.prompts.lay_out(values, shown, t, pad, prompt=False, appended=True)
                         for name, (values, pad) in (notes or {}).items() if name in asked}
                verdicts = [self._verdict(criterion(input_ids, None, **{name: extra[name]
                                                                        for name in notes_taken(criterion)}),
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
        try:
            done = torch.as_tensor(verdict)
        except (TypeError, ValueError, RuntimeError):  # None, or what is no tensor's data
            done = None
        if done is None or done.dtype != torch.bool or done.dim() > 1 or done.numel() not in (1, rows):
            got = type(verdict).__name__ if done is None else f"{done.dtype} of shape {tuple(done.shape)}"
            raise ValueError(f"stopping_criteria must return a bool or a bool tensor [batch={rows}] (as transformers' "
                             f"criteria do), got {got}")
        return done.expand(rows).tolist()


def takes_confidences(criterion) -> bool:
    """Whether a stopping criterion asks for each new token's confidence (its ``takes_confidences`` attribute)."""
    return getattr(criterion, "takes_confidences", False) is True


def takes_top_logprobs(criterion) -> bool:
    """Whether a stopping criterion asks for each new token's most likely tokens (its ``takes_top_logprobs``
    attribute)."""
    return getattr(criterion, "takes_top_logprobs", False) is True


def notes_taken(criterion) -> tuple[str, ...]:
    """The keywords a stopping criterion is called with besides (input_ids, scores)."""
    return ("confidences",) * takes_confidences(criterion) + ("top_logprobs", "top_token_ids") * \
        takes_top_logprobs(criterion)
