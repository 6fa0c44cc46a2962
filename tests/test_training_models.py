"""training.models: a new MRP head's normal init, and which frozen projections MRP training stores in bf16."""

import pytest
import torch

from training_fixtures import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(**kw):
    """A one-layer SDAR model (no MRP head yet)."""
    from hf_integration import SDARMRPConfig, SDARMRPForCausalLM

    torch.manual_seed(0)
    return SDARMRPForCausalLM(SDARMRPConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, block_size=4, mask_token_id=1, num_nextn_predict_layers=0, **kw))


def test_normal_init_draws_the_heads_matrices_with_its_std_and_records_it():
    from training.models import init_mrp_normal

    model = _model()
    model.add_mrp_head(1)
    init_mrp_normal(model, 0.5)
    matrices = [q for q in model.mrp_parameters() if q.dim() >= 2]
    vectors = [q for q in model.mrp_parameters() if q.dim() == 1]
    assert matrices and vectors
    values = torch.cat([q.detach().flatten() for q in matrices])
    assert values.numel() > 10_000  # enough draws for the sample std to be within 5%
    assert float(values.std()) == pytest.approx(0.5, rel=0.05)
    assert all(bool((q == 1).all()) for q in vectors)  # norm weights
    assert model.config.mrp_init_std == 0.5


def test_a_projection_whose_bias_bf16_cannot_hold_stays_in_fp32():
    from training.models import freeze_all_but_mrp, frozen_projections_in_bf16

    model = _model(attention_bias=True)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        for prm in model.parameters():
            prm.copy_(prm.to(torch.bfloat16))  # bf16 values throughout ...
        attn.q_proj.bias.fill_(0.1)  # ... but a bias bf16 cannot hold (0.1 has no exact bf16 value)
    model.add_mrp_head(1)
    freeze_all_but_mrp(model)
    converted = [m for m, _ in frozen_projections_in_bf16(model)]
    assert attn.k_proj in converted and attn.k_proj.bias.dtype == torch.bfloat16
    assert attn.q_proj not in converted
    assert attn.q_proj.weight.dtype == attn.q_proj.bias.dtype == torch.float32
