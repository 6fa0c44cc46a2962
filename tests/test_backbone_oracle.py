"""The SDAR backbone against an implementation that is not ours (transformers' Qwen3 with the block-causal mask), and
the MRP head's input against its specification (method.md section 3) written out in plain torch."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3Model

from hf_integration.attention_masks import block_causal_mask
from hf_integration.modeling_sdar import rotary_cos_sin, run_decoder_layers
from tiny_models import random_prompts, tiny_model


@pytest.mark.parametrize("block_size", [1, 4])
def test_backbone_is_qwen3_with_a_block_causal_mask(block_size):
    """Same weights, same positions: our backbone's hidden states (each layer's, as ``output_hidden_states`` returns
    them, and the final normed ones) equal Qwen3Model's given the block-causal mask as an additive 4-D mask
    (block 1: plain causal attention). HF computes RoPE in float32, hence the tolerance in float64. Every RMSNorm
    weight is drawn (a fresh model has them all at 1), so a norm applied in another's place shows; the other weights
    are drawn with std 0.2: at the initializer's 0.02 the attention barely moves the hidden states, and swapped q/k
    norm weights or other RoPE frequencies stayed within the tolerance."""
    model = tiny_model(seed=5, block_size=block_size, rms_norm_eps=0.05)  # an eps that shows where it is missed
    c = model.config
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, weight in model.model.named_parameters():
            if "norm" in name:
                weight.copy_(torch.rand(weight.shape, generator=g, dtype=weight.dtype) + 0.5)
            else:
                weight.copy_(torch.randn(weight.shape, generator=g, dtype=weight.dtype) * 0.2)
    qwen = Qwen3Model(Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters), max_position_embeddings=c.max_position_embeddings,
        attn_implementation="eager")).to(torch.float64).eval()
    qwen.load_state_dict(model.model.state_dict(), strict=True)
    ids = random_prompts(2, 11, seed=3)
    positions = torch.arange(11).expand(2, -1)
    visible = block_causal_mask(positions, positions, block_size)
    additive = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, float("-inf"))
    with torch.no_grad():
        ours = model(ids, position_ids=positions, output_hidden_states=True).hidden_states
        theirs = qwen(input_ids=ids, position_ids=positions, attention_mask=additive,
                      output_hidden_states=True).hidden_states
    assert len(ours) == len(theirs) == c.num_hidden_layers + 1
    for layer, (h, expected) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(h, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"hidden state {layer}: {m}")
    torch.testing.assert_close(ours[-1], model.model(ids, positions), rtol=0, atol=0)


def test_mrp_head_projects_the_normed_embedding_and_hidden_state_then_runs_its_layers():
    """x = eh_proj(concat(enorm(E[ids]), hnorm(h))), then the head's layers and norm: with enorm and hnorm
    weights that differ (a fresh model has both at 1), so a swap of the two norms or of the halves shows."""
    model = tiny_model(seed=7, rms_norm_eps=0.05)  # an eps that shows where it is missed
    m, c = model.mrp_modules[0].model, model.config
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for norm in (m.enorm, m.hnorm):
            norm.weight.copy_(torch.rand(c.hidden_size, generator=g, dtype=torch.float64) + 0.5)
    ids = random_prompts(2, 6, seed=2)
    h = torch.randn(2, 6, c.hidden_size, generator=g, dtype=torch.float64)
    positions = torch.arange(6).expand(2, -1)

    def rms_norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * weight

    embedded = model.model.embed_tokens.weight[ids]
    with torch.no_grad():
        x = m.eh_proj(torch.cat([rms_norm(embedded, m.enorm.weight), rms_norm(h, m.hnorm.weight)], dim=-1))
        expected = run_decoder_layers(m.layers, m.norm, x, c, positions, None, None)
        got = model.mrp_forward(ids, h, positions)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # the kernel computes in float32


def test_linear_rope_scaling_divides_the_positions_by_its_factor():
    """RoPE tables in fp32 unless asked otherwise; ``rope_type="linear"`` with factor 2 at position p is the
    default table at p / 2."""
    plain = tiny_model(seed=0).config
    scaled = tiny_model(seed=0, rope_parameters=dict(plain.rope_parameters, rope_type="linear", factor=2.0)).config
    positions = torch.arange(12).expand(2, -1)
    got, want = rotary_cos_sin(scaled, positions), rotary_cos_sin(plain, positions / 2)
    assert all(t.dtype == torch.float32 and t.shape == (2, 12, plain.head_dim) for t in got + want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(got[1], rotary_cos_sin(plain, positions)[1])
    assert all(t.dtype == torch.bfloat16 for t in rotary_cos_sin(plain, positions, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_dtype", [None, torch.float32])
def test_reference_ops_round_as_qwen3s_modules_do(dtype, weight_dtype):
    """In bf16 / fp16, the reference ops (the CPU path, and the kernels' oracle) equal transformers' Qwen3 modules bit
    for bit: RMSNorm (variance in fp32, the normalised row rounded to the input's dtype before the weight, which may be
    fp32: autocast's master weights), its residual add, the q/k head norms with rotate-half RoPE (tables cast to q's
    dtype, each product rounded), SwiGLU (silu rounded before the multiply), and the MRP input (the embedding row in
    hidden's dtype before enorm). The float64 tests above cannot see a rounding point moved; this one does."""
    from transformers.activations import ACT2FN
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from mrp_triton import reference as ref

    g = torch.Generator().manual_seed(0)

    def draw(*shape, scale=1.0, dt=dtype):
        return (torch.randn(shape, generator=g) * scale).to(dt)

    def hf_norm(x, weight, eps):
        norm = Qwen3RMSNorm(weight.shape[0], eps=eps).to(weight.dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
        return norm(x).detach()

    def same(got, want, what):
        assert got.dtype == want.dtype and torch.equal(got, want), f"{what}: the reference rounds unlike Qwen3's"

    eps, H, D = 1e-6, 96, 32
    x, r, w = draw(4, 6, H, scale=3.0), draw(4, 6, H), draw(H, dt=weight_dtype or dtype)
    same(ref.rms_norm(x, w, eps), hf_norm(x, w, eps), "rms_norm")
    y, s = ref.rms_norm(x, w, eps, r)
    same(s, x + r, "rms_norm's residual stream")
    same(y, hf_norm(x + r, w, eps), "rms_norm after the residual add")
    q, k, qw, kw = draw(2, 5, 4, D, scale=2.0), draw(2, 5, 2, D, scale=2.0), draw(D), draw(D)
    angle = torch.randn(2, 5, D, generator=g) * 3.0
    cos, sin = angle.cos(), angle.sin()  # fp32 tables, cast to q's dtype as Qwen3's rotary embedding returns them
    expect = apply_rotary_pos_emb(hf_norm(q, qw, eps), hf_norm(k, kw, eps), cos.to(dtype), sin.to(dtype),
                                  unsqueeze_dim=2)
    for got, want, what in zip(ref.qk_norm_rope(q, k, qw, kw, cos, sin, eps), expect, ("q", "k")):
        same(got, want, f"qk_norm_rope's {what}")
    gate, up = draw(4, 6, H, scale=4.0), draw(4, 6, H, scale=2.0)
    same(ref.swiglu(gate, up), ACT2FN["silu"](gate) * up, "swiglu")
    ids, E, h = torch.tensor([3, 0, 3, 7]), draw(8, H, dt=torch.float32), draw(4, H, scale=5.0)
    ew, hw = draw(H, dt=weight_dtype or dtype), draw(H, dt=weight_dtype or dtype)
    expect = torch.cat([hf_norm(E[ids].to(dtype), ew, eps), hf_norm(h, hw, eps)], dim=-1)
    same(ref.mrp_input(ids, E, h, ew, hw, eps), expect, "mrp_input")
