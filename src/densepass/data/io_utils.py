"""Helpers shared by the non-BEIR readers (MS MARCO, DPR, SQuAD); file opening lives in ``beir.py``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from densepass.data.beir import open_text
from densepass.data.dataset import Corpus
from densepass.errors import DataError


def require_dir(directory: str | Path) -> Path:
    """``directory`` as a Path, with a clear error when it is not an existing directory."""
    path = Path(directory)
    if not path.is_dir():
        raise DataError(f"dataset directory not found: {path}")
    return path


def data_files(directory: Path, suffix: str) -> dict[str, Path]:
    """Files in ``directory`` named ``<stem><suffix>`` or ``<stem><suffix>.gz``, by stem (plain file preferred)."""
    found: dict[str, Path] = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        for ending in (suffix, f"{suffix}.gz"):
            if path.name.endswith(ending) and len(path.name) > len(ending):
                stem = path.name[: -len(ending)]
                if stem not in found or ending == suffix:
                    found[stem] = path
    return found


def split_files(
    directory: Path, suffix: str, split_of: Callable[[str], str | None], expected: str
) -> dict[str, Path]:
    """``{split: path}`` for the data files (see :func:`data_files`) whose stem ``split_of`` maps to a split
    (None: not a split file); ``expected`` describes the wanted file names in the error when there is none."""
    files: dict[str, Path] = {}
    for stem, path in data_files(directory, suffix).items():
        split = split_of(stem)
        if split is None:
            continue
        if split in files:
            raise DataError(f"{directory}: two files for split {split!r}: {files[split].name} and {path.name}")
        files[split] = path
    if not files:
        raise DataError(f"{directory}: no {expected} file")
    return files


def read_json(path: Path) -> Any:
    """A whole (optionally gzipped) JSON file, with ``file:line:column`` in the error for invalid JSON."""
    with open_text(path) as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})") from None


_REQUIRED = object()


def get_field(record: Any, key: str, kind: type | tuple[type, ...], where: str, default: Any = _REQUIRED) -> Any:
    """``record[key]`` checked to be of ``kind``; ``where`` locates the record in error messages.

    With a ``default``, a missing or null field gives the default instead of an error."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    value = record.get(key)
    if value is None:
        if default is not _REQUIRED:
            return default
        raise DataError(f"{where}: missing field {key!r}")
    if not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise DataError(f"{where}: field {key!r} should be a {expected}, got {type(value).__name__}")
    return value


def unique(items: Iterable[str]) -> list[str]:
    """``items`` without repeats, first occurrence kept."""
    return list(dict.fromkeys(items))


class CorpusBuilder:
    """Accumulates passages column-wise, ignoring repeated ids, and builds a :class:`Corpus`."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.titles: list[str] = []
        self.texts: list[str] = []
        self.doc_ids: list[str] = []
        self._seen: set[str] = set()

    def __contains__(self, pid: str) -> bool:
        return pid in self._seen

    def add(self, pid: str, title: str, text: str, doc_id: str) -> bool:
        """Append a passage; False (and nothing added) when ``pid`` is already present."""
        if pid in self._seen:
            return False
        self._seen.add(pid)
        self.ids.append(pid)
        self.titles.append(title)
        self.texts.append(text)
        self.doc_ids.append(doc_id)
        return True

    def build(self, source: str | Path) -> Corpus:
        """The corpus; ``source`` names where the passages came from in the empty-corpus error."""
        if not self.ids:
            raise DataError(f"{source}: the corpus is empty")
        return Corpus(self.ids, self.titles, self.texts, self.doc_ids)
