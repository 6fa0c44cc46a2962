"""Backend dispatch (mrp_triton.backend): every op has a Triton launcher and a reference twin; ops autograd must
differentiate run their backward kernels, or the reference where they have none; autocast forwards."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from triton.runtime.jit import KernelInterface

import mrp_triton
from mrp_triton import reference, select_backend, use_backend
from kernel_utils import KERNEL_BACKWARDS, backward_nodes
from tiny_models import random_prompts, tiny_model

pytestmark = pytest.mark.triton  # the default dispatch (the interpreter is on), not the suite's reference override


def test_every_op_has_a_triton_launcher_and_a_reference_twin_of_its_signature():
    """The layout's promise: each public op of mrp_triton lives in a file with its Triton kernel and ``<op>_triton``
    (the launcher, the op's arguments first), and ``mrp_triton.reference.<op>`` (the oracle and CPU path) takes the
    same arguments; all three are exported."""
    ops = [name for name in mrp_triton.__all__ if f"{name}_triton" in mrp_triton.__all__]
    assert set(mrp_triton.__all__) - set(ops) - {f"{name}_triton" for name in ops} == {"select_backend", "use_backend"}
    assert set(reference.__all__) == set(ops) == set(_op_calls())
    for name in ops:
        op, launcher = getattr(mrp_triton, name), getattr(mrp_triton, f"{name}_triton")
        twin = getattr(reference, name)
        params = list(inspect.signature(op).parameters)
        assert list(inspect.signature(twin).parameters) == params, name
        assert list(inspect.signature(launcher).parameters)[:len(params)] == params, name
        module = importlib.import_module(op.__module__)
        assert importlib.import_module(launcher.__module__) is module, name
        assert any(isinstance(v, KernelInterface) and v.fn.__module__ == module.__name__  # defined there, not imported
                   for v in vars(module).values()), name


def _op_calls() -> dict:
    """One small valid call (args, kwargs) of each public op, on the CPU."""
    r = torch.randn
    block = torch.tensor([[5, 0, 0, 7], [0, 3, 0, 0]])  # mask token 0
    ints, scores, L = torch.randint(1, 9, (2, 4)), torch.rand(2, 4), torch.arange(4).expand(2, 4)
    return {
        "confidence": ((r(3, 11),), {}),
        "select_commit": ((block.clone(), ints, scores), dict(mask_token_id=0, n=1)),
        "verify_drafts": ((block.clone(), torch.tensor([[1], [-1]]), torch.tensor([[4], [0]]),
                           torch.randint(1, 9, (2, 2, 4)), torch.rand(2, 2, 4)), dict(mask_token_id=0)),
        "remask": ((ints.clone(), block != 0, scores, 0.5), dict(mask_token_id=0)),
        "settle_rows": ((block.clone(), L.contiguous(), torch.tensor([0, 1]), torch.tensor([4, 3]),
                         torch.arange(9) == 7), dict(mask_token_id=0, filler=8)),
        "lm_head_confidence": ((r(3, 8), r(11, 8)), {}),
        "mrp_input": ((torch.tensor([1, 4, 10]), r(11, 8), r(3, 8), r(8), r(8), 1e-6), {}),
        "qk_norm_rope": ((r(1, 2, 2, 4), r(1, 2, 1, 4), r(4), r(4), r(1, 2, 4), r(1, 2, 4), 1e-6), {}),
        "rms_norm": ((r(3, 8), r(8), 1e-6, r(3, 8)), {}),
        "swiglu": ((r(3, 8), r(3, 8)), {}),
        "cached_attention": ((r(1, 2, 2, 4), r(1, 1, 2, 4), r(1, 1, 2, 4), r(1, 1, 4, 4), r(1, 1, 4, 4),
                              torch.tensor([3]), torch.tensor([[3, 4]]), 2), {}),
        "candidate_confidence": ((r(3, 8), r(11, 8), torch.randint(0, 11, (3, 2)), r(3)),
                                 dict(seed_hidden=r(3, 8), vocab_mean=r(8))),
        "softmax_kl": ((r(3, 11), r(3, 11)), {}),
    }


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("name", sorted(_op_calls()))
def test_each_public_op_checks_its_arguments_once(monkeypatch, name, backend):
    """Either path runs the op's argument checks (its module's ``_check_args``) exactly once: the public op leaves
    them to the launcher on Triton's path (in the interpreter here), and runs them itself before the reference."""
    module = importlib.import_module(getattr(mrp_triton, name).__module__)
    calls = []
    check = module._check_args
    monkeypatch.setattr(module, "_check_args", lambda *a, **k: calls.append(1) or check(*a, **k))
    args, kwargs = _op_calls()[name]
    with use_backend(backend):
        getattr(mrp_triton, name)(*args, **kwargs)
    assert len(calls) == 1


def test_ops_that_autograd_differentiates_run_the_reference_unless_they_have_a_backward_kernel():
    x = torch.randn(3, 8, requires_grad=True)
    assert select_backend(x.device, x, None) == "reference"
    assert select_backend(x.device, x, None, backward=True) == "triton"
    assert select_backend(x.device, x.detach(), None) == "triton"
    with torch.no_grad():
        assert select_backend(x.device, x) == "triton"
    with use_backend("triton"), pytest.raises(RuntimeError, match="no backward"):
        select_backend(x.device, x)
    with use_backend("reference"):
        assert select_backend(x.device, x) == "reference"


def test_dispatch_rules_apply_in_order_and_refuse_what_cannot_run(monkeypatch):
    """The module's rules: use_backend beats MRP_TRITON_BACKEND, a name that is no backend is refused from either;
    with the interpreter off, CUDA tensors go to Triton (by device type: no GPU needed here), CPU ones to the
    reference, and a forced Triton is refused on CPU tensors and without triton installed."""
    from mrp_triton import backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(ValueError, match="backend='tritno' is not a backend"), use_backend("tritno"):
        pass
    monkeypatch.setenv("MRP_TRITON_BACKEND", "reference")
    assert select_backend(cpu) == "reference"  # over rule 4 (the interpreter is on)
    with use_backend("triton"):
        assert select_backend(cpu) == "triton"
    monkeypatch.setenv("MRP_TRITON_BACKEND", "tritno")
    with pytest.raises(ValueError, match="MRP_TRITON_BACKEND='tritno' is not a backend"):
        select_backend(cpu)
    monkeypatch.delenv("MRP_TRITON_BACKEND")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert (select_backend(cuda), select_backend(cpu)) == ("triton", "reference")
    with use_backend("triton"), pytest.raises(RuntimeError, match="need CUDA tensors"):
        select_backend(cpu)
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    with use_backend("triton"), pytest.raises(RuntimeError, match="triton is not installed"):
        select_backend(cuda)


def test_a_forward_with_grad_gets_every_gradient():
    """With grad on, the default dispatch runs each layer's norms, q/k-norm + RoPE and SwiGLU through their backward
    kernels (a kernel without one would cut the graph: the embeddings and layers would get no gradient at all): the
    gradients equal autograd's through the reference."""
    model = tiny_model(dtype=torch.float32).train()
    ids = random_prompts(2, 8)
    grads = []
    for kernels, context in ((False, use_backend("reference")), (True, torch.enable_grad())):
        model.zero_grad()
        with context:
            loss = model.lm_head(model.model(ids)).logsumexp(-1).sum()
            assert (KERNEL_BACKWARDS <= backward_nodes(loss)) == kernels
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    reference, default = grads
    assert "model.embed_tokens.weight" in default and default.keys() == reference.keys()
    for name, grad in reference.items():
        # fp32 sums in another order: an element where large terms cancel (the embedding's rows sum over positions)
        # keeps an error of the terms' size, so the absolute tolerance follows the gradient's scale
        torch.testing.assert_close(default[name], grad, rtol=1.3e-6, atol=2e-6 * max(1.0, grad.abs().max().item()),
                                   msg=name)


def test_autocast_forward_runs_on_the_kernels():
    """An autocast forward adds bf16 layer outputs to the fp32 residual stream: the kernels take the mixed dtypes
    as the reference does; generate runs in the model's dtype whatever autocast encloses it."""
    model = tiny_model(dtype=torch.float32).eval()
    ids = random_prompts(2, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        kernels = model.model(ids)
        with use_backend("reference"):
            reference = model.model(ids)
    assert kernels.dtype == reference.dtype
    torch.testing.assert_close(kernels, reference, atol=5e-2, rtol=5e-2)
    greedy = model.generate(ids, max_new_tokens=8, strategy="speculative")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model.generate(ids, max_new_tokens=8, strategy="speculative"), greedy)


def test_fit_stages_keeps_what_fits_a_gpus_shared_memory():
    """Each stage counted with its buffers, plus the fixed bytes and a 4 KiB margin; no limit (the interpreter):
    the stages asked for; not even one stage: None. Off CUDA there is no limit, and grids are sized for 4 stand-in
    SMs (the interpreter still runs multi-program grids)."""
    from mrp_triton.backend import fit_stages, num_sms, shared_memory_limit

    assert fit_stages(4, 48 * 1024, 0, None) == 4
    assert fit_stages(4, 48 * 1024, 0, 232448) == 4  # an H200's 227 KiB: 196 KiB
    assert fit_stages(4, 48 * 1024, 0, 101376) == 1  # an RTX 4090's 99 KiB: two stages would need 100 KiB
    assert fit_stages(4, 32 * 1024, 8 * 1024, 101376) == 2
    assert fit_stages(3, 96 * 1024, 0, 101376) is None
    assert fit_stages(2, 1024, 512, 2 * 1024 + 512 + 4096) == 2  # exactly full fits
    assert shared_memory_limit(torch.device("cpu")) is None and num_sms(torch.device("cpu")) == 4


@pytest.mark.parametrize("capability, hip, expected", [((9, 0), None, None), ((8, 6), None, None),
                                                       ((7, 5), None, "sm_75"), ((9, 4), "6.4", None)])
def test_before_ampere_names_only_nvidia_gpus_older_than_sm_80(monkeypatch, capability, hip, expected):
    """Turing (sm_75) has no bf16 units and stages no loads through shared memory (cached_attention then fits its
    tiles otherwise); NVIDIA's sm_80 and newer and AMD's GPUs are not before Ampere, nor is a CPU."""
    from mrp_triton import backend

    monkeypatch.setattr(backend, "_BEFORE_AMPERE", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert backend.before_ampere(torch.device("cuda:0")) == expected
    assert backend.before_ampere(torch.device("cpu")) is None
