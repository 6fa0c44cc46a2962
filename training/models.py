"""Building the models to train, on top of ``hf_integration``.

- :func:`build_backbone`: a fresh SDAR backbone (no MRP head) from size flags and a tokenizer.
- :func:`prepare_mrp_model`: load a backbone (or a model with an MRP head, to continue), attach
  a D-layer MRP head if needed, freeze everything else (embeddings and lm_head included).
- :func:`frozen_projections_in_bf16`: under bf16 autocast, keep the frozen backbone's projection weights in bf16
  when they are bf16 numbers already (same forward, half their memory, no cast at every use).

MRP initialisation (``--mrp-init``): ``default`` is the model's own init (transformers' normal
with ``initializer_range`` for linear weights, ones for norms); ``normal`` re-draws every 2-D
weight of the MRP head (eh_proj and all projection matrices) from N(0, ``--mrp-init-std``),
std 0.2 by default as in the authors' recipe ("MRP init N(0, 0.2)"), norm weights stay 1. The
std is recorded in the config as ``mrp_init_std``. We read the recipe's "0.2" as the standard
deviation of these weights; the authors' code is not reproduced here.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .config import ConfigError, TrainConfig


def load_model(model_dir: str, dtype=torch.float32):
    """``SDARMRPForCausalLM.from_pretrained(model_dir)`` without its warning that a checkpoint without an MRP head
    refuses MRP decoding (training gives it a head; evaluation refuses it with its own message)."""
    from hf_integration import modeling_sdar_mrp

    log = logging.getLogger(modeling_sdar_mrp.__name__)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return modeling_sdar_mrp.SDARMRPForCausalLM.from_pretrained(model_dir, dtype=dtype)
    finally:
        log.setLevel(level)


def backbone_head_dim(*, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
                      num_kv_heads: int, head_dim: int | None) -> int:
    """The head size of a backbone of these sizes (``head_dim``, or hidden / heads); raises :class:`ConfigError`
    naming the flag when the sizes do not make a model."""
    sizes = {"--hidden-size": hidden_size, "--intermediate-size": intermediate_size, "--num-layers": num_layers,
             "--num-heads": num_heads, "--num-kv-heads": num_kv_heads, "--head-dim": head_dim}
    for flag, value in sizes.items():
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if num_heads % num_kv_heads:
        raise ConfigError(f"--num-heads ({num_heads}) must be a multiple of --num-kv-heads ({num_kv_heads})")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ConfigError(f"--hidden-size ({hidden_size}) must be a multiple of --num-heads ({num_heads}) "
                              "or give --head-dim")
        head_dim = hidden_size // num_heads
    if head_dim % 2:
        raise ConfigError(f"--head-dim must be even (RoPE), got {head_dim}")
    return head_dim


def build_backbone(tokenizer_ids: dict, vocab_size: int, *, hidden_size: int, intermediate_size: int,
                   num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int | None,
                   block_size: int, max_position_embeddings: int, rope_theta: float = 1e6,
                   rms_norm_eps: float = 1e-6, tie_word_embeddings: bool = False,
                   initializer_range: float = 0.02):
    from hf_integration import SDARMRPConfig, SDARMRPForCausalLM

    head_dim = backbone_head_dim(hidden_size=hidden_size, intermediate_size=intermediate_size, num_layers=num_layers,
                                 num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    cfg = SDARMRPConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta, tie_word_embeddings=tie_word_embeddings, block_size=block_size,
        mask_token_id=tokenizer_ids["mask_token_id"], num_nextn_predict_layers=0, num_mrp_heads=1,
        bos_token_id=tokenizer_ids["eos_token_id"], eos_token_id=tokenizer_ids["eos_token_id"],
        pad_token_id=tokenizer_ids["pad_token_id"], initializer_range=initializer_range,
    )
    return SDARMRPForCausalLM(cfg)


def freeze_all_but_mrp(model: nn.Module) -> set[str]:
    """requires_grad False everywhere except the MRP head; returns the MRP parameter names."""
    mrp_ids = {id(p) for p in model.mrp_parameters()}
    names = set()
    for n, p in model.named_parameters():
        p.requires_grad_(id(p) in mrp_ids)
        if id(p) in mrp_ids:
            names.add(n)
    if not names:
        raise ConfigError("the model has no MRP parameters to train")
    for n in names:
        if n.startswith(("model.", "lm_head.")):
            raise AssertionError(f"MRP parameter {n} is shared with the backbone")
    return names


def init_mrp_normal(model: nn.Module, std: float) -> None:
    """N(0, std) for every 2-D weight of the MRP head; 1-D (norm) weights to 1."""
    with torch.no_grad():
        for p in model.mrp_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.fill_(1.0)
    model.config.mrp_init_std = std


def prepare_mrp_model(model_dir: str, num_layers: int | None = None, init: str | None = None, init_std: float = 0.2,
                      block_size: int | None = None, device=None, dtype=torch.float32) -> tuple[nn.Module, bool]:
    """Load ``model_dir``, freeze all but its MRP head, and return ``(model, continued)``: ``continued`` when the
    folder has a head, which training then continues (``num_layers``, if given, must be its depth; ``init`` must be
    None: its weights are trained ones), else a new ``num_layers``-layer head (default:
    ``TrainConfig.num_mrp_layers``) initialised by ``init`` (None or "default": the model's own init; "normal":
    N(0, ``init_std``))."""
    import os

    if not os.path.isdir(model_dir) or not os.path.exists(os.path.join(model_dir, "config.json")):
        raise ConfigError(f"--model: {model_dir!r} is not a model folder (no config.json)")
    model = load_model(model_dir, dtype)
    if block_size is not None:
        model.config.block_size = block_size
    continued = model.has_mrp
    if continued:
        depth = model.config.num_nextn_predict_layers
        if num_layers is not None and num_layers != depth:
            raise ConfigError(f"--mrp-layers {num_layers}: --model {model_dir} has a {depth}-layer MRP head, which "
                              "this run trains on; drop --mrp-layers (or give a model without a head)")
        if init is not None:
            raise ConfigError(f"--mrp-init {init} initialises a new head, but --model {model_dir} has a trained one, "
                              "which this run trains on; drop --mrp-init")
    else:
        model.add_mrp_head(TrainConfig.num_mrp_layers if num_layers is None else num_layers)
        if init == "normal":
            init_mrp_normal(model, init_std)
    if device is not None:
        model.to(device)
    freeze_all_but_mrp(model)
    return model, continued


def frozen_projections_in_bf16(model: nn.Module) -> list[tuple[nn.Linear, torch.dtype]]:
    """Store in bf16 the frozen backbone's decoder-layer projections (q/k/v/o, gate/up/down) whose weights hold bf16
    numbers already (a bf16 checkpoint loaded in fp32, as the released ones are). bf16 autocast casts each such weight
    to bf16 at every use, to these very values (frozen weights are not in its cast cache), so a forward under it
    computes the same while the weights take half the memory and no forward re-reads them in fp32 to cast them.
    Embeddings, norms, the lm_head (the KD loss reads it at ``--kd-precision``) and the MRP head keep their dtype; a
    projection with a value bf16 cannot hold is left as it is. Returns the converted modules with their dtype before,
    for :func:`restore_dtypes` (before saving the model)."""
    converted = []
    for module in model.model.layers.modules():
        if not isinstance(module, nn.Linear) or module.weight.requires_grad:
            continue
        tensors = [t for t in (module.weight, module.bias) if t is not None]
        if module.weight.dtype == torch.bfloat16 or not all(torch.equal(t, t.to(torch.bfloat16).to(t.dtype))
                                                             for t in tensors):
            continue
        converted.append((module, module.weight.dtype))
        module.to(torch.bfloat16)
    return converted


def restore_dtypes(converted: list[tuple[nn.Linear, torch.dtype]]) -> None:
    """Undo :func:`frozen_projections_in_bf16` (exactly: the values were bf16 numbers)."""
    for module, dtype in converted:
        module.to(dtype)


def set_activation_checkpointing(model: nn.Module, enable: bool) -> None:
    """Activation (gradient) checkpointing of every decoder layer, the backbone's and the MRP head's, on or off
    (``--activation-checkpointing``): a layer that trains keeps only its inputs and recomputes its activations in the
    backward pass (frozen layers run without gradients and are never recomputed). Through transformers' API, with
    torch's non-reentrant checkpoint, which the MRP loss needs (:func:`training.losses.mrp_loss_sum` refuses the
    reentrant one). Turning it off also removes the hook that makes the input embeddings require gradients."""
    # newer transformers 5.x name it activation_checkpointing_* (and warn on gradient_checkpointing_*); 5.17 has only
    # gradient_checkpointing_*
    renamed = hasattr(model, "activation_checkpointing_enable")
    if enable:
        kwargs = {"use_reentrant": False}
        if renamed:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        if renamed:
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()
        model.disable_input_require_grads()
