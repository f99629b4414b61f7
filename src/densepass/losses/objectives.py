"""What a retriever's training minimises: an objective turns the global batch's representations into a loss.

Objectives compose with ``+``: ``InfoNCE() + FLOPS(lambda_q=5e-4, lambda_d=3e-4)`` is SPLADE's loss,
``Distillation("kl") + FLOPS(...)`` distils into SPLADE; each term keeps its own state.

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
>>> from densepass.losses.batch import BatchTensors
>>> class Dot(torch.nn.Module):
...     class config:
...         temperature = 1.0
...     def similarity(self, q, p):
...         return q @ p.T
>>> batch = BatchTensors({}, {}, torch.tensor([0, 1]), torch.zeros(2, 2, dtype=torch.bool))
>>> round(float(InfoNCE()(Dot(), torch.eye(2), torch.eye(2), batch)), 4)
0.3133
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from densepass.errors import ConfigError
from densepass.losses.batch import BatchTensors
from densepass.losses.contrastive import info_nce
from densepass.losses.flops import flops, quadratic_warmup
from densepass.losses.listwise_kl import listwise_kl_loss
from densepass.losses.margin_mse import margin_mse_loss


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

    def identity(self) -> dict:
        """What a resumed run must train with again: the objective's kind and exact settings, as JSON (``describe``
        rounds numbers for reading). An objective with settings of its own says them here; the default is its
        kind and description."""
        return {"objective": type(self).__name__, "describe": self.describe()}

    def __add__(self, other: Objective) -> Sum:
        """The sum of both objectives (each term keeps its own state and parameters)."""
        if not isinstance(other, Objective):
            return NotImplemented
        terms = [*(self.terms if isinstance(self, Sum) else [self])]
        return Sum([*terms, *(other.terms if isinstance(other, Sum) else [other])])


class Sum(Objective):
    """``terms[0] + terms[1] + ...`` (made by ``+``): the losses add up; ``after_step``, ``to``, the parameters and
    the state are each term's."""

    def __init__(self, terms: list[Objective]) -> None:
        self.terms = terms

    def __call__(
        self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors
    ) -> torch.Tensor:
        """The sum of the terms' losses."""
        return sum(
            (term(model, queries, passages, batch) for term in self.terms[1:]),
            self.terms[0](model, queries, passages, batch),
        )

    def after_step(self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors) -> None:
        """Every term's ``after_step``."""
        for term in self.terms:
            term.after_step(model, queries, passages, batch)

    def state_dict(self) -> dict:
        """Every term's state, in order."""
        return {"terms": [term.state_dict() for term in self.terms]}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output."""
        if len(state.get("terms", ())) != len(self.terms):
            raise ConfigError(
                "the checkpoint's objective has other terms than this run's (an older densepass's SPLADE run?): "
                "--restart to train from the start"
            )
        for term, saved in zip(self.terms, state["terms"]):
            term.load_state_dict(saved)

    def parameters(self) -> list[nn.Parameter]:
        """Every term's trainable parameters."""
        return [p for term in self.terms for p in term.parameters()]

    def to(self, device: torch.device) -> Sum:
        """Every term on ``device``."""
        self.terms = [term.to(device) for term in self.terms]
        return self

    def describe(self) -> str:
        """The terms' lines joined by ``+``."""
        return " + ".join(term.describe() for term in self.terms)

    def identity(self) -> dict:
        """Every term's, in order."""
        return {"objective": "Sum", "terms": [term.identity() for term in self.terms]}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sum) and self.terms == other.terms


@dataclass
class InfoNCE(Objective):
    """InfoNCE over in-batch and shared hard negatives (negative-contrast eq. 1; with ``bidirectional``,
    eq. 3), false negatives masked: ``-log e^{s(q, p+)/τ} / Σ_p e^{s(q, p)/τ}`` over the batch's passages.
    ``temperature`` τ: None for the model's own (``model.config.temperature``).

    >>> InfoNCE(temperature=0.05).describe()
    'contrastive (τ 0.05)'
    """

    bidirectional: bool = False
    temperature: float | None = None

    def __post_init__(self) -> None:
        if self.temperature is not None and not self.temperature > 0:
            raise ConfigError(f"InfoNCE temperature must be > 0, got {self.temperature}")

    def __call__(
        self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors
    ) -> torch.Tensor:
        """InfoNCE of the batch's similarities over the temperature."""
        temperature = self.temperature if self.temperature is not None else model.config.temperature
        scores = model.similarity(queries, passages) / temperature
        return info_nce(scores, batch.positive_index, batch.mask, self.bidirectional)

    def identity(self) -> dict:
        """Its direction and temperature."""
        temperature = None if self.temperature is None else float(self.temperature)  # (a numpy number: JSON's)
        return {"objective": "InfoNCE", "bidirectional": bool(self.bidirectional), "temperature": temperature}

    def describe(self) -> str:
        """One line for reports."""
        what = "contrastive (bidirectional)" if self.bidirectional else "contrastive"
        return (
            what
            if self.temperature is None
            else f"{what[:-1]}, τ {self.temperature:g})"
            if self.bidirectional
            else f"{what} (τ {self.temperature:g})"
        )


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
    contrastive: InfoNCE | None = None

    def __post_init__(self) -> None:
        if self.loss not in ("margin-mse", "kl"):
            raise ConfigError(f"unknown distillation loss {self.loss!r} (use margin-mse or kl)")
        if not self.weight >= 0 or not self.temperature > 0:  # (NaN fails both)
            raise ConfigError(
                f"distillation weight must be >= 0 and temperature > 0, got {self.weight} and {self.temperature}"
            )

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
        # the contrastive term at its own temperature (None: the model's, where it reuses these scores' values)
        return self.contrastive(model, queries, passages, batch) + self.weight * term

    def describe(self) -> str:
        """One line for reports."""
        what = "Margin-MSE" if self.loss == "margin-mse" else f"listwise KL (T={self.temperature:g})"
        extra = f" + {self.contrastive.describe()}" if self.contrastive else ""
        return f"distillation: {self.weight:g} x {what}{extra}"

    def identity(self) -> dict:
        """Its loss, weight and temperature, and the contrastive term's."""
        contrastive = self.contrastive.identity() if self.contrastive is not None else None
        settings = {"loss": self.loss, "weight": float(self.weight), "temperature": float(self.temperature)}
        return {"objective": "Distillation", **settings, "contrastive": contrastive}


@dataclass
class FLOPS(Objective):
    """SPLADE's FLOPS regulariser (neural-retrieval-lecture): ``lambda_q FLOPS(queries) + lambda_d FLOPS(passages)``
    over the global batch, each λ warmed up quadratically over ``warmup_steps`` optimiser steps
    (``losses.flops``). Added to a base objective: ``InfoNCE() + FLOPS(...)``. The step count is its state, so a
    resumed run continues the warm-up where it stopped.

    >>> (InfoNCE() + FLOPS(lambda_q=5e-4, lambda_d=3e-4, warmup_steps=100)).describe()
    'contrastive + FLOPS (lambda_q 0.0005, lambda_d 0.0003, quadratic warm-up over 100 steps)'
    """

    lambda_q: float = 5e-4
    lambda_d: float = 3e-4
    warmup_steps: int = 100
    step: int = 0

    def __post_init__(self) -> None:
        if not (self.lambda_q >= 0 and self.lambda_d >= 0) or self.warmup_steps < 0:
            got = f"{self.lambda_q}, {self.lambda_d}, {self.warmup_steps}"
            raise ConfigError(f"FLOPS lambdas and warmup_steps must be >= 0, got {got}")

    def __call__(
        self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors
    ) -> torch.Tensor:
        """The warmed-up FLOPS terms of both sides."""
        lambda_q = quadratic_warmup(self.lambda_q, self.step, self.warmup_steps)
        lambda_d = quadratic_warmup(self.lambda_d, self.step, self.warmup_steps)
        return lambda_q * flops(queries) + lambda_d * flops(passages)

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
            f"FLOPS (lambda_q {self.lambda_q:g}, lambda_d {self.lambda_d:g}, "
            f"quadratic warm-up over {self.warmup_steps} steps)"
        )

    def identity(self) -> dict:
        """Its weights and warm-up (the step reached is state, not a setting)."""
        lambdas = {"lambda_q": float(self.lambda_q), "lambda_d": float(self.lambda_d)}
        return {"objective": "FLOPS", **lambdas, "warmup": int(self.warmup_steps)}
