"""The hard-negatives file: per training query, ranked candidate negatives with their source and score.

In memory a ``NegativePool`` is ``{query_id: [Candidate(passage_id, source, score), ...]}``, best
first. On disk it is JSONL, one query a line::

    {"query_id": "q7", "negatives": [["p12", "bm25", 17.3], ["p9", "bm25", 15.1]]}

written atomically (a crash never leaves half a file). ``load_pool`` reports a missing file, a bad
line (not UTF-8, not JSON), an unknown query or an unknown passage as one ``DataError`` naming the line, and a
file without a single negative as one ``DataError`` too (a run would otherwise draw random passages instead).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from densepass.data.dataset import RetrievalDataset
from densepass.data.keys import is_known_passage
from densepass.errors import DataError
from densepass.io import atomic_write_text


class Candidate(NamedTuple):
    """A candidate negative: its passage id, the strategy that found it and its score there."""

    passage_id: str
    source: str
    score: float


NegativePool = dict[str, list[Candidate]]


@dataclass
class MiningResult:
    """A mined pool, what each filter removed, and how long it took."""

    pool: NegativePool
    removed: dict[str, int]  # filter name -> candidates removed
    seconds: float  # mining's, also when read back from the cache
    read_from: Path | None = None  # the cache entry it was read from (negatives.pool_cache), None when mined now
    read_seconds: float = 0.0  # how long reading it back took

    @property
    def source_counts(self) -> dict[str, int]:
        """Candidates per strategy in the pool."""
        return source_counts(self.pool)

    def summary(self) -> str:
        """One line describing the pool (sizes, sources, removals, time)."""
        n = len(self.pool)
        total = sum(len(c) for c in self.pool.values())
        empty = sum(1 for c in self.pool.values() if not c)
        sources = ", ".join(f"{s}: {k}" for s, k in self.source_counts.items()) or "none"
        removed = ", ".join(f"{f}: {k}" for f, k in self.removed.items())
        took = f"in {self.seconds:.1f}s"
        if self.read_from is not None:
            took = f"read in {self.read_seconds:.1f}s from the cache {self.read_from} (mined {took})"
        return (
            f"{total} negatives for {n} queries ({total / max(n, 1):.1f} per query, {empty} with none) {took}; "
            f"by source: {sources}; removed by filter: {removed}"
        )


def is_pool_line(line: str) -> bool:
    """Whether ``line`` reads as a line of ``save_pool``'s JSONL (``{"query_id", "negatives"}``)."""
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and {"query_id", "negatives"} <= set(record)


def save_pool(pool: NegativePool, path: str | Path) -> None:
    """Write ``pool`` as JSONL (queries in insertion order), atomically."""
    lines = [
        json.dumps({"query_id": qid, "negatives": [[c.passage_id, c.source, float(c.score)] for c in cands]})
        for qid, cands in pool.items()
    ]
    atomic_write_text(path, "\n".join(lines) + ("\n" if lines else ""))


def _candidate(item: object, where: str) -> Candidate:
    if (
        not isinstance(item, list)
        or len(item) != 3
        or not isinstance(item[0], str)
        or not isinstance(item[1], str)
        or isinstance(item[2], bool)
        or not isinstance(item[2], (int, float))
    ):
        raise DataError(f"{where}: each negative must be [passage_id, source, score], got {item!r}")
    return Candidate(item[0], item[1], float(item[2]))


def load_pool(path: str | Path, dataset: RetrievalDataset | None = None) -> NegativePool:
    """Read a hard-negatives file; with ``dataset``, every query and passage id must exist in it. A file that
    gives no negative at all (empty, blank, or every list empty) is refused: it is no pool to train from."""
    from densepass.io import check_regular_file

    path = Path(path)
    check_regular_file(path, "hard-negatives file")  # a FIFO is not waited on
    pool: NegativePool = {}
    with open(path, "rb") as handle:
        for line_no, raw in enumerate(handle, 1):
            where = f"{path}:{line_no}"
            if line_no == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark (a file saved by a Windows editor)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{where}: not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}); a hard-negatives "
                    "file is UTF-8 JSONL"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg})") from None
            if (
                not isinstance(record, dict)
                or not isinstance(record.get("query_id"), str)
                or not isinstance(record.get("negatives"), list)
            ):
                raise DataError(f'{where}: expected {{"query_id": str, "negatives": [...]}}')
            qid = record["query_id"]
            if qid in pool:
                raise DataError(f"{where}: query {qid!r} appears twice")
            cands = [_candidate(item, where) for item in record["negatives"]]
            if dataset is not None:
                if qid not in dataset.queries:
                    raise DataError(f"{where}: unknown query id {qid!r} (not in the dataset's queries)")
                bad = next((c.passage_id for c in cands if not is_known_passage(dataset.corpus, c.passage_id)), None)
                if bad is not None:
                    raise DataError(f"{where}: unknown passage id {bad!r} (query {qid!r})")
            pool[qid] = cands
    if not any(pool.values()):
        held = f"{len(pool)} queries, every one without a negative" if pool else "no line"
        raise DataError(f"hard-negatives file {path} holds no negatives ({held}): mine one with densepass mine")
    return pool


def truncate(pool: NegativePool, depth: int) -> NegativePool:
    """The first ``depth`` candidates of each query."""
    return {qid: cands[:depth] for qid, cands in pool.items()}


def passage_ids(pool: NegativePool) -> dict[str, list[str]]:
    """``{query_id: [passage_id, ...]}``, the form ``TrainingData`` samples from."""
    return {qid: [c.passage_id for c in cands] for qid, cands in pool.items()}


def source_counts(pool: NegativePool) -> dict[str, int]:
    """Candidates per strategy, over every query."""
    counts: dict[str, int] = {}
    for cands in pool.values():
        for c in cands:
            counts[c.source] = counts.get(c.source, 0) + 1
    return dict(sorted(counts.items()))


def from_rankings(query_ids: Iterable[str], rankings: Iterable[list[tuple[str, float]]], source: str) -> NegativePool:
    """A pool from per-query ``[(passage_id, score), ...]`` lists, best first."""
    return {qid: [Candidate(pid, source, float(s)) for pid, s in ranked] for qid, ranked in zip(query_ids, rankings)}
