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

from .attention_masks import block_causal_mask
from .configuration_sdar_mrp import SDARMRPConfig
from .generation import generate_blocks
from .modeling_mrp import MRPModule
from .modeling_sdar import SDARModel, pack_projections

logger = logging.get_logger(__name__)

MRP_PREFIX = "mrp_modules.0."
LEGACY_MRP_KEYS = {r"^mtp_modules\.": "mrp_modules."}
AUTO_MAP = {
    "AutoConfig": "configuration_sdar_mrp.SDARMRPConfig",
    "AutoModel": "modeling_sdar_mrp.SDARMRPForCausalLM",
    "AutoModelForCausalLM": "modeling_sdar_mrp.SDARMRPForCausalLM",
}


class SDARMRPPreTrainedModel(PreTrainedModel):
    config_class = SDARMRPConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
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
        super().__init__(config)
        self.model = SDARModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mrp_modules = nn.ModuleList([MRPModule(config)] if config.has_mrp else [])
        self.mrp_loaded = config.has_mrp
        self._decode_engine = None  # (key, StaticKVCache, StepGraphs) of the last graphed generate call
        self.post_init()

    def release_decode_engine(self) -> None:
        """Free the KV cache and CUDA graphs that graphed ``generate`` calls keep for the next call of the
        same shapes (calls on one model run one at a time: see :func:`.generation.one_call_at_a_time`)."""
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
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs) -> CausalLMOutput:
        """input_ids: [B, T] -> logits [B, T, V]; logits at position i predict token i (no shift).

        attention_mask: None (block-causal over T from position 0), a padding mask [B, T] of 0/1
        (padded keys are hidden), or a bool mask broadcastable to [B, 1, T, T] (True = attend).
        labels: [B, T] with -100 for positions that carry no loss (e.g. unmasked ones)."""
        if attention_mask is not None and attention_mask.dim() == 2:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            keys = position_ids.masked_fill(attention_mask == 0, -1)
            attention_mask = block_causal_mask(position_ids, keys, self.config.block_size)
            attention_mask = attention_mask | torch.eye(input_ids.shape[1], dtype=torch.bool,
                                                        device=input_ids.device)
        hidden = self.model(input_ids, position_ids, attention_mask)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def mrp_forward(self, input_ids: torch.Tensor, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, attn=None) -> torch.Tensor:
        """The MRP head: input_ids [B, T], hidden_states [B, T, H] (h_A), position_ids [B, T] -> h_p [B, T, H]."""
        self.require_mrp("mrp_forward")
        return self.mrp_modules[0](input_ids, hidden_states, self.model.embed_tokens.weight, position_ids,
                                   attention_mask, attn)

    # ---------------------------------------------------------------------------------------- MRP
    @property
    def has_mrp(self) -> bool:
        return len(self.mrp_modules) > 0 and self.mrp_loaded

    def require_mrp(self, what: str) -> None:
        if not self.has_mrp:
            raise ValueError(
                f"{what} needs MRP weights, but this model has none (the checkpoint is a plain SDAR model or "
                "its mrp_modules.* weights were missing). Use strategy='static' or 'dynamic', or load MRP "
                "weights with model.add_mrp_head(...) and model.load_mrp_state_dict(state_dict)."
            )

    def mrp_parameters(self):
        """Parameters of the MRP head (the only ones MRP training updates)."""
        return self.mrp_modules.parameters()

    def add_mrp_head(self, num_layers: int = 3) -> MRPModule:
        """Attach a freshly initialised D-layer MRP head to a backbone-only model."""
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.config.num_nextn_predict_layers = num_layers
        head = MRPModule(self.config).to(device=self.lm_head.weight.device, dtype=self.lm_head.weight.dtype)
        head.apply(self._init_weights)
        self._init_weights(head)
        self.mrp_modules = nn.ModuleList([head])
        self.mrp_loaded = True
        return head

    def load_mrp_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """Load a separately trained MRP head. Keys may carry the ``mrp_modules.0.`` / ``mtp_modules.0.``
        prefix of a full checkpoint or start at ``model.``; non-MRP keys are rejected when strict."""
        if not self.mrp_modules:
            layers = {int(m.group(1)) for k in state_dict if (m := re.search(r"model\.layers\.(\d+)\.", k))}
            self.add_mrp_head(max(layers) + 1 if layers else 1)
        renamed = {}
        for key, value in state_dict.items():
            key = re.sub(r"^mtp_modules\.", "mrp_modules.", key)
            if key.startswith(MRP_PREFIX):
                key = key[len(MRP_PREFIX):]
            elif strict and not key.startswith("model."):
                raise ValueError(f"load_mrp_state_dict: key {key!r} does not belong to an MRP head")
            renamed[key] = value
        result = self.mrp_modules[0].load_state_dict(renamed, strict=strict)
        self.mrp_loaded = True
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
            model.mrp_loaded = False
            logger.warning(f"{pretrained_model_name_or_path}: the config asks for an MRP head but "
                           f"{len(missing_mrp)} mrp_modules.* weights are missing from the checkpoint; MRP "
                           "decoding is disabled (static and dynamic work).")
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
        ids [B * num_return_sequences, P + max_new_tokens]; with ``return_dict_in_generate=True`` an output
        with ``.sequences`` and per-row ``.stats``. Keywords (also read from ``generation_config`` and the model's
        generation config): see :class:`.generation_settings.GenerationSettings`.
        """
        return generate_blocks(self, input_ids, attention_mask, generation_config, kwargs)


SDARMRPForCausalLM.register_for_auto_class("AutoModelForCausalLM")
SDARMRPConfig.register_for_auto_class("AutoConfig")

__all__ = ["SDARMRPForCausalLM", "SDARMRPPreTrainedModel"]
