"""A completion's text as its tokens come, each token's offset in it, in time linear in the tokens."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast


class IncrementalText:
    """The text of token ids added a few at a time, as ``tokenizer.decode(ids, skip_special_tokens=True)`` gives it
    where that text is whole, and each token's offset in it: the length of the text before the token.

    The text holds back what a later token may still change: a character whose UTF-8 bytes have not all come (a
    decoded text ending with U+FFFD), so it only grows (unless a tokenizer's clean-up of spaces changes its end). A
    token that starts such a character, or adds to one, has the offset where the character starts.

    A fast tokenizer that decodes as its Rust tokenizer does (no space clean-up, no ``decode`` of its own) decodes
    each token once (the ``tokenizers`` library's ``DecodeStream``); another tokenizer decodes all the ids at each
    token (time quadratic in their number)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.offsets: list[int] = []
        self.text = ""
        self._stream = DecodeStream(skip_special_tokens=True) if decodes_as_its_backend(tokenizer) else None

    def add(self, ids: list[int]) -> None:
        """Append ``ids`` (each token's offset first, then its text)."""
        for token in ids:
            self.offsets.append(len(self.text))
            self.ids.append(token)
            if self._stream is not None:
                self.text += self._stream.step(self.tokenizer.backend_tokenizer, token) or ""
            else:
                self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")


def decodes_as_its_backend(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` is its Rust tokenizer's decode (a fast tokenizer that neither overrides
    ``decode`` nor cleans up spaces after it), which ``DecodeStream`` follows token by token."""
    kind = type(tokenizer)
    return (isinstance(tokenizer, PreTrainedTokenizerFast) and kind.decode is PreTrainedTokenizerFast.decode
            and kind._decode is PreTrainedTokenizerFast._decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False))


def token_offsets(tokenizer, ids: list[int], start: int = 0) -> list[int]:
    """The offset of each of ``ids`` from ``start`` on in the text of ``ids`` (:class:`IncrementalText`)."""
    text = IncrementalText(tokenizer)
    text.add(ids)
    return text.offsets[start:]
