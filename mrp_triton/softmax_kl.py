"""KL(softmax(teacher) || softmax(student)) per row and its gradient over the student logits, in two passes.

What the MRP distillation loss (``training.kd_loss``) does with a chunk of rows once its two GEMMs have written
the student's and the teacher's fp32 logits, [n, V] each: per row the KL divergence of the student's softmax from
the teacher's and, for backward, the gradient of sum_i w_i KL_i with respect to the student logits,
w_i (softmax(student_i) - softmax(teacher_i)), written over the student logits (the last GEMM, gradient @ W,
reads it from there).

Cost model (n rows of V logits, b = 4 bytes in fp32):
    reads  4*n*V*b (each of the two tensors twice), writes n*V*b (the gradient, in place), ~4 exps an element
    (vs the reference in eager torch: two log-softmaxes and 8 elementwise ops, in place where they can be, ~25
       reads and writes of n*V*b and three [n, V] temporaries; at V = 151936 a chunk of 220 rows is 134 MB a pass)
Kernels, grid (n, S): the vocabulary in S slices of whole BLOCK tiles (S sized so that n * S is ~4 programs per
SM; rows are few and long here: 220 rows of a chunk would fill an H200 with under 2 programs an SM):
1. ``_stats_kernel``: each program's slice of both rows -> running max and rescaled sum of exp (an online softmax,
   one exp an element and tensor), written per (row, slice).
2. ``_kl_kernel``: each program merges its row's S partials into both log-sum-exps, then walks its slice again:
   p = exp(t - lse_t), q = exp(s - lse_s), KL partial += p (log p - log q) (0 where p = 0), and with the gradient
   w (q - p) stored over s. Per (row, slice) KL partials, summed per row by one small torch reduction (the sum
   stays deterministic, no atomics).
Logits are fp32 or fp64, computed in their own dtype (fp64 is what the tests differentiate against).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import as_rows, check_kernel_device, check_matches
from .backend import interpreter_on, num_sms, select_backend
from .reference.softmax_kl import softmax_kl as softmax_kl_reference

_DTYPES = (torch.float32, torch.float64)


@triton.jit
def _online_step(m, d, x):
    """One tile x [BLOCK] of an online softmax: the running max m and sum d of exp(x - m) -> updated (m, d)."""
    new_m = tl.maximum(m, tl.max(x, 0))
    safe = tl.where(new_m == float("-inf"), 0.0, new_m)  # no -inf - -inf while only -inf has been seen
    return new_m, d * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), 0)


@triton.jit
def _stats_kernel(s_ptr, t_ptr, part_ptr, V, stride_s, stride_t, span, S, BLOCK: tl.constexpr):
    """part[row, slice] = (max s, sum exp(s - max s), max t, sum exp(t - max t)) over the slice's columns."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * span
    end = tl.minimum(start + span, V)
    dt = s_ptr.dtype.element_ty
    m_s = tl.full([], float("-inf"), dt)
    m_t = tl.full([], float("-inf"), dt)
    d_s = tl.zeros([], dt)
    d_t = tl.zeros([], dt)
    for c0 in range(start, end, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < end
        s = tl.load(s_ptr + row * stride_s + cols, mask=mask, other=float("-inf"))
        t = tl.load(t_ptr + row * stride_t + cols, mask=mask, other=float("-inf"))
        m_s, d_s = _online_step(m_s, d_s, s)
        m_t, d_t = _online_step(m_t, d_t, t)
    out = part_ptr + (row * S + split) * 4
    tl.store(out, m_s)
    tl.store(out + 1, d_s)
    tl.store(out + 2, m_t)
    tl.store(out + 3, d_t)


@triton.jit
def _lse(part_ptr, which, S, BLOCK_S: tl.constexpr):
    """The log-sum-exp of a row from its S (max, sum) partials at offsets ``which``, ``which + 1`` of each 4."""
    offs = tl.arange(0, BLOCK_S)
    live = offs < S
    m = tl.load(part_ptr + offs * 4 + which, mask=live, other=float("-inf"))
    d = tl.load(part_ptr + offs * 4 + which + 1, mask=live, other=0.0)
    top = tl.max(m, 0)
    safe = tl.where(top == float("-inf"), 0.0, top)
    return safe + tl.log(tl.sum(d * tl.exp(m - safe), 0))


@triton.jit
def _kl_kernel(s_ptr, t_ptr, scale_ptr, part_ptr, kl_ptr, V, stride_s, stride_t, span, S,
               GRAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    """kl[row, slice] = the slice's sum of p (log p - log q); with GRAD, s <- scale[row] * (q - p) on the slice."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * span
    end = tl.minimum(start + span, V)
    row_parts = part_ptr + row * S * 4
    lse_s = _lse(row_parts, 0, S, BLOCK_S)
    lse_t = _lse(row_parts, 2, S, BLOCK_S)
    if GRAD:
        w = tl.load(scale_ptr + row).to(s_ptr.dtype.element_ty)
    acc = tl.zeros([BLOCK], s_ptr.dtype.element_ty)
    for c0 in range(start, end, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < end
        log_q = tl.load(s_ptr + row * stride_s + cols, mask=mask, other=0.0) - lse_s
        log_p = tl.load(t_ptr + row * stride_t + cols, mask=mask, other=0.0) - lse_t
        p = tl.where(mask, tl.exp(log_p), 0.0)
        acc += tl.where(p == 0, 0.0, p * (log_p - log_q))
        if GRAD:
            tl.store(s_ptr + row * stride_s + cols, w * (tl.exp(log_q) - p), mask=mask)
    tl.store(kl_ptr + row * S + split, tl.sum(acc, 0))


def _pick_config(n: int, V: int, device: torch.device, splits: int | None, block: int | None) -> tuple[int, int, int]:
    """(slices S, BLOCK, num_warps): 2048-wide tiles on 8 warps (8 fp32 elements a thread: two 16-byte loads a
    tensor and tile) and ~4 programs an SM on CUDA; in the interpreter one slice of one wide tile (numpy is faster on
    long vectors). ``splits`` and ``block`` force either (tests). Untimed on hardware so far:
    ``benchmarks/bench_kd_loss.py`` times the op inside the KD loss."""
    if interpreter_on() and device.type != "cuda":
        block = block or min(4096, triton.next_power_of_2(max(triton.cdiv(V, splits or 1), 16)))
        wanted, num_warps = splits or 1, 4
    else:
        block = block or (2048 if V >= 2048 else triton.next_power_of_2(max(V, 128)))
        wanted, num_warps = splits or triton.cdiv(4 * num_sms(device), max(n, 1)), 8 if block >= 2048 else 4
    return max(1, min(wanted, triton.cdiv(V, block))), block, num_warps


def _check_args(student: torch.Tensor, teacher: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
    if student.dim() != 2:
        raise ValueError(f"student must be a [n, V] tensor of logits, got shape {tuple(student.shape)}")
    check_matches("teacher", teacher, "student", student)
    if student.dtype not in _DTYPES:
        raise TypeError(f"student and teacher logits must be float32 or float64 (scored in their own dtype; "
                        f"low-precision logits would round away the differences KD learns from), got {student.dtype}")
    if grad_scale is not None:
        if grad_scale.shape != student.shape[:1] or not grad_scale.dtype.is_floating_point:
            raise ValueError(f"grad_scale must be a float tensor [n={student.shape[0]}], got {grad_scale.dtype} "
                             f"of shape {tuple(grad_scale.shape)}")
        if grad_scale.device != student.device:
            raise ValueError(f"grad_scale is on {grad_scale.device} but student on {student.device}")


def softmax_kl_triton(student: torch.Tensor, teacher: torch.Tensor, grad_scale: torch.Tensor | None = None,
                      splits: int | None = None, block: int | None = None) -> torch.Tensor:
    """Triton launcher of :func:`softmax_kl` (same arguments and result); ``splits`` and ``block`` force the number
    of vocabulary slices and the tile width (tests)."""
    _check_args(student, teacher, grad_scale)
    check_kernel_device(student.device, "softmax_kl")
    n, V = student.shape
    if n == 0 or V == 0:
        return softmax_kl_reference(student, teacher, grad_scale)
    if grad_scale is not None and student.stride(1) != 1:
        raise ValueError("student must have contiguous rows (stride 1 along V) to take the gradient in place")
    s, t = as_rows(student), as_rows(teacher)
    S, block, num_warps = _pick_config(n, V, student.device, splits, block)
    span = triton.cdiv(triton.cdiv(V, S), block) * block
    S = triton.cdiv(V, span)
    parts = torch.empty((n, S, 4), dtype=student.dtype, device=student.device)
    kl = torch.empty((n, S), dtype=student.dtype, device=student.device)
    _stats_kernel[(n, S)](s, t, parts, V, s.stride(0), t.stride(0), span, S, BLOCK=block, num_warps=num_warps)
    scale = grad_scale.contiguous() if grad_scale is not None else s  # (not read without the gradient)
    _kl_kernel[(n, S)](s, t, scale, parts, kl, V, s.stride(0), t.stride(0),
                       span, S, GRAD=grad_scale is not None, BLOCK=block,
                       BLOCK_S=triton.next_power_of_2(S), num_warps=num_warps)
    return kl.sum(-1)


def softmax_kl(student: torch.Tensor, teacher: torch.Tensor, grad_scale: torch.Tensor | None = None) -> torch.Tensor:
    """KL(softmax(teacher_i) || softmax(student_i)) per row; student, teacher: [n, V] logits (the same dtype,
    float32 or float64) -> [n] in that dtype. With ``grad_scale`` ([n]), the student logits are overwritten by
    grad_scale_i * (softmax(student_i) - softmax(teacher_i)), the gradient of sum_i grad_scale_i * KL_i with
    respect to them (they are consumed: what the KD loss's last GEMM reads). A teacher probability of 0
    contributes 0; NaN, +inf and rows of -inf only give NaN (see the reference). Not differentiable by
    autograd (it gives its own gradient)."""
    if select_backend(student.device, student, teacher) == "triton":
        return softmax_kl_triton(student, teacher, grad_scale)
    _check_args(student, teacher, grad_scale)
    return softmax_kl_reference(student, teacher, grad_scale)
