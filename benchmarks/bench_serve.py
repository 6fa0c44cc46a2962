"""``mrp-serve`` under concurrent clients: what batching waiting requests buys.

Each client is a thread that sends one ``/v1/completions`` request (``max_tokens`` new tokens, EOS held back with
``min_tokens`` so every completion is as long; greedy at temperature 0, else sampled with the client's index as its
``seed``) over HTTP to a server in this process, all at once; per strategy, temperature and ``--max-batch-size``: the
median wall time of ``--repeats`` rounds until the last answer, the new tokens a second it gives, and whether every
completion equals the one at ``--max-batch-size 1`` (each request decoded alone). With ``--stream`` the clients stream
(server-sent events, the text joined from the deltas; results to ``serve_<device>_stream``). With ``--mixed`` the
clients ask for different lengths, stop strings and temperatures, as real clients do: client i asks for
``max_tokens`` (i % 4 + 1) quarters of ``--max-new-tokens`` (EOS held back for the first quarter), an odd one with a
stop string, and in a sampled round each one at (i % 3 + 3) / 4 of the round's temperature but every fifth (i % 5 ==
4), which decodes greedily (results to ``serve_<device>_mixed``); new tokens a second then count the tokens the
completions hold. With ``--penalties`` client i also asks for a frequency penalty of (i % 4) / 4 and, when i is odd, a
presence penalty of 0.5 (OpenAI's fields; results to ``serve_<device>[_mixed]_penalties``).

    python benchmarks/bench_serve.py              # the shipped model, 16 clients, results to benchmarks/results/
    python benchmarks/bench_serve.py --clients 4 --max-new-tokens 8 --repeats 1 --out /tmp/serve
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _harness import run_meta, write_results  # noqa: E402
from bench_e2e import heldout_prompts  # noqa: E402
from hf_integration.cli import SHIPPED_MODEL, load  # noqa: E402
from hf_integration.server import Server  # noqa: E402

FIELDS = ["strategy", "temperature", "stream", "mixed", "penalties", "max_batch_size", "clients", "max_new_tokens",
          "seconds_median", "new_tokens_per_s", "same_as_alone", "gpu", "torch", "triton", "commit"]
MIXED_STOP = ["\n\n\n"]  # what an odd client of --mixed stops at


def request_body(i: int, prompt: str, max_new_tokens: int, temperature: float, stream: bool, mixed: bool,
                 penalties: bool = False) -> dict:
    """Client i's request (see the module docstring)."""
    if mixed:
        temperature = temperature * (i % 3 + 3) / 4 if i % 5 != 4 else 0.0
    body = {"prompt": prompt, "max_tokens": max_new_tokens, "min_tokens": max_new_tokens, "temperature": temperature,
            "stream": stream, **({"seed": i} if temperature else {})}
    if mixed:
        body.update(max_tokens=max_new_tokens * (i % 4 + 1) // 4, min_tokens=max_new_tokens // 4,
                    **({"stop": MIXED_STOP} if i % 2 else {}))
    if penalties:
        body.update(frequency_penalty=(i % 4) / 4, **({"presence_penalty": 0.5} if i % 2 else {}))
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def serve_round(server: Server, prompts: list[str], max_new_tokens: int, temperature: float,
                stream: bool = False, mixed: bool = False, penalties: bool = False) -> tuple[float, list[str], int]:
    """One request a prompt (:func:`request_body`), each from a thread of its own, all at once (``stream``: streamed,
    the text joined from the deltas): (seconds until the last answer, texts, new tokens the completions hold)."""
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    texts, tokens = [None] * len(prompts), [0] * len(prompts)

    def client(i: int) -> None:
        body = request_body(i, prompts[i], max_new_tokens, temperature, stream, mixed, penalties)
        with urllib.request.urlopen(urllib.request.Request(url, data=json.dumps(body).encode())) as response:
            if not stream:
                answer = json.loads(response.read())
                texts[i], tokens[i] = answer["choices"][0]["text"], answer["usage"]["completion_tokens"]
                return
            events = [json.loads(line[6:]) for line in map(bytes.decode, response)
                      if line.startswith("data: ") and line[6:].strip() != "[DONE]"]
            texts[i] = "".join(event["choices"][0]["text"] for event in events[:-1])
            tokens[i] = events[-1]["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [i for i, text in enumerate(texts) if text is None]
    if failed:
        raise RuntimeError(f"clients {failed} got no answer (their errors are printed above)")
    return time.perf_counter() - start, texts, sum(tokens)


def serve_sizes(args, model, tokenizer, prompts: list[str], strategy: str, temperature: float, meta: dict) -> list:
    """A row per ``--max-batch-sizes`` of ``--repeats`` rounds of ``prompts`` at this strategy and temperature."""
    alone, rows = None, []
    for size in args.max_batch_sizes:
        server = Server(("127.0.0.1", 0), model, tokenizer, {"strategy": strategy}, "bench", size, quiet=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        serve_round(server, prompts[:1], args.max_new_tokens, temperature)  # warm-up (GPU: compilation, capture)
        seconds, texts = [], None
        for _ in range(args.repeats):
            took, texts, tokens = serve_round(server, prompts, args.max_new_tokens, temperature, args.stream,
                                              args.mixed, args.penalties)
            seconds.append(took)
        server.shutdown()
        server.server_close()
        alone = alone if size != 1 else texts
        median = statistics.median(seconds)
        rows.append({"strategy": strategy, "temperature": temperature, "stream": args.stream, "mixed": args.mixed,
                     "penalties": args.penalties,
                     "max_batch_size": size, "clients": args.clients, "max_new_tokens": args.max_new_tokens,
                     "seconds_median": median, "new_tokens_per_s": tokens / median,
                     "same_as_alone": None if alone is None else texts == alone, **meta})
        print(f"{strategy:<12} temperature {temperature:g} max-batch-size {size:>3}: {args.clients} clients, "
              f"{tokens} new tokens in {median:.2f} s ({rows[-1]['new_tokens_per_s']:.0f} new tokens/s), "
              f"same as alone: {rows[-1]['same_as_alone']}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(SHIPPED_MODEL))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-batch-sizes", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--strategies", nargs="+", default=["static", "speculative"])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8], help="0: greedy")
    p.add_argument("--stream", action="store_true", help="the clients stream (server-sent events)")
    p.add_argument("--mixed", action="store_true",
                   help="the clients ask for different lengths, stop strings and temperatures (some greedy)")
    p.add_argument("--penalties", action="store_true",
                   help="the clients ask for presence and frequency penalties of their own")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="CPU threads torch runs on")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    tokenizer, model = load(args.model, args.device, None)
    prompts = heldout_prompts(Path(args.model) / "stdlib_manifest.json", args.clients)
    prompts = (prompts * args.clients)[: args.clients]
    meta, rows = run_meta(args.device.startswith("cuda")), []
    for strategy in args.strategies:
        for temperature in args.temperatures:
            rows += serve_sizes(args, model, tokenizer, prompts, strategy, temperature, meta)
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    name = f"serve_{device}" + "_stream" * args.stream + "_mixed" * args.mixed + "_penalties" * args.penalties
    write_results(args.out, name, FIELDS, rows, {"meta": meta, "rows": rows, "command": " ".join(sys.argv)},
                  float_format=".4g")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
