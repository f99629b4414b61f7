"""Batch orders that do not optimise hardness: sequential (data order), random, and topic-clustered
batches in the style of TAS-Balanced (k-means over query embeddings; each batch from one cluster)."""

from __future__ import annotations

import numpy as np

from densepass.errors import ConfigError


def _check(n: int, batch_size: int) -> None:
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    if batch_size > n:
        raise ConfigError(f"batch size {batch_size} is larger than the {n} training instances")


def sequential_batches(n: int, batch_size: int) -> list[list[int]]:
    """Data order; the last partial batch is dropped."""
    _check(n, batch_size)
    return [list(range(i, i + batch_size)) for i in range(0, n - batch_size + 1, batch_size)]


def random_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """A fresh seeded permutation per epoch; the last partial batch is dropped."""
    _check(n, batch_size)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i : i + batch_size].tolist() for i in range(0, n - batch_size + 1, batch_size)]


def clustered_batches(
    embeddings: np.ndarray, batch_size: int, n_clusters: int, seed: int, epoch: int
) -> list[list[int]]:
    """TAS-style: k-means (FAISS) on query embeddings; each batch is drawn from a single cluster
    (clusters shuffled, members shuffled, leftovers of all clusters batched at random at the end)."""
    import faiss

    n = len(embeddings)
    _check(n, batch_size)
    if n_clusters < 1:
        raise ConfigError(f"number of clusters must be >= 1, got {n_clusters}")
    n_clusters = min(n_clusters, n)
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    kmeans = faiss.Kmeans(x.shape[1], n_clusters, niter=20, seed=seed, verbose=False)
    kmeans.train(x)
    _, labels = kmeans.index.search(x, 1)
    labels = labels.ravel()
    rng = np.random.default_rng([seed, epoch])
    batches, leftovers = [], []
    for c in rng.permutation(n_clusters):
        members = rng.permutation(np.flatnonzero(labels == c))
        full = len(members) // batch_size * batch_size
        batches.extend(members[i : i + batch_size].tolist() for i in range(0, full, batch_size))
        leftovers.extend(members[full:].tolist())
    leftovers = rng.permutation(np.asarray(leftovers, dtype=np.int64))
    batches.extend(
        leftovers[i : i + batch_size].tolist() for i in range(0, len(leftovers) - batch_size + 1, batch_size)
    )
    return [batches[i] for i in rng.permutation(len(batches))]
