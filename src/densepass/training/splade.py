"""SPLADE's training objective: a base objective (the contrastive loss, or distillation from a cross-encoder)
plus the FLOPS regulariser of both sides, warmed up."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from densepass.losses.flops import flops, quadratic_warmup
from densepass.training.batches import BatchTensors
from densepass.training.objectives import Contrastive, Objective


@dataclass
class SpladeObjective(Objective):
    """SPLADE's loss (neural-retrieval-lecture): ``base`` (the contrastive loss by default, or a ``Distillation``)
    plus lambda_q FLOPS(queries) + lambda_d FLOPS(passages) over the global batch, each lambda warmed up
    quadratically over ``warmup_steps`` optimiser steps (``losses.flops``). The step count is the objective's
    state (with the base's), so a resumed run continues the warm-up where it stopped.

        >>> objective = SpladeObjective(lambda_q=5e-4, lambda_d=3e-4, warmup_steps=100)
        >>> objective.describe()
        'contrastive + FLOPS (lambda_q 0.0005, lambda_d 0.0003, quadratic warm-up over 100 steps)'
    """

    lambda_q: float = 5e-4
    lambda_d: float = 3e-4
    warmup_steps: int = 100
    base: Objective = field(default_factory=Contrastive)
    step: int = 0

    def __call__(
        self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors
    ) -> torch.Tensor:
        """The base loss + the warmed-up FLOPS terms of both sides."""
        loss = self.base(model, queries, passages, batch)
        lambda_q = quadratic_warmup(self.lambda_q, self.step, self.warmup_steps)
        lambda_d = quadratic_warmup(self.lambda_d, self.step, self.warmup_steps)
        return loss + lambda_q * flops(queries) + lambda_d * flops(passages)

    def after_step(self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors) -> None:
        """Count the step (the warm-up's clock) and let the base update its state."""
        self.base.after_step(model, queries, passages, batch)
        self.step += 1

    def state_dict(self) -> dict:
        """The warm-up's step and the base's state."""
        return {"step": self.step, "base": self.base.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the warm-up's step and the base's state."""
        self.step = int(state["step"])
        self.base.load_state_dict(state.get("base", {}))

    def parameters(self) -> list[nn.Parameter]:
        """The base's trainable parameters (FLOPS has none)."""
        return self.base.parameters()

    def to(self, device: torch.device) -> SpladeObjective:
        """Move the base's tensors to ``device``."""
        self.base = self.base.to(device)
        return self

    def describe(self) -> str:
        """One line for reports."""
        return (
            f"{self.base.describe()} + FLOPS (lambda_q {self.lambda_q:g}, lambda_d {self.lambda_d:g}, "
            f"quadratic warm-up over {self.warmup_steps} steps)"
        )
