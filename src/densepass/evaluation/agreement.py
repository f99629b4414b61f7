"""How far one reranker's scores are from another's on the same candidate lists (neural-retrieval-lecture:
a cheaper scorer, here an int8 cross-encoder, is judged by whether it keeps the expensive one's order).

``score_agreement`` compares two score vectors of the same pairs, ``per_query`` candidates per query in
order: absolute differences (with the reference's spread, to read them against), Spearman's rank correlation
over all pairs and its mean over queries, and the share of queries whose top-k candidates keep their order,
and whose first candidate stays first.

>>> int8, fp32 = [3.0, 2.0, 1.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 1.0, 3.0, 2.0]  # 2 queries x 3 candidates
>>> agreement = score_agreement(int8, fp32, per_query=3, top=2)
>>> round(agreement["mean_query_spearman"], 2), agreement["top2_order_unchanged"], agreement["top1_unchanged"]
(0.75, 0.5, 0.5)
"""

from __future__ import annotations

import numpy as np
from scipy.stats import spearmanr

from densepass.errors import DataError


def score_agreement(scores: np.ndarray, reference: np.ndarray, per_query: int, top: int = 10) -> dict[str, float]:
    """Agreement of ``scores`` with ``reference`` (module docstring); both hold ``per_query`` scores per query,
    query after query. Ties rank in candidate order; a bad shape is a one-line DataError."""
    scores, reference = np.asarray(scores, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    if scores.shape != reference.shape or scores.ndim != 1 or per_query < 2 or len(scores) % per_query:
        raise DataError(
            f"score_agreement needs two score vectors of the same length, a multiple of per_query >= 2; got "
            f"{scores.shape} and {reference.shape}, per_query {per_query}"
        )
    a, b = scores.reshape(-1, per_query), reference.reshape(-1, per_query)
    top = min(top, per_query)
    order_a = np.argsort(-a, axis=1, kind="stable")[:, :top]
    order_b = np.argsort(-b, axis=1, kind="stable")[:, :top]
    per_query_spearman = [spearmanr(x, y).statistic for x, y in zip(a, b)]  # nan where a query's scores tie
    return {
        "mean_abs_difference": float(np.mean(np.abs(scores - reference))),
        "max_abs_difference": float(np.max(np.abs(scores - reference))),
        "reference_std": float(np.std(reference)),
        "spearman": float(spearmanr(scores, reference).statistic),
        "mean_query_spearman": float(np.nanmean(per_query_spearman)),
        f"top{top}_order_unchanged": float(np.mean(np.all(order_a == order_b, axis=1))),
        "top1_unchanged": float(np.mean(order_a[:, 0] == order_b[:, 0])),
    }
