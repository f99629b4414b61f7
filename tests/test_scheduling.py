"""Adaptive Batch Scheduling: the fast scheduler equals the literal reference, beats random batches,
never batches false negatives together, and the background process delivers each instance once."""

from __future__ import annotations

import itertools

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
from densepass.scheduling.unscheduled import Unscheduled
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


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(6, 60),
    batch=st.integers(2, 6),
    slots=st.integers(2, 6),
    seed=st.integers(0, 1000),
    with_conflicts=st.booleans(),
)
def test_dense_and_sparse_instances_give_one_concurrent_schedule(n, batch, slots, seed, with_conflicts):
    """The same instances held dense (members' rows kept per batch) or sparse (gathered each round) give the same
    batches with many slots at once, where no literal reference exists."""
    rng = np.random.default_rng(seed)
    q, p = random_instances(rng, n, 4, sparse=True)
    conflicts = random_conflicts(rng, n, n // 4) if with_conflicts else None
    batch = min(batch, n)
    schedules = [
        list(iter_concurrent_batches(BilinearSimilarity(a, b, dtype=torch.float64), batch, slots, conflicts, seed))
        for a, b in ((q, p), (q.toarray(), p.toarray()))
    ]
    assert schedules[0] == schedules[1]


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(6, 60),
    batch=st.integers(2, 6),
    slots=st.integers(1, 5),
    seed=st.integers(0, 1000),
    sparse=st.booleans(),
    with_conflicts=st.booleans(),
)
def test_when_the_pool_is_compacted_changes_no_schedule(n, batch, slots, seed, sparse, with_conflicts):
    """``greedy.COMPACT_BELOW`` decides only how often the products' matrix is rebuilt from U's rows (never: 0;
    after every batch: 1): the batches, sequential and concurrent, are the same whatever it is."""
    from densepass.scheduling import greedy

    rng = np.random.default_rng(seed)
    sim = BilinearSimilarity(*random_instances(rng, n, 3, sparse), dtype=torch.float64)
    batch = min(batch, n)
    conflicts = random_conflicts(rng, n, n // 4) if with_conflicts else None
    schedules = []
    for share in (0.0, 0.5, 7 / 8, 1.0):
        greedy.COMPACT_BELOW, before = share, greedy.COMPACT_BELOW
        try:
            sequential = schedule_batches(sim, batch, conflicts=conflicts, seed=seed)
            concurrent = list(iter_concurrent_batches(sim, batch, slots, conflicts=conflicts, seed=seed))
        finally:
            greedy.COMPACT_BELOW = before
        schedules.append((sequential, concurrent))
    assert all(schedule == schedules[0] for schedule in schedules)
    assert covers_once(schedules[0][1], n)


def test_concurrent_batches_keep_the_hardness():
    """On topic-clustered data, 8 batches grown at once are about as hard as one at a time: over 8 seeds their
    mean hardness is 0.955 of the sequential greedy's (per seed 0.91-0.99, so one seed alone says little)."""
    sim = topic_similarity()
    ratios = []
    for seed in range(8):
        sequential = schedule_batches(sim, 16, seed=seed)
        concurrent = list(iter_concurrent_batches(sim, 16, 8, seed=seed))
        assert covers_once(concurrent, 400)
        assert mean_hardness(sim, concurrent) > 2 * mean_hardness(sim, random_batches(400, 16, seed, 0))
        ratios.append(mean_hardness(sim, concurrent) / mean_hardness(sim, sequential))
    assert np.mean(ratios) >= 0.93
    with pytest.raises(ConfigError, match="concurrent batches must be >= 1"):
        list(iter_concurrent_batches(sim, 16, 0))


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(2, 30),
    batch=st.integers(1, 6),
    slots=st.integers(1, 4),
    dim=st.integers(1, 5),
    seed=st.integers(0, 1000),
    sparse=st.booleans(),
)
def test_each_batch_scores_its_own_members_as_a_product_over_all_rows_would(n, batch, slots, dim, seed, sparse):
    """``cross_own`` (eq. 3's c(d) + 2 Q_d.P_d, from the members' rows alone) equals ``cross`` over every
    instance read at each batch's members, for dense and sparse (BM25-like) instances."""
    rng = np.random.default_rng(seed)
    sim = BilinearSimilarity(*random_instances(rng, n, dim, sparse), dtype=torch.float64)
    members = torch.as_tensor(rng.integers(0, n, size=(slots, batch)))
    sums = torch.stack([sim.sums(rng.choice(n, size=min(n, batch), replace=False).tolist()) for _ in range(slots)])
    over_all = sim.cross(sums.T)  # [N, slots]
    assert torch.equal(sim.cross_own(sums, members), over_all.T.gather(1, members))
    if not sparse:  # the members' rows as a caller keeps them
        assert torch.equal(sim.cross_own(sums, members, sim.stacked[members]), over_all.T.gather(1, members))


def test_a_seed_batch_draws_every_order_of_the_unscheduled_alike():
    """Seeds are random members of U in a uniformly random order, drawn without shuffling all of U: each
    instance is equally likely at each place, both in the sample drawn first and beyond it (conflicts force
    the walk past it)."""
    n, draws = 6, 6000
    counts = np.zeros((n, n))
    unscheduled = Unscheduled(n, seed=0)
    for _ in range(draws):
        order = list(unscheduled._random_order(np.arange(n), first=2))
        assert sorted(order) == list(range(n))
        counts[order, np.arange(n)] += 1
    assert np.abs(counts - draws / n).max() < 150  # 1,000 expected in each cell, standard deviation 29
    # a large U, where the first sample is drawn without touching the rest: the first four places, by id decile
    large, draws = 20_000, 4000
    deciles = np.zeros((4, 10))
    for _ in range(draws):
        head = list(itertools.islice(unscheduled._random_order(np.arange(large), first=4), 4))
        deciles[np.arange(4), np.asarray(head) * 10 // large] += 1
    assert np.abs(deciles - draws / 10).max() < 100  # 400 expected in each cell, standard deviation 19
    everyone_conflicts = [[j for j in range(n) if j != i] for i in range(n)]
    assert len(unscheduled.seed_batch(3, everyone_conflicts)) == 1
    assert sorted(unscheduled.seed_batch(n, [[] for _ in range(n)])) == list(range(n))


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


@pytest.mark.parametrize("seed", range(10))
def test_restricted_candidates_leave_a_batch_of_one_as_it_is(seed):
    """A seed batch of one member (everything left conflicts with it, or batches of one): the restricted scheduler
    had no neighbours to draw from and raised an IndexError from argmax; it emits the batch, as the exact one does."""
    rng = np.random.default_rng(0)
    q, p = rng.normal(size=(8, 4)), rng.normal(size=(8, 4))
    sim = BilinearSimilarity(q, p, dtype=torch.float64)
    conflicts = build_conflicts([7, 7, 7, 7, 7, 1, 2, 3], [set() for _ in range(8)])  # 0-4 share a positive
    restricted = schedule_batches(sim, 2, conflicts=conflicts, seed=seed, neighbours=neighbour_lists(sim, 3))
    assert covers_once(restricted, 8) and all(len(set(b) & {0, 1, 2, 3, 4}) <= 1 for b in restricted)
    assert covers_once(schedule_batches(sim, 1, seed=seed, neighbours=neighbour_lists(sim, 3)), 8)


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
        # the default similarity (BM25 in epoch 1) refused the restriction only when epoch 1 was planned
        (ScheduleConfig(method="abs-greedy", restrict_top_k=10), "restrict_top_k .* needs schedule.similarity: enc"),
        (ScheduleConfig(method="abs-beam", similarity="bm25", restrict_top_k=10), "needs schedule.similarity"),
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
    assert all(len(b) == 32 for b in batches[: planner.steps_per_epoch])  # every trained batch is full
    # conflicts only in the batches merged from ABS's short ones, the queries it could not keep apart
    full = {tuple(b) for b in planner._abs(0) if len(b) == 32}
    relevant = dataset.relevant_sets()
    corpus = dataset.corpus
    shared_positive_pairs = 0
    for batch in (b for b in batches if tuple(b) in full):
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


# ---- the background scheduler's failures reach the trainer -------------------------------------------------


def test_a_failing_epoch_in_the_scheduler_process_is_reported_not_waited_for(monkeypatch):
    import queue as queue_module

    from densepass.training import planner as planner_module

    monkeypatch.setattr(planner_module, "die_with_parent", lambda pid: None)
    rng = np.random.default_rng(0)
    job = planner_module.ScheduleJob(
        rng.normal(size=(2, 4)).astype(np.float32),
        rng.normal(size=(2, 4)).astype(np.float32),
        "cpu",
        8,
        None,
        0,
        1,
        None,
        None,
        1,
    )  # fmt: skip  (a batch of 8 from 2 instances: the scheduler refuses it)
    jobs, results = queue_module.Queue(), queue_module.Queue()
    jobs.put(job)
    jobs.put(None)
    planner_module._worker_loop(jobs, results, 0)
    message = results.get_nowait()
    assert "larger than the 2 instances" in message[planner_module.SCHEDULER_FAILED]


def test_a_scheduler_process_that_died_is_one_line_not_a_hang():
    import multiprocessing
    import queue as queue_module

    from densepass.errors import DensepassError
    from densepass.training.planner import EpochPlanner

    planner = EpochPlanner.__new__(EpochPlanner)
    process = multiprocessing.get_context("spawn").Process(target=int)  # ends at once, sending nothing
    process.start()
    process.join()
    planner._process = process
    with pytest.raises(DensepassError, match="ended without a schedule"):
        planner._next(queue_module.Queue())


@pytest.mark.parametrize("damage", ["two rows", "object array", "missing key", "truncated"])
def test_damaged_or_foreign_saved_scheduling_embeddings_are_one_line(tmp_path, damage):
    from types import SimpleNamespace

    from densepass.errors import DataError
    from densepass.training.planner import EpochPlanner

    saved = tmp_path / "epoch-0.npz"
    vectors = np.zeros((5, 4), dtype=np.float32)
    if damage == "two rows":
        np.savez(saved, queries=vectors[:2], passages=vectors[:2])
    elif damage == "object array":
        np.savez(saved, queries=np.array([{"a": 1}] * 5, dtype=object), passages=vectors)
    elif damage == "missing key":
        np.savez(saved, queries=vectors)
    else:
        np.savez(saved, queries=vectors, passages=vectors)
        saved.write_bytes(saved.read_bytes()[:40])
    planner = EpochPlanner.__new__(EpochPlanner)
    planner.data = SimpleNamespace(query_texts=["q"] * 5)
    with pytest.raises(DataError, match="damaged or another run's") as caught:
        planner._load_saved(saved)
    assert "\n" not in str(caught.value)


def test_short_batches_are_merged_into_full_ones_and_the_remainder_comes_last():
    """ABS leaves an epoch's last batches short where the queries left share a positive; the planner trains full
    batches only: the short ones' members fill batches in order, fewer than a batch come last (not trained)."""
    from densepass.training.planner import full_batches

    raw = [[0, 1, 2, 3], [4, 5, 6], [7], [8, 9, 10, 11], [12, 13], [14]]
    assert list(full_batches(iter(raw), 4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14]]
    assert list(full_batches(iter([[0, 1], [2, 3]]), 2)) == [[0, 1], [2, 3]]
