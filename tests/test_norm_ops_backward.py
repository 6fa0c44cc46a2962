"""Backward kernels of the ops training runs (rms_norm, swiglu, qk_norm_rope, mrp_input) vs autograd through the
PyTorch reference: same gradients for every input that requires one, on drawn shapes, dtypes, layouts and subsets of
inputs that require grad; the Triton side runs with poisoned allocations, so an unwritten gradient element or
weight-gradient partial fails."""

from __future__ import annotations

import importlib
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernel_utils import NORM_EPS as EPS
from kernel_utils import NORM_EPSILONS as EPSILONS
from kernel_utils import NORM_SCALES as SCALES
from kernel_utils import seeded_randn as _randn
from kernel_utils import DEV, DTYPES, poisoned_allocations
from mrp_triton import mrp_input, qk_norm_rope, rms_norm, swiglu, use_backend

dtypes = st.sampled_from(DTYPES)
# The oracle is autograd through the reference in float64 on the same inputs (autograd through it in bf16 rounds every
# intermediate, and where the gradient cancels, as a norm's over one element does, it can round it to 0 where the
# kernels, in fp32 until the store, get the float64 value); the tolerance is the coarsest input dtype's rounding.
REL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}


GRAD_LAYOUTS = ("plain", "transposed", "sliced")


def _grads(backend: str, op, inputs: list, needs: list[bool], seed: int, layout: str) -> list[torch.Tensor]:
    """Gradients of sum(out * r) (r a fixed random cotangent per output) w.r.t. the inputs marked in ``needs``,
    with ``op`` dispatched to ``backend`` (forward and backward). ``layout`` (GRAD_LAYOUTS) of the gradient reaching
    the op's backward: "transposed": r multiplies each output with its last two dimensions swapped, so it is a
    transposed, non-contiguous view (as attention's transposes of q and k hand it back); "sliced": each output is
    concatenated with a constant column first, so it is a column slice of a wider tensor (rows contiguous, another
    row stride; as a concatenation's backward hands it back)."""
    leaves = [t.detach().requires_grad_(n) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
              for t, n in zip(inputs, needs)]
    with use_backend(backend), (poisoned_allocations() if backend == "triton" else torch.enable_grad()):
        outs = op(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if layout == "sliced":
            outs = [torch.cat([o, torch.zeros_like(o[..., :1])], -1) for o in outs]
        outs = [o.float().transpose(-1, -2) if layout == "transposed" and o.dim() >= 2 else o.float() for o in outs]
        g = torch.Generator().manual_seed(seed)
        loss = sum((o * torch.randn(o.shape, generator=g).to(DEV)).sum() for o in outs)
        return list(torch.autograd.grad(loss, [t for t, n in zip(leaves, needs) if n]))


def _check(op, inputs: list, needs: list[bool], seed: int, layout: str = "plain") -> None:
    got = _grads("triton", op, inputs, needs, seed, layout)
    floating = [isinstance(t, torch.Tensor) and t.is_floating_point() for t in inputs]
    expect = _grads("reference", op, [t.double() if f else t for t, f in zip(inputs, floating)], needs, seed, layout)
    rel = max(REL[t.dtype] for t, f in zip(inputs, floating) if f)
    for out, exp, leaf in zip(got, expect, [t for t, n in zip(inputs, needs) if n]):
        assert out.shape == leaf.shape and out.dtype == leaf.dtype
        torch.testing.assert_close(out.double(), exp, rtol=rel, atol=rel * max(1.0, exp.abs().max().item()))


def _needs(draw_bools: list[bool]) -> list[bool]:
    """At least one input requires grad (else autograd has nothing to differentiate)."""
    return draw_bools if any(draw_bools) else [True] + draw_bools[1:]


@settings(max_examples=20)
@given(rows=st.integers(1, 40), H=st.integers(1, 300), dtype=dtypes, residual_dtype=st.sampled_from((None, *DTYPES)),
       needs=st.lists(st.booleans(), min_size=3, max_size=3), pad=st.sampled_from((0, 0, 3)),
       layout=st.sampled_from(GRAD_LAYOUTS), eps=st.sampled_from(EPSILONS), scale=st.sampled_from(SCALES),
       seed=st.integers(0, 2**16))
@example(rows=20, H=37, dtype=torch.float32, residual_dtype=torch.float32, needs=[True, True, True], pad=3,
         layout="sliced", eps=0.05, scale=1.0, seed=0)
@example(rows=20, H=37, dtype=torch.float32, residual_dtype=None, needs=[True, True, False], pad=3,
         layout="plain", eps=EPS, scale=1.0, seed=1)
@example(rows=5, H=24, dtype=torch.float32, residual_dtype=torch.bfloat16, needs=[False, False, True], pad=0,
         layout="plain", eps=EPS, scale=1.0, seed=2)  # only the residual requires grad
def test_rms_norm_backward_matches_reference(rows, H, dtype, residual_dtype, needs, pad, layout, eps, scale, seed):
    """Rows beyond 16 share a program (the backward loops over rows); x and the residual may be column slices;
    mixed x / residual dtypes are what autocast gives; with a residual the new stream s is an output too; the
    output gradients may be transposed views or column slices."""
    x = _randn((rows, H + pad), dtype, seed, 3.0 * scale)[:, :H]
    w = _randn((H,), dtype, seed + 1)
    r = None if residual_dtype is None else _randn((rows, H + pad), residual_dtype, seed + 2, scale)[:, :H]
    _check(lambda x, w, r: rms_norm(x, w, eps, r), [x, w, r], _needs([*needs[:2], needs[2] and r is not None]), seed,
           layout)


def test_rms_norm_backward_of_no_rows_is_zero():
    x = torch.zeros(0, 8, device=DEV, requires_grad=True)
    w = torch.ones(8, device=DEV, requires_grad=True)
    with use_backend("triton"), poisoned_allocations():
        dx, dw = torch.autograd.grad(rms_norm(x, w, EPS).sum(), [x, w])
    assert dx.shape == (0, 8) and torch.equal(dw, torch.zeros(8, device=DEV))


@settings(max_examples=15)
@given(lead=st.lists(st.integers(1, 5), min_size=1, max_size=2), F=st.integers(1, 3000), dtype=dtypes,
       layout=st.sampled_from(("fused", "separate", "strides")), needs=st.lists(st.booleans(), min_size=2, max_size=2),
       grad_layout=st.sampled_from(GRAD_LAYOUTS), seed=st.integers(0, 2**16))
@example(lead=[2], F=2100, dtype=torch.float32, layout="strides", needs=[True, True], grad_layout="sliced",
         seed=0)  # rows wider than one program
def test_swiglu_backward_matches_reference(lead, F, dtype, layout, needs, grad_layout, seed):
    """``fused``: gate and up are the halves of one [..., 2F] tensor (read in place); ``strides``: column slices of
    two tensors of other widths, so gate's and up's rows have different strides; the output gradient may be a
    transposed view or a column slice."""
    if layout == "fused":
        gate_up = _randn((*lead, 2 * F), dtype, seed, 3.0)
        g, u = gate_up[..., :F], gate_up[..., F:]
    elif layout == "separate":
        g, u = _randn((*lead, F), dtype, seed, 4.0), _randn((*lead, F), dtype, seed + 1, 2.0)
    else:
        g, u = _randn((*lead, F + 3), dtype, seed, 4.0)[..., 1:F + 1], _randn((*lead, 2 * F), dtype, seed + 1)[..., :F]
    _check(swiglu, [g, u], _needs(needs), seed, grad_layout)


@settings(max_examples=15)
@given(B=st.integers(1, 3), T=st.integers(1, 9), Hkv=st.integers(1, 3), groups=st.integers(1, 3),
       half=st.integers(1, 40), dtype=dtypes, k_weight_dtype=st.sampled_from((None, torch.float32)),
       fused=st.booleans(), broadcast=st.sampled_from(("neither", "both", "cos")),
       needs=st.lists(st.booleans(), min_size=4, max_size=4),
       layout=st.sampled_from(GRAD_LAYOUTS), eps=st.sampled_from(EPSILONS), scale=st.sampled_from(SCALES),
       seed=st.integers(0, 2**16))
@example(B=2, T=3, Hkv=2, groups=2, half=5, dtype=torch.float32, k_weight_dtype=None, fused=True, broadcast="cos",
         needs=[True, True, True, True], layout="sliced", eps=0.05, scale=1.0, seed=0)
@example(B=1, T=2, Hkv=1, groups=2, half=4, dtype=torch.float32, k_weight_dtype=None, fused=False, broadcast="neither",
         needs=[False, False, False, True], layout="plain", eps=EPS, scale=1.0, seed=1)  # only k's weight requires grad
def test_qk_norm_rope_backward_matches_reference(B, T, Hkv, groups, half, dtype, k_weight_dtype, fused,
                                                 broadcast, needs, layout, eps, scale, seed):
    """``fused``: q and k are column slices of one q/k/v projection output (read in place); tokens beyond 16 share
    a program; the fp32 RoPE tables get no gradient; an fp32 k weight makes k's output (and the dtype its RoPE
    tables are rounded to) fp32 where q's stays in ``dtype``; ``broadcast``: which tables are given once for the
    whole batch ("cos": cos is, sin is not, so the two are read at other strides); the outputs' gradients may be
    transposed views or column slices."""
    D, Hq = 2 * half, Hkv * groups
    if fused:
        qkv = _randn((B, T, (Hq + 2 * Hkv) * D), dtype, seed, 2.0 * scale)
        q, k = qkv[..., : Hq * D].unflatten(-1, (Hq, D)), qkv[..., Hq * D: (Hq + Hkv) * D].unflatten(-1, (Hkv, D))
    else:
        q, k = _randn((B, T, Hq, D), dtype, seed, 2.0 * scale), _randn((B, T, Hkv, D), dtype, seed + 1, 2.0 * scale)
    qw, kw = _randn((D,), dtype, seed + 2), _randn((D,), k_weight_dtype or dtype, seed + 3)
    angle = _randn((1 if broadcast == "both" else B, T, D), torch.float32, seed + 4, 3.0)
    cos, sin = angle.cos()[:1] if broadcast == "cos" else angle.cos(), angle.sin()
    _check(lambda q, k, qw, kw, c, s: qk_norm_rope(q, k, qw, kw, c, s, eps), [q, k, qw, kw, cos, sin],
           _needs(needs) + [False, False], seed, layout)


@pytest.mark.triton
def test_qk_norm_rope_tables_that_require_grad_run_the_reference():
    """The backward kernel gives no gradient to cos / sin: tables that require one take the reference path."""
    q, k, w = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 1, 8), torch.ones(8)
    cos = torch.randn(1, 2, 8, requires_grad=True)
    oq, ok = qk_norm_rope(q, k, w, w, cos, torch.randn(1, 2, 8), EPS)
    assert oq.grad_fn is not None and "QKNormRope" not in type(oq.grad_fn).__name__
    (dcos,) = torch.autograd.grad(oq.sum() + ok.sum(), [cos])
    assert dcos.abs().sum() > 0


@settings(max_examples=15)
@given(N=st.integers(1, 40), H=st.integers(1, 200), V=st.integers(1, 30), dtype=dtypes,
       embed_dtype=st.sampled_from((None, torch.float32)),
       weight_dtypes=st.sampled_from(((None, None), (torch.float32, None), (None, torch.float32))),
       needs=st.lists(st.booleans(), min_size=4, max_size=4), layout=st.sampled_from(GRAD_LAYOUTS),
       eps=st.sampled_from(EPSILONS), scale=st.sampled_from(SCALES), seed=st.integers(0, 2**16))
def test_mrp_input_backward_matches_reference(N, H, V, dtype, embed_dtype, weight_dtypes, needs, layout, eps, scale,
                                              seed):
    """Repeated ids (V small) add their rows' gradients into one embedding row; the output gradient may be a
    transposed view or a column slice; with one fp32 norm weight the output gradient is fp32 for both halves."""
    ids = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(seed)).to(DEV)
    E = _randn((V, H), embed_dtype or dtype, seed + 1, scale)
    h = _randn((N, H), dtype, seed + 2, 5.0 * scale)
    ew, hw = (_randn((H,), wd or dtype, seed + 3 + i) for i, wd in enumerate(weight_dtypes))
    _check(lambda i, E, h, ew, hw: mrp_input(i, E, h, ew, hw, eps), [ids, E, h, ew, hw], [False] + _needs(needs),
           seed, layout)


def test_mrp_input_backward_of_its_norm_weights_only():
    """MRP training's first head step: the embedding frozen and h_A the frozen backbone's, so only the two norm weights
    get gradients (the backward computes neither half's input gradient: each norm backward runs without want_dx)."""
    ids = torch.tensor([3, 0, 3, 7], device=DEV)
    E, h = _randn((8, 40), torch.float32, 1), _randn((4, 40), torch.float32, 2, 5.0)
    ew, hw = _randn((40,), torch.float32, 3), _randn((40,), torch.float32, 4)
    module = importlib.import_module("mrp_triton.mrp_input")  # the package's mrp_input is the function
    with mock.patch.object(module, "rms_norm_backward", wraps=module.rms_norm_backward) as norm_backward:
        _check(lambda i, E, h, ew, hw: mrp_input(i, E, h, ew, hw, EPS), [ids, E, h, ew, hw],
               [False, False, False, True, True], 0)
    wanted = [call.kwargs.get("want_dx", True) for call in norm_backward.call_args_list]
    assert wanted == [False, False], f"the two halves' norm backwards ran with want_dx={wanted}"


@pytest.mark.parametrize("op", ["rms_norm", "swiglu"])
def test_second_order_gradients_are_refused(op):
    """The backward kernels have no backward of their own: differentiating a gradient raises instead of giving a
    wrong second derivative."""
    x = torch.randn(3, 8, device=DEV, requires_grad=True)
    w = torch.rand(8, device=DEV, requires_grad=True)
    with use_backend("triton"):
        out = rms_norm(x, w, EPS) if op == "rms_norm" else swiglu(x, w.expand(3, 8))
        (dx,) = torch.autograd.grad(out.pow(2).sum(), [x], create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            dx.sum().backward()
