"""torch.distributed helpers for cross-device in-batch negatives.

Every process computes the loss of the *global* batch from gathered embeddings in which only its own
slice carries gradient; summing parameter gradients over processes then gives exactly the gradient of
the global-batch loss (tested: two gloo processes of batch b equal one process of batch 2b).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """Whether this process is part of an initialised torch.distributed group."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 outside torch.distributed)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of processes (1 outside torch.distributed)."""
    return dist.get_world_size() if is_distributed() else 1


def init_from_environment() -> None:
    """Join the process group described by torchrun's environment variables, when there is one."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not is_distributed():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


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


def broadcast_object(value):
    """Rank 0's ``value`` on every process."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait for every process (nothing outside torch.distributed)."""
    if is_distributed():
        dist.barrier()
