"""Embedding files: a corpus encoded shard by shard into a float32 ``.npy`` memory map, resumable."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from densepass.errors import DensepassError
from densepass.models.biencoder import BiEncoder, Side
from densepass.models.encode import encode_texts


def encode_to_memmap(
    model: BiEncoder, texts: Sequence[str], side: Side, path: str | Path, shard_size: int = 100_000, **kwargs
) -> np.memmap:
    """Encode a corpus larger than memory shard by shard into a float32 ``.npy`` memory map.

    Finished shards are recorded in ``<path>.done``; an interrupted run resumes at the first
    unfinished shard, and the file is renamed into place only when every shard is written.
    """
    path = Path(path)
    if path.is_file():
        return np.load(path, mmap_mode="r")
    partial = path.with_name(path.name + ".partial")
    done_file = path.with_name(path.name + ".done")
    n, dim = len(texts), model.dim
    if partial.is_file():
        out = np.lib.format.open_memmap(partial, mode="r+")
        if out.shape != (n, dim):
            raise DensepassError(f"{partial} has shape {out.shape}, expected {(n, dim)}: delete it to restart")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(n, dim))
        done_file.unlink(missing_ok=True)
    done = set(int(x) for x in done_file.read_text().split()) if done_file.is_file() else set()
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
