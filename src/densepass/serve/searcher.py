"""What the search service needs from a search pipeline (the :class:`Searcher` protocol), and hits as JSON."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Searcher(Protocol):
    """Anything the service can search with, e.g. ``densepass.pipelines.search.SearchPipeline``.

    It is used read-only, from one worker thread at a time (``describe`` may be called meanwhile). It may declare
    ``nested_top_k`` (a bool): True when its hits for a k are always the first k of its hits for any larger k, so
    that requests of different k can share a batch (``microbatch.nested_top_k``; undeclared, its index's kind
    decides).
    """

    def search_batch(self, queries: list[str], k: int) -> list[list[Any]]:
        """One list of hits per query, best first, at most ``k`` each. A hit is a dataclass with at least
        ``id: str, score: float, title: str, text: str`` and optional fields (``answer``, ``start``, ``end``...)
        that may be None. Raises ``densepass.errors.DensepassError`` for input it cannot handle."""
        ...

    def describe(self) -> dict:
        """JSON-able facts shown by ``GET /health``: index kind, model, number of passages..."""
        ...


def hit_to_json(hit: Any) -> dict[str, Any]:
    """A hit dataclass as a JSON-able dict: its fields without the None ones, numpy scalars as Python numbers."""
    return {
        key: value.item() if hasattr(value, "item") else value
        for key, value in dataclasses.asdict(hit).items()
        if value is not None
    }
