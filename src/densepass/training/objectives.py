"""What the trainer minimises: an objective turns the global batch's representations into a loss.

``forward_backward`` (``training.step``) embeds the batch (with gradient caching when asked), gathers the
representations of every process (only this process's rows carry gradient) and calls the objective
with them and the batch's tensors (positive columns, false-negative mask, passage content keys, the
queries' relevant keys, and per-batch extras such as teacher scores). Scores come from
``model.similarity(queries, passages)``, so the same objective trains any model that defines it.

An objective may keep state across steps (a memory of earlier batches, a queue, a momentum encoder):
``after_step`` updates it once the optimiser has stepped, and ``state_dict`` / ``load_state_dict`` put it
in the trainer's checkpoints, so an interrupted run resumes to the same model. An objective may also have
trainable ``parameters`` of its own (optimised with the model's) and modules to move ``to`` the device.

>>> import torch
>>> from densepass.training.batches import BatchTensors
>>> class Dot(torch.nn.Module):
...     class config:
...         temperature = 1.0
...     def similarity(self, q, p):
...         return q @ p.T
>>> batch = BatchTensors({}, {}, torch.tensor([0, 1]), torch.zeros(2, 2, dtype=torch.bool))
>>> round(float(Contrastive()(Dot(), torch.eye(2), torch.eye(2), batch)), 4)
0.3133
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from densepass.errors import ConfigError
from densepass.losses.contrastive import info_nce
from densepass.losses.listwise_kl import listwise_kl_loss
from densepass.losses.margin_mse import margin_mse_loss
from densepass.training.batches import BatchTensors


class Objective:
    """Base class: a loss of the global batch, with optional state kept across steps."""

    def __call__(
        self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors
    ) -> torch.Tensor:
        """The loss of the global batch (``queries`` [B, ...], ``passages`` [P, ...], all processes')."""
        raise NotImplementedError

    def after_step(self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors) -> None:
        """Update the state after the optimiser step, from the step's detached representations."""

    def state_dict(self) -> dict:
        """The state to checkpoint (tensors and plain values)."""
        return {}

    def parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of the objective itself (e.g. a scoring head), optimised with the model's."""
        return []

    def to(self, device: torch.device) -> Objective:
        """Move the objective's tensors and modules to ``device``."""
        return self

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output."""

    def describe(self) -> str:
        """One line for reports."""
        return type(self).__name__


@dataclass
class Contrastive(Objective):
    """InfoNCE over in-batch and shared hard negatives (negative-contrast eq. 1; with ``bidirectional``,
    eq. 3), false negatives masked."""

    bidirectional: bool = False

    def __call__(
        self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors
    ) -> torch.Tensor:
        """InfoNCE of the batch's similarities over the model's temperature."""
        scores = model.similarity(queries, passages) / model.config.temperature
        return info_nce(scores, batch.positive_index, batch.mask, self.bidirectional)

    def describe(self) -> str:
        """One line for reports."""
        return "contrastive (bidirectional)" if self.bidirectional else "contrastive"


TEACHER_SCORES = "teacher_scores"  # BatchTensors.extras key: [B, 1 + h] teacher scores of each query's candidates


def own_candidates(scores: torch.Tensor, positive_index: torch.Tensor) -> torch.Tensor:
    """Each query's scores of its own candidates ``[B, 1 + h]`` (its positive, then its h hard negatives)
    out of the global batch's ``[B, P]`` score matrix, whose columns are every query's positive, then
    every query's hard negatives query by query (``training.batches``)."""
    n_queries, n_passages = scores.shape
    h, rest = divmod(n_passages - n_queries, n_queries)
    if rest or h < 1:
        raise ConfigError(
            f"distillation needs the same number (>= 1) of hard negatives per query; the batch has "
            f"{n_passages} passages for {n_queries} queries"
        )
    negatives = (
        n_queries + torch.arange(n_queries, device=scores.device)[:, None] * h + torch.arange(h, device=scores.device)
    )
    columns = torch.cat([positive_index[:, None].to(scores.device), negatives], dim=1)
    return scores.gather(1, columns)


@dataclass
class Distillation(Objective):
    """A cross-encoder teacher distilled into the bi-encoder over each query's 1 + h candidates: Margin-MSE
    (neural-retrieval-lecture) or listwise KL with a temperature (training-inference-gap §2's distillation
    from a cross encoder), alone or added to the contrastive loss: ``contrastive + weight * distillation``.

    The student's scores are its logits, similarity over the model's temperature (those of the contrastive
    loss); the teacher's, the cross-encoder's logits, arrive per batch in ``extras["teacher_scores"]``
    (NaN where a candidate was not scored: left out)."""

    loss: Literal["margin-mse", "kl"] = "kl"
    weight: float = 1.0
    temperature: float = 1.0
    contrastive: Contrastive | None = None

    def __post_init__(self) -> None:
        if self.loss not in ("margin-mse", "kl"):
            raise ConfigError(f"unknown distillation loss {self.loss!r} (use margin-mse or kl)")

    def __call__(
        self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors
    ) -> torch.Tensor:
        """The weighted distillation term (plus the contrastive loss when configured)."""
        if TEACHER_SCORES not in batch.extras:
            raise ConfigError("distillation needs teacher scores in the batch (TrainingData(teacher_scores=...))")
        scores = model.similarity(queries, passages) / model.config.temperature
        student = own_candidates(scores, batch.positive_index)
        teacher = batch.extras[TEACHER_SCORES]
        if self.loss == "margin-mse":
            term = margin_mse_loss(student, teacher)
        else:
            term = listwise_kl_loss(student, teacher, self.temperature)
        if self.contrastive is None:
            return self.weight * term
        return info_nce(scores, batch.positive_index, batch.mask, self.contrastive.bidirectional) + self.weight * term

    def describe(self) -> str:
        """One line for reports."""
        what = "Margin-MSE" if self.loss == "margin-mse" else f"listwise KL (T={self.temperature:g})"
        extra = f" + {self.contrastive.describe()}" if self.contrastive else ""
        return f"distillation: {self.weight:g} x {what}{extra}"
