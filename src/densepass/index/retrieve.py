"""Dense retrieval end to end: encode queries and passages, search with the chosen backend."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from densepass.errors import ConfigError
from densepass.index.exact import exact_search
from densepass.index.faiss_index import KINDS, build_faiss_index, faiss_search
from densepass.models.biencoder import BiEncoder
from densepass.models.encode import encode_texts


def search_embeddings(
    query_emb: np.ndarray, passage_emb: np.ndarray, k: int, index: str = "exact", device: torch.device | None = None
) -> tuple[np.ndarray, np.ndarray]:
    if index == "exact":
        return exact_search(query_emb, passage_emb, k, device=device)
    if index in KINDS:
        return faiss_search(build_faiss_index(passage_emb, index), query_emb, k)
    raise ConfigError(f"unknown index {index!r} (known: exact, {', '.join(KINDS)})")


def dense_retrieve(
    model: BiEncoder,
    queries: Sequence[str],
    passages: Sequence[str],
    k: int,
    index: str = "exact",
    batch_size: int = 256,
    device: torch.device | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` (scores, passage rows) for each query."""
    passage_emb = encode_texts(model, passages, "passage", batch_size=batch_size, device=device)
    query_emb = encode_texts(model, queries, "query", batch_size=batch_size, device=device)
    return search_embeddings(query_emb, passage_emb, k, index, device)


def rerank_candidates(
    model: BiEncoder,
    queries: Sequence[str],
    candidate_texts: Sequence[Sequence[str]],
    batch_size: int = 256,
    device: torch.device | None = None,
) -> list[np.ndarray]:
    """Scores of each query's own candidate passages (the ABS paper's 1 positive + 99 setting)."""
    flat = [text for cands in candidate_texts for text in cands]
    passage_emb = encode_texts(model, flat, "passage", batch_size=batch_size, device=device, show_progress=False)
    query_emb = encode_texts(model, queries, "query", batch_size=batch_size, device=device, show_progress=False)
    out, start = [], 0
    for q, cands in zip(query_emb, candidate_texts):
        out.append(passage_emb[start : start + len(cands)] @ q)
        start += len(cands)
    return out
