"""Inference copies of a model in lower precision, made once and reused while the model's weights stay the same.

Encoding in bf16 or int8 runs a copy of the model, never the model itself (which may still train, in float32): a
bfloat16 copy (``bf16_copy``; on the CPU with ``models.fused``'s layers where the encoder is BERT-layered) or an int8
one (``models.encode.quantized_copy``: ``models.fused``'s int8 layers, or ``models.quantize``). A copy takes a deep
copy, a cast and, fused, a reordering of every weight, so a server encoding one query at a time must not make one
per call (making it cost more than the query's encoding itself: docs/benchmarks.md, "Search service"):
``reused_copy`` keeps one copy per model, keyed by the precision, the device and ``models.quantize.weights_key`` (a
training step or a load makes a new one).

>>> from transformers import AutoModel
>>> from densepass.models.biencoder import resolve_model_path
>>> bert = AutoModel.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
>>> cpu = torch.device("cpu")
>>> runner = reused_copy(bert, ("bf16", cpu), lambda: bf16_copy(bert, fuse=True))
>>> runner is reused_copy(bert, ("bf16", cpu), lambda: bf16_copy(bert, fuse=True))
True
>>> runner.embeddings.word_embeddings.weight.dtype
torch.bfloat16
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch
from torch import nn

from densepass.device import resolve_precision
from densepass.errors import ConfigError
from densepass.models.fused import FusedBertEncoder, fusable, int8_runs
from densepass.models.quantize import weights_key

M = TypeVar("M", bound=nn.Module)
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (key, its inference copy)


def reused_copy(model: nn.Module, setting: Hashable, make: Callable[[], M]) -> M:
    """``make()``, a copy of ``model`` for ``setting`` (e.g. the precision and device), made at the first call and
    returned again while ``model``'s weights, its ``config`` and ``setting`` stay the same; one copy per model is
    kept (a new setting, config or weights replace it, the stale copy freed first)."""
    key = (setting, repr(getattr(model, "config", None)), weights_key(model))
    cached = _COPIES.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    _COPIES.pop(model, None)
    made = make()
    _COPIES[model] = (key, made)
    return made


def bf16_copy(model: nn.Module, fuse: bool, first_position: bool = False, padding_outputs: bool = True) -> nn.Module:
    """A bfloat16 copy of a ``transformers`` model in eval mode, without gradients; ``model`` is left untouched.
    With ``fuse`` (the CPU), a BERT-layered encoder (``models.fused.fusable``) runs as ``FusedBertEncoder``: the
    model itself, or the encoder under its head (``base_model_prefix``: the ``bert`` of a ``BertForMaskedLM``,
    whose head then runs as it is, in bf16); ``first_position``: its last layer can run on the first position
    only (a cross-encoder's); ``padding_outputs``: False where only the tokens' hidden states are read
    (``FusedBertEncoder``)."""
    half = copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False)
    if not fuse:
        return half
    if fusable(half):
        return FusedBertEncoder(half, first_position, padding_outputs)
    base = fusable_base(half)
    if base is not None:
        setattr(half, half.base_model_prefix, FusedBertEncoder(base, first_position, padding_outputs))
    return half


def int8_copy(model: nn.Module) -> nn.Module:
    """A bf16 copy of a BERT-layered ``transformers`` encoder, or of a model with a head on one (``fusable_base``:
    a classifier), whose encoder runs ``FusedBertEncoder``'s int8 layers on its tokens alone (the padding's hidden
    states zero: for a bi-encoder's pooling and a head that reads the first position), a head as it is, in bf16;
    where ``models.fused.int8_runs`` the encoder (a one-line error otherwise). ``model`` is left untouched."""
    half = copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False)
    base = half if fusable(half) else fusable_base(half)
    if base is None or not int8_runs(base):
        raise ValueError(f"the int8 layers do not run the encoder of a {type(model).__name__} here")
    fused = FusedBertEncoder(base, padding_outputs=False, int8=True)
    if base is half:
        return fused
    setattr(half, half.base_model_prefix, fused)
    return half


def fusable_base(model: nn.Module) -> nn.Module | None:
    """The encoder under ``model``'s head (its ``base_model_prefix`` attribute) where the fused layers compute it,
    else None."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    return base if isinstance(base, nn.Module) and base is not model and fusable(base) else None


KIND_NAMES = {"splade": "SPLADE", "colbert": "ColBERT"}  # model kinds (``models.kinds``) as messages name them


def float_precision(precision: str, device: torch.device, kind: str) -> str:
    """fp32 or bf16: a ``precision`` setting as ``device.resolve_precision`` reads it (``auto``: bf16 where it is
    fast), for a ``kind`` model (``splade``, ``colbert``) that runs no int8; a one-line error
    otherwise."""
    resolved = resolve_precision(precision, device)
    if resolved not in ("fp32", "bf16"):
        raise ConfigError(f"{KIND_NAMES.get(kind, kind)} models encode in fp32 or bf16 (or auto), not {precision}")
    return resolved


def encoder_in_precision(model: nn.Module, precision: str, device: torch.device) -> nn.Module:
    """What encodes for ``model`` on ``device`` in ``precision`` (fp32 or bf16, as ``float_precision`` returns
    it): the model itself, or its reused bf16 copy (``bf16_copy``, fused on the CPU)."""
    if precision == "fp32":
        return model
    return reused_copy(model, (precision, device), lambda: bf16_copy(model, fuse=device.type == "cpu"))
