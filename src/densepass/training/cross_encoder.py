"""Fine-tuning a cross-encoder reranker on hard-negative pools (neural-retrieval-lecture: "cross-encoder
re-ranking ... binary cross-entropy"; localized contrastive estimation, Gao et al. 2021).

Each step takes ``batch_size`` training queries; each brings a *group*: its positive and
``negatives_per_query`` negatives drawn from its pool (``TrainingData``: the same pools, false-negative
filters and seeded draws as bi-encoder training). The cross-encoder scores every (query, passage) pair
of the step in one forward pass; the loss is listwise (softmax cross-entropy over each group) or
pointwise (binary cross-entropy of every pair): ``losses.localized_contrastive``.

The training engine (``training.engine``) runs it: AdamW with linear warm-up, clipping, checkpoints (the
model as a loadable cross-encoder) and exact resume. Pairs are tokenised one step ahead in a worker thread.

Under torch.distributed every process collates the whole step (rank 0's plan), scores the pairs of its share of the
groups (``training.distributed.shares``: contiguous groups, so a group's softmax never spans two processes' rows)
and gathers every process's logits (only its own carry gradient): each computes the loss of the global step and the
engine sums the gradients, so the update is that of one process on the whole step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification
from typing_extensions import override

from densepass import distributed
from densepass.checkpoints import training_identity
from densepass.config import RerankerTrainConfig
from densepass.device import autocast_context
from densepass.errors import ConfigError
from densepass.losses.localized_contrastive import localized_contrastive_loss, pointwise_bce_loss
from densepass.models.cross_encoder import CrossEncoder, packed_logits, packing_refusal
from densepass.models.dropout import use_cpu_dropout
from densepass.models.inputs import forward_in_pieces, piece_tokens
from densepass.models.packing import use_packed_attention
from densepass.training import engine
from densepass.training.batches import TrainingBatch, TrainingData
from densepass.training.distributed import gather_rows, shares
from densepass.training.trainer import RandomPlanner, TrainResult, planned_steps


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


class CrossEncoderTask(engine.Task):
    """A cross-encoder trained on the groups of ``data``: every (query, passage) pair of a step scored in one
    forward pass (in pieces on the CPU), then the listwise or pointwise loss; under torch.distributed each process
    scores its share of the groups (module docstring)."""

    section = "reranker.train"
    description = "train cross-encoder"
    prefetch = True
    distributed = True
    shardable = True  # FSDP (training.sharding): with equal shares, so that every process runs every step's forward

    def __init__(self, model: CrossEncoder, data: TrainingData, config: RerankerTrainConfig) -> None:
        n = config.negatives_per_query
        if data.negatives_per_query != n:
            raise ConfigError(f"the training data draws {data.negatives_per_query} negatives per query, the config {n}")
        world = distributed.world_size()
        if config.fsdp and config.batch_size % world:
            raise ConfigError(
                f"reranker.train.fsdp: reranker.train.batch_size {config.batch_size} must split evenly over the "
                f"{world} processes (each scores a share of every step)"
            )
        self.model, self.data, self.config = model, data, config
        self.planner = RandomPlanner(len(data), config.batch_size, config.seed)
        self.steps_per_epoch, self.epochs = self.planner.steps_per_epoch, config.epochs
        self.loss_fn = localized_contrastive_loss if config.loss == "listwise" else pointwise_bce_loss
        refusal = packing_refusal(model.model) if config.packing else None
        if refusal:
            raise ConfigError(refusal)
        if config.packing:
            use_packed_attention(model.model)

    @override
    def setup(self, device: torch.device) -> None:
        self.net = use_cpu_dropout(self.model.model.to(device).train(), device)  # faster masks on the CPU
        self.tokenizer = copy.deepcopy(self.model.tokenizer)  # batches are tokenised in a worker thread

    @override
    def network(self) -> torch.nn.Module:
        return self.net

    @override
    def parameter_groups(self) -> list[dict]:
        return parameter_groups(self.model, self.config)

    @override
    def named_weights(self):
        return self.net.named_parameters()

    @override
    def plan(self, epoch: int):
        return (list(members) for members in self.planner(epoch))

    @override
    def prepare(self, epoch: int, index: int, members: list[int]) -> tuple[int, list[int], dict[str, torch.Tensor]]:
        """The step's size, the pairs each process scores, and this process's pairs tokenised (padded as the whole
        step's, so that each pair is tokenised as in one process)."""
        batch = self.data.collate(members, seed=(self.config.seed, epoch, index))
        pairs = group_pairs(batch, self.config.negatives_per_query)
        tokens = self.model.tokenize(*pairs, tokenizer=self.tokenizer)
        group = self.config.negatives_per_query + 1
        parts = shares(len(members))
        mine = parts[distributed.rank()]
        if len(parts) > 1:
            tokens = {k: v[mine.start * group : mine.stop * group] for k, v in tokens.items()}
        return len(members), [len(part) * group for part in parts], tokens

    @override
    def step(self, batch, context: engine.StepContext) -> engine.StepOutput:
        size, counts, tokens = batch
        if counts[distributed.rank()]:
            with autocast_context(context.device, context.bf16):
                pieces = piece_tokens(context.device)
                tokens = {k: v.to(context.device) for k, v in tokens.items()}
                if self.config.packing:  # padding-free (models.packing)
                    logits = forward_in_pieces(partial(packed_logits, self.net), tokens, pieces, packed=True)
                else:
                    logits = forward_in_pieces(self.model.logits, tokens, pieces)
        else:  # more processes than groups: this one scores none
            logits = torch.zeros(0, device=context.device)
        logits = gather_rows(logits, counts)
        loss = self.loss_fn(logits.view(size, self.config.negatives_per_query + 1))
        if loss.requires_grad:  # not when this process scored no pair
            loss.backward()
        return engine.StepOutput(loss.detach(), size=size)

    @override
    def save(self, checkpoint: Path) -> None:
        self.model.save(checkpoint / "model")

    @override
    def load(self, checkpoint: Path, device: torch.device) -> None:
        saved = AutoModelForSequenceClassification.from_pretrained(str(checkpoint / "model"))
        self.net.load_state_dict(saved.state_dict())

    @override
    def finish(self) -> None:
        self.net.eval()


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
    ``on_step_end(step)`` is called after every step, before its checkpoint."""
    task = CrossEncoderTask(model, data, config)
    result = engine.fit(
        task,
        config,
        run_dir,
        device,
        total=planned_steps(task.steps_per_epoch, config),
        identity={"reranker": training_identity(config), **(identity or {})},
        bf16=bf16,
        callbacks=[engine.Hooks(on_step_end)] if on_step_end is not None else [],
    )
    return TrainResult(result.steps, result.final_loss, result.per_second, result.log_path, result.earlier_seconds)
