"""Benchmark of the MRP-head and backbone building blocks.

(a) ``lm_head_confidence`` (fused lm_head matmul + online softmax, no logits written) vs torch
    ``softmax(h @ W.T).max(-1)`` and vs the time to read the lm_head weight once at the copy
    bandwidth measured in the same run (V=151936, H in {2048, 4096}, N in {1,4,16,64,128}, bf16).
    ``x_weight_read`` = median / that floor (the goal is <= 1.3 for N <= 128). ``triton_fused_skip_half``:
    the same with every other row in ``skip_rows`` (what a decoding step asks: only masked positions are
    scored), against ``triton_fused`` at N/2 rows; ``triton_fused_skip_half_top16``: that call also listing each
    scored row's 16 largest logits (``top_m=16``: what a verify forward asks with ``draft_candidates=16``).
(b) rms_norm (plain and with residual), qk_norm_rope, swiglu and mrp_input at decode shapes of
    SDAR-1.7B (H 2048, 16 q / 8 kv heads, head_dim 128, ffn 6144) and SDAR-8B
    (4096 / 32 / 8 / 128 / 12288), tokens x batch in {16, 64, 128} x {1, 8}: Triton vs eager (the
    reference ops) vs ``torch.compile(reference, dynamic=True)``; eager and Triton also replayed from a CUDA
    graph (``*_graph``: the GPU time alone, what the ops cost inside the decode engine's captured steps; called
    from Python, after do_bench's L2 flush: a one-kernel op's GPU time on a cold L2, plus, for an op of several
    kernels, the GPU's waits for the host between them).
(c) ``training``: forward + backward (autograd, fixed cotangents) of rms_norm (+ residual), qk_norm_rope, swiglu
    and mrp_input at a training micro-batch of each model (8 sequences x 512 tokens, every input and weight
    requiring grad but mrp_input's embedding, frozen in MRP training): the backward kernels vs autograd through
    the reference ops vs ``torch.compile`` of the reference (AOTAutograd's fused backward). GB/s counts the
    forward's bytes plus the backward's (inputs and output gradients read, the gradients autograd asks for
    written; mrp_input's backward also writes the embedding half's input gradient, which a frozen embedding
    does not need: not counted). Then training's attention over ``[noisy | clean]`` (2T queries and keys, block
    16, 8 x 512 and 1 x 4096 tokens): SDPA with the dense mask and the key/value heads repeated (its
    memory-efficient kernel) vs compiled FlexAttention with the block masks (``training.noising.BlockDiffusionMasks``),
    both through ``hf_integration.modeling_sdar.masked_attention`` as training calls it.
(0) ``candidate_confidence`` (first: ``candidates``): a draft step's pick among 16 listed tokens per position
    (``draft_candidates=16``: 16 gathered lm_head rows a row) at N = 16 and 128 rows (batch 1 and 8, one block
    each) of each model's H: Triton (called and graph-replayed) vs its reference, to set against (a)'s
    lm_head_confidence over the whole vocabulary at the same rows.

On CUDA: ``python benchmarks/bench_mrp_head.py --out benchmarks/results`` (about 2 minutes on an
H200, most of it torch.compile; ``--no-compile`` skips that provider, ``--sweep`` also times the
tile configs of ``SWEEP`` for lm_head_confidence, each first checked against the logits, and prints the
best per shape; ``--sweep-rows`` limits the sweep to some N). Every kernel is first
checked against its reference on the GPU (odd shapes, fp32/fp16/bf16); a mismatch is printed and
recorded, timing goes on. Times are ``triton.testing.do_bench`` quantiles [0.5, 0.2, 0.8] in us;
GB/s counts the bytes each op must move once. Rows go to ``<out>/mrp_head.csv`` and ``.json``.

Without CUDA it exits with a message, unless ``--smoke``: tiny shapes through the Triton
interpreter on CPU, timed with perf_counter, only to check that the script runs end to end.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

FIELDS = ["kernel", "shape", "provider", "median_us", "p20_us", "p80_us", "gbps", "x_weight_read",
          "speedup_vs_eager", "gpu", "torch", "triton", "commit", "note"]

MODELS = {  # name: (hidden, q heads, kv heads, head_dim, ffn)
    "1.7B": (2048, 16, 8, 128, 6144),
    "8B": (4096, 32, 8, 128, 12288),
}

# tile configs tried by --sweep (BLOCK_N follows N unless given)
SWEEP = [
    dict(BLOCK_V=128, BLOCK_K=128, num_warps=4, num_stages=4, tiles_per_split=1),
    dict(BLOCK_V=128, BLOCK_K=128, num_warps=8, num_stages=3, tiles_per_split=2),
    dict(BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=4, tiles_per_split=2),
    dict(BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3, tiles_per_split=1),
    dict(BLOCK_V=256, BLOCK_K=64, num_warps=8, num_stages=3, tiles_per_split=1),
    dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=128, num_warps=4, num_stages=4, tiles_per_split=1),
    dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=4, tiles_per_split=2),
    dict(BLOCK_N=64, BLOCK_V=256, BLOCK_K=64, num_warps=8, num_stages=3, tiles_per_split=1),
    # rows on the MMA's M side (rows_major), for 64-128 rows; the 4-warp ones fit two programs per SM
    # (benchmarks/sm90_kernels.py --lm-head-sweep), so one's softmax epilogue may run under the other's loads
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=4, tiles_per_split=1, rows_major=True),
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, num_warps=4, num_stages=3, tiles_per_split=1, rows_major=True),
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=128, num_warps=8, num_stages=3, tiles_per_split=1, rows_major=True),
    dict(BLOCK_N=128, BLOCK_V=64, BLOCK_K=64, num_warps=4, num_stages=4, tiles_per_split=1, rows_major=True),
    dict(BLOCK_N=64, BLOCK_V=256, BLOCK_K=64, num_warps=8, num_stages=3, tiles_per_split=1, rows_major=True),
    dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=64, num_warps=4, num_stages=4, tiles_per_split=1, rows_major=True),
    # the weight tiles through the TMA copy engine (tma), and with flatten the loop over a split's tiles and the
    # K loop inside it pipelined as one loop: the next tile's copies are in flight during this tile's softmax
    # epilogue. 9 tiles of 128 per split: 132 splits of V = 151936, one per SM of an H200.
    dict(BLOCK_N=64, BLOCK_V=256, BLOCK_K=64, num_warps=8, num_stages=3, tiles_per_split=1, tma=True),
    dict(BLOCK_N=64, BLOCK_V=256, BLOCK_K=64, num_warps=8, num_stages=3, tiles_per_split=4, tma=True, flatten=True),
    dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=128, num_warps=4, num_stages=4, tiles_per_split=4, tma=True, flatten=True),
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=4, tiles_per_split=2, tma=True),
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=4, tiles_per_split=9, tma=True, flatten=True),
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=4, tiles_per_split=4, rows_major=True,
         tma=True, flatten=True),
]


CANDIDATES = 16  # listed tokens a position of the candidate_confidence rows (draft_candidates=16)


def _listed(op):
    """``op`` (candidate_confidence, Triton or reference) with the positional arguments of the case table:
    (hidden, weight, ids, rest, seed_hidden, vocab_mean)."""
    return lambda h, w, ids, rest, seed_h, mean: op(h, w, ids, rest, seed_hidden=seed_h, vocab_mean=mean)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="directory for mrp_head.csv / .json")
    ap.add_argument("--rows", default="1,4,16,64,128", help="comma-separated N for lm_head_confidence")
    ap.add_argument("--hidden", default="2048,4096", help="comma-separated H for lm_head_confidence")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--models", default="1.7B,8B", help=f"op-level shapes, from {list(MODELS)}")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP tile configs of lm_head_confidence")
    ap.add_argument("--sweep-rows", default=None, help="comma-separated N to sweep at (default: every N of --rows)")
    ap.add_argument("--only", default="candidates,lm_head,ops,training",
                    help="parts to run: candidates, lm_head, ops, training")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run through the Triton interpreter")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    cuda = _harness.cuda_or_smoke("bench_mrp_head", args.smoke)
    if cuda is None:
        return 2
    import torch

    import mrp_triton as mt
    from hf_integration.modeling_sdar import masked_attention
    from mrp_triton import reference as ref
    from training.noising import BlockDiffusionMasks

    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.bfloat16
    parts = set(args.only.split(","))
    if args.smoke:
        rows, hiddens, V = [1, 5], [64], 1000
        models = {"tiny": (64, 4, 2, 16, 96)}
        seq = [(1, 4), (2, 3)]
        train_seq = (2, 5)
        train_attention, attention_block = [(2, 12)], 4
    else:
        rows, hiddens, V = [int(r) for r in args.rows.split(",")], [int(h) for h in args.hidden.split(",")], args.vocab
        models = {m: MODELS[m] for m in args.models.split(",")}
        seq = [(b, t) for b in (1, 8) for t in (16, 64, 128)]
        train_seq = (8, 512)
        train_attention, attention_block = [(8, 512), (1, 4096)], 16
    sweep_rows = set(rows if args.sweep_rows is None else (int(r) for r in args.sweep_rows.split(",")))
    meta = _harness.run_meta(cuda)
    print(f"# {meta}")
    results: list[dict] = []
    failures: list[str] = []
    stem = "mrp_head_smoke" if args.smoke else "mrp_head"
    doc = {"meta": meta, "failures": failures, "rows": results}  # the copy bandwidth joins meta once measured
    bench = _harness.make_bench(cuda, warmup=5, rep=25)
    graph_bench = _harness.make_bench(cuda, warmup=5, rep=25, graph=True)

    def record(kernel, shape, provider, q, nbytes=None, floor_us=None, eager_us=None, note=""):
        """Print and save a row at once: a run cut by a time limit keeps the rows it measured."""
        med = q[0]
        row = dict(kernel=kernel, shape=shape, provider=provider, median_us=round(med, 2), p20_us=round(q[1], 2),
                   p80_us=round(q[2], 2), gbps=round(nbytes / med / 1e3, 1) if nbytes else "",
                   x_weight_read=round(med / floor_us, 4) if floor_us else "",  # targets.py compares it with 1.3
                   speedup_vs_eager=round(eager_us / med, 2) if eager_us else "", note=note, **meta)
        results.append(row)
        _harness.write_results(args.out, stem, FIELDS, results, doc)
        print(f"{kernel:20s} {shape:34s} {provider:22s} {med:10.1f} us  [{q[1]:.1f}, {q[2]:.1f}]"
              f"  {row['gbps']!s:>8} GB/s  x_read {row['x_weight_read']!s:>5}  vs_eager {row['speedup_vs_eager']!s:>5}"
              + (f"  {note}" if note else ""))
        return med

    def check(name, got, want, atol, rtol):
        try:
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
        except AssertionError as e:
            msg = f"MISMATCH {name}: {str(e).splitlines()[0:3]}"
            print(msg)
            failures.append(msg)

    # ------------------------------------------------------------ copy bandwidth (the ceiling)
    if cuda:
        copy_bw = _harness.copy_bandwidth(bench, 2**29)[1]  # 512 MiB; bytes/s, read + written
        print(f"# device-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + written)")
    else:
        copy_bw = 1e10
    doc["meta"] = {**meta, "copy_bw_tbps": round(copy_bw / 1e12, 3)}

    # ------------------------------------------------------------ correctness on this device
    g = torch.Generator(device=dev).manual_seed(0)
    for wdt in (torch.float32, torch.float16, torch.bfloat16):
        Nv, Hv, Vv = 5, 100, 1003
        h = torch.randint(-2, 3, (Nv, Hv), device=dev, generator=g).to(wdt)
        W = torch.randint(-2, 3, (Vv, Hv), device=dev, generator=g).to(wdt)
        base = torch.randint(-3, 4, (Nv, Vv), device=dev, generator=g).to(torch.bfloat16)
        W[[7, 600, 1000]] = 2
        h[0] = 1
        for skip in (None, torch.tensor([True, False, False, True, False], device=dev)):
            kw = dict(base_logits=base, mask_token_id=7, temperature=0.5, skip_rows=skip)
            out = mt.lm_head_confidence_triton(h, W, **kw)
            exp = ref.lm_head_confidence(h, W, **kw)
            name = f"lm_head_confidence {wdt}{'' if skip is None else ' skip_rows'}"
            if not torch.equal(out[0], exp[0]):
                failures.append(f"MISMATCH {name} tokens: {out[0].tolist()} vs {exp[0].tolist()}")
                print(failures[-1])
            check(f"{name} probs", out[1], exp[1], 1e-5, 1e-4)
            check(f"{name} lse", out[2], exp[2], 1e-4, 1e-5)
            out, exp = (op(h, W, top_m=16, **kw)[3:] for op in (mt.lm_head_confidence_triton, ref.lm_head_confidence))
            if not (torch.equal(out[1], exp[1]) and torch.equal(out[0], exp[0])):  # integer logits: exact
                failures.append(f"MISMATCH {name} top_m=16: {out[1].tolist()} vs {exp[1].tolist()}")
                print(failures[-1])
        if "ops" not in parts:  # the norm / RoPE / SwiGLU / MRP-input kernels' checks go with their timings
            continue
        tol = dict(atol=1e-5, rtol=1e-5) if wdt == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        x = torch.randn(3, 7, 333, device=dev, dtype=wdt)
        r = torch.randn_like(x)
        w = torch.randn(333, device=dev, dtype=wdt)
        y, s = mt.rms_norm_triton(x, w, 1e-6, r)
        ey, es = ref.rms_norm(x, w, 1e-6, r)
        check(f"rms_norm y {wdt}", y, ey, **tol)
        check(f"rms_norm s {wdt}", s, es, **tol)
        gg, uu = torch.randn(5, 3001, device=dev, dtype=wdt), torch.randn(5, 3001, device=dev, dtype=wdt)
        check(f"swiglu {wdt}", mt.swiglu_triton(gg, uu), ref.swiglu(gg, uu), **tol)
        q, k = torch.randn(2, 3, 6, 130, device=dev, dtype=wdt), torch.randn(2, 3, 2, 130, device=dev, dtype=wdt)
        qw, kw_ = torch.randn(130, device=dev, dtype=wdt), torch.randn(130, device=dev, dtype=wdt)
        ang = torch.randn(2, 3, 130, device=dev)
        got = mt.qk_norm_rope_triton(q, k, qw, kw_, ang.cos(), ang.sin(), 1e-6)
        want = ref.qk_norm_rope(q, k, qw, kw_, ang.cos(), ang.sin(), 1e-6)
        rtol_ = dict(tol, atol={torch.float32: 1e-5, torch.float16: 8e-3, torch.bfloat16: 6e-2}[wdt])
        check(f"qk_norm_rope q {wdt}", got[0], want[0], **rtol_)
        check(f"qk_norm_rope k {wdt}", got[1], want[1], **rtol_)
        ids = torch.randint(0, Vv, (9,), device=dev, generator=g)
        hh = torch.randn(9, Hv, device=dev, dtype=wdt)
        check(f"mrp_input {wdt}", mt.mrp_input_triton(ids, W, hh, w[:Hv], w[:Hv], 1e-6),
              ref.mrp_input(ids, W, hh, w[:Hv], w[:Hv], 1e-6), **tol)
    print(f"# device check: {'all kernels match their references' if not failures else f'{len(failures)} MISMATCHES'}")

    # ------------------------------------------------------------ (0) candidate_confidence
    if "candidates" in parts:
        for mname, (H, *_) in models.items():
            W = (torch.randn(V, H, device=dev, generator=g) * 0.02).to(dt)
            mean = W.float().mean(0)
            for B in (1, 8):
                N = B * 16  # a draft step: one block of 16 positions a row
                h, seed_h = (torch.randn(N, H, device=dev, generator=g).to(dt) for _ in range(2))
                ids = torch.randint(0, V, (N, CANDIDATES), device=dev, generator=g)
                rest = torch.randn(N, device=dev, generator=g)
                shape = f"{mname} N={N} H={H} M={CANDIDATES}"
                a = (h, W, ids, rest, seed_h, mean)
                tri, eag = _listed(mt.candidate_confidence_triton), _listed(ref.candidate_confidence)
                got, want = tri(*a), eag(*a)
                check(f"candidate_confidence prob {shape}", got[1], want[1], 1e-5, 1e-4)
                nbytes = (N * CANDIDATES + 2 * N) * H * 2
                _harness.time_against_eager(
                    {"": bench, "_graph": graph_bench}, lambda: eag(*a), lambda: tri(*a),
                    lambda provider, q, eager_us: record("candidate_confidence", shape, provider, q, nbytes,
                                                         eager_us=eager_us), f"candidate_confidence {shape}")
            del W

    # ------------------------------------------------------------ (a) lm_head_confidence
    if "lm_head" in parts:
        def check_picks(name, h, W, z, config=None):
            tok, prob, _ = mt.lm_head_confidence_triton(h, W, config=config)
            check(f"lm_head_confidence prob {name}", prob, torch.softmax(z, -1).max(-1).values, 1e-4, 1e-3)
            check(f"lm_head_confidence picked logit {name}", z.gather(1, tok[:, None]).squeeze(1),
                  z.max(-1).values, 2e-3, 1e-3)

        sweeps = []  # (shape, h, W, z, bytes, floor, eager): swept after every shape's default rows
        for H in hiddens:
            W = (torch.randn(V, H, device=dev, generator=g) * 0.02).to(dt)
            w_bytes = W.numel() * W.element_size()
            floor_us = w_bytes / copy_bw * 1e6
            for N in rows:
                h = torch.randn(N, H, device=dev, generator=g).to(dt)
                shape = f"N={N} H={H} V={V}"
                z = h.float() @ W.float().T
                check_picks(shape, h, W, z)
                nbytes = w_bytes + N * H * 2
                record("lm_head_confidence", shape, "weight_read_floor", [floor_us] * 3, nbytes, floor_us)
                eager = record("lm_head_confidence", shape, "torch_eager",
                               bench(lambda: torch.softmax((h @ W.T).float(), -1).max(-1)), nbytes, floor_us)
                record("lm_head_confidence", shape, "triton_fused",
                       bench(lambda: mt.lm_head_confidence_triton(h, W)), nbytes, floor_us, eager)
                if N >= 2:  # a decoding step scores only its masked positions: here every other row
                    skip = torch.arange(N, device=dev) % 2 == 1
                    record("lm_head_confidence", shape, "triton_fused_skip_half",
                           bench(lambda: mt.lm_head_confidence_triton(h, W, skip_rows=skip)), nbytes, floor_us, eager)
                    # what listing each scored row's top 16 (draft_candidates=16) adds to a verify forward's pass
                    record("lm_head_confidence", shape, "triton_fused_skip_half_top16",
                           bench(lambda: mt.lm_head_confidence_triton(h, W, skip_rows=skip, top_m=16)), nbytes,
                           floor_us, eager)
                if args.sweep and N in sweep_rows:
                    sweeps.append((shape, h, W, z, nbytes, floor_us, eager))
        # The tile sweep last: a time limit that cuts the run keeps every shape's default rows (the target's), and
        # a config that faults (several never ran on a GPU) cannot take them with it.
        for shape, h, W, z, nbytes, floor_us, eager in sweeps:
            best = None
            for i, cfg in enumerate(SWEEP):
                try:
                    check_picks(f"{shape} sweep_{i}", h, W, z, cfg)
                    t = bench(lambda: mt.lm_head_confidence_triton(h, W, config=cfg))
                except Exception as e:  # e.g. out of shared memory for big tiles
                    print(f"  sweep cfg {i} failed: {type(e).__name__}: {str(e)[:100]}")
                    continue
                record("lm_head_confidence", shape, f"sweep_{i}", t, nbytes, floor_us, eager, note=str(cfg))
                if best is None or t[0] < best[0]:
                    best = (t[0], i)
            if best:
                print(f"  best sweep config for {shape}: {best[1]} {SWEEP[best[1]]} at {best[0]:.1f} us")
        del sweeps

    # ------------------------------------------------------------ (b) op-level decode shapes
    if "ops" in parts:
        compiled = {}
        if not args.no_compile and cuda:
            for name, fn in (("rms_norm", ref.rms_norm), ("qk_norm_rope", ref.qk_norm_rope),
                             ("swiglu", ref.swiglu), ("mrp_input", ref.mrp_input)):
                compiled[name] = torch.compile(fn, dynamic=True)
        for mname, (H, Hq, Hkv, D, F) in models.items():
            E = (torch.randn(V, H, device=dev, generator=g) * 0.02).to(dt)
            w_h = torch.rand(H, device=dev, generator=g).to(dt) + 0.5
            w_d = torch.rand(D, device=dev, generator=g).to(dt) + 0.5
            for B, T in seq:
                M = B * T
                x = torch.randn(M, H, device=dev, generator=g).to(dt)
                r = torch.randn(M, H, device=dev, generator=g).to(dt)
                q = torch.randn(B, T, Hq, D, device=dev, generator=g).to(dt)
                k = torch.randn(B, T, Hkv, D, device=dev, generator=g).to(dt)
                ang = torch.randn(B, T, D, device=dev, generator=g)
                cos, sin = ang.cos().to(dt), ang.sin().to(dt)
                gate = torch.randn(M, F, device=dev, generator=g).to(dt)
                up = torch.randn(M, F, device=dev, generator=g).to(dt)
                ids = torch.randint(0, V, (M,), device=dev, generator=g)
                cases = [
                    ("rms_norm", f"{mname} B={B} T={T} H={H}", 2 * M * H * 2,
                     (x, w_h, 1e-6), mt.rms_norm_triton, ref.rms_norm, "rms_norm"),
                    ("rms_norm+residual", f"{mname} B={B} T={T} H={H}", 4 * M * H * 2,
                     (x, w_h, 1e-6, r), mt.rms_norm_triton, ref.rms_norm, "rms_norm"),
                    ("qk_norm_rope", f"{mname} B={B} T={T} {Hq}q/{Hkv}kv D={D}", 2 * M * (Hq + Hkv) * D * 2 + 4 * M * D,
                     (q, k, w_d, w_d, cos, sin, 1e-6), mt.qk_norm_rope_triton, ref.qk_norm_rope, "qk_norm_rope"),
                    ("swiglu", f"{mname} B={B} T={T} F={F}", 3 * M * F * 2,
                     (gate, up), mt.swiglu_triton, ref.swiglu, "swiglu"),
                    ("mrp_input", f"{mname} B={B} T={T} H={H}", 4 * M * H * 2,
                     (ids, E, x, w_h, w_h, 1e-6), mt.mrp_input_triton, ref.mrp_input, "mrp_input"),
                ]
                for kernel, shape, nbytes, a, tri, eag, cname in cases:
                    got, want = tri(*a), eag(*a)
                    for gg_, ww_ in zip(got if isinstance(got, tuple) else (got,),
                                        want if isinstance(want, tuple) else (want,)):
                        check(f"{kernel} {shape}", gg_.float(), ww_.float(), 6e-2, 2e-2)
                    eager = _harness.time_against_eager(
                        {"": bench, "_graph": graph_bench}, lambda: eag(*a), lambda: tri(*a),
                        lambda provider, q, eager_us: record(kernel, shape, provider, q, nbytes, eager_us=eager_us),
                        f"{kernel} {shape}").get("")
                    if cname in compiled:
                        try:
                            record(kernel, shape, "torch_compile", bench(lambda: compiled[cname](*a)), nbytes,
                                   eager_us=eager)
                        except Exception as e:
                            print(f"  torch.compile failed for {kernel}: {type(e).__name__}: {str(e)[:200]}")
                            compiled.pop(cname)
            del E

    # ------------------------------------------------------------ (c) training: forward + backward
    if "training" in parts:
        for mname, (H, Hq, Hkv, D, F) in models.items():
            B, T = train_seq
            M = B * T

            def leaf(*shape, scale=1.0):
                return (torch.randn(*shape, device=dev, generator=g) * scale).to(dt).requires_grad_()

            E = (torch.randn(V, H, device=dev, generator=g) * 0.02).to(dt)
            ang = torch.randn(B, T, D, device=dev, generator=g)
            cases = [  # kernel, shape, inputs, op, bytes of the forward and backward together
                ("rms_norm+residual", f"{mname} B={B} T={T} H={H}", (leaf(M, H), leaf(H), 1e-6, leaf(M, H)),
                 mt.rms_norm, (4 + 4) * M * H * 2),
                ("qk_norm_rope", f"{mname} B={B} T={T} {Hq}q/{Hkv}kv D={D}",
                 (leaf(B, T, Hq, D), leaf(B, T, Hkv, D), leaf(D), leaf(D), ang.cos(), ang.sin(), 1e-6),
                 mt.qk_norm_rope, (2 + 3) * M * (Hq + Hkv) * D * 2 + 2 * 2 * 4 * M * D),
                ("swiglu", f"{mname} B={B} T={T} F={F}", (leaf(M, F), leaf(M, F)), mt.swiglu, (3 + 5) * M * F * 2),
                ("mrp_input", f"{mname} B={B} T={T} H={H}",
                 (torch.randint(0, V, (M,), device=dev, generator=g), E, leaf(M, H), leaf(H), leaf(H), 1e-6),
                 mt.mrp_input, (4 + 5) * M * H * 2),
            ]
            for kernel, shape, a, op, nbytes in cases:
                grads_of = [t for t in a if isinstance(t, torch.Tensor) and t.requires_grad]
                outs = op(*a)
                cotangents = [torch.randn_like(o) for o in (outs if isinstance(outs, tuple) else (outs,))]

                def fwd_bwd(fn, op=op, a=a, grads_of=grads_of, cotangents=cotangents):
                    def run():
                        out = fn(*a)
                        return torch.autograd.grad(out if isinstance(out, tuple) else (out,), grads_of, cotangents)
                    return run

                def on(backend, op=op):
                    def call(*a):
                        with mt.use_backend(backend):
                            return op(*a)
                    return call

                got, want = fwd_bwd(on("triton"))(), fwd_bwd(on("reference"))()
                for i, (gg_, ww_) in enumerate(zip(got, want)):
                    scale = float(ww_.float().abs().max())
                    check(f"{kernel} backward {shape} grad {i}", gg_.float(), ww_.float(), 5e-2 * max(scale, 1.0), 5e-2)
                tkernel = f"{kernel} fwd+bwd"
                eager = record(tkernel, shape, "torch_eager", bench(fwd_bwd(on("reference"))), nbytes)
                record(tkernel, shape, "triton", bench(fwd_bwd(on("triton"))), nbytes, eager_us=eager)
                if not args.no_compile and cuda:
                    try:
                        compiled_op = torch.compile(on("reference"), dynamic=False)
                        record(tkernel, shape, "torch_compile", bench(fwd_bwd(compiled_op)), nbytes, eager_us=eager)
                    except Exception as e:
                        print(f"  torch.compile failed for {tkernel}: {type(e).__name__}: {str(e)[:200]}")
            del E
            for B, T in train_attention:
                shape = f"{mname} B={B} 2T={2 * T} {Hq}q/{Hkv}kv D={D} block={attention_block}"
                torch._dynamo.reset()  # each shape compiled as a training run's first (static) one
                q, k, v = (leaf(B, h, 2 * T, D).requires_grad_(cuda) for h in (Hq, Hkv, Hkv))
                cotangent = torch.randn_like(q)
                masks = {flex: BlockDiffusionMasks.build(T, attention_block, dev, flex).full for flex in (False, True)}

                def attend(flex, q=q, k=k, v=v, cotangent=cotangent, masks=masks):
                    def run():
                        if not cuda:  # FlexAttention has no CPU backward: the smoke run times the forward
                            with warnings.catch_warnings():
                                warnings.simplefilter("ignore")  # "called without torch.compile"
                                return (masked_attention(q, k, v, masks[flex], expand_kv=True),)
                        return torch.autograd.grad(masked_attention(q, k, v, masks[flex], expand_kv=True), (q, k, v),
                                                   cotangent)
                    return run

                for i, (got, want) in enumerate(zip(attend(True)(), attend(False)())):
                    check(f"attention {shape} {'grad ' + 'qkv'[i] if cuda else 'output'}", got.float(), want.float(),
                          2e-2, 2e-2)
                kernel = "attention fwd+bwd" if cuda else "attention fwd"
                eager = record(kernel, shape, "sdpa_dense_mask", bench(attend(False)))
                record(kernel, shape, "flex_block_mask", bench(attend(True)), eager_us=eager,
                       note="compiled flex_attention; the mask lets a query see about a quarter of the keys")

    out = _harness.write_results(args.out, stem, FIELDS, results, doc)
    print(f"# wrote {out / stem}.csv and .json ({len(results)} rows, {len(failures)} mismatches)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
