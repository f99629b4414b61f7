"""SPLADE's training objective: the contrastive loss plus the FLOPS regulariser of both sides, warmed up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from densepass.losses.flops import flops, quadratic_warmup
from densepass.training.objectives import Contrastive

if TYPE_CHECKING:
    from densepass.training.step import BatchTensors


@dataclass
class SpladeObjective(Contrastive):
    """SPLADE's loss (neural-retrieval-lecture): the contrastive loss plus lambda_q FLOPS(queries) +
    lambda_d FLOPS(passages) over the global batch, each lambda warmed up quadratically over
    ``warmup_steps`` optimiser steps (``losses.flops``). The step count is the objective's state, so a
    resumed run continues the warm-up where it stopped."""

    lambda_q: float = 5e-4
    lambda_d: float = 3e-4
    warmup_steps: int = 100
    step: int = 0

    def __call__(
        self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors
    ) -> torch.Tensor:
        """Contrastive loss + the warmed-up FLOPS terms of both sides."""
        loss = super().__call__(model, queries, passages, batch)
        lambda_q = quadratic_warmup(self.lambda_q, self.step, self.warmup_steps)
        lambda_d = quadratic_warmup(self.lambda_d, self.step, self.warmup_steps)
        return loss + lambda_q * flops(queries) + lambda_d * flops(passages)

    def after_step(self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors) -> None:
        """Count the step (the warm-up's clock)."""
        self.step += 1

    def state_dict(self) -> dict:
        """The warm-up's step."""
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        """Restore the warm-up's step."""
        self.step = int(state["step"])

    def describe(self) -> str:
        """One line for reports."""
        return (
            f"contrastive + FLOPS (lambda_q {self.lambda_q:g}, lambda_d {self.lambda_d:g}, "
            f"quadratic warm-up over {self.warmup_steps} steps)"
        )
