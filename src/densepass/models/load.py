"""Load any saved densepass retriever (bi-encoder, SPLADE or ColBERT), whichever its directory holds."""

from __future__ import annotations

from densepass.models.biencoder import BiEncoder, resolve_model_path
from densepass.models.colbert import ColBERT
from densepass.models.kinds import model_kind
from densepass.models.splade import SpladeEncoder

Retriever = BiEncoder | SpladeEncoder | ColBERT
CLASSES: dict[str, type] = {"bi-encoder": BiEncoder, "splade": SpladeEncoder, "colbert": ColBERT}


def load_model(name_or_path: str) -> Retriever:
    """The model saved in ``name_or_path`` as its own kind; a plain Hugging Face model loads as a bi-encoder."""
    kind = model_kind(resolve_model_path(name_or_path)) or "bi-encoder"
    return CLASSES[kind].from_pretrained(name_or_path)


def kind_of(model: Retriever) -> str:
    """The kind name of a loaded model."""
    return next(kind for kind, cls in CLASSES.items() if isinstance(model, cls))
