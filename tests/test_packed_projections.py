"""Packed projections: each decoder layer's q/k/v and gate/up weights laid out in one storage, run as one GEMM each
in decoding, with the parameters unchanged as the rest of the world sees them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_integration import SDARMRPForCausalLM, modeling_sdar
from hf_integration.modeling_sdar import pack_linears, packed_linears
from tiny_models import random_prompts, tiny_model


def _storage_layout(model) -> list[tuple[int, int]]:
    """(storage, offset) of every parameter: what packing moves."""
    return [(p.untyped_storage().data_ptr(), p.storage_offset()) for p in model.parameters()]


def _is_packed(linears) -> bool:
    first = linears[0].weight
    ends = [first.data_ptr()]
    for lin in linears:
        ends.append(ends[-1] + lin.weight.numel() * lin.weight.element_size())
    return [lin.weight.data_ptr() for lin in linears] == ends[:-1] and \
        len({lin.weight.untyped_storage().data_ptr() for lin in linears}) == 1


@pytest.mark.parametrize("bias", [False, True])
def test_pack_linears_keeps_parameters_and_runs_them_as_one_gemm(bias):
    torch.manual_seed(0)
    linears = [nn.Linear(12, n, bias=bias, dtype=torch.float64) for n in (8, 4, 4)]
    params = [p for lin in linears for p in lin.parameters()]
    before = [p.detach().clone() for p in params]
    x = torch.randn(2, 3, 12, dtype=torch.float64)
    expect = [lin(x) for lin in linears]
    assert not _is_packed(linears)

    assert pack_linears(linears)
    assert _is_packed(linears)
    assert [p for lin in linears for p in lin.parameters()] == params  # the same Parameter objects
    for p, b in zip(params, before):
        assert torch.equal(p, b) and p.is_contiguous()
    layout = [p.data_ptr() for p in params]
    assert pack_linears(linears) and [p.data_ptr() for p in params] == layout  # packed already: nothing moves
    for got, want in zip(packed_linears(x, linears), expect):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_pack_linears_leaves_what_it_cannot_pack():
    meta = [nn.Linear(4, 2, device="meta"), nn.Linear(4, 2, device="meta")]
    assert not pack_linears(meta)
    mixed = [nn.Linear(4, 2), nn.Linear(4, 2, dtype=torch.float64)]
    ptrs = [lin.weight.data_ptr() for lin in mixed]
    assert not pack_linears(mixed)
    assert [lin.weight.data_ptr() for lin in mixed] == ptrs


def test_pack_linears_under_inference_mode_leaves_parameters_that_train():
    """``model.pack_projections()`` called under ``torch.inference_mode`` (generate leaves inference mode itself):
    the new storage is a normal tensor, so an optimizer may update the packed weights in place afterwards."""
    torch.manual_seed(0)
    linears = [nn.Linear(6, n, dtype=torch.float64) for n in (4, 2)]
    with torch.inference_mode():
        assert pack_linears(linears)
    assert _is_packed(linears)
    params = [p for lin in linears for p in lin.parameters()]
    assert not any(p.is_inference() for p in params)
    sum(lin(torch.ones(6, dtype=torch.float64)).sum() for lin in linears).backward()
    torch.optim.SGD(params, lr=0.1).step()


def test_pack_linears_repacks_a_weight_that_is_not_contiguous():
    """Weights that start where they should but one is a transposed view (as a converted checkpoint may hold) are
    not packed yet: packed_linears reads the storage row by row, so they are copied into a new layout first."""
    torch.manual_seed(0)
    linears = [nn.Linear(4, 4, bias=False, dtype=torch.float64) for _ in range(2)]
    storage = torch.randn(32, dtype=torch.float64)
    linears[0].weight.data = storage[:16].view(4, 4).t()  # starts at the storage, is not row-major
    linears[1].weight.data = storage[16:].view(4, 4)  # right after it
    x = torch.randn(3, 4, dtype=torch.float64)
    expect = [lin(x) for lin in linears]
    assert pack_linears(linears) and _is_packed(linears) and linears[0].weight.is_contiguous()
    for got, want in zip(packed_linears(x, linears), expect):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_generate_packs_the_model_once_and_the_state_dict_is_unchanged():
    model = tiny_model(seed=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    groups = [m.projections for m in model.modules() if hasattr(m, "projections")]
    assert len(groups) == 2 * (model.config.num_hidden_layers + model.config.num_nextn_predict_layers)
    model.generate(random_prompts(1, 5), max_new_tokens=4)
    assert all(_is_packed(group) for group in groups)
    layout = _storage_layout(model)
    model.generate(random_prompts(1, 5), max_new_tokens=4)
    assert _storage_layout(model) == layout
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())


@pytest.mark.parametrize("strategy", ["static", "dynamic", "direct", "speculative", "remask"])
def test_packed_projections_decode_what_unpacked_ones_do(strategy, monkeypatch):
    model = tiny_model(seed=1)
    ids = random_prompts(3, 6, seed=4)
    kwargs = dict(max_new_tokens=11, strategy=strategy, return_dict_in_generate=True)
    calls = []

    def counted(x, linears):
        calls.append(len(linears))
        return packed_linears(x, linears)

    monkeypatch.setattr(modeling_sdar, "packed_linears", counted)
    unpacked = model.generate(ids, packed_projections=False, **kwargs)
    assert not calls
    packed = model.generate(ids, **kwargs)
    assert set(calls) == {2, 3}  # gate/up and q/k/v, of every layer the decoding ran
    assert torch.equal(packed.sequences, unpacked.sequences)
    assert packed.stats.as_dict() == unpacked.stats.as_dict()


def test_a_packed_model_converts_saves_reloads_and_trains_as_before(tmp_path):
    model = tiny_model(seed=2)
    ids = random_prompts(2, 6, seed=5)
    out = model.generate(ids, max_new_tokens=8)
    # A dtype conversion gives every parameter its own storage again; the next call packs anew.
    model32 = copy.deepcopy(model).float()
    assert not _is_packed(model32.model.layers[0].self_attn.projections)
    assert torch.equal(model32.generate(ids, max_new_tokens=8), model32.generate(ids, max_new_tokens=8))
    # save_pretrained writes each parameter as itself (no shared-storage error); the reload decodes the same.
    model.save_pretrained(tmp_path)
    reloaded = SDARMRPForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert torch.equal(reloaded.generate(ids, max_new_tokens=8), out)
    # Training runs the projections one by one: gradients reach every packed parameter as if unpacked.
    fresh = tiny_model(seed=2)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    for m in (model, fresh):
        m.train()
        hidden = m.model(ids, positions)
        m.lm_head(hidden + m.mrp_forward(ids, hidden, positions)).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12), name
