"""Negatives from several sources in one loss: the unified λ-weighted softmax (training-inference-gap
eq. 2) and the original separate terms (eq. 1).

A batch's candidates are columns of a score matrix ``scores`` [B, P] (already divided by the
temperature). Each column comes from a *source* -- in-batch positives of other queries, pre-batch or
queue entries, hard negatives, or (for phrases) the other tokens of the gold passage -- given by
``sources`` [P], and each query's positive column by ``positive_index`` [B]. ``mask`` [B, P] removes
false negatives. Where a column's source depends on the row -- a phrase's token is an in-passage
negative for the questions on its passage and an in-batch one for the others (training-inference-gap
§4.2) -- ``sources`` is [B, P]. With λ_s the weight of source s, eq. 2 is

    L_i = -log e^{s_i+} / (e^{s_i+} + sum_{j negative for i} λ_{source(j)} e^{s_ij})

(multiplying by λ adds log λ to the logit: a soft margin, or λ copies of each negative, the paper's
reading), and eq. 1 sums one such softmax per *term*, each term over its own sources, weighted:

    L_i = sum_t w_t * -log e^{s_i+} / (e^{s_i+} + sum_{j in term t} e^{s_ij}).

With every λ = 1, ``unified_loss`` is ``contrastive_loss`` (InfoNCE over all columns).

>>> import torch
>>> scores = torch.tensor([[2.0, 0.5, 0.1], [0.3, 1.5, 0.2]])
>>> sources = torch.tensor([0, 0, 1])  # two in-batch positives, one hard negative
>>> round(float(unified_loss(scores, torch.tensor([0, 1]), sources, weights=[1.0, 1.0])), 4)
0.3851
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from densepass.errors import ConfigError


def _check(scores: torch.Tensor, positive_index: torch.Tensor, sources: torch.Tensor, n_sources: int) -> None:
    if (
        scores.dim() != 2
        or positive_index.shape != (scores.shape[0],)
        or sources.shape not in ((scores.shape[1],), scores.shape)
    ):
        raise ConfigError(
            f"scores [B, P], positive_index [B] and sources [P] or [B, P] do not fit: {list(scores.shape)}, "
            f"{list(positive_index.shape)}, {list(sources.shape)}"
        )
    if sources.numel() and (int(sources.min()) < 0 or int(sources.max()) >= n_sources):
        raise ConfigError(f"a column's source is outside 0..{n_sources - 1}")


def _negatives_only(
    scores: torch.Tensor, positive_index: torch.Tensor, mask: torch.Tensor | None, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Scores with every column that is not a negative of its row (masked, outside ``keep``) at -inf,
    the positive column kept."""
    rows = torch.arange(scores.shape[0], device=scores.device)
    drop = torch.zeros_like(scores, dtype=torch.bool) if mask is None else mask.clone()
    if keep is not None:
        drop |= ~keep
    drop[rows, positive_index] = False
    return scores.masked_fill(drop, float("-inf"))


def unified_loss(
    scores: torch.Tensor,
    positive_index: torch.Tensor,
    sources: torch.Tensor,
    weights: Sequence[float],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean eq. 2 loss: one softmax over every negative, source s weighted by ``weights[s]`` (λ > 0)."""
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ConfigError(f"every λ must be a positive number, got {list(weights)}")
    _check(scores, positive_index, sources, len(weights))
    log_weights = torch.log(torch.as_tensor(weights, dtype=scores.dtype, device=scores.device))
    bias = log_weights[sources].expand_as(scores).clone()
    bias[torch.arange(scores.shape[0], device=scores.device), positive_index] = 0.0  # the positive is not weighted
    return F.cross_entropy(_negatives_only(scores, positive_index, mask) + bias, positive_index)


def separate_terms_loss(
    scores: torch.Tensor,
    positive_index: torch.Tensor,
    sources: torch.Tensor,
    terms: Sequence[Sequence[int]],
    weights: Sequence[float],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean eq. 1 loss: ``sum_t weights[t]`` times a softmax of the positive against the sources in ``terms[t]``.

    A term with no negative left for a row contributes log 1 = 0 there."""
    if len(terms) != len(weights) or not terms:
        raise ConfigError(f"{len(terms)} terms but {len(weights)} weights")
    if any(not (w >= 0 and math.isfinite(w)) for w in weights):
        raise ConfigError(f"term weights must be >= 0, got {list(weights)}")
    n_sources = 1 + max([s for term in terms for s in term] + [int(sources.max()) if sources.numel() else 0])
    _check(scores, positive_index, sources, n_sources)
    total = scores.new_zeros(())
    for term, weight in zip(terms, weights):
        in_term = torch.isin(sources, torch.as_tensor(list(term), device=sources.device))
        keep = in_term.expand_as(scores)
        total = total + weight * F.cross_entropy(_negatives_only(scores, positive_index, mask, keep), positive_index)
    return total
