"""Triton kernels (interpreter on CPU, real kernels on CUDA) vs the PyTorch reference: rms_norm, swiglu, qk_norm_rope,
mrp_input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_utils import DEV, DTYPES, poisoned_allocations, tol
from mrp_triton import mrp_input, qk_norm_rope, rms_norm, swiglu
from mrp_triton import reference as ref
from mrp_triton.mrp_input import mrp_input_triton
from mrp_triton.qk_norm_rope import qk_norm_rope_triton
from mrp_triton.rms_norm import rms_norm_triton
from mrp_triton.swiglu import swiglu_triton

dtypes = st.sampled_from(DTYPES)
EPS = 1e-6
# input scales of the norms' tests: rows of tiny or zero values, whose mean square eps dominates
SCALES = (1.0, 1.0, 1e-4, 0.0)


def _close(out: torch.Tensor, expect: torch.Tensor, atol: float | None = None) -> None:
    assert out.shape == expect.shape and out.dtype == expect.dtype
    t = dict(tol(expect.dtype))
    if atol is not None:
        t["atol"] = atol
    torch.testing.assert_close(out.float(), expect.float(), **t)


# RoPE: the reference rounds x*cos and rot(x)*sin to the dtype before adding them, the kernel
# adds in fp32; where the two products cancel, the difference is an ulp of the products (|x| ~ 4)
ROPE_ATOL = {torch.float32: 1e-5, torch.float16: 8e-3, torch.bfloat16: 6e-2}


def _randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(DEV, dtype)


# ---------------------------------------------------------------------------------------- rms_norm
@settings(max_examples=20)
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2), H=st.integers(1, 300), dtype=dtypes,
       with_residual=st.booleans(), pad=st.sampled_from((0, 0, 5)), scale=st.sampled_from(SCALES),
       seed=st.integers(0, 2**16))
def test_rms_norm_matches_reference(lead, H, dtype, with_residual, pad, scale, seed):
    """``pad``: x and the residual are the first H columns of [..., H + pad] tensors (rows read in place)."""
    wide = (*lead, H + pad)
    x = _randn(wide, dtype, seed, 3.0 * scale)[..., :H]
    w = _randn((H,), dtype, seed + 1)
    r = _randn(wide, dtype, seed + 2, scale)[..., :H] if with_residual else None
    with poisoned_allocations():
        out = rms_norm_triton(x, w, EPS, r)
    expect = ref.rms_norm(x, w, EPS, r)
    if with_residual:
        _close(out[0], expect[0])
        _close(out[1], expect[1])
    else:
        _close(out, expect)


@settings(max_examples=10)
@given(x_dtype=dtypes, r_dtype=dtypes, w_dtype=dtypes, seed=st.integers(0, 2**16))
def test_rms_norm_mixed_dtypes_promote_like_reference(x_dtype, r_dtype, w_dtype, seed):
    """What an autocast forward hands the norm (a bf16 layer output, an fp32 residual stream): s = x + residual in
    their promoted dtype, the normalised row rounded to it (Qwen3's input dtype), y in promote(s, weight)."""
    x, r, w = _randn((3, 5, 40), x_dtype, seed, 3.0), _randn((3, 5, 40), r_dtype, seed + 1), _randn((40,), w_dtype, 2)
    y, s = rms_norm_triton(x, w, EPS, r)
    ey, es = ref.rms_norm(x, w, EPS, r)
    assert (y.dtype, s.dtype) == (ey.dtype, es.dtype) == (torch.promote_types(es.dtype, w_dtype),
                                                          torch.promote_types(x_dtype, r_dtype))
    _close(s, es)
    torch.testing.assert_close(y.float(), ey.float(), **tol(es.dtype))  # rounded at s's dtype before the weight


def test_rms_norm_fp32_weight_promotes_like_reference():
    x = _randn((3, 40), torch.bfloat16, 0)
    w = _randn((40,), torch.float32, 1)
    out = rms_norm_triton(x, w, EPS)
    expect = ref.rms_norm(x, w, EPS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expect, atol=2e-2, rtol=2e-2)


def test_rms_norm_of_a_transposed_input_matches_reference():
    """Rows whose elements are not adjacent (a transposed tensor: the last dim's stride is not 1) are copied before
    the kernel reads them with a unit column stride (_checks.as_rows); read in place they would be other values."""
    x = _randn((33, 6), torch.float32, 7).t()  # [6, 33], strides (1, 6)
    w = _randn((33,), torch.float32, 8)
    _close(rms_norm_triton(x, w, EPS), ref.rms_norm(x, w, EPS))


@pytest.mark.triton
def test_rms_norm_public_dispatch_runs_kernel():
    x = _randn((2, 5, 33), torch.float32, 3)
    r = _randn((2, 5, 33), torch.float32, 4)
    w = _randn((33,), torch.float32, 5)
    with poisoned_allocations():
        y, s = rms_norm(x, w, EPS, residual=r)
    ey, es = ref.rms_norm(x, w, EPS, r)
    _close(y, ey)
    _close(s, es)


def test_rms_norm_errors():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm_triton(x, torch.ones(7), EPS)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        rms_norm_triton(x, torch.ones(8), EPS, torch.randn(2, 7))
    with pytest.raises(TypeError, match="residual must be a floating-point"):
        rms_norm_triton(x, torch.ones(8), EPS, torch.ones(2, 8, dtype=torch.int64))
    with pytest.raises(TypeError, match="floating-point"):
        rms_norm_triton(torch.ones(2, 8, dtype=torch.int64), torch.ones(8), EPS)


# ------------------------------------------------------------------------------------------ swiglu
@settings(max_examples=15)
@given(lead=st.lists(st.integers(1, 5), min_size=0, max_size=2), F=st.integers(1, 3000), dtype=dtypes,
       fused=st.booleans(), pad=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_swiglu_matches_reference(lead, F, dtype, fused, pad, seed):
    """``fused``: gate and up are the two halves of one [..., 2F + pad] tensor (a fused gate/up projection's
    output), read in place at that row stride."""
    if fused:
        gate_up = _randn((*lead, 2 * F + pad), dtype, seed, 3.0)
        g, u = gate_up[..., :F], gate_up[..., F: 2 * F]
    else:
        g = _randn((*lead, F), dtype, seed, 4.0)
        u = _randn((*lead, F), dtype, seed + 1, 2.0)
    with poisoned_allocations():
        out = swiglu_triton(g, u)
    _close(out, ref.swiglu(g, u))


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else []))
def test_swiglu_rounds_silu_to_the_input_dtype_like_eager(dtype):
    """Eager ``F.silu(gate) * up`` rounds silu(gate) to the dtype before the multiply; a kernel that multiplied the
    fp32 silu would differ from it by an output ulp on about a quarter of the elements, within any tolerance. So
    count the elements that are not bit-equal (a rare one may be, where the fp32 silu sits an ulp apart). bf16 only
    on a GPU: Triton's interpreter converts fp32 to bf16 by truncation, not rounding to nearest."""
    g = _randn((8, 512), dtype, 0, 4.0)
    u = _randn((8, 512), dtype, 1, 2.0)
    differing = (swiglu_triton(g, u) != ref.swiglu(g, u)).float().mean().item()
    assert differing <= 0.01


@pytest.mark.triton
def test_swiglu_public_dispatch_and_errors():
    g = _randn((3, 77), torch.float16, 0)
    u = _randn((3, 77), torch.float16, 1)
    _close(swiglu(g, u), ref.swiglu(g, u))
    with pytest.raises(ValueError, match="shape"):
        swiglu_triton(g, u[:, :-1])
    with pytest.raises(TypeError, match="dtype"):
        swiglu_triton(g, u.float())


# ------------------------------------------------------------------------------------ qk_norm_rope
@settings(max_examples=15)
@given(B=st.integers(1, 3), T=st.integers(1, 5), Hkv=st.integers(1, 3), groups=st.integers(1, 3),
       half=st.integers(1, 40), dtype=dtypes, table_dtype=st.sampled_from((torch.float32, None)),
       broadcast_batch=st.booleans(), layout=st.sampled_from(("contiguous", "fused", "heads_apart")),
       side_by_side=st.booleans(), scale=st.sampled_from(SCALES), seed=st.integers(0, 2**16))
def test_qk_norm_rope_matches_reference(B, T, Hkv, groups, half, dtype, table_dtype, broadcast_batch, layout,
                                        side_by_side, scale, seed):
    """``layout``: q and k contiguous; column slices of one fused q/k/v projection output [B, T, (Hq + 2 Hkv) D]
    (read in place); or [B, heads, T, D] tensors transposed, whose heads do not lie next to each other (copied).
    ``side_by_side``: cos and sin are the halves of one [B, T, 2, D] table (as a decode engine's gathered rows)."""
    D = 2 * half
    Hq = Hkv * groups
    if layout == "fused":
        qkv = _randn((B, T, (Hq + 2 * Hkv) * D), dtype, seed, 2.0 * scale)
        q, k = qkv[..., : Hq * D].unflatten(-1, (Hq, D)), qkv[..., Hq * D: (Hq + Hkv) * D].unflatten(-1, (Hkv, D))
    elif layout == "heads_apart":
        q = _randn((B, Hq, T, D), dtype, seed, 2.0 * scale).transpose(1, 2)
        k = _randn((B, Hkv, T, D), dtype, seed + 1, 2.0 * scale).transpose(1, 2)
    else:
        q = _randn((B, T, Hq, D), dtype, seed, 2.0 * scale)
        k = _randn((B, T, Hkv, D), dtype, seed + 1, 2.0 * scale)
    qw = _randn((D,), dtype, seed + 2)
    kw = _randn((D,), dtype, seed + 3)
    angle = _randn((1 if broadcast_batch else B, T, D), torch.float32, seed + 4, 3.0)
    cos, sin = angle.cos().to(table_dtype or dtype), angle.sin().to(table_dtype or dtype)
    if side_by_side:
        cos, sin = torch.stack([cos, sin], -2).unbind(-2)
    with poisoned_allocations():
        oq, ok = qk_norm_rope_triton(q, k, qw, kw, cos, sin, EPS)
    eq, ek = ref.qk_norm_rope(q, k, qw, kw, cos, sin, EPS)
    _close(oq, eq, ROPE_ATOL[dtype])
    _close(ok, ek, ROPE_ATOL[dtype])


@pytest.mark.triton
def test_qk_norm_rope_public_dispatch_qwen_shape():
    # head_dim 128, 4 q / 2 kv heads (GQA): the layout of the real models, scaled down
    B, T, D = 2, 3, 128
    q = _randn((B, T, 4, D), torch.bfloat16, 0)
    k = _randn((B, T, 2, D), torch.bfloat16, 1)
    qw, kw = _randn((D,), torch.bfloat16, 2), _randn((D,), torch.bfloat16, 3)
    pos = torch.arange(T, dtype=torch.float32, device=DEV)[None, :, None].expand(B, T, D // 2)
    inv_freq = 1e6 ** (-torch.arange(0, D, 2, dtype=torch.float32, device=DEV) / D)
    ang = torch.cat([pos * inv_freq, pos * inv_freq], dim=-1)
    with poisoned_allocations():
        oq, ok = qk_norm_rope(q, k, qw, kw, ang.cos(), ang.sin(), EPS)
    eq, ek = ref.qk_norm_rope(q, k, qw, kw, ang.cos(), ang.sin(), EPS)
    _close(oq, eq, ROPE_ATOL[torch.bfloat16])
    _close(ok, ek, ROPE_ATOL[torch.bfloat16])


def test_qk_norm_rope_errors():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 2, 8)
    w = torch.ones(8)
    cs = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="even"):
        qk_norm_rope_triton(q[..., :7], k[..., :7], w[:7], w[:7], cs[..., :7], cs[..., :7], EPS)
    with pytest.raises(ValueError, match="does not match"):
        qk_norm_rope_triton(q, torch.randn(1, 3, 2, 8), w, w, cs, cs, EPS)
    with pytest.raises(ValueError, match="cos must have shape"):
        qk_norm_rope_triton(q, k, w, w, torch.randn(1, 3, 8), cs, EPS)
    with pytest.raises(ValueError, match="q_weight"):
        qk_norm_rope_triton(q, k, torch.ones(4), w, cs, cs, EPS)


# --------------------------------------------------------------------------------------- mrp_input
@settings(max_examples=15)
@given(N=st.integers(1, 9), H=st.integers(1, 200), V=st.integers(1, 60), dtype=dtypes,
       embed_dtype=st.sampled_from((None, torch.float32)), scale=st.sampled_from(SCALES), seed=st.integers(0, 2**16))
def test_mrp_input_matches_reference(N, H, V, dtype, embed_dtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (N,), generator=g).to(DEV)
    E = _randn((V, H), embed_dtype or dtype, seed + 1, scale)
    h = _randn((N, H), dtype, seed + 2, 5.0 * scale)
    ew, hw = _randn((H,), dtype, seed + 3), _randn((H,), dtype, seed + 4)
    with poisoned_allocations():
        out = mrp_input_triton(ids, E, h, ew, hw, EPS)
    _close(out, ref.mrp_input(ids, E, h, ew, hw, EPS))


@pytest.mark.triton
def test_mrp_input_public_dispatch_and_errors():
    ids = torch.tensor([3, 0, 3, 7], dtype=torch.int32, device=DEV)
    E, h = _randn((8, 24), torch.float32, 0), _randn((4, 24), torch.float32, 1)
    ew, hw = _randn((24,), torch.float32, 2), _randn((24,), torch.float32, 3)
    out = mrp_input(ids, E, h, ew, hw, EPS)
    _close(out, ref.mrp_input(ids.long(), E, h, ew, hw, EPS))
    with pytest.raises(IndexError, match="ids must lie"):
        mrp_input_triton(torch.tensor([8, 0, 0, 0], device=DEV), E, h, ew, hw, EPS)
    with pytest.raises(ValueError, match="embed_weight must be"):
        mrp_input_triton(ids, E[:, :5], h, ew, hw, EPS)
    with pytest.raises(TypeError, match="ids must be"):
        mrp_input_triton(ids.float(), E, h, ew, hw, EPS)
