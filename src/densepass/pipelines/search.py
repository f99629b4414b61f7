"""Search pipelines: a first stage (any index: dense, BM25, hybrid, phrase) and an optional second stage that
re-scores the first stage's top candidates (a reranker, e.g. a cross-encoder).

``SearchPipeline.search("query", k)`` returns ``Hit``s with the passage's id, score, title and text (and,
from a phrase index, the answer phrase and its character span);
``search_batch`` does many queries at once (what ``densepass serve`` calls with micro-batches).
A reranked list holds every first-stage candidate it was given, re-ordered: nothing is lost.

>>> from densepass.index import BM25Index
>>> pipeline = SearchPipeline(BM25Index.build(["tar archiving utility", "X11 window manager"]))
>>> [hit.id for hit in pipeline.search("window manager", k=1)]
['1']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from densepass.errors import ConfigError
from densepass.index.base import Index, SearchResults, check_k, load_index
from densepass.phrase.index import PhraseIndex, PhraseSearchResults  # registers the phrase kind for load_index


@dataclass
class Hit:
    """One retrieved passage; a phrase index also gives the answer phrase and its character span
    ``[start, end)`` in ``text``."""

    id: str
    score: float
    title: str
    text: str
    answer: str | None = None
    start: int | None = None
    end: int | None = None


class Reranker(Protocol):
    """A second stage: scores (query, passage text) pairs, higher is better."""

    def score_pairs(self, queries: Sequence[str], passages: Sequence[str]) -> np.ndarray:
        """One score per pair ``(queries[i], passages[i])``."""
        ...

    def describe(self) -> dict:
        """JSON-able facts about the reranker (shown by ``/health``)."""
        ...


class SearchPipeline:
    """First stage ``index``, then (optionally) ``reranker`` over its top ``rerank_depth`` candidates."""

    def __init__(self, index: Index, reranker: Reranker | None = None, rerank_depth: int = 100) -> None:
        if rerank_depth < 1:
            raise ConfigError(f"rerank depth must be >= 1, got {rerank_depth}")
        if reranker is not None and isinstance(index, PhraseIndex):
            raise ConfigError("a phrase index returns phrases: rerank passages with a passage index instead")
        self.index, self.reranker, self.rerank_depth = index, reranker, rerank_depth

    @classmethod
    def load(
        cls, directory: str | Path, reranker: Reranker | None = None, rerank_depth: int = 100, **index_options: Any
    ) -> SearchPipeline:
        """A pipeline over the index saved in ``directory``."""
        return cls(load_index(directory, **index_options), reranker, rerank_depth)

    def search(self, query: str, k: int = 10) -> list[Hit]:
        """The top-``k`` hits of one query."""
        if not isinstance(query, str):
            raise ConfigError(f"a query is a string, got {type(query).__name__}")
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: Sequence[str], k: int = 10) -> list[list[Hit]]:
        """The top-``k`` hits of each query."""
        return self.hits(self.results(queries, k))

    def results(self, queries: Sequence[str], k: int = 10) -> SearchResults:
        """Rows and scores of the top-``k`` of each query (reranked when there is a second stage)."""
        k = check_k(k)
        if self.reranker is None:
            return self.index.search(queries, k)
        first = self.index.search(queries, max(k, self.rerank_depth))
        return rerank(first, list(queries), self.reranker, self.rerank_depth, k)

    def hits(self, results: SearchResults) -> list[list[Hit]]:
        """``Hit``s (with title and text) of search results."""
        corpus = results.passages
        spans = isinstance(results, PhraseSearchResults)
        out = []
        for i in range(len(results)):
            hits = []
            for j, (r, s) in enumerate(zip(results.rows[i].tolist(), results.scores[i].tolist())):
                if r >= 0:
                    hit = Hit(corpus.ids[r], float(s), corpus.titles[r], corpus.texts[r])
                    if spans:
                        hit.answer = results.answers[i][j]
                        hit.start, hit.end = int(results.starts[i, j]), int(results.ends[i, j])
                    hits.append(hit)
            out.append(hits)
        return out

    def describe(self) -> dict:
        """What the pipeline searches with (for ``/health`` and reports)."""
        manifest_model = getattr(self.index, "model_path", None)
        facts = {"index": self.index.kind, "passages": len(self.index)}
        if manifest_model:
            facts["model"] = manifest_model
        if self.reranker is not None:
            facts["reranker"] = self.reranker.describe()
            facts["rerank_depth"] = self.rerank_depth
        return facts


def rerank(first: SearchResults, queries: list[str], reranker: Reranker, depth: int, k: int) -> SearchResults:
    """Re-score the top ``depth`` candidates of each query with ``reranker``; keep the best ``k``. Every
    query's candidates are scored in one call (the reranker batches and sorts them by length)."""
    corpus = first.passages
    texts = corpus.passage_inputs(" ")
    pairs_q, pairs_p, where = [], [], []
    for i, rows in enumerate(first.rows):
        for j, r in enumerate(rows[:depth].tolist()):
            if r >= 0:
                pairs_q.append(queries[i])
                pairs_p.append(texts[r])
                where.append((i, j))
    scores = np.full(first.rows[:, :depth].shape, -np.inf, dtype=np.float32)
    if pairs_q:
        values = np.asarray(reranker.score_pairs(pairs_q, pairs_p), dtype=np.float32)
        if values.shape != (len(pairs_q),):
            raise ConfigError(f"the reranker returned {values.shape} scores for {len(pairs_q)} pairs")
        for (i, j), value in zip(where, values):
            scores[i, j] = value
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    rows = np.take_along_axis(first.rows[:, :depth], order, axis=1)
    out_scores = np.take_along_axis(scores, order, axis=1)
    rows[~np.isfinite(out_scores)] = -1
    out_scores[~np.isfinite(out_scores)] = 0.0
    return SearchResults(out_scores, rows, corpus)


def read_queries(path: str | Path) -> tuple[list[str], list[str]]:
    """(ids, texts) of a queries file: BEIR ``queries.jsonl`` (``_id``, ``text``; .gz too) or ``id<TAB>text`` lines."""
    from densepass.data.beir import read_queries as read_jsonl_queries
    from densepass.data.msmarco import read_id_text_tsv
    from densepass.errors import DataError

    path = Path(path)
    if not path.is_file():
        raise DataError(f"queries file not found: {path}")
    if path.name.endswith((".jsonl", ".jsonl.gz", ".json")):
        queries, _ = read_jsonl_queries(path)
        return list(queries), list(queries.values())
    ids, texts = [], []
    for _, qid, text in read_id_text_tsv(path):
        ids.append(qid)
        texts.append(text)
    if not ids:
        raise DataError(f"{path}: no queries")
    return ids, texts
