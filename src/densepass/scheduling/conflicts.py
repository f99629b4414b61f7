"""Which training instances must never share a batch: each would be a false negative of the other.

Instances i and j conflict when their positive passages coincide (the same content), or when j's
positive is judged relevant to i's query or vice versa. On debian-packages several synopses often
point at one passage; batching them together would make each a negative of the other.
"""

from __future__ import annotations

from collections.abc import Sequence


def build_conflicts(positive_keys: Sequence[int], relevant_keys: Sequence[set[int]]) -> list[list[int]]:
    """For each instance, the sorted list of other instances it must not share a batch with."""
    by_key: dict[int, list[int]] = {}
    for i, key in enumerate(positive_keys):
        by_key.setdefault(key, []).append(i)
    conflicts: list[set[int]] = [set() for _ in positive_keys]
    for i, key in enumerate(positive_keys):
        for k in relevant_keys[i] | {key}:
            for j in by_key.get(k, ()):
                if j != i:
                    conflicts[i].add(j)
                    conflicts[j].add(i)
    return [sorted(c) for c in conflicts]
