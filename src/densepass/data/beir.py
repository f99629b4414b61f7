"""Reader for the BEIR layout: corpus.jsonl, queries.jsonl, qrels/{split}.tsv (each optionally .gz).

Every field read is type-checked, and bad input is a one-line :class:`DataError` naming the file and line:
a non-string ``text`` or ``title``, a null or non-scalar ``_id``, bad UTF-8, a truncated gzip file. What is
tolerated is counted and reported once per file as a :class:`DataWarning` (see each reader's docstring).
"""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from densepass.data.dataset import Corpus, LazyTexts, Qrels, RetrievalDataset, passage_input
from densepass.data.files import Tally, open_text, reading
from densepass.data.io_utils import CorpusBuilder, get_field, get_id, get_strings
from densepass.errors import DataError


def find_file(directory: Path, stem: str) -> Path:
    """``stem`` or ``stem.gz`` inside ``directory``, with a clear error when neither exists."""
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise DataError(f"missing file: {directory / stem} (or .gz)")


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` for each non-blank line of a JSON-lines file; each must be a JSON object."""
    with reading(path), open_text(path) as handle:
        for line_no, line in enumerate(handle, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                if not line.strip():
                    continue
                raise DataError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
            if record.__class__ is not dict:
                raise DataError(f"{path}:{line_no}: expected a JSON object")
            yield line_no, record


def _passage(rec: dict, where: str) -> tuple[str, str, str, str]:
    """``(_id, title, text, doc_id)`` of a corpus record, each field type-checked."""
    pid = get_id(rec, "_id", where)
    doc_id = str(get_field(rec, "doc_id", (str, int), where, default=""))
    return (pid, get_field(rec, "title", str, where, default=""), get_field(rec, "text", str, where), doc_id or pid)


def iter_passages(path: Path) -> Iterator[tuple[int, str, str, str, str]]:
    """``(line number, _id, title, text, doc_id)`` of each passage of a corpus file, in order, fields checked
    as :func:`read_corpus` says (repeated ids are the caller's to detect)."""
    for line_no, rec in read_jsonl(path):
        pid, title, text, doc_id = rec.get("_id"), rec.get("title"), rec.get("text"), rec.get("doc_id")
        if not (
            pid.__class__ is str
            and pid
            and title.__class__ is str
            and text.__class__ is str
            and doc_id.__class__ is str
            and doc_id
        ):  # fast path; anything else is checked field by field
            pid, title, text, doc_id = _passage(rec, f"{path}:{line_no}")
        yield line_no, pid, title, text, doc_id


def read_corpus(path: Path) -> Corpus:
    """Passages ``{"_id", "text", "title"?, "doc_id"?}``: ``_id`` a string or integer, ``text`` a string,
    ``title`` a string or null, ``doc_id`` a string, integer or null (then the passage is its own document).
    A repeated ``_id`` is an error."""
    corpus = CorpusBuilder()
    for line_no, pid, title, text, doc_id in iter_passages(path):
        if not corpus.add(pid, title, text, doc_id):
            raise DataError(f"{path}:{line_no}: duplicate passage id {pid!r}")
    return corpus.build(path)


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
        if not (qid.__class__ is str and qid and text.__class__ is str):  # fast path, as in read_corpus
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


def _grade(text: str, where: str) -> int:
    """A relevance grade that is not written as an integer: an integral float (``1.0``) is accepted."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value.is_integer():
        raise DataError(f"{where}: relevance {text!r} is not an integer")
    return int(value)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_qrels_tsv(path: Path) -> Qrels:
    """``query-id<TAB>corpus-id<TAB>score`` (BEIR) or TREC ``qid 0 pid grade`` (tabs or spaces).

    The first row is a header, and skipped, when its grade column is not a number. Grades are integers
    (``1.0`` is read as 1; ``0.5`` is an error). A (query, passage) pair judged twice with the same grade
    is skipped with one counted DataWarning; with different grades it is a DataError (silently keeping
    either one could drop a positive)."""
    qrels: Qrels = {}
    repeats = Tally(path, "repeated (query, passage) rows with the same grade, ignored")
    first_row = True
    with reading(path), open_text(path) as handle:
        reader = csv.reader(handle, delimiter="\t")
        for row in reader:
            if not row or not "".join(row).strip():
                continue
            line_no = reader.line_num
            if len(row) == 1:
                row = row[0].split()
            if first_row:
                first_row = False
                if row and not _is_number(row[-1].strip()):
                    continue  # header
            if len(row) == 4:
                row = [row[0], row[2], row[3]]
            if len(row) != 3:
                raise DataError(f"{path}:{line_no}: expected 3 tab-separated columns, got {len(row)}")
            qid, pid, grade_text = (c.strip() for c in row)
            try:
                grade = int(grade_text)
            except ValueError:
                grade = _grade(grade_text, f"{path}:{line_no}")
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
    return qrels


def load_beir(directory: str | Path, name: str | None = None) -> RetrievalDataset:
    """Read a BEIR directory into a :class:`RetrievalDataset` (one qrels split per ``qrels/*.tsv``)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"dataset directory not found: {directory}")
    corpus = read_corpus(find_file(directory, "corpus.jsonl"))
    queries, answers = read_queries(find_file(directory, "queries.jsonl"))
    qrels_dir = directory / "qrels"
    if not qrels_dir.is_dir():
        raise DataError(f"missing directory: {qrels_dir}")
    qrels = {}
    for path in sorted(qrels_dir.iterdir()):
        split = path.name.split(".")[0]
        if path.name.endswith((".tsv", ".tsv.gz")):
            qrels[split] = read_qrels_tsv(path)
    if not qrels:
        raise DataError(f"{qrels_dir}: no qrels/<split>.tsv file")
    return RetrievalDataset(name or directory.name, corpus, queries, qrels, answers)
