"""Stop strings: a row stops once its new text contains one of them (checked as its blocks fill)."""

from __future__ import annotations


class StopStrings:
    """``strings`` looked for in one row's new text (``tokenizer.decode(new ids, skip_special_tokens=False)``), its
    new tokens given a block at a time (:meth:`tokens_to_keep`), in time linear in their number.

    Each block decodes a window: the block's ids after those of the text before it, as context (the incremental
    detokenizing of TGI and vLLM), up to its last token that ends a whole character (a text not ending with U+FFFD,
    the decode's mark of a character whose UTF-8 bytes have not all come); the strings are looked for in that text
    after the last ``longest - 1`` characters before it. Tokens after it are decoded again with the next block.
    This finds the first token after which the whole text holds a stop string wherever decoding a window that
    starts on a whole character gives the characters' text in the whole: a byte-level BPE (Qwen's, SDAR's), or
    SentencePiece with byte fallback. (A stop string with U+FFFD in it is looked for in whole characters' text.)"""

    def __init__(self, tokenizer, strings: tuple[str, ...]):
        self.tokenizer, self.strings = tokenizer, strings
        self.longest = max(map(len, strings))
        self.ids: list[int] = []  # the row's new ids so far
        self.start = 0  # the window: ids[start:], the text after that of ids[start:read] is the new one
        self.read = 0
        self.tail = ""  # the last characters (longest - 1 at most) of the text of ids[:read]

    def _text_after_context(self, end: int, context: str) -> str:
        """The text of ``ids[read:end]``: the window up to ``end`` decoded, less its ``context`` (ids[start:read])."""
        return self.tokenizer.decode(self.ids[self.start:end], skip_special_tokens=False)[len(context):]

    def _found(self, text: str) -> bool:
        return any(s in text for s in self.strings)

    def tokens_to_keep(self, ids: list[int]) -> int | None:
        """ids: the row's next new token ids (a block's). Returns how many of its new tokens it keeps, if a stop
        string is now in its text (up to and with the token that completes the first one), else None."""
        before = len(self.ids)
        self.ids += ids
        context = self.tokenizer.decode(self.ids[self.start:self.read], skip_special_tokens=False)
        end = len(self.ids)
        new = self._text_after_context(end, context)
        while new.endswith("\ufffd") and end > before + 1:  # the block's last text that ends with a whole character
            end -= 1
            new = self._text_after_context(end, context)
        if new.endswith("\ufffd"):  # none: held for the next block
            return None
        if self._found(self.tail + new):
            return next(n for n in range(before + 1, end + 1)
                        if self._found(self.tail + self._text_after_context(n, context)))
        seen = self.tail + new
        self.tail = seen[max(len(seen) - self.longest + 1, 0):]
        self.start, self.read = self.read, end
        return None
