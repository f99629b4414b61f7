"""Cross-encoders (neural-retrieval-lecture: "cross-encoder re-ranking"): query and passage read together
by one transformer, one relevance logit per pair.

Any model that ``transformers.AutoModelForSequenceClassification`` loads with a single output is
accepted; a saved cross-encoder is a plain Hugging Face directory, which ``sentence_transformers``'
``CrossEncoder`` loads too. Scoring is batched over pairs sorted by length (little padding), under
bf16 autocast where the device computes bfloat16 natively (``device.uses_bf16``).

>>> from densepass.models.cross_encoder import CrossEncoder
>>> reranker = CrossEncoder.from_pretrained("path/to/cross-encoder")  # doctest: +SKIP
>>> reranker.score_pairs(["audio editor"], ["Audacity: fast audio editor"])  # doctest: +SKIP
array([7.3], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from densepass.device import autocast_context, default_device
from densepass.errors import ConfigError
from densepass.io import atomic_directory


class CrossEncoder:
    """A (query, passage) -> relevance scorer."""

    def __init__(
        self,
        model,
        tokenizer,
        max_length: int = 256,
        batch_size: int = 64,
        device: torch.device | None = None,
        bf16: bool = False,
        source: str | None = None,
    ) -> None:
        if getattr(model.config, "num_labels", None) != 1:
            raise ConfigError(
                f"a cross-encoder needs a one-logit head; {source or 'this model'} has "
                f"{getattr(model.config, 'num_labels', 'no')} labels"
            )
        if max_length < 8 or batch_size < 1:
            raise ConfigError(
                f"cross-encoder max_length must be >= 8 and batch_size >= 1, got {max_length}, {batch_size}"
            )
        self.model, self.tokenizer = model, tokenizer
        self.max_length, self.batch_size, self.bf16, self.source = max_length, batch_size, bf16, source
        self.device = device or default_device()
        self.model.to(self.device).eval()

    @classmethod
    def from_pretrained(cls, name_or_path: str, **options) -> CrossEncoder:
        """Load a cross-encoder (a sequence-classification model with one label) from a directory or name."""
        from densepass.models.biencoder import resolve_model_path

        path = resolve_model_path(name_or_path)
        try:
            model = AutoModelForSequenceClassification.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise ConfigError(f"cannot load cross-encoder {name_or_path!r}: {str(err).splitlines()[0]}") from None
        return cls(model, AutoTokenizer.from_pretrained(path), source=str(path), **options)

    @torch.inference_mode()
    def score_pairs(self, queries: Sequence[str], passages: Sequence[str]) -> np.ndarray:
        """One relevance logit per pair ``(queries[i], passages[i])``, float32."""
        if len(queries) != len(passages):
            raise ConfigError(f"{len(queries)} queries but {len(passages)} passages")
        out = np.empty(len(queries), dtype=np.float32)
        order = np.argsort([-(len(q) + len(p)) for q, p in zip(queries, passages)], kind="stable")
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            tokens = self.tokenizer(
                [queries[r] for r in rows],
                [passages[r] for r in rows],
                truncation="only_second",
                max_length=self.max_length,
                padding=True,
                return_tensors="pt",
            ).to(self.device)
            with autocast_context(self.device, self.bf16):
                logits = self.model(**tokens).logits
            out[rows] = logits.float().squeeze(-1).cpu().numpy()
        return out

    def describe(self) -> dict:
        """JSON-able facts about the reranker."""
        return {"kind": "cross-encoder", "model": self.source, "max_length": self.max_length}

    def save(self, path: str | Path) -> None:
        """Write the model atomically as a Hugging Face directory (``CrossEncoder`` and ``AutoModel...`` load it)."""
        with atomic_directory(path) as tmp:
            self.model.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
