"""Load any saved densepass retriever (bi-encoder, SPLADE or ColBERT), whichever its directory holds."""

from __future__ import annotations

from pathlib import Path

from densepass.models.biencoder import BiEncoder, resolve_model_path
from densepass.models.colbert import ColBERT
from densepass.models.kinds import model_kind, refuse_cross_encoder
from densepass.models.splade import SpladeEncoder

Retriever = BiEncoder | SpladeEncoder | ColBERT
CLASSES: dict[str, type] = {"bi-encoder": BiEncoder, "splade": SpladeEncoder, "colbert": ColBERT}


def load_model(name_or_path: str) -> Retriever:
    """The model saved in ``name_or_path`` as its own kind; a plain Hugging Face model loads as a bi-encoder."""
    path = resolve_model_path(name_or_path)
    refuse_cross_encoder(path, "a retriever's load")
    kind = model_kind(path) or "bi-encoder"
    return CLASSES[kind].from_pretrained(name_or_path)


def kind_of(model: Retriever) -> str:
    """The kind name of a loaded model."""
    return next(kind for kind, cls in CLASSES.items() if isinstance(model, cls))


def save_random_bert(path: str | Path, layers: int, hidden: int, seed: int = 13) -> str:
    """Save a BERT of ``layers`` x ``hidden`` units with random weights (drawn under torch seed ``seed``; a head
    per 64 units, feed-forward 4 x hidden) and all-MiniLM-L6-v2's tokenizer in ``path``, unless one is there: a
    start for pre-training from scratch, or a model whose matrix products cost little."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    path = Path(path)
    if not (path / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
        config = BertConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=max(1, hidden // 64),
            intermediate_size=4 * hidden,
            max_position_embeddings=512,
        )
        torch.manual_seed(seed)
        BertModel(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return str(path)
