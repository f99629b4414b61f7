"""Indexes behind one interface (``base.Index``: build, add, search, save, load): dense (exact and FAISS, and
IVF-PQ with its lists on disk; binary and int8 codes re-scored from disk, ``index.binary``), BM25, SPLADE (an
inverted index of term weights), ColBERT (token vectors, MaxSim) and hybrid fusion; plus the exact-search and FAISS
building blocks and memory-mapped embeddings. Importing the package registers every kind."""

from densepass.index.base import KINDS, Index, SearchResults, load_index
from densepass.index.binary import CompactIndex
from densepass.index.bm25 import BM25Index
from densepass.index.colbert import ColbertIndex
from densepass.index.dense import DenseIndex
from densepass.index.hybrid import HybridIndex
from densepass.index.ondisk import OnDiskIVFPQIndex
from densepass.index.splade import SpladeIndex

__all__ = [
    "KINDS",
    "BM25Index",
    "ColbertIndex",
    "CompactIndex",
    "DenseIndex",
    "HybridIndex",
    "Index",
    "OnDiskIVFPQIndex",
    "SearchResults",
    "SpladeIndex",
    "load_index",
]
