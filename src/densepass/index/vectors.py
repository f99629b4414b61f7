"""A dense index's passage embeddings for any other store: NumPy arrays and an Arrow table, read-only.

What a dense index (``exact`` and the FAISS kinds: ``index.dense``) holds per passage is one float32 vector, the
one its model encoded; these functions hand those vectors out with the passages' ids (and titles and texts), the
live passages only (a passage deleted from the index and not yet compacted away is left out), in row order. The
vectors are the index's own (a memory map for a loaded index: ``live_embeddings`` copies only where passages
were deleted), so a store filled from them answers inner-product (or, for a normalising model, cosine) queries
exactly as the index does. ``densepass export INDEX --to qdrant`` (``pipelines.vector_export``) is built on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa


class DenseIndex(Protocol):
    """What these functions read of a dense index (``index.dense.DenseIndex``; named here without importing
    it, which imports this module): its passages, their float32 embeddings and their dimension."""

    passages: Any
    embeddings: np.ndarray
    dim: int


def live_rows(index: DenseIndex) -> np.ndarray:
    """The rows (int64, ascending) of the passages the index searches: every row, less the deleted ones."""
    deleted = getattr(index, "deleted", None)  # the flags of a living index (index.base), where it has them
    rows = len(index.passages)
    if deleted is None or not np.asarray(deleted).any():
        return np.arange(rows, dtype=np.int64)
    return np.flatnonzero(~np.asarray(deleted, dtype=bool)).astype(np.int64)


def live_embeddings(index: DenseIndex) -> tuple[list[str], np.ndarray]:
    """(passage ids, float32 embeddings [n, dim]) of the live passages, in row order."""
    rows = live_rows(index)
    ids = index.passages.ids
    if len(rows) == len(ids):
        return list(ids), index.embeddings
    return [ids[r] for r in rows.tolist()], np.asarray(index.embeddings[rows], dtype=np.float32)


def embeddings_table(index: DenseIndex, texts: bool = True) -> pa.Table:
    """The live passages as an Arrow table: ``id`` (string), ``title`` and ``text`` (strings; left out when
    ``texts`` is false) and ``embedding`` (a fixed-size list of ``dim`` float32), one row per passage."""
    import pyarrow as pa

    rows = live_rows(index)
    ids, embeddings = live_embeddings(index)
    flat = pa.array(np.ascontiguousarray(embeddings, dtype=np.float32).reshape(-1), type=pa.float32())
    columns = {"id": pa.array(ids, type=pa.string())}
    if texts:
        passages = index.passages
        every = len(rows) == len(passages)
        columns["title"] = pa.array(list(passages.titles) if every else [passages.titles[r] for r in rows.tolist()])
        columns["text"] = pa.array(list(passages.texts) if every else [passages.texts[r] for r in rows.tolist()])
    columns["embedding"] = pa.FixedSizeListArray.from_arrays(flat, index.dim)
    return pa.table(columns)
