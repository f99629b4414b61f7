"""A momentum (exponential moving average) copy of a bi-encoder's passage side: MoCo's key encoder.

MoCo (He et al. 2020), as Contriever uses it (neural-retrieval-lecture): the keys in the queue come from an
encoder that is not trained by gradient but follows the trained one slowly, after every optimiser step

    θ_k <- m θ_k + (1 - m) θ        (Contriever: m = 0.9995)

so keys written many steps apart stay comparable. The copy holds the passage tower and the projection
(one encoder when the towers are shared), starts equal to the model, runs without dropout (eval mode,
no random numbers drawn, so a resumed run's keys are the same) and never requires gradients.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder


def passage_parameters(model: BiEncoder) -> list[nn.Parameter]:
    """The parameters that embed passages: the passage tower's, then the projection's."""
    projection = list(model.projection.parameters()) if model.projection is not None else []
    return [*model.passage_encoder.parameters(), *projection]


class MomentumEncoder(nn.Module):
    """An EMA copy of ``model``'s passage side with rate ``momentum`` (0 <= m <= 1; m = 1 never moves)."""

    def __init__(self, model: BiEncoder, momentum: float) -> None:
        super().__init__()
        if not 0 <= momentum <= 1:
            raise ConfigError(f"momentum must be in [0, 1], got {momentum}")
        self.momentum = momentum
        encoder = copy.deepcopy(model.passage_encoder)
        projection = copy.deepcopy(model.projection)
        config = dataclasses.replace(model.config, shared=True)
        self.copy = BiEncoder(encoder, encoder, model.tokenizer, config, projection).requires_grad_(False).eval()

    @property
    def dim(self) -> int:
        """The keys' dimension."""
        return self.copy.dim

    def train(self, mode: bool = True) -> MomentumEncoder:
        """Stays in eval mode: keys are computed without dropout."""
        return self

    @torch.no_grad()
    def update(self, model: BiEncoder) -> None:
        """One EMA step towards ``model``'s current passage-side weights."""
        mine, theirs = passage_parameters(self.copy), passage_parameters(model)
        if len(mine) != len(theirs) or any(a.shape != b.shape for a, b in zip(mine, theirs)):
            raise ConfigError("the momentum encoder does not have the model's architecture")
        for key, query in zip(mine, theirs):
            key.mul_(self.momentum).add_(query.detach().to(key.device), alpha=1 - self.momentum)

    @torch.no_grad()
    def encode(self, tokens: dict[str, torch.Tensor], chunk_size: int | None = None) -> torch.Tensor:
        """Key embeddings [n, dim] (float32) of tokenised passages, ``chunk_size`` rows at a time."""
        ids, mask = tokens["input_ids"], tokens["attention_mask"]
        size = chunk_size or max(len(ids), 1)
        parts = [self.copy(ids[i : i + size], mask[i : i + size], side="passage") for i in range(0, len(ids), size)]
        return torch.cat(parts).float() if parts else torch.zeros(0, self.dim, device=ids.device)

    def weights(self) -> list[torch.Tensor]:
        """Copies of the EMA weights, in ``passage_parameters`` order (for a checkpoint)."""
        return [p.detach().clone() for p in passage_parameters(self.copy)]

    @torch.no_grad()
    def load_weights(self, weights: list[torch.Tensor]) -> None:
        """Restore ``weights()`` output; another architecture is a one-line ConfigError."""
        mine = passage_parameters(self.copy)
        if len(weights) != len(mine) or any(tuple(w.shape) != tuple(p.shape) for w, p in zip(weights, mine)):
            raise ConfigError("the saved momentum encoder does not have the model's architecture (or dimension)")
        for param, saved in zip(mine, weights):
            param.copy_(saved)
