"""Refresh of the hard-negative pool while training, with the model being trained (ance;
neural-retrieval-lecture; training-inference-gap §4.3.1 does it once, between rounds).

Every ``every`` steps the model being trained re-encodes the corpus, mines each training query's top
``pool_depth`` through the same false-negative filters, and the new pool replaces the old one. ANCE
refreshes asynchronously from a stale checkpoint; here the refresh is synchronous, so its cost shows
in the training time. The trainer prepares one batch ahead (``densepass.prefetch``): the pool mined
after N steps serves the batches from the (N + 2)-th on, the (N + 1)-th having been prepared meanwhile.
Each pool is saved as ``refresh-step-N.jsonl``: a resumed run reloads the pools mined before its
checkpoint, so it samples the same negatives as an uninterrupted one. A distilled run's teacher (``PairScorer``)
scores each new pool's candidates it has not scored before, into ``refresh-teacher-step-N.jsonl``, before any
batch draws them (RocketQA and TAS-B score every negative they train on), and a resumed run reads those again.

Under torchrun every process takes part in each refresh: each encodes and searches its shard of the corpus
(``negatives.dense``, ``index.sharded``) and all receive the merged pool, the one a single process would mine
with the same weights. Rank 0 alone writes the pool and the log, and on resume reads them and hands the
pools to every process (whose run directory may be its own), and alone deletes the stale ones.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path

from densepass import distributed
from densepass.checkpoints import trim_log
from densepass.config import NegativesConfig
from densepass.data.dataset import RetrievalDataset
from densepass.errors import ConfigError, DataError
from densepass.io import atomic_write_text
from densepass.models.biencoder import BiEncoder
from densepass.negatives.mine import MiningContext, mine_negatives
from densepass.negatives.pool import load_pool, passage_ids, save_pool
from densepass.training.batches import TrainingData
from densepass.training.teacher_scores import PairScorer, Scores, is_teacher_scores_file

PREPARED_AHEAD = 1  # batches the trainer has prepared when a step ends (densepass.prefetch)


POOL_FILE = "refresh-step-{step}.jsonl"  # the pool mined after step N
TEACHER_FILE = "refresh-teacher-step-{step}.jsonl"  # the teacher's scores of its new candidates (distilling)


def refresh_files(directory: Path, pattern: str) -> list[tuple[int, Path]]:
    """(step, path) of the regular files in ``directory`` named exactly as ``pattern`` names them, by step: a file of
    any other name (a user's copy, ``refresh-step-4-old.jsonl``) is neither read nor removed."""
    head, tail = pattern.split("{step}")
    shape = re.compile(re.escape(head) + r"(\d+)" + re.escape(tail))
    found = []
    for path in directory.glob(head + "*"):
        match = shape.fullmatch(path.name)
        if match and path.is_file() and not path.is_symlink():
            found.append((int(match.group(1)), path))
    return sorted(found)


class NegativeRefresher:
    """An ``on_step_end`` callback of the trainer that re-mines ``data``'s negative pool with ``model``
    after every ``every`` steps, while some batch is still to draw from it: the batch after a step is prepared
    when it ends (``PREPARED_AHEAD``), so a refresh after step ``last_step - 1`` (or later) would re-encode the
    corpus for no batch, and is skipped."""

    def __init__(
        self,
        every: int,
        model: BiEncoder,
        data: TrainingData,
        dataset: RetrievalDataset,
        query_ids: Sequence[str],
        config: NegativesConfig,
        context: MiningContext,
        work_dir: Path,
        last_step: int,
        teacher: PairScorer | None = None,
    ) -> None:
        if every < 1:
            raise ConfigError(f"negatives.refresh_every must be >= 1, got {every}")
        if not data.negatives_per_query:
            raise ConfigError("negatives.refresh_every needs hard negatives (negatives.per_query > 0)")
        self.every, self.model, self.data, self.dataset = every, model, data, dataset
        self.last_step = last_step
        self.query_ids, self.config, self.work_dir = list(query_ids), config, Path(work_dir)
        self.context = dataclasses.replace(context, model=model, show_progress=False)
        self.log_path = self.work_dir / "refresh_log.jsonl"
        self.teacher = teacher

    def _path(self, step: int) -> Path:
        return self.work_dir / POOL_FILE.format(step=step)

    def _teacher_path(self, step: int) -> Path:
        return self.work_dir / TEACHER_FILE.format(step=step)

    def restore(self, resume_step: int) -> None:
        """Reload the pools mined up to ``resume_step`` (rank 0's) on every process; rank 0 drops later ones
        and their log records (their model is being retrained)."""

        def read() -> tuple[list[tuple[int, dict[str, list[str]]]], list[Scores]]:
            pools, scores = [], []
            for step, path in refresh_files(self.work_dir, POOL_FILE):
                if step <= resume_step:
                    pools.append((step, passage_ids(load_pool(path, self.dataset))))
                else:
                    path.unlink()
            for step, path in refresh_files(self.work_dir, TEACHER_FILE):  # the teacher's scores of each refresh
                if step > resume_step:
                    path.unlink()
                elif self.teacher is not None:
                    scores.append(self.teacher.read(path))
            for step, path in refresh_files(self.work_dir, TEACHER_FILE + ".partial"):  # scored in part, retrained
                if step > resume_step and is_teacher_scores_file(path):
                    path.unlink()
            trim_log(self.log_path, resume_step)
            return pools, scores

        pools, scores = distributed.on_rank_zero(read)
        for scored in scores:  # which refresh scored a pair first does not matter: each pair is scored once
            self.data.add_teacher_scores(scored)
        for step, pool in pools:
            if self.teacher is not None and self.data.unscored(pool):
                raise DataError(
                    f"{self._path(step)}'s candidates lack the teacher's scores ({self._teacher_path(step).name} is "
                    "missing or short): resume from an earlier checkpoint, or start over with --restart"
                )
            self.data.replace_negatives(pool, step + PREPARED_AHEAD)

    def __call__(self, step: int) -> None:
        """Re-mine the pool after step ``step`` when a refresh is due (every process of the group calls it)."""
        if step % self.every or step + PREPARED_AHEAD >= self.last_step:  # its first batch: step + PREPARED_AHEAD
            return
        was_training = self.model.training
        self.model.eval()
        mined = mine_negatives(
            self.dataset, self.query_ids, self.config, self.context, self.data.sep_token, strategy="model"
        )
        self.model.train(was_training)
        scored, started = 0, time.perf_counter()
        if self.teacher is not None:  # distilling: the teacher scores the new candidates before a batch draws them
            pairs = self.data.unscored(passage_ids(mined.pool))
            self.data.add_teacher_scores(self.teacher.score(pairs, self._teacher_path(step)))
            scored = sum(map(len, pairs.values()))
        teacher_seconds = time.perf_counter() - started
        self.data.replace_negatives(passage_ids(mined.pool), step + PREPARED_AHEAD)
        if distributed.rank() == 0:
            save_pool(mined.pool, self._path(step))
            record = {
                "step": step,
                "seconds": mined.seconds,
                "removed": mined.removed,
                "negatives": sum(len(c) for c in mined.pool.values()),
                **({"teacher_scored": scored, "teacher_seconds": teacher_seconds} if self.teacher else {}),
            }
            # damaged bytes stay a damaged line (replaced, never a UnicodeDecodeError); readers leave it out
            logged = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
            atomic_write_text(self.log_path, logged + json.dumps(record) + "\n")
        distributed.barrier()  # the pool is on disk before any process trains on with it
