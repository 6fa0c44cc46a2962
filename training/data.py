"""Documents -> tokens -> packed training sequences with a per-token ``is_prompt`` flag.

Inputs (``read_records``):
- plain text files (any extension other than .jsonl/.json): one document per file;
- JSONL, one JSON object per line, one of
  ``{"text": ...}`` (plain document),
  ``{"prompt": ..., "response": ...}`` (instruction pair),
  ``{"messages": [{"role": ..., "content": ...}, ...]}`` (chat; every ``assistant`` turn is answer).
  Blank lines are skipped; anything else is an error naming the file and line.
- directories: every regular file below them (sorted), recursively, hidden files and directories (``.git``) left out.

Rendering (``record_to_segments``) turns a record into ``(text, is_prompt)`` segments. Chat and
prompt/response records (a user and an assistant turn) are rendered with the tokenizer's chat template
(the real SDAR tokenizer's, or :data:`training.tokenizer.CHAT_TEMPLATE`, which a tokenizer trained here
carries and which serves a tokenizer without one): an assistant turn's answer text is the part the
template adds on top of the conversation before it rendered with ``add_generation_prompt=True``, and the
rest is prompt (:func:`_chat_segments`).

Tokenization encodes each segment separately (so the flags are exact; the text of a special token in a
``{text}`` record or text file stays characters, while in a rendered conversation it is the template's markup, and
the mask token there is refused) and appends the EOS token after every document (documents are separated by
EOS; the EOS carries the flag of the document's last segment, so a response learns to stop). Packing concatenates
the documents and cuts the stream into ``seq_len`` pieces (``seq_len`` a multiple of the block size); the last
partial piece is padded with the pad token flagged as prompt, so it is never masked and never scored. Plain text
has no prompt tokens.

The held-out split is by document and by content (:func:`split_records`): a document is held out when the hash of
its text falls below the fraction, so every run on the same documents holds out the same ones, whatever its seed
or file order (about ``fraction * n`` documents; at least one when ``fraction > 0`` and there are >= 2).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from hf_integration.cli_prompts import is_conversation

from .config import ConfigError
from .tokenizer import CHAT_TEMPLATE

Segment = tuple[str, bool]  # (text, is_prompt)

JSON_EXTS = (".jsonl", ".json")


def iter_files(paths: Sequence[str], flag: str = "--data") -> list[str]:
    """Expand files and directories (recursively, sorted) into a list of files."""
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # hidden ones (.git) are not data
                for n in sorted(names):
                    if not n.startswith("."):
                        files.append(os.path.join(root, n))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise ConfigError(f"{flag}: {p!r} does not exist")
    return files


def read_records(paths: Sequence[str], flag: str = "--data") -> list[dict]:
    """Read every record from ``paths`` (see the module docstring for the formats)."""
    records: list[dict] = []
    for path in iter_files(paths, flag):
        if path.endswith(JSON_EXTS):
            with open(path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    try:  # (a byte-order mark opening the file is no data)
                        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                    except UnicodeDecodeError as e:
                        raise ConfigError(f"{flag}: {path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start}); "
                                          "JSON text is UTF-8: convert the file (e.g. iconv -t UTF-8)") from None
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ConfigError(f"{flag}: {path}:{lineno}: not valid JSON ({e.msg}); a .json / .jsonl file "
                                          "holds one JSON object a line (JSONL)") from None
                    _check_record(rec, f"{flag}: {path}:{lineno}")
                    records.append(rec)
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            if text:
                records.append({"text": text})
    return records


def _check_record(rec, where: str) -> None:
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "text" in rec:
        if not isinstance(rec["text"], str):
            raise ConfigError(f"{where}: 'text' must be a string")
    elif "prompt" in rec and "response" in rec:
        if not isinstance(rec["prompt"], str) or not isinstance(rec["response"], str):
            raise ConfigError(f"{where}: 'prompt' and 'response' must be strings")
    elif "messages" in rec:
        if not is_conversation(rec["messages"]):
            raise ConfigError(f"{where}: 'messages' must be a list of {{role, content}} strings")
        if rec["messages"] and rec["messages"][0]["role"] == "assistant":
            raise ConfigError(f"{where}: the conversation opens with an assistant turn, which has no conversation "
                              "before it to render as its prompt (chat templates refuse an empty one); open it with "
                              "a user or system turn")
    else:
        raise ConfigError(f"{where}: a record needs 'text', 'prompt'+'response' or 'messages' (got keys {sorted(rec)})")


@functools.cache
def _own_template():
    """:data:`training.tokenizer.CHAT_TEMPLATE`, compiled as transformers compiles chat templates."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)


def _render_chat(messages: list[dict], tokenizer=None, add_generation_prompt: bool = False) -> str:
    """``messages`` as text: with the tokenizer's own chat template, else with :data:`CHAT_TEMPLATE`."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return _own_template().render(messages=messages, add_generation_prompt=add_generation_prompt)


def _turn(messages: list[dict], i: int, tokenizer) -> tuple[str, str]:
    """The conversation before assistant turn i rendered with the generation prompt, and with turn i; the first is
    a prefix of the second (else a ConfigError: the answer cannot be told apart from the prompt)."""
    prefix = _render_chat(messages[:i], tokenizer, add_generation_prompt=True)
    full = _render_chat(messages[:i + 1], tokenizer)
    if not full.startswith(prefix):
        raise ConfigError("--data: the tokenizer's chat template does not render a conversation up to an assistant "
                          "turn as its generation prompt followed by the answer, so the answer cannot be told apart "
                          "from the prompt; train on {text} records or with another --tokenizer")
    return prefix, full


def _chat_segments(messages: list[dict], tokenizer=None) -> list[Segment]:
    """``(text, is_prompt)`` segments of a conversation: each assistant turn's answer is what the template adds to
    the conversation before it rendered with the generation prompt, and the rest is prompt. A template that renders
    earlier turns differently once a conversation goes on (Qwen3's drops their reasoning) trains the last answer
    only, after the history as the template renders it for that turn."""
    if not messages:  # nothing to render (transformers refuses an empty conversation): an empty document
        return []
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        return [(_render_chat(messages, tokenizer), True)]
    segs: list[Segment] = []
    done = ""
    for i in turns:
        prefix, full = _turn(messages, i, tokenizer)
        if not prefix.startswith(done):  # not prefix-stable: the last answer after the history as rendered for it
            prefix, full = _turn(messages, turns[-1], tokenizer)
            return [(prefix, True), (full[len(prefix):], False)]
        segs += [(prefix[len(done):], True), (full[len(prefix):], False)]
        done = full
    return segs


def record_to_segments(rec: dict, tokenizer=None) -> list[Segment]:
    """``(text, is_prompt)`` segments of one record (empty segments dropped); a prompt/response pair is a
    conversation of a user and an assistant turn."""
    if "text" in rec:
        segs = [(rec["text"], False)]
    else:
        messages = rec["messages"] if "messages" in rec else [{"role": "user", "content": rec["prompt"]},
                                                              {"role": "assistant", "content": rec["response"]}]
        segs = _chat_segments(messages, tokenizer)
    return [(t, fl) for t, fl in segs if t]


def hash_draw(key: str, seed: int = 0) -> float:
    """A uniform draw in [0, 1) from ``sha256(f"{seed}:{key}")``: the same for the same key on every machine and run."""
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def split_by_hash(items: Sequence, heldout_fraction: float, seed: int = 0, key=str) -> tuple[list, list]:
    """``(kept, heldout)``, both in the order of ``items``: an item is held out when the :func:`hash_draw` of its
    ``key(item)`` is below the fraction, so membership depends on the key alone (not on the order or the other
    items; a larger fraction holds out a superset; items of one key fall on one side). One item is always kept (the
    largest draw, with its copies), and with ``fraction > 0`` and >= 2 items one is held out (the smallest, with its
    copies), unless all are copies of one. Raises ``ConfigError`` for a fraction outside [0, 1)."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ConfigError(f"--heldout-fraction must be in [0, 1), got {heldout_fraction}")
    draws = [hash_draw(key(item), seed) for item in items]
    held = {i for i, d in enumerate(draws) if d < heldout_fraction}
    if heldout_fraction > 0 and not held and len(items) >= 2:
        held = {i for i, d in enumerate(draws) if d == min(draws)}  # (copies of an item draw alike: all of them)
    if held and len(held) == len(items):
        held -= {i for i, d in enumerate(draws) if d == max(draws)}
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def record_key(rec: dict) -> str:
    """A record's content (its text, prompt/response or messages; other fields left out) as canonical JSON."""
    return json.dumps({k: rec[k] for k in ("text", "prompt", "response", "messages") if k in rec}, sort_keys=True,
                      ensure_ascii=False)


def split_records(records: list, heldout_fraction: float) -> tuple[list, list]:
    """Document-level split by content: ``(train, heldout)``, both in original order. A record is held out by the
    hash of its :func:`record_key` (:func:`split_by_hash`), so a backbone run and a later MRP run on the same
    documents agree on the split whatever their ``--seed``, file order or added documents, and copies of a document
    fall on the same side."""
    return split_by_hash(records, heldout_fraction, key=record_key)


def is_literal(record: dict) -> bool:
    """Whether a record's text is data as it stands (``{text}`` records and text files), not a conversation the
    chat template renders (whose special tokens are the template's markup)."""
    return "text" in record


def encode(texts: list[str], tokenizer, literal: bool) -> list[list[int]]:
    """Token ids of each of ``texts``, no BOS / EOS added. ``literal`` (:func:`is_literal`): the text of a special
    token in it (``<|endoftext|>``, ``<|MASK|>``) stays characters (``split_special_tokens``), as it is data;
    else it is the chat template's markup and becomes the special token."""
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=literal)["input_ids"] if texts else []


def tokenize_documents(docs: Iterable[list[Segment]], tokenizer, eos_id: int, literal: Sequence[bool] | None = None,
                       mask_id: int | None = None) -> tuple[list[int], list[bool]]:
    """Tokenize segment lists into one token stream with flags; EOS after every document.

    literal: per document, :func:`is_literal` of its record (default: none is). A rendered conversation that holds
    the mask token (``mask_id``) is refused with a ConfigError: training would teach the model to predict it, which
    decoding must never commit (method.md, section 2)."""
    docs = list(docs)
    literal = [False] * len(docs) if literal is None else list(literal)
    enc = {kind: iter(encode([t for d, lit in zip(docs, literal) if lit == kind for t, _ in d], tokenizer, kind))
           for kind in (True, False)}
    ids: list[int] = []
    flags: list[bool] = []
    for d, lit in zip(docs, literal):
        if not d:
            continue
        for text, is_prompt in d:
            toks = next(enc[lit])
            if mask_id is not None and mask_id in toks:
                raise ConfigError(f"--data: a conversation holds the mask token's text ({text[:80]!r}...): training "
                                  "would teach the model to predict the mask token; take it out of the messages")
            ids.extend(toks)
            flags.extend([is_prompt] * len(toks))
        ids.append(eos_id)
        flags.append(d[-1][1])
    return ids, flags


@dataclass
class PackedDataset:
    """``input_ids`` [N, T] long and ``is_prompt`` [N, T] bool."""

    input_ids: torch.Tensor
    is_prompt: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def num_answer_tokens(self) -> int:
        return int((~self.is_prompt).sum())

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(str(tuple(self.input_ids.shape)).encode())
        h.update(self.input_ids.numpy().tobytes())
        h.update(self.is_prompt.numpy().tobytes())
        return h.hexdigest()[:16]

    def save(self, path: str) -> None:
        torch.save({"input_ids": self.input_ids, "is_prompt": self.is_prompt}, path)

    @classmethod
    def load(cls, path: str) -> "PackedDataset":
        d = torch.load(path)
        return cls(d["input_ids"], d["is_prompt"])


def pack(ids: Sequence[int], flags: Sequence[bool], seq_len: int, pad_id: int,
         block_size: int | None = None) -> PackedDataset:
    """Cut a token stream into ``seq_len`` rows; pad the tail with ``pad_id`` flagged as prompt."""
    if block_size is not None and seq_len % block_size:
        raise ConfigError(f"--seq-len ({seq_len}) must be a multiple of --block-size ({block_size})")
    n = len(ids)
    rows = -(-n // seq_len)
    t_ids = torch.full((rows * seq_len,), pad_id, dtype=torch.long)
    t_pr = torch.ones(rows * seq_len, dtype=torch.bool)
    if n:
        t_ids[:n] = torch.tensor(list(ids), dtype=torch.long)
        t_pr[:n] = torch.tensor(list(flags), dtype=torch.bool)
    return PackedDataset(t_ids.view(rows, seq_len), t_pr.view(rows, seq_len))


def build_datasets(
    paths: Sequence[str] | None,
    tokenizer,
    seq_len: int,
    block_size: int,
    heldout_fraction: float = 0.01,
    records: tuple[list, list] | None = None,
    flag: str = "--data",
) -> tuple[PackedDataset, PackedDataset]:
    """Read, split, tokenize and pack. ``records=(train, heldout)`` skips reading and splitting.

    Raises ``ConfigError`` (naming ``flag``) when the training split yields no answer tokens.
    """
    from .tokenizer import special_token_ids

    if seq_len % block_size:
        raise ConfigError(f"--seq-len ({seq_len}) must be a multiple of --block-size ({block_size})")
    if records is None:
        recs = read_records(paths or [], flag)
        train_r, held_r = split_records(recs, heldout_fraction)
    else:
        train_r, held_r = records
    ids = special_token_ids(tokenizer)
    eos, pad = ids["eos_token_id"], ids["pad_token_id"]
    out = []
    for part in (train_r, held_r):
        toks, flags = tokenize_documents([record_to_segments(r, tokenizer) for r in part], tokenizer, eos,
                                         literal=[is_literal(r) for r in part], mask_id=ids["mask_token_id"])
        out.append(pack(toks, flags, seq_len, pad))
    train, held = out
    if len(train) == 0 or train.num_answer_tokens() == 0:
        where = f" in {list(paths)!r}" if paths else ""
        raise ConfigError(f"{flag}: the data is empty: no answer tokens to learn or score{where} (conversations "
                          "need an assistant turn; prompt/response records a response)")
    return train, held


def record_texts(records: Iterable[dict]) -> Iterable[str]:
    """Plain texts of records (for tokenizer training)."""
    for r in records:
        for t, _ in record_to_segments(r, None):
            yield t
