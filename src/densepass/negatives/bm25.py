"""BM25 hard negatives: the top-ranked passages of each training query that are not relevant to it."""

from __future__ import annotations

from collections.abc import Sequence

from densepass.data.dataset import RetrievalDataset
from densepass.index.bm25 import BM25Index


def mine_bm25_negatives(
    dataset: RetrievalDataset,
    index: BM25Index,
    query_ids: Sequence[str],
    depth: int,
    skip_top: int = 0,
    batch_size: int = 4096,
) -> dict[str, list[str]]:
    """Query id -> up to ``depth`` non-relevant passage ids in BM25 order (``index`` covers the corpus)."""
    relevant = dataset.relevant_sets()
    ids = dataset.corpus.ids
    out: dict[str, list[str]] = {}
    for start in range(0, len(query_ids), batch_size):
        chunk = list(query_ids[start : start + batch_size])
        scores, rows = index.search([dataset.queries[q] for q in chunk], depth + skip_top + 8)
        for qid, row_scores, row_ids in zip(chunk, scores, rows):
            ranked = [ids[r] for s, r in zip(row_scores, row_ids) if s > 0][skip_top:]
            out[qid] = [p for p in ranked if p not in relevant.get(qid, ())][:depth]
    return out
