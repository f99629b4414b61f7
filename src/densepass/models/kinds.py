"""Which kind of retriever a saved model directory holds: a bi-encoder, SPLADE or ColBERT.

Each kind writes its own config file beside the weights (``densepass.json``, ``densepass-splade.json``,
``densepass-colbert.json``), so a loader can tell them apart before it reads any weights and refuse the
wrong one with a one-line error (``models.load.load_model`` loads whichever it is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

ModelKind = Literal["bi-encoder", "splade", "colbert"]
CONFIG_FILES: dict[str, str] = {
    "splade": "densepass-splade.json",
    "colbert": "densepass-colbert.json",
    "bi-encoder": "densepass.json",
}


def model_kind(path: str | Path) -> ModelKind | None:
    """The kind of the densepass model saved in ``path``; None for anything else (a Hugging Face model,
    which every kind can start from)."""
    for kind, name in CONFIG_FILES.items():
        if (Path(path) / name).is_file():
            return kind  # type: ignore[return-value]
    return None
