"""Prompts as ``mrp-generate`` and the benchmarks read them: chat rendering, JSONL prompt records, padded batches.

A prompt file is JSONL, one record a line (blank lines skipped): ``{"prompt": ...}`` (sent through the chat template
as a user message when ``chat``), ``{"messages": [{"role": ..., "content": ...}, ...]}`` (always rendered by the chat
template with the assistant's turn opened; a last assistant turn, a reference answer, is left out: the model writes
its own) or ``{"text": ...}`` (as it is). Other keys (an id, an answer to score against) are kept with the record.
Not part of a checkpoint's remote code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


class UsageError(ValueError):
    """A command line that cannot run as given; the message names the option to fix."""


@dataclass
class PromptRecord:
    """One prompt of a prompt file: the record as read (``fields``), its token ids (``ids``, non-empty) and where it
    stands (``where``: the option, the file and the line, for messages)."""

    fields: dict
    ids: list[int]
    where: str


def is_conversation(messages) -> bool:
    """Whether ``messages`` is a list of ``{"role": str, "content": str}`` dicts (a ``messages`` record's value)."""
    return isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)


def user_turn(prompt: str, system: str | None) -> list[dict]:
    """``prompt`` as a conversation's user message, after ``system`` as its system message (when not None)."""
    return ([] if system is None else [{"role": "system", "content": system}]) + [{"role": "user", "content": prompt}]


def chat_ids(tokenizer, messages: list[dict], model: str) -> list[int]:
    """The token ids of ``messages`` ({role, content} dicts) rendered by the tokenizer's chat template with the
    assistant's turn opened (:class:`UsageError` naming ``model`` when its tokenizer has no template)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"--chat needs a tokenizer with a chat template, and {model}'s has none (drop --chat to "
                         "complete the prompt as plain text)")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


def read_prompt_records(path: Path, tokenizer, chat: bool, system: str | None, model: str,
                        option: str = "--prompt-file") -> list[PromptRecord]:
    """Every prompt of the JSONL file ``path`` (the record forms: the module docstring), tokenized; ``chat``: send
    ``prompt`` records through the chat template as a user message after ``system``'s, if given (``messages``
    records always go through it; their own system message wins). A bad record raises :class:`UsageError` naming
    ``option``, the file and the line."""
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a byte-order mark (Windows editors) skipped
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{option}: {err}") from None
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{option} {path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(rec, dict):
            raise UsageError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        if "messages" in rec:
            messages = rec["messages"]
            if not (is_conversation(messages) and messages):
                raise UsageError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
            if messages[-1]["role"] == "assistant":
                messages = messages[:-1]  # the reference answer: the model writes its own
            if system is not None and messages and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": system}, *messages]
            ids = _rendered(tokenizer, messages, model, where, by_chat=False)
        elif isinstance(rec.get("prompt"), str):
            ids = (_rendered(tokenizer, user_turn(rec["prompt"], system), model, where, by_chat=True) if chat
                   else tokenizer(rec["prompt"]).input_ids)
        elif isinstance(rec.get("text"), str):
            ids = tokenizer(rec["text"]).input_ids
        else:
            raise UsageError(f"{where}: a record needs a 'prompt' or 'text' string or a 'messages' list "
                             f"(got keys {sorted(rec)})")
        if not ids:
            raise UsageError(f"{where}: the prompt is empty")
        records.append(PromptRecord(rec, list(ids), where))
    return records


def _rendered(tokenizer, messages: list[dict], model: str, where: str, by_chat: bool) -> list[int]:
    """:func:`chat_ids` of a record's conversation (``by_chat``: a prompt ``--chat`` sends through the template, whose
    lack is the flag's fault, not the record's); a conversation the template cannot render (none left once the
    reference answer is left out, a role it refuses) or a ``messages`` record for a tokenizer without a template
    raises :class:`UsageError` naming the record (``where``)."""
    if not messages:
        raise UsageError(f"{where}: the conversation holds only the reference answer (its last assistant turn, left "
                         "out): give the turns before it")
    if not by_chat and not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"{where}: a 'messages' record goes through the tokenizer's chat template, and {model}'s "
                         "has none: give the record as a 'prompt' or 'text'")
    try:
        return chat_ids(tokenizer, messages, model)
    except UsageError:
        raise
    except Exception as err:  # noqa: BLE001 - the template's own refusal (jinja2's raise_exception), or transformers'
        raise UsageError(f"{where}: the chat template cannot render the conversation ({type(err).__name__}: "
                         f"{err})") from None


def left_padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as one left-padded batch: (input_ids, attention_mask), each int64 [len(rows), longest]; the
    padding holds id 0 (``generate`` reads any id there: the attention mask hides it)."""
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)
