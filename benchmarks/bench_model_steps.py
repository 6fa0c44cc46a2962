"""Per-forward cost of the SDAR+MRP model at real shapes: what one decode step pays, and its floor.

The model is the project's own ``hf_integration.SDARMRPForCausalLM`` (random weights, bf16 on CUDA)
at the SDAR-1.7B shape (hidden 2048, ffn 6144, 28 layers, 16 q / 8 kv heads, head_dim 128, vocab
151936) and the SDAR-8B shape (4096, 12288, 36, 32 / 8, 128), with a D=3 MRP head. Every forward
runs through a real ``hf_integration.decoding.BlockDecoder``: its ``StaticKVCache`` holds a committed
prefix of 512 tokens (written once by ``BlockDecoder.commit``, i.e. one backbone forward and one MRP
forward that write their keys/values), and the timed calls are ``BlockDecoder.backbone`` /
``BlockDecoder.mrp``, which build the ``AttentionInputs`` as decoding does.
Block 16, batch 1 and 8. Rows (the ``kernel`` column):

``backbone_denoise``
    (a) one plain denoising backbone forward over q new tokens, q in {16, 64, 128} (q = 16 is one
    block: the forward every strategy pays per step). Output: h_A, no lm_head.
``backbone_verify``
    (b) the verify forward of lossless speculative decoding: K+1 in {2, 3, 4, 5} candidate copies of
    the block in one forward, one attention segment per copy, laid out exactly as
    ``speculation_round`` does (``states.reshape(B, (K+1)*T)``, ``positions.repeat``).
``mrp_head``
    (c) one D=3 MRP head forward over the block (reading its own prefix cache), eager and
    ``torch.compile`` (the compiled function is ``BlockDecoder.mrp`` itself; by default with the ops on
    their PyTorch reference so that Inductor fuses them, ``--compile-ops triton`` keeps the Triton
    kernels). ``ratio`` = MRP forward / the eager one-block backbone forward of the same model and
    batch; the issue's target is <= 0.12 at 1.7B, batch 1.
``weight_read_floor``
    (d) bytes of weights a forward must read once / the device-to-device copy bandwidth measured in
    this run (``copy_bandwidth`` row): the backbone's decoder layers + final norm (the embedding
    gathers only q rows), the same plus the lm_head (a whole denoising step, as in
    ``shared/docs/h200-baselines.md``), and the MRP head.

Columns: kernel, shape, provider, median_us, p20_us, p80_us (``triton.testing.do_bench`` quantiles
[0.5, 0.2, 0.8]), ratio and ratio_to (what the ratio divides by), x_weight_read (median / the weight
floor of what that forward reads), tokens (query tokens per row), GPU name, torch / triton versions,
commit, note. Rows go to ``<out>/model_steps.csv`` and ``.json`` (with the run's settings and checks).

    python benchmarks/bench_model_steps.py --out benchmarks/results    # CUDA
    python benchmarks/bench_model_steps.py --no-compile                # eager only
    python benchmarks/bench_model_steps.py --smoke --out /tmp/ms       # CPU, tiny, seconds

Not yet run on a GPU when written: the estimate for an H200 is 2-4 minutes, most of it the four
torch.compile runs of the MRP head (``--no-compile``: about a minute; ``--models 1.7B`` halves it).
``--compile-mode reduce-overhead`` adds CUDA graphs to the compiled provider.

"eager" means the model as decoding runs it: on CUDA its norms, q/k-norm + RoPE, SwiGLU and MRP input go
through the fused Triton kernels of :mod:`mrp_triton`, the rest is PyTorch (cuBLAS, SDPA).

Without CUDA the script exits with status 2 and a message, unless ``--smoke``: a tiny model in
float32 on CPU on the reference backend, through the same code path (torch.compile with Dynamo's
``eager`` backend, so the tracing is exercised without Inductor); its numbers mean nothing.
(``--smoke`` on a CUDA machine runs the tiny model there, in bf16.)
"""

from __future__ import annotations

import argparse
import gc
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

FIELDS = ["kernel", "shape", "provider", "median_us", "p20_us", "p80_us", "ratio", "ratio_to", "x_weight_read",
          "tokens", "gpu", "torch", "triton", "commit", "note"]

MODELS = {  # name: SDARMRPConfig fields (Qwen3 shapes; Qwen3-1.7B ties its embeddings, 8B does not)
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
SMOKE_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=512, mask_token_id=511, tie_word_embeddings=False)
MRP_TARGET = 0.12  # MRP head forward / one-block backbone forward, 1.7B batch 1 (the goal)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="directory for model_steps.csv / .json")
    ap.add_argument("--models", default="1.7B,8B", help=f"comma-separated, from {list(MODELS)}")
    ap.add_argument("--batches", default="1,8", help="batch sizes")
    ap.add_argument("--prefix", type=int, default=512, help="committed tokens in the KV cache")
    ap.add_argument("--block", type=int, default=16, help="block length (query of one denoising forward)")
    ap.add_argument("--queries", default="16,64,128", help="(a) query lengths of the plain backbone forward")
    ap.add_argument("--copies", default="2,3,4,5", help="(b) K+1 candidate copies in one verify forward")
    ap.add_argument("--mrp-layers", type=int, default=3, help="(c) D, layers of the MRP head")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider of (c)")
    ap.add_argument("--compile-ops", choices=["reference", "triton"], default="reference",
                    help="ops inside the compiled MRP head: the PyTorch reference (Inductor fuses it) or the "
                         "Triton kernels")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode: default, reduce-overhead (CUDA graphs), max-autotune-no-cudagraphs")
    _harness.add_model_bench_args(ap, rep_help="do_bench repetition time, ms (~10 samples at 20 ms)")
    return ap.parse_args(argv)


# --------------------------------------------------------------------------------------- the model
def build_model(shape: dict, mrp_layers: int, block: int, device, dtype):
    """A random-weight ``SDARMRPForCausalLM`` with a ``mrp_layers``-layer MRP head, created directly on
    ``device`` in ``dtype`` (no fp32 copy of an 8B model on the host), in eval mode."""
    import torch

    from hf_integration import SDARMRPConfig, SDARMRPForCausalLM

    config = SDARMRPConfig(**shape, block_size=block, num_nextn_predict_layers=mrp_layers,
                           max_position_embeddings=32768)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = SDARMRPForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype).eval()


def weight_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def make_decoder(model, batch: int, prefix: int, block: int, seed: int, cuda_graphs: bool = False,
                 new_tokens: int | None = None, **settings):
    """A ``BlockDecoder`` (speculative settings, commits not fused, plus ``settings``; forwards eager unless
    ``cuda_graphs``) whose cache holds ``prefix`` committed random tokens per row, written the way decoding writes
    them: ``commit`` = one backbone forward plus one MRP forward over the prefix, each writing its layers'
    keys/values, then ``cache.advance``. Its layout has room for ``new_tokens`` (default one block) after the
    prefix: the positions its forwards may use. With ``cuda_graphs`` it holds the batch bucket's rows (as
    ``generate`` would: 1, 2, 4, 8, 16, 24, ...)."""
    import torch

    from hf_integration.decoding import BlockDecoder
    from hf_integration.generation_settings import GenerationSettings
    from hf_integration.prompts import PromptBatch

    device = model.lm_head.weight.device
    g = torch.Generator(device="cpu").manual_seed(seed)
    top = min(model.config.vocab_size, model.config.mask_token_id)  # prompts never hold the mask token
    ids = torch.randint(0, top, (batch, prefix), generator=g).to(device)
    settings = GenerationSettings.resolve(model, None, dict(max_new_tokens=new_tokens or block, block_length=block,
                                                            strategy="speculative", fuse_commit=False,
                                                            cuda_graphs=cuda_graphs, **settings),
                                       prompt_width=prefix)
    dec = BlockDecoder(model, PromptBatch.from_inputs(model.config, ids, None), settings)
    positions = torch.arange(prefix, device=device).expand(dec.x.shape[0], -1)
    dec.commit(dec.x[:, :prefix], positions, None)
    assert bool((dec.cache.lengths == prefix).all()) and dec.pending is None
    return dec


def query(dec, q: int, seed: int):
    """q new positions right after the prefix: ids [B, q] (mostly mask tokens, some revealed, as mid-block)
    and positions [B, q]."""
    import torch

    B, device = dec.x.shape[0], dec.device
    g = torch.Generator(device="cpu").manual_seed(seed)
    top = min(dec.model.config.vocab_size, dec.mask_id)
    ids = torch.full((B, q), dec.mask_id, dtype=torch.long)
    revealed = torch.rand(B, q, generator=g) < 0.25
    ids[revealed] = torch.randint(0, top, (int(revealed.sum()),), generator=g)
    start = int(dec.cache.lengths[0])  # every row holds the same prefix
    positions = torch.arange(start, start + q, device=device).expand(B, -1)
    return ids.to(device), positions


def verify_inputs(block_ids, positions, copies: int):
    """The verify forward's inputs as ``speculation_round`` builds them from K+1 = ``copies``
    candidate states [B, K+1, T]: copy 0 is the block, copy k has k more positions revealed (k drafts).
    Returns ids [B, (K+1)*T], positions [B, (K+1)*T] and segments [(K+1)*T]."""
    import torch

    B, T = block_ids.shape
    states = block_ids[:, None].repeat(1, copies, 1)
    for k in range(1, copies):
        states[:, k, :k] = torch.arange(1, k + 1, device=block_ids.device)  # any valid, non-mask token ids
    segments = torch.arange(copies, device=block_ids.device).repeat_interleave(T)
    return states.reshape(B, copies * T), positions.repeat(1, copies), segments


# --------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = _harness.cuda_or_smoke("bench_model_steps", args.smoke)
    if cuda is None:
        return 2
    import torch

    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)  # tiny CPU shapes: extra threads only spin (and the CPU may be shared)
    try:
        return run(args, cuda)
    finally:
        torch.set_num_threads(threads)


def run(args, cuda: bool) -> int:
    """Build each model, fill its cache, time (a)-(d), write the results; 1 if a check failed, else 0."""
    import torch

    import mrp_triton

    meta = _harness.run_meta(cuda)
    if not cuda:  # the harness names the CPU path after the interpreter; here the ops run on their reference
        meta["gpu"] = meta["gpu"].replace("cpu-interpreter", "cpu-reference")
    print(f"# {meta}")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.smoke:  # tiny model, same code path
        models, batches, prefix = {"tiny": SMOKE_MODEL}, [1, 2], 32
    else:
        models = {m: MODELS[m] for m in args.models.split(",")}
        batches, prefix = ints(args.batches), args.prefix
    queries, copies_list, T, D = ints(args.queries), ints(args.copies), args.block, args.mrp_layers
    queries = [T] + [q for q in queries if q != T]  # the one-block forward first: every ratio's denominator
    # CPU runs the reference ops (the harness switched the interpreter on for --smoke: keep it out of the way)
    ops = nullcontext() if cuda else mrp_triton.use_backend("reference")
    compile_ops = args.compile_ops if cuda else "reference"
    compile_kw = dict(mode=None if args.compile_mode == "default" else args.compile_mode) if cuda \
        else dict(backend="eager")
    bench = _harness.make_bench(cuda, warmup=args.warmup, rep=args.rep)
    rows: list[dict] = []
    checks: dict[str, float] = {}
    failures: list[str] = []

    def record(kernel, shape, provider, q, tokens="", ratio=None, ratio_to="", floor_us=None, note=""):
        med = q[0]
        row = dict(kernel=kernel, shape=shape, provider=provider, median_us=round(med, 2), p20_us=round(q[1], 2),
                   p80_us=round(q[2], 2), ratio=round(ratio, 4) if ratio is not None else "", ratio_to=ratio_to,
                   x_weight_read=round(med / floor_us, 2) if floor_us else "", tokens=tokens, note=note, **meta)
        rows.append(row)
        print(f"{kernel:18s} {shape:44s} {provider:18s} {med / 1e3:9.3f} ms [{q[1] / 1e3:.3f}, {q[2] / 1e3:.3f}]"
              f"  ratio {row['ratio']!s:>7} {ratio_to:22s} x_read {row['x_weight_read']!s:>6}"
              + (f"  {note}" if note else ""))
        return med

    def finite(name, t):
        if not torch.isfinite(t).all():
            failures.append(f"non-finite output: {name}")
            print(f"FAILED {failures[-1]}")

    # ------------------------------------------------------------ the memory ceiling
    if cuda:
        copy_q, copy_bw = _harness.copy_bandwidth(bench)
        record("copy_bandwidth", "512 MiB device-to-device", "torch_copy", copy_q,
               note=f"{copy_bw / 1e12:.2f} TB/s (read + written)")
    else:
        copy_bw = 1e10  # a nominal 10 GB/s so the smoke run fills every column; not measured
    print(f"# copy bandwidth {copy_bw / 1e12:.3f} TB/s{'' if cuda else ' (nominal, --smoke)'}")

    torch.manual_seed(args.seed)
    with torch.no_grad(), ops:
        for mname, shape in models.items():
            model = build_model(shape, D, T, device, dtype)
            # ------------------------------------------------ (d) weight-read floors
            layers_bytes = weight_bytes(model.model.layers) + weight_bytes(model.model.norm)
            lm_head_bytes = weight_bytes(model.lm_head)
            mrp_bytes = weight_bytes(model.mrp_modules[0])  # layers, eh_proj, norms (no embedding of its own)
            floor = {k: v / copy_bw * 1e6 for k, v in
                     (("backbone", layers_bytes), ("step", layers_bytes + lm_head_bytes), ("mrp", mrp_bytes))}
            for key, nbytes, what in (("backbone", layers_bytes, "backbone layers+norm"),
                                      ("step", layers_bytes + lm_head_bytes, "backbone layers+norm+lm_head"),
                                      ("mrp", mrp_bytes, f"MRP head D={D}")):
                record("weight_read_floor", f"{mname} {what}", "copy_bw_floor", [floor[key]] * 3,
                       note=f"{nbytes / 1e9:.3f} GB at {copy_bw / 1e12:.2f} TB/s")

            for B in batches:
                dec = make_decoder(model, B, prefix, T, args.seed, new_tokens=max(queries))
                tag = f"{mname} B={B}"
                # ------------------------------------------------ (a) plain denoising forwards
                for q in queries:
                    ids, pos = query(dec, q, args.seed + q)
                    h = dec.backbone(ids, pos)
                    finite(f"backbone {tag} q={q}", h)
                    t = bench(lambda: dec.backbone(ids, pos))
                    if q == T:
                        base, block_ids, block_pos, h_a = t[0], ids, pos, h
                    record("backbone_denoise", f"{tag} q={q} prefix={prefix}", "eager", t, tokens=q,
                           ratio=t[0] / base, ratio_to=f"backbone_denoise q={T}", floor_us=floor["backbone"])
                # ------------------------------------------------ (b) verify forwards over K+1 copies
                for c in copies_list:
                    v_ids, v_pos, seg = verify_inputs(block_ids, block_pos, c)
                    h_all = dec.backbone(v_ids, v_pos, seg)
                    finite(f"verify {tag} copies={c}", h_all)
                    # copy 0 is the plain block and sees only the prefix and itself: same h_A as (a)
                    checks[f"verify copy0 vs plain, max abs diff, {tag} copies={c}"] = \
                        float((h_all[:, :T].float() - h_a.float()).abs().max())
                    t = bench(lambda: dec.backbone(v_ids, v_pos, seg))
                    record("backbone_verify", f"{tag} copies={c} q={c * T} prefix={prefix}", "eager", t,
                           tokens=c * T, ratio=t[0] / base, ratio_to=f"backbone_denoise q={T}",
                           floor_us=floor["backbone"])
                # ------------------------------------------------ (c) one MRP head forward
                target = f"target <= {MRP_TARGET}" if (mname, B) == ("1.7B", 1) else ""
                h_p = dec.mrp(block_ids, h_a, block_pos)
                finite(f"mrp {tag}", h_p)
                t = bench(lambda: dec.mrp(block_ids, h_a, block_pos))
                record("mrp_head", f"{tag} D={D} q={T} prefix={prefix}", "eager", t, tokens=T, ratio=t[0] / base,
                       ratio_to=f"backbone_denoise q={T}", floor_us=floor["mrp"], note=target)
                if not args.no_compile:
                    compiled = torch.compile(dec.mrp, **compile_kw)

                    def run_compiled():
                        with mrp_triton.use_backend(compile_ops):
                            return compiled(block_ids, h_a, block_pos)
                    try:
                        got = run_compiled()
                        checks[f"mrp compiled vs eager, max abs diff, {tag}"] = \
                            float((got.float() - h_p.float()).abs().max())
                        t = bench(run_compiled)
                        how = f"ops={args.compile_ops} mode={args.compile_mode}" if cuda else "dynamo eager backend"
                        record("mrp_head", f"{tag} D={D} q={T} prefix={prefix}", "torch_compile", t, tokens=T,
                               ratio=t[0] / base, ratio_to=f"backbone_denoise q={T} (eager)",
                               floor_us=floor["mrp"], note="; ".join(x for x in (how, target) if x))
                    except Exception as e:  # a compile failure is a result too: record it, keep timing the rest
                        failures.append(f"torch.compile of the MRP head failed ({tag}): {type(e).__name__}: "
                                        f"{str(e)[:300]}")
                        print(f"FAILED {failures[-1]}")
                    del compiled
                    torch._dynamo.reset()
                del dec
            del model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()

    for name, value in checks.items():
        print(f"# check: {name} = {value:.3g}")
    stem = "model_steps_smoke" if args.smoke else "model_steps"
    doc = {"meta": {**meta, "copy_bw_tbps": round(copy_bw / 1e12, 3), "dtype": str(dtype).removeprefix("torch."),
                    "models": {m: s for m, s in models.items()}, "batches": batches, "prefix": prefix, "block": T,
                    "queries": queries, "copies": copies_list, "mrp_layers": D,
                    "compile": None if args.no_compile else (compile_kw | {"ops": args.compile_ops})},
           "checks": checks, "failures": failures, "rows": rows}
    out = _harness.write_results(args.out, stem, FIELDS, rows, doc)
    print(f"# wrote {out / stem}.csv and .json ({len(rows)} rows, {len(failures)} failures)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
