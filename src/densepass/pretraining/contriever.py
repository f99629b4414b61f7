"""Contriever-style contrastive pre-training (neural-retrieval-lecture, on Contriever): a shared bi-encoder learns
to match the two views of a document (``pretraining.crops``), with negatives from a MoCo queue.

With ``negatives="moco"`` (Contriever's MoCo mode): a momentum copy of the encoder (``models.momentum``) embeds the
key views; "the gradients for similarity with these representations is only computed w.r.t. parameters of the
'query' encoder". Each query view's positive is its own key; its negatives are the batch's other keys and the
queue of the newest K keys of earlier steps (entries of the same document masked). After the step the keys join
the queue. Keys carry no gradient, so each query's loss depends on its own view only: gradient accumulation over
micro-batches of queries equals the whole batch's gradient exactly. The momentum encoder's update (θ_k <- m θ_k +
(1 - m) θ) runs at the start of each step, from the weights the previous step left.

With ``negatives="in-batch"``: both views go through the trained encoder and each query's negatives are the
batch's other key views (Contriever's in-batch mode; no accumulation, the pool is the whole batch).

The loss is InfoNCE over similarities / temperature (Contriever: 0.05). The trained encoder is what is saved
(``save_backbone``): a plain BiEncoder that fine-tuning, AutoModel and SentenceTransformer load.

Under torch.distributed every process holds the step's whole batch (rank 0's), encodes its share of the documents'
two views (``training.distributed.shares``) and gathers the query and key vectors of every process (only its own
carry gradient): each computes the loss of the global batch and the training engine sums the gradients, so the
update is that of one process on the whole batch. The keys are gathered before they join the queue and the momentum
encoder follows weights every process shares, so the queue and the key encoder stay the same on every process. With
gradient accumulation each process splits its share into micro-batches, the i-th micro-batch of every process
gathered into one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from densepass import distributed
from densepass.device import autocast_context
from densepass.errors import ConfigError
from densepass.losses.contrastive import info_nce
from densepass.losses.memory import NegativeMemory, memory_mask
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.models.momentum import MomentumEncoder
from densepass.pretraining.data import Batch
from densepass.training.distributed import gather_rows, shares

Negatives = Literal["moco", "in-batch"]


class Contriever(nn.Module):
    """A shared bi-encoder with (in MoCo mode) its momentum encoder and queue."""

    def __init__(
        self, encoder: BiEncoder, negatives: Negatives = "moco", queue_size: int = 4096, momentum: float = 0.999
    ) -> None:
        super().__init__()
        if not encoder.config.shared:
            raise ConfigError("Contriever pre-training trains one shared encoder")
        if negatives not in ("moco", "in-batch"):
            raise ConfigError(f"negatives must be 'moco' or 'in-batch', got {negatives!r}")
        if negatives == "moco" and (isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1):
            raise ConfigError(f"a MoCo queue needs K >= 1 keys, got {queue_size!r}")
        self.encoder = encoder
        self.negatives = negatives
        self.key_encoder = MomentumEncoder(encoder, momentum) if negatives == "moco" else None
        self.queue = NegativeMemory(max_entries=queue_size) if negatives == "moco" else None

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        pooling: str,
        normalize: bool,
        temperature: float,
        max_length: int,
        negatives: Negatives = "moco",
        queue_size: int = 4096,
        momentum: float = 0.999,
    ) -> Contriever:
        """A Contriever over any Hugging Face encoder (pooling, normalisation and temperature as configured)."""
        config = BiEncoderConfig(
            shared=True,
            pooling=pooling,
            normalize=normalize,
            temperature=temperature,
            query_max_length=max_length,
            passage_max_length=max_length,
        )
        return cls(BiEncoder.from_pretrained(name_or_path, config=config), negatives, queue_size, momentum)

    @property
    def tokenizer(self):
        """The encoder's tokenizer."""
        return self.encoder.tokenizer

    @property
    def backbone_config(self):
        """The transformer's configuration (positions, sizes)."""
        return self.encoder.query_encoder.config

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The encoder's parameters (the momentum encoder is not trained by gradient)."""
        return list(self.encoder.parameters())

    def memory_state(self) -> dict:
        """The queue, for a checkpoint (the momentum encoder's weights are module weights)."""
        return {} if self.queue is None else {"queue": self.queue.state_dict()}

    def load_memory_state(self, state: dict | None) -> None:
        """Restore ``memory_state()`` output; a checkpoint without the queue is a one-line ConfigError."""
        if self.queue is not None:
            self.queue.load_state_dict((state or {}).get("queue"), "MoCo queue")
            self.queue.check_dim(self.encoder.dim, "the encoder's keys")

    def save_backbone(self, path: str | Path, pooling: str = "mean", max_length: int = 128) -> None:
        """Write the trained encoder (not the momentum copy) as a plain BiEncoder."""
        config = dataclasses.replace(self.encoder.config, pooling=pooling, passage_max_length=max_length)
        BiEncoder(self.encoder.query_encoder, self.encoder.query_encoder, self.tokenizer, config).save(path)


def _views(batch: Batch, device: torch.device, which: int, rows: range) -> dict[str, torch.Tensor]:
    """View ``which`` (0: queries, 1: keys) of the documents ``rows``."""
    return {k: batch[k][which::2][rows.start : rows.stop].to(device) for k in ("input_ids", "attention_mask")}


def contriever_forward_backward(
    model: Contriever, batch: Batch, accumulation: int, device: torch.device, bf16: bool
) -> dict[str, float]:
    """Accumulate the gradient of one step's InfoNCE loss into ``.grad``; return the step's loss terms (of the global
    batch under torch.distributed, this process encoding its share of the documents)."""
    encoder, temperature = model.encoder, model.encoder.config.temperature
    documents = batch["documents"].to(device)
    n = len(documents)
    parts = shares(n)
    mine = parts[distributed.rank()]

    def embed(rows: range, which: int = 0) -> torch.Tensor:
        """The trained encoder's vectors of view ``which`` of the documents ``rows`` (none when there are none)."""
        if not len(rows):
            return torch.zeros(0, encoder.dim, device=device)
        tokens = _views(batch, device, which, rows)
        with autocast_context(device, bf16):
            return encoder(tokens["input_ids"], tokens["attention_mask"], side="passage").float()

    if model.key_encoder is None:
        if accumulation > 1:
            raise ConfigError("in-batch Contriever pre-training uses the whole batch as its pool: grad_accumulation 1")
        counts = [len(part) for part in parts]
        queries = gather_rows(embed(mine), counts)
        keys = gather_rows(embed(mine, 1), counts)
        loss = info_nce(queries @ keys.T / temperature, torch.arange(n, device=device))
        if loss.requires_grad:  # not when this process holds no document
            loss.backward()
        return {"loss": loss.item(), "contrastive": loss.item()}
    model.key_encoder.update(encoder)
    keys = gather_rows(model.key_encoder.encode(_views(batch, device, 1, mine)), [len(part) for part in parts])
    entries, entry_documents = model.queue.entries(device, keys.shape[1])
    candidates = torch.cat([keys, entries])
    same_document = memory_mask(entry_documents, documents, [{int(d)} for d in documents])
    mask = torch.cat([torch.zeros(n, n, dtype=torch.bool, device=device), same_document], dim=1)
    share = len(parts[0])  # the largest share: every process takes as many micro-batches
    size = -(-share // accumulation)
    total = 0.0
    for start in range(0, share, size):
        micro = [range(part.start + start, min(part.start + start + size, part.stop)) for part in parts]
        rows = [row for part in micro for row in part]
        target = torch.tensor(rows, dtype=torch.long, device=device)  # each query's key is its document's
        queries = gather_rows(embed(micro[distributed.rank()]), [len(part) for part in micro])
        loss = info_nce(queries @ candidates.T / temperature, target, mask[target]) * len(target) / n
        if loss.requires_grad:  # not when this process holds none of the micro-batch
            loss.backward()
        total += loss.item()
    model.queue.push(keys, documents)
    return {"loss": total, "contrastive": total}
