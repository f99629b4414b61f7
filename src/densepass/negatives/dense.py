"""Dense hard negatives: top-k passages of each training query under a bi-encoder, by exact search.

The miner is any ``BiEncoder``: a saved checkpoint (the training-inference-gap paper's model-based
negatives, §4.3.1), the model being trained (ANCE-style refresh), or a dual encoder trained on the
training pairs with a projection of the chosen size (negative-contrast §4.2: 25-d for "coarse", 512-d
for "fine"; ``densepass.training.dense_miners`` trains those).

The corpus is encoded and searched in shards (``index.sharded``): under torchrun each process encodes and
searches its shard and the top-k are merged, so the pool equals one process's and each process holds only
its shard's embeddings (and one block of passage inputs at a time). Every process of the group must call
:func:`mine_dense_negatives`; each returns the whole pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from densepass import distributed
from densepass.data.dataset import RetrievalDataset
from densepass.index.sharded import DEFAULT_BLOCK, ShardedEmbeddings, encode_cached, encode_sharded
from densepass.models.biencoder import BiEncoder
from densepass.models.encode import encode_texts
from densepass.negatives.pool import Candidate, NegativePool


def mine_dense_negatives(
    model: BiEncoder,
    dataset: RetrievalDataset,
    query_ids: Sequence[str],
    depth: int,
    skip_top: int = 0,
    source: str = "dense",
    batch_size: int = 256,
    device: torch.device | None = None,
    passage_embeddings: np.ndarray | None = None,
    show_progress: bool = True,
    block: int = DEFAULT_BLOCK,
    precision: str = "auto",
    cache_dir: str | Path | None = None,
) -> NegativePool:
    """Query id -> the top ``depth`` passages by dot product (after dropping ``skip_top``), best first, equal
    scores by corpus row. ``passage_embeddings``: the whole corpus's, already encoded (searched in one process);
    ``block``: passages encoded and searched together (``index.sharded``); texts encoded in ``precision``
    (``models.encode``); ``cache_dir``: the corpus's embeddings read from (or encoded once into) that content-keyed
    cache in a one-process run (``index.sharded.encode_cached``)."""
    sep = model.tokenizer.sep_token or " "
    show_progress = show_progress and distributed.rank() == 0
    if passage_embeddings is None and cache_dir is not None and distributed.world_size() == 1:
        shards = encode_cached(
            model,
            dataset.corpus,
            cache_dir,
            block=block,
            batch_size=batch_size,
            device=device,
            show_progress=show_progress,
            precision=precision,
        )
    elif passage_embeddings is None:
        shards = encode_sharded(
            model,
            dataset.corpus.lazy_inputs(sep),
            block=block,
            batch_size=batch_size,
            device=device,
            show_progress=show_progress,
            precision=precision,
        )
    else:
        shards = ShardedEmbeddings.whole(passage_embeddings, block)
    queries = encode_texts(
        model, [dataset.queries[q] for q in query_ids], "query", batch_size, device, precision, show_progress
    )
    scores, rows = shards.search(queries, depth + skip_top, device=device)
    ids = dataset.corpus.ids
    return {
        qid: [Candidate(ids[r], source, s) for s, r in zip(row_s[skip_top:], row_r[skip_top:])]
        for qid, row_s, row_r in zip(query_ids, scores.tolist(), rows.tolist())
    }
