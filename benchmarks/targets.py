"""The issues' benchmark targets against measured results: one line per measured figure, met or missed.

    python benchmarks/targets.py RESULTS_DIR          # after benchmarks/gpu_session.sh: OUT/results

Reads what the benchmarks wrote on a GPU (``decode_kernels.json``, ``mrp_head.json``, ``engine.json``,
``e2e_gpu.json``), prints a Markdown table (issue, target, what was measured, the figure, met / missed; a target
with no figure says "not measured") and writes it to ``RESULTS_DIR/targets.md``. The targets are the issues'
benchmark figures (not tests) at the shapes they name: SDAR-1.7B (H 2048), V = 151936, batch 8 for the decode
ops. Each target lists the figures it needs (every N, kernel, batch or mode its issue names): one that no row
gives is a line of its own, "not measured", so a run a time limit cut short cannot pass on the rows it reached.
``--smoke`` reads the ``*_smoke.json`` files of ``--smoke`` runs at the tiny shapes (a check that this script reads
them; those figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Finding:
    """One measured figure against its target: ``what`` was measured, the figure as text, and whether it meets
    the target."""

    what: str
    figure: str
    met: bool | None  # None: not measured


@dataclass(frozen=True)
class Target:
    """A target of an issue, checked on the rows of one results file (``source``: the stem bench_*.py writes);
    ``expects(model)``: the ``what`` of every finding it needs at the issue's shapes."""

    issue: int
    text: str
    source: str
    check: Callable[[list[dict], str], list[Finding]]  # (rows, model tag) -> findings
    expects: Callable[[str], list[str]]


def _rows_n(shape: str) -> int:
    """N of a shape such as ``N=256,V=151936,bf16`` or ``N=16 H=2048 V=151936``."""
    return int(re.search(r"N=(\d+)", shape).group(1))


def _pick(rows: list[dict], **match) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


# The confidence rows the issue's targets are about (bench_decode_kernels: with and without a residual); its sampled
# rows with top-k / top-p / min-p / epsilon and eta / top-h / typical (confidence_topkp, confidence_topp,
# confidence_minp, confidence_epsilon_eta, confidence_toph, confidence_typical) also time the torch ops that find the
# cut; confidence_ban holds EOS back in half its rows (min_new_tokens); confidence_penalty reads a repetition
# penalty's seen tokens, confidence_offsets presence / frequency penalties' and a bias's offsets; confidence_entropy
# also gives each row's entropy (entropy-bounded decoding).
GREEDY_CONFIDENCE = ("confidence_res", "confidence_nores")


def _confidence_bandwidth(rows, model):
    return [Finding(f"{r['kernel']} {r['shape']}", f"{100 * r['copy_ratio']:.0f}% of copy", r["copy_ratio"] >= 0.8)
            for r in _pick(rows, provider="triton") if r["kernel"] in GREEDY_CONFIDENCE
            and _rows_n(r["shape"]) >= 256 and r.get("copy_ratio")]


def _confidence_speedup(rows, model):
    return [Finding(f"{r['kernel']} {r['shape']}", f"{r['speedup_vs_eager']:.1f}x eager", r["speedup_vs_eager"] >= 10)
            for r in _pick(rows, provider="triton") if r["kernel"] in GREEDY_CONFIDENCE
            and _rows_n(r["shape"]) == 16 and r.get("speedup_vs_eager")]


def _small_ops(rows, model):
    findings = []
    for r in _pick(rows, provider="triton_graph"):
        if r["kernel"].split("_")[0] in ("select", "verify", "remask"):
            called = _pick(rows, kernel=r["kernel"], shape=r["shape"], provider="triton")
            note = f" ({called[0]['median_us']:.1f} us a call from Python, cold L2)" if called else ""
            findings.append(Finding(f"{r['kernel']} {r['shape']}, in a CUDA graph", f"{r['median_us']:.1f} us{note}",
                                    r["median_us"] < 10))
    return findings


def _lm_head(rows, model):
    """Judged on the default tiles (what generate() runs); the best config of a ``--sweep`` at the same shape is
    named beside it, for the tile table to follow."""
    findings = []
    for r in _pick(rows, kernel="lm_head_confidence", provider="triton_fused"):
        if _rows_n(r["shape"]) > 128 or not r.get("x_weight_read"):
            continue
        figure = f"{r['x_weight_read']:.2f}x the weight read"
        swept = [s for s in _pick(rows, kernel="lm_head_confidence", shape=r["shape"])
                 if s["provider"].startswith("sweep_") and s.get("x_weight_read")]
        if swept:
            best = min(swept, key=lambda s: s["x_weight_read"])
            figure += f" (best of the sweep: {best['x_weight_read']:.2f}x, {best['provider']} {best['note']})"
        findings.append(Finding(f"lm_head_confidence {r['shape']}", figure, r["x_weight_read"] <= 1.3))
    return findings


def _speculative_ratio(row: dict) -> tuple[str, bool]:
    return f"{row['ratio']:.2f}x", row["ratio"] >= 1.6


def _static_decoding(rows, model):
    return [Finding(r["shape"], f"{r['ratio']:.1f}x eager ({r['tokens_per_s']:.0f} tokens/s)", r["ratio"] >= 8)
            for r in _pick(rows, kernel="decode", provider="cuda_graph") if r["shape"].startswith(f"{model} ")]


def _speculative_e2e(rows, model):
    return [Finding(f"{r['mode']} on the shipped model", f"{r['speedup_vs_static']:.2f}x static tokens/s",
                    r["speedup_vs_static"] >= 1.6) for r in rows if r["mode"].startswith("speculative K=3")]


def _speculative_lossless(rows, model):
    return [Finding(f"{r['mode']} on the shipped model", f"{r['identical_to_static']:.0%} of completions identical",
                    r["identical_to_static"] == 1) for r in rows if r["mode"].startswith("speculative")]


V = 151936
SMALL_OPS = ("select_static", "select_dynamic", "select_entropy", "verify", "remask_tau", "remask_delta")
LM_HEAD_ROWS, LM_HEAD_HIDDEN = (1, 4, 16, 64, 128), (2048, 4096)
DECODE_BATCHES = (1, 8, 32)


def _engine_target(issue: int, text: str, kernel: str, shape: str, figure: Callable[[dict], tuple[str, bool]],
                   provider: str = "cuda_graph") -> Target:
    """A target on the engine row (kernel, ``<model> <shape>``, provider): ``figure(row)`` -> (text, met); the
    finding it expects names the same shape and provider."""
    def check(rows, model):
        return [Finding(f"{r['shape']} ({provider})", *figure(r))
                for r in _pick(rows, kernel=kernel, shape=f"{model} {shape}", provider=provider)]
    return Target(issue, text, "engine", check, lambda model: [f"{model} {shape} ({provider})"])


TARGETS = [
    Target(4, "confidence >= 80% of the copy bandwidth for N >= 256", "decode_kernels", _confidence_bandwidth,
           lambda model: [f"{k} N={n},V={V},bf16" for n in (256, 1024, 4096) for k in GREEDY_CONFIDENCE]),
    Target(4, "confidence >= 10x faster than torch eager at N = 16", "decode_kernels", _confidence_speedup,
           lambda model: [f"{k} N=16,V={V},bf16" for k in GREEDY_CONFIDENCE]),
    Target(4, "select, verify and remask under 10 us each at batch 8", "decode_kernels", _small_ops,
           lambda model: [f"{k} B=8,L=16,K=3, in a CUDA graph" for k in SMALL_OPS]),
    _engine_target(5, "MRP head forward (D = 3) <= 12% of a backbone forward, batch 1", "step", "B=1 mrp D=3",
                   lambda r: (f"{100 * r['ratio']:.1f}% of the plain step", r["ratio"] <= 0.12)),
    Target(5, "fused LM-head confidence within 1.3x of reading the lm_head weight once, N <= 128", "mrp_head",
           _lm_head, lambda model: [f"lm_head_confidence N={n} H={h} V={V}" for h in LM_HEAD_HIDDEN
                                    for n in LM_HEAD_ROWS]),
    _engine_target(8, "static step at batch 1 <= 2.0 ms (the backbone forward alone)", "step", "B=1 plain q=16",
                   lambda r: (f"{r['median_us'] / 1e3:.2f} ms", r["median_us"] <= 2000)),
    _engine_target(8, "static step at batch 1 <= 2.0 ms (the whole graphed step: forward, LM-head pick, commit)",
                   "whole_step", "B=1 static step",
                   lambda r: (f"{r['median_us'] / 1e3:.2f} ms", r["median_us"] <= 2000)),
    Target(8, "static decoding >= 8x the eager loop", "engine", _static_decoding,
           lambda model: [f"{model} B={b} static 512+256" for b in DECODE_BATCHES]),
    _engine_target(8, "verify step with 4 copies <= 1.2x a plain step at batch 1", "step", "B=1 verify copies=4",
                   lambda r: (f"{r['ratio']:.2f}x", r["ratio"] <= 1.2)),
    _engine_target(8, "speculative K = 3 >= 1.6x over static decoding (estimate from step costs)",
                   "speculative_estimate", "B=1 K=3", _speculative_ratio),
    _engine_target(8, "speculative K = 3 >= 1.6x over static decoding (estimate; drafts among 16 candidates)",
                   "speculative_estimate", "B=1 K=3", _speculative_ratio, provider="draft_candidates=16"),
    Target(8, "speculative K = 3 >= 1.6x over static decoding (end to end)", "e2e_gpu", _speculative_e2e,
           lambda model: ["speculative K=3 mrp on the shipped model"]),
    # exact on the CPU (tested); in bf16 the verify forward's wider matmuls may round differently from the static
    # step's and flip a near-tie: a miss here is a finding to look into, numerics or a defect
    Target(8, "speculative decoding is lossless: identical to static decoding (greedy)", "e2e_gpu",
           _speculative_lossless, lambda model: [f"speculative K={k} mrp on the shipped model" for k in (1, 3)]),
]


def evaluate(results: Path, smoke: bool = False, model: str = "1.7B") -> list[tuple[Target, str, list[Finding]]]:
    """Every target with the file it reads and its findings from that file in ``results``, then a "not measured"
    finding (met None) for each figure it expects that no row gave (not with ``smoke``: tiny shapes)."""
    out = []
    for target in TARGETS:
        path = results / f"{target.source}{'_smoke' if smoke else ''}.json"
        try:
            rows = json.loads(path.read_text())["rows"] if path.is_file() else []
        except (ValueError, KeyError) as err:  # a file a killed step cut: its target is not measured
            print(f"{path}: unreadable ({err!r})", file=sys.stderr)
            rows = []
        findings = target.check(rows, model)
        found = {f.what for f in findings}
        missing = [] if smoke else [w for w in target.expects(model) if w not in found]
        out.append((target, path.name, findings + [Finding(w, "-", None) for w in missing]))
    return out


VERDICTS = {True: "met", False: "missed", None: "not measured"}


def table(evaluated: list[tuple[Target, str, list[Finding]]]) -> str:
    lines = ["| issue | target | measured | figure | verdict |", "|---|---|---|---|---|"]
    for target, source, findings in evaluated:
        if not findings:
            lines.append(f"| {target.issue} | {target.text} | - | - | not measured (no rows in {source}) |")
        for f in findings:
            verdict = VERDICTS[f.met] + (f" (no row in {source})" if f.met is None else "")
            lines.append(f"| {target.issue} | {target.text} | {f.what} | {f.figure} | {verdict} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="folder with the benchmarks' JSON results")
    ap.add_argument("--smoke", action="store_true", help="read the *_smoke.json files (tiny shapes)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    text = table(evaluate(args.results, args.smoke, "tiny" if args.smoke else "1.7B"))
    print(text, end="")
    (args.results / "targets.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
