"""Reader for DPR's retriever training files (``{split}.json`` or e.g. ``biencoder-nq-train.json``, optionally .gz).

Each file is a JSON list of ``{"question", "answers", "positive_ctxs", "negative_ctxs", "hard_negative_ctxs"}``
records, each context ``{"title", "text", "passage_id"?, "psg_id"?}``. The corpus is every context seen
(de-duplicated by id); query ids are ``{split}-{index}``; positives get grade 1; a passage's document is
its title (the passages of one Wikipedia article share it). The given hard negatives are returned by
:func:`dpr_hard_negatives`, with the same ids.

Every field is type-checked (a DataError names the file and record). A passage id seen again with the same
title and text is the same passage; with a different title or text it is a DataError.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from densepass.data.dataset import Qrels, RetrievalDataset
from densepass.data.files import records_files
from densepass.data.reader_helpers import (
    CorpusBuilder,
    check_id,
    get_field,
    get_id,
    get_strings,
    read_json,
    require_dir,
    split_files,
    unique,
)
from densepass.errors import DataError

CONTEXT_FIELDS = ("positive_ctxs", "negative_ctxs", "hard_negative_ctxs")


@dataclass(frozen=True)
class Context:
    """One DPR context: its passage id, title and text."""

    pid: str
    title: str
    text: str


@dataclass
class DprRecord:
    """One DPR training record: question, answers and contexts by field."""

    qid: str
    question: str
    answers: list[str]
    contexts: dict[str, list[Context]]  # CONTEXT_FIELDS -> contexts


def context_id(ctx: dict, title: str, text: str, where: str) -> str:
    """``passage_id`` or ``psg_id`` (a string or integer) when given, else a stable id hashed from title and
    text."""
    for key in ("passage_id", "psg_id"):
        if ctx.get(key) not in (None, ""):
            return get_id(ctx, key, where)
    digest = hashlib.sha1(f"{title}\x00{text}".encode()).hexdigest()
    return f"h{digest[:16]}"


def parse_context(ctx: Any, where: str) -> Context:
    """A checked ``Context`` from one JSON context; ``where`` locates it in errors."""
    text = get_field(ctx, "text", str, where)
    title = get_field(ctx, "title", str, where, default="")
    return Context(context_id(ctx, title, text, where), title, text)


def parse_record(record: Any, split: str, index: int, where: str) -> DprRecord:
    """A checked ``DprRecord`` (query id ``{split}-{index}``) from one JSON record."""
    qid = check_id(f"{split}-{index}", "query id (from the file name)", where)
    question = get_field(record, "question", str, where)
    answers = get_strings(record, "answers", where)
    contexts = {}
    for key in CONTEXT_FIELDS:
        items = get_field(record, key, list, where, default=[])
        contexts[key] = [parse_context(ctx, f"{where}.{key}[{i}]") for i, ctx in enumerate(items)]
    return DprRecord(qid, question, unique(answers), contexts)


def dpr_split_files(directory: Path) -> dict[str, Path]:
    """``{split: path}``: the split is the last ``-``-separated part of the name before ``.json``."""
    return split_files(directory, ".json", lambda stem: stem.rsplit("-", 1)[-1], "DPR <split>.json")


def read_split(path: Path, split: str) -> Iterator[DprRecord]:
    """The records of one DPR file, in order."""
    records = read_json(path)
    if not isinstance(records, list):
        raise DataError(f"{path}: expected a JSON list of records, got {type(records).__name__}")
    for index, record in enumerate(records):
        yield parse_record(record, split, index, f"{path}: record {index}")


@records_files
def load_dpr(directory: str | Path, name: str | None = None) -> RetrievalDataset:
    """Read a directory of DPR JSON files into a :class:`RetrievalDataset` (positives get grade 1)."""
    directory = require_dir(directory)
    corpus = CorpusBuilder()
    queries: dict[str, str] = {}
    answers: dict[str, list[str]] = {}
    qrels: dict[str, Qrels] = {}
    for split, path in dpr_split_files(directory).items():
        split_qrels = qrels.setdefault(split, {})
        for index, record in enumerate(read_split(path, split)):
            queries[record.qid] = record.question
            if record.answers:
                answers[record.qid] = record.answers
            for key, contexts in record.contexts.items():
                for i, ctx in enumerate(contexts):
                    conflict = corpus.add_or_compare(ctx.pid, ctx.title, ctx.text, ctx.title or ctx.pid)
                    if conflict:
                        raise DataError(f"{path}: record {index}.{key}[{i}]: {conflict}")
            positives = record.contexts["positive_ctxs"]
            if positives:
                split_qrels[record.qid] = {ctx.pid: 1 for ctx in positives}
    return RetrievalDataset(name or directory.name, corpus.build(directory), queries, qrels, answers)


def dpr_hard_negatives(directory: str | Path) -> dict[str, list[str]]:
    """Query id -> ids of its given ``hard_negative_ctxs`` (ids as in :func:`load_dpr`; queries without any
    hard negative are left out; repeats removed, order kept)."""
    out: dict[str, list[str]] = {}
    for split, path in dpr_split_files(require_dir(directory)).items():
        for record in read_split(path, split):
            ids = unique(ctx.pid for ctx in record.contexts["hard_negative_ctxs"])
            if ids:
                out[record.qid] = ids
    return out
