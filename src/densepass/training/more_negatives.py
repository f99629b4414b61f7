"""More negatives per step: pre-batch negatives, a MoCo queue, a λ per negative source, the LTR loss.

``MultiSource`` is the objective. A query's candidates come from three sources: the batch's positives of
the other queries (in-batch), the batch's hard negatives, and a *memory* of earlier steps:

- ``PreBatch(T)``: the passage representations of the previous T global batches, detached, with their
  content keys (training-inference-gap §4.1, N_prb): no extra encoding, but the entries are T steps stale;
- ``MoCoQueue(model, K, m)``: a FIFO of the newest K keys, written by a momentum (EMA) copy of the passage
  encoder that encodes every batch's passages after the optimiser step (MoCo as Contriever uses it,
  neural-retrieval-lecture): one extra forward pass per step, keys that change slowly.

Every memory entry whose passage is relevant to the query (or in the current batch, or held by a newer
entry) is masked by key (``losses.memory.memory_mask``). Under torch.distributed the objective sees the
gathered global batch, so every process holds the same memory of global batches. With gradient caching
the memory is a constant of the loss, so the cached representation gradients stay exact.

The loss over the sources is training-inference-gap eq. 2 (``combine="unified"``: one softmax, source s
weighted by λ_s) or separate terms after eq. 1 (``"separate"``: one softmax per source, in-batch, memory and hard
negatives each, summed with weights λ_s; eq. 1 itself has two terms, in-passage negatives, and in-batch with
pre-batch negatives together under one λ); with
every λ = 1, no memory and the unified form it is exactly ``InfoNCE``. ``ltr_head`` scores pairs with
abs-condenser-openqa eq. 14 instead of similarity / temperature. ``objective_from_config`` builds the
objective a ``LossConfig`` describes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn

from densepass import distributed
from densepass.config import LossConfig, TrainConfig
from densepass.errors import ConfigError
from densepass.losses.batch import BatchTensors
from densepass.losses.contrastive import passage_to_query_loss
from densepass.losses.ltr import ltr_scores
from densepass.losses.memory import NegativeMemory, memory_mask
from densepass.losses.objectives import InfoNCE, Objective
from densepass.losses.unified import separate_terms_loss, unified_loss
from densepass.models.biencoder import BiEncoder
from densepass.models.momentum import MomentumEncoder
from densepass.training.distributed import gather_with_local_grad

IN_BATCH, MEMORY, HARD = 0, 1, 2  # the sources; λ is given in this order
SOURCE_NAMES = ("in-batch", "memory", "hard")


class Memory(Protocol):
    """Negatives kept across steps: entries to score, updated after each optimiser step, checkpointed."""

    memory: NegativeMemory

    def update(self, model: BiEncoder, passages: torch.Tensor, batch: BatchTensors) -> None:
        """Add the step's passages (``passages``: the global batch's detached representations)."""
        ...

    def to(self, device: torch.device) -> None:
        """Move modules to ``device``."""
        ...

    def state_dict(self) -> dict:
        """The state to checkpoint."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output (a missing memory is a one-line ConfigError)."""
        ...

    def describe(self) -> str:
        """One line for reports."""
        ...


def _check_keys(passages: torch.Tensor, batch: BatchTensors) -> None:
    if len(batch.passage_keys) != len(passages):
        raise ConfigError(
            f"a negative memory needs the content key of every passage column ({len(batch.passage_keys)} keys "
            f"for {len(passages)} passages)"
        )


class PreBatch:
    """The passage representations of the previous ``batches`` (T) global batches."""

    def __init__(self, batches: int) -> None:
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ConfigError(f"pre-batch negatives need T >= 1 previous batches, got {batches!r}")
        self.batches = batches
        self.memory = NegativeMemory(max_batches=batches)

    def update(self, model: BiEncoder, passages: torch.Tensor, batch: BatchTensors) -> None:
        """Remember the step's passages as they were embedded for its loss."""
        _check_keys(passages, batch)
        self.memory.push(passages.detach(), batch.passage_keys)

    def to(self, device: torch.device) -> None:
        """Entries move to the device of the representations they are scored against."""

    def state_dict(self) -> dict:
        """The entries and keys."""
        return {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the entries; a checkpoint without them is a one-line ConfigError."""
        self.memory.load_state_dict(state.get("memory"), "pre-batch memory")

    def describe(self) -> str:
        """One line for reports."""
        return f"pre-batch negatives (T = {self.batches})"


class MoCoQueue:
    """A FIFO of ``size`` (K) keys from a momentum copy of ``model``'s passage encoder (rate ``momentum``)."""

    def __init__(self, model: BiEncoder, size: int, momentum: float, chunk_size: int | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"a MoCo queue needs K >= 1 keys, got {size!r}")
        self.size, self.chunk_size = size, chunk_size
        self.memory = NegativeMemory(max_entries=size)
        self.encoder = MomentumEncoder(model, momentum)

    def update(self, model: BiEncoder, passages: torch.Tensor, batch: BatchTensors) -> None:
        """Move the momentum encoder towards the model, then enqueue its keys of the step's passages
        (this process's passages, gathered in the global batch's order: every positive, then every hard
        negative)."""
        _check_keys(passages, batch)
        self.encoder.update(model)
        keys = self.encoder.encode(batch.passages, self.chunk_size)
        b = len(batch.queries["input_ids"])  # this process's queries = its positives
        gathered = torch.cat([gather_with_local_grad(keys[:b]), gather_with_local_grad(keys[b:])])
        self.memory.push(gathered, batch.passage_keys)

    def to(self, device: torch.device) -> None:
        """Move the momentum encoder."""
        self.encoder.to(device)

    def state_dict(self) -> dict:
        """The queue and the momentum encoder's weights."""
        return {"memory": self.memory.state_dict(), "momentum_encoder": self.encoder.weights()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the queue and the momentum encoder; a checkpoint without them is a one-line ConfigError."""
        if "momentum_encoder" not in state:
            raise ConfigError(
                "the checkpoint holds no saved MoCo queue and momentum encoder (it was written by a run without "
                "one); resume with the objective it was trained with, or start over (--restart)"
            )
        self.memory.load_state_dict(state.get("memory"), "MoCo queue")
        self.memory.check_dim(self.encoder.dim, "the momentum encoder's keys")
        self.encoder.load_weights(state["momentum_encoder"])

    def describe(self) -> str:
        """One line for reports."""
        return f"MoCo queue (K = {self.size}, m = {self.encoder.momentum})"


def ltr_head(dim: int) -> nn.Linear:
    """A new eq. 14 head W{q, d} + b for ``dim``-d representations. Every process computes the loss of the
    global batch, so the head's gradient is the whole gradient on each; it is divided by the number of
    processes so that summing gradients over processes gives it once."""
    head = nn.Linear(2 * dim, 1)
    for param in head.parameters():
        param.register_hook(lambda grad: grad / distributed.world_size())
    return head


@dataclass
class MultiSource(Objective):
    """Contrastive (or LTR) loss over in-batch, memory and hard negatives, with λ = ``weights`` per source
    (in-batch, memory, hard) combined as eq. 2 (``unified``) or eq. 1's separate terms."""

    weights: tuple[float, float, float] = (1.0, 1.0, 1.0)
    combine: Literal["unified", "separate"] = "unified"
    memory: Memory | None = None
    head: nn.Linear | None = None  # the LTR head (eq. 14); None: similarity / temperature
    bidirectional: bool = False

    def __post_init__(self) -> None:
        self.weights = tuple(float(w) for w in self.weights)
        if len(self.weights) != 3 or any(not (w > 0 and w < float("inf")) for w in self.weights):
            raise ConfigError(f"λ must be three positive numbers (in-batch, memory, hard), got {list(self.weights)}")
        if self.combine not in ("unified", "separate"):
            raise ConfigError(f"combine must be 'unified' or 'separate', got {self.combine!r}")
        if self.head is not None and self.bidirectional:
            raise ConfigError("the LTR loss has no passage-to-query term: it cannot be bidirectional")

    def scores(self, model: nn.Module, queries: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """[B, C] scores: similarity / temperature, or the LTR head's σ(W{q, d} + b)."""
        if self.head is None:
            return model.similarity(queries, candidates) / model.config.temperature
        return ltr_scores(queries, candidates, self.head.weight, self.head.bias)

    def __call__(
        self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors
    ) -> torch.Tensor:
        """The loss of the global batch against its passages and the memory's entries."""
        if self.memory is not None:
            entries, entry_keys = self.memory.memory.entries(passages.device, passages.shape[1])
        else:
            entries, entry_keys = passages.new_zeros(0, passages.shape[1]), batch.passage_keys[:0]
        positive_index = batch.positive_index
        sources = torch.full((len(passages) + len(entries),), HARD, dtype=torch.long, device=passages.device)
        sources[len(passages) :] = MEMORY
        sources[positive_index] = IN_BATCH
        mask = batch.mask
        if len(entries):
            _check_keys(passages, batch)
            relevant = [
                set(batch.relevant_keys[i] if i < len(batch.relevant_keys) else ()) | {int(batch.passage_keys[p])}
                for i, p in enumerate(positive_index.tolist())
            ]
            mask = torch.cat([mask, memory_mask(entry_keys, batch.passage_keys, relevant)], dim=1)
        scores = self.scores(model, queries, torch.cat([passages, entries]))
        if self.combine == "unified":
            loss = unified_loss(scores, positive_index, sources, self.weights, mask)
        else:
            present = sorted(set(sources.tolist()))
            terms = [[s] for s in present]
            loss = separate_terms_loss(scores, positive_index, sources, terms, [self.weights[s] for s in present], mask)
        if self.bidirectional:
            batch_scores = scores[:, : len(passages)].masked_fill(batch.mask, float("-inf"))
            loss = (loss + passage_to_query_loss(batch_scores, positive_index)) / 2
        return loss

    def after_step(self, model: nn.Module, queries: torch.Tensor, passages: torch.Tensor, batch: BatchTensors) -> None:
        """Add the step's passages to the memory."""
        if self.memory is not None:
            self.memory.update(model, passages, batch)

    def parameters(self) -> list[nn.Parameter]:
        """The LTR head's weight and bias (none for the contrastive loss)."""
        return [] if self.head is None else list(self.head.parameters())

    def to(self, device: torch.device) -> MultiSource:
        """Move the head and the memory's modules."""
        if self.head is not None:
            self.head.to(device)
        if self.memory is not None:
            self.memory.to(device)
        return self

    def state_dict(self) -> dict:
        """The memory's state and the LTR head's weights."""
        state: dict = {}
        if self.memory is not None:
            state["memory"] = self.memory.state_dict()
        if self.head is not None:
            state["ltr_head"] = {k: v.detach().clone() for k, v in self.head.state_dict().items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output; a checkpoint without the memory (or head) is a one-line ConfigError."""
        if self.memory is not None:
            self.memory.load_state_dict(state.get("memory") or {})
        if self.head is not None:
            if "ltr_head" not in state:
                raise ConfigError("the checkpoint holds no saved LTR head; resume with its own objective or --restart")
            try:
                self.head.load_state_dict(state["ltr_head"])
            except RuntimeError:
                raise ConfigError("the saved LTR head does not fit the model's dimension") from None

    def describe(self) -> str:
        """One line for reports."""
        parts = ["LTR (abs-condenser-openqa eq. 14)" if self.head is not None else "contrastive"]
        if self.memory is not None:
            parts.append(self.memory.describe())
        if self.weights != (1.0, 1.0, 1.0) or self.combine == "separate":
            form = "eq. 2, one softmax" if self.combine == "unified" else "eq. 1, separate terms"
            lambdas = ", ".join(f"{n} {w:g}" for n, w in zip(SOURCE_NAMES, self.weights))
            parts.append(f"λ {lambdas} ({form})")
        if self.bidirectional:
            parts.append("bidirectional")
        return "; ".join(parts)

    def identity(self) -> dict:
        """Its λ, their combination, its direction, the LTR head's presence and the memory (whose description holds
        its sizes and momentum exactly)."""
        memory = self.memory.describe() if self.memory is not None else None
        settings = {"weights": list(self.weights), "combine": self.combine, "bidirectional": self.bidirectional}
        return {"objective": "MultiSource", **settings, "ltr": self.head is not None, "memory": memory}


def check_loss(loss: LossConfig, train: TrainConfig) -> None:
    """What ``objective_from_config`` would refuse, checked before any work starts."""
    if loss.kind == "ltr" and train.bidirectional:
        raise ConfigError("loss.kind=ltr has no passage-to-query term: set train.bidirectional=false")
    if loss.memory == "moco" and train.lora_rank:  # its key encoder copies the weights LoRA leaves frozen
        raise ConfigError(
            "loss.memory=moco does not combine with train.lora_rank: the momentum encoder would follow the frozen "
            "weights, not the adapted model"
        )


def objective_from_config(loss: LossConfig, train: TrainConfig, model: BiEncoder) -> Objective:
    """The objective ``loss`` describes for ``model``: today's ``InfoNCE`` when nothing is asked for."""
    check_loss(loss, train)
    weights = (loss.lambda_in_batch, loss.lambda_memory, loss.lambda_hard)
    plain = loss.kind == "contrastive" and loss.memory == "none" and loss.combine == "unified"
    if plain and weights == (1.0, 1.0, 1.0):
        return InfoNCE(train.bidirectional)
    memory: Memory | None = None
    if loss.memory == "pre-batch":
        memory = PreBatch(loss.pre_batches)
    elif loss.memory == "moco":
        memory = MoCoQueue(model, loss.queue_size, loss.momentum, train.grad_cache_chunk)
    head = ltr_head(model.dim) if loss.kind == "ltr" else None
    return MultiSource(weights, loss.combine, memory, head, train.bidirectional)
