"""Vocabulary-table gradients added row by row on the CPU, into one dense buffer kept from step to step.

Why: the backward pass of ``torch.nn.functional.embedding`` writes a dense gradient the size of the whole table for
every forward pass that read it (all-MiniLM-L6-v2's 30,522 x 384 table: 47 MB of float32, twice a bi-encoder step,
for the queries and for the passages; a Qwen2 embedder's 151,936 x 896: over half a gigabyte), each time in a fresh
allocation that the CPU zero-fills page by page, though a step reads a few thousand of its rows: a large share of a
bf16 MiniLM step on a small CPU (``benchmarks/bench_train.py --profile``: ``aten::fill_`` of [30522, 384]; the
measurement is in docs/benchmarks.md, "Where a step's time goes on Zen 5").

How: ``SparseEmbeddingGradients(model)`` switches the vocabulary tables of ``model`` (``nn.Embedding`` modules of at
least ``MIN_ROWS`` rows whose weight trains) to sparse gradients (``sparse=True``: the rows read and their
gradients), and hooks each table's weight so that, before the first gradient of a step reaches it, its ``.grad`` is a
dense buffer kept across steps and zeroed in place (memory already resident). Autograd adds every gradient, sparse or
dense (a tied output layer's), into that buffer in place. The optimiser, clipping, all-reduces and checkpoints see a
dense gradient as before, equal to the dense backward's up to the order of float additions
(tests/test_embedding_grads.py). ``remove()`` switches the tables back. On the CPU only (on a GPU the caching
allocator hands back memory already mapped, and fills are fast), and not under FSDP, whose sharded parameters hold
their own gradients.

>>> import torch
>>> table = torch.nn.Embedding(5000, 8)
>>> switched = SparseEmbeddingGradients(table)
>>> table(torch.tensor([[1, 2, 2]])).sum().backward()
>>> table.weight.grad.is_sparse, table.weight.grad[2].tolist() == [2.0] * 8, table.weight.grad[3].abs().sum().item()
(False, True, 0.0)
>>> switched.remove()
"""

from __future__ import annotations

import torch
from torch import nn

MIN_ROWS = 4096
"""Tables with fewer rows (positions, token types) keep dense gradients: their fills cost little."""


class SparseEmbeddingGradients:
    """The vocabulary tables of ``model`` on sparse gradients into kept dense buffers (module docstring), until
    ``remove()``."""

    def __init__(self, model: nn.Module) -> None:
        self.tables = [
            m
            for m in model.modules()
            if isinstance(m, nn.Embedding)
            and m.num_embeddings >= MIN_ROWS
            and m.weight.requires_grad
            and not m.sparse
            and m.max_norm is None  # a renormalising lookup writes the table in the forward pass: left as it is
        ]
        self.handles = [m.weight.register_hook(self._hook(m.weight)) for m in self.tables]
        for table in self.tables:
            table.sparse = True

    @staticmethod
    def _hook(weight: torch.Tensor):
        """A hook on ``weight``'s incoming gradients that makes its ``.grad`` the kept buffer, zeroed, when a step's
        first gradient arrives (``.grad`` dropped by the optimiser's ``zero_grad``)."""
        kept: list[torch.Tensor] = []

        def hook(grad: torch.Tensor) -> None:
            if weight.grad is not None:
                return
            if (
                not kept
                or kept[0].shape != weight.shape
                or kept[0].dtype != weight.dtype
                or kept[0].device != weight.device
            ):
                kept[:] = [torch.zeros_like(weight, memory_format=torch.contiguous_format)]
            else:
                kept[0].zero_()
            weight.grad = kept[0]

        return hook

    def remove(self) -> None:
        """Dense gradients again, as before the switch."""
        for handle in self.handles:
            handle.remove()
        for table in self.tables:
            table.sparse = False
        self.tables, self.handles = [], []
