"""Encoders: the bi-encoder (shared or separate towers, pooling, projection, normalisation)."""

from densepass.models.biencoder import BiEncoder, BiEncoderConfig, resolve_model_path

__all__ = ["BiEncoder", "BiEncoderConfig", "resolve_model_path"]
