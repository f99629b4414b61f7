"""Cross-encoder training losses over groups of one positive and n hard negatives.

A group is a row of logits ``[1 + n]``: the cross-encoder's score of the query with its positive
(column 0), then with n hard negatives drawn from its pool. Two ways to train on it:

- **listwise** (localized contrastive estimation, LCE: Gao, Dai and Callan, "Rethink Training of BERT
  Rerankers in Multi-Stage Retrieval Pipeline", 2021): a softmax over the group, the positive the target,

      L = -1/B sum_i log( exp(s_i0) / sum_{j=0..n} exp(s_ij) );

- **pointwise** (neural-retrieval-lecture, "Cross-Encoder: Binary Cross-Entropy, each passage classified
  independently"): binary cross-entropy of every pair, label 1 for the positive and 0 for each negative,

      L = -1/(B(1+n)) sum_i [ log sigma(s_i0) + sum_{j>=1} log(1 - sigma(s_ij)) ].

>>> import torch
>>> round(float(localized_contrastive_loss(torch.tensor([[2.0, 0.0, 0.0]]))), 4)
0.2395
>>> round(float(pointwise_bce_loss(torch.tensor([[2.0, 0.0]]))), 4)
0.41
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from densepass.errors import ConfigError


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[1] < 2:
        raise ConfigError(f"group logits must be [B, 1 + n] with n >= 1, got {list(logits.shape)}")


def localized_contrastive_loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean softmax cross-entropy of each group ``[B, 1 + n]`` with its positive in column 0 (LCE)."""
    _check(logits)
    return F.cross_entropy(logits.float(), torch.zeros(len(logits), dtype=torch.long, device=logits.device))


def pointwise_bce_loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of every pair of the groups ``[B, 1 + n]``: column 0 relevant, the rest not."""
    _check(logits)
    labels = torch.zeros_like(logits, dtype=torch.float32)
    labels[:, 0] = 1.0
    return F.binary_cross_entropy_with_logits(logits.float(), labels)
