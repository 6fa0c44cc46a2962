"""The MRP distillation loss, forward + backward: chunked (``training.kd_loss.kd_loss_sum``) vs autograd through
the dense formula (fp32 logits of teacher and student, log-softmax, KL), as MRP training computed it before.

Per (rows, provider): the median time of forward + backward over ``--reps`` calls (after one warm-up) and the
peak memory above the inputs: on CUDA ``torch.cuda.max_memory_allocated``, on CPU the peak resident set
(``getrusage``), each (rows, provider) in its own process so one peak does not hide another. Both run in
PyTorch, so CPU figures are real measurements (of a CPU), not a smoke run.

    python benchmarks/bench_kd_loss.py                                  # 1.7B lm_head shape (H 2048, V 151936)
    python benchmarks/bench_kd_loss.py --hidden 256 --rows 256,1024     # what fits a small CPU
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import _harness

FIELDS = ["rows", "hidden", "vocab", "provider", "median_ms", "peak_mb", "device", "torch", "commit"]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="256,1024,4096", help="comma-separated scored rows (masked positions)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=3, help="timed calls per provider (after one warm-up)")
    ap.add_argument("--out", default="benchmarks/results", help="directory for kd_loss_<device>.csv / .json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "provider,rows": one measurement
    return ap.parse_args(argv)


def measure(provider: str, n: int, H: int, V: int, reps: int) -> dict:
    """Time and peak memory of ``reps`` forward + backward calls of one provider in this process."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(_harness.ROOT))
    from training.kd_loss import kd_loss_sum

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    g = torch.Generator(device=dev).manual_seed(0)
    weight = 0.02 * torch.randn(V, H, generator=g, device=dev, dtype=torch.bfloat16)  # a frozen bf16 lm_head
    teacher = torch.randn(n, H, generator=g, device=dev)
    student = (teacher + 0.1 * torch.randn(n, H, generator=g, device=dev)).requires_grad_()
    row_weights = torch.rand(n, generator=g, device=dev) + 0.5

    def dense():
        with torch.no_grad():
            log_p = F.linear(teacher, weight.float()).log_softmax(-1)
        log_q = F.linear(student, weight.float()).log_softmax(-1)
        ((log_p.exp() * (log_p - log_q)).sum(-1) * row_weights).sum().backward()

    def chunked():
        kd_loss_sum(student, teacher, weight, row_weights).backward()

    fn = {"dense": dense, "chunked": chunked}[provider]
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
    return {"median_ms": sorted(times)[len(times) // 2], "peak_mb": (peak - base) / 2**20,
            "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        provider, n = args.child.split(",")
        print(json.dumps(measure(provider, int(n), args.hidden, args.vocab, args.reps)))
        return 0
    rows = []
    for n in (int(r) for r in args.rows.split(",")):
        for provider in ("dense", "chunked"):
            cmd = [sys.executable, __file__, "--child", f"{provider},{n}", "--hidden", str(args.hidden),
                   "--vocab", str(args.vocab), "--reps", str(args.reps)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                print(f"rows={n} {provider}: failed\n{r.stderr[-2000:]}", file=sys.stderr)
                continue
            row = {"rows": n, "hidden": args.hidden, "vocab": args.vocab, "provider": provider,
                   **json.loads(r.stdout.splitlines()[-1]), "commit": _harness.commit()}
            rows.append(row)
            print(f"rows={n:5d} H={args.hidden} V={args.vocab} {provider:8s} {row['median_ms']:9.1f} ms "
                  f"peak +{row['peak_mb']:8.0f} MB  ({row['device']})")
    if not rows:
        return 1
    device = "cuda" if rows[0]["device"] != "cpu" else "cpu"
    out = _harness.write_results(args.out, f"kd_loss_{device}", FIELDS, rows, {"args": vars(args), "rows": rows},
                                 float_format=".1f")
    print(f"results in {out}/kd_loss_{device}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
