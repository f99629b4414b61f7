"""torch.distributed basics shared by every layer: who this process is, joining torchrun's group, and
collectives that keep errors from hanging the other processes.

Under torchrun (``WORLD_SIZE`` > 1) the processes join one group (nccl on GPU, gloo on CPU); outside it
every helper behaves as a group of one, so the same code path runs in a single process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from densepass.errors import DensepassError
from densepass.io import exclusive_lock, locked_run_directory

T = TypeVar("T")
_alone = False  # rank 0 inside ``rank_zero_alone``: a group of one for every helper here


def is_distributed() -> bool:
    """Whether this process is part of an initialised torch.distributed group (and not working alone in it)."""
    return not _alone and dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 outside torch.distributed)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of processes (1 outside torch.distributed)."""
    return dist.get_world_size() if is_distributed() else 1


def launched_by_torchrun() -> bool:
    """Whether torchrun (or another launcher setting ``WORLD_SIZE``) started several processes."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_environment() -> None:
    """Join the process group described by torchrun's environment variables, when there is one."""
    if launched_by_torchrun() and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """Under torchrun, torchrun's process group joined for the block and left after it; nothing otherwise."""
    joined = launched_by_torchrun() and not dist.is_initialized()
    init_from_environment()
    try:
        yield
    finally:
        if joined:
            dist.destroy_process_group()


@contextlib.contextmanager
def rank_zero_alone() -> Iterator[bool]:
    """For the stages of a command that are one process's work: once every process has come here, rank 0 runs the
    block as a process of its own (every helper here sees a group of one, so the training engine trains a task
    that is not distributed and waits for no one) and the block is given True; the other processes are given
    False, to skip the block and end (they do not wait for rank 0). True outside torch.distributed."""
    global _alone
    if not is_distributed():
        yield True
        return
    main = rank() == 0
    barrier()
    if not main:
        yield False
        return
    _alone = True
    try:
        yield True
    finally:
        _alone = False


def collective_device() -> torch.device:
    """Where tensors given to collectives must live: the GPU under nccl, else the CPU."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather(local: torch.Tensor) -> list[torch.Tensor]:
    """``local`` of every process (equal shapes), in rank order, on the CPU."""
    if not is_distributed():
        return [local]
    device = collective_device()
    parts = [torch.empty_like(local, device=device) for _ in range(world_size())]
    dist.all_gather(parts, local.contiguous().to(device))
    return [part.cpu() for part in parts]


def broadcast_object(value):
    """Rank 0's ``value`` on every process."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(value) -> list:
    """Every process's ``value`` (picklable, in memory between this run's own processes), in rank order."""
    if not is_distributed():
        return [value]
    found = [None] * world_size()
    dist.all_gather_object(found, value)
    return found


def barrier() -> None:
    """Wait for every process (nothing outside torch.distributed)."""
    if is_distributed():
        dist.barrier()


def on_rank_zero(func: Callable[[], T]) -> T:
    """``func()`` computed on rank 0 and given to every process; a :class:`DensepassError` it raises is
    raised on every process (so a bad input stops them all with the same one-line error instead of leaving
    the others waiting in a collective). Any other error stops them all too: rank 0 raises it as it is, the others
    a DensepassError naming it (they waited in the broadcast until the backend's timeout, without a word)."""
    result, error, raised = None, None, None
    if rank() == 0:
        try:
            result = func()
        except DensepassError as err:
            error, raised = (type(err), str(err)), err
        except BaseException as err:
            if is_distributed():  # the others learn of it; this process raises the error itself
                broadcast_object((None, (DensepassError, f"rank 0 failed: {type(err).__name__}: {err}")))
            raise
    result, error = broadcast_object((result, error))
    if raised is not None:  # rank 0: the error itself (a DiskError keeps its errno and the space it needed)
        raise raised
    if error is not None:
        try:
            again = error[0](error[1])
        except TypeError:  # a class that takes more than its message (DiskError's errno): its message, one line
            again = DensepassError(error[1])
        raise again
    return result


@contextlib.contextmanager
def rank_zero_lock(directory: str | Path, what: str = "run") -> Iterator[None]:
    """``io.exclusive_lock`` on ``directory`` held by rank 0 for the whole group (each process asking for it
    would lock the others out); when it is taken, every process gets the one-line error."""
    with contextlib.ExitStack() as stack:
        on_rank_zero(lambda: stack.enter_context(exclusive_lock(directory, what)))
        yield


@contextlib.contextmanager
def rank_zero_run_directory(
    directory: str | Path, what: str, entries: tuple[str, ...], restart: bool, saved: tuple[str, ...] = ()
) -> Iterator[Callable[[], Path]]:
    """``io.locked_run_directory`` for a group of processes: rank 0 locks the directory and claims it for the group.
    A refusal of the lock is every process's one-line error; ``claim()`` waits until every process has passed the
    checks before it (which read the directory), and returns on every process once rank 0's claim (and
    ``restart``'s removal) is done. Outside torch.distributed, ``locked_run_directory`` itself."""
    if not is_distributed():
        with locked_run_directory(directory, what, entries, restart, saved) as claim:
            yield claim
        return
    with contextlib.ExitStack() as stack:
        held: list[Callable[[], Path]] = []

        def lock() -> None:
            held.append(stack.enter_context(locked_run_directory(directory, what, entries, restart, saved)))

        def claim_on_rank_zero() -> None:
            held[0]()

        def claim() -> Path:
            barrier()
            on_rank_zero(claim_on_rank_zero)
            return Path(directory)

        on_rank_zero(lock)
        yield claim
