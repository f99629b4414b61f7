"""One interface for every index: build, add, search, save, load.

An index holds the passages it was given (ids, titles, texts, document ids: a ``Corpus``; a loaded index, or one
built from a BEIR ``corpus.jsonl`` by ``densepass index``, reads titles and texts from that file when a search
returns them: ``data.beir.PassageFile``) and answers
``search(queries, k)`` with ``SearchResults`` (rows into those passages, scores, and the passage ids).
Kinds register themselves in ``KINDS``; ``load_index(directory)`` reads the manifest and returns the
right class. Today: ``exact`` and the FAISS kinds (``index.dense``), ``faiss-ivfpq-disk`` (IVF-PQ with
memory-mapped lists, ``index.ondisk``), ``bm25`` (``index.bm25``), ``splade`` (``index.splade``),
``colbert`` (``index.colbert``) and ``hybrid`` fusion of two (``index.hybrid``).

A saved index is a directory written atomically (a temporary directory renamed into place) holding
the passages (``passages.jsonl``), the kind's own files, and ``manifest.json`` written last: kind,
densepass version, model path and weights fingerprint (dense kinds), dimension, size, corpus
fingerprint, options, and the size and digest of every file. Loading verifies all of it: a truncated or
corrupted file, or another model than the one that built the index, is a one-line error.

>>> from densepass.index import BM25Index
>>> index = BM25Index.build(["the tar archiver", "a kernel driver", "an audio editor"])
>>> results = index.search(["audio"], k=2)
>>> results.ids(0)
['2']
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from densepass.data.beir import PassageFile
from densepass.data.dataset import Corpus
from densepass.errors import ConfigError, DataError
from densepass.fingerprints import fingerprint_corpus
from densepass.io import (
    MANIFEST,
    atomic_directory,
    check_replaceable,
    disk_errors,
    hold_temporaries,
    read_manifest,
    remove_stale_temporaries,
    write_manifest,
)
from densepass.version import __version__

PASSAGES = "passages.jsonl"
FORMAT = "densepass-index"
Passages = Corpus | Sequence[str] | Sequence[dict]


def as_corpus(passages: Passages, first_id: int = 0) -> Corpus:
    """A ``Corpus`` from a Corpus, from texts (ids ``"0"``, ``"1"``, ... from ``first_id``), or from dicts
    with ``id`` (or ``_id``), ``text`` and optional ``title`` / ``doc_id``."""
    if isinstance(passages, Corpus):
        return passages
    if isinstance(passages, str):
        raise ConfigError("index passages must be a list (of texts or of {id, title, text} records), not one string")
    items = list(passages)
    if not items:
        raise ConfigError("no passages to index")
    if all(isinstance(p, str) for p in items):
        ids = [str(first_id + i) for i in range(len(items))]
        return Corpus(ids, [""] * len(items), items, ids)
    ids, titles, texts, docs = [], [], [], []
    for i, record in enumerate(items):
        if not isinstance(record, dict):
            raise ConfigError(
                f"passage {i}: expected a text or an {{id, title, text}} record, got {type(record).__name__}"
            )
        pid = record.get("id", record.get("_id"))
        text = record.get("text")
        if not isinstance(pid, (str, int)) or isinstance(pid, bool) or not isinstance(text, str):
            raise ConfigError(f"passage {i}: a record needs a string or integer 'id' and a string 'text'")
        title = record.get("title") or ""
        if not isinstance(title, str):
            raise ConfigError(f"passage {i}: 'title' must be a string")
        ids.append(str(pid))
        titles.append(title)
        texts.append(text)
        docs.append(str(record.get("doc_id") or pid))
    return Corpus(ids, titles, texts, docs)


def concat_corpora(first: Corpus, second: Corpus) -> Corpus:
    """Passages of ``first`` then of ``second`` (in memory, also when ``first`` was read from a file); a repeated
    id is an error (Corpus checks)."""
    return Corpus(
        first.ids + second.ids,
        [*first.titles, *second.titles],
        [*first.texts, *second.texts],
        first.doc_ids + second.doc_ids,
    )


def check_index_target(directory: str | Path) -> None:
    """A one-line error where ``directory`` holds something densepass saved that is not an index (a model, a
    checkpoint): an index replaces only an index (``io.atomic_directory`` checks that densepass wrote it)."""
    directory = Path(directory)
    check_replaceable(directory, "--output")
    if not directory.is_dir() or directory.is_symlink() or not any(directory.iterdir()):
        return
    try:
        format = json.loads((directory / MANIFEST).read_text(encoding="utf-8")).get("format")
    except (OSError, ValueError, AttributeError):
        format = None
    if format != FORMAT:
        raise DataError(
            f"--output {directory} holds something that is not a densepass index (a model or a checkpoint?); an "
            "index replaces only an index: choose another path"
        )


def save_passages(corpus: Corpus, path: Path) -> None:
    """The passages as JSONL, one ``{"id", "title", "text", "doc_id"}`` a line, written as they are read (a corpus
    read from its file is never all in memory); the caller makes the write atomic (``Index.save``)."""
    with open(path, "w", encoding="utf-8") as handle:
        for i, t, x, d in zip(corpus.ids, corpus.titles, corpus.texts, corpus.doc_ids):
            handle.write(json.dumps({"id": i, "title": t, "text": x, "doc_id": d}, ensure_ascii=False) + "\n")


def load_passages(path: Path) -> Corpus:
    """Read ``save_passages`` output back: ids in memory, titles and texts read from the file when a search
    returns them (``data.beir.PassageFile``)."""
    return PassageFile.open(path, id_key="id")


@dataclass
class SearchResults:
    """Top-k of each query: ``rows`` [n, k] into ``passages`` (-1 where fewer than k were found) and
    their ``scores`` [n, k], best first."""

    scores: np.ndarray
    rows: np.ndarray
    passages: Corpus

    def __len__(self) -> int:
        return len(self.rows)

    def hits(self, i: int) -> list[tuple[str, float]]:
        """(passage id, score) of query ``i``, best first."""
        ids = self.passages.ids
        return [(ids[r], float(s)) for r, s in zip(self.rows[i].tolist(), self.scores[i].tolist()) if r >= 0]

    def ids(self, i: int) -> list[str]:
        """Passage ids of query ``i``, best first."""
        return [pid for pid, _ in self.hits(i)]

    def as_run(self, query_ids: Sequence[str]) -> dict[str, dict[str, float]]:
        """``{query id: {passage id: score}}`` (a TREC run in memory, as ``evaluation.metrics`` reads it)."""
        if len(query_ids) != len(self):
            raise ConfigError(f"{len(query_ids)} query ids for {len(self)} result lists")
        return {qid: dict(self.hits(i)) for i, qid in enumerate(query_ids)}

    def __iter__(self) -> Iterator[list[tuple[str, float]]]:
        return (self.hits(i) for i in range(len(self)))


def check_k(k: int) -> int:
    """``k`` as an int, or a one-line error unless it is a positive integer."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ConfigError(f"k must be a positive integer, got {k!r}")
    return int(k)


def check_queries(queries: Sequence[str]) -> list[str]:
    """``queries`` as a non-empty list of strings, or a one-line error."""
    if isinstance(queries, str):
        raise ConfigError("search takes a list of queries, not one string")
    queries = list(queries)
    if not queries:
        raise ConfigError("no queries to search")
    bad = next((q for q in queries if not isinstance(q, str)), None)
    if bad is not None:
        raise ConfigError(f"queries must be strings, got {type(bad).__name__}")
    return queries


class Index(ABC):
    """An index over passages; see the module docstring."""

    kind: ClassVar[str]
    load_options: ClassVar[tuple[str, ...] | None] = ()
    """The options ``load`` takes for this kind (what searching may change: the model, device, precision ...);
    None: the kind checks them itself (a hybrid, per part)."""
    passages: Corpus

    def __len__(self) -> int:
        return len(self.passages)

    @abstractmethod
    def add(self, passages: Passages) -> None:
        """Index more passages (their ids must be new)."""

    @abstractmethod
    def search_rows(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores [n, k'], rows [n, k']) of the top k' = min(k, len(self)) passages of each query."""

    def search(self, queries: Any, k: int = 10) -> SearchResults:
        """The top-``k`` passages of each query (query texts; dense kinds also take query embeddings)."""
        if len(self) == 0:
            raise ConfigError("the index is empty: add passages before searching")
        scores, rows = self.search_rows(queries, check_k(k))
        return SearchResults(scores, rows, self.passages)

    # ---- persistence --------------------------------------------------------------------------------

    def facts(self) -> dict:
        """What the manifest records besides the common facts (model, dimension, options)."""
        return {}

    @abstractmethod
    def _write(self, directory: Path) -> None:
        """Write the kind's own files into ``directory``."""

    def save(self, directory: str | Path) -> Path:
        """Write the index atomically to ``directory`` (replacing what is there only once complete); a full disk is
        a one-line error, with nothing left behind (``io.disk_errors``)."""
        directory = Path(directory)
        check_index_target(directory)
        remove_stale_temporaries(directory.parent, re.escape(directory.name))  # a killed save's
        with disk_errors(directory), hold_temporaries() as hold, atomic_directory(directory) as tmp:
            hold(tmp)
            save_passages(self.passages, tmp / PASSAGES)
            self._write(tmp)
            write_manifest(
                tmp,
                format=FORMAT,
                kind=self.kind,
                densepass_version=__version__,
                size=len(self),
                corpus_fingerprint=fingerprint_corpus(self.passages),
                **with_absolute_model_path(self.facts()),
            )
        return directory

    @classmethod
    @abstractmethod
    def _read(cls, directory: Path, manifest: dict, passages: Corpus, **options) -> Index:
        """Build the index from its verified files."""

    @classmethod
    def load(cls, directory: str | Path, **options) -> Index:
        """Read a saved index of this kind (verified against its manifest)."""
        directory = Path(directory)
        manifest = read_index_manifest(directory)
        kinds = getattr(cls, "kinds", (cls.kind,))
        if manifest["kind"] not in kinds:
            raise DataError(f"{directory} holds a {manifest['kind']} index, not a {' or '.join(kinds)} index")
        kind = KINDS[manifest["kind"]]
        unknown = sorted(set(options) - set(kind.load_options)) if kind.load_options is not None else []
        if unknown:
            takes = ", ".join(kind.load_options) or "none"
            raise ConfigError(
                f"a {manifest['kind']} index takes no load option {', '.join(unknown)} (it takes: {takes})"
            )
        passages = load_passages(directory / PASSAGES)
        if len(passages) != manifest["size"]:
            raise DataError(f"{directory}: {len(passages)} passages but the manifest says {manifest['size']}")
        try:
            return kind._read(directory, manifest, passages, **options)
        except (ValueError, EOFError) as err:  # NumPy, SciPy, JSON: files of another format under a matching manifest
            raise DataError(f"{directory} is not a usable densepass index: its files do not load ({err})") from None


def with_absolute_model_path(facts: dict) -> dict:
    """``facts`` with the model's path made absolute where it is a local directory, so that the saved index finds
    its model from any working directory (a hub name stays as it is)."""
    model = facts.get("model")
    if isinstance(model, dict) and model.get("path") and Path(model["path"]).exists():
        return {**facts, "model": {**model, "path": str(Path(model["path"]).resolve())}}
    return facts


KINDS: dict[str, type[Index]] = {}


def register(cls: type[Index]) -> type[Index]:
    """Class decorator: make ``load_index`` know an index kind (``cls.kind``, or each of ``cls.kinds``)."""
    for kind in getattr(cls, "kinds", (cls.kind,)):
        KINDS[kind] = cls
    return cls


def read_index_manifest(directory: Path) -> dict:
    """The verified manifest of a saved index, with a one-line error for anything else."""
    manifest = read_manifest(directory, "densepass index")
    if manifest.get("format") != FORMAT or manifest.get("kind") not in KINDS:
        raise DataError(f"{directory} is not a densepass index (manifest kind {manifest.get('kind')!r})")
    return manifest


def load_index(directory: str | Path, **options) -> Index:
    """Load any saved index: its manifest says which kind (``options`` go to that kind, e.g. ``model=``)."""
    directory = Path(directory)
    return KINDS[read_index_manifest(directory)["kind"]].load(directory, **options)
