"""The training loop shared by backbone and MRP training.

- Global batch per optimizer step: ``G = micro_batch_size * world_size * grad_accum`` sequences.
  Step s takes G consecutive indices of an epoch permutation (seeded by ``(seed, epoch)``) and
  rank r, micro-step j trains on slice ``(j * world + r) * micro``. The data position is just
  the step counter, so resuming needs nothing but the step.
- Loss = weighted sum over the global batch / number of answer tokens of the global batch
  (>= 1). Each rank back-propagates ``sum_rank * world / denom`` and DDP averages, so 1 process
  and N processes with the same global batch compute the same gradient.
- Noise is drawn per sample from ``(seed, step, dataset index)`` (see :mod:`training.noising`).
- AdamW; linear warmup then cosine decay to ``min_lr_ratio * lr``; grad-norm clipping;
  bf16 autocast on CUDA (MRP training keeps the frozen backbone's projections in bf16 when they hold bf16
  values: :func:`training.models.frozen_projections_in_bf16`); tqdm bar (loss, lr, tokens/s) and
  ``metrics.jsonl`` on rank 0; held-out loss every ``eval_every`` steps (fixed noise, so values are comparable).
- Checkpoints ``checkpoints/step_XXXXXXXX.pt`` are written to a temp file, fsynced and
  ``os.replace``d; they hold the trainable weights (for MRP: the MRP head only, the frozen
  backbone is re-read from ``--model``), optimizer, scheduler, RNG states of every rank
  (python, torch, cuda) and the data position. ``resume`` loads the newest readable one.
- Model ops dispatch as everywhere (:mod:`mrp_triton.backend`): on CUDA the norms, q/k-norm + RoPE, SwiGLU and
  the MRP input run their forward and backward Triton kernels; on CPU the reference. Attention over
  ``[noisy | clean]`` runs compiled FlexAttention on CUDA (``cfg.attention``; block masks that skip the tiles no
  query of a block may see) and SDPA with a dense mask elsewhere.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import random
import re
import sys
import time
import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mrp_triton.backend import before_ampere, select_backend

from .config import ConfigError, TrainConfig
from .data import PackedDataset
from .losses import AGREEMENT_COUNTS, backbone_loss_sum, mrp_loss_sum
from .models import frozen_projections_in_bf16, restore_dtypes, set_activation_checkpointing
from .noising import BlockDiffusionMasks, make_generators, sample_mask, sample_seed

CKPT_DIR = "checkpoints"
CKPT_RE = re.compile(r"^step_(\d{8})\.pt$")
METRICS = "metrics.jsonl"


# ----------------------------------------------------------------------------------- distributed
def init_distributed(device: str | None = None) -> tuple[int, int, torch.device]:
    """Join the torchrun group if there is one. Returns ``(rank, world_size, device)``.

    nccl on CUDA, gloo on CPU. Without torchrun (no ``WORLD_SIZE``) this is a no-op.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = resolve_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dev
    return 0, 1, dev


def resolve_device(device: str | None, local_rank: int = 0) -> torch.device:
    """``--device`` as a torch device: None is ``cuda:LOCAL_RANK`` where CUDA is available, else the CPU; ``cuda``
    without an index is this process's GPU (``cuda:LOCAL_RANK``, as torchrun gives each process its own). Raises
    :class:`ConfigError` naming ``--device`` for what is no device, or a GPU this machine does not have."""
    if device is None:
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {device!r} is not a device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: this machine has no CUDA GPU torch can use; train on --device cpu")
        dev = dev if dev.index is not None else torch.device("cuda", local_rank)
        if dev.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: GPU {dev.index} does not exist (this machine has "
                              f"{torch.cuda.device_count()})")
    return dev


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if _world()[1] > 1:
        dist.barrier()


# ------------------------------------------------------------------------------------ schedule
def lr_lambda_factory(total_steps: int, warmup_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Linear warmup (step 0 gets 1/warmup), then cosine from 1 to ``min_lr_ratio``."""

    def f(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


# ------------------------------------------------------------------------------------- sampler
class GlobalBatchSampler:
    """Stateless: the indices of optimizer step s are a function of s alone."""

    def __init__(self, n: int, global_batch: int, seed: int):
        if n < global_batch:
            raise ConfigError(
                f"the training set has {n} sequences, fewer than one global batch of {global_batch} "
                "(--micro-batch-size x processes x --grad-accum): lower them or add --data")
        self.n, self.g, self.seed = n, global_batch, seed
        self.steps_per_epoch = n // global_batch
        self._cache: tuple[int, torch.Tensor] | None = None

    def perm(self, epoch: int) -> torch.Tensor:
        if self._cache is None or self._cache[0] != epoch:
            g = torch.Generator().manual_seed(sample_seed(self.seed, "epoch", epoch))
            self._cache = (epoch, torch.randperm(self.n, generator=g))
        return self._cache[1]

    def step_indices(self, step: int) -> torch.Tensor:
        epoch, k = divmod(step, self.steps_per_epoch)
        return self.perm(epoch)[k * self.g:(k + 1) * self.g]


# --------------------------------------------------------------------------------- loss module
class LossModule(nn.Module):
    """Wraps the model so the loss is computed inside ``forward`` (what DDP needs)."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, mask_token_id: int):
        super().__init__()
        self.model = model
        self.cfg = cfg
        self.mask_token_id = mask_token_id
        self._mask_cache: dict = {}

    def attention(self, device: torch.device) -> str:
        """``cfg.attention`` resolved on ``device``: "flex" or "sdpa" (``auto``: flex on a GPU FlexAttention compiles
        for, :func:`mrp_triton.backend.before_ampere`)."""
        if self.cfg.attention == "auto":
            return "flex" if device.type == "cuda" and before_ampere(device) is None else "sdpa"
        return self.cfg.attention

    def attn_masks(self, T: int, device: torch.device) -> BlockDiffusionMasks:
        """The ``[noisy | clean]`` masks of length T (built once per length and device): FlexAttention block masks
        or dense ones for SDPA, as :meth:`attention` says."""
        key = (T, str(device))
        if key not in self._mask_cache:
            flex = self.attention(device) == "flex"
            self._mask_cache[key] = BlockDiffusionMasks.build(T, self.cfg.block_size, device, flex)
        return self._mask_cache[key]

    def forward(self, ids: torch.Tensor, is_prompt: torch.Tensor, seeds: Sequence[int], with_stats: bool = False):
        """The loss sum of the batch; ``with_stats``: ``(loss sum, stats)``, the MRP stats with the draft
        agreement counts (:func:`training.losses.draft_agreement`)."""
        gens = make_generators(seeds)
        masked, p = sample_mask(is_prompt, gens, self.cfg.noise_eps)
        masked, p = masked.to(ids.device), p.to(ids.device)
        am = self.attn_masks(ids.shape[1], ids.device)
        if self.cfg.mode == "backbone":
            num, stats = backbone_loss_sum(self.model, ids, masked, p, am, self.mask_token_id)
        else:
            num, stats = mrp_loss_sum(self.model, ids, masked, p, am, self.mask_token_id, self.cfg.block_size,
                                      gens, self.cfg.unroll_k, self.cfg.mrp_loss, agreement=with_stats,
                                      kd_precision=self.cfg.kd_precision)
        return (num, stats) if with_stats else num


# ---------------------------------------------------------------------------------- checkpoints
def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict:
    st = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def atomic_torch_save(obj, path: str) -> None:
    """Write ``path`` so that it is either the old file or the complete new one, never partial."""
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    try:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_out_dir(out_dir: str, resume: bool) -> None:
    """Refuse to start a run from step 0 (not ``resume``) in a folder that holds another run's checkpoints: call it
    before writing anything there (a tokenizer, a manifest), so the other run stays resumable."""
    if not resume and list_checkpoints(out_dir):
        raise ConfigError(f"--out: {out_dir} already holds checkpoints of another run; pass --resume to continue it "
                          "or choose a new --out")


# The model config fields a resumed run must find as its checkpoint has them (those the model flags and --model set).
ARCHITECTURE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                "rope_parameters", "tie_word_embeddings", "attention_bias", "block_size", "mask_token_id",
                "num_nextn_predict_layers")


# The optimizer's settings a checkpoint restores (its param groups'), named by the settings that set them.
OPTIMIZER_FLAGS = {"initial_lr": "--lr", "weight_decay": "--weight-decay", "betas": "betas (adam_beta1, --adam-beta2)",
                   "eps": "adam_eps"}


def _check_optimizer_settings(saved: dict, optim: torch.optim.Optimizer) -> None:
    """Raise if this run's optimizer settings (:data:`OPTIMIZER_FLAGS`) differ from those of the checkpoint's
    optimizer state ``saved``, which a resumed run would restore over them."""
    def plain(value):  # Adam's betas come back from a checkpoint as a list or a tuple
        return tuple(value) if isinstance(value, (list, tuple)) else value

    for group, was in zip(optim.param_groups, saved["param_groups"]):
        for key, flag in OPTIMIZER_FLAGS.items():
            if key in was and plain(group.get(key)) != plain(was[key]):
                raise ConfigError(f"--resume: the checkpoint was made with {flag} {was[key]}, this run has "
                                  f"{flag} {group.get(key)}; use the same flags (or a new --out)")


def list_checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """``[(step, path)]`` of complete checkpoint files, newest first (temp files are ignored)."""
    out = []
    for p in glob.glob(os.path.join(out_dir, CKPT_DIR, "step_*.pt")):
        m = CKPT_RE.match(os.path.basename(p))
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


def load_latest_checkpoint(out_dir: str) -> dict | None:
    """The newest checkpoint that loads; unreadable ones are skipped with a warning."""
    for step, path in list_checkpoints(out_dir):
        try:
            ck = torch.load(path, map_location="cpu", weights_only=False)
            if ck.get("step") != step:
                raise ValueError(f"step {ck.get('step')} in a file named for step {step}")
            return ck
        except Exception as e:  # noqa: BLE001 - any unreadable file: fall back to an older one
            warnings.warn(f"skipping unreadable checkpoint {path}: {e}")
    return None


def _prune(out_dir: str, keep: int) -> None:
    for _, path in list_checkpoints(out_dir)[keep:]:
        with contextlib.suppress(OSError):
            os.remove(path)


def _truncate_metrics(path: str, step: int) -> None:
    """Drop log lines of steps after ``step`` (written by a run that died before checkpointing them)."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    atomic_write_text(path, "".join(keep))


# ------------------------------------------------------------------------------------- helpers
def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW on the trainable parameters; no weight decay on 1-D ones (norm weights)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ConfigError("the model has no trainable parameters")
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


def total_steps_for(cfg: TrainConfig, n: int, world: int) -> int:
    g = cfg.micro_batch_size * world * cfg.grad_accum
    if cfg.max_steps is not None:
        return cfg.max_steps
    return max(1, int(cfg.epochs * (n // max(1, g))))


def check_only_trainable_grads(model: nn.Module, allowed: set[str]) -> None:
    """Raise if a parameter outside ``allowed`` received a gradient, or requires one."""
    for n, p in model.named_parameters():
        if n not in allowed and (p.requires_grad or p.grad is not None):
            raise AssertionError(f"parameter {n} is outside the MRP head but has a gradient / requires grad")


def _autocasts(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether forwards run under bf16 autocast (CUDA with ``cfg.bf16``)."""
    return device.type == "cuda" and cfg.bf16


def check_device_support(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse what ``cfg`` asks that ``device`` cannot run (``mrp-train`` checks it before it reads the data too):
    ``--attention flex`` off CUDA, and :func:`check_gpu_support`'s."""
    if cfg.attention == "flex" and device.type != "cuda":
        raise ConfigError(f"--attention flex needs a CUDA device (FlexAttention has no backward on {device.type}); "
                          "use --attention sdpa or auto")
    check_gpu_support(cfg, device)


def check_gpu_support(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse what an NVIDIA GPU before sm_80 (Turing's T4) cannot run well, naming the way out: bf16 autocast (the
    default on CUDA; ``--no-bf16`` trains in fp32) and ``--attention flex`` (``sdpa``, which ``auto`` picks there)."""
    old = before_ampere(device)
    if old is not None and cfg.bf16:
        raise ConfigError(f"bf16 autocast (the default on CUDA) needs a GPU with bf16 units (NVIDIA sm_80 or newer), "
                          f"but {device} is {old}: pass --no-bf16 to train in fp32")
    if old is not None and cfg.attention == "flex":
        raise ConfigError(f"--attention flex needs NVIDIA sm_80 or newer (FlexAttention has no kernel for {old}, "
                          "where it would run densely and eagerly): use --attention sdpa or auto")


def _autocast(cfg: TrainConfig, device: torch.device):
    if _autocasts(cfg, device):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(loss_mod: LossModule, ds: PackedDataset, cfg: TrainConfig, device: torch.device) -> dict:
    """Held-out metrics over the first ``eval_batches * micro * world`` sequences, fixed noise: ``eval_loss``
    (None without data); for MRP training also, per unroll step k = 1..K, ``eval_token_agreement`` (the
    corrected logits' argmax equals the backbone's) and ``eval_pick_agreement`` (a decoding step would pick
    the same position and token: a speculative draft is accepted), see
    :func:`training.losses.draft_agreement`."""
    rank, world = _world()
    n = min(len(ds), cfg.eval_batches * cfg.micro_batch_size * world)
    if n == 0:
        return {"eval_loss": None}
    was_training = loss_mod.training
    loss_mod.eval()
    mrp = cfg.mode == "mrp"
    # [loss sum, answer tokens, then per unroll step the agreement counts]
    totals = torch.zeros(2 + (len(AGREEMENT_COUNTS) * cfg.unroll_k if mrp else 0), dtype=torch.float64)
    mine = list(range(rank, n, world))
    for i in range(0, len(mine), cfg.micro_batch_size):
        idx = torch.tensor(mine[i:i + cfg.micro_batch_size])
        ids, isp = ds.input_ids[idx].to(device), ds.is_prompt[idx]
        with _autocast(cfg, device):
            s, stats = loss_mod(ids, isp, [sample_seed(cfg.seed, "eval", int(j)) for j in idx], with_stats=True)
        counts = [float(a[c]) for a in stats["agreement"] for c in AGREEMENT_COUNTS] if mrp else []
        totals += torch.tensor([float(s), float((~isp).sum()), *counts], dtype=torch.float64)
    if world > 1:
        t = totals.to(device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t)
        totals = t.cpu()
    loss_mod.train(was_training)
    result = {"eval_loss": float(totals[0] / max(1.0, float(totals[1])))}
    if mrp:
        per_k = totals[2:].view(cfg.unroll_k, len(AGREEMENT_COUNTS))
        result["eval_token_agreement"] = [round(float(k[0] / k[1].clamp(min=1)), 4) for k in per_k]
        result["eval_pick_agreement"] = [round(float(k[2] / k[3].clamp(min=1)), 4) for k in per_k]
    return result


# ---------------------------------------------------------------------------------------- train
def train(
    cfg: TrainConfig,
    model: nn.Module,
    train_ds: PackedDataset,
    eval_ds: PackedDataset | None = None,
    mask_token_id: int | None = None,
    export: Callable[[nn.Module], None] | None = None,
    callbacks: Sequence[Callable[[int, dict], None]] = (),
    device: torch.device | None = None,
) -> dict:
    """Train ``model`` in place. Returns ``{"step", "loss", "eval_loss", "history"}`` (and the other metrics
    of the last :func:`evaluate`).

    ``mode == "mrp"``: only parameters with ``requires_grad`` train (the caller freezes the
    rest); after the first backward this checks that no other parameter got a gradient.
    ``export(model)`` runs on rank 0 at the end (final ``save_pretrained``).
    ``callbacks(step, info)`` run after each optimizer step (and its checkpoint) on every rank.
    An MRP run under bf16 autocast (CUDA) stores the frozen backbone's projections in bf16 while it trains
    (:func:`training.models.frozen_projections_in_bf16`); they are restored before ``export``, and when a run fails.
    ``cfg.activation_checkpointing`` checkpoints the model's layers while it trains, likewise turned off after.
    """
    cfg.validate()
    if device is None:
        device = next(model.parameters()).device
    check_device_support(cfg, device)
    if train_ds.seq_len != cfg.seq_len:
        raise ConfigError(f"--seq-len is {cfg.seq_len} but the packed data has length {train_ds.seq_len}")
    if len(train_ds) == 0 or train_ds.num_answer_tokens() == 0:
        raise ConfigError("--data: the training data is empty (no answer tokens)")
    in_bf16 = frozen_projections_in_bf16(model) if cfg.mode == "mrp" and _autocasts(cfg, device) else []
    if cfg.activation_checkpointing:
        set_activation_checkpointing(model, True)
    try:
        result = _train_steps(cfg, model, train_ds, eval_ds, mask_token_id, callbacks, device, len(in_bf16))
    finally:
        restore_dtypes(in_bf16)
        if cfg.activation_checkpointing:
            set_activation_checkpointing(model, False)
    if _world()[0] == 0 and export is not None:
        export(model)
    barrier()
    return result


def _train_steps(cfg: TrainConfig, model: nn.Module, train_ds: PackedDataset, eval_ds: PackedDataset | None,
                 mask_token_id: int | None, callbacks: Sequence[Callable[[int, dict], None]], device: torch.device,
                 projections_in_bf16: int) -> dict:
    """:func:`train`'s steps, evaluations and checkpoints (``projections_in_bf16``: how many frozen projections
    it stored in bf16, for the setup line)."""
    rank, world = _world()
    if mask_token_id is None:
        mask_token_id = int(model.config.mask_token_id)
    if rank == 0:
        os.makedirs(os.path.join(cfg.out_dir, CKPT_DIR), exist_ok=True)

    G = cfg.micro_batch_size * world * cfg.grad_accum
    sampler = GlobalBatchSampler(len(train_ds), G, cfg.seed)
    total = total_steps_for(cfg, len(train_ds), world)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * total)

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    loss_mod = LossModule(model, cfg, mask_token_id).to(device)
    optim = build_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda_factory(total, warmup, cfg.min_lr_ratio))
    fingerprint = train_ds.fingerprint()
    data_info = {"fingerprint": fingerprint, "num_sequences": len(train_ds), "global_batch": G,
                 "seq_len": cfg.seq_len, "block_size": cfg.block_size, "seed": cfg.seed, "total_steps": total,
                 "warmup_steps": warmup, "min_lr_ratio": cfg.min_lr_ratio,  # the schedule (LambdaLR saves no lambda)
                 "grad_clip": cfg.grad_clip}
    if cfg.mode == "mrp":  # the loss the steps take
        data_info.update(unroll_k=cfg.unroll_k, mrp_loss=cfg.mrp_loss, kd_precision=cfg.kd_precision)
    data_info.update({f"config.{k}": getattr(model.config, k) for k in ARCHITECTURE})  # the model the flags built

    start_step, tokens_seen = 0, 0
    metrics_path = os.path.join(cfg.out_dir, METRICS)
    check_out_dir(cfg.out_dir, cfg.resume)
    ck = load_latest_checkpoint(cfg.out_dir) if cfg.resume else None
    if cfg.resume and ck is None and rank == 0:
        print(f"--resume: no checkpoint in {cfg.out_dir}/{CKPT_DIR}; starting from step 0", file=sys.stderr)
    if ck is not None:
        for k, v in data_info.items():
            if k in ck["data"] and ck["data"][k] != v:  # (checkpoints before the schedule keys lack them)
                raise ConfigError(f"--resume: the checkpoint was made with {k}={ck['data'].get(k)!r}, "
                                  f"this run has {k}={v!r}; use the same data and flags (or a new --out)")
        _check_optimizer_settings(ck["optimizer"], optim)
        sd = ck["model"]
        if set(sd) != trainable:
            raise ConfigError(f"--resume: the checkpoint's trainable parameters do not match the model "
                              f"({len(set(sd) ^ trainable)} differ)")
        with torch.no_grad():
            params = dict(model.named_parameters())
            for n, v in sd.items():
                params[n].copy_(v)
        optim.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        rngs = ck["rng"]
        set_rng_state(rngs[rank] if len(rngs) == world else rngs[0])
        start_step, tokens_seen = ck["step"], ck["tokens_seen"]
        if rank == 0:
            _truncate_metrics(metrics_path, start_step)
    else:  # a run from step 0: its metrics start afresh
        barrier()
        if rank == 0 and os.path.exists(metrics_path):
            os.remove(metrics_path)

    setup = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
             "world_size": world, "ops": select_backend(device, backward=True), "attention": loss_mod.attention(device),
             "bf16_autocast": _autocasts(cfg, device), "projections_in_bf16": projections_in_bf16,
             "activation_checkpointing": cfg.activation_checkpointing,
             "kd_precision": cfg.kd_precision if cfg.mode == "mrp" else None, "global_batch": G, "total_steps": total,
             "torch": torch.__version__}

    ddp = None
    if world > 1:
        ddp = nn.parallel.DistributedDataParallel(
            loss_mod, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    fwd = ddp if ddp is not None else loss_mod

    def save(step: int) -> None:
        rngs = [None] * world
        if world > 1:
            dist.all_gather_object(rngs, rng_state())
        else:
            rngs = [rng_state()]
        if rank == 0:
            ck = {"step": step, "tokens_seen": tokens_seen, "model": trainable_state(model),
                  "optimizer": optim.state_dict(), "scheduler": sched.state_dict(), "rng": rngs,
                  "data": data_info, "config": cfg.to_dict(), "world_size": world}
            atomic_torch_save(ck, os.path.join(cfg.out_dir, CKPT_DIR, f"step_{step:08d}.pt"))
            _prune(cfg.out_dir, cfg.keep_checkpoints)
        barrier()

    def log(rec: dict) -> None:
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    log({"step": start_step, "setup": setup})  # what this run (or its resumption) runs on
    if rank == 0 and cfg.progress:
        print(f"mrp-train {cfg.mode}: {json.dumps(setup)}", file=sys.stderr)

    try:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, initial=start_step, disable=not (cfg.progress and rank == 0),
                   desc=f"train {cfg.mode}", dynamic_ncols=True)
    except ImportError:  # pragma: no cover
        bar = None

    history: list[dict] = []
    last_loss, evaluation = None, {"eval_loss": None}  # None: no step ran (a finished run resumed)
    checked = False
    loss_mod.train()
    t_start = time.perf_counter()
    step = start_step
    while step < total:
        t0 = time.perf_counter()
        idx = sampler.step_indices(step)
        denom = max(1, int((~train_ds.is_prompt[idx]).sum()))
        scale = world / denom
        loss_sum = torch.zeros((), dtype=torch.float64)
        for j in range(cfg.grad_accum):
            lo = (j * world + rank) * cfg.micro_batch_size
            sub = idx[lo:lo + cfg.micro_batch_size]
            ids = train_ds.input_ids[sub].to(device, non_blocking=True)
            isp = train_ds.is_prompt[sub]
            seeds = [sample_seed(cfg.seed, "train", step, int(i)) for i in sub]
            sync = ddp.no_sync() if (ddp is not None and j < cfg.grad_accum - 1) else contextlib.nullcontext()
            with sync:
                with _autocast(cfg, device):
                    num = fwd(ids, isp, seeds)
                (num.float() * scale).backward()
            loss_sum += float(num.detach())
        if cfg.mode == "mrp" and not checked:
            check_only_trainable_grads(model, trainable)
            checked = True
        grad_norm = None
        params = [p for p in model.parameters() if p.requires_grad]
        if cfg.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        lr = optim.param_groups[0]["lr"]
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += G * cfg.seq_len
        if world > 1:
            t = loss_sum.to(device if device.type == "cuda" else "cpu")
            dist.all_reduce(t)
            loss_sum = t.cpu()
        last_loss = float(loss_sum) / denom
        dt = time.perf_counter() - t0
        rec = {"step": step, "loss": last_loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens_seen,
               "tokens_per_s": G * cfg.seq_len / max(dt, 1e-9), "elapsed_s": time.perf_counter() - t_start}
        history.append(rec)
        if step % cfg.log_every == 0 or step == total:
            log(rec)
        if bar is not None:
            bar.set_postfix(loss=f"{last_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{rec['tokens_per_s']:.0f}")
            bar.update(1)
        if eval_ds is not None and len(eval_ds) and cfg.eval_every and step % cfg.eval_every == 0 and step < total:
            evaluation = evaluate(loss_mod, eval_ds, cfg, device)
            log({"step": step, **evaluation})
        if cfg.save_every and step % cfg.save_every == 0:
            save(step)
        for cb in callbacks:
            cb(step, rec)
    if bar is not None:
        bar.close()
    if eval_ds is not None and len(eval_ds) and cfg.eval_batches:
        evaluation = evaluate(loss_mod, eval_ds, cfg, device)
        log({"step": step, **evaluation})
    if cfg.save_every and step % cfg.save_every != 0 and step > start_step:
        save(step)
    return {"step": step, "loss": last_loss, **evaluation, "history": history}
