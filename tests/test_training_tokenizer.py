import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from training_fixtures import make_tokenizer, tiny_texts


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    make_tokenizer(d)
    return d


def test_autotokenizer_loads_with_special_ids(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert os.path.exists(os.path.join(tok_dir, "tokenizer.json"))
    assert os.path.exists(os.path.join(tok_dir, "tokenizer_config.json"))
    assert tok.eos_token == "<|endoftext|>" and tok.mask_token == "<|MASK|>"
    assert tok.eos_token_id == 0 and tok.mask_token_id == 1
    assert len(tok) == 300
    rec = json.load(open(os.path.join(tok_dir, "special_token_ids.json")))
    assert rec == {"eos_token_id": 0, "mask_token_id": 1, "pad_token_id": 0}
    # special tokens stay single tokens inside text
    ids = tok("a<|MASK|>b<|endoftext|>", add_special_tokens=False)["input_ids"]
    assert 1 in ids and 0 in ids
    assert tok("the cat sat", add_special_tokens=False)["input_ids"] != []


@given(st.text(max_size=60))
def test_round_trip(tok_dir, s):

    tok = _cached(tok_dir)
    ids = tok(s, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == s
    assert all(0 <= i < len(tok) for i in ids)


_CACHE = {}


def _cached(d):
    from transformers import AutoTokenizer

    if d not in _CACHE:
        _CACHE[d] = AutoTokenizer.from_pretrained(d)
    return _CACHE[d]


def test_round_trip_corpus_and_code(tok_dir):
    tok = _cached(tok_dir)
    for s in tiny_texts(5) + ["def f(x):\n    return x  # ünïcödé ✓\n\t\r\n", "  leading spaces"]:
        assert tok.decode(tok(s, add_special_tokens=False)["input_ids"]) == s


def test_vocab_too_small_rejected(tmp_path):
    from training.tokenizer import train_tokenizer

    with pytest.raises(ValueError, match="vocab_size must be >= 258"):
        train_tokenizer(["abc"], str(tmp_path), vocab_size=100)


def test_the_smallest_vocabulary_trains(tmp_path):
    from training.tokenizer import MIN_VOCAB_SIZE, train_tokenizer

    assert len(train_tokenizer(tiny_texts(5), str(tmp_path), vocab_size=MIN_VOCAB_SIZE)) == MIN_VOCAB_SIZE


def test_missing_tokenizer_rejected(tmp_path):
    from training.config import ConfigError
    from training.tokenizer import load_tokenizer

    with pytest.raises(ConfigError, match="--tokenizer"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="--tokenizer"):
        load_tokenizer(str(tmp_path))


def test_a_folder_with_only_tokenizer_json_is_read(tok_dir, tmp_path):
    """tokenizer.json alone is a tokenizer (it is read: without tokenizer_config.json it names no EOS token)."""
    import shutil

    from training.config import ConfigError
    from training.tokenizer import load_tokenizer

    shutil.copy(os.path.join(tok_dir, "tokenizer.json"), tmp_path)
    with pytest.raises(ConfigError, match="has no EOS token"):
        load_tokenizer(str(tmp_path))


def test_a_tokenizer_without_the_mask_token_has_no_mask_id(tmp_path):
    """A tokenizer that neither declares a mask token nor holds <|MASK|> (its lookup falls back to the unk id) has
    none: the unk id must not pass for it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from training.config import ConfigError
    from training.tokenizer import load_tokenizer, special_token_ids

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "</s>": 2},
                                                                              unk_token="<unk>")),
                                  unk_token="<unk>", eos_token="</s>")
    assert tok.convert_tokens_to_ids("<|MASK|>") == tok.unk_token_id == 0
    assert special_token_ids(tok) == {"eos_token_id": 2, "mask_token_id": None, "pad_token_id": 2}
    tok.save_pretrained(str(tmp_path))  # and training refuses it
    with pytest.raises(ConfigError, match=r"has no <\|MASK\|> token"):
        load_tokenizer(str(tmp_path))
