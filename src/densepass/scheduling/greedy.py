"""Exact greedy and beam-search batch scheduling over all unscheduled instances (ABS eq. 3-4).

For each batch: draw a random conflict-free seed from the unscheduled instances U, then repeat

    d_r = argmax_{d in B} h(B - d)                       (eq. 3)
    d_a = argmax_{d in U, d not in B} h(B - d_r + d)     (eq. 4)

and swap d_r for d_a while that raises h(B). With running sums sQ, sP of the batch (see
``similarity.py``) both arg-maxes are cheap and exact:

    h(B - d)       = h(B) - c(d),       c(d) = Q_d.sP + P_d.sQ - 2 Q_d.P_d
    h(B' + a)      = h(B') + Q_a.sP' + P_a.sQ'      (B' = B - d_r; sums of B')

so eq. 3 is an argmin over the batch and eq. 4 one matrix-vector product over U, instead of
the pairwise search that made the paper restrict candidates to a top-100. Candidates that conflict
with a batch member (``conflicts.py``) are never added.

Beam search (``beam_width`` k > 1): the k removals with the smallest c(d), each with its best
addition, and the best of those swaps by the resulting h (the k x k swaps of the paper evaluated
exactly: for each removal, its best addition is the best of its k). With ``neighbours``, additions
are restricted to the neighbour lists of the batch members (the paper's top-100 variant).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from densepass.errors import ConfigError
from densepass.scheduling.similarity import BilinearSimilarity
from densepass.scheduling.unscheduled import Unscheduled, pack_remainder

COMPACT_BELOW = 7 / 8
"""``ActiveRows`` is rebuilt once the unscheduled instances fall below this share of its rows. A product's cost is the
matrix's rows, so compacting sooner cuts an epoch's reads from about 2/3 of N per product on average (rebuilt at
half) toward 1/2, for a rebuild (one gather of U's rows, about one product's reads) every eighth of U scheduled."""


class ActiveRows:
    """The rows of U as a compact matrix, in ascending id order (so first-on-ties choices are those over all N),
    rebuilt once U is below ``COMPACT_BELOW`` of its rows, so each product runs over the instances still in U
    rather than all N."""

    def __init__(self, sim: BilinearSimilarity, ids: np.ndarray) -> None:
        self.ids = torch.as_tensor(ids, dtype=torch.long, device=sim.device)
        self.matrix = sim.rows_matrix(self.ids)
        self.position = torch.full((sim.n,), -1, dtype=torch.long, device=sim.device)
        self.position[self.ids] = torch.arange(len(ids), device=sim.device)


def check_schedule_args(sim: BilinearSimilarity, batch_size: int) -> None:
    """A one-line error for a batch size below 1 or above the unscheduled."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    if batch_size > sim.n:
        raise ConfigError(f"batch size {batch_size} is larger than the {sim.n} instances to schedule")


def iter_batches(
    sim: BilinearSimilarity,
    batch_size: int,
    conflicts: Sequence[Sequence[int]] | None = None,
    seed: int = 0,
    beam_width: int = 1,
    neighbours: np.ndarray | None = None,
    max_swaps: int | None = None,
) -> Iterator[list[int]]:
    """Yield batches (lists of instance indices) covering every instance exactly once."""
    n = sim.n
    check_schedule_args(sim, batch_size)
    if beam_width < 1:
        raise ConfigError(f"beam width must be >= 1, got {beam_width}")
    if neighbours is not None and len(neighbours) != n:
        raise ConfigError(f"neighbour lists cover {len(neighbours)} instances, expected {n}")
    conflicts = conflicts if conflicts is not None else [[] for _ in range(n)]
    max_swaps = max_swaps if max_swaps is not None else 4 * batch_size
    device = sim.device
    unscheduled = Unscheduled(n, seed)
    available = torch.ones(n, dtype=torch.bool, device=device)  # in U and not in the current batch
    blocked = torch.zeros(n, dtype=torch.int32, device=device)  # batch members each instance conflicts with
    conflict_idx = [torch.as_tensor(c, dtype=torch.long, device=device) for c in conflicts]
    neighbour_t = torch.as_tensor(neighbours, dtype=torch.long, device=device) if neighbours is not None else None
    neg_inf = torch.tensor(float("-inf"), dtype=sim.dtype, device=device)
    active = ActiveRows(sim, unscheduled.ids())

    def best_addition(
        reduced: torch.Tensor, removed: int, members: list[int], gains_over_u: torch.Tensor | None = None
    ) -> tuple[int, torch.Tensor] | None:
        """eq. 4 for B - removed: the allowed instance of U with the largest gain, and that gain
        (``gains_over_u``: the gains over U, when already computed)."""
        if neighbour_t is not None:
            candidates = torch.unique(neighbour_t[[m for m in members if m != removed]].flatten())
            if not len(candidates):  # a batch of one: no member left whose neighbours could join
                return None
            gains = sim.cross(reduced, candidates)
        else:
            candidates = active.ids
            gains = gains_over_u if gains_over_u is not None else sim.cross(reduced, matrix=active.matrix)
        allowed = available[candidates] & (blocked[candidates] == 0)
        gains = torch.where(allowed, gains, neg_inf)
        freed = conflict_idx[removed]  # instances blocked only by the removed member become allowed
        if len(freed):
            where = _positions(candidates, freed, active if neighbour_t is None else None)
            keep = where >= 0
            if keep.any():
                freed, where = freed[keep], where[keep]
                ok = available[freed] & (blocked[freed] - 1 == 0)
                exact = sim.cross(reduced, freed)
                gains[where] = torch.where(ok, exact, neg_inf)
        k = int(torch.argmax(gains))
        if not torch.isfinite(gains[k]):
            return None
        return int(candidates[k]), gains[k]

    while unscheduled.remaining > batch_size:
        if unscheduled.remaining < len(active.ids) * COMPACT_BELOW:
            active = ActiveRows(sim, unscheduled.ids())
        members = unscheduled.seed_batch(batch_size, conflicts)
        for m in members:
            available[m] = False
            blocked[conflict_idx[m]] += 1
        sums = sim.sums(members)
        for _ in range(max_swaps):
            member_t = torch.as_tensor(members, device=device)
            contrib = sim.cross(sums, member_t) - 2 * sim.self_sim[member_t]
            order = torch.sort(contrib, stable=True).indices[:beam_width].tolist()  # eq. 3, best first
            reduced = [sums - sim.row(members[pos]) for pos in order]
            gains_over_u = None  # beam: the k products over U as one matrix product, one read of U
            if neighbour_t is None and len(order) > 1:
                gains_over_u = sim.cross(torch.stack(reduced, 1), matrix=active.matrix)
            best = None  # (gain in h, position, addition)
            for j, pos in enumerate(order):
                found = best_addition(
                    reduced[j], members[pos], members, None if gains_over_u is None else gains_over_u[:, j]
                )
                if found is None:
                    continue
                delta = float(found[1] - contrib[pos])
                if best is None or delta > best[0]:
                    best = (delta, pos, found[0])
            if best is None or not best[0] > 0:
                break
            _, pos, addition = best
            removed = members[pos]
            members[pos] = addition
            sums = sums - sim.row(removed) + sim.row(addition)
            available[removed], available[addition] = True, False
            blocked[conflict_idx[removed]] -= 1
            blocked[conflict_idx[addition]] += 1
        for m in members:
            blocked[conflict_idx[m]] -= 1
        unscheduled.take(members)
        yield members
    yield from pack_remainder(unscheduled.ids().tolist(), batch_size, conflicts)


def _positions(candidates: torch.Tensor, ids: torch.Tensor, active: ActiveRows | None) -> torch.Tensor:
    """Where each of ``ids`` sits in ``candidates`` (-1 when absent)."""
    if active is not None:
        return active.position[ids]
    match = candidates.unsqueeze(0) == ids.unsqueeze(1)
    return torch.where(match.any(1), match.float().argmax(1), torch.tensor(-1, device=ids.device))


def schedule_batches(sim: BilinearSimilarity, batch_size: int, **kwargs) -> list[list[int]]:
    """All batches of one epoch (see ``iter_batches``)."""
    return list(iter_batches(sim, batch_size, **kwargs))


def neighbour_lists(sim: BilinearSimilarity, k: int = 100) -> np.ndarray:
    """The paper's candidate restriction: for each instance i, the top-k instances j by
    sim(q_i, p_j) and the top-k by sim(q_j, p_i) (dense similarities; exact search)."""
    from densepass.index.exact import exact_search

    if sim.sparse:
        raise ConfigError("candidate restriction needs dense similarities (use the encoder, not BM25)")
    q, p = sim.stacked[:, : sim.dim], sim.stacked[:, sim.dim :]
    k = min(k, sim.n)
    _, by_query = exact_search(q.float(), p.float(), k, device=sim.device)
    _, by_passage = exact_search(p.float(), q.float(), k, device=sim.device)
    return np.concatenate([by_query, by_passage], axis=1)
