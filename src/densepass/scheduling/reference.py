"""A slow, literal implementation of ABS scheduling (eq. 1, 3, 4) for testing the fast one.

Every hardness is recomputed from the full similarity matrix with ``batch_hardness``; no running
sums, no incremental updates. Only for small training sets (O(N^2) memory, O(N * n^2) per step).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from densepass.scheduling.similarity import batch_hardness
from densepass.scheduling.unscheduled import Unscheduled, pack_remainder


def reference_schedule(
    similarity: np.ndarray,
    batch_size: int,
    conflicts: Sequence[Sequence[int]] | None = None,
    seed: int = 0,
    beam_width: int = 1,
    max_swaps: int | None = None,
) -> list[list[int]]:
    """Batches of the literal ABS greedy / beam search over a dense similarity matrix (slow; for tests)."""
    n = len(similarity)
    conflicts = conflicts if conflicts is not None else [[] for _ in range(n)]
    max_swaps = max_swaps if max_swaps is not None else 4 * batch_size
    unscheduled = Unscheduled(n, seed)
    batches = []
    while unscheduled.remaining > batch_size:
        batch = unscheduled.seed_batch(batch_size, conflicts)
        for _ in range(max_swaps):
            h = batch_hardness(similarity, batch)
            # eq. 3: the removals that leave the hardest batch, best first (stable on ties)
            after_removal = [batch_hardness(similarity, batch[:i] + batch[i + 1 :]) for i in range(len(batch))]
            removal_order = sorted(range(len(batch)), key=lambda i: -after_removal[i])[:beam_width]
            best = None
            for pos in removal_order:
                rest = batch[:pos] + batch[pos + 1 :]
                banned = set(rest) | {batch[pos]} | {c for m in rest for c in conflicts[m]}
                candidates = [d for d in unscheduled.ids().tolist() if d not in banned]
                if not candidates:
                    continue
                # eq. 4: the addition that makes B - d_r + d hardest (first on ties)
                values = [batch_hardness(similarity, rest[:pos] + [d] + rest[pos:]) for d in candidates]
                k = int(np.argmax(values))
                if best is None or values[k] > best[0]:
                    best = (values[k], pos, candidates[k])
            if best is None or not best[0] > h:
                break
            batch = batch.copy()
            batch[best[1]] = best[2]
        unscheduled.take(batch)
        batches.append(batch)
    batches.extend(pack_remainder(unscheduled.ids().tolist(), batch_size, conflicts))
    return batches
