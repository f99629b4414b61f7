"""Adaptive Batch Scheduling: the fast scheduler equals the literal reference, beats random batches,
never batches false negatives together, and the background process delivers each instance once."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SHARED_DATA
from densepass.config import ScheduleConfig, load_config
from densepass.data import load_dataset
from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder
from densepass.scheduling.baselines import clustered_batches, random_batches, sequential_batches
from densepass.scheduling.concurrent import iter_concurrent_batches
from densepass.scheduling.conflicts import build_conflicts
from densepass.scheduling.greedy import neighbour_lists, schedule_batches
from densepass.scheduling.reference import reference_schedule
from densepass.scheduling.similarity import BilinearSimilarity, batch_hardness, bm25_instance_matrices, mean_hardness
from densepass.training.batches import TrainingData
from densepass.training.planner import EpochPlanner, check_schedule


def random_conflicts(rng, n, pairs):
    conflicts = [set() for _ in range(n)]
    for a, b in rng.integers(0, n, size=(pairs, 2)):
        if a != b:
            conflicts[a].add(int(b))
            conflicts[b].add(int(a))
    return [sorted(c) for c in conflicts]


def topic_similarity(n=400, topics=8, dim=16):
    """Instances around a few topic centres (query and positive share one): hard batches exist."""
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(topics, dim))
    labels = rng.integers(0, topics, size=n)
    q = centers[labels] + 0.5 * rng.normal(size=(n, dim))
    p = centers[labels] + 0.5 * rng.normal(size=(n, dim))
    return BilinearSimilarity(q, p)


def conflict_free(batches, conflicts):
    return not any(j in conflicts[i] for b in batches for i in b for j in b)


def covers_once(batches, n):
    flat = [i for b in batches for i in b]
    return sorted(flat) == list(range(n))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(6, 40),
    batch=st.integers(2, 6),
    dim=st.integers(1, 6),
    beam=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 1000),
    sparse=st.booleans(),
)
def test_fast_scheduler_equals_reference(n, batch, dim, beam, seed, sparse):
    """Same batches, in the same order. Entries are small integers, so float64 arithmetic is exact
    in both implementations and the many ties must be broken identically (first position/index)."""
    rng = np.random.default_rng(seed)
    batch = min(batch, n)
    sim = BilinearSimilarity(*random_instances(rng, n, dim, sparse), dtype=torch.float64)
    conflicts = random_conflicts(rng, n, n // 4)
    fast = schedule_batches(sim, batch, conflicts=conflicts, seed=seed, beam_width=beam)
    slow = reference_schedule(sim.dense_matrix(), batch, conflicts=conflicts, seed=seed, beam_width=beam)
    assert fast == slow
    assert covers_once(fast, n)
    S = sim.dense_matrix()
    assert conflict_free(fast, conflicts)
    assert mean_hardness(sim, fast) == pytest.approx(np.mean([batch_hardness(S, b) for b in fast]))


def random_instances(rng, n, dim, sparse):
    """Small-integer Q, P (exact in float64, so ties are many and must be broken identically)."""
    if sparse:  # BM25-like: non-negative, mostly zero
        q = sp.csr_matrix(rng.integers(0, 4, size=(n, 3 * dim)) * (rng.random((n, 3 * dim)) < 0.3))
        p = sp.csr_matrix(rng.integers(0, 4, size=(n, 3 * dim)) * (rng.random((n, 3 * dim)) < 0.3))
        return q, p
    return rng.integers(-3, 4, size=(n, dim)), rng.integers(-3, 4, size=(n, dim))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(6, 40),
    batch=st.integers(2, 6),
    dim=st.integers(1, 6),
    slots=st.integers(1, 5),
    seed=st.integers(0, 1000),
    sparse=st.booleans(),
)
def test_concurrent_scheduler(n, batch, dim, slots, seed, sparse):
    """One slot: the reference greedy, batch for batch. Several: still a partition without conflicts."""
    rng = np.random.default_rng(seed)
    sim = BilinearSimilarity(*random_instances(rng, n, dim, sparse), dtype=torch.float64)
    batch = min(batch, n)
    conflicts = random_conflicts(rng, n, n // 4)
    one = list(iter_concurrent_batches(sim, batch, 1, conflicts=conflicts, seed=seed))
    assert one == reference_schedule(sim.dense_matrix(), batch, conflicts=conflicts, seed=seed)
    many = list(iter_concurrent_batches(sim, batch, slots, conflicts=conflicts, seed=seed))
    assert covers_once(many, n)
    assert conflict_free(many, conflicts)


def test_concurrent_batches_keep_the_hardness():
    """On topic-clustered data, 8 batches grown at once are about as hard as one at a time."""
    sim = topic_similarity()
    sequential = schedule_batches(sim, 16, seed=0)
    concurrent = list(iter_concurrent_batches(sim, 16, 8, seed=0))
    assert covers_once(concurrent, 400)
    assert mean_hardness(sim, concurrent) >= 0.95 * mean_hardness(sim, sequential)
    assert mean_hardness(sim, concurrent) > 2 * mean_hardness(sim, random_batches(400, 16, 0, 0))
    with pytest.raises(ConfigError, match="concurrent batches must be >= 1"):
        list(iter_concurrent_batches(sim, 16, 0))


def test_scheduled_batches_are_harder_than_random():
    sim = topic_similarity()
    greedy = schedule_batches(sim, 16, seed=0)
    beam = schedule_batches(sim, 16, seed=0, beam_width=4)
    rand = random_batches(400, 16, 0, 0)
    assert mean_hardness(sim, greedy) > 2 * mean_hardness(sim, rand)
    assert mean_hardness(sim, beam) >= 0.95 * mean_hardness(sim, greedy)


def test_restricted_candidates():
    """With every instance as a neighbour the restricted scheduler is the exact one; with a
    top-10 restriction it still beats random batches."""
    rng = np.random.default_rng(1)
    q, p = rng.normal(size=(60, 8)), rng.normal(size=(60, 8))
    sim = BilinearSimilarity(q, p, dtype=torch.float64)
    exact = schedule_batches(sim, 6, seed=3)
    everyone = np.tile(np.arange(60), (60, 1))
    assert schedule_batches(sim, 6, seed=3, neighbours=everyone) == exact
    top10 = neighbour_lists(sim, 10)
    assert top10.shape == (60, 20)
    restricted = schedule_batches(sim, 6, seed=3, neighbours=top10)
    assert covers_once(restricted, 60)
    assert mean_hardness(sim, restricted) > mean_hardness(sim, random_batches(60, 6, 3, 0))


def test_bm25_similarity_is_bilinear_and_exact():
    import bm25s

    from densepass.index.bm25 import english_stemmer

    passages = [
        "audio editor for linux audio",
        "python library for audio",
        "free font collection",
        "mail server and mail tools",
        "video player and audio player",
    ]
    queries = ["audio editor", "python fonts", "mail", "video audio player", "zzz unknown"]
    q, p, retriever = bm25_instance_matrices(queries, passages, [0, 1, 2, 3, 4])
    tokens = bm25s.tokenize(queries, stopwords="en", stemmer=english_stemmer(), return_ids=False, show_progress=False)
    for i, toks in enumerate(tokens):
        expected = retriever.get_scores(toks) if toks else np.zeros(5)
        np.testing.assert_allclose((q[i] @ p.T).toarray().ravel(), expected, rtol=1e-5)


def test_conflicts_are_symmetric_and_complete():
    conflicts = build_conflicts([1, 1, 2, 3], [{1}, {1, 3}, {2}, {3}])
    assert conflicts == [[1], [0, 3], [], [1]]


def test_bad_configurations():
    sim = BilinearSimilarity(np.ones((4, 2)), np.ones((4, 2)))
    with pytest.raises(ConfigError, match="larger than the 4 instances to schedule"):
        schedule_batches(sim, 5)
    with pytest.raises(ConfigError, match="differ in shape"):
        BilinearSimilarity(np.ones((4, 2)), np.ones((3, 2)))
    with pytest.raises(ConfigError, match="no training instances"):
        BilinearSimilarity(np.ones((0, 2)), np.ones((0, 2)))
    with pytest.raises(ConfigError, match="dense similarities"):
        neighbour_lists(BilinearSimilarity(sp.csr_matrix(np.eye(3)), sp.csr_matrix(np.eye(3))), 2)
    with pytest.raises(ConfigError, match="batch size"):
        sequential_batches(3, 4)
    with pytest.raises(ConfigError, match="schedule.concurrent_batches: must be >= 1"):
        load_config(None, ["schedule.concurrent_batches=0"])
    for bad, match in [
        (ScheduleConfig(method="abs-beam", concurrent_batches=4), "not abs-beam"),
        (ScheduleConfig(method="random", concurrent_batches=4), "the baselines"),
        (ScheduleConfig(method="abs-beam", beam_width=1), "beam_width must be >= 2"),
        (ScheduleConfig(method="abs-greedy", concurrent_batches=4, restrict_top_k=100), "restrict_top_k"),
    ]:
        with pytest.raises(ConfigError, match=match):
            check_schedule(bad)
        with pytest.raises(ConfigError, match=match):
            EpochPlanner(bad, 4, 0, data=None, model=None, device=torch.device("cpu"))


def test_baselines():
    assert sequential_batches(7, 3) == [[0, 1, 2], [3, 4, 5]]
    assert random_batches(10, 3, 1, 0) == random_batches(10, 3, 1, 0) != random_batches(10, 3, 1, 1)
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(4, 8)) * 10
    labels = np.repeat(np.arange(4), 30)
    emb = (centers[labels] + rng.normal(size=(120, 8))).astype(np.float32)
    batches = clustered_batches(emb, 10, 4, seed=0, epoch=0)
    assert len(batches) == 12 and covers_once(batches, 120)
    assert all(len(set(labels[b])) == 1 for b in batches)  # each batch from one topic


@pytest.fixture(scope="module")
def debian_subset():
    if not (SHARED_DATA / "debian-packages").is_dir():
        pytest.skip("../shared/data/debian-packages not present")
    dataset = load_dataset("debian-packages", data_dir=SHARED_DATA)
    positives = dataset.positives("train")
    qids = sorted(positives, key=lambda q: int(q[1:]))[:1500]  # consecutive ids: many share packages
    return dataset, TrainingData(dataset, "train", "[SEP]", query_ids=qids)


@pytest.mark.parametrize("concurrent", [1, 8])
def test_no_false_negatives_share_a_batch_on_real_data(debian_subset, tiny_model_dir, concurrent):
    dataset, data = debian_subset
    config = ScheduleConfig(method="abs-greedy", similarity="bm25", background=False, concurrent_batches=concurrent)
    planner = EpochPlanner(
        config,
        batch_size=32,
        seed=0,
        data=data,
        model=BiEncoder.from_pretrained(str(tiny_model_dir)),
        device=torch.device("cpu"),
    )
    batches = list(planner(0))
    assert covers_once(batches, len(data))
    relevant = dataset.relevant_sets()
    corpus = dataset.corpus
    shared_positive_pairs = 0
    for batch in batches:
        for i in batch:
            for j in batch:
                if i == j:
                    continue
                qi, qj = data.query_ids[i], data.query_ids[j]
                pj = data.positives[qj][0]
                same_text = corpus.passage_inputs(
                    "[SEP]", [corpus.position(data.positives[qi][0])]
                ) == corpus.passage_inputs("[SEP]", [corpus.position(pj)])
                assert pj not in relevant[qi] and not same_text, (qi, qj)
    for i in range(len(data.query_ids)):  # the subset really has such pairs to keep apart
        shared_positive_pairs += sum(1 for c in planner.conflicts[i])
    assert shared_positive_pairs > 0


@pytest.mark.parametrize(
    "method,concurrent",
    [("abs-greedy", 1), ("abs-greedy", 3), ("abs-beam", 1), ("clustered", 1), ("random", 1), ("sequential", 1)],
)
def test_planner_delivers_each_instance_once(tiny_beir, tiny_model_dir, tmp_path, method, concurrent):
    dataset = load_dataset(str(tiny_beir))
    data = TrainingData(dataset, "train", "[SEP]")
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    config = ScheduleConfig(
        method=method, similarity="bm25-then-encoder", background=True, clusters=3, concurrent_batches=concurrent
    )
    planner = EpochPlanner(config, 4, 0, data, model, torch.device("cpu"), tmp_path / "schedule.jsonl")
    try:
        epochs = [list(planner(epoch)) for epoch in (0, 1)]
    finally:
        planner.close()
    for batches in epochs:
        flat = [i for b in batches for i in b]
        assert len(flat) == len(set(flat))
        if method.startswith("abs"):
            assert covers_once(batches, len(data))
        else:
            assert len(batches) == planner.steps_per_epoch
    if method.startswith("abs"):
        import json

        log = [json.loads(line) for line in (tmp_path / "schedule.jsonl").read_text().splitlines()]
        assert [r["similarity"] for r in log] == ["bm25", "encoder"]
        assert all(r["mean_hardness"] >= r["random_mean_hardness"] for r in log), log
