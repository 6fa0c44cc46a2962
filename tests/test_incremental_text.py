"""IncrementalText: a completion's text and its tokens' offsets as the tokens come, for a stream and for the
``text_offset`` of log-probabilities."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import LetterTokenizer
from tokenizers_here import TOKENIZERS, byte_fallback_tokenizer, cleaning_tokenizer, shipped_tokenizer, token_runs

from hf_integration.incremental_text import IncrementalText, decodes_as_its_backend, token_offsets


def test_a_fast_tokenizer_that_decodes_as_its_rust_tokenizer_decodes_each_token_once():
    assert decodes_as_its_backend(shipped_tokenizer()) and decodes_as_its_backend(byte_fallback_tokenizer())
    assert not decodes_as_its_backend(cleaning_tokenizer())
    assert not decodes_as_its_backend(LetterTokenizer())


@pytest.mark.parametrize("kind", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_text_grows_as_the_whole_decode_and_each_token_starts_where_the_text_before_it_ends(kind, data):
    """After each group of tokens: the text is a prefix of the ids' whole decode (``skip_special_tokens``), equal to
    it where that ends with a whole character, and never ends with U+FFFD; each token's offset is the length of the
    text before it; groups of any size give the tokens one at a time's text and offsets."""
    tokenizer = TOKENIZERS[kind]()
    ids, sizes = data.draw(token_runs(tokenizer))
    text, one_by_one, start = IncrementalText(tokenizer), IncrementalText(tokenizer), 0
    for size in sizes + [len(ids)]:
        group = ids[start : start + size]
        text.add(group)
        for token in group:
            offset = len(one_by_one.text)
            one_by_one.add([token])
            assert one_by_one.offsets[-1] == offset
        start += len(group)
        whole = tokenizer.decode(ids[:start], skip_special_tokens=True)
        assert whole.startswith(text.text) and not text.text.endswith("\ufffd")
        if not whole.endswith("\ufffd"):
            assert text.text == whole
        assert (text.text, text.offsets) == (one_by_one.text, one_by_one.offsets)
    assert text.ids == ids and len(text.offsets) == len(ids)
    assert all(a <= b for a, b in zip(text.offsets, text.offsets[1:])) and text.offsets[:1] in ([], [0])
    assert token_offsets(tokenizer, ids, 2) == text.offsets[2:]


def test_a_character_split_over_tokens_appears_whole_at_the_offset_where_it_starts():
    tokenizer = shipped_tokenizer()
    ids = tokenizer.encode("é≥ café", add_special_tokens=False)
    text = IncrementalText(tokenizer)
    texts = []
    for token in ids:
        text.add([token])
        texts.append(text.text)
    assert texts[0] == "" and texts[1] == "é" and texts[-1] == "é≥ café"  # é takes two tokens, ≥ three
    pieces = [text.text[a:b] for a, b in zip(text.offsets, text.offsets[1:] + [len(text.text)])]
    assert "".join(pieces) == "é≥ café" and "" in pieces  # a byte that adds to a character adds no text of its own
