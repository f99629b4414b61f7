"""Training objectives (pure functions of embeddings)."""

from densepass.losses.contrastive import contrastive_loss, false_negative_mask

__all__ = ["contrastive_loss", "false_negative_mask"]
