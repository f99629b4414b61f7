"""Exact search over phrases: the top-k (start, end) token pairs by start score + end score, under the span
constraint (same passage, start <= end < start + max_answer_tokens, both tokens kept by the filter), and
the top-k passages by their best phrase (DensePhrases' passage retrieval, training-inference-gap §6.3).

Tokens are the rows of a corpus-wide token table: passage p holds rows ``bounds[p]:bounds[p + 1]``, so a
phrase (i, j) is valid when j < ``limit[i]`` = min(end of i's passage, i + max_answer_tokens). Scores are
computed for every valid pair at once (a [queries, tokens, max_answer_tokens] block, chunked by queries), so
the search is exact: the tests compare it with an enumeration of every pair.

>>> import torch
>>> a = torch.tensor([[0.0, 2.0, 1.0]])       # start scores of 3 tokens
>>> b = torch.tensor([[1.0, 0.0, 3.0]])       # end scores
>>> limit = span_limits(torch.tensor([0, 3]), max_answer_tokens=2)
>>> scores, starts, ends = top_spans(a, b, limit, k=2)
>>> scores.tolist(), starts.tolist(), ends.tolist()   # (1, 2): 2 + 3; (2, 2): 1 + 3; (0, 2) is too long
([[5.0, 4.0]], [[1, 2]], [[2, 2]])
"""

from __future__ import annotations

import torch

ELEMENTS_PER_CHUNK = 1 << 25  # scores materialised at once (128 MiB of float32)


def span_limits(bounds: torch.Tensor, max_answer_tokens: int) -> torch.Tensor:
    """``limit[i]``: one past the last row a phrase starting at row i may end on."""
    lengths = bounds[1:] - bounds[:-1]
    passage_end = torch.repeat_interleave(bounds[1:], lengths)
    rows = torch.arange(int(bounds[-1]), dtype=bounds.dtype)
    return torch.minimum(passage_end, rows + max_answer_tokens)


def _span_block(a: torch.Tensor, b: torch.Tensor, limit: torch.Tensor, width: int) -> torch.Tensor:
    """Scores [Q, N, width]: ``a[q, i] + b[q, i + l]``, -inf where (i, i + l) is not a valid phrase."""
    n = a.shape[1]
    padded = torch.cat([b, b.new_full((b.shape[0], width - 1), float("-inf"))], dim=1)
    ends = padded.unfold(1, width, 1)[:, :n]  # [Q, N, width] view: ends[q, i, l] = b[q, i + l]
    valid = torch.arange(width, device=a.device)[None, :] < (limit - torch.arange(n, device=a.device))[:, None]
    return (a[:, :, None] + ends).masked_fill(~valid, float("-inf"))


def _width(limit: torch.Tensor) -> int:
    """The longest phrase any row allows (at least 1)."""
    n = len(limit)
    return max(1, int((limit - torch.arange(n, dtype=limit.dtype)).max())) if n else 1


def _query_chunks(q: int, n: int, width: int) -> list[tuple[int, int]]:
    """Query ranges whose [queries, n, width] score blocks fit ``ELEMENTS_PER_CHUNK``."""
    step = max(1, ELEMENTS_PER_CHUNK // max(1, n * width))
    return [(lo, min(q, lo + step)) for lo in range(0, q, step)]


def top_spans(
    a: torch.Tensor, b: torch.Tensor, limit: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores, start rows, end rows), each [Q, k], best first, of the top-k valid phrases of each query
    (``a``, ``b``: start and end scores [Q, N], -inf for filtered tokens). Rows are -1 and scores -inf
    where a query has fewer than k valid phrases."""
    q, n = a.shape
    width = _width(limit)
    scores = torch.full((q, k), float("-inf"))
    starts = torch.full((q, k), -1, dtype=torch.long)
    ends = torch.full((q, k), -1, dtype=torch.long)
    take = min(k, n * width)
    for lo, hi in _query_chunks(q, n, width) if n else []:
        block = _span_block(a[lo:hi], b[lo:hi], limit, width)
        values, flat = block.reshape(hi - lo, -1).topk(take, dim=1)
        rows = torch.div(flat, width, rounding_mode="floor")
        found = torch.isfinite(values)
        scores[lo:hi, :take] = values
        starts[lo:hi, :take] = torch.where(found, rows, -1)
        ends[lo:hi, :take] = torch.where(found, rows + flat % width, -1)
    return scores, starts, ends


def best_span_per_start(a: torch.Tensor, b: torch.Tensor, limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(score, end row) [Q, N] of the best valid phrase starting at each row (-inf / -1 where there is none)."""
    q, n = a.shape
    width = _width(limit)
    best = torch.full((q, n), float("-inf"))
    ends = torch.full((q, n), -1, dtype=torch.long)
    for lo, hi in _query_chunks(q, n, width) if n else []:
        values, offset = _span_block(a[lo:hi], b[lo:hi], limit, width).max(dim=2)
        best[lo:hi] = values
        ends[lo:hi] = torch.where(torch.isfinite(values), torch.arange(n)[None, :] + offset, -1)
    return best, ends


def top_passages(
    a: torch.Tensor, b: torch.Tensor, limit: torch.Tensor, passage_of_row: torch.Tensor, n_passages: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, passage rows) [Q, k]: passages ranked by their best valid phrase (-1 / -inf past the last)."""
    best, _ = best_span_per_start(a, b, limit)
    per_passage = torch.full((a.shape[0], n_passages), float("-inf"))
    per_passage.scatter_reduce_(1, passage_of_row.expand(a.shape[0], -1), best, reduce="amax")
    take = min(k, n_passages)
    values, rows = per_passage.topk(take, dim=1)
    scores = torch.full((a.shape[0], k), float("-inf"))
    out = torch.full((a.shape[0], k), -1, dtype=torch.long)
    scores[:, :take] = values
    out[:, :take] = torch.where(torch.isfinite(values), rows, -1)
    return scores, out
