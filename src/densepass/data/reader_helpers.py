"""Helpers shared by the readers: split files, JSON with typed fields, and the corpus builder (file opening
and decoding errors live in ``files.py``)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from densepass.data.dataset import Corpus
from densepass.data.files import Tally, read_text
from densepass.data.texts import lone_escape_line, might_hold_surrogates, surrogate_in
from densepass.errors import DataError


def require_dir(directory: str | Path) -> Path:
    """``directory`` as a Path, with a clear error when it is not an existing directory."""
    path = Path(directory)
    if not path.is_dir():
        raise DataError(f"dataset directory not found: {path}")
    return path


def data_files(directory: Path, suffix: str) -> dict[str, Path]:
    """Files in ``directory`` named ``<stem><suffix>`` or ``<stem><suffix>.gz``, by stem; both of one stem is a
    one-line DataError (``check_one_of``). Hidden files (``._train.tsv``: the resource forks macOS leaves on other
    file systems) are not data."""
    found: dict[str, Path] = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")):
        for ending in (suffix, f"{suffix}.gz"):
            if path.name.endswith(ending) and len(path.name) > len(ending):
                stem = path.name[: -len(ending)]
                if stem in found:
                    check_one_of(found[stem], path)
                found[stem] = path
    return found


def check_one_of(plain: Path, gzipped: Path) -> None:
    """A one-line DataError for a file beside its gzipped copy (``qrels/dev.tsv`` and ``qrels/dev.tsv.gz``):
    which one holds the data meant is unknowable (they may differ), so neither is read in silence."""
    raise DataError(f"{plain.parent}: both {plain.name} and {gzipped.name}: keep one of them")


def split_files(directory: Path, suffix: str, split_of: Callable[[str], str | None], expected: str) -> dict[str, Path]:
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


def json_limit(err: ValueError | RecursionError) -> str:
    """What ``json.loads`` met beyond Python's limits, where it raises something other than a JSONDecodeError: an
    integer of more than ``sys.get_int_max_str_digits()`` digits (a ValueError), arrays or objects nested deeper
    than the interpreter recurses (a RecursionError)."""
    if isinstance(err, RecursionError):
        return "arrays or objects nested too deeply"
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    return f"an integer of more than {limit} digits" if limit and "digits" in str(err) else " ".join(str(err).split())


def read_json(path: Path) -> Any:
    """A whole (optionally gzipped) JSON file, with ``file:line:column`` in the error for invalid JSON, and
    ``file:line`` and the JSON path in the error for a string holding a lone surrogate (``data.texts``)."""
    text = read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})") from None
    except (ValueError, RecursionError) as err:
        raise DataError(f"{path}: not valid JSON ({json_limit(err)})") from None
    if might_hold_surrogates(text):
        found = surrogate_in(data)
        if found is not None:
            line = lone_escape_line(text)
            raise DataError(f"{path}{'' if line is None else f':{line}'}: {found[0]}: {found[1]}")
    return data


_REQUIRED = object()


def get_field(record: Any, key: str, kind: type | tuple[type, ...], where: str, default: Any = _REQUIRED) -> Any:
    """``record[key]`` checked to be of ``kind``; ``where`` locates the record in error messages.

    With a ``default``, a missing or null field gives the default instead of an error. A JSON boolean is
    not accepted where an integer is asked for."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    value = record.get(key)
    if value is None:
        if default is not _REQUIRED:
            return default
        raise DataError(f"{where}: {'null' if key in record else 'missing'} field {key!r}")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise DataError(f"{where}: field {key!r} should be a {expected}, got {type(value).__name__}")
    return value


WHITESPACE = re.compile(r"\s")
"""Any whitespace character (what ``str.split()`` splits at, and so every reader of TREC run and qrels lines)."""

HEADER_KEYS = frozenset(
    {"id", "_id", "pid", "qid", "docid", "doc_id", "passage_id", "query_id", "query-id", "corpus-id"}
)
"""First-column names that mark a header line rather than an id (an MS MARCO TSV file's, a qrels file's)."""


RESERVED_ID_PREFIX = "\x00deleted:"
"""How the id densepass gives a deleted row of an index starts (``index.base.DELETED_ID``, which imports this module:
the two are kept equal by a test): a dataset's id starting so would be taken for a deleted passage."""


def check_id(value: str, what: str, where: str, reserved_ok: bool = False) -> str:
    """``value``, an id (of a query or passage), or a one-line DataError when it holds whitespace: a TREC run or
    qrels line (``qid Q0 pid rank score tag``) cannot represent it, so a run written with it could not be read back
    (``where`` locates it, ``what`` names it: ``query id``, ``field '_id'``); or, unless ``reserved_ok`` (a saved
    index's own passages), when it starts with :data:`RESERVED_ID_PREFIX`."""
    found = WHITESPACE.search(value)
    if found is not None:
        raise DataError(
            f"{where}: {what} {value!r} holds whitespace ({found.group()!r}), which TREC run and qrels files cannot "
            "represent (their columns are separated by whitespace)"
        )
    if not reserved_ok and value.startswith(RESERVED_ID_PREFIX):
        raise DataError(
            f"{where}: {what} {value!r} starts with {RESERVED_ID_PREFIX!r}, which densepass keeps for the deleted "
            "rows of an index"
        )
    return value


def get_id(record: Any, key: str, where: str, reserved_ok: bool = False) -> str:
    """An id field: a non-empty string, or an integer (returned as its decimal string), without whitespace, not
    starting with :data:`RESERVED_ID_PREFIX` unless ``reserved_ok`` (``check_id``)."""
    value = record.get(key) if isinstance(record, dict) else None
    if value.__class__ is str and value and value[0] != "\x00" and WHITESPACE.search(value) is None:
        return value
    value = get_field(record, key, (str, int), where)
    if value == "":
        raise DataError(f"{where}: empty field {key!r}")
    return check_id(str(value), f"field {key!r}", where, reserved_ok)


def get_strings(record: Any, key: str, where: str) -> list[str]:
    """An optional list of strings (numbers are taken as their text), e.g. answers; [] when missing or null."""
    values = get_field(record, key, list, where, default=[])
    for i, value in enumerate(values):
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise DataError(f"{where}: {key}[{i}] should be a str, got {type(value).__name__}")
    return [str(v) for v in values]


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
        self._rows: dict[str, int] = {}

    def __contains__(self, pid: str) -> bool:
        return pid in self._rows

    def add(self, pid: str, title: str, text: str, doc_id: str) -> bool:
        """Append a passage; False (and nothing added) when ``pid`` is already present."""
        if pid in self._rows:
            return False
        self._rows[pid] = len(self.ids)
        self.ids.append(pid)
        self.titles.append(title)
        self.texts.append(text)
        self.doc_ids.append(doc_id)
        return True

    def add_or_compare(self, pid: str, title: str, text: str, doc_id: str) -> str | None:
        """Append a passage, or, when ``pid`` is already present, compare: None when it repeats the same
        title and text, else what differs (for the caller's error message)."""
        row = self._rows.get(pid)
        if row is None:
            self.add(pid, title, text, doc_id)
            return None
        for what, old, new in (("text", self.texts[row], text), ("title", self.titles[row], title)):
            if old != new:
                return f"passage id {pid!r} given again with a different {what} ({new[:40]!r}, before {old[:40]!r})"
        return None

    def build(self, source: str | Path) -> Corpus:
        """The corpus; ``source`` names where the passages came from in the errors for an empty corpus and for
        one whose every passage has an empty (or whitespace) title and text (nothing to index or search)."""
        if not self.ids:
            raise DataError(f"{source}: the corpus is empty")
        empty = Tally(source, EMPTY_PASSAGES)
        for pid, title, text in zip(self.ids, self.titles, self.texts):
            if not has_words(title, text):
                empty.add(f"passage {pid!r}")
        if empty.count == len(self.ids):
            raise DataError(all_empty(source, len(self.ids)))
        empty.warn()
        return Corpus(self.ids, self.titles, self.texts, self.doc_ids)


EMPTY_PASSAGES = "passages with an empty title and text, kept (no query can match them)"
"""What a corpus reader's counted warning says of its passages without a word (a whole corpus of them: an error)."""


def has_words(title: str, text: str) -> bool:
    """Whether a passage has a title or text that is not empty or whitespace."""
    return (bool(title) and not title.isspace()) or (bool(text) and not text.isspace())


def all_empty(source: str | Path, count: int) -> str:
    """The error message for a corpus whose ``count`` passages all have an empty title and text."""
    return f"{source}: every passage of the corpus ({count}) has an empty title and text: there is nothing to index"
