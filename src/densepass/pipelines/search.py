"""Search pipelines: a first stage (any index: dense, BM25, hybrid, phrase) and an optional second stage that
re-scores the first stage's top candidates (a reranker, e.g. a cross-encoder).

``SearchPipeline.search("query", k)`` returns ``Hit``s with the passage's id, score, title and text (and,
from a phrase index, the answer phrase and its character span);
``search_batch`` does many queries at once (what ``densepass serve`` calls with micro-batches).
A reranked list holds every first-stage candidate it was given: the top ``rerank_depth`` re-ordered by
the reranker, the rest after them in their first-stage order; nothing is lost.

>>> from densepass.index import BM25Index
>>> pipeline = SearchPipeline(BM25Index.build(["tar archiving utility", "X11 window manager"]))
>>> [hit.id for hit in pipeline.search("window manager", k=1)]
['1']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from densepass.data.dataset import Corpus
from densepass.data.texts import is_blank, surrogate_problem
from densepass.device import default_device, resolve_precision
from densepass.errors import ConfigError, DataError
from densepass.index.base import Index, SearchResults, check_k, load_index
from densepass.models.biencoder import model_name
from densepass.phrase.index import PhraseIndex, PhraseSearchResults  # registers the phrase kind for load_index


@dataclass
class Hit:
    """One retrieved passage; a phrase index also gives the answer phrase and its character span
    ``[start, end)`` in ``text``."""

    id: str
    score: float
    title: str
    text: str
    answer: str | None = None
    start: int | None = None
    end: int | None = None


class Reranker(Protocol):
    """A second stage: scores (query, passage text) pairs, higher is better."""

    def score_pairs(self, queries: Sequence[str], passages: Sequence[str]) -> np.ndarray:
        """One score per pair ``(queries[i], passages[i])``."""
        ...

    def describe(self) -> dict:
        """JSON-able facts about the reranker (shown by ``/health``)."""
        ...


class CachedScores:
    """A reranker that remembers the score of every (query, passage text) pair it has scored, so that
    reranking several first stages of one evaluation scores their shared candidates once.
    ``scored`` counts the pairs the wrapped reranker was actually asked for."""

    def __init__(self, reranker: Reranker) -> None:
        self.reranker, self.scores, self.scored = reranker, {}, 0

    def score_pairs(self, queries: Sequence[str], passages: Sequence[str]) -> np.ndarray:
        """The scores of the pairs, the new ones from the wrapped reranker in one call."""
        pairs = list(zip(queries, passages))
        new = [pair for pair in dict.fromkeys(pairs) if pair not in self.scores]
        if new:
            values = np.asarray(self.reranker.score_pairs([q for q, _ in new], [p for _, p in new]), dtype=np.float32)
            if values.shape != (len(new),):
                raise ConfigError(f"the reranker returned {values.shape} scores for {len(new)} pairs")
            self.scores.update(zip(new, values.tolist()))
            self.scored += len(new)
        return np.asarray([self.scores[pair] for pair in pairs], dtype=np.float32)

    def describe(self) -> dict:
        """The wrapped reranker's description."""
        return self.reranker.describe()


class SearchPipeline:
    """First stage ``index``, then (optionally) ``reranker`` over its top ``rerank_depth`` candidates."""

    def __init__(self, index: Index, reranker: Reranker | None = None, rerank_depth: int = 100) -> None:
        if rerank_depth < 1:
            raise ConfigError(f"rerank depth must be >= 1, got {rerank_depth}")
        if reranker is not None and rerank_depth > len(index):
            raise ConfigError(f"rerank depth {rerank_depth} is larger than the index's {len(index)} passages")
        if reranker is not None and isinstance(index, PhraseIndex):
            raise ConfigError("a phrase index returns phrases: rerank passages with a passage index instead")
        self.index, self.reranker, self.rerank_depth = index, reranker, rerank_depth

    @classmethod
    def load(
        cls, directory: str | Path, reranker: Reranker | None = None, rerank_depth: int = 100, **index_options: Any
    ) -> SearchPipeline:
        """A pipeline over the index saved in ``directory``."""
        return cls(load_index(directory, **index_options), reranker, rerank_depth)

    def search(self, query: str, k: int = 10) -> list[Hit]:
        """The top-``k`` hits of one query (a blank one, or one holding a lone surrogate, is a one-line
        DataError: ``check_query``)."""
        if not isinstance(query, str):
            raise ConfigError(f"a query is a string, got {type(query).__name__}")
        check_query(query, "the query")
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: Sequence[str], k: int = 10) -> list[list[Hit]]:
        """The top-``k`` hits of each query."""
        return self.hits(self.results(queries, k))

    def results(self, queries: Sequence[str], k: int = 10) -> SearchResults:
        """Rows and scores of the top-``k`` of each query (reranked when there is a second stage); a blank query,
        or one holding a lone surrogate, is a one-line DataError naming it (``check_query``)."""
        k = check_k(k)
        if not isinstance(queries, str):
            for i, query in enumerate(queries):
                if isinstance(query, str):
                    check_query(query, f"query {i}")
        if self.reranker is None:
            return self.index.search(queries, k)
        first = self.index.search(queries, max(k, self.rerank_depth))
        return rerank(first, list(queries), self.reranker, self.rerank_depth, k)

    def hits(self, results: SearchResults) -> list[list[Hit]]:
        """``Hit``s (with title and text) of search results."""
        corpus = results.passages
        spans = isinstance(results, PhraseSearchResults)
        out = []
        for i in range(len(results)):
            hits = []
            for j, (r, s) in enumerate(zip(results.rows[i].tolist(), results.scores[i].tolist())):
                if r >= 0:
                    hit = Hit(corpus.ids[r], float(s), corpus.titles[r], corpus.texts[r])
                    if spans:
                        hit.answer = results.answers[i][j]
                        hit.start, hit.end = int(results.starts[i, j]), int(results.ends[i, j])
                    hits.append(hit)
            out.append(hits)
        return out

    def describe(self) -> dict:
        """What the pipeline searches with (for ``/health`` and reports)."""
        manifest_model = getattr(self.index, "model_path", None)
        facts = {"index": self.index.kind, "passages": len(self.index)}
        if manifest_model:
            facts["model"] = model_name(manifest_model)
        precision = getattr(self.index, "precision", None)  # how queries are encoded (auto: as resolved here)
        if precision is not None:
            facts["precision"] = resolve_precision(precision, getattr(self.index, "device", None) or default_device())
        if getattr(self.index, "search_precision", None) is not None:  # how an exact index scores passages
            facts["search_precision"] = self.index.search_precision
        if self.reranker is not None:
            facts["reranker"] = self.reranker.describe()
            facts["rerank_depth"] = self.rerank_depth
        return facts


def check_query(query: str, what: str) -> None:
    """A one-line DataError for a query nothing can be searched for: blank (empty, whitespace, or invisible
    characters only, such as zero-width spaces: ``data.texts.is_blank``), or holding a lone surrogate (not a
    Unicode character). ``what`` names it (``the query``, ``query 3``)."""
    if is_blank(query):
        shown = "" if not query else f" ({query!r})"
        raise DataError(
            f"{what} is empty{shown}: it has no visible character (whitespace and zero-width characters do not "
            "count), so there is nothing to search for"
        )
    problem = surrogate_problem(query)
    if problem is not None:
        raise DataError(f"{what}: {problem}")


def rerank(
    first: SearchResults, queries: Sequence[str], reranker: Reranker, depth: int, k: int | None = None
) -> SearchResults:
    """Re-score the top ``depth`` candidates of each query with ``reranker`` and order them by that score;
    candidates past ``depth`` follow in their first-stage order, scored below every re-scored one, so the
    reranked list holds every first-stage candidate (its top ``k`` when given). Every query's candidates
    are scored in one call (the reranker batches and sorts them by length). A ``depth`` larger than the
    first stage's candidate lists is a one-line ConfigError."""
    width = first.rows.shape[1]
    if depth < 1 or depth > width:
        raise ConfigError(f"rerank depth {depth} is outside the first stage's {width} candidates per query")
    if len(queries) != len(first):
        raise ConfigError(f"{len(queries)} queries for {len(first)} first-stage result lists")
    k = width if k is None else min(check_k(k), width)
    texts = first.passages.passage_inputs(" ")
    head = first.rows[:, :depth]
    where = np.nonzero(head >= 0)
    scores = np.full(head.shape, -np.inf, dtype=np.float32)
    if len(where[0]):
        values = np.asarray(
            reranker.score_pairs([queries[i] for i in where[0]], [texts[r] for r in head[where]]), dtype=np.float32
        )
        if values.shape != (len(where[0]),) or not np.isfinite(values).all():
            raise ConfigError(f"the reranker returned {values.shape} scores (finite?) for {len(where[0])} pairs")
        scores[where] = values
    order = np.argsort(-scores, axis=1, kind="stable")
    rows = np.concatenate([np.take_along_axis(head, order, axis=1), first.rows[:, depth:]], axis=1)
    reranked = np.take_along_axis(scores, order, axis=1)
    floor = np.where(np.isfinite(reranked), reranked, np.inf).min(axis=1, keepdims=True)
    floor[~np.isfinite(floor)] = 0.0
    tail = floor - 1.0 - np.arange(width - depth, dtype=np.float32)[None, :]
    out = np.concatenate([reranked, tail], axis=1).astype(np.float32)
    valid = rows >= 0
    # a query's -1 slots (fewer candidates than the width) go last
    order = np.argsort(~valid, axis=1, kind="stable")
    rows, out = np.take_along_axis(rows, order, axis=1), np.take_along_axis(out, order, axis=1)
    rows[rows < 0], out[rows < 0] = -1, 0.0
    return SearchResults(out[:, :k], rows[:, :k], first.passages)


def results_from_run(
    run: Mapping[str, Mapping[str, float]], query_ids: Sequence[str], corpus: Corpus, width: int = 1
) -> SearchResults:
    """A run's rankings (best first) as ``SearchResults`` over ``corpus``, at least ``width`` wide, padded
    with -1 rows; a passage outside ``corpus`` is a DataError."""
    from densepass.errors import DataError

    width = max([len(run.get(q, {})) for q in query_ids] + [width])
    rows = np.full((len(query_ids), width), -1, dtype=np.int64)
    scores = np.zeros((len(query_ids), width), dtype=np.float32)
    for i, qid in enumerate(query_ids):
        ranked = sorted(run.get(qid, {}).items(), key=lambda item: -item[1])
        for j, (pid, score) in enumerate(ranked):
            if pid not in corpus:
                raise DataError(f"the run ranks passage {pid!r} for query {qid!r}, which is not in the corpus")
            rows[i, j], scores[i, j] = corpus.position(pid), score
    return SearchResults(scores, rows, corpus)


def rerank_run(
    run: Mapping[str, Mapping[str, float]],
    queries: Mapping[str, str],
    corpus: Corpus,
    reranker: Reranker,
    depth: int,
    k: int | None = None,
    fuse_weight: float | None = None,
) -> dict[str, dict[str, float]]:
    """A run (e.g. a TREC file of any first stage) with each query's top ``depth`` re-scored by ``reranker``
    (``rerank``: the rest follow in their first-stage order), its top ``k`` per query when given. ``queries``
    maps the run's query ids to their texts; an id without one is a one-line DataError.

    ``fuse_weight`` w: the top ``depth`` are ordered by w x the reranker's score + (1 - w) x the first stage's,
    each min-max normalised over the query's top ``depth`` (``evaluation.fusion.linear_fusion``), instead of by
    the reranker's alone: interpolating with the first stage keeps what it knew that the reranker does not.

    >>> class Length:  # a toy reranker: longer passages first
    ...     def score_pairs(self, queries, passages): return np.array([len(p) for p in passages], dtype=float)
    >>> corpus = Corpus(["a", "b"], ["", ""], ["tar", "X11 window manager"], ["a", "b"])
    >>> rerank_run({"q": {"a": 2.0, "b": 1.0}}, {"q": "window"}, corpus, Length(), depth=2)["q"]
    {'b': 18.0, 'a': 3.0}
    """
    check_run_queries(run, queries)
    if fuse_weight is not None and not 0 <= fuse_weight <= 1:
        raise ConfigError(f"the fusion weight of the reranker lies in [0, 1], got {fuse_weight}")
    query_ids = list(run)
    first = results_from_run(run, query_ids, corpus, width=depth)
    reranked = rerank(first, [queries[q] for q in query_ids], reranker, depth, k if fuse_weight is None else None)
    if fuse_weight is None:
        return reranked.as_run(query_ids)
    from densepass.evaluation.fusion import linear_fusion

    head = {q: dict(ranked[:depth]) for q, ranked in zip(query_ids, first)}
    scored = {q: {p: s for p, s in ranked if p in head[q]} for q, ranked in zip(query_ids, reranked)}
    fused = linear_fusion([scored, head], [fuse_weight, 1 - fuse_weight])
    out = {}
    for q, ranked in zip(query_ids, first):  # the fused top depth (in [0, 1]), then the rest below it, in order
        tail = {p: -1.0 - i for i, (p, _) in enumerate(ranked[depth:])}
        out[q] = dict(sorted({**fused.get(q, {}), **tail}.items(), key=lambda item: -item[1])[:k])
    return out


def check_run_queries(run: Mapping[str, object], queries: Mapping[str, str]) -> None:
    """A one-line DataError unless every query of ``run`` has a text in ``queries``."""
    from densepass.errors import DataError

    missing = [q for q in run if q not in queries]
    if missing:
        raise DataError(f"{len(missing)} of the run's queries have no text in the dataset (e.g. {missing[0]!r})")


def read_queries(path: str | Path) -> tuple[list[str], list[str]]:
    """(ids, texts) of a queries file: BEIR ``queries.jsonl`` (``_id``, ``text``; .gz too) or ``id<TAB>text`` lines,
    in the file's order, checked as the dataset readers check theirs (a lone surrogate, an id with whitespace: a
    DataError naming the line).

    A query id given again with a different text is a DataError naming the id and both lines (which text is meant
    is unknowable); with the same text the repeat is skipped, with one counted DataWarning. A blank query (empty,
    whitespace or invisible characters only, e.g. zero-width spaces: ``data.texts.is_blank``) is skipped, with one
    counted DataWarning naming the first line: the run has no line for it, as for a query a search returns nothing
    for (the dataset readers keep theirs, with the same kind of warning, since evaluation counts them); a file of
    blank queries only is a DataError."""
    from densepass.data.files import Tally

    path = Path(path)
    if not path.is_file():
        raise DataError(f"queries file not found: {path}")
    first: dict[str, tuple[str, int]] = {}  # query id -> (text, line)
    repeats = Tally(path, "repeated query ids with the same text, ignored")
    blank = Tally(path, "blank queries (empty, whitespace or zero-width characters only) skipped: nothing to search")
    ids, texts = [], []
    for line_no, qid, text in _query_lines(path):
        if qid in first:
            old, old_line = first[qid]
            if old != text:
                raise DataError(
                    f"{path}:{line_no}: query id {qid!r} given again with a different text ({text[:40]!r}; line "
                    f"{old_line}: {old[:40]!r})"
                )
            repeats.add(line_no)
            continue
        first[qid] = (text, line_no)
        if is_blank(text):
            blank.add(line_no)
            continue
        ids.append(qid)
        texts.append(text)
    if not first:
        raise DataError(f"{path}: no queries")
    if not ids:
        raise DataError(f"{path}: every query is blank (empty, whitespace or zero-width characters only)")
    repeats.warn()
    blank.warn()
    return ids, texts


def _query_lines(path: Path):
    """``(line number, id, text)`` of each query of a queries file (``read_queries``), fields checked."""
    from densepass.data.beir import read_jsonl
    from densepass.data.io_utils import get_field, get_id
    from densepass.data.msmarco import read_id_text_tsv

    if not path.name.endswith((".jsonl", ".jsonl.gz", ".json")):
        yield from read_id_text_tsv(path)
        return
    for line_no, record in read_jsonl(path):
        where = f"{path}:{line_no}"
        yield line_no, get_id(record, "_id", where), get_field(record, "text", str, where)
