"""Checks shared by the indexes that encode queries with a model of their own (dense, SPLADE, ColBERT)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from densepass.errors import ConfigError, DataError
from densepass.fingerprints import fingerprint_weights
from densepass.models.kinds import model_kind


def model_for_index(directory: Path, kind: str, recorded: dict, model: Any, cls: type) -> Any:
    """The model a saved index of ``kind`` encodes queries with: ``model`` if given (it must be of the right
    class and have the recorded weights), else the one at the recorded path."""
    if model is None:
        if not recorded["path"] or not Path(recorded["path"]).exists():
            raise DataError(f"{directory}: its model {recorded['path']!r} is not there any more; pass the model")
        model = cls.from_pretrained(recorded["path"])
    if not isinstance(model, cls):
        source = getattr(model, "source", None) or type(model).__name__
        other = model_kind(source) if isinstance(source, str) and Path(source).is_dir() else None
        raise ConfigError(f"{directory} is a {kind} index; {source} is a {other or type(model).__name__} model")
    if fingerprint_weights(model) != recorded["fingerprint"]:
        raise ConfigError(
            f"{directory} was built with another model (weights {recorded['fingerprint'][:12]}, "
            f"from {recorded['path']}): encode queries with that model or index again"
        )
    return model
