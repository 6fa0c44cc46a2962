"""Kernels each decoding step would launch on a GPU, counted on the CPU.

A CUDA graph replays a step's kernels back to back, so what a step costs beyond its bytes is how many it has: a
small kernel costs its launch and ramp-up however little it does. This script runs ``generate`` on the reference
backend and counts, per step the decoder graphs (``BlockDecoder.graphed``: a denoising step, an opening
forward, a verify round, ...), the ATen operations dispatched outside our ops, less the ones that launch
nothing (views), plus one launch per ``mrp_triton`` op call (a Triton kernel on a GPU; its PyTorch reference
is not counted). They fall in three groups: our ops, GEMMs (``mm``/``addmm``/``bmm``: the projections), and
the rest (the glue between them: masks, gathers, counters). A few ops launch two kernels on a GPU where a
split pays (``cached_attention``'s merge, ``lm_head_confidence``'s), so the counts are a floor.

    python benchmarks/launch_counts.py                 # the shipped model; results to benchmarks/results/
    python benchmarks/launch_counts.py --model DIR --out DIR --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mrp_triton  # noqa: E402
from hf_integration.decoding import BlockDecoder  # noqa: E402

OPS = tuple(n for n in mrp_triton.__all__ if not n.endswith("_triton") and n not in ("select_backend", "use_backend"))
GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
# ATen operations that only make a new view (or a tensor's metadata) and launch nothing on a GPU.
VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "expand_as", "slice", "select", "unsqueeze",
    "squeeze", "t", "permute", "transpose", "as_strided", "alias", "detach", "split", "split_with_sizes", "chunk",
    "unbind", "narrow", "view_as", "unflatten", "flatten", "movedim", "diagonal", "unfold", "lift_fresh"})
MODES = {
    "static": {},
    "dynamic tau=0.9": {"strategy": "dynamic", "threshold": 0.9},
    "direct K=2": {"strategy": "direct", "mrp_steps": 2},
    "speculative K=3": {"strategy": "speculative", "mrp_steps": 3},
    "speculative K=3, draft_candidates=16": {"strategy": "speculative", "mrp_steps": 3, "draft_candidates": 16},
    "remask tau=0.7": {"strategy": "remask", "threshold": 0.7},
}


class LaunchCounter(TorchDispatchMode):
    """Counts launches by name while ``step`` is set (see the module docstring); ``op_depth`` > 0 inside an op."""

    def __init__(self):
        super().__init__()
        self.step: str | None = None
        self.op_depth = 0
        self.launches = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if self.step is not None and not self.op_depth and name not in VIEWS:
            self.launches[name] += 1
        return func(*args, **(kwargs or {}))


def _counted_op(counter: LaunchCounter, name: str, fn):
    def op(*args, **kwargs):
        if counter.step is not None and not counter.op_depth:
            counter.launches[f"op:{name}"] += 1
        counter.op_depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            counter.op_depth -= 1

    return op


@contextlib.contextmanager
def counting_steps():
    """Inside: every step the decoder graphs records its launches (a Counter) in the yielded dict under its key
    (the step's name, with "+commit" when it carries finished blocks' commit), once per call (with CUDA graphs,
    what the step runs, not the copies of its inputs into the graph's buffers); forwards outside a step (the
    prefill) are not counted. Runs the reference backend."""
    counter, per_step = LaunchCounter(), {}
    originals = {name: getattr(mrp_triton, name) for name in OPS}
    graphed = BlockDecoder.graphed

    def counted_graphed(self, key, fn, *inputs, **kwargs):
        if counter.step is not None or key[0] in ("backbone", "mrp"):  # inside a step, or a forward of the prefill
            return graphed(self, key, fn, *inputs, **kwargs)
        step = key[0] + ("+commit" if "commit" in key else "")

        def counted(*args):  # what a capture records: the step itself, not the copies into its buffers
            counter.step, counter.launches = step, Counter()
            try:
                return fn(*args)
            finally:
                per_step.setdefault(step, []).append(counter.launches)
                counter.step = None

        return graphed(self, key, counted, *inputs, **kwargs)

    for name, fn in originals.items():
        setattr(mrp_triton, name, _counted_op(counter, name, fn))
    BlockDecoder.graphed = counted_graphed
    try:
        with mrp_triton.use_backend("reference"), counter:
            yield per_step
    finally:
        BlockDecoder.graphed = graphed
        for name, fn in originals.items():
            setattr(mrp_triton, name, fn)


def grouped(launches: Counter) -> dict:
    """{"ops", "gemms", "other", "total"} launch counts of one step, and "other_by_name"."""
    ops = sum(n for k, n in launches.items() if k.startswith("op:"))
    gemms = sum(n for k, n in launches.items() if k in GEMMS)
    other = {k: n for k, n in launches.most_common() if not k.startswith("op:") and k not in GEMMS}
    return {"ops": ops, "gemms": gemms, "other": sum(other.values()), "total": sum(launches.values()),
            "other_by_name": other}


def step_launches(model, input_ids: torch.Tensor, **settings) -> dict[str, Counter]:
    """One ``generate`` call -> the launches of each kind of step it ran: the most common
    count among its calls (a step's code path does not depend on the values it decodes)."""
    with counting_steps() as per_step:
        model.generate(input_ids, **{"cuda_graphs": True, **settings})
    typical = {}
    for step, calls in per_step.items():
        keys = Counter(tuple(sorted(c.items())) for c in calls)
        typical[step] = Counter(dict(keys.most_common(1)[0][0]))
    return typical


def main(argv=None) -> int:
    from hf_integration.cli import SHIPPED_MODEL, load

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(SHIPPED_MODEL))
    ap.add_argument("--prompt", default="def parse_header(line):\n")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    tokenizer, model = load(args.model, "cpu", "float32")
    ids = tokenizer([args.prompt], return_tensors="pt").input_ids
    cfg = model.config
    rows = []
    for mode, extra in MODES.items():
        for step, launches in step_launches(model, ids, max_new_tokens=args.max_new_tokens, **extra).items():
            rows.append({"mode": mode, "step": step, **grouped(launches)})
            r = rows[-1]
            print(f"{mode:38s} {step:16s} ops {r['ops']:4d}  gemms {r['gemms']:4d}  other {r['other']:4d}  "
                  f"({', '.join(f'{k} {n}' for k, n in r['other_by_name'].items())})")
    meta = {"model": args.model, "layers": cfg.num_hidden_layers, "mrp_layers": cfg.num_nextn_predict_layers,
            "batch": 1, "prompt": args.prompt, "max_new_tokens": args.max_new_tokens, "torch": torch.__version__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch_counts_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"Launches per decoding step, batch 1 ({cfg.num_hidden_layers} backbone layers, "
             f"{cfg.num_nextn_predict_layers} MRP layers; `python benchmarks/launch_counts.py`)", "",
             "| mode | step | our ops | GEMMs | other | total |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['step']} | {r['ops']} | {r['gemms']} | {r['other']} | {r['total']} |" for r in rows]
    (out / "launch_counts_cpu.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
