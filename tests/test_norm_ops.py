"""Triton kernels (interpreter on CPU, real kernels on CUDA) vs the PyTorch reference: rms_norm, swiglu, qk_norm_rope,
mrp_input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernel_utils import NORM_EPS as EPS
from kernel_utils import NORM_EPSILONS as EPSILONS
from kernel_utils import NORM_SCALES as SCALES
from kernel_utils import seeded_randn as _randn
from kernel_utils import DEV, DTYPES, poisoned_allocations, refused_alike, tol
from mrp_triton import mrp_input, qk_norm_rope, rms_norm, swiglu
from mrp_triton import reference as ref
from mrp_triton.mrp_input import _mrp_input_kernel, mrp_input_triton
from mrp_triton.qk_norm_rope import qk_norm_rope_triton
from mrp_triton.rms_norm import rms_norm_triton, row_settings
from mrp_triton.swiglu import swiglu_triton

dtypes = st.sampled_from(DTYPES)


def _close(out: torch.Tensor, expect: torch.Tensor, atol: float | None = None,
           rounded_at: torch.dtype | None = None) -> None:
    """Same shape and dtype, and close at the tolerance of ``rounded_at`` (the coarsest dtype the op rounds
    intermediates to; default: the output's)."""
    assert out.shape == expect.shape and out.dtype == expect.dtype
    t = dict(tol(rounded_at or expect.dtype))
    if atol is not None:
        t["atol"] = atol
    torch.testing.assert_close(out.float(), expect.float(), **t)


# RoPE: the reference rounds x*cos and rot(x)*sin to the dtype before adding them, the kernel
# adds in fp32; where the two products cancel, the difference is an ulp of the products (|x| ~ 4)
ROPE_ATOL = {torch.float32: 1e-5, torch.float16: 8e-3, torch.bfloat16: 6e-2}


def _outputs(out) -> tuple:
    """rms_norm's results as a tuple: (y,) without a residual, (y, s) with one."""
    return out if isinstance(out, tuple) else (out,)


# ---------------------------------------------------------------------------------------- rms_norm
@settings(max_examples=20)
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2), H=st.integers(1, 300), dtype=dtypes,
       with_residual=st.booleans(), pad=st.sampled_from((0, 0, 5)), residual_pad=st.sampled_from((0, 2)),
       eps=st.sampled_from(EPSILONS), scale=st.sampled_from(SCALES), seed=st.integers(0, 2**16))
@example(lead=[3], H=37, dtype=torch.float32, with_residual=True, pad=5, residual_pad=2, eps=0.05, scale=1.0, seed=0)
def test_rms_norm_matches_reference(lead, H, dtype, with_residual, pad, residual_pad, eps, scale, seed):
    """``pad``: x is the first H columns of a [..., H + pad] tensor, the residual of a [..., H + pad + residual_pad]
    one (rows read in place, each at its own row stride)."""
    x = _randn((*lead, H + pad), dtype, seed, 3.0 * scale)[..., :H]
    w = _randn((H,), dtype, seed + 1)
    r = _randn((*lead, H + pad + residual_pad), dtype, seed + 2, scale)[..., :H] if with_residual else None
    with poisoned_allocations():
        out = rms_norm_triton(x, w, eps, r)
    expect = ref.rms_norm(x, w, eps, r)
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


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_of_a_transposed_input_matches_reference(with_residual):
    """Rows whose elements are not adjacent (a transposed tensor: the last dim's stride is not 1) are copied before
    the kernel reads them with a unit column stride (_checks.as_rows); read in place they would be other values.
    With a residual, x and the residual are both transposed."""
    x = _randn((33, 6), torch.float32, 7).t()  # [6, 33], strides (1, 6)
    w = _randn((33,), torch.float32, 8)
    r = _randn((33, 6), torch.float32, 9).t() if with_residual else None
    for got, want in zip(_outputs(rms_norm_triton(x, w, EPS, r)), _outputs(ref.rms_norm(x, w, EPS, r))):
        _close(got, want)


def _differing(out: torch.Tensor, expect: torch.Tensor) -> float:
    """The fraction of elements of ``out`` that are not bit-equal to ``expect``: a rounding point dropped or moved
    (an intermediate kept in fp32, or rounded at another step) changes about a quarter of the fp16 elements by an
    ulp, within any tolerance; where both round at the same points only a rare tie may differ."""
    assert out.shape == expect.shape and out.dtype == expect.dtype
    return (out != expect).float().mean().item()


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_rounds_like_the_reference(with_residual):
    """fp16 (the interpreter rounds fp32 -> fp16 to nearest, as CUDA does; bf16 it truncates): s = x + residual is
    rounded to fp16 before it is normalised, the normalised row is rounded to fp16 before the weight multiply, the
    variance is taken in fp32 (Qwen3's RMSNorm). The kernel and the reference round at those points; one that kept
    either intermediate in fp32, or took the variance in fp16, would differ from the other on many elements."""
    x = _randn((16, 200), torch.float16, 10, 3.0)
    w = _randn((200,), torch.float16, 11)
    r = _randn((16, 200), torch.float16, 12) if with_residual else None
    for got, want in zip(_outputs(rms_norm_triton(x, w, EPS, r)), _outputs(ref.rms_norm(x, w, EPS, r))):
        assert _differing(got, want) <= 0.01, "kernel and reference round the norm at different points"


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
    with pytest.raises(TypeError, match="weight must be a floating-point"):
        rms_norm_triton(x, torch.ones(8, dtype=torch.int64), EPS)
    for empty in (torch.randn(2, 0), torch.tensor(1.0)):
        with pytest.raises(ValueError, match="non-empty last dim"):
            rms_norm_triton(empty, torch.ones(0), EPS)
    with pytest.raises(ValueError, match="weight is on meta"):
        rms_norm_triton(x, torch.ones(8, device="meta"), EPS)
    with pytest.raises(ValueError, match="residual must have x's shape .* and device"):
        rms_norm_triton(x, torch.ones(8), EPS, torch.randn(2, 8, device="meta"))


# ------------------------------------------------------------------------------------------ swiglu
@settings(max_examples=15)
@given(lead=st.lists(st.integers(1, 5), min_size=0, max_size=2), F=st.integers(1, 3000), dtype=dtypes,
       layout=st.sampled_from(("fused", "separate", "strides", "transposed")), pad=st.integers(0, 3),
       seed=st.integers(0, 2**16))
@example(lead=[2], F=2100, dtype=torch.float32, layout="strides", pad=0, seed=0)  # rows wider than one program
@example(lead=[3], F=7, dtype=torch.float16, layout="transposed", pad=0, seed=1)
def test_swiglu_matches_reference(lead, F, dtype, layout, pad, seed):
    """``fused``: gate and up are the two halves of one [..., 2F + pad] tensor (a fused gate/up projection's
    output), read in place at that row stride; ``strides``: column slices of two tensors of other widths, so gate's
    and up's rows have different strides; ``transposed``: tensors whose last dim is not unit-stride (copied)."""
    if layout == "fused":
        gate_up = _randn((*lead, 2 * F + pad), dtype, seed, 3.0)
        g, u = gate_up[..., :F], gate_up[..., F: 2 * F]
    elif layout == "strides":
        g = _randn((*lead, F + pad + 1), dtype, seed, 4.0)[..., 1:F + 1]
        u = _randn((*lead, 2 * F), dtype, seed + 1, 2.0)[..., :F]
    elif layout == "transposed":
        g = _randn((F, *lead), dtype, seed, 4.0).movedim(0, -1)
        u = _randn((F, *lead), dtype, seed + 1, 2.0).movedim(0, -1)
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
    assert _differing(swiglu_triton(g, u), ref.swiglu(g, u)) <= 0.01


@pytest.mark.triton
def test_swiglu_public_dispatch_and_errors():
    g = _randn((3, 77), torch.float16, 0)
    u = _randn((3, 77), torch.float16, 1)
    _close(swiglu(g, u), ref.swiglu(g, u))
    with pytest.raises(ValueError, match="shape"):
        swiglu_triton(g, u[:, :-1])
    with pytest.raises(TypeError, match="dtype"):
        swiglu_triton(g, u.float())
    with pytest.raises(TypeError, match="gate must be a floating-point"):
        swiglu_triton(g.long(), u.long())


# ------------------------------------------------------------------------------------ qk_norm_rope
@settings(max_examples=15)
@given(B=st.integers(1, 3), T=st.integers(1, 5), Hkv=st.integers(1, 3), groups=st.integers(1, 3),
       half=st.integers(1, 40), dtype=dtypes, table_dtype=st.sampled_from((torch.float32, None)),
       k_weight_dtype=st.sampled_from((None, torch.float32)), broadcast_batch=st.booleans(),
       layout=st.sampled_from(("contiguous", "fused", "heads_apart", "columns_apart")),
       tables=st.sampled_from(("separate", "side_by_side", "sin_per_batch", "columns_apart")),
       eps=st.sampled_from(EPSILONS), scale=st.sampled_from(SCALES), seed=st.integers(0, 2**16))
@example(B=2, T=3, Hkv=2, groups=2, half=5, dtype=torch.float32, table_dtype=None, k_weight_dtype=torch.float32,
         broadcast_batch=True, layout="heads_apart", tables="sin_per_batch", eps=0.05, scale=1.0, seed=0)
@example(B=2, T=3, Hkv=1, groups=3, half=4, dtype=torch.float16, table_dtype=torch.float32, k_weight_dtype=None,
         broadcast_batch=False, layout="fused", tables="columns_apart", eps=EPS, scale=1.0, seed=1)
@example(B=1, T=2, Hkv=1, groups=2, half=3, dtype=torch.float32, table_dtype=None, k_weight_dtype=None,
         broadcast_batch=False, layout="columns_apart", tables="separate", eps=EPS, scale=1.0, seed=2)
def test_qk_norm_rope_matches_reference(B, T, Hkv, groups, half, dtype, table_dtype, k_weight_dtype, broadcast_batch,
                                        layout, tables, eps, scale, seed):
    """``layout``: q and k contiguous; column slices of one fused q/k/v projection output [B, T, (Hq + 2 Hkv) D]
    (read in place); [B, heads, T, D] tensors transposed, whose heads do not lie next to each other (copied); or
    [B, D, T, heads] tensors permuted, whose columns are not adjacent (copied, also with one head).
    ``tables``: cos and sin separate tensors; the halves of one [B, T, 2, D] table (as a decode engine's gathered
    rows); cos broadcast over the batch and sin given per batch row (the two tables at other strides); or
    [B, D, T] tables transposed, whose columns are not adjacent (copied). An fp32 k weight makes k's output fp32
    where q's stays in ``dtype``."""
    D = 2 * half
    Hq = Hkv * groups
    if layout == "fused":
        qkv = _randn((B, T, (Hq + 2 * Hkv) * D), dtype, seed, 2.0 * scale)
        q, k = qkv[..., : Hq * D].unflatten(-1, (Hq, D)), qkv[..., Hq * D: (Hq + Hkv) * D].unflatten(-1, (Hkv, D))
    elif layout == "heads_apart":
        q = _randn((B, Hq, T, D), dtype, seed, 2.0 * scale).transpose(1, 2)
        k = _randn((B, Hkv, T, D), dtype, seed + 1, 2.0 * scale).transpose(1, 2)
    elif layout == "columns_apart":
        q = _randn((B, D, T, Hq), dtype, seed, 2.0 * scale).permute(0, 2, 3, 1)
        k = _randn((B, D, T, Hkv), dtype, seed + 1, 2.0 * scale).permute(0, 2, 3, 1)
    else:
        q = _randn((B, T, Hq, D), dtype, seed, 2.0 * scale)
        k = _randn((B, T, Hkv, D), dtype, seed + 1, 2.0 * scale)
    qw = _randn((D,), dtype, seed + 2)
    kw = _randn((D,), k_weight_dtype or dtype, seed + 3)
    angle = _randn((1 if broadcast_batch else B, T, D), torch.float32, seed + 4, 3.0)
    cos, sin = angle.cos().to(table_dtype or dtype), angle.sin().to(table_dtype or dtype)
    if tables == "side_by_side":
        cos, sin = torch.stack([cos, sin], -2).unbind(-2)
    elif tables == "sin_per_batch":  # sin of other angles, one row per batch row
        cos, sin = cos[:1], _randn((B, T, D), torch.float32, seed + 5, 3.0).sin().to(sin.dtype)
    elif tables == "columns_apart":
        cos, sin = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (cos, sin))
    with poisoned_allocations():
        oq, ok = qk_norm_rope_triton(q, k, qw, kw, cos, sin, eps)
    eq, ek = ref.qk_norm_rope(q, k, qw, kw, cos, sin, eps)
    _close(oq, eq, ROPE_ATOL[dtype])
    _close(ok, ek, ROPE_ATOL[dtype], rounded_at=dtype)  # k's output may be fp32, its normalised heads in dtype


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


@pytest.mark.parametrize("fp32_weight", ["q", "k"])
@pytest.mark.parametrize("zero_table", ["sin", "cos"])
def test_qk_norm_rope_rounds_like_the_reference(zero_table, fp32_weight):
    """fp16 q and k, fp32 tables, one weight fp16 and the other fp32 (that one's output fp32): the normalised heads are
    rounded to fp16 before the weight multiply, to the output's dtype after it, and the tables are rounded to the
    output's dtype before RoPE, as the reference (Qwen3's eager attention) does. With one table all zeros, RoPE's
    every product is exact or rounded once in both, so the kernel equals the reference bit for bit; one that kept
    any of those intermediates in fp32, or rounded the fp32 output's to fp16, would differ on many elements."""
    B, T, D = 2, 3, 64
    q, k = _randn((B, T, 4, D), torch.float16, 20, 2.0), _randn((B, T, 2, D), torch.float16, 21, 2.0)
    qw = _randn((D,), torch.float32 if fp32_weight == "q" else torch.float16, 22)
    kw = _randn((D,), torch.float32 if fp32_weight == "k" else torch.float16, 23)
    angle = _randn((B, T, D), torch.float32, 24, 3.0)
    cos, sin = angle.cos(), angle.sin()
    cos, sin = (cos, torch.zeros_like(sin)) if zero_table == "sin" else (torch.zeros_like(cos), sin)
    args = (q, k, qw, kw, cos, sin, EPS)
    for got, want in zip(qk_norm_rope_triton(*args), ref.qk_norm_rope(*args)):
        assert _differing(got, want) <= 0.01, "kernel and reference round q/k norm or RoPE at different points"


def test_qk_norm_rope_errors():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 2, 8)
    w = torch.ones(8)
    cs = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="even"):
        qk_norm_rope_triton(q[..., :7], k[..., :7], w[:7], w[:7], cs[..., :7], cs[..., :7], EPS)
    for other_k in (torch.randn(1, 3, 2, 8), torch.randn(2, 2, 2, 8), torch.randn(1, 2, 2, 6)):  # T, B, D
        with pytest.raises(ValueError, match="does not match"):
            qk_norm_rope_triton(q, other_k, w, w, cs, cs, EPS)
    with pytest.raises(ValueError, match=r"must be \[B, T, heads, D\]"):
        qk_norm_rope_triton(q[0], k[0], w, w, cs, cs, EPS)
    for table in (torch.randn(1, 3, 8), torch.randn(2, 2, 8), torch.randn(1, 2, 6)):  # T, B (q has B=1), D
        with pytest.raises(ValueError, match="cos must have shape"):
            qk_norm_rope_triton(q, k, w, w, table, cs, EPS)
    with pytest.raises(ValueError, match="q_weight"):
        qk_norm_rope_triton(q, k, torch.ones(4), w, cs, cs, EPS)
    with pytest.raises(ValueError, match="k_weight must have shape"):
        qk_norm_rope_triton(q, k, w, torch.ones(4), cs, cs, EPS)
    with pytest.raises(TypeError, match="q must be a floating-point"):
        qk_norm_rope_triton(q.long(), k, w, w, cs, cs, EPS)
    with pytest.raises(TypeError, match="sin must be a floating-point"):
        qk_norm_rope_triton(q, k, w, w, cs, cs.long(), EPS)
    with pytest.raises(ValueError, match="k_weight is on meta"):
        qk_norm_rope_triton(q, k, w, w.to("meta"), cs, cs, EPS)
    with pytest.raises(ValueError, match="sin is on meta"):
        qk_norm_rope_triton(q, k, w, w, cs, cs.to("meta"), EPS)


# --------------------------------------------------------------------------------------- mrp_input
@settings(max_examples=15)
@given(N=st.integers(1, 9), H=st.integers(1, 200), V=st.integers(1, 60), dtype=dtypes,
       embed_dtype=st.sampled_from((None, torch.float32)),
       weight_dtypes=st.sampled_from(((None, None), (torch.float32, torch.float32), (torch.float32, None),
                                      (None, torch.float32))),
       layout=st.sampled_from(("contiguous", "columns_of_wider", "transposed")), eps=st.sampled_from(EPSILONS),
       scale=st.sampled_from(SCALES), seed=st.integers(0, 2**16))
@example(N=5, H=37, V=7, dtype=torch.float32, embed_dtype=None, weight_dtypes=(None, None), layout="columns_of_wider",
         eps=0.05, scale=1.0, seed=0)
@example(N=5, H=37, V=7, dtype=torch.bfloat16, embed_dtype=torch.float32, weight_dtypes=(torch.float32, None),
         layout="transposed", eps=EPS, scale=1.0, seed=1)
def test_mrp_input_matches_reference(N, H, V, dtype, embed_dtype, weight_dtypes, layout, eps, scale, seed):
    """``layout`` of the embedding table and the hidden states: contiguous; the first H columns of wider tensors
    (rows read in place at their row stride); or transposed tensors, whose columns are not adjacent (copied). fp32
    norm weights (autocast's master weights) make the output fp32."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (N,), generator=g).to(DEV)
    if layout == "columns_of_wider":
        E = _randn((V, H + 3), embed_dtype or dtype, seed + 1, scale)[:, :H]
        h = _randn((N, H + 2), dtype, seed + 2, 5.0 * scale)[:, :H]
    elif layout == "transposed":
        E = _randn((H, V), embed_dtype or dtype, seed + 1, scale).t()
        h = _randn((H, N), dtype, seed + 2, 5.0 * scale).t()
    else:
        E = _randn((V, H), embed_dtype or dtype, seed + 1, scale)
        h = _randn((N, H), dtype, seed + 2, 5.0 * scale)
    ew, hw = (_randn((H,), wd or dtype, seed + 3 + i) for i, wd in enumerate(weight_dtypes))
    with poisoned_allocations():
        out = mrp_input_triton(ids, E, h, ew, hw, eps)
    expect = ref.mrp_input(ids, E, h, ew, hw, eps)
    assert expect.dtype == torch.promote_types(dtype, torch.promote_types(ew.dtype, hw.dtype))
    _close(out, expect, rounded_at=dtype)  # the normalised rows are rounded to hidden's dtype before the weights


def test_mrp_input_rounds_like_the_reference():
    """fp16 hidden states, an fp32 embedding table: the gathered embedding row is rounded to fp16 before it is
    normalised, and each normalised half is rounded to fp16 before its weight multiply, as the reference does; a
    kernel that kept any of those in fp32, or a reference that normalised the fp32 row, would differ on many
    elements."""
    ids = torch.tensor([3, 0, 3, 7, 5, 1], device=DEV)
    E, h = _randn((8, 200), torch.float32, 40), _randn((6, 200), torch.float16, 41, 5.0)
    ew, hw = _randn((200,), torch.float16, 42), _randn((200,), torch.float16, 43)
    got, want = mrp_input_triton(ids, E, h, ew, hw, EPS), ref.mrp_input(ids, E, h, ew, hw, EPS)
    for half, name in ((slice(None, 200), "embedding"), (slice(200, None), "hidden")):
        assert _differing(got[:, half], want[:, half]) <= 0.01, f"the {name} half is rounded at other points"


@pytest.mark.parametrize("fp32_weight", ["enorm", "hnorm"])
def test_mrp_input_rounds_each_half_at_its_own_weights_dtype(fp32_weight):
    """fp16 hidden states and norm weights of two dtypes, one fp32: the output is fp32, the half scaled by the fp32
    weight keeps its product in fp32, and the half scaled by the fp16 weight is rounded to fp16 first, as the
    reference's per-half norm is before the cat widens it. A kernel that kept both products in fp32 would differ on
    about a quarter of the fp16-weighted half."""
    ids = torch.tensor([2, 0, 5, 7, 5, 1], device=DEV)
    E, h = _randn((8, 200), torch.float16, 50), _randn((6, 200), torch.float16, 51, 5.0)
    weights = {"enorm": _randn((200,), torch.float16, 52), "hnorm": _randn((200,), torch.float16, 53)}
    weights[fp32_weight] = weights[fp32_weight].float()
    got = mrp_input_triton(ids, E, h, weights["enorm"], weights["hnorm"], EPS)
    want = ref.mrp_input(ids, E, h, weights["enorm"], weights["hnorm"], EPS)
    assert want.dtype == torch.float32
    for half, name in ((slice(None, 200), "enorm"), (slice(200, None), "hnorm")):
        assert _differing(got[:, half], want[:, half]) <= 0.01, f"the {name} half is rounded at other points"
    fp16_half = slice(200, None) if fp32_weight == "enorm" else slice(None, 200)
    assert torch.equal(want[:, fp16_half], want[:, fp16_half].half().float())  # the setting this test is about


def test_mrp_input_kernel_reads_an_out_of_range_id_as_a_zero_row():
    """On CUDA the launcher does not range-check the ids (a host sync): the kernel reads an id outside [0, V) as a
    zero embedding row (its normalised half 0) instead of the memory around the table. The kernel is called directly
    (the launcher refuses such ids on CPU); the table is the middle rows of a larger one, so the rows at -1 and V
    are other values that a missing guard would read."""
    V, H = 5, 24
    E = _randn((V + 2, H), torch.float32, 30)[1:-1]
    ids = torch.tensor([-1, 2, V], device=DEV)
    h, ew, hw = _randn((3, H), torch.float32, 31), _randn((H,), torch.float32, 32), _randn((H,), torch.float32, 33)
    out = torch.full((3, 2 * H), float("nan"), device=DEV)
    block, num_warps = row_settings(H)
    _mrp_input_kernel[(3,)](ids, E, h, ew, hw, out, V, H, EPS, E.stride(0), h.stride(0), out.stride(0),
                            ROUND_E=False, ROUND_H=False, BLOCK=block, num_warps=num_warps)
    expect = ref.mrp_input(ids.clamp(0, V - 1), E, h, ew, hw, EPS)
    expect[[0, 2], :H] = 0.0
    _close(out, expect)


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
    with pytest.raises(IndexError, match="ids must lie"):
        mrp_input_triton(torch.tensor([-1, 0, 0, 0], device=DEV), E, h, ew, hw, EPS)
    for bad_ids, bad_h in ((ids[:3], h), (ids, h[None]), (ids[:, None], h)):
        with pytest.raises(ValueError, match=r"ids must be \[N\] and hidden \[N, H\]"):
            mrp_input_triton(bad_ids, E, bad_h, ew, hw, EPS)
    with pytest.raises(ValueError, match="enorm_weight and hnorm_weight must have shape"):
        mrp_input_triton(ids, E, h, ew, hw[:5], EPS)
    with pytest.raises(TypeError, match="hidden must be a floating-point"):
        mrp_input_triton(ids, E, h.long(), ew, hw, EPS)
    with pytest.raises(ValueError, match="embed_weight is on meta"):
        mrp_input_triton(ids, E.to("meta"), h, ew, hw, EPS)


# ------------------------------------------------------------------------ checks on either backend
def _bad_calls() -> dict:
    """Calls each launcher refuses; the reference alone would broadcast a weight, residual, table or ``up`` of
    another shape, promote mixed swiglu dtypes, normalise an integer tensor, rotate an odd head_dim's unequal
    halves, or fail with an error that names no argument."""
    x, w, ids, E = _randn((3, 8), torch.float32, 1), torch.ones(8, device=DEV), torch.tensor([0, 1], device=DEV), \
        _randn((5, 8), torch.float32, 2)
    q, k, cs = _randn((1, 2, 2, 8), torch.float32, 3), _randn((1, 2, 1, 8), torch.float32, 4), \
        _randn((1, 2, 8), torch.float32, 5)
    q7, k7, cs7, w7 = q[..., :7], k[..., :7], cs[..., :7], w[:7]
    return {
        "rms_norm weight [1]": (rms_norm, rms_norm_triton, (x, w[:1], EPS)),
        "rms_norm residual [H]": (rms_norm, rms_norm_triton, (x, w, EPS, x[0])),
        "rms_norm integer x": (rms_norm, rms_norm_triton, (x.long(), w, EPS)),
        "rms_norm empty rows": (rms_norm, rms_norm_triton, (x[:, :0], w[:0], EPS)),
        "swiglu up [F]": (swiglu, swiglu_triton, (x, x[0])),
        "swiglu mixed dtypes": (swiglu, swiglu_triton, (x.half(), x)),
        "mrp_input hnorm_weight [1]": (mrp_input, mrp_input_triton, (ids, E, x[:2], w, w[:1], EPS)),
        "mrp_input hidden [1, N, H]": (mrp_input, mrp_input_triton, (ids, E, x[None, :2], w, w, EPS)),
        "qk_norm_rope q_weight [1]": (qk_norm_rope, qk_norm_rope_triton, (q, k, w[:1], w, cs, cs, EPS)),
        "qk_norm_rope odd head_dim": (qk_norm_rope, qk_norm_rope_triton, (q7, k7, w7, w7, cs7, cs7, EPS)),
        "qk_norm_rope q [T, heads, D]": (qk_norm_rope, qk_norm_rope_triton, (q[0], k[0], w, w, cs, cs, EPS)),
        "qk_norm_rope cos [T, D]": (qk_norm_rope, qk_norm_rope_triton, (q, k, w, w, cs[0], cs, EPS)),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_the_public_ops_refuse_on_the_reference_path_what_their_kernels_refuse(case):
    """The reference is the CPU path: there the public op runs its launcher's checks first."""
    public, launcher, args = _bad_calls()[case]
    refused_alike(public, launcher, *args)
