"""Errors under torch.distributed: what rank 0 computes for every process (``distributed.on_rank_zero``) stops
every process when it fails, whatever the error, instead of leaving the others in a collective until the backend's
timeout (gloo, two processes on the CPU)."""

from __future__ import annotations

import datetime
import errno
import os
import socket
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from densepass import distributed
from densepass.errors import DensepassError, DiskError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:

        def fails():
            raise OSError("the disk is gone")

        def full():
            raise DiskError("no space left writing tokens.npy", errno.ENOSPC)

        outcomes = []
        for func in (fails, full):
            try:
                distributed.on_rank_zero(func)
                outcomes.append("returned")
            except DensepassError as err:
                code = f" ({err.code})" if isinstance(err, DiskError) else ""
                outcomes.append(f"{type(err).__name__}: {err}{code}")
            except OSError as err:
                outcomes.append(f"OSError: {err}")
        Path(out, f"rank{rank}").write_text("\n".join(outcomes))
    finally:
        dist.destroy_process_group()


def test_a_failure_on_rank_zero_stops_every_process_with_its_reason(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2)
    assert (tmp_path / "rank0").read_text().splitlines() == [
        "OSError: the disk is gone",
        f"DiskError: no space left writing tokens.npy ({errno.ENOSPC})",  # itself (a TypeError before: no errno)
    ]
    assert (tmp_path / "rank1").read_text().splitlines() == [
        "DensepassError: rank 0 failed: OSError: the disk is gone",
        "DensepassError: no space left writing tokens.npy",  # its message, one line
    ]


def test_a_disk_error_on_rank_zero_of_one_process_is_itself():
    def full():
        raise DiskError("no space left writing tokens.npy", errno.ENOSPC, needs=10)

    try:
        distributed.on_rank_zero(full)
    except DiskError as err:
        assert (str(err), err.code, err.needs) == ("no space left writing tokens.npy", errno.ENOSPC, 10)
    else:
        raise AssertionError("no error")
