"""Metrics of phrase retrieval: exact match and F1 of the top phrase (SQuAD's normalisation and token F1),
top-k answer accuracy (one of the top-k phrases matches an answer: the paper's Acc@k), passage recall@k and
DPR-style passage answer accuracy@k (training-inference-gap Tables 1-2), and average precision, the
token filter's AUC-PR (§5.2).

>>> exact_match("the Denver Broncos", ["Denver Broncos"]), round(f1_score("Denver", ["Denver Broncos"]), 3)
(1.0, 0.667)
>>> exact_match("U.S.", ["US"]), exact_match("Denver-Broncos", ["Denver Broncos"])
(1.0, 0.0)
>>> average_precision([0.9, 0.8, 0.3, 0.1], [1, 0, 1, 0])
0.8333333333333333
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import numpy as np

from densepass.evaluation.answers import has_answer
from densepass.index.base import SearchResults

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def squad_normalize(text: str) -> str:
    """SQuAD v1.1's answer normalisation, as its evaluation script has it: lower case, punctuation removed (``U.S.``
    is ``us``), articles removed, whitespace collapsed. (``evaluation.answers.normalize_answer``, DPR's, reads
    punctuation as a space instead: right for finding an answer inside a passage, not for EM and F1.)"""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised answer (``squad_normalize``)."""
    norm = squad_normalize(prediction)
    return float(any(norm == squad_normalize(a) for a in answers))


def f1_score(prediction: str, answers: Sequence[str]) -> float:
    """The best token-overlap F1 of the prediction against any answer (SQuAD v1.1's evaluation)."""
    best = 0.0
    predicted = squad_normalize(prediction).split()
    for answer in answers:
        truth = squad_normalize(answer).split()
        common = sum((Counter(predicted) & Counter(truth)).values())
        if common:
            precision, recall = common / len(predicted), common / len(truth)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def phrase_metrics(predictions: Sequence[Sequence[str]], answers: Sequence[Sequence[str]], ks: Sequence[int]) -> dict:
    """``em@1``, ``f1@1`` of the top phrase and ``accuracy@k`` (a top-k phrase matches) over questions, in %."""
    n = len(predictions)
    if n == 0:
        return {}
    out = {
        "em@1": 100 * sum(exact_match(p[0], a) if p else 0.0 for p, a in zip(predictions, answers)) / n,
        "f1@1": 100 * sum(f1_score(p[0], a) if p else 0.0 for p, a in zip(predictions, answers)) / n,
    }
    first = [
        next((r for r, text in enumerate(p, 1) if exact_match(text, a)), None) for p, a in zip(predictions, answers)
    ]
    for k in ks:
        out[f"accuracy@{k}"] = 100 * sum(1 for r in first if r is not None and r <= k) / n
    return out


def passage_metrics(
    results: SearchResults, gold: Sequence[str], answers: Sequence[Sequence[str]], ks: Sequence[int]
) -> dict:
    """``passage_recall@k`` (the gold passage is in the top k) and ``passage_accuracy@k`` (a top-k passage
    contains an answer string, DPR's metric), in %, of ranked passages (``results`` row i: question i)."""
    n = len(gold)
    texts = results.passages.texts
    recall_rank, answer_rank = [], []
    for i in range(n):
        ids = results.ids(i)
        recall_rank.append(ids.index(gold[i]) + 1 if gold[i] in ids else None)
        rows = [r for r in results.rows[i].tolist() if r >= 0]
        answer_rank.append(next((rank for rank, r in enumerate(rows, 1) if has_answer(texts[r], answers[i])), None))
    out = {}
    for k in ks:
        out[f"passage_recall@{k}"] = 100 * sum(1 for r in recall_rank if r is not None and r <= k) / n
    for k in ks:
        out[f"passage_accuracy@{k}"] = 100 * sum(1 for r in answer_rank if r is not None and r <= k) / n
    return out


def average_precision(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Area under the precision-recall curve as the mean precision at each positive, tied scores taken
    together (the step-wise AUC-PR of ``sklearn.metrics.average_precision_score``); 0.0 without positives."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(bool)
    if not labels.any():
        return 0.0
    order = np.argsort(-scores, kind="stable")
    scores, labels = scores[order], labels[order]
    last_of_tie = np.r_[np.flatnonzero(np.diff(scores)), len(scores) - 1]  # thresholds: distinct scores
    true_positives = np.cumsum(labels)[last_of_tie]
    precision = true_positives / (last_of_tie + 1)
    recall = true_positives / labels.sum()
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))
