"""Reader for the BEIR layout: corpus.jsonl, queries.jsonl, qrels/{split}.tsv (each optionally .gz)."""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path

from densepass.data.dataset import Corpus, Qrels, RetrievalDataset
from densepass.errors import DataError


def find_file(directory: Path, stem: str) -> Path:
    """``stem`` or ``stem.gz`` inside ``directory``, with a clear error when neither exists."""
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise DataError(f"missing file: {directory / stem} (or .gz)")


def open_text(path: Path) -> io.TextIOBase:
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def read_jsonl(path: Path) -> Iterator[dict]:
    with open_text(path) as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{line_no}: expected a JSON object")
            yield record


def read_corpus(path: Path) -> Corpus:
    ids, titles, texts, doc_ids = [], [], [], []
    for line_no, rec in enumerate(read_jsonl(path), 1):
        if "_id" not in rec or "text" not in rec:
            raise DataError(f"{path}: record {line_no} lacks '_id' or 'text'")
        pid = str(rec["_id"])
        ids.append(pid)
        titles.append(rec.get("title") or "")
        texts.append(rec["text"] or "")
        doc_ids.append(str(rec.get("doc_id") or pid))
    if not ids:
        raise DataError(f"{path}: the corpus is empty")
    return Corpus(ids, titles, texts, doc_ids)


def read_queries(path: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Queries and, where records carry them (``answers`` or ``metadata.answers``), answer strings."""
    queries, answers = {}, {}
    for line_no, rec in enumerate(read_jsonl(path), 1):
        if "_id" not in rec or "text" not in rec:
            raise DataError(f"{path}: record {line_no} lacks '_id' or 'text'")
        qid = str(rec["_id"])
        queries[qid] = rec["text"]
        found = rec.get("answers") or (rec.get("metadata") or {}).get("answers")
        if found:
            answers[qid] = [str(a) for a in found]
    if not queries:
        raise DataError(f"{path}: no queries")
    return queries, answers


def read_qrels_tsv(path: Path) -> Qrels:
    """``query-id<TAB>corpus-id<TAB>score`` with a header line (BEIR), or TREC ``qid 0 pid grade``."""
    qrels: Qrels = {}
    with open_text(path) as handle:
        for line_no, row in enumerate(csv.reader(handle, delimiter="\t"), 1):
            if not row or not "".join(row).strip():
                continue
            if len(row) == 1:
                row = row[0].split()
            if line_no == 1 and not row[-1].strip().lstrip("-").isdigit():
                continue  # header
            if len(row) == 4:
                row = [row[0], row[2], row[3]]
            if len(row) != 3:
                raise DataError(f"{path}:{line_no}: expected 3 tab-separated columns, got {len(row)}")
            qid, pid, grade = (c.strip() for c in row)
            try:
                qrels.setdefault(qid, {})[pid] = int(grade)
            except ValueError:
                raise DataError(f"{path}:{line_no}: relevance {grade!r} is not an integer") from None
    return qrels


def load_beir(directory: str | Path, name: str | None = None) -> RetrievalDataset:
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
