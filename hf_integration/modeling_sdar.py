"""SDAR backbone: a Qwen3 decoder whose causal mask is block-causal (see attention_masks.py).

Parameter names are exactly those of the Hub checkpoints (``model.embed_tokens``,
``model.layers.N.self_attn.{q,k,v,o}_proj``, ``...self_attn.{q,k}_norm``,
``...mlp.{gate,up,down}_proj``, ``...input_layernorm``, ``...post_attention_layernorm``,
``model.norm``). Norms, q/k-norm + RoPE and SwiGLU go through the :mod:`mrp_triton` ops (fused
Triton kernels on CUDA, the PyTorch reference on CPU). For decoding, each layer's q/k/v projections and
its gate/up projections can run as one GEMM each (:func:`pack_linears`): the parameters keep their
names, shapes and identity, only their storage is laid out one after another.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers.modeling_layers import GradientCheckpointingLayer

import mrp_triton

from .attention_masks import block_causal_mask
from .configuration_sdar_mrp import SDARMRPConfig
from .kv_cache import AttentionInputs


class SDARRMSNorm(nn.Module):
    """RMSNorm with a learned scale ``weight [H]``; optionally adds a residual first."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return mrp_triton.rms_norm(x, self.weight, self.eps, residual)


def _adjacent(params: Sequence[torch.Tensor]) -> bool:
    """Whether ``params`` (of one dtype) are contiguous and lie one right after another in one storage."""
    storage, end = params[0].untyped_storage().data_ptr(), params[0].data_ptr()
    for p in params:
        if not p.is_contiguous() or p.data_ptr() != end or p.untyped_storage().data_ptr() != storage:
            return False
        end += p.numel() * p.element_size()
    return True


def pack_linears(linears: Sequence[nn.Linear]) -> bool:
    """Lay the weights (and biases) of ``linears``, which read the same input, out one after another in one
    storage, so that :func:`packed_linears` runs them as one GEMM. Each parameter keeps its identity, name,
    shape and values (only its ``.data`` moves into the new storage): optimizers, state dicts and
    ``save_pretrained`` see no change, also when this runs under ``torch.inference_mode`` (the new storage is a
    normal tensor, so training may follow). Already packed: nothing moves. Returns whether they are packed; False
    (nothing moved) when their parameters live on the meta device or differ in dtype or device."""
    groups = [[lin.weight for lin in linears]]
    if linears[0].bias is not None:
        groups.append([lin.bias for lin in linears])
    for group in groups:
        if any(p is None or p.is_meta or p.dtype != group[0].dtype or p.device != group[0].device for p in group):
            return False
    for group in groups:
        if not _adjacent(group):
            with torch.inference_mode(False), torch.no_grad():
                packed = torch.cat([p.detach() for p in group])
                for p, part in zip(group, packed.split([p.shape[0] for p in group])):
                    p.data = part
    return True


def packed_linears(x: torch.Tensor, linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x) for linear in linears)`` as one GEMM, for parameters :func:`pack_linears` packed (the
    caller's guarantee; inference only: no gradient reaches them). x: [..., in] -> views [..., out_i] of one
    [..., sum(out_i)] output."""
    first, sizes = linears[0], [lin.out_features for lin in linears]
    weight = first.weight.as_strided((sum(sizes), first.in_features), (first.in_features, 1))
    bias = None if first.bias is None else first.bias.as_strided((sum(sizes),), (1,))
    return F.linear(x, weight, bias).split(sizes, dim=-1)


def project(x: torch.Tensor, linears: Sequence[nn.Linear], packed: bool) -> tuple[torch.Tensor, ...]:
    """Each of ``linears`` applied to x: as one GEMM when ``packed`` (see :func:`packed_linears`)."""
    return packed_linears(x, linears) if packed else tuple(lin(x) for lin in linears)


def rotary_cos_sin(config: SDARMRPConfig, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32):
    """RoPE tables for absolute ``position_ids [B, T]`` -> (cos, sin), each ``[B, T, head_dim]`` in ``dtype``.

    Computed on the fly (no buffers, so meta-device loading has nothing to re-materialise)."""
    dim = config.head_dim
    device = position_ids.device
    inv_freq = config.rope_theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)
    positions = position_ids.to(torch.float64)
    if config.rope_parameters["rope_type"] == "linear":
        positions = positions / float(config.rope_parameters["factor"])
    angles = positions.unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None,
                     expand_kv: bool) -> torch.Tensor:
    """Grouped-query attention with ``mask``: bool (True = may attend) or a FlexAttention ``BlockMask`` (training's
    ``[noisy | clean]`` masks on CUDA: ``training.noising.BlockDiffusionMasks``). q: [B, Hq, T, D], k and v:
    [B, Hkv, S, D] -> [B, Hq, T, D]. A ``BlockMask`` runs ``flex_attention`` (compiled on CUDA, which fuses it into
    one kernel that skips the masked tiles; in the autocast dtype under autocast, as SDPA runs). With a bool mask,
    ``expand_kv`` repeats each key/value head for its query heads first: on CUDA, SDPA's flash kernel takes no
    mask and its memory-efficient kernel no grouped heads, so a masked ``enable_gqa`` call falls back to the math
    kernel, which writes the [T, S] scores of every head; with the heads expanded the memory-efficient kernel takes
    it."""
    grouped = k.shape[1] != q.shape[1]
    if isinstance(mask, BlockMask):
        device = q.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        attend = _compiled_flex_attention() if q.is_cuda else flex_attention
        return attend(q, k, v, block_mask=mask, enable_gqa=grouped)
    if expand_kv and mask is not None and grouped:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


@functools.cache
def _compiled_flex_attention():
    """``flex_attention`` compiled once per process. Training calls it with a few shapes (2T or T queries, with and
    without grad, a smaller last held-out batch): after the first recompile torch.compile treats the sizes that
    changed as dynamic, which keeps these within its recompile limit (past it, dynamo would run the eager
    fallback, which writes every head's scores)."""
    return torch.compile(flex_attention)


class SDARAttention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm before RoPE; reads/writes cache slot ``layer_idx``."""

    def __init__(self, config: SDARMRPConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = SDARRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = SDARRMSNorm(self.head_dim, config.rms_norm_eps)

    @property
    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
        """x: [B, T, H], cos/sin: [B, T, head_dim] -> [B, T, H] (a ragged forward, ``attn.tokens``: B = 1, T = L; the
        attention finds the grid's positions through ``attn.places()``)."""
        q, k, v = (rearrange(t, "b t (h d) -> b t h d", d=self.head_dim)
                   for t in project(x, self.projections, attn.packed))
        q, k = mrp_triton.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, cos, sin, self.eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if attn.cache is None:
            if attn.kv_out is not None:
                attn.kv_out[self.layer_idx] = (k, v)
            if attn.kv_in is not None:
                k_in, v_in = attn.kv_in[self.layer_idx]
                k, v = torch.cat([k, k_in], 2), torch.cat([v, v_in], 2)
            out = masked_attention(q, k, v, attn.mask, expand_kv=q.is_cuda)
        else:
            past_k, past_v = attn.cache.prefix(self.layer_idx)
            if attn.write_len:  # visible from the next forward on (after cache.advance)
                attn.write(self.layer_idx, k, v)
            out = mrp_triton.cached_attention(q, k, v, past_k, past_v, attn.cache.lengths, attn.positions,
                                              attn.block_size, attn.segments, attn.places(), attn.computing_rows())
        return self.o_proj(rearrange(out, "b h t d -> b t (h d)"))


class SDARMLP(nn.Module):
    def __init__(self, config: SDARMRPConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    @property
    def projections(self) -> tuple[nn.Linear, nn.Linear]:
        return self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, packed: bool = False) -> torch.Tensor:
        """x: [..., H] -> [..., H]; ``packed``: gate and up as one GEMM (see :func:`packed_linears`)."""
        return self.down_proj(mrp_triton.swiglu(*project(x, self.projections, packed)))


class SDARDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm transformer layer. Its residual adds are fused into the norms after them: the attention's into the
    post-attention norm, the MLP's into the next layer's input norm (or the stack's final norm).

    Under transformers' activation (gradient) checkpointing, a layer that runs in training mode with gradients on
    keeps only its inputs and recomputes its activations in the backward pass; decoding runs without gradients, so it
    is never checkpointed. Its keys and values (``attn.kv_out``) escape the checkpointed region, which only torch's
    non-reentrant checkpoint backpropagates through (transformers' default, ``use_reentrant=False``)."""

    def __init__(self, config: SDARMRPConfig, layer_idx: int):
        super().__init__()
        self.self_attn = SDARAttention(config, layer_idx)
        self.mlp = SDARMLP(config)
        self.input_layernorm = SDARRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = SDARRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, H], the previous layer's MLP output to add to the ``residual`` stream [B, T, H] (for the first
        layer: its input, residual None). Returns (this layer's MLP output, the stream before it): the layer's
        output is their sum."""
        normed, residual = (self.input_layernorm(x), x) if residual is None else \
            self.input_layernorm(x, residual=residual)
        h = self.self_attn(normed, cos, sin, attn)
        normed, residual = self.post_attention_layernorm(h, residual=residual)
        return self.mlp(normed, attn.packed), residual


def run_decoder_layers(layers: nn.ModuleList, norm: SDARRMSNorm, x: torch.Tensor, config: SDARMRPConfig,
                       position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       attn: AttentionInputs | None, hidden_states: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The decoder ``layers`` and the final ``norm`` (the last residual add fused into it); shared by the backbone
    and the MRP head. x: [B, T, H], position_ids: [B, T] -> [B, T, H] (ragged, ``attn.tokens``: B = 1, T = L).

    Without ``attn`` the stack attends only over x itself, with ``attention_mask`` (bool, broadcastable
    to [B, 1, T, T]) or, if that is None, the block-causal mask of ``position_ids``. A ``hidden_states`` list gets
    transformers' L + 1 hidden states appended (each [B, T, H]): x, the output of each layer but the last, and the
    returned normed output."""
    if attn is None:
        if attention_mask is None:
            attention_mask = block_causal_mask(position_ids, position_ids, config.block_size)
        attn = AttentionInputs(mask=attention_mask)
    cos, sin = rotary_cos_sin(config, position_ids) if attn.rope is None else attn.rope[position_ids].unbind(-2)
    if hidden_states is not None:
        hidden_states.append(x)
    residual = None
    for i, layer in enumerate(layers):
        x, residual = layer(x, residual, cos, sin, attn)
        if hidden_states is not None and i < len(layers) - 1:
            hidden_states.append(x + residual)
    out = norm(x) if residual is None else norm(x, residual=residual)[0]
    if hidden_states is not None:
        hidden_states.append(out)
    return out


def pack_projections(module: nn.Module) -> bool:
    """Pack the q/k/v and the gate/up projections of every decoder layer in ``module`` (:func:`pack_linears`);
    returns whether all are packed."""
    groups = [m.projections for m in module.modules() if isinstance(m, (SDARAttention, SDARMLP))]
    return all([pack_linears(group) for group in groups])


class SDARModel(nn.Module):
    """The backbone: embeddings, decoder layers (cache slots 0..L-1) and the final norm."""

    def __init__(self, config: SDARMRPConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(SDARDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = SDARRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, attn: AttentionInputs | None = None,
                inputs_embeds: torch.Tensor | None = None,
                hidden_states: list[torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids: [B, T] (or their embeddings, ``inputs_embeds`` [B, T, H]) -> hidden states after the final
        norm (h_A), [B, T, H].

        position_ids default to 0..T-1. See :func:`run_decoder_layers` for the masks and ``hidden_states``."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device).expand(x.shape[:2])
        return run_decoder_layers(self.layers, self.norm, x, self.config, position_ids, attention_mask, attn,
                                  hidden_states)
