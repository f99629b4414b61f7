"""Training objectives (pure functions of scores or embeddings): one loss per module, each citing its equation."""

from densepass.losses.contrastive import contrastive_loss, false_negative_mask
from densepass.losses.unified import separate_terms_loss, unified_loss

__all__ = ["contrastive_loss", "false_negative_mask", "separate_terms_loss", "unified_loss"]
