"""Data layer: one dataset model (``RetrievalDataset``) and readers for common layouts."""

from __future__ import annotations

from pathlib import Path

from densepass.config import FORMATS
from densepass.data.dataset import Corpus, Qrels, RetrievalDataset, sample_queries
from densepass.data.paths import dataset_dir, default_data_dir
from densepass.errors import DataError


def load_dataset(name: str, data_dir: str | Path | None = None, format: str = "beir") -> RetrievalDataset:
    """Read dataset ``name`` (a directory under the data dir, or a path) in the given layout."""
    directory = dataset_dir(name, data_dir)
    if format == "beir":
        from densepass.data.beir import load_beir

        return load_beir(directory, Path(name).name)
    if format == "msmarco":
        from densepass.data.msmarco import load_msmarco

        return load_msmarco(directory, Path(name).name)
    if format == "dpr":
        from densepass.data.dpr import load_dpr

        return load_dpr(directory, Path(name).name)
    if format == "squad":
        from densepass.data.squad import load_squad

        return load_squad(directory, Path(name).name)
    raise DataError(f"unknown dataset format {format!r} (known: {', '.join(FORMATS)})")


__all__ = ["Corpus", "Qrels", "RetrievalDataset", "load_dataset", "sample_queries", "dataset_dir", "default_data_dir"]
