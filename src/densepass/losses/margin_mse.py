"""Margin-MSE distillation (neural-retrieval-lecture, "Distillation via Margin-MSE"; Hofstätter et al.,
"Improving Efficient Neural Ranking Models with Cross-Architecture Knowledge Distillation", 2020).

The student (a bi-encoder) does not have to reproduce the teacher's (a cross-encoder's) scores, only
their margins: for query q with positive p+ and negative p-,

    L(q, p+, p-) = ( (M_S(q, p+) - M_S(q, p-)) - (M_T(q, p+) - M_T(q, p-)) )^2,

averaged over every (query, negative) pair. Scores come as rows ``[B, 1 + n]``: column 0 the positive,
columns 1..n the query's negatives. A NaN teacher score (a candidate the teacher did not score) drops
that pair; a batch with no pair left has loss 0.

>>> import torch
>>> student = torch.tensor([[3.0, 1.0, 2.0]])
>>> teacher = torch.tensor([[5.0, 1.0, 4.0]])
>>> float(margin_mse_loss(student, teacher))  # ((2 - 4)^2 + (1 - 1)^2) / 2
2.0
"""

from __future__ import annotations

import torch

from densepass.errors import ConfigError


def check_pair(student: torch.Tensor, teacher: torch.Tensor) -> None:
    """A one-line ConfigError unless student and teacher scores are both ``[B, 1 + n]`` with n >= 1."""
    if student.shape != teacher.shape or student.dim() != 2 or student.shape[1] < 2:
        raise ConfigError(
            f"student and teacher scores must both be [B, 1 + n] with n >= 1, got "
            f"{list(student.shape)} and {list(teacher.shape)}"
        )


def margin_mse_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean squared difference of student and teacher margins (positive minus each negative)."""
    check_pair(student, teacher)
    student, teacher = student.float(), teacher.float().to(student.device)
    student_margin = student[:, :1] - student[:, 1:]
    teacher_margin = teacher[:, :1] - teacher[:, 1:]
    known = torch.isfinite(teacher_margin)
    if not bool(known.any()):
        return student.sum() * 0.0
    return ((student_margin - teacher_margin.nan_to_num())[known] ** 2).mean()
