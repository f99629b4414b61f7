"""The FLOPS regulariser of sparse representations (Paria et al. 2020, as SPLADE uses it;
neural-retrieval-lecture "FLOPS Sparsity Loss").

For a batch of N non-negative term-weight vectors w_1..w_N over a vocabulary V,

    FLOPS(w) = sum_{j in V} ( (1/N) sum_i w_ij )^2

the squared mean activation of each term, summed: a smooth stand-in for the expected number of
multiplications of a sparse dot product, sum_j P(w_qj != 0) P(w_dj != 0), which penalises terms that are
active in many texts (an L1 penalty would not care whether the non-zeros are spread or shared). SPLADE adds
lambda_q FLOPS(queries) + lambda_d FLOPS(passages) to the ranking loss, each lambda grown quadratically
over the first steps (``quadratic_warmup``) so that the ranking loss shapes the vectors first.

>>> w = torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, 0.0]])
>>> flops(w)  # means (2, 0, 1) -> 4 + 0 + 1
tensor(5.)
>>> quadratic_warmup(1e-3, step=50, warmup_steps=100)
0.00025
"""

from __future__ import annotations

import torch


def flops(weights: torch.Tensor) -> torch.Tensor:
    """sum_j (mean_i weights_ij)^2 of a [N, V] batch (float32)."""
    return weights.float().mean(dim=0).pow(2).sum()


def quadratic_warmup(value: float, step: int, warmup_steps: int) -> float:
    """``value`` * min(1, (step / warmup_steps)^2): the regulariser weight at ``step`` (0-based)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return value
    return value * (step / warmup_steps) ** 2
