"""The GPU decode engine: forwards replayed from CUDA graphs vs eager, and what that makes of decoding.

Random-weight ``SDARMRPForCausalLM`` models at the SDAR-1.7B and 8B shapes (``bench_model_steps.MODELS``,
D=3 MRP head), bf16, block 16. Rows (the ``kernel`` column):

``step``
    One forward through a real ``BlockDecoder`` over a committed prefix of 512 tokens, with the
    decoder's CUDA graphs off (``eager``) and on (``cuda_graph``): the plain denoising step (q=16), the
    verify step over K+1 in {2, 3, 4, 5} candidate copies, one MRP draft step. ``x_weight_read`` =
    median / the time to read the weights that forward reads at the copy bandwidth measured in this run.
    Targets: the plain step at 1.7B batch 1 <= 2.0 ms (2.5x the weight-read floor); a verify step with 4
    copies <= 1.2x a plain step at batch 1.
``whole_step``
    Whole decoding steps as ``generate`` runs them (``BlockDecoder.step``, one graph each with graphs on):
    ``static step`` = the plain forward + LM-head pick + commit + stats; ``speculative round K=3`` = three
    MRP draft steps with their LM-head picks, the verify forward over 4 copies, its picks, verification and
    acceptance. ``ratio`` = over the static step. ``+ commit``: the same step carrying every row's finished
    block in front of its forward (as when the rows of a batch move on to their next block at the same step);
    ``+ commit of one row`` (batch > 1, graphed): only one row's (as when they move on at different steps,
    ``per_row_blocks``: a ragged forward, the other rows' finished positions not computed); ``ratio`` = over the
    step alone.
``unpacked``
    The plain forward and the static whole step again, graphed, with each q/k/v and gate/up projection as a GEMM
    of its own (``packed_projections=False``; decoding packs each group into one GEMM): ``ratio`` = over the
    packed ``cuda_graph`` row, what packing saves.
``draft_vocab=N``
    The graphed speculative round K=3 with drafts choosing among the first N token ids (``draft_vocab``: each
    draft step reads N rows of the lm_head instead of all; N = 32768 of 151936, N = 16 for the smoke model):
    ``ratio`` = over the round with whole-vocabulary drafts. What it does to acceptance is measured on the
    shipped model by ``bench_e2e.py``.
``draft_candidates=16``
    The graphed speculative round K=3 with each draft choosing among the 16 tokens the seed forward found most
    likely at its position (``draft_candidates``: a draft step reads 16 lm_head rows per position; the verify
    forward's LM-head pass also lists them): ``ratio`` = over the round with whole-vocabulary drafts.
``decode``
    Wall clock of ``model.generate(strategy="static")``: random 512-token prompts, 256 new tokens one
    token a step, batch 1, 8 and 32, with ``cuda_graphs=False`` (the eager reference loop) and ``True``.
    The first call (untimed as a repetition) captures the graphs; the timed calls replay them (the engine
    is kept on the model). Its time is the ``first call`` row: what a call of a new shape costs, capture
    included. ``tokens_per_s`` counts new tokens of all rows; ``ratio`` = graphed tokens/s over eager.
    Target: >= 8x.
``host_checks``
    Batch 1: graphed ``generate(strategy="dynamic", threshold=1.0)``, the steps of static one-token-a-step
    decoding (no confidence exceeds 1) with the host checking the row after every step, as dynamic, remask and
    speculative decoding do once a block may be full; ``ratio`` = per-step time over the graphed static step:
    what those checks cost. Where torch captures conditional nodes (>= 2.12; and in ``--smoke``) a second row
    with ``device_loop=True``: the steps after a block's first in one graph, one check per block. And
    ``cuda_graph, lagged reads``: graphed static decoding given an EOS id (the last non-mask id, which random
    weights hardly ever pick; the steps counted are those run), so the host reads after each step, a step late,
    whether the step before left work: ``ratio`` over the graphed static step is what those reads cost.
``attention``
    One layer's attention of a decoding forward at the model's head shapes: ``mrp_triton.cached_attention``
    (Triton: reads each row's committed slots in place) vs its reference (``sdpa_cat``: concatenate the
    cache prefix with the new keys/values, SDPA with the derived mask), T = one block or 4 candidate
    copies, over a cache of width prefix + new tokens with every row committed to the prefix;
    ``triton_one_split``: the kernel with each row's slots in one piece (at small batch the default cuts
    them, flash-decoding style, so more SMs stream the cache).
``prefill``
    A long prompt's prefill as ``generate`` runs it: random ``--prefill-tokens``-token prompts (8192) at batch 1 and
    8, one new token (sequential: one decoding step after the prefill), the prompt's blocks written in one forward
    (``chunk=none``) and in forwards of at most 2048 and 512 positions (``prefill_chunk_size``): the call's time
    (``ratio``: over the one-forward call, what chunking costs) and, on CUDA, its peak allocated memory (``note``:
    what chunking saves). Last, so a time limit cuts these first.
``speculative_estimate``
    Speculative K=3 over static decoding from the graphed whole-step costs of this run and the counts that
    ``bench_e2e.py`` measured on the shipped model (``--e2e``, mode "speculative K=3 mrp"):
    ``tokens * t_static_step / (verify_rounds * t_round + openings * t_static_step)`` (a block's opening
    forward is a static step; openings = backbone_forwards - verify_rounds); a second row with the
    ``draft_candidates=16`` round and the counts of bench_e2e's mode of that name (by default from
    ``e2e_cpu.json`` and ``e2e_cpu_draft_candidates.json``: each mode from the first file that has it; the
    TPF is a property of the model, not of the device). The counts are per row, so
    the estimate is exact at batch 1; at batch > 1 a batch takes about as many steps as its slowest row
    (``batch_steps`` in bench_e2e), some of them carrying other rows' commits (``+ commit`` rows). An
    estimate, labelled so; the end-to-end figure on the shipped model comes from ``bench_e2e.py --device
    cuda``. Target: >= 1.6x.

    python benchmarks/bench_engine.py --out benchmarks/results          # CUDA, about 3 minutes on an H200
    python benchmarks/bench_engine.py --smoke --out /tmp/engine          # CPU, tiny model, seconds

Without CUDA the script exits with status 2, unless ``--smoke``: a tiny float32 model on the reference
ops, where ``cuda_graph`` runs the same fixed-width forwards eagerly; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402
import bench_model_steps as steps  # noqa: E402

FIELDS = ["kernel", "shape", "provider", "median_us", "p20_us", "p80_us", "ratio", "ratio_to", "x_weight_read",
          "tokens_per_s", "gpu", "torch", "triton", "commit", "note"]
PROVIDERS = {"eager": False, "cuda_graph": True}
SPEC_MODE = "speculative K=3 mrp"
CANDIDATES = 16  # draft_candidates of the candidate rows (bench_e2e.py runs the same mode)
CANDIDATES_MODE = f"{SPEC_MODE}, draft_candidates={CANDIDATES}"
DRAFT_VOCAB, SMOKE_DRAFT_VOCAB = 32768, 16  # the draft_vocab rows' (the smoke model has 512 ids)
PREFILL_CHUNKS, SMOKE_PREFILL_CHUNKS = (None, 2048, 512), (None, 16)  # prefill_chunk_size of the prefill rows'
SMOKE_PREFILL_TOKENS = 64


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="directory for engine.csv / .json")
    ap.add_argument("--models", default="1.7B,8B", help=f"comma-separated, from {list(steps.MODELS)}")
    ap.add_argument("--step-batches", default="1,8", help="batch sizes of the per-forward rows")
    ap.add_argument("--decode-batches", default="1,8,32", help="batch sizes of the decoding rows")
    ap.add_argument("--prefix", type=int, default=512, help="prompt / committed tokens")
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens generated per row in the decoding rows")
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="prompt tokens of the prefill rows")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--copies", default="2,3,4,5", help="K+1 candidate copies of the verify rows")
    ap.add_argument("--decode-reps", type=int, default=2, help="timed generate calls per setting (after one warm-up)")
    ap.add_argument("--e2e", nargs="+", default=["benchmarks/results/e2e_cpu.json",
                                                 "benchmarks/results/e2e_cpu_draft_candidates.json"],
                    help="bench_e2e.py results with the shipped model's forward counts (a mode is read from the "
                    "first file that has it)")
    _harness.add_model_bench_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = _harness.cuda_or_smoke("bench_engine", args.smoke)
    if cuda is None:
        return 2
    import torch

    import mrp_triton

    meta = _harness.run_meta(cuda)
    print(f"# {meta}")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.smoke:
        models, step_batches, decode_batches = {"tiny": steps.SMOKE_MODEL}, [1, 2], [1, 2]
        prefix, new_tokens = 32, 16
    else:
        models = {m: steps.MODELS[m] for m in args.models.split(",")}
        step_batches, decode_batches = steps.ints(args.step_batches), steps.ints(args.decode_batches)
        prefix, new_tokens = args.prefix, args.new_tokens
    T, copies_list = args.block, steps.ints(args.copies)
    bench = _harness.make_bench(cuda, warmup=args.warmup, rep=args.rep)
    copy_bw = _harness.copy_bandwidth(bench)[1] if cuda else 1e10  # nominal on CPU: fills the column only
    spec, candidates_spec = (_spec_counts([Path(f) for f in args.e2e], mode) for mode in (SPEC_MODE, CANDIDATES_MODE))
    stem, rows = "engine_smoke" if args.smoke else "engine", []
    doc = {"meta": {**meta, "copy_bw_tbps": round(copy_bw / 1e12, 3), "dtype": str(dtype).removeprefix("torch."),
                    "models": models, "prefix": prefix, "new_tokens": new_tokens, "block": T,
                    "speculative_counts": spec, "candidates_counts": candidates_spec}, "rows": rows}

    def record(kernel, shape, provider, q, ratio=None, ratio_to="", floor_us=None, tokens_per_s="", note=""):
        """Print and save a row at once: a run cut by a time limit keeps the rows it measured."""
        row = dict(kernel=kernel, shape=shape, provider=provider, median_us=round(q[0], 2), p20_us=round(q[1], 2),
                   p80_us=round(q[2], 2), ratio=round(ratio, 4) if ratio is not None else "", ratio_to=ratio_to,
                   x_weight_read=round(q[0] / floor_us, 2) if floor_us else "", note=note,
                   tokens_per_s=round(tokens_per_s, 1) if tokens_per_s != "" else "", **meta)
        rows.append(row)
        _harness.write_results(args.out, stem, FIELDS, rows, doc)
        print(f"{kernel:20s} {shape:34s} {provider:10s} {q[0] / 1e3:9.3f} ms  ratio {row['ratio']!s:>7} "
              f"{ratio_to:24s} x_read {row['x_weight_read']!s:>6} tok/s {row['tokens_per_s']!s:>8}  {note}")
        return q[0]

    ops = nullcontext() if cuda else mrp_triton.use_backend("reference")
    torch.manual_seed(args.seed)
    with torch.no_grad(), ops:
        for mname, shape in models.items():
            model = steps.build_model(shape, 3, T, device, dtype)
            layers = steps.weight_bytes(model.model.layers) + steps.weight_bytes(model.model.norm)
            floor = {"step": (layers + steps.weight_bytes(model.lm_head)) / copy_bw * 1e6,
                     "backbone": layers / copy_bw * 1e6,
                     "mrp": steps.weight_bytes(model.mrp_modules[0]) / copy_bw * 1e6}
            graphed = {}  # batch -> the graphed step costs
            for B in step_batches:
                cost = {}
                for provider, graphs in PROVIDERS.items():
                    cost[provider] = _step_rows(record, bench, model, B, prefix, T, copies_list, graphs, floor,
                                                f"{mname} B={B}", provider, args.seed)
                graphed[B] = c = cost["cuda_graph"]
                c["candidates_round"] = _draft_round_row(
                    record, bench, model, B, prefix, T, f"{mname} B={B}", args.seed, c["round"],
                    draft_candidates=CANDIDATES)
                for provider, counts, round_us in (("cuda_graph", spec, c["round"]),
                                                   (f"draft_candidates={CANDIDATES}", candidates_spec,
                                                    c["candidates_round"])):
                    if counts:
                        _estimate_row(record, f"{mname} B={B} K=3", provider, counts, round_us, c["static_step"])
            for B in decode_batches:  # before the attention rows: a target reads these
                _decode_rows(record, model, B, prefix, new_tokens, T, args.decode_reps, cuda, f"{mname} B={B}",
                             floor["step"], args.seed)
            for B in decode_batches:
                _attention_rows(record, bench, shape, B, prefix, prefix + new_tokens, T, device, dtype,
                                f"{mname} B={B}", args.seed)
            for B in step_batches:  # last: the issues' targets come first when a time limit cuts the run
                _unpacked_rows(record, bench, model, B, prefix, T, floor, f"{mname} B={B}", args.seed, graphed[B])
                _draft_round_row(record, bench, model, B, prefix, T, f"{mname} B={B}", args.seed, graphed[B]["round"],
                                 draft_vocab=DRAFT_VOCAB if cuda else SMOKE_DRAFT_VOCAB)
            for B in step_batches:
                _prefill_rows(record, model, B, SMOKE_PREFILL_TOKENS if args.smoke else args.prefill_tokens, T,
                              args.decode_reps, cuda, f"{mname} B={B}",
                              SMOKE_PREFILL_CHUNKS if args.smoke else PREFILL_CHUNKS, args.seed)
            del model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    print(f"# wrote {Path(args.out) / stem}.csv and .json ({len(rows)} rows)")
    return 0


def _estimate_row(record, shape: str, provider: str, spec: dict, round_us: float, static_us: float) -> None:
    """The speculative_estimate row of a round costing ``round_us`` with the counts ``spec`` (:func:`_spec_counts`):
    against static decoding of the same prompts (its forwards from the same file; the greedy outputs are the same,
    so the ratio of the two times is the tokens/s speedup), and the cost per token the completions keep."""
    openings = spec["backbone_forwards"] - spec["verify_rounds"]
    spent = spec["verify_rounds"] * round_us + openings * static_us
    record("speculative_estimate", shape, provider, [spent / spec["output_tokens"]] * 3,
           ratio=spec["static_forwards"] * static_us / spent, ratio_to="static (graphed whole step)",
           note=f"from {spec['source']} {spec['mode']!r} ({spec['tpf']:.2f} tokens/forward, {spec['verify_rounds']} "
                f"rounds + {openings} openings; static: {spec['static_forwards']} steps); per-row counts: exact at "
                f"B=1; target >= 1.6x")


def _spec_counts(paths: list[Path], mode: str = SPEC_MODE) -> dict | None:
    """Forward counts of speculative K=3 (mrp schedule; bench_e2e's ``mode``) on the shipped model, and of static
    decoding of the same prompts, from the first of the bench_e2e results ``paths`` that has both (and counts the
    tokens the completions keep, ``output_tokens``: files of older runs do not)."""
    found = [(path, rows) for path in paths if path.is_file()
             for rows in [{row["mode"]: row for row in json.loads(path.read_text())["rows"]}]
             if "output_tokens" in rows.get(mode, {}) and "static" in rows]
    if not found:
        print(f"# {mode!r} with output_tokens and a static row is in none of {[str(p) for p in paths]} (rerun "
              "bench_e2e.py): its speculative estimate is skipped")
        return None
    path, rows = found[0]
    row, static = rows[mode], rows["static"]
    keys = ("output_tokens", "backbone_forwards", "verify_rounds", "mrp_forwards", "tpf")
    return {k: row[k] for k in keys} | {"static_forwards": static["backbone_forwards"], "source": path.name,
                                        "mode": mode}


def _step_rows(record, bench, model, B, prefix, T, copies_list, graphs, floor, tag, provider, seed) -> dict:
    """Time the plain, verify and MRP forwards and the whole static step and speculative round of one decoder;
    returns their medians (us)."""
    import torch

    from hf_integration.decoding import PendingCommit

    dec = steps.make_decoder(model, B, prefix, T, seed, cuda_graphs=graphs)
    ids, pos = steps.query(dec, T, seed)
    h_a = dec.backbone(ids, pos)
    plain = record("step", f"{tag} plain q={T}", provider, bench(lambda: dec.backbone(ids, pos)),
                   floor_us=floor["backbone"], note="target <= 2.0 ms" if tag == "1.7B B=1" else "")
    verify = {}
    for c in copies_list:
        v_ids, v_pos, seg = steps.verify_inputs(ids, pos, c)
        q = bench(lambda: dec.backbone(v_ids, v_pos, seg))
        verify[c] = record("step", f"{tag} verify copies={c}", provider, q, ratio=q[0] / plain,
                           ratio_to=f"plain q={T}", floor_us=floor["backbone"],
                           note="target <= 1.2x plain at B=1" if c == 4 else "")
    q = bench(lambda: dec.mrp(ids, h_a, pos))
    mrp = record("step", f"{tag} mrp D=3", provider, q, ratio=q[0] / plain, ratio_to=f"plain q={T}",
                 floor_us=floor["mrp"])
    whole = _whole_steps(dec, ids, pos, h_a)
    static = record("whole_step", f"{tag} static step", provider, _time_step(bench, dec, whole, "denoise"),
                    floor_us=floor["step"])
    q = _time_step(bench, dec, whole, "speculate")
    spec_round_us = record("whole_step", f"{tag} speculative round K={dec.settings.mrp_steps}", provider, q,
                           ratio=q[0] / static, ratio_to="static step")
    # A finished block riding in front, for every row and (graphed: a ragged forward) for one row of the batch;
    # committed for no row, so the cache stays as it is: the same work at every repetition.
    B = ids.shape[0]
    ridings = {"": torch.arange(B, device=ids.device)}
    if B > 1 and graphs:
        ridings[" of one row"] = torch.zeros(1, dtype=torch.long, device=ids.device)
    for name, label, alone in (("denoise", "static step", static),
                               ("speculate", f"speculative round K={dec.settings.mrp_steps}", spec_round_us)):
        for which, riders in ridings.items():
            riding = PendingCommit(ids.clone(), pos + T, False, torch.zeros(B, dtype=torch.bool, device=ids.device),
                                   riders)
            q = _time_step(bench, dec, whole, name, riding)
            record("whole_step", f"{tag} {label} + commit{which}", provider, q, ratio=q[0] / alone, ratio_to=label)
    return {"plain": plain, "verify": verify, "mrp": mrp, "static_step": static, "round": spec_round_us}


def _whole_steps(dec, ids, pos, h_a) -> dict:
    """The decoder's whole steps as ``generate`` runs them, by step name: ``denoise`` (the static step) and
    ``speculate`` (the speculative round; every row mid-block, so it drafts), each (step function, inputs). Whole
    steps commit into the block they are given; their cost does not depend on how many masks are left."""
    import torch

    from hf_integration.decoding import denoising_step
    from hf_integration.mrp_decoding import seed_of, speculation_round

    block, B = ids.clone(), ids.shape[0]
    quota = torch.ones(B, dtype=torch.long, device=ids.device)
    opening = torch.zeros(B, dtype=torch.bool, device=ids.device)
    top_m = dec.settings.draft_candidates or 0  # the seed's candidate lists, as its forward's picks give them
    seed = seed_of(h_a, dec.pick_hidden(h_a, pos, dec.masked(block), dec.counter, top_m=top_m))
    return {"denoise": (denoising_step(dec), (block, pos, quota)),
            "speculate": (speculation_round(dec), (block, pos, seed[0], opening, *seed[1:]))}


def _time_step(bench, dec, whole: dict, name: str, riding: tuple | None = None):
    """``bench`` of the whole step ``name`` of :func:`_whole_steps` (with ``riding``: carrying that pending commit)."""
    fn, inputs = whole[name]

    def run():
        if riding is not None:
            dec.pending = riding
        return dec.step(name, fn, *inputs, mutated=(0,))

    return bench(run)


def _unpacked_rows(record, bench, model, B, prefix, T, floor, tag, seed, packed: dict) -> None:
    """Time the graphed plain forward and static whole step with every projection a GEMM of its own."""
    dec = steps.make_decoder(model, B, prefix, T, seed, cuda_graphs=True, packed_projections=False)
    ids, pos = steps.query(dec, T, seed)
    h_a = dec.backbone(ids, pos)
    q = bench(lambda: dec.backbone(ids, pos))
    record("step", f"{tag} plain q={T}", "unpacked", q, ratio=q[0] / packed["plain"], ratio_to="packed (cuda_graph)",
           floor_us=floor["backbone"])
    q = _time_step(bench, dec, _whole_steps(dec, ids, pos, h_a), "denoise")
    record("whole_step", f"{tag} static step", "unpacked", q, ratio=q[0] / packed["static_step"],
           ratio_to="packed (cuda_graph)", floor_us=floor["step"])


def _draft_round_row(record, bench, model, B, prefix, T, tag, seed, full_round: float, **drafts) -> float:
    """Time the graphed speculative round K=3 with the drafts' tokens chosen by ``drafts`` (one keyword:
    ``draft_vocab`` or ``draft_candidates``); returns its median (us)."""
    dec = steps.make_decoder(model, B, prefix, T, seed, cuda_graphs=True, **drafts)
    ids, pos = steps.query(dec, T, seed)
    q = _time_step(bench, dec, _whole_steps(dec, ids, pos, dec.backbone(ids, pos)), "speculate")
    (name, value), = drafts.items()
    return record("whole_step", f"{tag} speculative round K={dec.settings.mrp_steps}", f"{name}={value}", q,
                  ratio=q[0] / full_round, ratio_to="whole-vocabulary drafts (cuda_graph)")


def _attention_rows(record, bench, shape, B, prefix, width, T, device, dtype, tag, seed) -> None:
    """Time one layer's cached attention, Triton kernel vs reference, for one block and 4 copies of it (and the
    kernel with the committed slots in one piece, ``triton_one_split``)."""
    import torch

    from mrp_triton.cached_attention import cached_attention_triton
    from mrp_triton.reference import cached_attention as attention_reference

    g = torch.Generator().manual_seed(seed)
    Hq, Hkv, D = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    cache_k, cache_v = r(B, Hkv, width, D), r(B, Hkv, width, D)
    lengths = torch.full((B,), prefix, dtype=torch.long, device=device)
    for copies in (1, 4):
        q, k, v = r(B, Hq, copies * T, D), r(B, Hkv, copies * T, D), r(B, Hkv, copies * T, D)
        positions = (prefix + torch.arange(T, device=device)).repeat(copies).expand(B, -1).contiguous()
        segments = torch.arange(copies, device=device).repeat_interleave(T) if copies > 1 else None
        args = (q, k, v, cache_k, cache_v, lengths, positions, T, segments)
        base = bench(lambda: attention_reference(*args))
        record("attention", f"{tag} copies={copies} prefix={prefix}", "sdpa_cat", base)
        t = bench(lambda: cached_attention_triton(*args))
        record("attention", f"{tag} copies={copies} prefix={prefix}", "triton", t, ratio=base[0] / t[0],
               ratio_to="speedup over sdpa_cat")
        t = bench(lambda: cached_attention_triton(*args, splits=1))  # what cutting the committed slots saves
        record("attention", f"{tag} copies={copies} prefix={prefix}", "triton_one_split", t, ratio=base[0] / t[0],
               ratio_to="speedup over sdpa_cat")


def _timed_generate(model, ids, reps: int, cuda: bool, **kwargs):
    """``model.generate(ids, return_dict_in_generate=True, **kwargs)`` once untimed (kernels compiled, allocator
    primed, graphs captured), then ``reps`` times. Returns the last output, the first call's seconds and the
    timed calls' seconds."""
    import torch

    def run():
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, return_dict_in_generate=True, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    out, first = run()
    times = []
    for _ in range(reps):
        out, seconds = run()
        times.append(seconds)
    return out, first, times


def _prefill_rows(record, model, B, prompt, T, reps, cuda, tag, chunks, seed) -> None:
    """The ``prefill`` rows: sequential decoding of one new token after a random ``prompt``-token prompt, the prompt
    written with each ``prefill_chunk_size`` of ``chunks`` (None: one forward); ratio over the first."""
    import torch

    g = torch.Generator().manual_seed(seed)
    top = min(model.config.vocab_size, model.config.mask_token_id)
    ids = torch.randint(0, top, (B, prompt), generator=g).to(model.lm_head.weight.device)
    whole = None
    for chunk in chunks:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        out, _, times = _timed_generate(model, ids, reps, cuda, strategy="sequential", max_new_tokens=1,
                                        block_length=T, eos_token_id=[], prefill_chunk_size=chunk)
        assert out.sequences.shape == (B, prompt + 1)
        q = [statistics.median(times) * 1e6, min(times) * 1e6, max(times) * 1e6]
        whole = whole or q[0]
        record("prefill", f"{tag} prompt {prompt}", f"chunk={chunk or 'none'}", q, ratio=q[0] / whole,
               ratio_to="one forward",
               note=f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated" if cuda else "")


def _per_step(times: list[float], steps: int) -> list[float]:
    """Median, fastest and slowest call over ``steps`` decoding steps, in microseconds."""
    return [statistics.median(times) / steps * 1e6, min(times) / steps * 1e6, max(times) / steps * 1e6]


def _decode_rows(record, model, B, prefix, new_tokens, T, reps, cuda, tag, step_floor, seed) -> None:
    """Time static one-token-a-step ``generate`` with graphs off and on; at batch 1 also the host checks between
    steps (see :func:`_host_check_rows`)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    top = min(model.config.vocab_size, model.config.mask_token_id)
    ids = torch.randint(0, top, (B, prefix), generator=g).to(model.lm_head.weight.device)
    kwargs = dict(max_new_tokens=new_tokens, block_length=T, eos_token_id=[])
    eager_tps = None
    for provider, graphs in PROVIDERS.items():
        out, first, times = _timed_generate(model, ids, reps, cuda, strategy="static", cuda_graphs=graphs, **kwargs)
        if graphs:
            record("decode", f"{tag} static {prefix}+{new_tokens}", "cuda_graph, first call",
                   [first / new_tokens * 1e6] * 3, tokens_per_s=B * new_tokens / first,
                   note="per step, capture included")
        assert out.sequences.shape == (B, prefix + new_tokens)
        tps = B * new_tokens / statistics.median(times)
        eager_tps = eager_tps or tps
        static_step = record("decode", f"{tag} static {prefix}+{new_tokens}", provider, _per_step(times, new_tokens),
                             ratio=tps / eager_tps, ratio_to="eager tokens/s", floor_us=step_floor, tokens_per_s=tps,
                             note="per step; target >= 8x eager" if graphs else "per step")
    if B == 1:  # static_step and out: the graphed call's (the last provider)
        _host_check_rows(record, model, ids, reps, cuda, tag, f"{prefix}+{new_tokens}", static_step, out.batch_steps,
                         **kwargs)


def _host_check_rows(record, model, ids, reps, cuda, tag, lengths, static_step, static_steps, **kwargs) -> None:
    """Graphed static decoding given an EOS id that random weights hardly ever pick: the host reads after each step,
    a step late, whether the step before left work (per step run, over the graphed static step: what those reads
    cost). Graphed dynamic decoding at threshold 1: the steps of static one-token-a-step decoding (no confidence
    exceeds 1), but the host checks the row after every step (a dynamic step may fill the block), so its
    per-step time over the static one's is what those checks cost; with ``device_loop`` (where torch can
    capture conditional nodes) the steps after a block's first run in one graph, one check per block. Shapes:
    ``tag``, the decoding, ``lengths`` (prompt+new tokens)."""
    from hf_integration.step_graphs import conditional_nodes_supported

    config = model.config
    rare = next(i for i in range(config.vocab_size - 1, -1, -1) if i != config.mask_token_id)
    out, _, times = _timed_generate(model, ids, reps, cuda, strategy="static", cuda_graphs=True,
                                    **{**kwargs, "eos_token_id": rare})
    q = _per_step(times, out.batch_steps)
    record("host_checks", f"{tag} static eos={rare} {lengths}", "cuda_graph, lagged reads", q,
           ratio=q[0] / static_step, ratio_to="static step (graphed)",
           tokens_per_s=int(out.new_tokens.sum()) / statistics.median(times),
           note="the host reads after each step whether the step before left work")
    loops = [False] + ([True] if conditional_nodes_supported() or not cuda else [])
    for device_loop in loops:
        out, _, times = _timed_generate(model, ids, reps, cuda, strategy="dynamic", threshold=1.0, cuda_graphs=True,
                                        device_loop=device_loop, **kwargs)
        assert out.batch_steps == static_steps, (out.batch_steps, static_steps)  # one token a step, as static
        q = _per_step(times, static_steps)
        provider = "cuda_graph, device_loop" if device_loop else "cuda_graph"
        record("host_checks", f"{tag} dynamic tau=1 {lengths}", provider, q,
               ratio=q[0] / static_step, ratio_to="static step (graphed)",
               tokens_per_s=kwargs["max_new_tokens"] / statistics.median(times),
               note="one host check a block" if device_loop else "a host check after every step")


if __name__ == "__main__":
    raise SystemExit(main())
