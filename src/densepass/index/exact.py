"""Exact maximum-inner-product search: chunked matrix products with a running top-k merge, on GPU
when one is present. Exact like FAISS ``IndexFlatIP``, without copying the corpus into an index."""

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
    """Top-``k`` (scores, indices) of every query by inner product, best first."""
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
            scores = (q @ chunk.T).float()
            top_scores, top_ids = scores.topk(min(k, chunk.shape[0]), dim=1)
            top_ids += offset
            offset += chunk.shape[0]
            if best_scores is None:
                best_scores, best_ids = top_scores, top_ids
            else:
                merged_scores = torch.cat([best_scores, top_scores], 1)
                merged_ids = torch.cat([best_ids, top_ids], 1)
                best_scores, pos = merged_scores.topk(min(k, merged_scores.shape[1]), dim=1)
                best_ids = merged_ids.gather(1, pos)
        all_scores[qs : qs + len(q)] = best_scores.cpu().numpy()
        all_ids[qs : qs + len(q)] = best_ids.cpu().numpy()
    return all_scores, all_ids
