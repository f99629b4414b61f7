"""Reader for the MS MARCO passage layout.

``collection.tsv`` (``pid<TAB>text``), ``queries.{split}.tsv`` (``qid<TAB>text``) and ``qrels.{split}.tsv``
(TREC ``qid 0 pid grade``), each optionally ``.gz``. Queries of every split go into one dict; passages
have no title and each passage is its own document.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from densepass.data.beir import find_file, open_text, read_qrels_tsv
from densepass.data.dataset import Corpus, Qrels, RetrievalDataset
from densepass.data.io_utils import CorpusBuilder, require_dir, split_files
from densepass.errors import DataError


def read_id_text_tsv(path: Path) -> Iterator[tuple[int, str, str]]:
    """``(line number, id, text)`` for each non-blank ``id<TAB>text`` line of ``path``."""
    with open_text(path) as handle:
        for line_no, line in enumerate(handle, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            key, tab, text = line.partition("\t")
            if not tab or not key.strip():
                raise DataError(f"{path}:{line_no}: expected 'id<TAB>text', got {line[:60]!r}")
            yield line_no, key.strip(), text


def read_collection(path: Path) -> Corpus:
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
        return stem[len(start):]

    return split_files(directory, ".tsv", split_of, f"{prefix}.<split>.tsv")


def read_all_queries(directory: Path) -> dict[str, str]:
    queries: dict[str, str] = {}
    for path in prefixed_split_files(directory, "queries").values():
        for _, qid, text in read_id_text_tsv(path):
            queries.setdefault(qid, text)
    return queries


def read_all_qrels(directory: Path) -> dict[str, Qrels]:
    return {split: read_qrels_tsv(path) for split, path in prefixed_split_files(directory, "qrels").items()}


def load_msmarco(directory: str | Path, name: str | None = None) -> RetrievalDataset:
    """Read an MS MARCO passage-ranking directory into a :class:`RetrievalDataset`."""
    directory = require_dir(directory)
    corpus = read_collection(find_file(directory, "collection.tsv"))
    queries = read_all_queries(directory)
    qrels = read_all_qrels(directory)
    return RetrievalDataset(name or directory.name, corpus, queries, qrels)
