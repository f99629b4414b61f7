"""Training rows from a dataset on the Hugging Face Hub: ``hf://datasets/org/name[@revision]`` (or, as
``data.name`` with ``data.format: pairs``, ``org/name[@revision]`` where no local file or folder has that name).

The dataset's card is fetched with ``huggingface_hub`` into its cache, then the data files of the split asked for:
those the card's ``configs`` give the subset (``data.subset``; none: the card's default) and split, or, where the
card names no subsets, every data file (``datasets`` then tells the splits from the files' names). Each is fetched
once and read from the cache afterwards (a download that did not complete is completed by the next online run:
``hub_snapshots``; ``HF_HUB_OFFLINE=1``: the cache only); the token comes from ``HF_TOKEN``
or ``huggingface-cli login``; the downloads show huggingface_hub's progress bars. The files (Parquet, JSON Lines,
JSON, CSV or Arrow) are read by ``datasets``' own readers; a loading script is never fetched or run (densepass runs
no code of a dataset's). Every failure is one line: offline and not cached, not found, gated, a revision, subset
or split the dataset does not have, files of no format densepass reads.
"""

from __future__ import annotations

import os
import re
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from densepass.errors import DataError
from densepass.hub_snapshots import download_in_full, is_complete, mark_complete, network_errors

PREFIX = "hf://datasets/"
DATA_PATTERNS = ["*.parquet", "*.jsonl", "*.jsonl.gz", "*.json", "*.json.gz", "*.csv", "*.csv.gz", "*.arrow"]
CARD = "README.md"
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def hub_dataset(name: str, local_exists: bool = False) -> tuple[str, str | None] | None:
    """(repo id, revision) when ``name`` names a Hub dataset: ``hf://datasets/org/name[@revision]``, or
    ``org/name[@revision]`` when ``local_exists`` is false (no local file or folder has that name); else None.
    A name that starts with ``hf://`` but is not a dataset's is a one-line DataError."""
    if name.startswith("hf://"):
        if not name.startswith(PREFIX):
            raise DataError(f"{name}: write a Hugging Face dataset as hf://datasets/org/name (or @revision)")
        found = _split(name.removeprefix(PREFIX))
        if found is None:
            raise DataError(f"{name}: write a Hugging Face dataset as hf://datasets/org/name (or @revision)")
        return found
    if local_exists or name.lower().removesuffix(".gz").endswith((".jsonl", ".json", ".csv", ".parquet")):
        return None  # a path (a file name that does not exist: its own error)
    return _split(name)


def _split(name: str) -> tuple[str, str | None] | None:
    repo, _, revision = name.partition("@")
    if not _REPO.match(repo) or ".." in repo or repo.endswith((".", "-")) or name.endswith("@"):
        return None
    return repo, revision or None


def load_hub_rows(repo: str, subset: str | None, split: str, revision: str | None) -> Any:
    """The ``split`` of ``subset`` of the Hub dataset ``repo`` at ``revision``, a ``datasets.Dataset`` (module
    docstring); a one-line DataError for every failure."""
    import datasets

    at = f" at revision {revision}" if revision else ""
    label = f"dataset {repo}{at}"
    card = _snapshot(repo, revision, [CARD], at, required=False)
    splits = _card_splits(card / CARD if card is not None else None, subset, label)
    if splits is None:  # no subsets on the card: datasets finds the splits from the files' names
        if subset is not None:
            raise DataError(f"{label} has no subsets (its card names none): leave data.subset out")
        folder = _snapshot(repo, revision, [CARD, *DATA_PATTERNS], at, required=True)
        return _load(label, split, lambda: datasets.load_dataset(str(folder), split=split))
    if split not in splits:
        raise DataError(f"{label} has no split {split!r} (its splits: {', '.join(splits)}): set data.train_split")
    folder = _snapshot(repo, revision, [CARD, *splits[split]], at, required=True)
    files = sorted(
        str(p) for p in folder.rglob("*") if p.is_file() and _matches(p.relative_to(folder).as_posix(), splits[split])
    )
    builder = next((b for suffix, b in BUILDERS if files and all(f.endswith(suffix) for f in files)), None)
    if builder is None:
        raise DataError(
            f"{label}: the files of split {split!r} are not all of one format densepass reads (Parquet, JSON Lines, "
            "JSON, CSV, Arrow); a dataset built by a loading script is not run"
        )
    return _load(label, split, lambda: datasets.load_dataset(builder, data_files={split: files}, split=split))


BUILDERS = (
    (".parquet", "parquet"),
    (".jsonl", "json"),
    (".jsonl.gz", "json"),
    (".json", "json"),
    (".json.gz", "json"),
    (".csv", "csv"),
    (".csv.gz", "csv"),
    (".arrow", "arrow"),
)


def _load(label: str, split: str, load) -> Any:
    import datasets

    try:
        return load()
    except ValueError as err:
        text = " ".join(str(err).split())
        if "split" in text.lower():
            raise DataError(f"{label} has no split {split!r} ({text[:200]}): set data.train_split") from None
        raise DataError(f"{label} could not be read: {text[:300]}") from None
    except (datasets.exceptions.DatasetsError, OSError) as err:
        raise DataError(f"{label} could not be read: {' '.join(str(err).split())[:300]}") from None


def _card_splits(card: Path | None, subset: str | None, label: str) -> dict[str, list[str]] | None:
    """{split: data-file patterns} of ``subset`` (None: the default one) as the dataset card's ``configs`` give
    them (a config's files without splits are its train split); None where the card names no subsets."""
    from huggingface_hub import metadata_load

    try:
        configs = (metadata_load(str(card)) or {}).get("configs") if card is not None and card.is_file() else None
    except (ValueError, OSError):
        configs = None
    if not isinstance(configs, list) or not configs:
        return None
    named = {c.get("config_name", "default"): c for c in configs if isinstance(c, dict)}
    if subset is None:
        chosen = next((c for c in named.values() if c.get("default")), None) or named.get("default")
        chosen = chosen or (next(iter(named.values())) if len(named) == 1 else None)
        if chosen is None:
            raise DataError(f"{label} has subsets {', '.join(named)}: name one in data.subset")
    elif subset not in named:
        raise DataError(f"{label} has no subset {subset!r} (its subsets: {', '.join(named)}): set data.subset")
    else:
        chosen = named[subset]
    files = chosen.get("data_files")
    splits: dict[str, list[str]] = {}
    for item in files if isinstance(files, list) else [files]:
        split, value = (item.get("split", "train"), item.get("path")) if isinstance(item, dict) else ("train", item)
        splits.setdefault(str(split), []).extend(p for p in (value if isinstance(value, list) else [value]) if p)
    return splits or None


def _matches(path: str, patterns: list[str]) -> bool:
    """Whether ``path`` (relative to the repo's root) matches a pattern, itself relative to the root as the Hub's
    ``allow_patterns`` and a card's ``data_files`` are (``*`` crosses folders, as ``fnmatch``'s does): a file's
    name alone is not matched, or a card's ``train.jsonl`` would take another subset's ``other/train.jsonl``."""
    return any(fnmatch(path, pattern) for pattern in patterns)


def _snapshot(repo: str, revision: str | None, patterns: list[str], at: str, required: bool) -> Path | None:
    """``repo``'s files matching ``patterns``: the cached snapshot, else downloaded (offline: the cache only)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    kwargs = {"repo_type": "dataset", "revision": revision, "allow_patterns": patterns}
    offline = constants.HF_HUB_OFFLINE or _true(os.environ.get("HF_HUB_OFFLINE"))
    try:
        cached = Path(snapshot_download(repo, local_files_only=True, **kwargs))
        wanted = [p for p in patterns if p != CARD] or patterns
        # the snapshot may hold the card alone, or another subset's files; online, one densepass did not see
        # downloaded in full may hold part of the files (an interrupted download): the download below completes it
        if _holds(cached, wanted) and (offline or is_complete(cached, patterns)):
            return cached
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    if offline:
        if not required:
            return None
        raise DataError(
            f"dataset {repo}{at} is not in the Hugging Face cache and the Hub is offline (HF_HUB_OFFLINE=1): download "
            "it once with the Hub online, or give a local file or folder"
        )
    try:
        folder = Path(_download(repo, **kwargs))
    except GatedRepoError:
        raise DataError(
            f"dataset {repo} is gated on the Hugging Face Hub: accept its terms on its page, then set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise DataError(f"dataset {repo} has no revision {revision} on the Hugging Face Hub") from None
    except RepositoryNotFoundError:
        raise DataError(
            f"dataset not found on the Hugging Face Hub: {repo}, nor a local file or folder of that name (a typo? a "
            "private dataset needs HF_TOKEN)"
        ) from None
    except network_errors() as err:  # the Hub could not be reached, or answered with an error
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"dataset {repo}{at} could not be downloaded: {first}") from None
    mark_complete(folder, patterns)
    return folder


def _holds(folder: Path, patterns: list[str]) -> bool:
    """Whether ``folder`` holds a file matching one of ``patterns`` (by its path in the folder, or its name)."""
    return any(_matches(p.relative_to(folder).as_posix(), patterns) for p in folder.rglob("*") if p.is_file())


def _download(repo: str, **kwargs: Any) -> str:
    """Fetch files of the dataset repo into the cache (the network; replaced by a fake in the tests)."""
    options = dict(kwargs)
    return download_in_full(repo, options.pop("allow_patterns"), **options)


def _true(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")
