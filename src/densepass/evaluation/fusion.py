"""Ensembles of retrievers (negative-contrast §4.4).

Embedding fusion: each model's query and passage embeddings are scaled and concatenated. Scaling
both sides of model i by sqrt(w_i) makes the fused dot product the weighted sum of the per-model dot
products, <[sqrt(w_i) q_i]_i, [sqrt(w_i) p_i]_i> = sum_i w_i <q_i, p_i>, so one search over the fused
index ranks by the weighted score. Weights are tuned on dev by a coordinate-wise grid search.

Rank fusion: reciprocal rank fusion (rrf), score(d) = sum_runs 1 / (k + rank(d)),
through ``ranx.fuse(method="rrf")``; or linear fusion, sum_runs w_run * minmax_run(score(d)), through
``ranx.fuse(method="wsum", norm="min-max")`` (the usual BM25 + dense hybrid).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from densepass.errors import ConfigError
from densepass.evaluation.metrics import NO_PASSAGE, Run, passage_codes, quiet_numba, strict_order


def fuse_embeddings(embeddings: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``[sqrt(w_1) e_1, ..., sqrt(w_n) e_n]`` concatenated along the last axis (float32)."""
    if len(embeddings) != len(weights) or not embeddings:
        raise ConfigError(f"{len(embeddings)} embedding matrices but {len(weights)} weights")
    if any(w < 0 for w in weights):
        raise ConfigError(f"fusion weights must be >= 0, got {list(weights)}")
    rows = {len(e) for e in embeddings}
    if len(rows) != 1:
        raise ConfigError(f"embedding matrices have different numbers of rows: {sorted(rows)}")
    return np.concatenate(
        [np.sqrt(w, dtype=np.float32) * np.asarray(e, dtype=np.float32) for e, w in zip(embeddings, weights)], axis=-1
    )


def tune_weights(
    score: Callable[[tuple[float, ...]], float],
    n_models: int,
    grid: Sequence[float] = (0.0, 0.5, 1.0, 2.0),
    rounds: int = 2,
) -> tuple[tuple[float, ...], float, int]:
    """Coordinate-wise grid search maximising ``score(weights)``, from the best of all weights 1 and
    each single model (so the result is never worse than the best single model): each round sets every
    weight in turn to its best grid value with the others fixed. Returns (weights, best score, number
    of evaluations). All-zero weights are never tried."""
    cache: dict[tuple[float, ...], float] = {}

    def value(w: tuple[float, ...]) -> float:
        if w not in cache:
            cache[w] = score(w)
        return cache[w]

    starts = [(1.0,) * n_models] + [tuple(float(i == j) for j in range(n_models)) for i in range(n_models)]
    weights = max(dict.fromkeys(starts), key=value)
    best = value(weights)
    for _ in range(rounds):
        changed = False
        for i in range(n_models):
            for g in grid:
                trial = weights[:i] + (float(g),) + weights[i + 1 :]
                if any(trial) and trial != weights and value(trial) > best:
                    weights, best, changed = trial, value(trial), True
        if not changed:
            break
    return weights, best, len(cache)


def reciprocal_rank_fusion(runs: Sequence[Run], k: int = 60) -> Run:
    """RRF of runs over the same queries, via ranx (a query missing from a run counts as empty there). Tied scores
    are ranked in each run's own order (a run file's rank column, an index's row order): ranx ranks a list with an
    unstable sort, which scrambles long runs of ties."""
    strict = [{q: strict_order(ranking) for q, ranking in run.items()} for run in runs]
    return _ranx_fuse(strict, norm=None, method="rrf", params={"k": k})


def linear_fusion(runs: Sequence[Run], weights: Sequence[float]) -> Run:
    """The weighted sum of each run's scores min-max normalised per query (ranx ``wsum`` with ``min-max``):
    a passage missing from a run counts 0 there, and a run's lowest-scored passage of a query scores 0."""
    if len(weights) != len(runs) or any(w < 0 for w in weights) or not any(weights):
        raise ConfigError(f"linear fusion needs one weight >= 0 per run, not all zero; got {list(weights)}")
    return _ranx_fuse(runs, norm="min-max", method="wsum", params={"weights": list(map(float, weights))})


def _ranx_fuse(runs: Sequence[Run], norm: str | None, method: str, params: dict) -> Run:
    from ranx import Run as RanxRun
    from ranx import fuse

    if len(runs) < 2:
        raise ConfigError("rank fusion needs at least two runs")
    queries = sorted(set().union(*runs))
    codes = passage_codes(*(ranking for run in runs for ranking in run.values()))  # one width for ranx: compiled once
    ids = dict(zip(codes.values(), codes))

    def coded(run: Run, q: str) -> dict[str, float]:
        return {codes[p]: s for p, s in run[q].items()} if run.get(q) else {NO_PASSAGE: -1e9}

    ranx_runs = [RanxRun({q: coded(run, q) for q in queries}) for run in runs]
    with quiet_numba():  # ranx's numba compile warnings are not the user's concern
        fused = fuse(ranx_runs, norm=norm, method=method, params=params).to_dict()
    return {q: {ids[p]: float(s) for p, s in fused[q].items() if p != NO_PASSAGE} for q in queries}
