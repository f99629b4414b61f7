"""torch.distributed helpers for cross-device in-batch negatives.

Every process computes the loss of the *global* batch from gathered embeddings in which only its own
slice carries gradient; summing parameter gradients over processes then gives exactly the gradient of
the global-batch loss (tested: two gloo processes of batch b equal one process of batch 2b).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from densepass.distributed import is_distributed, rank, world_size


def gather_with_local_grad(local: torch.Tensor) -> torch.Tensor:
    """Concatenate ``local`` from every process (equal shapes); only this process's rows keep grad."""
    if not is_distributed():
        return local
    parts = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(parts, local.detach().contiguous())
    parts[rank()] = local
    return torch.cat(parts)


def sum_gradients(parameters) -> None:
    """All-reduce (sum) the gradients of ``parameters`` over processes."""
    if not is_distributed():
        return
    for p in parameters:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
