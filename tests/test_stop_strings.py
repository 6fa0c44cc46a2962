"""StopStrings: where a row's new text, given a block at a time, first holds a stop string."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import LetterTokenizer
from tokenizers_here import TEXTS, TOKENIZERS, shipped_tokenizer, token_runs

from hf_integration.stop_strings import StopStrings


def fed_in_blocks(stops: StopStrings, ids: list[int], sizes: list[int]) -> list[int | None]:
    """What :meth:`StopStrings.tokens_to_keep` says after each block of ``ids`` (blocks of ``sizes``, then the
    rest), up to the first block that finds a stop string."""
    said, start = [], 0
    for size in sizes + [len(ids)]:
        if start >= len(ids):
            break
        said.append(stops.tokens_to_keep(ids[start : start + size]))
        start += size
        if said[-1] is not None:
            break
    return said


def test_tokens_to_keep_ends_with_the_token_that_completes_a_stop_string():
    tok = LetterTokenizer()  # ids 0, 1, 2, 3 decode as "abcd"
    assert fed_in_blocks(StopStrings(tok, ("cd",)), [0, 1, 2, 3, 4], [2, 3]) == [None, 4]
    assert fed_in_blocks(StopStrings(tok, ("cd",)), [0, 1, 2, 3], [3, 1]) == [None, 4]  # across a block's end
    assert fed_in_blocks(StopStrings(tok, ("abc", "b")), [0, 1, 2], [3]) == [2]  # the first one completed
    assert fed_in_blocks(StopStrings(tok, ("bcd",)), [1, 2, 3], [1, 1, 1]) == [None, None, 3]  # over three blocks
    assert fed_in_blocks(StopStrings(tok, ("x",)), [0, 1, 2], [2]) == [None, None]


def test_a_stop_string_may_be_a_special_token_of_the_tokenizer():
    """Stop strings are looked for in the text with special tokens kept, so one can name the EOS text."""
    tok = shipped_tokenizer()
    ids = tok("x = 1").input_ids + [tok.eos_token_id] + tok("y").input_ids
    assert fed_in_blocks(StopStrings(tok, (tok.eos_token,)), ids, [2]) == [None, len(ids) - 1]


@pytest.mark.parametrize("kind", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_first_stop_string_is_found_where_the_whole_text_first_holds_one(kind, data):
    """Fed a block at a time, the stops say nothing until the block holding the first n whose ids' whole decode
    holds a stop string, and then n; nothing at all where no prefix holds one. The strings are drawn from the
    text (so they are found, often across blocks and inside characters of several tokens) or anywhere."""
    tokenizer = TOKENIZERS[kind]()
    ids, sizes = data.draw(token_runs(tokenizer))
    whole = tokenizer.decode(ids, skip_special_tokens=False)
    pieces = st.integers(0, max(len(whole) - 1, 0)).flatmap(
        lambda a: st.integers(a + 1, min(a + 6, len(whole))).map(lambda b: whole[a:b]))
    strings = data.draw(st.lists(pieces, max_size=3) if whole else st.just([]))
    strings += data.draw(st.lists(st.text(min_size=1, max_size=3), max_size=1))
    strings = [s for s in strings if "\ufffd" not in s] or ["\x00"]  # (U+FFFD: bytes that are no character)
    first = next((n for n in range(1, len(ids) + 1)
                  if any(s in tokenizer.decode(ids[:n], skip_special_tokens=False) for s in strings)), None)
    said = fed_in_blocks(StopStrings(tokenizer, tuple(strings)), ids, sizes)
    assert said[-1] == first and not any(x is not None for x in said[:-1])
    if first is not None:  # found in the block that holds it
        ends = [sum(sizes[: i + 1]) if i < len(sizes) else len(ids) for i in range(len(said))]
        assert ends[-1] >= first and (len(ends) == 1 or ends[-2] < first)


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_every_split_into_blocks_finds_every_piece_of_the_text_where_the_whole_text_first_holds_it(kind):
    """Each text of three characters in each of TEXTS, its tokens fed in blocks that split them at each place (then
    two tokens, then the rest): found where the whole decode first holds it, across block ends, inside characters of
    several tokens, and after a block that begins with a space that decodes alone as nothing."""
    tokenizer = TOKENIZERS[kind]()
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        prefixes = [tokenizer.decode(ids[:n], skip_special_tokens=False) for n in range(len(ids) + 1)]
        for piece in {prefixes[-1][a : a + 3] for a in range(len(prefixes[-1]) - 2)}:
            first = next(n for n, prefix in enumerate(prefixes) if piece in prefix)
            for split in range(1, len(ids)):
                said = fed_in_blocks(StopStrings(tokenizer, (piece,)), ids, [split, 2])
                assert said[-1] == first, (piece, split)
