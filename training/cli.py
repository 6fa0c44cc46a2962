"""``mrp-train``: train an SDAR backbone from scratch, or an MRP head on a frozen backbone.

    mrp-train backbone --data corpus.jsonl --out runs/tiny --seq-len 256 --block-size 4 \\
        --hidden-size 256 --num-layers 4 --num-heads 4 --num-kv-heads 2 --vocab-size 4096
    mrp-train backbone --stdlib --out runs/stdlib ...          # the CPython stdlib corpus
    mrp-train mrp --model runs/tiny --data sft.jsonl --out runs/tiny-mrp --mrp-layers 3 --unroll-k 2
    mrp-train mrp --model runs/stdlib --stdlib --out runs/stdlib-mrp   # same corpus and split as the backbone
    mrp-train eval --model runs/stdlib-mrp --stdlib --unroll-k 3   # held-out KD loss and draft agreement
    mrp-train draft-vocab --model runs/stdlib-mrp --stdlib --size 512 --out draft_vocab.json   # speculative drafts
    mrp-train mrp --model JetLM/SDAR-1.7B-Chat --data sft.jsonl --out runs/sdar-mrp   # a Hub backbone
    torchrun --nproc_per_node 2 -m training.cli backbone ...    # same flags, DDP

Exit status 2 with a message naming the flag on a bad configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys

import torch

from .config import KD_PRECISIONS, ConfigError, TrainConfig
from .tokenizer import MIN_VOCAB_SIZE


# ``mrp-train eval``'s settings that default to how the head was trained, and their defaults for a head trained
# elsewhere (no training_config.json of an MRP run in its folder).
EVAL_DEFAULTS = {"seq_len": TrainConfig().seq_len, "unroll_k": 3, "mrp_loss": "kd_diff_sum"}


def _common(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    g = p.add_argument_group("data")
    g.add_argument("--data", nargs="+", default=[], metavar="PATH",
                   help="text files, JSONL ({text} | {prompt,response} | {messages}) or folders")
    g.add_argument("--heldout-fraction", type=float, default=None,
                   help="documents (files for --stdlib) held out for evaluation; default 0.01 (0.02 with --stdlib)")
    g.add_argument("--seq-len", type=int, default=d.seq_len,
                   help="tokens per packed sequence (multiple of --block-size)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub repo id (AutoTokenizer)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--out", required=True, help="output folder (checkpoints, metrics.jsonl, final model)")
    g.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size,
                   help="sequences per process per micro-step")
    g.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-steps per optimizer step")
    g.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: --epochs over the data)")
    g.add_argument("--epochs", type=float, default=d.epochs)
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="cosine floor as a fraction of --lr")
    g.add_argument("--warmup-ratio", type=float, default=d.warmup_ratio)
    g.add_argument("--warmup-steps", type=int, default=None, help="overrides --warmup-ratio")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--adam-beta2", type=float, default=d.adam_beta2)
    g.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max grad norm (<= 0: off)")
    g.add_argument("--no-bf16", action="store_true", help="no bf16 autocast on CUDA")
    g.add_argument("--attention", choices=("auto", "flex", "sdpa"), default=d.attention,
                   help="[noisy | clean] attention: compiled FlexAttention with block masks (CUDA only) or SDPA with "
                   "a dense mask; auto: flex on a CUDA GPU from sm_80 on, sdpa elsewhere")
    g.add_argument("--activation-checkpointing", "--gradient-checkpointing", action="store_true",
                   help="keep only each trained decoder layer's input and recompute its activations in the backward "
                   "pass: less memory for a longer sequence or a larger micro-batch, a forward's compute more a step; "
                   "the same steps (a run may resume with or without it)")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK if available, else cpu")
    g = p.add_argument_group("bookkeeping")
    g.add_argument("--log-every", type=int, default=d.log_every)
    g.add_argument("--eval-every", type=int, default=d.eval_every, help="held-out loss every N steps (0: at the end)")
    g.add_argument("--eval-batches", type=int, default=d.eval_batches, help="micro-batches per process per evaluation")
    g.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N steps (0: none)")
    g.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    g.add_argument("--push-to-hub", metavar="REPO_ID", help="when training ends, upload the model folder (not its "
                   "checkpoints) to this Hub repo, created if missing (log in first: hf auth login)")
    g.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")


def _stdlib_args(p: argparse.ArgumentParser, default_manifest: str, writes: bool = True) -> argparse._ArgumentGroup:
    """--stdlib and --stdlib-manifest (``writes``: a training command, which writes the manifest if it is missing)."""
    g = p.add_argument_group("corpus / tokenizer")
    g.add_argument("--stdlib", action="store_true",
                   help="the CPython standard library's .py files (file-level split; see --stdlib-manifest)")
    g.add_argument("--stdlib-manifest", default=None,
                   help=f"{'read (if it exists) or write' if writes else 'read'} this manifest; default "
                   f"{default_manifest}")
    return g


def _kd_precision_arg(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--kd-precision", choices=KD_PRECISIONS, default=TrainConfig().kd_precision,
                   help="the KD loss's lm_head GEMMs: exact fp32, TF32 tensor cores (CUDA; fp32 elsewhere), or bf16 "
                   "inputs with fp32 accumulation; the logits and softmax are fp32 in every case")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mrp-train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    b = sub.add_parser("backbone", help="train an SDAR backbone from scratch",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common(b)
    g = _stdlib_args(b, "OUT/stdlib_manifest.json")
    g.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary when training a tokenizer")
    g = b.add_argument_group("model size")
    g.add_argument("--block-size", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--intermediate-size", type=int, default=None, help="default: 3 x --hidden-size")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--num-heads", type=int, default=4)
    g.add_argument("--num-kv-heads", type=int, default=None, help="default: --num-heads")
    g.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: max(--seq-len, 4096)")
    g.add_argument("--rope-theta", type=float, default=1e6)
    g.add_argument("--tie-word-embeddings", action="store_true")

    m = sub.add_parser("mrp", help="train an MRP head on a frozen backbone",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common(m)
    _stdlib_args(m, "MODEL/stdlib_manifest.json (the backbone's split) if it exists, else OUT/stdlib_manifest.json")
    g = m.add_argument_group("MRP")
    g.add_argument("--model", required=True, help="backbone folder (save_pretrained) or Hub repo id; its tokenizer is "
                   "used unless --tokenizer")
    g.add_argument("--block-size", type=int, default=None, help="default: the model config's block_size")
    g.add_argument("--mrp-layers", type=int, default=None,
                   help=f"D decoder layers of a new head (default {TrainConfig.num_mrp_layers}; a --model with a head "
                   "trains that head on)")
    g.add_argument("--unroll-k", type=int, default=1, help="K successive reveals per sample")
    g.add_argument("--mrp-loss", choices=("kd_diff_sum", "direct"), default="kd_diff_sum")
    _kd_precision_arg(g)
    g.add_argument("--mrp-init", choices=("default", "normal"), default=None,
                   help="a new head's init: 'default' (the model's), or 'normal': N(0, --mrp-init-std) for the head's "
                   "matrices (authors' recipe: 0.2)")
    g.add_argument("--mrp-init-std", type=float, default=0.2)

    e = sub.add_parser("eval", help="held-out KD loss and draft agreement of a model's MRP head (no training)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = e.add_argument_group("data")
    g.add_argument("--data", nargs="+", default=[], metavar="PATH",
                   help="held-out text files, JSONL or folders (all of it is evaluated)")
    g.add_argument("--seq-len", type=int, default=None,
                   help="default: the head's training length (MODEL/training_config.json), else "
                   f"{EVAL_DEFAULTS['seq_len']}")
    g = _stdlib_args(e, "MODEL/stdlib_manifest.json", writes=False)
    g.description = "--stdlib evaluates the manifest's held-out files"
    g = e.add_argument_group("evaluation")
    g.add_argument("--model", required=True, help="a model folder or Hub repo id with an MRP head (its tokenizer "
                   "is used)")
    g.add_argument("--block-size", type=int, default=None, help="default: the model config's block_size")
    g.add_argument("--unroll-k", type=int, default=None, help="K successive reveals: agreement of drafts 1..K; "
                   f"default: the head's training K (MODEL/training_config.json), else {EVAL_DEFAULTS['unroll_k']}")
    g.add_argument("--mrp-loss", choices=("kd_diff_sum", "direct"), default=None,
                   help="how the head chains; default: as it was trained (MODEL/training_config.json), else "
                   f"{EVAL_DEFAULTS['mrp_loss']}")
    _kd_precision_arg(g)
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--eval-batches", type=int, default=16, help="micro-batches to evaluate")
    g.add_argument("--seed", type=int, default=0, help="noise seed")
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu")

    v = sub.add_parser("draft-vocab", help="the most frequent token ids of your data, as a draft vocabulary for "
                       "speculative decoding (generate(draft_vocab=...), mrp-generate --draft-vocab FILE)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = v.add_argument_group("data")
    g.add_argument("--data", nargs="+", default=[], metavar="PATH", help="text files, JSONL or folders (all counted)")
    g = _stdlib_args(v, "MODEL/stdlib_manifest.json", writes=False)
    g.description = "--stdlib counts the manifest's training files"
    g = v.add_argument_group("vocabulary")
    g.add_argument("--model", required=True, help="a model folder or Hub repo id (its tokenizer and config are used)")
    g.add_argument("--size", type=int, required=True, help="token ids to keep (a draft step reads that many lm_head "
                   "rows)")
    g.add_argument("--out", default=None, help="JSON file to write: the sorted list of token ids")
    g.add_argument("--into-generation-config", action="store_true", help="also write the ids as draft_vocab into "
                   "the --model folder's generation_config.json: its speculative calls then draft among them")
    return ap


def _given(args, name: str, default):
    """``args.name`` when the command has the option and it was given, else ``default``."""
    value = getattr(args, name, None)
    return default if value is None else value


def _config(args, block_size: int, argv: list[str]) -> TrainConfig:
    return TrainConfig(
        mode=args.command, out_dir=args.out, seq_len=args.seq_len, block_size=block_size,
        micro_batch_size=args.micro_batch_size, grad_accum=args.grad_accum, max_steps=args.max_steps,
        epochs=args.epochs, lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup_ratio=args.warmup_ratio,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, adam_beta2=args.adam_beta2,
        grad_clip=args.grad_clip, bf16=not args.no_bf16, attention=args.attention,
        activation_checkpointing=args.activation_checkpointing, seed=args.seed,
        log_every=args.log_every, eval_every=args.eval_every, eval_batches=args.eval_batches,
        save_every=args.save_every,
        keep_checkpoints=args.keep_checkpoints, resume=args.resume, progress=not args.no_progress,
        device=args.device,
        unroll_k=getattr(args, "unroll_k", 1), mrp_loss=getattr(args, "mrp_loss", "kd_diff_sum"),
        kd_precision=getattr(args, "kd_precision", TrainConfig().kd_precision),
        num_mrp_layers=_given(args, "mrp_layers", TrainConfig.num_mrp_layers),
        mrp_init=_given(args, "mrp_init", TrainConfig.mrp_init),
        mrp_init_std=getattr(args, "mrp_init_std", 0.2),
        extra={"argv": argv},
    ).validate()


def _export(out_dir: str, tokenizer, cfg: TrainConfig, base_model: str | None = None, repo_id: str | None = None):
    """The run's export: the model folder (weights and remote code, tokenizer, generation config, training config
    and model card; ``base_model``: the Hub repo ``--model`` named, ``repo_id``: the ``--push-to-hub`` repo)."""
    def export(model) -> None:
        from transformers import GenerationConfig

        from .model_card import write_model_card
        from .tokenizer import special_token_ids

        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        ids = special_token_ids(tokenizer)
        # The generation config the model was loaded with (an MRP run's --model folder's: its EOS ids, draft
        # vocabulary or sampling defaults; a new backbone has none of its own), its missing token ids taken from
        # the tokenizer.
        own = model.generation_config
        gen = GenerationConfig() if own._from_model_config else GenerationConfig.from_dict(own.to_dict())
        for name, value in (("bos_token_id", model.config.bos_token_id), ("eos_token_id", ids["eos_token_id"]),
                            ("pad_token_id", ids["pad_token_id"])):
            if getattr(gen, name, None) is None:
                setattr(gen, name, value)
        gen.mask_token_id = ids["mask_token_id"]
        gen.block_size = cfg.block_size
        gen.save_pretrained(out_dir)
        with open(os.path.join(out_dir, "training_config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2)
        write_model_card(out_dir, model.config, cfg.to_dict(), base_model, repo_id)

    return export


def _default_manifest(args, out_dir: str) -> str:
    """An MRP head trains on its backbone's split when the backbone recorded one."""
    if args.command == "mrp" and os.path.exists(os.path.join(args.model, "stdlib_manifest.json")):
        return os.path.join(args.model, "stdlib_manifest.json")
    return os.path.join(out_dir, "stdlib_manifest.json")


# What a model needs from its Hub repo: config, weights, remote code, tokenizer and chat template files.
HUB_FILES = ["*.json", "*.safetensors", "*.py", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def _local_folder(path_or_repo: str, flag: str) -> str:
    """A local folder as it is; otherwise a Hub repo id, fetched into the Hugging Face cache by huggingface_hub
    (offline, ``HF_HUB_OFFLINE=1``: found there), and its snapshot folder returned."""
    if os.path.isdir(path_or_repo):
        return path_or_repo
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path_or_repo, allow_patterns=HUB_FILES)
    except Exception as err:  # a malformed id, no such repo, offline without a cached copy, ...
        raise ConfigError(f"{flag}: {path_or_repo!r} is neither a local folder nor a Hub repo that could be fetched "
                          f"({type(err).__name__}: {err})") from err


def _model_config(model: str) -> dict:
    """The ``--model`` folder's config.json (:class:`ConfigError` when it has none)."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--model: {model!r} is not a model folder (no config.json)")
    with open(path) as f:
        return json.load(f)


def _model_block_size(args) -> int:
    """``--block-size``, else the ``--model`` folder's (4 when its config has none)."""
    config = _model_config(args.model)
    return args.block_size if args.block_size is not None else config.get("block_size") or 4


def _model_records(args, what: str, heldout: bool) -> list[dict]:
    """The records of ``--data``, or with ``--stdlib`` the manifest's held-out or training files (the manifest
    recorded with ``--model`` unless ``--stdlib-manifest``); ``args.model`` becomes a local folder first."""
    from .data import read_records
    from .stdlib_corpus import load_manifest, manifest_records

    if args.stdlib == bool(args.data):
        raise ConfigError(f"give the {what}: --data PATH... or --stdlib")
    args.model = _local_folder(args.model, "--model")
    if args.stdlib:
        path = args.stdlib_manifest or os.path.join(args.model, "stdlib_manifest.json")
        if not os.path.exists(path):
            raise ConfigError(f"--stdlib: no manifest at {path} (a model trained with --stdlib records its file split "
                              "there); pass --stdlib-manifest FILE, or the data with --data")
        train, held = manifest_records(load_manifest(path))
        return held if heldout else train
    return read_records(args.data)


def _eval_defaults(args) -> None:
    """Fill the :data:`EVAL_DEFAULTS` settings ``args`` leaves None from ``args.model``'s training_config.json (the
    MRP run that trained its head, as ``mrp-train mrp`` writes it), else from :data:`EVAL_DEFAULTS`; so evaluating a
    head you trained measures what its training's held-out evaluation measured."""
    path = os.path.join(args.model, "training_config.json")
    trained = {}
    if os.path.exists(path):
        with open(path) as f:
            trained = json.load(f)
        if trained.get("mode") != "mrp":
            trained = {}
    for name, default in EVAL_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, trained.get(name, default))


def run_eval(args) -> dict:
    """``mrp-train eval``: :func:`training.trainer.evaluate` of the model's own MRP head on held-out data; the result
    names the settings it ran with."""
    from .data import build_datasets
    from .models import load_model
    from .tokenizer import load_tokenizer, special_token_ids
    from .trainer import LossModule, evaluate, resolve_device

    records = _model_records(args, "held-out data", heldout=True)
    _eval_defaults(args)
    cfg = TrainConfig(mode="mrp", seq_len=args.seq_len, block_size=_model_block_size(args),
                      micro_batch_size=args.micro_batch_size, eval_batches=args.eval_batches, seed=args.seed,
                      unroll_k=args.unroll_k, mrp_loss=args.mrp_loss, kd_precision=args.kd_precision,
                      progress=False).validate()
    if cfg.eval_batches < 1:
        raise ConfigError(f"--eval-batches must be >= 1, got {cfg.eval_batches}")
    tokenizer = load_tokenizer(args.model, "--model (its tokenizer)")
    data, _ = build_datasets(None, tokenizer, cfg.seq_len, cfg.block_size, records=(records, []))
    device = resolve_device(args.device)
    model = load_model(args.model).to(device).eval()
    if not model.has_mrp:
        raise ConfigError(f"--model: {args.model!r} has no MRP head to evaluate")
    model.config.block_size = cfg.block_size
    mask_id = special_token_ids(tokenizer)["mask_token_id"]
    settings = {"seq_len": cfg.seq_len, "block_size": cfg.block_size, "unroll_k": cfg.unroll_k,
                "mrp_loss": cfg.mrp_loss, "seed": cfg.seed}
    return {"sequences": min(len(data), cfg.eval_batches * cfg.micro_batch_size), **settings,
            **evaluate(LossModule(model, cfg, mask_id), data, cfg, device)}


def run_draft_vocab(args) -> dict:
    """``mrp-train draft-vocab``: the ``--size`` most frequent token ids of the data (without the mask token),
    written to ``--out`` as a JSON list and/or into the model's generation config; reports how much of the counted
    text they cover, and the ids below ``--size`` (what ``draft_vocab=SIZE`` takes) for comparison."""
    from .draft_vocab import coverage, most_frequent_ids, token_counts
    from .tokenizer import load_tokenizer, special_token_ids

    if not args.out and not args.into_generation_config:
        raise ConfigError("say where the ids go: --out FILE and/or --into-generation-config")
    if args.into_generation_config and not os.path.isdir(args.model):
        raise ConfigError(f"--into-generation-config writes into a model folder, and {args.model!r} is not one (a Hub "
                          "repo's cached snapshot is not to be edited): download it with `hf download REPO "
                          "--local-dir DIR` and pass --model DIR")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise ConfigError(f"--out {args.out}: its folder does not exist")
    records = _model_records(args, "data to count", heldout=False)
    vocab_size = _model_config(args.model)["vocab_size"]
    tokenizer = load_tokenizer(args.model, "--model (its tokenizer)")
    counts = token_counts(records, tokenizer)
    if not counts:
        raise ConfigError("--data: no tokens found to count")
    try:
        ids = most_frequent_ids(counts, args.size, vocab_size, exclude=[special_token_ids(tokenizer)["mask_token_id"]])
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if args.out:
        with open(args.out, "w") as f:
            json.dump(ids, f)
    if args.into_generation_config:
        from transformers import GenerationConfig

        try:
            gen = GenerationConfig.from_pretrained(args.model)
        except OSError:  # the folder has none yet
            gen = GenerationConfig()
        gen.draft_vocab = ids
        gen.save_pretrained(args.model)
    return {"out": args.out, "size": len(ids), "tokens_counted": sum(counts.values()),
            "coverage": round(coverage(counts, ids), 4),
            "coverage_ids_below_size": round(coverage(counts, range(args.size)), 4)}


def _backbone_sizes(args: argparse.Namespace) -> dict:
    """The backbone's sizes the flags give (keywords of :func:`.models.build_backbone`), defaults filled in."""
    def given(value, default):
        return default if value is None else value

    return dict(hidden_size=args.hidden_size, intermediate_size=given(args.intermediate_size, 3 * args.hidden_size),
                num_layers=args.num_layers, num_heads=args.num_heads,
                num_kv_heads=given(args.num_kv_heads, args.num_heads), head_dim=args.head_dim)


def run(argv: list[str] | None = None) -> dict:
    """Parse ``argv``, train and export (or evaluate, or count a draft vocabulary). Raises ConfigError on a bad
    configuration."""
    args = build_parser().parse_args(argv)
    if args.command == "eval":
        return run_eval(args)
    if args.command == "draft-vocab":
        return run_draft_vocab(args)
    with _progress_bars(not args.no_progress):
        return run_training(args, sys.argv[1:] if argv is None else list(argv))


@contextlib.contextmanager
def _progress_bars(shown: bool):
    """transformers' progress bars (loading and saving weights) shown or not while the block runs (``--no-progress``
    hides them as it hides the training's own), as they were after."""
    from transformers.utils import logging as hf_logging

    hide = not shown and hf_logging.is_progress_bar_enabled()
    if hide:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hide:
            hf_logging.enable_progress_bar()


def run_training(args, argv: list[str]) -> dict:
    """``mrp-train backbone`` / ``mrp-train mrp``: train and export as ``args`` (parsed from ``argv``, which the
    checkpoints record) say (:func:`run`)."""
    from .data import build_datasets, read_records, record_texts, split_records
    from .hub import check_push, push
    from .tokenizer import load_tokenizer, special_token_ids, train_tokenizer
    from .trainer import barrier, check_device_support, check_out_dir, init_distributed, train

    base_model = None  # the card's: --model when it names a Hub repo
    if args.command == "mrp":
        base_model = None if os.path.isdir(args.model) else args.model
        args.model = _local_folder(args.model, "--model")
    if args.tokenizer is not None:
        args.tokenizer = _local_folder(args.tokenizer, "--tokenizer")
    cfg = _config(args, _model_block_size(args) if args.command == "mrp" else args.block_size, argv)
    if args.private and not args.push_to_hub:
        raise ConfigError("--private goes with --push-to-hub (the repo it creates)")
    positions = _model_config(args.model).get("max_position_embeddings") if args.command == "mrp" else None
    if positions is not None and cfg.seq_len > positions:
        raise ConfigError(f"--seq-len ({cfg.seq_len}) must be <= --model's max_position_embeddings ({positions})")
    if args.push_to_hub:
        check_push(args.push_to_hub)
    if args.stdlib and args.data:
        raise ConfigError("--stdlib and --data are mutually exclusive")
    if not args.data and not args.stdlib:
        raise ConfigError("--data: no training data given (or use --stdlib)")
    if args.command == "backbone":  # before the data is read and a tokenizer trained
        from .models import backbone_head_dim

        sizes = _backbone_sizes(args)
        backbone_head_dim(**sizes)
        if args.tokenizer is None and args.vocab_size < MIN_VOCAB_SIZE:
            raise ConfigError(f"--vocab-size must be >= {MIN_VOCAB_SIZE} (256 bytes + 2 special tokens), got "
                              f"{args.vocab_size}")
        if args.max_position_embeddings is not None and args.max_position_embeddings < cfg.seq_len:
            raise ConfigError(f"--max-position-embeddings ({args.max_position_embeddings}) must be >= --seq-len "
                              f"({cfg.seq_len})")
        if not args.rope_theta > 0:
            raise ConfigError(f"--rope-theta must be > 0, got {args.rope_theta}")

    check_out_dir(cfg.out_dir, cfg.resume)  # before a tokenizer or a manifest is written there
    rank, world, device = init_distributed(cfg.device)
    check_device_support(cfg, device)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)

    # records and their split (every rank reads the same files deterministically)
    if args.stdlib:
        from .stdlib_corpus import build_manifest, load_manifest, manifest_records, write_manifest

        mpath = args.stdlib_manifest or _default_manifest(args, cfg.out_dir)
        if rank == 0 and not os.path.exists(mpath):
            frac = 0.02 if args.heldout_fraction is None else args.heldout_fraction
            write_manifest(mpath, build_manifest(frac, cfg.seed))
        barrier()
        manifest = load_manifest(mpath)
        if args.heldout_fraction is not None and args.heldout_fraction != manifest.get("heldout_fraction"):
            raise ConfigError(f"--heldout-fraction {args.heldout_fraction}: the split comes from {mpath}, which holds "
                              f"out {manifest.get('heldout_fraction')}; drop --heldout-fraction or pass "
                              "--stdlib-manifest NEW_FILE for a new split")
        if rank == 0 and os.path.abspath(mpath) != os.path.abspath(os.path.join(cfg.out_dir, "stdlib_manifest.json")):
            write_manifest(os.path.join(cfg.out_dir, "stdlib_manifest.json"), manifest)  # recorded with the model
        train_r, held_r = manifest_records(manifest)
    else:
        frac = 0.01 if args.heldout_fraction is None else args.heldout_fraction
        train_r, held_r = split_records(read_records(args.data), frac)
    if not train_r:
        raise ConfigError(f"--data: no documents found in {args.data!r}")

    # tokenizer
    if args.command == "mrp":
        tok_dir = args.tokenizer or args.model
        tokenizer = load_tokenizer(tok_dir, "--tokenizer" if args.tokenizer else "--tokenizer (none in --model)")
        vocab = _model_config(args.model)["vocab_size"]
        if len(tokenizer) > vocab:
            raise ConfigError(f"--tokenizer: its {len(tokenizer)} token ids are more than the model's vocabulary "
                              f"({vocab}), whose embeddings would not hold them: give the model's own tokenizer")
    else:
        tok_dir = args.tokenizer
        if tok_dir is None:
            tok_dir = os.path.join(cfg.out_dir, "tokenizer")
            if rank == 0 and not (cfg.resume and os.path.exists(os.path.join(tok_dir, "tokenizer.json"))):
                train_tokenizer(record_texts(train_r), tok_dir, args.vocab_size)
            barrier()
        tokenizer = load_tokenizer(tok_dir)
    ids = special_token_ids(tokenizer)

    train_ds, held_ds = build_datasets(None, tokenizer, cfg.seq_len, cfg.block_size, records=(train_r, held_r))

    if args.command == "backbone":
        from .models import build_backbone

        model = build_backbone(
            ids, len(tokenizer), **sizes, block_size=cfg.block_size,
            max_position_embeddings=args.max_position_embeddings or max(cfg.seq_len, 4096), rope_theta=args.rope_theta,
            tie_word_embeddings=args.tie_word_embeddings).to(device)
    else:
        from .models import prepare_mrp_model

        model, continued = prepare_mrp_model(args.model, args.mrp_layers, args.mrp_init, cfg.mrp_init_std,
                                             block_size=cfg.block_size, device=device)
        if continued:  # what training_config.json and the checkpoints record: the head this run trains
            cfg.num_mrp_layers, cfg.mrp_init = model.config.num_nextn_predict_layers, "continued"
        if int(model.config.mask_token_id) != ids["mask_token_id"]:
            raise ConfigError(f"--tokenizer: its <|MASK|> id {ids['mask_token_id']} differs from the model's "
                              f"mask_token_id {model.config.mask_token_id}")
    result = train(cfg, model, train_ds, held_ds, mask_token_id=ids["mask_token_id"],
                   export=_export(cfg.out_dir, tokenizer, cfg, base_model, args.push_to_hub), device=device)
    if args.push_to_hub and rank == 0:
        result["pushed_to"] = push(cfg.out_dir, args.push_to_hub, args.private,
                                   f"mrp-train {cfg.mode}: step {result['step']}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    try:
        res = run(argv)
    except ConfigError as e:
        parser.exit(2, f"mrp-train: error: {e}\n")
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in res.items() if k != "history"}))


if __name__ == "__main__":
    main()
