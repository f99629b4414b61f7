"""Batched encoding for throughput: length-sorted batches, tokenisation overlapped with the model.

Texts are ordered by character length (known before tokenising) and tokenised in chunks by a
background thread while the model encodes the previous chunk; inside a chunk, rows are sorted by
token count so each batch pads little, and padded batches are built with numpy. On GPU, inputs go
through pinned memory, and embeddings stay on the device until one copy back at the end. On the CPU a batch
runs in length-sorted pieces of 2,048 tokens (``models.inputs.forward_in_pieces``): a batch of 256 passages
x 128 tokens has activations of 200 MB, above glibc's mmap threshold, so each one would be mapped and faulted in
afresh (``benchmarks/bench_encode.py`` measures the gain; docs/history/benchmarks-log.md); in bf16, pieces of 4,096
tokens. Results are float32 in the original order.

The model runs in one of three precisions (``densepass.device.resolve_precision``; ``auto`` is bf16
on GPU and on a CPU with bf16 instructions, else fp32): ``fp32``; ``bf16``, a bfloat16 copy (weights cast once, pooling
and normalisation in float32; on a CPU as fast as bf16 autocast, without a cast per operation, and a BERT, RoBERTa
or XLM-R tower runs there with fused layers, ``models.fused``, faster still: docs/benchmarks.md);
``int8``, a copy whose linear layers' products run on int8: with densepass's CPU kernels (AVX512-BF16 and
AVX512-VNNI) a BERT, RoBERTa or XLM-R tower runs ``models.fused``'s layers on int8 products, each token quantised
over its own range (so a text's embedding does not depend on the texts batched with it), faster than bf16 where
the CPU's int8 peak is twice its bf16 one (AVX-512 without AMX), MRR@10 a little below fp32 (docs/benchmarks.md);
any other tower or CPU gets dynamic quantisation (``models.quantize``: int8 weights with a scale per output
channel, activations with one scale per batch, so a text's int8 embedding depends slightly on the texts batched
with it), except the feed-forward output projections, whose inputs (GELU activations with outliers)
lose too much with one scale per batch (docs/history/benchmarks-log.md, "Encoding precision"). A copy
is made once per model and reused until its weights change (``models.copies``).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from densepass.data.texts import tokenizing
from densepass.device import attention_kernels, resolve_device, resolve_precision
from densepass.errors import ConfigError, DensepassError
from densepass.models.copies import bf16_copy, int8_copy, reused_copy
from densepass.models.fused import int8_runs
from densepass.models.inputs import Side, forward_in_pieces, piece_tokens
from densepass.models.quantize import quantized_linear_copy
from densepass.prefetch import prefetched

PAD_MULTIPLE = 8  # batches are padded to a multiple of 8 tokens: tensor-core friendly, few distinct shapes
TOKENIZE_CHUNK = 16_384  # texts tokenised at once; the next chunk is tokenised while this one is encoded


class TwoTowers(Protocol):
    """What this module needs of a model (``models.biencoder.BiEncoder`` is one): a query and a passage tower (one
    module when shared), its tokenizer, config and optional projection, its embedding ``dim`` and each side's
    ``max_length``, a forward pass ``model(input_ids, attention_mask, side=...)`` returning one embedding per
    text, and a constructor taking (query tower, passage tower, tokenizer, config, projection). Stated here so
    that the model, which encodes through this module, is not imported by it (no import circle)."""

    query_encoder: nn.Module
    passage_encoder: nn.Module
    tokenizer: PreTrainedTokenizerBase
    config: Any
    projection: nn.Linear | None

    @property
    def dim(self) -> int:
        """The embedding dimension."""

    def max_length(self, side: Side) -> int:
        """The truncation length of one side's texts."""

    def prompted(self, texts: list[str], side: Side) -> list[str]:
        """One side's texts behind its prompt (as they are encoded, in training and here alike)."""

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, side: Side) -> torch.Tensor:
        """Embeddings [batch, dim] of one side's tokenised batch."""

    def to(self, device: torch.device) -> Any:
        """The model on ``device`` (``nn.Module.to``)."""

    def eval(self) -> Any:
        """The model in inference mode (``nn.Module.eval``)."""


Model = TypeVar("Model", bound=TwoTowers)


def inference_copy(model: Model, fuse: bool = False) -> Model:
    """A copy of ``model`` for inference whose towers are bfloat16 (``models.copies.bf16_copy``; ``fuse``, on the
    CPU: BERT, RoBERTa and XLM-R towers run with ``models.fused``'s layers, which skip the padding: the pooling
    reads the tokens alone); the projection stays float32 (``pool`` returns float32). ``model`` itself is left
    untouched."""
    return _copy_towers(model, lambda tower: bf16_copy(tower, fuse, padding_outputs=False))


def quantized_copy(model: Model) -> Model:
    """A copy of ``model`` for CPU inference whose towers' products run on int8: a BERT, RoBERTa or XLM-R tower
    on densepass's CPU kernels as fused layers on int8 products (``models.fused``, ``int8_runs``: each token
    quantised over its own range, the padding skipped), any other tower dynamically quantised (``models.quantize``:
    per-channel weights, one scale per batch, all but the feed-forward output projections); the projection stays
    float32."""
    return _copy_towers(model, _int8_tower)


def _int8_tower(tower: nn.Module) -> nn.Module:
    """``quantized_copy``'s copy of one tower."""
    return int8_copy(tower) if int8_runs(tower) else quantized_linear_copy(tower)


def _copy_towers(model: Model, copy_tower) -> Model:
    """``model`` with each distinct tower replaced by ``copy_tower(tower)`` (a shared tower stays shared) and a
    copy of its projection."""
    towers = {id(t): t for t in (model.query_encoder, model.passage_encoder)}
    copies = {key: copy_tower(t) for key, t in towers.items()}
    projection = copy.deepcopy(model.projection) if model.projection is not None else None
    return type(model)(
        copies[id(model.query_encoder)], copies[id(model.passage_encoder)], model.tokenizer, model.config, projection
    ).eval()


def inference_runner(model: Model, precision: str, device: torch.device) -> Model:
    """``model`` itself (fp32), or its bf16 or int8 copy (``precision`` as ``resolve_precision`` returns it),
    made once and reused while the model's weights, device and the precision stay the same (``models.copies``)."""
    if precision == "fp32":
        return model
    if precision == "bf16":
        return reused_copy(model, (precision, device), lambda: inference_copy(model, fuse=device.type == "cpu"))
    fused = tuple(int8_runs(tower) for tower in (model.query_encoder, model.passage_encoder))  # kernels switched on
    return reused_copy(model, (precision, device, fused), lambda: quantized_copy(model))


def padded_batches(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    rows: np.ndarray,
    max_length: int,
    batch_size: int,
    max_tokens: int | None,
    pin: bool,
) -> list[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
    """Tokenise ``texts[rows]`` and cut them into batches of similar length, longest first:
    a list of (rows of the batch, input ids, attention mask), each padded to its longest row."""
    batch = [texts[r] for r in rows]
    with tokenizing(batch):
        encoded = tokenizer(
            batch, truncation=True, max_length=max_length, return_attention_mask=False, return_token_type_ids=False
        )["input_ids"]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    pad_id = tokenizer.pad_token_id or 0
    flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
    flat = np.append(flat, pad_id)  # never empty, so clipped gathers below stay in range
    starts = np.cumsum(lengths) - lengths
    by_length = np.argsort(-lengths, kind="stable")
    batches, start = [], 0
    while start < len(by_length):
        n = int(lengths[by_length[start]])
        # rounded up for fewer distinct shapes, never past max_length (a position table of 100 has no 104th row)
        longest = max(n, min(-(-n // PAD_MULTIPLE) * PAD_MULTIPLE, max_length))
        size = batch_size if max_tokens is None else max(batch_size, max_tokens // max(longest, 1))
        members = by_length[start : start + size]
        columns = np.arange(longest)
        mask = columns[None, :] < lengths[members, None]
        ids = np.where(mask, flat[np.minimum(starts[members, None] + columns[None, :], len(flat) - 1)], pad_id)
        ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))
        if pin:
            ids_t, mask_t = ids_t.pin_memory(), mask_t.pin_memory()
        batches.append((rows[members], ids_t, mask_t))
        start += len(members)
    return batches


def placed_for_inference(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to(device).eval()``, walking the modules only where something changes: each walk sets every parameter
    and module again, a fixed cost per call that a service, which encodes a few texts per call, would pay on every
    request (docs/benchmarks.md, the embedding service against infinity-emb)."""
    if any(t.device != device for t in itertools.chain(model.parameters(), model.buffers())):
        model.to(device)
    if any(module.training for module in model.modules()):
        model.eval()


def encode_texts(
    model: TwoTowers,
    texts: Sequence[str],
    side: Side,
    batch_size: int = 256,
    device: torch.device | None = None,
    precision: str = "auto",
    show_progress: bool = True,
    max_tokens: int | None = None,
) -> np.ndarray:
    """Embeddings [len(texts), dim] as float32, in the order of ``texts``, each read behind the side's prompt (the
    model's ``query_prompt`` / ``passage_prompt``), as training reads it.

    ``precision``: auto, fp32, bf16 or int8 (module docstring; ``auto``: bf16 where the device has it natively).
    ``max_tokens`` (optional) caps padded tokens per batch, so batches of short texts are larger.
    """
    device = device if isinstance(device, torch.device) else resolve_device(device)  # "cpu" too
    precision = resolve_precision(precision, device)
    if len(texts) == 0:
        raise DensepassError(f"nothing to encode: the list of {side} texts is empty")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a whole number >= 1, got {batch_size!r}")  # 0 would never end
    texts = model.prompted(list(texts), side)  # every encoding reads a side's texts behind its prompt, if any
    placed_for_inference(model, device)
    runner = inference_runner(model, precision, device)
    order = np.argsort([-len(t) for t in texts], kind="stable")
    chunks = [order[s : s + TOKENIZE_CHUNK] for s in range(0, len(order), TOKENIZE_CHUNK)]
    # a worker thread tokenises while this one encodes. With several chunks it gets its own tokenizer
    # (a fast tokenizer's truncation settings are shared state); with one, this thread just waits.
    tokenizer = model.tokenizer if len(chunks) == 1 else copy.deepcopy(model.tokenizer)
    pin = device.type == "cuda"
    # on the CPU a batch runs in pieces of 2,048 tokens, 4,096 in bf16 (module docstring)
    pieces = piece_tokens(device, bf16=precision == "bf16")

    def forward(tokens: dict[str, torch.Tensor]) -> torch.Tensor:
        return runner(tokens["input_ids"], tokens["attention_mask"], side=side)

    def prepare(rows: np.ndarray):
        return padded_batches(tokenizer, texts, rows, model.max_length(side), batch_size, max_tokens, pin)

    encoded = torch.empty((len(texts), model.dim), dtype=torch.float32, device=device)  # rows in `placed` order
    placed, filled = np.empty(len(texts), dtype=np.int64), 0
    label = {"query": "queries", "passage": "passages"}.get(side, side)
    progress = tqdm(total=len(texts), desc=f"encode {label}", disable=not show_progress, dynamic_ncols=True)
    with torch.inference_mode(), attention_kernels(device):
        for batches in prefetched(chunks, prepare):
            for rows, ids, mask in batches:
                tokens = {
                    "input_ids": ids.to(device, non_blocking=pin),
                    "attention_mask": mask.to(device, non_blocking=pin),
                }
                emb = forward_in_pieces(forward, tokens, pieces)
                encoded[filled : filled + len(rows)] = emb
                placed[filled : filled + len(rows)] = rows
                filled += len(rows)
                progress.update(len(rows))
    progress.close()
    out = np.empty((len(texts), model.dim), dtype=np.float32)
    out[placed] = encoded.cpu().numpy()
    return out
