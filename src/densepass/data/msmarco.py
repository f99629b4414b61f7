"""Reader for the MS MARCO passage layout.

``collection.tsv`` (``pid<TAB>text``), ``queries.{split}.tsv`` (``qid<TAB>text``) and ``qrels.{split}.tsv``
(TREC ``qid 0 pid grade``), each optionally ``.gz``. Queries of every split go into one dict; passages
have no title and each passage is its own document.

Bad input is a one-line :class:`DataError` naming the file and line: a line without a tab, a repeated
passage id, a query id given two different texts (in one file or across split files), bad UTF-8. A header
line (``id<TAB>text``, ``pid<TAB>passage``, ``qid<TAB>query``, ...), first in a file or repeated in it, is skipped
with a counted :class:`DataWarning`, and so are query ids repeated with the same text within one file (the same
query in two split files, e.g. ``queries.dev.tsv`` and its subset ``queries.dev.small.tsv``, is normal).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from densepass.data.beir import find_file, read_qrels_tsv
from densepass.data.dataset import Corpus, Qrels, RetrievalDataset
from densepass.data.files import LONE_CR, Tally, read_lines, records_files
from densepass.data.reader_helpers import HEADER_KEYS, CorpusBuilder, check_id, require_dir, split_files
from densepass.errors import DataError

HEADER_TEXTS = frozenset({"text", "passage", "query", "title", "contents", "body", "question"})
"""Second-column names of a header line (``pid<TAB>passage``): a header repeated inside a file names both columns."""


def read_id_text_tsv(path: Path) -> Iterator[tuple[int, str, str]]:
    """``(line number, id, text)`` for each non-blank ``id<TAB>text`` line of ``path``; header lines are skipped with
    one counted DataWarning: first in the file, one whose first column is one of :data:`HEADER_KEYS`; further on
    (files concatenated), one whose second column is a header name too (:data:`HEADER_TEXTS`)."""
    headers = Tally(path, "header lines skipped")
    first = None  # the first line that is not blank
    for line_no, line in read_lines(path):
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        if "\r" in line:  # a file whose lines end in \r alone would be one line: one passage, in silence
            raise DataError(f"{path}:{line_no}: {LONE_CR}")
        first = first or line_no
        key, tab, text = line.partition("\t")
        key = key.strip()
        if not tab or not key:
            raise DataError(f"{path}:{line_no}: expected 'id<TAB>text', got {line[:60]!r}")
        check_id(key, "id", f"{path}:{line_no}")
        # first in the file, a header by its id column alone; further on, by both columns (a passage may be "id")
        if key.lower() in HEADER_KEYS and (line_no == first or text.strip().lower() in HEADER_TEXTS):
            headers.add(line_no)
            continue
        yield line_no, key, text
    headers.warn()


def read_collection(path: Path) -> Corpus:
    """The passages of ``collection.tsv``; a repeated passage id is a DataError."""
    builder = CorpusBuilder()
    for line_no, pid, text in read_id_text_tsv(path):
        if not builder.add(pid, "", text, pid):
            raise DataError(f"{path}:{line_no}: duplicate passage id {pid!r}")
    return builder.build(path)


def prefixed_split_files(directory: Path, prefix: str) -> dict[str, Path]:
    """``{split: path}`` for the files ``{prefix}.{split}.tsv[.gz]`` in ``directory``."""
    start = f"{prefix}."

    def split_of(stem: str) -> str | None:
        if not stem.startswith(start) or stem == start:
            return None
        return stem[len(start) :]

    return split_files(directory, ".tsv", split_of, f"{prefix}.<split>.tsv")


def read_all_queries(directory: Path) -> dict[str, str]:
    """The queries of every ``queries.{split}.tsv``: a query id with two different texts is a DataError;
    one repeated with the same text within a file is ignored, with one counted DataWarning per file."""
    queries: dict[str, str] = {}
    for path in prefixed_split_files(directory, "queries").values():
        in_file: set[str] = set()
        repeats = Tally(path, "repeated query ids with the same text, ignored")
        for line_no, qid, text in read_id_text_tsv(path):
            old = queries.setdefault(qid, text)
            if old != text:
                raise DataError(
                    f"{path}:{line_no}: query id {qid!r} given again with a different text "
                    f"({text[:40]!r}, before {old[:40]!r})"
                )
            if qid in in_file:
                repeats.add(line_no)
            in_file.add(qid)
        repeats.warn()
    return queries


def read_all_qrels(directory: Path) -> dict[str, Qrels]:
    """``{split: qrels}`` of every ``qrels.{split}.tsv`` in ``directory``."""
    return {split: read_qrels_tsv(path) for split, path in prefixed_split_files(directory, "qrels").items()}


@records_files
def load_msmarco(directory: str | Path, name: str | None = None) -> RetrievalDataset:
    """Read an MS MARCO passage-ranking directory into a :class:`RetrievalDataset`."""
    directory = require_dir(directory)
    corpus = read_collection(find_file(directory, "collection.tsv"))
    queries = read_all_queries(directory)
    qrels = read_all_qrels(directory)
    return RetrievalDataset(name or directory.name, corpus, queries, qrels)
