"""SQuAD v1.1 (``train-v1.1.json``, ``dev-v1.1.json``, optionally .gz) as an open-retrieval dataset.

Every paragraph is a passage (id ``{split}-{article index}-{paragraph index}``, title = article title with
underscores as spaces, document = article title); every question is a query (its SQuAD id) with grade 1
for its own paragraph and its answer texts (repeats removed, order kept). The split is the file name's
prefix before the first ``-``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from densepass.data.dataset import Qrels, RetrievalDataset
from densepass.data.io_utils import CorpusBuilder, get_field, read_json, require_dir, split_files, unique
from densepass.errors import DataError


class SquadBuilder:
    """Accumulates passages, queries, answers and qrels over the SQuAD files of a directory."""

    def __init__(self) -> None:
        self.corpus = CorpusBuilder()
        self.queries: dict[str, str] = {}
        self.answers: dict[str, list[str]] = {}
        self.qrels: dict[str, Qrels] = {}

    def add_file(self, path: Path, split: str) -> None:
        """Add every article of one SQuAD file as split ``split``."""
        data = get_field(read_json(path), "data", list, str(path))
        qrels = self.qrels.setdefault(split, {})
        for a, article in enumerate(data):
            where = f"{path}: data[{a}]"
            title = get_field(article, "title", str, where)
            for p, paragraph in enumerate(get_field(article, "paragraphs", list, where)):
                pid = f"{split}-{a}-{p}"
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
        qid = str(get_field(qa, "id", (str, int), where))
        if qid in self.queries:
            raise DataError(f"{where}: duplicate question id {qid!r}")
        self.queries[qid] = get_field(qa, "question", str, where).strip()
        answers = get_field(qa, "answers", list, where, default=[])
        texts = unique(get_field(ans, "text", str, f"{where}.answers[{i}]") for i, ans in enumerate(answers))
        if texts:
            self.answers[qid] = texts
        qrels[qid] = {pid: 1}


def load_squad(directory: str | Path, name: str | None = None) -> RetrievalDataset:
    """Read SQuAD JSON files into a :class:`RetrievalDataset` (one passage per paragraph)."""
    directory = require_dir(directory)
    builder = SquadBuilder()
    files = split_files(directory, ".json", lambda stem: stem.split("-", 1)[0], "SQuAD <split>-v1.1.json")
    for split, path in files.items():
        builder.add_file(path, split)
    return RetrievalDataset(
        name or directory.name, builder.corpus.build(directory), builder.queries, builder.qrels, builder.answers
    )
