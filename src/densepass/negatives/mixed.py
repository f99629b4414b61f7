"""Mixed negatives (negative-contrast §6.1): one pool drawing from several strategies.

Candidates are interleaved round-robin (first of each strategy, then the second of each, ...),
without repeating a passage, so uniform sampling from the top of the mixed pool draws every
strategy about equally often.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, zip_longest

from densepass.negatives.pool import Candidate, NegativePool


def mix_pools(pools: Sequence[NegativePool], depth: int) -> NegativePool:
    """Per query (the union of the pools' queries): up to ``depth`` candidates, round-robin."""
    out: NegativePool = {}
    for qid in dict.fromkeys(chain.from_iterable(pools)):
        seen: set[str] = set()
        mixed: list[Candidate] = []
        for cand in chain.from_iterable(zip_longest(*(p.get(qid, []) for p in pools))):
            if cand is not None and cand.passage_id not in seen:
                seen.add(cand.passage_id)
                mixed.append(cand)
        out[qid] = mixed[:depth]
    return out
