"""Checks shared by the indexes that encode queries with a model of their own (dense, SPLADE, ColBERT)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from densepass.errors import ConfigError, DataError
from densepass.fingerprints import fingerprint_weights
from densepass.models.kinds import model_kind

# the settings of a model that change its embeddings beside its weights (bi-encoder; ColBERT's dim, skiplist, markers)
SETTINGS = ("shared", "pooling", "normalize", "projection_dim", "query_prompt", "passage_prompt", "dim", "skiplist",
            "markers")  # fmt: skip


def encoded_precision(precision: str, device: Any) -> str:
    """What the manifest records as the precision an index encodes in: its ``precision`` setting as ``device``
    resolves it (``auto``: bf16 or fp32 by the device)."""
    from densepass.device import default_device, resolve_precision

    return resolve_precision(precision, device or default_device())


def precision_as_built(manifest: dict, options: dict) -> dict:
    """Load ``options`` with ``precision`` the one a saved index's passages were encoded in (its manifest's), where
    the caller left it to ``auto``: queries then encode as the passages did, not as this machine's ``auto`` would
    (an index built in fp32 keeps searching in fp32 on a CPU with fast bf16). A precision the device does not run
    (int8 off the CPU) or runs slowly (bf16 on a CPU without fast bf16) keeps ``auto``, as does a manifest of an
    index saved before the precision was recorded."""
    from densepass.device import default_device, fast_bf16

    built = manifest.get("precision")
    if built is None or options.get("precision", "auto") != "auto":
        return options
    device = options.get("device") or default_device()
    if (built == "int8" and device.type != "cpu") or (built == "bf16" and not fast_bf16(device)):
        return options
    return {**options, "precision": built}


def model_settings(model: Any) -> dict:
    """What an index records of its model besides the weights' fingerprint: the :data:`SETTINGS` its config has."""
    return config_settings(getattr(model, "config", None))


def config_settings(config: Any) -> dict:
    """The :data:`SETTINGS` a model config has."""
    return {key: getattr(config, key) for key in SETTINGS if hasattr(config, key)}


def _settings_before_they_were_recorded(model: Any) -> dict | None:
    """What an index saved before it recorded settings was built with, where that differs from how the model loads
    now: a sentence-transformers model without ``densepass.json`` loaded then with densepass's defaults (mean
    pooling, normalised, no projection, no prompts) and now with its own modules' (``models.st_layout``); None
    where nothing changed (a model densepass saved: its ``densepass.json`` was read then too)."""
    from densepass.config import BiEncoderConfig
    from densepass.models.kinds import CONFIG_FILES

    source = getattr(model, "source", None)
    if (
        not isinstance(source, str)
        or not Path(source).is_dir()
        or (Path(source) / CONFIG_FILES["bi-encoder"]).is_file()
    ):
        return None
    if not isinstance(getattr(model, "config", None), BiEncoderConfig):
        return None
    defaults = config_settings(BiEncoderConfig())
    return defaults if model_settings(model) != defaults else None


def model_for_index(directory: Path, kind: str, recorded: dict, model: Any, cls: type) -> Any:
    """The model a saved index of ``kind`` encodes queries with: ``model`` if given (it must be of the right
    class and have the recorded weights and settings: the same weights pooled or prompted otherwise embed queries
    apart from the passages), else the one at the recorded path."""
    if model is None:
        if not recorded["path"] or not Path(recorded["path"]).exists():
            missing = f"{directory}: its model {recorded['path']!r} is not there any more"
            raise DataError(f"{missing}; pass the model (--model)")
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
    saved, given = recorded.get("settings"), model_settings(model)  # (indexes saved before it: weights only)
    if saved is None:
        saved = _settings_before_they_were_recorded(model)
    changed = [key for key in saved or {} if key in given and given[key] != saved[key]]
    if changed:
        shown = ", ".join(f"{key} {given[key]!r} (the index's: {saved[key]!r})" for key in changed)
        raise ConfigError(
            f"{directory} was built with the same weights but other settings: {shown}; load the model as it was "
            "saved or index again"
        )
    return model
