"""Reference KL divergence between the softmaxes of two logit rows, and its gradient over the student's logits."""

from __future__ import annotations

import torch


def softmax_kl(student: torch.Tensor, teacher: torch.Tensor, grad_scale: torch.Tensor | None = None) -> torch.Tensor:
    """KL(softmax(teacher_i) || softmax(student_i)) per row; student, teacher: [n, V] (same float dtype) -> [n].

    With ``grad_scale`` ([n]) the student logits are overwritten by the gradient of sum_i grad_scale_i * KL_i
    with respect to them, grad_scale_i * (softmax(student_i) - softmax(teacher_i)). A teacher probability of 0
    contributes 0 (x log x -> 0); a NaN logit makes its row's results NaN, as do +inf logits and rows of -inf only
    (log_softmax's)."""
    log_q = student.log_softmax(-1)
    log_p = teacher.log_softmax(-1)
    p = log_p.exp()
    kl = log_p.sub_(log_q).mul_(p).masked_fill_(p == 0, 0.0).sum(-1)  # in place: no [n, V] temporary but the mask
    if grad_scale is not None:
        torch.mul(log_q.exp_().sub_(p), grad_scale.to(student.dtype)[:, None], out=student)
    return kl
