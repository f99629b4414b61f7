"""Exact-step greedy ABS for many batches at once: one pass over the unscheduled instances U serves P batches.

The sequential greedy (``greedy.py``) grows one batch at a time, and each of its swaps reads the whole
of U for one matrix-vector product: memory-bound, with ~N/b x swaps passes over an N-row U per
epoch. Here P batches ("slots") grow together. Each round, for every open batch p with running sums
s_p = [sum Q, sum P] (``similarity.py``):

    c_p(d) = [Q_d | P_d] [sum P; sum Q]_p - 2 Q_d.P_d  for d in B_p   (its members' rows only)
    r_p = argmin_{d in B_p} c_p(d)                        (eq. 3: the member whose removal hurts least)
    G' = [sum P; sum Q] of B_p - r_p, times [Q | P] over U    a_p = argmax_{allowed a} G'[p, a]   (eq. 4)

that is, one matrix product over U with P columns (compute-bound, not memory-bound). Every batch
whose best swap raises h(B_p) makes it, except that an instance wanted by several batches goes to the
one it raises most (ties: the lowest slot); the others retry next round without it. A batch that
stops improving (or reaches ``max_swaps``) is emitted and its slot is seeded again from the unscheduled.

With P = 1 this is the sequential greedy step for step (tested against the literal reference). With
P > 1 the batches compete for candidates, so the schedule differs; ``benchmarks/bench_abs.py`` reports
its hardness beside the sequential greedy's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from densepass.errors import ConfigError
from densepass.scheduling import greedy
from densepass.scheduling.greedy import ActiveRows, check_schedule_args
from densepass.scheduling.similarity import BilinearSimilarity
from densepass.scheduling.unscheduled import Unscheduled, pack_remainder


class _ConflictLists:
    """The conflict lists held as one flat index, so that many instances' lists are expanded at once."""

    def __init__(self, conflicts: Sequence[Sequence[int]], device: torch.device) -> None:
        sizes = torch.tensor([len(c) for c in conflicts], dtype=torch.long)
        self.start = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).to(device)
        self.flat = torch.tensor([j for c in conflicts for j in c], dtype=torch.long, device=device)
        self.any = len(self.flat) > 0  # without conflicts nothing is ever blocked

    def expand(self, rows: torch.Tensor, instances: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row, x)`` for every ``(row, i)`` pair of ``rows`` and ``instances`` and every x in conflicts[i]."""
        sizes = self.start[instances + 1] - self.start[instances]
        total = int(sizes.sum())
        first = torch.repeat_interleave(self.start[instances], sizes)
        offset = torch.arange(total, device=sizes.device) - torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)
        return torch.repeat_interleave(rows, sizes), self.flat[first + offset]


def iter_concurrent_batches(
    sim: BilinearSimilarity,
    batch_size: int,
    slots: int,
    conflicts: Sequence[Sequence[int]] | None = None,
    seed: int = 0,
    max_swaps: int | None = None,
) -> Iterator[list[int]]:
    """Yield batches covering every instance exactly once, ``slots`` of them grown at a time."""
    check_schedule_args(sim, batch_size)
    if slots < 1:
        raise ConfigError(f"concurrent batches must be >= 1, got {slots}")
    n, device = sim.n, sim.device
    conflicts = conflicts if conflicts is not None else [[] for _ in range(n)]
    max_swaps = max_swaps if max_swaps is not None else 4 * batch_size
    unscheduled = Unscheduled(n, seed)
    available = torch.ones(n, dtype=torch.bool, device=device)  # in U and in no open batch
    lists = _ConflictLists(conflicts, device)
    members = torch.zeros((slots, batch_size), dtype=torch.long, device=device)
    valid = torch.zeros((slots, batch_size), dtype=torch.bool, device=device)  # a seed may be short (conflicts)
    sums = torch.zeros((slots, 2 * sim.dim), dtype=sim.dtype, device=device)
    # the members' rows, kept (dense instances) so eq. 3 reads them without a gather from the pool each round
    rows_of = None if sim.sparse else torch.zeros((slots, batch_size, 2 * sim.dim), dtype=sim.dtype, device=device)
    swaps = [0] * slots
    every_slot = list(range(slots))
    open_slots: list[int] = []
    unassigned = n  # instances of U in no open batch
    inf = torch.tensor(float("inf"), dtype=sim.dtype, device=device)
    active = ActiveRows(sim, unscheduled.ids())

    def open_batch(slot: int) -> None:
        nonlocal unassigned
        seed_ids = unscheduled.seed_batch(batch_size, conflicts, exclude=~available.cpu().numpy())
        ids = torch.as_tensor(seed_ids, device=device)
        members[slot].zero_()
        valid[slot] = False
        members[slot, : len(ids)], valid[slot, : len(ids)] = ids, True
        if rows_of is not None:
            rows_of[slot, : len(ids)] = sim.stacked[ids]
        sums[slot] = sim.sums(seed_ids)
        available[ids] = False
        swaps[slot] = 0
        unassigned -= len(ids)
        open_slots.append(slot)

    def close_batch(slot: int) -> list[int]:
        ids = members[slot][valid[slot]]
        open_slots.remove(slot)
        unscheduled.take(ids.tolist())
        return ids.tolist()

    for slot in range(slots):
        if unassigned > batch_size:
            open_batch(slot)
    while open_slots:
        if unscheduled.remaining < len(active.ids) * greedy.COMPACT_BELOW:
            active = ActiveRows(sim, unscheduled.ids())
        finished = [s for s in open_slots if swaps[s] >= max_swaps]
        rows = sorted(s for s in open_slots if swaps[s] < max_swaps)
        if rows:
            slot_t = torch.as_tensor(rows, device=device)
            batch = members[slot_t]
            kept = None if rows_of is None else (rows_of if rows == every_slot else rows_of[slot_t])
            contrib = sim.cross_own(sums[slot_t], batch, kept) - 2 * sim.self_sim[batch]  # c_p(d): members' rows
            contrib = torch.where(valid[slot_t], contrib, inf)
            removal_pos = torch.argmin(contrib, 1)  # eq. 3 (first on ties)
            removed = batch.gather(1, removal_pos[:, None]).squeeze(1)
            reduced = sums[slot_t] - sim.dense_rows(removed)
            gains = sim.cross_each(reduced, active.matrix)  # [k, |U|]: eq. 4 for B_p - r_p
            # what no batch may take: the columns of instances in an open batch (or scheduled since U was last
            # compacted), and each batch's instances in conflict with a member other than r_p. Only those entries
            # are written: a mask over all of [k, |U|] cost more than the product itself
            gains.index_fill_(1, torch.nonzero(~available[active.ids]).squeeze(1), -inf)
            if lists.any:
                others = valid[slot_t].scatter(1, removal_pos[:, None], False)  # the members of B_p - r_p
                row = torch.arange(len(rows), device=device)[:, None].expand_as(batch)
                row, conflicting = lists.expand(row[others], batch[others])
                position = active.position[conflicting]
                inside = position >= 0  # (the others are scheduled: in no column)
                gains[row[inside], position[inside]] = -inf
            addition_pos = torch.argmax(gains, 1)  # first on ties
            best = gains.gather(1, addition_pos[:, None]).squeeze(1)
            addition = active.ids[addition_pos]
            delta = best - contrib.gather(1, removal_pos[:, None]).squeeze(1)
            wants = torch.isfinite(best) & (delta > 0)
            top = torch.full((n,), -float("inf"), dtype=sim.dtype, device=device)
            top.scatter_reduce_(0, addition[wants], delta[wants], "amax")
            wants_most = wants & (delta == top[addition])
            owner = torch.full((n,), slots, dtype=torch.long, device=device)
            owner.scatter_reduce_(0, addition[wants_most], slot_t[wants_most], "amin")
            wins = wants_most & (owner[addition] == slot_t)
            if wins.any():
                won = slot_t[wins]
                members[won, removal_pos[wins]] = addition[wins]
                if rows_of is not None:
                    rows_of[won, removal_pos[wins]] = sim.stacked[addition[wins]]
                sums[won] = reduced[wins] + sim.dense_rows(addition[wins])
                available[removed[wins]] = True
                available[addition[wins]] = False
            for slot, won_swap, wanted in zip(rows, wins.tolist(), wants.tolist()):
                if won_swap:
                    swaps[slot] += 1
                elif not wanted:
                    finished.append(slot)
        for slot in sorted(finished):
            batch_ids = close_batch(slot)
            yield batch_ids
            if unassigned > batch_size:
                open_batch(slot)
    yield from pack_remainder(unscheduled.ids().tolist(), batch_size, conflicts)
