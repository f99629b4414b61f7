"""DPR-style top-k answer accuracy: a query counts as answered at k when one of its top-k passages
contains one of its answer strings, as DPR's ``has_answer`` finds them: the answer's tokens, in order, among the
passage's (lower case, Unicode NFD; a token is a run of letters, digits and marks, or one other visible character,
so ``“Paris”``, ``Paris—the`` and ``1900–1910`` hold ``Paris`` and ``1900``, and ``The Who`` is not ``who``)."""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Sequence

import regex

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})
_TOKEN = regex.compile(r"[\p{L}\p{N}\p{M}]+|[^\p{Z}\p{C}]")  # DPR's SimpleTokenizer: words, or one other character


def normalize_answer(text: str) -> str:
    """SQuAD/DPR answer normalisation: lower case, no punctuation or articles, whitespace collapsed (to compare
    whole texts, e.g. a query with another; ``has_answer`` searches inside a passage on ``answer_tokens``)."""
    text = unicodedata.normalize("NFD", text).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def answer_tokens(text: str) -> str:
    """``text``'s DPR tokens, lower-cased after Unicode NFD, joined by single spaces (a token holds none)."""
    return " ".join(_TOKEN.findall(unicodedata.normalize("NFD", text).lower()))


def has_answer(passage: str, answers: Sequence[str]) -> bool:
    """Whether ``passage`` holds one of ``answers``: its tokens, in order (``answer_tokens``; DPR's ``has_answer``,
    which keeps articles: ``The Who`` is not found in "Who is ...", ``Vitamin A`` not in "vitamin B12")."""
    padded = f" {answer_tokens(passage)} "
    return any(tokens and f" {tokens} " in padded for tokens in map(answer_tokens, answers))


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
