"""Embedding files: a corpus encoded shard by shard into a float32 ``.npy`` memory map, resumable."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from densepass.errors import DataWarning
from densepass.models.biencoder import BiEncoder, Side
from densepass.models.encode import encode_texts


def encode_to_memmap(
    model: BiEncoder, texts: Sequence[str], side: Side, path: str | Path, shard_size: int = 100_000, **kwargs
) -> np.memmap:
    """Encode a corpus larger than memory shard by shard into a float32 ``.npy`` memory map.

    Finished shards are recorded in ``<path>.done``; an interrupted run resumes at the first
    unfinished shard, and the file is renamed into place only when every shard is written. Callers name
    ``path`` by the content it encodes (model and corpus fingerprints), so what is there is reused; files
    damaged on disk (a truncated array, an unreadable list of shards) are encoded again, with a warning.
    """
    path = Path(path)
    n, dim = len(texts), model.dim
    finished = _open(path, "r", (n, dim))
    if finished is not None:
        return finished
    partial = path.with_name(path.name + ".partial")
    done_file = path.with_name(path.name + ".done")
    out = _open(partial, "r+", (n, dim))
    done = _done_shards(done_file) if out is not None else set()
    if out is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(n, dim))
        done_file.unlink(missing_ok=True)
    for shard, start in enumerate(range(0, n, shard_size)):
        if shard in done:
            continue
        out[start : start + shard_size] = encode_texts(model, texts[start : start + shard_size], side, **kwargs)
        out.flush()
        with open(done_file, "a") as handle:
            handle.write(f"{shard}\n")
    del out
    partial.rename(path)
    done_file.unlink(missing_ok=True)
    return np.load(path, mmap_mode="r")


def _open(path: Path, mode: str, shape: tuple[int, int]) -> np.memmap | None:
    """The float32 array at ``path`` with ``shape``, memory-mapped; None (and the file removed, with a
    warning) when it is missing, damaged or of another shape."""
    if not path.is_file():
        return None
    try:
        array = np.lib.format.open_memmap(path, mode=mode)
        if array.shape == shape and array.dtype == np.float32:
            return array
        problem = f"shape {array.shape} {array.dtype}, expected {shape} float32"
    except (ValueError, OSError) as err:
        problem = str(err).splitlines()[0]
    warnings.warn(f"{path} is damaged ({problem}); encoding it again", DataWarning, stacklevel=3)
    path.unlink()
    return None


def _done_shards(path: Path) -> set[int]:
    """The shards recorded as written (none when the record is missing or unreadable)."""
    try:
        return {int(x) for x in path.read_text().split()}
    except (OSError, ValueError):
        return set()
