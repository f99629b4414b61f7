"""One optimisation step's forward and backward, plain or with gradient caching.

Gradient caching (Gao et al., "Scaling Deep Contrastive Learning Batch Size under Memory Limited
Setup", GC-DPR/GradCache): (1) embed the whole batch in chunks without a graph; (2) compute the
contrastive loss on those embeddings and its gradient with respect to each embedding; (3) re-embed
chunk by chunk with a graph and back-propagate the cached embedding gradients. Random states are
replayed so dropout matches between (1) and (3); the result equals the plain large-batch gradient,
which gradient accumulation does not (in-batch negatives span the whole batch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from densepass.device import RandomState, autocast_context
from densepass.losses.contrastive import contrastive_loss
from densepass.models.biencoder import BiEncoder, Side
from densepass.training.batches import TrainingBatch
from densepass.training.distributed import gather_with_local_grad


def _embed(model: BiEncoder, tokens: dict[str, torch.Tensor], side: Side, autocast) -> torch.Tensor:
    with autocast():
        return model(tokens["input_ids"], tokens["attention_mask"], side=side).float()


def _chunks(tokens: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    n = tokens["input_ids"].shape[0]
    return [{k: v[i : i + size] for k, v in tokens.items()} for i in range(0, n, size)]


@dataclass
class BatchTensors:
    """A batch's tensors on the host, ready to copy: tokens of each side, positive columns and mask."""

    queries: dict[str, torch.Tensor]
    passages: dict[str, torch.Tensor]
    positive_index: torch.Tensor
    mask: torch.Tensor

    def to(self, device: torch.device) -> BatchTensors:
        """The tensors on ``device`` (non-blocking from pinned memory)."""
        move = lambda t: t.to(device, non_blocking=t.is_pinned())  # noqa: E731
        return BatchTensors(
            {k: move(v) for k, v in self.queries.items()},
            {k: move(v) for k, v in self.passages.items()},
            move(self.positive_index),
            move(self.mask),
        )


def batch_tensors(model: BiEncoder, batch: TrainingBatch, pin: bool = False, tokenizer=None) -> BatchTensors:
    """Tokenise a batch (``tokenizer``: a private copy when called from a worker thread); ``pin`` puts
    the tensors in page-locked memory so copies to the GPU do not wait for it."""
    tensors = BatchTensors(
        model.tokenize(batch.query_texts, "query", tokenizer=tokenizer),
        model.tokenize(batch.passage_texts, "passage", tokenizer=tokenizer),
        batch.positive_index,
        batch.mask,
    )
    if not pin:
        return tensors
    return BatchTensors(
        {k: v.pin_memory() for k, v in tensors.queries.items()},
        {k: v.pin_memory() for k, v in tensors.passages.items()},
        tensors.positive_index.pin_memory(),
        tensors.mask.pin_memory(),
    )


def global_loss(
    tensors: BatchTensors,
    n_local_queries: int,
    queries: torch.Tensor,
    passages: torch.Tensor,
    temperature: float,
    bidirectional: bool,
) -> torch.Tensor:
    """Loss of the global batch from this process's query and passage embeddings."""
    b = n_local_queries
    all_queries = gather_with_local_grad(queries)
    all_passages = torch.cat([gather_with_local_grad(passages[:b]), gather_with_local_grad(passages[b:])])
    return contrastive_loss(
        all_queries, all_passages, tensors.positive_index, temperature, mask=tensors.mask, bidirectional=bidirectional
    )


def forward_backward(
    model: BiEncoder,
    batch: TrainingBatch,
    device: torch.device,
    bidirectional: bool = False,
    chunk_size: int | None = None,
    bf16: bool = False,
    tensors: BatchTensors | None = None,
) -> torch.Tensor:
    """Accumulate into ``.grad`` the gradient of the batch loss; return the loss (detached, on
    ``device``: reading it waits for the GPU, so the trainer reads it only when it logs).
    ``bf16``: autocast to bfloat16 (resolved for the device by ``uses_bf16``).
    ``tensors``: the batch already tokenised by ``batch_tensors`` (e.g. in a worker thread)."""
    tensors = (tensors or batch_tensors(model, batch)).to(device)
    q_tokens, p_tokens = tensors.queries, tensors.passages
    autocast: Callable[[], contextlib.AbstractContextManager] = lambda: autocast_context(device, bf16)  # noqa: E731
    temperature = model.config.temperature
    b = batch.n_local_queries
    if chunk_size is None:
        q = _embed(model, q_tokens, "query", autocast)
        p = _embed(model, p_tokens, "passage", autocast)
        loss = global_loss(tensors, b, q, p, temperature, bidirectional)
        loss.backward()
        return loss.detach()

    sides: list[tuple[Side, list[dict[str, torch.Tensor]]]] = [
        ("query", _chunks(q_tokens, chunk_size)),
        ("passage", _chunks(p_tokens, chunk_size)),
    ]
    cached: dict[Side, list[tuple[torch.Tensor, RandomState]]] = {"query": [], "passage": []}
    with torch.no_grad():
        for side, chunks in sides:
            for chunk in chunks:
                state = RandomState(device)
                cached[side].append((_embed(model, chunk, side, autocast), state))
    q = torch.cat([e for e, _ in cached["query"]]).requires_grad_()
    p = torch.cat([e for e, _ in cached["passage"]]).requires_grad_()
    loss = global_loss(tensors, b, q, p, temperature, bidirectional)
    loss.backward()
    grads = {"query": q.grad.split(chunk_size), "passage": p.grad.split(chunk_size)}
    for side, chunks in sides:
        for chunk, (_, state), grad in zip(chunks, cached[side], grads[side]):
            with state.replay():
                reps = _embed(model, chunk, side, autocast)
            torch.dot(reps.flatten(), grad.flatten()).backward()
    return loss.detach()
