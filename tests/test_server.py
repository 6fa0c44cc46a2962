"""``mrp-serve``: OpenAI-style requests to the shipped model give what ``generate()`` gives their prompts alone
(completions, chat completions, streams), waiting greedy requests share one ``generate()`` call, a stream sends no
text it would have to take back, bad requests are refused naming the field, and the OpenAI client talks to it."""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from hypothesis import given, strategies as st

from hf_integration.cli import SHIPPED_MODEL, load
from hf_integration.cli_prompts import chat_ids
from hf_integration.server import Server, main, stream_events
from hf_integration.server_batcher import Batcher, Completion, Job
from hf_integration.server_requests import Request, cut_at_stop, logprobs_in_text, read_request, streamable
from tiny_models import LetterTokenizer
from training_fixtures import subprocess_env

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
DEFAULTS = {"strategy": "static", "max_new_tokens": 24}
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shipped():
    """(tokenizer, model) of the shipped checkpoint; the tokenizer given a chat template (the shipped one has none)."""
    tokenizer, model = load(str(SHIPPED_MODEL), "cpu", None)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer, model


@contextlib.contextmanager
def serving(tokenizer, model, defaults=DEFAULTS, max_batch_size=8):
    """A server on a free port of this machine, answering on a thread; yields its base URL."""
    server = Server(("127.0.0.1", 0), model, tokenizer, defaults, "sdar", max_batch_size, quiet=True)
    try:
        with serving_on(server):
            yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.server_close()


@contextlib.contextmanager
def serving_on(server: Server):
    """``server`` answering on a thread of its own until the block ends."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()


def post(url: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=raw if raw is not None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def events(url: str, body: dict) -> list:
    """The data of each server-sent event of a streamed request (JSON decoded; ``[DONE]`` as it is)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        lines = [line.decode().rstrip("\n") for line in response]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert all(not line or line.startswith("data: ") for line in lines), lines
    return [item if item == "[DONE]" else json.loads(item) for item in data]


def alone(model, ids: list[int], **settings):
    """generate()'s output for one prompt's ids, with its stats."""
    return model.generate(torch.tensor([ids]), return_dict_in_generate=True, **settings)


def kept(out, width: int, row: int = 0) -> list[int]:
    return out.sequences[row, width : width + int(out.new_tokens[row])].tolist()


@pytest.mark.parametrize("strategy", ["static", "speculative"])
def test_each_completion_is_what_generate_gives_its_prompt_alone(shipped, strategy):
    """Prompts as text and as token ids in one request, with a stop string that ends some of them: each choice is
    generate()'s completion of that prompt alone, cut before the stop string, with its finish reason, stats and
    token counts."""
    tokenizer, model = shipped
    prompts = ["def mean(values):\n", "import os\n", tokenizer("class Point:\n").input_ids]
    stop = ["self"]
    with serving(tokenizer, model) as url:
        status, body = post(url + "/v1/completions", {"model": "sdar", "prompt": prompts, "max_tokens": 20,
                                                      "strategy": strategy, "stop": stop})
    assert status == 200 and body["object"] == "text_completion" and body["model"] == "sdar"
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    reasons, prompt_tokens, completion_tokens = [], 0, 0
    for choice, prompt in zip(body["choices"], prompts):
        ids = prompt if isinstance(prompt, list) else tokenizer(prompt).input_ids
        out = alone(model, ids, max_new_tokens=20, strategy=strategy, stop_strings=stop, tokenizer=tokenizer)
        new = kept(out, len(ids))
        text, stopped = cut_at_stop(tokenizer.decode(new, skip_special_tokens=True), stop)
        assert choice["text"] == text and "self" not in choice["text"]
        reasons.append(choice["finish_reason"])
        assert choice["finish_reason"] == ("stop" if stopped or new[-1] == 0 else "length")
        stats = out.stats.as_dict()
        assert choice["stats"] == {key: stats[key][0] for key in ("backbone_forwards", "mrp_forwards",
                                                                  "tokens_per_forward")}
        prompt_tokens, completion_tokens = prompt_tokens + len(ids), completion_tokens + len(new)
    assert set(reasons) == {"stop", "length"}, reasons  # both ends exercised
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}


def test_a_sampled_completion_ending_with_eos_finishes_with_stop(shipped):
    """n samples of a prompt, drawn as generate() draws them with the request's seed; a sample that ends with its
    EOS finishes with ``stop`` (the EOS not in its text), one that runs to max_tokens with ``length``."""
    tokenizer, model = shipped
    ids = tokenizer("def f(x):\n").input_ids
    with serving(tokenizer, model) as url:
        status, body = post(url + "/v1/completions", {"prompt": ids, "max_tokens": 5, "temperature": 1.0, "seed": 1,
                                                      "n": 3})
    out = alone(model, ids, max_new_tokens=5, do_sample=True, seed=1, num_return_sequences=3)
    assert status == 200
    reasons = []
    for row, choice in enumerate(body["choices"]):
        new = kept(out, len(ids), row)
        assert choice["text"] == tokenizer.decode(new, skip_special_tokens=True)
        reasons.append(choice["finish_reason"])
        assert choice["finish_reason"] == ("stop" if new[-1] == tokenizer.eos_token_id else "length")
    assert set(reasons) == {"stop", "length"}, reasons


def test_the_servers_defaults_apply_where_a_request_reads_them(shipped):
    """Defaults of a sampling server with a dynamic threshold: a request without its own settings samples with them;
    one with temperature 0 decodes greedily, the sampling filters left out; one asking for static decoding leaves
    the threshold out; one whose extension fields are null takes the defaults (null is unset, as in OpenAI's
    fields); one setting top_k replaces the default's."""
    tokenizer, model = shipped
    defaults = {"strategy": "dynamic", "threshold": 0.6, "do_sample": True, "temperature": 0.8, "top_k": 5,
                "max_new_tokens": 12}
    ids = tokenizer("def mean(values):\n").input_ids
    cases = [({"seed": 4}, dict(strategy="dynamic", threshold=0.6, do_sample=True, temperature=0.8, top_k=5, seed=4)),
             ({"temperature": 0}, dict(strategy="dynamic", threshold=0.6)),
             ({"temperature": 0, "strategy": "static"}, dict(strategy="static")),
             ({"temperature": 0, "strategy": None, "top_k": None}, dict(strategy="dynamic", threshold=0.6)),  # unset
             ({"seed": 4, "top_k": 50, "temperature": 1.5},
              dict(strategy="dynamic", threshold=0.6, do_sample=True, temperature=1.5, top_k=50, seed=4))]
    with serving(tokenizer, model, defaults) as url:
        answers = [post(url + "/v1/completions", {"prompt": ids, **fields}) for fields, _ in cases]
    for (status, body), (_, settings) in zip(answers, cases):
        assert status == 200, body
        assert body["choices"][0]["text"] == tokenizer.decode(kept(alone(model, ids, max_new_tokens=12, **settings),
                                                                   len(ids)), skip_special_tokens=True), settings
    assert len({body["choices"][0]["text"] for _, body in answers}) > 2  # the settings differ in what they give


def test_a_chat_completion_renders_the_conversation_and_streams_the_same_text(shipped):
    tokenizer, model = shipped
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def parse(line):"}]
    request = {"messages": messages, "max_completion_tokens": 40, "strategy": "speculative"}
    with serving(tokenizer, model) as url:
        status, body = post(url + "/v1/chat/completions", request)
        chunks = events(url + "/v1/chat/completions", {**request, "stream": True,
                                                       "stream_options": {"include_usage": True}})
    ids = chat_ids(tokenizer, messages, "sdar")
    out = alone(model, ids, max_new_tokens=40, strategy="speculative")
    text = tokenizer.decode(kept(out, len(ids)), skip_special_tokens=True)
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert chunks[-1] == "[DONE]"
    chunks = chunks[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" and chunk["id"] == chunks[0]["id"] for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(chunks) >= 5  # the opening chunk, the text as the blocks fill (40 tokens: 3 blocks), the end, the usage
    deltas = [chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"]]
    assert "".join(deltas) == text
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[:-1]] == [None] * (len(chunks) - 2) + [
        body["choices"][0]["finish_reason"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    assert all(chunk["usage"] is None for chunk in chunks[:-1])  # OpenAI's: null until the usage chunk


def test_logprobs_are_the_log_of_each_kept_tokens_confidence(shipped):
    """/v1/completions with logprobs=3 and chat with logprobs=true (and top_logprobs=2, or none): the tokens that make
    the text (a stop string's tokens cut off, the EOS left out), their offsets in it, as each one's log-probability
    the log of generate()'s output_confidences there and as its most likely tokens generate()'s output_top_logprobs
    (completions: the chosen token's beside them; a text two tokens share shows the likelier's); a request without
    logprobs in the same batch gets none."""
    tokenizer, model = shipped
    prompts = ["def mean(values):\n", "import os\n"]
    with serving(tokenizer, model) as url:
        replies = {}

        def send(key, path, body):
            replies[key] = post(url + path, body)

        messages = [{"role": "user", "content": "def parse(line):"}]
        requests = [("plain", "/v1/completions", {"prompt": prompts, "max_tokens": 30, "logprobs": 3, "stop": "("}),
                    ("none", "/v1/completions", {"prompt": prompts[1], "max_tokens": 30, "stop": "("}),
                    ("chat", "/v1/chat/completions", {"messages": messages, "max_tokens": 30, "logprobs": True,
                                                      "top_logprobs": 2}),
                    ("chosen", "/v1/chat/completions", {"messages": messages, "max_tokens": 30, "logprobs": True})]
        threads = [threading.Thread(target=send, args=request) for request in requests]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    status, body = replies["none"]
    assert status == 200 and body["choices"][0]["logprobs"] is None
    cut = 0
    cases = [("plain", i, tokenizer(p).input_ids) for i, p in enumerate(prompts)]
    for key, index, ids in cases + [(key, 0, chat_ids(tokenizer, messages, "sdar")) for key in ("chat", "chosen")]:
        status, body = replies[key]
        assert status == 200
        k = {"plain": 3, "chat": 2, "chosen": 0}[key]
        out = alone(model, ids, max_new_tokens=30, output_confidences=True, output_top_logprobs=3,
                    **({"stop_strings": "(", "tokenizer": tokenizer} if key == "plain" else {}))
        new = kept(out, len(ids))
        reply = body["choices"][index]
        text = reply["text"] if key == "plain" else reply["message"]["content"]
        logprobs = reply["logprobs"] if key == "plain" else {
            "tokens": [t["token"] for t in reply["logprobs"]["content"]],
            "token_logprobs": [t["logprob"] for t in reply["logprobs"]["content"]]}
        n = len(logprobs["tokens"])
        assert 0 < n <= len(new) and "".join(logprobs["tokens"]).startswith(text)
        assert len("".join(logprobs["tokens"][:-1])) < len(text)  # no token past the text
        assert logprobs["tokens"] == [tokenizer.decode([i], skip_special_tokens=True) for i in new[:n]]
        expected = out.confidences[0, len(ids) : len(ids) + n].log().tolist()
        assert logprobs["token_logprobs"] == pytest.approx(expected, rel=1e-6)
        assert all(value < 0 for value in expected)
        top_ids = out.top_token_ids[0, len(ids) : len(ids) + n, :k].tolist()
        top_values = out.top_logprobs[0, len(ids) : len(ids) + n, :k].tolist()
        tops = [[(tokenizer.decode([i], skip_special_tokens=True), chosen_value if i == chosen else v)
                 for i, v in zip(*pair)]  # (the chosen token shows its own value there)
                for pair, chosen, chosen_value in zip(zip(top_ids, top_values), new, logprobs["token_logprobs"])]
        if key == "plain":
            cut += n < len(new)
            assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(n)]
            for listed, top, token, value in zip(logprobs["top_logprobs"], tops, logprobs["tokens"],
                                                 logprobs["token_logprobs"]):
                likelier = {}
                for text_, v in sorted([*top, (token, value)], key=lambda pair: -pair[1]):
                    likelier.setdefault(text_, v)
                assert listed == pytest.approx(likelier, rel=1e-6) and len(listed) <= 4
                assert listed[token] == value  # the chosen token shows its own value among the likeliest too
        else:
            assert [[(t["token"], t["logprob"]) for t in entry["top_logprobs"]]
                    for entry in reply["logprobs"]["content"]] == [pytest.approx(top, rel=1e-6) for top in tops]
            assert all(t["bytes"] == list(t["token"].encode()) and
                       all(alt["bytes"] == list(alt["token"].encode()) for alt in t["top_logprobs"])
                       for t in reply["logprobs"]["content"])
            assert all(alt["logprob"] == t["logprob"] for t in reply["logprobs"]["content"]
                       for alt in t["top_logprobs"] if alt["token"] == t["token"])
    assert cut  # a stop string or an EOS left tokens out


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_logit_bias_of_minus_100_bans_its_tokens(shipped, endpoint):
    """logit_bias -100 at the first two tokens the prompt's greedy completion starts with: the completion is
    generate()'s with those tokens suppressed (never decoded), unlike the one without the bias; an empty logit_bias
    asks for nothing."""
    tokenizer, model = shipped
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    request = {"max_tokens": 16, **({"prompt": "def add(a, b):\n"} if endpoint == "completions" else
                                    {"messages": [{"role": "user", "content": "def add(a, b):"}]})}
    ids = tokenizer("def add(a, b):\n").input_ids if endpoint == "completions" else \
        list(chat_ids(tokenizer, request["messages"], "sdar"))
    free = kept(alone(model, ids, max_new_tokens=16), len(ids))
    banned = sorted(set(free[:2]))
    with serving(tokenizer, model) as url:
        plain = post(url + path, {**request, "logit_bias": {}})
        biased = post(url + path, {**request, "logit_bias": {str(t): -100 for t in banned}})
    expected = kept(alone(model, ids, max_new_tokens=16, suppress_tokens=banned), len(ids))
    assert not set(banned) & set(expected) and expected != free
    assert plain[0] == biased[0] == 200

    def text(body):
        reply = body["choices"][0]
        return reply["text"] if endpoint == "completions" else reply["message"]["content"]

    assert text(plain[1]) == tokenizer.decode(free, skip_special_tokens=True)
    assert text(biased[1]) == tokenizer.decode(expected, skip_special_tokens=True)


def test_penalties_and_a_logit_bias_decode_as_generate(shipped):
    """presence_penalty, frequency_penalty and logit_bias (-100 a ban, another value a bias) give generate()'s
    completion with those penalties, the ban as suppress_tokens and the bias as sequence_bias; not the free one."""
    tokenizer, model = shipped
    ids = tokenizer("def add(a, b):\n").input_ids
    free = kept(alone(model, ids, max_new_tokens=16), len(ids))
    request = {"prompt": "def add(a, b):\n", "max_tokens": 16, "presence_penalty": 0.8, "frequency_penalty": 1.5,
               "logit_bias": {str(free[0]): -100, str(free[1]): -7.5}}
    with serving(tokenizer, model) as url:
        status, body = post(url + "/v1/completions", request)
    expected = kept(alone(model, ids, max_new_tokens=16, presence_penalty=0.8, frequency_penalty=1.5,
                          suppress_tokens=[free[0]], sequence_bias={(free[1],): -7.5}), len(ids))
    assert status == 200 and expected != free
    assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)


def test_a_stream_cut_by_a_stop_string_sends_the_text_before_it(shipped):
    tokenizer, model = shipped
    request = {"prompt": "def mean(values):\n", "max_tokens": 48, "stop": ["Return a"]}
    with serving(tokenizer, model) as url:
        status, body = post(url + "/v1/completions", request)
        chunks = events(url + "/v1/completions", {**request, "stream": True})
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1] == "[DONE]" and "usage" not in chunks[-2]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks[:-1]) == body["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_streams_logprobs_are_the_unstreamed_ones_chunk_by_chunk(shipped, endpoint):
    """Sampled choices (n=2, a seed; for /v1/completions two prompts) cut by a stop string, asking for logprobs and
    the 2 most likely tokens: each chunk carries those of the tokens starting in the text it adds (/v1/completions:
    their offsets lie in it), a choice's chunks together carry what the same request gets unstreamed, and a stream
    that does not ask for them, beside it in the call, gets none."""
    tokenizer, model = shipped
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    request = {"max_tokens": 32, "temperature": 0.9, "seed": 4, "n": 2}
    request.update({"prompt": ["def mean(values):\n", "import os\n"], "logprobs": 2, "stop": "("}
                   if endpoint == "completions" else
                   {"messages": [{"role": "user", "content": "def mean(values):"}], "logprobs": True, "stop": "#",
                    "top_logprobs": 2})

    def entries(logprobs) -> list[tuple]:
        """(token, log-probability, its most likely tokens, offset or None) of each token of a choice's logprobs."""
        if endpoint == "completions":
            return list(zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                            logprobs["text_offset"]))
        return [(t["token"], t["logprob"], t["top_logprobs"], None) for t in logprobs["content"]]

    with serving(tokenizer, model) as url:
        status, body = post(url + path, request)
        streams = {}

        def stream(key, logprobs):
            asked = {"logprobs": logprobs} if logprobs else {"logprobs": None, "top_logprobs": None}
            streams[key] = events(url + path, {**request, "stream": True, **asked})

        threads = [threading.Thread(target=stream, args=args) for args in (("with", request["logprobs"]),
                                                                             ("without", None))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert status == 200
    texts, joined = [""] * len(body["choices"]), [[] for _ in body["choices"]]
    for chunk in streams["with"][:-1]:
        (delta,) = chunk["choices"]
        if endpoint == "chat" and "role" in delta["delta"]:
            assert delta["logprobs"] is None
            continue
        index, text = delta["index"], delta["text"] if endpoint == "completions" else delta["delta"].get("content")
        new = entries(delta["logprobs"])
        if endpoint == "completions" and delta["finish_reason"] is None:
            assert text and all(len(texts[index]) <= offset < len(texts[index]) + len(text) for *_, offset in new)
        # (completions: the chosen token among the 2, or beside them)
        assert all(len(top) in ((2, 3) if endpoint == "completions" else (2,)) for _, _, top, _ in new)
        texts[index] += text or ""
        joined[index] += new
    expected = [entries(c["logprobs"]) for c in body["choices"]]
    assert joined == expected
    assert all(expected) and sum(c["finish_reason"] == "stop" for c in body["choices"]) >= 1
    assert all(delta["logprobs"] is None for chunk in streams["without"][:-1] for delta in chunk["choices"])


def test_a_chunk_carries_the_logprobs_of_the_tokens_starting_in_the_text_it_sends():
    """Tokens x a a b x with stop string "ab" (letters as token ids): the second "a" may start the stop string, so the
    chunk that sends the first "a" leaves its log-probability for later; the stop string then ends the text, and
    the last chunk sends nothing more: x and the first a, each with its own log-probability and offset."""
    ids, values = [23, 0, 0, 1, 23], [-0.5, -1.0, -1.5, -2.0, -2.5]
    job = Job(Request([[2]], {"stop_strings": ["ab"], "max_new_tokens": 8}, stream=True, include_usage=False,
                      logprobs=True), pieces=queue.SimpleQueue())
    for token, value in zip(ids, values):
        job.pieces.put((0, [token], [value], [[]]))
    job.pieces.put(None)
    job.future.set_result([Completion(ids[:4], ended=False, stats={}, logprobs=values[:4], tops=[[]] * 4)])
    chunks = [json.loads(e.removeprefix("data: ")) for e in stream_events(job, "completions", "id", LetterTokenizer(),
                                                                             "sdar") if "[DONE]" not in e]
    assert [(c["choices"][0]["text"], c["choices"][0]["logprobs"]["tokens"], c["choices"][0]["logprobs"]["text_offset"],
             c["choices"][0]["finish_reason"]) for c in chunks] == [("x", ["x"], [0], None), ("a", ["a"], [1], None),
                                                                   ("", [], [], "stop")]
    assert [c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks] == [[-0.5], [-1.0], []]


def test_a_stream_sends_a_character_split_over_tokens_once_it_is_whole(shipped):
    """The shipped tokenizer's tokens of "é≥ café ∑" (é two of them, ≥ and ∑ three), streamed a token at a time: no
    chunk carries U+FFFD, the chunks join to the unstreamed text, and each token's log-probability comes with the chunk
    its character starts in; unstreamed, every token's comes, the last character's later bytes' too (offsets that
    counted a partial character's U+FFFD put them past the text, and left them out)."""
    tokenizer, _ = shipped
    text = "é≥ café ∑"
    ids = tokenizer.encode(text, add_special_tokens=False)
    values = [-0.25 * (i + 1) for i in range(len(ids))]
    job = Job(Request([[2]], {"max_new_tokens": len(ids)}, stream=True, include_usage=False, logprobs=True),
              pieces=queue.SimpleQueue())
    for token, value in zip(ids, values):
        job.pieces.put((0, [token], [value], [[]]))
    job.pieces.put(None)
    job.future.set_result([Completion(ids, ended=True, stats={}, logprobs=values, tops=[[]] * len(ids))])
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0]
              for e in stream_events(job, "completions", "id", tokenizer, "sdar") if "[DONE]" not in e]
    assert "".join(c["text"] for c in chunks) == text and not any("\ufffd" in c["text"] for c in chunks)
    assert [c["text"] for c in chunks[:3]] == ["é", "≥", " c"]  # the bytes of é and ≥ wait for their last
    sent = 0
    for c in chunks:
        assert all(sent <= offset < sent + len(c["text"]) for offset in c["logprobs"]["text_offset"])
        sent += len(c["text"])
    assert [v for c in chunks for v in c["logprobs"]["token_logprobs"]] == values
    unstreamed = logprobs_in_text("completions", tokenizer, ids, values, text, [[]] * len(ids))
    assert unstreamed["token_logprobs"] == values  # the last character's later bytes too
    assert unstreamed["text_offset"] == [o for c in chunks for o in c["logprobs"]["text_offset"]]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_stream_of_several_choices_sends_each_ones_text_under_its_index(shipped, endpoint):
    """Sampled (n=2, a seed) and, for /v1/completions, two prompts: each choice's deltas join to the text the same
    request gets unstreamed, each choice ends with its finish reason and stats, and the usage counts them all."""
    tokenizer, model = shipped
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    request = {"max_tokens": 24, "min_tokens": 24, "temperature": 0.9, "seed": 11, "n": 2}  # EOS held back
    request.update({"prompt": ["def mean(values):\n", "import os\n"]} if endpoint == "completions" else
                   {"messages": [{"role": "user", "content": "def mean(values):"}]})
    with serving(tokenizer, model) as url:
        status, body = post(url + path, request)
        chunks = events(url + path, {**request, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and chunks[-1] == "[DONE]" and chunks[-2]["usage"] == body["usage"]
    choices = body["choices"]
    texts = [""] * len(choices)
    for chunk in chunks[:-2]:
        (delta,) = chunk["choices"]
        texts[delta["index"]] += delta["text"] if endpoint == "completions" else delta["delta"].get("content") or ""
    expected = [c["text"] if endpoint == "completions" else c["message"]["content"] for c in choices]
    assert texts == expected and len(choices) == (4 if endpoint == "completions" else 2)
    assert len(set(expected)) == len(expected)
    streamed = [chunk["choices"][0]["index"] for chunk in chunks[:-2] if not chunk["choices"][0]["finish_reason"]]
    assert set(streamed) == set(range(len(choices))) and len(streamed) > 2 * len(choices)  # as they were decoded
    ends = [chunk["choices"][0] for chunk in chunks[:-2] if chunk["choices"][0]["finish_reason"]]
    assert [(c["index"], c["finish_reason"], c["stats"]) for c in ends] == [
        (c["index"], c["finish_reason"], c["stats"]) for c in choices]


@given(text=st.text(alphabet="ab\n", max_size=24), stop=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4),
                                                                  max_size=3), cut=st.integers(0, 24))
def test_a_stream_never_sends_text_it_would_have_to_take_back(text, stop, cut):
    """What a stream sends of a completion's text so far is a prefix of the final text (cut before its first stop
    string), whatever comes after, and grows as the text grows."""
    sent = streamable(text[:cut], stop)
    final, stopped = cut_at_stop(text, stop)
    assert final.startswith(sent)
    assert streamable(text, stop).startswith(sent)
    assert not any(s in sent for s in stop)
    if stopped:
        assert streamable(text, stop) == final


def test_waiting_requests_with_the_same_settings_share_one_generate_call(shipped, monkeypatch):
    """While a call decodes, the requests that arrive wait; then the oldest goes with every waiting request of the
    same settings (up to max_batch_size rows; a greedy request's seed, sampled requests' seeds, temperatures and top-p
    and the max_tokens and stop strings each asks aside; streamed or not) in one call, while one with other settings
    gets its own (so does one leaving max_new_tokens to generate()'s default). Each completion is the one its prompt
    gets alone, with its max_tokens and stop strings: greedy, or sampled at its request's temperature and top-p with
    its seed (its own, or the one drawn for it); the streamed one's pieces are its tokens."""
    tokenizer, model = shipped
    calls, gate, real = [], threading.Event(), model.generate

    def held(input_ids, **settings):
        calls.append([tokenizer.decode(row[mask.bool()]) for row, mask in zip(input_ids, settings["attention_mask"])])
        gate.wait(120) if len(calls) == 1 else None
        return real(input_ids, **settings)

    monkeypatch.setattr(model, "generate", held)
    reports = []
    batcher = Batcher(model, max_batch_size=4, report=reports.append)

    def submit(prompt, defaults=DEFAULTS, **fields):
        return batcher.submit(read_request({"prompt": prompt, "max_tokens": 16, **fields}, "completions", tokenizer,
                                           defaults, "sdar"))

    jobs = [submit("import os\n")]
    while not calls:
        threading.Event().wait(0.01)
    jobs += [submit("def add(a, b):\n"), submit("class Box:\n", seed=9, max_tokens=7, stop="\n"),  # a greedy
             submit(["x = 1\n", "y = 2\n"], max_tokens=30, stop=["=", "("]),  # 4 rows  # request's seed: no matter
             submit("z = 3\n"),  # a fifth row: too many for that call
             submit("def add(a, b):\n", temperature=0.7, seed=5, n=2),  # sampled: together, a seed each
             submit("def add(a, b):\n", stream=True, max_tokens=10, stop="("),  # streamed: with z
             submit("class Box:\n", temperature=1.3, top_p=0.8, n=2),  # a seed drawn for it, another temperature
             submit("def add(a, b):\n", temperature=0.7, seed=6, n=2, max_tokens=12),
             submit("def add(a, b):\n", strategy="speculative"),  # other settings
             submit("z = 3\n", defaults={"strategy": "static"}, max_tokens=None)]  # generate()'s max_new_tokens
    gate.set()
    pieces = []
    while (piece := jobs[6].next_piece()) is not None:
        assert piece[0] == 0  # its one choice
        pieces += piece[1]
    results = [job.future.result(120) for job in jobs]
    assert pieces == results[6][0].ids
    batcher.close()
    add, box = "def add(a, b):\n", "class Box:\n"
    assert calls == [["import os\n"], [add, box, "x = 1\n", "y = 2\n"], ["z = 3\n", add], [add, box], [add], [add],
                     ["z = 3\n"]]
    assert [line.split(":")[0] for line in reports] == [
        "1 request, 1 row in one static call", "3 requests, 4 rows in one static call",
        "2 requests, 2 rows in one static call", "2 requests, 4 rows in one static call",
        "1 request, 2 rows in one static call", "1 request, 1 row in one speculative call",
        "1 request, 1 row in one static call"]
    new_tokens = sum(len(completion.ids) for completions in results[1:4] for completion in completions)
    assert reports[1].split(": ")[1].startswith(f"{new_tokens} new tokens in ")
    samples = {tuple(completion.ids) for job in (jobs[5], jobs[8]) for completion in job.future.result()}
    assert len(samples) == 4  # two seeds, two samples each
    for job, completions in zip(jobs, results):
        settings = {"strategy": job.request.settings["strategy"],
                    "max_new_tokens": job.request.settings.get("max_new_tokens"),
                    **({"stop_strings": job.request.stop, "tokenizer": tokenizer} if job.request.stop else {})}
        if job.request.settings["do_sample"]:
            settings.update(do_sample=True, temperature=job.request.settings["temperature"],
                            seed=job.request.settings["seed"], num_return_sequences=2,
                            top_p=job.request.settings.get("top_p"))
        n = settings.get("num_return_sequences", 1)
        assert len(completions) == len(job.request.prompts) * n
        for p, ids in enumerate(job.request.prompts):
            out = real(torch.tensor([ids]), return_dict_in_generate=True, **settings)
            assert [c.ids for c in completions[p * n : (p + 1) * n]] == [kept(out, len(ids), row) for row in range(n)]


MIXED_REQUESTS = {  # the requests of a test below, and the rows of each call they share
    "greedy and sampled": ([{"prompt": "import os\n"},
                            {"prompt": "def add(a, b):\n", "temperature": 0.8, "seed": 5, "top_k": 5},
                            {"prompt": "class Box:\n", "stream": True, "logprobs": 0},
                            {"prompt": "x = 1\n", "temperature": 1.2, "seed": 6, "repetition_penalty": 1.3}], [3, 1]),
    "filters": ([{"prompt": "import os\n", "temperature": 0.7, "seed": 1, "min_p": 0.1, "top_k": 20},
                 {"prompt": "def add(a, b):\n", "temperature": 1.1, "seed": 2, "typical_p": 0.8,
                  "epsilon_cutoff": 0.01},
                 {"prompt": "class Box:\n", "temperature": 0.9, "seed": 3, "eta_cutoff": 0.02, "stream": True,
                  "logprobs": 0},
                 {"prompt": "x = 1\n", "temperature": 1.0, "seed": 4, "top_k": 0, "top_h": 0.6}], [4]),
    "penalties": ([{"prompt": "import os\n", "frequency_penalty": 0.5},
                   {"prompt": "def add(a, b):\n", "temperature": 0.8, "seed": 5, "presence_penalty": 1.0},
                   {"prompt": "class Box:\n", "stream": True, "logprobs": 0, "frequency_penalty": 1.5,
                    "presence_penalty": -0.5},
                   {"prompt": "x = 1\n"}], [4])}


@pytest.mark.parametrize("mix", MIXED_REQUESTS)
@pytest.mark.parametrize("strategy", ["static", "speculative"])
def test_requests_share_a_call_whatever_their_temperature_and_filters_greedy_or_not(shipped, monkeypatch, strategy,
                                                                                     mix):
    """Greedy requests (one streamed, one asking for logprobs) and a sampled one (a temperature, top-k and seed of
    its own) share a call; a second sampled request, at a repetition penalty, cannot share that call (a call has one)
    and gets its own. Sampled requests at their own top-k (one at 0, two at none), top-h (one; the others none), min-p,
    typical-p, epsilon and eta (one at none) share a call; so do requests at presence and frequency penalties of
    their own (greedy and sampled; one without). Each
    completion is what its prompt gets alone: greedy, or sampled with its request's settings (and its logprobs those
    of the tokens it keeps)."""
    tokenizer, model = shipped
    calls, real = [], model.generate
    monkeypatch.setattr(model, "generate", lambda input_ids, **settings: calls.append(input_ids.shape[0]) or
                        real(input_ids, **settings))
    batcher = Batcher(model, max_batch_size=8)
    bodies, expected_calls = MIXED_REQUESTS[mix]
    with batcher.changed:  # all wait before the decoding thread looks
        jobs = [batcher.submit(read_request({**body, "max_tokens": 20, "strategy": strategy}, "completions",
                                            tokenizer, DEFAULTS, "sdar")) for body in bodies]
    while jobs[2].next_piece() is not None:
        pass
    results = [job.future.result(120)[0] for job in jobs]
    batcher.close()
    assert calls == expected_calls
    for job, completion in zip(jobs, results):
        settings = {k: v for k, v in job.request.settings.items() if k not in ("stop_strings", "tokenizer")}
        ids = job.request.prompts[0]
        out = alone(model, ids, output_confidences=True, **settings)
        assert completion.ids == kept(out, len(ids))
        if job.request.logprobs:
            assert completion.logprobs == out.confidences[0, len(ids):len(ids) + len(completion.ids)].log().tolist()
    greedy = alone(model, jobs[1].request.prompts[0], strategy=strategy, max_new_tokens=20)
    assert results[1].ids != kept(greedy, len(jobs[1].request.prompts[0])) and jobs[1].request.settings["do_sample"]


def test_a_stream_whose_client_left_stops_its_row_and_the_others_go_on(shipped):
    """A streamed request and a plain one share a call; the stream's client leaves after its first piece: its row
    stops short of its 400 tokens (without the criterion's verdict it decodes all 400), the other row decodes on to
    what it gives alone."""
    tokenizer, model = shipped
    batcher = Batcher(model, max_batch_size=8)

    def submit(body):
        return batcher.submit(read_request(body, "completions", tokenizer, DEFAULTS, "sdar"))

    with batcher.changed:  # both wait before the decoding thread looks: one call
        job = submit({"prompt": "def f(x):\n", "max_tokens": 400, "min_tokens": 400, "stream": True})  # no EOS
        other = submit({"prompt": "import os\n", "max_tokens": 200, "min_tokens": 200})
    assert job.next_piece()
    job.cancelled.set()
    while job.next_piece() is not None:
        pass
    completion, (rest,) = job.future.result(120)[0], other.future.result(120)
    batcher.close()
    assert 0 < len(completion.ids) < 400
    ids = tokenizer("import os\n").input_ids
    assert len(rest.ids) == 200
    assert rest.ids == kept(alone(model, ids, max_new_tokens=200, min_new_tokens=200), len(ids))


def test_a_request_whose_client_left_stops_its_row_and_the_others_go_on(shipped, monkeypatch):
    """A request that does not stream shares a call with another; its client closes the connection while the call
    decodes: the server notices (a waiting request checks its connection), answers nothing and stops its row, which
    ends short of its 300 tokens (EOS held back: it decodes all 300 unless stopped), while the other row decodes its
    300 as alone."""
    tokenizer, model = shipped
    started, gate, real = [], threading.Event(), model.generate

    def held(input_ids, **settings):
        started.append(input_ids.shape[0])
        gate.wait(120) if len(started) == 1 else None
        out = real(input_ids, **settings)
        started.append(out.new_tokens.tolist())
        return out

    monkeypatch.setattr(model, "generate", held)
    server = Server(("127.0.0.1", 0), model, tokenizer, DEFAULTS, "sdar", quiet=True)
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    answers = []

    def client(body):
        answers.append(post(url, body))

    with serving_on(server):
        threads = [threading.Thread(target=client, args=({"prompt": "x = 1\n", "max_tokens": 4},))]
        threads[0].start()  # holds the decoding thread while the two others queue
        while not started:
            time.sleep(0.01)
        leaving = socket.create_connection(server.server_address)
        body = json.dumps({"prompt": "def f(x):\n", "max_tokens": 300, "min_tokens": 300}).encode()  # no EOS
        leaving.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        while server.batcher.metrics()[0] < 1:
            time.sleep(0.01)
        threads.append(threading.Thread(target=client, args=({"prompt": "import os\n", "max_tokens": 300,
                                                              "min_tokens": 300},)))
        threads[1].start()
        while server.batcher.metrics()[0] < 2:
            time.sleep(0.01)
        gate.set()
        while len(started) < 3:  # the shared call has begun
            time.sleep(0.01)
        leaving.close()
        for thread in threads:
            thread.join(300)
    assert started[2] == 2 and 0 < started[3][0] < 300 and started[3][1] == 300, started
    (status, first), (status2, other) = answers
    assert status == status2 == 200 and len(answers) == 2
    ids = tokenizer("import os\n").input_ids
    assert other["choices"][0]["text"] == tokenizer.decode(
        kept(alone(model, ids, max_new_tokens=300, min_new_tokens=300), len(ids)), skip_special_tokens=True)


def test_a_burst_of_connections_waits_in_the_kernels_queue(shipped):
    """64 clients connect while the server accepts none (its accept loop held, as when the decoding thread holds the
    interpreter): the kernel queues every connection (socketserver's default backlog of 5 let 6 in, then timed out or
    reset the rest), and each is answered once the loop runs."""
    tokenizer, model = shipped
    server = Server(("127.0.0.1", 0), model, tokenizer, DEFAULTS, "sdar", quiet=True)
    connections = []
    try:
        for _ in range(64):
            connections.append(socket.create_connection(server.server_address, timeout=5))
        with serving_on(server):
            for connection in connections:
                connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert all(connection.recv(64).startswith(b"HTTP/1.0 200") for connection in connections)
    finally:
        for connection in connections:
            connection.close()
        server.server_close()


@pytest.mark.parametrize("path, body, status, param, message", [
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty", "in [-2, 2]"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": "high"}, 400, "presence_penalty", "a finite number"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", "in [-100, 100]"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "at most 20"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs", "integer >= 0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs", "at most 20"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -2},
     400, "top_logprobs", "integer >= 0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400,
     "top_logprobs", "top_logprobs=3 needs logprobs=true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400, "logprobs",
     "true or false"),
    ("/v1/completions", {"prompt": "x", "beams": 2}, 400, "beams", "unknown field 'beams'"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "3"}}, 400, "logit_bias", "must be a number"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": -100.0, "6": True}},
     400, "logit_bias", "logit_bias True for token 6"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": -100}}, 400, "logit_bias", "'a' is not a token id"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"\uff15": 3}}, 400, "logit_bias", "is not a token id"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": -100}}, 400, "logit_bias", "not a token id"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [5]}, 400, "logit_bias", "an object of token id -> bias"),
    ("/v1/completions", {"messages": [{"role": "user", "content": "x"}]}, 400, "messages", "unknown field"),
    ("/v1/chat/completions", {"prompt": "x"}, 400, "prompt", "unknown field"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "serves 'sdar'"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "a string, a list of token ids"),
    ("/v1/completions", {}, 400, "prompt", "a string, a list of token ids"),
    ("/v1/completions", {"prompt": [5, 99999]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens", "max_position_embeddings"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", ">= 0"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "a finite number"),
    ("/v1/completions", {"prompt": "x", "top_k": 5}, 400, "top_k", "temperature > 0"),
    ("/v1/completions", {"prompt": "x", "top_p": 0.5, "temperature": 0}, 400, "top_p", "temperature > 0"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", "temperature > 0"),
    ("/v1/completions", {"prompt": "x", "threshold": 0.5}, 400, "threshold", "threshold=0.5"),
    ("/v1/completions", {"prompt": "x", "strategy": "beam"}, 400, "strategy", "strategy"),
    ("/v1/completions", {"prompt": "x", "seed": -1, "temperature": 1}, 400, "seed", "seed=-1"),
    ("/v1/completions", {"prompt": "x", "strategy": "direct", "mrp_scale": 1e39}, 400, "mrp_scale", "float32"),
    ("/v1/completions", {"prompt": "x", "strategy": "speculative", "mrp_steps": 17}, 400, "mrp_steps",
     "at most block_length (16)"),
    ("/v1/completions", {"prompt": "x", "temperature": float("nan")}, 400, "temperature", "a finite number"),
    ("/v1/completions", {"prompt": "x", "top_p": float("inf"), "temperature": 1}, 400, "top_p", "a finite number"),
    ("/v1/completions", {"prompt": "x", "stream": "true"}, 400, "stream", "true or false"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": "yes"}, 400, "stream_options",
     "an object with include_usage"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "stream_options", "true or false"),
    ("/v1/completions", {"prompt": "x", "temperature": 1, "n": 9}, 400, "n", "9 completions, more than the 8 rows"),
    ("/v1/completions", {"prompt": "x", "temperature": 1, "n": 2**70, "stream": True}, 400, "n", "more than the 8"),
    ("/v1/completions", {"prompt": ["x"] * 9}, 400, "prompt", "9 prompts ask for 9 completions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages", "part of type 'image_url' is not supported"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "non-empty string"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages", "non-empty list"),
    ("/v1/embeddings", {"input": "x"}, 404, None, "no route POST /v1/embeddings"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt", "one of them"),
    ("/tokenize", {}, 400, "prompt", "one of them"),
    ("/tokenize", {"prompt": [5]}, 400, "prompt", "must be a string"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": False}, 400, "add_special_tokens", "unknown field"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model", "serves 'sdar'"),
    ("/tokenize", {"messages": []}, 400, "messages", "non-empty list"),
    ("/detokenize", {"tokens": [5, 99999]}, 400, "tokens", "99999, outside the vocabulary"),
    ("/detokenize", {"tokens": "5"}, 400, "tokens", "a list of token ids"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens", "a list of token ids"),
    ("/detokenize", ["x"], 400, None, "a JSON object"),
    ("/v1/completions", ["x"], 400, None, "a JSON object"),
])
def test_a_bad_request_is_refused_naming_the_field(shipped, path, body, status, param, message):
    tokenizer, model = shipped
    with serving(tokenizer, model) as url:
        code, answer = post(url + path, body)
        bad_json = post(url + "/v1/completions", None, raw=b"{not json")
        served = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4})  # the server goes on
    assert code == status, answer
    assert answer["error"]["param"] == param and message in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert bad_json[0] == 400 and "not valid JSON" in bad_json[1]["error"]["message"]
    assert served[0] == 200


def test_a_body_too_large_or_with_a_bad_length_is_refused_before_it_is_read(shipped):
    tokenizer, model = shipped
    with serving(tokenizer, model) as url:
        answers = []
        nested = b"[" * 100_000 + b"]" * 100_000
        for header, value, body in (("Content-Length", str(2**30), b""), ("Content-Length", "many", b""),
                                    ("Content-Length", "-1", b'{"prompt": "x"}'),
                                    ("Transfer-Encoding", "chunked", b'f\r\n{"prompt": "x"}\r\n0\r\n\r\n'),
                                    ("Content-Length", str(len(nested)), nested)):
            connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
            connection.putrequest("POST", "/v1/completions")
            connection.putheader(header, value)
            connection.endheaders(body)
            response = connection.getresponse()
            answers.append((response.status, json.loads(response.read())["error"]["message"]))
            connection.close()
    assert answers[0][0] == 413 and "more than the 16777216" in answers[0][1]
    assert answers[1] == (400, "Content-Length is not a number: 'many'")
    assert answers[2] == (400, "Content-Length must be >= 0, got -1")  # (read to the end: the answer never came)
    assert answers[3][0] == 411 and "not one sent in chunks" in answers[3][1]
    assert answers[4] == (400, "the body nests its JSON arrays or objects too deeply to read")


def test_a_failure_while_decoding_is_answered_with_a_500_and_the_server_goes_on(shipped, monkeypatch):
    tokenizer, model = shipped
    real = model.generate
    failures = iter([RuntimeError("CUDA out of memory"), RuntimeError("CUDA out of memory")])

    def failing(*args, **kwargs):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", failing)
    with serving(tokenizer, model) as url:
        code, answer = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4})
        chunks = events(url + "/v1/completions", {"prompt": "x", "max_tokens": 4, "stream": True})
        served = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4})
        metrics = metrics_of(url)
    assert code == 500 and answer["error"] == {"message": "RuntimeError: CUDA out of memory", "type": "server_error",
                                               "param": None, "code": None}
    assert chunks == [answer, "[DONE]"]
    assert served[0] == 200
    assert metrics["generate_calls_total"] == 3 and metrics["failed_generate_calls_total"] == 2
    assert metrics["new_tokens_total"] == served[1]["usage"]["completion_tokens"]


def test_a_client_gone_before_its_answer_is_sent_gets_no_500(shipped, monkeypatch):
    """A client that leaves as its answer is being written (a broken pipe) is not answered again with a 500 (one more
    failed write, and a traceback in the log); the server goes on."""
    from hf_integration.server import Handler

    tokenizer, model = shipped
    sent, send_text = [], Handler.send_text

    def breaking(self, text, status=200, kind="application/json"):
        sent.append(status)
        if len(sent) == 1:
            raise BrokenPipeError(32, "Broken pipe")
        return send_text(self, text, status, kind)

    monkeypatch.setattr(Handler, "send_text", breaking)
    with serving(tokenizer, model) as url:
        with pytest.raises((urllib.error.URLError, http.client.HTTPException, ConnectionError)):
            post(url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        served = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert sent == [200, 200] and served[0] == 200


def metrics_of(url: str) -> dict[str, float]:
    """``GET /metrics``, each ``mrp_serve_`` sample by its name without the prefix (its HELP and TYPE lines checked)."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        lines = response.read().decode().splitlines()
    samples = {}
    for help_line, type_line, sample in zip(lines[::3], lines[1::3], lines[2::3]):
        name, value = sample.split(" ")
        assert help_line.startswith(f"# HELP {name} ") and type_line.split(" ")[:3] == ["#", "TYPE", name]
        samples[name.removeprefix("mrp_serve_")] = float(value)
    return samples


def test_metrics_count_what_the_server_decoded(shipped):
    """GET /metrics: nothing at first; then the calls, requests, rows (prompts x n) and new tokens of what was served
    (the new tokens those the responses count), and the seconds decoding."""
    tokenizer, model = shipped
    with serving(tokenizer, model) as url:
        first = metrics_of(url)
        _, two = post(url + "/v1/completions", {"prompt": ["a = 1\n", "b = 2\n"], "max_tokens": 5})
        _, sampled = post(url + "/v1/completions", {"prompt": "c = 3\n", "max_tokens": 3, "temperature": 1, "n": 2})
        after = metrics_of(url)
    assert first == dict.fromkeys(first, 0.0) and len(first) == 7
    assert {name: after[name] for name in ("waiting_requests", "generate_calls_total", "failed_generate_calls_total",
                                           "requests_total", "rows_total")} == {
        "waiting_requests": 0, "generate_calls_total": 2, "failed_generate_calls_total": 0, "requests_total": 2,
        "rows_total": 4}
    assert after["new_tokens_total"] == two["usage"]["completion_tokens"] + sampled["usage"]["completion_tokens"]
    assert after["decoding_seconds_total"] > 0


def test_tokenize_gives_the_ids_a_requests_prompt_takes_and_detokenize_their_text(shipped):
    """vLLM's token utilities: /tokenize gives a prompt's ids as /v1/completions tokenizes it (its usage's
    prompt_tokens is their count) and chat messages' as /v1/chat/completions renders them; /detokenize decodes ids
    back to text, special tokens included. A message's content given as OpenAI's list of text parts is their texts,
    one a line."""
    tokenizer, model = shipped
    messages = [{"role": "user", "content": "def parse(line):\n    pass"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "def parse(line):"},
                                          {"type": "text", "text": "    pass"}]}]
    with serving(tokenizer, model) as url:
        prompt = post(url + "/tokenize", {"prompt": "import os\nimport sys", "model": "sdar"})
        chat = post(url + "/tokenize", {"messages": messages})
        in_parts = post(url + "/tokenize", {"messages": parts})
        empty = post(url + "/tokenize", {"prompt": ""})
        completion = post(url + "/v1/completions", {"prompt": "import os\nimport sys", "max_tokens": 4})
        text = post(url + "/detokenize", {"tokens": prompt[1]["tokens"]})
        special = post(url + "/detokenize", {"tokens": [tokenizer.eos_token_id]})
    ids = tokenizer("import os\nimport sys").input_ids
    assert prompt == (200, {"count": len(ids), "max_model_len": model.config.max_position_embeddings, "tokens": ids})
    assert completion[1]["usage"]["prompt_tokens"] == len(ids)
    assert chat[1]["tokens"] == list(chat_ids(tokenizer, messages, "sdar"))
    assert chat[1]["count"] == len(chat[1]["tokens"]) and in_parts == chat
    assert empty[1]["count"] == 0
    assert text == (200, {"prompt": "import os\nimport sys"})
    assert special == (200, {"prompt": tokenizer.eos_token})


def test_a_chat_request_to_a_model_without_a_chat_template_is_refused(shipped):
    tokenizer, model = shipped
    plain = copy.copy(tokenizer)
    plain.chat_template = None
    with serving(plain, model) as url:
        code, answer = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert code == 400 and answer["error"]["param"] == "messages" and "no chat template" in answer["error"]["message"]


def test_the_openai_client_talks_to_mrp_serve(shipped):
    """The OpenAI Python client: models, a completion with an extension field (extra_body), a sampled one that its
    seed repeats, a chat completion with its tokens' logprobs streamed and not, and an error."""
    tokenizer, model = shipped
    with serving(tokenizer, model, {"strategy": "speculative", "max_new_tokens": 24}) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["sdar"] and client.models.retrieve("sdar").id == "sdar"
        completion = client.completions.create(model="sdar", prompt="def mean(values):\n", max_tokens=20,
                                               extra_body={"strategy": "static", "min_tokens": 20})
        ids = tokenizer("def mean(values):\n").input_ids
        assert completion.choices[0].text == tokenizer.decode(kept(alone(model, ids, max_new_tokens=20,
                                                                         min_new_tokens=20), len(ids)))
        assert completion.usage.completion_tokens == 20 and completion.choices[0].finish_reason == "length"
        sampled = [client.completions.create(model="sdar", prompt="import", max_tokens=12, temperature=0.9, seed=3,
                                             n=2, top_p=0.95) for _ in range(2)]
        assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
        stream = list(client.chat.completions.create(model="sdar", messages=[{"role": "user", "content": "def f(x):"}],
                                                     max_tokens=24, stream=True, logprobs=True))
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        reply = client.chat.completions.create(model="sdar", messages=[{"role": "user", "content": "def f(x):"}],
                                               max_tokens=24)
        assert text == reply.choices[0].message.content and text
        scored = client.chat.completions.create(model="sdar", messages=[{"role": "user", "content": "def f(x):"}],
                                                max_tokens=24, logprobs=True)
        tokens = scored.choices[0].logprobs.content
        assert "".join(t.token for t in tokens) == text and all(t.logprob < 0 for t in tokens)
        assert [t for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for t in chunk.choices[0].logprobs.content] == tokens
        with pytest.raises(openai.BadRequestError, match="presence_penalty"):
            client.completions.create(model="sdar", prompt="x", presence_penalty=2.5)
        penalized = client.completions.create(model="sdar", prompt="def mean(values):\n", max_tokens=20,
                                              frequency_penalty=1.5, presence_penalty=0.5)
        assert penalized.choices[0].text == tokenizer.decode(kept(alone(
            model, ids, max_new_tokens=20, frequency_penalty=1.5, presence_penalty=0.5), len(ids)),
            skip_special_tokens=True)


def test_a_server_with_an_api_key_answers_only_requests_that_send_it(shipped):
    """Without the key, or with another, a request gets a 401 (OpenAI's error body; the OpenAI client raises its
    AuthenticationError); with it, an answer; GET /health needs none."""
    tokenizer, model = shipped
    server = Server(("127.0.0.1", 0), model, tokenizer, DEFAULTS, "sdar", quiet=True, api_key="sk-local")
    url = f"http://127.0.0.1:{server.server_address[1]}"
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    try:
        with serving_on(server):
            for headers in ({}, {"Authorization": "Bearer sk-other"}, {"Authorization": "sk-local"},
                            {"Authorization": "Bearer \u00ff"}):
                for request in (urllib.request.Request(url + "/v1/completions", data=body, headers=headers),
                                urllib.request.Request(url + "/v1/models", headers=headers),
                                urllib.request.Request(url + "/metrics", headers=headers)):
                    with pytest.raises(urllib.error.HTTPError) as refused:
                        urllib.request.urlopen(request, timeout=60)
                    assert refused.value.code == 401
                    assert "needs an API key" in json.loads(refused.value.read())["error"]["message"]
            with urllib.request.urlopen(url + "/health", timeout=60) as response:
                assert response.status == 200
            client = openai.OpenAI(base_url=url + "/v1", api_key="sk-local", max_retries=0)
            assert client.completions.create(model="sdar", prompt="x", max_tokens=2).usage.completion_tokens == 2
            request = urllib.request.Request(url + "/v1/models", headers={"Authorization": "bearer  sk-local"})
            with urllib.request.urlopen(request, timeout=60) as response:  # the scheme's case is free (RFC 9110)
                assert response.status == 200
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url + "/v1", api_key="sk-other", max_retries=0).models.list()
    finally:
        server.server_close()


def test_mrp_serve_cli_listens_with_its_options_as_the_defaults(monkeypatch, capsys):
    served = []
    monkeypatch.setattr(Server, "serve_forever", lambda self: served.append(self))
    monkeypatch.setenv("MRP_SERVE_API_KEY", "from-the-environment")
    assert main(["--port", "0", "--strategy", "dynamic", "--threshold", "0.6", "--max-new-tokens", "8",
                 "--threads", "1", "--quiet"]) == 0
    assert main(["--port", "0", "--threads", "1", "--quiet", "--api-key", "given"]) == 0
    server, keyed = served
    assert server.api_key == "from-the-environment" and keyed.api_key == "given"
    assert server.model_name == "sdar-stdlib-mrp" and server.quiet
    assert {k: v for k, v in server.defaults.items() if v is not None} == {
        "strategy": "dynamic", "threshold": 0.6, "max_new_tokens": 8, "do_sample": False, "temperature": 1.0}
    assert f"serving sdar-stdlib-mrp (dynamic decoding by default) on http://127.0.0.1:{server.server_address[1]}/v1" \
        in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--strategy", "dynamic", "--threshold", "2"])
    assert exit_.value.code == 2 and "threshold" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--max-batch-size", "0"])
    assert exit_.value.code == 2 and "--max-batch-size" in capsys.readouterr().err
    with socket.socket() as taken, pytest.raises(SystemExit) as exit_:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        main(["--port", str(taken.getsockname()[1])])
    assert exit_.value.code == 2 and "cannot listen on 127.0.0.1" in capsys.readouterr().err


@pytest.mark.parametrize("stream, mixed", [(False, False), (True, True)])
def test_serve_benchmark_smoke(tmp_path, stream, mixed):
    """benchmarks/bench_serve.py on the shipped model: a row per strategy, temperature and max batch size, greedy and
    sampled completions (streamed: the text joined from the deltas; mixed: clients asking different lengths, stop
    strings, temperatures and penalties, the fifth greedy among sampled ones) the same batched as alone."""
    subprocess.run([sys.executable, "benchmarks/bench_serve.py", "--clients", "5" if mixed else "3",
                    "--max-new-tokens", "8",
                    "--max-batch-sizes", "1", "4", "--strategies", "static", "speculative", "--temperatures", "0", "1",
                    "--repeats", "1", "--out", str(tmp_path)]
                   + ["--stream"] * stream + ["--mixed", "--penalties"] * mixed,
                   check=True, cwd=REPO_ROOT, timeout=600,
                   env=subprocess_env(str(REPO_ROOT)))  # on the reference ops, not the interpreter
    name = f"serve_cpu{'_stream' * stream}{'_mixed_penalties' * mixed}.json"
    rows = json.loads((tmp_path / name).read_text())["rows"]
    assert [(row["strategy"], row["temperature"], row["stream"], row["mixed"], row["penalties"], row["max_batch_size"])
            for row in rows] == [(strategy, temperature, stream, mixed, mixed, size)
                                 for strategy in ("static", "speculative") for temperature in (0, 1) for size in (1, 4)]
    assert all(row["same_as_alone"] and row["new_tokens_per_s"] > 0 for row in rows)
