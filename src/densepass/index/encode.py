"""Batched encoding with length sorting: texts are tokenised once, sorted by length so each batch
pads little, encoded under bf16 autocast on GPU, and returned in the original order."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from densepass.errors import DensepassError
from densepass.models.biencoder import BiEncoder, Side
from densepass.training.step import autocast_context


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.inference_mode()
def encode_texts(
    model: BiEncoder,
    texts: Sequence[str],
    side: Side,
    batch_size: int = 256,
    device: torch.device | None = None,
    bf16: bool = True,
    show_progress: bool = True,
    max_tokens: int | None = None,
) -> np.ndarray:
    """Embeddings [len(texts), dim] as float32.

    ``max_tokens`` (optional) caps padded tokens per batch, so batches of short texts are larger.
    """
    if len(texts) == 0:
        raise DensepassError(f"nothing to encode: the list of {side} texts is empty")
    device = device or default_device()
    model.to(device).eval()
    encoded = model.tokenizer(list(texts), truncation=True, max_length=model.max_length(side))["input_ids"]
    order = np.argsort([-len(ids) for ids in encoded], kind="stable")
    out = np.empty((len(texts), model.dim), dtype=np.float32)
    pad_id = model.tokenizer.pad_token_id or 0
    start = 0
    progress = tqdm(total=len(texts), desc=f"encode {side}s", disable=not show_progress, dynamic_ncols=True)
    while start < len(order):
        longest = len(encoded[order[start]])
        size = batch_size if max_tokens is None else max(batch_size, max_tokens // max(longest, 1))
        rows = order[start : start + size]
        ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for k, r in enumerate(rows):
            seq = encoded[r]
            ids[k, : len(seq)] = torch.tensor(seq)
            mask[k, : len(seq)] = 1
        with autocast_context(device, bf16):
            emb = model(ids.to(device, non_blocking=True), mask.to(device, non_blocking=True), side=side)
        out[rows] = emb.float().cpu().numpy()
        start += len(rows)
        progress.update(len(rows))
    progress.close()
    return out


def encode_to_memmap(
    model: BiEncoder,
    texts: Sequence[str],
    side: Side,
    path: str | Path,
    shard_size: int = 100_000,
    **kwargs,
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
