"""DPR-style top-k answer accuracy: a query counts as answered at k when one of its top-k passages
contains one of its answer strings after normalisation (lower case, no punctuation or articles,
whitespace collapsed; the SQuAD/DPR normalisation), matched on token boundaries."""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})


def normalize_answer(text: str) -> str:
    """SQuAD/DPR answer normalisation: lower case, no punctuation or articles, whitespace collapsed."""
    text = unicodedata.normalize("NFD", text).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def has_answer(passage: str, answers: Sequence[str]) -> bool:
    """Whether ``passage`` contains one of ``answers`` on token boundaries, after normalisation."""
    padded = f" {normalize_answer(passage)} "
    return any(norm and f" {norm} " in padded for norm in map(normalize_answer, answers))


def top_k_accuracy(
    rankings: dict[str, list[str]], passages: dict[str, str], answers: dict[str, list[str]], ks: Sequence[int]
) -> dict[str, float]:
    """``accuracy@k`` for each k over the queries that have answers."""
    judged = [q for q in rankings if answers.get(q)]
    if not judged:
        return {}
    first_hit = {}
    for qid in judged:
        first_hit[qid] = next(
            (rank for rank, pid in enumerate(rankings[qid], 1) if has_answer(passages[pid], answers[qid])), None
        )
    return {
        f"accuracy@{k}": sum(1 for q in judged if first_hit[q] is not None and first_hit[q] <= k) / len(judged)
        for k in ks
    }
