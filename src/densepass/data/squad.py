"""SQuAD v1.1 (``train-v1.1.json``, ``dev-v1.1.json``, optionally .gz) as an open-retrieval dataset.

Every paragraph is a passage (id ``{split}-{article index}-{paragraph index}``, title = article title with
underscores as spaces, document = article title); every question is a query (its SQuAD id) with grade 1
for its own paragraph and its answer texts (repeats removed, order kept). The split is the file name's
prefix before the first ``-``.

For phrase retrieval, ``load_squad_spans`` also returns every answer's character span in its paragraph
(``answers[].answer_start``), checked against the text: an answer whose offset does not point at its
text, a question with no usable answer and an empty paragraph are skipped there, each kind counted in
one :class:`DataWarning` (the passage-level dataset is the same as ``load_squad``'s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from densepass.data.dataset import Qrels, RetrievalDataset
from densepass.data.files import Tally, records_files
from densepass.data.reader_helpers import (
    CorpusBuilder,
    check_id,
    get_field,
    read_json,
    require_dir,
    split_files,
    unique,
)
from densepass.errors import DataError


@dataclass(frozen=True)
class AnswerSpan:
    """An answer's text and its character span ``[start, end)`` in its passage's text."""

    text: str
    start: int

    @property
    def end(self) -> int:
        """One past the answer's last character."""
        return self.start + len(self.text)


@dataclass
class SquadSpans:
    """A SQuAD dataset with its answer spans: ``spans[qid]`` are the checked spans of the question in its
    passage ``passage[qid]``; ``skipped`` counts what was left out of ``spans`` (by kind)."""

    dataset: RetrievalDataset
    spans: dict[str, list[AnswerSpan]]
    passage: dict[str, str]
    skipped: dict[str, int] = field(default_factory=dict)


class SquadBuilder:
    """Accumulates passages, queries, answers and qrels over the SQuAD files of a directory."""

    def __init__(self) -> None:
        self.corpus = CorpusBuilder()
        self.queries: dict[str, str] = {}
        self.answers: dict[str, list[str]] = {}
        self.qrels: dict[str, Qrels] = {}
        # qid -> (where the question is, [(answer text, answer_start, where the answer is)]), unchecked
        self.raw_spans: dict[str, tuple[str, list[tuple[Any, Any, str]]]] = {}

    def add_file(self, path: Path, split: str) -> None:
        """Add every article of one SQuAD file as split ``split``."""
        data = get_field(read_json(path), "data", list, str(path))
        qrels = self.qrels.setdefault(split, {})
        for a, article in enumerate(data):
            where = f"{path}: data[{a}]"
            title = get_field(article, "title", str, where)
            for p, paragraph in enumerate(get_field(article, "paragraphs", list, where)):
                pid = check_id(f"{split}-{a}-{p}", "passage id (from the file name)", where)
                self.add_paragraph(paragraph, pid, title, qrels, f"{where}.paragraphs[{p}]")

    def add_paragraph(self, paragraph: Any, pid: str, title: str, qrels: Qrels, where: str) -> None:
        """Add a paragraph as passage ``pid`` and its questions as queries."""
        context = get_field(paragraph, "context", str, where)
        self.corpus.add(pid, title.replace("_", " "), context, title)
        for q, qa in enumerate(get_field(paragraph, "qas", list, where)):
            self.add_question(qa, pid, qrels, f"{where}.qas[{q}]")

    def add_question(self, qa: Any, pid: str, qrels: Qrels, where: str) -> None:
        """Add one question (skipping SQuAD v2 unanswerable ones) with its answers and qrels."""
        if get_field(qa, "is_impossible", bool, where, default=False):
            return  # SQuAD v2 unanswerable question: no passage answers it
        qid = check_id(str(get_field(qa, "id", (str, int), where)), "field 'id'", where)
        if qid in self.queries:
            raise DataError(f"{where}: duplicate question id {qid!r}")
        self.queries[qid] = get_field(qa, "question", str, where).strip()
        answers = get_field(qa, "answers", list, where, default=[])
        texts = unique(get_field(ans, "text", str, f"{where}.answers[{i}]") for i, ans in enumerate(answers))
        if texts:
            self.answers[qid] = texts
        self.raw_spans[qid] = (
            where,
            [(ans.get("text"), ans.get("answer_start"), f"{where}.answers[{i}]") for i, ans in enumerate(answers)],
        )
        qrels[qid] = {pid: 1}

    def checked_spans(self, dataset: RetrievalDataset) -> SquadSpans:
        """The answer spans that point at their text in their paragraph; the rest counted and warned about."""
        source = dataset.name
        tallies = {
            "empty passage": Tally(source, "questions on an empty paragraph, skipped for phrases"),
            "offset mismatch": Tally(source, "answers whose answer_start does not point at their text, skipped"),
            "no answer": Tally(source, "questions without a usable answer span, skipped for phrases"),
        }
        spans: dict[str, list[AnswerSpan]] = {}
        passage: dict[str, str] = {}
        for qrels in self.qrels.values():
            for qid, rels in qrels.items():
                pid = next(iter(rels))
                text = dataset.corpus.texts[dataset.corpus.position(pid)]
                where, answers = self.raw_spans[qid]
                if not text.strip():
                    tallies["empty passage"].add(where)
                    continue
                good = []
                for answer, start, at in answers:
                    valid = isinstance(start, int) and not isinstance(start, bool) and start >= 0 and answer
                    if not valid or text[start : start + len(answer)] != answer:
                        tallies["offset mismatch"].add(at)
                        continue
                    if AnswerSpan(answer, start) not in good:
                        good.append(AnswerSpan(answer, start))
                if not good:
                    tallies["no answer"].add(where)
                    continue
                spans[qid], passage[qid] = good, pid
        for tally in tallies.values():
            tally.warn()
        return SquadSpans(dataset, spans, passage, {kind: t.count for kind, t in tallies.items()})


@records_files
def _read(directory: str | Path, name: str | None) -> tuple[SquadBuilder, RetrievalDataset]:
    directory = require_dir(directory)
    builder = SquadBuilder()
    files = split_files(directory, ".json", lambda stem: stem.split("-", 1)[0], "SQuAD <split>-v1.1.json")
    for split, path in files.items():
        builder.add_file(path, split)
    dataset = RetrievalDataset(
        name or directory.name, builder.corpus.build(directory), builder.queries, builder.qrels, builder.answers
    )
    return builder, dataset


def load_squad(directory: str | Path, name: str | None = None) -> RetrievalDataset:
    """Read SQuAD JSON files into a :class:`RetrievalDataset` (one passage per paragraph)."""
    return _read(directory, name)[1]


def load_squad_spans(directory: str | Path, name: str | None = None) -> SquadSpans:
    """``load_squad`` plus every question's answer spans, checked against the paragraph text (see the module)."""
    builder, dataset = _read(directory, name)
    return builder.checked_spans(dataset)
