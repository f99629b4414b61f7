"""Data layer: one dataset model (``RetrievalDataset``) and readers for common layouts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from densepass.config import FORMATS
from densepass.data.dataset import Corpus, LazyTexts, Qrels, RetrievalDataset, sample_queries
from densepass.data.paths import dataset_dir, dataset_file, default_data_dir, pairs_path
from densepass.errors import DataError


def load_dataset(
    name: str,
    data_dir: str | Path | None = None,
    format: str = "beir",
    passages_on_disk: bool = False,
    columns: Mapping[str, Any] | None = None,
    subset: str | None = None,
    revision: str | None = None,
    split: str = "train",
) -> RetrievalDataset:
    """Read dataset ``name`` (a directory under the data dir, or a path) in the given layout.
    ``passages_on_disk``: a ``beir`` corpus keeps its titles and texts in ``corpus.jsonl``, read when asked for
    (``data.beir.PassageFile``: memory for ids, not for text); other layouts are always loaded whole.
    ``pairs``: ``name`` is a file of training rows or a ``save_to_disk`` folder (a path, or a name under the data
    dir; or a dataset on the Hugging Face Hub, ``hf://datasets/org/name[@revision]``, or ``org/name[@revision]``
    where no such path exists: ``data.hub``, its ``subset`` at ``revision``), its ``columns`` mapped as
    ``data.pairs.load_pairs`` says; the rows are read as (a saved ``DatasetDict``'s or the Hub dataset's) ``split``."""
    if format == "pairs":
        from densepass.data.hub import hub_dataset, load_hub_rows
        from densepass.data.pairs import load_pairs

        root = Path(data_dir) if data_dir else default_data_dir()
        local = os.path.lexists(name) or os.path.lexists(root / name)
        found = hub_dataset(name, local_exists=local)
        if found is not None:
            repo, pinned = found
            if pinned and revision and pinned != revision:
                raise DataError(f"{name} pins revision {pinned} and data.revision says {revision}: give one")
            rows = load_hub_rows(repo, subset, split, pinned or revision)
            label = f"{repo}{f'@{pinned or revision}' if pinned or revision else ''}"
            return load_pairs(rows, columns, name=label + (f" ({subset})" if subset else ""), split=split)
        if subset or revision:
            raise DataError(f"data.subset and data.revision are for a dataset on the Hugging Face Hub; {name} is local")
        return load_pairs(pairs_path(name, data_dir), columns, split=split)
    mapped = columns is not None and any(v is not None for v in columns.values())  # (a run passes its empty mapping)
    given = [k for k, v in (("columns", mapped), ("subset", subset), ("revision", revision)) if v] + (
        ["split"] if split != "train" else []
    )
    if given:  # options of training rows: a retrieval layout has all its splits and no columns to map
        raise DataError(f"{', '.join(given)} {'is an option' if len(given) == 1 else 'are options'} of "
                        f"format='pairs' (training rows), not of format={format!r}")  # fmt: skip
    directory = dataset_dir(name, data_dir)
    check_plain_files(directory)
    if format == "beir":
        from densepass.data.beir import load_beir

        return load_beir(directory, Path(name).name, passages_on_disk)
    if format == "msmarco":
        from densepass.data.msmarco import load_msmarco

        return load_msmarco(directory, Path(name).name)
    if format == "dpr":
        from densepass.data.dpr import load_dpr

        return load_dpr(directory, Path(name).name)
    if format == "squad":
        from densepass.data.squad import load_squad

        return load_squad(directory, Path(name).name)
    raise DataError(f"unknown dataset format {format!r} (known: {', '.join(FORMATS)}, pairs)")


def hub_options(data: Any) -> dict[str, Any]:
    """``load_dataset``'s options for training rows from a ``DataConfig`` (``data.subset``, ``data.revision``, and
    ``data.train_split`` as the split read); none for the other layouts, where a subset or revision is a one-line
    error (they name a part of a Hub dataset of training rows)."""
    if data.format != "pairs":
        if data.subset is not None or data.revision is not None:
            raise DataError(
                "data.subset and data.revision name a part of a Hugging Face dataset of training rows: they need "
                f"data.format: pairs (not {data.format})"
            )
        return {}
    return {"subset": data.subset, "revision": data.revision, "split": data.train_split}


CORPUS_FILES = {"beir": "corpus.jsonl", "msmarco": "collection.tsv"}
"""The file holding a layout's passages; the other layouts (dpr, squad) take theirs from their records."""


def corpus_file(name: str, data_dir: str | Path | None = None, format: str = "beir") -> Path | None:
    """The file of dataset ``name``'s passages: ``name`` itself where it is a file (a BEIR ``*.jsonl`` or an MS
    MARCO ``*.tsv``, gzipped or not: the name says which, whatever ``format``), else the layout's corpus file in the
    dataset's folder (``CORPUS_FILES``); None for the layouts without one (a one-line DataError where none is
    found, or a file's name says neither layout)."""
    if format == "pairs":
        raise DataError("format='pairs' is training rows, which hold no corpus to index: give a retrieval dataset")
    path = dataset_file(name, data_dir)
    if path is not None:
        if _file_layout(path) is None:
            raise DataError(
                f"{name}: a corpus file is BEIR passages (.jsonl) or an MS MARCO collection (.tsv), gzipped or not"
            )
        return path
    if format not in CORPUS_FILES:
        return None
    from densepass.data.beir import find_file

    directory = dataset_dir(name, data_dir)
    check_plain_files(directory)
    return find_file(directory, CORPUS_FILES[format])


def _file_layout(path: Path) -> str | None:
    suffixes = path.name.lower().removesuffix(".gz")
    return next((layout for layout, file in CORPUS_FILES.items() if suffixes.endswith(Path(file).suffix)), None)


def load_corpus(
    name: str, data_dir: str | Path | None = None, format: str = "beir", passages_on_disk: bool = False
) -> tuple[Corpus, str]:
    """The passages of dataset ``name`` and its name, without its queries and judgements: what an index needs.
    ``name`` is a corpus file (``corpus_file``: named after its folder where it is the layout's own file, such as
    ``scifact/corpus.jsonl``, else after itself), or a dataset as ``load_dataset`` takes it, whose layout's corpus
    file alone is read (dpr and squad, whose passages come from their records, are loaded whole).
    ``passages_on_disk`` as ``load_dataset`` has it."""
    path = corpus_file(name, data_dir, format)
    if path is None:
        dataset = load_dataset(name, data_dir, format)
        return dataset.corpus, dataset.name
    layout = _file_layout(path)
    own_file = path.name.removesuffix(".gz") == CORPUS_FILES[layout] and path.parent.name
    label = path.parent.name if own_file else path.name.removesuffix(".gz").rsplit(".", 1)[0]
    if layout == "beir":
        from densepass.data.beir import read_corpus

        return read_corpus(path, passages_on_disk), label
    from densepass.data.msmarco import read_collection

    return read_collection(path), label


def stream_passage_inputs(
    name: str, data_dir: str | Path | None, format: str, sep_token: str, length: int
) -> LazyTexts | None:
    """The ``length`` passage encoder inputs of dataset ``name``, read from its corpus file on demand (a process
    that reads a shard holds only that shard as strings); None for layouts that can only be loaded whole
    (every one but BEIR's passages: ``corpus_file``)."""
    path = corpus_file(name, data_dir, format)
    if path is None or _file_layout(path) != "beir":
        return None
    from densepass.data.beir import stream_passage_inputs as stream_beir

    return stream_beir(path, sep_token, length)


__all__ = [
    "Corpus",
    "Qrels",
    "RetrievalDataset",
    "load_corpus",
    "load_dataset",
    "stream_passage_inputs",
    "sample_queries",
    "dataset_dir",
    "default_data_dir",
]


def check_plain_files(directory: Path, depth: int = 2) -> None:
    """A one-line error where a dataset folder (or a folder in it, ``qrels/``) holds a named pipe, a socket or a
    device where its files are: reading one would wait forever, before any work."""
    import stat

    folders = [(Path(directory), 0)]
    while folders:
        folder, level = folders.pop()
        for entry in os.scandir(folder):
            mode = (
                entry.stat(follow_symlinks=True).st_mode if not entry.is_symlink() or os.path.exists(entry.path) else 0
            )
            if stat.S_ISDIR(mode):
                if level + 1 < depth:
                    folders.append((Path(entry.path), level + 1))
            elif mode and not stat.S_ISREG(mode):
                kind = "a named pipe" if stat.S_ISFIFO(mode) else "not a regular file"
                raise DataError(f"{entry.path} is {kind}: a dataset's files must be regular files")
