"""Fine-tuning a bi-encoder (dense, SPLADE, ColBERT): the task the training engine runs for ``densepass run``.

Each step collates ``batch_size`` training queries with their positives and hard negatives
(``training.batches``), tokenises them one step ahead in a worker thread and minimises the run's objective
(``losses.objectives``: InfoNCE, the unified λ loss, distillation, + FLOPS for SPLADE) with gradient caching
when asked (``training.step``). Batches and negatives depend only on (seed, epoch, step), so the engine's exact
resume holds; under torch.distributed every process embeds its share of the batch and the objective contrasts
the whole gathered batch (``training.distributed``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from typing_extensions import override

from densepass import distributed
from densepass.checkpoints import Checkpoints, training_identity
from densepass.config import TrainConfig
from densepass.device import resolved_packing
from densepass.losses.objectives import InfoNCE, Objective
from densepass.models.biencoder import BiEncoder
from densepass.models.dropout import use_cpu_dropout
from densepass.models.freeze import freeze_bottom
from densepass.models.packing import can_pack, enable_packing
from densepass.models.token_cache import cached_tokenizer
from densepass.scheduling.baselines import random_batches
from densepass.training import engine
from densepass.training.batches import TrainingData
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


def resumed_note(earlier_seconds: float) -> str:
    """A report's words for a run that resumed: how much of its training time earlier pieces spent."""
    return f"; resumed: {earlier_seconds:,.1f} s of training in earlier pieces" if earlier_seconds > 0 else ""


@dataclass
class TrainResult:
    """What a fine-tuning run ends with (over all its pieces where it resumed: ``engine.FitResult``);
    ``earlier_seconds``: the training time of the pieces before this one."""

    steps: int
    final_loss: float
    examples_per_second: float
    log_path: Path
    earlier_seconds: float = 0.0


def planned_steps(steps_per_epoch: int, config: TrainConfig) -> int:
    """Training steps of a run: every epoch's batches, capped by ``max_steps``."""
    return engine.planned_steps(steps_per_epoch, config.epochs, config.max_steps)


def asks_packing(model: nn.Module, config: TrainConfig, device: torch.device) -> bool:
    """What ``train.packing`` resolves to for ``model`` trained on ``device`` (``device.resolved_packing``): the
    value a run's identity holds."""
    return resolved_packing(config, device, isinstance(model, BiEncoder))


def packs(model: nn.Module, config: TrainConfig, device: torch.device) -> bool:
    """Whether ``model`` trains packed on ``device`` (``train.packing``, ``models.packing``): as set where true or
    false; where ``auto``, when ``asks_packing`` and the model's encoders can pack (padded otherwise, without an
    error; a model's architecture is part of a run's identity, so its resolution is the same on resuming)."""
    return asks_packing(model, config, device) and (config.packing is True or can_pack(model))


def run_identity(config: TrainConfig, identity: dict | None = None, packing: bool | None = None) -> dict:
    """What a fine-tuning run's checkpoints must match: ``config``'s training settings (``packing: auto`` as
    ``packing``, what ``asks_packing`` resolved it to) and the caller's (data, model, negatives, batch order)."""
    return {"train": training_identity(config, packing), **(identity or {})}


def checkpoints_of(
    run_dir: Path, config: TrainConfig, identity: dict | None = None, packing: bool | None = None
) -> Checkpoints:
    """The checkpoints of a fine-tuning run; ``identity`` adds the caller's settings (data, model, ...)."""
    return Checkpoints(run_dir, config.keep_checkpoints, run_identity(config, identity, packing))


def resume_step(run_dir: Path, config: TrainConfig, identity: dict | None = None, packing: bool | None = None) -> int:
    """The step ``train`` will resume from in ``run_dir`` (0 for a fresh run); ``packing`` as in ``run_identity``."""
    resumed = checkpoints_of(run_dir, config, identity, packing).latest()
    return resumed.step if resumed else 0


class BiEncoderTask(engine.Task):
    """A bi-encoder (any retriever kind: dense, SPLADE, ColBERT) trained on ``data`` with ``objective``; the
    objective may train a head of its own and keep state across steps (a MoCo queue, pre-batch memory)."""

    prefetch = True
    distributed = True

    def __init__(
        self,
        model: BiEncoder,
        data: TrainingData,
        config: TrainConfig,
        run_dir: Path,
        planner: BatchPlanner | None = None,
        objective: Objective | None = None,
    ) -> None:
        self.model, self.data, self.config, self.run_dir = model, data, config, run_dir
        self.shardable = isinstance(model, BiEncoder)  # FSDP: dense bi-encoders (SPLADE ties its MLM head)
        if config.packing is True:  # an encoder it cannot pack: one line before training
            enable_packing(model)
        # mixed-in pairs (data.mix) fill the rest of every batch: the planner plans the main queries' share
        self.planner = planner or RandomPlanner(len(data), config.batch_size - data.mixed_per_batch, config.seed)
        self.objective = objective or InfoNCE(config.bidirectional)
        self.steps_per_epoch, self.epochs = self.planner.steps_per_epoch, config.epochs

    @override
    def setup(self, device: torch.device) -> None:
        self.device = device
        if packs(self.model, self.config, device):
            enable_packing(self.model)
        elif hasattr(self.model, "packing"):  # padded, whatever an earlier run of this model object did
            self.model.packing = False
        use_cpu_dropout(self.model.to(device).train(), device)  # on the CPU, faster dropout masks (models.dropout)
        self.objective.to(device)
        if self.config.freeze_layers is not None:
            freeze_bottom(self.model, self.config.freeze_layers)
        # batches are collated and tokenised one step ahead in a worker thread, with its own tokenizer, which
        # answers from the run's token cache the texts it holds
        self.tokenizer = copy.deepcopy(self.model.tokenizer)
        if self.config.token_cache:
            lengths = {"passage": self.config.passage_max_length}
            texts = self.data.texts_in_use()
            self.tokenizer = cached_tokenizer(self.model, texts, self.run_dir / "token_cache", self.tokenizer, lengths)

    @override
    def parameter_groups(self) -> list[dict]:
        parameters = (*self.model.parameters(), *self.objective.parameters())
        return [{"params": [p for p in parameters if p.requires_grad]}]

    @override
    def named_weights(self):
        return self.model.named_parameters()

    @override
    def plan(self, epoch: int) -> Iterable[list[int]]:
        return (list(members) for members in self.planner(epoch))

    @override
    def prepare(self, epoch: int, index: int, members: list[int]):
        batch = self.data.collate(
            members,
            seed=(self.config.seed, epoch, index),
            rank=distributed.rank(),
            world=distributed.world_size(),
            step=epoch * self.steps_per_epoch + index,
        )
        pin = self.device.type == "cuda"
        return members, batch, batch_tensors(self.model, batch, pin, self.tokenizer, self.config.passage_max_length)

    @override
    def step(self, prepared, context: engine.StepContext) -> engine.StepOutput:
        members, batch, tensors = prepared
        out = forward_backward(
            self.model, batch, context.device, self.objective, self.config.grad_cache_chunk, context.bf16, tensors
        )
        terms = {"mixed_queries": float(self.data.mixed_per_batch)} if self.data.mix else {}
        return engine.StepOutput(out.loss, size=len(members) + self.data.mixed_per_batch, terms=terms, outputs=out)

    @override
    def after_step(self, output: engine.StepOutput, prepared) -> None:
        out = output.outputs
        self.objective.after_step(self.model, out.queries, out.passages, out.batch)

    @override
    def save(self, checkpoint: Path) -> None:
        self.model.save(checkpoint / "model")

    @override
    def load(self, checkpoint: Path, device: torch.device) -> None:
        saved = type(self.model).from_pretrained(str(checkpoint / "model"), config=self.model.config)  # any kind
        self.model.load_state_dict(saved.state_dict())
        self.model.to(device)

    @override
    def state_dict(self) -> dict:
        return {"objective": self.objective.state_dict()}

    @override
    def load_state_dict(self, state: dict) -> None:
        self.objective.load_state_dict(state["objective"])


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
    (default: ``InfoNCE(config.bidirectional)``); its state is checkpointed with the model.
    ``on_step_end(step)`` runs on every process after each step, before that step's checkpoint (a callback
    that writes files writes them from rank 0); ``on_epoch_end(epoch)`` runs on rank 0 only."""
    task = BiEncoderTask(model, data, config, run_dir, planner, objective)
    result = engine.fit(
        task,
        config,
        run_dir,
        device,
        total=planned_steps(task.steps_per_epoch, config),
        identity=run_identity(config, identity, asks_packing(model, config, device)),
        callbacks=[engine.Hooks(on_step_end, on_epoch_end)] if on_step_end or on_epoch_end else [],
    )
    return TrainResult(result.steps, result.final_loss, result.per_second, result.log_path, result.earlier_seconds)
