"""Host time a row's text costs while it decodes: stop strings checked a block at a time (``StopStrings``), against
decoding the row's whole new text at each block (what the check did before), and the token offsets of log-probabilities
(``token_offsets``). CPU only (the tokenizer's work), on the shipped checkpoint's tokenizer, over a standard-library
source file's tokens; no stop string is ever found, so every block is checked. Prints and saves the median, fastest and
slowest of ``--reps`` runs (after one warm-up) in milliseconds.

    python benchmarks/bench_host_text.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _harness  # noqa: E402

FIELDS = ["tokens", "block", "method", "median_ms", "min_ms", "max_ms", "ratio_to_whole_decode", "transformers",
          "tokenizers", "commit"]
NEVER = ("\x00never\x00",)  # a stop string the text never holds


def whole_decode_check(tokenizer, ids: list[int], block: int) -> None:
    """The check before StopStrings: the row's whole new text decoded at each block."""
    for end in range(block, len(ids) + block, block):
        text = tokenizer.decode(ids[:end], skip_special_tokens=False)
        assert not any(s in text for s in NEVER)


def windowed_check(tokenizer, ids: list[int], block: int) -> None:
    from hf_integration.stop_strings import StopStrings

    stops = StopStrings(tokenizer, NEVER)
    for start in range(0, len(ids), block):
        assert stops.tokens_to_keep(ids[start : start + block]) is None


def offsets(tokenizer, ids: list[int]) -> None:
    from hf_integration.incremental_text import token_offsets

    assert len(token_offsets(tokenizer, ids)) == len(ids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,4096", help="new tokens a row, comma-separated")
    ap.add_argument("--blocks", default="4,16", help="block lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="folder for host_text_cpu.csv / .json (default: print only)")
    args = ap.parse_args(argv)
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    from hf_integration.cli import SHIPPED_MODEL

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    source = tokenizer.encode(Path(random.__file__).read_text(), add_special_tokens=False)
    meta = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "commit": _harness.commit()}
    rows = []

    def record(n: int, block, method: str, fn, whole: float | None = None) -> float:
        median, low, high = (us / 1e3 for us in _harness.host_timings(fn, args.reps))
        ratio = "" if whole is None else median / whole
        rows.append({"tokens": n, "block": block, "method": method, "median_ms": median, "min_ms": low,
                     "max_ms": high, "ratio_to_whole_decode": ratio, **meta})
        print(f"{n:5d} tokens  block {block or '-':>3}  {method:13s} {median:9.2f} ms"
              + ("" if whole is None else f"  ({ratio:.3f}x the whole decode)"))
        return median

    for n in map(int, args.tokens.split(",")):
        ids = (source * (n // len(source) + 1))[:n]
        for block in map(int, args.blocks.split(",")):
            whole = record(n, block, "whole_decode", lambda: whole_decode_check(tokenizer, ids, block))
            record(n, block, "stop_strings", lambda: windowed_check(tokenizer, ids, block), whole)
        record(n, "", "token_offsets", lambda: offsets(tokenizer, ids))  # (not by block)
    if args.out:
        _harness.write_results(args.out, "host_text_cpu", FIELDS, rows,
                               {"what": __doc__.split("\n\n")[0], "args": vars(args), "rows": rows}, ".4g")
    return 0


if __name__ == "__main__":
    sys.exit(main())
