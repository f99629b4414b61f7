"""An inverted index of SPLADE term weights on SciPy sparse matrices, searched term at a time.

The passages' weights are stored term-major: a CSR matrix [|V|, n] whose row j is term j's postings list
(passage rows and impacts). A batch of queries [q, |V|] (CSR, a handful of terms each) times that matrix
is SciPy's sparse-sparse product, which walks only the postings of the queries' terms and accumulates the
scores of the passages found there: term-at-a-time evaluation of an inverted index, exactly the dot
products of the weights (neural-retrieval-lecture: "sparse-vector products"). Passages that share no term
with a query score 0 and are not returned.

Optional pruning at indexing time keeps each passage's ``top_terms`` heaviest terms. ``stats`` reports the
average non-zeros per passage and per query and the FLOPS estimate of Paria et al., the expected number of
multiplications of one query-passage dot product, sum_j P(query uses j) P(passage uses j).

A query whose weights are all zero (an empty query, or only words the model gives no weight) has no
hits: its row of the results is all -1, with one ``DataWarning`` per search call that met any. A query
longer than the model's ``query_max_length`` tokens is cut there (as every encoder here does), with one
``DataWarning`` per search call saying how many were.

>>> from densepass.models.splade import SpladeEncoder
>>> model = SpladeEncoder.from_pretrained("all-MiniLM-L6-v2")
>>> index = SpladeIndex.build(model, ["tar archiving utility", "X11 window manager"], device=torch.device("cpu"))
>>> index.search(["window manager"], k=1).ids(0)
['1']
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import scipy.sparse as sp
import torch

from densepass.data.dataset import Corpus
from densepass.device import default_device
from densepass.errors import ConfigError, DataError, DataWarning
from densepass.fingerprints import fingerprint_weights
from densepass.index.base import (
    Index,
    Passages,
    as_corpus,
    check_positive,
    check_queries,
    concat_corpora,
    is_vectors,
    next_free_id,
    records_corpus,
    register,
)
from densepass.index.checks import encoded_precision, model_for_index, model_settings, precision_as_built
from densepass.models.copies import float_precision
from densepass.models.inputs import warn_long_queries
from densepass.models.splade import SpladeEncoder

POSTINGS = "postings.npz"
QUERY_CHUNK = 256  # queries scored at once (bounds the dense [chunk, n] score block)


def top_k_rows(scores: sp.csr_matrix, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` (scores, columns) of each row of a sparse score matrix, best first (ties: lower column
    first); -1 columns and 0 scores where a row has fewer than ``k`` non-zero entries."""
    n = scores.shape[0]
    out_scores = np.zeros((n, k), dtype=np.float32)
    out_rows = np.full((n, k), -1, dtype=np.int64)
    for i in range(n):
        start, end = scores.indptr[i], scores.indptr[i + 1]
        values, columns = scores.data[start:end], scores.indices[start:end]
        positive = values > 0
        values, columns = values[positive], columns[positive]
        order = np.lexsort((columns, -values))[:k]
        out_scores[i, : len(order)] = values[order]
        out_rows[i, : len(order)] = columns[order]
    return out_scores, out_rows


@register
class SpladeIndex(Index):
    """Passages' SPLADE term weights in an inverted index; ``search`` takes query texts or a CSR matrix."""

    kind: ClassVar[str] = "splade"
    load_options: ClassVar[tuple[str, ...]] = ("model", "batch_size", "device", "precision", "show_progress")

    def __init__(
        self,
        model: SpladeEncoder,
        top_terms: int | None = None,
        batch_size: int = 64,
        device: torch.device | None = None,
        show_progress: bool = False,
        model_path: str | None = None,
        precision: str = "auto",
    ) -> None:
        if not isinstance(model, SpladeEncoder):
            raise ConfigError(f"a splade index needs a SPLADE model, got a {type(model).__name__}")
        float_precision(precision, device or default_device(), "splade")  # a bad setting fails before any work
        if top_terms is not None:
            check_positive("top_terms", top_terms)
        if batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {batch_size}")
        self.model, self.top_terms, self.batch_size, self.device = model, top_terms, batch_size, device
        self.show_progress, self.precision = show_progress, precision
        self.model_path = model_path or model.source
        self.passages = Corpus([], [], [], [])
        self.postings = sp.csr_matrix((model.dim, 0), dtype=np.float32)  # [|V|, n]
        self.model_fingerprint: str | None = None

    @classmethod
    def build(cls, model: SpladeEncoder, passages: Passages, **options: Any) -> SpladeIndex:
        """Encode ``passages`` (a Corpus, texts, or {id, title, text} records) with ``model`` and index them."""
        index = cls(model, **options)
        index.add(passages)
        return index

    def add(self, passages: Passages) -> None:
        """Encode ``passages`` and append their postings."""
        corpus = as_corpus(passages, first_id=next_free_id(self.passages))
        weights = self.model.encode_passages(
            corpus,
            self.batch_size,
            device=self.device,
            show_progress=self.show_progress,
            top_terms=self.top_terms,
            precision=self.precision,
        )
        self.add_weights(corpus, weights)

    def add_weights(self, passages: Passages, weights: sp.spmatrix) -> None:
        """Index passages whose term weights [n, |V|] were computed already (by this index's model)."""
        corpus = as_corpus(passages, first_id=next_free_id(self.passages))
        weights = sp.csr_matrix(weights, dtype=np.float32)
        if weights.shape != (len(corpus), self.model.dim):
            raise ConfigError(
                f"weights of shape {weights.shape} for {len(corpus)} passages of a {self.model.dim} vocabulary"
            )
        self.passages = concat_corpora(self.passages, corpus) if len(self.passages) else corpus
        self.postings = sp.hstack([self.postings, weights.T.tocsr()], format="csr")
        self.postings.sort_indices()

    def encode_new(self, corpus: Corpus) -> sp.csr_matrix:
        """The term weights of ``corpus`` (for ``upsert``), by the index's model."""
        return self.model.encode_passages(
            corpus,
            self.batch_size,
            device=self.device,
            show_progress=self.show_progress,
            top_terms=self.top_terms,
            precision=self.precision,
        )

    def append_encoded(self, corpus: Corpus, prepared: sp.spmatrix) -> None:
        """Index ``corpus`` with its term weights ``prepared``."""
        self.add_weights(corpus, prepared)

    def upsert_weights(self, passages: Passages, weights: sp.spmatrix) -> None:
        """``upsert`` of passages whose term weights [n, |V|] were computed already (by this index's model)."""
        corpus = records_corpus(passages)
        weights = sp.csr_matrix(weights, dtype=np.float32)
        if weights.shape != (len(corpus), self.model.dim):
            raise ConfigError(
                f"weights of shape {weights.shape} for {len(corpus)} passages of a {self.model.dim} vocabulary"
            )
        self.upsert_encoded(corpus, weights)

    def _compact(self, live: np.ndarray) -> None:
        """Keep the ``live`` rows' passages and postings (the columns of the term-major matrix)."""
        self.passages = self.passages.subset(live.tolist())
        self.postings = self.postings[:, live].tocsr()
        self.postings.sort_indices()

    def encode_queries(self, queries: Any) -> sp.csr_matrix:
        """Query term weights: texts are encoded by the model, a sparse or dense [n, |V|] matrix is used as it is."""
        if sp.issparse(queries) or is_vectors(queries):
            matrix = sp.csr_matrix(
                np.asarray(queries) if isinstance(queries, torch.Tensor) else queries, dtype=np.float32
            )
            if matrix.shape[1] != self.model.dim:
                raise ConfigError(f"query weights must be [n, {self.model.dim}], got {list(matrix.shape)}")
            return matrix
        queries = check_queries(queries)
        warn_long_queries(self.model.tokenizer, queries, self.model.config.query_max_length)
        return self.model.encode_queries(queries, self.batch_size, device=self.device, precision=self.precision)

    def search_rows(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` (scores, rows) of each query; rows -1 past the passages sharing a term with it."""
        weights = self.encode_queries(queries)
        empty = int((np.diff(weights.indptr) == 0).sum())
        if empty:
            warnings.warn(
                f"{empty} of {weights.shape[0]} queries have no term with a non-zero weight: they have no hits",
                DataWarning,
                stacklevel=2,
            )
        k = min(k, len(self.passages))
        parts = [
            top_k_rows(weights[s : s + QUERY_CHUNK] @ self.postings, k) for s in range(0, weights.shape[0], QUERY_CHUNK)
        ]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    # ---- statistics ---------------------------------------------------------------------------------------

    def stats(self, query_weights: sp.spmatrix | None = None) -> dict:
        """Average non-zeros per passage, postings, index bytes, and with query weights the average
        non-zeros per query and the FLOPS estimate sum_j P(q_j != 0) P(d_j != 0)."""
        n = max(len(self.passages), 1)
        document_frequency = np.diff(self.postings.indptr)
        facts = {
            "passages": len(self.passages),
            "postings": int(self.postings.nnz),
            "avg_nnz_per_passage": float(self.postings.nnz / n),
            "terms_used": int((document_frequency > 0).sum()),
            "bytes": int(self.postings.data.nbytes + self.postings.indices.nbytes + self.postings.indptr.nbytes),
        }
        if query_weights is not None:
            q = sp.csr_matrix(query_weights)
            nq = max(q.shape[0], 1)
            query_frequency = np.bincount(q.indices, minlength=self.model.dim)
            facts["avg_nnz_per_query"] = float(q.nnz / nq)
            facts["flops"] = float((query_frequency / nq) @ (document_frequency / n))
        return facts

    # ---- persistence --------------------------------------------------------------------------------------

    def facts(self) -> dict:
        """Model path and fingerprint, pruning, vocabulary size and postings statistics, for the manifest."""
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
            "options": {"top_terms": self.top_terms},
            "stats": self.stats(),
        }

    def _write(self, directory: Path) -> None:
        sp.save_npz(directory / POSTINGS, self.postings, compressed=False)

    def save(self, directory: str | Path) -> Path:
        """Write the index atomically (the model must be saved somewhere: the manifest records where)."""
        if self.model_path is None:
            raise ConfigError("save the model first (SpladeEncoder.save) or give model_path")
        return super().save(directory)

    @classmethod
    def _read(cls, directory: Path, manifest: dict, passages: Corpus, model: Any = None, **options: Any) -> SpladeIndex:
        recorded = manifest["model"]
        model = model_for_index(directory, "splade", recorded, model, SpladeEncoder)
        options = precision_as_built(manifest, options)
        index = cls(model, model_path=recorded["path"], **options, **manifest["options"])
        postings = sp.load_npz(directory / POSTINGS).tocsr()
        if postings.shape != (manifest["dim"], len(passages)):
            raise DataError(f"{directory}: postings of shape {postings.shape} for {len(passages)} passages")
        index.passages, index.postings = passages, postings.astype(np.float32)
        index.model_fingerprint = recorded["fingerprint"]
        return index
