"""The MRP distillation loss, forward + backward: chunked (``training.kd_loss.kd_loss_sum``) vs autograd through
the dense formula (fp32 logits of teacher and student, log-softmax, KL), as MRP training computed it before.
The chunked loss runs at each GEMM precision (``chunked``: fp32, ``chunked_tf32``, ``chunked_bf16``; see
``training.kd_loss``; off CUDA tf32 is fp32), each chunk's KL and gradient on ``mrp_triton.softmax_kl`` (the Triton
kernels on CUDA, the PyTorch reference on CPU); ``chunked_tf32_torch_kl`` is ``chunked_tf32`` with that step in
PyTorch ops on CUDA too (the reference: two log-softmaxes and 8 elementwise ops, ~25 passes over the chunk's
logits), what the kernels are measured against.

Per (rows, provider): the median time of forward + backward over ``--reps`` calls (after one warm-up), the
peak memory above the inputs: on CUDA ``torch.cuda.max_memory_allocated``, on CPU the peak resident set
(``getrusage``), each (rows, provider) in its own process so one peak does not hide another; and the loss's and
the student gradient's relative error against the same loss in fp64 (``loss_rel_err``, ``grad_rel_err``: norm of
the difference over norm). On CPU all run in PyTorch, so CPU figures are real measurements (of a CPU), not a smoke
run. ``--providers`` picks some.

With ``--model DIR`` the rows are real instead of random: the (student, teacher) hidden states every KD loss call
of MRP training steps scores (K = 3 unroll, ``--batches`` micro-batches of 8 of the model's held-out stdlib
sequences of 256 tokens; the model needs its head and its ``stdlib_manifest.json``, as the shipped one has), with
its own lm_head; ``rows`` is then their count and ``--rows`` / ``--hidden`` / ``--vocab`` are ignored.

    python benchmarks/bench_kd_loss.py                                  # 1.7B lm_head shape (H 2048, V 151936)
    python benchmarks/bench_kd_loss.py --hidden 256 --rows 256,1024     # what fits a small CPU
    python benchmarks/bench_kd_loss.py --model hf_integration/shipped/sdar-stdlib-mrp --tag shipped
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness

FIELDS = ["rows", "hidden", "vocab", "provider", "median_ms", "peak_mb", "loss_rel_err", "grad_rel_err", "device",
          "torch", "commit"]
# name: (GEMM precision, backend of the per-chunk KL step: None = the default dispatch)
PROVIDERS = {"dense": (None, None), "chunked": ("fp32", None), "chunked_tf32": ("tf32", None),
             "chunked_bf16": ("bf16", None), "chunked_tf32_torch_kl": ("tf32", "reference")}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="256,1024,4096", help="comma-separated scored rows (masked positions)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=3, help="timed calls per provider (after one warm-up)")
    ap.add_argument("--providers", default=",".join(PROVIDERS), help=f"comma-separated, of {', '.join(PROVIDERS)}")
    ap.add_argument("--out", default="benchmarks/results", help="directory for kd_loss_<device>.csv / .json")
    ap.add_argument("--model", default=None, help="score the rows MRP training steps of this model's head score")
    ap.add_argument("--batches", type=int, default=4, help="with --model: micro-batches of 8 sequences recorded")
    ap.add_argument("--tag", default=None, help="results file kd_loss_<device>[_<tag>]")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "provider,rows": one measurement
    ap.add_argument("--rows-file", default=None, help=argparse.SUPPRESS)  # the recorded rows (with --model)
    args = ap.parse_args(argv)
    unknown = sorted(set(args.providers.split(",")) - set(PROVIDERS))
    if unknown:
        ap.error(f"--providers: unknown {unknown}; choose among {', '.join(PROVIDERS)}")
    return args


def record_model_rows(model_dir: str, batches: int, path: str) -> None:
    """Save to ``path`` what the KD loss calls of ``batches`` MRP training steps of ``model_dir``'s head score:
    (student [n, H], teacher [n, H], lm_head weight [V, H], row weights [n]), the calls' rows concatenated."""
    from unittest import mock

    import torch

    sys.path.insert(0, str(_harness.ROOT))
    import training.losses as losses
    from hf_integration import SDARMRPForCausalLM
    from training.config import TrainConfig
    from training.data import build_datasets
    from training.stdlib_corpus import load_manifest, manifest_records
    from training.tokenizer import load_tokenizer
    from training.trainer import LossModule

    model = SDARMRPForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(model_dir)
    held_out = manifest_records(load_manifest(str(Path(model_dir) / "stdlib_manifest.json")))[1]
    data, _ = build_datasets(None, tokenizer, 256, model.config.block_size, records=(held_out, []))
    calls, kd_loss_sum = [], losses.kd_loss_sum

    def spy(student, teacher, weight, row_weights, **kw):
        calls.append((student.detach(), teacher.detach(), row_weights.detach()))
        return kd_loss_sum(student, teacher, weight, row_weights, **kw)

    cfg = TrainConfig(mode="mrp", seq_len=256, block_size=model.config.block_size, unroll_k=3)
    loss_module = LossModule(model, cfg, int(model.config.mask_token_id))
    with mock.patch.object(losses, "kd_loss_sum", spy), torch.no_grad():
        for b in range(batches):
            idx = list(range(8 * b, 8 * b + 8))
            loss_module(data.input_ids[idx], data.is_prompt[idx], idx)
    student, teacher, row_weights = (torch.cat(parts) for parts in zip(*calls))
    torch.save((student, teacher, model.lm_head.weight.detach(), row_weights), path)


def measure(provider: str, n: int, H: int, V: int, reps: int, rows_file: str | None = None) -> dict:
    """Time and peak memory of ``reps`` forward + backward calls of one provider in this process, and its errors
    against fp64; on random rows ([n, H], a bf16 lm_head [V, H]) or on those saved in ``rows_file``."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(_harness.ROOT))
    from mrp_triton import use_backend
    from training.kd_loss import kd_loss_sum

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if rows_file:
        student, teacher, weight, row_weights = (t.to(dev) for t in torch.load(rows_file))
        student.requires_grad_()
    else:
        g = torch.Generator(device=dev).manual_seed(0)
        weight = 0.02 * torch.randn(V, H, generator=g, device=dev, dtype=torch.bfloat16)  # a frozen bf16 lm_head
        teacher = torch.randn(n, H, generator=g, device=dev)
        student = (teacher + 0.1 * torch.randn(n, H, generator=g, device=dev)).requires_grad_()
        row_weights = torch.rand(n, generator=g, device=dev) + 0.5

    def dense():
        with torch.no_grad():
            log_p = F.linear(teacher, weight.float()).log_softmax(-1)
        log_q = F.linear(student, weight.float()).log_softmax(-1)
        loss = ((log_p.exp() * (log_p - log_q)).sum(-1) * row_weights).sum()
        loss.backward()
        return loss

    def chunked():
        precision, backend = PROVIDERS[provider]
        with use_backend(backend) if backend else contextlib.nullcontext():
            loss = kd_loss_sum(student, teacher, weight, row_weights, precision=precision)
        loss.backward()
        return loss

    fn = dense if provider == "dense" else chunked
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for i in range(reps + 1):
        student.grad = None
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    student.grad = None
    loss, grad = fn().detach().double(), student.grad.double()
    exact_student = student.detach().double().requires_grad_()
    exact = kd_loss_sum(exact_student, teacher.double(), weight.double(), row_weights.double())
    exact.backward()
    return {"median_ms": sorted(times)[len(times) // 2], "peak_mb": (peak - base) / 2**20,
            "loss_rel_err": float((loss - exact).abs() / exact.abs()),
            "grad_rel_err": float((grad - exact_student.grad).norm() / exact_student.grad.norm()),
            "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__}


def measure_providers(args, sizes: list[int], source: list[str]) -> list[dict]:
    """Each provider at each number of rows, in a process of its own (``source``: the child's row arguments)."""
    rows = []
    for n in sizes:
        for provider in args.providers.split(","):
            cmd = [sys.executable, __file__, "--child", f"{provider},{n}", "--hidden", str(args.hidden),
                   "--vocab", str(args.vocab), "--reps", str(args.reps), *source]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                print(f"rows={n} {provider}: failed\n{r.stderr[-2000:]}", file=sys.stderr)
                continue
            row = {"rows": n, "hidden": args.hidden, "vocab": args.vocab, "provider": provider,
                   **json.loads(r.stdout.splitlines()[-1]), "commit": _harness.commit()}
            rows.append(row)
            print(f"rows={n:5d} H={args.hidden} V={args.vocab} {provider:12s} {row['median_ms']:9.1f} ms "
                  f"peak +{row['peak_mb']:8.0f} MB  err loss {row['loss_rel_err']:.1e} grad {row['grad_rel_err']:.1e}"
                  f"  ({row['device']})")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        provider, n = args.child.split(",")
        print(json.dumps(measure(provider, int(n), args.hidden, args.vocab, args.reps, args.rows_file)))
        return 0
    if args.model:
        import torch

        with tempfile.TemporaryDirectory() as tmp:
            rows_file = str(Path(tmp) / "rows.pt")
            record_model_rows(args.model, args.batches, rows_file)
            student, _, weight, _ = torch.load(rows_file)
            args.vocab, args.hidden = weight.shape
            rows = measure_providers(args, [student.shape[0]], ["--rows-file", rows_file])
    else:
        rows = measure_providers(args, [int(r) for r in args.rows.split(",")], [])
    if not rows:
        return 1
    stem = "kd_loss_" + ("cuda" if rows[0]["device"] != "cpu" else "cpu") + (f"_{args.tag}" if args.tag else "")
    out = _harness.write_results(args.out, stem, FIELDS, rows, {"args": vars(args), "rows": rows}, float_format=".3g")
    print(f"results in {out}/{stem}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
