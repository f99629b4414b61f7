"""The unified λ-weighted loss (training-inference-gap eq. 2) and the separate terms (eq. 1) against
literal implementations of the equations on random inputs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from densepass.errors import ConfigError
from densepass.losses.contrastive import contrastive_loss
from densepass.losses.unified import separate_terms_loss, unified_loss


def literal_eq2(scores, positive, sources, weights, mask):
    """Eq. 2 written out: per row, e^pos over e^pos + sum of λ(source) e^neg over the unmasked negatives."""
    total = 0.0
    for i, row in enumerate(scores.tolist()):
        pos = row[positive[i]]
        denominator = math.exp(pos)
        for j, value in enumerate(row):
            if j != positive[i] and not mask[i][j]:
                denominator += weights[sources[j]] * math.exp(value)
        total += -(pos - math.log(denominator))
    return total / len(scores)


def literal_eq1(scores, positive, sources, terms, weights, mask):
    """Eq. 1 written out: a weighted sum of one softmax per term, each over its own sources."""
    total = 0.0
    for i, row in enumerate(scores.tolist()):
        pos = row[positive[i]]
        for term, weight in zip(terms, weights):
            denominator = math.exp(pos) + sum(
                math.exp(v) for j, v in enumerate(row) if j != positive[i] and not mask[i][j] and sources[j] in term
            )
            total += weight * -(pos - math.log(denominator))
    return total / len(scores)


@st.composite
def batches(draw):
    b = draw(st.integers(1, 5))
    p = draw(st.integers(b, b + 6))
    n_sources = draw(st.integers(1, 4))
    scores = torch.tensor(draw(st.lists(st.lists(st.floats(-5, 5), min_size=p, max_size=p), min_size=b, max_size=b)))
    positive = torch.tensor([draw(st.integers(0, p - 1)) for _ in range(b)])
    sources = torch.tensor([draw(st.integers(0, n_sources - 1)) for _ in range(p)])
    mask = torch.tensor([[draw(st.booleans()) for _ in range(p)] for _ in range(b)])
    weights = [draw(st.floats(0.01, 300)) for _ in range(n_sources)]
    return scores.double(), positive, sources, mask, weights


@settings(max_examples=80, deadline=None)
@given(batches())
def test_unified_loss_is_eq2(case):
    scores, positive, sources, mask, weights = case
    got = unified_loss(scores, positive, sources, weights, mask)
    want = literal_eq2(scores, positive.tolist(), sources.tolist(), weights, mask.tolist())
    assert float(got) == pytest.approx(want, rel=1e-9, abs=1e-9)


@settings(max_examples=80, deadline=None)
@given(batches(), st.data())
def test_separate_terms_loss_is_eq1(case, data):
    scores, positive, sources, mask, _ = case
    n_sources = int(sources.max()) + 1
    terms = [sorted(set(data.draw(st.lists(st.integers(0, n_sources - 1), min_size=1, max_size=3)))) for _ in range(2)]
    weights = [data.draw(st.floats(0, 300)) for _ in terms]
    got = separate_terms_loss(scores, positive, sources, terms, weights, mask)
    want = literal_eq1(scores, positive.tolist(), sources.tolist(), terms, weights, mask.tolist())
    assert float(got) == pytest.approx(want, rel=1e-9, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(batches())
def test_with_every_lambda_one_it_is_the_contrastive_loss(case):
    scores, positive, sources, mask, weights = case
    ones = [1.0] * len(weights)
    queries = scores  # contrastive_loss takes embeddings: with an identity "passage" matrix the scores are the inputs
    identity = torch.eye(scores.shape[1], dtype=scores.dtype)
    masked = mask.clone()
    masked[torch.arange(len(positive)), positive] = False
    expected = contrastive_loss(queries, identity, positive, temperature=1.0, mask=masked)
    assert float(unified_loss(scores, positive, sources, ones, mask)) == pytest.approx(
        float(expected), rel=1e-5, abs=1e-6
    )  # contrastive_loss computes in float32: near-zero losses need an absolute tolerance


def test_lambda_is_log_lambda_added_to_the_negatives_logits():
    scores = torch.tensor([[1.0, 0.2, -0.3]], dtype=torch.double)
    sources = torch.tensor([0, 0, 1])
    weighted = unified_loss(scores, torch.tensor([0]), sources, [1.0, 256.0])
    shifted = scores.clone()
    shifted[0, 2] += math.log(256.0)
    assert float(weighted) == pytest.approx(float(unified_loss(shifted, torch.tensor([0]), sources, [1.0, 1.0])))


def test_bad_weights_and_shapes_are_one_line_errors():
    scores, positive, sources = torch.zeros(2, 3), torch.tensor([0, 1]), torch.tensor([0, 0, 1])
    with pytest.raises(ConfigError, match="positive number"):
        unified_loss(scores, positive, sources, [1.0, 0.0])
    with pytest.raises(ConfigError, match="outside 0..0"):
        unified_loss(scores, positive, sources, [1.0])
    with pytest.raises(ConfigError, match="do not fit"):
        unified_loss(scores, positive, torch.tensor([0, 0]), [1.0])
    with pytest.raises(ConfigError, match="2 terms but 1 weights"):
        separate_terms_loss(scores, positive, sources, [[0], [1]], [1.0])


@st.composite
def per_row_batches(draw):
    scores, positive, _, mask, weights = draw(batches())
    rows = [[draw(st.integers(0, len(weights) - 1)) for _ in range(scores.shape[1])] for _ in range(scores.shape[0])]
    return scores, positive, torch.tensor(rows), mask, weights


@settings(max_examples=60, deadline=None)
@given(per_row_batches(), st.data())
def test_a_source_per_row_and_column_is_eq2_and_eq1_with_that_rows_sources(case, data):
    scores, positive, sources, mask, weights = case
    want2 = [
        literal_eq2(scores[i : i + 1], positive[i : i + 1].tolist(), s, weights, mask[i : i + 1].tolist())
        for i, s in enumerate(sources.tolist())
    ]
    got2 = unified_loss(scores, positive, sources, weights, mask)
    assert float(got2) == pytest.approx(sum(want2) / len(want2), rel=1e-9, abs=1e-9)
    terms = [sorted(set(data.draw(st.lists(st.integers(0, len(weights) - 1), min_size=1, max_size=3)))) for _ in "ab"]
    term_weights = [data.draw(st.floats(0, 300)) for _ in terms]
    want1 = [
        literal_eq1(scores[i : i + 1], positive[i : i + 1].tolist(), s, terms, term_weights, mask[i : i + 1].tolist())
        for i, s in enumerate(sources.tolist())
    ]
    got1 = separate_terms_loss(scores, positive, sources, terms, term_weights, mask)
    assert float(got1) == pytest.approx(sum(want1) / len(want1), rel=1e-9, abs=1e-9)
