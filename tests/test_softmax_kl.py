"""softmax_kl (the KD loss's per-chunk KL and gradient): Triton kernels (interpreter on CPU) vs the PyTorch reference,
and the reference vs autograd."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_utils import DEV, poisoned_allocations
from mrp_triton import reference as ref
from mrp_triton import softmax_kl, use_backend
from mrp_triton.softmax_kl import softmax_kl_triton

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def _logits(n, V, dtype, seed, scale, pad=0):
    """Student and teacher logits [n, V] (the teacher near the student), each the first V columns of [n, V + pad]."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, V + pad, generator=g, dtype=torch.float64) * scale
    t = s + torch.randn(n, V + pad, generator=g, dtype=torch.float64) * scale / 2
    return s.to(DEV, dtype)[:, :V], t.to(DEV, dtype)[:, :V]


def _sprinkle(x, seed, value, every):
    """x with ``value`` at random places, at most one in ``every`` of each row and never a whole row."""
    g = torch.Generator().manual_seed(seed)
    hit = torch.rand(x.shape, generator=g) < 1 / every
    hit[:, 0] = False
    return x.masked_fill(hit.to(x.device), value)


@pytest.mark.triton
@settings(max_examples=30)
@given(n=st.integers(1, 9), V=st.integers(1, 3000), dtype=st.sampled_from((torch.float32, torch.float64)),
       splits=st.sampled_from((None, 1, 2, 3, 7)), block=st.sampled_from((None, 16, 64)),
       scale=st.sampled_from((0.1, 1.0, 30.0)), grad=st.booleans(), pad=st.sampled_from((0, 0, 3)),
       minus_inf=st.sampled_from((None, "student", "teacher", "range")), seed=st.integers(0, 2**16))
def test_kernel_matches_reference(n, V, dtype, splits, block, scale, grad, pad, minus_inf, seed):
    """Drawn rows, vocabularies, slices (one to more than there are tiles), tiles (one to many a slice), sharpness
    and row strides; -inf logits (teacher: probability 0, contributing 0; student: KL inf where the teacher has
    mass; ``range``: both over the first half of the vocabulary, a masked range, so whole tiles see only -inf
    before any finite logit); the gradient written over the student logits, which nothing else may touch (the
    padding columns stay); a strided grad_scale."""
    s, t = _logits(n, V, dtype, seed, scale, pad)
    if minus_inf == "student":
        s = _sprinkle(s.clone(), seed, float("-inf"), 5)
    elif minus_inf == "teacher":
        t = _sprinkle(t.clone(), seed, float("-inf"), 5)
    elif minus_inf == "range":
        s, t = s.clone(), t.clone()
        s[:, : V // 2], t[:, : V // 2] = float("-inf"), float("-inf")
    w = (torch.rand(2 * n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5).to(DEV, dtype)
    w = w[::2]
    wide = torch.full((n, V + pad), 7.0, dtype=dtype, device=DEV)
    got_s = wide[:, :V].copy_(s)
    want_s = s.clone()
    with poisoned_allocations():
        got = softmax_kl_triton(got_s, t, w if grad else None, splits=splits, block=block)
    want = ref.softmax_kl(want_s, t, w if grad else None)
    assert got.dtype == dtype and got.shape == (n,)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(got_s, want_s, **TOL[dtype])  # the gradient, or the logits left as they were
    assert (wide[:, V:] == 7.0).all()


@pytest.mark.parametrize("splits", [3, 5])
def test_rows_of_very_negative_logits_merge_their_slices(splits):
    """Slice counts that are not a power of two leave padding lanes in the merge: they must not lift a row's maximum
    (logits all near -200 would then underflow to a normaliser of -inf, the KL to NaN)."""
    g = torch.Generator().manual_seed(0)
    s = (torch.randn(3, 300, generator=g) - 200).to(DEV)
    t = s + 0.5 * torch.randn(3, 300, generator=g).to(DEV)
    got = softmax_kl_triton(s.clone(), t, splits=splits, block=16)
    torch.testing.assert_close(got, ref.softmax_kl(s.clone(), t), **TOL[torch.float32])


@pytest.mark.triton
def test_kernel_at_a_real_vocabulary():
    """A chunk's rows at the released models' vocabulary (V = 151936, not a multiple of the tiles), with the
    launcher's own slicing (on a GPU ~4 programs an SM): what MRP training hands the op, against the reference in
    fp64 on the same fp32 logits (the kernel is within 2e-6 of it here; the reference in fp32 is 1e-4 off, its
    sum over V rounding more)."""
    s, t = _logits(6, 151936, torch.float32, 5, 4.0)
    w = torch.rand(6, generator=torch.Generator().manual_seed(5)).to(DEV) + 0.5
    got_s, want_s = s.clone(), s.double()
    with poisoned_allocations():
        got = softmax_kl_triton(got_s, t, w)
    torch.testing.assert_close(got.double(), ref.softmax_kl(want_s, t.double(), w.double()), rtol=2e-6, atol=0)
    torch.testing.assert_close(got_s.double(), want_s, rtol=1e-5, atol=2e-7)  # fp32 steps of a probability ~1


@pytest.mark.triton
def test_nan_logits_make_their_row_nan_only():
    s, t = _logits(4, 300, torch.float32, 0, 1.0)
    s, t = s.clone(), t.clone()
    s[1, 17] = float("nan")
    t[2, 250] = float("nan")
    w = torch.ones(4, device=DEV)
    got_s, want_s = s.clone(), s.clone()
    got = softmax_kl_triton(got_s, t, w, splits=3)
    want = ref.softmax_kl(want_s, t, w)
    assert got[1:3].isnan().all() and got_s[1:3].isnan().all() and not got[[0, 3]].isnan().any()
    torch.testing.assert_close(got, want, equal_nan=True, **TOL[torch.float32])
    torch.testing.assert_close(got_s, want_s, equal_nan=True, **TOL[torch.float32])


def test_reference_equals_autograd_of_the_kl():
    """The reference's KL and the gradient it writes against autograd through log_softmax (fp64)."""
    s, t = _logits(6, 50, torch.float64, 3, 2.0)
    w = torch.rand(6, dtype=torch.float64, device=DEV)
    leaf = s.clone().requires_grad_()
    dense = (t.softmax(-1) * (t.log_softmax(-1) - leaf.log_softmax(-1))).sum(-1)
    (dense * w).sum().backward()
    written = s.clone()
    kl = ref.softmax_kl(written, t, w)
    torch.testing.assert_close(kl, dense.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(written, leaf.grad, rtol=1e-12, atol=1e-14)


def _on_the_reference_backend(*args):
    """The public op where it dispatches to the reference (which runs the same argument checks)."""
    with use_backend("reference"):
        return softmax_kl(*args)


@pytest.mark.triton
@pytest.mark.parametrize("op", [softmax_kl, softmax_kl_triton, _on_the_reference_backend])
def test_bad_input_is_refused_with_the_argument_named(op):
    s, t = _logits(3, 20, torch.float32, 0, 1.0)
    with pytest.raises(TypeError, match="float32 or float64"):
        op(s.bfloat16(), t.bfloat16())
    with pytest.raises(ValueError, match="teacher shape"):
        op(s, t[:2])
    with pytest.raises(TypeError, match="teacher dtype"):
        op(s, t.double())
    with pytest.raises(ValueError, match=r"student must be a \[n, V\]"):
        op(s[0], t[0])
    with pytest.raises(ValueError, match=r"grad_scale must be a float tensor \[n=3\]"):
        op(s, t, torch.ones(2, device=DEV))
    with pytest.raises(ValueError, match=r"grad_scale must be a float tensor \[n=3\]"):
        op(s, t, torch.ones(3, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="grad_scale is on meta"):
        op(s, t, torch.ones(3, device="meta"))


@pytest.mark.parametrize("shape", [(0, 20), (3, 0)], ids=["no-rows", "no-vocabulary"])
def test_empty_logits_give_the_reference_result(shape):
    """A chunk of no rows, or rows of no logits (KL 0: an empty sum), with and without the gradient: what the
    reference gives, not a launch over an empty grid or slices of width 0."""
    s, t = torch.zeros(shape, device=DEV), torch.zeros(shape, device=DEV)
    for w in (None, torch.ones(shape[0], device=DEV)):
        got, want = softmax_kl_triton(s.clone(), t, w), ref.softmax_kl(s.clone(), t, w)
        assert got.shape == (shape[0],)
        torch.testing.assert_close(got, want)


@pytest.mark.triton
def test_the_gradient_needs_rows_it_can_write_in_place():
    s, t = _logits(3, 20, torch.float32, 0, 1.0)
    with pytest.raises(ValueError, match="contiguous rows"):
        softmax_kl_triton(s.t().contiguous().t(), t, torch.ones(3, device=DEV))
    torch.testing.assert_close(softmax_kl_triton(s.t().contiguous().t(), t), ref.softmax_kl(s.clone(), t))
