"""Indexes behind one interface (``base.Index``: build, add, search, save, load): dense (exact and FAISS),
BM25, and hybrid fusion; plus the exact-search and FAISS building blocks and memory-mapped embeddings."""

from densepass.index.base import KINDS, Index, SearchResults, load_index
from densepass.index.bm25 import BM25Index
from densepass.index.dense import DenseIndex
from densepass.index.hybrid import HybridIndex

__all__ = ["KINDS", "BM25Index", "DenseIndex", "HybridIndex", "Index", "SearchResults", "load_index"]
