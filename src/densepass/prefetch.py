"""One-ahead prefetching: prepare the next item in a background thread while the current one is used."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def prefetched(items: Iterable[T], prepare: Callable[[T], R]) -> Iterator[R]:
    """``prepare(item)`` for each item, in order. Items are drawn in the calling thread (so
    collective operations inside ``items`` keep their order); ``prepare`` runs in one worker thread,
    one item ahead of the consumer. ``prepare`` must not share mutable state with the consumer."""
    with ThreadPoolExecutor(max_workers=1) as worker:
        pending = None
        for item in items:
            future = worker.submit(prepare, item)
            if pending is not None:
                yield pending.result()
            pending = future
        if pending is not None:
            yield pending.result()
