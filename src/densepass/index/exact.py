"""Exact maximum-inner-product search: chunked matrix products with a running top-k merge, on GPU
when one is present. Exact like FAISS ``IndexFlatIP``, without copying the corpus into an index.

Ties are broken by passage row (equal scores: the lower row first), so the result is one well-defined
list whatever the chunking: a corpus searched in shards by several processes (``index.sharded``) and
merged gives the same ids, scores and order as one process.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from densepass.errors import DensepassError


def _on(rows: np.ndarray | torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if torch.is_tensor(rows):
        return rows.to(device, dtype)
    with warnings.catch_warnings():  # a read-only memory map: searching never writes to it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(rows)).to(device, dtype)


def sort_by_score_then_row(scores: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each line of (``scores``, ``rows``) sorted by score, best first, equal scores by row (rows of a line
    are distinct)."""
    by_row = rows.argsort(dim=1)
    scores, rows = scores.gather(1, by_row), rows.gather(1, by_row)
    order = scores.sort(dim=1, descending=True, stable=True).indices
    return scores.gather(1, order), rows.gather(1, order)


def top_k_by_score_then_row(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` (scores, column indices) of each line of ``scores``, best first, equal scores by column.

    ``topk`` alone keeps an arbitrary subset of the passages tied at the k-th score; lines with such a tie
    (rare: an extra comparison pass finds them) are redone with a stable sort of their candidates."""
    k = min(k, scores.shape[1])
    top, cols = scores.topk(k, dim=1)
    if k:
        kth = top[:, -1:]
        for line in ((scores >= kth).sum(1) > k).nonzero().flatten().tolist():
            candidates = (scores[line] >= kth[line]).nonzero().flatten()  # ascending columns
            keep = scores[line, candidates].sort(descending=True, stable=True).indices[:k]
            cols[line] = candidates[keep]
            top[line] = scores[line, cols[line]]
    return sort_by_score_then_row(top, cols)


@torch.inference_mode()
def exact_search(
    queries: np.ndarray | torch.Tensor,
    passages: np.ndarray | torch.Tensor,
    k: int,
    device: torch.device | None = None,
    query_chunk: int = 4096,
    passage_chunk: int = 262_144,
    half: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` (scores, indices) of every query by inner product, best first, equal scores by index."""
    if len(passages) == 0:
        raise DensepassError("cannot search an empty corpus")
    if queries.shape[1] != passages.shape[1]:
        raise DensepassError(f"query dim {queries.shape[1]} != passage dim {passages.shape[1]}")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    k = min(k, len(passages))
    dtype = torch.float16 if half and device.type == "cuda" else torch.float32
    corpus_chunks = [
        _on(passages[s : s + passage_chunk], device, dtype) for s in range(0, len(passages), passage_chunk)
    ]
    all_scores = np.empty((len(queries), k), dtype=np.float32)
    all_ids = np.empty((len(queries), k), dtype=np.int64)
    for qs in range(0, len(queries), query_chunk):
        q = _on(queries[qs : qs + query_chunk], device, dtype)
        best_scores, best_ids, offset = None, None, 0
        for chunk in corpus_chunks:
            top_scores, top_ids = top_k_by_score_then_row((q @ chunk.T).float(), k)
            top_ids += offset
            offset += chunk.shape[0]
            if best_scores is None:
                best_scores, best_ids = top_scores, top_ids
            else:
                best_scores, best_ids = sort_by_score_then_row(
                    torch.cat([best_scores, top_scores], 1), torch.cat([best_ids, top_ids], 1)
                )
                best_scores, best_ids = best_scores[:, :k], best_ids[:, :k]
        all_scores[qs : qs + len(q)] = best_scores.cpu().numpy()
        all_ids[qs : qs + len(q)] = best_ids.cpu().numpy()
    return all_scores, all_ids
