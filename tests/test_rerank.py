"""Reranking as a second stage: a reranked list keeps every first-stage candidate (the top `depth` in the
reranker's order, the rest after them in first-stage order), and bad depths are one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from densepass.data.dataset import Corpus
from densepass.errors import ConfigError, DataError
from densepass.index.base import SearchResults
from densepass.index.bm25 import BM25Index
from densepass.pipelines.search import SearchPipeline, rerank, results_from_run

TEXTS = [f"passage {i} about {w}" for i, w in enumerate("audio video kernel printer mail shell font game".split())]
CORPUS = Corpus([f"p{i}" for i in range(len(TEXTS))], [""] * len(TEXTS), TEXTS, [f"p{i}" for i in range(len(TEXTS))])


class TableReranker:
    """Scores a pair by a fixed table of passage scores (and counts the pairs it was asked for)."""

    def __init__(self, scores):
        self.scores, self.pairs = scores, 0

    def score_pairs(self, queries, passages):
        self.pairs += len(passages)
        return np.array([self.scores[TEXTS.index(p)] for p in passages], dtype=np.float32)

    def describe(self):
        return {"kind": "table"}


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.integers(0, len(TEXTS) - 1), min_size=0, max_size=8, unique=True), min_size=1, max_size=4
    ),
    table=st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=len(TEXTS), max_size=len(TEXTS)),
    depth=st.integers(1, 8),
)
def test_a_reranked_list_never_loses_a_first_stage_candidate(rows, table, depth):
    width = 8
    padded = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    first = SearchResults(-np.arange(width, dtype=np.float32)[None].repeat(len(rows), 0), padded, CORPUS)
    out = rerank(first, ["q"] * len(rows), TableReranker(table), depth)
    for i, r in enumerate(rows):
        got = out.ids(i)
        assert sorted(got) == sorted(f"p{x}" for x in r)  # nothing lost, nothing added
        head, tail = r[:depth], r[depth:]
        expected_head = sorted(head, key=lambda x: -table[x])
        assert [table[int(p[1:])] for p in got[: len(head)]] == [table[x] for x in expected_head]
        assert got[len(head) :] == [f"p{x}" for x in tail]  # the tail keeps its first-stage order
        scores = [s for _, s in out.hits(i)]
        assert all(a >= b for a, b in zip(scores, scores[1:]))
        assert len(scores) == len(set(scores[len(head) :])) + len(head)


def test_the_pipeline_returns_k_hits_when_k_is_deeper_than_the_reranking():
    index = BM25Index.build(CORPUS)
    reranker = TableReranker([float(i) for i in range(len(TEXTS))])
    pipeline = SearchPipeline(index, reranker, rerank_depth=2)
    first = [hit.id for hit in SearchPipeline(index).search("passage about audio", k=6)]
    hits = [hit.id for hit in pipeline.search("passage about audio", k=6)]
    assert len(hits) == 6 and sorted(hits) == sorted(first)
    assert hits[:2] == sorted(first[:2], key=lambda p: -int(p[1:])) and hits[2:] == first[2:]
    assert reranker.pairs == 2  # only the top `depth` candidates were re-scored


def test_a_depth_larger_than_the_candidate_list_is_a_one_line_error():
    first = SearchResults(np.zeros((1, 3), dtype=np.float32), np.array([[0, 1, 2]]), CORPUS)
    with pytest.raises(ConfigError, match="rerank depth 4 is outside the first stage's 3 candidates"):
        rerank(first, ["q"], TableReranker([0.0] * len(TEXTS)), 4)
    with pytest.raises(ConfigError, match="rerank depth 9 is larger than the index's 8 passages"):
        SearchPipeline(BM25Index.build(CORPUS), TableReranker([0.0] * len(TEXTS)), rerank_depth=9)


def test_a_reranker_returning_the_wrong_number_of_scores_is_a_one_line_error():
    class Short(TableReranker):
        def score_pairs(self, queries, passages):
            return np.zeros(len(passages) - 1, dtype=np.float32)

    first = SearchResults(np.zeros((1, 3), dtype=np.float32), np.array([[0, 1, 2]]), CORPUS)
    with pytest.raises(ConfigError, match="the reranker returned"):
        rerank(first, ["q"], Short([]), 3)


def test_a_run_becomes_search_results_best_first_and_unknown_passages_are_refused():
    run = {"a": {"p3": 1.0, "p1": 2.0}, "b": {}}
    results = results_from_run(run, ["a", "b"], CORPUS, width=3)
    assert results.rows.tolist() == [[1, 3, -1], [-1, -1, -1]]
    assert results.as_run(["a", "b"]) == {"a": {"p1": 2.0, "p3": 1.0}, "b": {}}
    with pytest.raises(DataError, match="'nope'"):
        results_from_run({"a": {"nope": 1.0}}, ["a"], CORPUS)


def test_cached_scores_score_each_pair_once_and_return_the_same_scores():
    from densepass.pipelines.search import CachedScores

    table = TableReranker([float(i) for i in range(len(TEXTS))])
    cached = CachedScores(table)
    first = cached.score_pairs(["q", "q", "r"], [TEXTS[1], TEXTS[1], TEXTS[2]])
    second = cached.score_pairs(["q", "r", "r"], [TEXTS[1], TEXTS[2], TEXTS[3]])
    assert first.tolist() == [1.0, 1.0, 2.0] and second.tolist() == [1.0, 2.0, 3.0]
    assert table.pairs == 3 and cached.scored == 3
