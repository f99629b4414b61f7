"""A ColBERT index: every passage token vector, candidate generation by centroids, exact MaxSim re-scoring.

Storage (PLAID-style, ColBERT v2): the token vectors of all passages in one array, passage by passage
(``offsets``), as

- ``fp16``: the vectors in half precision (2 x dim bytes a token), or
- ``residual``: the id of the token's nearest k-means centroid plus its residual (vector - centroid)
  quantised to ``residual_bits`` per dimension with buckets at the quantiles of all residual values
  (ColBERT v2's compression; dim x bits / 8 bytes a token, plus 4 for the centroid id).

The centroids come from FAISS k-means over the token vectors (trained by the first ``add``), and an
inverted list per centroid holds the passages with a token there. Search, per query (its
``query_max_length`` vectors):

1. candidate generation by centroid pruning: each query vector probes its ``nprobe`` closest centroids;
   the candidates are the passages in those lists;
2. approximate MaxSim of every candidate with each token replaced by its centroid (PLAID's centroid
   interaction), which keeps the best ``candidates`` passages;
3. exact MaxSim of those with their stored (or decompressed) vectors -> the top k.

``exhaustive=True`` skips 1-2 and computes exact MaxSim against every passage: the reference the
pruned search is measured against. A query longer than ``query_max_length`` tokens is cut (every
encoder here truncates), with one ``DataWarning`` per search call saying how many were.

>>> from densepass.models.colbert import ColBERT
>>> _ = torch.manual_seed(0)
>>> model = ColBERT.from_pretrained("all-MiniLM-L6-v2")
>>> index = ColbertIndex.build(model, ["tar archiving utility", "X11 window manager"], device=torch.device("cpu"))
>>> index.search(["window manager"], k=1).ids(0)
['1']
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from densepass.data.dataset import Corpus
from densepass.device import default_device
from densepass.errors import ConfigError, DataError
from densepass.fingerprints import fingerprint_weights
from densepass.index.base import (
    Index,
    Passages,
    SearchResults,
    as_corpus,
    check_k,
    check_positive,
    check_queries,
    concat_corpora,
    is_vectors,
    next_free_id,
    records_corpus,
    register,
)
from densepass.index.checks import encoded_precision, model_for_index, model_settings, precision_as_built
from densepass.models.colbert import ColBERT
from densepass.models.copies import float_precision
from densepass.models.inputs import warn_long_queries

Compression = Literal["fp16", "residual"]
ARRAYS = ("offsets", "codes", "centroids", "vectors", "residuals", "bucket_cutoffs", "bucket_weights")


def segment_max_sum(sims: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """MaxSim of consecutive passages from query-token similarities ``sims`` [Lq, T]: for passage p, whose
    tokens are columns starts[p]..starts[p+1]-1 (every passage non-empty), sum_i max_j sims[i, j]."""
    return np.maximum.reduceat(sims, starts[:-1], axis=1).sum(axis=0)


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """[T, d] integer codes < 2**bits packed into [T, d * bits / 8] bytes (d * bits must be a multiple of 8)."""
    per_byte = 8 // bits
    grouped = codes.astype(np.uint8).reshape(len(codes), -1, per_byte)
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits)[None, None, :]
    return np.bitwise_or.reduce(grouped << shifts, axis=2).astype(np.uint8)


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of ``pack_bits``: [T, d] codes."""
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits)[None, None, :]
    return ((packed[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(len(packed), -1)


@register
class ColbertIndex(Index):
    """Passage token vectors of a ColBERT model, searched by centroid pruning + exact MaxSim."""

    kind: ClassVar[str] = "colbert"
    load_options: ClassVar[tuple[str, ...]] = (
        "model",
        "batch_size",
        "device",
        "precision",
        "show_progress",
        "nprobe",
        "candidates",
    )

    def __init__(
        self,
        model: ColBERT,
        compression: Compression = "fp16",
        residual_bits: int = 2,
        centroids: int | None = None,
        nprobe: int = 4,
        candidates: int = 256,
        batch_size: int = 64,
        device: torch.device | None = None,
        show_progress: bool = False,
        model_path: str | None = None,
        seed: int = 13,
        precision: str = "auto",
    ) -> None:
        if not isinstance(model, ColBERT):
            raise ConfigError(f"a colbert index needs a ColBERT model, got a {type(model).__name__}")
        float_precision(precision, device or default_device(), "colbert")  # a bad setting fails before any work
        if compression not in ("fp16", "residual"):
            raise ConfigError(f"unknown compression {compression!r} (use 'fp16' or 'residual')")
        if type(residual_bits) is not int or residual_bits not in (1, 2, 4, 8) or (model.dim * residual_bits) % 8:
            raise ConfigError(
                f"residual_bits must be 1, 2, 4 or 8 with dim x bits a multiple of 8, got {residual_bits}"
            )
        for name, value in (("centroids", centroids), ("nprobe", nprobe), ("candidates", candidates)):
            if value is not None or name != "centroids":  # centroids None: chosen from the corpus's size
                check_positive(name, value)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ConfigError(f"seed must be an integer, got {seed!r}")
        self.model, self.compression, self.residual_bits = model, compression, residual_bits
        self.n_centroids, self.nprobe, self.candidates, self.seed = centroids, nprobe, candidates, seed
        self.batch_size, self.device, self.show_progress = batch_size, device, show_progress
        self.precision = precision
        self.model_path = model_path or model.source
        self.passages = Corpus([], [], [], [])
        self.offsets = np.zeros(1, dtype=np.int64)
        self.codes = np.zeros(0, dtype=np.int32)
        self.centroids: np.ndarray | None = None
        self.vectors = np.zeros((0, model.dim), dtype=np.float16)
        self.residuals = np.zeros((0, model.dim * residual_bits // 8), dtype=np.uint8)
        self.bucket_cutoffs = np.zeros(0, dtype=np.float32)
        self.bucket_weights = np.zeros(0, dtype=np.float32)
        self._lists: tuple[np.ndarray, np.ndarray] | None = None  # centroid -> passages (CSR), built lazily
        self.model_fingerprint: str | None = None

    @classmethod
    def build(cls, model: ColBERT, passages: Passages, **options: Any) -> ColbertIndex:
        """Encode ``passages`` with ``model`` and index their token vectors."""
        index = cls(model, **options)
        index.add(passages)
        return index

    @property
    def n_tokens(self) -> int:
        """Token vectors stored."""
        return int(self.offsets[-1])

    def add(self, passages: Passages) -> None:
        """Encode ``passages`` and append their token vectors (the first call trains the centroids)."""
        corpus = as_corpus(passages, first_id=next_free_id(self.passages))
        vectors = self.model.encode_passages(
            corpus, self.batch_size, device=self.device, show_progress=self.show_progress, precision=self.precision
        )
        self.add_vectors(corpus, vectors)

    def add_vectors(self, passages: Passages, vectors: list[np.ndarray]) -> None:
        """Index passages whose token vectors were computed already (by this index's model)."""
        corpus = as_corpus(passages, first_id=next_free_id(self.passages))
        if len(vectors) != len(corpus) or any(v.ndim != 2 or v.shape[1] != self.model.dim for v in vectors):
            raise ConfigError(f"expected one [n_i, {self.model.dim}] array per passage for {len(corpus)} passages")
        flat = np.concatenate(vectors).astype(np.float32) if vectors else np.zeros((0, self.model.dim), np.float32)
        if self.centroids is None:
            self._train(flat)
        codes = self._assign(flat)
        self.passages = concat_corpora(self.passages, corpus) if len(self.passages) else corpus
        lengths = np.array([len(v) for v in vectors], dtype=np.int64)
        self.offsets = np.concatenate([self.offsets, self.offsets[-1] + np.cumsum(lengths)])
        self.codes = np.concatenate([self.codes, codes])
        if self.compression == "fp16":
            self.vectors = np.concatenate([self.vectors, flat.astype(np.float16)])
        else:
            residual = flat - self.centroids[codes]
            bucket = np.searchsorted(self.bucket_cutoffs, residual)
            self.residuals = np.concatenate([self.residuals, pack_bits(bucket, self.residual_bits)])
        self._lists = None

    def encode_new(self, corpus: Corpus) -> list[np.ndarray]:
        """The token vectors of ``corpus`` (for ``upsert``), by the index's model."""
        return self.model.encode_passages(
            corpus, self.batch_size, device=self.device, show_progress=self.show_progress, precision=self.precision
        )

    def append_encoded(self, corpus: Corpus, prepared: list[np.ndarray]) -> None:
        """Index ``corpus`` with its token vectors ``prepared``."""
        self.add_vectors(corpus, prepared)

    def upsert_vectors(self, passages: Passages, vectors: list[np.ndarray]) -> None:
        """``upsert`` of passages whose token vectors were computed already (by this index's model)."""
        corpus = records_corpus(passages)
        if len(vectors) != len(corpus) or any(v.ndim != 2 or v.shape[1] != self.model.dim for v in vectors):
            raise ConfigError(f"expected one [n_i, {self.model.dim}] array per passage for {len(corpus)} passages")
        self.upsert_encoded(corpus, vectors)

    def _compact(self, live: np.ndarray) -> None:
        """Keep the ``live`` rows' passages and token vectors (codes, and fp16 vectors or residuals); the centroids
        and residual buckets stay as trained."""
        tokens, starts = self._gather(live)
        self.passages = self.passages.subset(live.tolist())
        self.offsets = starts.astype(np.int64)
        self.codes = self.codes[tokens]
        if self.compression == "fp16":
            self.vectors = self.vectors[tokens]
        else:
            self.residuals = self.residuals[tokens]
        self._lists = None

    def _train(self, flat: np.ndarray) -> None:
        """k-means centroids of the first vectors (and, for residual compression, the residual buckets)."""
        if len(flat) == 0:
            raise ConfigError("the first passages added to a colbert index have no token vectors")
        import faiss  # imported where used, as in index.faiss_index: searching needs no FAISS

        k = min(self.n_centroids or max(1, int(4 * math.sqrt(len(flat)))), len(flat))
        kmeans = faiss.Kmeans(
            self.model.dim, k, niter=20, seed=self.seed, spherical=True, verbose=False, min_points_per_centroid=1
        )
        kmeans.train(np.ascontiguousarray(flat))
        self.centroids = kmeans.centroids.astype(np.float32)
        if self.compression == "residual":
            residual = (flat - self.centroids[self._assign(flat)]).ravel()
            levels = 1 << self.residual_bits
            self.bucket_cutoffs = np.quantile(residual, np.arange(1, levels) / levels).astype(np.float32)
            self.bucket_weights = np.quantile(residual, (np.arange(levels) + 0.5) / levels).astype(np.float32)

    def _assign(self, flat: np.ndarray) -> np.ndarray:
        """Nearest centroid (by inner product) of each vector."""
        codes = np.empty(len(flat), dtype=np.int32)
        for start in range(0, len(flat), 65_536):
            codes[start : start + 65_536] = (flat[start : start + 65_536] @ self.centroids.T).argmax(1)
        return codes

    def token_vectors(self, start: int, end: int) -> np.ndarray:
        """Stored token vectors ``start``..``end`` as float32 (decompressed when residual-compressed)."""
        if self.compression == "fp16":
            return self.vectors[start:end].astype(np.float32)
        return self._decompress(np.arange(start, end))

    def _decompress(self, tokens: np.ndarray) -> np.ndarray:
        residual = self.bucket_weights[unpack_bits(self.residuals[tokens], self.residual_bits)]
        return self.centroids[self.codes[tokens]] + residual

    def _gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token positions of passages ``rows`` (concatenated) and their segment starts."""
        lengths = self.offsets[rows + 1] - self.offsets[rows]
        starts = np.concatenate([[0], np.cumsum(lengths)])
        tokens = np.repeat(self.offsets[rows] - starts[:-1], lengths) + np.arange(starts[-1])
        return tokens, starts

    def _vectors_of(self, tokens: np.ndarray) -> np.ndarray:
        return self.vectors[tokens].astype(np.float32) if self.compression == "fp16" else self._decompress(tokens)

    def _inverted_lists(self) -> tuple[np.ndarray, np.ndarray]:
        """Per centroid, the distinct passages with a token there (CSR: indptr, passage rows)."""
        if self._lists is None:
            owner = np.repeat(np.arange(len(self.passages)), np.diff(self.offsets))
            pairs = np.unique(np.stack([self.codes.astype(np.int64), owner]), axis=1)
            indptr = np.searchsorted(pairs[0], np.arange(len(self.centroids) + 1))
            self._lists = (indptr, pairs[1])
        return self._lists

    def maxsim_rows(self, query: np.ndarray, rows: np.ndarray, centroids_only: bool = False) -> np.ndarray:
        """MaxSim of one query's vectors [Lq, dim] with passages ``rows`` (0 for a passage without tokens);
        ``centroids_only`` scores each token by its centroid (PLAID's approximation)."""
        rows = np.asarray(rows, dtype=np.int64)
        scores = np.zeros(len(rows), dtype=np.float32)
        filled = rows[self.offsets[rows + 1] > self.offsets[rows]]
        where = np.flatnonzero(self.offsets[rows + 1] > self.offsets[rows])
        if len(filled) == 0:
            return scores
        tokens, starts = self._gather(filled)
        if centroids_only:
            sims = (query @ self.centroids.T)[:, self.codes[tokens]]
        else:
            sims = query @ self._vectors_of(tokens).T
        scores[where] = segment_max_sum(sims, starts)
        return scores

    def encode_queries(self, queries: Any) -> np.ndarray:
        """Query vectors [n, Lq, dim]: texts are encoded by the model (too long ones cut, with a warning),
        an array is used as it is."""
        if is_vectors(queries):
            queries = np.asarray(queries, dtype=np.float32)
            if queries.ndim != 3 or queries.shape[2] != self.model.dim:
                raise ConfigError(f"query vectors must be [n, length, {self.model.dim}], got {list(queries.shape)}")
            return queries
        queries = check_queries(queries)
        config = self.model.config
        warn_long_queries(self.model.tokenizer, queries, config.query_max_length, int(config.markers))
        return self.model.encode_queries(queries, self.batch_size, device=self.device, precision=self.precision)

    def search_rows(self, queries: Any, k: int, exhaustive: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` (scores, rows) of each query, by centroid pruning + exact MaxSim (or exact MaxSim over
        every passage with ``exhaustive``)."""
        encoded = self.encode_queries(queries)
        k = min(k, len(self.passages))
        scores = np.zeros((len(encoded), k), dtype=np.float32)
        rows = np.full((len(encoded), k), -1, dtype=np.int64)
        everything = np.arange(len(self.passages))
        for i, query in enumerate(encoded):
            candidates = everything if exhaustive else self._candidates(query)
            exact = self.maxsim_rows(query, candidates)
            order = np.lexsort((candidates, -exact))[:k]
            scores[i, : len(order)], rows[i, : len(order)] = exact[order], candidates[order]
        return scores, rows

    def search(self, queries: Any, k: int = 10, exhaustive: bool = False) -> SearchResults:
        """The top-``k`` passages of each query (see the module docstring; ``exhaustive``: no pruning)."""
        if len(self) == 0:
            raise ConfigError("the index is empty: add passages before searching")
        search_rows = lambda encoded, depth: self.search_rows(encoded, depth, exhaustive)  # noqa: E731
        return SearchResults(*self.live_rows(search_rows, queries, check_k(k)), self.passages)

    def _candidates(self, query: np.ndarray) -> np.ndarray:
        """Passages in the inverted lists of the query vectors' ``nprobe`` closest centroids, cut to the best
        ``candidates`` by centroid-approximated MaxSim."""
        indptr, members = self._inverted_lists()
        nprobe = min(self.nprobe, len(self.centroids))
        probed = np.unique(np.argpartition(-(query @ self.centroids.T), nprobe - 1, axis=1)[:, :nprobe])
        found = np.unique(np.concatenate([members[indptr[c] : indptr[c + 1]] for c in probed]))
        if len(found) <= self.candidates:
            return found
        approx = self.maxsim_rows(query, found, centroids_only=True)
        keep = np.argpartition(-approx, self.candidates - 1)[: self.candidates]
        return found[np.sort(keep)]

    # ---- statistics and persistence --------------------------------------------------------------------

    def stats(self) -> dict:
        """Passages, token vectors, average tokens per passage and the bytes of what is stored."""
        stored = [getattr(self, name) for name in ARRAYS if getattr(self, name) is not None]
        return {
            "passages": len(self.passages),
            "token_vectors": self.n_tokens,
            "avg_tokens_per_passage": self.n_tokens / max(len(self.passages), 1),
            "centroids": 0 if self.centroids is None else len(self.centroids),
            "bytes": int(sum(a.nbytes for a in stored)),
        }

    def facts(self) -> dict:
        """Model path and fingerprint, storage and search options, statistics, for the manifest."""
        if self.model_fingerprint is None:
            self.model_fingerprint = fingerprint_weights(self.model)
        return {
            "model": {
                "path": self.model_path,
                "fingerprint": self.model_fingerprint,
                "settings": model_settings(self.model),  # what else shapes its embeddings (index.checks)
            },
            "dim": self.model.dim,
            "precision": encoded_precision(self.precision, self.device),  # reloaded, queries encode the same way
            "options": {
                "compression": self.compression,
                "residual_bits": self.residual_bits,
                "centroids": self.n_centroids,
                "nprobe": self.nprobe,
                "candidates": self.candidates,
                "seed": self.seed,
            },
            "stats": self.stats(),
        }

    def _write(self, directory: Path) -> None:
        for name in ARRAYS:
            np.save(directory / f"{name}.npy", getattr(self, name))

    def save(self, directory: str | Path) -> Path:
        """Write the index atomically (the model must be saved somewhere: the manifest records where)."""
        if self.model_path is None:
            raise ConfigError("save the model first (ColBERT.save) or give model_path")
        if self.centroids is None:
            raise ConfigError("the index is empty: add passages before saving")
        return super().save(directory)

    @classmethod
    def _read(
        cls, directory: Path, manifest: dict, passages: Corpus, model: Any = None, **options: Any
    ) -> ColbertIndex:
        recorded = manifest["model"]
        model = model_for_index(directory, "colbert", recorded, model, ColBERT)
        settings = {**manifest["options"], **precision_as_built(manifest, options)}
        if settings.get("centroids") == 0:  # written by a densepass that took 0 as "chosen from the corpus's size"
            settings["centroids"] = None
        index = cls(model, model_path=recorded["path"], **settings)
        for name in ARRAYS:
            setattr(index, name, np.load(directory / f"{name}.npy", allow_pickle=False))
        if len(index.offsets) != len(passages) + 1 or len(index.codes) != index.n_tokens:
            raise DataError(f"{directory}: token arrays do not match its {len(passages)} passages")
        index.passages = passages
        index.model_fingerprint = recorded["fingerprint"]
        return index
