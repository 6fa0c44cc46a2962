"""``mrp-generate``: complete a prompt with an SDAR+MRP checkpoint (by default the small model shipped here).

Examples::

    mrp-generate "def fibonacci(n):"                     # speculative MRP decoding, K = 3
    mrp-generate --prompt-file snippet.py --strategy remask --threshold 0.5
    mrp-generate "import os" --compare                  # every strategy on one prompt, as a table
    mrp-generate "import os" --show-steps               # then which tokens each decoding step revealed, how sure
    mrp-generate "def add(a, b):" --stop $'\\n\\n'       # stop at the first blank line
    mrp-generate --model JetLM/SDAR-1.7B-Chat --strategy dynamic --chat "Name three sorting algorithms."
    mrp-generate --model JetLM/SDAR-1.7B-Chat --chat --prompts questions.jsonl --output answers.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from transformers import TextStreamer

from mrp_triton.backend import before_ampere

from .cli_prompts import UsageError, chat_ids, left_padded, read_prompt_records, user_turn
from .generation_settings import DRAFT_SCHEDULES, MRP_STRATEGIES, READ_BY, REMASK_RULES, STRATEGIES, GenerationSettings
from .prompts import PromptBatch

SHIPPED_MODEL = Path(__file__).resolve().parent / "shipped" / "sdar-stdlib-mrp"
BATCH_SIZE = 8  # --prompts: prompts decoded together
SEEDS = 2**64  # the seeds generate() takes: record r (turn t) samples with (--seed + r) mod SEEDS
OUTPUT_KEYS = ("completion", "stats", "sample")  # what --prompts adds to each record (sample: with samples)
COMPARE = [
    ("static", {}),
    ("dynamic", {"threshold": 0.7}),
    ("sequential", {}),
    ("entropy_bounded", {}),
    ("direct", {"mrp_steps": 2}),
    ("speculative", {"mrp_steps": 3}),
    ("remask", {"threshold": 0.5}),
]


def draft_vocab_arg(value: str) -> int | list[int]:
    """``--draft-vocab``: an int N, or a JSON file holding a list of token ids."""
    if value.isdigit():
        return int(value)
    try:
        with open(value) as f:
            ids = json.load(f)
    except (OSError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"neither a number of ids nor a readable JSON list of ids: {err}") from err
    if not isinstance(ids, list):
        raise argparse.ArgumentTypeError(f"{value} must hold a JSON list of token ids, got {type(ids).__name__}")
    return ids


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds an option's default to its help where it has one (not None or False: those leave the choice to
    generate(), or are flags)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mrp-generate", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("prompt", nargs="?", help="prompt text (or use --prompt-file or --prompts)")
    p.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    p.add_argument("--prompts", type=Path, metavar="JSONL", help="complete every prompt of this file, a batch at a "
                   "time, and write one JSON line a prompt: its record with the completion and its stats (records: "
                   "{\"prompt\": ...}, {\"messages\": [...]} or {\"text\": ...}; other keys are kept)")
    p.add_argument("--interactive", "-i", action="store_true", help="read prompts from standard input, one a line "
                   "(end a line with \\ to go on on the next), and complete each; with --chat a conversation: each "
                   "message continues it (/reset forgets it, /exit or the end of input quits)")
    p.add_argument("--output", type=Path, metavar="JSONL", help="with --prompts: write the results to this file "
                   "(default: standard output)")
    p.add_argument("--batch-size", type=int, metavar="N", help="with --prompts: prompts decoded together (default: "
                   f"{BATCH_SIZE})")
    p.add_argument("--num-return-sequences", type=int, metavar="N", help="with --prompts and --do-sample: N samples "
                   "of each prompt, one JSON line each with its number (\"sample\": 0..N-1), as pass@k evaluations "
                   "read them")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the tokenizer's "
                   "chat template (chat checkpoints such as SDAR-*-Chat)")
    p.add_argument("--system", help="a system message before the prompt (with --chat)")
    p.add_argument("--seed", type=int, default=0, help="with --do-sample: the seed of the sampling noise")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop once the completion holds TEXT (repeatable; e.g. --stop $'\\n\\n')")
    p.add_argument("--max-time", type=float, metavar="SECONDS",
                   help="end the completion with the block being decoded once this much time has passed (with "
                   "--prompts: since its batch began)")
    p.add_argument("--compare", action="store_true", help="run static, dynamic, sequential, entropy_bounded, direct, "
                   "speculative and remask (the first four on a model without an MRP head) and print each completion "
                   "that differs from static's")
    p.add_argument("--show-steps", action="store_true", help="after the completion, list each decoding step's "
                   "tokens, each with its probability when committed: the order in which decoding revealed them "
                   "(generate(output_reveal_steps=True, output_confidences=True))")
    add_model_options(p)
    add_decoding_options(p)
    return p


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The options saying what to load and where to run it: ``--model``, ``--device``, ``--dtype``, ``--threads``
    (shared with ``mrp-serve``)."""
    p.add_argument("--model", default=str(SHIPPED_MODEL), help="checkpoint folder or Hub repo id")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where to decode")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU, "
                   "bfloat16 on a GPU with bf16 units (NVIDIA sm_80 and newer, AMD's), float16 on an older one (T4)")
    p.add_argument("--threads", type=int, help="CPU threads torch runs on (default: torch's, one a core); a small "
                   "model on a busy machine can decode many times faster on 1")


def add_decoding_options(p: argparse.ArgumentParser) -> None:
    """The options saying how to decode (the strategy, its settings, sampling; :func:`decoding_settings` reads them;
    shared with ``mrp-serve``, where they are the defaults of its requests)."""
    p.add_argument("--strategy", choices=STRATEGIES, help="decoding mode (docs/decoding.md; default: "
                   "speculative, or static for a model without an MRP head)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to decode")
    p.add_argument("--min-new-tokens", type=int, metavar="N", help="hold EOS back at the first N new tokens, so the "
                   "completion ends no sooner")
    p.add_argument("--block-length", type=int, help="default: the model's block size")
    p.add_argument("--denoising-steps", type=int, help="static / dynamic / sequential / entropy_bounded / remask: "
                   "steps a block takes at most "
                   "(default: the block length, one token a step)")
    p.add_argument("--threshold", type=float, help="dynamic / remask confidence threshold in (0, 1]")
    p.add_argument("--entropy-bound", type=float, metavar="NATS", help="entropy_bounded: the entropy a step's run of "
                   "commits may sum to, its largest left out (default 0.1)")
    p.add_argument("--mrp-steps", "-K", type=int, help="direct / speculative: MRP steps (drafts) per backbone forward "
                   "(default: 3)")
    p.add_argument("--draft-schedule", choices=DRAFT_SCHEDULES, help="speculative (default: mrp)")
    p.add_argument("--draft-vocab", type=draft_vocab_arg, metavar="N|FILE",
                   help="speculative drafts choose among the token ids below N, or those listed in a JSON FILE "
                   "(mrp-train draft-vocab); the output stays lossless")
    p.add_argument("--draft-candidates", type=int, metavar="M",
                   help="speculative drafts choose among the M tokens the round's seed forward found most likely at "
                   "each position (1-64); the output stays lossless")
    p.add_argument("--remask-rule", choices=REMASK_RULES, help="remask (default: tau)")
    p.add_argument("--residual-delta", type=float, help="remask rule delta (default: 1.0)")
    p.add_argument("--repetition-penalty", type=float, help="scale down the logits of the tokens the text already "
                   "holds by this factor (transformers' repetition penalty; > 1 discourages repeats, 1: none)")
    p.add_argument("--presence-penalty", type=float, help="subtract this from the logits of the tokens already "
                   "generated (OpenAI's presence penalty; > 0 discourages repeats, 0: none)")
    p.add_argument("--frequency-penalty", type=float, help="subtract this from the logits of the tokens already "
                   "generated, once per time each was (OpenAI's frequency penalty; > 0 discourages repeats, 0: none)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="with --do-sample: divides the logits")
    p.add_argument("--top-h", type=float, help="with --do-sample: among the 100 most likely tokens, sample among the "
                   "most likely ones holding this fraction of their entropy (top-h, in (0, 1])")
    p.add_argument("--top-k", type=int, help="with --do-sample: sample among the k largest logits"
                   " (ties at the cut kept)")
    p.add_argument("--top-p", type=float, help="with --do-sample: sample among the most likely tokens holding mass p")
    p.add_argument("--min-p", type=float, help="with --do-sample: sample among the tokens at least p times as likely "
                   "as the most likely one")
    p.add_argument("--typical-p", type=float, help="with --do-sample: typical sampling, among the tokens whose "
                   "surprise lies nearest the entropy, holding mass p (in (0, 1])")
    p.add_argument("--epsilon-cutoff", type=float, help="with --do-sample: leave out the tokens less likely than this "
                   "(epsilon sampling, in [0, 1))")
    p.add_argument("--eta-cutoff", type=float, help="with --do-sample: eta sampling's cutoff (in [0, 1)), which "
                   "lowers the floor of epsilon sampling where the distribution is flat")
    p.add_argument("--prefill-chunk-size", type=int, metavar="N", help="write a long prompt into the cache in "
                   "forwards of at most N positions (whole blocks), which bounds the memory its prefill takes; the "
                   "output is the same (default: one forward)")


def default_dtype(device: torch.device) -> str:
    """The dtype a model is loaded in on ``device`` without ``--dtype``: float32 on a CPU; on a GPU bfloat16 where it
    has bf16 units (NVIDIA's sm_80 and newer, AMD's), else float16 (Turing, sm_75: a T4 computes bf16 only by
    conversion)."""
    if device.type != "cuda":
        return "float32"
    return "float16" if before_ampere(device) else "bfloat16"


def load(model_path: str, device: str, dtype: str | None):
    """(tokenizer, model) of a checkpoint folder or Hub repo id. The model is always this package's class, also
    for the SDAR / MRP releases, whose own remote code ``AutoModelForCausalLM`` would run instead. Raises
    :class:`UsageError` for a device this torch cannot use or a checkpoint that cannot be loaded."""
    from transformers import AutoTokenizer

    from .modeling_sdar_mrp import SDARMRPForCausalLM

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {device!r} is not a device (cpu, cuda, cuda:N)") from None
    if kind not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: mrp-generate decodes on cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: this torch sees no CUDA GPU (torch {torch.__version__}); "
                         "use --device cpu")
    if dtype is None:
        dtype = default_dtype(torch.device(device))
    if _looks_local(model_path) and not Path(model_path).expanduser().exists():
        raise UsageError(f"--model: no folder {model_path!r} (a Hub repo id reads 'owner/name')")
    try:
        model = SDARMRPForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        # With the model's config given, AutoTokenizer does not load (and ask to trust) the remote config again.
        tokenizer = AutoTokenizer.from_pretrained(model_path, config=model.config)
    except OSError as err:  # no such folder or repo, a folder without a checkpoint, offline without a cached copy
        raise UsageError(f"--model: {model_path!r} is neither a checkpoint folder nor a Hub repo that could be "
                         f"fetched ({type(err).__name__}: {' '.join(str(err).split())})") from err
    except Exception as err:  # noqa: BLE001 - found, but not an SDAR checkpoint: no tokenizer, another config, ...
        raise UsageError(f"--model: {model_path!r} could not be loaded as an SDAR checkpoint ({type(err).__name__}: "
                         f"{' '.join(str(err).split())})") from err
    return tokenizer, model.to(device).eval()


def _looks_local(model_path: str) -> bool:
    """Whether ``--model`` names a path rather than a Hub repo id (``owner/name``): absolute, relative to ``.`` /
    ``..`` / ``~``, or deeper than one slash."""
    return model_path.startswith(("/", "./", "../", "~", ".\\")) or model_path.count("/") > 1


def encode(tokenizer, prompt: str, args: argparse.Namespace, history: list[dict] = ()) -> torch.Tensor:
    """The prompt's ids [1, P]: as it is, or (``--chat``) as a user message after the optional system message and
    the conversation's earlier turns (``history``: {role, content} dicts), rendered by the tokenizer's chat template
    with the assistant's turn opened."""
    if not args.chat:
        return tokenizer(prompt, return_tensors="pt").input_ids
    *system, user = user_turn(prompt, args.system)
    return torch.tensor([chat_ids(tokenizer, [*system, *history, user], args.model)])


def hint_chat(tokenizer, args: argparse.Namespace) -> None:
    """Without ``--chat``, tell a user whose model's tokenizer has a chat template that ``--chat`` uses it."""
    if not args.chat and getattr(tokenizer, "chat_template", None):
        print("note: this model's tokenizer has a chat template; --chat sends the prompt through it", file=sys.stderr)


def run_one(model, ids: torch.Tensor, settings: dict):
    """Generate once; returns (generate()'s output with ``return_dict_in_generate``, seconds)."""
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, return_dict_in_generate=True, **settings)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def steps_text(tokenizer, new: torch.Tensor, reveal_steps: torch.Tensor, confidences: torch.Tensor) -> str:
    """One line per decoding step of a completion: the step and the tokens it revealed for good, each as its place
    among the new tokens, its text and its probability when committed. new, reveal_steps, confidences: [n] (the
    output's new positions; a step 0 is padding)."""
    lines = []
    for step in range(1, int(reveal_steps.max()) + 1):
        places = (reveal_steps == step).nonzero().flatten().tolist()
        text = "  ".join(f"{i}:{tokenizer.decode(new[i : i + 1])!r}@{float(confidences[i]):.2g}" for i in places)
        lines.append(f"step {step:>3}: " + (text or "(revealed only positions past the completion's end)"))
    return "\n".join(lines)


def compare_settings(base: dict, mrp: bool = True) -> list[dict]:
    """The settings of each row of :data:`COMPARE` (without ``mrp``, those of the strategies that need no MRP head):
    ``base`` with the row's strategy and its own values where ``base`` gives none (None), without the settings the
    row's strategy does not read (:data:`READ_BY`)."""
    runs = []
    for strategy, extra in COMPARE:
        if strategy in MRP_STRATEGIES and not mrp:
            continue
        runs.append(read_by(strategy, {**extra, **{k: v for k, v in base.items() if v is not None or k not in extra}}))
    return runs


def read_by(strategy: str, settings: dict) -> dict:
    """``settings`` with ``strategy``, without the settings that strategy does not read (:data:`READ_BY`), which
    ``generate()`` would refuse."""
    unread = {name for name, strategies in READ_BY.items() if strategy not in strategies}
    return {"strategy": strategy, **{k: v for k, v in settings.items() if k not in unread}}


def check_settings(model, ids: torch.Tensor, runs: list[dict]) -> None:
    """Check the prompt and resolve each run's generate() settings as generate() will, with the layout they give
    (:class:`UsageError` with their message when they are refused), before anything is decoded."""
    try:
        prompts = PromptBatch.from_inputs(model.config, ids, None)
    except ValueError as err:
        raise UsageError(f"the prompt: {err}") from err
    for settings in runs:
        try:
            check_layout(model, prompts, settings)
        except (ValueError, TypeError) as err:
            raise UsageError(f"--strategy {settings['strategy']}: {err}") from err


def check_layout(model, prompts: PromptBatch, settings: dict) -> GenerationSettings:
    """Resolve generate()'s ``settings`` for ``prompts`` as generate() will, and the blocks they take (the
    ValueError or TypeError generate() would raise); returns the resolved settings."""
    resolved = GenerationSettings.resolve(model, None, settings, prompt_width=prompts.ids.shape[1],
                                           prompts=len(prompts.lens))
    prompts.block_ends(resolved.new_tokens_per_prompt(len(prompts.lens)), resolved.block_length,
                       model.config.max_position_embeddings)
    return resolved


def compare_table(model, tokenizer, ids: torch.Tensor, runs: list[dict]) -> str:
    """One row per run of :func:`compare_settings` (tokens: the new tokens the completion keeps; TPF: tokens
    decoded a backbone forward, the last block's positions past the end included), then the completion of the first
    run and each other run's that differs from it. On a GPU each strategy runs once untimed first (Triton
    compilation and CUDA-graph capture), so tok/s is the steady state."""
    rows, reference, texts = [], None, []
    width = max([len("strategy"), *(len(run["strategy"]) for run in runs)]) + 1  # a column wide enough for each
    header = f"{'strategy':<{width}}{'tokens':>7}{'bb fwd':>8}{'mrp fwd':>8}{'TPF':>7}{'tok/s':>9}{'= static':>10}"
    for settings in runs:
        strategy = settings["strategy"]
        if ids.is_cuda:
            run_one(model, ids, settings)
        out, seconds = run_one(model, ids, settings)
        new, stats = out.sequences[0, ids.shape[1]:], out.stats.as_dict()
        kept = int(out.new_tokens[0])
        if reference is None or not torch.equal(new, reference):
            texts.append(f"--- {strategy}'s completion"
                         f"{'' if reference is None else ' (differs from ' + runs[0]['strategy'] + ')'}"
                         f"\n{tokenizer.decode(new[:kept], skip_special_tokens=True)}")
        reference = new if reference is None else reference
        agree = (new == reference).double().mean().item()
        rows.append(f"{strategy:<{width}}{kept:>7}{stats['backbone_forwards'][0]:>8}{stats['mrp_forwards'][0]:>8}"
                    f"{stats['tokens_per_forward'][0]:>7.2f}{kept / seconds:>9.1f}{agree:>10.0%}")
    return "\n".join([header, *rows, *texts])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prompt = args.prompt
    if args.prompt_file is not None:
        try:
            prompt = args.prompt_file.read_text()
        except (OSError, UnicodeDecodeError) as err:
            parser.error(f"--prompt-file: {err}")
    elif args.prompt is None and args.prompts is None and not args.interactive:
        parser.error("give a prompt, --prompt-file, --prompts or --interactive")
    if args.system is not None and not args.chat:
        parser.error("--system needs --chat")
    if args.prompts is not None and (args.prompt is not None or args.prompt_file is not None):
        parser.error("--prompts reads every prompt from its file: drop the prompt / --prompt-file")
    if args.prompt_file is not None and args.prompt is not None:
        parser.error("--prompt-file holds the prompt: drop the prompt given on the command line")
    if args.interactive and (args.prompt is not None or args.prompt_file is not None or args.prompts is not None
                             or args.compare):
        parser.error("--interactive reads its prompts from standard input: drop the prompt / --prompt-file / "
                     "--prompts / --compare")
    if args.prompts is None and (args.output is not None or args.batch_size is not None
                                 or args.num_return_sequences is not None):
        parser.error("--output, --batch-size and --num-return-sequences go with --prompts")
    if args.prompts is not None and (args.compare or args.show_steps):
        parser.error("--prompts writes one strategy's completions: drop --compare / --show-steps (to compare the "
                     "strategies on a file of prompts: python benchmarks/bench_e2e.py --prompt-file FILE)")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.num_return_sequences is not None and args.num_return_sequences < 1:
        parser.error(f"--num-return-sequences must be >= 1, got {args.num_return_sequences}")
    if args.output is not None and (args.output.is_dir() or not args.output.parent.is_dir()):
        parser.error(f"--output {args.output}: not a file in an existing folder")
    if args.compare and args.strategy is not None:
        parser.error("--compare runs every strategy: drop --strategy")
    if args.compare and args.show_steps:
        parser.error("--show-steps lists one strategy's steps: drop --compare (or --show-steps)")
    set_threads(parser, args)
    try:
        if args.interactive:
            return converse(args)
        return generate_and_print(args, prompt) if args.prompts is None else generate_file(args)
    except UsageError as err:
        parser.exit(2, f"mrp-generate: error: {err}\n")


def set_threads(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Apply ``--threads`` (refused below 1)."""
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)


def decoding_settings(args: argparse.Namespace) -> dict:
    """The keywords of ``generate()`` that :func:`add_decoding_options`' options give, all but ``strategy`` (None:
    not given, generate()'s default)."""
    return dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, block_length=args.block_length,
                denoising_steps=args.denoising_steps, threshold=args.threshold, entropy_bound=args.entropy_bound,
                mrp_steps=args.mrp_steps,
                draft_schedule=args.draft_schedule, draft_vocab=args.draft_vocab,
                draft_candidates=args.draft_candidates, remask_rule=args.remask_rule,
                residual_delta=args.residual_delta, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                do_sample=args.do_sample,
                temperature=args.temperature, top_h=args.top_h, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                typical_p=args.typical_p, epsilon_cutoff=args.epsilon_cutoff, eta_cutoff=args.eta_cutoff,
                prefill_chunk_size=args.prefill_chunk_size)


def generate_settings(args: argparse.Namespace, tokenizer) -> dict:
    """The keywords of ``generate()`` the options give (None: not given, generate()'s default)."""
    return dict(decoding_settings(args), seed=args.seed, progress=args.max_new_tokens >= 256, stop_strings=args.stop,
                max_time=args.max_time, tokenizer=tokenizer if args.stop else None)


def load_for(args: argparse.Namespace):
    """(tokenizer, model) of ``--model``, with ``args.strategy`` defaulted for it (speculative, or static for a model
    without an MRP head)."""
    tokenizer, model = load(args.model, args.device, args.dtype)
    if args.strategy is None:
        args.strategy = "speculative" if model.has_mrp else "static"
    return tokenizer, model


def generate_and_print(args: argparse.Namespace, prompt: str) -> int:
    """Load the model, check the settings, then print the completion (streamed) and its stats, or the table of
    ``--compare``."""
    tokenizer, model = load_for(args)
    hint_chat(tokenizer, args)
    ids = encode(tokenizer, prompt, args).to(args.device)
    settings = generate_settings(args, tokenizer)
    runs = compare_settings(settings, model.has_mrp) if args.compare else [{**settings, "strategy": args.strategy}]
    check_settings(model, ids, runs)
    if args.compare:
        print(compare_table(model, tokenizer, ids, runs))
        return 0
    if not args.chat:
        print(prompt, end="", flush=True)  # then the completion, block by block as it is decoded
    complete_streamed(model, tokenizer, ids, {**settings, "strategy": args.strategy}, args.show_steps, first=True)
    return 0


def complete_streamed(model, tokenizer, ids: torch.Tensor, settings: dict, show_steps: bool, first: bool) -> dict:
    """Decode the prompt ids [1, P] with ``settings``, the completion streamed to standard output block by block,
    then its stats on standard error (``first``: the process's first call, which on a GPU compiles the kernels and
    captures the graphs, so it says so) and, with ``show_steps``, its decoding steps. Returns its
    :func:`completions` result."""
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out, seconds = run_one(model, ids, {**settings, "streamer": streamer, "output_reveal_steps": show_steps,
                                        "output_confidences": show_steps})
    result = completions(tokenizer, out, ids.shape[1])[0]
    print("\n" + stats_line(settings["strategy"], result["stats"], seconds)
          + (" (with Triton compilation and CUDA-graph capture: --compare times the steady state)"
             if ids.is_cuda and first else ""), file=sys.stderr)
    if show_steps:
        P = ids.shape[1]
        print(steps_text(tokenizer, out.sequences[0, P:], out.reveal_steps[0, P:], out.confidences[0, P:]))
    return result


def converse(args: argparse.Namespace) -> int:
    """``--interactive``: complete each line read from standard input (streamed), with its stats (and with
    ``--show-steps`` its decoding steps); with ``--chat`` each line is a user message of one conversation, which the
    replies (the new tokens kept) join as the assistant's turns. ``/reset`` forgets the conversation, ``/exit`` (or
    the end of input, or Ctrl-C) quits. A message the settings cannot decode (one that takes the conversation past
    the model's positions) is refused with the reason, and the session goes on. Sampled turn t draws with seed
    ``--seed`` + t."""
    tokenizer, model = load_for(args)
    hint_chat(tokenizer, args)
    settings = {**generate_settings(args, tokenizer), "strategy": args.strategy}
    check_settings(model, encode(tokenizer, "x", args), [settings])  # the options, before the first line is read
    print(("one message a line (end a line with \\ to go on on the next); /reset forgets the conversation, /exit quits"
           if args.chat else "one prompt a line (end a line with \\ to go on on the next), each completed on its "
           "own; /exit quits"), file=sys.stderr)
    history, turn = [], 0
    while True:
        try:
            line = read_message()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        command = line.strip()
        if command == "/exit":
            return 0
        if command == "/reset":
            history = []
            print("(a new conversation)", file=sys.stderr)
            continue
        if not command:
            continue
        ids = encode(tokenizer, line, args, history).to(args.device)
        try:
            check_settings(model, ids, [settings])
        except UsageError as err:
            print(f"error: {err}" + (" (/reset starts a new conversation)" if history else ""), file=sys.stderr)
            continue
        if not args.chat:
            print(line, end="", flush=True)
        try:
            reply = complete_streamed(model, tokenizer, ids, {**settings, "seed": (args.seed + turn) % SEEDS},
                                      args.show_steps, first=turn == 0)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        turn += 1
        if args.chat:
            history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply["completion"]}]


def read_message() -> str:
    """One message from standard input: a line, or several when each but the last ends with a backslash (joined by
    newlines, the backslashes dropped). Raises EOFError at the end of input before any line."""
    lines = [input("> ")]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        try:
            lines.append(input(". "))
        except EOFError:
            break
    return "\n".join(lines)


def stats_line(strategy: str, stats: dict, seconds: float) -> str:
    """What one completion (or several: their sums) cost (``stats``: a :func:`completions` result's): its new tokens,
    those decoded past the end of the last block (decoding fills whole blocks: counted in tokens/forward, not kept),
    the forwards, seconds."""
    kept, decoded = stats["new_tokens"], stats["tokens_decoded"]
    return (f"[{strategy}] {kept} new tokens"
            + (f" ({decoded} decoded: the last block's positions past the end too)" if decoded != kept else "")
            + f", {stats['backbone_forwards']} backbone forwards, {stats['mrp_forwards']} MRP forwards, "
            f"{stats['tokens_per_forward']:.2f} tokens/forward, {seconds:.2f} s")


def completions(tokenizer, out, width: int) -> list[dict]:
    """Each row's result of ``generate()``'s output ``out`` (with ``return_dict_in_generate``; ``width``: the width
    of its ``input_ids``): ``completion``, the new tokens it keeps as text, and ``stats``: ``new_tokens`` (kept),
    ``tokens_decoded`` (the last block's positions past the end too), ``backbone_forwards``, ``mrp_forwards`` and
    ``tokens_per_forward`` (decoded a backbone forward)."""
    stats = out.stats.as_dict()
    results = []
    for row, kept in enumerate(out.new_tokens.tolist()):
        results.append({"completion": tokenizer.decode(out.sequences[row, width : width + kept],
                                                       skip_special_tokens=True),
                        "stats": {"new_tokens": kept, "tokens_decoded": stats["tokens_committed"][row],
                                  **{key: stats[key][row] for key in ("backbone_forwards", "mrp_forwards",
                                                                      "tokens_per_forward")}}})
    return results


def generate_file(args: argparse.Namespace) -> int:
    """``--prompts``: load the model, read every prompt record and check it with the settings (before anything is
    decoded), then decode the prompts ``--batch-size`` at a time (left-padded; each row moves on on its own), writing
    each batch's results as it ends: one JSON line a record, in the file's order, the record with ``completion`` (the
    new tokens kept, as text) and ``stats`` (its new tokens, backbone and MRP forwards, tokens decoded a backbone
    forward) added (with ``--num-return-sequences`` N, N lines a record, numbered by ``sample``); then print the
    totals. Sampled record r (counted from 0 in the file's order) draws with seed ``--seed`` + r (a seed per prompt), so
    no two records share their noise and a record's samples do not depend on ``--batch-size``."""
    tokenizer, model = load_for(args)
    records = read_prompt_records(args.prompts, tokenizer, args.chat, args.system, args.model, option="--prompts")
    if not records:
        raise UsageError(f"--prompts {args.prompts}: no prompts")
    samples = 1 if args.num_return_sequences is None else args.num_return_sequences
    settings = {**generate_settings(args, tokenizer), "strategy": args.strategy, "num_return_sequences": samples}
    check_settings(model, torch.tensor([records[0].ids[:1]]), [settings])  # the options, before any record's line
    for record in records:
        taken = [key for key in OUTPUT_KEYS if key in record.fields]
        if taken:
            raise UsageError(f"{record.where}: the record holds {taken[0]!r}, which the output writes: rename it")
        try:
            check_settings(model, torch.tensor([record.ids]), [settings])
        except UsageError as err:
            raise UsageError(f"{record.where}: {err}") from None
    size = args.batch_size or BATCH_SIZE
    totals, seconds = dict.fromkeys(("new_tokens", "tokens_decoded", "backbone_forwards", "mrp_forwards"), 0), 0.0
    with contextlib.ExitStack() as stack:
        sink = sys.stdout if args.output is None else stack.enter_context(open(args.output, "w", encoding="utf-8"))
        for start in range(0, len(records), size):
            batch = records[start : start + size]
            ids, mask = left_padded([record.ids for record in batch], args.device)
            seeds = [(args.seed + start + row) % SEEDS for row in range(len(batch))]
            out, took = run_one(model, ids, {**settings, "attention_mask": mask, "seed": seeds})
            for row, result in enumerate(completions(tokenizer, out, ids.shape[1])):  # a prompt's samples together
                sample = {"sample": row % samples} if samples > 1 else {}
                sink.write(json.dumps({**batch[row // samples].fields, **sample, **result}, ensure_ascii=False) + "\n")
                for key in totals:
                    totals[key] += result["stats"][key]
            sink.flush()
            seconds += took
            print(f"{start + len(batch)}/{len(records)} prompts, {seconds:.1f} s", file=sys.stderr)
    totals["tokens_per_forward"] = totals["tokens_decoded"] / max(totals["backbone_forwards"], 1)
    print(stats_line(args.strategy, totals, seconds) + f" for {len(records)} prompts "
          f"({totals['new_tokens'] / seconds:.1f} new tokens/s)"
          + (f" -> {args.output}" if args.output is not None else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
