"""OpenAI-style requests as ``mrp-serve`` reads them, and the response bodies it writes; no web framework here.

A request body (``/v1/completions`` or ``/v1/chat/completions``) becomes the prompts' token ids and the keywords of
``generate()`` (:func:`read_request`): the server's defaults (``mrp-serve``'s decoding options), then the request's
OpenAI fields (``max_tokens``, ``temperature``, ``top_p``, ``n``, ``stop``, ``seed``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``: -100 a ban, any other value a bias; ``logprobs`` and ``top_logprobs`` for the
response), then its extension fields, named as ``generate()`` names them
(``strategy``, ``mrp_steps``, ``threshold``, ``top_k``, ``min_p``, ``repetition_penalty``, ...; ``min_tokens`` is
``min_new_tokens``, as in vLLM), which the OpenAI clients send with ``extra_body``. A field this server does not
read is refused, naming it, unless it asks for nothing (``best_of=1``, ``echo=False``, ...): a request is
never served as something it did not ask for. Not part of a checkpoint's remote code.
"""

from __future__ import annotations

import math
import re
import secrets
import time
import uuid
from dataclasses import dataclass

from .cli import read_by
from .cli_prompts import UsageError, chat_ids, is_conversation
from .generation_settings import SAMPLING
from .incremental_text import token_offsets

MAX_TOP_LOGPROBS = 20  # the most likely tokens a request may ask for at each position (OpenAI's chat bound)


class RequestError(ValueError):
    """A request that cannot be served as sent: the message, the field to fix (``param``: OpenAI's error field) and
    the HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict:
        """The OpenAI error body."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


# Fields read by both endpoints, and by each; those accepted at the values that ask for nothing (and ``user``, an
# end user's id for the provider's records, at any value).
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options",
                 "user", "logit_bias", "presence_penalty", "frequency_penalty"}
ENDPOINT_FIELDS = {"completions": {"prompt", "logprobs"},
                   "chat": {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}}
ASKING_FOR_NOTHING = {"echo": (False,), "best_of": (1,), "top_logprobs": (0,),  # (completions: chat reads it)
                      "suffix": ("",),
                      "tools": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},)}
# Extension fields: generate() keywords under their own names (min_tokens: vLLM's name for min_new_tokens).
EXTENSIONS = {"min_tokens": "min_new_tokens", **{name: name for name in (
    "strategy", "mrp_steps", "threshold", "denoising_steps", "block_length", "entropy_bound", "draft_schedule",
    "draft_vocab", "draft_candidates", "remask_rule", "residual_delta", "mrp_mix", "mrp_scale", "repetition_penalty",
    *(name for name in SAMPLING if name not in ("temperature", "top_p")))}}


@dataclass
class Request:
    """A request read: its prompts' token ids (one list a prompt, each non-empty), the ``generate()`` keywords
    (``num_return_sequences`` is the request's ``n``; a sampled request's ``seed`` is its own or one drawn for it,
    which keys each of its prompts' samples as if that prompt were sent alone), whether it streams, with
    ``include_usage`` whether its stream ends with a usage chunk, and whether its choices carry each token's
    log-probability (``logprobs``) and how many of the most likely tokens beside it (``top_logprobs``)."""

    prompts: list[list[int]]
    settings: dict
    stream: bool
    include_usage: bool
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def max_new_tokens(self) -> int | None:
        """The new tokens it asks for (what a completion's ``finish_reason`` reads): its settings', which the server
        resolves before the request waits (None: generate()'s default, not resolved)."""
        return self.settings.get("max_new_tokens")

    @property
    def stop(self) -> list[str]:
        """Its stop strings (OpenAI's: the text ends before the first one)."""
        return self.settings.get("stop_strings", [])


def read_request(body, endpoint: str, tokenizer, defaults: dict, model_name: str) -> Request:
    """The :class:`Request` of a JSON body sent to ``endpoint`` (``completions`` or ``chat``). ``defaults``: the
    server's ``generate()`` keywords (``strategy`` included; None: not set), which the request's fields override
    (a default that the request's strategy does not read is dropped; one the request gives is left for
    ``generate()`` to refuse). Raises :class:`RequestError` naming the field to fix."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
    _check_fields(body, endpoint)
    _check_model(body, model_name)
    prompts = (_completion_prompts(body.get("prompt"), tokenizer) if endpoint == "completions"
               else [_chat_prompt(body.get("messages"), tokenizer, model_name)])
    given = {EXTENSIONS[name]: value for name, value in body.items() if name in EXTENSIONS and value is not None}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        given["max_new_tokens"] = _count(max_tokens, "max_completion_tokens" if "max_completion_tokens" in body
                                         else "max_tokens", minimum=1)
    if body.get("n") is not None:
        given["num_return_sequences"] = _count(body["n"], "n", minimum=1)
    if body.get("seed") is not None:
        given["seed"] = _count(body["seed"], "seed", minimum=None)
    banned, bias = _logit_bias(body.get("logit_bias"), tokenizer)
    if banned:
        given["suppress_tokens"] = banned
    if bias:
        given["sequence_bias"] = {(token,): value for token, value in bias.items()}
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None and body[name] != 0:
            given[name] = _number(body[name], name)
            if not -2.0 <= given[name] <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2] (OpenAI's range; 0: none), got {body[name]}", param=name)
    if body.get("top_p") is not None and body["top_p"] != 1:  # 1 cuts nothing; clients send it by default
        given["top_p"] = _number(body["top_p"], "top_p")
    sample = defaults.get("do_sample", False)
    if body.get("temperature") is not None:
        temperature = _number(body["temperature"], "temperature")
        if temperature < 0:
            raise RequestError(f"temperature must be >= 0 (0: greedy decoding), got {temperature}",
                               param="temperature")
        sample = temperature > 0
        if sample:
            given["temperature"] = temperature
    if not sample:
        asked = sorted(name for name in given if name in SAMPLING)
        if asked:
            raise RequestError(f"{asked[0]} steers sampling, and this request decodes greedily: give a temperature "
                               "> 0 (or drop it)", param=asked[0])
        if given.get("num_return_sequences", 1) > 1:
            raise RequestError(f"n={given['num_return_sequences']} completions of a greedy request would all be the "
                               "same: give a temperature > 0 (or n=1)", param="n")
        given.pop("seed", None)  # greedy decoding draws nothing
    else:  # a seed of its own, so it draws the same whatever else shares its generate() call
        given.setdefault("seed", secrets.randbits(63))
    stop = _stop_strings(body.get("stop"))
    stream = _flag(body.get("stream"), "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError(f"stream_options must be an object with include_usage (true or false), got {options!r}",
                           param="stream_options")
    include_usage = _flag(options.get("include_usage"), "stream_options")
    logprobs, top_logprobs = _asks_for_logprobs(body, endpoint)
    from_defaults = {name: value for name, value in defaults.items()
                     if value is not None and not (name in SAMPLING and not sample)}
    strategy = given.pop("strategy", from_defaults.pop("strategy", "static"))
    settings = {**read_by(strategy, from_defaults), **given, "do_sample": sample, "strategy": strategy}
    if stop:
        settings.update(stop_strings=stop, tokenizer=tokenizer)
    return Request(prompts, settings, stream, stream and include_usage, logprobs=logprobs, top_logprobs=top_logprobs)


# The request field that sets each generate() keyword whose name differs from it.
REQUEST_FIELDS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "num_return_sequences": "n",
                  "suppress_tokens": "logit_bias", "sequence_bias": "logit_bias", "stop_strings": "stop"}


def refusal(err: Exception, settings: dict) -> RequestError:
    """``generate()``'s refusal (``err``) of a request's ``settings`` as a 400 whose ``param`` is the request field of
    the setting its message names first (None where it names none)."""
    message = str(err)
    named = sorted((found.start(), name) for name in settings if (found := re.search(rf"\b{name}\b", message)))
    return RequestError(message, param=REQUEST_FIELDS.get(named[0][1], named[0][1]) if named else None)


def _logit_bias(value, tokenizer) -> tuple[list[int], dict[int, float]]:
    """OpenAI's ``logit_bias`` (a token id as a string -> a bias in [-100, 100]; None or {}: none) as the tokens it
    bans and the biases it adds: a bias of -100 ("should result in a ban or exclusive selection of the relevant
    token", OpenAI's reference says) never decodes its token (``generate()``'s ``suppress_tokens``: out of every pick
    and its softmax); any other is added to its token's logit in every pick (``sequence_bias``). Ids past the
    tokenizer's are refused."""
    if value is None or value == {}:
        return [], {}
    if not isinstance(value, dict):
        raise RequestError(f"logit_bias must be an object of token id -> bias, got {type(value).__name__}",
                           param="logit_bias")
    banned, biases, vocab = [], {}, len(tokenizer)
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdecimal() and int(key) < vocab):
            raise RequestError(f"logit_bias key {key!r} is not a token id of this model's vocabulary [0, {vocab})",
                               param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise RequestError(f"logit_bias {bias!r} for token {key} must be a number in [-100, 100] (-100: never "
                               "decoded)", param="logit_bias")
        if bias == -100:
            banned.append(int(key))
        elif bias != 0:
            biases[int(key)] = float(bias)
    return sorted(set(banned)), biases


def _check_model(body: dict, model_name: str) -> None:
    """Refuse a request naming a model other than the one served (a 404, as OpenAI's)."""
    if body.get("model") not in (None, model_name):
        raise RequestError(f"model {body['model']!r} is not served here; this server serves {model_name!r} "
                           "(GET /v1/models)", param="model", status=404)


# The fields of vLLM's token utilities, POST /tokenize and /detokenize.
UTILITY_FIELDS = {"tokenize": ("model", "prompt", "messages"), "detokenize": ("model", "tokens")}


def _check_utility(body, route: str, model_name: str) -> None:
    """Refuse a body of ``route`` (``tokenize`` or ``detokenize``) that is not an object, holds a field the route does
    not read, or names another model."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
    for name in body:
        if name not in UTILITY_FIELDS[route]:
            raise RequestError(f"unknown field {name!r} for /{route} (it reads {', '.join(UTILITY_FIELDS[route])})",
                               param=name)
    _check_model(body, model_name)


def read_tokenize(body, tokenizer, model_name: str) -> list[int]:
    """The token ids ``POST /tokenize`` answers with: its ``prompt`` (a string) tokenized as ``/v1/completions``
    tokenizes one, or its ``messages`` rendered as ``/v1/chat/completions`` renders them (the assistant's turn
    opened), so a client counts what a request's prompt will take. Raises :class:`RequestError` naming the field."""
    _check_utility(body, "tokenize", model_name)
    if ("prompt" in body) == ("messages" in body):
        raise RequestError("give a prompt (tokenized as /v1/completions does) or messages (rendered as "
                           "/v1/chat/completions does), one of them", param="prompt")
    if "messages" in body:
        return _chat_prompt(body["messages"], tokenizer, model_name)
    if not isinstance(body["prompt"], str):
        raise RequestError(f"prompt must be a string, got {type(body['prompt']).__name__}", param="prompt")
    return tokenizer(body["prompt"]).input_ids


def read_detokenize(body, tokenizer, model_name: str) -> list[int]:
    """The token ids ``POST /detokenize`` decodes: its ``tokens``, each a token id of the tokenizer's vocabulary.
    Raises :class:`RequestError` naming the field."""
    _check_utility(body, "detokenize", model_name)
    tokens, vocab = body.get("tokens"), len(tokenizer)
    if not isinstance(tokens, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in tokens):
        raise RequestError("tokens must be a list of token ids", param="tokens")
    outside = [i for i in tokens if not 0 <= i < vocab]
    if outside:
        raise RequestError(f"tokens holds {outside[0]}, outside the vocabulary [0, {vocab})", param="tokens")
    return tokens


def _check_fields(body: dict, endpoint: str) -> None:
    """Refuse a field this endpoint does not read (unless at a value asking for nothing)."""
    for name, value in body.items():
        if name in COMMON_FIELDS or name in ENDPOINT_FIELDS[endpoint] or name in EXTENSIONS:
            continue
        if name in ASKING_FOR_NOTHING:
            if value is None or value in ASKING_FOR_NOTHING[name]:
                continue
            raise RequestError(f"{name}={value!r} is not supported by this server (it accepts {name} only at "
                               f"{ASKING_FOR_NOTHING[name][0]!r})", param=name)
        known = sorted(COMMON_FIELDS | ENDPOINT_FIELDS[endpoint] | set(EXTENSIONS))
        raise RequestError(f"unknown field {name!r} for this endpoint (it reads {', '.join(known)})", param=name)


def _asks_for_logprobs(body: dict, endpoint: str) -> tuple[bool, int]:
    """Whether the request asks for each chosen token's log-probability, and for how many of the most likely tokens
    beside it (``/v1/completions``: ``logprobs: k``; chat: ``logprobs: true`` and ``top_logprobs: k``; k up to
    ``MAX_TOP_LOGPROBS``)."""
    if endpoint == "completions":
        value, name = body.get("logprobs"), "logprobs"
        if value is None or value is False:
            return False, 0
    else:
        value, name = body.get("top_logprobs") or 0, "top_logprobs"
        if not isinstance(body.get("logprobs", False), (bool, type(None))):
            raise RequestError(f"logprobs must be true or false, got {body['logprobs']!r}", param="logprobs")
        if not body.get("logprobs"):
            if value:
                raise RequestError(f"top_logprobs={value!r} needs logprobs=true", param="top_logprobs")
            return False, 0
    if _count(value, name, minimum=0) > MAX_TOP_LOGPROBS:
        raise RequestError(f"{name}={value} asks for more of the most likely tokens than this server gives (at most "
                           f"{MAX_TOP_LOGPROBS})", param=name)
    return True, value


def shown_tokens(offsets: list[int], text_length: int) -> int:
    """How many tokens, at ``offsets`` in their choice's text, make its first ``text_length`` characters: those
    starting before that end (an EOS, or the tokens of a stop string cut off, start at or past it)."""
    shown = 0
    while shown < len(offsets) and offsets[shown] < text_length:
        shown += 1
    return shown


def logprobs_in_text(endpoint: str, tokenizer, ids: list[int], logprobs: list[float], text: str,
                     tops: list[list[tuple[int, float]]], start: int = 0) -> dict:
    """OpenAI's ``logprobs`` (:func:`logprobs_of`) of a choice's tokens ``ids`` from ``start`` on that make its
    ``text`` (cut before a stop string): those starting before its end."""
    offsets = token_offsets(tokenizer, ids, start)
    end = start + shown_tokens(offsets, len(text))
    return logprobs_of(endpoint, tokenizer, ids[start:end], logprobs[start:end], offsets[: end - start],
                       tops[start:end])


def logprobs_of(endpoint: str, tokenizer, ids: list[int], logprobs: list[float], offsets: list[int],
                tops: list[list[tuple[int, float]]]) -> dict:
    """OpenAI's ``logprobs`` of a choice's tokens ``ids`` (all or a stream chunk's), with log-probabilities
    ``logprobs``, at ``offsets`` in the choice's text, and each one's most likely tokens (``tops``: (id,
    log-probability) pairs, most likely first; empty lists when not asked): each token as its own text
    (``tokenizer.decode([id])``) with its log-probability, and its most likely tokens (chat); for
    ``/v1/completions`` also its offset, and as its ``top_logprobs`` its most likely tokens and the chosen one (a text
    two of them share shows the likelier's)."""
    def text(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=True)

    def value(logprob: float) -> float:
        return max(logprob, -9999.0)  # a probability that underflowed: JSON has no -inf

    tokens, values = [text(token) for token in ids], [value(logprob) for logprob in logprobs]
    # a chosen token among its most likely ones shows its own log-probability there (the top lists' come from
    # another pass over the vocabulary, which may round it differently in the last digits)
    tops = [[(other, logprob if other == token else top_logprob) for other, top_logprob in top]
            for token, logprob, top in zip(ids, logprobs, tops)]
    if endpoint == "completions":
        ranked = [sorted([*top, (token, logprob)], key=lambda pair: -pair[1])
                  for token, logprob, top in zip(ids, logprobs, tops)]
        listed = [{} for _ in ranked]
        for entries, pairs in zip(listed, ranked):
            for token, logprob in pairs:
                entries.setdefault(text(token), value(logprob))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": listed, "text_offset": list(offsets)}
    return {"content": [{"token": t, "logprob": v, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": text(token), "logprob": value(logprob),
                                           "bytes": list(text(token).encode())} for token, logprob in top]}
                        for t, v, top in zip(tokens, values, tops)], "refusal": None}


def _completion_prompts(prompt, tokenizer) -> list[list[int]]:
    """``prompt``: a string, a list of token ids, or a list of either (several prompts) -> token ids a prompt."""
    if isinstance(prompt, str) or _is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or _is_ids(p) for p in prompt):
        raise RequestError("prompt must be a string, a list of token ids, or a non-empty list of those",
                           param="prompt")
    rows = [tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompt]
    if not all(rows):
        raise RequestError("prompt is empty: give at least one token", param="prompt")
    return rows


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in value)


def _chat_prompt(messages, tokenizer, model_name: str) -> list[int]:
    """``messages`` ({role, content} dicts) rendered by the chat template, the assistant's turn opened; a content
    given as OpenAI's list of text parts is their texts, one a line (as vLLM renders them)."""
    if isinstance(messages, list):
        messages = [{**m, "content": _text_of_parts(m["content"])}
                    if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in messages]
    if not (is_conversation(messages) and messages):
        raise RequestError("messages must be a non-empty list of {role, content} objects with string values (or "
                           "lists of text parts)", param="messages")
    try:
        return list(chat_ids(tokenizer, messages, model_name))
    except UsageError:
        raise RequestError(f"{model_name}'s tokenizer has no chat template: use /v1/completions with a plain prompt",
                           param="messages") from None


def _text_of_parts(parts: list) -> str:
    """The text of a message's content given as parts (``[{"type": "text", "text": ...}, ...]``), one a line; a
    part of another type (an image, audio) is refused: the model reads text only."""
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"a message's content part of type {kind!r} is not supported: this model reads text "
                               'parts only ({"type": "text", "text": ...})', param="messages")
    return "\n".join(part["text"] for part in parts)


def _count(value, name: str, minimum: int | None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        raise RequestError(f"{name} must be an integer" + ("" if minimum is None else f" >= {minimum}")
                           + f", got {value!r}", param=name)
    return value


def _number(value, name: str) -> float:
    """A finite JSON number (Python's JSON reader also takes NaN and Infinity)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}", param=name)
    return float(value)


def _flag(value, name: str) -> bool:
    """A JSON boolean, or null (false)."""
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
    return bool(value)


def _stop_strings(stop) -> list[str]:
    """``stop``: None, a string or a list of strings (non-empty) -> a list."""
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a non-empty string or a list of them, got {stop!r}", param="stop")
    return stop


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """``text`` up to (without) the first of the stop strings it holds, and whether it held one."""
    ends = [text.find(s) for s in stop if s in text]
    return (text[: min(ends)], True) if ends else (text, False)


def streamable(text: str, stop: list[str]) -> str:
    """What of a completion's text so far (:class:`.IncrementalText`'s, which holds back a character a later token
    may still complete) a stream may send: the text before a stop string it holds; else the text without its end
    where a stop string might be starting."""
    text, stopped = cut_at_stop(text, stop)
    if stopped:
        return text
    held = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - held]


def finish_reason(kept: int, ended: bool, stopped: bool, max_new_tokens: int) -> str:
    """OpenAI's ``finish_reason`` of a completion of ``kept`` new tokens: ``stop`` where it ended with an EOS
    (``ended``) or a stop string, or short of its budget; else ``length``."""
    return "stop" if ended or stopped or kept < max_new_tokens else "length"


def response_id(endpoint: str) -> str:
    return ("cmpl-" if endpoint == "completions" else "chatcmpl-") + uuid.uuid4().hex


def envelope(endpoint: str, rid: str, model_name: str, chunk: bool) -> dict:
    """The fields every response body (``chunk``: every stream chunk) of ``endpoint`` starts with."""
    kind = "text_completion" if endpoint == "completions" else "chat.completion.chunk" if chunk else "chat.completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model_name}


def choice(endpoint: str, index: int, text: str | None, reason: str | None, chunk: bool) -> dict:
    """One entry of a response's ``choices``: ``text`` (a stream chunk's: the text it adds; None: none, as in the
    last chunk) and the finish reason (None while a stream goes on)."""
    if endpoint == "completions":
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
    if chunk:
        return {"index": index, "delta": {} if text is None else {"content": text}, "logprobs": None,
                "finish_reason": reason}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": reason}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
