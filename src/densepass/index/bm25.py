"""BM25 through ``bm25s`` (Lucene scoring, English stop words, Snowball stemming when available)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import bm25s
import numpy as np

from densepass.errors import DensepassError


def english_stemmer():
    """PyStemmer's English Snowball stemmer, or None when PyStemmer is not installed."""
    try:
        import Stemmer

        return Stemmer.Stemmer("english")
    except ImportError:
        return None


class BM25Index:
    """A BM25 index over passage texts; rows of results are positions in the indexed list."""

    def __init__(self, retriever: bm25s.BM25, size: int) -> None:
        self.retriever = retriever
        self.size = size
        self.stemmer = english_stemmer()

    @classmethod
    def build(cls, texts: Sequence[str], k1: float = 0.9, b: float = 0.4, show_progress: bool = False) -> BM25Index:
        if len(texts) == 0:
            raise DensepassError("cannot build a BM25 index over an empty corpus")
        tokens = bm25s.tokenize(list(texts), stopwords="en", stemmer=english_stemmer(), show_progress=show_progress)
        retriever = bm25s.BM25(k1=k1, b=b)
        retriever.index(tokens, show_progress=show_progress)
        return cls(retriever, len(texts))

    def search(
        self, queries: Sequence[str], k: int, show_progress: bool = False, n_threads: int = 1
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` (scores, rows) per query, best first."""
        if len(queries) == 0:
            raise DensepassError("no queries to search")
        k = min(k, self.size)
        tokens = bm25s.tokenize(list(queries), stopwords="en", stemmer=self.stemmer, show_progress=False)
        rows, scores = self.retriever.retrieve(tokens, k=k, show_progress=show_progress, n_threads=n_threads)
        return scores.astype(np.float32), rows.astype(np.int64)

    def score_all(self, query: str) -> np.ndarray:
        """BM25 score of one query against every indexed passage."""
        tokens = bm25s.tokenize([query], stopwords="en", stemmer=self.stemmer, show_progress=False, return_ids=False)[0]
        if not tokens:
            return np.zeros(self.size, dtype=np.float32)
        return np.asarray(self.retriever.get_scores(tokens), dtype=np.float32)

    def save(self, path: str | Path) -> None:
        from densepass.io import atomic_directory

        with atomic_directory(path) as tmp:
            self.retriever.save(str(tmp))

    @classmethod
    def load(cls, path: str | Path) -> BM25Index:
        path = Path(path)
        if not path.is_dir():
            raise DensepassError(f"BM25 index not found: {path}")
        retriever = bm25s.BM25.load(str(path))
        return cls(retriever, int(retriever.scores["num_docs"]))
