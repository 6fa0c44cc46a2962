"""``mrp-serve``: an OpenAI-compatible HTTP server for an SDAR+MRP checkpoint (by default the small model shipped here).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream": true`` as server-sent
events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus' text format), and vLLM's ``POST
/tokenize`` and ``POST /detokenize``. Any OpenAI client talks to it::

    mrp-serve --port 8000 --strategy speculative -K 3
    curl localhost:8000/v1/completions -d '{"prompt": "def mean(values):", "max_tokens": 32}'

    from openai import OpenAI
    client = OpenAI(base_url="http://localhost:8000/v1", api_key="unused")
    client.completions.create(model="sdar-stdlib-mrp", prompt="import os", extra_body={"strategy": "static"})

The decoding options set the defaults of every request; a request's fields override them (the fields read:
:mod:`.server_requests`). Concurrent requests with the same settings are decoded together, as one batch
(:mod:`.server_batcher`). The HTTP server is the standard library's (``http.server``, a thread a connection), which
serves one machine's clients well; put a reverse proxy in front of it to expose it wider. Not part of a checkpoint's
remote code.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import select
import socket
import sys
import traceback
from concurrent.futures import TimeoutError as WaitedTooLong
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from .cli import (HelpFormatter, UsageError, add_decoding_options, add_model_options, check_layout,
                  decoding_settings, load_for, set_threads)
from .incremental_text import IncrementalText
from .prompts import PromptBatch
from .server_batcher import Batcher, Job
from .server_requests import (Request, RequestError, choice, cut_at_stop, envelope, finish_reason, logprobs_in_text,
                              logprobs_of, read_detokenize, read_request, read_tokenize, refusal, response_id,
                              shown_tokens, streamable, usage)

MAX_BATCH_SIZE = 8
MAX_BODY_BYTES = 16 * 2**20
ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def tokenize_answer(body, server: Server) -> dict:
    """``POST /tokenize`` (vLLM's): the token ids of a ``prompt`` or of chat ``messages`` as a request's prompt takes
    them (:func:`.server_requests.read_tokenize`), their count and the positions the model holds."""
    tokens = read_tokenize(body, server.tokenizer, server.model_name)
    return {"count": len(tokens), "max_model_len": server.model.config.max_position_embeddings, "tokens": tokens}


def detokenize_answer(body, server: Server) -> dict:
    """``POST /detokenize`` (vLLM's): the text of ``tokens``, special tokens included."""
    return {"prompt": server.tokenizer.decode(read_detokenize(body, server.tokenizer, server.model_name))}


TOKEN_UTILITIES = {"/tokenize": tokenize_answer, "/detokenize": detokenize_answer}
CLIENT_CHECK_S = 0.25  # how often a request that does not stream checks, while it waits, that its client is there


def client_gone(connection: socket.socket) -> bool:
    """Whether the client has closed ``connection`` (its end reads as EOF now; what it sent ahead stays unread)."""
    if not select.select([connection], [], [], 0)[0]:
        return False
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:  # reset by the client
        return True


class Server(ThreadingHTTPServer):
    """The HTTP server of ``mrp-serve``: serves ``model`` as ``model_name`` (:class:`Handler` answers each request on
    a thread of its own); ``defaults``: the ``generate()`` keywords of a request that sets none (``strategy``
    included). Its decoding thread (``batcher``) starts here. ``server_address`` (host, port 0) picks a free port,
    then holds it; ``quiet``: no line a request (nor a decoding call) on standard error; ``api_key``: the key every
    request but ``GET /health`` must send (``Authorization: Bearer KEY``, as OpenAI clients send theirs), else a 401."""

    daemon_threads = True
    # connections the kernel holds for the accept loop: socketserver's 5 overflowed (connection reset) when 16 clients
    # connected at once while the decoding thread held the interpreter (bench_serve.py --stream, this 2-core CPU)
    request_queue_size = socket.SOMAXCONN

    def __init__(self, server_address, model, tokenizer, defaults: dict, model_name: str,
                 max_batch_size: int = MAX_BATCH_SIZE, quiet: bool = False, api_key: str | None = None):
        self.model, self.tokenizer, self.defaults, self.model_name = model, tokenizer, defaults, model_name
        self.quiet, self.api_key = quiet, api_key
        # one write a line: print's separate write of the newline would let a request line (another thread's) in
        self.batcher = Batcher(model, max_batch_size,
                               report=None if quiet else lambda line: sys.stderr.write(f"mrp-serve: {line}\n"))
        super().__init__(server_address, Handler)  # on a failure to listen, it calls server_close

    def server_close(self) -> None:
        super().server_close()
        self.batcher.close()


class Handler(BaseHTTPRequestHandler):
    """One HTTP request: the routes of the module docstring, errors as OpenAI error bodies."""

    server: Server
    server_version = "mrp-serve"

    def do_GET(self) -> None:
        model = {"id": self.server.model_name, "object": "model", "created": 0, "owned_by": "mrp-triton"}
        if self.path == "/health":
            self.send_json({"status": "ok"})
        elif not self.authorized():
            return
        elif self.path == "/metrics":
            self.send_text(prometheus_text(*self.server.batcher.metrics()))
        elif self.path == "/v1/models":
            self.send_json({"object": "list", "data": [model]})
        elif self.path == f"/v1/models/{self.server.model_name}":
            self.send_json(model)
        else:
            self.send_json(RequestError(f"no route GET {self.path}", status=404).body(), 404)

    def do_POST(self) -> None:
        endpoint = ROUTES.get(self.path)
        if not self.authorized():
            return
        try:
            if self.path in TOKEN_UTILITIES:
                self.send_json(TOKEN_UTILITIES[self.path](self.read_body(), self.server))
            elif endpoint is None:
                raise RequestError(f"no route POST {self.path} (POST /v1/completions, /v1/chat/completions, "
                                   "/tokenize or /detokenize)", status=404)
            else:
                self.serve(endpoint)
        except RequestError as err:
            self.send_json(err.body(), err.status)
        except (BrokenPipeError, ConnectionResetError):  # the client left before its answer was sent
            self.close_connection = True
        except Exception as err:  # noqa: BLE001 - a failure of the server's, answered as one (and logged)
            traceback.print_exc()
            self.send_json(RequestError(f"{type(err).__name__}: {err}", status=500).body(), 500)

    def serve(self, endpoint: str) -> None:
        server = self.server
        request = read_request(self.read_body(), endpoint, server.tokenizer, server.defaults, server.model_name)
        check_rows(request, server.batcher.max_batch_size)
        # resolved (what it shares a call with may ask another count; a finish reason reads it)
        request.settings["max_new_tokens"] = check_decodable(server.model, request)
        job, rid = server.batcher.submit(request), response_id(endpoint)
        if request.stream:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            events = stream_events(job, endpoint, rid, server.tokenizer, server.model_name)
            try:
                for event in events:
                    self.wfile.write(event.encode())
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client left
            finally:
                events.close()  # which stops the decoding of a client that left
            return
        try:
            completions = self.wait_for(job)
        except (ValueError, TypeError) as err:  # generate() refused the settings of the batch
            raise refusal(err, request.settings) from None
        if completions is None:  # the client left: no one to answer
            self.close_connection = True
            return
        self.send_json(response_body(endpoint, rid, server.model_name, request, completions, server.tokenizer))

    def wait_for(self, job: Job) -> list | None:
        """The completions of a job that does not stream, or None once its client has closed the connection (checked
        every ``CLIENT_CHECK_S`` seconds while it waits), which stops its decoding: its rows end with their block."""
        while True:
            try:
                return job.future.result(timeout=CLIENT_CHECK_S)
            except WaitedTooLong:
                if client_gone(self.connection):
                    job.cancelled.set()
                    return None

    def authorized(self) -> bool:
        """Whether the request carries the server's API key (any request does when it has none); if not, answer it
        with a 401."""
        key = self.server.api_key
        scheme, _, given = self.headers.get("Authorization", "").partition(" ")
        if key is None or (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())):
            return True
        self.send_json(RequestError("this server needs an API key: send the header 'Authorization: Bearer KEY' "
                                    "(an OpenAI client's api_key) with the key mrp-serve was given",
                                    status=401).body(), 401)
        return False

    def read_body(self):
        """The request's JSON body (:class:`RequestError` when it is missing, too large or not JSON)."""
        if "Content-Length" not in self.headers and "Transfer-Encoding" in self.headers:
            raise RequestError("this server reads a body of a given Content-Length, not one sent in chunks "
                               f"(Transfer-Encoding: {self.headers['Transfer-Encoding']})", status=411)
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise RequestError(f"Content-Length is not a number: {self.headers['Content-Length']!r}") from None
        if length < 0:
            raise RequestError(f"Content-Length must be >= 0, got {length}")
        if length > MAX_BODY_BYTES:
            raise RequestError(f"the body is {length} bytes, more than the {MAX_BODY_BYTES} this server reads",
                               status=413)
        try:
            return json.loads(self.rfile.read(length))
        except ValueError as err:
            raise RequestError(f"the body is not valid JSON ({err})") from None
        except RecursionError:
            raise RequestError("the body nests its JSON arrays or objects too deeply to read") from None

    def send_json(self, payload: dict, status: int = 200) -> None:
        self.send_text(json.dumps(payload, ensure_ascii=False), status, "application/json")

    def send_text(self, text: str, status: int = 200, kind: str = "text/plain; version=0.0.4") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:
        """Request lines on standard error, as http.server writes them, unless ``quiet``."""
        if not self.server.quiet:
            super().log_message(format, *args)


METRICS = [("waiting_requests", "gauge", "requests waiting for a decoding call", None),
           ("generate_calls_total", "counter", "generate() calls", "calls"),
           ("failed_generate_calls_total", "counter", "generate() calls that raised", "failed_calls"),
           ("requests_total", "counter", "requests decoded", "requests"),
           ("rows_total", "counter", "rows decoded (prompts x n)", "rows"),
           ("new_tokens_total", "counter", "new tokens the completions keep", "new_tokens"),
           ("decoding_seconds_total", "counter", "seconds spent in generate() calls", "seconds")]


def prometheus_text(waiting: int, totals) -> str:
    """``GET /metrics``: the decoding thread's :class:`.server_batcher.Totals` and the requests waiting, in
    Prometheus' text format (``mrp_serve_`` names)."""
    lines = []
    for name, kind, help_text, field in METRICS:
        value = waiting if field is None else getattr(totals, field)
        name = f"mrp_serve_{name}"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"


def check_rows(request: Request, max_batch_size: int) -> None:
    """Refuse a request of more rows (its prompts x ``n``) than a ``generate()`` call of this server decodes."""
    n = request.settings.get("num_return_sequences", 1)
    rows = len(request.prompts) * n
    if rows > max_batch_size:
        asked = f"{len(request.prompts)} prompts x n={n}" if n > 1 else f"{rows} prompts"
        raise RequestError(f"{asked} ask for {rows} completions, more than the {max_batch_size} rows this server "
                           "decodes at once (mrp-serve --max-batch-size): send fewer in a request",
                           param="n" if n > 1 else "prompt")


def check_decodable(model, request: Request) -> int:
    """Refuse a request as ``generate()`` would refuse its prompts (token ids outside the vocabulary) or settings
    (their values, or a layout past the model's positions), before it waits for a batch that it would fail.
    Returns the new tokens it asks for (the settings' ``max_new_tokens``, or generate()'s default)."""
    for ids in request.prompts:
        try:
            prompts = PromptBatch.from_inputs(model.config, torch.tensor([ids]), None)
        except ValueError as err:
            raise RequestError(f"the prompt: {err}", param="prompt") from None
        try:
            budget = check_layout(model, prompts, request.settings).max_new_tokens
        except (ValueError, TypeError) as err:
            raise refusal(err, request.settings) from None
    return budget


def completion_text(tokenizer, ids: list[int], stop: list[str]) -> tuple[str, bool]:
    """A completion's text, cut before its first stop string, and whether it held one."""
    return cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), stop)


def response_body(endpoint: str, rid: str, model_name: str, request: Request, completions: list, tokenizer) -> dict:
    """The response of a request that does not stream: a choice a completion (``index``: prompt i's sample j is
    ``i * n + j``), each with its decoding stats (``stats``: backbone and MRP forwards, tokens decoded a backbone
    forward; an extension) and, if asked, its tokens' log-probabilities, and the usage."""
    choices = []
    for index, completion in enumerate(completions):
        text, stopped = completion_text(tokenizer, completion.ids, request.stop)
        reason = finish_reason(len(completion.ids), completion.ended, stopped, request.max_new_tokens)
        choices.append({**choice(endpoint, index, text, reason, chunk=False), "stats": completion.stats})
        if request.logprobs:
            choices[-1]["logprobs"] = logprobs_in_text(endpoint, tokenizer, completion.ids, completion.logprobs, text,
                                                       requested_tops(request, completion.tops))
    return {**envelope(endpoint, rid, model_name, chunk=False), "choices": choices,
            "usage": usage(sum(map(len, request.prompts)), sum(len(c.ids) for c in completions))}


def requested_tops(request: Request, tops: list[list[tuple[int, float]]]) -> list[list[tuple[int, float]]]:
    """Each token's most likely tokens as many as ``request`` asks for (its call may have asked for more)."""
    return [top[: request.top_logprobs] for top in tops]


class StreamedChoice(IncrementalText):
    """A stream's choice as its tokens come: their ids, text and offsets in it (:class:`.IncrementalText`),
    log-probabilities and most likely tokens (when asked); the part of the text sent so far (``sent``) and how many
    tokens' log-probabilities were (``sent_tokens``)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.sent, self.sent_tokens = "", 0

    def add(self, ids: list[int], logprobs: list[float] | None = None,
            tops: list[list[tuple[int, float]]] | None = None) -> None:
        super().add(ids)
        self.logprobs += logprobs or []
        self.tops += tops or []


def stream_events(job: Job, endpoint: str, rid: str, tokenizer, model_name: str):
    """The server-sent events of a streamed request: chunks of each choice's new text as the call decodes it (held
    back where a stop string may be starting; a choice a prompt's sample, indexed as :func:`response_body` does), if
    asked with the log-probabilities of the tokens that text adds (the tokens starting in it; all of a choice's chunks
    together give :func:`response_body`'s), then a chunk a choice with its finish reason, with
    ``stream_options.include_usage`` one with the usage, and ``[DONE]``. A client that leaves stops the decoding of its
    rows."""
    head = envelope(endpoint, rid, model_name, chunk=True)
    request = job.request
    usage_field = {"usage": None} if request.include_usage else {}  # OpenAI's: null until the usage chunk

    def event(payload) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def chunk(index: int, text: str | None, reason: str | None, logprobs: dict | None) -> dict:
        """A chunk of choice ``index``: the text it adds, its finish reason, and (when asked) the log-probabilities
        of its tokens (OpenAI's ``logprobs``)."""
        body = choice(endpoint, index, text, reason, chunk=True)
        if logprobs is not None:
            body["logprobs"] = logprobs
        return {**head, "choices": [body], **usage_field}

    streamed = [StreamedChoice(tokenizer) for _ in range(job.rows)]
    try:
        for index in range(job.rows) if endpoint == "chat" else ():  # a chunk a choice, as every chunk
            yield event({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}], **usage_field})
        while (piece := job.next_piece()) is not None:
            index, new, new_logprobs, new_tops = piece
            one = streamed[index]
            one.add(new, new_logprobs, new_tops)
            text = streamable(one.text, request.stop)
            if len(text) > len(one.sent):
                first = one.sent_tokens
                one.sent_tokens += shown_tokens(one.offsets[first:], len(text))
                sent = slice(first, one.sent_tokens)
                logprobs = logprobs_of(endpoint, tokenizer, one.ids[sent], one.logprobs[sent], one.offsets[sent],
                                       requested_tops(request, one.tops[sent])) if request.logprobs else None
                yield event(chunk(index, text[len(one.sent):], None, logprobs))
                one.sent = text
        try:
            completions = job.future.result()
        except Exception as err:  # noqa: BLE001 - the stream has begun: its last event says what failed
            yield event(RequestError(f"{type(err).__name__}: {err}", status=500).body())
            yield "data: [DONE]\n\n"
            return
        for index, (completion, one) in enumerate(zip(completions, streamed)):
            text, stopped = completion_text(tokenizer, completion.ids, request.stop)
            reason = finish_reason(len(completion.ids), completion.ended, stopped, request.max_new_tokens)
            logprobs = logprobs_in_text(endpoint, tokenizer, completion.ids, completion.logprobs, text,
                                        requested_tops(request, completion.tops), start=one.sent_tokens) \
                if request.logprobs else None
            last = chunk(index, text[len(one.sent):] or None, reason, logprobs)
            last["choices"][0]["stats"] = completion.stats
            yield event(last)
        if request.include_usage:
            yield event({**head, "choices": [], "usage": usage(sum(map(len, request.prompts)),
                                                               sum(len(c.ids) for c in completions))})
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # a no-op once it has ended; else the client left: stop decoding


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mrp-serve", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter,
                                epilog="The decoding options (--strategy and after) are the defaults of every request, "
                                "which its own fields override (max_tokens, temperature, top_p, n, stop, seed, and "
                                "generate()'s keywords by name: strategy, threshold, top_k, ...); a default that a "
                                "request's strategy does not read is left out for that request.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", metavar="NAME", help="the model's name in requests and /v1/models "
                   "(default: the last part of --model)")
    p.add_argument("--quiet", action="store_true", help="no line a request (nor a decoding call: its requests, "
                   "rows, new tokens and seconds) on standard error")
    p.add_argument("--api-key", default=os.environ.get("MRP_SERVE_API_KEY"), metavar="KEY",
                   help="the key every request but GET /health must send (Authorization: Bearer KEY); default: "
                   "$MRP_SERVE_API_KEY, else none needed")
    p.add_argument("--max-batch-size", type=int, default=MAX_BATCH_SIZE, metavar="N",
                   help="rows (prompts x n) that waiting requests may share one decoding call with")
    add_model_options(p)
    add_decoding_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_batch_size < 1:
        parser.error(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    set_threads(parser, args)
    try:
        tokenizer, model = load_for(args)
        defaults = {**decoding_settings(args), "strategy": args.strategy}
        check_decodable(model, read_request({"prompt": [0]}, "completions", tokenizer, defaults, ""))
        name = args.served_model_name or Path(args.model.rstrip("/")).name
        server = Server((args.host, args.port), model, tokenizer, defaults, name, args.max_batch_size,
                        quiet=args.quiet, api_key=args.api_key)
    except (UsageError, RequestError) as err:
        parser.exit(2, f"mrp-serve: error: {err}\n")
    except OSError as err:  # the port is taken, or the address is not this machine's
        parser.exit(2, f"mrp-serve: error: cannot listen on {args.host}:{args.port}: {err.strerror}\n")
    host, port = server.server_address[:2]
    print(f"mrp-serve: serving {name} ({args.strategy} decoding by default) on http://{host}:{port}/v1",
          file=sys.stderr)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
