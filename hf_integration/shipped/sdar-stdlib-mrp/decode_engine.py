"""What a ``generate`` call decodes on: the KV cache, the per-row state and the captured steps.

The per-row state is which original row each row of the working batch is (``rows``: it keys the sampling noise
and the stats), how many tokens each has committed (``counter``: the state index in the noise key), where its
new tokens start and where its output ends (``starts``, ``ends``: past its last new token, or past its first EOS
once it has committed one), the per-row stats and the steps device loops have run (``loop_steps``); beside it the
call's sampling seeds (``noise_rows``), EOS ids (``is_eos``), token bans (``ban_table``) and the settings read on the
device (``on_device``: temperature, top-k, top-p, min-p, thresholds, min_new_tokens), so one set of captured steps
serves every value. Like the
cache, it lives in buffers whose storage never moves: ``rows``, ``counter``, ``starts`` and ``ends`` are views of
the first B' entries, finished rows are dropped by moving the kept ones to the front, and the stats (and, for
``output_reveal_steps``, each row's decoding steps and the step that revealed each of its positions) are indexed by
original row. So steps captured in CUDA graphs may read and update it,
and a graphed engine is kept on the model for the next call of the same shapes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mrp_triton import select_backend
from mrp_triton.reference.confidence import seed_hash

from .generation_settings import ON_THE_DEVICE, PER_ROW_ON_THE_DEVICE, GenerationSettings
from .kv_cache import StaticKVCache
from .modeling_sdar import rotary_cos_sin
from .step_graphs import LaggedFlags, StepGraphs


# The classes of token ban (bits of DecodeEngine.ban_table and of a pick's rows: mrp_triton.confidence's banned_tokens
# and ban_rows): EOS before min_new_tokens, suppress_tokens everywhere, begin_suppress_tokens at a row's first new token
BAN_EOS, BAN_SUPPRESS, BAN_FIRST = 1, 2, 4


@dataclass
class DecodeStats:
    """Per-row counters, each an int64 tensor [B] (``accepted_lengths``: [B, K+1] histogram of drafts
    accepted per verify round). ``backbone_forwards`` counts denoising and verify forwards;
    ``commit_forwards`` the forwards that only write a finished block to the cache."""

    backbone_forwards: torch.Tensor
    commit_forwards: torch.Tensor
    mrp_forwards: torch.Tensor
    tokens_committed: torch.Tensor
    tokens_remasked: torch.Tensor
    accepted_lengths: torch.Tensor

    @classmethod
    def zeros(cls, batch: int, max_drafts: int, device) -> "DecodeStats":
        z = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)  # noqa: E731
        return cls(z(batch), z(batch), z(batch), z(batch), z(batch), z(batch, max_drafts + 1))

    def add(self, name: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``values`` [B'] (bool or int) to counter ``name`` at ``rows`` (int64 [B'], distinct)."""
        getattr(self, name).index_add_(0, rows, values.long())

    def zero_(self) -> None:
        for counter in vars(self).values():
            counter.zero_()

    def clone(self, rows: int | None = None) -> "DecodeStats":
        """A copy (of the first ``rows`` rows)."""
        return DecodeStats(**{k: v[:rows].clone() for k, v in vars(self).items()})

    @property
    def tokens_per_forward(self) -> torch.Tensor:
        """Tokens committed per backbone (denoising or verify) forward, per row [B] float."""
        return self.tokens_committed.double() / self.backbone_forwards.clamp(min=1).double()

    def as_dict(self) -> dict:
        rows = {k: v.tolist() for k, v in vars(self).items()}
        rows["tokens_per_forward"] = self.tokens_per_forward.tolist()
        return rows


@dataclass(frozen=True)
class EngineShape:
    """Everything a decode engine's buffers are sized by (cache slots, batch, positions, KV heads, head
    dim, dtype, device, block length, drafts per verify round)."""

    slots: int
    batch: int
    max_len: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    block: int
    max_drafts: int


class DecodeEngine:
    """The cache, per-row state, RoPE tables and (with ``graphed``) the :class:`StepGraphs` of ``generate`` calls of
    one :class:`EngineShape`. ``graphed`` engines read the cache over its full width (what a captured graph
    needs); the graphs capture on CUDA and replay the recorded step functions elsewhere."""

    def __init__(self, shape: EngineShape, graphed: bool, config):
        self.shape = shape
        s = shape
        # RoPE tables of every position a forward may use (the layout's, and a block past it: where rows that do not
        # commit put their part of a commit forward), read by position: no table kernels in each forward.
        positions = torch.arange(s.max_len + s.block, device=s.device)[None]
        self.rope = torch.stack([t[0] for t in rotary_cos_sin(config, positions)], 1)  # [P, 2, head_dim]: cos, sin
        self.cache = StaticKVCache(s.slots, s.batch, s.max_len, s.kv_heads, s.head_dim, s.dtype, s.device,
                                   full_width=graphed)
        self.graphs = StepGraphs(capture=s.device.type == "cuda") if graphed else None
        self.lagged_flags = LaggedFlags(s.device)  # the host's lagged reads of replayed steps' work flags
        self._rows = torch.arange(s.batch, device=s.device)
        self._counter = torch.zeros(s.batch, dtype=torch.long, device=s.device)
        self._starts = torch.zeros(s.batch, dtype=torch.long, device=s.device)
        self._ends = torch.zeros(s.batch, dtype=torch.long, device=s.device)
        self.is_eos = torch.zeros(config.vocab_size, dtype=torch.bool, device=s.device)  # bool [V], by token id
        # uint8 [V], by token id: the classes of ban each token is in (BAN_EOS, BAN_SUPPRESS, BAN_FIRST bits)
        self.ban_table = torch.zeros(config.vocab_size, dtype=torch.uint8, device=s.device)
        # with a repetition penalty, bool [batch, V]: the tokens each working row has seen before its block (its
        # prompt and finished blocks); made by the first call that asks for it (use_settings)
        self.seen: torch.Tensor | None = None
        # with presence / frequency penalties (settings.counts_tokens), float32 [batch, V]: how often each working row
        # generated each token before its block, less the prompt's tokens inside its block (which the block's tokens
        # then add back); with a sequence bias, float32 [V]: the bias by token id; each made by the first call that
        # asks for it (use_settings)
        self.counts: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        # output_top_logprobs=k: by original row and position, the k most likely tokens of the softmax that committed
        # it and their log-probabilities, ([batch, max_len, k] float32, int64) by k; made by the first call asking
        # for k (use_settings) and kept, as the steps captured for k write them
        self.top_notes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.vocab_size = config.vocab_size
        self.stats = DecodeStats.zeros(s.batch, s.max_drafts, s.device)
        # output_reveal_steps: by original row, the decoding steps it has taken [B] and the step that revealed each
        # position [B, max_len]; output_confidences: the probability of the token committed at each position
        self.decoding_steps = torch.zeros(s.batch, dtype=torch.long, device=s.device)
        self.reveal_steps = torch.zeros((s.batch, s.max_len), dtype=torch.long, device=s.device)
        self.confidences = torch.zeros((s.batch, s.max_len), dtype=torch.float32, device=s.device)
        self.loop_steps = torch.zeros((), dtype=torch.long, device=s.device)
        self.noise_rows = torch.zeros(s.batch, dtype=torch.long, device=s.device)  # by original row
        # by original row, the settings a call gives per prompt (GenerationSettings.PER_PROMPT's lists)
        self.per_row = {name: torch.ones(s.batch, dtype=torch.float64, device=s.device)
                        for name in PER_ROW_ON_THE_DEVICE}
        self.draft_rows: dict = {}  # the lm_head rows of each listed draft vocabulary (draft_vocab.draft_head)
        self.vocab_mean: torch.Tensor | None = None  # the mean lm_head row (draft_candidates.refresh_vocab_mean)
        self._copy_index: dict[tuple[int, int], torch.Tensor] = {}
        self.iota = torch.arange(max(s.batch, s.block), device=s.device)  # sliced where a step needs an arange
        settings = torch.ones(len(ON_THE_DEVICE), dtype=torch.float64, device=s.device)
        self.on_device = dict(zip(ON_THE_DEVICE, settings.unbind()))  # 0-d views of one fixed buffer
        self.reset()

    def use_settings(self, settings: GenerationSettings) -> None:
        """This call's values of the settings the captured steps read on the device: each row's first noise-key
        column (:func:`noise_rows`), each row's value of the settings the call gives per prompt (``per_row``, by
        the list's name: ``temperatures``, ``top_ps``, ``sampling``; 1 past the prompts' rows and without a list)
        and those in ``on_device`` (float64, so a step computes exactly what it would from the Python float; an unset
        one holds 1)."""
        copies = settings.num_return_sequences
        self.noise_rows.copy_(noise_rows(settings.seed, copies, self.shape.batch))
        for name, buffer in self.per_row.items():
            buffer.fill_(1.0)
            if getattr(settings, name) is not None:
                values = torch.tensor(getattr(settings, name), dtype=torch.float64).repeat_interleave(copies)
                buffer[: values.shape[0]] = values.to(buffer.device)
        for name, value in self.on_device.items():
            value.fill_(1.0 if getattr(settings, name) is None else float(getattr(settings, name)))
        self.is_eos.zero_()
        self.is_eos[list(settings.eos_ids)] = True
        self.ban_table.zero_()
        for bit, ids in ((BAN_EOS, settings.eos_ids), (BAN_SUPPRESS, settings.suppress_tokens),
                         (BAN_FIRST, settings.begin_suppress_tokens)):
            self.ban_table[list(ids or ())] |= bit
        if settings.repetition_penalty is not None and self.seen is None:
            self.seen = torch.zeros((self.shape.batch, self.vocab_size), dtype=torch.bool, device=self.shape.device)
        if settings.counts_tokens and self.counts is None:
            self.counts = torch.zeros((self.shape.batch, self.vocab_size), device=self.shape.device)
        if settings.sequence_bias is not None:
            if self.bias is None:
                self.bias = torch.zeros(self.vocab_size, device=self.shape.device)
            tokens, biases = zip(*settings.sequence_bias)
            self.bias.zero_()
            self.bias[torch.tensor(tokens, device=self.bias.device)] = torch.tensor(biases, device=self.bias.device)
        k = settings.output_top_logprobs
        if k and k not in self.top_notes:
            s = self.shape
            self.top_notes[k] = (torch.full((s.batch, s.max_len, k), float("-inf"), device=s.device),
                                 torch.full((s.batch, s.max_len, k), -1, dtype=torch.long, device=s.device))

    def use_layout(self, starts: torch.Tensor, ends: torch.Tensor) -> None:
        """This call's rows (every row of the engine's batch): where each one's new tokens start and end, int64
        [B] (position of the first new token; past the last)."""
        self._starts.copy_(starts)
        self._ends.copy_(ends)

    def reset(self) -> None:
        """Every row back, nothing committed, stats zero (graphs captured over the buffers stay valid)."""
        self.cache.reset()
        self._rows.copy_(torch.arange(self.shape.batch, device=self._rows.device))
        self._counter.zero_()
        self.stats.zero_()
        self.decoding_steps.zero_()
        self.reveal_steps.zero_()
        self.confidences.zero_()
        for values, ids in self.top_notes.values():
            values.fill_(float("-inf"))
            ids.fill_(-1)
        self.loop_steps.zero_()
        self._use_rows(self.shape.batch)

    def copy_index(self, copies: int, T: int) -> torch.Tensor:
        """int64 [copies * T]: which copy of a block each position of a forward over ``copies`` copies of it belongs
        to (0 for the first T, ...; a verify forward's candidate states). Made once per shape and kept with the
        graphs: the steps close over it as a constant instead of building it."""
        if (copies, T) not in self._copy_index:
            self._copy_index[copies, T] = torch.arange(copies, device=self.shape.device).repeat_interleave(T)
        return self._copy_index[copies, T]

    def _use_rows(self, n: int) -> None:
        self.rows, self.counter = self._rows[:n], self._counter[:n]
        self.starts, self.ends = self._starts[:n], self._ends[:n]

    def keep_rows(self, kept: torch.Tensor) -> None:
        """Shrink the working batch to ``kept`` (int64 [B''], increasing indices into it)."""
        n = kept.shape[0]
        self._rows[:n] = self.rows[kept]
        self._counter[:n] = self.counter[kept]
        self._starts[:n] = self.starts[kept]
        self._ends[:n] = self.ends[kept]
        for table in (self.seen, self.counts):
            if table is not None:
                table[:n] = table[kept]
        self._use_rows(n)
        self.cache.keep_rows(kept)


def noise_rows(seed: int | tuple[int, ...], copies: int, batch: int) -> torch.Tensor:
    """int64 [batch]: each row's first sampling-noise key column, a seed's hash (folded to 31 bits) in the high
    half and a row index (< 2**32) in the low half. One ``seed`` for the call: the row's index in the batch. A seed
    per prompt (a tuple; each prompt's ``copies`` rows next to each other, as ``num_return_sequences`` lays them
    out): its prompt's seed and the row's index among the prompt's copies, so each prompt draws what it draws alone
    with its seed, whatever else the batch holds. Rows past the prompts' (a graphed batch's padding) draw nothing."""
    rows = torch.arange(batch)
    if not isinstance(seed, tuple):
        return rows + ((seed_hash(seed) & 0x7FFFFFFF) << 32)
    keys = torch.tensor([(seed_hash(s) & 0x7FFFFFFF) << 32 for s in seed]).repeat_interleave(copies)
    return torch.cat([keys + rows[: len(keys)] % copies, rows[len(keys) :]])


def engine_for(model, shape: EngineShape, graphed: bool) -> DecodeEngine:
    """A fresh engine, or for ``graphed`` calls the model's last graphed engine, reset, when it has the same
    shape, weight storage and op backend (its captured graphs are reused); a new graphed engine replaces it.
    ``model.release_decode_engine()`` frees it."""
    if not graphed:
        return DecodeEngine(shape, graphed=False, config=model.config)
    key = (dataclasses.astuple(shape), repr(model.config.rope_parameters),
           tuple(p.data_ptr() for p in model.parameters()),
           select_backend(shape.device))  # the ops a captured step launches (a use_backend(...) call may change it)
    kept = model._decode_engine
    if kept is not None and kept[0] == key:
        kept[1].reset()
        return kept[1]
    model.release_decode_engine()  # free the old buffers before allocating new ones
    engine = DecodeEngine(shape, graphed=True, config=model.config)
    model._decode_engine = (key, engine)
    return engine
