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
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from densepass.losses.contrastive import contrastive_loss
from densepass.models.biencoder import BiEncoder, Side
from densepass.training.batches import TrainingBatch
from densepass.training.distributed import gather_with_local_grad


class RandomState:
    """Captures the CPU and CUDA random states so a forward pass can be replayed exactly."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """On GPU, scaled-dot-product attention through the flash / memory-efficient kernels (no cuDNN):
    cuDNN builds an execution plan for every new sequence length, which costs seconds over the
    many lengths of length-sorted batches."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU computes bfloat16 in hardware (the ``avx512_bf16`` or ``amx_bf16`` flag), where
    bf16 autocast speeds training up instead of emulating bf16 in float32 (False where unknown)."""
    try:
        flags = Path(cpuinfo).read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def uses_bf16(device: torch.device, bf16: bool, cpu_bf16: bool) -> bool:
    """Whether steps on ``device`` autocast to bfloat16: on GPU when ``bf16`` (the default), on CPU only
    when ``cpu_bf16`` is asked for, so that CPU results stay float32 unless a run opts in (MiniLM
    fine-tuning about 2x and pre-training 2-2.4x faster on a CPU with AVX512-BF16: docs/benchmarks.md)."""
    if device.type == "cuda":
        return bf16
    if device.type == "cpu" and cpu_bf16:
        if not cpu_has_native_bf16():
            warnings.warn("cpu_bf16: this CPU has no native bfloat16 (avx512_bf16 / amx_bf16), so bf16 autocast "
                          "is emulated and likely slower than float32", stacklevel=2)
        return True
    return False


@contextlib.contextmanager
def autocast_context(device: torch.device, bf16: bool) -> Iterator[None]:
    """bf16 autocast on ``device`` (when ``bf16``; see ``uses_bf16``) with the attention kernels of
    ``attention_kernels``."""
    with attention_kernels(device):
        if bf16 and device.type in ("cuda", "cpu"):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                yield
        else:
            yield


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
        move = lambda t: t.to(device, non_blocking=t.is_pinned())  # noqa: E731
        return BatchTensors({k: move(v) for k, v in self.queries.items()}, {k: move(v) for k, v in self.passages.items()},
                            move(self.positive_index), move(self.mask))


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
    return BatchTensors({k: v.pin_memory() for k, v in tensors.queries.items()},
                        {k: v.pin_memory() for k, v in tensors.passages.items()},
                        tensors.positive_index.pin_memory(), tensors.mask.pin_memory())


def global_loss(
    tensors: BatchTensors, n_local_queries: int, queries: torch.Tensor, passages: torch.Tensor, temperature: float,
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
