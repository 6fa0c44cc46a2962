"""Training end to end: a few optimizer steps of ``mrp-train mrp`` (and ``mrp-train backbone``) at the shipped model's
shapes on the standard library, with what each run ran on and how fast it went.

For each mode it saves the run's setup line (device, op backend, attention, bf16 autocast, activation checkpointing,
KD precision), the mean loss of its first and of its last steps, the held-out loss at the end (and, for the MRP head,
the draft agreement per unroll step), tokens/s (the median over the steps after ``--warmup``: the first ones compile
FlexAttention and the Triton kernels), the first step's seconds, the whole run's, and on CUDA the peak memory (run
it with and without ``--activation-checkpointing`` to see what that saves and costs). A loss that is not finite fails
the script (exit 1). On a GPU this runs training's CUDA path as a whole: compiled FlexAttention forward
and backward, bf16 autocast, the Triton kernels with their backward, the TF32 KD GEMMs; on a CPU, the reference ops
and SDPA.

    python benchmarks/bench_training.py --out /tmp/training           # both modes, 40 steps each
    python benchmarks/bench_training.py --modes mrp --steps 4 --seq-len 64 --micro-batch-size 2 --out /tmp/t
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import _harness  # noqa: E402

FIELDS = ["mode", "steps", "seq_len", "micro_batch_size", "device", "ops", "attention", "bf16_autocast",
          "activation_checkpointing", "kd_precision", "loss_first", "loss_last", "eval_loss", "eval_pick_agreement",
          "tokens_per_s", "first_step_s", "wall_s", "peak_memory_gb"]
# The backbone's architecture flags, read from the model's config.json (the shipped model's: reproduce.sh's).
ARCHITECTURE = {"block_size": "--block-size", "hidden_size": "--hidden-size",
                "intermediate_size": "--intermediate-size",
                "num_hidden_layers": "--num-layers", "num_attention_heads": "--num-heads",
                "num_key_value_heads": "--num-kv-heads", "head_dim": "--head-dim",
                "max_position_embeddings": "--max-position-embeddings"}


def parse_args(argv=None):
    from hf_integration.cli import SHIPPED_MODEL

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=SHIPPED_MODEL, help="the checkpoint whose head `mrp` trains on "
                   "and whose tokenizer and shapes `backbone` takes (default: the shipped model)")
    p.add_argument("--modes", nargs="+", choices=["mrp", "backbone"], default=["mrp", "backbone"])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per mode (default: 40)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the tokens/s median (default: 5)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="train with mrp-train's --activation-checkpointing (compare the peak memory and tokens/s)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) to leave steps to time")
    return args


def train_argv(mode: str, args: argparse.Namespace, out: Path) -> list[str]:
    """``mrp-train`` arguments of one run: ``args.steps`` steps on the standard library, logged every step,
    evaluated (2 micro-batches) at the end, no checkpoints."""
    common = ["--stdlib", "--out", str(out), "--max-steps", str(args.steps), "--seq-len", str(args.seq_len),
              "--micro-batch-size", str(args.micro_batch_size), "--log-every", "1", "--eval-batches", "2",
              "--save-every", "0", "--no-progress"] + ["--activation-checkpointing"] * args.activation_checkpointing
    if mode == "mrp":
        return ["mrp", "--model", str(args.model), *common]
    config = json.loads((args.model / "config.json").read_text())
    shape = [arg for key, flag in ARCHITECTURE.items() for arg in (flag, str(config[key]))]
    tied = ["--tie-word-embeddings"] if config.get("tie_word_embeddings") else []
    return ["backbone", "--tokenizer", str(args.model), *shape, *tied, "--lr", "2e-3", *common]


def summarise(mode: str, args: argparse.Namespace, metrics: Path, wall_s: float, peak_gb: float | None) -> dict:
    """One row of :data:`FIELDS` from the run's ``metrics.jsonl``."""
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    setup = next(line["setup"] for line in lines if "setup" in line)
    steps = [line for line in lines if "loss" in line and "lr" in line]
    evaluation = next(line for line in reversed(lines) if "eval_loss" in line)
    losses = [s["loss"] for s in steps]
    if not all(math.isfinite(x) for x in losses + [evaluation["eval_loss"]]):
        raise SystemExit(f"{mode}: a loss is not finite: {losses} (held out: {evaluation['eval_loss']})")
    head = max(1, len(losses) // 4)
    return {"mode": mode, "steps": len(steps), "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
            "device": setup["device"], "ops": setup["ops"], "attention": setup["attention"],
            "bf16_autocast": setup["bf16_autocast"], "activation_checkpointing": setup["activation_checkpointing"],
            "kd_precision": setup.get("kd_precision") if mode == "mrp" else None,
            "loss_first": statistics.mean(losses[:head]), "loss_last": statistics.mean(losses[-head:]),
            "eval_loss": evaluation["eval_loss"], "eval_pick_agreement": evaluation.get("eval_pick_agreement"),
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in steps[args.warmup:]),
            "first_step_s": steps[0]["elapsed_s"], "wall_s": wall_s, "peak_memory_gb": peak_gb}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from training.cli import main as mrp_train

    cuda = torch.cuda.is_available()
    stem = f"training_{'gpu' if cuda else 'cpu'}"
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    meta = {**_harness.run_meta(cuda), "model": str(args.model)}
    for mode in args.modes:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with tempfile.TemporaryDirectory() as run_dir:  # the run's export: only its metrics are kept
            start = time.perf_counter()
            mrp_train(train_argv(mode, args, Path(run_dir)))
            wall_s = time.perf_counter() - start
            metrics = shutil.copy(Path(run_dir) / "metrics.jsonl", args.out / f"{stem}_{mode}_metrics.jsonl")
        row = summarise(mode, args, Path(metrics), wall_s, torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
        rows.append(row)
        print(f"{mode:<9} {row['device']} ({row['ops']} ops, {row['attention']} attention, bf16 autocast "
              f"{row['bf16_autocast']}): loss {row['loss_first']:.4f} -> {row['loss_last']:.4f}, held out "
              f"{row['eval_loss']:.4f}; {row['tokens_per_s']:.0f} tokens/s after step {args.warmup}; first step "
              f"{row['first_step_s']:.1f} s, run {wall_s:.1f} s", flush=True)
        # after every mode, so a run stopped by a time limit keeps the modes it finished
        _harness.write_results(args.out, stem, FIELDS, rows, {"meta": meta, "rows": rows})
    print(f"wrote {args.out / stem}.{{csv,json}} and the runs' metrics ({stem}_<mode>_metrics.jsonl)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
