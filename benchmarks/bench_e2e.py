"""End-to-end decoding benchmark: every strategy against static one-token-a-step decoding, on held-out code or
on your own prompts.

By default the prompts are function signatures plus their first body line, taken from the held-out
standard-library files recorded with the model (``stdlib_manifest.json``). ``--prompt-file`` takes your own
instead: JSONL, one record a line, ``{"prompt": ...}`` (sent through the chat template as a user message with
``--chat``), ``{"messages": [{"role": ..., "content": ...}, ...]}`` (always rendered by the chat template, the
assistant's turn opened; a last assistant turn, the reference answer, is left out) or ``{"text": ...}`` (as it is);
other keys (an answer to score against) are ignored. For each mode the script reports tokens per backbone
forward (TPF), backbone and MRP forwards, batch steps (forwards over the whole batch: rows move on block by
block on their own, so a batch takes about as many as its slowest row), tokens/s (of the tokens the completions
keep: a verify round may commit some past the EOS, which TPF counts), speedup over static, whether
each completion is identical to the static one, and quality: token agreement with the static output and, for the
held-out code, the share of completions that parse with ``ast.parse`` once the function is closed, and
(stricter) the share whose whole completion parses with only its last, cut line dropped. Every completion is
saved too (``<tag>_completions.jsonl``: mode, prompt index, prompt and completion text), to score with your own
checks. Rows stop at the checkpoint's EOS. On CUDA each mode first runs one untimed call (kernel compilation,
CUDA-graph capture); the timed calls replay the captured steps.

    python benchmarks/bench_e2e.py                       # the shipped model, results to benchmarks/results/
    python benchmarks/bench_e2e.py --model DIR --prompts 8 --max-new-tokens 32 --out /tmp/e2e
    python benchmarks/bench_e2e.py --model DIR --prompt-file questions.jsonl --chat --max-new-tokens 256 \\
        --modes "speculative K=3 mrp" "dynamic tau=0.9" --out /tmp/e2e
    python benchmarks/bench_e2e.py --device-loop --modes dynamic speculative --tag e2e_gpu_device_loop
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import sys
import time
from collections import namedtuple
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _harness  # noqa: E402
from hf_integration.cli import SHIPPED_MODEL, load  # noqa: E402
from hf_integration.cli_prompts import UsageError, left_padded, read_prompt_records  # noqa: E402
from training.stdlib_corpus import manifest_root  # noqa: E402

# A mode's draft vocabulary: the ``size`` most frequent token ids of the model's training files.
MostFrequent = namedtuple("MostFrequent", "size")


MODES = (
    [("static", {})]
    + [("sequential", {"strategy": "sequential"})]
    + [(f"entropy_bounded bound={b}", {"strategy": "entropy_bounded", "entropy_bound": b})
       for b in (0.01, 0.1, 0.35, 1.0)]
    + [(f"dynamic tau={t}", {"strategy": "dynamic", "threshold": t}) for t in (0.5, 0.6, 0.7, 0.8, 0.9)]
    + [(f"direct K={k}", {"strategy": "direct", "mrp_steps": k}) for k in (1, 2)]
    + [(f"speculative K={k} {s}", {"strategy": "speculative", "mrp_steps": k, "draft_schedule": s})
       for s in ("mrp", "authors") for k in (1, 2, 3, 4)]
    + [("speculative K=3 mrp, blocks together", {"strategy": "speculative", "mrp_steps": 3, "per_row_blocks": False})]
    + [(f"speculative K=3 mrp, draft_vocab={n}", {"strategy": "speculative", "mrp_steps": 3, "draft_vocab": n})
       for n in (1024, 512)]
    + [(f"speculative K=3 mrp, draft_vocab={n} most frequent ids",
        {"strategy": "speculative", "mrp_steps": 3, "draft_vocab": MostFrequent(n)}) for n in (1024, 512)]
    + [(f"speculative K=3 mrp, draft_candidates={m}",
        {"strategy": "speculative", "mrp_steps": 3, "draft_candidates": m}) for m in (16, 4)]
    + [(f"remask {r} tau={t}", {"strategy": "remask", "threshold": t, "remask_rule": r})
       for r in ("tau", "delta") for t in (0.5, 0.6, 0.7, 0.8, 0.9)]
)


def heldout_prompts(manifest_path: Path, limit: int, max_lines: int = 2) -> list[str]:
    """``def`` line(s) and the first body line of functions from the held-out files, dedented; only
    functions whose first statement fits on one line, so that every prompt is complete code."""
    manifest = json.loads(manifest_path.read_text())
    root = Path(manifest_root(manifest))
    prompts: list[str] = []
    for rel in manifest["heldout"]:
        path = root / rel
        if not path.exists():
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        lines = source.splitlines()
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for fn in sorted(functions, key=lambda n: n.lineno)[:6]:
            first = fn.body[0]
            first_body = first.lineno
            if first_body - fn.lineno >= max_lines or first.end_lineno != first.lineno:
                continue  # long signatures and multi-line first statements (docstrings) make poor prompts
            indent = len(lines[fn.lineno - 1]) - len(lines[fn.lineno - 1].lstrip())
            chunk = [line[indent:] for line in lines[fn.lineno - 1 : first_body]]
            prompts.append("\n".join(chunk) + "\n")
    return prompts[:limit]


def closes_and_parses(prompt: str, completion: str) -> bool:
    """Whether prompt + completion parses once cut where the function ends (first line back at column 0)
    and with the last, possibly unfinished, line dropped."""
    lines = (prompt + completion).split("\n")
    body = [lines[0]]
    for line in lines[1:]:
        if line.strip() and not line[0].isspace():
            break
        body.append(line)
    else:
        body = body[:-1]  # generation stopped inside the function: drop the cut line
    text = "\n".join(body).rstrip()
    if len(text.split("\n")) < 2:
        text += "\n    pass"
    return _parses(text)


def whole_completion_parses(prompt: str, completion: str) -> bool:
    """Stricter quality: prompt + completion parses as a module, only the last (cut) line dropped."""
    return _parses("\n".join((prompt + completion).split("\n")[:-1]))


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
    except SyntaxError:
        return False
    return True


def most_frequent_ids(manifest: Path, tokenizer, size: int, model, counts: dict) -> list[int]:
    """The ``size`` most frequent token ids of the manifest's training files, without the mask token (what
    ``mrp-train draft-vocab --stdlib`` writes); the counts are kept in ``counts`` for the next mode."""
    from training.draft_vocab import most_frequent_ids as top_ids
    from training.draft_vocab import token_counts
    from training.stdlib_corpus import load_manifest, manifest_records

    if "train" not in counts:
        counts["train"] = token_counts(manifest_records(load_manifest(manifest))[0], tokenizer)
    return top_ids(counts["train"], size, model.config.vocab_size, exclude=[model.config.mask_token_id])


def run_mode(model, prompts: list[list[int]], settings: dict, batch_size: int):
    """prompts: token ids each. Returns per-prompt completions (token lists) and summed stats, plus wall seconds."""
    completions, totals, seconds = [], {}, 0.0
    for start in range(0, len(prompts), batch_size):
        ids, mask = left_padded(prompts[start : start + batch_size], model.device)
        if ids.is_cuda:  # untimed: compiles the kernels and captures the CUDA graphs this batch's shapes need
            model.generate(ids, attention_mask=mask, **settings)
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **settings)
        if ids.is_cuda:
            torch.cuda.synchronize()
        seconds += time.perf_counter() - t0
        completions += out.sequences[:, ids.shape[1]:].tolist()
        totals["batch_steps"] = totals.get("batch_steps", 0) + out.batch_steps
        totals["output_tokens"] = totals.get("output_tokens", 0) + int(out.new_tokens.sum())
        for key, values in out.stats.as_dict().items():
            if key == "accepted_lengths":  # per row, a histogram of drafts accepted per verify round
                histogram = [sum(column) for column in zip(*values)]
                totals[key] = [a + b for a, b in zip(totals.get(key, [0] * len(histogram)), histogram)]
            else:
                totals[key] = totals.get(key, 0) + sum(values)
    return completions, totals, seconds


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(SHIPPED_MODEL))
    p.add_argument("--manifest", type=Path, help="default: MODEL/stdlib_manifest.json")
    p.add_argument("--prompts", type=int, default=24, help="how many prompts at most (default: 24)")
    p.add_argument("--prompt-file", type=Path, help="your own prompts: JSONL records {prompt}, {messages} or {text} "
                   "(default: held-out code of the model's stdlib_manifest.json)")
    p.add_argument("--chat", action="store_true", help="send --prompt-file's prompt records through the tokenizer's "
                   "chat template as a user message")
    p.add_argument("--system", help="with --chat: a system message before each prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--modes", nargs="*", help="substrings selecting modes (default: all)")
    p.add_argument("--skip", nargs="*", default=[], help="substrings of modes to leave out of those selected")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--tag", default=None, help="file name stem (default: e2e_<device>)")
    p.add_argument("--device-loop", action="store_true", help="every mode runs the steps that may have work in "
                   "device loops (generate's device_loop, with CUDA graphs; on CUDA it "
                   "needs torch >= 2.12)")
    args = p.parse_args(argv)
    if (args.chat or args.system is not None) and args.prompt_file is None:
        p.error("--chat and --system apply to the prompt records of --prompt-file")
    if args.system is not None and not args.chat:
        p.error("--system needs --chat")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    tokenizer, model = load(args.model, args.device, args.dtype)
    manifest = args.manifest or Path(args.model) / "stdlib_manifest.json"
    code = args.prompt_file is None  # held-out code, whose completions are checked to parse
    if code:
        prompts = [tokenizer(p).input_ids for p in heldout_prompts(manifest, args.prompts)]
        if not prompts:
            raise SystemExit(f"no held-out prompts found from {manifest}")
    else:
        try:
            records = read_prompt_records(args.prompt_file, tokenizer, args.chat, args.system, args.model)
        except UsageError as err:
            raise SystemExit(str(err)) from None
        prompts = [record.ids for record in records[: args.prompts]]
        if not prompts:
            raise SystemExit(f"--prompt-file {args.prompt_file}: no prompts")
    texts_in = [tokenizer.decode(p) for p in prompts]
    modes = [m for m in MODES if (not args.modes or any(s in m[0] for s in args.modes))
             and not any(s in m[0] for s in args.skip)]
    if modes[0][0] != "static":
        modes.insert(0, MODES[0])
    if not manifest.exists() and any(isinstance(m[1].get("draft_vocab"), MostFrequent) for m in modes):
        print(f"left out the 'most frequent ids' modes: they count the training files of {manifest}, not found")
        modes = [m for m in modes if not isinstance(m[1].get("draft_vocab"), MostFrequent)]
    base = dict(max_new_tokens=args.max_new_tokens)  # rows stop at the checkpoint's EOS

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    commit = _harness.commit()
    meta = {"model": str(args.model), "device": device_name, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "prompts": len(prompts),
            "prompt_source": str(args.prompt_file) if args.prompt_file else f"held-out code ({manifest.name})",
            "chat": args.chat, "max_new_tokens": args.max_new_tokens,
            "batch_size": args.batch_size, "device_loop": args.device_loop, "commit": commit,
            "example_prompt": texts_in[0]}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.tag or f"e2e_{'gpu' if args.device.startswith('cuda') else 'cpu'}"

    rows, static, counts, saved = [], None, {}, []
    for name, extra in modes:
        if isinstance(extra.get("draft_vocab"), MostFrequent):
            extra = {**extra, "draft_vocab": most_frequent_ids(manifest, tokenizer, extra["draft_vocab"].size, model,
                                                               counts)}
        if args.device_loop:
            extra = {**extra, "device_loop": True, "cuda_graphs": True}
        completions, totals, seconds = run_mode(model, prompts, {**base, **extra}, args.batch_size)
        static = static or (completions, totals, seconds)
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        saved += [{"mode": name, "prompt_index": i, "prompt": p, "completion": t}
                  for i, (p, t) in enumerate(zip(texts_in, texts))]
        agree = [sum(a == b for a, b in zip(c, s)) / len(c) for c, s in zip(completions, static[0])]
        row = {
            "mode": name,
            "tpf": totals["tokens_committed"] / max(totals["backbone_forwards"], 1),
            "backbone_forwards": totals["backbone_forwards"],
            "verify_rounds": sum(totals["accepted_lengths"]),  # the other backbone forwards denoise
            "batch_steps": totals["batch_steps"],  # forwards over the batch (a row's steps: backbone_forwards)
            "accepted_lengths": totals["accepted_lengths"],
            "mrp_forwards": totals["mrp_forwards"],
            "tokens": totals["tokens_committed"],
            # speed counts the tokens the completions keep: a verify round may commit some past the EOS
            "output_tokens": totals["output_tokens"],
            "tokens_per_s": totals["output_tokens"] / seconds,
            "speedup_vs_static": (totals["output_tokens"] / seconds) / (static[1]["output_tokens"] / static[2]),
            "identical_to_static": sum(c == s for c, s in zip(completions, static[0])) / len(prompts),
            "agreement_with_static": sum(agree) / len(agree),
            "parses": sum(map(closes_and_parses, texts_in, texts)) / len(prompts) if code else None,
            "parses_whole": sum(map(whole_completion_parses, texts_in, texts)) / len(prompts) if code else None,
            "tokens_remasked": totals["tokens_remasked"],
        }
        rows.append(row)
        print(f"{name:<26} TPF {row['tpf']:5.2f}  tok/s {row['tokens_per_s']:7.1f}  x{row['speedup_vs_static']:.2f}  "
              f"identical {row['identical_to_static']:.0%}  agree {row['agreement_with_static']:.0%}"
              + (f"  parses {row['parses']:.0%} / whole {row['parses_whole']:.0%}" if code else ""), flush=True)
        meta["example_static_completion"] = tokenizer.decode(static[0][0], skip_special_tokens=True)
        write_tables(args.out / stem, rows, meta, saved)  # after every mode: a run cut by a time limit keeps them

    plot(rows, args.out / f"{stem}.png", meta)
    print(f"wrote {args.out / stem}.{{json,csv,md,png}} and {stem}_completions.jsonl")
    return 0


def write_tables(stem: Path, rows: list[dict], meta: dict, saved: list[dict]) -> None:
    """The rows so far as ``stem``.json / .csv / .md, and every completion as ``stem``_completions.jsonl."""
    _harness.write_results(stem.parent, stem.name, list(rows[0]), rows, {"meta": meta, "rows": rows})
    _harness.write_atomically(stem.with_suffix(".md"), markdown_table(rows, meta))
    _harness.write_atomically(stem.parent / f"{stem.name}_completions.jsonl",
                              "".join(json.dumps(r) + "\n" for r in saved))


def markdown_table(rows: list[dict], meta: dict) -> str:
    code = rows[0]["parses"] is not None
    columns = ["mode", "TPF", "backbone fwd", "MRP fwd", "batch steps", "tok/s", "speedup", "identical to static",
               "agreement"] + (["parses (function closed)", "parses (whole completion)"] if code else [])
    head = f"| {' | '.join(columns)} |\n|{'---|' * len(columns)}\n"
    body = "".join(f"| {r['mode']} | {r['tpf']:.2f} | {r['backbone_forwards']} | {r['mrp_forwards']} | "
                   f"{r['batch_steps']} | "
                   f"{r['tokens_per_s']:.1f} | {r['speedup_vs_static']:.2f}x | {r['identical_to_static']:.0%} | "
                   f"{r['agreement_with_static']:.0%} |"
                   + (f" {r['parses']:.0%} | {r['parses_whole']:.0%} |" if code else "") + "\n" for r in rows)
    return (f"{meta['prompts']} prompts ({meta['prompt_source']}{', chat template' if meta['chat'] else ''}), "
            f"{meta['max_new_tokens']} new tokens, batch {meta['batch_size']}, "
            f"{meta['device']} ({meta['threads']} threads), torch {meta['torch']}, commit {meta['commit']}\n\n"
            + head + body)


def plot(rows: list[dict], path: Path, meta: dict) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    families = {"static": "k", "sequential": "tab:gray", "entropy_bounded": "tab:purple", "dynamic": "tab:blue",
                "direct": "tab:orange", "speculative": "tab:green", "remask": "tab:red"}
    for family, color in families.items():
        pts = [r for r in rows if r["mode"].startswith(family)]
        ax.scatter([r["tpf"] for r in pts], [r["agreement_with_static"] for r in pts], c=color, label=family)
    ax.set_xlabel("tokens per backbone forward (TPF)")
    ax.set_ylabel("agreement with static decoding")
    ax.set_title(f"Quality vs TPF, {meta['prompts']} prompts: {meta['prompt_source']} ({meta['device']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
