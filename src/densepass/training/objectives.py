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
>>> from densepass.training.step import BatchTensors
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
from typing import TYPE_CHECKING

import torch
from torch import nn

from densepass.losses.contrastive import info_nce

if TYPE_CHECKING:
    from densepass.training.step import BatchTensors


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
