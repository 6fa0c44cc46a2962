"""Validated settings of one ``generate()`` call.

Precedence: explicit keyword arguments > the ``generation_config`` argument > the model's own
``generation_config`` (only the values it sets explicitly) > the defaults below.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import operator
import reprlib
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.utils import logging

from mrp_triton._checks import MAX_TOP_M
from mrp_triton.confidence import check_temperature

from .draft_vocab import normalize_draft_vocab
from .stopping_criteria import takes_confidences, takes_top_logprobs

logger = logging.get_logger(__name__)

STRATEGIES = ("static", "dynamic", "sequential", "entropy_bounded", "direct", "speculative", "remask")
MRP_STRATEGIES = ("direct", "speculative", "remask")
DRAFT_SCHEDULES = ("mrp", "authors")
REMASK_RULES = ("tau", "delta")
MRP_MIX_MODES = ("logits_sum", "none")
DEFAULT_THRESHOLD = {"dynamic": 0.9, "remask": 0.5}
DEFAULT_ENTROPY_BOUND = 0.1  # nats (entropy_bounded)
# Settings that take True or False only (a string such as "no" would read as True).
FLAGS = ("do_sample", "return_dict_in_generate", "output_reveal_steps", "output_confidences", "progress", "fuse_commit",
         "per_row_blocks", "use_cache", "device_loop", "packed_projections")
DEFAULT_MAX_NEW_TOKENS = 64
# GenerationConfig fields that do not steer decoding as such (bookkeeping; the model's block size and mask id, read by
# _model_fields).
NOT_DECODING_FIELDS = {"transformers_version", "_from_model_config", "bos_token_id", "use_cache", "block_size",
                       "mask_token_id"}
# what only sampled decoding reads
SAMPLING = ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
HF_DEFAULTS = GenerationConfig()  # a field at its default (or False / 0 / None) asks for nothing
# Nor does a field at the value transformers fills in when nobody set it (GenerationMixin._prepare_generation_config,
# which the text-generation pipeline of some versions runs before generate: num_beams=1, repetition_penalty=1.0, ...).
FILLED_DEFAULTS = getattr(GenerationConfig, "_get_default_generation_params", dict)()
# The keywords transformers' generate() takes: its config's fields and its own parameters (logits_processor,
# synced_gpus, ...: None, their default, asks for nothing)
HF_KEYWORDS = frozenset(HF_DEFAULTS.to_dict()) | {
    name for name, p in inspect.signature(GenerationMixin.generate).parameters.items()
    if p.default is not inspect.Parameter.empty}
# Settings a captured decoding step does not bake in (so not part of its key): they never change what a step
# computes, or reach it through a buffer (the seed; denoising_steps, through each row's quota set when its block
# starts; the new tokens per prompt, through the rows' layout).
OUTSIDE_THE_STEPS = ("max_new_tokens", "max_length", "min_length", "num_return_sequences", "eos_token_id",
                     "pad_token_id", "return_dict_in_generate", "progress", "streamer", "cuda_graphs", "eos_ids",
                     "per_row_blocks", "device_loop", "stop_strings", "stopping_criteria", "max_time", "tokenizer",
                     "use_cache", "seed", "denoising_steps", "prefill_chunk_size", "new_token_limits")
# Settings the steps read from the decode engine's buffers (DecodeEngine.use_settings): only whether one is set
# at all (None or not) is part of a step's key, so one set of captured steps serves every value (of top_k, every
# value up to its bound: GenerationSettings.top_k_max).
ON_THE_DEVICE = ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                 "threshold", "entropy_bound", "residual_delta", "min_new_tokens", "repetition_penalty",
                 "presence_penalty", "frequency_penalty")
# Per-prompt lists of a setting (setting -> the field that holds the list), which the steps read from the decode
# engine's buffers of one value a row (DecodeEngine.per_row): as for ON_THE_DEVICE, only whether a call gives one is
# part of a step's key.
PER_PROMPT = {"temperature": "temperatures", "top_h": "top_hs", "top_k": "top_ks", "top_p": "top_ps", "min_p": "min_ps",
              "typical_p": "typical_ps", "epsilon_cutoff": "epsilon_cutoffs", "eta_cutoff": "eta_cutoffs"}
# Per-prompt lists of a penalty, greedy or sampled (setting -> the field that holds the list), read as PER_PROMPT's
PER_PROMPT_PENALTIES = {"presence_penalty": "presence_penalties", "frequency_penalty": "frequency_penalties"}
PER_ROW_ON_THE_DEVICE = (*PER_PROMPT.values(), *PER_PROMPT_PENALTIES.values(), "sampling")  # sampling: do_sample
# per prompt
# Token bans the steps read from the decode engine's ban table (DecodeEngine.use_settings): as for ON_THE_DEVICE, only
# whether one is set is part of a step's key (bad_words_ids of one token each are folded into suppress_tokens).
IN_THE_BAN_TABLE = ("suppress_tokens", "begin_suppress_tokens", "bad_words_ids")
# Settings the steps read from the decode engine's bias table, a logit bias by token id (DecodeEngine.use_settings):
# as for ON_THE_DEVICE, only whether one is set is part of a step's key.
IN_THE_BIAS_TABLE = ("sequence_bias",)
# The value at which a setting asks nothing, as transformers reads it: a cut that keeps every token, no penalty.
NEUTRAL = {"min_p": 0, "epsilon_cutoff": 0, "eta_cutoff": 0, "typical_p": 1, "repetition_penalty": 1,
           "presence_penalty": 0, "frequency_penalty": 0}
# A prompt's entry in ``top_ks`` / ``top_hs`` where its top_k / top_h cuts nothing (None in the list; a top_k of 0):
# more ranks than any vocabulary holds, a top-h above 1 (the ops' "no cut" for a row; the rows of such a call sort
# their whole vocabulary: top_k_max None)
NO_CUT = {"top_k": float(2**31 - 1), "top_h": 2.0}
# Settings only some strategies read. A call that asks for one (a value other than its default) with another strategy
# is refused: the value would change nothing. A checkpoint's generation config serves every strategy: its values apply
# to the calls whose strategy reads them (e.g. a draft_vocab to the speculative calls).
READ_BY = {
    "threshold": ("dynamic", "remask"),
    "entropy_bound": ("entropy_bounded",),
    # direct and speculative decoding commit by their own rules
    "denoising_steps": ("static", "dynamic", "sequential", "entropy_bounded", "remask"),
    "mrp_steps": ("direct", "speculative"),
    "draft_schedule": ("speculative",),
    "draft_vocab": ("speculative",),
    "draft_candidates": ("speculative",),
    "remask_rule": ("remask",),
    "residual_delta": ("remask",),
    "mrp_mix": MRP_STRATEGIES,
    "mrp_scale": MRP_STRATEGIES,
    # static, sequential, direct rows: blocks together
    "per_row_blocks": ("dynamic", "entropy_bounded", "remask", "speculative"),
}


# transformers' settings at values that ask for what block-diffusion decoding does anyway: its KV cache is static
# (allocated once for the call), and it never compiles the model with torch.compile (graphed steps replay instead)
DONE_ANYWAY = {"cache_implementation": "static", "disable_compile": True,
               "guidance_scale": 1.0}  # (transformers adds classifier-free guidance only for a scale other than 1)


# transformers' settings refused here that have a counterpart, which the error that refuses them names
COUNTERPARTS = {name: "output_confidences=True (each new token's probability) or output_top_logprobs=k (the k most "
                      "likely tokens at each new position)" for name in ("output_scores", "output_logits")}


def _counterparts(names: list[str]) -> str:
    """The refusal's pointer to the counterparts of the refused settings ``names`` (empty when none has one)."""
    hints = [f"for {name}, {COUNTERPARTS[name]}" for name in names if name in COUNTERPARTS]
    return "; " + "; ".join(hints) if hints else ""


def _asks_nothing(name: str, value) -> bool:
    """Whether transformers' generation setting ``name`` (a GenerationConfig field or a parameter of its
    ``generate``) at ``value`` asks for nothing: False, None, an empty list (an empty ``LogitsProcessorList``), its
    default, the value transformers fills in, or what decoding does anyway (:data:`DONE_ANYWAY`)."""
    plain = isinstance(value, (bool, numbers.Number, str))
    return value is None or isinstance(value, (list, tuple)) and not value or plain and (
        value in (False, getattr(HF_DEFAULTS, name, None), FILLED_DEFAULTS.get(name))
        or name in DONE_ANYWAY and isinstance(value, bool) == isinstance(DONE_ANYWAY[name], bool)
        and value == DONE_ANYWAY[name])


def _model_fields(diff: dict, config) -> dict:
    """What a passed generation config's ``block_size`` and ``mask_token_id`` ask for (``diff``: its fields that
    differ from the model's own generation config, which holds copies of the model config's taken when it was saved,
    so that a value overridden at load, ``from_pretrained(..., block_size=...)``, wins over them): a ``block_size``
    other than the model's asks for blocks of that size (``block_length``, which a ``block_length`` of the same
    config overrides); a ``mask_token_id`` other than the model's is refused, as the model decodes with its own (set
    when loading)."""
    mask_id = diff.get("mask_token_id")
    if mask_id is not None and mask_id != config.mask_token_id:
        raise ValueError(f"generation_config sets mask_token_id={mask_id}, but the model decodes with "
                         f"config.mask_token_id={config.mask_token_id}: load it with from_pretrained(..., "
                         f"mask_token_id={mask_id}) (or drop mask_token_id from generation_config)")
    block = diff.get("block_size")
    return {"block_length": block} if block is not None and block != config.block_size else {}


@dataclass
class GenerationSettings:
    """Everything that steers decoding. ``max_new_tokens`` defaults to ``max_length`` minus the width of
    ``input_ids`` when only ``max_length`` is given (as in transformers), else to 64; a list of one count per prompt
    gives each prompt (its copies too) its own, and the output is as wide as the largest asks (a row's tokens past its
    own count are padding): each prompt gives what it gives alone with its count, as a server batching requests that
    ask for different lengths needs (``new_token_limits`` then holds the list, ``max_new_tokens`` the largest).
    ``temperature`` and the filters (``top_h``, ``top_k``, ``top_p``, ``min_p``, ``typical_p``, ``epsilon_cutoff``,
    ``eta_cutoff``; sampling) may also be lists of one per prompt (each of its copies too; a filter's neutral value,
    1 or 0, or a top_h or top_k of None, or a top_k of 0, cuts nothing for its prompt): each prompt draws what it
    draws alone with its values and its seed (``temperatures``, ``top_ks``, ... then hold the lists:
    :data:`PER_PROMPT`). ``do_sample`` may be a list too:
    the prompts given False pick greedily in the same call (no noise, no filter, at temperature 1: what they give
    alone with ``do_sample=False``; their entries in the other lists are unread), the others sample (``sampling``
    then holds the list, ``do_sample`` True).
    ``min_new_tokens`` holds EOS back
    (every ``eos_token_id``, excluded from the picks and their softmax, as transformers' logits processor sets its
    logits to -inf) at each row's first ``min_new_tokens`` new tokens, so no row ends before them (stop strings,
    stopping criteria and ``max_time`` still may); ``min_length`` asks the same of the width of ``input_ids`` plus the
    new tokens (as in transformers; both given: the larger). ``suppress_tokens`` are never decoded (excluded from every
    pick and its softmax, as transformers' processor sets their logits to -inf), ``begin_suppress_tokens`` not as a
    row's first new token; ``bad_words_ids`` of one token each are suppressed tokens (a sequence of several tokens is
    refused: which of its tokens comes last depends on the order a block is decoded in). ``num_return_sequences``
    (sampling only) decodes each prompt that many times, the copies next to each other in the output and each drawing
    its own noise (the prompt's prefill computed once, its later copies getting the first's keys and values).
    ``repetition_penalty`` (> 0; 1, transformers' default, none) is transformers' repetition
    penalty, greedy or sampled: every pick scales down the logit of each token the row has seen so far (a positive one
    divided by it, a negative one multiplied), before the temperature and the filters; what a row has seen is its
    prompt, its finished blocks and the tokens committed in its block so far (a speculative draft's are seen by the
    candidate states after it), not the padding transformers' left-padded batches also count.
    ``presence_penalty`` and ``frequency_penalty`` (finite numbers, or lists of one a prompt, greedy or sampled; 0 or
    None: none) are OpenAI's (and vLLM's): every
    pick subtracts from the logit of each token the row has generated so far ``presence_penalty`` once and
    ``frequency_penalty`` per time it was generated (its finished blocks and the tokens committed in its block so far,
    as for the repetition penalty, but never the prompt's tokens), after the repetition penalty, before the
    temperature and the filters; negative values encourage repeats. ``sequence_bias`` (transformers' name: a dict of
    ``(token_id,)`` -> bias, or a list of ``[[token_id], bias]``) adds each bias to its token's logit in every pick,
    before the penalties, as transformers' processor (and vLLM's logit bias) does (a bias of -inf never decodes the
    token; tokens of several ids are refused, as for ``bad_words_ids``).
    ``top_h`` (sampling, in (0, 1]) is transformers' top-h, applied before top-k as its warpers are:
    among the 100 most likely tokens, the most likely ones whose entropy terms ``-p log p`` (under the softmax over
    the 100) sum to at most ``top_h`` times their entropy. ``typical_p`` (sampling, in (0, 1], 1 none cut) is
    transformers' typical sampling (Meister et al. 2022), after min-p: the tokens whose surprise ``-log p`` lies
    nearest the entropy, up to that much probability (which may leave out the most likely). ``epsilon_cutoff`` and
    ``eta_cutoff`` (sampling, in [0, 1)) are transformers' epsilon and eta sampling (Hewitt et al. 2022), applied
    after top-k, top-p, min-p and typical: the tokens whose probability, under the softmax over what the filters
    before kept, falls below ``epsilon_cutoff`` (or below ``min(eta_cutoff, sqrt(eta_cutoff) * exp(-entropy))``) are
    left out, the most likely of those never (:func:`mrp_triton.reference.confidence.sampling_cut`). ``seed`` keys
    the sampling noise: a call without one draws it from torch's default generator, so sampled calls differ and
    ``torch.manual_seed`` / ``transformers.set_seed`` repeat them, as in transformers; with one, the draw is fixed
    whatever torch's generator holds. One int keys each row by its index in the batch; a list of one seed per prompt
    keys each prompt's rows by that seed and their index among its copies, so a prompt draws what it draws alone with
    its seed, whatever else the batch holds (what a server batching sampled requests needs).
    ``strategy="sequential"`` commits each step's quota at the
    first masked positions, left to right (the ``sequential`` rule of SDAR's ``generate.py``), picking tokens there
    only. ``strategy="entropy_bounded"`` is the EB-sampler (Ben-Hamu et al. 2025): each step ranks the masked positions
    by the entropy of their softmax (lowest first) and commits the longest run of them whose entropies, the largest left
    out, sum to at most ``entropy_bound`` nats (default 0.1; so at least one a step), or the step's quota when that is
    more. ``block_length`` defaults to the model's block size and ``denoising_steps`` to ``block_length`` (one token a
    step); ``threshold`` defaults to 0.9 (dynamic) or 0.5 (remask). ``fuse_commit`` writes a finished block's cache
    entries in the row's next forward (same output, one forward fewer per block); ``per_row_blocks`` (dynamic,
    entropy_bounded, remask, speculative) lets each row of a batch move on to its next block as soon as its own is full,
    so a batch takes as many steps as its slowest row alone, at the price of the finished block riding in the next
    forward of every row (``False``: rows start their blocks together; the output is the same either way);
    ``stop_strings`` (with the ``tokenizer`` that decodes the ids, as in transformers) end a row once its new text
    contains one of them: checked as its blocks fill, the tokens after the one completing it become padding (a list
    of one list of strings per prompt gives each prompt its own, an empty one none);
    ``stopping_criteria`` (transformers' criteria, called as its generate calls them, once per new token in order as
    soon as every row has decoded it: :mod:`.stopping_criteria`; one with ``takes_confidences = True`` also gets each
    new token's confidence, with ``output_confidences``, one with ``takes_top_logprobs = True`` its most likely tokens,
    with ``output_top_logprobs``) end a row at the first token at which one holds;
    ``max_time`` (seconds, as in transformers) ends every row with the block it is decoding once that much time has
    passed since the call began (checked as blocks fill, so a call may run past it by the rest of a block); ``progress``
    shows a bar over blocks; ``streamer`` (one prompt at a time) is an object with ``put(ids)`` and ``end()``, like
    transformers' ``TextStreamer``: it receives the prompt ids, then each finished block's new tokens (up to the first
    EOS), then ``end()``. ``output_reveal_steps`` (with ``return_dict_in_generate``) also returns, per output position,
    the row's decoding step that revealed its token for good (1 for the row's first step; 0 at prompt and padding
    positions): the order in which decoding filled each block; ``output_confidences`` the probability of each new token
    under the softmax that committed it for good, and ``output_top_logprobs=k`` (0 to 64) the k most likely tokens of
    that softmax and their log-probabilities (:class:`.SDARGenerateOutput`). ``use_cache`` is accepted as
    transformers' ``generate`` takes it: decoding always runs on its KV cache, which gives the tokens a forward over the
    whole sequence would. ``prefill_chunk_size`` (transformers' name; default None: one forward) writes the prompt's
    full blocks into the cache in forwards of at most that many positions (rounded down to whole blocks, at least one),
    each attending to the cache the ones before it wrote: the same output, with the activations and attention scores of
    a long prompt bounded by the chunk. ``cuda_graphs`` (default: on for a CUDA model) replays each kind of decoding
    step from a captured CUDA graph; ``True`` on a CPU model replays the recorded step functions on the same fixed
    buffers (a graph's data flow, without the graph). ``device_loop`` (needs ``cuda_graphs`` and on CUDA torch >= 2.12)
    runs the steps after those that surely have work inside one graph, each only while no row has filled its block,
    tested on the device (CUDA-graph conditional nodes), so the host checks the rows once a block fills instead of after
    every step (same output; a static, sequential, direct or speculative row that an EOS settles stops with that step,
    not one step later). ``packed_projections`` runs each layer's q/k/v projections as one GEMM and its gate/up
    projections as another (the model's weights are laid out for it once, in place: ``model.pack_projections()``);
    the same output up to the rounding of a differently blocked GEMM (``False``: one GEMM per projection, to measure
    what packing saves).
    ``draft_vocab`` (speculative) lets the drafts choose among some token ids only: an int N (the ids below N; BPE ids
    are in merge order, so roughly the frequent tokens) or the ids themselves (a sequence or 1-D tensor, e.g. the most
    frequent tokens of your data: ``mrp-train draft-vocab``). Each draft step reads those rows of the lm_head instead of
    all of them (the lm_head is most of a draft step's weights at large vocabularies); verification uses the whole
    vocabulary: the output stays lossless, only the acceptance may drop (:mod:`.draft_vocab`). ``draft_candidates`` M
    (speculative, 1 to 64) lets each draft choose among the M tokens the round's seed forward found most likely at that
    position (listed by the same pass over the lm_head that picks the backbone's tokens), so a draft step reads M rows
    of the lm_head per position instead of all of them (:mod:`.draft_candidates`); lossless like ``draft_vocab``, with
    which it does not combine.

    Settings that only some strategies read (:data:`READ_BY`: ``threshold``, ``mrp_steps``, ``draft_vocab``, ...)
    are refused when a call asks for them (a value other than the default) with a strategy that does not read
    them; set in the model's own generation config, they apply to the calls whose strategy reads them."""

    max_new_tokens: int | Sequence[int] | None = None  # validated: an int (a list moves to new_token_limits)
    max_length: int | None = None
    min_new_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | Sequence[float] | None = None  # validated: a float (a list moves to presence_penalties)
    frequency_penalty: float | Sequence[float] | None = None  # validated: as presence_penalty
    min_length: int | None = None
    num_return_sequences: int = 1
    block_length: int | None = None
    denoising_steps: int | None = None
    strategy: str = "static"
    threshold: float | None = None
    entropy_bound: float | None = None
    do_sample: bool | Sequence[bool] = False  # validated: a bool (a list moves to sampling)
    temperature: float | Sequence[float] = 1.0  # validated: a float (a list moves to temperatures)
    top_h: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    suppress_tokens: Sequence[int] | None = None  # validated: a sorted tuple of distinct ids, or None
    begin_suppress_tokens: Sequence[int] | None = None  # validated: as suppress_tokens
    bad_words_ids: Sequence[Sequence[int]] | None = None  # validated: folded into suppress_tokens, then None
    sequence_bias: dict | Sequence | None = None  # validated: a sorted tuple of (token id, bias) pairs, or None
    seed: int | Sequence[int] | None = None  # validated: an int, or a tuple of ints (one per prompt)
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    return_dict_in_generate: bool = False
    output_reveal_steps: bool = False
    output_confidences: bool = False
    output_top_logprobs: int = 0
    mrp_steps: int = 3
    draft_schedule: str = "mrp"
    draft_vocab: int | Sequence[int] | torch.Tensor | None = None  # validated: an int or a sorted tuple of ids
    draft_candidates: int | None = None
    remask_rule: str = "tau"
    residual_delta: float = 1.0
    mrp_mix: str = "logits_sum"
    mrp_scale: float = 1.0
    progress: bool = False
    fuse_commit: bool = True
    per_row_blocks: bool = True
    cuda_graphs: bool | None = None
    device_loop: bool = False
    packed_projections: bool = True
    streamer: object | None = None
    stop_strings: str | Sequence[str] | Sequence[Sequence[str]] | None = None  # validated: a tuple of strings, or
    # of one tuple of them per prompt (stops_per_prompt), or None
    stopping_criteria: Sequence | None = None  # validated: a non-empty tuple of callables, or None
    max_time: float | None = None
    tokenizer: object | None = None
    use_cache: bool = True
    prefill_chunk_size: int | None = None
    eos_ids: tuple[int, ...] = field(default=(), init=False)
    new_token_limits: tuple[int, ...] | None = field(default=None, init=False)  # one per prompt, or None
    temperatures: tuple[float, ...] | None = field(default=None, init=False)  # one per prompt, or None
    top_hs: tuple[float, ...] | None = field(default=None, init=False)  # one per prompt (no cut: NO_CUT's), or None
    top_ks: tuple[float, ...] | None = field(default=None, init=False)  # one per prompt (no cut: NO_CUT's), or None
    top_ps: tuple[float, ...] | None = field(default=None, init=False)  # one per prompt, or None
    min_ps: tuple[float, ...] | None = field(default=None, init=False)  # one per prompt, or None
    typical_ps: tuple[float, ...] | None = field(default=None, init=False)  # one per prompt, or None
    epsilon_cutoffs: tuple[float, ...] | None = field(default=None, init=False)  # one per prompt, or None
    eta_cutoffs: tuple[float, ...] | None = field(default=None, init=False)  # one per prompt, or None
    sampling: tuple[bool, ...] | None = field(default=None, init=False)  # whether each prompt samples, or None
    presence_penalties: tuple[float, ...] | None = field(default=None, init=False)  # one per prompt, or None
    frequency_penalties: tuple[float, ...] | None = field(default=None, init=False)  # one per prompt, or None

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if f.init}

    def step_key(self) -> tuple:
        """The settings a decoding step's computation depends on, as a hashable key: of a setting read on the
        device, whether it is set; of a sampling setting in a greedy call, nothing (a checkpoint's generation
        config may set top_k or top_p that greedy decoding ignores)."""
        def part(name: str):
            value = getattr(self, name)
            if name in SAMPLING and not self.do_sample:  # greedy steps never read them
                return None
            if name == "top_k":
                return self.top_k_max
            if name in ON_THE_DEVICE + PER_ROW_ON_THE_DEVICE + IN_THE_BAN_TABLE + IN_THE_BIAS_TABLE:
                return value is None
            return repr(value)

        return tuple((f.name, part(f.name)) for f in dataclasses.fields(self) if f.name not in OUTSIDE_THE_STEPS)

    @property
    def counts_tokens(self) -> bool:
        """Whether the picks read how often each row generated each token (a presence or frequency penalty, or one
        per prompt)."""
        return any(getattr(self, name) is not None or getattr(self, lists) is not None
                   for name, lists in PER_PROMPT_PENALTIES.items())

    @property
    def top_k_max(self) -> int | None:
        """The bound on ``top_k`` the decoding steps are built for (they read top_k on the device; its cut selects
        this many of a row's largest logits instead of sorting the row): the power of two at or above top_k (with
        one per prompt, their largest), at least 64, so calls with top_k up to 64 share their captured steps. None
        without top_k, and where a prompt's top_k cuts nothing (its rows need the whole sorted row)."""
        largest = self.top_k if self.top_ks is None else max(self.top_ks)
        if largest is None or largest == NO_CUT["top_k"]:
            return None
        return max(64, 1 << (int(largest) - 1).bit_length())

    @classmethod
    def resolve(cls, model, generation_config, kwargs: dict, prompt_width: int,
                prompts: int | None = None) -> "GenerationSettings":
        """Settings of a call whose ``input_ids`` are ``prompt_width`` tokens wide (for ``max_length``) and hold
        ``prompts`` prompts (the length a list of seeds must have; None: not checked)."""
        names = cls.names()
        foreign = set(kwargs) - names
        unknown = sorted(foreign - HF_KEYWORDS)
        if unknown:
            raise TypeError(f"generate() got unknown keyword argument(s) {unknown}; accepted: {sorted(names)}")
        refused = [k for k in sorted(foreign) if not _asks_nothing(k, kwargs[k])]
        if refused:  # transformers' keywords at the values that ask for nothing (num_beams=1, ...) pass
            shown = ", ".join(f"{k}={reprlib.repr(kwargs[k])}" for k in refused)
            raise TypeError(f"generate() got {shown}, which block-diffusion decoding does not support; drop "
                            f"{'them' if len(refused) > 1 else 'it'} (supported: {sorted(names)})"
                            + _counterparts(refused))
        kwargs = {k: v for k, v in kwargs.items() if k in names}
        if generation_config is not None and not isinstance(generation_config, GenerationConfig):
            raise TypeError(f"generation_config must be a transformers.GenerationConfig, got "
                            f"{type(generation_config).__name__}; build one (GenerationConfig(**settings)) or pass "
                            "the settings as keywords")
        values: dict = {}
        sources = (getattr(model, "generation_config", None), generation_config)
        own, passed = ({} if source is None else source.to_diff_dict() for source in sources)
        # what a passed config changes from the model's own (a pipeline passes a copy of the model's)
        changed = {k: v for k, v in passed.items() if k not in own or own[k] != v}
        for source, diff in zip(sources, (own, passed)):
            if source is None:
                continue
            if source is generation_config:  # the model's own file holds copies of its config's, taken when saved
                values.update(_model_fields(changed, model.config))
            given = {k: v for k, v in diff.items() if v is not None and k not in NOT_DECODING_FIELDS}
            unsupported = sorted(k for k in set(given) - names if not _asks_nothing(k, given[k]))
            if unsupported and source is generation_config:
                raise TypeError(f"generation_config sets {unsupported}, which block-diffusion decoding does not "
                                f"support; drop them (supported: {sorted(names)})" + _counterparts(unsupported))
            if unsupported:
                logger.warning_once(f"the model's generation_config sets {unsupported}, which block-diffusion "
                                    "decoding does not support: they are ignored")
            values.update({k: v for k, v in given.items() if k in names})
        values.update({k: v for k, v in kwargs.items() if v is not None})
        settings = cls(**values)
        # The call asked for a setting if it passed it (None passes nothing), or a generation_config whose value
        # differs from the model's (a pipeline passes a copy of the model's).
        asked = {k for k, v in kwargs.items() if v is not None} | set(changed)
        if kwargs.get("do_sample") is not None:  # the call decides whether to sample: a passed config's sampling
            asked -= set(SAMPLING) - set(kwargs)  # values wait, as the checkpoint's do (pipelines of transformers
            # 5.17 pass their sampling defaults in a config beside an explicit do_sample=False)
        settings._drop_unread(asked)
        settings._one_draft_choice(asked)
        if {"max_new_tokens", "max_length"} <= asked:
            logger.warning_once(f"both max_new_tokens={settings.max_new_tokens} and max_length={settings.max_length} "
                                "were given: max_new_tokens wins (as in transformers)")
        settings._split_new_token_limits(prompts)
        settings._split_sampling(prompts)
        for name in (*PER_PROMPT, *PER_PROMPT_PENALTIES):
            settings._split_per_prompt(name, prompts)
        settings._greedy_prompts_at_temperature_1()
        settings._fill_defaults(model.config, prompt_width)
        settings.validate(model)
        settings._check_seeds(prompts)
        settings._check_stops_per_prompt(prompts)
        settings._check_sampling(asked)
        settings._check_minimum(asked)
        return settings

    @classmethod
    def _default(cls, name: str):
        """The default of setting ``name`` (its field's)."""
        return next(f.default for f in dataclasses.fields(cls) if f.name == name)

    def _at_default(self, name: str) -> bool:
        """Whether setting ``name`` holds its default (None where the default is None)."""
        default, value = self._default(name), getattr(self, name)
        return value is None if default is None else value == default

    def _check_seeds(self, prompts: int | None) -> None:
        """``seed`` is an int in [0, 2**64), or a list or tuple of them with one per prompt (kept as a tuple)."""
        if isinstance(self.seed, (list, tuple)):
            self.seed = _one_per_prompt("seed", self.seed, prompts, "seeds", "one int")
        for seed in self.seed if isinstance(self.seed, tuple) else (self.seed,):
            _int_at_least("seed", seed, 0)
            if seed >= 2**64:
                raise ValueError(f"seed={seed} must be below 2**64 (the noise hash reads 64 bits of it)")

    def _split_new_token_limits(self, prompts: int | None) -> None:
        """A list of ``max_new_tokens`` (one count >= 1 per prompt) goes to ``new_token_limits`` (a tuple), its largest
        to ``max_new_tokens``."""
        if not isinstance(self.max_new_tokens, (list, tuple)):
            return
        limits = _one_per_prompt("max_new_tokens", self.max_new_tokens, prompts, "counts", "one int")
        for limit in limits:
            _int_at_least("max_new_tokens", limit, 1)
        self.new_token_limits, self.max_new_tokens = limits, max(limits)

    def _split_sampling(self, prompts: int | None) -> None:
        """A list of ``do_sample`` (one bool per prompt) goes to ``sampling`` (a tuple; None when they are all the
        same: ``do_sample`` then holds it), ``do_sample`` then True (the call samples)."""
        if not isinstance(self.do_sample, (list, tuple)):
            return
        values = _one_per_prompt("do_sample", self.do_sample, prompts, "flags", "one bool")
        wrong = next((value for value in values if not isinstance(value, bool)), None)
        if wrong is not None:
            raise TypeError(f"do_sample must be a bool, or a list of one bool per prompt; the list holds {wrong!r}")
        if len(set(values)) == 1:
            self.do_sample = values[0]
        else:
            self.sampling, self.do_sample = values, True

    def _greedy_prompts_at_temperature_1(self) -> None:
        """With ``sampling``, the prompts that do not sample pick at temperature 1 (as a greedy call does): the
        temperature becomes one per prompt (``temperatures``, even if all are 1: one set of captured steps serves
        every such call), theirs 1."""
        if self.sampling is None:
            return
        if self.temperatures is None:
            _check_sampling_value("temperature", self.temperature)
        given = self.temperatures or (self.temperature,) * len(self.sampling)
        self.temperatures = tuple(float(t) if sampled else 1.0 for t, sampled in zip(given, self.sampling))
        self.temperature = self._default("temperature")

    def _split_per_prompt(self, name: str, prompts: int | None) -> None:
        """A list of setting ``name`` (:data:`PER_PROMPT`: one usable value per prompt, of a sampled call;
        :data:`PER_PROMPT_PENALTIES`: one finite number or None, none, per prompt) goes to its field of lists (a tuple
        of floats; None when they are all the same: ``name`` then holds it), ``name`` then holding its default
        (unread); a top_h or top_k of None (or a top_k of 0: no cut) is :data:`NO_CUT`'s there, a penalty's None 0."""
        values = getattr(self, name)
        if not isinstance(values, (list, tuple)):
            return
        values = _one_per_prompt(name, values, prompts, "values", "one number")
        if name in PER_PROMPT_PENALTIES:
            values = tuple(0.0 if value is None else _number(name, value) for value in values)
            if not all(map(math.isfinite, values)):
                raise ValueError(f"{name}={list(values)!r} must hold finite numbers (0 or None: no penalty)")
            if len(set(values)) == 1:
                setattr(self, name, values[0])
            else:
                setattr(self, PER_PROMPT_PENALTIES[name], values)
                setattr(self, name, None)
            return
        if not self.do_sample:
            raise ValueError(f"{name}={list(values)!r} steers sampling, which this call does not do: pass "
                             "do_sample=True (or drop it)")
        for value in values:
            if not (value is None and name in NO_CUT):
                _check_sampling_value(name, value)
        if name == "top_k":  # 0, None and a top_k past any vocabulary cut nothing
            values = tuple(None if type(value) is int and (value == 0 or value >= NO_CUT["top_k"]) else value
                           for value in values)
        if len(set(values)) == 1:
            setattr(self, name, values[0])
        else:
            setattr(self, PER_PROMPT[name], tuple(NO_CUT[name] if value is None else float(value) for value in values))
            setattr(self, name, self._default(name))

    def _check_stops_per_prompt(self, prompts: int | None) -> None:
        """``stop_strings`` given per prompt: one list for each (an empty one: none), not all empty (None then)."""
        strings = self.stop_strings
        if not (isinstance(strings, tuple) and strings and all(isinstance(x, tuple) for x in strings)):
            return
        if len(strings) != (prompts or len(strings)):
            raise ValueError(f"stop_strings has {len(strings)} lists for {prompts} prompts: give one per row of "
                             "input_ids (an empty list: none for that row), or one list for the whole batch")
        if not any(strings):
            self.stop_strings = None

    def stops_per_prompt(self, prompts: int) -> list[tuple[str, ...]]:
        """The stop strings of each of a call's ``prompts`` prompts (each of its copies too; empty: none)."""
        strings = self.stop_strings or ()
        per_prompt = bool(strings) and isinstance(strings[0], tuple)
        return list(strings) if per_prompt else [strings] * prompts

    def new_tokens_per_prompt(self, prompts: int) -> list[int]:
        """The most new tokens each of a call's ``prompts`` prompts decodes (each of its copies too)."""
        return list(self.new_token_limits or (self.max_new_tokens,) * prompts)

    def _check_sampling(self, asked: set[str]) -> None:
        """Raise if the call asked for a sampling setting (:data:`SAMPLING`: ``temperature``, ``top_k``, ...) without
        sampling, which would change nothing (greedy decoding reads none of them)."""
        given = [f"{name}={getattr(self, name)!r}" for name in SAMPLING
                 if name in asked and getattr(self, name) is not None and not self._at_default(name)]
        if given and not self.do_sample:
            raise ValueError(f"{', '.join(given)} {'steers' if len(given) == 1 else 'steer'} sampling, which this "
                             "call does not do: pass do_sample=True (or drop them)")

    def _check_minimum(self, asked: set[str]) -> None:
        """A minimum (``min_new_tokens`` / ``min_length``) with no EOS id holds nothing back: refused when the call
        asked for it, set aside when it comes from the checkpoint's generation config."""
        if self.min_new_tokens is None or self.eos_ids:
            return
        if asked & {"min_new_tokens", "min_length"}:
            raise ValueError(f"min_new_tokens={self.min_new_tokens} holds back EOS, but this call has no "
                             "eos_token_id (nothing ends a row early): pass eos_token_id=... (or drop "
                             "min_new_tokens / min_length)")
        self.min_new_tokens = None

    def _drop_unread(self, asked: set[str]) -> None:
        """Reset the settings this call's strategy does not read (:data:`READ_BY`) to their defaults; raise if the
        call asked for one of them."""
        for name, strategies in READ_BY.items():
            if self.strategy in strategies or self._at_default(name):
                continue
            if name in asked:
                readers = " or ".join(repr(s) for s in strategies)
                raise ValueError(f"{name}={getattr(self, name)!r} steers strategy {readers}, not {self.strategy!r}: "
                                 "drop it (or choose a strategy that reads it)")
            setattr(self, name, self._default(name))

    def _one_draft_choice(self, asked: set[str]) -> None:
        """``draft_vocab`` and ``draft_candidates`` exclude each other: when the call asks for one, a generation
        config's value of the other waits (a checkpoint carrying a draft vocabulary still serves a call asking for
        draft_candidates); :meth:`validate` refuses both only when both come from the call or both from configs."""
        pair = ("draft_vocab", "draft_candidates")
        if all(getattr(self, name) is not None for name in pair):
            for name, other in (pair, pair[::-1]):
                if other in asked and name not in asked:
                    setattr(self, name, None)

    def _fill_defaults(self, config, prompt_width: int) -> None:
        if self.max_new_tokens is None and self.max_length is not None:
            _int_at_least("max_length", self.max_length, prompt_width + 1, f" (the input_ids are {prompt_width} wide: "
                          "leave room for at least one new token, or give max_new_tokens)")
            self.max_new_tokens = self.max_length - prompt_width
        if self.max_new_tokens is None:
            self.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        if self.min_length is not None:
            _int_at_least("min_length", self.min_length, 0)
            _int_at_least("min_new_tokens", 0 if self.min_new_tokens is None else self.min_new_tokens, 0)
            self.min_new_tokens = max(self.min_new_tokens or 0, self.min_length - prompt_width)
        if self.block_length is None:
            self.block_length = config.block_size
        if self.denoising_steps is None:
            self.denoising_steps = self.block_length
        if self.seed is None:  # from torch's generator when sampled (greedy decoding reads no noise)
            self.seed = int(torch.randint(0, 2**63 - 1, ())) if self.do_sample is True else 0
        if self.threshold is None:
            self.threshold = DEFAULT_THRESHOLD.get(self.strategy)
        if self.entropy_bound is None and self.strategy == "entropy_bounded":
            self.entropy_bound = DEFAULT_ENTROPY_BOUND
        if type(self.top_k) is int and (self.top_k == 0 or self.top_k >= NO_CUT["top_k"]):  # transformers' "no
            self.top_k = None  # top-k cut" (0; a checkpoint may carry it), or one past any vocabulary (sys.maxsize)
        for name, neutral in NEUTRAL.items():  # asks nothing: nothing for the steps to do
            if getattr(self, name) == neutral and not isinstance(getattr(self, name), bool):
                setattr(self, name, None)
        if isinstance(self.stop_strings, str):
            self.stop_strings = (self.stop_strings,)
        elif isinstance(self.stop_strings, (list, tuple)):  # a list of one list per prompt: a tuple of tuples
            self.stop_strings = tuple(tuple(x) if isinstance(x, (list, tuple)) else x for x in self.stop_strings)
        if isinstance(self.stopping_criteria, (list, tuple)):  # transformers' StoppingCriteriaList is a list
            self.stopping_criteria = tuple(self.stopping_criteria) or None
        if self.eos_token_id is None:
            self.eos_token_id = config.eos_token_id
        eos = self.eos_token_id
        self.eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if self.min_new_tokens == 0 and type(self.min_new_tokens) is int:  # asks nothing: no ban in the steps
            self.min_new_tokens = None
        if self.pad_token_id is None:
            self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else (
                self.eos_ids[0] if self.eos_ids else config.mask_token_id)

    def validate(self, model) -> None:
        config = model.config
        _int_at_least("max_new_tokens", self.max_new_tokens, 1)
        if self.min_new_tokens is not None:
            _int_at_least("min_new_tokens", self.min_new_tokens, 0)
        _int_at_least("block_length", self.block_length, 1)
        _int_at_least("num_return_sequences", self.num_return_sequences, 1)
        if self.num_return_sequences > 1 and not self.do_sample:
            raise ValueError(f"num_return_sequences={self.num_return_sequences} without sampling gives identical "
                             "copies: set do_sample=True (or num_return_sequences=1)")
        if self.num_return_sequences > 1 and self.sampling is not None:
            raise ValueError(f"num_return_sequences={self.num_return_sequences} gives identical copies of the prompts "
                             "whose do_sample is False: sample every prompt (or num_return_sequences=1)")
        _int_at_least("denoising_steps", self.denoising_steps, 1)
        if self.denoising_steps > self.block_length:
            raise ValueError(f"denoising_steps={self.denoising_steps} must be in 1..block_length "
                             f"({self.block_length})")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is unknown; use one of {STRATEGIES}")
        if self.threshold is not None and not 0.0 < _number("threshold", self.threshold) <= 1.0:
            raise ValueError(f"threshold={self.threshold} must be in (0, 1]")
        if self.entropy_bound is not None and not 0.0 <= _number("entropy_bound", self.entropy_bound) < math.inf:
            raise ValueError(f"entropy_bound={self.entropy_bound} must be a finite number >= 0 (nats)")
        for name in FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        _int_at_least("output_top_logprobs", self.output_top_logprobs, 0)
        if self.output_top_logprobs > MAX_TOP_M:
            raise ValueError(f"output_top_logprobs={self.output_top_logprobs} must be at most {MAX_TOP_M}")
        for name, field_name in (("output_reveal_steps", "reveal_steps"), ("output_confidences", "confidences"),
                                 ("output_top_logprobs", "top_logprobs")):
            if getattr(self, name) and not self.return_dict_in_generate:
                raise ValueError(f"{name}={getattr(self, name)} returns its values in the output's .{field_name}: "
                                 "pass return_dict_in_generate=True too")
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool or None (on for a CUDA model), got "
                            f"{type(self.cuda_graphs).__name__}")
        if self.do_sample:
            _check_sampling_value("temperature", self.temperature)
        for name in ("top_k", "top_p", "top_h", "typical_p", "min_p", "epsilon_cutoff", "eta_cutoff"):
            if getattr(self, name) is not None:
                _check_sampling_value(name, getattr(self, name), " (or None to disable)")
        if self.repetition_penalty is not None and not 0.0 < _number("repetition_penalty", self.repetition_penalty) \
                < math.inf:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be a finite number > 0 (1 or None: "
                             "no penalty; above 1 discourages repeating a token)")
        for name in PER_PROMPT_PENALTIES:
            if getattr(self, name) is not None and not math.isfinite(_number(name, getattr(self, name))):
                raise ValueError(f"{name}={getattr(self, name)} must be a finite number (0 or None: no penalty; above "
                                 "0 discourages repeating a token)")
        if self.streamer is not None and not all(callable(getattr(self.streamer, m, None)) for m in ("put", "end")):
            raise TypeError(f"streamer must have put(ids) and end() methods (like transformers.TextStreamer), got "
                            f"{type(self.streamer).__name__}")
        if self.stop_strings is not None:
            strings = self.stop_strings
            per_prompt = isinstance(strings, tuple) and strings and all(isinstance(x, tuple) for x in strings)
            if not isinstance(strings, tuple) or not strings or not all(
                    isinstance(x, str) and x for x in (sum(strings, ()) if per_prompt else strings)):
                raise TypeError(f"stop_strings must be a non-empty string, a list of them, or a list of one such list "
                                f"per prompt, got {self.stop_strings!r}")
            if not callable(getattr(self.tokenizer, "decode", None)):
                raise ValueError("stop_strings needs the tokenizer that decodes the ids: pass tokenizer=... (as "
                                 "transformers' generate does)")
        if self.stopping_criteria is not None and not (isinstance(self.stopping_criteria, tuple) and
                                                       all(map(callable, self.stopping_criteria))):
            raise TypeError(f"stopping_criteria must be a list (or transformers.StoppingCriteriaList) of criteria "
                            f"called as criterion(input_ids, scores), got {reprlib.repr(self.stopping_criteria)}")
        if not self.output_confidences and any(map(takes_confidences, self.stopping_criteria or ())):
            raise ValueError("stopping_criteria holds a criterion that takes each new token's confidence "
                             "(takes_confidences=True): pass output_confidences=True (and return_dict_in_generate=True)"
                             ", which notes them")
        if not self.output_top_logprobs and any(map(takes_top_logprobs, self.stopping_criteria or ())):
            raise ValueError("stopping_criteria holds a criterion that takes each new token's most likely tokens "
                             "(takes_top_logprobs=True): pass output_top_logprobs=k (and return_dict_in_generate=True)"
                             ", which notes them")
        self._normalize_bans(config.vocab_size)
        self._normalize_bias(config.vocab_size)
        if self.prefill_chunk_size is not None:
            _int_at_least("prefill_chunk_size", self.prefill_chunk_size, 1, " (None: the whole prompt in one forward)")
        if self.max_time is not None and not _number("max_time", self.max_time) > 0.0:
            raise ValueError(f"max_time={self.max_time} must be > 0 seconds (or None: no time limit)")
        self.eos_ids = tuple(_token_id("eos_token_id", i, config.vocab_size) for i in self.eos_ids)
        if config.mask_token_id in self.eos_ids:
            raise ValueError(f"eos_token_id {config.mask_token_id} is the mask token, which decoding never commits "
                             "(it marks the positions still to decode): pass the model's end-of-text id(s)")
        self._check_a_first_token_is_left(config)
        self.pad_token_id = _token_id("pad_token_id", self.pad_token_id, config.vocab_size)
        if self.strategy in MRP_STRATEGIES:
            model.require_mrp(f"strategy={self.strategy!r}")
            _int_at_least("mrp_steps", self.mrp_steps, 1)
            if self.mrp_steps > self.block_length:  # each MRP step picks one token; K + 1 copies a verify forward
                raise ValueError(f"mrp_steps={self.mrp_steps} must be at most block_length ({self.block_length}): a "
                                 "block has no more positions for MRP steps to pick")
            if self.draft_schedule not in DRAFT_SCHEDULES:
                raise ValueError(f"draft_schedule={self.draft_schedule!r} is unknown; use one of {DRAFT_SCHEDULES}")
            if self.remask_rule not in REMASK_RULES:
                raise ValueError(f"remask_rule={self.remask_rule!r} is unknown; use one of {REMASK_RULES}")
            if self.mrp_mix not in MRP_MIX_MODES:
                raise ValueError(f"mrp_mix={self.mrp_mix!r} is unknown; use one of {MRP_MIX_MODES}")
            if not _number("residual_delta", self.residual_delta) > 0.0:
                raise ValueError(f"residual_delta={self.residual_delta} must be > 0")
            if isinstance(self.mrp_scale, bool) or not isinstance(self.mrp_scale, numbers.Real) or \
                    not abs(self.mrp_scale) <= torch.finfo(torch.float32).max:
                raise ValueError(f"mrp_scale={self.mrp_scale!r} must be a finite float32 number (the weight of the "
                                 "MRP residual; 1.0 as trained)")
        if self.draft_vocab is not None:
            self.draft_vocab = normalize_draft_vocab(self.draft_vocab, config.vocab_size)
        if self.draft_candidates is not None:
            _int_at_least("draft_candidates", self.draft_candidates, 1)
            if self.draft_candidates > min(MAX_TOP_M, config.vocab_size - 1):
                raise ValueError(f"draft_candidates={self.draft_candidates} must be at most "
                                 f"{min(MAX_TOP_M, config.vocab_size - 1)} (64, and the vocabulary without the mask "
                                 "token); None drafts from the whole vocabulary")
            if self.draft_vocab is not None:
                raise ValueError("draft_candidates and draft_vocab both choose the tokens a draft scores: give one "
                                 "of them (one a call gives overrides the other's value in a generation config)")

    def _normalize_bans(self, vocab_size: int) -> None:
        """``suppress_tokens`` and ``begin_suppress_tokens`` as sorted tuples of distinct token ids (None when empty),
        the former with the ids of ``bad_words_ids`` (one token each) folded in."""
        banned = {}
        for name in IN_THE_BAN_TABLE:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise TypeError(f"{name} must be a list of token ids{' lists' if name == 'bad_words_ids' else ''}, "
                                f"got {type(value).__name__}")
            if name == "bad_words_ids":
                if not all(isinstance(w, Sequence) and not isinstance(w, (str, bytes)) for w in value):
                    raise TypeError(f"bad_words_ids must be a list of token id lists ([[id], ...], as in "
                                    f"transformers), got {reprlib.repr(value)}")
                several = [list(w) for w in value if len(w) != 1]
                if several:
                    raise ValueError(f"bad_words_ids {reprlib.repr(several)} are not single tokens: block diffusion "
                                     "decodes a block in no fixed order, so a ban on a token sequence has no last "
                                     "token to ban; ban single tokens ([[id], ...], or suppress_tokens)")
                value = [w[0] for w in value]
            banned[name] = {_token_id(name, i, vocab_size) for i in value}
        suppressed = banned.get("suppress_tokens", set()) | banned.get("bad_words_ids", set())
        self.suppress_tokens = tuple(sorted(suppressed)) or None
        self.begin_suppress_tokens = tuple(sorted(banned.get("begin_suppress_tokens", ()))) or None
        self.bad_words_ids = None

    def _check_a_first_token_is_left(self, config) -> None:
        """Refuse bans that leave a row no token to decode as its first new token (every later one may be any token
        its first may be): ``suppress_tokens`` (``bad_words_ids`` folded in), ``begin_suppress_tokens``, a
        ``sequence_bias`` of -inf, the EOS ids ``min_new_tokens`` holds back and the mask token, together."""
        sources = {"suppress_tokens": set(self.suppress_tokens or ()),
                   "begin_suppress_tokens": set(self.begin_suppress_tokens or ()),
                   "sequence_bias": {i for i, b in self.sequence_bias or () if b == float("-inf")},
                   "min_new_tokens": set(self.eos_ids) if self.min_new_tokens else set()}
        if len(set.union({config.mask_token_id}, *sources.values())) >= config.vocab_size:
            named = " and ".join(name for name, ids in sources.items() if ids)
            raise ValueError(f"{named} leave no token of the vocabulary ({config.vocab_size} ids, the mask token "
                             "never decoded) for a row's first new token: ban fewer tokens")

    def _normalize_bias(self, vocab_size: int) -> None:
        """``sequence_bias`` (transformers' dict of ``(id,)`` -> bias, or list of ``[[id], bias]``; a later pair for an
        id overrides an earlier one) as a sorted tuple of (token id, bias) pairs, or None when empty."""
        value = self.sequence_bias
        if value is None:
            return
        if isinstance(value, dict):
            value = list(value.items())
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(
                isinstance(pair, Sequence) and len(pair) == 2 for pair in value):
            raise TypeError(f"sequence_bias must be a dict of (token_id,) -> bias or a list of [[token_id], bias], "
                            f"got {reprlib.repr(self.sequence_bias)}")
        bias = {}
        for ids, b in value:
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or len(ids) != 1:
                raise ValueError(f"sequence_bias key {reprlib.repr(ids)} is not a single token: block diffusion "
                                 "decodes a block in no fixed order, so a bias on a token sequence has no last token "
                                 "to bias; bias single tokens ((id,) keys)")
            if _number("sequence_bias", b) != float("-inf") and not math.isfinite(b):
                raise ValueError(f"sequence_bias {b} for token {ids[0]} must be a finite number (or -inf: never "
                                 "decoded)")
            bias[_token_id("sequence_bias", ids[0], vocab_size)] = float(b)
        self.sequence_bias = tuple(sorted(bias.items())) or None


def _number(name: str, value) -> float:
    """``value`` as a float, if it is a real number (not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def _token_id(name: str, value, vocab_size: int) -> int:
    """``value`` as an int, if it is a token id of the vocabulary (an int, a numpy or 0-d torch integer)."""
    try:
        i = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        i = None
    if i is None or not 0 <= i < vocab_size:
        raise ValueError(f"{name} {value!r} is not a token id of the vocabulary [0, {vocab_size})")
    return i


def _check_sampling_value(name: str, value, why: str = "") -> None:
    """A usable ``temperature`` (:func:`check_temperature`), a ``top_k`` int >= 0 (0: no cut), a ``top_p``,
    ``top_h`` or ``typical_p`` in (0, 1], a ``min_p`` in [0, 1], an ``epsilon_cutoff`` or ``eta_cutoff`` in [0, 1)
    (transformers applies neither at 1 or above) (``why``: what the error adds)."""
    if name == "temperature":
        check_temperature(_number(name, value))
    elif name == "top_k":
        _int_at_least(name, value, 0, " (0 or None: no top-k cut)")
    elif name == "min_p":
        if not 0.0 <= _number(name, value) <= 1.0:
            raise ValueError(f"{name}={value} must be in [0, 1]{why}")
    elif name in ("epsilon_cutoff", "eta_cutoff"):
        if not 0.0 <= _number(name, value) < 1.0:
            raise ValueError(f"{name}={value} must be in [0, 1){why}")
    elif not 0.0 < _number(name, value) <= 1.0:
        raise ValueError(f"{name}={value} must be in (0, 1]{why}")


def _one_per_prompt(name: str, values, prompts: int | None, unit: str, single: str) -> tuple:
    """``values`` (a list or tuple given as ``name``, ``unit`` of them) as a tuple, refused unless it holds one per
    prompt (``prompts``; None: any number but none); ``single``: what the whole batch may have instead."""
    values = tuple(values)
    if not values or len(values) != (prompts or len(values)):
        raise ValueError(f"{name} has {len(values)} {unit} for {prompts or 'the'} prompts: give one per row of "
                         f"input_ids (or {single} for the whole batch)")
    return values


def _int_at_least(name: str, value, low: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}{why}")
