"""Fine-tuning a cross-encoder reranker on hard-negative pools (neural-retrieval-lecture: "cross-encoder
re-ranking ... binary cross-entropy"; localized contrastive estimation, Gao et al. 2021).

Each step takes ``batch_size`` training queries; each brings a *group*: its positive and
``negatives_per_query`` negatives drawn from its pool (``TrainingData``: the same pools, false-negative
filters and seeded draws as bi-encoder training). The cross-encoder scores every (query, passage) pair
of the step in one forward pass; the loss is listwise (softmax cross-entropy over each group) or
pointwise (binary cross-entropy of every pair): ``losses.localized_contrastive``.

AdamW with linear warm-up and gradient clipping; checkpoints through ``densepass.checkpoints`` (the
model as a loadable cross-encoder, optimiser, scheduler, random states and the run's identity), so an
interrupted run resumes to the same weights bit for bit. Pairs are tokenised one step ahead in a
worker thread.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, get_linear_schedule_with_warmup

from densepass.checkpoints import Checkpoints, restore_rng, training_identity, trim_log
from densepass.config import RerankerTrainConfig
from densepass.device import autocast_context
from densepass.errors import ConfigError
from densepass.losses.localized_contrastive import localized_contrastive_loss, pointwise_bce_loss
from densepass.models.batching import forward_in_pieces, piece_tokens
from densepass.models.cross_encoder import CrossEncoder
from densepass.models.dropout import use_cpu_dropout
from densepass.numerics import DivergenceGuard
from densepass.prefetch import prefetched
from densepass.training.batches import TrainingBatch, TrainingData
from densepass.training.trainer import RandomPlanner, TrainResult, planned_steps, seed_everything


def group_pairs(batch: TrainingBatch, n: int) -> tuple[list[str], list[str]]:
    """(queries, passages) of every pair of a collated batch, group by group: query i with its positive,
    then with its ``n`` negatives (``TrainingData.collate`` lists every positive, then the negatives)."""
    b = batch.n_local_queries
    texts = batch.passage_texts
    passages = [p for i in range(b) for p in (texts[i], *texts[b + i * n : b + (i + 1) * n])]
    return [q for q in batch.query_texts for _ in range(n + 1)], passages


def parameter_groups(model: CrossEncoder, config: RerankerTrainConfig) -> list[dict]:
    """AdamW groups: the pre-trained weights at ``learning_rate``, a newly initialised head
    (``model.head_parameters()``) at ``head_learning_rate``: a fresh head with the encoder's small rate
    barely moves in a few hundred steps."""
    named = list(model.model.named_parameters())
    head = model.head_parameters() if config.head_learning_rate is not None else set()
    groups = [{"params": [p for n, p in named if n not in head]}]
    if head:
        groups.append({"params": [p for n, p in named if n in head], "lr": config.head_learning_rate})
    return groups


def train_cross_encoder(
    model: CrossEncoder,
    data: TrainingData,
    config: RerankerTrainConfig,
    run_dir: Path,
    device: torch.device,
    bf16: bool = False,
    identity: dict | None = None,
    on_step_end: Callable[[int], None] | None = None,
) -> TrainResult:
    """Fine-tune ``model`` in place on the groups of ``data`` (whose ``negatives_per_query`` must equal
    ``config.negatives_per_query``); resumes from the newest intact checkpoint in ``run_dir``.
    ``identity``: the caller's settings that define the run besides ``config`` (data, model, pool);
    ``on_step_end(step)`` is called after every step."""
    n = config.negatives_per_query
    if data.negatives_per_query != n:
        raise ConfigError(f"the training data draws {data.negatives_per_query} negatives per query, the config {n}")
    seed_everything(config.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    planner = RandomPlanner(len(data), config.batch_size, config.seed)
    steps_per_epoch = planner.steps_per_epoch
    total = planned_steps(steps_per_epoch, config)
    net = use_cpu_dropout(model.model.to(device).train(), device)  # on the CPU, faster masks (models.dropout)
    optimizer = torch.optim.AdamW(
        parameter_groups(model, config), lr=config.learning_rate, weight_decay=config.weight_decay, fused=True
    )
    scheduler = get_linear_schedule_with_warmup(optimizer, int(config.warmup_ratio * total), total)
    checkpoints = Checkpoints(
        run_dir, config.keep_checkpoints, {"reranker": training_identity(config), **(identity or {})}
    )
    log_path = run_dir / "train_log.jsonl"
    loss_fn = localized_contrastive_loss if config.loss == "listwise" else pointwise_bce_loss
    step, interval = 0, (0.0, 0)
    guard = DivergenceGuard(config.skip_nonfinite, "reranker.train")
    resumed = checkpoints.latest()
    if resumed is not None:
        saved = AutoModelForSequenceClassification.from_pretrained(str(resumed.path / "model"))
        net.load_state_dict(saved.state_dict())
        optimizer.load_state_dict(resumed.optimizer)
        scheduler.load_state_dict(resumed.scheduler)
        restore_rng(resumed.rng)
        guard.load_state_dict(resumed.extra.get("nonfinite"))
        step, interval = resumed.step, tuple(resumed.extra["interval"])
    trim_log(log_path, step)
    interval_loss, interval_steps = torch.tensor(interval[0], device=device), interval[1]
    loss, seen, started = torch.tensor(float("nan")), 0, time.perf_counter()
    tokenizer = copy.deepcopy(model.tokenizer)

    def prepare(item: tuple[int, int, list[int]]) -> tuple[int, dict[str, torch.Tensor]]:
        epoch, index, members = item
        batch = data.collate(members, seed=(config.seed, epoch, index))
        return len(members), model.tokenize(*group_pairs(batch, n), tokenizer=tokenizer)

    def remaining_batches(epoch: int):
        done = step - epoch * steps_per_epoch
        for index, members in enumerate(planner(epoch)[:steps_per_epoch]):
            if index >= done and epoch * steps_per_epoch + index < total:
                yield epoch, index, list(members)

    progress = tqdm(total=total, initial=step, desc="train cross-encoder", dynamic_ncols=True)
    for epoch in range(step // steps_per_epoch, config.epochs):
        for size, tokens in prefetched(remaining_batches(epoch), prepare):
            with autocast_context(device, bf16):
                logits = forward_in_pieces(model.logits, tokens.to(device), piece_tokens(device)).view(size, n + 1)
            step_loss = loss_fn(logits)
            step_loss.backward()
            taken, _ = guard.step(step + 1, step_loss, net.parameters(), optimizer, scheduler)
            if taken:
                loss = step_loss
                interval_loss += loss.detach()
                interval_steps += 1
            step += 1
            seen += size
            progress.update(1)
            if (step % config.log_every == 0 or step == total) and interval_steps:
                record = {
                    "step": step,
                    "epoch": epoch,
                    "loss": interval_loss.item() / interval_steps,
                    "lr": scheduler.get_last_lr()[0],
                    "examples_per_s": seen / (time.perf_counter() - started),
                    **({"skipped": guard.skipped} if guard.skipped else {}),
                }
                interval_loss.zero_()
                interval_steps = 0
                progress.set_postfix(loss=f"{record['loss']:.4f}")
                with open(log_path, "a") as handle:
                    handle.write(json.dumps(record) + "\n")
            if step % config.checkpoint_every == 0 or step == total:
                guard.check_weights(step, net.named_parameters())
                checkpoints.save(
                    step,
                    lambda directory: model.save(directory / "model"),
                    optimizer,
                    scheduler,
                    {"interval": [interval_loss.item(), interval_steps], "nonfinite": guard.state_dict()},
                )
            if on_step_end is not None:
                on_step_end(step)
    progress.close()
    net.eval()
    elapsed = time.perf_counter() - started
    return TrainResult(step, loss.item(), seen / elapsed if elapsed > 0 else 0.0, log_path)
