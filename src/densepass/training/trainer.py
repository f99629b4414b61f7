"""The fine-tuning loop: AdamW with linear warm-up, checkpoints, exact resume, seeded determinism, logs.

Checkpoints (``densepass.checkpoints``) hold the model (loadable like any saved BiEncoder), the
optimiser, scheduler and random states, and the run's identity. Batches and negatives depend only on
(seed, epoch, step) and dropout on the restored random state, so a run resumed after an interruption
ends with the same weights, bit for bit, as one that never stopped.
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from densepass import distributed
from densepass.checkpoints import Checkpoints, restore_rng, training_identity, trim_log
from densepass.config import TrainConfig
from densepass.device import uses_bf16
from densepass.models.biencoder import BiEncoder
from densepass.models.dropout import use_cpu_dropout
from densepass.models.freeze import freeze_bottom
from densepass.models.token_cache import cached_tokenizer
from densepass.numerics import DivergenceGuard
from densepass.prefetch import prefetched
from densepass.scheduling.baselines import random_batches
from densepass.training.batches import TrainingData
from densepass.training.distributed import sum_gradients
from densepass.training.objectives import Contrastive, Objective
from densepass.training.step import batch_tensors, forward_backward


class BatchPlanner(Protocol):
    """epoch -> that epoch's batches of instance indices (see ``densepass.training.planner``)."""

    steps_per_epoch: int

    def __call__(self, epoch: int) -> Iterable[Sequence[int]]:
        """The batches of ``epoch``."""
        ...


class RandomPlanner:
    """Fresh random batches every epoch (the default batch order)."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.steps_per_epoch = len(random_batches(n, batch_size, seed, 0))

    def __call__(self, epoch: int) -> list[list[int]]:
        """A fresh random order of ``epoch``."""
        return random_batches(self.n, self.batch_size, self.seed, epoch)


@dataclass
class TrainResult:
    """What a fine-tuning run ends with."""

    steps: int
    final_loss: float
    examples_per_second: float
    log_path: Path


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def planned_steps(steps_per_epoch: int, config: TrainConfig) -> int:
    """Training steps of a run: every epoch's batches, capped by ``max_steps``."""
    total = steps_per_epoch * config.epochs
    return total if config.max_steps is None else min(total, config.max_steps)


def checkpoints_of(run_dir: Path, config: TrainConfig, identity: dict | None = None) -> Checkpoints:
    """The checkpoints of a fine-tuning run; ``identity`` adds the caller's settings (data, model, ...)."""
    return Checkpoints(run_dir, config.keep_checkpoints, {"train": training_identity(config), **(identity or {})})


def resume_step(run_dir: Path, config: TrainConfig, identity: dict | None = None) -> int:
    """The step ``train`` will resume from in ``run_dir`` (0 for a fresh run)."""
    resumed = checkpoints_of(run_dir, config, identity).latest()
    return resumed.step if resumed else 0


def _load_weights(model: BiEncoder, path: Path) -> None:
    saved = type(model).from_pretrained(str(path), config=model.config)  # any retriever kind (SPLADE, ColBERT)
    model.load_state_dict(saved.state_dict())


def train(
    model: BiEncoder,
    data: TrainingData,
    config: TrainConfig,
    run_dir: Path,
    device: torch.device,
    planner: BatchPlanner | None = None,
    on_epoch_end: Callable[[int], None] | None = None,
    on_step_end: Callable[[int], None] | None = None,
    identity: dict | None = None,
    objective: Objective | None = None,
) -> TrainResult:
    """Fine-tune ``model`` in place on ``data``; resumes from the newest intact checkpoint in ``run_dir``.

    ``identity``: the caller's settings that define the run besides ``config`` (data, model, negatives,
    batch order); a checkpoint written with other settings is refused. ``objective``: what is minimised
    (default: ``Contrastive(config.bidirectional)``); its state is checkpointed with the model.
    ``on_step_end(step)`` runs on every process after each step, before that step's checkpoint (a callback
    that writes files writes them from rank 0); ``on_epoch_end(epoch)`` runs on rank 0 only."""
    seed_everything(config.seed)
    objective = objective or Contrastive(config.bidirectional)
    run_dir.mkdir(parents=True, exist_ok=True)
    world, rank = distributed.world_size(), distributed.rank()
    planner = planner or RandomPlanner(len(data), config.batch_size, config.seed)
    steps_per_epoch = planner.steps_per_epoch
    total = planned_steps(steps_per_epoch, config)
    use_cpu_dropout(model.to(device).train(), device)  # on the CPU, faster dropout masks (models.dropout)
    objective.to(device)
    if config.freeze_layers is not None:
        freeze_bottom(model, config.freeze_layers)
    # an objective may train a head of its own
    trainable = [p for p in (*model.parameters(), *objective.parameters()) if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay, fused=True)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(config.warmup_ratio * total), total)
    checkpoints = checkpoints_of(run_dir, config, identity)
    log_path = run_dir / "train_log.jsonl"
    step, interval = 0, (0.0, 0)
    guard = DivergenceGuard(config.skip_nonfinite)  # a non-finite loss or gradient: stop, or skip the batch
    resumed = checkpoints.latest()
    if resumed is not None:
        _load_weights(model, resumed.path / "model")
        model.to(device)
        optimizer.load_state_dict(resumed.optimizer)
        scheduler.load_state_dict(resumed.scheduler)
        restore_rng(resumed.rng)
        objective.load_state_dict(resumed.extra["objective"])
        guard.load_state_dict(resumed.extra.get("nonfinite"))
        step, interval = resumed.step, tuple(resumed.extra["interval"])
    if rank == 0:
        trim_log(log_path, step)
    loss, seen, started = torch.tensor(float("nan")), 0, time.perf_counter()
    # the loss summed since the last log record, on the device (no sync per step)
    interval_loss, interval_steps = torch.tensor(interval[0], device=device), interval[1]

    def save_checkpoint() -> None:
        guard.check_weights(step, model.named_parameters())  # every process: the same weights, the same verdict
        if rank == 0:
            checkpoints.save(
                step,
                lambda directory: model.save(directory / "model"),
                optimizer,
                scheduler,
                {
                    "interval": [interval_loss.item(), interval_steps],
                    "objective": objective.state_dict(),
                    "nonfinite": guard.state_dict(),
                },
            )
        distributed.barrier()

    progress = tqdm(total=total, initial=step, desc="train", disable=rank != 0, dynamic_ncols=True)
    # batches are collated and tokenised one step ahead in a worker thread, with its own tokenizer, which
    # answers from the run's token cache the texts it holds
    tokenizer, pin = copy.deepcopy(model.tokenizer), device.type == "cuda"
    if config.token_cache:
        lengths = {"passage": config.passage_max_length}
        tokenizer = cached_tokenizer(model, data.texts_in_use(), run_dir / "token_cache", tokenizer, lengths)
    bf16 = uses_bf16(device, config.bf16, config.cpu_bf16)

    def prepare(item: tuple[int, int, list[int]]):
        epoch, index, members = item
        batch = data.collate(
            members, seed=(config.seed, epoch, index), rank=rank, world=world, step=epoch * steps_per_epoch + index
        )
        return members, batch, batch_tensors(model, batch, pin, tokenizer, config.passage_max_length)

    def epoch_batches(epoch: int) -> Iterator[tuple[int, int, list[int]]]:
        """(epoch, index, members) of the batches still to train on in ``epoch``."""
        done_in_epoch, remaining = step - epoch * steps_per_epoch, total - step
        for index, members in enumerate(planner(epoch)):
            if index >= steps_per_epoch:
                continue  # a partial batch past the epoch's steps, drawn so that the planner ends its epoch
            if remaining == 0:
                break  # max_steps ends training inside the epoch
            if index < done_in_epoch:
                continue  # trained on before a resume
            if world > 1:  # every process trains on rank 0's batch (schedules may differ in the last bits)
                members = distributed.broadcast_object(list(members))
            remaining -= 1
            yield epoch, index, list(members)

    for epoch in range(step // steps_per_epoch, config.epochs):
        for members, batch, tensors in prefetched(epoch_batches(epoch), prepare):
            out = forward_backward(model, batch, device, objective, config.grad_cache_chunk, bf16, tensors)
            sum_gradients(trainable)
            taken, _ = guard.step(step + 1, out.loss, trainable, optimizer, scheduler)
            if taken:  # a skipped batch's representations may hold NaN: kept out of the objective's state
                loss = out.loss
                objective.after_step(model, out.queries, out.passages, out.batch)
                interval_loss += loss.detach()
                interval_steps += 1
            step += 1
            seen += len(members)
            progress.update(1)
            # reading the loss waits for the GPU; an interval whose batches were all skipped has no record
            if (step % config.log_every == 0 or step == total) and interval_steps:
                loss_value = interval_loss.item() / interval_steps  # mean over the steps since the last record
                interval_loss.zero_()
                interval_steps = 0
                progress.set_postfix(loss=f"{loss_value:.4f}")
                if rank == 0:
                    record = {
                        "step": step,
                        "epoch": epoch,
                        "loss": loss_value,
                        "lr": scheduler.get_last_lr()[0],
                        "examples_per_s": seen / (time.perf_counter() - started),
                        **({"skipped": guard.skipped} if guard.skipped else {}),
                    }
                    with open(log_path, "a") as handle:
                        handle.write(json.dumps(record) + "\n")
            if on_step_end is not None:  # before the checkpoint: a resume from it never skips the callback
                on_step_end(step)
            if step % config.checkpoint_every == 0 or step == total:
                save_checkpoint()
        if on_epoch_end is not None and rank == 0 and step == min(total, (epoch + 1) * steps_per_epoch):
            on_epoch_end(epoch)
    progress.close()
    elapsed = time.perf_counter() - started
    return TrainResult(step, loss.item(), seen / elapsed if elapsed > 0 else 0.0, log_path)
