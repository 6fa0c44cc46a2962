"""Shared helpers for the tests/test_training_*.py files (tiny corpora, tokenizer, models)."""

from __future__ import annotations

import contextlib
import json
import os
import random

WORDS = ("the cat sat on a mat and the dog ran to the red ball while one bird sang "
         "def return import class self if else for in range print").split()


def tiny_texts(n: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(8, 30)
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)) + f" {i % 7}.")
    return out


def write_corpus(folder: str, n: int = 40) -> dict:
    """Writes text.jsonl, chat.jsonl, pairs.jsonl, plain.txt under folder; returns their paths."""
    os.makedirs(folder, exist_ok=True)
    texts = tiny_texts(n)
    paths = {k: os.path.join(folder, f) for k, f in
             (("text", "text.jsonl"), ("pairs", "pairs.jsonl"), ("chat", "chat.jsonl"), ("plain", "plain.txt"))}
    with open(paths["text"], "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    with open(paths["pairs"], "w") as f:
        for t in texts[: n // 2]:
            f.write(json.dumps({"prompt": "say: " + t[:20], "response": t}) + "\n")
    with open(paths["chat"], "w") as f:
        for t in texts[: n // 2]:
            msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": t[:15]},
                    {"role": "assistant", "content": t}, {"role": "user", "content": "again"},
                    {"role": "assistant", "content": t[::-1]}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with open(paths["plain"], "w") as f:
        f.write("\n".join(texts))
    return paths


def make_tokenizer(folder: str, vocab_size: int = 300):
    from training.tokenizer import train_tokenizer

    return train_tokenizer(tiny_texts(60), folder, vocab_size=vocab_size)


TINY = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            max_position_embeddings=256)


def tiny_backbone(tokenizer, block_size: int = 4, seed: int = 0, **kw):
    import torch

    from training.models import build_backbone
    from training.tokenizer import special_token_ids

    torch.manual_seed(seed)
    size = dict(TINY)
    size.update(kw)
    return build_backbone(special_token_ids(tokenizer), len(tokenizer), block_size=block_size, **size)


import pytest  # noqa: E402


@contextlib.contextmanager
def single_thread():
    """Tiny models run much faster on one thread, above all on a shared, busy CPU."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture
def one_thread():
    """:func:`single_thread` around a test."""
    with single_thread():
        yield


def subprocess_env(repo: str) -> dict:
    """The environment of a training subprocess: on the reference ops, as the suite's model-level tests in this
    process are (conftest), so runs split across processes compare with runs here."""
    return dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", MRP_TRITON_BACKEND="reference")
