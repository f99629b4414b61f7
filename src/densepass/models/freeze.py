"""Freezing the bottom of a pre-trained encoder while fine-tuning: the token embeddings and the lowest
transformer layers keep their starting weights (``train.freeze_layers``).

The lower layers of a pre-trained transformer hold its most general features; fine-tuning only the upper
ones is a standard guard against forgetting what the starting model knew out of domain (beside wise-ft's
weight-space ensembling, ``models.interpolate``), and on a CPU it also saves the backward pass through
every frozen layer. The towers of a bi-encoder are frozen alike (one shared encoder once).

Usage::

    model = BiEncoder.from_pretrained("all-MiniLM-L6-v2")
    freeze_bottom(model, layers=3)  # embeddings + layers 0-2 of 6 frozen: requires_grad is off
    # the training engine (training.engine) optimises only the weights that still require gradients
"""

from __future__ import annotations

from torch import nn

from densepass.errors import ConfigError


def backbones(network: nn.Module) -> list[nn.Module]:
    """The backbone of every outermost Hugging Face transformer in ``network`` (a shared tower once): a
    bi-encoder's towers, a SPLADE model's or a cross-encoder's encoder under its head, ColBERT's encoder."""
    from transformers import PreTrainedModel

    found = [m for m in network.modules() if isinstance(m, PreTrainedModel)]
    inner = {id(sub) for m in found for sub in m.modules() if sub is not m and isinstance(sub, PreTrainedModel)}
    outer = list({id(m): m for m in found if id(m) not in inner}.values())
    return list({id(m.base_model): m.base_model for m in outer}.values())


def check_freeze(model: nn.Module, layers: int) -> list[nn.Module]:
    """``freeze_bottom``'s one-line errors, changing nothing; returns the encoders it would freeze."""
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        raise ConfigError(f"freeze_layers must be a whole number >= 0, got {layers!r}")
    towers = backbones(model)
    if not towers:
        raise ConfigError(f"freeze_layers: a {type(model).__name__} holds no transformer to freeze layers of")
    for tower in towers:
        stack = getattr(getattr(tower, "encoder", None), "layer", None)
        if getattr(tower, "embeddings", None) is None or not isinstance(stack, nn.ModuleList):
            raise ConfigError(
                f"freeze_layers needs a BERT-like encoder (embeddings + encoder.layer), got {type(tower).__name__}"
            )
        if layers > len(stack):
            raise ConfigError(f"freeze_layers={layers} but the encoder has {len(stack)} layers")
    return towers


def freeze_bottom(model: nn.Module, layers: int) -> int:
    """Stop gradients to the embeddings and the ``layers`` lowest transformer layers of each tower of
    ``model`` (a ``BiEncoder``'s towers, the encoder of a ``SpladeEncoder`` or ``ColBERT``); returns the number of
    weights frozen. Idempotent. An encoder that is not BERT-like (``embeddings`` + ``encoder.layer``) or has fewer
    layers is a one-line error, before any change (``check_freeze``)."""
    frozen = {}
    for tower in check_freeze(model, layers):
        for module in [tower.embeddings, *tower.encoder.layer[:layers]]:
            for param in module.parameters():
                param.requires_grad_(False)
                frozen[id(param)] = param.numel()
    return sum(frozen.values())
