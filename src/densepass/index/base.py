"""One interface for every index: build, add, search, save, load; and delete, upsert, compact (a living index:
tombstones left out of every search, then compaction; saved updates are versions, ``index.living``).

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

import contextlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from densepass.data.beir import PassageFile
from densepass.data.dataset import Corpus
from densepass.data.reader_helpers import WHITESPACE, check_id
from densepass.data.texts import check_texts
from densepass.errors import ConfigError, DataError
from densepass.fingerprints import fingerprint_corpus
from densepass.io import (
    MANIFEST,
    OWNED,
    atomic_directory,
    check_replaceable,
    disk_errors,
    exclusive_lock,
    hold_temporaries,
    read_manifest,
    remove_stale_temporaries,
    write_manifest,
)
from densepass.version import __version__

PASSAGES = "passages.jsonl"
FORMAT = "densepass-index"
DELETED = "deleted.npy"  # tombstones: the rows deleted since the last compaction (int64, sorted)
DELETED_ID = "\x00deleted:"  # a tombstoned row's id (+ its row): never a passage id, frees the id for an upsert
Passages = Corpus | Sequence[str] | Sequence[dict]


def next_free_id(corpus: Corpus) -> int:
    """The first id ``as_corpus`` gives texts added to an index holding ``corpus``: past every numeric id in use
    (a compacted index is shorter than its highest id, so its length would name a passage it holds)."""
    numeric = [int(pid) for pid in corpus.ids if pid.isascii() and pid.isdigit()]
    return max(len(corpus.ids), max(numeric, default=-1) + 1)


def as_corpus(passages: Passages, first_id: int = 0) -> Corpus:
    """A ``Corpus`` from a Corpus, from texts (ids ``"0"``, ``"1"``, ... from ``first_id``), or from dicts
    with ``id`` (or ``_id``), ``text`` and optional ``title`` / ``doc_id``. In texts or records, a string holding a
    lone surrogate is a one-line error (``checked_texts``): no file can hold it, so the index could not be saved (a
    Corpus comes from a reader, which checked its file). An id that is empty or holds whitespace is one too: the
    saved passages and a TREC run could not hold it, so the index could not be loaded back (``check_corpus_ids``)."""
    if isinstance(passages, Corpus):
        return check_corpus_ids(passages)
    if isinstance(passages, str):
        raise ConfigError("index passages must be a list (of texts or of {id, title, text} records), not one string")
    items = list(passages)
    if not items:
        raise ConfigError("no passages to index")
    if all(isinstance(p, str) for p in items):
        ids = [str(first_id + i) for i in range(len(items))]
        return checked_texts(Corpus(ids, [""] * len(items), items, ids))
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
        if pid == "":
            raise ConfigError(f"passage {i}: its 'id' is empty")
        check_id(str(pid), "id", f"passage {i}")  # a TREC run (or the saved passages) could not hold it
        title = record.get("title") or ""
        if not isinstance(title, str):
            raise ConfigError(f"passage {i}: 'title' must be a string")
        ids.append(str(pid))
        titles.append(title)
        texts.append(text)
        docs.append(str(record.get("doc_id") or pid))
    return checked_texts(Corpus(ids, titles, texts, docs))


def check_corpus_ids(corpus: Corpus) -> Corpus:
    """``corpus``, or a one-line error naming the first passage whose id is empty or holds whitespace (as the
    dataset readers refuse: ``data.reader_helpers.check_id``); one scan of the ids joined, the common case."""
    if "" in corpus:
        raise ConfigError(f"passage {corpus.position('')}: its 'id' is empty")
    if WHITESPACE.search("".join(corpus.ids)) is not None:
        row = next(i for i, pid in enumerate(corpus.ids) if WHITESPACE.search(pid))
        check_id(corpus.ids[row], "id", f"passage {row}")
    return corpus


def checked_texts(corpus: Corpus) -> Corpus:
    """``corpus`` (of texts or records given through the Python API), or a one-line DataError where one of its ids,
    titles, texts or document ids holds a lone surrogate (``data.texts.check_texts``)."""
    for column, what in [(corpus.ids, "passage id"), (corpus.titles, "passage title"), (corpus.texts, "passage text"),
                         (corpus.doc_ids, "passage doc_id")]:  # fmt: skip
        check_texts(column, what)
    return corpus


def check_new_ids(passages: Corpus, new: Corpus) -> None:
    """The one-line error ``concat_corpora`` raises where an id of ``new`` is already one of ``passages``, before
    anything is encoded or changed."""
    repeated = next((pid for pid in new.ids if pid in passages), None)
    if repeated is not None:
        raise DataError(f"corpus has duplicate passage id {repeated!r}")


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
    checkpoint), or is part of a larger index, a version folder or a hybrid's part (``check_not_a_part``): an index
    replaces only an index (``io.atomic_directory`` checks that densepass wrote it)."""
    directory = Path(directory)
    check_not_a_part(directory, "--output")
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


def check_not_a_part(directory: str | Path, what: str) -> None:
    """A one-line error where ``directory`` is part of a larger saved index: a version folder (``v000002``) of an
    updated index (``index.living``), or a part (``first/``, ``second/``) of a hybrid index, at any depth
    (``HY/v000002/first``). The larger index's manifest records the digests of the part's files (rewriting them
    breaks it), and an update of a version folder would remove the files of the parent's current version as old
    ones. A folder is a part when an enclosing folder's ``OWNED`` list holds its files, or when its parent's manifest
    names a current version and the folder is named as versions are."""
    directory = Path(directory).resolve()
    parent, name = directory.parent, directory.name
    if re.fullmatch(r"v\d{6}", name):
        try:
            manifest = json.loads((parent / MANIFEST).read_text(encoding="utf-8"))
            index = isinstance(manifest, dict) and manifest.get("format") == FORMAT
        except (OSError, ValueError):
            index = False
        if index and "current" in manifest:
            raise ConfigError(
                f"{what} {directory} is version {name} of the updated index {parent}: update or replace {parent} "
                "itself (changing one of its versions breaks it)"
            )
        if index:  # not updated yet: its first update would take the folder for a killed update's, and remove it
            raise ConfigError(
                f"{what} {directory} is named as the versions of the index {parent} are: choose a path outside it"
            )
    for enclosing in directory.parents:
        inside = directory.relative_to(enclosing).as_posix()
        try:
            owned = json.loads((enclosing / OWNED).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(owned, list) and any(str(entry).startswith(f"{inside}/") for entry in owned):
            kind = f"version {inside}" if re.fullmatch(r"v\d{6}", inside) else f"part {inside}"
            raise ConfigError(
                f"{what} {directory} is {kind} of the index {enclosing}: update or replace {enclosing} itself "
                "(changing one of its parts breaks it)"
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
        """``{query id: {passage id: score}}`` (a TREC run in memory, as ``evaluation.metrics`` reads it); a passage
        listed twice (a phrase index's hits are phrases) keeps its first, best score."""
        if len(query_ids) != len(self):
            raise ConfigError(f"{len(query_ids)} query ids for {len(self)} result lists")
        run = {}
        for i, qid in enumerate(query_ids):
            ranking: dict[str, float] = {}
            for pid, score in self.hits(i):
                ranking.setdefault(pid, score)
            run[qid] = ranking
        return run

    def __iter__(self) -> Iterator[list[tuple[str, float]]]:
        return (self.hits(i) for i in range(len(self)))


def check_positive(name: str, value: Any) -> int:
    """``value`` as an int, or a one-line error unless it is a positive integer (a float, a bool: refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_k(k: int) -> int:
    """``k`` as an int, or a one-line error unless it is a positive integer."""
    return check_positive("k", k)


def is_vectors(queries: Any) -> bool:
    """Whether ``queries`` are query vectors (a tensor, or an array of numbers) rather than texts: an array of
    strings (``df["query"].values``) holds texts."""
    import torch

    return isinstance(queries, torch.Tensor) or (isinstance(queries, np.ndarray) and queries.dtype.kind in "biuf")


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

    @abstractmethod
    def add(self, passages: Passages) -> None:
        """Index more passages (their ids must be new)."""

    @abstractmethod
    def search_rows(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores [n, k'], rows [n, k']) of the top k' = min(k, len(self)) passages of each query."""

    def search(self, queries: Any, k: int = 10) -> SearchResults:
        """The top-``k`` passages of each query (query texts; dense kinds also take query embeddings); deleted
        passages never come back (``live_rows``)."""
        if len(self) == 0:
            raise ConfigError("the index is empty: add passages before searching")
        scores, rows = self.live_rows(self.search_rows, queries, check_k(k))
        return SearchResults(scores, rows, self.passages)

    # ---- a living index: tombstones, upsert, compaction -----------------------------------------------

    _deleted: np.ndarray | None = None  # one flag per row: deleted (a tombstone) since the last compaction
    updatable: ClassVar[bool] = True
    """Whether the kind takes ``delete`` / ``upsert`` / ``compact`` (its searches leave tombstones out)."""

    def check_updatable(self) -> None:
        """A one-line error where the kind cannot be updated (``updatable``)."""
        if not self.updatable:
            raise ConfigError(f"a {self.kind} index cannot delete or upsert passages: build it again")

    @property
    def deleted(self) -> np.ndarray:
        """One boolean per row of ``passages``: True where the passage was deleted (or replaced by an upsert)
        and not yet compacted away. Searches leave those rows out."""
        rows = len(self.passages)
        if self._deleted is None or len(self._deleted) != rows:  # rows were added since
            grown = np.zeros(rows, dtype=bool)
            if self._deleted is not None:
                grown[: min(rows, len(self._deleted))] = self._deleted[:rows]
            self._deleted = grown
        return self._deleted

    def __len__(self) -> int:
        """Passages searchable: the rows less the deleted ones."""
        rows = len(self.passages)
        return rows - int(self._deleted.sum()) if self._deleted is not None and self._deleted.any() else rows

    def encode_for_search(self, queries: Any) -> Any:
        """What ``search_rows`` takes, computed once per search (query embeddings for the kinds that encode):
        a search that must look deeper past deleted rows (``live_rows``) does not encode its queries again."""
        encode = getattr(self, "encode_queries", None)
        return encode(queries) if encode is not None else check_queries(queries)

    def live_rows(
        self, search_rows: Callable[[Any, int], tuple[np.ndarray, np.ndarray]], queries: Any, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) of the top ``k`` live passages of each query, from ``search_rows`` (this kind's):
        without tombstones its answer itself; with them the search over-fetches (2k, then 4 times deeper, at most
        k + the number of deleted rows: where the kind is exact that depth holds the exact top k of the live
        rows) until every query has k live rows or nothing more to find, and drops the deleted rows, order kept.
        Rows -1 (scores 0) pad a query with fewer hits."""
        if self._deleted is None or not self._deleted.any():
            return search_rows(queries, k)
        deleted = self.deleted  # grown to the rows added since the last tombstone
        encoded = self.encode_for_search(queries)
        rows_total, dead = len(self.passages), int(deleted.sum())
        want = min(k, rows_total - dead)
        depth = min(rows_total, 2 * k, k + dead)
        while True:
            scores, rows = search_rows(encoded, depth)
            live = (rows >= 0) & ~deleted[np.clip(rows, 0, None)]
            full = live.sum(axis=1) >= want
            if full.all() or depth >= min(rows_total, k + dead):
                break
            depth = min(rows_total, k + dead, 4 * depth)
        order = np.argsort(~live, axis=1, kind="stable")[:, :want]
        kept = np.take_along_axis(live, order, axis=1)
        out_rows = np.where(kept, np.take_along_axis(rows, order, axis=1), -1).astype(np.int64)
        out_scores = np.where(kept, np.take_along_axis(scores, order, axis=1), 0).astype(np.float32)
        return out_scores, out_rows

    def live_position(self, pid: str) -> int | None:
        """The row of live passage ``pid``, or None when the index holds none of that id."""
        return self.passages.position(pid) if not pid.startswith(DELETED_ID) and pid in self.passages else None

    def delete(self, ids: Sequence[str]) -> None:
        """Delete the passages ``ids`` (tombstones: searches leave them out at once; ``compact`` removes their rows).
        Every id must be in the index, once: otherwise a one-line error and nothing is deleted."""
        self.check_updatable()
        ids = check_ids(ids, "delete")
        unknown = [pid for pid in ids if self.live_position(pid) is None]
        if unknown:
            raise DataError(
                f"{len(unknown)} of the {len(ids)} ids to delete are not in the index (the first: {unknown[0]!r})"
            )
        self._tombstone(np.array([self.passages.position(pid) for pid in ids], dtype=np.int64))

    def upsert(self, passages: Passages) -> None:
        """Index ``passages`` ({id, title, text} records or a Corpus: ids required, each once), replacing the
        passages of the same ids (their old rows become tombstones) and adding the others. New passages are
        encoded first (``encode_new``), so that a failure changes nothing."""
        self.check_updatable()
        corpus = records_corpus(passages)
        prepared = self.encode_new(corpus)
        self.upsert_encoded(corpus, prepared)

    def upsert_encoded(self, corpus: Corpus, prepared: Any) -> None:
        """``upsert`` of passages already encoded (``encode_new``'s output, or embeddings / weights / token vectors
        this index's model computed). The old rows are tombstoned first (their ids freed for the new passages); an
        append that fails (it checks before it changes anything) brings them back, so that nothing changes."""
        replaced = [row for row in map(self.live_position, corpus.ids) if row is not None]
        if not replaced:
            self.append_encoded(corpus, prepared)
            return
        passages, deleted = self.passages, None if self._deleted is None else self._deleted.copy()
        self._tombstone(np.array(replaced, dtype=np.int64))
        try:
            self.append_encoded(corpus, prepared)
        except BaseException:
            self._set_passages(passages)
            self._deleted = deleted
            raise

    def encode_new(self, corpus: Corpus) -> Any:
        """What ``append_encoded`` needs to index ``corpus`` (its embeddings, for the kinds with a model); None
        where the kind indexes texts."""
        return None

    def append_encoded(self, corpus: Corpus, prepared: Any) -> None:
        """Index ``corpus`` (new ids), encoded by ``encode_new``."""
        self.add(corpus)

    def _tombstone(self, rows: np.ndarray) -> None:
        """Mark ``rows`` deleted, and free their ids (a tombstoned row's id becomes ``DELETED_ID`` + its row)."""
        deleted = self.deleted.copy()  # set once the new ids are in: a failure leaves the index as it was
        deleted[rows] = True
        ids = list(self.passages.ids)
        for row in rows.tolist():
            ids[row] = f"{DELETED_ID}{row}"
        self._set_passages(Corpus(ids, self.passages.titles, self.passages.texts, self.passages.doc_ids))
        self._deleted = deleted

    def _set_passages(self, passages: Corpus) -> None:
        """Replace the passages (same rows; ids changed by ``_tombstone``)."""
        self.passages = passages

    def compact(self) -> None:
        """Remove the deleted rows for good: the passages and the kind's own arrays are rewritten without them
        (``_compact``), so the index is as if built from the live passages (approximate kinds: rebuilt, or their
        trained quantisers kept; see each kind). Nothing to do without tombstones."""
        if self._deleted is None or not self._deleted.any():
            return
        live = np.flatnonzero(~self.deleted)
        if len(live) == 0:
            raise ConfigError("every passage of the index is deleted: compacting would leave an empty index")
        self._compact(live)
        self._deleted = None

    def _compact(self, live: np.ndarray) -> None:
        """Keep only rows ``live`` (sorted): the kind's arrays and ``passages``."""
        raise ConfigError(f"a {self.kind} index cannot be compacted")

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
        if not len(self.passages):  # no index could load it (and it would replace one that loads)
            raise ConfigError("the index is empty: add passages before saving")
        check_not_a_part(directory, "--output")  # before anything in it is touched
        if (directory / MANIFEST).is_file() and not directory.is_symlink():  # a killed update's half-written version
            remove_stale_temporaries(directory, r"v\d{6}")  # (index.living): densepass's own, else it blocks the save
        check_index_target(directory)
        # an index there: its updates' lock (index.living), so that a save and an update never interleave (the save
        # would land under an update that then writes its version over it, or between its two last writes)
        held = exclusive_lock(directory, "index update") if directory.is_dir() else contextlib.nullcontext()
        with held:
            remove_stale_temporaries(directory.parent, re.escape(directory.name))  # a killed save's
            with disk_errors(directory), hold_temporaries() as hold, atomic_directory(directory) as tmp:
                hold(tmp)
                self.write_into(tmp)
        return directory

    def write_into(self, directory: Path) -> None:
        """Write the passages, the tombstones (if any), the kind's files and the manifest (last) into ``directory``
        (a temporary directory the caller renames into place)."""
        save_passages(self.passages, directory / PASSAGES)
        if self._deleted is not None and self._deleted.any():
            np.save(directory / DELETED, np.flatnonzero(self._deleted).astype(np.int64))
        self._write(directory)
        write_manifest(
            directory,
            format=FORMAT,
            kind=self.kind,
            densepass_version=__version__,
            size=len(self.passages),
            deleted=len(self.passages) - len(self),
            corpus_fingerprint=fingerprint_corpus(self.passages),
            **with_absolute_model_path(self.facts()),
        )

    @classmethod
    @abstractmethod
    def _read(cls, directory: Path, manifest: dict, passages: Corpus, **options) -> Index:
        """Build the index from its verified files."""

    @classmethod
    def load(cls, directory: str | Path, **options) -> Index:
        """Read a saved index of this kind (verified against its manifest; an updated index: its current version,
        ``index.living``)."""
        directory, manifest = current_version(Path(directory))
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
        try:
            if len(passages) != manifest["size"]:
                raise DataError(f"{directory}: {len(passages)} passages but the manifest says {manifest['size']}")
            index = kind._read(directory, manifest, passages, **options)
            index._deleted = read_tombstones(directory, len(passages))
            index.version = index.loaded_version = int(manifest.get("version", 0))
            return index
        except (ValueError, EOFError) as err:  # NumPy, SciPy, JSON: files of another format under a matching manifest
            raise DataError(f"{directory} is not a usable densepass index: its files do not load ({err})") from None
        except KeyError as err:  # a manifest whose files match but that lacks what the kind reads (written by hand?)
            raise DataError(f"{directory} is not a usable densepass index: its manifest has no {err} entry") from None

    version: int = 0
    """Which saved version of its directory the index was loaded from (0: as built; ``index.living``)."""
    loaded_version: int | None = None
    """The version it was loaded at or last saved as (None: built here): ``save_version`` refuses to write over a
    newer version another process saved since."""


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


def current_version(directory: Path) -> tuple[Path, dict]:
    """The folder holding the current version of the saved index ``directory`` and its verified manifest: the
    directory itself, or for an updated index the version folder its manifest names (``index.living``), whose
    own manifest's digest the top manifest records (and which verifies every file there)."""
    manifest = read_index_manifest(directory)
    current = manifest.get("current")
    if current is None:
        return directory, manifest
    if not isinstance(current, str) or not re.fullmatch(r"v\d{6}", current):
        raise DataError(f"{directory}: its manifest names no version folder ({current!r})")
    inner = read_index_manifest(directory / current)
    if inner.get("kind") != manifest["kind"]:
        raise DataError(f"{directory}: version {current} holds a {inner.get('kind')} index, not {manifest['kind']}")
    return directory / current, {**inner, "version": manifest.get("version", 0)}


def read_tombstones(directory: Path, rows: int) -> np.ndarray | None:
    """The deleted flags of a saved index's ``rows`` (None without tombstones); damaged ones are a one-line error."""
    path = directory / DELETED
    if not path.is_file():
        return None
    listed = np.load(path, allow_pickle=False)
    shaped = listed.ndim == 1 and listed.dtype.kind in "iu"  # first: a 0-d array has no len()
    if not shaped or len(listed) and not 0 <= listed.min() <= listed.max() < rows:
        raise DataError(f"{directory}: {DELETED} does not list rows of its {rows} passages")
    deleted = np.zeros(rows, dtype=bool)
    deleted[listed] = True
    return deleted


def check_ids(ids: Sequence[str], what: str) -> list[str]:
    """``ids`` as a non-empty list of distinct strings, or a one-line error."""
    if isinstance(ids, str):
        raise ConfigError(f"{what} takes a list of passage ids, not one string")
    ids = [str(pid) if isinstance(pid, (int, np.integer)) and not isinstance(pid, bool) else pid for pid in ids]
    if not ids:
        raise ConfigError(f"no passage ids to {what}")
    bad = next((pid for pid in ids if not isinstance(pid, str) or not pid), None)
    if bad is not None:
        raise ConfigError(f"passage ids to {what} must be non-empty strings, got {bad!r}")
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        repeated = [pid for pid in ids if pid in seen or seen.add(pid)]
        raise ConfigError(f"{len(repeated)} ids to {what} are repeated (the first: {repeated[0]!r})")
    return ids


def records_corpus(passages: Passages) -> Corpus:
    """The passages of an upsert as a Corpus: records or a Corpus with their ids (texts alone have none), each id
    once (a repeated one is a one-line error), none of them a tombstone's."""
    if not isinstance(passages, Corpus) and not isinstance(passages, str):
        passages = list(passages)
        if passages and all(isinstance(p, str) for p in passages):
            raise ConfigError("upsert takes {id, title, text} records (or a Corpus): the ids say what to replace")
    corpus = as_corpus(passages)
    check_ids(corpus.ids, "upsert")
    bad = next((pid for pid in corpus.ids if pid.startswith(DELETED_ID)), None)
    if bad is not None:
        raise ConfigError(f"passage id {bad!r} starts with a NUL character, which densepass keeps for deleted rows")
    return corpus


def load_index(directory: str | Path, **options) -> Index:
    """Load any saved index: its manifest says which kind (``options`` go to that kind, e.g. ``model=``)."""
    directory = Path(directory)
    return KINDS[read_index_manifest(directory)["kind"]].load(directory, **options)
