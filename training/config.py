"""Training configuration and its validation (errors name the offending command-line flag)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .kd_loss import PRECISIONS as KD_PRECISIONS


class ConfigError(ValueError):
    """A bad training configuration; the message names the flag to fix."""


@dataclass
class TrainConfig:
    mode: str = "backbone"  # "backbone" | "mrp"
    out_dir: str = "runs/out"
    # data layout
    seq_len: int = 256  # tokens per packed sequence (the clean half; the model sees 2 * seq_len)
    block_size: int = 4
    # batch: global batch = micro_batch_size * world_size * grad_accum sequences per optimizer step
    micro_batch_size: int = 8
    grad_accum: int = 1
    max_steps: int | None = None  # default: ``epochs`` passes over the training sequences
    epochs: float = 1.0
    # optimisation
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.03
    warmup_steps: int | None = None  # overrides warmup_ratio
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # <= 0 disables clipping
    bf16: bool = True  # bf16 autocast (CUDA only; CPU runs fp32)
    attention: str = "auto"  # "auto" (flex on CUDA from sm_80, sdpa elsewhere) | "flex" | "sdpa"
    activation_checkpointing: bool = False  # recompute each trained decoder layer's activations in the backward
    seed: int = 0
    noise_eps: float = 1e-3  # p = (1 - eps) t + eps
    # bookkeeping
    log_every: int = 1
    eval_every: int = 0  # 0: only at the end (when there is held-out data)
    eval_batches: int = 4  # micro-batches per process per evaluation
    save_every: int = 500  # a checkpoint every N steps and at the end (0: none), for --resume
    keep_checkpoints: int = 2
    resume: bool = False
    progress: bool = True
    device: str | None = None  # default: cuda:<local_rank> if available, else cpu
    # MRP
    unroll_k: int = 1
    mrp_loss: str = "kd_diff_sum"  # "kd_diff_sum" | "direct"
    kd_precision: str = "tf32"  # the KD loss's lm_head GEMMs: "fp32" | "tf32" (CUDA; fp32 elsewhere) | "bf16"
    num_mrp_layers: int = 3
    # "default" (the model's own init) | "normal" (N(0, mrp_init_std)) | "continued" (--model's head, trained on)
    mrp_init: str = "default"
    mrp_init_std: float = 0.2
    extra: dict = field(default_factory=dict)  # free-form record (e.g. CLI args), saved with checkpoints

    def validate(self) -> "TrainConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.mode in ("backbone", "mrp"), f"mode must be 'backbone' or 'mrp', got {self.mode!r}")
        need(self.block_size >= 1, f"--block-size must be >= 1, got {self.block_size}")
        need(self.seq_len >= 1, f"--seq-len must be >= 1, got {self.seq_len}")
        need(self.seq_len % self.block_size == 0,
             f"--seq-len ({self.seq_len}) must be a multiple of --block-size ({self.block_size})")
        need(self.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        need(self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}")
        need(self.max_steps is None or self.max_steps >= 1, f"--max-steps must be >= 1, got {self.max_steps}")
        need(self.epochs > 0, f"--epochs must be > 0, got {self.epochs}")
        need(0 < self.lr < math.inf, f"--lr must be a finite number > 0, got {self.lr}")
        need(0.0 <= self.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        need(0.0 <= self.warmup_ratio < 1.0, f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        need(self.warmup_steps is None or self.warmup_steps >= 0,
             f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        need(0.0 <= self.weight_decay < math.inf,
             f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        for flag, beta in (("adam_beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            need(0.0 <= beta < 1.0, f"{flag} must be in [0, 1), got {beta}")
        need(0 < self.adam_eps < math.inf, f"adam_eps must be a finite number > 0, got {self.adam_eps}")
        need(not math.isnan(self.grad_clip), f"--grad-clip must be a number (<= 0: no clipping), got {self.grad_clip}")
        need(self.attention in ("auto", "flex", "sdpa"),
             f"--attention must be 'auto', 'flex' or 'sdpa', got {self.attention!r}")
        need(0.0 < self.noise_eps < 1.0, f"--noise-eps must be in (0, 1), got {self.noise_eps}")
        need(self.log_every >= 1, f"--log-every must be >= 1, got {self.log_every}")
        need(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        need(self.eval_batches >= 0, f"--eval-batches must be >= 0, got {self.eval_batches}")
        need(self.save_every >= 0, f"--save-every must be >= 0, got {self.save_every}")
        need(self.keep_checkpoints >= 1, f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")
        need(self.unroll_k >= 1, f"--unroll-k (K) must be >= 1, got {self.unroll_k}")
        need(self.mrp_loss in ("kd_diff_sum", "direct"),
             f"--mrp-loss must be 'kd_diff_sum' or 'direct', got {self.mrp_loss!r}")
        need(self.kd_precision in KD_PRECISIONS,
             f"--kd-precision must be 'fp32', 'tf32' or 'bf16', got {self.kd_precision!r}")
        need(self.num_mrp_layers >= 1, f"--mrp-layers must be >= 1, got {self.num_mrp_layers}")
        need(self.mrp_init in ("default", "normal", "continued"),
             f"--mrp-init must be 'default' or 'normal', got {self.mrp_init!r}")
        need(0 < self.mrp_init_std < math.inf, f"--mrp-init-std must be a finite number > 0, got {self.mrp_init_std}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
