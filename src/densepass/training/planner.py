"""Plugs a batch order into training: one call per epoch yields that epoch's batches.

For ABS the similarity is BM25 in the first epoch (no encoder signal yet) and the current encoder's
dot product afterwards, re-encoding queries and positives at the start of each epoch. With
``background`` the scheduler runs in a separate process and hands batches over a queue as it makes
them (the paper's on-demand generation), so training starts on the first batch at once. Each epoch
appends to ``schedule_log.jsonl``: mean batch hardness of the schedule and of random batches under
the same similarity, scheduling time, and how long training waited for batches.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from densepass import distributed
from densepass.config import ScheduleConfig
from densepass.errors import ConfigError, DataError, DensepassError
from densepass.io import atomic_file, atomic_write_text
from densepass.models.biencoder import BiEncoder
from densepass.models.encode import encode_texts
from densepass.plots import read_log
from densepass.processes import die_with_parent
from densepass.scheduling.baselines import clustered_batches, random_batches, sequential_batches
from densepass.scheduling.concurrent import iter_concurrent_batches
from densepass.scheduling.conflicts import build_conflicts
from densepass.scheduling.greedy import iter_batches, neighbour_lists
from densepass.scheduling.similarity import BilinearSimilarity, bm25_instance_matrices, mean_hardness
from densepass.training.batches import TrainingData


@dataclass
class ScheduleJob:
    """One epoch of ABS scheduling, as handed to the scheduler process: the instances' similarity
    matrices (dense or sparse), the conflicts, and the settings of ``ScheduleConfig``."""

    queries: Any
    passages: Any
    device: str
    batch_size: int
    conflicts: list[list[int]]
    seed: int
    beam_width: int  # 1 = greedy
    restrict_top_k: int | None
    max_swaps: int | None
    concurrent_batches: int


def _schedule_epoch(queue, job: ScheduleJob) -> None:
    """Build the similarity, stream one epoch's batches into ``queue``, then its statistics."""
    started = time.perf_counter()
    sim = BilinearSimilarity(job.queries, job.passages, device=job.device)
    if job.concurrent_batches > 1:
        scheduled = iter_concurrent_batches(
            sim, job.batch_size, job.concurrent_batches, conflicts=job.conflicts, seed=job.seed, max_swaps=job.max_swaps
        )
    else:
        neighbours = neighbour_lists(sim, job.restrict_top_k) if job.restrict_top_k else None
        scheduled = iter_batches(
            sim,
            job.batch_size,
            conflicts=job.conflicts,
            seed=job.seed,
            beam_width=job.beam_width,
            neighbours=neighbours,
            max_swaps=job.max_swaps,
        )
    batches = []
    for batch in scheduled:
        queue.put(batch)
        batches.append(batch)
    elapsed = time.perf_counter() - started
    baseline = random_batches(sim.n, job.batch_size, job.seed, 0)
    full = [b for b in batches if len(b) == job.batch_size]  # compare like with like: full batches only
    queue.put(
        {
            "schedule_s": elapsed,
            "mean_hardness": mean_hardness(sim, full),
            "random_mean_hardness": mean_hardness(sim, baseline),
            "n_batches": len(batches),
        }
    )


SCHEDULER_FAILED = "scheduler_error"  # the key of the message a failed epoch sends instead of its statistics


def _worker_loop(jobs, results, parent_pid: int) -> None:
    """A scheduler process that lives across epochs (its start-up is paid once per run) and ends with the
    training process, however that ends (on SIGKILL no ``None`` job ever comes). An epoch that fails sends its
    error's one line instead of its statistics, so training stops with it instead of waiting."""
    die_with_parent(parent_pid)
    while (job := jobs.get()) is not None:
        try:
            _schedule_epoch(results, job)
        except Exception as err:  # any failure: the trainer must hear of it
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            results.put({SCHEDULER_FAILED: first})


def check_schedule(config: ScheduleConfig) -> None:
    """Option combinations a schedule cannot run with (checked before any work)."""
    if config.method == "abs-beam" and config.beam_width < 2:
        raise ConfigError("schedule.beam_width must be >= 2 for abs-beam (1 is plain greedy)")
    if config.concurrent_batches > 1 and (config.method != "abs-greedy" or config.restrict_top_k is not None):
        raise ConfigError(
            "schedule.concurrent_batches > 1 is for abs-greedy over the whole pool "
            "(not abs-beam, the baselines or restrict_top_k)"
        )
    if config.restrict_top_k is not None and config.method.startswith("abs") and config.similarity != "encoder":
        raise ConfigError(
            f"schedule.restrict_top_k restricts candidates by dense similarities: it needs schedule.similarity: "
            f"encoder (with {config.similarity}, BM25's epoch 1 would refuse it)"
        )


def full_batches(batches: Iterator[list[int]], size: int) -> Iterator[list[int]]:
    """``batches`` with the short ones merged into full ones: a batch of ``size`` passes as it is; the members of
    shorter ones wait until they fill a batch, in their order, and what is left at the end (fewer than ``size``)
    comes last, as the other methods' remainder does (past ``steps_per_epoch``, n // size: not trained). ABS leaves
    an epoch's last batches short where the queries left conflict (they share a positive): trained as they were, a
    step had fewer in-batch negatives than configured, and under torchrun a batch that does not split over the
    processes stopped the run. A merged batch may hold queries of one positive: the loss masks each one's positive
    out of the others' negatives (``losses.contrastive.false_negative_mask``)."""
    waiting: list[int] = []
    try:
        for batch in batches:
            if len(batch) >= size:
                yield batch
                continue
            waiting += batch
            while len(waiting) >= size:
                yield waiting[:size]
                waiting = waiting[size:]
        if waiting:
            yield waiting
    finally:  # stopped early (max_steps): the schedule's generator ends too (ABS's background worker with it)
        close = getattr(batches, "close", None)
        if close is not None:
            close()


class EpochPlanner:
    """Callable epoch -> batches, with ``steps_per_epoch`` for the learning-rate schedule.

    Schedules that depend on the encoder (clustered, ABS with encoder similarity) encode the training
    queries and positives once per epoch, at its start; with ``state_dir`` those embeddings are kept in
    ``epoch-N.npz`` so that a run resumed in the middle of epoch N schedules it from the same embeddings
    (not from the half-trained model) and trains on the same batches as an uninterrupted run.
    """

    def __init__(
        self,
        config: ScheduleConfig,
        batch_size: int,
        seed: int,
        data: TrainingData,
        model: BiEncoder,
        device: torch.device,
        log_path: Path | None = None,
        state_dir: Path | None = None,
    ) -> None:
        check_schedule(config)
        if batch_size > len(data):
            raise ConfigError(f"batch size {batch_size} is larger than the {len(data)} training instances")
        self.config, self.batch_size, self.seed = config, batch_size, seed
        self.data, self.model, self.device, self.log_path = data, model, device, log_path
        self.state_dir = state_dir
        self.steps_per_epoch = len(data) // batch_size
        self._bm25: tuple | None = None
        self._process = None
        self._queues = None
        positive_keys = [int(data.keys[rows[0]]) for rows in data.positive_rows]
        self.conflicts = build_conflicts(positive_keys, data.relevant_keys)

    def __call__(self, epoch: int) -> Iterator[list[int]]:
        """The batches of ``epoch``, as the configured method orders them."""
        method = self.config.method
        if method == "sequential":
            yield from sequential_batches(len(self.data), self.batch_size)
        elif method == "random":
            yield from random_batches(len(self.data), self.batch_size, self.seed, epoch)
        elif method == "clustered":
            queries, _ = self._encode(epoch)
            yield from clustered_batches(queries, self.batch_size, self.config.clusters, self.seed, epoch)
        else:
            yield from full_batches(self._abs(epoch), self.batch_size)

    def similarity_source(self, epoch: int) -> str:
        """Which similarity ABS uses in ``epoch``: bm25 or encoder."""
        kind = self.config.similarity
        return "bm25" if kind == "bm25" or (kind == "bm25-then-encoder" and epoch == 0) else "encoder"

    def _encode(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The encoder's embeddings of the training queries and their positives at the start of ``epoch``."""
        saved = self.state_dir / f"epoch-{epoch}.npz" if self.state_dir is not None else None
        if saved is not None and saved.is_file():
            return self._load_saved(saved)
        queries, passages = self._encode_now()
        if saved is not None and distributed.rank() == 0:  # atomically, under densepass's temporary name (a killed
            # save's is its own to remove); under torchrun every process plans, rank 0 writes
            with atomic_file(saved, "wb", needs=queries.nbytes + passages.nbytes) as handle:
                np.savez(handle, queries=queries, passages=passages)
        return queries, passages

    def _load_saved(self, saved: Path) -> tuple[np.ndarray, np.ndarray]:
        """The embeddings an interrupted run saved for this epoch, checked against the training data (one row per
        training query, as many passage rows, float vectors): anything else is a one-line error."""
        problem = None
        try:
            with np.load(saved, allow_pickle=False) as arrays:
                queries, passages = arrays["queries"], arrays["passages"]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
            problem = (str(err).strip().splitlines() or [type(err).__name__])[0]
        else:
            n = len(self.data.query_texts)
            shapes_ok = queries.ndim == passages.ndim == 2 and len(queries) == len(passages) == n
            if not shapes_ok or queries.dtype.kind != "f" or passages.dtype.kind != "f":
                problem = f"it holds {queries.shape} and {passages.shape} arrays, not {n} rows of vectors"
        if problem is not None:
            raise DataError(
                f"{saved}, the scheduling embeddings an interrupted run saved, does not load ({problem}): it is "
                "damaged or another run's; remove it (it is computed again) or run with --restart"
            )
        return queries, passages

    def _encode_now(self) -> tuple[np.ndarray, np.ndarray]:
        was_training = self.model.training
        rows = [r[0] for r in self.data.positive_rows]
        queries = encode_texts(self.model, self.data.query_texts, "query", device=self.device, show_progress=False)
        passages = encode_texts(
            self.model, [self.data.passage_inputs[r] for r in rows], "passage", device=self.device, show_progress=False
        )
        self.model.train(was_training)
        return queries, passages

    def _matrices(self, epoch: int):
        if self.similarity_source(epoch) == "encoder":
            return self._encode(epoch)
        if self._bm25 is None:
            rows = [r[0] for r in self.data.positive_rows]
            distinct = sorted(set(rows))
            where = {r: i for i, r in enumerate(distinct)}
            q, p, _ = bm25_instance_matrices(
                self.data.query_texts, [self.data.passage_inputs[r] for r in distinct], [where[r] for r in rows]
            )
            self._bm25 = (q, p)
        return self._bm25

    def _abs(self, epoch: int) -> Iterator[list[int]]:
        queries, passages = self._matrices(epoch)
        job = ScheduleJob(
            queries,
            passages,
            str(self.device),
            self.batch_size,
            self.conflicts,
            self.seed + epoch,
            self.config.beam_width if self.config.method == "abs-beam" else 1,
            self.config.restrict_top_k,
            self.config.max_swaps,
            self.config.concurrent_batches,
        )
        waited = 0.0
        if self.config.background:
            jobs, results = self._worker()
            jobs.put(job)
            try:
                while True:
                    start = time.perf_counter()
                    item = self._next(results)
                    waited += time.perf_counter() - start
                    if isinstance(item, dict):
                        if SCHEDULER_FAILED in item:
                            raise ConfigError(f"batch scheduling (ABS) failed: {item[SCHEDULER_FAILED]}")
                        stats = item
                        break
                    yield item
            except GeneratorExit:  # training stopped early (max_steps): the worker's epoch is abandoned
                self.close()
                raise
        else:
            items: list = []
            _schedule_epoch(_ListQueue(items), job)
            stats = items.pop()
            yield from items
        self._log(
            {
                "epoch": epoch,
                "method": self.config.method,
                "similarity": self.similarity_source(epoch),
                "waited_s": waited,
                **stats,
            }
        )

    def _next(self, results):
        """The worker's next message; a one-line error if the worker process ended without sending one."""
        while True:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                if self._process is None or not self._process.is_alive():
                    code = self._process.exitcode if self._process is not None else None
                    self.close()
                    raise DensepassError(
                        f"the batch scheduler process ended without a schedule (exit {code})"
                    ) from None

    def _worker(self):
        if self._process is None or not self._process.is_alive():
            context = mp.get_context("spawn")
            jobs, results = context.Queue(), context.Queue(maxsize=1024)
            self._process = context.Process(target=_worker_loop, args=(jobs, results, os.getpid()), daemon=True)
            self._process.start()
            self._queues = (jobs, results)
        return self._queues

    def close(self) -> None:
        """Stop the background scheduler process, if any."""
        if self._process is not None:
            if self._process.is_alive():
                self._process.terminate()
            self._process.join()
            self._process = None

    def _log(self, record: dict) -> None:
        """Write ``record`` (an epoch's) to the schedule log in place of any earlier record of the same epoch: a run
        resumed inside an epoch plans it again, and one record an epoch is what ``hardness.png`` draws."""
        if self.log_path is None or distributed.rank() != 0:  # (under torchrun every process plans)
            return
        earlier = [] if self.log_path.is_symlink() else read_log(self.log_path)  # a line cut short: left out
        kept = [r for r in earlier if "epoch" in r and r["epoch"] != record["epoch"]]
        atomic_write_text(self.log_path, "".join(f"{json.dumps(r)}\n" for r in [*kept, record]))


class _ListQueue:
    """The queue interface of the worker, in-process."""

    def __init__(self, items: list) -> None:
        self.items = items

    def put(self, item) -> None:
        self.items.append(item)
