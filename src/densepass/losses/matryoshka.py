"""Matryoshka representation learning (MRL): one model whose first 64, 128, 256 ... dimensions are each a usable
embedding, trained by adding up a base objective's loss at each prefix dimension.

With a base objective L (InfoNCE, the unified λ loss, distillation: any whose scores come from the embeddings),
prefix dimensions d_1 > ... > d_m and weights c_1 ... c_m,

    L_MRL(Q, P) = Σ_i c_i · L( t_{d_i}(Q), t_{d_i}(P) )

where t_d keeps the first d numbers of each embedding and, for a model that L2-normalises, normalises them again
(``models.matryoshka.truncate``): each prefix is trained as the embedding it is searched as. MRL §3 trains with
weights 1 at nested dimensions halving down to 8; sentence-transformers' ``MatryoshkaLoss`` is the same sum.

>>> from densepass.losses import InfoNCE
>>> Matryoshka(InfoNCE(), dims=[384, 256, 128, 64]).describe()
'Matryoshka (384, 256, 128, 64; weights 1, 1, 1, 1) of contrastive'
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from densepass.errors import ConfigError
from densepass.losses.batch import BatchTensors
from densepass.losses.objectives import Objective, Sum
from densepass.models.matryoshka import check_dims, truncate


class Matryoshka(Objective):
    """``base`` at each of ``dims`` (the embeddings' prefixes, normalised again when the model normalises), weighted
    by ``weights`` (default 1 each) and summed (module docstring). Composes like any objective:
    ``Matryoshka(InfoNCE(), [384, 128]) + other``. The base must score from the embeddings alone: an objective with
    state (a memory of earlier batches, a queue) or a head of its own holds full-size vectors and is refused."""

    def __init__(self, base: Objective, dims: Sequence[int], weights: Sequence[float] | None = None) -> None:
        if not isinstance(base, Objective):
            raise ConfigError(f"Matryoshka wraps a densepass objective, got {type(base).__name__}")
        if not _stateless(base):
            raise ConfigError(
                f"Matryoshka needs a base objective that scores the embeddings alone; {base.describe()} keeps a "
                "memory, a queue or a head of full-size vectors (use loss.memory: none and loss.kind: contrastive)"
            )
        self.dims = check_dims(dims)
        order = sorted(range(len(dims)), key=lambda i: -int(dims[i]))  # largest first, as check_dims sorts
        weights = [1.0] * len(self.dims) if weights is None else [float(w) for w in weights]
        if len(weights) != len(self.dims):
            raise ConfigError(f"train.matryoshka_weights has {len(weights)} weights for {len(self.dims)} dimensions")
        if any(not (w >= 0 and w < float("inf")) for w in weights) or not any(weights):
            raise ConfigError(f"train.matryoshka_weights must be finite, >= 0 and not all 0, got {weights}")
        self.weights = tuple(weights[i] for i in order)  # each weight stays with its dimension
        self.base = base

    def __call__(
        self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors
    ) -> torch.Tensor:
        """Σ_i c_i · base(prefix d_i of the queries, prefix d_i of the passages)."""
        if max(self.dims) > queries.shape[-1]:
            raise ConfigError(
                f"train.matryoshka_dims asks for {max(self.dims)} dimensions of {queries.shape[-1]}-dimensional "
                "embeddings"
            )
        normalize = bool(getattr(model.config, "normalize", False))
        total = None
        for dim, weight in zip(self.dims, self.weights):
            if weight == 0:
                continue
            loss = weight * self.base(
                model, truncate(queries, dim, normalize), truncate(passages, dim, normalize), batch
            )
            total = loss if total is None else total + loss
        return total

    def describe(self) -> str:
        """One line for reports."""
        dims = ", ".join(str(d) for d in self.dims)
        weights = ", ".join(f"{w:g}" for w in self.weights)
        return f"Matryoshka ({dims}; weights {weights}) of {self.base.describe()}"

    def identity(self) -> dict:
        """Its dimensions and weights, and the base objective's."""
        return {
            "objective": "Matryoshka",
            "dims": [int(d) for d in self.dims],
            "weights": [float(w) for w in self.weights],
            "base": self.base.identity(),
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Matryoshka) and (self.base, self.dims, self.weights) == (
            other.base,
            other.dims,
            other.weights,
        )


def _stateless(objective: Objective) -> bool:
    """Whether ``objective`` scores from the batch's embeddings alone (no parameters, no state kept across steps)."""
    if isinstance(objective, Sum):
        return all(_stateless(term) for term in objective.terms)
    return not objective.parameters() and not objective.state_dict()


def trained_dims(objective: Objective, weighted: bool = True) -> tuple[int, ...] | None:
    """The prefix dimensions ``objective`` trains (a ``Matryoshka``, alone or a term of a sum; a dimension of
    weight 0 is not trained), None when it trains the full embedding only: what a saved model records. With
    ``weighted`` False, every dimension it names, of weight 0 too (what it must be able to cut)."""
    if isinstance(objective, Matryoshka):
        dims = [d for d, w in zip(objective.dims, objective.weights) if w > 0 or not weighted]
        return tuple(dims) or None
    terms = getattr(objective, "terms", ())
    return next((dims for term in terms if (dims := trained_dims(term, weighted))), None)
