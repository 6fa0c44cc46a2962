"""Benchmark of the decode kernels: confidence (with / without residual), select, verify, remask.

On CUDA: ``python benchmarks/bench_decode_kernels.py --out benchmarks/results`` (about a minute on
an H200; ``--no-compile`` skips torch.compile, ``--sweep`` also times a few split / tile / prefetch configs
of the confidence kernel). Times are ``triton.testing.do_bench`` quantiles [0.5, 0.2, 0.8] in us
(calls from Python after do_bench's L2 flush: a one-kernel op's GPU time on a cold L2, plus, for an eager op of
several kernels, the GPU's waits for the host between them; not the host launch path); the ``*_graph`` providers
are the same calls replayed from a CUDA graph (``do_bench_cudagraph``): the GPU time alone, what the op
costs inside the decode engine's captured steps, which is what the "under 10 us at batch 8" targets of
select, verify and remask are about. GB/s counts bytes read + written once; ``copy_ratio`` = GB/s /
measured device-to-device copy bandwidth (measured in the same run); ``speedup_vs_eager`` compares
like with like (a graph provider with ``torch_eager_graph``). Rows go to ``<out>/decode_kernels.csv``
and ``.json``.

Without CUDA it exits with a message, unless ``--smoke``: tiny shapes through the Triton
interpreter (CPU), timed with perf_counter, to check that the script runs end to end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

FIELDS = ["kernel", "shape", "provider", "median_us", "p20_us", "p80_us", "gbps", "copy_ratio",
          "speedup_vs_eager", "gpu", "torch", "triton", "commit"]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="directory for decode_kernels.csv / .json")
    ap.add_argument("--rows", default="4,16,64,256,1024,4096", help="comma-separated N for confidence")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    ap.add_argument("--sweep", action="store_true", help="also time a few (splits, block_v, prefetch) configs")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run through the Triton interpreter")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    cuda = _harness.cuda_or_smoke("bench_decode_kernels", args.smoke)
    if cuda is None:
        return 2
    import torch

    import mrp_triton as mt
    from mrp_triton import reference as ref

    dev = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        rows, V = [2, 5], 1000
    else:
        rows, V = [int(r) for r in args.rows.split(",")], args.vocab
    meta = _harness.run_meta(cuda)
    gpu = meta["gpu"]
    bench = _harness.make_bench(cuda, warmup=10, rep=40)
    graph_bench = _harness.make_bench(cuda, warmup=10, rep=20, graph=True)

    results = []
    copy_bw = None
    stem = "decode_kernels_smoke" if args.smoke else "decode_kernels"

    def fmt(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    def add(kernel, shape, provider, q, nbytes, eager_med=None):
        """Record a row, save and print it at once (a run cut by a time limit keeps what it measured)."""
        med, p20, p80 = q
        gbps = nbytes / (med * 1e-6) / 1e9 if nbytes else None
        r = dict(kernel=kernel, shape=shape, provider=provider, median_us=med, p20_us=p20, p80_us=p80, gbps=gbps,
                 copy_ratio=(gbps / copy_bw if (gbps and copy_bw) else None),
                 speedup_vs_eager=(eager_med / med if eager_med else None), **meta)
        results.append(r)
        _harness.write_results(args.out, stem, FIELDS, results, {"meta": meta, "copy_gbps": copy_bw, "rows": results},
                               float_format=".4g")
        print(f"{kernel:<18} {shape:<24} {provider:<26} {med:>10.1f} {p20:>9.1f} {p80:>9.1f} "
              f"{fmt(gbps, '8.0f'):>8} {fmt(100 * r['copy_ratio'] if r['copy_ratio'] else None, '6.0f'):>6} "
              f"{fmt(r['speedup_vs_eager'], '8.2f'):>8}", flush=True)

    print(f"# {gpu}  torch {meta['torch']}  triton {meta['triton']}  commit {meta['commit']}")
    print(f"{'kernel':<18} {'shape':<24} {'provider':<26} {'median_us':>10} {'p20':>9} {'p80':>9} "
          f"{'GB/s':>8} {'%copy':>6} {'x eager':>8}")
    if cuda:
        nbytes = 512 * 2**20
        q, bytes_per_s = _harness.copy_bandwidth(bench, nbytes)
        copy_bw = bytes_per_s / 1e9
        add("copy", f"{nbytes // 2**20}MiB", "torch", q, 2 * nbytes)

    def eager_res(L, R):
        return torch.softmax((L + R).float(), dim=-1).max(dim=-1)

    def eager_nores(L):
        return torch.softmax(L.float(), dim=-1).max(dim=-1)

    compiled = {}
    if cuda and not args.no_compile:
        compiled = {"res": torch.compile(eager_res, dynamic=True), "nores": torch.compile(eager_nores, dynamic=True)}

    benches = {"": bench, "_graph": graph_bench}

    def eager_and_triton(kernel, shape, nbytes, eager_fn, triton_fn) -> float | None:
        """Rows of the torch reference and the Triton op, called from Python and replayed from a CUDA graph;
        returns the eager median called from Python."""
        def record(provider, q, eager_med):
            add(kernel, shape, provider, q, nbytes, eager_med)

        return _harness.time_against_eager(benches, eager_fn, triton_fn, record, f"{kernel} {shape}").get("")

    gen = torch.Generator(device=dev).manual_seed(0)
    # select / verify / remask at batch 8, L = 16, K = 3: first (their targets are the issue's; the confidence sweep
    # below is the long part of a run a time limit may cut)
    B, Lb, K, M = 8, 16, 3, 151669
    blk0 = torch.randint(0, 1000, (B, Lb), device=dev, generator=gen)
    blk0[:, Lb // 2:] = M
    tok = torch.randint(0, 1000, (B, Lb), device=dev, generator=gen)
    conf = torch.rand(B, Lb, device=dev, generator=gen)
    ttok = torch.randint(0, 1000, (B, K + 1, Lb), device=dev, generator=gen)
    tconf = torch.rand(B, K + 1, Lb, device=dev, generator=gen)
    dpos = torch.full((B, K), -1, dtype=torch.int64, device=dev)
    dtok = torch.zeros((B, K), dtype=torch.int64, device=dev)
    rev = blk0 == M
    blk = blk0.clone()
    shape = f"B={B},L={Lb},K={K}"
    # thresholds as the decode engine passes them: 0-d device tensors (one captured graph serves every value)
    tau, tau_remask, bound = (torch.tensor(t, dtype=torch.float64, device=dev) for t in (0.9, 0.5, 0.1))
    entropy = conf * 4  # the entropy-bounded rule ranks and sums these instead of conf
    small = {
        "select_static": (lambda: mt.select_commit_triton(blk.copy_(blk0), tok, conf, mask_token_id=M, n=2),
                          lambda: ref.select_commit(blk.copy_(blk0), tok, conf, mask_token_id=M, n=2)),
        "select_dynamic": (lambda: mt.select_commit_triton(blk.copy_(blk0), tok, conf, mask_token_id=M, n=1,
                                                           threshold=tau),
                           lambda: ref.select_commit(blk.copy_(blk0), tok, conf, mask_token_id=M, n=1,
                                                     threshold=tau)),
        "select_entropy": (lambda: mt.select_commit_triton(blk.copy_(blk0), tok, conf, mask_token_id=M, n=1,
                                                           entropy=entropy, entropy_bound=bound),
                           lambda: ref.select_commit(blk.copy_(blk0), tok, conf, mask_token_id=M, n=1,
                                                     entropy=entropy, entropy_bound=bound)),
        "verify": (lambda: mt.verify_drafts_triton(blk.copy_(blk0), dpos, dtok, ttok, tconf, mask_token_id=M),
                   lambda: ref.verify_drafts(blk.copy_(blk0), dpos, dtok, ttok, tconf, mask_token_id=M)),
        "remask_tau": (lambda: mt.remask_triton(blk.copy_(blk0), rev, conf, tau_remask, mask_token_id=M),
                       lambda: ref.remask(blk.copy_(blk0), rev, conf, tau_remask, mask_token_id=M)),
        "remask_delta": (lambda: mt.remask_triton(blk.copy_(blk0), rev, conf, tau_remask, mask_token_id=M,
                                                  rule="delta"),
                         lambda: ref.remask(blk.copy_(blk0), rev, conf, tau_remask, mask_token_id=M, rule="delta")),
    }
    for name, (tfn, rfn) in small.items():
        eager_and_triton(name, shape, 0, rfn, tfn)

    sweeps = []  # (kernel, shape, bytes, eager median, logits, residual): swept after every N's default rows
    for N in rows:
        L = torch.randn(N, V, device=dev, generator=gen).to(torch.bfloat16)
        Rr = torch.randn(N, V, device=dev, generator=gen).to(torch.bfloat16)
        for variant, res in (("res", Rr), ("nores", None)):
            kname = f"confidence_{variant}"
            shape = f"N={N},V={V},bf16"
            nbytes = (2 if res is not None else 1) * N * V * 2 + 16 * N
            e = eager_and_triton(kname, shape, nbytes,
                                 (lambda: eager_res(L, Rr)) if res is not None else (lambda: eager_nores(L)),
                                 lambda: mt.confidence_triton(L, res, mask_token_id=151669 % V))
            if variant in compiled:
                try:
                    c = bench((lambda: compiled["res"](L, Rr)) if res is not None else (lambda: compiled["nores"](L)))
                    add(kname, shape, "torch_compile", c, nbytes, e)
                except Exception as exc:  # keep the run going; report the failure
                    print(f"torch.compile failed for {kname} {shape}: {exc!r}", file=sys.stderr)
            if args.sweep and cuda:
                sweeps.append((kname, shape, nbytes, e, L, res))
        # Sampling among the tokens top-k / top-p / min-p keep (what chat checkpoints ask for), at the N of a decoding
        # step's picks (up to a verify round's at batch 8): the launcher finds each row's cut among its top_k largest
        # effective logits (torch.topk; top-p alone: a sort of the row; min-p: its max; epsilon and eta: a
        # logsumexp and an entropy over the row; top-h: torch.topk of 100), the kernel draws in its
        # pass; eager: the reference (noise over all of V). Then a greedy pick holding two EOS ids back in half the
        # rows (min_new_tokens), a greedy pick under a repetition penalty (8 rows of seen tokens, a tenth of V each,
        # as 8 sequences' blocks read them: one more byte a logit), one under presence / frequency penalties and a
        # logit bias (8 rows of float32 logit offsets read the same way: four more bytes a logit; the bias, one [V]
        # vector every row reads), and one with each row's entropy too (entropy-bounded decoding), against the plain
        # confidence_nores rows.
        if N <= 512:
            keys = torch.randint(0, 2**31, (N, 3), device=dev, generator=gen)
            sampled = dict(do_sample=True, seed=1, noise_keys=keys, mask_token_id=151669 % V)
            eos = torch.zeros(V, dtype=torch.bool, device=dev)
            eos[[151643 % V, 151645 % V]] = True
            banned = dict(mask_token_id=151669 % V, banned_tokens=eos, ban_rows=torch.arange(N, device=dev) % 2 == 0)
            seen = torch.rand(8, V, device=dev, generator=gen) < 0.1
            penalty = dict(mask_token_id=151669 % V, repetition_penalty=1.2, seen_tokens=seen,
                           seen_rows=torch.arange(N, device=dev) % 8)
            offsets = dict(mask_token_id=151669 % V, logit_offsets=-0.5 * seen.float(), logit_bias=seen[0].float(),
                           seen_rows=torch.arange(N, device=dev) % 8)
            for kname, kw in (("confidence_topkp", dict(top_k=50, top_p=0.9, **sampled)),
                              ("confidence_topp", dict(top_p=0.9, **sampled)),
                              ("confidence_minp", dict(min_p=0.05, **sampled)),
                              ("confidence_epsilon_eta", dict(epsilon_cutoff=3e-4, eta_cutoff=2e-3, **sampled)),
                              ("confidence_toph", dict(top_h=0.5, **sampled)),
                              ("confidence_typical", dict(typical_p=0.9, **sampled)),
                              ("confidence_ban", banned),
                              ("confidence_penalty", penalty),
                              ("confidence_offsets", offsets),
                              ("confidence_entropy", dict(mask_token_id=151669 % V, entropy=True))):
                eager_and_triton(kname, f"N={N},V={V},bf16", N * V * 2,
                                 lambda: ref.confidence(L, **kw), lambda: mt.confidence_triton(L, **kw))
        del L, Rr
        if cuda:
            torch.cuda.empty_cache()

    # The tile sweep last: a time limit that cuts the run keeps every N's default rows (the targets' rows), and a
    # config that faults cannot take them with it.
    for kname, shape, nbytes, e, L, res in sweeps:
        for s, bv, nw, pf in ((1, 2048, 8, True), (0, 1024, 4, True), (0, 2048, 8, True), (0, 4096, 8, True),
                              (0, 4096, 16, True), (0, 8192, 16, True), (0, 1024, 4, False), (0, 2048, 8, False)):
            sp = None if s == 0 else s
            try:
                q = bench(lambda: mt.confidence_triton(L, res, splits=sp, block_v=bv, num_warps=nw, prefetch=pf))
                add(kname, shape, f"triton[s={s or 'auto'},bv={bv},w={nw}{'' if pf else ',no prefetch'}]", q,
                    nbytes, e)
            except Exception as exc:
                print(f"sweep config s={s} bv={bv} failed: {exc!r}", file=sys.stderr)
    print(f"wrote {Path(args.out) / (stem + '.csv')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
