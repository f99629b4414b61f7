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

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from densepass.config import DENSE_INDEX_KINDS, ONDISK_INDEX_KIND
from densepass.data.dataset import Corpus
from densepass.data.texts import is_blank, surrogate_problem
from densepass.device import default_device, resolve_device, resolve_precision
from densepass.errors import ConfigError, DataError
from densepass.index.base import KINDS, Index, SearchResults, check_k, current_version, load_index, read_index_manifest
from densepass.index.binary import COMPACT_KINDS, CompactIndex
from densepass.index.bm25 import BM25Index
from densepass.index.hybrid import HybridIndex
from densepass.io import check_cache_dir, check_regular_file
from densepass.models.biencoder import model_name, resolve_model_path
from densepass.models.colbert import ColBERT, ColbertReranker
from densepass.models.copies import float_precision
from densepass.models.cross_encoder import PASSAGE_SEP, TOKENIZE_CHUNK, CrossEncoder
from densepass.models.kinds import model_kind
from densepass.models.load import load_model
from densepass.models.score_cache import CachedPairScores
from densepass.phrase.index import PhraseIndex, PhraseSearchResults  # registers the phrase kind for load_index

PROGRESS_PAIRS = 4 * TOKENIZE_CHUNK
"""Pairs per reranker call under ``rerank``'s progress bar: a multiple of a cross-encoder's tokenising chunk."""


def compact_part(directory: Path) -> tuple[str, dict] | None:
    """(kind, manifest) of the int8 or binary index saved in ``directory`` (its current version): itself, or a
    hybrid's dense part; None without one."""
    folder, manifest = current_version(directory)
    if manifest["kind"] in COMPACT_KINDS:
        return manifest["kind"], manifest
    if manifest["kind"] == "hybrid":
        first = read_index_manifest(folder / "first")
        if first["kind"] in COMPACT_KINDS:
            return first["kind"], first
    return None


BIENCODER_KINDS = (*DENSE_INDEX_KINDS, ONDISK_INDEX_KIND, *COMPACT_KINDS)  # indexes of one bi-encoder's embeddings


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

    @property
    def passage_sep(self) -> str:
        """How the wrapped reranker joins a passage's title and text."""
        return getattr(self.reranker, "passage_sep", PASSAGE_SEP)


class SearchPipeline:
    """First stage ``index``, then (optionally) ``reranker`` over its top ``rerank_depth`` candidates, ordered by
    its scores or, with ``rerank_fuse_weight`` w, by w x its scores + (1 - w) x the first stage's (``rerank``)."""

    def __init__(
        self,
        index: Index,
        reranker: Reranker | None = None,
        rerank_depth: int = 100,
        rerank_fuse_weight: float | None = None,
    ) -> None:
        if rerank_depth < 1:
            raise ConfigError(f"rerank depth must be >= 1, got {rerank_depth}")
        check_fuse_weight(rerank_fuse_weight)
        if rerank_fuse_weight is not None and reranker is None:
            raise ConfigError("the rerank fusion weight weighs a reranker's scores, and there is no reranker")
        if reranker is not None and rerank_depth > len(index):
            raise ConfigError(f"rerank depth {rerank_depth} is larger than the index's {len(index)} passages")
        if reranker is not None and isinstance(index, PhraseIndex):
            raise ConfigError("a phrase index returns phrases: rerank passages with a passage index instead")
        self.index, self.reranker, self.rerank_depth = index, reranker, rerank_depth
        self.rerank_fuse_weight = rerank_fuse_weight

    @classmethod
    def load(
        cls,
        directory: str | Path,
        reranker: Reranker | str | Path | None = None,
        rerank_depth: int | None = None,
        *,
        model: Any = None,
        device: str | torch.device | None = None,
        precision: str = "auto",
        search_precision: str = "fp32",
        rescore: int | None = None,
        nprobe: int | None = None,
        hybrid: str | None = None,
        fusion_weight: float | None = None,
        rerank_batch_size: int | None = None,
        rerank_precision: str = "auto",
        rerank_fuse_weight: float | None = None,
        **index_options: Any,
    ) -> SearchPipeline:
        """A pipeline over the index saved in ``directory`` (what ``densepass search`` and ``serve`` run; each
        keyword is the option of the same name there, ``--rerank`` being ``reranker``).

        ``model``: the index's model (a saved path, or a loaded model) if it moved since indexing; ``device`` where
        models run (default: ``default_device()``); ``precision`` how a model index encodes queries (fp32, bf16,
        int8, auto); ``search_precision`` / ``rescore``: an exact index scores every passage in bf16 or int8, then
        re-scores the best ``rescore`` x k in fp32; ``nprobe``: lists an on-disk IVF-PQ index probes per query;
        ``hybrid`` (rrf or linear): fuse a bi-encoder index with BM25 over its passages, the dense scores weighing
        ``fusion_weight`` (linear; default 0.5). ``reranker``: a second stage, loaded or the path of a saved
        cross-encoder or ColBERT model (``load_reranker``: ``rerank_batch_size`` texts or pairs per pass, scoring in
        ``rerank_precision``), re-scoring the top ``rerank_depth`` candidates (default: 100, or every passage of a
        smaller index), ordered by its scores or, with ``rerank_fuse_weight``, by their interpolation with the first
        stage's (``rerank``). Other ``index_options`` go to the index's kind (``index.base.load_index``).

        An option that does not apply to the index or to the options given with it (a second-stage option without a
        reranker, ``rescore`` without a reduced search precision, a model for BM25, a precision a model cannot run)
        is a one-line ConfigError before any model or index is loaded, so that nothing asked for is silently
        ignored."""
        device = device if isinstance(device, torch.device) else resolve_device(device)
        manifest = read_index_manifest(Path(directory))
        kind = manifest["kind"]
        options: dict[str, Any] = {} if kind == "bm25" else {"device": device}
        given = [f"--{key.replace('_', '-')}" for key in ("rescore_with", "rescore_multiplier") if key in index_options]
        if given:  # (the index's own errors named the Python options, or none: a multiplier with nothing re-scored)
            compact = compact_part(Path(directory))
            if compact is None:
                raise ConfigError(
                    f"{', '.join(given)}: options of an int8 or binary index; {directory} is an index of kind {kind}"
                )
            part, saved = compact
            rescore_with = index_options.get("rescore_with", saved.get("options", {}).get("rescore_with", "float"))
            if "rescore_multiplier" in index_options and not CompactIndex.rescores(part, rescore_with):
                raise ConfigError(
                    f"--rescore-multiplier: this {part} index with --rescore-with {rescore_with} re-scores none"
                )
        if kind in ("splade", "colbert"):
            float_precision(precision, device, kind)
            options["precision"] = precision
        elif kind in (*BIENCODER_KINDS, "hybrid"):  # a hybrid index's first part is dense
            resolve_precision(precision, device)
            options["precision"] = precision
        elif precision not in ("auto", "fp32"):
            raise ConfigError(f"--precision {precision} applies to model indexes; {directory} is a {kind} index")
        check_fuse_weight(rerank_fuse_weight)
        if isinstance(reranker, str | Path):
            check_reranker_precision(reranker, rerank_precision, device)
        else:
            second_stage = [
                ("--rerank-depth", rerank_depth is not None and reranker is None),
                ("--rerank-fuse-weight", rerank_fuse_weight is not None and reranker is None),
                ("--rerank-batch-size", rerank_batch_size is not None),
                (f"--rerank-precision {rerank_precision}", rerank_precision != "auto"),
            ]
            given = [option for option, set_ in second_stage if set_]
            if given:
                what = "is not given" if reranker is None else "is loaded already"
                raise ConfigError(f"{', '.join(given)} applies to the second stage of --rerank, which {what}")
        if rescore is not None and search_precision == "fp32":
            raise ConfigError("--rescore sets how many candidates --search-precision bf16 / int8 re-scores in fp32")
        if fusion_weight is not None and hybrid != "linear":
            raise ConfigError("--fusion-weight weighs the dense scores of --hybrid linear")
        if search_precision != "fp32":
            if kind != "exact":
                raise ConfigError(f"--search-precision is an option of exact indexes; {directory} is a {kind} index")
            options["search_precision"] = search_precision
            if rescore is not None:
                options["rescore"] = rescore
        if nprobe is not None:
            if kind != ONDISK_INDEX_KIND:
                raise ConfigError(
                    f"--nprobe is an option of {ONDISK_INDEX_KIND} indexes; {directory} is a {kind} index"
                )
            options["nprobe"] = nprobe
        if hybrid is not None and kind not in BIENCODER_KINDS:
            raise ConfigError(f"--hybrid adds BM25 to a dense index; {directory} is a {kind} index")
        if model is not None and KINDS[kind].load_options is not None and "model" not in KINDS[kind].load_options:
            raise ConfigError(f"--model is the model of a model index; {directory} is a {kind} index")
        if model is not None:  # a phrase index loads its own model; the others check the kind of the one given
            options["model"] = load_model(str(model)) if isinstance(model, str | Path) and kind != "phrase" else model
        index = load_index(directory, **options, **index_options)
        if hybrid is not None:
            weight = 0.5 if fusion_weight is None else fusion_weight
            bm25 = BM25Index.build(index.passages)
            if len(index) < len(index.passages):  # an updated index's tombstones: BM25 leaves the same rows out
                bm25._deleted = index.deleted.copy()
            index = HybridIndex(index, bm25, hybrid, weight)
        if isinstance(reranker, str | Path):
            reranker = load_reranker(reranker, device, rerank_batch_size, rerank_precision)
        depth = min(100, len(index)) if rerank_depth is None else rerank_depth
        return cls(index, reranker, depth, rerank_fuse_weight)

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
        return rerank(first, list(queries), self.reranker, self.rerank_depth, k, fuse_weight=self.rerank_fuse_weight)

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
        facts = {"index": self.index.kind, "passages": len(self.index), "index_version": self.index.version}
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
            if self.rerank_fuse_weight is not None:
                facts["rerank_fuse_weight"] = self.rerank_fuse_weight
        return facts


def check_fuse_weight(weight: float | None) -> None:
    """A one-line ConfigError unless the reranker's fusion weight is None or a number in [0, 1]."""
    if weight is None:
        return
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not 0 <= weight <= 1:
        raise ConfigError(f"the fusion weight of the reranker lies in [0, 1], got {weight!r}")


def check_reranker_precision(path: str | Path, precision: str, device: torch.device) -> None:
    """A one-line error, before anything loads, where the reranker saved at ``path`` does not run ``precision``
    (int8 on a GPU; int8 for ColBERT, which runs fp32 or bf16)."""
    if model_kind(resolve_model_path(str(path))) == "colbert":
        float_precision(precision, device, "colbert")
    else:
        resolve_precision(precision, device)


def load_reranker(path: str | Path, device: torch.device, batch_size: int | None = None, precision: str = "auto"):
    """A second stage from a saved model: ColBERT (late interaction over the candidates) or a cross-encoder,
    ``batch_size`` texts or pairs per forward pass (None: 64), scoring in ``precision`` (checked first:
    ``check_reranker_precision``)."""
    check_reranker_precision(path, precision, device)
    path, batch_size = str(path), 64 if batch_size is None else batch_size
    if model_kind(resolve_model_path(path)) == "colbert":
        return ColbertReranker(ColBERT.from_pretrained(path), batch_size, device, precision)
    return CrossEncoder.from_pretrained(path, device=device, batch_size=batch_size, precision=precision)


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
    first: SearchResults,
    queries: Sequence[str],
    reranker: Reranker,
    depth: int,
    k: int | None = None,
    show_progress: bool = False,
    fuse_weight: float | None = None,
) -> SearchResults:
    """Re-score the top ``depth`` candidates of each query with ``reranker`` and order them by that score;
    candidates past ``depth`` follow in their first-stage order, scored below every re-scored one, so the
    reranked list holds every first-stage candidate (its top ``k`` when given). Every query's candidates
    are scored in one call (the reranker batches and sorts them by length); with ``show_progress``, in calls of
    ``PROGRESS_PAIRS`` pairs under a progress bar, cut where a cross-encoder cuts its own tokenising chunks, so
    its batches, and so its scores, are the same. A ``depth`` larger than the first stage's candidate lists is a
    one-line ConfigError.

    ``fuse_weight`` w: the top ``depth`` are ordered, and scored, by w x the reranker's score + (1 - w) x the first
    stage's, each min-max normalised over the query's top ``depth`` (``interpolate``, as
    ``evaluation.fusion.linear_fusion`` normalises): interpolating with the first stage keeps what it knew that the
    reranker does not."""
    width = first.rows.shape[1]
    if depth < 1 or depth > width:
        raise ConfigError(f"rerank depth {depth} is outside the first stage's {width} candidates per query")
    check_fuse_weight(fuse_weight)
    head = first.rows[:, :depth]
    if fuse_weight is not None and not np.isfinite(first.scores[:, :depth][head >= 0]).all():
        raise ConfigError("the first stage's scores of the candidates to fuse with the reranker's must be finite")
    if len(queries) != len(first):
        raise ConfigError(f"{len(queries)} queries for {len(first)} first-stage result lists")
    k = width if k is None else min(check_k(k), width)
    # "title text", as a cross-encoder trains; a reranker that joins them otherwise says how (ColBERT: [SEP])
    texts = first.passages.passage_inputs(getattr(reranker, "passage_sep", PASSAGE_SEP))
    where = np.nonzero(head >= 0)
    scores = np.full(head.shape, -np.inf, dtype=np.float32)
    if len(where[0]):
        pair_queries, pair_texts = [queries[i] for i in where[0]], [texts[r] for r in head[where]]
        step = PROGRESS_PAIRS if show_progress else len(pair_queries)
        parts = []
        with tqdm(total=len(pair_queries), desc="rerank", unit="pairs", disable=not show_progress) as bar:
            for start in range(0, len(pair_queries), step):
                end = start + step
                parts.append(np.asarray(reranker.score_pairs(pair_queries[start:end], pair_texts[start:end])))
                bar.update(len(parts[-1]))
        values = np.concatenate(parts).astype(np.float32, copy=False)
        if values.shape != (len(where[0]),) or not np.isfinite(values).all():
            raise ConfigError(f"the reranker returned {values.shape} scores (finite?) for {len(where[0])} pairs")
        scores[where] = values
    if fuse_weight is not None:
        scores = interpolate(scores, first.scores[:, :depth], head >= 0, fuse_weight)
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


def interpolate(reranker: np.ndarray, first: np.ndarray, valid: np.ndarray, weight: float) -> np.ndarray:
    """Per row, ``weight`` x the reranker's scores + (1 - weight) x the first stage's, each min-max normalised over
    the row's ``valid`` entries (a row of equal scores normalises to 0, as ranx's min-max does); -inf elsewhere.

    >>> interpolate(np.array([[2.0, 0.0, 1.0]]), np.array([[3.0, 2.0, 1.0]]), np.array([[True] * 3]), 0.5).tolist()
    [[1.0, 0.25, 0.25]]
    """

    def normalised(values: np.ndarray) -> np.ndarray:
        values = values.astype(np.float64)
        low = np.where(valid, values, np.inf).min(axis=1, keepdims=True)
        high = np.where(valid, values, -np.inf).max(axis=1, keepdims=True)
        span = np.maximum(np.where(np.isfinite(high - low), high - low, 0.0), 1e-9)
        return np.where(valid, (values - np.where(np.isfinite(low), low, 0.0)) / span, 0.0)

    fused = weight * normalised(reranker) + (1 - weight) * normalised(first)
    return np.where(valid, fused, -np.inf).astype(np.float32)


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
    show_progress: bool = False,
) -> dict[str, dict[str, float]]:
    """A run (e.g. a TREC file of any first stage) with each query's top ``depth`` re-scored by ``reranker``
    (``rerank``: the rest follow in their first-stage order), its top ``k`` per query when given. ``queries``
    maps the run's query ids to their texts; an id without one is a one-line DataError.

    ``fuse_weight`` w: the top ``depth`` are ordered by w x the reranker's score + (1 - w) x the first stage's,
    each min-max normalised over the query's top ``depth`` (``rerank``), instead of by the reranker's alone.

    >>> class Length:  # a toy reranker: longer passages first
    ...     def score_pairs(self, queries, passages): return np.array([len(p) for p in passages], dtype=float)
    >>> corpus = Corpus(["a", "b"], ["", ""], ["tar", "X11 window manager"], ["a", "b"])
    >>> rerank_run({"q": {"a": 2.0, "b": 1.0}}, {"q": "window"}, corpus, Length(), depth=2)["q"]
    {'b': 18.0, 'a': 3.0}
    """
    check_run_queries(run, queries)
    check_fuse_weight(fuse_weight)
    query_ids = list(run)
    first = results_from_run(run, query_ids, corpus, width=depth)
    query_texts = [queries[q] for q in query_ids]
    return rerank(first, query_texts, reranker, depth, k, show_progress, fuse_weight).as_run(query_ids)


def rerank_run_file(
    dataset: str,
    run: str | Path,
    model: str | Path,
    output: str | Path,
    *,
    data_dir: str | Path | None = None,
    format: str = "beir",
    depth: int = 100,
    k: int | None = None,
    fuse_weight: float | None = None,
    device: str | torch.device | None = None,
    batch_size: int = 64,
    precision: str = "auto",
    tag: str = "densepass-rerank",
    cache_dir: str | Path | None = None,
    queries: str | Path | None = None,
) -> dict:
    """``densepass rerank``: the TREC run file ``run`` over dataset ``dataset`` (its queries and corpus; with
    ``queries``, a queries file as ``read_queries`` reads it, the dataset's passages alone: ``data.load_corpus``,
    so a corpus file will do) reranked by
    the saved cross-encoder or ColBERT ``model`` (``rerank_run``) and written to the run file ``output``; returns
    what was done (queries, depth, device, reranker, seconds). Before any work: ``output`` must be free for a run
    (``check_run_file``) and not the run being read, and the reranker must run ``precision`` on the device; before
    the model loads, every query of the run must have a text in the dataset. ``cache_dir``: a cross-encoder's
    scores are kept there by content (``models.score_cache``), so reranking another first stage of the same
    queries scores only the pairs it has not met (the summary counts both)."""
    import time

    from densepass.data import load_corpus, load_dataset
    from densepass.evaluation.metrics import check_run_file, read_trec_run, write_trec_run

    if Path(output).resolve() == Path(run).resolve():
        raise ConfigError(f"--output {output} is the run being reranked; write the reranked run elsewhere")
    check_run_file(output, tag)
    if cache_dir is not None and not str(cache_dir).strip():
        raise ConfigError("--cache-dir is empty: name the folder where the reranker's scores are kept")
    check_cache_dir(cache_dir, "--cache-dir")
    device = device if isinstance(device, torch.device) else resolve_device(device)
    check_reranker_precision(model, precision, device)  # a missing model or a bad precision: first
    if cache_dir is not None and model_kind(resolve_model_path(str(model))) == "colbert":
        raise ConfigError(f"--cache-dir keeps a cross-encoder's scores; {model} is a ColBERT model: rerank without it")
    if cache_dir is not None and precision == "int8":
        raise ConfigError("--cache-dir keeps fp32 and bf16 scores: an int8 score depends on its batch (one scale each)")
    if queries is None:
        data = load_dataset(dataset, data_dir, format)
        corpus, texts, where = data.corpus, data.queries, "the dataset"
    else:
        texts, where = dict(zip(*read_queries(queries))), str(queries)
        corpus = load_corpus(dataset, data_dir, format)[0]
    first = read_trec_run(run, corpus)
    check_run_queries(first, texts, where)  # before the model loads
    reranker = load_reranker(model, device, batch_size, precision)
    scorer = CachedPairScores(reranker, cache_dir) if cache_dir is not None else reranker
    started = time.perf_counter()
    reranked = rerank_run(first, texts, corpus, scorer, depth, k, fuse_weight, show_progress=True)
    seconds = time.perf_counter() - started
    write_trec_run(reranked, output, tag=tag)
    summary = {"queries": len(first), "depth": depth, "fuse_weight": fuse_weight, "device": str(device)}
    summary["seconds"] = round(seconds, 2)
    summary["ms_per_query"] = round(1000 * seconds / len(first), 2)
    if scorer is not reranker:
        summary.update(pairs_scored=scorer.scored, pairs_from_cache=scorer.found)
    return {**summary, "reranker": reranker.describe(), "output": str(output)}


def check_run_queries(run: Mapping[str, object], queries: Mapping[str, str], where: str = "the dataset") -> None:
    """A one-line DataError unless every query of ``run`` has a text in ``queries`` (read from ``where``)."""
    from densepass.errors import DataError

    missing = [q for q in run if q not in queries]
    if missing:
        raise DataError(f"{len(missing)} of the run's queries have no text in {where} (e.g. {missing[0]!r})")


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
    check_regular_file(path, "queries file")  # a FIFO: not waited on, and not "not found"
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
    from densepass.data.msmarco import read_id_text_tsv
    from densepass.data.reader_helpers import get_field, get_id

    if not path.name.endswith((".jsonl", ".jsonl.gz", ".json")):
        yield from read_id_text_tsv(path)
        return
    for line_no, record in read_jsonl(path):
        where = f"{path}:{line_no}"
        yield line_no, get_id(record, "_id", where), get_field(record, "text", str, where)
