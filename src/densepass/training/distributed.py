"""torch.distributed helpers for cross-device in-batch negatives.

Every process computes the loss of the *global* batch from gathered embeddings in which only its own
slice carries gradient; summing parameter gradients over processes then gives exactly the gradient of
the global-batch loss (tested: two gloo processes of batch b equal one process of batch 2b).

A batch whose rows do not split evenly (phrase windows, Contriever documents) is shared with ``shares``: contiguous
slices of ceil(n / processes) rows, the last ones shorter or empty, gathered back with ``gather_rows``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from densepass.distributed import collective_device, is_distributed, rank, world_size


def gather_with_local_grad(local: torch.Tensor) -> torch.Tensor:
    """Concatenate ``local`` from every process (equal shapes); only this process's rows keep grad."""
    if not is_distributed():
        return local
    parts = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(parts, local.detach().contiguous())
    parts[rank()] = local
    return torch.cat(parts)


def shares(n: int) -> list[range]:
    """``n`` rows split over the processes, in rank order: contiguous shares of ceil(n / processes) rows (the last
    processes' shares may be shorter, or empty); one share of every row outside torch.distributed."""
    world = world_size()
    size = -(-n // world)
    return [range(min(r * size, n), min((r + 1) * size, n)) for r in range(world)]


def gather_rows(local: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Every process's rows in rank order, process r holding ``counts[r]`` of them (``local``: this process's);
    only this process's rows keep grad. Unequal counts are padded with zeros for the all-gather and cut after it."""
    if not is_distributed():
        return local
    if len(local) != counts[rank()]:
        raise ValueError(f"process {rank()} holds {len(local)} rows, not the {counts[rank()]} counted")
    width = max(counts)
    if width == 0:
        return local
    padded = torch.cat([local, local.new_zeros(width - len(local), *local.shape[1:])]) if len(local) < width else local
    parts = gather_with_local_grad(padded).split(width)
    return torch.cat([part[:count] for part, count in zip(parts, counts)])


def sum_gradients(parameters: Iterable[torch.Tensor]) -> None:
    """All-reduce (sum) the gradients of ``parameters`` over processes.

    A parameter that some process left without a gradient (its share of the batch was empty, so its graph never
    reached the parameter) counts as zeros there, so that every process takes part in the same all-reduces; one that
    no process gave a gradient keeps none (the optimiser skips it, as it would in one process)."""
    if not is_distributed():
        return
    parameters = list(parameters)
    has_grad = torch.tensor([p.grad is not None for p in parameters], dtype=torch.int32, device=collective_device())
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
    for p, anywhere in zip(parameters, has_grad.tolist()):
        if not anywhere:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def summed(values: Sequence[float]) -> list[float]:
    """``values`` summed element-wise over processes (in float64, so that a logged sum does not depend on the
    order of the processes' float32 additions); ``values`` themselves outside torch.distributed."""
    if not is_distributed():
        return list(values)
    total = torch.tensor(list(values), dtype=torch.float64, device=collective_device())
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.tolist()
