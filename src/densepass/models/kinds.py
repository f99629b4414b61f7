"""Which kind of retriever a saved model directory holds: a bi-encoder, SPLADE or ColBERT.

Each kind writes its own config file beside the weights (``densepass.json``, ``densepass-splade.json``,
``densepass-colbert.json``), so a loader can tell them apart before it reads any weights and refuse the
wrong one with a one-line error (``models.load.load_model`` loads whichever it is).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, TypeVar

from safetensors import SafetensorError

from densepass.config import from_dict
from densepass.errors import ConfigError, DataError

ModelKind = Literal["bi-encoder", "splade", "colbert"]
Architecture = TypeVar("Architecture")
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


def saved_architecture(path: str | Path, kind: ModelKind, cls: type[Architecture], what: str) -> Architecture | None:
    """The ``cls`` architecture saved in ``path`` by a ``kind`` model (None for a plain Hugging Face model);
    a directory holding another kind is a one-line ConfigError ("... holds a splade model, not ``what``")."""
    found = model_kind(path)
    if found not in (None, kind):
        raise ConfigError(f"{path} holds a {found} model, not {what}")
    saved = Path(path) / CONFIG_FILES[kind]
    return from_dict(cls, json.loads(saved.read_text()), str(saved)) if saved.is_file() else None


@contextmanager
def loading_weights(directory: str | Path, weights: str = "model.safetensors") -> Iterator[None]:
    """Turn weights that do not load, in a model directory without a manifest to check them by (a truncated or
    damaged ``weights`` file, which safetensors reports as a ``SafetensorError``, or a read that fails), into one
    line: ``<directory>/model.safetensors does not load (truncated or damaged?): <reason>``. transformers' own
    errors (a missing weights file, an unknown architecture) pass through."""
    try:
        yield
    except (SafetensorError, OSError) as err:
        if isinstance(err, OSError) and err.errno is None:
            raise  # transformers' "no file named ..." and the like: not a damaged file
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"{Path(directory) / weights} does not load (truncated or damaged?): {reason}") from None
