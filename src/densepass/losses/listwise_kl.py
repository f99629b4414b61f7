"""Listwise (KL) distillation: the student's softmax over a query's 1 + n candidates matches the
teacher's (Hinton, Vinyals and Dean, "Distilling the Knowledge in a Neural Network", 2015; the
cross-encoder-to-dual-encoder distillation of training-inference-gap §2 and of RocketQAv2).

With temperature T, teacher distribution P_T = softmax(t / T) and student distribution
P_S = softmax(s / T) over the candidates of each query (column 0 its positive, 1..n its negatives),

    L = T^2 * 1/B sum_i KL(P_T(i) || P_S(i)) = T^2 * 1/B sum_i sum_j P_T(i, j) (log P_T(i, j) - log P_S(i, j)),

the T^2 keeping the gradient's scale independent of T (as sentence-transformers' ``DistillKLDivLoss``).
A candidate whose teacher score is NaN (not scored) is left out of both softmaxes; a row with fewer
than two scored candidates contributes nothing.

>>> import torch
>>> round(float(listwise_kl_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, -1.0]]))), 4)
0.3278
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from densepass.errors import ConfigError
from densepass.losses.margin_mse import check_pair


def listwise_kl_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over queries of T^2 KL(softmax(teacher / T) || softmax(student / T)), rows ``[B, 1 + n]``."""
    check_pair(student, teacher)
    if not temperature > 0:
        raise ConfigError(f"the distillation temperature must be > 0, got {temperature}")
    student, teacher = student.float(), teacher.float().to(student.device)
    known = torch.isfinite(teacher)
    rows = known.sum(1) >= 2
    if not bool(rows.any()):
        return student.sum() * 0.0
    student, teacher, known = student[rows], teacher[rows], known[rows]
    log_student = F.log_softmax((student / temperature).masked_fill(~known, float("-inf")), dim=1)
    log_teacher = F.log_softmax((teacher.nan_to_num() / temperature).masked_fill(~known, float("-inf")), dim=1)
    gap = torch.where(known, log_teacher - log_student, 0.0)  # 0 where a candidate is left out, not NaN
    return temperature**2 * (log_teacher.exp() * gap).sum(1).mean()
