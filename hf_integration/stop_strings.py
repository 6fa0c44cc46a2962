"""Stop strings: a row stops once its new text contains one of them (checked as its blocks fill)."""

from __future__ import annotations


class StopStrings:
    """``strings`` looked for in a row's new text, decoded with ``tokenizer.decode``."""

    def __init__(self, tokenizer, strings: tuple[str, ...]):
        self.tokenizer, self.strings = tokenizer, strings

    def _found(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return any(s in text for s in self.strings)

    def tokens_to_keep(self, new: list[int], checked: int) -> int | None:
        """new: a row's new token ids so far, the first ``checked`` of which held no stop string. Returns
        how many to keep (up to and with the token that completes the first stop string), or None."""
        if not self._found(new):
            return None
        return next(n for n in range(checked + 1, len(new) + 1) if self._found(new[:n]))
