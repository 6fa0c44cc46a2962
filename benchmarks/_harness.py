"""Pieces shared by the benchmark scripts.

Typical use, in this order (torch and triton are imported lazily so ``--help`` stays fast, and the
Triton interpreter is switched on before any ``mrp_triton`` kernel is decorated)::

    cuda = _harness.cuda_or_smoke("bench_x", args.smoke)   # None: no GPU and no --smoke, exit 2
    meta = _harness.run_meta(cuda)                         # gpu, torch, triton, commit
    bench = _harness.make_bench(cuda, warmup=10, rep=40)   # fn -> [median, p20, p80] in us
    graph_bench = _harness.make_bench(cuda, warmup=10, rep=40, graph=True)  # replayed from a CUDA graph
    _harness.time_against_eager({"": bench, "_graph": graph_bench}, eager_fn, triton_fn, record, "op")
    q, bw = _harness.copy_bandwidth(bench)                 # the memory ceiling (CUDA only)
    _harness.write_results(out, stem, FIELDS, rows, {...}) # <out>/<stem>.csv and .json
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUANTILES = [0.5, 0.2, 0.8]  # median, p20, p80


def commit() -> str:
    """Short hash of the checked-out commit, with "+changes" when tracked files differ from it (the figures are then
    of a tree no commit holds). Outside a checkout (the device machine gets a copy of the tree without .git) the
    ``MRP_COMMIT`` environment variable its launcher sets (benchmarks/gpu_session.sh), else "unknown"."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).resolve().parent,
                              timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head:
            return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:
        pass
    return os.environ.get("MRP_COMMIT") or "unknown"


def cuda_or_smoke(script: str, smoke: bool) -> bool | None:
    """True with a CUDA device; False for ``--smoke`` without one (sets ``TRITON_INTERPRET=1``, so call
    this before importing ``mrp_triton``); None after printing to stderr why the benchmark cannot run.

    Also puts the repository root on ``sys.path`` so ``import mrp_triton`` finds this checkout.
    """
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not smoke:
        print(f"{script}: no CUDA device found; this benchmark needs a GPU "
              "(run with --smoke for a tiny CPU check through the Triton interpreter)", file=sys.stderr)
        return None
    if smoke and not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before mrp_triton's kernels are decorated
    sys.path.insert(0, str(ROOT))
    return cuda


def run_meta(cuda: bool) -> dict:
    """Columns every result row carries: GPU name (or the CPU interpreter), torch / triton versions, commit."""
    import torch
    import triton

    gpu = torch.cuda.get_device_name(torch.device("cuda")) if cuda \
        else f"cpu-interpreter ({platform.processor() or 'cpu'})"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "commit": commit()}


def add_model_bench_args(ap, rep_help: str = "do_bench repetition time, ms") -> None:
    """The timing, seed and ``--smoke`` options of the model-level benchmarks (bench_model_steps, bench_engine)."""
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=200, help=rep_help)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny float32 model on CPU (reference ops), seconds")


def make_bench(cuda: bool, *, warmup: int, rep: int, graph: bool = False):
    """Return ``bench(fn) -> [median, p20, p80]`` in microseconds.

    CUDA: ``triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=warmup, rep=rep)`` (ms -> us): each call
    from Python timed by CUDA events after an L2 flush, which keeps the GPU busy while the host launches, so a
    one-kernel op shows its GPU time on a cold L2 (not its host launch path); an op of several kernels also shows
    the gaps in which the GPU waits for the host between them.
    ``graph``: ``triton.testing.do_bench_cudagraph`` (``fn`` repeated in one captured CUDA graph, replayed): the
    GPU time alone, what the decode engine pays for the op inside its captured steps; ``fn`` must be capturable
    (a RuntimeError otherwise).
    CPU (--smoke): one warm-up call, then three perf_counter timings (middle, fastest, slowest):
    only to show that the script runs, the numbers mean nothing.
    """
    def bench(fn):
        if cuda:
            import triton.testing

            if graph:
                import torch

                side = torch.cuda.Stream()  # older Tritons refuse to capture on the default stream
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    q = triton.testing.do_bench_cudagraph(fn, rep=rep, quantiles=QUANTILES)
            else:
                q = triton.testing.do_bench(fn, quantiles=QUANTILES, warmup=warmup, rep=rep)
            return [x * 1e3 for x in q]
        return host_timings(fn, 3)

    return bench


def host_timings(fn, reps: int) -> list[float]:
    """[median, fastest, slowest] of ``reps`` perf_counter timings of ``fn`` after one warm-up call, in microseconds
    (host time: what ``fn`` leaves running on a GPU is not waited for)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return [statistics.median(ts), min(ts), max(ts)]


def time_against_eager(benches: dict, eager_fn, triton_fn, record, what: str) -> dict:
    """Time the torch reference ``eager_fn`` and the Triton op ``triton_fn`` with each of ``benches``
    (``{suffix: bench}``, e.g. ``{"": bench, "_graph": graph_bench}``) and ``record(provider, quantiles,
    eager_median)`` the rows ``torch_eager<suffix>`` (eager_median None) and ``triton<suffix>``. A timing that
    fails (an op that cannot be captured) is printed to stderr with ``what`` and skipped; the Triton row is still
    timed when the eager one failed (recorded with eager_median None). Returns ``{suffix: eager median}`` of the
    eager timings that ran."""
    eager = {}
    for suffix, bench in benches.items():
        for provider, fn in (("torch_eager", eager_fn), ("triton", triton_fn)):
            try:
                q = bench(fn)
            except Exception as exc:  # e.g. an op that cannot be captured: report it, the run goes on
                print(f"{what}: timing {provider}{suffix} failed: {exc!r}", file=sys.stderr)
                continue
            record(provider + suffix, q, eager.get(suffix))
            if provider == "torch_eager":
                eager[suffix] = q[0]
    return eager


def copy_bandwidth(bench, nbytes: int = 512 * 2**20) -> tuple[list[float], float]:
    """Time a device-to-device copy of ``nbytes`` (default 512 MiB) on the current CUDA device.

    Returns ``(quantiles_us, bytes_per_s)``, the bandwidth counting bytes read + written (2 * nbytes)
    at the median: the ceiling a memory-bound kernel is compared with.
    """
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    q = bench(lambda: dst.copy_(src))
    del src, dst
    return q, 2 * nbytes / (q[0] * 1e-6)


def write_results(out_dir, stem: str, fields: list[str], rows: list[dict], doc: dict,
                  float_format: str | None = None) -> Path:
    """Write ``rows`` to ``<out_dir>/<stem>.csv`` (columns ``fields``, floats formatted with
    ``float_format`` if given) and ``doc`` to ``<stem>.json``; creates ``out_dir``; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = io.StringIO()
    w = csv.DictWriter(table, fieldnames=fields)
    w.writeheader()
    for r in rows:
        if float_format:
            r = {k: (format(v, float_format) if isinstance(v, float) else v) for k, v in r.items()}
        w.writerow(r)
    write_atomically(out / f"{stem}.csv", table.getvalue())
    write_atomically(out / f"{stem}.json", json.dumps(doc, indent=1))
    return out


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it: a run killed mid-write (a time limit)
    leaves the previous complete file, never a cut one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
