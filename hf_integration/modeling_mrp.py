"""The MRP head: a small transformer that predicts the residual between adjacent denoising steps.

Layout of the authors' checkpoints (``mrp_modules.0.model.*``)::

    enorm.weight [H], hnorm.weight [H], eh_proj.weight [H, 2H], layers.{0..D-1}.*, norm.weight [H]

``h_p = norm(layers(eh_proj([enorm(E[ids]) | hnorm(h)])))``. The head owns no embedding and no
lm_head: the backbone's are passed in. Its D layers use KV-cache slots L..L+D-1 (after the backbone's L).
"""

from __future__ import annotations

import torch
from torch import nn

import mrp_triton

from .configuration_sdar_mrp import SDARMRPConfig
from .kv_cache import AttentionInputs
from .modeling_sdar import SDARDecoderLayer, SDARRMSNorm, run_decoder_layers


class MRPLayers(nn.Module):
    def __init__(self, config: SDARMRPConfig, num_layers: int):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.enorm = SDARRMSNorm(h, config.rms_norm_eps)
        self.hnorm = SDARRMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        first_slot = config.num_hidden_layers
        self.layers = nn.ModuleList(SDARDecoderLayer(config, first_slot + d)
                                    for d in range(num_layers))
        self.norm = SDARRMSNorm(h, config.rms_norm_eps)


class MRPModule(nn.Module):
    """One MRP head of ``num_layers`` decoder layers (default: ``config.num_nextn_predict_layers``);
    ``self.model`` carries the checkpoint's parameter names."""

    def __init__(self, config: SDARMRPConfig, num_layers: int | None = None):
        super().__init__()
        self.model = MRPLayers(config, config.num_nextn_predict_layers if num_layers is None else num_layers)

    def forward(self, input_ids: torch.Tensor, hidden_states: torch.Tensor, embed_weight: torch.Tensor,
                position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                attn: AttentionInputs | None = None) -> torch.Tensor:
        """input_ids: [B, T] (the block after the newly committed tokens), hidden_states: [B, T, H]
        (backbone h_A, post-norm, from the state before that commit; plus the running residual sum when
        chaining), embed_weight: [V, H], position_ids: [B, T] -> h_p [B, T, H]."""
        m = self.model
        b, t, h = hidden_states.shape
        x = mrp_triton.mrp_input(input_ids.reshape(-1), embed_weight, hidden_states.reshape(-1, h),
                                 m.enorm.weight, m.hnorm.weight, m.config.rms_norm_eps)
        x = m.eh_proj(x.view(b, t, 2 * h))
        return run_decoder_layers(m.layers, m.norm, x, m.config, position_ids, attention_mask, attn)
