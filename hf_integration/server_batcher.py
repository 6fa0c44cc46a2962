"""``mrp-serve``'s decoding thread: requests queue up, and those waiting together that decode alike share one
``generate()`` call.

Only this thread calls the model. It takes the oldest waiting request and every other waiting request with the same
``generate()`` keywords (whether a request samples, a sampled request's ``seed``, ``temperature`` and filters ``top_p``,
``min_p``, ``typical_p``, ``epsilon_cutoff`` and ``eta_cutoff``, the new tokens and the stop strings a request asks for
aside; a greedy request reads no sampling setting, so it shares a call with sampled ones whatever theirs), up to
``max_batch_size`` rows, and decodes them as one left-padded batch: each row moves on through its blocks on its own and
stops at its request's ``max_new_tokens`` and stop strings (``generate()`` takes them per prompt), a greedy row gives
what it gives alone, and each prompt of a sampled request draws with the request's seed, temperature and filters
(``generate()`` takes them, and ``do_sample``, per prompt too) what it draws alone, so batching changes the speed, not
the text. A stopping criterion, which sees each new token once every row of the call has it, watches the call's rows: a
streamed request's row sends its new tokens as the call decodes them, and the rows of a request whose client is gone
(streamed or not) end, while the other rows go on. Not part of a checkpoint's remote code.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .cli_prompts import left_padded
from .generation_settings import NEUTRAL, NO_CUT, PER_PROMPT, PER_PROMPT_PENALTIES, SAMPLING
from .server_requests import Request


# The sampling filters a call takes one of per prompt, and the value at which each cuts nothing.
FILTERS_PER_PROMPT = {name: NEUTRAL.get(name, None if name in NO_CUT else 1.0) for name in PER_PROMPT
                      if name != "temperature"}


@dataclass
class Completion:
    """One completion: the new token ids it keeps, whether its last one is an EOS (``ended``), what it cost
    (``stats``: backbone and MRP forwards, tokens decoded a backbone forward) and, when its request asks for them,
    each new token's log-probability (``logprobs``: of the probability it was committed with, ``generate()``'s
    ``output_confidences``) and its call's most likely tokens there (``tops``: (id, log-probability) pairs, most
    likely first, ``output_top_logprobs``; empty lists when the call asks for none)."""

    ids: list[int]
    ended: bool
    stats: dict
    logprobs: list[float] | None = None
    tops: list[list[tuple[int, float]]] | None = None


@dataclass
class Job:
    """A request waiting or decoding. ``future`` gets its completions (``n`` a prompt, a prompt's together, in its
    prompts' order) or the error ``generate()`` raised; a streamed job's ``pieces`` gets (choice, new token ids, their
    log-probabilities or None, their most likely tokens or None): each choice's (row's) new tokens as the call
    decodes them (with their log-probabilities and the request's most likely tokens if it asks for them, as
    :class:`Completion` has them), then None; ``cancelled`` is set when no one waits for it any more."""

    request: Request
    future: Future = field(default_factory=Future)
    pieces: queue.SimpleQueue | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def rows(self) -> int:
        return len(self.request.prompts) * self.request.settings.get("num_return_sequences", 1)

    def next_piece(self) -> tuple[int, list[int], list[float] | None, list | None] | None:
        """A streamed job's next (choice, new token ids, their log-probabilities and most likely tokens if the request
        asks for them) (waiting for it), or None once the stream has ended."""
        return self.pieces.get()


@dataclass
class Totals:
    """What a :class:`Batcher` has decoded since it started: ``generate()`` calls (and those that raised), the
    requests and rows they decoded, the new tokens the completions keep, and the seconds spent in the calls."""

    calls: int = 0
    failed_calls: int = 0
    requests: int = 0
    rows: int = 0
    new_tokens: int = 0
    seconds: float = 0.0


class _RowWatch:
    """A stopping criterion (``criterion(input_ids, scores)``, as ``generate()`` calls it once a new token every row
    has decoded) that stops nothing but the rows of the jobs no one waits for any more (``Job.cancelled``: the client
    has gone), and puts each new token of a streamed job's row in its ``pieces``, with the row's choice index (and the
    token's log-probability and most likely tokens if the request asks for them: the watch then takes the tokens'
    confidences and top log-probabilities), until the row's end (an EOS or padding: ``ends``; or its request's
    ``max_new_tokens``). ``batch``: the call's jobs, whose rows lie in their order (``Job.rows`` each): ``spans``,
    each job's; ``streamed``: each streamed row's (row, job, choice)."""

    def __init__(self, batch: list[Job], ends: set[int]):
        self.jobs, self.ends = [job for job in batch if job.request.stream], ends
        firsts = list(itertools.accumulate((job.rows for job in batch), initial=0))
        self.spans = [(slice(first, first + job.rows), job) for first, job in zip(firsts, batch)]
        self.streamed = [(first + index, job, index) for first, job in zip(firsts, batch) if job.request.stream
                         for index in range(job.rows)]
        self.ended: set[int] = set()
        self.calls = 0  # the new tokens each row has decoded
        self.takes_confidences = any(job.request.logprobs for job in self.jobs)
        self.takes_top_logprobs = any(job.request.top_logprobs for job in self.jobs)

    def __call__(self, input_ids: torch.Tensor, scores, confidences: torch.Tensor | None = None,
                 top_logprobs: torch.Tensor | None = None, top_token_ids: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        gone = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        for rows, job in self.spans:
            gone[rows] = job.cancelled.is_set()
        last = input_ids[:, -1].tolist() if self.streamed else []  # the new token (one call a new token)
        logprobs = confidences[:, -1].log().tolist() if confidences is not None else []
        tops = top_pairs(top_token_ids[:, -1], top_logprobs[:, -1]) if top_logprobs is not None else []
        for row, job, index in self.streamed:
            if row not in self.ended:
                asked = job.request.logprobs
                job.pieces.put((index, [last[row]], [logprobs[row]] if asked else None,
                                [tops[row] if job.request.top_logprobs else []] if asked else None))
                if last[row] in self.ends or self.calls == job.request.max_new_tokens:
                    self.ended.add(row)
        return gone

    def end(self) -> None:
        """Every stream's pieces end."""
        for job in self.jobs:
            job.pieces.put(None)


class Batcher:
    """Decodes submitted requests on a thread of its own (see the module docstring); ``report``, if given, gets a
    line a ``generate()`` call: its requests, rows, new tokens and seconds."""

    def __init__(self, model, max_batch_size: int, report: Callable[[str], None] | None = None):
        self.model, self.max_batch_size, self.report = model, max_batch_size, report
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        # what a streamed call's rows hold past their end (passed to generate(), so a stream knows where one ends)
        pad = model.config.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=model.config.mask_token_id)
        self.waiting: collections.deque[Job] = collections.deque()
        self.changed = threading.Condition()
        self.closed = False
        self.totals = Totals()
        self.thread = threading.Thread(target=self._serve, name="mrp-serve decoding", daemon=True)
        self.thread.start()

    def submit(self, request: Request) -> Job:
        job = Job(request, pieces=queue.SimpleQueue() if request.stream else None)
        with self.changed:
            self.waiting.append(job)
            self.changed.notify()
        return job

    def metrics(self) -> tuple[int, Totals]:
        """(requests waiting for a call, a copy of the :class:`Totals`), read together."""
        with self.changed:
            return len(self.waiting), dataclasses.replace(self.totals)

    def _count(self, batch: list[Job], new_tokens: int, seconds: float, failed: bool) -> None:
        """Add one call to the totals (``failed``: it raised)."""
        with self.changed:
            totals = self.totals
            totals.calls += 1
            totals.failed_calls += failed
            totals.requests += len(batch)
            totals.rows += sum(job.rows for job in batch)
            totals.new_tokens += new_tokens
            totals.seconds += seconds

    def close(self) -> None:
        """End the decoding thread once the jobs waiting now are done."""
        with self.changed:
            self.closed = True
            self.changed.notify()
        self.thread.join()

    def _serve(self) -> None:
        while batch := self._next_batch():
            self._decode(batch)

    def _next_batch(self) -> list[Job]:
        """The oldest waiting job and the waiting jobs that may share its call (the module docstring), removed from
        the queue (none once closed and nothing waits)."""
        with self.changed:
            self.changed.wait_for(lambda: self.waiting or self.closed)
            if not self.waiting:
                return []
            first = self.waiting.popleft()
            batch, rows = [first], first.rows
            for job in list(self.waiting):
                if rows + job.rows <= self.max_batch_size and \
                        all(_decoded_alike(job.request, other.request) for other in batch):
                    self.waiting.remove(job)
                    batch.append(job)
                    rows += job.rows
        return batch

    def _decode(self, batch: list[Job]) -> None:
        """One ``generate()`` call for the batch's prompts (a job no one waits for any more left out); each job's
        future gets its completions."""
        batch = [job for job in batch if not (job.cancelled.is_set() and job.future.cancel())]
        if not batch:
            return

        def per_prompt(value: Callable[[Request], object]) -> list:
            """``value`` of each job's request once for each of its prompts, in the call's order."""
            return [value(job.request) for job in batch for _ in job.request.prompts]

        input_ids, mask = left_padded(sum((job.request.prompts for job in batch), []), self.model.device)
        extra = {}
        if any(job.request.logprobs for job in batch):
            extra["output_confidences"] = True
        top_logprobs = max(job.request.top_logprobs for job in batch)
        if top_logprobs:
            extra["output_top_logprobs"] = top_logprobs
        sampled = [job for job in batch if job.request.settings["do_sample"]]
        if sampled:  # a seed, a temperature and the filters per prompt: each request's own (a greedy one's unread)
            extra["seed"] = per_prompt(lambda request: request.settings.get("seed", 0))
            extra["temperature"] = per_prompt(lambda request: request.settings.get("temperature", 1.0))
            for name, neutral in FILTERS_PER_PROMPT.items():  # (a request without one: its neutral value, none cut)
                values = per_prompt(lambda request: _or(request.settings.get(name), neutral))
                if len(set(values)) > 1:
                    extra[name] = values
            if len(sampled) < len(batch):  # greedy requests among them: whether each prompt samples
                extra["do_sample"] = per_prompt(lambda request: request.settings["do_sample"])
        for name in PER_PROMPT_PENALTIES:  # each request's own (greedy or sampled; without one: 0, none)
            values = per_prompt(lambda request: request.settings.get(name) or 0.0)
            if len(set(values)) > 1:
                extra[name] = values
        limits = per_prompt(lambda request: request.max_new_tokens)
        if len(set(limits)) > 1:  # a count per prompt: each request's own
            extra["max_new_tokens"] = limits
        stops = per_prompt(lambda request: request.stop)
        if len({tuple(strings) for strings in stops}) > 1:  # a list per prompt (empty: none), each request's own
            extra.update(stop_strings=stops,
                         tokenizer=next(job.request.settings["tokenizer"] for job in batch if job.request.stop))
        watch = _RowWatch(batch, self.eos_ids | {self.pad_id})
        extra.update(stopping_criteria=[watch], pad_token_id=self.pad_id)
        start = time.perf_counter()
        try:
            out = self.model.generate(input_ids, attention_mask=mask, return_dict_in_generate=True,
                                      **{**(sampled or batch)[0].request.settings, **extra})
        except Exception as err:  # noqa: BLE001 - the request's error, sent to whoever waits for it
            for job in batch:
                job.future.set_exception(err)
            watch.end()
            self._count(batch, 0, time.perf_counter() - start, failed=True)
            return
        width, stats = input_ids.shape[1], out.stats.as_dict()
        results = []
        for row, kept in enumerate(out.new_tokens.tolist()):
            ids = out.sequences[row, width : width + kept].tolist()
            new = slice(width, width + kept)
            logprobs = None if out.confidences is None else out.confidences[row, new].log().tolist()
            tops = top_pairs(out.top_token_ids[row, new], out.top_logprobs[row, new]) if top_logprobs else \
                [[] for _ in ids]
            results.append(Completion(ids, bool(ids) and ids[-1] in self.eos_ids,
                                      {key: stats[key][row] for key in ("backbone_forwards", "mrp_forwards",
                                                                        "tokens_per_forward")}, logprobs, tops))
        seconds, new_tokens = time.perf_counter() - start, sum(len(c.ids) for c in results)
        self._count(batch, new_tokens, seconds, failed=False)
        for job in batch:
            job.future.set_result(results[: job.rows])
            results = results[job.rows :]
        watch.end()
        if self.report is not None:
            requests, rows = len(batch), out.sequences.shape[0]
            self.report(f"{requests} request{'s' * (requests > 1)}, {rows} row{'s' * (rows > 1)} in one "
                        f"{batch[0].request.settings['strategy']} call: {new_tokens} new tokens in {seconds:.2f} s "
                        f"({new_tokens / seconds:.0f} tokens/s)")


def _or(value, default):
    """``value``, or ``default`` where it is None."""
    return default if value is None else value


def top_pairs(ids: torch.Tensor, logprobs: torch.Tensor) -> list[list[tuple[int, float]]]:
    """Each position's most likely tokens as (id, log-probability) pairs, most likely first, from ``generate()``'s
    ``top_token_ids`` and ``top_logprobs`` [L, k] (the pairs past a softmax's tokens, id -1, left out)."""
    return [[(token, value) for token, value in zip(row_ids, row_values) if token >= 0]
            for row_ids, row_values in zip(ids.tolist(), logprobs.tolist())]


def _decoded_alike(one: Request, other: Request) -> bool:
    """Whether two requests' prompts may share a ``generate()`` call: the same keywords, whether they sample, a sampled
    request's seed, temperature and filters (:data:`FILTERS_PER_PROMPT`), the presence and frequency penalties, the
    new tokens and the stop strings asked for aside (the call takes them per prompt; a request that leaves
    ``max_new_tokens`` to generate()'s default shares only with those that do too), and a greedy request's with a
    sampled one's sampling settings aside too (greedy rows read none)."""
    greedy = not (one.settings["do_sample"] and other.settings["do_sample"])

    def key(settings: dict) -> dict:
        return {**{name: value for name, value in settings.items() if not (greedy and name in SAMPLING)},
                "do_sample": None, "seed": None, "temperature": None, **dict.fromkeys(FILTERS_PER_PROMPT),
                **dict.fromkeys(PER_PROMPT_PENALTIES),
                "max_new_tokens": "max_new_tokens" in settings, "stop_strings": None, "tokenizer": None}

    return key(one.settings) == key(other.settings)
