"""Contrastive loss over in-batch and hard negatives, with false negatives masked out.

Forward term (negative-contrast eq. 1; Condenser eq. 12; DPR): for query i with positive column
``pos[i]`` among all passages P of the batch (every query's positive, then every query's hard
negatives, all shared across the batch),

    L_qp(i) = -log exp(s_i,pos[i] / t) / sum_{j in P, not masked(i, j)} exp(s_ij / t)

Backward term (negative-contrast eq. 2): each positive passage ranks its own query above the other
queries of the batch. Hard negatives are only used in the forward direction (their footnote 3).
The loss is L_qp, or (L_qp + L_pq) / 2 with ``bidirectional`` (eq. 3).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def info_nce(
    scores: torch.Tensor, positive_index: torch.Tensor, mask: torch.Tensor | None = None, bidirectional: bool = False
) -> torch.Tensor:
    """Mean InfoNCE loss of a score matrix [B, P] (similarities already divided by the temperature).

    ``positive_index`` [B] gives each query's positive column; ``mask`` [B, P] is True where a
    passage must not count as a negative of the query (a false negative or a duplicate). The
    positive itself is never masked.
    """
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    loss = F.cross_entropy(scores, positive_index)
    if not bidirectional:
        return loss
    return (loss + passage_to_query_loss(scores, positive_index)) / 2


def passage_to_query_loss(masked_scores: torch.Tensor, positive_index: torch.Tensor) -> torch.Tensor:
    """The backward term (negative-contrast eq. 2) of masked scores [B, P]: each query's positive passage
    ranks its own query above the batch's other queries."""
    backward_scores = masked_scores[:, positive_index].T  # rows: the positive passages, columns: the queries
    target = torch.arange(len(positive_index), device=masked_scores.device)
    return F.cross_entropy(backward_scores, target)


def contrastive_loss(
    queries: torch.Tensor,
    passages: torch.Tensor,
    positive_index: torch.Tensor,
    temperature: float,
    mask: torch.Tensor | None = None,
    bidirectional: bool = False,
) -> torch.Tensor:
    """``info_nce`` of ``queries`` [B, d] against ``passages`` [P, d] by dot product over ``temperature``."""
    return info_nce(queries.float() @ passages.float().T / temperature, positive_index, mask, bidirectional)


def false_negative_mask(
    positive_keys: Sequence[int],
    passage_keys: Sequence[int],
    relevant_keys: Sequence[set[int]],
    positive_index: Sequence[int],
) -> torch.Tensor:
    """Mask [B, P] of passages that must not be negatives.

    ``passage_keys[j]`` identifies passage column j (equal keys = the same passage or the same
    content); ``relevant_keys[i]`` holds every passage key judged relevant to query i (qrels).
    Column j is masked for query i when j is not i's positive column and either
    (a) its key equals i's positive key or is relevant to query i (a false negative), or
    (b) the same key already occurred in an earlier column (a duplicate would count twice).
    """
    n_queries, n_passages = len(positive_index), len(passage_keys)
    mask = torch.zeros(n_queries, n_passages, dtype=torch.bool)
    first_seen: dict[int, int] = {}
    duplicate_cols = []
    for j, key in enumerate(passage_keys):
        if key in first_seen:
            duplicate_cols.append(j)
        else:
            first_seen[key] = j
    if duplicate_cols:
        mask[:, duplicate_cols] = True
    columns_of: dict[int, list[int]] = {}
    for j, key in enumerate(passage_keys):
        columns_of.setdefault(key, []).append(j)
    for i in range(n_queries):
        for key in relevant_keys[i] | {positive_keys[i]}:
            for j in columns_of.get(key, ()):
                mask[i, j] = True
        mask[i, positive_index[i]] = False
    return mask
