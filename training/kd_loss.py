"""The MRP distillation loss over the vocabulary, in row chunks, keeping nothing of size V for backward.

``kd_loss_sum(student, teacher, weight, row_weights)`` = sum_i w_i KL(softmax(W t_i) || softmax(W s_i)): the
teacher's and student's logits through the (frozen) lm_head W [V, H], in fp32 (fp64 inputs stay fp64).

Written out through autograd, one unroll step keeps its [n, V] log-probabilities for backward (plus a
few more [n, V] temporaries at the peak): at V = 151936 and the n ~ 2000 masked positions of one
4096-token sequence that is ~1.2 GB per tensor, several GB per unroll step, which is what bounds the
micro-batch of MRP training on a real backbone. Here each chunk of rows computes its logits, its share
of the loss and, in the same pass, its gradient with respect to the student rows,
``w_i (softmax(W s_i) - softmax(W t_i)) @ W``: backward keeps only that [n, H] tensor and scales it.
Same GEMMs as autograd (two logit products forward, one for the gradient), fewer passes over [n, V]. The
weight is cast to fp32 once per call, as the dense formula also needs ([V, H] fp32: 1.2 GB at the 1.7B shape).
Between the GEMMs, ``mrp_triton.softmax_kl`` takes a chunk's two logit tensors to its KL per row and writes the
gradient over the student's logits: on CUDA two Triton passes (both tensors read twice, the gradient written once,
nothing else of size [rows, V] allocated), elsewhere its PyTorch reference (log-softmaxes and in-place elementwise
ops).

``top_choices`` gives what the draft-agreement statistics need (per row the most probable token without the
mask token and its log-probability) in the same chunks, without gradients.

``precision`` sets how the GEMMs read fp32 inputs (fp64 inputs stay fp64): ``fp32`` (exact, and on a GPU the slowest:
no tensor cores), ``tf32`` (CUDA's TF32 tensor cores, 10-bit input mantissas, fp32 accumulation; fp32 elsewhere)
or ``bf16`` (inputs rounded to bf16, products accumulated and returned in fp32: one GEMM with an fp32 output on
CUDA; elsewhere the rounded values multiplied in fp32, the same products, since a product of two bf16 values is exact
in fp32). The logits and the softmax stay fp32 in every case (bf16 logits would round a logit of 20 to 1/8).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

import mrp_triton

CHUNK_ELEMENTS = 1 << 25  # logits per chunk: [chunk_rows, V] in fp32 is 128 MB; a chunk holds 2 such (4 on CPU)


def default_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk: as many as keep one [rows, V] tensor at CHUNK_ELEMENTS (at least one)."""
    return max(1, CHUNK_ELEMENTS // vocab_size)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for fp64 inputs


def _chunks(n: int, rows: int) -> Iterator[slice]:
    for start in range(0, n, rows):
        yield slice(start, min(start + rows, n))


def _no_autocast(device: torch.device) -> torch.autocast:
    """The logits in fp32 even under bf16 autocast: the KD targets are small logit differences."""
    return torch.autocast(device.type, enabled=False)


PRECISIONS = ("fp32", "tf32", "bf16")


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision (--kd-precision) must be one of {PRECISIONS}, got {precision!r}")


@contextlib.contextmanager
def _tf32_on(device: torch.device, on: bool):
    """CUDA fp32 GEMMs on TF32 tensor cores inside the block (``torch.set_float32_matmul_precision("high")``),
    the process's setting restored after."""
    if not (on and device.type == "cuda"):
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class _LMHead:
    """The frozen lm_head W [V, H] as one call's GEMMs read it: ``logits(x [n, H]) -> [n, V]`` and
    ``back(c [n, V]) -> [n, H]`` (= c @ W), both in ``dtype`` (the compute dtype); at ``precision`` bf16 (fp32
    compute only) their inputs rounded to bf16 first (see the module's ``precision``)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, precision: str):
        self.dtype = dtype
        self.bf16 = bf16 = precision == "bf16" and dtype == torch.float32
        self.fused = bf16 and weight.is_cuda  # one GEMM of bf16 operands with an fp32 output
        w = weight.to(torch.bfloat16) if bf16 else weight.to(dtype)
        self.w = w if self.fused or not bf16 else w.float()  # the rounded values, multiplied in fp32

    def _operand(self, x: torch.Tensor) -> torch.Tensor:
        if not self.bf16:
            return x.to(self.dtype)
        x = x.to(torch.bfloat16)
        return x if self.fused else x.float()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self._operand(x)
        return torch.mm(x, self.w.t(), out_dtype=torch.float32) if self.fused else F.linear(x, self.w)

    def back(self, c: torch.Tensor) -> torch.Tensor:
        c = self._operand(c)
        return torch.mm(c, self.w, out_dtype=torch.float32) if self.fused else c @ self.w


def _check(student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor, row_weights: torch.Tensor,
           chunk_rows: int | None) -> None:
    if student.dim() != 2 or teacher.shape != student.shape:
        raise ValueError(f"student and teacher must both be [n, H], got {tuple(student.shape)} and "
                         f"{tuple(teacher.shape)}")
    if weight.dim() != 2 or weight.shape[1] != student.shape[1]:
        raise ValueError(f"weight must be the lm_head weight [V, H={student.shape[1]}], got {tuple(weight.shape)}")
    if row_weights.shape != student.shape[:1]:
        raise ValueError(f"row_weights must be [n={student.shape[0]}], got {tuple(row_weights.shape)}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")


class _ChunkedKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, weight, row_weights, chunk_rows, want_grad, precision):
        dt = _compute_dtype(student.dtype)
        ctx.student_dtype = student.dtype
        with _no_autocast(student.device), _tf32_on(student.device, precision == "tf32"):
            head = _LMHead(weight, dt, precision)
            grad = torch.empty(student.shape, dtype=dt, device=student.device) if want_grad else None
            total = torch.zeros((), dtype=dt, device=student.device)
            for rows in _chunks(student.shape[0], chunk_rows):
                logits = head.logits(student[rows])  # with want_grad, overwritten by the gradient over them
                rw = row_weights[rows].to(dt)
                kl = mrp_triton.softmax_kl(logits, head.logits(teacher[rows]), rw if grad is not None else None)
                total += (kl * rw).sum()
                if grad is not None:
                    grad[rows] = head.back(logits)
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return (grad * grad_total).to(ctx.student_dtype), None, None, None, None, None, None


def kd_loss_sum(student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor, row_weights: torch.Tensor,
                chunk_rows: int | None = None, precision: str = "fp32") -> torch.Tensor:
    """sum_i row_weights_i * KL(softmax(weight @ teacher_i) || softmax(weight @ student_i)), a 0-d tensor.

    student: [n, H] (the only input that may require grad), teacher: [n, H], weight: [V, H] (frozen),
    row_weights: [n]. Computed ``chunk_rows`` rows at a time (default :func:`default_chunk_rows`) in fp32
    (fp64 for fp64 inputs), also under autocast, its GEMMs at ``precision`` (see the module); backward keeps one
    [n, H] tensor."""
    _check(student, teacher, weight, row_weights, chunk_rows)
    _check_precision(precision)
    grad_on = torch.is_grad_enabled()
    if grad_on and (teacher.requires_grad or weight.requires_grad or row_weights.requires_grad):
        raise ValueError("kd_loss_sum differentiates the student rows only: the teacher, the lm_head weight and the "
                         "row weights must not require grad (freeze the lm_head, detach the teacher)")
    rows = default_chunk_rows(weight.shape[0]) if chunk_rows is None else chunk_rows
    return _ChunkedKD.apply(student, teacher, weight, row_weights, rows, grad_on and student.requires_grad, precision)


def top_choice(logits: torch.Tensor, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] -> (log of the largest probability [n], its token [n]), the mask token excluded (as the
    decoder's picks exclude it); ties go to the lowest token id."""
    z = logits.to(_compute_dtype(logits.dtype)).index_fill(-1, torch.tensor([mask_token_id], device=logits.device),
                                                           float("-inf"))
    top, token = z.max(-1)  # first maximal index
    return top - torch.logsumexp(z, -1), token


@torch.no_grad()
def top_choices(hidden: torch.Tensor, weight: torch.Tensor, mask_token_id: int,
                chunk_rows: int | None = None, precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_choice` of ``hidden [n, H] @ weight.T`` (fp32 logits, GEMMs at ``precision``), ``chunk_rows``
    rows at a time."""
    _check_precision(precision)
    rows_per_chunk = default_chunk_rows(weight.shape[0]) if chunk_rows is None else chunk_rows
    dt = _compute_dtype(hidden.dtype)
    with _no_autocast(hidden.device), _tf32_on(hidden.device, precision == "tf32"):
        head = _LMHead(weight, dt, precision)
        parts = [top_choice(head.logits(hidden[rows]), mask_token_id)
                 for rows in _chunks(hidden.shape[0], rows_per_chunk)]
    if not parts:
        empty = hidden.new_empty(0, dtype=dt)
        return empty, empty.long()
    return torch.cat([c for c, _ in parts]), torch.cat([t for _, t in parts])
