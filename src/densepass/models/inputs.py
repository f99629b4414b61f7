"""The encoders' inputs: tokenisation, position limits, length-sorted batches and forward passes in pieces.

Texts are encoded in batches of similar character length (few pad tokens), longest first, and the
outputs are put back in the order of the input by the caller (``order`` says where each batch's rows go).
On the CPU, a training batch's forward pass, and a cross-encoder's scoring batch, run in length-sorted
pieces (``forward_in_pieces``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from densepass.data.texts import tokenizing
from densepass.errors import ConfigError, DataWarning


def tokenize(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int, padding: bool | str = True
) -> dict[str, torch.Tensor]:
    """Truncated, padded tensors of ``texts`` (padded to a multiple of 8 when padding to the longest and
    ``max_length`` is one too: tensor-core friendly, few distinct shapes; ``transformers`` refuses a
    multiple that does not divide the truncation length)."""
    with tokenizing(texts):
        return tokenizer(
            texts,
            truncation=True,
            max_length=max_length,
            padding=padding,
            return_tensors="pt",
            pad_to_multiple_of=8 if padding is True and max_length % 8 == 0 else None,
        )


Side = Literal["query", "passage"]

PADDING_OFFSET_MODELS = frozenset(
    {
        "camembert",
        "data2vec-text",
        "ibert",
        "lilt",
        "longformer",
        "luke",
        "markuplm",
        "mpnet",
        "roberta",
        "roberta-prelayernorm",
        "xlm-roberta",
        "xlm-roberta-xl",
        "xmod",
    }
)
"""Model types whose position ids start after the padding token's (RoBERTa's ``padding_idx + 1``): of their
``max_position_embeddings`` (514 for RoBERTa), ``pad_token_id + 1`` are never a token's position (512 are)."""


def position_limit(model_config: Any) -> tuple[int, int] | None:
    """``(limit, offset)``: the most tokens (special tokens included) an encoder with this Hugging Face config
    reads, its ``max_position_embeddings`` less ``offset``, RoBERTa's padding offset (``PADDING_OFFSET_MODELS``;
    0 for BERT and the rest); None when the config gives no limit."""
    positions = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(positions, int) or isinstance(positions, bool) or positions <= 0:
        return None
    offset = 0
    if getattr(model_config, "model_type", None) in PADDING_OFFSET_MODELS:
        offset = (getattr(model_config, "pad_token_id", None) or 0) + 1
    return positions - offset, offset


def check_position_limit(model_config: Any, lengths: dict[str, int | None], name: str | None = None) -> None:
    """Refuse token limits (``{"model.passage_max_length": 512, ...}``) above the positions of the encoder with
    ``model_config`` (``position_limit``): a longer input would crash in its position embeddings on the first
    long text, so this is a one-line ConfigError naming the key and the limit when the model is loaded. ``name``:
    how to call the model (default: the path it was loaded from)."""
    found = position_limit(model_config)
    if found is None:
        return
    limit, offset = found
    name = name or getattr(model_config, "_name_or_path", None) or "the model"
    for key, value in lengths.items():
        if value is not None and value > limit:
            how = (
                f" (max_position_embeddings {limit + offset} less RoBERTa's padding offset {offset})" if offset else ""
            )
            raise ConfigError(f"{key} {value} exceeds {name}'s {limit} positions{how}: set it to {limit} or less")


def pad_on_the_right(tokenizer: PreTrainedTokenizerBase) -> None:
    """Set ``tokenizer`` to pad after the text, as densepass's encoding always does (``encode.padded_batches``), so
    that training and evaluation read the same columns: one set to pad on the left (an LLM's, often) numbered an
    absolute-position model's tokens from the padding in training only, and put padding in column 0, where CLS
    pooling and ColBERT's markers read."""
    tokenizer.padding_side = "right"


class SidedInputs:
    """Token limits and tokenisation of a retriever with a query side and a passage side: a ``config`` with
    ``query_max_length`` and ``passage_max_length``, and a ``tokenizer`` (the bi-encoder, SPLADE, ColBERT)."""

    config: Any
    tokenizer: PreTrainedTokenizerBase

    def max_length(self, side: Side) -> int:
        """Token limit of one side's inputs."""
        return self.config.query_max_length if side == "query" else self.config.passage_max_length

    def check_positions(self, query_encoder: Any, passage_encoder: Any = None) -> None:
        """Refuse ``model.query_max_length`` / ``model.passage_max_length`` above the positions of the encoder that
        reads that side (``check_position_limit``; ``passage_encoder``: the query encoder when None)."""
        check_position_limit(query_encoder.config, {"model.query_max_length": self.config.query_max_length})
        passage = (passage_encoder or query_encoder).config
        check_position_limit(passage, {"model.passage_max_length": self.config.passage_max_length})

    def prompted(self, texts: list[str], side: Side) -> list[str]:
        """``texts`` behind the side's prompt (``query_prompt`` / ``passage_prompt`` of the config, if it has them)."""
        prompt = getattr(self.config, f"{side}_prompt", "")
        return [prompt + text for text in texts] if prompt else texts

    def tokenize(
        self,
        texts: list[str],
        side: Side,
        padding: bool | str = True,
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_length: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Padded tensors of one side's texts, behind its prompt; ``tokenizer``: a private copy of
        ``self.tokenizer`` for a worker thread (a fast tokenizer's truncation settings are shared state);
        ``max_length``: another token limit than the side's (training's shorter passage crops)."""
        texts = self.prompted(texts, side)
        return tokenize(tokenizer or self.tokenizer, texts, max_length or self.max_length(side), padding)


CPU_PIECE_TOKENS = 2048
"""Tokens (rows x padded length) per piece of a forward pass on the CPU (``forward_in_pieces``)."""

BF16_PIECE_TOKENS = 4096
"""Tokens per piece of a bf16 forward pass on the CPU: bf16 activations take half the bytes of float32 ones, so
twice ``CPU_PIECE_TOKENS`` stays under glibc's mmap threshold, and larger products run faster on AMX (pieces of
2,048 and 8,192 tokens were measured against it: docs/history/benchmarks-log.md, "Fused BERT layers")."""


def piece_tokens(device: torch.device, bf16: bool = False, cpu_tokens: int = CPU_PIECE_TOKENS) -> int | None:
    """The piece size of a forward pass on ``device``: ``cpu_tokens`` on the CPU, scaled as ``BF16_PIECE_TOKENS``
    is to ``CPU_PIECE_TOKENS`` for ``bf16`` activations (half the bytes each); None (whole) elsewhere."""
    if device.type != "cpu":
        return None
    return cpu_tokens * BF16_PIECE_TOKENS // CPU_PIECE_TOKENS if bf16 else cpu_tokens


def forward_in_pieces(
    fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    tokens: dict[str, torch.Tensor],
    max_tokens: int | None,
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
    packed: bool = False,
) -> torch.Tensor:
    """``fn(tokens)`` (one output row per input row), computed on pieces of at most ``max_tokens`` tokens:
    rows sorted by length, each piece cut to its own longest row, the outputs put back in input order.
    Equal to ``fn(tokens)`` up to float rounding (masked positions do not change the unmasked outputs);
    the autograd graph runs through the pieces. ``max_tokens`` None: ``fn(tokens)`` whole.

    Why, on the CPU: a forward pass over a whole training batch allocates activations of tens of MB each
    (e.g. 64 passages x 96 tokens x 1,536 feed-forward units x 4 bytes = 38 MB), above glibc's largest
    mmap threshold (32 MB), so every step maps fresh pages and faults them in, and pads every row to the
    batch's longest. Pieces of 2,048 tokens stay in the reused heap and cut most padding:
    ``benchmarks/bench_train.py`` and ``bench_rerank.py`` measure the effect (docs/benchmarks.md).
    GPU memory comes from PyTorch's caching allocator: there, one large forward is best.

    ``embed`` (training): the token-embedding lookup (``input_ids`` -> vectors), done once for every piece's ids
    together and handed to ``fn`` as each piece's ``inputs_embeds``. A lookup's backward writes a dense gradient
    of the whole vocabulary table (MiniLM: 30,522 x 384 floats, 47 MB, mapped afresh each time), so one lookup
    per piece would cost a training step one such table per piece.

    ``packed`` (``fn`` runs its piece packed without padding: ``models.packing``): a piece's size is its real
    tokens, not rows x longest."""
    mask = tokens["attention_mask"]
    rows, width = mask.shape
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"piece size must be >= 1 token, got {max_tokens}")
    if max_tokens is None or (int(mask.sum()) if packed else rows * width) <= max_tokens:
        order, pieces = None, [dict(tokens)]
    else:
        lengths = mask.sum(1)
        right_padded = bool(mask[:, 0].all())
        order = torch.argsort(lengths, descending=True, stable=True)
        ends = lengths[order].cumsum(0)
        pieces, start = [], 0
        while start < rows:
            longest = int(lengths[order[start]]) if right_padded else width
            if packed:  # the rows whose tokens fit, at least one
                before = int(ends[start - 1]) if start else 0
                count = int(torch.searchsorted(ends, before + max_tokens, right=True)) - start
            else:
                count = max_tokens // max(longest, 1)
            index = order[start : start + max(1, count)]
            pieces.append({k: v[index, :longest] for k, v in tokens.items()})
            start += len(index)
    if embed is not None:
        ids = [piece["input_ids"] for piece in pieces]
        vectors = embed(torch.cat([i.reshape(-1) for i in ids])).split([i.numel() for i in ids])
        for piece, i, v in zip(pieces, ids, vectors):
            piece["inputs_embeds"] = v.view(*i.shape, -1)
    outputs = [fn(piece) for piece in pieces]
    if order is None:
        return outputs[0]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(rows, device=order.device)
    return torch.cat(outputs)[inverse]


def text_list(texts: Sequence[str], what: str) -> list[str]:
    """``texts`` as a list of strings; one string (it would be encoded a character a row) or an item that is not a
    string is a one-line ``ConfigError`` naming ``what`` (the call) and the item's place."""
    if isinstance(texts, str):
        raise ConfigError(f"{what} takes a list of texts, not one string")
    texts = list(texts)
    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
    if bad is not None:
        raise ConfigError(f"{what}: text {bad} is {type(texts[bad]).__name__}, not a string")
    return texts


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
