"""The in-training refresh of hard negatives (training.refresh) under torch.distributed: two gloo processes
refresh with the pool one process mines from the same weights, each encoding only its shard of the corpus,
and rank 0 alone writes it; a two-process run interrupted inside a refresh resumes to the same weights;
restoring hands rank 0's pools to every process, whether they share a run directory or not; ``densepass run``
refreshes under torchrun."""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import run_densepass, write_tiny_beir
from densepass.config import NegativesConfig, TrainConfig
from densepass.data import load_dataset
from densepass.models.biencoder import BiEncoder
from densepass.negatives.mine import MiningContext, mine_negatives
from densepass.negatives.pool import Candidate, load_pool, passage_ids, save_pool
from densepass.training.batches import TrainingData
from densepass.training.refresh import NegativeRefresher
from densepass.training.trainer import asks_packing, resume_step, train

CPU = torch.device("cpu")
BLOCK = 8  # 60 passages in 8 blocks: rank 0 encodes the first 4 (32 passages), rank 1 the other 28
SHARDS = [[8, 8, 8, 8], [8, 8, 8, 4]]  # passages per encoded block, per rank
STEPS = 6  # refreshed after steps 2 and 4, not after the last
NEGATIVES = NegativesConfig(source="model", pool_depth=5, per_query=1, shard_block=BLOCK, refresh_every=2)
TRAIN = TrainConfig(
    epochs=1,
    max_steps=STEPS,
    batch_size=6,
    learning_rate=1e-3,
    warmup_ratio=0.0,
    checkpoint_every=2,
    keep_checkpoints=10,
    seed=3,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refresher(model: BiEncoder, beir: Path, work_dir: Path) -> tuple[TrainingData, NegativeRefresher]:
    """Training data whose first pool is every third passage, and its refresher."""
    dataset = load_dataset(str(beir))
    query_ids = sorted(dataset.positives("train"))
    first = {q: list(dataset.corpus.ids[::3]) for q in query_ids}
    data = TrainingData(dataset, "train", "[SEP]", first, NEGATIVES.per_query, query_ids=query_ids)
    context = MiningContext(device=CPU, show_progress=False)
    return data, NegativeRefresher(2, model, data, dataset, query_ids, NEGATIVES, context, work_dir, STEPS)


def _pools(data: TrainingData) -> list:
    """(first step, rows of every query's pool) of each refreshed pool the data holds."""
    return [(first, [pool.tolist() for pool in pools]) for first, pools in data._refreshed]


def _join(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)


def _train_worker(rank: int, port: int, model_dir: str, beir: str, run_dir: str, out: str, crash_at: int):
    """Train with a refresher (resuming from ``run_dir``); the ``crash_at``-th refresh fails on every rank.
    Saves the final weights, the refreshed pools and the sizes of the passage blocks this process encoded."""
    _join(rank, port)
    import densepass.index.embeddings as embeddings
    import densepass.training.refresh as refresh

    encoded, encode = [], embeddings.encode_texts
    mined, mine = [], refresh.mine_negatives

    def counted(model, texts, side, *args, **kwargs):
        encoded.append(len(texts))
        return encode(model, texts, side, *args, **kwargs)

    def crashing(*args, **kwargs):
        mined.append(1)
        if len(mined) == crash_at:
            raise RuntimeError("interrupted inside a refresh")
        return mine(*args, **kwargs)

    embeddings.encode_texts, refresh.mine_negatives = counted, crashing
    try:
        model = BiEncoder.from_pretrained(model_dir)
        data, refresher = _refresher(model, Path(beir), Path(run_dir) / "negatives")
        refresher.restore(resume_step(Path(run_dir), TRAIN, packing=asks_packing(model, TRAIN, CPU)))
        train(model, data, TRAIN, Path(run_dir), CPU, on_step_end=refresher)
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        torch.save({"params": params, "pools": _pools(data), "encoded": encoded}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _train(model_dir: Path, beir: Path, run_dir: Path, out: Path, crash_at: int = 0) -> list[dict]:
    mp.spawn(_train_worker, args=(_free_port(), str(model_dir), str(beir), str(run_dir), str(out), crash_at), nprocs=2)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    """A two-process run of 6 steps refreshed after steps 2 and 4 (sharing one run directory)."""
    root = tmp_path_factory.mktemp("refresh")
    beir = write_tiny_beir(root / "beir60", n_passages=60)
    return root, beir, _train(tiny_model_dir, beir, root / "run", root)


def test_two_processes_refresh_with_the_pool_one_process_mines_from_the_same_weights(uninterrupted):
    root, beir, ranks = uninterrupted
    work = root / "run" / "negatives"
    assert ranks[0]["pools"] == ranks[1]["pools"]
    assert [first for first, _ in ranks[0]["pools"]] == [3, 5]  # the pools of steps 2 and 4 serve from step 4, 6
    assert sorted(p.name for p in work.glob("refresh-step-*")) == ["refresh-step-2.jsonl", "refresh-step-4.jsonl"]
    log = [json.loads(line) for line in (work / "refresh_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4]  # one record per refresh: rank 0 alone writes
    dataset = load_dataset(str(beir))
    for step, (first, pools) in zip((2, 4), ranks[0]["pools"]):
        model = BiEncoder.from_pretrained(str(root / "run" / "checkpoints" / f"step-{step}" / "model")).eval()
        context = MiningContext(device=CPU, show_progress=False, model=model)
        single = mine_negatives(dataset, sorted(dataset.positives("train")), NEGATIVES, context, strategy="model")
        assert load_pool(work / f"refresh-step-{step}.jsonl", dataset) == single.pool  # ids, order and scores
        data, _ = _refresher(model, beir, root / "unused")
        data.replace_negatives(passage_ids(single.pool), first)
        assert pools == [pool.tolist() for pool in data.negative_rows_at(first)]


def test_each_process_encodes_only_its_shard_of_the_corpus_at_each_refresh(uninterrupted):
    _, _, ranks = uninterrupted
    assert [r["encoded"] for r in ranks] == [shard * 2 for shard in SHARDS]  # two refreshes; 32 + 28 = 60 passages


def test_a_two_process_run_interrupted_inside_a_refresh_resumes_to_the_same_weights(
    tiny_model_dir, uninterrupted, tmp_path
):
    root, beir, ranks = uninterrupted
    run = tmp_path / "run"
    with pytest.raises(Exception, match="interrupted inside a refresh"):
        _train(tiny_model_dir, beir, run, tmp_path, crash_at=2)
    # the checkpoint of step 4 follows its refresh: the resumed run starts at step 2 and mines step 4's pool
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-2"]
    resumed = _train(tiny_model_dir, beir, run, tmp_path)
    for got in resumed:
        assert got["pools"] == ranks[0]["pools"]
        assert torch.equal(got["params"], ranks[0]["params"])
    for name in ("refresh-step-2.jsonl", "refresh-step-4.jsonl"):
        assert (run / "negatives" / name).read_bytes() == (root / "run" / "negatives" / name).read_bytes()
    log = [json.loads(line) for line in (run / "negatives" / "refresh_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4]


def _restore_worker(rank: int, port: int, model_dir: str, beir: str, work_dirs: list[str], out: str):
    _join(rank, port)
    try:
        data, refresher = _refresher(BiEncoder.from_pretrained(model_dir), Path(beir), Path(work_dirs[rank]))
        refresher.restore(2)
        torch.save(_pools(data), Path(out) / f"restored{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shared", [True, False], ids=["shared-run-directory", "run-directory-per-process"])
def test_restoring_gives_every_process_rank_zeros_pools_and_only_rank_zero_drops_later_ones(
    tiny_model_dir, tmp_path, shared
):
    beir = write_tiny_beir(tmp_path / "beir", n_passages=60)
    dataset = load_dataset(str(beir))
    ids, query_ids, work = dataset.corpus.ids, sorted(dataset.positives("train")), tmp_path / "rank0"
    for step in (2, 4):  # pools mined after steps 2 and 4; the run resumes from its checkpoint of step 2
        pool = {q: [Candidate(p, "model", 1.0) for p in ids[i + step : i + step + 5]] for i, q in enumerate(query_ids)}
        save_pool(pool, work / f"refresh-step-{step}.jsonl")
    (work / "refresh_log.jsonl").write_text('{"step": 2}\n{"step": 4}\n')
    dirs = [str(work), str(work if shared else tmp_path / "rank1")]
    mp.spawn(_restore_worker, args=(_free_port(), str(tiny_model_dir), str(beir), dirs, str(tmp_path)), nprocs=2)
    data, _ = _refresher(BiEncoder.from_pretrained(str(tiny_model_dir)), beir, tmp_path / "unused")
    data.replace_negatives(passage_ids(load_pool(work / "refresh-step-2.jsonl", dataset)), 3)
    expected = [(3, [pool.tolist() for pool in data.negative_rows_at(3)])]
    assert [torch.load(tmp_path / f"restored{rank}.pt") for rank in range(2)] == [expected, expected]
    assert sorted(p.name for p in work.iterdir()) == ["refresh-step-2.jsonl", "refresh_log.jsonl"]
    assert (work / "refresh_log.jsonl").read_text() == '{"step": 2}\n'  # the later record trimmed, once


def torchrun_refreshing(tmp_path: Path, model_dir: Path, name: str, *extra: str):
    """``densepass run`` under torchrun (two gloo processes) on 60 passages, re-mining every 2 steps."""
    beir = write_tiny_beir(tmp_path / "beir", n_passages=60)
    settings = [
        f"data.name={beir}",
        f"model.name_or_path={model_dir}",
        f"output_dir={tmp_path / 'out'}",
        f"name={name}",
        "train.batch_size=8",
        "negatives.pool_depth=5",
        "negatives.refresh_every=2",
        f"negatives.shard_block={BLOCK}",
        "eval.baselines=[]",
        "eval.metrics=[mrr@10]",
        "model.passage_max_length=32",
        *extra,
    ]
    return run_densepass("run", *(arg for kv in settings for arg in ("--set", kv)), cwd=tmp_path, processes=2)


def test_densepass_run_under_torchrun_refreshes_and_writes_each_pool_once(tiny_model_dir, tmp_path):
    done = torchrun_refreshing(tmp_path, tiny_model_dir, "r", "train.epochs=2")
    assert done.returncode == 0, done.stderr
    work = tmp_path / "out" / "r" / "negatives"
    steps = [2, 4, 6, 8]  # 10 steps of 2 x 5 batches
    assert sorted(p.name for p in work.glob("refresh-step-*")) == [f"refresh-step-{s}.jsonl" for s in steps]
    assert [json.loads(line)["step"] for line in (work / "refresh_log.jsonl").read_text().splitlines()] == steps


def test_a_distilled_run_under_torchrun_scores_each_refresh_once_for_every_process(tiny_model_dir, tmp_path):
    """Distillation with refreshes under torchrun: rank 0 has the teacher score each refresh's new candidates and
    gives them to the other process (no shared run directory needed); both train on."""
    done = torchrun_refreshing(
        tmp_path,
        tiny_model_dir,
        "d",
        "train.epochs=1",
        "reranker.enabled=true",
        f"reranker.name_or_path={tiny_model_dir}",
        "reranker.max_length=48",
        "reranker.train.batch_size=4",
        "reranker.train.negatives_per_query=3",
        "reranker.first_stages=[]",
        "reranker.distill.loss=kl",
        "reranker.distill.contrastive=true",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    work = tmp_path / "out" / "d" / "negatives"
    log = [json.loads(line) for line in (work / "refresh_log.jsonl").read_text().splitlines()]
    # 5 steps: refreshed after step 2; after step 4 no batch is left to draw from a new pool
    assert [r["step"] for r in log] == [2] and all(r["teacher_scored"] > 0 for r in log)
    teacher_files = sorted(p.name for p in work.glob("refresh-teacher-step-*"))
    assert teacher_files == ["refresh-teacher-step-2.jsonl"]
