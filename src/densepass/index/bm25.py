"""BM25 through ``bm25s`` (Lucene scoring, English stop words, Snowball stemming when available).

The text indexed for a passage is ``title text``. ``bm25s`` builds its sparse score matrix in one go, so ``add``
re-indexes every passage (its cost grows with the whole corpus, not with what is added); saved with ``bm25s``' own
files (NumPy arrays without pickle, JSON vocabulary and parameters) beside the passages.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

# bm25s imports JAX where it is installed and runs a top-k with it at import time: on a GPU machine JAX then
# takes 75% of the GPU's memory (its default preallocation) and the encoders' own CUDA allocations fail. Unless
# the user chose otherwise, JAX allocates on demand; retrieval itself ranks with NumPy (``top_k``).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import bm25s  # noqa: E402
import numpy as np  # noqa: E402

from densepass.data.dataset import Corpus
from densepass.errors import ConfigError, DataError
from densepass.index.base import (
    Index,
    Passages,
    SearchResults,
    as_corpus,
    check_queries,
    concat_corpora,
    next_free_id,
    register,
)

BM25_DIR = "bm25s"


def english_stemmer():
    """PyStemmer's English Snowball stemmer, or None when PyStemmer is not installed."""
    try:
        import Stemmer

        return Stemmer.Stemmer("english")
    except ImportError:
        return None


def bm25_texts(corpus: Corpus) -> list[str]:
    """What BM25 indexes for each passage: ``title text``."""
    return corpus.passage_inputs(" ")


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` highest of one query's ``scores`` and their rows, best first, tied scores in row order.

    Ties are common in BM25 (duplicate and near-duplicate passages score alike), and who wins them decides which
    passages enter a top-k: hard negatives, an evaluation subcorpus, a reranker's candidates. NumPy's
    ``argpartition`` and quicksort ``argsort`` (what ``bm25s`` ranks with) run SIMD kernels chosen by the CPU, which
    break ties differently on AVX2 and AVX-512 machines; the k-th score and a stable sort are the same everywhere.
    """
    n = len(scores)
    if k <= 0:
        rows = np.empty(0, dtype=np.int64)
    elif k >= n:
        rows = np.argsort(-scores, kind="stable")
    else:
        kth = np.partition(scores, n - k)[n - k]  # the k-th highest value: one value, whatever the algorithm
        above = np.flatnonzero(scores > kth)
        tied = np.flatnonzero(scores == kth)[: k - len(above)]
        rows = np.concatenate([above[np.argsort(-scores[above], kind="stable")], tied])
    return scores[rows], rows


@register
class BM25Index(Index):
    """A BM25 index; ``search`` takes query texts.

    >>> index = BM25Index.build(["fast audio editor", "kernel driver", "audio player"])
    >>> index.search(["audio editor"], k=1).ids(0)
    ['0']
    """

    kind: ClassVar[str] = "bm25"

    def __init__(self, k1: float = 0.9, b: float = 0.4, show_progress: bool = False) -> None:
        if k1 < 0 or not 0 <= b <= 1:
            raise ConfigError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.k1, self.b, self.show_progress = k1, b, show_progress
        self.passages = Corpus([], [], [], [])
        self.retriever: bm25s.BM25 | None = None
        self.stemmer = english_stemmer()

    @classmethod
    def build(cls, passages: Passages, k1: float = 0.9, b: float = 0.4, show_progress: bool = False) -> BM25Index:
        """A BM25 index of ``passages`` (a Corpus, texts, or {id, title, text} records)."""
        index = cls(k1, b, show_progress)
        index.add(passages)
        return index

    @property
    def size(self) -> int:
        """Number of indexed passages."""
        return len(self.passages)

    def add(self, passages: Passages) -> None:
        """Index more passages; bm25s indexes in one go, so every passage is indexed again."""
        new = as_corpus(passages, first_id=next_free_id(self.passages))
        corpus = concat_corpora(self.passages, new) if len(self.passages) else new
        tokens = bm25s.tokenize(
            bm25_texts(corpus), stopwords="en", stemmer=self.stemmer, show_progress=self.show_progress
        )
        if not tokens.vocab:  # bm25s fails on it with "max() arg is an empty sequence"
            raise DataError(
                f"BM25 has nothing to index: none of the {len(corpus)} passages has a word (each is empty, "
                "whitespace or English stopwords)"
            )
        retriever = bm25s.BM25(k1=self.k1, b=self.b)
        retriever.index(tokens, show_progress=self.show_progress)
        self.passages, self.retriever = corpus, retriever

    def _compact(self, live: np.ndarray) -> None:
        """Index the ``live`` passages again (bm25s indexes in one go): a deleted passage's terms count in the
        document frequencies and the average length until then, as in Lucene until its segments merge."""
        before = self.passages
        self.passages = Corpus([], [], [], [])
        try:
            self.add(before.subset(live.tolist()))
        except BaseException:  # (say no live passage has a word left) the index stays as it was
            self.passages = before
            raise

    def search_rows(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` (scores, rows) per query, best first, tied scores in row order (``top_k``): when fewer than
        ``k`` passages share a term with a query, the rest are zero-score passages in index order."""
        queries = check_queries(queries)
        k = min(k, len(self.passages))
        tokens = bm25s.tokenize(queries, stopwords="en", stemmer=self.stemmer, show_progress=False, return_ids=False)
        scores = np.empty((len(queries), k), dtype=np.float32)
        rows = np.empty((len(queries), k), dtype=np.int64)
        for i, words in enumerate(tokens):
            scores[i], rows[i] = top_k(self._scores(words), k)
        return scores, rows

    def search(self, queries: Sequence[str], k: int = 10) -> SearchResults:
        """The top-``k`` passages of each query that share at least one term with it."""
        results = super().search(queries, k)
        results.rows[results.scores <= 0] = -1
        return results

    def score_all(self, query: str) -> np.ndarray:
        """BM25 score of one query against every indexed passage."""
        words = bm25s.tokenize([query], stopwords="en", stemmer=self.stemmer, show_progress=False, return_ids=False)
        return self._scores(words[0])

    def _scores(self, words: list[str]) -> np.ndarray:
        """BM25 scores of one tokenized query against every passage (float32)."""
        if not words:
            return np.zeros(len(self.passages), dtype=np.float32)
        return np.asarray(self.retriever.get_scores(words), dtype=np.float32)

    def facts(self) -> dict:
        """The BM25 parameters, for the manifest."""
        return {"options": {"k1": self.k1, "b": self.b}}

    def _write(self, directory: Path) -> None:
        self.retriever.save(str(directory / BM25_DIR))

    @classmethod
    def _read(cls, directory: Path, manifest: dict, passages: Corpus, **options) -> BM25Index:
        index = cls(**manifest["options"])
        index.passages = passages
        index.retriever = bm25s.BM25.load(str(directory / BM25_DIR), allow_pickle=False)
        return index
