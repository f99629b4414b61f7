"""The unscheduled instances U, and the two steps every scheduler shares: drawing a random
conflict-free seed batch (ABS §3.2: "randomly select n elements from U") and packing the last
instances into conflict-free batches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


class Unscheduled:
    """Unscheduled instances U, with O(1) membership and seeded random draws."""

    def __init__(self, n: int, seed: int) -> None:
        self.alive = np.ones(n, dtype=bool)
        self.remaining = n
        self.rng = np.random.default_rng(seed)

    def ids(self) -> np.ndarray:
        """The unscheduled instances, ascending."""
        return np.flatnonzero(self.alive)

    def take(self, batch: Sequence[int]) -> None:
        """Remove ``batch`` from the unscheduled instances."""
        self.alive[list(batch)] = False
        self.remaining -= len(batch)

    def seed_batch(self, size: int, conflicts: Sequence[Sequence[int]], exclude: np.ndarray | None = None) -> list[int]:
        """Up to ``size`` random members of U, no two in conflict (drawn in random order); ``exclude``
        (a boolean mask over all instances) leaves out members of batches still being built."""
        ids = self.ids() if exclude is None else np.flatnonzero(self.alive & ~exclude)
        chosen: list[int] = []
        blocked: set[int] = set()
        for i in self._random_order(ids, 2 * size):
            if i in blocked:
                continue
            chosen.append(i)
            blocked.update(conflicts[i])
            if len(chosen) == size:
                break
        return chosen

    def _random_order(self, ids: np.ndarray, first: int) -> Iterator[int]:
        """``ids`` in a uniformly random order, drawn lazily: a random ordered sample of ``first`` of them (what
        a seed batch usually needs), then the rest shuffled only if the walk gets that far. A full shuffle of U for
        every batch is host work that grows with U, while the device waits for the seed."""
        head = self.rng.choice(len(ids), size=min(first, len(ids)), replace=False)
        yield from ids[head].tolist()
        if len(head) < len(ids):
            rest = np.ones(len(ids), dtype=bool)
            rest[head] = False
            yield from ids[np.flatnonzero(rest)[self.rng.permutation(len(ids) - len(head))]].tolist()


def pack_remainder(ids: Sequence[int], size: int, conflicts: Sequence[Sequence[int]]) -> list[list[int]]:
    """First-fit packing of the last instances into batches of at most ``size`` without conflicts."""
    batches: list[list[int]] = []
    blocked: list[set[int]] = []
    for i in ids:
        for batch, block in zip(batches, blocked):
            if len(batch) < size and i not in block:
                batch.append(i)
                block.update(conflicts[i])
                break
        else:
            batches.append([i])
            blocked.append(set(conflicts[i]))
    return batches
