"""``SDARMRPForCausalLM``: the SDAR backbone, its lm_head and an optional MRP head, as a Hugging Face model.

Loads the SDAR release (``JetLM/SDAR-*-Chat``) and the MRP release (``heavyball/sdar-*-mrp-3lyr``)
as they are; ``save_pretrained`` writes ``auto_map`` and copies this package's files next to the
weights, so ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` works anywhere
``mrp_triton`` is installed.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput
from transformers.utils import logging

try:  # a checkpoint's copy of this file runs on mrp-triton's ops (transformers' import check skips try blocks)
    import mrp_triton  # noqa: F401
except ModuleNotFoundError as err:
    if err.name != "mrp_triton":
        raise
    raise ImportError("this SDAR+MRP checkpoint's code runs on the mrp-triton package (its decoding kernels and "
                      "their PyTorch references), which this Python cannot import: install it where you load the "
                      "model (pip install mrp-triton, or pip install -e <its source folder>)") from err

from .attention_masks import padded_block_causal_mask
from .configuration_sdar_mrp import SDARMRPConfig
from .generation import generate_blocks
from .modeling_mrp import MRPModule
from .modeling_sdar import SDARModel, pack_projections
from .prompts import INDEX_DTYPES, check_padding_mask, check_vocabulary_ids

logger = logging.get_logger(__name__)

MRP_PREFIX = "mrp_modules.0."
LEGACY_MRP_KEYS = {r"^mtp_modules\.": "mrp_modules."}
AUTO_MAP = {
    "AutoConfig": "configuration_sdar_mrp.SDARMRPConfig",
    "AutoModel": "modeling_sdar_mrp.SDARMRPForCausalLM",
    "AutoModelForCausalLM": "modeling_sdar_mrp.SDARMRPForCausalLM",
}


def _check_forward_inputs(config: SDARMRPConfig, input_ids, inputs_embeds, attention_mask, position_ids, labels,
                          logits_to_keep, past_key_values, flags: dict[str, bool | None]) -> tuple[int, int]:
    """Refuse what :meth:`SDARMRPForCausalLM.forward` would misread, naming the argument. Returns the input's
    [batch, seq_len]."""
    for name, flag in flags.items():
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{name} must be True, False or None, got {flag!r}")
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("forward takes input_ids [batch, seq_len] or inputs_embeds [batch, seq_len, hidden], "
                         "exactly one of them")
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in INDEX_DTYPES:
            raise ValueError(f"input_ids must be an integer tensor [batch, seq_len] (one sequence: ids[None]), got "
                             f"{_describe(input_ids)}")
        check_vocabulary_ids(input_ids, config.vocab_size)
        shape = tuple(input_ids.shape)
    else:
        if (not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3
                or inputs_embeds.shape[-1] != config.hidden_size or not inputs_embeds.is_floating_point()):
            raise ValueError(f"inputs_embeds must be a float tensor [batch, seq_len, {config.hidden_size}], got "
                             f"{_describe(inputs_embeds)}")
        shape = tuple(inputs_embeds.shape[:2])
    if 0 in shape:
        raise ValueError(f"forward got an empty batch of shape {shape}: give at least one token per row")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise ValueError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
        if attention_mask.dim() == 2:
            if tuple(attention_mask.shape) != shape:
                raise ValueError(f"attention_mask [batch, seq_len] must have the shape {shape} of the input, got "
                                 f"{tuple(attention_mask.shape)}")
            check_padding_mask(attention_mask)
        elif (attention_mask.dim() != 4 or attention_mask.dtype != torch.bool or attention_mask.shape[0] not in
              (1, shape[0]) or tuple(attention_mask.shape[1:]) != (1, shape[1], shape[1])):
            raise ValueError(f"attention_mask must be a padding mask {shape} or a bool mask "
                             f"[{_rows(shape)}, 1, {shape[1]}, {shape[1]}] (True = attend), got "
                             f"{_describe(attention_mask)}")
    if position_ids is not None and (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
                                     or position_ids.dtype not in INDEX_DTYPES or position_ids.shape[1] != shape[1]
                                     or position_ids.shape[0] not in (1, shape[0])):
        raise ValueError(f"position_ids must be an integer tensor [{_rows(shape)}, {shape[1]}], got "
                         f"{_describe(position_ids)}")
    if labels is not None and (not isinstance(labels, torch.Tensor) or tuple(labels.shape) != shape
                               or labels.dtype not in INDEX_DTYPES):
        raise ValueError(f"labels must be an integer tensor {shape} (-100 where no loss), got {_describe(labels)}")
    if labels is not None:
        check_vocabulary_ids(labels, config.vocab_size, "labels", ignored=-100,
                             fix="-100 marks a position without loss")
    if isinstance(logits_to_keep, bool) or not (
            (isinstance(logits_to_keep, int) and logits_to_keep >= 0)
            or (isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.dim() == 1
                and logits_to_keep.dtype in INDEX_DTYPES)):
        raise ValueError(f"logits_to_keep must be an int >= 0 (the last n positions; 0: all) or a 1-D tensor of "
                         f"positions, got {logits_to_keep!r}")
    if labels is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError("labels score every position: drop logits_to_keep (or set it to 0) when giving labels")
    if past_key_values is not None:
        raise ValueError("forward scores whole sequences and takes no past_key_values: decode with generate(), "
                         "which keeps its own KV cache")
    if flags["output_attentions"]:
        raise ValueError("output_attentions=True is not supported: attention runs in fused kernels (SDPA, "
                         "FlexAttention) that never form the attention weights")
    return shape


def _rows(shape: tuple[int, int]) -> str:
    """How many rows a broadcast [rows, ...] input may have for an input of ``shape`` [batch, seq_len]."""
    return "1" if shape[0] == 1 else f"{shape[0]} or 1"


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} dtype {value.dtype}"
    return type(value).__name__


def _mrp_head_keys(state_dict: dict[str, torch.Tensor], strict: bool) -> dict[str, torch.Tensor]:
    """The MRP head's entries of ``state_dict``, keyed as the head names them (``model.*``): a whole checkpoint's
    ``mrp_modules.0.*`` (or legacy ``mtp_modules.0.*``) entries when it has any, its other keys (the backbone's)
    left out; else every entry, each of which must then start with ``model.`` when ``strict``."""
    (legacy, current), = LEGACY_MRP_KEYS.items()
    named = [(re.sub(legacy, current, key), value) for key, value in state_dict.items()]
    whole = any(key.startswith(current) for key, _ in named)
    head = {}
    for key, value in named:
        if whole and not key.startswith(current):
            continue
        if key.startswith(MRP_PREFIX):
            key = key[len(MRP_PREFIX):]
        elif strict and not whole and not key.startswith("model."):
            raise ValueError(f"load_mrp_state_dict: key {key!r} does not belong to an MRP head (its keys start "
                             f"with 'model.', or with {MRP_PREFIX!r} in a whole checkpoint)")
        if key in head:
            raise ValueError(f"load_mrp_state_dict: the MRP head's key {key!r} is given twice (as mrp_modules.* "
                             "and as legacy mtp_modules.*); pass one of them")
        head[key] = value
    return head


class SDARMRPPreTrainedModel(PreTrainedModel):
    config_class = SDARMRPConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True  # each SDARDecoderLayer, backbone and MRP head alike
    _no_split_modules = ["SDARDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.mrp_init_std
        if std is not None and isinstance(module, MRPModule):
            for name, param in module.named_parameters():
                if param.dim() == 2:
                    nn.init.normal_(param, mean=0.0, std=std)


class SDARMRPForCausalLM(SDARMRPPreTrainedModel, GenerationMixin):
    """Block-diffusion LM. ``forward`` scores a whole block-causal sequence (training, checks);
    ``generate`` runs the block-diffusion decoding loop with a static KV cache."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: SDARMRPConfig):
        config._validate()  # again: from_pretrained sets its overrides (mask_token_id=...) after the config's __init__
        super().__init__(config)
        self.model = SDARModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mrp_modules = nn.ModuleList([MRPModule(config)] if config.has_mrp else [])
        self._decode_engine = None  # (key, StaticKVCache, StepGraphs) of the last graphed generate call
        self.post_init()

    def release_decode_engine(self) -> None:
        """Free the KV cache and CUDA graphs that graphed ``generate`` calls keep for the next call of the
        same shapes (calls on one model run one at a time: see :func:`.generation.one_call_at_a_time`)."""
        if self._decode_engine is not None:
            self._decode_engine[1].graphs.clear()  # the recorded steps' closures hold the decoder, which holds it
        self._decode_engine = None

    def pack_projections(self) -> bool:
        """Lay each decoder layer's q/k/v and gate/up weights (backbone and MRP head) out one after another in
        one storage, so that decoding runs each group as one GEMM (``generate`` does this itself; see
        :func:`.modeling_sdar.pack_linears`: the parameters keep their identity, names, shapes and values).
        Returns whether every layer is packed."""
        return pack_projections(self)

    # ----------------------------------------------------------------------------------- embeddings
    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    # ------------------------------------------------------------------------------------- forwards
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 0,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                use_cache: bool | None = None, past_key_values=None,
                output_attentions: bool | None = None) -> CausalLMOutput | tuple:
        """Scores whole sequences at once, block-causally: input_ids [B, T] (or ``inputs_embeds`` [B, T, H]) ->
        logits [B, T, V]; the logits at position i predict token i (no shift: give a masked state to see what
        the model would reveal). Decoding, with its KV cache, is :meth:`generate`'s.

        attention_mask: None (every token real, positions 0..T-1), a padding mask [B, T] of 0/1 (left or right
        padding: padding keys are hidden and, unless ``position_ids`` are given, each row's real tokens count
        from 0, so a row scores as it does alone), or a bool mask [B or 1, 1, T, T] (True = attend).
        position_ids: [B or 1, T]. labels: [B, T] with -100 for positions that carry no loss (the loss is the
        mean cross entropy of the rest, unshifted).
        logits_to_keep: an int n > 0 computes the logits of the last n positions only (0: all), a 1-D tensor
        those positions. output_hidden_states: also return the L + 1 hidden states [B, T, H] (embeddings, each
        layer's output, the final normed states), as transformers does. return_dict=False: a tuple.
        use_cache is accepted and changes nothing (a forward keeps no cache); ``past_key_values`` and
        ``output_attentions=True`` are refused."""
        shape = _check_forward_inputs(self.config, input_ids, inputs_embeds, attention_mask, position_ids, labels,
                                      logits_to_keep, past_key_values,
                                      dict(output_hidden_states=output_hidden_states, return_dict=return_dict,
                                           use_cache=use_cache, output_attentions=output_attentions))
        if position_ids is not None:
            position_ids = position_ids.expand(shape)
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask, position_ids = padded_block_causal_mask(attention_mask, position_ids,
                                                                    self.config.block_size)
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None \
            else output_hidden_states
        hidden_states = [] if output_hidden_states else None
        hidden = self.model(input_ids, position_ids, attention_mask, inputs_embeds=inputs_embeds,
                            hidden_states=hidden_states)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep])
        loss = None
        if labels is not None:
            scores = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 / fp16 logits: in fp32
            loss = nn.functional.cross_entropy(scores.flatten(0, 1), labels.flatten(), ignore_index=-100)
        out = CausalLMOutput(loss=loss, logits=logits,
                             hidden_states=None if hidden_states is None else tuple(hidden_states))
        return out if (self.config.return_dict if return_dict is None else return_dict) else out.to_tuple()

    def mrp_forward(self, input_ids: torch.Tensor, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, attn=None) -> torch.Tensor:
        """The MRP head: input_ids [B, T], hidden_states [B, T, H] (h_A), position_ids [B, T] -> h_p [B, T, H]."""
        self.require_mrp("mrp_forward")
        return self.mrp_modules[0](input_ids, hidden_states, self.model.embed_tokens.weight, position_ids,
                                   attention_mask, attn)

    # ---------------------------------------------------------------------------------------- MRP
    @property
    def has_mrp(self) -> bool:
        return len(self.mrp_modules) > 0

    def require_mrp(self, what: str) -> None:
        if not self.has_mrp:
            raise ValueError(
                f"{what} needs MRP weights, but this model has none (the checkpoint is a plain SDAR model or "
                "its mrp_modules.* weights were missing). Use strategy='static', 'dynamic', 'sequential' or "
                "'entropy_bounded', or load MRP weights with model.add_mrp_head(...) and "
                "model.load_mrp_state_dict(state_dict)."
            )

    def mrp_parameters(self):
        """Parameters of the MRP head (the only ones MRP training updates)."""
        return self.mrp_modules.parameters()

    def add_mrp_head(self, num_layers: int = 3) -> MRPModule:
        """Attach a freshly initialised D-layer MRP head to the model (replacing any head it has)."""
        return self._attach_mrp_head(self._new_mrp_head(num_layers))

    def _new_mrp_head(self, num_layers: int) -> MRPModule:
        """A freshly initialised head of ``num_layers`` layers on the lm_head's device and dtype, not attached."""
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        head = MRPModule(self.config, num_layers).to(device=self.lm_head.weight.device,
                                                     dtype=self.lm_head.weight.dtype)
        head.apply(self._init_weights)
        self._init_weights(head)
        return head

    def _attach_mrp_head(self, head: MRPModule | None) -> MRPModule | None:
        """Make ``head`` the model's MRP head (None: the model has none), the config saying how many layers."""
        self.mrp_modules = nn.ModuleList([head] if head is not None else [])
        self.config.num_nextn_predict_layers = len(head.model.layers) if head is not None else 0
        return head

    def load_mrp_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """Load a separately trained MRP head: the keys of the head alone (``model.*``), or a whole checkpoint's
        state dict, whose ``mrp_modules.0.`` / ``mtp_modules.0.`` keys are then the head's and the rest (the
        backbone's) are left out. A model without a head gets one with as many layers as the keys name.

        Nothing changes unless every key fits: with ``strict``, the head's keys must be exactly the head's
        parameters; in any case a key of the wrong shape, or one given twice, a value that is no tensor, and a state
        dict none of whose keys is the head's (``strict=False`` would attach an untrained head) raise a
        ``ValueError``."""
        renamed = _mrp_head_keys(state_dict, strict)
        odd = [k for k, v in renamed.items() if not isinstance(v, torch.Tensor) or v.is_meta]
        if odd:
            raise ValueError(f"load_mrp_state_dict: {odd[:4]} hold no weights (a value that is not a tensor, or a "
                             "tensor on the meta device)")
        head = self.mrp_modules[0] if self.mrp_modules else None
        if head is None:
            layers = {int(m.group(1)) for k in renamed if (m := re.match(r"model\.layers\.(\d+)\.", k))}
            head = self._new_mrp_head(max(layers) + 1 if layers else 1)
        expected = head.state_dict()
        missing = sorted(set(expected) - set(renamed))
        unexpected = sorted(set(renamed) - set(expected))
        if not set(expected) & set(renamed):  # (strict=False would attach an untrained head, or change nothing)
            raise ValueError(f"load_mrp_state_dict: none of the state dict's {len(renamed)} keys is a weight of this "
                             f"{len(head.model.layers)}-layer MRP head (e.g. {sorted(renamed)[:2]}; the head's: "
                             f"{sorted(expected)[:2]}); strip a prefix such as 'module.' first")
        if strict and (missing or unexpected):
            raise ValueError(f"load_mrp_state_dict: the state dict does not fit this {len(head.model.layers)}-layer "
                             f"MRP head (missing: {missing[:4]}, unexpected: {unexpected[:4]}); pass the head's "
                             "keys, or strict=False to load the ones that fit")
        wrong = [f"{k}: {tuple(renamed[k].shape)} for {tuple(expected[k].shape)}" for k in renamed
                 if k in expected and renamed[k].shape != expected[k].shape]
        if wrong:
            raise ValueError(f"load_mrp_state_dict: shapes do not fit this model's MRP head: {wrong[:4]}")
        result = head.load_state_dict(renamed, strict=strict)
        self._attach_mrp_head(head)
        return result

    # ------------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """As :meth:`PreTrainedModel.from_pretrained`; also accepts legacy ``mtp_modules.`` keys and
        warns (then refuses MRP decoding) when the checkpoint has no MRP weights."""
        legacy_only = "key_mapping" not in kwargs
        kwargs.setdefault("key_mapping", dict(LEGACY_MRP_KEYS))
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                              **kwargs)
        if legacy_only and getattr(model, "_weight_conversions", None) is not None:
            # The legacy renaming is one-way: save_pretrained must keep writing mrp_modules.* keys.
            model._weight_conversions = None
        missing_mrp = [k for k in info.get("missing_keys", []) if k.startswith("mrp_modules.")]
        if not model.config.has_mrp:
            logger.warning(f"{pretrained_model_name_or_path} has no MRP head: strategies 'static' and "
                           "'dynamic' work; MRP strategies will raise until an MRP head is loaded.")
        elif missing_mrp:
            model._attach_mrp_head(None)  # no randomly initialised head to decode with or to save
            logger.warning(f"{pretrained_model_name_or_path}: the config asks for an MRP head but "
                           f"{len(missing_mrp)} mrp_modules.* weights are missing from the checkpoint; the head is "
                           "left out (config.num_nextn_predict_layers = 0), so MRP decoding is disabled (static "
                           "and dynamic work) and save_pretrained writes the backbone alone.")
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        self.config.auto_map = dict(AUTO_MAP)
        return super().save_pretrained(save_directory, *args, **kwargs)

    # ---------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 generation_config=None, **kwargs):
        """Block-diffusion decoding.

        input_ids (or ``inputs``, transformers' name): [B, P] (left or right padded, with ``attention_mask`` [B, P]
        of 0/1) ->
        ids [B * num_return_sequences, P + max_new_tokens] (the largest, given one per prompt); with
        ``return_dict_in_generate=True`` an output with ``.sequences`` and per-row ``.stats``. Keywords (also read
        from ``generation_config`` and the model's generation config): see
        :class:`.generation_settings.GenerationSettings`.
        """
        return generate_blocks(self, input_ids, attention_mask, generation_config, kwargs)


SDARMRPForCausalLM.register_for_auto_class("AutoModelForCausalLM")
SDARMRPConfig.register_for_auto_class("AutoConfig")

__all__ = ["SDARMRPForCausalLM", "SDARMRPPreTrainedModel"]
