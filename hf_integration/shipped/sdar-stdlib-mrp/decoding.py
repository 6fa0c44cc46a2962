"""The block-diffusion decoding loop (every decision goes through mrp_triton ops).

Layout (SDAR's): row b holds its prompt, then masks up to ``ceil((P_b + max_new) / B) * B``; blocks are aligned
to position 0. Each row's full prompt blocks are prefilled in one forward. Then every row progresses on its own:
it denoises its current block with the chosen strategy and moves on to its next block as soon as this one is
full, while the other rows of the batch go on with theirs (rows of one forward sit at different positions over
caches of different lengths; the attention masks derive from the per-row lengths). A finished block's
keys/values (and the MRP head's) are written by the row's next forward (``fuse_commit``: the finished block
rides in front of the next block, or of its K+1 candidate copies) or by a forward of their own; only the
committing rows' finished positions are computed (a ragged forward, :class:`PendingCommit`; with CUDA graphs,
up to a batch bucket of rows: the extra rows' are written past their length and do not advance them). The host
checks which rows are full (one synchronisation) only after as many steps as surely leave every row with work
(:class:`Strategy`; with ``device_loop``, and the steps that may have work after them in one graph, each run
while no row has filled its block, tested on the device); a row finishes once it has committed its last new token,
or an EOS and every new token before it (the positions after are context, not decoded: each step ends by
settling such rows on the device, :meth:`BlockDecoder.settle`), and leaves the batch, so it stops costing work
(with CUDA graphs, once the rows left fit a smaller batch bucket: until then it rides along as padding).
Strategies run whole steps through :meth:`BlockDecoder.step`, which with CUDA graphs on replays each kind of step
(forwards and decisions) as one graph.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import ModelOutput
from transformers.utils.logging import tqdm

import mrp_triton
from mrp_triton.reference.confidence import CUTS, exclude_banned, inverse_temperature, penalties_applied
from mrp_triton.reference.lm_head_confidence import top_by_value

from .decode_engine import BAN_EOS, BAN_FIRST, BAN_SUPPRESS, DecodeStats, EngineShape, engine_for
from .draft_candidates import refresh_vocab_mean
from .draft_vocab import DraftHead, draft_head
from .generation_settings import MRP_STRATEGIES, PER_PROMPT, PER_PROMPT_PENALTIES, GenerationSettings
from .kv_cache import AttentionInputs
from .prompts import PromptBatch
from .step_graphs import conditional_nodes_supported, run_if
from .stop_strings import StopStrings
from .stopping_criteria import CriteriaCheck
from .streaming import BlockStream

# the penalties' tables by token id, [rows, V] (DecodeEngine.seen and the logit offsets: BlockDecoder.penalties)
TABLES = ("seen_tokens", "logit_offsets")
# and the bias by token id, [V] (DecodeEngine.bias)
BIAS = "logit_bias"


def by_token(seen: dict, table, bias) -> dict:
    """``seen`` (:meth:`BlockDecoder.penalties`) with its operands indexed by token id mapped: ``table`` applied to
    each table [rows, V], ``bias`` to the bias [V]; the other arguments as they are."""
    return {name: table(value) if name in TABLES else bias(value) if name == BIAS else value
            for name, value in seen.items()}


@dataclass
class PendingCommit:
    """Finished blocks waiting for their keys and values to be written (by the rows' next forward with
    ``fuse_commit``, else by a forward of their own).

    ids, positions: [B, n] (rows that do not commit hold positions past their current block: nobody attends to
    them); counted: a forward of their own is charged to the committing rows as a commit forward; rows: bool [B],
    the rows that commit; riders: int64 [R], increasing, the rows whose n positions the forward computes: the
    committing rows and, with CUDA graphs, other rows up to the next batch bucket (few sizes to capture). With
    R < B the forward is ragged (``AttentionInputs.tokens``): the other rows' n positions cost nothing."""

    ids: torch.Tensor
    positions: torch.Tensor
    counted: bool
    rows: torch.Tensor
    riders: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """ids, positions, rows, riders: what a captured step takes as inputs."""
        return self.ids, self.positions, self.rows, self.riders


@dataclass
class SDARGenerateOutput(ModelOutput):
    """sequences: [B, P + max_new_tokens]; stats: :class:`DecodeStats` (per row); batch_steps: the decoding
    steps the batch ran, each one forward over the rows still decoding (denoising, verify round or direct
    MRP step; the prefill and commit-only forwards not counted): what the call costs when a forward costs
    about the same for any number of rows, as on a GPU at small batch. reveal_steps (``output_reveal_steps``):
    int64 [B, P + max_new_tokens], laid out as ``sequences``: at each new token the row's decoding step that
    revealed it for good (1, 2, ...: the row's denoising steps, speculative rounds, direct backbone and MRP steps,
    counted over the whole call), 0 at prompt and padding positions. confidences (``output_confidences``): float32
    [B, P + max_new_tokens], laid out as ``sequences``: at each new token its probability under the softmax that
    committed it for good (that of the call's temperature, without the mask token and the tokens the call bans there,
    under its penalties and bias, before any sampling filter's cut: the confidence the commit rules rank by), the
    backbone's (a speculative round's tokens: the verify forward's on the candidate state each was verified on, so
    greedy speculative decoding gives static one-token-a-step decoding's; remask's: that of the reveal the MRP pass
    let stand), save those of direct decoding's MRP steps (the head's corrected logits'); 0 at prompt and padding
    positions. top_logprobs and top_token_ids (``output_top_logprobs=k``): float32 and int64 [B, P + max_new_tokens,
    k], laid out as ``sequences``: at each new token the k most likely tokens of that same softmax (most likely first,
    ties to the lowest id; the committed token among them when it is one of the k most likely) and their
    log-probabilities; -inf and -1 at prompt and padding positions (and past the tokens a softmax has). new_tokens:
    int64 [B], the new tokens each row
    keeps in ``sequences`` (up to its first EOS, the end of a stop string or the token a stopping criterion stopped
    at; the rest is padding), which may be fewer than ``stats.tokens_committed`` (a verify round or a denoising step
    can commit tokens past the EOS)."""

    sequences: torch.Tensor | None = None
    stats: DecodeStats | None = None
    batch_steps: int | None = None
    reveal_steps: torch.Tensor | None = None
    confidences: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    new_tokens: torch.Tensor | None = None


class BlockDecoder:
    """State of one ``generate`` call: the token layout, the KV cache, per-row progress and stats."""

    def __init__(self, model, prompts: PromptBatch, settings: GenerationSettings):
        config = model.config
        self.model, self.settings = model, settings
        self.mask_id = config.mask_token_id
        self.block = T = settings.block_length
        device = prompts.ids.device
        self.device = device
        copies = settings.num_return_sequences
        # per original row, the most new tokens it decodes
        limits = [n for n in settings.new_tokens_per_prompt(len(prompts.lens) // copies) for _ in range(copies)]
        ends = prompts.block_ends(limits, T, config.max_position_embeddings)
        total = max(ends)
        graphed = settings.cuda_graphs if settings.cuda_graphs is not None else device.type == "cuda"
        if settings.device_loop and not graphed:
            raise ValueError("device_loop=True runs a block's steps inside one CUDA graph: it needs cuda_graphs "
                             "(on by default for a CUDA model; cuda_graphs=True replays the recorded steps on a "
                             "CPU model)")
        if settings.device_loop and device.type == "cuda" and not conditional_nodes_supported():
            raise ValueError(f"device_loop=True needs CUDA-graph conditional nodes (torch >= 2.12); this is torch "
                             f"{torch.__version__}: upgrade torch or drop device_loop")
        # A graphed engine decodes a batch bucket: the rows past the prompts' are padding (one full block,
        # nothing to decode), so calls whose batches share a bucket share the engine and its graphs.
        real = len(prompts.lens)
        self.criteria = None if settings.stopping_criteria is None else CriteriaCheck(
            settings.stopping_criteria, prompts, settings.max_new_tokens, settings.eos_ids, settings.pad_token_id,
            self.mask_id)
        self.prompts = prompts = prompts.with_padding_rows(_graphed_batch(real) - real if graphed else 0)
        lens = torch.tensor(prompts.lens, device=device)
        B = lens.shape[0]
        self.x = torch.full((B, total), self.mask_id, dtype=torch.long, device=device)
        self.x[:, : prompts.ids.shape[1]] = torch.where(
            torch.arange(prompts.ids.shape[1], device=device)[None, :] < lens[:, None], prompts.ids, self.mask_id)
        self.filler = 0 if self.mask_id else 1  # a token that is not the mask: what padding rows hold
        self.x[real:] = self.filler
        self.first_blocks = [n // T for n in prompts.lens]  # each row's first block with masks (host)
        self.first_block = torch.tensor(self.first_blocks, device=device)
        self.blocks_to_decode = [end // T - first for end, first in zip(ends, self.first_blocks)] + [0] * (B - real)
        self.limits = limits + [settings.max_new_tokens] * (B - real)
        # the rows whose prefill computes their prompt's blocks: all but the later copies of a prompt, which get the
        # first copy's keys and values
        self.computes_prompt = [b % copies == 0 or b >= real for b in range(B)]
        # The positions a row's last block keeps (host, per working row): up to its last new token.
        self.last_block_kept = [(n + limit - 1) % T + 1 for n, limit in zip(prompts.lens, self.limits)]
        self.uses_mrp = settings.strategy in MRP_STRATEGIES
        # Before the engine: packing may move the weights' storage, which keys a graphed engine.
        self.packed = settings.packed_projections and model.pack_projections()
        slots = config.num_hidden_layers + (config.num_nextn_predict_layers if self.uses_mrp else 0)
        width = _graphed_width(total, config.max_position_embeddings) if graphed else total
        shape = EngineShape(slots, B, width, config.num_key_value_heads, config.head_dim, model.lm_head.weight.dtype,
                            device, T, settings.mrp_steps if settings.strategy == "speculative" else 0)
        self.engine = engine_for(model, shape, graphed)
        self.engine.use_settings(settings)
        self.engine.use_layout(lens, lens + torch.tensor(self.limits, device=device))
        self.cache, self.graphs = self.engine.cache, self.engine.graphs
        self.settings_key = settings.step_key()
        self.draft = None if settings.draft_vocab is None else draft_head(
            model.lm_head.weight, settings.draft_vocab, self.mask_id, self.engine.draft_rows)
        if settings.draft_candidates:
            self.engine.vocab_mean = refresh_vocab_mean(model.lm_head.weight, self.engine.vocab_mean)
        self.pending: PendingCommit | None = None  # finished blocks whose commit waits for the next forward
        self.row_state: dict[str, torch.Tensor] = {}  # per working row [B', ...]: follows the rows as they leave
        self.all_fresh = True  # every working row is at the start of a block (host)
        self.block_steps = 0  # steps since every working row last opened a block: where a synchronous strategy is
        self.steps_launched = 0  # steps launched one by one
        self.loop_steps = 0  # steps run inside device loops (read back at each check of the rows)
        self.loop_slots = 0  # steps the next device loop may run (0: no loop)
        # Replayed steps without a device loop, when an EOS may settle a row before the schedule's check: the host
        # reads after each step whether the step before it left work (LaggedFlags), and stops there.
        self.lagged_checks = self.graphs is not None and not settings.device_loop and bool(settings.eos_ids)
        # per original row, its stop strings (None: it has none)
        self.stops = None if settings.stop_strings is None else [
            StopStrings(settings.tokenizer, strings) if strings else None
            for strings in settings.stops_per_prompt(real // copies) for _ in range(copies)]
        self.new_tokens_kept: dict[int, int] = {}  # original row -> new tokens it keeps (a stop ended it)
        # original row -> the most new tokens it keeps, where fewer than the call's max_new_tokens
        self.row_limits = {r: limit for r, limit in enumerate(limits) if limit < settings.max_new_tokens}
        self.deadline = None if settings.max_time is None else time.monotonic() + settings.max_time
        self.stream = None if settings.streamer is None else BlockStream(
            settings.streamer, prompts.ids[0, : prompts.lens[0]], settings.max_new_tokens, settings.eos_ids, T)

    @property
    def batch_steps(self) -> int:
        """Decoding steps the batch has run (see :class:`SDARGenerateOutput`), as of the last check of the rows."""
        return self.steps_launched + self.loop_steps

    @property
    def rows(self) -> torch.Tensor:
        """int64 [B']: the original rows still decoding (the working batch; they key noise and stats)."""
        return self.engine.rows

    @property
    def counter(self) -> torch.Tensor:
        """int64 [B']: tokens each working row has committed so far (the state index in the noise key)."""
        return self.engine.counter

    def on_device(self, name: str) -> torch.Tensor | None:
        """The 0-d tensor the steps read setting ``name`` from (``DecodeEngine.on_device``; float64), or None
        when it is not set; a captured step reads its value at every replay, so graphs serve every value."""
        return None if getattr(self.settings, name) is None else self.engine.on_device[name]

    def sampling_cuts(self, T: int) -> dict:
        """The filters a sampled pick over the B' * T rows of a step's flattened [B', T] positions applies (keyword
        arguments of the confidence ops, named by ``CUTS``: top_h, top_k, top_p, min_p, typical_p, epsilon_cutoff,
        eta_cutoff), each the 0-d tensor the steps read it from (None where not set; given per prompt: each
        position's, [B' * T]); none when greedy (the most likely token is always kept)."""
        if not self.settings.do_sample:
            return {}
        cuts = {name: self.on_device(name) for name in CUTS}
        for name, lists in PER_PROMPT.items():
            if name in cuts and getattr(self.settings, lists) is not None:
                cuts[name] = self.per_row(lists, T)
        return cuts

    def per_row(self, name: str, T: int = 1) -> torch.Tensor:
        """float64 [B' * T]: each working row's value (T times, for a step's flattened [B', T] positions) of a setting
        the call gives per prompt (``name``: its list's, :data:`.PER_PROMPT`; read on the device, so one set of
        captured steps serves every list)."""
        values = self.engine.per_row[name][self.rows]
        return values if T == 1 else values.repeat_interleave(T)

    def sampling_rows(self, T: int) -> bool | torch.Tensor:
        """The ops' ``do_sample`` for the B' * T rows of a step's flattened [B', T] positions: the call's, or with
        ``do_sample`` given per prompt whether each position's row samples (bool [B' * T])."""
        if self.settings.sampling is None:
            return self.settings.do_sample
        return self.per_row("sampling", T) != 0

    @property
    def temperature(self) -> torch.Tensor | float:
        """What the logits are divided by: the temperature (on the device: 0-d, or with one per prompt each working
        row's, [B']) when sampling, else 1."""
        if not self.settings.do_sample:
            return 1.0
        return self.on_device("temperature") if self.settings.temperatures is None else self.per_row("temperatures")

    def temperature_by_position(self, T: int) -> torch.Tensor | float:
        """:attr:`temperature` for the B' * T rows of a step's flattened [B', T] positions."""
        if self.settings.do_sample and self.settings.temperatures is not None:
            return self.per_row("temperatures", T)
        return self.temperature

    @property
    def stats(self) -> DecodeStats:
        """Per original row [B] (the engine's buffers: clone them to keep them past the call)."""
        return self.engine.stats

    # ---------------------------------------------------------------------------------- forwards
    def _attn(self, positions: torch.Tensor, segments: torch.Tensor | None = None, write_len: int = 0,
              tokens: torch.Tensor | None = None, riders: torch.Tensor | None = None):
        return AttentionInputs(cache=self.cache, write_len=write_len, positions=positions, segments=segments,
                               block_size=self.block, packed=self.packed, rope=self.engine.rope, tokens=tokens,
                               riders=riders)

    def graphed(self, key: tuple, fn, *inputs: torch.Tensor, mutated: tuple[int, ...] = (), branches: bool = False):
        """``fn(*inputs)``; with CUDA graphs on, replayed from the graph of ``key`` + the input shapes (see
        :class:`StepGraphs` for what ``fn`` may read and update)."""
        if self.graphs is None:
            return fn(*inputs)
        return self.graphs.run((*key, *(tuple(t.shape) for t in inputs)), fn, *inputs, mutated=mutated,
                               branches=branches)

    def _forward(self, kind: str, write_len: int, run, ids: torch.Tensor, positions: torch.Tensor,
                 *inputs: torch.Tensor, **optional: torch.Tensor | None):
        """``run(ids, positions, *inputs, attn=...)``, a forward over the cache, graphed by (kind, write_len, which
        ``optional`` inputs it has, input shapes); ``optional``: ``AttentionInputs`` fields (segments; tokens and
        riders for a ragged forward, where ``run`` gets ids and positions [1, L] at the computed places). Forwards
        that write more than one block (the prefill) run once and are not worth a capture."""
        optional = {name: t for name, t in optional.items() if t is not None}

        def forward(ids: torch.Tensor, positions: torch.Tensor, *values: torch.Tensor):
            split = len(values) - len(optional)
            attn = self._attn(positions, write_len=write_len, **dict(zip(optional, values[split:])))
            if attn.tokens is not None:
                ids, positions = attn.from_grid(ids), attn.from_grid(positions)
            return run(ids, positions, *values[:split], attn=attn)

        values = (ids, positions, *inputs, *optional.values())
        if write_len > self.block:
            return forward(*values)
        return self.graphed((kind, write_len, self.packed, *optional), forward, *values)

    def step(self, name: str, fn, *inputs: torch.Tensor, mutated: tuple[int, ...] = ()):
        """One whole decoding step ``fn(*inputs)``: its forwards and the decode ops between them, graphed as
        one by (name, settings, input shapes), so a step costs one launch. ``fn`` reads the decoder's
        per-row state (``rows``, ``counter``, ``stats``: fixed buffers) and its inputs, and updates the
        inputs in ``mutated`` in place; ``inputs[0]`` is the block [B, T] (always mutated: the step ends with
        :meth:`settle`), ``inputs[1]`` its positions. The first step after rows finished blocks carries their pending
        commit (``fuse_commit``): the finished ids, positions and committing rows become inputs of its
        graph, so the commit rides along in the same launch. Only the prefill (longer than a block, once per
        call) runs as it is, each of its forwards graphed on its own."""
        self.steps_launched += 1
        self.block_steps += 1
        fn = self._settling(fn)
        pending = self.pending
        if pending is None:
            return self.graphed((name, self.settings_key), fn, *inputs, mutated=mutated)
        if pending.ids.shape[1] > self.block:
            return fn(*inputs)
        self.pending = None

        def with_commit(ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, riders: torch.Tensor,
                        *inputs: torch.Tensor):
            self.pending = PendingCommit(ids, positions, pending.counted, rows, riders)
            output = fn(*inputs)
            self.flush()  # a step that read neither the backbone nor the head still writes the block
            return output

        commit = pending.tensors()
        return self.graphed((name, "commit", pending.counted, self.settings_key), with_commit, *commit, *inputs,
                            mutated=tuple(i + len(commit) for i in mutated))

    def _settling(self, fn):
        """``fn``, a step over inputs (block, positions, ...), followed by :meth:`settle` of its block (and, with
        ``output_reveal_steps``, by :meth:`note_reveals`)."""
        reveals = self.settings.output_reveal_steps

        def settled(*inputs: torch.Tensor):
            block, positions = inputs[0], inputs[1]
            before = self.masked_kept(block, positions) if reveals else None
            output = fn(*inputs)
            self.settle(block, positions)
            if before is not None:
                self.note_reveals(block, positions, before)
            return output

        return settled

    def note_reveals(self, block: torch.Tensor, positions: torch.Tensor, before: torch.Tensor) -> None:
        """After a step (on the device): count it as a decoding step of the rows that had kept masks ``before`` it
        (bool [B', T]; :meth:`masked_kept`) and note it as the reveal step of each such position it unmasked in
        ``block`` [B', T] (at ``positions``), in the engine's ``decoding_steps`` and ``reveal_steps``. A position that
        a later step reveals again (after a remask) is noted again; positions that a settled row drops are dropped
        from the output with it."""
        engine = self.engine
        step = engine.decoding_steps[self.rows] + before.any(-1).long()
        engine.decoding_steps[self.rows] = step
        self._note_at(engine.reveal_steps, positions, before & (block != self.mask_id), step[:, None])

    def note_confidences(self, positions: torch.Tensor, committed: torch.Tensor, conf: torch.Tensor,
                         top: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """With ``output_confidences`` (on the device): note ``conf`` [B', T] of the tokens a step ``committed``
        (bool [B', T]) at ``positions`` [B', T] in the engine's ``confidences`` (a position that a later step commits
        again, after a remask, is noted again); with ``output_top_logprobs``, ``top`` too (the top log-probabilities
        and their token ids, [B', T, k] each: :meth:`split_top`) in the engine's ``top_notes``."""
        if self.settings.output_confidences:
            self._note_at(self.engine.confidences, positions, committed, conf)
        if top is not None:
            for buffer, values in zip(self.engine.top_notes[self.settings.output_top_logprobs], top):
                self._note_at(buffer, positions, committed, values)

    def split_top(self, picks: tuple, top_m: int) -> tuple[tuple, tuple[torch.Tensor, torch.Tensor] | None]:
        """The picks of :meth:`pick_hidden` asked for :meth:`top_lists` ``(top_m)`` lists -> (the picks as asked for
        with ``top_m`` (their lists cut to top_m; none for 0), with ``output_top_logprobs=k`` the first k of the
        lists as log-probabilities (the top logits over temperature minus the lse, at most 0: both are fp32 numbers,
        whose rounding at a small temperature may put a top logit past the lse) and their token ids, [..., k] each,
        else None)."""
        k = self.settings.output_top_logprobs
        if not k:
            return picks, None
        *head, top, ids = picks
        lists = (top[..., :top_m], ids[..., :top_m]) if top_m else ()
        return (*head, *lists), ((top[..., :k] - picks[2][..., None]).clamp(max=0.0), ids[..., :k])

    def top_lists(self, top_m: int = 0) -> int:
        """How many top logits a committing pick asks :meth:`pick_hidden` for: ``top_m`` (a draft's candidates), and
        with ``output_top_logprobs`` at least that many (:meth:`split_top` parts them)."""
        return max(top_m, self.settings.output_top_logprobs)

    def _note_at(self, buffer: torch.Tensor, positions: torch.Tensor, where: torch.Tensor,
                 values: torch.Tensor) -> None:
        """``values`` (broadcast to [B', T, ...]) into ``buffer`` [B, max_len, ...] (by original row) at ``positions``
        [B', T] ``where`` (bool [B', T]); the other positions keep theirs."""
        rows = self.rows[:, None].expand_as(positions)
        where = where[(...,) + (None,) * (buffer.dim() - 2)]
        buffer[rows, positions] = torch.where(where, values.to(buffer.dtype), buffer[rows, positions])

    def steps(self, kinds: tuple, *inputs: torch.Tensor, count: int, mutated: tuple[int, ...] = (),
              carry: tuple[int, ...] = (), phase: int = 0) -> None:
        """``count`` steps that surely have work, each as :meth:`step`, then, with ``device_loop``, up to ``loop_slots``
        steps that may have work in one graph, each run only while some row has masks and no :meth:`watched` row has
        filled its block (a settled row has no masks: :meth:`settle`), tested on the device; so the host checks the
        rows once a block fills, not after every step. Replayed steps without a device loop, where an EOS may settle
        a row (``lagged_checks``: then only the first of the ``count`` surely has work), test the same after each step
        and the host reads it a step late (:class:`LaggedFlags`): the steps stop one step after the one that left
        no work, the device never idle for the read. ``kinds``: ((name, fn), ...), the kinds of step in turn, the
        first at index ``phase``; every ``fn(*inputs)`` takes the same inputs (with ``carry``, it returns one tensor
        per index in it, which replaces that input in place: the next step's seed). ``inputs[0]`` is the block
        [B, T], ``inputs[1]`` its positions."""
        lagged = self.engine.lagged_flags if self.lagged_checks and count > 1 else None
        if lagged is not None:
            lagged.start(count)
            watched = torch.tensor(self.watched(), device=self.device)
        for i in range(count):
            name, fn = kinds[(phase + i) % len(kinds)]
            _carry_over(inputs, carry, self.step(name, fn, *inputs, mutated=mutated))
            if lagged is not None:
                lagged.push(self._busy(inputs[0], watched))
                if i and not lagged.read(i - 1):
                    return  # the step before this one left the rows as only the host may move them on
        if not self.loop_slots:
            return
        slots, loop_steps = self.loop_slots, self.engine.loop_steps
        busy = self._busy

        def body_of(fn):
            def body(go: torch.Tensor, watched: torch.Tensor, *inputs: torch.Tensor) -> None:
                _carry_over(inputs, carry, fn(*inputs))
                loop_steps.add_(1)
                go.copy_(busy(inputs[0], watched))

            return body

        bodies = [body_of(self._settling(fn)) for _, fn in kinds]
        first = (phase + count) % len(kinds)

        def loop(watched: torch.Tensor, *inputs: torch.Tensor) -> None:
            go = busy(inputs[0], watched)
            for j in range(slots):
                run_if(go, bodies[(first + j) % len(kinds)], go, watched, *inputs)

        watched = torch.tensor(self.watched(), device=self.device)
        changed = tuple(i + 1 for i in (*mutated, *carry))
        names = tuple(name for name, _ in kinds)
        self.graphed(("loop", names, slots, first, self.settings_key), loop, watched, *inputs, mutated=changed,
                     branches=True)

    def _busy(self, block: torch.Tensor, watched: torch.Tensor) -> torch.Tensor:
        """0-d bool: whether the next step has work the host need not see first: some row of ``block`` [B', T] has
        masks, and every ``watched`` (bool [B']) row still has some."""
        has_masks = self.masked(block).any(-1)
        return has_masks.any() & (has_masks | ~watched).all()

    def watched(self) -> list[bool]:
        """Per working row (host): whether the steps must stop once its block is done (no kept masks), for the
        host to move it on: every row with blocks left; with rows moving on together, only a row decoding a last
        block that ends before the block does (past its last new token a row stops, whatever the others do)."""
        if not self.together:
            return [b > 0 for b in self.blocks_left]
        return self.in_short_last_block()

    def in_short_last_block(self) -> list[bool]:
        """Per working row (host): whether it decodes its last block and that block goes on past its last new
        token (positions that are context only: :meth:`masked_kept`)."""
        return [b == 1 and kept < self.block for b, kept in zip(self.blocks_left, self.last_block_kept)]

    def _backbone_forward(self, ids: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor | None = None,
                          write_len: int = 0, **ragged: torch.Tensor) -> torch.Tensor:
        """ids, positions: [B, T] -> h_A [B, T, H]; ragged (``tokens`` [L] and ``riders``, see ``AttentionInputs``):
        h_A [1, L, H] of the computed places."""
        def run(ids, positions, attn):
            return self.model.model(ids, positions, attn=attn)

        return self._forward("backbone", write_len, run, ids, positions, segments=segments, **ragged)

    def _mrp_forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                     write_len: int = 0, **ragged: torch.Tensor) -> torch.Tensor:
        """ids, positions: [B, T], hidden: [B, T, H] -> h_p [B, T, H]; ragged (``tokens`` [L] and ``riders``):
        hidden and h_p are [1, L, H], the computed places only."""
        def run(ids, positions, hidden, attn):
            return self.model.mrp_forward(ids, hidden, positions, attn=attn)

        return self._forward("mrp", write_len, run, ids, positions, hidden, **ragged)

    def backbone(self, ids: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor | None = None,
                 write_len: int = 0) -> torch.Tensor:
        """ids, positions: [B, T] -> h_A [B, T, H] over the committed prefix (writes ``write_len`` positions).

        Finished blocks waiting for their commit (``fuse_commit``) ride along in front of the rows' next
        forward (a denoising forward, or the K+1 ``segments`` of a verify forward, which all see them): one
        forward fewer per block, the same keys and values."""
        if self.pending is not None and write_len == 0:
            pending, self.pending = self.pending, None
            if segments is not None:
                segments = torch.cat([segments.new_full((pending.ids.shape[1],), -1), segments])
            return self._write_finished(pending, torch.cat([pending.ids, ids], 1),
                                        torch.cat([pending.positions, positions], 1), segments)
        self.flush()
        return self._backbone_forward(ids, positions, segments, write_len)

    def mrp(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, write_len: int = 0,
            committing_rows_discard: bool = False):
        """The MRP head over the committed prefix: ids [B, T], hidden [B, T, H] -> h_p [B, T, H]. With
        ``committing_rows_discard`` the rows whose finished block waits for its commit ignore this output
        (they are at the start of a new block), so the commit may still ride on the next backbone forward."""
        if not committing_rows_discard:
            self.flush()
        return self._mrp_forward(ids, hidden, positions, write_len)

    def _write_finished(self, pending: PendingCommit, ids: torch.Tensor, positions: torch.Tensor,
                        segments: torch.Tensor | None = None) -> torch.Tensor:
        """One backbone forward over ids, positions [B, T] whose first n positions are ``pending``'s finished
        blocks: writes their keys and values (and the MRP head's, from the same h_A), makes them committed for
        the committing rows only, and returns h_A of the positions after them, [B, T - n, H]. Only the riders'
        finished blocks are computed (a ragged forward when they are not every row)."""
        (B, T), n, R = ids.shape, pending.ids.shape[1], pending.riders.shape[0]
        if R == B:
            hidden = self._backbone_forward(ids, positions, segments, write_len=n)
            finished, rest, ragged = hidden[:, :n], hidden[:, n:], {}
        else:
            hidden = self._backbone_forward(ids, positions, segments, write_len=n, riders=pending.riders,
                                            tokens=ride_tokens(pending.riders, n, B, T))
            finished, rest = hidden[:, : R * n], hidden[0, R * n:].view(B, T - n, hidden.shape[-1])
            ragged = dict(tokens=ride_tokens(pending.riders, n, B, n), riders=pending.riders)
        if self.uses_mrp:
            self._mrp_forward(pending.ids, finished, pending.positions, write_len=n, **ragged)
        self.cache.advance(n, pending.rows)
        return rest

    def commit(self, ids: torch.Tensor, positions: torch.Tensor, counted: bool = True,
               rows: list[bool] | None = None) -> None:
        """Finished positions ids [B, T] of ``rows`` (host bools [B]; default all) go to the cache: with the rows'
        next forward (``fuse_commit``) or at once (then ``counted`` charges those rows a commit forward).
        Positions of the other rows must lie past their current block (nobody attends to them)."""
        self.flush()
        rows = [True] * ids.shape[0] if rows is None else rows
        self.pending = PendingCommit(ids, positions, bool(counted), torch.tensor(rows, device=self.device),
                                     self._riders(rows))
        if not self.settings.fuse_commit:
            self.flush()

    def _riders(self, rows: list[bool]) -> torch.Tensor:
        """int64 [R]: the committing ``rows`` and, with CUDA graphs, the first others up to the next batch bucket
        (:func:`_graphed_batch`), increasing (see :class:`PendingCommit`)."""
        committing = [i for i, commits in enumerate(rows) if commits]
        size = len(committing) if self.graphs is None else min(_graphed_batch(len(committing)), len(rows))
        others = [i for i, commits in enumerate(rows) if not commits]
        return torch.tensor(sorted(committing + others[: size - len(committing)]), dtype=torch.long,
                            device=self.device)

    def flush(self) -> None:
        """Write pending finished blocks in a forward of their own."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._write_finished(pending, pending.ids, pending.positions)
            if pending.counted:
                self.count("commit_forwards", pending.rows)

    # --------------------------------------------------------------------------------- decisions
    def mask_among(self, vocab: int) -> int | None:
        """The mask token id when it is among the first ``vocab`` ids (the columns a pick reads), else None."""
        return self.mask_id if self.mask_id < vocab else None

    def noise_keys(self, positions: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        """int64 [B, T, 3]: the sampling noise key (row, position, state) of each position; positions: [B, T],
        counter: [B] or [B, T] (the state index). The seed sits in the first column with the row
        (:func:`.decode_engine.noise_rows`), not in the ops' seed argument, which a captured step would bake in."""
        B, T = positions.shape
        return torch.stack([self.engine.noise_rows[self.rows][:, None].expand(B, T), positions,
                            counter.expand(B, T) if counter.dim() == 2 else counter[:, None].expand(B, T)], dim=-1)

    def noise_counter(self, offset: int | torch.Tensor = 0) -> torch.Tensor | None:
        """The state index of the sampling noise key: ``counter + offset`` ([B], or [B, n] for an offset [n]); None
        when not sampling (greedy picks read no noise, and a step computes no keys for them)."""
        if not self.settings.do_sample:
            return None
        return self.counter + offset if isinstance(offset, int) else self.counter[:, None] + offset

    def token_bans(self, positions: torch.Tensor, vocab: int | None = None, draft: DraftHead | None = None) -> dict:
        """The ops' ``banned_tokens`` / ``ban_rows`` arguments for the positions [B, T]: each position's classes of
        ban (``decode_engine.BAN_*`` bits): EOS before the row's ``min_new_tokens``-th new token (the minimum read on
        the device), ``suppress_tokens`` everywhere, ``begin_suppress_tokens`` at the row's first new token; and the
        classes of each column the op scores (``engine.ban_table``: its first ``vocab`` ids, or ``draft``'s columns).
        Empty when the call bans nothing."""
        s, engine = self.settings, self.engine
        if s.min_new_tokens is None and s.suppress_tokens is None and s.begin_suppress_tokens is None:
            return {}
        table = engine.ban_table[:vocab] if draft is None else draft.columns(engine.ban_table)
        starts = engine.starts[:, None]
        classes = torch.full_like(positions, BAN_SUPPRESS if s.suppress_tokens is not None else 0, dtype=torch.uint8)
        if s.min_new_tokens is not None:
            classes |= (positions < starts + engine.on_device["min_new_tokens"]).to(torch.uint8) * BAN_EOS
        if s.begin_suppress_tokens is not None:
            classes |= (positions == starts).to(torch.uint8) * BAN_FIRST
        return dict(banned_tokens=table, ban_rows=classes.reshape(-1))

    @property
    def penalizing(self) -> bool:
        """Whether the picks depend on the tokens before them (a repetition, presence or frequency penalty) or add a
        bias: they then need :meth:`penalties`."""
        s = self.settings
        return s.repetition_penalty is not None or s.counts_tokens or s.sequence_bias is not None

    def penalties(self, states: torch.Tensor) -> dict:
        """The picks' penalty arguments (the ``seen`` of :meth:`pick`, :meth:`pick_hidden` and :meth:`pick_listed`)
        for picks over the block states [B, T] or [B, C, T] (C candidate states of each row; the picks' rows are the
        states' positions, flattened), over the whole vocabulary: with a repetition penalty each state's row of tokens
        seen, its row's (prompt and finished blocks: ``engine.seen``) with the state's own tokens (its mask tokens
        too: the mask column is never picked); with presence / frequency penalties each state's row of logit offsets,
        ``-presence * (count > 0) - frequency * count`` with the count of each token the row generated: its row's
        (``engine.counts``) with the state's own tokens; with a sequence bias, the bias by token id (``engine.bias``).
        Empty without any."""
        settings = self.settings
        if not self.penalizing:
            return {}
        s = states if states.dim() == 3 else states[:, None]
        B, C, T = s.shape
        flat = s.reshape(B * C, T)
        out = {} if settings.sequence_bias is None else {BIAS: self.engine.bias}
        if settings.repetition_penalty is not None or settings.counts_tokens:
            out["seen_rows"] = torch.arange(B * C * T, device=s.device) // T
        if settings.repetition_penalty is not None:
            out.update(repetition_penalty=self.on_device("repetition_penalty"),
                       seen_tokens=self.engine.seen[:B].repeat_interleave(C, 0).scatter_(1, flat, True))
        if settings.counts_tokens:
            counts = self.engine.counts[:B].repeat_interleave(C, 0).scatter_add_(
                1, flat, torch.ones(flat.shape, device=flat.device))
            offsets = torch.zeros_like(counts)
            for name, term in (("frequency_penalty", counts), ("presence_penalty", counts > 0)):
                weight = self.penalty_weight(name, C)
                if weight is not None:
                    offsets.sub_(weight * term)
            out["logit_offsets"] = offsets
        return out

    def penalty_weight(self, name: str, C: int) -> torch.Tensor | None:
        """The presence or frequency penalty (``name``) as read on the device: 0-d float32, or given per prompt, each
        working row's [B' * C, 1] (C states a row); None when not set."""
        lists = PER_PROMPT_PENALTIES[name]
        if getattr(self.settings, lists) is not None:
            return self.per_row(lists).float().repeat_interleave(C)[:, None]
        return None if getattr(self.settings, name) is None else self.on_device(name).float()

    def _penalty(self, seen: dict | None, vocab: int | None = None) -> dict:
        """``seen`` (:meth:`penalties`) as the keyword arguments of a pick among the first ``vocab`` ids (a draft
        vocabulary of the ids below it; None: all); a pick under a penalty must be given it."""
        if seen is None and self.penalizing:
            raise RuntimeError("a pick under a penalty needs the penalties' arguments (a bug)")
        return by_token(seen or {}, lambda table: table[:, :vocab], lambda bias: bias[:vocab])

    def see(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Note the finished blocks ``ids`` [R, T] of the working ``rows`` [R]: as seen, with a repetition penalty
        (``engine.seen``), and counted, with presence / frequency penalties (``engine.counts``)."""
        if self.settings.repetition_penalty is not None:
            self.engine.seen[rows] = self.engine.seen[rows].scatter_(1, ids, True)
        if self.settings.counts_tokens:
            self.engine.counts[rows] = self.engine.counts[rows].scatter_add_(
                1, ids, torch.ones(ids.shape, device=ids.device))

    def pick(self, logits: torch.Tensor, positions: torch.Tensor, candidates: torch.Tensor,
             counter: torch.Tensor | None, entropy: bool = False, seen: dict | None = None):
        """Per position the token to commit and its confidence (never the mask token, nor a token the call bans there:
        :meth:`token_bans`).

        logits: [B, T, V], positions: [B, T], candidates: bool [B, T] (positions to score),
        counter: [B] or [B, T] (the state index in the noise key; :meth:`noise_counter`, None when not sampling);
        seen: the penalties' arguments for the block states the logits were computed from
        (:meth:`penalties`; required under a penalty).
        Returns tokens int64 [B, T] (-1 where not scored), conf float32 [B, T], lse float32 [B, T], and with
        ``entropy`` the entropy of each position's softmax, float32 [B, T]."""
        s = self.settings
        B, T, V = logits.shape
        # the temperature and the filters are read on the device too
        keys = self.noise_keys(positions, counter).reshape(B * T, 3) if s.do_sample else None
        picks = mrp_triton.confidence(
            logits.reshape(B * T, V), temperature=self.temperature_by_position(T), skip_rows=~candidates.reshape(-1),
            mask_token_id=self.mask_among(V), **self.token_bans(positions, V), **self._penalty(seen, V),
            do_sample=self.sampling_rows(T), seed=0, noise_keys=keys, top_k_max=s.top_k_max, **self.sampling_cuts(T),
            entropy=entropy)
        return tuple(x.view(B, T) for x in picks)

    def pick_hidden(self, hidden: torch.Tensor, positions: torch.Tensor, candidates: torch.Tensor,
                    counter: torch.Tensor | None, draft: DraftHead | None = None, top_m: int = 0,
                    entropy: bool = False, seen: dict | None = None):
        """:meth:`pick` on ``lm_head(hidden)`` (hidden: [B, T, H]); with ``draft``, among its token ids only (its
        rows of the lm_head; confidences under the softmax over them). Greedy picks go through the fused LM-head
        confidence, which never writes the [B, T, V] logits and on the GPU skips the positions that are not
        candidates (committed ones: about half of a step's); sampling builds the logits. With ``top_m`` (whole
        vocabulary only) also each scored position's top_m logits / temperature (float32) and their token ids
        (-1 elsewhere), [B, T, top_m] each: the draft candidates of the next round (:mod:`.draft_candidates`). With
        ``entropy`` (whole vocabulary only) each position's entropy comes after the lse (:meth:`pick`). ``seen``: the
        penalties' arguments for the block states the hidden states were computed from (:meth:`pick`; the
        fused pick reads their tables too, by draft column with ``draft``)."""
        weight = self.model.lm_head.weight if draft is None else draft.weight
        B, T, H = hidden.shape
        seen = self._penalty(seen)
        if self.settings.do_sample:
            logits = F.linear(hidden, weight)
            if draft is not None:
                logits = draft.full_logits(logits, self.model.lm_head.weight.shape[0])
            picks = self.pick(logits, positions, candidates, counter, entropy, seen)
            if not top_m:
                return picks
            z = logits.float()
            if seen:  # the lists rank the logits the picks saw
                z = penalties_applied(z.view(B * T, -1), **seen).view(B, T, -1)
            z = z.masked_fill(~candidates[..., None], float("-inf"))
            z[..., self.mask_id] = float("-inf")
            ban = self.token_bans(positions)
            if ban:
                z = exclude_banned(z.view(B * T, -1), **ban).view(B, T, -1)
            # ties to the lowest id, as the fused pick's lists: the first m of a longer list are the m-list
            top, ids = (x.view(B, T, top_m) for x in top_by_value(z.view(B * T, -1), top_m))
            top = top * inverse_temperature(self.temperature)[..., None]  # (one a row: [B', 1, 1])
            return *picks, top, ids.masked_fill(top == float("-inf"), -1)
        if seen and draft is not None:  # the tables by draft column, as the draft's weight rows
            seen = by_token(seen, lambda table: draft.columns(table.T).T, draft.columns)
        out = mrp_triton.lm_head_confidence(
            hidden.reshape(B * T, H), weight, mask_token_id=self.mask_id if draft is None else draft.mask_column,
            **self.token_bans(positions, draft=draft), **seen, skip_rows=~candidates.reshape(-1), top_m=top_m,
            entropy=entropy)
        tok = out[0] if draft is None else draft.tokens(out[0])
        return (tok.view(B, T), *(x.view(B, T, *x.shape[1:]) for x in out[1:]))

    def pick_listed(self, hidden: torch.Tensor, seed: tuple, positions: torch.Tensor, candidates: torch.Tensor,
                    counter: torch.Tensor | None, seen: dict | None = None):
        """A draft pick among each position's listed tokens (``draft_candidates``): hidden [B, T, H]; ``seed`` =
        (h_seed [B, T, H], ids [B, T, M], rest [B, T]) of the round (:mod:`.draft_candidates`), candidates: bool
        [B, T] (the positions to pick at), seen: the penalties' arguments for the block states the hidden
        states were computed from (:meth:`pick`). Returns tokens int64 [B, T] (-1 where not picked) and conf float32
        [B, T] (``mrp_triton.candidate_confidence``)."""
        s = self.settings
        seed_h, ids, rest = seed
        B, T, H = hidden.shape
        tok, conf = mrp_triton.candidate_confidence(
            hidden.reshape(B * T, H), self.model.lm_head.weight, ids.reshape(B * T, -1), rest.reshape(-1),
            seed_hidden=seed_h.reshape(B * T, H), vocab_mean=self.engine.vocab_mean,
            temperature=self.temperature_by_position(T),
            skip_rows=~candidates.reshape(-1), do_sample=self.sampling_rows(T),
            noise_keys=self.noise_keys(positions, counter).reshape(B * T, 3) if s.do_sample else None,
            **self.sampling_cuts(T), **self._penalty(seen))
        return tok.view(B, T), conf.view(B, T)

    def commit_picks(self, block: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                     masked: torch.Tensor, n: int | torch.Tensor, threshold: float | None = None,
                     mrp: bool = False, top_m: int = 0, entropy_bound: torch.Tensor | None = None) -> tuple:
        """Pick on ``lm_head(hidden)`` [B, T, H] over the ``masked`` positions, commit into ``block`` in place
        (static top-n, dynamic with ``threshold``, or entropy-bounded with ``entropy_bound``; n: an int or one per
        row [B]) and count the forward. Returns the picks of :meth:`pick_hidden` (with ``top_m``, the positions'
        top_m lists too; with ``entropy_bound``, their entropies)."""
        by_entropy = entropy_bound is not None
        picks, top = self.split_top(self.pick_hidden(hidden, positions, masked, self.noise_counter(),
                                                     top_m=self.top_lists(top_m), entropy=by_entropy,
                                                     seen=self.penalties(block)), top_m)
        committed = mrp_triton.select_commit(block, picks[0], picks[1], mask_token_id=self.mask_id, n=n,
                                             threshold=threshold, entropy=picks[3] if by_entropy else None,
                                             entropy_bound=entropy_bound)
        self.record(masked.any(-1), committed, mrp=mrp)
        self.note_confidences(positions, committed, picks[1], top)
        return picks

    def scheduled_quota(self, quota_base: torch.Tensor, quota_extra: torch.Tensor,
                        steps_taken: torch.Tensor) -> torch.Tensor:
        """This step's quota by SDAR's schedule (n = T // S per step, the first T % S steps one more; T: the block
        length, S: the denoising steps; a first block that holds the prompt's tail runs out of masks in fewer steps),
        and the step counted: ``steps_taken`` is incremented in place. quota_base, quota_extra, steps_taken: [B]
        (T // S and T % S; the steps the row has taken in its block), so one captured step serves every number of
        denoising steps."""
        quota = quota_base + (steps_taken < quota_extra)
        steps_taken.add_(1)
        return quota

    def masked(self, block: torch.Tensor) -> torch.Tensor:
        """bool [B, T]: the masked positions of ``block`` (every row of the working batch is decoding)."""
        return block == self.mask_id

    def masked_kept(self, block: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """bool [B, T]: the masked positions of ``block`` (at ``positions`` [B, T]) that the output keeps: those
        before the row's end (``engine.ends``: past its last new token, or past the first EOS it committed). A row's
        output is settled once they are committed: the positions after it are context while the row decodes, and
        are dropped, not decoded, after (:meth:`settle`)."""
        return self.masked(block) & (positions < self.engine.ends[:, None])

    def settle(self, block: torch.Tensor, positions: torch.Tensor) -> None:
        """What every step ends with, on the device: a row that has committed an EOS among its new tokens ends its
        output there (``engine.ends`` lowered to past the first), and a row whose output is settled (no kept masks:
        :meth:`masked_kept`) has its other masks filled, in place in ``block`` [B, T] (at ``positions`` [B, T]), so
        the next steps find no work in it (they commit nothing there and count no forward for it) and the host
        sees its block full (``mrp_triton.settle_rows``, one launch). Committed tokens never change, so this drops
        only tokens that the output drops."""
        engine = self.engine
        mrp_triton.settle_rows(block, positions, engine.starts, engine.ends, engine.is_eos, mask_token_id=self.mask_id,
                               filler=self.filler)

    def count(self, name: str, values: torch.Tensor) -> None:
        """Add ``values`` [B'] (one per row of the working batch) to the stats counter ``name``."""
        self.stats.add(name, self.rows, values)

    def record(self, forward_rows: torch.Tensor, committed: torch.Tensor, mrp: bool = False) -> None:
        """Count one backbone forward (or, with ``mrp``, one MRP forward) for ``forward_rows`` [B] bool and
        the ``committed`` tokens (bool [B, T], or a count per row [B])."""
        n = committed.sum(-1) if committed.dtype == torch.bool else committed.long()
        self.count("mrp_forwards" if mrp else "backbone_forwards", forward_rows)
        self.count("tokens_committed", n)
        self.counter.add_(n)

    # ---------------------------------------------------------------------------------- the loop
    def run(self, strategy: "Strategy") -> torch.Tensor:
        """Decode every row's blocks with ``strategy`` and return the layout x [B, total]."""
        T = self.block
        self._prefill()
        positions = self.first_block[:, None] * T + torch.arange(T, device=self.device)
        block = self.x.gather(1, positions)
        if self.settings.repetition_penalty is not None:  # the prompts' tokens (masks past them: never picked)
            prompts = self.x[:, : self.prompts.ids.shape[1]]
            self.engine.seen.zero_()
            self.engine.seen[self.rows] = self.engine.seen[self.rows].scatter_(1, prompts, True)
        if self.settings.counts_tokens:  # no token generated yet, less the prompt's tail in each row's first block
            self.engine.counts.zero_()
            self.engine.counts[self.rows] = self.engine.counts[self.rows].scatter_add_(
                1, block, -(positions < self.engine.starts[:, None]).float())
        # Host state per working row: masks left in its block, blocks left to decode (with this one; 0 for a
        # finished row kept as padding of a graphed batch, see retire).
        masks = [T - n % T if b else 0 for n, b in zip(self.prompts.lens, self.blocks_to_decode)]
        self.masks_left = [min(m, limit) for m, limit in zip(masks, self.limits)]  # the kept ones (masked_kept)
        self.blocks_left = list(self.blocks_to_decode)
        # SDAR's schedule is the block's, the first block's too (its masks follow the prompt's tail): it just runs out
        # of masks sooner
        S = self.settings.denoising_steps
        self.row_state["quota_base"] = torch.full((len(masks),), T // S, device=self.device)
        self.row_state["quota_extra"] = torch.full((len(masks),), T % S, device=self.device)
        self.row_state["steps_taken"] = torch.zeros_like(self.rows)
        self.row_state["fresh"] = torch.ones_like(self.rows, dtype=torch.bool)
        step_limit = sum(self.blocks_left) * T  # every step commits a token in every row with masks
        self.together = together = strategy.synchronous or not self.settings.per_row_blocks
        most = strategy.most_per_step(self)
        # Any row may settle (an EOS) at its first step: then only that one surely has work. Check after it where a
        # check idles no device (steps not replayed) or the device checks (device_loop).
        one_sure_step = bool(self.settings.eos_ids) and (self.graphs is None or self.settings.device_loop)
        with tqdm(total=sum(self.blocks_left), desc="blocks", disable=not self.settings.progress) as bar:
            while self.masks_left:
                # Steps that surely have work: for the row with the fewest left (together: for all rows, but no
                # more than a watched row surely has: a row decoding its last block must not step on past its
                # last new token, see watched). A step commits at least one token in each row with masks, so a
                # block (together: every block) is full at most `left` steps after them (the masks past a last
                # new token counted as left too: a step may commit them first).
                row = max if together else min
                steps = 1 if one_sure_step else min(
                    [row(-(-m // most) for m in self.masks_left if m)]
                    + [-(-m // most) for m, w in zip(self.masks_left, self.watched()) if m and w])
                left = row(m + (T - kept if b == 1 else 0) for m, b, kept in
                           zip(self.masks_left, self.blocks_left, self.last_block_kept) if m) - steps
                if self.settings.device_loop and left > 0:
                    self.loop_slots = 1 << (left - 1).bit_length()  # few sizes of loop: few graphs
                strategy.decode(self, block, positions, steps)
                self.loop_slots = 0
                self.all_fresh = False
                block, positions = self._move_on(block, positions, bar, together)
                if self.batch_steps > step_limit:
                    raise RuntimeError("decoding made no progress: steps committed no token, as the model gave no "
                                       "finite logit (the mask token's aside) at a block's masked positions; check "
                                       "the weights for NaN or inf and the dtype for overflow (if the logits are "
                                       "finite, this is a bug: please report it)")
        if self.stream is not None:
            self.stream.end()
        return self.x

    def _prefill(self) -> None:
        """Commit every row's full prompt blocks: in one forward, or with ``prefill_chunk_size`` in forwards of that
        many positions at most (rounded down to whole blocks, at least one), each attending to the cache the ones
        before it wrote; the last one fused into the first step when the rows' prompts span the same blocks. With
        ``num_return_sequences`` copies of each prompt, only each prompt's first copy computes them (a ragged
        forward); the other copies get its keys and values."""
        T, prefill = self.block, max(self.first_blocks)
        if not prefill:
            return
        B, copies = self.x.shape[0], self.settings.num_return_sequences
        chunk = self.settings.prefill_chunk_size
        blocks = prefill if chunk is None else max(chunk // T, 1)
        for start in range(0, prefill, blocks):
            span = torch.arange(start * T, min(start + blocks, prefill) * T, device=self.device)
            self.commit(self.x[:, span], span.expand(B, -1), counted=False, rows=self.computes_prompt)
        if min(self.first_blocks) < prefill or copies > 1:
            self.flush()
            if copies > 1:  # the later copies get their first copy's keys and values
                later = torch.tensor([b for b, computes in enumerate(self.computes_prompt) if not computes],
                                     device=self.device)
                self.cache.copy_rows(later - later % copies, later, prefill * T)
            # Rows with fewer full prompt blocks keep only their own: the rest of their width is
            # masked out and overwritten by their next commits.
            self.cache.lengths.copy_(self.first_block * T)

    def _move_on(self, block: torch.Tensor, positions: torch.Tensor, bar, together: bool):
        """Check the working rows (one host synchronisation, which also reads the steps device loops ran): full
        blocks (no kept masks: :meth:`masked_kept`; the steps filled the others, :meth:`settle`) go to x (and the
        stream); rows whose output ends in them (an EOS, or the last new token) leave; the other full rows commit
        theirs and move on to their next block (``together``: only once every row's block is full). Returns the
        working rows' block and positions [B'', T]."""
        B, T = block.shape
        counts = torch.cat([self.masked_kept(block, positions).sum(-1), self.engine.ends, positions[:, 0], self.rows,
                            self.engine.loop_steps.view(1)]).tolist()
        self.block_steps += counts[-1] - self.loop_steps  # the steps the device loops ran count in the block too
        self.masks_left, ends, starts, rows = (counts[i * B : (i + 1) * B] for i in range(4))
        self.loop_steps = counts[-1]
        live = sum(1 for b in self.blocks_left if b)
        full = [i for i, m in enumerate(self.masks_left) if m == 0 and self.blocks_left[i]]
        if not full or (together and len(full) < live):
            return block, positions
        bar.update(len(full))
        index = torch.tensor(full, device=self.device)
        self.x[self.rows[index, None], positions[index]] = block[index]
        ended = [end <= start + T for end, start in zip(ends, starts)]  # the row's output ends in this block
        if self.stops is not None:
            self._stop_at_strings(full, rows, starts, ends, ended)
        if self.deadline is not None and time.monotonic() > self.deadline:
            self._out_of_time(full, rows, starts, ended)
        if self.criteria is not None:  # last: it sees where the others ended the rows
            self._stop_by_criteria(full, rows, starts, ended)
        if self.stream is not None:  # one prompt: row 0 is the working batch
            self.stream.block(block[0])
        for i in full:
            self.blocks_left[i] = 0 if ended[i] else self.blocks_left[i] - 1
        kept = [i for i, b in enumerate(self.blocks_left) if b]
        if not kept:
            self.masks_left = []
            return block, positions
        if len(kept) < live:
            block, positions = self.retire(kept, block, positions)
        self._next_blocks(block, positions)
        return block, positions

    def _stop_at_strings(self, full: list[int], rows: list[int], starts: list[int], ends: list[int],
                         ended: list[bool]) -> None:
        """The ``full`` rows whose new text (up to their ``ends``) now holds a stop string end with this block
        (``ended``), keeping their new tokens up to and with the one that completes it; ``rows``: each working row's
        original row, ``starts``: its block start."""
        for i in full:
            r, first_new = rows[i], self.prompts.lens[rows[i]]
            if r in self.new_tokens_kept or self.stops[r] is None:  # criteria ended it earlier, or it has no stops
                continue
            end = min(starts[i] + self.block, ends[i])
            keep = self.stops[r].tokens_to_keep(self.x[r, max(starts[i], first_new):end].tolist())
            if keep is not None:
                ended[i] = True
                self.new_tokens_kept[r] = keep
                if self.stream is not None:
                    self.stream.cut(keep)

    def _stop_by_criteria(self, full: list[int], rows: list[int], starts: list[int], ended: list[bool]) -> None:
        """Call the stopping criteria for the new tokens every row has now decoded (:class:`.CriteriaCheck`): a
        row they stop keeps its new tokens up to that step and ends with its current block (``ended``, for the
        ``full`` rows; ``rows``: each working row's original row, ``starts``: its block start)."""
        for i in full:  # (a graphed batch's padding rows have no blocks: never full)
            r = rows[i]
            self.criteria.row_decoded(r, self.settings.max_new_tokens if ended[i] else
                                      self._new_tokens_through_block(r, starts[i]))
        s, engine = self.settings, self.engine
        notes = {"confidences": (engine.confidences, 0)} if s.output_confidences else {}
        if s.output_top_logprobs:
            values, ids = engine.top_notes[s.output_top_logprobs]
            notes.update(top_logprobs=(values, float("-inf")), top_token_ids=(ids, -1))
        for r, keep in self.criteria.stopped_rows(self.x, self.kept_at_most, notes).items():
            self.new_tokens_kept[r] = keep
            if self.stream is not None:
                self.stream.cut(keep)
        for i in full:
            ended[i] = ended[i] or rows[i] in self.new_tokens_kept

    @property
    def kept_at_most(self) -> dict[int, int]:
        """Original row -> the most new tokens it keeps, where fewer than ``max_new_tokens``: those a stop string, a
        stopping criterion or ``max_time`` left it, else its own limit (``max_new_tokens`` given per prompt)."""
        return {**self.row_limits, **self.new_tokens_kept}

    def _out_of_time(self, full: list[int], rows: list[int], starts: list[int], ended: list[bool]) -> None:
        """``max_time`` has passed: the ``full`` rows end with this block (``ended``), keeping its new tokens
        (``rows``: each working row's original row, ``starts``: its block start); the others end with theirs when it
        fills."""
        for i in full:
            if not ended[i]:
                ended[i] = True
                self.new_tokens_kept[rows[i]] = self._new_tokens_through_block(rows[i], starts[i])

    def _new_tokens_through_block(self, row: int, start: int) -> int:
        """How many of original row ``row``'s new tokens lie up to the end of its block starting at ``start``."""
        return start + self.block - self.prompts.lens[row]

    def _next_blocks(self, block: torch.Tensor, positions: torch.Tensor) -> None:
        """Rows with a full block (no masks left) and blocks left make it their pending commit and move on to
        their next block, in place in ``block``/``positions`` [B', T], with fresh per-row state."""
        T = self.block
        switching = [m == 0 and b > 0 for m, b in zip(self.masks_left, self.blocks_left)]
        if not any(switching):
            return
        committing = torch.tensor(switching, device=self.device)
        # The other rows' part of the commit forward lies one block past their own: nobody attends to it.
        self.commit(block.clone(), torch.where(committing[:, None], positions, positions + T), rows=switching)
        index = torch.tensor([i for i, switch in enumerate(switching) if switch], dtype=torch.long,
                             device=self.device)
        self.see(index, block[index])
        positions[index] += T
        block[index] = self.x[self.rows[index, None], positions[index]]
        self.row_state["quota_base"][index] = T // self.settings.denoising_steps
        self.row_state["quota_extra"][index] = T % self.settings.denoising_steps
        self.row_state["steps_taken"][index] = 0
        self.row_state["fresh"][index] = True
        self.masks_left = [(T if b > 1 else kept) if switch else m
                           for switch, m, b, kept in zip(switching, self.masks_left, self.blocks_left,
                                                         self.last_block_kept)]
        self.all_fresh = all(switch for switch, b in zip(switching, self.blocks_left) if b)
        if self.all_fresh:
            self.block_steps = 0

    def retire(self, kept: list[int], block: torch.Tensor, positions: torch.Tensor):
        """Shrink the working batch to the rows ``kept`` (increasing indices into it); the others are finished.
        A graphed engine shrinks it only to the next batch bucket (:func:`_graphed_batch`), keeping finished
        rows as padding (full blocks, no blocks left: every step leaves them as they are), so a batch whose
        rows finish one by one replays a few captured sizes instead of capturing every size. Returns the
        working rows' block and positions [B'', T]."""
        size = len(kept) if self.graphs is None else min(_graphed_batch(len(kept)), len(self.blocks_left))
        if size == len(self.blocks_left):
            return block, positions
        padding = [i for i, b in enumerate(self.blocks_left) if not b][: size - len(kept)]
        kept = sorted(kept + padding)
        self.flush()
        index = torch.tensor(kept, device=self.device)
        self.engine.keep_rows(index)
        self.row_state = {name: value[index] for name, value in self.row_state.items()}
        self.masks_left = [self.masks_left[i] for i in kept]
        self.blocks_left = [self.blocks_left[i] for i in kept]
        self.last_block_kept = [self.last_block_kept[i] for i in kept]
        return block[index], positions[index]


@dataclass(frozen=True)
class Strategy:
    """How a decoding strategy advances the working rows.

    ``decode(dec, block [B', T], positions [B', T], steps)`` runs ``steps`` steps, committing into
    ``block`` in place (per-row state in ``dec.row_state``: ``quota_base``, ``quota_extra``, ``steps_taken``,
    ``fresh`` for rows at the start of a block, and what the strategy keeps there itself). ``most_per_step(dec)``
    bounds the tokens one step commits per row, so with m masks left a row surely has work for the next
    ceil(m / most) steps: the decoder runs that many for the row with the fewest, then checks (with
    ``device_loop``, after the steps that may have work, run on the device until a block fills). A
    ``synchronous`` strategy starts its blocks in all rows at once (and so does any strategy with
    ``per_row_blocks=False``): the decoder runs as many steps as the row with the most surely needs, and
    rows move on when every block is full.
    """

    decode: Callable
    most_per_step: Callable = lambda dec: dec.block  # noqa: E731
    synchronous: bool = False


GRAPHED_WIDTH_MULTIPLE = 256


def _carry_over(inputs: tuple, carry: tuple[int, ...], outputs) -> None:
    """A step's ``outputs`` (one tensor per index in ``carry``) replace those ``inputs`` in place."""
    for i, output in zip(carry, outputs if carry else ()):
        inputs[i].copy_(output)


def ride_tokens(riders: torch.Tensor, n: int, rows: int, width: int) -> torch.Tensor:
    """The places a forward over ``rows`` x ``width`` positions whose first n are finished blocks computes when
    only the ``riders``' (int64 [R]) finished blocks are computed: int64 [R * n + rows * (width - n)] indices into
    the flattened [rows, width] grid, the riders' first n places row by row, then every row's other places."""
    steps = torch.arange(width, device=riders.device)
    finished = riders[:, None] * width + steps[:n]
    rest = torch.arange(rows, device=riders.device)[:, None] * width + steps[n:]
    return torch.cat([finished.flatten(), rest.flatten()])


def _graphed_batch(rows: int) -> int:
    """The working-batch size a graphed engine keeps for ``rows`` rows still decoding: the next of
    1, 2, 4, 8, 16, 24, 32, ... (multiples of 8 past 8, as serving engines bucket their captured batches)."""
    return 1 << (rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8


def _graphed_width(total: int, limit: int) -> int:
    """Cache positions of a graphed engine: the layout's ``total`` rounded up to a multiple of 256 (at most
    ``limit``), so calls of similar lengths share one engine and its captured steps. On CUDA the attention
    kernel reads each row only up to its committed length: the spare width costs memory, not time."""
    return min(-(-total // GRAPHED_WIDTH_MULTIPLE) * GRAPHED_WIDTH_MULTIPLE, max(limit, total))


def leading_masks(masked: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: each row's first ``quota`` [B] positions of ``masked`` [B, T] (bool), left to right."""
    return masked & (masked.cumsum(-1) <= quota[:, None])


def denoising_step(dec: BlockDecoder, threshold: float | None = None, leftmost: bool = False,
                   entropy_bound: torch.Tensor | None = None):
    """The step ``(block [B, T], positions [B, T], quota [B]) -> h_A [B, T, H]``: one backbone forward over
    the block, then commit the quota's most confident masked positions (with ``threshold``: all above it,
    else the quota; ``leftmost``: the quota's first masked positions, picking at those only; ``entropy_bound``: the
    entropy-bounded run, else the quota) into ``block`` in place."""

    def step(block: torch.Tensor, positions: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
        masked = dec.masked(block)
        if leftmost:
            masked = leading_masks(masked, quota)
        hidden = dec.backbone(block, positions)
        dec.commit_picks(block, hidden, positions, masked, quota, threshold, entropy_bound=entropy_bound)
        return hidden

    return step


def scheduled_step(dec: BlockDecoder, **rule):
    """The step ``(block [B, T], positions [B, T], quota_base [B], quota_extra [B], steps_taken [B]) -> h_A`` of
    static / dynamic / sequential / entropy-bounded decoding: :func:`denoising_step` with the commit ``rule`` (its
    keywords) and each row's quota from SDAR's schedule (see :meth:`BlockDecoder.scheduled_quota`; ``steps_taken``
    is incremented in place)."""
    denoise = denoising_step(dec, **rule)

    def step(block: torch.Tensor, positions: torch.Tensor, quota_base: torch.Tensor, quota_extra: torch.Tensor,
             steps_taken: torch.Tensor) -> torch.Tensor:
        return denoise(block, positions, dec.scheduled_quota(quota_base, quota_extra, steps_taken))

    return step


def decode_scheduled(dec: BlockDecoder, block: torch.Tensor, positions: torch.Tensor, steps: int) -> None:
    """Static (n most confident per step), dynamic (all above the threshold, else the top n), sequential (the
    first n masked positions, left to right: SDAR's ``sequential`` rule) and entropy-bounded (the lowest-entropy
    run within the bound, else the n lowest) decoding."""
    s = dec.settings
    step = scheduled_step(dec, threshold=dec.on_device("threshold") if s.strategy == "dynamic" else None,
                          leftmost=s.strategy == "sequential", entropy_bound=dec.on_device("entropy_bound"))
    state = dec.row_state
    dec.steps((("denoise", step),), block, positions, state["quota_base"], state["quota_extra"], state["steps_taken"],
              count=steps, mutated=(0, 4))


# Static: a step commits at most ceil(T / S) tokens per row (SDAR's schedule), and every full block takes
# the same steps: moving on per row would save nothing. Dynamic: a step may fill the block.
STATIC = Strategy(decode_scheduled, most_per_step=lambda dec: -(-dec.block // dec.settings.denoising_steps),
                  synchronous=True)
DYNAMIC = Strategy(decode_scheduled)
