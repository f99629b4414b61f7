"""Tokenisation and length-sorted batching shared by the SPLADE and ColBERT encoders.

Texts are encoded in batches of similar character length (few pad tokens), longest first, and the
outputs are put back in the order of the input by the caller (``order`` says where each batch's rows go).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from densepass.errors import ConfigError, DataWarning


def tokenize(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int, padding: bool | str = True
) -> dict[str, torch.Tensor]:
    """Truncated, padded tensors of ``texts`` (padded to a multiple of 8 when padding to the longest and
    ``max_length`` is one too)."""
    return tokenizer(
        texts,
        truncation=True,
        max_length=max_length,
        padding=padding,
        return_tensors="pt",
        pad_to_multiple_of=8 if padding is True and max_length % 8 == 0 else None,
    )


def length_sorted_batches(texts: Sequence[str], batch_size: int) -> Iterator[np.ndarray]:
    """Row indices of ``texts`` in batches of ``batch_size``, longest texts first."""
    if isinstance(texts, str):
        raise ConfigError("encoding takes a list of texts, not one string")
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    order = np.argsort([-len(t) for t in texts], kind="stable")
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def warn_long_queries(tokenizer: PreTrainedTokenizerBase, queries: Sequence[str], limit: int, extra: int = 0) -> int:
    """Count the queries longer than ``limit`` tokens (with special tokens, plus ``extra`` such as a marker)
    and warn once (a ``DataWarning``) that they are cut there; returns the count."""
    lengths = [len(ids) + extra for ids in tokenizer(list(queries), truncation=False)["input_ids"]]
    cut = sum(n > limit for n in lengths)
    if cut:
        warnings.warn(
            f"{cut} of {len(lengths)} queries are longer than the model's {limit} query tokens and were cut",
            DataWarning,
            stacklevel=4,
        )
    return cut
