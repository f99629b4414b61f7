"""Context negatives (negative-contrast §4.1): other passages of the positive's document.

When the positive's document has no other passage, the passage is split in half at the middle word
and the half that does not contain an answer string is the negative (a random half, seeded per
query, when the query has no answers). A half is a synthetic passage with the id ``<pid>#half0`` or
``<pid>#half1``; ``passage_input`` gives its encoder input (title [SEP] half text).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from densepass.data.dataset import Corpus, RetrievalDataset
from densepass.data.keys import half_id, split_in_half
from densepass.evaluation.answers import has_answer
from densepass.negatives.pool import Candidate, NegativePool


def _half_negative(corpus: Corpus, pid: str, answers: Sequence[str], rng: random.Random) -> str | None:
    halves = split_in_half(corpus.texts[corpus.position(pid)])
    if not halves[0]:
        return None  # a one-word passage has no halves
    if answers:
        without = [h for h in (0, 1) if not has_answer(halves[h], answers)]
        if len(without) == 1:
            return half_id(pid, without[0])
        if not without:
            return None  # the answer is in both halves: neither is a negative
    return half_id(pid, rng.randrange(2))


def mine_context_negatives(
    dataset: RetrievalDataset,
    query_ids: Sequence[str],
    depth: int,
    split: str = "train",
    seed: int = 13,
    skip_top: int = 0,
) -> NegativePool:
    """Per query: up to ``depth`` passages of its positives' documents, nearest in the document first
    (score = minus the distance in passages); or one half of its positive (score 0). The first ``skip_top`` of
    these are dropped (the nearest: the likeliest unlabelled positives; the half, where it is the only one)."""
    corpus = dataset.corpus
    positives = dataset.positives(split)
    by_doc: dict[str, list[int]] = {}
    for row, doc in enumerate(corpus.doc_ids):
        by_doc.setdefault(doc, []).append(row)
    pool: NegativePool = {}
    for qid in query_ids:
        pos_rows = [corpus.position(p) for p in positives.get(qid, ())]
        distance: dict[int, int] = {}
        for pos in pos_rows:
            siblings = by_doc[corpus.doc_ids[pos]]
            at = siblings.index(pos)
            for k, row in enumerate(siblings):
                if row not in pos_rows:
                    distance[row] = min(distance.get(row, len(siblings)), abs(k - at))
        ranked = sorted(distance, key=lambda r: (distance[r], r))[: depth + skip_top]
        cands = [Candidate(corpus.ids[r], "context", -float(distance[r])) for r in ranked]
        if not cands and pos_rows and depth > 0:
            rng = random.Random(f"{seed}:{qid}")
            half = _half_negative(corpus, corpus.ids[pos_rows[0]], dataset.answers.get(qid, []), rng)
            cands = [Candidate(half, "context", 0.0)] if half else []
        pool[qid] = cands[skip_top:]
    return pool
