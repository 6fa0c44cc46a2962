"""Line completion on held-out code: what stopping a row at its first EOS saves.

Each of bench_e2e.py's held-out prompts (a signature and its first body line) is cut in the middle of its last line,
and every token holding a newline is an EOS, so a completion ends with its line: a row's output is settled as soon
as that token and the ones before it are committed, usually with its block still partly masked. Per mode, one prompt
at a time, greedy: backbone and MRP forwards (the work done for the rows), batch steps (the forwards run), tokens
committed, and a digest of the completions (lossless modes give static's).

    python benchmarks/line_completion.py                 # the shipped model, results to benchmarks/results/
    python benchmarks/line_completion.py --prompts 4 --max-new-tokens 16 --out /tmp/lines
    python benchmarks/line_completion.py --replayed      # the steps a CUDA model's replayed graphs run

``--replayed`` decodes as a CUDA model does by default (``cuda_graphs=True``: on a CPU the recorded step functions
are replayed, with the host checks of replayed steps), so its batch steps are the forwards a GPU runs; the counts
are the same on any machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_e2e import heldout_prompts  # noqa: E402
from hf_integration.cli import SHIPPED_MODEL, load  # noqa: E402

MODES = [("static", {}), ("dynamic tau=0.9", dict(strategy="dynamic", threshold=0.9)),
         ("speculative K=3", dict(strategy="speculative", mrp_steps=3)),
         ("remask tau=0.9", dict(strategy="remask", threshold=0.9))]


def cut_mid_line(prompt: str) -> str:
    """``prompt`` without its last newline and the second half of its last line (its indentation and at least one
    character kept)."""
    head, last = prompt.rstrip("\n").rsplit("\n", 1)
    indent = len(last) - len(last.lstrip())
    return head + "\n" + last[: max(len(last) // 2, indent + 1)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(SHIPPED_MODEL))
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--replayed", action="store_true", help="replay the steps as CUDA graphs do (cuda_graphs=True)")
    args = p.parse_args(argv)

    tokenizer, model = load(args.model, "cpu", None)
    prompts = [cut_mid_line(x) for x in heldout_prompts(Path(args.model) / "stdlib_manifest.json", args.prompts)]
    newline = [i for i in range(model.config.vocab_size) if i != model.config.mask_token_id
               and "\n" in tokenizer.decode([i])]
    rows = []
    for name, extra in MODES:
        row = dict(mode=name, backbone_forwards=0, mrp_forwards=0, batch_steps=0, tokens_committed=0)
        completions = []
        for prompt in prompts:
            ids = tokenizer([prompt], return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=newline, pad_token_id=0,
                                 return_dict_in_generate=True, cuda_graphs=args.replayed, **extra)
            for key in ("backbone_forwards", "mrp_forwards", "tokens_committed"):
                row[key] += int(getattr(out.stats, key).sum())
            row["batch_steps"] += out.batch_steps
            completions.append(out.sequences[0, ids.shape[1]:].tolist())
        row["completions_md5"] = hashlib.md5(json.dumps(completions).encode()).hexdigest()[:12]
        rows.append(row)
        print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    meta = dict(model=str(args.model), device=platform.processor() or "cpu", torch=torch.__version__,
                prompts=len(prompts), max_new_tokens=args.max_new_tokens, replayed=args.replayed, commit=commit,
                example_prompt=prompts[0])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"line_completion_cpu{'_replayed' if args.replayed else ''}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
