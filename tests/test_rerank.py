"""Reranking as a second stage: a reranked list keeps every first-stage candidate (the top `depth` in the
reranker's order, the rest after them in first-stage order), and bad depths are one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from densepass.data.dataset import Corpus
from densepass.errors import ConfigError, DataError
from densepass.index.base import SearchResults
from densepass.index.bm25 import BM25Index
from densepass.pipelines.search import SearchPipeline, rerank, results_from_run

TEXTS = [f"passage {i} about {w}" for i, w in enumerate("audio video kernel printer mail shell font game".split())]
CORPUS = Corpus([f"p{i}" for i in range(len(TEXTS))], [""] * len(TEXTS), TEXTS, [f"p{i}" for i in range(len(TEXTS))])


# scores of a ranker: normal floats (ranx min-max normalises a range of subnormal ones, 1e-39, to noise)
SCORES = st.floats(-5, 5, allow_nan=False, allow_subnormal=False, width=32)


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


@settings(max_examples=30, deadline=None)
@given(
    table=st.lists(SCORES, min_size=len(TEXTS), max_size=len(TEXTS), unique=True),
    depth=st.integers(2, 8),
    weight=st.sampled_from([0.0, 0.25, 0.55, 1.0]),
)
def test_a_pipeline_fusing_its_reranker_orders_and_scores_as_reranking_its_first_stage_run(table, depth, weight):
    """``SearchPipeline(..., rerank_fuse_weight=w)`` (what ``densepass search/serve --rerank-fuse-weight`` run) gives
    the hits ``rerank_run(..., fuse_weight=w)`` (``densepass rerank --fuse-weight``) gives on its first stage's run,
    whose fusion is checked against a hand-computed interpolation below."""
    from densepass.pipelines.search import rerank_run

    index, query = BM25Index.build(CORPUS), "passage about audio video"
    first = SearchPipeline(index).search(query, k=len(TEXTS))
    pipeline = SearchPipeline(index, TableReranker(table), rerank_depth=depth, rerank_fuse_weight=weight)
    hits = pipeline.search(query, k=len(TEXTS))
    run = {"q": {hit.id: hit.score for hit in first}}
    expected = rerank_run(run, {"q": query}, CORPUS, TableReranker(table), depth, fuse_weight=weight)["q"]
    assert [hit.id for hit in hits] == list(expected)
    assert [hit.score for hit in hits] == pytest.approx(list(expected.values()), abs=1e-6)
    assert pipeline.describe()["rerank_fuse_weight"] == weight
    assert all(0 <= hit.score <= 1 for hit in hits[:depth]) and all(hit.score < 0 for hit in hits[depth:])


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.integers(0, len(TEXTS) - 1), min_size=0, max_size=6, unique=True), min_size=1, max_size=4
    ),
    first_scores=st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.5, -1.0]), min_size=6, max_size=6),  # ties, often
    table=st.lists(st.sampled_from([0.0, 1.0, 3.0, -2.0]), min_size=len(TEXTS), max_size=len(TEXTS)),
    depth=st.integers(1, 6),
    weight=st.sampled_from([0.0, 0.3, 0.55, 1.0]),
)
def test_fused_reranking_scores_are_the_evaluations_linear_fusion_on_padded_and_tied_lists(
    rows, first_scores, table, depth, weight
):
    """``rerank(..., fuse_weight=w)`` over lists padded with -1 rows (fewer candidates than the width, or none), with
    tied scores and single candidates: each head candidate scores what ``evaluation.fusion.linear_fusion`` (ranx's
    min-max ``wsum``, the reference) gives it, the head in that order, then the rest in first-stage order below it."""
    from densepass.evaluation.fusion import linear_fusion

    width = 6
    padded = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    ordered = sorted(first_scores, reverse=True)  # a first stage's scores run best first
    first = SearchResults(np.array([ordered] * len(rows), dtype=np.float32), padded, CORPUS)
    out = rerank(first, ["q"] * len(rows), TableReranker(table), depth, fuse_weight=weight)
    for i, r in enumerate(rows):
        head, tail = r[:depth], r[depth:]
        got = out.hits(i)
        assert sorted(p for p, _ in got) == sorted(f"p{x}" for x in r)  # nothing lost, nothing added
        if not head:
            continue
        run_first = {"q": {f"p{x}": float(ordered[j]) for j, x in enumerate(head)}}
        run_ce = {"q": {f"p{x}": table[x] for x in head}}
        expected = linear_fusion([run_ce, run_first], [weight, 1 - weight])["q"]
        scored = dict(got[: len(head)])
        assert scored == pytest.approx(expected, abs=1e-6)
        values = [s for _, s in got]
        assert values[: len(head)] == sorted(values[: len(head)], reverse=True)
        assert [p for p, _ in got[len(head) :]] == [f"p{x}" for x in tail]  # the tail in first-stage order, below
        assert all(s < min(values[: len(head)]) for s in values[len(head) :])


def test_a_rerank_fusion_weight_needs_a_reranker_and_lies_in_0_1():
    index, reranker = BM25Index.build(CORPUS), TableReranker([0.0] * len(TEXTS))
    with pytest.raises(ConfigError, match=r"^the fusion weight of the reranker lies in \[0, 1\], got 1.5$"):
        SearchPipeline(index, reranker, rerank_depth=2, rerank_fuse_weight=1.5)
    with pytest.raises(ConfigError, match="weighs a reranker's scores, and there is no reranker"):
        SearchPipeline(index, rerank_fuse_weight=0.5)
    first = SearchResults(np.zeros((1, 3), dtype=np.float32), np.array([[0, 1, 2]]), CORPUS)
    with pytest.raises(ConfigError, match=r"lies in \[0, 1\], got -0.1"):
        rerank(first, ["q"], reranker, 2, fuse_weight=-0.1)


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


def test_the_rerank_command_reorders_a_trec_runs_top_depth_by_the_cross_encoder(
    tiny_beir, tiny_model_dir, tmp_path, capsys
):
    import gzip
    import json

    from densepass import cli
    from densepass.data import load_dataset
    from densepass.evaluation.metrics import read_trec_run
    from densepass.models.cross_encoder import CrossEncoder

    model = CrossEncoder.new(str(tiny_model_dir), seed=5, max_length=48, device=torch.device("cpu"), precision="fp32")
    with torch.no_grad():  # a random head's scores differ in the 7th decimal; TREC files keep 6
        model.model.classifier.weight.mul_(1e4)
    model.save(tmp_path / "ce")
    dataset = load_dataset(str(tiny_beir))
    first = tmp_path / "first.trec.gz"  # every dev query ranks 6 passages, in corpus order
    dev = sorted(dataset.split("dev"))
    with gzip.open(first, "wt") as f:
        for q in dev:
            f.writelines(f"{q} Q0 p{i} {i + 1} {10 - i} bm25\n" for i in range(6))
    out = tmp_path / "reranked.trec"
    common = [str(tiny_beir), str(first), "--model", str(tmp_path / "ce"), "--device", "cpu", "--precision", "fp32"]
    assert cli.main(["rerank", *common, "--depth", "4", "--output", str(out)]) == 0
    reranked = read_trec_run(out)
    texts = dict(zip(dataset.corpus.ids, dataset.corpus.passage_inputs(" ")))
    for q in dev:  # one pair at a time: the top 4 by the cross-encoder, then p4 and p5 as they were
        head = {f"p{i}": float(model.score_pairs([dataset.queries[q]], [texts[f"p{i}"]])[0]) for i in range(4)}
        expected = sorted(head, key=lambda p: -head[p]) + ["p4", "p5"]
        assert list(sorted(reranked[q], key=lambda p: -reranked[q][p])) == expected
        for p, score in head.items():
            assert reranked[q][p] == pytest.approx(score, rel=1e-5)
    assert cli.main(["rerank", *common, "--depth", "4", "--k", "2", "--output", str(out)]) == 0
    assert {len(ranked) for ranked in read_trec_run(out).values()} == {2}
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["queries"] == len(dev) and summary["depth"] == 4 and summary["reranker"]["kind"] == "cross-encoder"
    with gzip.open(first, "at") as f:  # a query the dataset does not have
        f.write("nosuchquery Q0 p1 1 1.0 bm25\n")
    assert cli.main(["rerank", *common, "--output", str(out)]) != 0
    err = capsys.readouterr().err.strip()
    assert "have no text in the dataset" in err and "'nosuchquery'" in err and len(err.splitlines()) == 1


def test_the_rerank_command_takes_a_queries_file_and_a_corpus_file_instead_of_a_dataset(
    tiny_beir, tiny_model_dir, tmp_path, capsys
):
    """``--queries FILE``: the queries' texts from the file, the passages alone from the dataset (a corpus file, no
    judgements needed): the same run as reranking over the whole dataset; a run's query the file lacks is refused
    in one line naming the file, before the model loads."""
    import json

    from densepass import cli
    from densepass.data import load_dataset
    from densepass.evaluation.metrics import read_trec_run
    from densepass.models.cross_encoder import CrossEncoder

    model = CrossEncoder.new(str(tiny_model_dir), seed=5, max_length=48, device=torch.device("cpu"), precision="fp32")
    with torch.no_grad():  # scores spread wide enough that no two tie in a TREC file's 6 decimals
        model.model.classifier.weight.mul_(1e4)
    model.save(tmp_path / "ce")
    dataset = load_dataset(str(tiny_beir))
    dev = sorted(dataset.split("dev"))
    first = tmp_path / "first.trec"
    first.write_text("".join(f"{q} Q0 p{i} {i + 1} {10 - i} bm25\n" for q in dev for i in range(6)))
    queries = tmp_path / "queries.tsv"
    queries.write_text("".join(f"{q}\t{dataset.queries[q]}\n" for q in dev))
    corpus = tmp_path / "apart" / "passages.jsonl"  # the corpus alone, away from the dataset's queries and qrels
    corpus.parent.mkdir()
    corpus.write_bytes((tiny_beir / "corpus.jsonl").read_bytes())
    common = [str(first), "--model", str(tmp_path / "ce"), "--device", "cpu", "--precision", "fp32", "--depth", "4"]
    assert cli.main(["rerank", str(tiny_beir), *common, "--output", str(tmp_path / "whole.trec")]) == 0
    assert (
        cli.main(["rerank", str(corpus), *common, "--queries", str(queries), "--output", str(tmp_path / "q.trec")]) == 0
    )
    whole, apart = read_trec_run(tmp_path / "whole.trec"), read_trec_run(tmp_path / "q.trec")
    assert all(list(apart[q]) == list(whole[q]) and apart[q] == pytest.approx(whole[q], rel=1e-5) for q in dev)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["queries"] == len(dev)
    queries.write_text("".join(f"{q}\t{dataset.queries[q]}\n" for q in dev[1:]))
    out = tmp_path / "refused.trec"
    assert cli.main(["rerank", str(corpus), *common, "--queries", str(queries), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"1 of the run's queries have no text in {queries}" in err and "\n" not in err and not out.exists()


def test_reranking_a_second_first_stage_with_a_cache_dir_scores_only_its_new_pairs(
    tiny_beir, tiny_model_dir, tmp_path, capsys
):
    """``densepass rerank --cache-dir``: a second first stage of the same queries, sharing most candidates with the
    first, scores only the pairs the first did not have, and its run is the one reranking it without a cache
    writes; a ColBERT model, whose scores are not kept, is refused in one line."""
    import json

    from densepass import cli
    from densepass.data import load_dataset
    from densepass.evaluation.metrics import read_trec_run
    from densepass.models.cross_encoder import CrossEncoder

    ce = CrossEncoder.new(str(tiny_model_dir), seed=5, max_length=48, device=torch.device("cpu"))
    with torch.no_grad():  # scores spread wide enough that no two tie in a TREC file's 6 decimals
        ce.model.classifier.weight.mul_(1e4)
    ce.save(tmp_path / "ce")
    dev = sorted(load_dataset(str(tiny_beir)).split("dev"))
    for name, ids in (("a", range(6)), ("b", range(2, 8))):  # four candidates of b's six are a's too
        (tmp_path / f"{name}.trec").write_text(
            "".join(f"{q} Q0 p{i} {r + 1} {10 - r} bm25\n" for q in dev for r, i in enumerate(ids))
        )
    model = [str(tiny_beir), "--model", str(tmp_path / "ce"), "--device", "cpu", "--precision", "fp32"]
    cache = ["--cache-dir", str(tmp_path / "cache")]
    summaries = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}-reranked.trec"
        assert (
            cli.main(["rerank", *model[:1], str(tmp_path / f"{name}.trec"), *model[1:], *cache, "--output", str(out)])
            == 0
        )
        summaries.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert [(s["pairs_scored"], s["pairs_from_cache"]) for s in summaries] == [
        (6 * len(dev), 0),
        (2 * len(dev), 4 * len(dev)),
    ]
    plain = tmp_path / "b-plain.trec"
    assert cli.main(["rerank", *model[:1], str(tmp_path / "b.trec"), *model[1:], "--output", str(plain)]) == 0
    cached, fresh = read_trec_run(tmp_path / "b-reranked.trec"), read_trec_run(plain)
    assert all(list(cached[q]) == list(fresh[q]) and cached[q] == pytest.approx(fresh[q], rel=1e-5) for q in dev)
    from densepass.models.colbert import ColBERT

    ColBERT.from_pretrained(str(tiny_model_dir)).save(tmp_path / "colbert")
    capsys.readouterr()
    late = [str(tiny_beir), str(tmp_path / "a.trec"), "--model", str(tmp_path / "colbert"), "--device", "cpu", *cache]
    assert cli.main(["rerank", *late, "--output", str(tmp_path / "late.trec")]) != 0
    err = capsys.readouterr().err.strip()
    assert "keeps a cross-encoder's scores" in err and len(err.splitlines()) == 1
    int8 = [*model[:1], str(tmp_path / "a.trec"), *model[1:-1], "int8", *cache, "--output", str(tmp_path / "q.trec")]
    assert cli.main(["rerank", *int8]) != 0
    err = capsys.readouterr().err.strip()
    assert "an int8 score depends on its batch" in err and len(err.splitlines()) == 1
    notes = tmp_path / "my-notes.txt"  # a user's file where the cache folder was named: refused, left as it is
    notes.write_text("mine\n")
    named = [
        *model[:1],
        str(tmp_path / "a.trec"),
        *model[1:],
        "--cache-dir",
        str(notes),
        "--output",
        str(tmp_path / "n.trec"),
    ]
    assert cli.main(["rerank", *named]) != 0
    err = capsys.readouterr().err.strip()
    assert "exists and is not a folder" in err and len(err.splitlines()) == 1 and notes.read_text() == "mine\n"
    assert not any((tmp_path / name).exists() for name in ("late.trec", "q.trec", "n.trec"))


@settings(max_examples=40, deadline=None)
@given(
    scores=st.lists(SCORES, min_size=len(TEXTS), max_size=len(TEXTS), unique=True),
    table=st.lists(SCORES, min_size=len(TEXTS), max_size=len(TEXTS), unique=True),
    depth=st.integers(2, 8),
    weight=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
)
def test_fusing_the_reranker_with_the_first_stage_matches_a_hand_computed_interpolation(scores, table, depth, weight):
    from densepass.pipelines.search import rerank_run

    run = {"q": {f"p{i}": s for i, s in enumerate(scores)}}
    out = rerank_run(run, {"q": "x"}, CORPUS, TableReranker(table), depth, fuse_weight=weight)["q"]
    ranked = sorted(run["q"], key=lambda p: -run["q"][p])
    head, tail = ranked[:depth], ranked[depth:]

    def minmax(values: dict) -> dict:
        low, high = min(values.values()), max(values.values())
        return {p: (v - low) / (high - low) if high > low else 0.0 for p, v in values.items()}

    ce = minmax({p: table[int(p[1:])] for p in head})
    first = minmax({p: run["q"][p] for p in head})
    expected = {p: weight * ce[p] + (1 - weight) * first[p] for p in head}
    order = sorted(out, key=lambda p: -out[p])
    assert order[depth:] == tail and set(order[:depth]) == set(head)
    for p in head:
        assert out[p] == pytest.approx(expected[p], abs=1e-6)
    assert list(out) == order  # the run lists its passages best first
    assert len(rerank_run(run, {"q": "x"}, CORPUS, TableReranker(table), depth, k=3, fuse_weight=weight)["q"]) == 3


def test_reranking_under_a_progress_bar_scores_in_the_cross_encoders_own_batches(
    tiny_beir, tiny_model_dir, monkeypatch, capsys
):
    """``rerank(show_progress=True)`` scores in calls of ``PROGRESS_PAIRS`` pairs, cut where the cross-encoder cuts
    its tokenising chunks: its batches are the same, so even int8 scores (one activation scale per batch) equal
    those of one call."""
    from densepass.data import load_dataset
    from densepass.models import cross_encoder
    from densepass.models.cross_encoder import CrossEncoder
    from densepass.pipelines import search

    dataset = load_dataset(str(tiny_beir))
    ce = CrossEncoder.new(str(tiny_model_dir), seed=5, max_length=48, device=torch.device("cpu"), precision="int8")
    monkeypatch.setattr(cross_encoder, "TOKENIZE_CHUNK", 4)
    monkeypatch.setattr(search, "PROGRESS_PAIRS", 8)
    qids = sorted(dataset.split("dev"))
    run = {q: {f"p{i}": 10.0 - i for i in range(7)} for q in qids}  # 7 pairs a query: calls cut inside queries
    whole = search.rerank_run(run, dataset.queries, dataset.corpus, ce, depth=7)
    shown = search.rerank_run(run, dataset.queries, dataset.corpus, ce, depth=7, show_progress=True)
    assert shown == whole
    assert "rerank" in capsys.readouterr().err  # the bar
