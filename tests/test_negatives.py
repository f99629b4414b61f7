"""Hard-negative mining, filtering, sampling and fusion (densepass.negatives)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SHARED_DATA
from densepass.config import NegativesConfig, TrainConfig
from densepass.data import load_dataset
from densepass.data.dataset import Corpus, RetrievalDataset
from densepass.data.keys import half_id, split_in_half
from densepass.errors import ConfigError, DataError, DataWarning
from densepass.evaluation.fusion import fuse_embeddings, linear_fusion, reciprocal_rank_fusion, tune_weights
from densepass.negatives.context import mine_context_negatives
from densepass.negatives.filters import AnswerFilter, CrossEncoderFilter, DuplicateFilter, QrelsFilter, apply_filters
from densepass.negatives.mine import MiningContext, mine_negatives
from densepass.negatives.mixed import mix_pools
from densepass.negatives.pool import Candidate, load_pool, passage_ids, save_pool
from densepass.training.batches import TrainingData, draw_negatives
from densepass.training.dense_miners import prepare_miners


def small_dataset() -> RetrievalDataset:
    """Doc A has three passages, docs B and C one each; p5 duplicates p1's content; q3 repeats q0's text."""
    corpus = Corpus(
        ids=["p0", "p1", "p2", "p3", "p4", "p5"],
        titles=["A", "A", "A", "B", "C", "A"],
        texts=[
            "audio editor for linux",
            "video editor with effects",
            "music player for the desktop",
            "alpha beta gamma delta",
            "one two three four five six",
            "video editor with effects",
        ],
        doc_ids=["A", "A", "A", "B", "C", "A2"],
    )
    queries = {"q0": "audio editor", "q1": "greek letters", "q2": "counting words", "q3": "Audio  Editor"}
    qrels = {"train": {"q0": {"p0": 1}, "q1": {"p3": 1}, "q2": {"p4": 1}, "q3": {"p1": 1}}, "dev": {"q0": {"p2": 1}}}
    return RetrievalDataset("small", corpus, queries, qrels, answers={"q1": ["delta"], "q0": ["with effects"]})


def tiny_context(tmp_path: Path, tiny_model_dir: Path) -> MiningContext:
    from densepass.models.biencoder import BiEncoderConfig

    return MiningContext(
        work_dir=tmp_path / "miners",
        base_model=str(tiny_model_dir),
        architecture=BiEncoderConfig(passage_max_length=64),
        train_config=TrainConfig(batch_size=8, max_steps=2, bf16=False, log_every=1),
        show_progress=False,
    )


# ---- strategies -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source,extra",
    [
        ("bm25", {}),
        ("context", {}),
        ("dense", {"dense_dim": 8}),
        ("model", {}),
        ("mixed", {"mix": ["bm25", "context", "dense:8"]}),
    ],
)
def test_no_relevant_passage_is_ever_a_negative(tiny_beir, tiny_model_dir, tmp_path, source, extra):
    dataset = load_dataset(str(tiny_beir))
    qids = sorted(dataset.positives("train"))
    if source == "model":
        extra = {"model": str(tiny_model_dir)}
    depth = 40 if source in ("dense", "model") else 10  # 40: the dense miners rank the whole corpus
    config = NegativesConfig(source=source, pool_depth=depth, miner_steps=2, **extra)
    ctx = tiny_context(tmp_path, tiny_model_dir)
    prepare_miners(dataset, qids, config, ctx)
    result = mine_negatives(dataset, qids, config, ctx)
    relevant = dataset.relevant_sets()
    assert set(result.pool) == set(qids)
    assert sum(map(len, result.pool.values())) > 0
    for qid, cands in result.pool.items():
        assert len(cands) <= depth
        assert not {c.passage_id for c in cands} & relevant[qid], qid
        assert len({c.passage_id for c in cands}) == len(cands)
    if depth == 40:  # every relevant passage was ranked, and removed
        assert result.removed["qrels"] == sum(len(relevant[q]) for q in qids)
        assert all(len(cands) == 40 - len(relevant[q]) for q, cands in result.pool.items())


def test_mining_gives_its_freed_memory_back(tiny_beir, monkeypatch):
    from densepass.negatives import mine as mine_module

    calls = []
    monkeypatch.setattr(mine_module, "release_freed_memory", lambda: calls.append(1) or True)
    dataset = load_dataset(str(tiny_beir))
    result = mine_negatives(dataset, sorted(dataset.positives("train")), NegativesConfig(source="bm25", pool_depth=3))
    assert calls == [1] and any(result.pool.values())


def test_bm25_drops_answer_passages_and_positives():
    dataset = small_dataset()
    config = NegativesConfig(source="bm25", pool_depth=5)
    result = mine_negatives(dataset, ["q0"], config, MiningContext(show_progress=False))
    assert result.pool["q0"] == []  # BM25 finds p0 (positive), p1 and p5 (contain the answer "with effects")
    assert result.removed == {"qrels": 1, "answers": 2}
    config = NegativesConfig(source="bm25", pool_depth=5, filters=[])
    result = mine_negatives(dataset, ["q0"], config, MiningContext(show_progress=False))
    assert sorted(c.passage_id for c in result.pool["q0"]) == ["p1", "p5"] and result.removed == {"qrels": 1}


def test_context_negatives_share_the_document_or_are_a_half():
    dataset = small_dataset()
    pool = mine_context_negatives(dataset, ["q0", "q1", "q2"], depth=5, seed=1)
    assert [c.passage_id for c in pool["q0"]] == ["p1", "p2"]  # nearest in the document first
    # single-passage doc with an answer: the half without "delta"
    assert split_in_half("alpha beta gamma delta") == ("alpha beta", "gamma delta")
    assert [c.passage_id for c in pool["q1"]] == [half_id("p3", 0)]
    # no answers: a seeded random half, the same for the same seed
    (half,) = pool["q2"]
    assert half.passage_id in (half_id("p4", 0), half_id("p4", 1))
    assert mine_context_negatives(dataset, ["q2"], 5, seed=1)["q2"] == [half]


def test_context_negatives_skip_the_nearest_skip_top():
    """negatives.skip_top applies to the context strategy too (it was ignored): its candidates are ranked, nearest in
    the document first; the depth counts what is left, and a lone half is its first candidate."""
    dataset = small_dataset()
    pool = mine_context_negatives(dataset, ["q0", "q1"], depth=1, seed=1, skip_top=1)
    assert [c.passage_id for c in pool["q0"]] == ["p2"] and pool["q1"] == []  # p1 (the nearest) and q1's half skipped
    for skip_top, kept in ((0, ["p1"]), (1, [])):  # (p2 is q0's dev positive: the qrels filter drops it)
        config = NegativesConfig(source="context", pool_depth=5, skip_top=skip_top, filters=["qrels"])
        result = mine_negatives(dataset, ["q0"], config, MiningContext(show_progress=False))
        assert [c.passage_id for c in result.pool["q0"]] == kept


@pytest.mark.skipif(not (SHARED_DATA / "debian-packages").is_dir(), reason="debian-packages not available")
def test_context_negatives_on_debian_packages():
    dataset = load_dataset("debian-packages", SHARED_DATA)
    positives = dataset.positives("train")
    qids = sorted(positives)[:3000]
    result = mine_negatives(
        dataset, qids, NegativesConfig(source="context", pool_depth=20), MiningContext(show_progress=False)
    )
    corpus, relevant = dataset.corpus, dataset.relevant_sets()
    halves = 0
    for qid, cands in result.pool.items():
        docs = {corpus.doc_ids[corpus.position(p)] for p in positives[qid]}
        for c in cands:
            assert c.passage_id not in relevant[qid]
            if "#half" in c.passage_id:
                halves += 1
                base = c.passage_id.split("#half")[0]
                assert base in positives[qid]
            else:
                assert corpus.doc_ids[corpus.position(c.passage_id)] in docs
    assert halves > 0 and sum(map(len, result.pool.values())) > halves


def test_coarse_miner_has_the_requested_dimension(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.models.biencoder import BiEncoder
    from densepass.models.encode import encode_texts
    from densepass.training.dense_miners import train_miner

    dataset = load_dataset(str(tiny_beir))
    ctx = tiny_context(tmp_path, tiny_model_dir)
    model = train_miner(
        dataset,
        sorted(dataset.positives("train")),
        25,
        ctx.train_config,
        tmp_path / "coarse",
        torch_cpu(),
        str(tiny_model_dir),
        ctx.architecture,
    )
    emb = encode_texts(model, ["audio editor", "kernel driver"], "query", device=torch_cpu(), show_progress=False)
    assert model.dim == 25 and emb.shape == (2, 25)
    (saved,) = (tmp_path / "coarse").glob("miner-25d-*/model")
    assert BiEncoder.from_pretrained(str(saved)).dim == 25


def test_a_dense_miner_is_reused_only_for_the_same_settings(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.training.dense_miners import prepare_miners

    dataset = load_dataset(str(tiny_beir))
    qids = sorted(dataset.positives("train"))
    trained = []
    for steps in (2, 2, 3):  # the same miner twice, then another number of steps
        ctx = tiny_context(tmp_path, tiny_model_dir)
        prepare_miners(dataset, qids, NegativesConfig(source="dense", dense_dim=8, miner_steps=steps), ctx)
        trained.append(sorted(p.name for p in (tmp_path / "miners").glob("miner-8d-*")))
    assert len(trained[0]) == 1 and trained[1] == trained[0]
    assert len(trained[2]) == 2


def test_a_dense_miner_is_trained_again_when_the_passages_or_judgements_change(tiny_beir, tiny_model_dir, tmp_path):
    """The miner's key named the positives by id only: rewriting every passage (or another split's judgements,
    which set the training masks) reused the miner trained on the old ones (``densepass mine`` keeps miners)."""
    import json

    from densepass.training.dense_miners import prepare_miners

    def miners() -> list[str]:
        dataset = load_dataset(str(tiny_beir))
        ctx = tiny_context(tmp_path, tiny_model_dir)
        prepare_miners(dataset, sorted(dataset.positives("train")), NegativesConfig(source="dense", dense_dim=8,
                       miner_steps=2), ctx)  # fmt: skip
        return sorted(p.name for p in (tmp_path / "miners").glob("miner-8d-*"))

    first = miners()
    corpus = tiny_beir / "corpus.jsonl"
    records = [json.loads(line) for line in corpus.read_text().splitlines()]
    corpus.write_text("".join(json.dumps({**r, "text": "other words " + r["text"]}) + "\n" for r in records))
    second = miners()
    assert len(first) == 1 and len(second) == 2
    (dev,) = tiny_beir.glob("qrels/dev.tsv")
    dev.write_text(dev.read_text() + "q30\tp3\t1\n")
    assert len(miners()) == 3


def test_dense_mining_without_its_miner_is_a_one_line_error(tiny_beir):
    dataset = load_dataset(str(tiny_beir))
    config = NegativesConfig(source="mixed", mix=["bm25", "dense:25"])
    with pytest.raises(ConfigError, match="needs a trained 25-d miner"):
        mine_negatives(dataset, ["q0"], config, MiningContext(show_progress=False))


def torch_cpu():
    import torch

    return torch.device("cpu")


def test_mixed_pool_round_robin_without_repeats():
    a = {"q": [Candidate("p1", "a", 3.0), Candidate("p2", "a", 2.0), Candidate("p3", "a", 1.0)]}
    b = {"q": [Candidate("p2", "b", 9.0), Candidate("p4", "b", 8.0)], "r": [Candidate("p5", "b", 1.0)]}
    mixed = mix_pools([a, b], depth=4)
    assert [(c.passage_id, c.source) for c in mixed["q"]] == [("p1", "a"), ("p2", "b"), ("p4", "b"), ("p3", "a")]
    assert [c.passage_id for c in mixed["r"]] == ["p5"]


# ---- filters ----------------------------------------------------------------------------------


def _pool(ids: list[str]) -> list[Candidate]:
    return [Candidate(p, "test", float(-i)) for i, p in enumerate(ids)]


def _check(filter_, pool, expected_removed):
    out, removed = apply_filters(pool, [filter_])
    gone = {(q, c.passage_id) for q, cands in pool.items() for c in cands} - {
        (q, c.passage_id) for q, cands in out.items() for c in cands
    }
    assert gone == expected_removed
    assert removed == {filter_.name: len(expected_removed)}
    assert sum(map(len, pool.values())) - sum(map(len, out.values())) == len(expected_removed)


def test_each_filter_removes_exactly_what_it_reports():
    dataset = small_dataset()
    everything = ["p0", "p1", "p2", "p3", "p4", "p5", half_id("p3", 1)]
    pool = {"q0": _pool(everything), "q1": _pool(everything), "q3": _pool(everything)}
    _check(QrelsFilter(dataset), pool, {("q0", "p0"), ("q0", "p2"), ("q1", "p3"), ("q3", "p1")})
    _check(AnswerFilter(dataset), pool, {("q0", "p1"), ("q0", "p5"), ("q1", "p3"), ("q1", half_id("p3", 1))})
    # q0 and q3 have the same text: each other's positives go; p5 has p1's content, q3's positive
    _check(
        DuplicateFilter(dataset, "train"),
        pool,
        {("q0", "p1"), ("q3", "p0"), ("q3", "p1"), ("q3", "p5"), ("q0", "p0"), ("q1", "p3")},
    )


def test_duplicates_filter_matches_query_texts_only_up_to_case_and_spaces():
    """The filter grouped queries by their answer-normalised text (punctuation and articles gone): "C++ compiler" and
    "C compiler" lost each other's positive, the hardest legitimate negatives, and queries with no words left ("the",
    "?") all shared theirs."""
    corpus = Corpus(
        [f"p{i}" for i in range(7)], [""] * 7, [f"passage {i}" for i in range(7)], [f"d{i}" for i in range(7)]
    )
    queries = {"a": "C++ compiler", "b": "C compiler", "c": " c  COMPILER ", "d": "the", "e": "?", "f": "", "g": " "}
    qrels = {"train": {q: {f"p{i}": 1} for i, q in enumerate(queries)}}
    with pytest.warns(DataWarning, match="2 of its 7 queries have an empty text"):
        dataset = RetrievalDataset("d", corpus, queries, qrels)
    everything = [f"p{i}" for i in range(7)]
    pool = {q: _pool(everything) for q in queries}
    own = {(q, f"p{i}") for i, q in enumerate(queries)}  # each query's positive: its content, dropped
    _check(DuplicateFilter(dataset, "train"), pool, own | {("b", "p2"), ("c", "p1")})  # only b and c are one text


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["p0", "p1", "p2", "p3", "p4", "p5"]), max_size=6, unique=True), st.floats(-2, 6))
def test_cross_encoder_filter_drops_candidates_above_the_threshold(ids, threshold):
    dataset = small_dataset()

    def scorer(query: str, passages: list[str]) -> list[float]:  # a tiny fake: shared words
        return [float(len(set(query.lower().split()) & set(p.lower().split()))) for p in passages]

    pool = {"q0": _pool(ids)}
    overlap = {p: len({"audio", "editor"} & set(dataset.corpus.texts[int(p[1])].split())) for p in ids}
    _check(CrossEncoderFilter(dataset, scorer, threshold), pool, {("q0", p) for p in ids if overlap[p] > threshold})


def test_unknown_filter_and_missing_cross_encoder_are_config_errors():
    dataset = small_dataset()
    with pytest.raises(ConfigError, match="unknown negatives filter"):
        mine_negatives(dataset, ["q0"], NegativesConfig(source="context", filters=["qrel"]))
    with pytest.raises(ConfigError, match="needs a cross-encoder"):
        mine_negatives(dataset, ["q0"], NegativesConfig(source="context", filters=["cross-encoder"]))
    with pytest.raises(ConfigError, match="needs negatives.model"):
        mine_negatives(dataset, ["q0"], NegativesConfig(source="model"))


# ---- sampling ---------------------------------------------------------------------------------


def test_sampler_draws_h_distinct_negatives_deterministically():
    pool = np.arange(100, 200)
    draws = [draw_negatives(pool, 2, np.random.default_rng([13, e, s]), 1000) for e in range(3) for s in range(20)]
    assert all(len(set(d)) == 2 and set(d) <= set(pool.tolist()) for d in draws)
    again = [draw_negatives(pool, 2, np.random.default_rng([13, e, s]), 1000) for e in range(3) for s in range(20)]
    assert draws == again
    assert len({tuple(d) for d in draws}) > 50  # different (epoch, step) seeds draw different negatives
    assert len(draw_negatives(np.array([7]), 3, np.random.default_rng(0), 1000)) == 3  # small pool: repeats
    assert draw_negatives(np.array([], dtype=np.int64), 2, np.random.default_rng(0), 5) != []


def test_training_data_samples_from_the_mined_pool_and_shares_negatives():
    dataset = small_dataset()
    pool = {"q0": ["p1", "p2", "p3", "p4"], "q1": [half_id("p3", 0), "p0", "p3"]}
    data = TrainingData(dataset, "train", "[SEP]", pool, 2, query_ids=["q0", "q1"])
    rows = [data.negative_rows[0].tolist(), data.negative_rows[1].tolist()]
    assert rows[0] == [1, 3, 4]  # p2 is q0's dev positive: dropped
    assert len(rows[1]) == 2 and rows[1][1] == 0 and data.passage_inputs[rows[1][0]] == "B [SEP] alpha beta"
    first = data.collate([0, 1], seed=(13, 0, 5))
    assert first.passage_texts == data.collate([0, 1], seed=(13, 0, 5)).passage_texts
    negs = first.passage_texts[2:]
    assert len(negs) == 4 and len(set(negs[:2])) == 2 and len(set(negs[2:])) == 2
    # every query sees every hard negative unless it is relevant to it or repeats an earlier column
    assert first.mask.shape == (2, 6)
    texts = first.passage_texts
    for j in range(2, 6):
        relevant_to_q0 = texts[j] in {data.passage_inputs[dataset.corpus.position(p)] for p in ("p0", "p2")}
        assert bool(first.mask[0, j]) == (relevant_to_q0 or texts[j] in texts[:j])


# ---- fusion -----------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0, 3), min_size=1, max_size=4), st.integers(0, 2**31 - 1))
def test_embedding_fusion_is_the_weighted_sum_of_dot_products(weights, seed):
    rng = np.random.default_rng(seed)
    dims = rng.integers(1, 6, size=len(weights))
    queries = [rng.normal(size=(3, d)) for d in dims]
    passages = [rng.normal(size=(5, d)) for d in dims]
    fused = fuse_embeddings(queries, weights) @ fuse_embeddings(passages, weights).T
    reference = sum(w * q @ p.T for w, q, p in zip(weights, queries, passages))
    np.testing.assert_allclose(fused, reference, rtol=1e-4, atol=1e-4)


def test_embedding_fusion_hand_computed():
    q = fuse_embeddings([np.array([[1.0, 0.0]]), np.array([[2.0]])], [4.0, 0.25])
    np.testing.assert_allclose(q, [[2.0, 0.0, 1.0]])
    p = fuse_embeddings([np.array([[3.0, 1.0]]), np.array([[5.0]])], [4.0, 0.25])
    assert float((q @ p.T)[0, 0]) == pytest.approx(4 * 3 + 0.25 * 10)
    with pytest.raises(ConfigError):
        fuse_embeddings([np.ones((2, 2))], [-1.0])


def test_weight_search_finds_the_grid_optimum():
    weights, best, evaluations = tune_weights(lambda w: -((w[0] - 2) ** 2) - (w[1] - 0.5) ** 2, 2)
    assert weights == (2.0, 0.5) and best == 0.0 and evaluations <= 3 + 2 * 2 * 4


def test_reciprocal_rank_fusion_hand_computed():
    a = {"q": {"d1": 0.9, "d2": 0.5, "d3": 0.1}}
    b = {"q": {"d3": 7.0, "d1": 3.0}}
    fused = reciprocal_rank_fusion([a, b], k=60)["q"]
    expected = {"d1": 1 / 61 + 1 / 62, "d2": 1 / 62, "d3": 1 / 63 + 1 / 61}
    assert fused.keys() == expected.keys()
    for d, value in expected.items():
        assert fused[d] == pytest.approx(value)
    assert sorted(fused, key=fused.get, reverse=True) == ["d1", "d3", "d2"]


def test_reciprocal_rank_fusion_ranks_tied_scores_in_each_runs_own_order():
    """A run read from a TREC file keeps its tied scores in its rank order; RRF ranks them so, by hand: the
    first of 60 tied passages of both runs is first (ranx's unstable sort put the 32nd first)."""
    tied = {"q": {f"p{i}": 1.0 for i in range(60)}}
    other = {"q": {f"p{i}": 60.0 - i for i in range(60)}}  # the same order, strict
    fused = reciprocal_rank_fusion([tied, tied], k=60)["q"]
    assert fused == pytest.approx({f"p{i}": 2 / (61 + i) for i in range(60)})
    assert fused == pytest.approx(reciprocal_rank_fusion([other, other], k=60)["q"])


def naive_linear_fusion(runs, weights):
    """Per query: each run's scores min-max normalised over its own passages (one passage: 0), weighted, summed."""
    fused = {}
    for q in set().union(*runs):
        scores = {}
        for run, weight in zip(runs, weights):
            own = run.get(q, {})
            if not own:
                continue
            low, high = min(own.values()), max(own.values())
            for d, s in own.items():
                scores[d] = scores.get(d, 0.0) + weight * ((s - low) / (high - low) if high > low else 0.0)
        fused[q] = scores
    return fused


@settings(max_examples=30, deadline=None)
@given(
    scores=st.lists(
        st.dictionaries(
            # ids of several lengths, the names of ranx's empty-ranking placeholders among them
            st.sampled_from(["d0", "d1", "-", "__none__", "a-longer-passage-id-" * 3, "é"]),
            st.integers(-5000, 5000).map(lambda x: x / 100),  # retrieval scores, not subnormal gaps
            max_size=6,
        ),
        min_size=4,
        max_size=4,
    ),
    weight=st.floats(0.05, 0.95),
)
def test_linear_fusion_matches_a_naive_min_max_weighted_sum(scores, weight):
    a = {"q1": scores[0], "q2": scores[1]}
    b = {"q1": scores[2], "q2": scores[3]}
    a, b = ({q: r for q, r in run.items() if r} for run in (a, b))  # a query a run does not answer is absent
    if not set(a) | set(b):
        return
    fused = linear_fusion([a, b], [weight, 1 - weight])
    expected = naive_linear_fusion([a, b], [weight, 1 - weight])
    assert fused.keys() == expected.keys()
    for q in expected:
        assert fused[q].keys() == expected[q].keys()
        for d, value in expected[q].items():
            assert fused[q][d] == pytest.approx(value, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    lists=st.lists(
        st.dictionaries(st.integers(0, 7), st.sampled_from([-1.5, 0.0, 0.25, 2.0, 7.0]), max_size=5),
        min_size=2,
        max_size=2,
    ),
    weight=st.floats(0.05, 0.95),
)
def test_the_hybrid_index_fuses_linearly_as_the_evaluation_does(lists, weight):
    """``HybridIndex``'s linear fusion (at search time) scores every passage as ``linear_fusion`` (ranx, used to tune
    the weight) does, tied and single-entry lists included: an all-equal list adds 0, not 1."""
    from densepass.index.hybrid import linear_scores

    if not any(lists):
        return
    fused = linear_scores([(list(d), list(d.values())) for d in lists], [weight, 1 - weight])
    runs = [{"q": {str(row): s for row, s in d.items()}} if d else {} for d in lists]
    expected = naive_linear_fusion(runs, [weight, 1 - weight])["q"]
    assert {str(row): s for row, s in fused.items()} == pytest.approx(expected, abs=1e-9)
    if all(runs):
        ranx = linear_fusion(runs, [weight, 1 - weight])["q"]
        assert {str(row): s for row, s in fused.items()} == pytest.approx(ranx, abs=1e-6)


def test_linear_fusion_bad_weights_are_one_line_errors():
    run = {"q": {"d": 1.0}}
    for weights in ([1.0], [0.0, 0.0], [-0.5, 1.5]):
        with pytest.raises(ConfigError, match="linear fusion needs one weight"):
            linear_fusion([run, run], weights)


# ---- the hard-negatives file, CLI and ensemble ------------------------------------------------


def test_pool_file_round_trip_and_bad_input(tmp_path):
    dataset = small_dataset()
    pool = {"q0": [Candidate("p1", "bm25", 3.5), Candidate(half_id("p3", 0), "context", 0.0)], "q1": []}
    path = tmp_path / "neg.jsonl"
    save_pool(pool, path)
    assert load_pool(path, dataset) == pool
    assert passage_ids(pool) == {"q0": ["p1", "p3#half0"], "q1": []}
    with pytest.raises(DataError, match="not found"):
        load_pool(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(path.read_text() + "{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:3: not valid JSON"):
        load_pool(bad)
    bad.write_text(json.dumps({"query_id": "q9", "negatives": []}) + "\n")
    with pytest.raises(DataError, match="unknown query id 'q9'"):
        load_pool(bad, dataset)
    bad.write_text(json.dumps({"query_id": "q0", "negatives": [["p99", "bm25", 1.0]]}) + "\n")
    with pytest.raises(DataError, match="unknown passage id 'p99'"):
        load_pool(bad, dataset)
    bad.write_text(json.dumps({"query_id": "q0", "negatives": [["p1", 1.0]]}) + "\n")
    with pytest.raises(DataError, match=r"\[passage_id, source, score\]"):
        load_pool(bad, dataset)


def test_mine_cli_writes_a_file_that_training_reads(tiny_beir, tmp_path, capsys):
    from densepass.cli import main

    out = tmp_path / "neg.jsonl"
    assert (
        main(
            [
                "mine",
                str(tiny_beir),
                "--strategy",
                "bm25",
                "--depth",
                "5",
                "--filters",
                "qrels",
                "duplicates",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "removed by qrels" in printed and "source bm25" in printed
    dataset = load_dataset(str(tiny_beir))
    pool = load_pool(out, dataset)
    assert set(pool) == set(dataset.positives("train")) and max(map(len, pool.values())) == 5
    config = NegativesConfig(source="file", file=str(out), pool_depth=3, filters=[])
    again = mine_negatives(dataset, sorted(pool), config, MiningContext(show_progress=False))
    assert passage_ids(again.pool) == {q: [c.passage_id for c in cands[:3]] for q, cands in pool.items()}
    others = sorted(dataset.positives("dev"))  # a file mined for the train split covers none of these
    with pytest.raises(ConfigError, match=rf"neg\.jsonl has negatives for none of the {len(others)} queries trained"):
        mine_negatives(dataset, others, config, MiningContext(show_progress=False))
    assert main(["mine", str(tiny_beir), "--strategy", "file", "--output", str(out)]) == 2
    assert "needs negatives.file" in capsys.readouterr().err
    assert main(["mine", str(tiny_beir), "--output", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    for strategy in ("bm25", "context"):  # no model encodes: a precision would be ignored
        assert main(["mine", str(tiny_beir), "--strategy", strategy, "--precision", "bf16", "--output", str(out)]) == 2
        message = f"--precision sets how a model encodes; the {strategy} strategy mines with no model"
        assert capsys.readouterr().err.strip() == f"densepass: error: {message}"
    # every candidate skipped: a file of empty lists, which densepass refuses to read, is not written
    empty = tmp_path / "empty.jsonl"
    skip_all = ["--depth", "2", "--set", "negatives.skip_top=100"]
    assert main(["mine", str(tiny_beir), *skip_all, "--output", str(empty)]) == 2
    assert "no negative is left for any of the " in capsys.readouterr().err and not empty.exists()


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--strategy", "bm25", "--model", "m"], "--model"),
        (["--strategy", "mixed", "--mix", "bm25", "context", "--model", "m"], "--model"),
        (["--strategy", "bm25", "--mix", "bm25", "context"], "--mix"),
        (["--strategy", "context", "--file", "f.jsonl"], "--file"),
        (["--strategy", "model", "--model", "m", "--dense-dim", "25"], "--dense-dim"),
        (["--strategy", "mixed", "--mix", "bm25", "dense:25", "--dense-dim", "64"], "--dense-dim"),
        (["--strategy", "bm25", "--miner-steps", "3"], "--miner-steps"),
        (["--strategy", "bm25", "--cross-encoder", "ce"], "--cross-encoder"),
        (["--filters", "relative-margin", "--cross-encoder-threshold", "0.5"], "--cross-encoder-threshold"),
        (["--set", "negatives.source=context", "--depth", "3", "--model", "m"], "--model"),
    ],
)
def test_mine_refuses_options_its_strategy_does_not_use(tiny_beir, tmp_path, capsys, args, flag):
    """An option of another strategy or filter was ignored in silence; it is one line before any work."""
    from densepass.cli import main

    out = tmp_path / "neg.jsonl"
    assert main(["mine", str(tiny_beir), *args, "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"densepass: error: {flag}: an option of ") and "unused by this mining" in err
    assert not out.exists()


def test_mine_takes_the_options_its_strategy_uses(tiny_beir, tiny_model_dir, tmp_path):
    """The same check lets through a mixed pool's model, a dense miner's steps and a bi-encoder teacher."""
    from densepass.cli import build_parser, check_mine_options
    from densepass.config import load_config

    parser = build_parser()
    for args, overrides in [
        (["--mix", "bm25", "model", "--model", "m"], ["negatives.source=mixed", 'negatives.mix=["bm25","model"]']),
        (["--dense-dim", "25", "--miner-steps", "2"], ["negatives.source=mixed", 'negatives.mix=["dense","bm25"]']),
        (["--miner-steps", "2"], ["negatives.source=mixed", 'negatives.mix=["dense:25"]']),
        (["--model", "m"], ['negatives.filters=["relative-margin"]', "negatives.relative_teacher=bi-encoder"]),
        (["--cross-encoder", "ce"], ['negatives.filters=["relative-margin"]']),
        (["--file", "f.jsonl"], ["negatives.source=mixed", 'negatives.mix=["bm25","file"]']),  # a bare file entry
    ]:
        parsed = parser.parse_args(["mine", str(tiny_beir), "--output", str(tmp_path / "o.jsonl"), *args])
        check_mine_options(parsed, load_config(None, overrides).negatives)


def test_ensemble_of_two_models(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.models.biencoder import BiEncoder, BiEncoderConfig
    from densepass.pipelines.ensemble import EnsembleSettings, evaluate_ensemble

    paths = []
    for dim in (8, 16):
        path = tmp_path / f"m{dim}"
        BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(projection_dim=dim)).save(path)
        paths.append(str(path))
    dataset = load_dataset(str(tiny_beir))
    options = dict(metrics=("mrr@10", "recall@5"), depth=10, grid=(0.0, 0.5, 1.0), device=torch_cpu())
    in_sample = evaluate_ensemble(dataset, paths, EnsembleSettings(folds=1, **options), labels=["a", "b"])
    results = in_sample["results"]
    assert set(results) == {"a", "b", "ensemble (embedding)", "ensemble (rank)"}
    weights = tuple(in_sample["weights"].values())
    best_single = max(results["a"]["mrr@10"], results["b"]["mrr@10"])
    assert results["ensemble (embedding)"]["mrr@10"] >= best_single - 1e-9  # (1,0) and (0,1) are on the grid
    if weights == (1.0, 0.0):
        assert results["ensemble (embedding)"] == results["a"]
    with pytest.raises(ConfigError, match="at least two"):
        evaluate_ensemble(dataset, paths[:1])


def test_the_ensemble_row_is_cross_fitted_each_fold_scored_with_the_weights_tuned_on_the_others(
    tiny_beir, tiny_model_dir, tmp_path
):
    """The reference: each fold's weights are the in-sample weights of the other folds' queries alone, and the
    row is the fused search of each fold's queries with its fold's weights, evaluated over all the queries."""
    import torch

    from densepass.evaluation.fusion import fuse_embeddings
    from densepass.evaluation.metrics import evaluate_run, make_run
    from densepass.models.biencoder import BiEncoder, BiEncoderConfig
    from densepass.models.encode import encode_texts
    from densepass.pipelines.ensemble import EnsembleSettings, evaluate_ensemble

    paths = []
    for seed, dim in ((1, 8), (2, 16)):
        torch.manual_seed(seed)
        path = tmp_path / f"m{dim}"
        BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(projection_dim=dim)).save(path)
        paths.append(str(path))
    dataset = load_dataset(str(tiny_beir))
    options = dict(metrics=("mrr@10", "recall@5"), depth=10, grid=(0.0, 0.5, 1.0, 2.0), device=torch_cpu())
    settings = EnsembleSettings(folds=3, seed=5, methods=["embedding"], **options)
    out = evaluate_ensemble(dataset, paths, settings, labels=["a", "b"])
    qrels = dataset.sample("dev", None, 5)
    qids = sorted(qrels)
    fold_of = np.empty(len(qids), dtype=np.int64)
    fold_of[np.random.default_rng(5).permutation(len(qids))] = np.arange(len(qids)) % 3
    models = [BiEncoder.from_pretrained(p) for p in paths]
    queries = [encode_texts(m, [dataset.queries[q] for q in qids], "query", device=torch_cpu()) for m in models]
    texts = dataset.corpus.passage_inputs("[SEP]")
    passages = [encode_texts(m, texts, "passage", device=torch_cpu()) for m in models]
    run = {}
    for fold in range(3):
        others = {q: qrels[q] for q, f in zip(qids, fold_of) if f != fold}
        alone = evaluate_ensemble(dataset, paths, EnsembleSettings(folds=1, **options), ["a", "b"], others)
        assert out["fold_weights"][fold] == alone["weights"]
        w = tuple(alone["weights"].values())
        held = np.flatnonzero(fold_of == fold)
        q = fuse_embeddings([e[held] for e in queries], w)
        scores = q @ fuse_embeddings(passages, w).T
        rows = np.argsort(-scores, axis=1, kind="stable")[:, :10]
        run.update(make_run([qids[i] for i in held], dataset.corpus.ids, np.take_along_axis(scores, rows, 1), rows))
    expected = evaluate_run(qrels, run, ["mrr@10", "recall@5"])
    assert out["results"]["ensemble (embedding)"] == pytest.approx(expected, abs=1e-6)
    in_sample = evaluate_ensemble(dataset, paths, EnsembleSettings(folds=1, seed=5, **options), ["a", "b"])
    assert out["weights"] == in_sample["weights"]  # the weights for other queries: tuned on all of these
    with pytest.raises(ConfigError, match="folds must be >= 1"):
        EnsembleSettings(folds=0)


# ---- ANCE-style refresh -----------------------------------------------------------------------


def test_replaced_pool_serves_batches_from_its_first_step_on():
    dataset = small_dataset()
    data = TrainingData(dataset, "train", "[SEP]", {"q0": ["p3"], "q1": ["p4"]}, 1, query_ids=["q0", "q1"])
    data.replace_negatives({"q0": ["p1"], "q1": ["p0"]}, from_step=4)
    old, new = {"alpha", "one"}, {"video", "audio"}

    def first_words(step):
        texts = data.collate([0, 1], seed=(13, 0, step or 0), step=step).passage_texts[2:]
        return {t.split(" [SEP] ")[1].split()[0] for t in texts}

    assert [first_words(s) for s in (0, 3)] == [old, old]
    assert [first_words(s) for s in (4, 9)] == [new, new]
    assert first_words(None) == old  # no step: the pool given at construction
    with pytest.raises(ConfigError, match="nothing to refresh"):
        TrainingData(dataset, "train", "[SEP]", query_ids=["q0"]).replace_negatives({"q0": ["p1"]}, 1)


def test_a_short_re_mined_pool_is_warned_as_the_first_pool_is():
    import warnings

    from densepass.errors import DataWarning

    dataset = small_dataset()
    data = TrainingData(dataset, "train", "[SEP]", {"q0": ["p3", "p1"], "q1": ["p4", "p0"]}, 2, query_ids=["q0", "q1"])
    with pytest.warns(DataWarning, match="1 of 2 training queries .* in the pool re-mined for step 4 .* holds 1"):
        data.replace_negatives({"q0": ["p1"], "q1": ["p0", "p4"]}, from_step=4)  # (p3 is q1's positive)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data.replace_negatives({"q0": ["p1", "p4"], "q1": ["p0", "p4"]}, from_step=8)  # full pools: no warning


def test_refresh_during_training_is_saved_filtered_and_resumable(tiny_beir, tiny_model_dir, tmp_path):
    import shutil

    from densepass.config import load_config
    from densepass.pipelines.experiment import run_experiment

    def config(root, *extra):
        return load_config(
            None,
            [
                f"data.name={tiny_beir}",
                f"model.name_or_path={tiny_model_dir}",
                f"output_dir={root}",
                "name=r",
                "train.batch_size=8",
                "train.epochs=2",
                "train.checkpoint_every=2",
                "train.keep_checkpoints=10",
                "negatives.source=bm25",
                "negatives.pool_depth=5",
                "negatives.per_query=1",
                "negatives.refresh_every=2",
                "eval.baselines=[]",
                "eval.metrics=[mrr@10]",
                "eval.depth=10",
                "model.passage_max_length=32",
                *extra,
            ],
        )

    first = run_experiment(config(tmp_path / "a"))["fine-tuned"]
    work = tmp_path / "a" / "r" / "negatives"
    # 6 steps: refreshed after steps 2 and 4, not after the last (no batch would use it)
    assert sorted(p.name for p in work.glob("refresh-step-*.jsonl")) == ["refresh-step-2.jsonl", "refresh-step-4.jsonl"]
    dataset = load_dataset(str(tiny_beir))
    positives = dataset.relevant_sets()
    for path in work.glob("refresh-step-*.jsonl"):
        pool = load_pool(path, dataset)
        assert all(len(c) == 5 and all(x.source == "model" for x in c) for c in pool.values())
        assert not any(c.passage_id in positives[q] for q, cands in pool.items() for c in cands)
    log = [json.loads(line) for line in (work / "refresh_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4] and log[0]["removed"]["qrels"] >= 0

    # Interrupted after step 2: the pool of step 4 was mined by a model that is trained again, so it goes;
    # the resumed run re-mines it and ends with the same model as the uninterrupted one.
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    run = tmp_path / "b" / "r"
    shutil.rmtree(run / "model")
    for step in (4, 6):
        shutil.rmtree(run / "checkpoints" / f"step-{step}", ignore_errors=True)
    (run / "negatives" / "refresh-step-4.jsonl").write_text('{"query_id": "q0", "negatives": []}\n')
    resumed = run_experiment(config(tmp_path / "b"))["fine-tuned"]
    assert resumed == pytest.approx(first)
    assert (run / "negatives" / "refresh-step-4.jsonl").read_text() == (work / "refresh-step-4.jsonl").read_text()
    log = [json.loads(line) for line in (run / "negatives" / "refresh_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4]  # the record of the dropped pool went with it

    with pytest.raises(ConfigError, match="refresh_every needs hard negatives"):
        run_experiment(config(tmp_path / "c", "negatives.source=none", "negatives.per_query=0"))
    with pytest.raises(ConfigError, match="refresh_every: must be >= 1"):
        run_experiment(config(tmp_path / "d", "negatives.refresh_every=0"))
    # One epoch of 3 steps: a refresh after step 2 would serve from step 4 on, so none is made, and the run is the
    # run without refreshes (the re-encoding of the corpus that no batch draws from is not paid for).
    once = run_experiment(config(tmp_path / "e", "train.epochs=1"))["fine-tuned"]
    assert not list((tmp_path / "e" / "r").glob("negatives/refresh-step-*"))
    without = run_experiment(config(tmp_path / "f", "train.epochs=1", "negatives.refresh_every=null"))
    assert once == without["fine-tuned"]


@pytest.fixture(scope="module")
def sigmoid_config_cross_encoder(tiny_model_dir, tmp_path_factory):
    """A one-logit cross-encoder saved as most hub cross-encoders are, without densepass's note of the identity
    activation, so sentence-transformers' ``predict`` puts its logits through a sigmoid; its head is rescaled so
    that q0's candidates get logits on both sides of 0 (-2 to 2). Returns its path and q0's texts."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from densepass.data.keys import passage_input
    from densepass.models.cross_encoder import PASSAGE_SEP, CrossEncoder

    path = tmp_path_factory.mktemp("sigmoid-ce") / "model"
    CrossEncoder.new(str(tiny_model_dir), seed=7, device=torch.device("cpu"), precision="fp32").save(path)
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    del model.config.sentence_transformers
    dataset = small_dataset()
    passages = [passage_input(dataset.corpus, p, PASSAGE_SEP) for p in dataset.corpus.ids]  # as cross-encoders read
    tokens = AutoTokenizer.from_pretrained(str(path))(
        [dataset.queries["q0"]] * len(passages), passages, truncation=True, padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        z = model(**tokens).logits.squeeze(-1) - model.classifier.bias
        scale = 4.0 / float(z.max() - z.min())
        model.classifier.weight.mul_(scale)
        model.classifier.bias.fill_(-scale * float(z.max() + z.min()) / 2)
    model.save_pretrained(path)
    return path, dataset.queries["q0"], passages


def _float64_logits(path, query: str, passages: list[str]) -> np.ndarray:
    """The reference: transformers' sequence classifier in float64, one pair at a time."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(path)).double().eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        return np.array([float(model(**tokenizer(query, p, return_tensors="pt")).logits) for p in passages])


def teacher_filters(dataset, path) -> list:
    """The cross-encoder filter (threshold: logit 0) and the relative-margin filter (0.95), both of the model at
    ``path``."""
    from densepass.negatives.filters import build_filters

    return build_filters(
        ["cross-encoder", "relative-margin"],
        dataset,
        cross_encoder=str(path),
        threshold=0.0,
        relative_margin=0.95,
        relative_teacher=str(path),
    )


def test_the_cross_encoder_filter_thresholds_logits_whatever_activation_the_model_names(sigmoid_config_cross_encoder):
    from scipy.special import expit
    from sentence_transformers import CrossEncoder as STCrossEncoder

    from densepass.negatives.filters import RelativeMarginFilter, relative_margin_keep

    path, query, passages = sigmoid_config_cross_encoder
    logits = _float64_logits(path, query, passages)
    # the premise: sentence-transformers scores this model through a sigmoid (every candidate above 0.0)
    st_scores = STCrossEncoder(str(path), device="cpu").predict([(query, p) for p in passages])
    np.testing.assert_allclose(st_scores, expit(logits), atol=1e-4)
    dataset = small_dataset()
    ids = dataset.corpus.ids
    low, high = {p for p, x in zip(ids, logits) if x < -0.1}, {p for p, x in zip(ids, logits) if x > 0.1}
    assert low and high and len(low) + len(high) == len(ids), logits  # planted: clear of the threshold
    candidates = [p for p in ids if p != "p0"]  # p0: q0's positive
    [absolute, relative] = teacher_filters(dataset, path)
    assert absolute.keep("q0", _pool(candidates)) == [p in low for p in candidates]
    # the relative-margin teacher: the same logits through a sigmoid, against q0's positive p0
    assert isinstance(relative, RelativeMarginFilter)
    by_id = dict(zip(ids, expit(logits)))
    np.testing.assert_allclose(relative.scorer(query, passages), expit(logits), atol=1e-4)
    expected = relative_margin_keep([by_id[p] for p in candidates], [by_id["p0"]], 0.95)
    assert relative.keep("q0", _pool(candidates)) == expected


def test_teacher_filters_score_every_querys_pairs_together_and_keep_what_one_query_at_a_time_keeps(
    sigmoid_config_cross_encoder, monkeypatch
):
    """``apply_filters`` has a cross-encoder score the pairs of every query in one ``score_pairs`` call (batches of
    similar length across queries) and keeps exactly what each filter's per-query ``keep`` keeps."""
    from densepass.negatives import filters as filters_module
    from densepass.negatives.filters import CrossEncoderScorer

    path = sigmoid_config_cross_encoder[0]
    dataset = small_dataset()
    pool = {
        q: _pool([p for p in dataset.corpus.ids if p not in dataset.relevant_sets().get(q, ())])
        for q in ("q0", "q1", "q2")
    }
    pool["q3"] = []
    built = teacher_filters(dataset, path)
    calls = []
    for f in built:
        assert isinstance(f.scorer, CrossEncoderScorer)
        score_pairs = f.scorer.score_pairs
        monkeypatch.setattr(
            f.scorer, "score_pairs", lambda q, p, score=score_pairs: calls.append(len(q)) or score(q, p)
        )
    monkeypatch.setattr(filters_module, "BATCH_PAIRS", 7)
    for f in built:
        one_at_a_time = {qid: f.keep(qid, cands) for qid, cands in pool.items()}
        calls.clear()
        assert f.keep_all(pool) == one_at_a_time
        assert calls and max(calls) == 7 and len(calls) == -(-sum(calls) // 7)  # chunks of 7 pairs, across queries
    out, removed = apply_filters(pool, built)
    assert set(out) == set(pool) and out["q3"] == []
    assert sum(removed.values()) == sum(map(len, pool.values())) - sum(map(len, out.values()))


def test_a_filters_cross_encoder_reads_passages_as_it_trained_and_a_bi_encoder_as_the_pool_was_mined(
    sigmoid_config_cross_encoder,
):
    """A cross-encoder reads a titled passage as "title text" wherever it meets one (training, reranking, teacher
    scores); the filters give it the same, not the bi-encoder's "title [SEP] text" the pool was mined with (a
    teacher scoring a format it never trained on would denoise by other scores than it distils with). A scorer
    that is not a cross-encoder (a bi-encoder teacher) reads the mining's format."""
    from densepass.data.keys import passage_input
    from densepass.models.cross_encoder import PASSAGE_SEP
    from densepass.negatives.filters import build_filters

    path = sigmoid_config_cross_encoder[0]
    dataset = small_dataset()
    seen = []

    def bi_encoder(query, passages):
        seen.extend(passages)
        return [0.0] * len(passages)

    built = build_filters(["cross-encoder", "relative-margin"], dataset, sep_token="[SEP]", cross_encoder=str(path),
                          relative_teacher=str(path))  # fmt: skip
    for f in built:
        read = []
        score_pairs = f.scorer.model.score_pairs
        f.scorer.model.score_pairs = lambda q, p, score=score_pairs, read=read: read.extend(p) or score(q, p)
        f.keep_all({"q1": _pool(["p0", "p4"])})
        assert read == [passage_input(dataset.corpus, p, PASSAGE_SEP) for p in ("p3", "p0", "p4")][-len(read) :]
        assert read[-1].split() == ["C", "one", "two", "three", "four", "five", "six"]  # no [SEP] inside
    [relative] = build_filters(["relative-margin"], dataset, sep_token="[SEP]", relative_teacher=bi_encoder)
    relative.keep_all({"q1": _pool(["p0"])})
    assert seen == ["B [SEP] alpha beta gamma delta", "A [SEP] audio editor for linux"]  # q1's positive p3, then p0


def test_the_filters_cross_encoder_scores_in_the_precision_asked_for(sigmoid_config_cross_encoder):
    """``negatives.filter_precision``: fp32 by default (a threshold is the same logit everywhere), else as asked."""
    from densepass.negatives.filters import build_filters

    path = sigmoid_config_cross_encoder[0]
    for precision in ("fp32", "bf16"):
        built = build_filters(["cross-encoder", "relative-margin"], small_dataset(), cross_encoder=str(path),
                              relative_teacher=str(path), precision=precision)  # fmt: skip
        assert [f.scorer.model.precision for f in built] == [precision, precision]


def test_both_filters_of_one_cross_encoder_load_it_once(sigmoid_config_cross_encoder, monkeypatch, tmp_path):
    """The cross-encoder and relative-margin filters of the same model share one loaded model (and its score cache),
    each with its own activation: raw logits for the threshold, exponents for the ratio."""
    from densepass.models.cross_encoder import CrossEncoder
    from densepass.negatives.filters import build_filters

    path, query, passages = sigmoid_config_cross_encoder
    loads = []
    load = CrossEncoder.from_pretrained.__func__
    monkeypatch.setattr(
        CrossEncoder, "from_pretrained", classmethod(lambda cls, *a, **k: loads.append(a) or load(cls, *a, **k))
    )
    names = ["cross-encoder", "relative-margin"]
    threshold, relative = build_filters(
        names, small_dataset(), cross_encoder=str(path), relative_teacher=str(path), relative_activation="exp",
        cache_dir=tmp_path,
    )  # fmt: skip
    assert len(loads) == 1
    assert threshold.scorer.model is relative.scorer.model and threshold.scorer.cached is relative.scorer.cached
    np.testing.assert_allclose(relative.scorer(query, passages), np.exp(threshold.scorer(query, passages)), rtol=1e-6)


def test_the_relative_margin_of_a_listwise_teacher_is_a_ratio_of_exponents(sigmoid_config_cross_encoder):
    """``negatives.relative_activation: exp``: a candidate stays only if exp(its logit) < margin x exp(the positive's),
    i.e. its logit is below the positive's + ln(margin), whatever offset the logits share."""
    import math

    from densepass.negatives.filters import build_filters

    path, query, passages = sigmoid_config_cross_encoder
    logits = _float64_logits(path, query, passages)
    dataset = small_dataset()
    candidates = [p for p in dataset.corpus.ids if p != "p0"]
    [relative] = build_filters(["relative-margin"], dataset, relative_teacher=str(path), relative_activation="exp")
    np.testing.assert_allclose(relative.scorer(query, passages), np.exp(logits), rtol=1e-3)  # fp32 logits
    by_id = dict(zip(dataset.corpus.ids, logits))
    expected = [by_id[p] < by_id["p0"] + math.log(0.95) for p in candidates]
    assert relative.keep("q0", _pool(candidates)) == expected


def test_an_empty_pools_random_negatives_leave_out_the_querys_relevant_passages():
    """The fallback for an empty pool draws random passages: never one relevant to the query (by content key), which
    a cross-encoder, masking nothing, would learn as a negative (about 3 draws in 10 on a 10-passage corpus)."""
    keys = np.arange(100, 110)
    rng = np.random.default_rng(0)
    drawn = [r for _ in range(300) for r in draw_negatives(np.array([], dtype=np.int64), 3, rng, 10, keys, {103, 107})]
    assert len(drawn) == 900 and not {3, 7} & set(drawn) and set(drawn) == set(range(10)) - {3, 7}


def test_an_empty_pools_random_negatives_are_distinct_passages():
    """The fallback draws ``h`` distinct passages when the corpus has that many (it drew 4h with replacement, then
    h of those, so one row could come twice in a query's negatives)."""
    for seed in range(300):
        drawn = draw_negatives(np.array([], dtype=np.int64), 4, np.random.default_rng(seed), 6)
        assert len(drawn) == 4 and len(set(drawn)) == 4
