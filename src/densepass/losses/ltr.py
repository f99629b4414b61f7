"""The learning-to-rank (LTR) loss of abs-condenser-openqa eq. 14.

A query q and a passage d are scored by a learned linear head over their concatenated representations,
squashed by a sigmoid, and the positive's score is contrasted with its negatives' in a softmax:

    L_LTR = -log exp(σ(W{q, d+} + b)) / (exp(σ(W{q, d+} + b)) + sum_i exp(σ(W{q, d_i-} + b)))

The paper found it far worse than the contrastive loss (eq. 13; dev MRR@10 0.67 against 0.95). Two
properties of the literal form explain much of that and are worth knowing before using it: the scores lie
in (0, 1), so the softmax can never be confident (at best e / (e + n) for n negatives); and since
W{q, d} = W_q q + W_d d, and σ is monotone, every query ranks passages in the same order (by W_d d):
the head cannot rank query-dependently, and the query encoder is trained only through where the
sigmoid's slope sits. Retrieval with the encoders (dot products) is what a full-corpus search can use.

>>> import torch
>>> weight, bias = torch.tensor([[1.0, 0.0, 0.0, 1.0]]), torch.tensor([0.0])
>>> scores = ltr_scores(torch.eye(2), torch.eye(2), weight, bias)
>>> [[round(float(s), 4) for s in row] for row in scores]
[[0.7311, 0.8808], [0.5, 0.7311]]
>>> round(float(ltr_loss(torch.eye(2), torch.eye(2), torch.tensor([0, 1]), weight, bias)), 4)
0.6775
"""

from __future__ import annotations

import torch

from densepass.errors import ConfigError
from densepass.losses.contrastive import info_nce


def ltr_scores(queries: torch.Tensor, passages: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """σ(W{q, d} + b) for every (query, passage) pair: [B, P] from queries [B, d], passages [P, d], the
    head's ``weight`` [1, 2d] (the query half first) and ``bias`` [1]; computed without materialising the
    B x P concatenations (W{q, d} = W_q q + W_d d)."""
    dim = queries.shape[1]
    if passages.shape[1] != dim or weight.shape != (1, 2 * dim) or bias.shape != (1,):
        raise ConfigError(
            f"the LTR head [1, {2 * dim}] + [1] does not fit queries {list(queries.shape)} and passages "
            f"{list(passages.shape)} (head {list(weight.shape)} + {list(bias.shape)})"
        )
    w_query, w_passage = weight[0, :dim], weight[0, dim:]
    logits = (queries.float() @ w_query).unsqueeze(1) + (passages.float() @ w_passage).unsqueeze(0) + bias
    return torch.sigmoid(logits)


def ltr_loss(
    queries: torch.Tensor,
    passages: torch.Tensor,
    positive_index: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean eq. 14 loss: each query's positive column against every unmasked other column."""
    return info_nce(ltr_scores(queries, passages, weight, bias), positive_index, mask)
