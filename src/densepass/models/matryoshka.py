"""Prefix dimensions of an embedding (MRL): the first ``dim`` numbers of a Matryoshka-trained embedding are an
embedding of their own.

``truncate`` keeps the first ``dim`` numbers of each row and, for a model that L2-normalises its embeddings,
normalises them again (a prefix of a unit vector is shorter than 1: dot products of prefixes would not be cosines).
Training (``losses.matryoshka``), indexing (``DenseIndex(dim=...)``, ``densepass index --dim``) and query encoding
all cut the same way, so an index built at ``dim`` is searched with queries cut at ``dim``. sentence-transformers
gives the same vectors with ``SentenceTransformer(path, truncate_dim=dim).encode(..., normalize_embeddings=True)``.

A model trained without Matryoshka can start its Matryoshka training at its principal axes
(``principal_rotation``, ``train.matryoshka_init: pca``): its embedding rotated so that the first k numbers are the
best k-dimensional linear summary of its passage embeddings (PCA). A rotation changes no cosine, so the full
embedding ranks exactly as before, while every prefix starts as PCA's instead of as k arbitrary coordinates; the
Matryoshka loss then trains from there (MRL §3 trains from scratch, where no such start exists).

>>> import numpy as np
>>> print(truncate(np.array([[3.0, 4.0, 12.0]]), 2, normalize=True))
[[0.6 0.8]]
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

from densepass.errors import ConfigError

Rows = TypeVar("Rows", np.ndarray, torch.Tensor)


def truncate(embeddings: Rows, dim: int, normalize: bool) -> Rows:
    """The first ``dim`` numbers of each row (``[n, d]``, numpy or torch), L2-normalised again when ``normalize``
    (a zero prefix stays zero); ``dim`` equal to ``d`` with ``normalize`` false returns the rows as they are."""
    if dim == embeddings.shape[-1] and not normalize:
        return embeddings
    prefix = embeddings[..., :dim]
    if not normalize:
        return prefix
    if isinstance(prefix, torch.Tensor):
        return torch.nn.functional.normalize(prefix, dim=-1)
    prefix = np.asarray(prefix, dtype=np.float32)
    norms = np.linalg.norm(prefix, axis=-1, keepdims=True)
    return prefix / np.maximum(norms, 1e-12)


def principal_rotation(embeddings: np.ndarray) -> np.ndarray:
    """The orthogonal matrix R [d, d] whose rows are the principal axes of ``embeddings`` [n, d]: the eigenvectors
    of their covariance, largest variance first, each signed so that its largest entry is positive (the same R for
    the same embeddings on any machine's LAPACK). ``x @ R.T`` keeps every dot product and cosine of ``x``; its first
    k numbers are the rows' coordinates on the k axes of largest variance (PCA's, without the centring: a rotation
    keeps the origin). Computed in float64."""
    x = np.asarray(embeddings, dtype=np.float64)
    if x.ndim != 2 or len(x) < 2:
        raise ConfigError(f"principal axes need at least 2 embeddings as [n, d], got shape {x.shape}")
    x = x - x.mean(axis=0)
    values, vectors = np.linalg.eigh(x.T @ x / (len(x) - 1))
    axes = vectors[:, np.argsort(values, kind="stable")[::-1]].T
    signs = np.sign(axes[np.arange(len(axes)), np.abs(axes).argmax(axis=1)])
    return axes * signs[:, None]


def check_dims(
    dims: Sequence[int], model_dim: int | None = None, what: str = "train.matryoshka_dims"
) -> tuple[int, ...]:
    """``dims`` as distinct positive integers, largest first, at most ``model_dim``; a one-line ConfigError else."""
    dims = tuple(dims)
    if not dims:
        raise ConfigError(f"{what} is empty: give the prefix dimensions to train, e.g. [384, 256, 128, 64]")
    if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims):
        raise ConfigError(f"{what} must be positive integers, got {list(dims)}")
    if len(set(dims)) != len(dims):
        raise ConfigError(f"{what} repeats a dimension: {list(dims)}")
    if model_dim is not None and max(dims) > model_dim:
        raise ConfigError(f"{what} asks for {max(dims)} dimensions of a {model_dim}-dimensional model")
    return tuple(sorted((int(d) for d in dims), reverse=True))


def check_index_dim(dim: int, model_dim: int, trained: Sequence[int] | None, source: str | None = None) -> int:
    """The dimension an index is built at: refused above the model's own, warned about where the model was trained
    with Matryoshka at other dimensions, or without Matryoshka at all (its prefixes were never trained to be
    embeddings)."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise ConfigError(f"--dim must be a positive integer, got {dim!r}")
    if dim > model_dim:
        raise ConfigError(f"--dim {dim} is above the model's {model_dim} dimensions")
    if dim != model_dim and dim not in (trained or ()):
        name = source or "the model"
        warnings.warn(
            f"{name} was not trained at {dim} dimensions "
            + (f"(its Matryoshka dimensions: {list(trained)})" if trained else "(no Matryoshka training recorded)")
            + f": its first {dim} dimensions may be a poor embedding",
            stacklevel=2,
        )
    return int(dim)
