"""The in-memory model of a retrieval dataset shared by every reader.

A corpus of passages (optionally grouped into documents by ``doc_id``), queries, graded qrels per
split and optional answer strings per query (for DPR-style top-k accuracy).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from densepass.data.files import Tally
from densepass.data.texts import is_blank
from densepass.errors import DataError
from densepass.fingerprints import fingerprint_corpus, fingerprint_file_cached, fingerprint_json, fingerprint_strings

Qrels = dict[str, dict[str, int]]  # query id -> passage id -> relevance grade


def passage_input(title: str, text: str, sep_token: str) -> str:
    """A passage's encoder input: ``title [SEP] text`` (negative-contrast §3), or the text alone without a title."""
    return f"{title} {sep_token} {text}" if title else text


class LazyTexts(Sequence[str]):
    """Texts produced on demand: ``texts[a:b]`` calls ``read(offset + a, offset + b)``, so a caller that reads
    a corpus block by block never holds more than a block of it as Python strings. ``window`` narrows the
    view (a process's shard) without reading anything."""

    def __init__(self, read: Callable[[int, int], list[str]], length: int, offset: int = 0) -> None:
        self._read, self._length, self._offset = read, length, offset

    @classmethod
    def of(cls, texts: Sequence[str]) -> LazyTexts:
        """A view of texts already in memory."""
        return cls(lambda start, end: list(texts[start:end]), len(texts))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self._length)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return self._read(self._offset + start, self._offset + max(start, stop))
        if not -self._length <= key < self._length:
            raise IndexError(key)
        key %= self._length
        return self._read(self._offset + key, self._offset + key + 1)[0]

    def __iter__(self) -> Iterator[str]:
        for start in range(0, self._length, 4096):
            yield from self[start : start + 4096]

    def window(self, start: int, end: int) -> LazyTexts:
        """The view of rows ``start`` to ``end`` (clipped to this view)."""
        start, end = min(max(start, 0), self._length), min(max(end, start), self._length)
        return LazyTexts(self._read, end - start, self._offset + start)


@dataclass
class Corpus:
    """Passages stored column-wise; ``position(pid)`` maps an id to its row. ``titles`` and ``texts`` are lists,
    or sequences read from the corpus file on demand (``data.beir.PassageFile``: a corpus that is not held in
    memory as strings); ids and documents are always in memory."""

    ids: list[str]
    titles: Sequence[str]
    texts: Sequence[str]
    doc_ids: list[str]
    _positions: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not (len(self.ids) == len(self.titles) == len(self.texts) == len(self.doc_ids)):
            raise DataError("corpus columns have different lengths")
        self._positions = {pid: i for i, pid in enumerate(self.ids)}
        if len(self._positions) != len(self.ids):
            seen: set[str] = set()
            dup = next(p for p in self.ids if p in seen or seen.add(p))
            raise DataError(f"corpus has duplicate passage id {dup!r}")

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, pid: str) -> bool:
        return pid in self._positions

    def position(self, pid: str) -> int:
        """The row of passage ``pid`` (KeyError when it is not in the corpus)."""
        return self._positions[pid]

    def passage_inputs(self, sep_token: str, positions: Sequence[int] | None = None) -> list[str]:
        """Passage encoder inputs ``title [SEP] text`` (negative-contrast §3), as one string each so that
        ``SentenceTransformer.encode`` on the same strings gives the same embeddings."""
        rows = range(len(self.ids)) if positions is None else positions
        if isinstance(rows, range) and rows.step == 1:  # a block: one slice of each column (one read from a file)
            return [
                passage_input(t, x, sep_token)
                for t, x in zip(self.titles[rows.start : rows.stop], self.texts[rows.start : rows.stop])
            ]
        return [passage_input(self.titles[i], self.texts[i], sep_token) for i in rows]

    def lazy_inputs(self, sep_token: str) -> LazyTexts:
        """The passage encoder inputs, built block by block as they are read (never all at once)."""
        return LazyTexts(lambda start, end: self.passage_inputs(sep_token, range(start, end)), len(self))

    def subset(self, positions: list[int]) -> Corpus:
        """The passages at ``positions``, in that order."""
        return Corpus(
            ids=[self.ids[i] for i in positions],
            titles=[self.titles[i] for i in positions],
            texts=[self.texts[i] for i in positions],
            doc_ids=[self.doc_ids[i] for i in positions],
        )


@dataclass
class RetrievalDataset:
    """Corpus + queries + qrels per split (+ answers), validated on construction.

    Every query and passage named by the qrels must exist. A split whose queries are all empty (or whitespace,
    or invisible characters only such as zero-width spaces: ``data.texts.is_blank``) is a DataError (nothing could
    be learnt or measured); some empty queries give one counted :class:`DataWarning` per split (they are kept: an
    empty query is a legitimate, if hopeless, input, and evaluation counts it)."""

    name: str
    corpus: Corpus
    queries: dict[str, str]
    qrels: dict[str, Qrels]
    answers: dict[str, list[str]] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)  # what the reader read, by name in the dataset directory

    def __post_init__(self) -> None:
        if len(self.corpus) == 0:
            raise DataError(f"{self.name}: the corpus is empty")
        for split, qrels in self.qrels.items():
            empty = Tally(f"{self.name}: qrels/{split}", f"of its {len(qrels)} queries have an empty text")
            for qid, rels in qrels.items():
                text = self.queries.get(qid)
                if text is None:
                    raise DataError(f"{self.name}: qrels/{split} names query {qid!r}, which is not in the queries")
                if is_blank(text):
                    empty.add(f"query {qid!r}")
                for pid in rels:
                    if pid not in self.corpus:
                        raise DataError(
                            f"{self.name}: qrels/{split} names passage {pid!r} (query {qid!r}), "
                            "which is not in the corpus"
                        )
            if qrels and empty.count == len(qrels):
                raise DataError(f"{self.name}: every query of qrels/{split} has an empty text (e.g. {empty.first})")
            empty.warn()

    def file_fingerprints(self) -> dict[str, str]:
        """{``<dataset name>/<file>``: content digest} of every file the reader read (corpus, queries, qrels, ...):
        a run's identity, so that a run is never resumed on data that changed (each file is hashed once per
        process while its size and modification time stay the same). A dataset built in Python, read from no file,
        gives the digest of its content instead (``<dataset name>/content``): its name alone says nothing of it."""
        if not self.files:
            return {f"{self.name}/content": self.content_fingerprint()}
        return {f"{self.name}/{name}": fingerprint_file_cached(path) for name, path in self.files.items()}

    def content_fingerprint(self) -> str:
        """Digest of the passages, queries, judgements and answers (every split), whatever they were read from."""
        content = {"queries": self.queries, "qrels": self.qrels, "answers": self.answers}
        return fingerprint_strings([fingerprint_corpus(self.corpus), fingerprint_json(content)])

    def split(self, name: str) -> Qrels:
        """Qrels of one split, with a clear error for a missing or empty split."""
        if name not in self.qrels:
            known = ", ".join(sorted(self.qrels)) or "none"
            raise DataError(f"{self.name}: no split {name!r} (available: {known})")
        qrels = self.qrels[name]
        if not any(grade > 0 for rels in qrels.values() for grade in rels.values()):
            raise DataError(f"{self.name}: split {name!r} has no relevant query-passage pair")
        return qrels

    def positives(self, split: str) -> dict[str, list[str]]:
        """Query id -> passage ids with a positive grade, best grade first."""
        out = {}
        for qid, rels in self.split(split).items():
            pos = sorted((p for p, g in rels.items() if g > 0), key=lambda p: -rels[p])
            if pos:
                out[qid] = pos
        return out

    def sample(self, split: str, limit: int | None = None, seed: int = 13, exclude: Collection[str] = ()) -> Qrels:
        """The qrels of a seeded sample of ``limit`` queries of ``split`` (all when None) among those with at least
        one relevant passage: the queries a run trains on or evaluates (queries judged only irrelevant are left out
        before sampling, so that a sample has ``limit`` queries where there are as many). Queries in ``exclude`` are
        removed before sampling (validation on the training split, without the queries trained on)."""
        excluded = set(exclude)
        judged = {q: r for q, r in self.split(split).items() if q not in excluded and any(g > 0 for g in r.values())}
        return sample_queries(judged, limit, seed)

    def relevant_sets(self) -> dict[str, set[str]]:
        """Query id -> every passage judged relevant in any split (used to mask false negatives)."""
        out: dict[str, set[str]] = {}
        for qrels in self.qrels.values():
            for qid, rels in qrels.items():
                out.setdefault(qid, set()).update(p for p, g in rels.items() if g > 0)
        return out


def sample_queries(qrels: Qrels, limit: int | None, seed: int) -> Qrels:
    """A seeded subsample of ``limit`` queries (all of them when limit is None or larger)."""
    if limit is None or limit >= len(qrels):
        return qrels
    if limit < 1:
        raise DataError(f"cannot sample {limit} queries")
    keep = random.Random(seed).sample(sorted(qrels), limit)
    return {qid: qrels[qid] for qid in sorted(keep)}
