"""The chunked MRP distillation loss (training.kd_loss) against autograd through the dense formula."""

import importlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from training.kd_loss import kd_loss_sum, top_choice, top_choices

SETTINGS = settings(max_examples=40, deadline=None)
softmax_kl_module = importlib.import_module("mrp_triton.softmax_kl")  # the package's attribute is the function


def dense_kd_sum(student, teacher, weight, row_weights):
    """sum_i w_i KL(softmax(W t_i) || softmax(W s_i)), written out for autograd (the oracle)."""
    log_p = F.linear(teacher, weight).log_softmax(-1)
    log_q = F.linear(student, weight).log_softmax(-1)
    return ((log_p.exp() * (log_p - log_q)).sum(-1) * row_weights).sum()


def draw_case(data, dtype=torch.float64):
    n = data.draw(st.integers(0, 24), label="n")
    V = data.draw(st.integers(2, 150), label="V")
    H = data.draw(st.integers(1, 10), label="H")
    sharp = data.draw(st.sampled_from([0.1, 1.0, 8.0]), label="logit scale")  # flat to nearly one-hot
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    student = torch.randn(n, H, generator=g, dtype=torch.float64).to(dtype)
    teacher = (student.double() + 0.5 * torch.randn(n, H, generator=g, dtype=torch.float64)).to(dtype)
    weight = (sharp * torch.randn(V, H, generator=g, dtype=torch.float64)).to(dtype)
    row_weights = 1.0 / torch.rand(n, generator=g, dtype=torch.float64).clamp(min=1e-3)
    return student, teacher, weight, row_weights.to(dtype)


def fp32_rounding(student, teacher, weight, row_weights) -> tuple[float, float]:
    """How far the dense formula computed in fp32 lands from float64 on a drawn case: (loss, largest student gradient
    element), the scale of the rounding any fp32 evaluation carries there. It grows with the row weights (up to
    1000), the logits' size (up to 8 |H|) and the cancellation of near-equal distributions, whose gradient terms
    row_weight * (q - p) * W nearly cancel (fuzz runs: an fp32 gradient of 54 was 2.5e-4 off, a loss of 0.51 2.5e-5
    off, an fp64 gradient 4.4e-12 off), so a fixed tolerance is either too tight or blind."""
    out = []
    for dtype in (torch.float32, torch.float64):
        s = student.detach().to(dtype).requires_grad_()
        loss = dense_kd_sum(s, teacher.to(dtype), weight.to(dtype), row_weights.to(dtype))
        loss.backward()
        out.append((loss.detach().double(), s.grad.double()))
    (l32, g32), (l64, g64) = out
    return float((l32 - l64).abs()), float((g32 - g64).abs().max()) if g64.numel() else 0.0


@SETTINGS
@given(data=st.data())
def test_loss_and_student_gradient_equal_autograd_of_the_dense_formula(data):
    _check_against_the_dense_formula(data)


@pytest.mark.triton
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_the_softmax_kl_kernel_gives_the_loss_and_gradient_of_the_dense_formula(data):
    """The same with each chunk's KL and gradient from the Triton kernel (``mrp_triton.softmax_kl``, what a CUDA
    run dispatches to; here in the interpreter)."""
    with mock.patch.object(softmax_kl_module, "softmax_kl_triton", wraps=softmax_kl_module.softmax_kl_triton) as kernel:
        n = _check_against_the_dense_formula(data, grad_atol=1e-10)  # its rounding differs: exp(s - lse)
    assert (kernel.call_count > 0) == (n > 0)  # a chunk each (the test above passes without the kernel)


def _check_against_the_dense_formula(data, grad_atol: float = 1e-12) -> int:
    """kd_loss_sum on a drawn case (fp64) equals autograd through :func:`dense_kd_sum`; returns the rows n (row
    weights reach 1000 and logits 8 * |H|, so the gradients' last bits are ~1e-12)."""
    student, teacher, weight, row_weights = draw_case(data)
    chunk = data.draw(st.integers(1, student.shape[0] + 3), label="chunk_rows")
    upstream = data.draw(st.floats(-3.0, 3.0), label="upstream grad")
    s1 = student.clone().requires_grad_()
    got = kd_loss_sum(s1, teacher, weight, row_weights, chunk_rows=chunk)
    (got * upstream).backward()
    s2 = student.clone().requires_grad_()
    want = dense_kd_sum(s2, teacher, weight, row_weights)
    (want * upstream).backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    grad_atol = max(grad_atol, 8 * 2.0**-29 * fp32_rounding(student, teacher, weight, row_weights)[1])  # fp64 ulps
    torch.testing.assert_close(s1.grad, s2.grad, rtol=1e-9, atol=grad_atol)
    assert got.dtype == torch.float64
    return student.shape[0]


@SETTINGS
@given(data=st.data())
def test_low_precision_inputs_are_scored_in_fp32_with_grads_in_their_dtype(data):
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), label="dtype")
    student, teacher, weight, row_weights = draw_case(data, dtype)
    s1 = student.clone().requires_grad_()
    got = kd_loss_sum(s1, teacher, weight, row_weights, chunk_rows=5)
    got.backward()
    s2 = student.double().requires_grad_()
    want = dense_kd_sum(s2, teacher.double(), weight.double(), row_weights.double())
    want.backward()
    assert got.dtype == torch.float32 and s1.grad.dtype == dtype
    loss_fp32, grad_fp32 = fp32_rounding(student, teacher, weight, row_weights)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 + 8 * loss_fp32)
    rtol = {torch.float32: 1.3e-6, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}[dtype]  # the dtype's own rounding
    torch.testing.assert_close(s1.grad.double(), s2.grad.to(dtype).double(), rtol=rtol, atol=1e-5 + 8 * grad_fp32)


def test_autocast_does_not_lower_the_logits_to_bf16():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(7, 16, generator=g).requires_grad_(), torch.randn(7, 16, generator=g)
    weight, rw = torch.randn(50, 16, generator=g), torch.rand(7, generator=g) + 0.5
    plain = kd_loss_sum(student, teacher, weight, rw, chunk_rows=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = kd_loss_sum(student, teacher, weight, rw, chunk_rows=3)
    assert autocast.dtype == torch.float32
    assert torch.equal(plain, autocast)


def test_backward_keeps_one_n_by_h_tensor_and_nothing_of_the_vocabulary():
    """What the loss saves for backward: the student gradient [n, H] only (autograd through the dense
    formula would keep [n, V] log-probabilities)."""
    n, H, V = 12, 8, 301
    student = torch.randn(n, H).requires_grad_()
    teacher, weight, rw = torch.randn(n, H), torch.randn(V, H), torch.ones(n)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = kd_loss_sum(student, teacher, weight, rw, chunk_rows=4)
    assert saved == [(n, H)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        dense_kd_sum(student, teacher, weight, rw)
    assert any(V in shape for shape in saved[1:])  # the oracle does keep vocabulary-sized tensors
    loss.backward()
    assert student.grad.shape == (n, H)


def test_frozen_inputs_are_required():
    student, teacher = torch.randn(3, 4).requires_grad_(), torch.randn(3, 4)
    weight, rw = torch.randn(9, 4), torch.ones(3)
    with pytest.raises(ValueError, match="lm_head weight"):
        kd_loss_sum(student, teacher, weight.requires_grad_(), rw)
    for trainable in ("teacher", "row_weights"):  # with a frozen lm_head
        args = {"teacher": torch.randn(3, 4), "row_weights": torch.ones(3)}
        args[trainable].requires_grad_()
        with pytest.raises(ValueError, match="must not require grad"):
            kd_loss_sum(student, args["teacher"], weight.detach(), args["row_weights"])
    with torch.no_grad():  # evaluation: nothing is differentiated, so a trainable lm_head is fine
        assert torch.isfinite(kd_loss_sum(student, teacher, weight, rw))


@pytest.mark.parametrize("args,match", [
    (((3, 4), (3, 5), (9, 4), (3,)), "student and teacher"),
    (((3, 4), (3, 4), (9, 5), (3,)), "weight must be"),
    (((3, 4), (3, 4), (9, 4), (2,)), "row_weights"),
])
def test_mismatched_shapes_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        kd_loss_sum(*(torch.randn(s) for s in args))


def test_a_vocabulary_larger_than_a_chunk_takes_one_row_a_chunk():
    from training.kd_loss import CHUNK_ELEMENTS, default_chunk_rows

    assert default_chunk_rows(CHUNK_ELEMENTS // 4) == 4
    assert default_chunk_rows(CHUNK_ELEMENTS + 1) == 1


def test_chunk_rows_below_one_is_refused():
    with pytest.raises(ValueError, match="chunk_rows"):
        kd_loss_sum(torch.randn(3, 4), torch.randn(3, 4), torch.randn(9, 4), torch.ones(3), chunk_rows=0)


@SETTINGS
@given(data=st.data())
def test_top_choices_in_chunks_equal_top_choice_of_the_whole_logits(data):
    hidden, _, weight, _ = draw_case(data, torch.float32)
    weight = weight.round()  # integer logits: exact ties between tokens
    hidden = hidden.round()
    mask = data.draw(st.integers(0, weight.shape[0] - 1), label="mask_token_id")
    chunk = data.draw(st.integers(1, hidden.shape[0] + 3), label="chunk_rows")
    conf, token = top_choices(hidden, weight, mask, chunk_rows=chunk)
    want_conf, want_token = top_choice(hidden @ weight.T, mask)
    assert torch.equal(token, want_token) and not (token == mask).any()
    torch.testing.assert_close(conf, want_conf)
    z = (hidden @ weight.T).index_fill(-1, torch.tensor([mask]), float("-inf"))
    first_max = (z == z.max(-1, keepdim=True).values).int().argmax(-1)  # ties go to the lowest token id
    assert torch.equal(token, first_max)


def _bf16(t):
    return t.to(torch.bfloat16).double()


def bf16_oracle(student, teacher, weight, row_weights):
    """What ``precision="bf16"`` computes, in fp64: the loss of the GEMM inputs rounded to bf16, and its student
    gradient with the softmax difference rounded to bf16 too (the input of the backward GEMM)."""
    w = _bf16(weight)
    log_p = F.linear(_bf16(teacher), w).log_softmax(-1)
    log_q = F.linear(_bf16(student), w).log_softmax(-1)
    rw = row_weights.double()
    loss = ((log_p.exp() * (log_p - log_q)).sum(-1) * rw).sum()
    return loss, _bf16((log_q.exp() - log_p.exp()) * rw[:, None]) @ w


@SETTINGS
@given(data=st.data())
def test_bf16_precision_rounds_the_gemm_inputs_and_keeps_the_logits_fp32(data):
    student, teacher, weight, row_weights = draw_case(data, torch.float32)
    chunk = data.draw(st.integers(1, student.shape[0] + 3), label="chunk_rows")
    s = student.clone().requires_grad_()
    got = kd_loss_sum(s, teacher, weight, row_weights, chunk_rows=chunk, precision="bf16")
    got.backward()
    want, want_grad = bf16_oracle(student, teacher, weight, row_weights)
    assert got.dtype == torch.float32 and s.grad.dtype == torch.float32
    loss_fp32, grad_fp32 = fp32_rounding(student, teacher, weight, row_weights)  # the loss and softmax are fp32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 + 8 * loss_fp32)
    scale = float(want_grad.abs().max()) if want_grad.numel() else 1.0
    torch.testing.assert_close(s.grad.double(), want_grad, rtol=1e-2, atol=1e-2 * scale + 8 * grad_fp32)


def test_each_precision_on_a_fixed_case():
    """bf16 inputs move the loss measurably (so the bf16 test above tells the two apart), tf32 is fp32 off CUDA
    (and leaves the process's matmul precision as it was), fp64 inputs stay fp64 whatever the precision."""
    g = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(40, 64, generator=g), torch.randn(40, 64, generator=g)
    weight, rw = 0.3 * torch.randn(500, 64, generator=g), torch.rand(40, generator=g) + 0.5
    fp32 = kd_loss_sum(student, teacher, weight, rw)
    bf16 = kd_loss_sum(student, teacher, weight, rw, precision="bf16")
    before = torch.get_float32_matmul_precision()
    assert torch.equal(kd_loss_sum(student, teacher, weight, rw, precision="tf32"), fp32)
    assert torch.get_float32_matmul_precision() == before
    assert abs(float(bf16 / fp32) - 1) > 1e-5
    torch.testing.assert_close(bf16.double(), bf16_oracle(student, teacher, weight, rw)[0], rtol=1e-6, atol=0)
    exact = kd_loss_sum(student.double(), teacher.double(), weight.double(), rw.double())
    assert torch.equal(kd_loss_sum(student.double(), teacher.double(), weight.double(), rw.double(), precision="bf16"),
                       exact)
    conf, token = top_choices(student, weight, 3, precision="bf16")
    want_conf, want_token = top_choice(_bf16(student) @ _bf16(weight).T, 3)
    assert torch.equal(token, want_token)
    torch.testing.assert_close(conf.double(), want_conf, rtol=1e-6, atol=1e-6)


def test_unknown_precision_is_refused():
    args = torch.randn(3, 4), torch.randn(3, 4), torch.randn(9, 4), torch.ones(3)
    with pytest.raises(ValueError, match=r"precision \(--kd-precision\) must be one of .* got 'fp16'"):
        kd_loss_sum(*args, precision="fp16")
    with pytest.raises(ValueError, match="--kd-precision"):
        top_choices(args[0], args[2], 0, precision="half")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: TF32 tensor cores and the fp32-output bf16 GEMM")
@pytest.mark.parametrize("precision,rtol", [("tf32", 1e-3), ("bf16", 1e-5)])
def test_cuda_precisions(precision, rtol):
    """On CUDA, tf32 stays within TF32's rounding of fp64, and bf16 (one GEMM of bf16 operands with an fp32 output)
    computes what the CPU's emulation does (the bf16 oracle)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    student, teacher = (torch.randn(300, 256, device="cuda", generator=g) for _ in range(2))
    weight = 0.1 * torch.randn(5000, 256, device="cuda", generator=g)
    rw = torch.rand(300, device="cuda", generator=g) + 0.5
    s = student.clone().requires_grad_()
    got = kd_loss_sum(s, teacher, weight, rw, chunk_rows=64, precision=precision)
    got.backward()
    if precision == "bf16":
        want, want_grad = bf16_oracle(student, teacher, weight, rw)
    else:
        sd = student.double().requires_grad_()
        want = dense_kd_sum(sd, teacher.double(), weight.double(), rw.double())
        want.backward()
        want_grad = sd.grad
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=0)
    torch.testing.assert_close(s.grad.double(), want_grad, rtol=2e-2, atol=2e-2 * float(want_grad.abs().max()))
