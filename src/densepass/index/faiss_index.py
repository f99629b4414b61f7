"""FAISS indexes over passage embeddings (inner product): flat, HNSW and IVF-PQ, with save/load."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from densepass.errors import ConfigError, DataError, DensepassError
from densepass.io import atomic_file

KINDS = ("faiss-flat", "faiss-hnsw", "faiss-ivfpq")
PQ_CODES = 256  # codes per sub-vector of the IVF-PQ's product quantiser (8 bits)


def check_trainable(kind: str, n: int) -> None:
    """A one-line error, before anything is encoded, where a ``kind`` index cannot be trained on ``n`` passages:
    an IVF-PQ's product quantiser learns ``PQ_CODES`` codes per sub-vector by k-means over the passages."""
    if kind == "faiss-ivfpq" and n < PQ_CODES:
        raise ConfigError(
            f"a faiss-ivfpq index trains {PQ_CODES} codes per sub-vector and needs at least {PQ_CODES} passages, "
            f"got {n}: index them exactly (exact, faiss-flat) or with faiss-hnsw"
        )


def build_faiss_index(
    embeddings: np.ndarray,
    kind: str = "faiss-flat",
    hnsw_m: int = 32,
    ivf_lists: int | None = None,
    pq_m: int | None = None,
    seed: int = 13,
):
    """An inner-product FAISS index of ``embeddings`` (float32, [n, d])."""
    import faiss

    if len(embeddings) == 0:
        raise DensepassError("cannot index an empty set of embeddings")
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    n, dim = x.shape
    check_trainable(kind, n)
    if kind == "faiss-flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "faiss-hnsw":
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = 128
    elif kind == "faiss-ivfpq":
        lists = ivf_lists or max(1, min(4096, int(4 * np.sqrt(n))))
        if n < lists * 39:  # FAISS wants >= 39 training points per list
            lists = max(1, n // 39)
        index = new_ivfpq(dim, lists, pq_m or default_pq_m(dim))
        rng = np.random.default_rng(seed)
        sample = x[rng.choice(n, size=min(n, 256 * max(lists, 256)), replace=False)]
        index.train(sample)
        index.nprobe = min(lists, 32)
    else:
        raise ConfigError(f"unknown index kind {kind!r} (known: exact, {', '.join(KINDS)})")
    index.add(x)
    return index


def default_pq_m(dim: int) -> int:
    """Product-quantiser sub-vectors for ``dim`` dimensions: one per 4 dimensions (or the nearest divisor)."""
    return next(c for c in (dim // 4, dim // 2, dim, 1) if c >= 1 and dim % c == 0)


def new_ivfpq(dim: int, lists: int, pq_m: int, pq_bits: int = 8):
    """An untrained inner-product IVF-PQ index: ``lists`` inverted lists over a flat coarse quantiser, codes
    of ``pq_m`` sub-vectors of ``pq_bits`` bits."""
    import faiss

    if dim % pq_m:
        raise ConfigError(f"pq_m={pq_m} must divide the embedding dimension {dim}")
    return faiss.IndexIVFPQ(faiss.IndexFlatIP(dim), dim, lists, pq_m, pq_bits, faiss.METRIC_INNER_PRODUCT)


def faiss_search(index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` (scores, rows) of each query from a FAISS index (rows -1 past what it found), best first, equal
    scores by row, as ``exact.top_k_by_score_then_row`` has them.

    FAISS orders tied scores as its heap leaves them, and keeps an arbitrary few of the passages tied at the k-th
    score: which duplicates come back then changed with ``k`` (and with a tombstone's deeper search). One result more
    than ``k`` shows a tie across the cut; such queries are searched deeper until the tie ends, and the lowest rows
    of it kept (a flat index only: an approximate one's results are only re-sorted)."""
    import faiss

    queries = np.ascontiguousarray(queries, dtype=np.float32)
    total = index.ntotal
    k = min(k, total)
    exact = isinstance(index, faiss.IndexFlat)  # approximate kinds: their order is re-sorted, not searched deeper
    fetch = min(k + 1, total) if exact else k
    scores, ids = index.search(queries, fetch)
    if k < fetch:
        for line in np.flatnonzero((scores[:, k - 1] == scores[:, k]) & (ids[:, k] >= 0)).tolist():
            depth, deep_scores, deep_ids = fetch, scores[line : line + 1], ids[line : line + 1]
            while depth < total:
                depth = min(2 * depth, total)
                deep_scores, deep_ids = index.search(queries[line : line + 1], depth)
                if deep_ids[0, -1] < 0 or deep_scores[0, -1] < deep_scores[0, k - 1]:
                    break
            top_scores, top_ids = _by_score_then_row(deep_scores, deep_ids)
            scores[line, :k], ids[line, :k] = top_scores[0, :k], top_ids[0, :k]
    return _by_score_then_row(scores[:, :k], ids[:, :k])


def _by_score_then_row(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each line sorted by score, best first, equal scores by row; rows -1 (nothing found) last."""
    missing = ids < 0
    order = np.lexsort((np.where(missing, np.iinfo(np.int64).max, ids), np.where(missing, np.inf, -scores)), axis=-1)
    return np.take_along_axis(scores, order, -1), np.take_along_axis(ids, order, -1)


def save_faiss_index(index, path: str | Path) -> None:
    """Write atomically (a temporary sibling, then rename: ``io.atomic_file``). The bytes go through Python's file
    API, so that a write that fails (a full disk: a one-line error) fails here, also the last one, which FAISS's
    own writer would only report on stderr when it closes the file."""
    import faiss

    with atomic_file(path, "wb") as handle:
        faiss.write_index(index, faiss.PyCallbackIOWriter(handle.write))


def load_faiss_index(path: str | Path, rows: int | None = None, dim: int | None = None, flags: int = 0):
    """Read a FAISS index file written by ``save_faiss_index``. A file FAISS refuses (its reader checks sizes and
    neighbour ids and raises ``RuntimeError``), or one that holds another number of vectors than ``rows`` or
    vectors of another dimension than ``dim`` (what the index's manifest and embeddings say), is one ``DataError``
    naming it: a file changed under a manifest rewritten to match it, a copy from another index. ``flags``: FAISS's
    ``IO_FLAG_*`` (an on-disk index's)."""
    import faiss

    if not Path(path).is_file():
        raise DensepassError(f"index file not found: {path}")
    try:
        index = faiss.read_index(str(path), flags)
    except (RuntimeError, MemoryError) as err:  # FAISS's own checks; a size in the header past the memory
        said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        said = said.split("Error: ", 1)[-1]  # drop FAISS's "Error in <function> at <file>:<line>:" prefix
        raise DataError(f"{path} does not load as a FAISS index (damaged?): {said[:300]}") from None
    if rows is not None and index.ntotal != rows:
        raise DataError(f"{path} holds {index.ntotal} vectors, the index {rows} (damaged, or another index's?)")
    if dim is not None and index.d != dim:
        raise DataError(f"{path} holds vectors of dimension {index.d}, the index {dim} (damaged, or another index's?)")
    flat = _flat_vectors(index)
    if flat is not None and not np.isfinite(flat).all():  # NaN scores for every query that meets them
        raise DataError(f"{path} holds vectors with NaN or infinity (damaged?): build the index again")
    return index


def _flat_vectors(index) -> np.ndarray | None:
    """The float32 vectors a flat index (or an HNSW index's flat storage) keeps as they are; None for other kinds
    (their codes are integers)."""
    import faiss

    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexHNSW) and index.storage is not None:
        index = faiss.downcast_index(index.storage)
    if not isinstance(index, faiss.IndexFlat):
        return None
    return faiss.vector_to_array(index.codes).view(np.float32)
