"""BM25 hard negatives: each training query's top BM25 passages (negative-contrast §4.2, "BM25").

Returns the raw ranking; ``densepass.negatives.mine`` removes the query's positives and, when the
dataset has answers, passages containing an answer string (``filters.AnswerFilter``).
"""

from __future__ import annotations

from collections.abc import Sequence

from densepass.data.dataset import RetrievalDataset
from densepass.index.bm25 import BM25Index
from densepass.negatives.pool import Candidate, NegativePool


def mine_bm25_negatives(
    dataset: RetrievalDataset,
    index: BM25Index,
    query_ids: Sequence[str],
    depth: int,
    skip_top: int = 0,
    batch_size: int = 4096,
) -> NegativePool:
    """Query id -> up to ``depth`` passages with a positive BM25 score, best first, after dropping the
    first ``skip_top`` (``index`` covers ``dataset.corpus`` row for row)."""
    ids = dataset.corpus.ids
    out: NegativePool = {}
    for start in range(0, len(query_ids), batch_size):
        chunk = list(query_ids[start : start + batch_size])
        scores, rows = index.search_rows([dataset.queries[q] for q in chunk], depth + skip_top)
        for qid, row_scores, row_ids in zip(chunk, scores.tolist(), rows.tolist()):
            ranked = [(ids[r], s) for s, r in zip(row_scores, row_ids) if s > 0][skip_top:]
            out[qid] = [Candidate(pid, "bm25", s) for pid, s in ranked]
    return out
