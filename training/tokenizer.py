"""Byte-level BPE tokenizer with the two special tokens SDAR needs.

``train_tokenizer`` trains a byte-level BPE (``tokenizers`` library) on an iterator of texts and
saves it with ``PreTrainedTokenizerFast.save_pretrained`` so that
``AutoTokenizer.from_pretrained(folder)`` loads it. ``<|endoftext|>`` (EOS, also used as pad)
is id 0 and ``<|MASK|>`` is id 1; both ids are recorded in ``tokenizer_config.json`` (through
``eos_token`` / ``mask_token``) and, explicitly, in ``special_token_ids.json``. It carries
:data:`CHAT_TEMPLATE`, the layout training gives chat records.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|MASK|>"
SPECIAL_IDS_FILE = "special_token_ids.json"
MIN_VOCAB_SIZE = 258  # the 256 byte symbols and the two special tokens
# How a conversation is laid out for a model trained here: "<|role|>\n{content}\n" a message, and "<|assistant|>\n"
# as the generation prompt. training/data.py renders chat and prompt/response records with it when the tokenizer has
# no template of its own, and a tokenizer trained here carries it, so ``apply_chat_template`` (``mrp-generate --chat``)
# prompts the model as it was trained.
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def train_tokenizer(texts: Iterable[str], out_dir: str, vocab_size: int = 8192, min_frequency: int = 2):
    """Train a byte-level BPE on ``texts`` and save it to ``out_dir``; return the HF tokenizer.

    ``vocab_size`` counts the 256 byte symbols and the two special tokens, so it must be >= 258.
    Byte-level means every string round-trips exactly: ``decode(encode(s)) == s``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + 2 special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return save_tokenizer(tok, out_dir)


def save_tokenizer(tok, out_dir: str):
    """Wrap a ``tokenizers.Tokenizer`` as a ``PreTrainedTokenizerFast`` and save it to ``out_dir``."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    hf.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
    with open(os.path.join(out_dir, SPECIAL_IDS_FILE), "w") as f:
        json.dump(special_token_ids(hf), f, indent=2)
    return hf


def special_token_ids(tokenizer) -> dict:
    """``{"eos_token_id", "mask_token_id", "pad_token_id"}`` of a loaded tokenizer.

    The mask token is looked up by its text ``<|MASK|>`` when the tokenizer does not declare a
    ``mask_token`` (the real SDAR tokenizer only has it as an added token).
    """
    mask_id = tokenizer.mask_token_id if getattr(tokenizer, "mask_token", None) else None
    if mask_id is None:
        mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        if mask_id is None or mask_id == tokenizer.unk_token_id:
            mask_id = None
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    return {"eos_token_id": eos_id, "mask_token_id": mask_id, "pad_token_id": pad_id}


def _own_config(path: str) -> dict:
    """``config=`` for AutoTokenizer when ``path`` holds an SDAR model: transformers 5 loads a folder's model
    config to pick the tokenizer, and an SDAR config carries remote code it would ask to trust."""
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        return {}
    with open(config_file) as f:
        if json.load(f).get("model_type") != "sdar":
            return {}
    from hf_integration import SDARMRPConfig

    return {"config": SDARMRPConfig.from_pretrained(path)}


def load_tokenizer(path: str, flag: str = "--tokenizer"):
    """``AutoTokenizer.from_pretrained(path)`` with a clear error naming ``flag`` when absent."""
    from transformers import AutoTokenizer

    from .config import ConfigError

    if not path or not os.path.isdir(path) or not (
        os.path.exists(os.path.join(path, "tokenizer.json"))
        or os.path.exists(os.path.join(path, "tokenizer_config.json"))
    ):
        raise ConfigError(f"{flag}: no tokenizer found at {path!r} (expected tokenizer.json / tokenizer_config.json)")
    tok = AutoTokenizer.from_pretrained(path, **_own_config(path))
    ids = special_token_ids(tok)
    if ids["eos_token_id"] is None:
        raise ConfigError(f"{flag}: the tokenizer at {path!r} has no EOS token")
    if ids["mask_token_id"] is None:
        raise ConfigError(f"{flag}: the tokenizer at {path!r} has no {MASK_TOKEN} token")
    return tok
