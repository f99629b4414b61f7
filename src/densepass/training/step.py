"""One optimisation step's forward and backward, plain or with gradient caching; the loss is the
objective's (``losses.objectives``) on the global batch's representations.

Gradient caching (gradcache): (1) embed the whole batch in chunks without a graph; (2) compute the
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
from torch.distributed.fsdp import FSDPModule

from densepass.device import RandomState, autocast_context
from densepass.losses.batch import BatchTensors
from densepass.losses.objectives import InfoNCE, Objective
from densepass.models.biencoder import BiEncoder, Side
from densepass.models.inputs import forward_in_pieces, piece_tokens
from densepass.models.splade import SpladeEncoder
from densepass.training.batches import TrainingBatch
from densepass.training.distributed import gather_with_local_grad


def sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP shards ``model`` (``training.sharding``)."""
    return isinstance(model, FSDPModule)


def _embed(model: BiEncoder, tokens: dict[str, torch.Tensor], side: Side, autocast) -> torch.Tensor:
    """The representations of one side (float32), in length-sorted pieces on the CPU (``forward_in_pieces``):
    pooled encoders (one vector per text: bi-encoder, SPLADE) and ColBERT's passages (padded back to their fixed
    width); ColBERT's queries run whole, since every position of a query counts, its [MASK] padding too. Packed
    bf16 pieces hold ``BF16_PIECE_TOKENS`` real tokens: they are no longer padded, and their activations take half
    the bytes of float32 ones (docs/benchmarks.md: faster, and less memory, than pieces of ``CPU_PIECE_TOKENS``)."""

    def run(piece: dict[str, torch.Tensor]) -> torch.Tensor:
        embedded = {"inputs_embeds": piece["inputs_embeds"]} if "inputs_embeds" in piece else {}
        return model(piece["input_ids"], piece["attention_mask"], side=side, **embedded).float()

    with autocast():
        if isinstance(model, BiEncoder | SpladeEncoder) or side == "passage":
            # one lookup for all pieces; not under FSDP, whose weights are whole only inside a forward
            embed = model.token_embeddings(side) if isinstance(model, BiEncoder) and not sharded(model) else None
            device, packed = tokens["input_ids"].device, getattr(model, "packing", False)
            bf16 = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == torch.bfloat16
            pieces = piece_tokens(device, bf16=packed and bf16)
            return forward_in_pieces(run, tokens, pieces, embed, packed=packed)
        return run(tokens)


def _chunks(tokens: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    n = tokens["input_ids"].shape[0]
    return [{k: v[i : i + size] for k, v in tokens.items()} for i in range(0, n, size)]


def batch_tensors(
    model: BiEncoder, batch: TrainingBatch, pin: bool = False, tokenizer=None, passage_length: int | None = None
) -> BatchTensors:
    """Tokenise a batch (``tokenizer``: a private copy when called from a worker thread; ``passage_length``:
    passages cut shorter than the model reads them, ``train.passage_max_length``); ``pin`` puts the tensors
    in page-locked memory so copies to the GPU do not wait for it."""
    tensors = BatchTensors(
        model.tokenize(batch.query_texts, "query", tokenizer=tokenizer),
        model.tokenize(batch.passage_texts, "passage", tokenizer=tokenizer, max_length=passage_length),
        batch.positive_index,
        batch.mask,
        batch.passage_keys,
        batch.relevant_keys,
        batch.extras,
    )
    return tensors.map(lambda t: t.pin_memory()) if pin else tensors


@dataclass
class StepOutput:
    """A step's loss and the global batch's representations, all detached (for the objective's state)."""

    loss: torch.Tensor
    queries: torch.Tensor
    passages: torch.Tensor
    batch: BatchTensors  # on the device


def gather_batch(queries: torch.Tensor, passages: torch.Tensor, n_local_queries: int) -> tuple[torch.Tensor, ...]:
    """The global batch's representations from this process's (every process's positives, then every
    process's hard negatives); only this process's rows carry gradient."""
    b = n_local_queries
    all_passages = torch.cat([gather_with_local_grad(passages[:b]), gather_with_local_grad(passages[b:])])
    return gather_with_local_grad(queries), all_passages


def forward_backward(
    model: BiEncoder,
    batch: TrainingBatch,
    device: torch.device,
    objective: Objective | None = None,
    chunk_size: int | None = None,
    bf16: bool = False,
    tensors: BatchTensors | None = None,
) -> StepOutput:
    """Accumulate into ``.grad`` the gradient of the objective on the batch (default: ``InfoNCE()``);
    return the loss (detached, on ``device``: reading it waits for the GPU, so the trainer reads it only
    when it logs) with the batch's representations.
    ``bf16``: autocast to bfloat16 (resolved for the device by ``uses_bf16``).
    ``tensors``: the batch already tokenised by ``batch_tensors`` (e.g. in a worker thread)."""
    objective = objective or InfoNCE()
    tensors = (tensors or batch_tensors(model, batch)).to(device)
    q_tokens, p_tokens = tensors.queries, tensors.passages
    autocast: Callable[[], contextlib.AbstractContextManager] = lambda: autocast_context(device, bf16)  # noqa: E731
    b = batch.n_local_queries
    if chunk_size is None:
        # both sides in one autocast region: autocast casts each weight to bf16 once a region (its cache), so once a
        # step, and the backward pass casts its gradient back once; not under FSDP, whose weights are whole only
        # inside a forward
        with autocast() if not sharded(model) else contextlib.nullcontext():
            q_reps = _embed(model, q_tokens, "query", autocast)
            p_reps = _embed(model, p_tokens, "passage", autocast)
        q, p = gather_batch(q_reps, p_reps, b)
        loss = objective(model, q, p, tensors)
        loss.backward()
        return StepOutput(loss.detach(), q.detach(), p.detach(), tensors)

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
    all_q, all_p = gather_batch(q, p, b)
    loss = objective(model, all_q, all_p, tensors)
    loss.backward()
    grads = {"query": q.grad.split(chunk_size), "passage": p.grad.split(chunk_size)}
    for side, chunks in sides:
        for chunk, (_, state), grad in zip(chunks, cached[side], grads[side]):
            with state.replay():
                reps = _embed(model, chunk, side, autocast)
            torch.dot(reps.flatten(), grad.flatten()).backward()
    return StepOutput(loss.detach(), all_q.detach(), all_p.detach(), tensors)
