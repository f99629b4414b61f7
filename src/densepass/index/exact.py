"""Exact maximum-inner-product search: chunked matrix products with a running top-k merge, on GPU
when one is present. Exact like FAISS ``IndexFlatIP``, without copying the corpus into an index.

Ties are broken by passage row (equal scores: the lower row first), so the result is one well-defined
list whatever the chunking: a corpus searched in shards by several processes (``index.sharded``) and
merged gives the same ids, scores and order as one process. (Equal up to float rounding only: the matrix
product of two chunkings may round two copies of one vector a unit in the last place apart, and they then
come in score order, not row order.)

``ReducedPassages`` holds a bf16 or int8 copy of the passages (int8: symmetric, one scale per passage) for
a first pass in reduced precision; ``exact_search(..., reduced=...)`` then re-scores each query's best
``rescore x k`` candidates of that pass in float32 from the full passages, so the top k and their scores are
fp32's unless a true top-k passage falls outside the candidates (a score error larger than the gap between
the k-th and the (rescore x k)-th passage; on unit vectors such errors are of the order of bf16's relative step,
2^-8, or int8's, 1/127). The copy is half (bf16) or a quarter (int8) of the float32 corpus; it is faster where the
device multiplies bf16 fast (GPUs, CPUs with AMX or AMD's AVX512-BF16: ``device.cpu_has_fast_bf16``), and slower
than float32 elsewhere.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

from densepass.errors import ConfigError, DensepassError

SEARCH_PRECISIONS = ("fp32", "bf16", "int8")
SCORE_BLOCK_BYTES = 256 << 20
"""The largest block of float32 scores (query chunk x passage chunk) a search holds at once: with the top-k
selection's temporaries, a search's memory is a few times this, whatever the corpus and query counts."""


def score_block_queries(passage_chunk: int) -> int:
    """Queries per chunk so that a chunk's scores against ``passage_chunk`` passages fit ``SCORE_BLOCK_BYTES``."""
    return max(1, SCORE_BLOCK_BYTES // (4 * max(1, passage_chunk)))


def passages_on(passages: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``passages`` as a float32 tensor on ``device`` (on the CPU a float32 array, memory maps included, is shared,
    not copied): what a searcher keeps to search many times."""
    return _on(passages, device, torch.float32)


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


class ReducedPassages:
    """Passage embeddings in bf16, or in int8 with one float32 scale per passage (``x ≈ codes * scale``), on
    ``device``, scored against float32 queries chunk by chunk."""

    def __init__(
        self, passages: np.ndarray | torch.Tensor, precision: str, device: torch.device, chunk: int = 262_144
    ) -> None:
        if precision not in ("bf16", "int8"):
            raise ConfigError(f"reduced search precision must be bf16 or int8, got {precision!r}")
        self.precision, self.device, self.chunks, self.scales = precision, device, [], []
        for start in range(0, len(passages), chunk):
            rows = _on(passages[start : start + chunk], device, torch.float32)
            if precision == "bf16":
                self.chunks.append(rows.to(torch.bfloat16))
                continue
            scale = rows.abs().amax(1).clamp_min(1e-12) / 127
            self.chunks.append(torch.round(rows / scale[:, None]).to(torch.int8))
            self.scales.append(scale)
        self.size = len(passages)

    def chunk_scores(self, queries: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
        """Per chunk, a function giving the approximate float32 scores [len(queries), chunk rows]."""
        if self.precision == "bf16":
            q = queries.to(torch.bfloat16)
            return [lambda c=c: (q @ c.T).float() for c in self.chunks]
        compute = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        q = queries.to(compute)
        return [lambda c=c, s=s: (q @ c.to(compute).T).float() * s for c, s in zip(self.chunks, self.scales)]


def _top_k(chunk_scores: list[Callable[[], torch.Tensor]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best ``k`` (scores, rows) over chunks of consecutive passages, merged as they come, equal scores by row."""
    best_scores, best_ids, offset = None, None, 0
    for scores_of in chunk_scores:
        scores = scores_of()
        top_scores, top_ids = top_k_by_score_then_row(scores, k)
        top_ids += offset
        offset += scores.shape[1]
        if best_scores is None:
            best_scores, best_ids = top_scores, top_ids
        else:
            best_scores, best_ids = sort_by_score_then_row(
                torch.cat([best_scores, top_scores], 1), torch.cat([best_ids, top_ids], 1)
            )
            best_scores, best_ids = best_scores[:, :k], best_ids[:, :k]
    return best_scores, best_ids


def _rescored(
    q: torch.Tensor, passages: np.ndarray | torch.Tensor, candidates: torch.Tensor, k: int, budget: int = 1 << 25
) -> tuple[torch.Tensor, torch.Tensor]:
    """The best ``k`` of each query's ``candidates`` (rows), scored in float32 from the full ``passages``, a
    few queries at a time (at most ``budget`` gathered floats)."""
    step = max(1, budget // (candidates.shape[1] * q.shape[1]))
    out_scores, out_ids = [], []
    for start in range(0, len(q), step):
        rows = candidates[start : start + step].cpu().numpy()
        unique, inverse = np.unique(rows, return_inverse=True)  # each candidate read once, in order (memory maps)
        vectors = _on(passages[unique], q.device, torch.float32)
        vectors = vectors[torch.from_numpy(inverse.reshape(rows.shape)).to(q.device)]  # [queries, candidates, dim]
        scores = torch.einsum("qd,qcd->qc", q[start : start + step], vectors)
        top_scores, top_ids = sort_by_score_then_row(scores, candidates[start : start + step])
        out_scores.append(top_scores[:, :k])
        out_ids.append(top_ids[:, :k])
    return torch.cat(out_scores), torch.cat(out_ids)


@torch.inference_mode()
def exact_search(
    queries: np.ndarray | torch.Tensor,
    passages: np.ndarray | torch.Tensor,
    k: int,
    device: torch.device | None = None,
    query_chunk: int | None = None,
    passage_chunk: int = 262_144,
    half: bool = False,
    reduced: ReducedPassages | None = None,
    rescore: int = 4,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` (scores, indices) of every query by inner product, best first, equal scores by index; queries
    and passages in chunks (``query_chunk`` None: as many queries as keep a chunk's scores within
    ``SCORE_BLOCK_BYTES``).

    With ``reduced`` (a bf16 / int8 copy of ``passages``), a first pass over it keeps ``rescore x k``
    candidates per query, re-scored in float32 from ``passages`` (module docstring)."""
    if len(passages) == 0:
        raise DensepassError("cannot search an empty corpus")
    if queries.shape[1] != passages.shape[1]:
        raise DensepassError(f"query dim {queries.shape[1]} != passage dim {passages.shape[1]}")
    if rescore < 1:
        raise ConfigError(f"rescore must be >= 1, got {rescore}")
    if reduced is not None and reduced.size != len(passages):
        raise DensepassError(f"the reduced copy holds {reduced.size} passages, the corpus {len(passages)}")
    device = (
        reduced.device
        if reduced is not None
        else device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    k = min(k, len(passages))
    query_chunk = query_chunk or score_block_queries(min(passage_chunk, len(passages)))
    dtype = torch.float16 if half and device.type == "cuda" else torch.float32
    corpus_chunks = (
        []
        if reduced is not None
        else [_on(passages[s : s + passage_chunk], device, dtype) for s in range(0, len(passages), passage_chunk)]
    )
    all_scores = np.empty((len(queries), k), dtype=np.float32)
    all_ids = np.empty((len(queries), k), dtype=np.int64)
    for qs in range(0, len(queries), query_chunk):
        q = _on(queries[qs : qs + query_chunk], device, torch.float32)
        if reduced is None:
            qd = q.to(dtype)
            best_scores, best_ids = _top_k([lambda c=c, qd=qd: (qd @ c.T).float() for c in corpus_chunks], k)
        else:
            _, candidates = _top_k(reduced.chunk_scores(q), min(len(passages), rescore * k))
            best_scores, best_ids = _rescored(q, passages, candidates, k)
        all_scores[qs : qs + len(q)] = best_scores.cpu().numpy()
        all_ids[qs : qs + len(q)] = best_ids.cpu().numpy()
    return all_scores, all_ids
