"""The contrastive loss and the false-negative mask against slow, obviously correct references."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from densepass.losses.contrastive import contrastive_loss, false_negative_mask


def naive_loss(q, p, pos, t, mask, bidirectional):
    """Loops over queries and passages, straight from negative-contrast eq. 1-3."""
    q, p = q.double().tolist(), p.double().tolist()
    dot = lambda a, b: sum(x * y for x, y in zip(a, b)) / t  # noqa: E731
    forward = []
    for i in range(len(q)):
        denom = sum(math.exp(dot(q[i], p[j])) for j in range(len(p)) if not mask[i][j])
        forward.append(-(dot(q[i], p[pos[i]]) - math.log(denom)))
    loss = sum(forward) / len(forward)
    if not bidirectional:
        return loss
    backward = []
    for i in range(len(q)):  # positive passage of query i ranks query i over other queries
        denom = sum(math.exp(dot(q[k], p[pos[i]])) for k in range(len(q)) if not mask[k][pos[i]])
        backward.append(-(dot(q[i], p[pos[i]]) - math.log(denom)))
    return (loss + sum(backward) / len(backward)) / 2


def naive_mask(positive_keys, passage_keys, relevant, pos):
    mask = []
    for i in range(len(pos)):
        row = []
        for j, key in enumerate(passage_keys):
            duplicate = key in passage_keys[:j]
            false_negative = key == positive_keys[i] or key in relevant[i]
            row.append(j != pos[i] and (duplicate or false_negative))
        mask.append(row)
    return mask


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 6),
    h=st.integers(0, 2),
    dim=st.integers(1, 8),
    seed=st.integers(0, 10_000),
    bidirectional=st.booleans(),
    n_keys=st.integers(2, 12),
)
def test_loss_and_mask_match_reference(b, h, dim, seed, bidirectional, n_keys):
    rng = np.random.default_rng(seed)
    q = torch.tensor(rng.normal(size=(b, dim)), dtype=torch.float32)
    p = torch.tensor(rng.normal(size=(b * (1 + h), dim)), dtype=torch.float32)
    keys = [int(k) for k in rng.integers(0, n_keys, size=b * (1 + h))]  # collisions = duplicates
    relevant = [set(int(k) for k in rng.integers(0, n_keys, size=rng.integers(0, 3))) for _ in range(b)]
    pos = list(range(b))
    mask = false_negative_mask(keys[:b], keys, relevant, pos)
    expected_mask = naive_mask(keys[:b], keys, relevant, pos)
    assert mask.tolist() == expected_mask
    got = contrastive_loss(q, p, torch.tensor(pos), 0.1, mask=mask, bidirectional=bidirectional).item()
    assert math.isclose(got, naive_loss(q, p, pos, 0.1, expected_mask, bidirectional), rel_tol=1e-4, abs_tol=1e-5)


def test_masked_false_negative_does_not_change_loss():
    """A passage relevant to the query contributes nothing: the loss equals the loss without it."""
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1]])  # column 2 is relevant to query 0
    mask = false_negative_mask([10, 11], [10, 11, 12], [{12}, set()], [0, 1])
    assert mask.tolist() == [[False, False, True], [False, False, False]]
    masked = contrastive_loss(q[:1], p, torch.tensor([0]), 1.0, mask=mask[:1])
    without = contrastive_loss(q[:1], p[:2], torch.tensor([0]), 1.0)
    assert torch.allclose(masked, without)


def test_duplicate_positive_is_not_a_negative():
    """Two queries sharing a positive passage never push each other's positive away."""
    mask = false_negative_mask([7, 7], [7, 7], [set(), set()], [0, 1])
    assert mask.tolist() == [[False, True], [True, False]]


def test_hard_negatives_only_forward_in_bidirectional_loss():
    """Hard-negative columns change L_qp but not L_pq (negative-contrast footnote 3)."""
    torch.manual_seed(0)
    q, p = torch.randn(3, 4), torch.randn(3, 4)
    extra = torch.randn(2, 4)
    pos = torch.arange(3)
    both = contrastive_loss(q, torch.cat([p, extra]), pos, 0.5, bidirectional=True)
    forward = contrastive_loss(q, torch.cat([p, extra]), pos, 0.5)
    backward = 2 * contrastive_loss(q, p, pos, 0.5, bidirectional=True) - contrastive_loss(q, p, pos, 0.5)
    assert torch.allclose(both, (forward + backward) / 2, atol=1e-6)
