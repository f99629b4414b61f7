"""Embedding files: a corpus encoded block by block into a float32 ``.npy`` memory map, resumable, or into
an array in memory through the same blocks (so both give the same embeddings).

``texts`` is any sequence that can be sliced, e.g. a ``LazyTexts`` view of a corpus file: only one block
of it is held as strings at a time.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from densepass.errors import DataWarning
from densepass.io import disk_errors, reserve_space
from densepass.models.biencoder import BiEncoder, Side
from densepass.models.encode import encode_texts


def encode_to_memmap(
    model: BiEncoder, texts: Sequence[str], side: Side, path: str | Path, shard_size: int = 100_000, **kwargs
) -> np.memmap:
    """Encode a corpus larger than memory shard by shard into a float32 ``.npy`` memory map.

    Finished shards are recorded in ``<path>.done``; an interrupted run resumes at the first
    unfinished shard, and the file is renamed into place only when every shard is written. Callers name
    ``path`` by the content it encodes (model and corpus fingerprints), so what is there is reused; files
    damaged on disk (a truncated array, an unreadable list of shards) are encoded again, with a warning. The
    file's disk blocks are reserved before the first shard (``create_memmap``): a full disk is a one-line error
    up front, never SIGBUS part-way.
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
        done_file.unlink(missing_ok=True)
        out = create_memmap(partial, (n, dim))
    else:
        reserve_space(partial)  # its blocks (reserved when it was made, unless an older version made it)

    def record(shard: int) -> None:
        out.flush()
        with disk_errors(done_file), open(done_file, "a") as handle:
            handle.write(f"{shard}\n")

    _encode_blocks(model, texts, side, out, shard_size, done, record, **kwargs)
    out.flush()
    partial.rename(path)
    done_file.unlink(missing_ok=True)
    return np.load(path, mmap_mode="r")


def create_memmap(path: str | Path, shape: tuple[int, int]) -> np.memmap:
    """A new float32 ``.npy`` memory map of ``shape`` at ``path`` with its disk blocks reserved (``io.reserve_space``):
    a full disk is a one-line error here, before any encoding, where a store to a page the file system cannot back
    would kill the process with SIGBUS. Nothing is left at ``path`` when it fails."""
    path = Path(path)
    try:
        with disk_errors(path, needs=4 * shape[0] * shape[1]):
            out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)
            reserve_space(path)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return out


def encode_in_blocks(model: BiEncoder, texts: Sequence[str], side: Side, block: int, **kwargs) -> np.ndarray:
    """Embeddings [len(texts), dim] encoded ``block`` texts at a time, in memory (no file, not resumable)."""
    out = np.empty((len(texts), model.dim), dtype=np.float32)
    _encode_blocks(model, texts, side, out, block, set(), lambda shard: None, **kwargs)
    return out


def _encode_blocks(
    model: BiEncoder,
    texts: Sequence[str],
    side: Side,
    out: np.ndarray,
    block: int,
    done: set[int],
    after: Callable[[int], None],
    **kwargs,
) -> None:
    """Encode each block of ``texts`` not in ``done`` into its rows of ``out``; ``after(block number)`` follows each."""
    for shard, start in enumerate(range(0, len(texts), block)):
        if shard in done:
            continue
        out[start : start + block] = encode_texts(model, texts[start : start + block], side, **kwargs)
        after(shard)


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
