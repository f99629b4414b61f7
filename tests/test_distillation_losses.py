"""Reranker and distillation losses: listwise (LCE) against a literal reference, pointwise BCE, and
Margin-MSE and KL against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from densepass.errors import ConfigError
from densepass.losses import listwise_kl_loss, localized_contrastive_loss, margin_mse_loss, pointwise_bce_loss


def literal_listwise(groups: list[list[float]]) -> float:
    """-log softmax of column 0, averaged over the groups, one exp at a time."""
    total = 0.0
    for row in groups:
        total += -math.log(math.exp(row[0]) / sum(math.exp(x) for x in row))
    return total / len(groups)


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 5).flatmap(
        lambda n: st.lists(
            st.lists(st.floats(-8, 8, allow_nan=False), min_size=n + 1, max_size=n + 1), min_size=1, max_size=6
        )
    )
)
def test_the_listwise_loss_equals_a_literal_softmax_cross_entropy(groups):
    got = float(localized_contrastive_loss(torch.tensor(groups, dtype=torch.float64)))
    assert got == pytest.approx(literal_listwise(groups), rel=1e-5, abs=1e-6)


def test_the_pointwise_loss_is_binary_cross_entropy_with_the_positive_first():
    # sigma(1) = 0.7311, sigma(-1) = 0.2689: -(log 0.7311 + log(1 - 0.2689) + log(1 - 0.7311)) / 3
    logits = torch.tensor([[1.0, -1.0, 1.0]])
    expected = -(math.log(1 / (1 + math.exp(-1))) * 2 + math.log(1 - 1 / (1 + math.exp(-1)))) / 3
    assert float(pointwise_bce_loss(logits)) == pytest.approx(expected, rel=1e-6)


def test_margin_mse_matches_hand_computed_values():
    student = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.4, 0.0]])
    teacher = torch.tensor([[8.0, 2.0, 7.0], [3.0, 1.0, 3.0]])
    # student margins: 0.8, 0.4 | -0.2, 0.2; teacher margins: 6, 1 | 2, 0
    expected = ((0.8 - 6) ** 2 + (0.4 - 1) ** 2 + (-0.2 - 2) ** 2 + (0.2 - 0) ** 2) / 4
    assert float(margin_mse_loss(student, teacher)) == pytest.approx(expected, rel=1e-6)


def test_margin_mse_leaves_out_unscored_candidates():
    student = torch.tensor([[0.9, 0.1, 0.5]])
    teacher = torch.tensor([[8.0, float("nan"), 7.0]])
    assert float(margin_mse_loss(student, teacher)) == pytest.approx((0.4 - 1) ** 2, rel=1e-6)
    assert float(margin_mse_loss(student, torch.full_like(teacher, float("nan")))) == 0.0


def test_kl_matches_hand_computed_values_with_a_temperature():
    student = torch.tensor([[2.0, 0.0, 0.0]])
    teacher = torch.tensor([[4.0, 2.0, 0.0]])
    t = 2.0
    p = [math.exp(x / t) for x in (4.0, 2.0, 0.0)]
    p = [x / sum(p) for x in p]
    q = [math.exp(x / t) for x in (2.0, 0.0, 0.0)]
    q = [x / sum(q) for x in q]
    expected = t**2 * sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    assert float(listwise_kl_loss(student, teacher, t)) == pytest.approx(expected, rel=1e-6)


def test_kl_is_zero_when_the_student_agrees_and_leaves_out_unscored_candidates():
    scores = torch.tensor([[3.0, 1.0, -2.0]])
    assert float(listwise_kl_loss(scores, scores.clone())) == pytest.approx(0.0, abs=1e-7)
    student = torch.tensor([[3.0, 50.0, -2.0]], requires_grad=True)
    teacher = torch.tensor([[3.0, float("nan"), -2.0]])
    loss = listwise_kl_loss(student, teacher)
    loss.backward()
    loss = loss.detach()
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert torch.isfinite(student.grad).all() and student.grad[0, 1] == 0


def test_bad_shapes_and_temperatures_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"\[B, 1 \+ n\]"):
        margin_mse_loss(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ConfigError, match="temperature must be > 0"):
        listwise_kl_loss(torch.zeros(1, 2), torch.zeros(1, 2), 0.0)
    with pytest.raises(ConfigError, match="n >= 1"):
        localized_contrastive_loss(torch.zeros(3, 1))
