"""Evaluate ensembles of saved bi-encoders on a split (negative-contrast §4.4, Table 2's last rows).

Each model encodes the split's queries and the whole corpus once. "embedding": fused embeddings
(``evaluation.fusion.fuse_embeddings``) with weights tuned by coordinate-wise grid search on ``tune_metric``;
"rrf": reciprocal rank fusion of the models' runs. Each single model is reported too.

The embedding fusion's reported row is cross-fitted: the queries are split in ``folds`` seeded folds, and each
fold is scored with the weights tuned on the others, so that no query is scored by weights chosen on it (weights
tuned on the reported queries themselves can only look better than any single model). The ``weights`` reported
for use elsewhere are tuned on all the queries; ``folds=1`` reports those in-sample, as negative-contrast tunes
on dev (and reports on test).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from densepass.data.dataset import RetrievalDataset
from densepass.device import default_device, resolve_precision
from densepass.errors import ConfigError
from densepass.evaluation.fusion import fuse_embeddings, reciprocal_rank_fusion, tune_weights
from densepass.evaluation.metrics import (
    Run,
    check_metrics,
    evaluate_run,
    make_run,
    refuse_answer_metrics,
    warn_if_shallow,
)
from densepass.index.exact import exact_search
from densepass.io import atomic_write_text, check_output_file
from densepass.models.biencoder import BiEncoder
from densepass.models.encode import encode_texts

METHODS = ("embedding", "rrf")


def _encode(path: str, queries: list[str], dataset: RetrievalDataset, batch_size: int, device, precision: str) -> tuple:
    model = BiEncoder.from_pretrained(path)
    q = encode_texts(model, queries, "query", batch_size, device, precision)
    passages = dataset.corpus.passage_inputs(model.tokenizer.sep_token or " ")
    p = encode_texts(model, passages, "passage", batch_size, device, precision)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return q, p


@dataclass
class EnsembleSettings:
    """What ``evaluate_ensemble`` fuses and reports."""

    methods: Sequence[str] = METHODS
    split: str = "dev"
    metrics: Sequence[str] = ("mrr@10", "ndcg@10", "recall@1", "recall@5", "recall@20", "recall@100")
    depth: int = 100
    max_queries: int | None = None
    seed: int = 13
    tune_metric: str = "mrr@10"
    grid: Sequence[float] = (0.0, 0.5, 1.0, 2.0)
    rrf_k: int = 60
    batch_size: int = 256
    device: torch.device | None = None
    precision: str = "auto"
    folds: int = 2
    """Embedding fusion: each of ``folds`` seeded folds of the queries scored with the weights tuned on the others
    (1: tuned on the reported queries themselves)."""

    def __post_init__(self) -> None:
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise ConfigError(f"unknown ensemble method(s) {sorted(unknown)} (known: {', '.join(METHODS)})")
        if self.depth < 1 or self.rrf_k < 1 or self.batch_size < 1 or self.folds < 1:
            raise ConfigError("ensemble depth, rrf_k, batch size and folds must be >= 1")
        resolve_precision(self.precision, self.device or default_device())  # a bad name: before any work
        check_metrics([*self.metrics, self.tune_metric])  # a typo: one line before any model encodes the corpus
        refuse_answer_metrics([*self.metrics, self.tune_metric], "the ensemble")
        warn_if_shallow([*self.metrics, self.tune_metric], self.depth, "the ensemble's depth (--depth)")


def evaluate_ensemble(
    dataset: RetrievalDataset,
    model_paths: Sequence[str],
    settings: EnsembleSettings | None = None,
    labels: Sequence[str] | None = None,
    qrels: dict | None = None,
) -> dict:
    """``{"results": {system: {metric: value}}, "queries": n, "weights": {model: w}, "fold_weights": [{model: w}
    per fold], "evaluations": n}`` over ``qrels`` (default: a seeded sample of ``settings.split``, as
    ``settings.max_queries`` and ``settings.seed`` say; a run passes its ``data.eval_part``'s)."""
    s = settings or EnsembleSettings()
    if len(model_paths) < 2:
        raise ConfigError("an ensemble needs at least two models")
    for path in model_paths:
        if not Path(path).is_dir():
            raise ConfigError(f"model not found: {path}")
    labels = list(labels or model_paths)
    device = s.device or default_device()
    metrics, depth, tune_metric = s.metrics, s.depth, s.tune_metric
    qrels = dataset.sample(s.split, s.max_queries, s.seed) if qrels is None else qrels
    qids = sorted(qrels)
    if "embedding" in s.methods and len(qids) < s.folds:
        raise ConfigError(f"{len(qids)} queries cannot be split in {s.folds} folds to cross-fit the fusion weights")
    queries = [dataset.queries[q] for q in qids]
    ids = dataset.corpus.ids

    def run_of(q: np.ndarray, p: np.ndarray, rows_of: np.ndarray | None = None) -> Run:
        """The run of query embeddings ``q`` (of the queries at ``rows_of`` in ``qids``; default all)."""
        scores, rows = exact_search(q, p, depth, device=device)
        return make_run(qids if rows_of is None else [qids[i] for i in rows_of], ids, scores, rows)

    embeddings = [_encode(path, queries, dataset, s.batch_size, device, s.precision) for path in model_paths]
    runs = [run_of(q, p) for q, p in embeddings]
    results = {label: evaluate_run(qrels, run, metrics) for label, run in zip(labels, runs)}
    out: dict = {"results": results, "queries": len(qids)}
    if "embedding" in s.methods:

        def fused_run(weights, rows_of: np.ndarray) -> Run:
            return run_of(
                fuse_embeddings([q[rows_of] for q, _ in embeddings], weights),
                fuse_embeddings([p for _, p in embeddings], weights),
                rows_of,
            )

        def tuned(rows_of: np.ndarray) -> tuple[tuple[float, ...], int]:
            """The weights that score the queries at ``rows_of`` best, and the evaluations it took."""
            part = {qids[i]: qrels[qids[i]] for i in rows_of}
            weights, _, evaluations = tune_weights(
                lambda w: evaluate_run(part, fused_run(w, rows_of), [tune_metric])[tune_metric],
                len(model_paths),
                s.grid,
            )
            return weights, evaluations

        every = np.arange(len(qids))
        weights, evaluations = tuned(every)
        fold_of = np.empty(len(qids), dtype=np.int64)
        fold_of[np.random.default_rng(s.seed).permutation(len(qids))] = every % s.folds
        fused: Run = {}
        fold_weights = []
        for fold in range(s.folds):
            held = np.flatnonzero(fold_of == fold)
            chosen, more = (weights, 0) if s.folds == 1 else tuned(np.flatnonzero(fold_of != fold))
            fused.update(fused_run(chosen, held))
            fold_weights.append(dict(zip(labels, chosen)))
            evaluations += more
        results["ensemble (embedding)"] = evaluate_run(qrels, fused, metrics)
        out["weights"] = dict(zip(labels, weights))
        out["fold_weights"] = fold_weights
        out["evaluations"] = evaluations
    if "rrf" in s.methods:
        results["ensemble (rank)"] = evaluate_run(qrels, reciprocal_rank_fusion(runs, s.rrf_k), metrics)
    return out


REPORT_KEYS = {"results", "queries", "weights", "fold_weights", "evaluations"}  # what ``evaluate_ensemble`` returns


def is_ensemble_report(path: str | Path) -> bool:
    """Whether ``path`` holds an ensemble report as ``save_ensemble_report`` writes it (its keys, no other)."""
    values = json.loads(Path(path).read_text(encoding="utf-8"))
    return isinstance(values, dict) and {"results", "queries"} <= set(values) <= REPORT_KEYS


def check_report_output(path: str | Path) -> None:
    """A one-line error unless ``path`` is free for an ensemble report: missing, empty, or a report densepass wrote
    (``io.check_output_file``): a user's file of that name is never overwritten."""
    check_output_file(path, "ensemble report", is_ensemble_report)


def save_ensemble_report(report: dict, path: str | Path) -> None:
    """Write what ``evaluate_ensemble`` returned to ``path`` as JSON, atomically, over nothing but an ensemble
    report (``check_report_output``)."""
    check_report_output(path)
    atomic_write_text(path, json.dumps(report, indent=2))
