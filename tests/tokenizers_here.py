"""Tokenizers to decode with in tests, none downloaded: the shipped checkpoint's, a Llama-style one trained here,
and the shipped one asking to clean up spaces; and runs of token ids to feed them."""

import copy
import functools

from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hf_integration.cli import SHIPPED_MODEL

TEXTS = ["def café(x):\n    return 'naïve ≥ ∑ 日本語'\n", "emoji 🙂 and more: ß, ø, ü",
         "plain ascii text, nothing else"]


@functools.cache
def shipped_tokenizer():
    """The shipped checkpoint's tokenizer: byte-level BPE, so a character of several UTF-8 bytes may take several
    tokens."""
    return AutoTokenizer.from_pretrained(SHIPPED_MODEL, trust_remote_code=True)


@functools.cache
def byte_fallback_tokenizer():
    """A Llama-style tokenizer trained here: metaspace BPE whose characters outside its vocabulary fall back to byte
    tokens (<0xC3> ...), decoded with the leading space stripped."""
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(["plain text of some words", "def f(x): return x"] * 8,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", *bytes_]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def cleaning_tokenizer():
    """The shipped tokenizer asking to clean up spaces (which a BPE tokenizer's decode ignores; IncrementalText
    decodes it whole at each token)."""
    tokenizer = copy.copy(shipped_tokenizer())
    tokenizer.clean_up_tokenization_spaces = True
    return tokenizer


TOKENIZERS = {"byte-level": shipped_tokenizer, "byte-fallback": byte_fallback_tokenizer,
              "decoded whole": cleaning_tokenizer}


@st.composite
def token_runs(draw, tokenizer):
    """Ids of one of TEXTS (or of its bytes' tokens, spread one a token) with drawn ids mixed in (special tokens and
    lone bytes among them), and the sizes of the groups they are added in."""
    vocab = len(tokenizer)
    ids = tokenizer.encode(draw(st.sampled_from(TEXTS)), add_special_tokens=False)
    for _ in range(draw(st.integers(0, 4))):
        ids.insert(draw(st.integers(0, len(ids))), draw(st.integers(0, vocab - 1)))
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=len(ids)))
    return ids, sizes
