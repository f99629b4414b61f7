"""The fine-tuning loop: AdamW with linear warm-up, checkpoints, resume, seeded determinism, logs.

A checkpoint is a directory ``checkpoints/step-N`` written atomically with the model (loadable like
any saved BiEncoder) and ``trainer_state.pt`` (optimiser, scheduler, step). Batches and negatives
depend only on (seed, epoch, step), so a resumed run continues exactly where the last checkpoint was.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from densepass.config import TrainConfig
from densepass.device import uses_bf16
from densepass.io import atomic_directory
from densepass.models.biencoder import BiEncoder
from densepass.prefetch import prefetched
from densepass.scheduling.baselines import random_batches
from densepass.training import distributed
from densepass.training.batches import TrainingData
from densepass.training.step import batch_tensors, forward_backward


class BatchPlanner(Protocol):
    """epoch -> that epoch's batches of instance indices (see ``densepass.training.planner``)."""

    steps_per_epoch: int

    def __call__(self, epoch: int) -> Iterable[Sequence[int]]: ...


class RandomPlanner:
    """Fresh random batches every epoch (the default batch order)."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.steps_per_epoch = len(random_batches(n, batch_size, seed, 0))

    def __call__(self, epoch: int) -> list[list[int]]:
        return random_batches(self.n, self.batch_size, self.seed, epoch)


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    examples_per_second: float
    log_path: Path


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[1])


def _checkpoints(run_dir: Path) -> list[Path]:
    found = [p for p in (run_dir / "checkpoints").glob("step-*") if (p / "trainer_state.pt").is_file()]
    return sorted(found, key=_step_of)


def planned_steps(steps_per_epoch: int, config: TrainConfig) -> int:
    """Training steps of a run: every epoch's batches, capped by ``max_steps``."""
    total = steps_per_epoch * config.epochs
    return total if config.max_steps is None else min(total, config.max_steps)


def resume_step(run_dir: Path) -> int:
    """The step ``train`` will resume from in ``run_dir`` (0 for a fresh run)."""
    existing = _checkpoints(run_dir)
    return _step_of(existing[-1]) if existing else 0


def save_checkpoint(model: BiEncoder, optimizer, scheduler, step: int, run_dir: Path, keep: int) -> Path:
    path = run_dir / "checkpoints" / f"step-{step}"
    if distributed.rank() == 0:
        with atomic_directory(path) as tmp:
            model.save(tmp / "model")
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step},
                       tmp / "trainer_state.pt")
        for old in _checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return path


def _load_weights(model: BiEncoder, path: Path) -> None:
    saved = BiEncoder.from_pretrained(str(path), config=model.config)
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
) -> TrainResult:
    """Fine-tune ``model`` in place on ``data``; resumes from the latest checkpoint in ``run_dir``."""
    seed_everything(config.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    world, rank = distributed.world_size(), distributed.rank()
    planner = planner or RandomPlanner(len(data), config.batch_size, config.seed)
    steps_per_epoch = planner.steps_per_epoch
    total = planned_steps(steps_per_epoch, config)
    model.to(device).train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay,
        fused=device.type == "cuda",
    )
    scheduler = get_linear_schedule_with_warmup(optimizer, int(config.warmup_ratio * total), total)
    step = 0
    existing = _checkpoints(run_dir)
    if existing:
        state = torch.load(existing[-1] / "trainer_state.pt", map_location="cpu", weights_only=False)
        _load_weights(model, existing[-1] / "model")
        model.to(device)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = state["step"]
    log_path = run_dir / "train_log.jsonl"
    if step == 0 and rank == 0:
        log_path.unlink(missing_ok=True)
    loss, seen, started = torch.tensor(float("nan")), 0, time.perf_counter()
    interval_loss, interval_steps = torch.zeros((), device=device), 0  # summed on the device: no sync per step
    progress = tqdm(total=total, initial=step, desc="train", disable=rank != 0, dynamic_ncols=True)
    # batches are collated and tokenised one step ahead in a worker thread, with its own tokenizer
    tokenizer, pin = copy.deepcopy(model.tokenizer), device.type == "cuda"
    bf16 = uses_bf16(device, config.bf16, config.cpu_bf16)

    def prepare(item: tuple[int, int, list[int]]):
        epoch, index, members = item
        batch = data.collate(members, seed=(config.seed, epoch, index), rank=rank, world=world,
                             step=epoch * steps_per_epoch + index)
        return members, batch, batch_tensors(model, batch, pin, tokenizer)

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
            loss = forward_backward(
                model, batch, device, config.bidirectional, config.grad_cache_chunk, bf16, tensors
            )
            distributed.sum_gradients(model.parameters())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            seen += len(members)
            interval_loss += loss.detach()
            interval_steps += 1
            progress.update(1)
            if step % config.log_every == 0 or step == total:  # reading the loss waits for the GPU
                loss_value = interval_loss.item() / interval_steps  # mean over the steps since the last record
                interval_loss.zero_()
                interval_steps = 0
                progress.set_postfix(loss=f"{loss_value:.4f}")
                if rank == 0:
                    record = {"step": step, "epoch": epoch, "loss": loss_value, "lr": scheduler.get_last_lr()[0],
                              "examples_per_s": seen / (time.perf_counter() - started)}
                    with open(log_path, "a") as handle:
                        handle.write(json.dumps(record) + "\n")
            if step % config.checkpoint_every == 0 or step == total:
                save_checkpoint(model, optimizer, scheduler, step, run_dir, config.keep_checkpoints)
            if on_step_end is not None and rank == 0:
                on_step_end(step)
        if on_epoch_end is not None and rank == 0 and step == min(total, (epoch + 1) * steps_per_epoch):
            on_epoch_end(epoch)
    progress.close()
    elapsed = time.perf_counter() - started
    return TrainResult(step, loss.item(), seen / elapsed if elapsed > 0 else 0.0, log_path)
