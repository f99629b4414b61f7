"""Bilinear similarities between training instances: sim(q_i, p_j) = Q_i . P_j.

Both similarities ABS uses have this form: the encoder's dot product (Q, P = query and positive
passage embeddings) and BM25 (Q = query term counts, P = the positive passage's BM25 term weights).
Because of it the hardness of a batch B (eq. 1) is

    h(B) = sum_{i != j in B} Q_i . P_j = (sum_B Q) . (sum_B P) - sum_{i in B} Q_i . P_i,

so two running sums per batch give any candidate's effect on h with one matrix-vector product.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
import torch

from densepass.errors import ConfigError


class BilinearSimilarity:
    """Instance-level Q [N, D] and P [N, D] (dense, or sparse CSR for BM25) on one device."""

    def __init__(self, queries, passages, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if queries.shape != passages.shape:
            raise ConfigError(f"query and passage matrices differ in shape: {queries.shape} vs {passages.shape}")
        if queries.shape[0] == 0:
            raise ConfigError("no training instances to schedule")
        self.device = torch.device(device)
        self.dtype = dtype
        self.sparse = sp.issparse(queries)
        self.n, self.dim = queries.shape
        if self.sparse:
            q, p = sp.csr_matrix(queries, dtype=np.float64), sp.csr_matrix(passages, dtype=np.float64)
            self.self_sim = torch.as_tensor(np.asarray(q.multiply(p).sum(1)).ravel(), dtype=dtype, device=self.device)
            self.stacked = _to_torch_csr(sp.hstack([q, p], format="csr"), self.device, dtype)  # [N, 2D]
            self._q_rows, self._p_rows = q, p
        else:
            q = torch.as_tensor(np.asarray(queries)).to(self.device, dtype)
            p = torch.as_tensor(np.asarray(passages)).to(self.device, dtype)
            self.self_sim = (q * p).sum(1)
            self.stacked = torch.cat([q, p], 1)  # [N, 2D]: row i = [Q_i, P_i]

    def sums(self, members: Sequence[int]) -> torch.Tensor:
        """[sum Q, sum P] over ``members`` as one dense vector of length 2D."""
        if self.sparse:
            idx = list(members)
            q = np.asarray(self._q_rows[idx].sum(0)).ravel()
            p = np.asarray(self._p_rows[idx].sum(0)).ravel()
            return torch.as_tensor(np.concatenate([q, p]), dtype=self.dtype, device=self.device)
        return self.stacked[torch.as_tensor(list(members), device=self.device)].sum(0)

    def row(self, i: int) -> torch.Tensor:
        """[Q_i, P_i] as a dense vector of length 2D."""
        return self.dense_rows(torch.tensor([i], device=self.device))[0]

    def dense_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[Q_i, P_i] for each of ``ids`` as a dense [k, 2D] matrix."""
        if self.sparse:
            idx = ids.cpu().numpy()
            rows = sp.hstack([self._q_rows[idx], self._p_rows[idx]], format="csr").toarray()
            return torch.as_tensor(rows, dtype=self.dtype, device=self.device)
        return self.stacked[ids]

    def cross(self, sums: torch.Tensor, rows: torch.Tensor | None = None, matrix=None) -> torch.Tensor:
        """For each instance a: Q_a . (sum P) + P_a . (sum Q), given ``sums`` = [sum Q, sum P].

        This is how much a adds to h(B) when it joins B (the batch the sums describe). ``sums`` may
        be [2D] or [2D, k] (k batches at once). ``rows`` restricts the product to some instances;
        ``matrix`` is a precomputed ``rows_matrix(rows)`` for repeated products over the same rows.
        """
        swapped = torch.cat([sums[self.dim :], sums[: self.dim]])  # [sum P, sum Q]
        if matrix is None:
            matrix = self.stacked if rows is None else self.rows_matrix(rows)
        if swapped.dim() == 1:
            return (matrix @ swapped.unsqueeze(1)).squeeze(1)
        return matrix @ swapped

    def cross_own(self, sums: torch.Tensor, members: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """For k batches at once, each member d's ``cross`` with its own batch's sums: [k, b] from ``sums`` [k, 2D]
        and ``members`` [k, b]. This is c(d) + 2 Q_d.P_d of eq. 3 for every member, read from the members' rows
        alone instead of a product over all of U. ``rows``: the members' stacked rows [k, b, 2D] when the caller
        keeps them (dense instances), which spares gathering them."""
        swapped = self._swapped_rows(sums)
        if not self.sparse:
            rows = self.stacked[members] if rows is None else rows
            return torch.bmm(rows, swapped.unsqueeze(2)).squeeze(2)
        k, b = members.shape  # sparse rows: every batch's sums against all k*b members, then each batch's own
        every = self.rows_matrix(members.reshape(-1)) @ swapped.T  # [k*b, k]
        return every.reshape(k, b, k)[torch.arange(k, device=self.device), :, torch.arange(k, device=self.device)]

    def cross_each(self, sums: torch.Tensor, matrix) -> torch.Tensor:
        """``cross`` for k batches at once laid out one row per batch: [k, M] from ``sums`` [k, 2D] and ``matrix``
        = ``rows_matrix`` of M instances, so each batch's arg-max over the instances reads contiguous memory
        (dense instances; for sparse ones it is a transposed view of the sparse product)."""
        swapped = self._swapped_rows(sums)
        if self.sparse:
            return (matrix @ swapped.T).T
        return swapped @ matrix.T

    def _swapped_rows(self, sums: torch.Tensor) -> torch.Tensor:
        """[sum P, sum Q] for each row of ``sums`` [k, 2D] = [sum Q, sum P]: what a row of [Q | P] is multiplied by."""
        return torch.cat([sums[:, self.dim :], sums[:, : self.dim]], 1)

    def rows_matrix(self, rows: torch.Tensor):
        """The stacked [Q | P] rows of some instances, in the form ``cross`` multiplies."""
        if self.sparse:
            idx = rows.cpu().numpy()
            return _to_torch_csr(
                sp.hstack([self._q_rows[idx], self._p_rows[idx]], format="csr"), self.device, self.dtype
            )
        return self.stacked[rows]

    def dense_matrix(self) -> np.ndarray:
        """The full [N, N] similarity matrix S_ij = sim(q_i, p_j) (small N only: tests, references)."""
        if self.sparse:
            return (self._q_rows @ self._p_rows.T).toarray()
        q, p = self.stacked[:, : self.dim].double(), self.stacked[:, self.dim :].double()
        return (q @ p.T).cpu().numpy()


def _to_torch_csr(matrix: sp.csr_matrix, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        return torch.sparse_csr_tensor(
            torch.as_tensor(matrix.indptr, dtype=torch.int64),
            torch.as_tensor(matrix.indices, dtype=torch.int64),
            torch.as_tensor(matrix.data),
            size=matrix.shape,
            check_invariants=False,
        ).to(device=device, dtype=dtype)


def batch_hardness(similarity: np.ndarray, batch: Sequence[int]) -> float:
    """Eq. 1 literally: h(B) = sum over ordered pairs i != j in B of S_ij."""
    idx = np.asarray(batch)
    block = similarity[np.ix_(idx, idx)]
    return float(block.sum() - np.trace(block))


def bm25_instance_matrices(
    queries: Sequence[str], passages: Sequence[str], passage_of: Sequence[int], k1: float = 0.9, b: float = 0.4
):
    """(Q, P, retriever): sparse matrices with Q_i . P_j = BM25(query i, passage ``passage_of[j]``),
    scored by bm25s over the collection ``passages`` (the distinct positive passages)."""
    from densepass.index.bm25 import bm25s, english_stemmer  # bm25s as that module imports it (its JAX setting)

    stemmer = english_stemmer()
    corpus_tokens = bm25s.tokenize(list(passages), stopwords="en", stemmer=stemmer, show_progress=False)
    retriever = bm25s.BM25(k1=k1, b=b)
    retriever.index(corpus_tokens, show_progress=False)
    s = retriever.scores
    n_terms = len(s["indptr"]) - 1  # bm25s leaves the empty token out of its score matrix
    vocab = {t: i for t, i in corpus_tokens.vocab.items() if i < n_terms}
    weights = sp.csc_matrix((s["data"], s["indices"], s["indptr"]), shape=(s["num_docs"], n_terms)).tocsr()
    query_tokens = bm25s.tokenize(list(queries), stopwords="en", stemmer=stemmer, show_progress=False, return_ids=False)
    rows, cols = [], []
    for i, tokens in enumerate(query_tokens):
        for tok in tokens:
            if tok in vocab:
                rows.append(i)
                cols.append(vocab[tok])
    counts = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(queries), n_terms))
    return counts, weights[np.asarray(passage_of)], retriever


def mean_hardness(sim: BilinearSimilarity, batches: list[list[int]]) -> float:
    """Mean h(B) (eq. 1) over batches, from the running-sum identity h = sQ.sP - sum Q_i.P_i."""
    values = []
    for batch in batches:
        sums = sim.sums(batch)
        values.append(
            float(sums[: sim.dim] @ sums[sim.dim :] - sim.self_sim[torch.as_tensor(batch, device=sim.device)].sum())
        )
    return float(np.mean(values)) if values else 0.0
