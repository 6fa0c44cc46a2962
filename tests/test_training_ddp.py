"""A 2-process torchrun (gloo) run equals a 1-process run with the same global batch."""

import glob
import json
import os
import shutil
import subprocess

import pytest
import torch

from training_fixtures import make_tokenizer, one_thread, subprocess_env, write_corpus  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import sys
import torch.distributed as dist
from training.cli import run
backbone_args, mrp_args = sys.argv[1].split("|"), sys.argv[2].split("|")
run(backbone_args)
run(mrp_args)
dist.destroy_process_group()  # as mrp-train's main does: a process group left to the interpreter's exit may abort it
"""


def _args(tok_dir, data, out, micro, accum, backbone=None):
    bb = ["backbone", "--data", data, "--tokenizer", tok_dir, "--out", f"{out}/bb", "--seq-len", "16",
          "--block-size", "4", "--hidden-size", "32", "--intermediate-size", "64", "--num-layers", "2",
          "--num-heads", "4", "--num-kv-heads", "2", "--micro-batch-size", str(micro), "--grad-accum", str(accum),
          "--max-steps", "4", "--heldout-fraction", "0.1", "--eval-batches", "1", "--no-progress", "--lr", "1e-2",
          "--save-every", "2"]
    mrp = ["mrp", "--model", backbone or f"{out}/bb", "--data", data, "--out", f"{out}/mrp", "--seq-len", "16",
           "--mrp-layers", "1", "--unroll-k", "2", "--micro-batch-size", str(micro), "--grad-accum", str(accum),
           "--max-steps", "3", "--heldout-fraction", "0.1", "--eval-batches", "1", "--no-progress", "--lr", "3e-3"]
    return bb, mrp


def _load(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(f))
    assert out, folder
    return out


def _steps(folder):
    """The per-step records (loss, grad_norm, ...) of a run's metrics.jsonl."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [rec for rec in map(json.loads, f) if "loss" in rec]


def _final_eval_loss(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [rec for rec in map(json.loads, f) if "eval_loss" in rec][-1]["eval_loss"]


def test_torchrun_two_processes_equal_one(tmp_path):
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun not on PATH")
    from training.cli import run

    tok_dir = str(tmp_path / "tok")
    make_tokenizer(tok_dir)
    data = write_corpus(str(tmp_path / "corpus"))["text"]
    script = tmp_path / "ddp_script.py"
    script.write_text(SCRIPT)
    bb1, mrp1 = _args(tok_dir, data, tmp_path / "one", micro=4, accum=2)  # 4 x 1 x 2 = 8 per step
    r1 = run(bb1)
    run(mrp1)
    # both MRP runs train on the same (1-process) backbone, so only the distribution differs
    bb2, mrp2 = _args(tok_dir, data, tmp_path / "two", micro=2, accum=2,  # 2 x 2 x 2 = 8 per step
                      backbone=str(tmp_path / "one" / "bb"))
    proc = subprocess.run(
        ["torchrun", "--standalone", "--nproc_per_node", "2", str(script), "|".join(bb2), "|".join(mrp2)],
        env=subprocess_env(REPO), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for part in ("bb", "mrp"):
        a, b = _load(tmp_path / "one" / part), _load(tmp_path / "two" / part)
        assert a.keys() == b.keys()
        for k in a:
            err = float((a[k] - b[k]).abs().max())
            assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), (part, k, err)
        if part == "bb":
            moved = [k for k in a if "mrp" not in k]
            assert moved
        # each step's loss and gradient norm too (AdamW's update would hide a gradient scaled by a constant)
        one, two = _steps(tmp_path / "one" / part), _steps(tmp_path / "two" / part)
        assert [s["step"] for s in one] == [s["step"] for s in two] and one
        for a, b in zip(one, two):
            for key in ("loss", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-4), (part, a["step"], key)
        # and the final held-out loss, of --eval-batches x micro x processes = 4 of the 16 held-out sequences each
        one_eval, two_eval = (_final_eval_loss(tmp_path / run / part) for run in ("one", "two"))
        assert two_eval == pytest.approx(one_eval, rel=1e-4), part
    # the 2-process MRP run left the backbone untouched and trained the head
    bb, mrp = _load(tmp_path / "one" / "bb"), _load(tmp_path / "two" / "mrp")
    assert all(torch.equal(bb[k], mrp[k]) for k in bb)
    assert any(k.startswith("mrp_modules.") for k in mrp)
    assert r1["step"] == 4
