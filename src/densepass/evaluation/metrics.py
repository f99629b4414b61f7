"""Ranking metrics through ``ranx`` (MRR@k, nDCG@k, Recall@k, ...) and TREC run files.

Metric names follow ranx (``mrr@10``, ``ndcg@10``, ``recall@100``); ``accuracy@k`` is DPR's top-k
answer accuracy (see ``answers.py``) and needs answer strings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from densepass.data.dataset import Qrels
from densepass.errors import DataError, DensepassError

Run = dict[str, dict[str, float]]  # query id -> passage id -> score


def make_run(
    query_ids: Sequence[str],
    passage_ids: Sequence[str],
    scores: np.ndarray,
    rows: np.ndarray,
    drop_nonpositive: bool = False,
) -> Run:
    """A run from top-k (scores, rows) arrays; ``rows`` index ``passage_ids``."""
    run: Run = {}
    for qid, row_scores, row_ids in zip(query_ids, scores, rows):
        ranking = {}
        for score, r in zip(row_scores.tolist(), row_ids.tolist()):
            if r < 0 or (drop_nonpositive and score <= 0):
                continue
            ranking[passage_ids[r]] = score
        run[qid] = ranking
    return run


def _ranx_inputs(qrels: Qrels, run: Run):
    """ranx Qrels/Run of the judged queries; a judged query missing from the run gets an empty ranking."""
    from ranx import Qrels as RanxQrels
    from ranx import Run as RanxRun

    judged = {q: {p: g for p, g in rels.items() if g > 0} for q, rels in qrels.items()}
    judged = {q: rels for q, rels in judged.items() if rels}
    if not judged:
        raise DataError("no query in the qrels has a relevant passage")
    unknown = set(run) - set(qrels)
    if unknown:
        raise DataError(f"the run has {len(unknown)} queries absent from the qrels (e.g. {next(iter(unknown))!r})")
    # ranx needs every judged query in the run; an empty ranking scores zero.
    full_run = {q: (run.get(q) or {"__none__": 0.0}) for q in judged}
    return RanxQrels(judged), RanxRun(full_run)


def evaluate_run(qrels: Qrels, run: Run, metrics: Sequence[str]) -> dict[str, float]:
    """Mean of each metric over the queries of ``qrels`` (a query missing from the run scores 0)."""
    from ranx import evaluate

    metrics = [m for m in metrics if not m.startswith("accuracy@")]
    if not metrics:
        return {}
    ranx_qrels, ranx_run = _ranx_inputs(qrels, run)
    try:
        result = evaluate(ranx_qrels, ranx_run, list(metrics), make_comparable=True)
    except (ValueError, KeyError) as err:
        raise DensepassError(f"cannot compute metrics {list(metrics)}: {err}") from None
    if isinstance(result, float):
        result = {metrics[0]: result}
    return {m: float(v) for m, v in result.items()}


def paired_significance(
    qrels: Qrels,
    runs: Mapping[str, Run],
    baseline: str,
    metric: str = "mrr@10",
    n_permutations: int = 10_000,
    seed: int = 42,
) -> dict[str, dict[str, float]]:
    """Every run against ``baseline`` on ``metric``, query by query.

    Returns, per other run: ``delta`` (its mean minus the baseline's), ``wins`` / ``ties`` / ``losses``
    (queries where it scores above / equal to / below the baseline) and ``p``, the two-sided p-value of
    Fisher's randomization test (Smucker et al., CIKM 2007) as computed by ``ranx.compare`` with
    ``n_permutations`` random swaps of the two systems' per-query scores (drawn in parallel threads, so
    p varies by about 1/sqrt(n_permutations) between calls despite the seed).
    """
    from ranx import compare

    if baseline not in runs:
        raise DensepassError(f"baseline {baseline!r} is not among the runs {sorted(runs)}")
    if len(runs) < 2:
        raise DensepassError("a paired test needs the baseline and at least one other run")
    ranx_qrels, ranx_runs = None, []
    for name, run in runs.items():
        ranx_qrels, ranx_run = _ranx_inputs(qrels, run)  # the same judged qrels for every run
        ranx_run.name = name
        ranx_runs.append(ranx_run)
    try:
        report = compare(ranx_qrels, ranx_runs, [metric], stat_test="fisher", n_permutations=n_permutations,
                         random_seed=seed, make_comparable=True)
    except (ValueError, KeyError) as err:
        raise DensepassError(f"cannot compare runs on {metric}: {err}") from None
    results = {}
    for name in runs:
        if name == baseline:
            continue
        counts = report.win_tie_loss[(name, baseline)][metric]
        results[name] = {
            "delta": report.results[name][metric] - report.results[baseline][metric],
            "wins": counts["W"], "ties": counts["T"], "losses": counts["L"],
            "p": float(report.comparisons[frozenset([name, baseline])][metric]["p_value"]),
        }
    return results


def write_trec_run(run: Run, path: str | Path, tag: str = "densepass") -> None:
    """TREC run format: ``qid Q0 pid rank score tag``, best first; written atomically."""
    from densepass.io import atomic_write_text

    lines = []
    for qid in run:
        ranked = sorted(run[qid].items(), key=lambda item: -item[1])
        lines.extend(f"{qid} Q0 {pid} {rank} {score:.6f} {tag}" for rank, (pid, score) in enumerate(ranked, 1))
    atomic_write_text(path, "\n".join(lines) + "\n")


def read_trec_run(path: str | Path) -> Run:
    run: Run = {}
    path = Path(path)
    if not path.is_file():
        raise DataError(f"run file not found: {path}")
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 6:
            raise DataError(f"{path}:{line_no}: expected 6 columns (qid Q0 pid rank score tag)")
        try:
            run.setdefault(parts[0], {})[parts[2]] = float(parts[4])
        except ValueError:
            raise DataError(f"{path}:{line_no}: score {parts[4]!r} is not a number") from None
    return run


RANX_METRICS = ("mrr", "ndcg", "ndcg_burges", "recall", "precision", "map", "hits", "hit_rate", "f1", "r-precision",
                "bpref", "dcg", "dcg_burges")


def check_metrics(names: Sequence[str]) -> None:
    """A one-line error for a metric name that neither ranx nor densepass computes (``name@k``, k >= 1)."""
    for name in names:
        base, at, cutoff = str(name).partition("@")
        if base == "accuracy" and not at:
            raise DensepassError(f"metric {name!r}: accuracy needs a cutoff, e.g. accuracy@5")
        if base not in (*RANX_METRICS, "accuracy") or (at and not (cutoff.isdigit() and int(cutoff) >= 1)):
            raise DensepassError(f"unknown metric {name!r} (known: {', '.join(RANX_METRICS)}, accuracy, "
                                 "each optionally @k with k >= 1, e.g. mrr@10)")
