"""Losses: the objects training minimises (``objectives``: ``InfoNCE``, ``Distillation``, ``FLOPS``, composed with
``+``; ``Matryoshka`` wraps any of them) and the pure functions of scores or embeddings they are made of, one per
module, each citing its equation."""

from densepass.losses.contrastive import contrastive_loss, false_negative_mask
from densepass.losses.listwise_kl import listwise_kl_loss
from densepass.losses.localized_contrastive import localized_contrastive_loss, pointwise_bce_loss
from densepass.losses.margin_mse import margin_mse_loss
from densepass.losses.matryoshka import Matryoshka
from densepass.losses.objectives import FLOPS, Distillation, InfoNCE, Objective, Sum
from densepass.losses.unified import separate_terms_loss, unified_loss

__all__ = [
    "FLOPS",
    "Distillation",
    "InfoNCE",
    "Matryoshka",
    "Objective",
    "Sum",
    "contrastive_loss",
    "false_negative_mask",
    "listwise_kl_loss",
    "localized_contrastive_loss",
    "margin_mse_loss",
    "pointwise_bce_loss",
    "separate_terms_loss",
    "unified_loss",
]
