"""Reader for the BEIR layout: corpus.jsonl, queries.jsonl, qrels/{split}.tsv (each optionally .gz).

Every field read is type-checked, and bad input is a one-line :class:`DataError` naming the file and line:
a non-string ``text`` or ``title``, a null or non-scalar ``_id``, an ``_id`` holding whitespace (a TREC run
cannot represent it: ``reader_helpers.check_id``), a string holding a lone surrogate (``data.texts``), bad UTF-8,
a truncated gzip file. What is
tolerated is counted and reported once per file as a :class:`DataWarning` (see each reader's docstring).
"""

from __future__ import annotations

import array
import codecs
import csv
import itertools
import json
import os
import re
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from densepass.data.dataset import Corpus, LazyTexts, Qrels, RetrievalDataset, passage_input
from densepass.data.files import LONE_CR, Tally, is_gzip_name, open_text, reading, records_files
from densepass.data.reader_helpers import (
    EMPTY_PASSAGES,
    HEADER_KEYS,
    WHITESPACE,
    CorpusBuilder,
    all_empty,
    check_id,
    check_one_of,
    get_field,
    get_id,
    get_strings,
    has_words,
    json_limit,
    split_files,
)
from densepass.data.texts import might_hold_surrogates, surrogate_in
from densepass.errors import DataError


def find_file(directory: Path, stem: str) -> Path:
    """``stem`` or ``stem.gz`` inside ``directory``, with a clear error when neither exists, or both
    (``reader_helpers.check_one_of``)."""
    plain, gzipped = directory / stem, directory / f"{stem}.gz"
    if plain.is_file() and gzipped.is_file():
        check_one_of(plain, gzipped)
    for candidate in (plain, gzipped):
        if candidate.is_file():
            return candidate
    raise DataError(f"missing file: {directory / stem} (or .gz)")


FIELDS = re.compile(r'"(?:_id|title|text|doc_id|answers|metadata)"')
"""The JSON-lines fields readers take, quoted as keys are: one given twice in an object is an error, not the last
value kept in silence."""


def _record(line: str | bytes, path: Path, line_no: int, unique_keys: bool = False) -> dict | None:
    """The JSON object on one line of a JSON-lines file; None for a blank line. Bytes are decoded as strict UTF-8
    first (a UnicodeDecodeError, which ``files.reading`` names by line): ``json.loads`` would let the bytes of a lone
    surrogate through. ``unique_keys``: an object that gives a key twice is a DataError (``json`` keeps the last
    value in silence), at the cost of a Python call per object; without it, a line naming one of the fields a
    reader takes (:data:`FIELDS`) twice is checked so too (a cheap count first: a text cannot hold ``"text"``
    unescaped, so only such lines, or a rare text ending in an escaped quote, pay for the check)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8")
    if not unique_keys:
        named = FIELDS.findall(line)  # one scan in C: a third of json.loads' time on a typical passage
        unique_keys = len(named) > len(set(named))
    try:
        record = json.loads(line, object_pairs_hook=_unique_keys(path, line_no) if unique_keys else None)
    except json.JSONDecodeError as err:
        if not line.strip():
            return None
        if "\r" in line.rstrip("\r\n"):  # records ended by \r alone are one line (a JSON string cannot hold one)
            raise DataError(f"{path}:{line_no}: not valid JSON ({err.msg}): {LONE_CR}") from None
        raise DataError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
    except (ValueError, RecursionError) as err:  # not JSONDecodeErrors: a 5000-digit number, [[[[...]]]]
        raise DataError(f"{path}:{line_no}: not valid JSON ({json_limit(err)})") from None
    if record.__class__ is not dict:
        raise DataError(f"{path}:{line_no}: expected a JSON object")
    if might_hold_surrogates(line):
        found = surrogate_in(record)
        if found is not None:
            raise DataError(f"{path}:{line_no}: {found[0]}: {found[1]}")
    return record


def _unique_keys(path: Path, line_no: int):
    def hook(pairs: list[tuple[str, object]]) -> dict:
        record = dict(pairs)
        if len(record) != len(pairs):
            keys = [key for key, _ in pairs]
            repeated = next(key for key in keys if keys.count(key) > 1)
            raise DataError(f"{path}:{line_no}: key {repeated!r} appears twice in one object (json keeps the last)")
        return record

    return hook


def read_jsonl(path: Path, unique_keys: bool = False) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` for each non-blank line of a JSON-lines file; each must be a JSON object
    (``unique_keys``: without a key given twice, see ``_record``)."""
    with reading(path), open_text(path) as handle:
        for line_no, line in enumerate(handle, 1):
            record = _record(line, path, line_no, unique_keys)
            if record is not None:
                yield line_no, record


def _passage(rec: dict, where: str, id_key: str = "_id") -> tuple[str, str, str, str]:
    """``(id, title, text, doc_id)`` of a corpus record (its id under ``id_key``), each field type-checked; a
    saved index's passages (ids under ``id``: ``PassageFile``) hold its deleted rows' ids (``RESERVED_ID_PREFIX``)."""
    pid = get_id(rec, id_key, where, reserved_ok=id_key != "_id")
    doc_id = str(get_field(rec, "doc_id", (str, int), where, default=""))
    return (pid, get_field(rec, "title", str, where, default=""), get_field(rec, "text", str, where), doc_id or pid)


def _checked_passage(rec: dict, path: Path, line_no: int, id_key: str = "_id") -> tuple[str, str, str, str]:
    """``(id, title, text, doc_id)`` of a corpus record, fields checked as :func:`read_corpus` says."""
    pid, title, text, doc_id = rec.get(id_key), rec.get("title"), rec.get("text"), rec.get("doc_id")
    if (
        pid.__class__ is str
        and pid
        and pid[0] != "\x00"  # RESERVED_ID_PREFIX, checked by _passage
        and WHITESPACE.search(pid) is None
        and title.__class__ is str
        and text.__class__ is str
        and doc_id.__class__ is str
        and doc_id
    ):  # fast path; anything else is checked field by field
        return pid, title, text, doc_id
    return _passage(rec, f"{path}:{line_no}", id_key)


def iter_passages(path: Path) -> Iterator[tuple[int, str, str, str, str]]:
    """``(line number, _id, title, text, doc_id)`` of each passage of a corpus file, in order, fields checked
    as :func:`read_corpus` says (repeated ids are the caller's to detect)."""
    for line_no, rec in read_jsonl(path):
        yield line_no, *_checked_passage(rec, path, line_no)


def read_corpus(path: Path, on_disk: bool = False) -> Corpus:
    """Passages ``{"_id", "text", "title"?, "doc_id"?}``: ``_id`` a string or integer, ``text`` a string,
    ``title`` a string or null, ``doc_id`` a string, integer or null (then the passage is its own document).
    A repeated ``_id`` is an error. ``on_disk``: titles and texts stay in the file and are read on demand
    (:class:`PassageFile`; an uncompressed file only, a gzipped one is loaded whole)."""
    if on_disk and not is_gzip_name(path):
        return PassageFile.open(path)
    corpus = CorpusBuilder()
    for line_no, pid, title, text, doc_id in iter_passages(path):
        if not corpus.add(pid, title, text, doc_id):
            raise DataError(f"{path}:{line_no}: duplicate passage id {pid!r}")
    return corpus.build(path)


class PassageFile:
    """The titles and texts of an uncompressed ``corpus.jsonl`` (or a saved index's ``passages.jsonl``), read
    from the file when asked for: a corpus of N passages holds its ids, documents and 16 bytes of line offsets
    per passage in memory, not its text.

    ``PassageFile.open(path)`` reads the file once (every record checked as in :func:`read_corpus`) and returns
    a :class:`Corpus` whose ``titles`` and ``texts`` are this file's two columns (``LazyTexts`` over
    :meth:`titles` and :meth:`texts`). A read of rows ``a`` to ``b`` is one ``pread`` of their lines; the last
    rows read are kept, so a block's titles and then its texts parse the lines once. The file stays open, so a
    file replaced by a new one (an index saved again over it) is still read as it was; one changed in place, so
    that a row no longer holds the same passage, is a ``DataError``. A copy or an unpickled corpus opens the
    file again."""

    def __init__(self, path: Path, ids: list[str], spans: np.ndarray, id_key: str = "_id") -> None:
        self.path, self.ids, self.spans, self.id_key = path, ids, spans, id_key
        self._handle: BinaryIO = self._open_handle()
        self._last: tuple[int, int, list[tuple[str, str]]] = (0, 0, [])

    def _open_handle(self) -> BinaryIO:
        """The file, open for reading, closed when this object (the corpus) is dropped, on any path (an error
        that ends a command with it included): never left to the garbage collector's "unclosed file" warning."""
        handle = open(self.path, "rb")
        weakref.finalize(self, handle.close)
        return handle

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_handle", "_last")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._handle, self._last = self._open_handle(), (0, 0, [])

    @classmethod
    def open(cls, path: Path, id_key: str = "_id") -> Corpus:
        """The corpus of ``path`` (ids under ``id_key``) with its titles and texts left in the file."""
        ids: list[str] = []
        doc_ids: list[str] = []
        spans = array.array("q")
        seen: set[str] = set()
        empty = Tally(path, EMPTY_PASSAGES)
        with reading(path), open(path, "rb") as handle:
            end = 0
            for line_no, line in enumerate(handle, 1):
                start, end = end, end + len(line)
                record = _record(line.removeprefix(codecs.BOM_UTF8) if start == 0 else line, path, line_no)
                if record is None:
                    continue
                pid, title, text, doc_id = _checked_passage(record, path, line_no, id_key)
                if not has_words(title, text):
                    empty.add(line_no)
                if pid in seen:
                    raise DataError(f"{path}:{line_no}: duplicate passage id {pid!r}")
                seen.add(pid)
                ids.append(pid)
                doc_ids.append(doc_id)
                spans.extend((start, end))
        if not ids:
            raise DataError(f"{path}: the corpus is empty")
        if empty.count == len(ids):
            raise DataError(all_empty(path, len(ids)))
        empty.warn()
        del seen
        file = cls(path, ids, np.frombuffer(spans, dtype=np.int64).reshape(-1, 2), id_key)
        return Corpus(ids, LazyTexts(file.titles, len(ids)), LazyTexts(file.texts, len(ids)), doc_ids)

    def rows(self, start: int, end: int) -> list[tuple[str, str]]:
        """``(title, text)`` of rows ``start`` to ``end``."""
        if (start, end) == self._last[:2]:
            return self._last[2]
        if end <= start:
            return []
        offset = int(self.spans[start, 0])
        with reading(self.path):
            data = os.pread(self._handle.fileno(), int(self.spans[end - 1, 1]) - offset, offset)
            out = []
            for row in range(start, end):  # each row's own line, as loading found it (the lines between: blank)
                a, b = int(self.spans[row, 0]), int(self.spans[row, 1])
                line = data[a - offset : b - offset]
                if a == 0:
                    line = line.removeprefix(codecs.BOM_UTF8)
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):  # a JSONDecodeError, or json_limit's
                    raise self._changed(row) from None
                if record.__class__ is not dict or str(record.get(self.id_key)) != self.ids[row]:
                    raise self._changed(row)
                out.append((record.get("title") or "", record.get("text")))
        self._last = (start, end, out)
        return out

    def titles(self, start: int, end: int) -> list[str]:
        """The titles of rows ``start`` to ``end``."""
        return [title for title, _ in self.rows(start, end)]

    def texts(self, start: int, end: int) -> list[str]:
        """The texts of rows ``start`` to ``end``."""
        return [text for _, text in self.rows(start, end)]

    def _changed(self, row: int) -> DataError:
        return DataError(
            f"{self.path}: row {row} is not passage {self.ids[row]!r} any more (the file changed after loading)"
        )


def stream_passage_inputs(path: Path, sep_token: str, length: int) -> LazyTexts:
    """The encoder inputs of the ``length`` passages of a corpus file, read from the file on demand: reading
    rows ``a`` to ``b`` holds only those as strings. Reads that go forward continue where the last one
    stopped (a process reading its shard block by block scans the file once); a read backwards starts over."""
    state: dict = {"rows": None, "at": 0}

    def read(start: int, end: int) -> list[str]:
        if state["rows"] is None or start < state["at"]:
            state["rows"], state["at"] = iter_passages(path), 0
        rows = state["rows"]
        for _ in itertools.islice(rows, start - state["at"]):
            pass
        texts = [passage_input(title, text, sep_token) for _, _, title, text, _ in itertools.islice(rows, end - start)]
        state["at"] = start + len(texts)
        if len(texts) != end - start:
            raise DataError(f"{path}: expected {length} passages, the file has fewer (it changed while being read?)")
        return texts

    return LazyTexts(read, length)


def _answers(rec: dict, where: str) -> list[str]:
    """Answer strings of a query record: ``answers``, else ``metadata.answers`` (lists of strings)."""
    return get_strings(rec, "answers", where) or get_strings(
        get_field(rec, "metadata", dict, where, default={}), "answers", f"{where}: metadata"
    )


def read_queries(path: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Queries ``{"_id", "text"}`` (``_id`` a string or integer, ``text`` a string) and, where records carry
    them (``answers`` or ``metadata.answers``, a list of strings), answer strings.

    A query id repeated with the same text is skipped with one counted DataWarning; repeated with a
    different text it is a DataError (which text is meant is unknowable)."""
    queries: dict[str, str] = {}
    answers: dict[str, list[str]] = {}
    repeats = Tally(path, "repeated query ids with the same text, ignored")
    for line_no, rec in read_jsonl(path):
        qid, text = rec.get("_id"), rec.get("text")
        if not (
            qid.__class__ is str
            and qid
            and qid[0] != "\x00"  # RESERVED_ID_PREFIX, checked by get_id
            and text.__class__ is str
            and WHITESPACE.search(qid) is None
        ):
            where = f"{path}:{line_no}"
            qid, text = get_id(rec, "_id", where), get_field(rec, "text", str, where)
        if qid in queries:
            if queries[qid] != text:
                raise DataError(
                    f"{path}:{line_no}: query id {qid!r} repeated with a different text "
                    f"({text[:40]!r}, before {queries[qid][:40]!r})"
                )
            repeats.add(line_no)
            continue
        queries[qid] = text
        if "answers" in rec or "metadata" in rec:
            found = _answers(rec, f"{path}:{line_no}")
            if found:
                answers[qid] = found
    if not queries:
        raise DataError(f"{path}: no queries")
    repeats.warn()
    return queries, answers


INTEGER = re.compile(r"[+-]?[0-9]+")
DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
"""How a grade is written: ASCII digits (Python's ``int`` and ``float`` would also take ``1_0`` and other
scripts' digits)."""

HEADER_GRADES = frozenset(
    {"score", "relevance", "rel", "relevant", "is_relevant", "relevance_score", "label", "grade", "target",
     "judgement", "judgment", "qrel", "qrels"}
)  # fmt: skip
"""The names a qrels header gives its grade column (BEIR's is ``query-id corpus-id score``)."""


def _grade(text: str, where: str) -> int:
    """A relevance grade: an integer, or a decimal of integral value (``1.0``); else a one-line DataError."""
    if INTEGER.fullmatch(text):
        if len(text.lstrip("+-0")) > 20:  # no grade comes near; int() refuses 4,300 digits and more
            raise DataError(f"{where}: relevance {text[:40]!r} is beyond +-{MAX_GRADE}")
        return int(text)
    if not DECIMAL.fullmatch(text) or not float(text).is_integer():
        raise DataError(f"{where}: relevance {text!r} is not an integer")
    return int(float(text))


def _is_header(row: list[str]) -> bool:
    """Whether a qrels file's first row names its columns: its grade column is a name (``HEADER_GRADES``), or its
    first column is (``reader_helpers.HEADER_KEYS``, ``query``, ``topic``). Another first row that is not a judgement
    (an empty or misspelt grade) is an error, not a header skipped in silence."""
    first, grade = row[0].strip().lower(), row[-1].strip().lower()
    named = first in (*HEADER_KEYS, "query", "queryid", "topic", "topic_id", "topicid", "qry_id")
    return grade in HEADER_GRADES or (not DECIMAL.fullmatch(grade) and named)


MAX_GRADE = 2**31 - 1  # the largest relevance grade a qrels file may give (and the lowest, negated)


def _csv_rows(reader: Iterator[list[str]], path: Path) -> Iterator[list[str]]:
    """The rows of a csv ``reader`` of ``path``, its errors (a field over ``csv.field_size_limit()``, a NUL before
    Python 3.11) as one-line DataErrors naming the line."""
    try:
        yield from reader
    except csv.Error as err:
        if "new-line character" in str(err):  # a \r alone: open_text ends lines at \n only
            raise DataError(f"{path}:{reader.line_num}: {LONE_CR}") from None
        raise DataError(f"{path}:{reader.line_num}: not a qrels line ({err})") from None


def read_qrels_tsv(path: Path) -> Qrels:
    """``query-id<TAB>corpus-id<TAB>score`` (BEIR) or TREC ``qid 0 pid grade`` (tabs or spaces).

    A row that names its columns (``_is_header``) is a header, skipped: the first row, or, counted in a
    DataWarning, a later one (files concatenated). Grades are integers in
    ASCII digits (``1.0`` is read as 1; ``0.5``, ``1_0`` or an empty grade is an error) within
    +-:data:`MAX_GRADE`. A (query, passage) pair judged
    twice with the same grade is skipped with one counted DataWarning; with different grades it is a DataError
    (silently keeping either one could drop a positive). An id holding whitespace (a tab-separated field can hold
    spaces) is a DataError (``reader_helpers.check_id``). Fields are never quoted: a ``"`` is part of the id, as in
    a TREC file. A line the csv module refuses (a field over its size limit) is a DataError too."""
    qrels: Qrels = {}
    repeats = Tally(path, "repeated (query, passage) rows with the same grade, ignored")
    headers = Tally(path, "header rows after the first line (concatenated files?), skipped")
    first_row = True
    with reading(path), open_text(path) as handle:
        reader = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)  # ids as written: '"q1' is an id
        for row in _csv_rows(reader, path):
            if not row or not "".join(row).strip():
                continue
            line_no = reader.line_num
            if len(row) == 1:
                row = row[0].split()
            if _is_header(row):
                if not first_row:
                    headers.add(line_no)
                first_row = False
                continue
            first_row = False
            if len(row) > 3 and not row[-1].strip():  # not TREC's 4 columns with an empty grade: a tab at the end
                raise DataError(
                    f"{path}:{line_no}: the line ends in an empty column (a tab at its end?); expected "
                    "query-id<TAB>corpus-id<TAB>score, or TREC's 'qid 0 pid grade'"
                )
            if len(row) == 4:
                row = [row[0], row[2], row[3]]
            if len(row) != 3:
                raise DataError(f"{path}:{line_no}: expected 3 tab-separated columns, got {len(row)}")
            qid, pid, grade_text = (c.strip() for c in row)
            check_id(qid, "query id", f"{path}:{line_no}")
            check_id(pid, "passage id", f"{path}:{line_no}")
            grade = _grade(grade_text, f"{path}:{line_no}")
            if abs(grade) > MAX_GRADE:  # ranx overflows on 2**63; no judgement scale comes near
                raise DataError(f"{path}:{line_no}: relevance {grade_text[:40]!r} is beyond +-{MAX_GRADE}")
            rels = qrels.setdefault(qid, {})
            old = rels.get(pid)
            if old is not None:
                if old != grade:
                    raise DataError(
                        f"{path}:{line_no}: query {qid!r} and passage {pid!r} judged again with "
                        f"grade {grade} (before: {old})"
                    )
                repeats.add(line_no)
                continue
            rels[pid] = grade
    repeats.warn()
    headers.warn()
    return qrels


@records_files
def load_beir(directory: str | Path, name: str | None = None, passages_on_disk: bool = False) -> RetrievalDataset:
    """Read a BEIR directory into a :class:`RetrievalDataset` (one qrels split per ``qrels/*.tsv``);
    ``passages_on_disk``: titles and texts are read from ``corpus.jsonl`` when asked for (:class:`PassageFile`)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"dataset directory not found: {directory}")
    corpus = read_corpus(find_file(directory, "corpus.jsonl"), passages_on_disk)
    queries, answers = read_queries(find_file(directory, "queries.jsonl"))
    qrels_dir = directory / "qrels"
    if not qrels_dir.is_dir():
        raise DataError(f"missing directory: {qrels_dir}")
    # two files of one split (test.tsv and test.v2.tsv) are one line, not the last one read silently
    files = split_files(qrels_dir, ".tsv", lambda stem: stem.split(".")[0], "qrels/<split>.tsv")
    qrels = {split: read_qrels_tsv(path) for split, path in files.items()}
    return RetrievalDataset(name or directory.name, corpus, queries, qrels, answers)
