"""Which kind of retriever a saved model directory holds: a bi-encoder, SPLADE or ColBERT.

Each kind writes its own config file beside the weights (``densepass.json``, ``densepass-splade.json``,
``densepass-colbert.json``), so a loader can tell them apart before it reads any weights and refuse the
wrong one with a one-line error (``models.load.load_model`` loads whichever it is).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar

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


def refuse_cross_encoder(path: str | Path, what: str) -> None:
    """A one-line ConfigError where ``path`` holds a cross-encoder (a sequence-classification model with one
    label, as ``CrossEncoder.save`` and sentence-transformers write them): it scores (query, passage) pairs and
    embeds nothing, so ``what`` (an index, an export as a retriever) would run its bare encoder, head dropped."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(config, dict) or model_kind(path) is not None:
        return
    classifier = any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ())
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if classifier and labels == 1:
        raise ConfigError(
            f"{path} holds a cross-encoder, which scores (query, passage) pairs and embeds nothing: {what} needs a "
            "retriever; rerank with it instead (densepass rerank --model, or --rerank at search time)"
        )


def saved_architecture(path: str | Path, kind: ModelKind, cls: type[Architecture], what: str) -> Architecture | None:
    """The ``cls`` architecture saved in ``path`` by a ``kind`` model (None for a plain Hugging Face model);
    a directory holding another kind is a one-line ConfigError ("... holds a splade model, not ``what``")."""
    found = model_kind(path)
    if found not in (None, kind):
        raise ConfigError(f"{path} holds a {found} model, not {what}")
    saved = Path(path) / CONFIG_FILES[kind]
    if not saved.is_file():
        return None
    return from_dict(cls, read_model_json(saved), str(saved))


def read_model_json(file: Path) -> Any:
    """The JSON of a model's file (its configs, densepass's and sentence-transformers'), or a one-line DataError
    naming it: ``<file> does not load (truncated or damaged?): <reason>``."""
    try:
        return json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        raise DataError(f"{file} does not load (truncated or damaged?): {reason}") from None


def check_config_and_weights(folder: str | Path) -> None:
    """One line, before any work, where the model in ``folder`` cannot be built from its ``config.json`` or its
    safetensors weights do not fit the model the config describes: transformers would fail later with a traceback
    (a field of the wrong type for its ``model_type``, ``vocab_size: 0``, a hidden size no multiple of the heads)
    or, for weights of another shape, print a table of mismatches and stop. The config is read with ``AutoConfig``
    and its model built on the meta device (no memory, no weights read); then each tensor's shape in the
    safetensors headers is compared with the model's, the weights under the model's name or its
    ``base_model_prefix`` (a task model's backbone). A folder whose ``model_type`` has no plain ``AutoModel`` is
    left to its own loader, and so are weights that do not open (``loading_weights`` names them)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModel

    folder = Path(folder)
    config_file = folder / "config.json"
    weights = sorted(p for p in folder.glob("*.safetensors") if p.is_file())  # a FIFO is never opened (a wait)
    key = (str(folder.resolve()), *(_stamp(p) for p in (config_file, *weights)))
    if key in _CHECKED:
        return
    with quiet_loading():
        try:
            config = AutoConfig.from_pretrained(str(folder))
        except Exception as err:  # ValueError, KeyError, huggingface_hub's StrictDataclassFieldValidationError...
            raise DataError(f"{config_file} is not a config transformers can load: {_reason(err)}") from None
        try:
            with torch.device("meta"):
                model = AutoModel.from_config(config)
        except ValueError as err:
            if "Unrecognized configuration class" in str(err):
                _CHECKED.add(key)
                return
            raise DataError(f"{config_file} describes no model transformers can build: {_reason(err)}") from None
        except Exception as err:  # IndexError (vocab_size 0), ZeroDivisionError, TypeError...
            raise DataError(f"{config_file} describes no model transformers can build: {_reason(err)}") from None
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix else ""
    for file in weights:
        try:
            with safe_open(str(file), framework="pt") as handle:
                shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
        except (SafetensorError, OSError, ValueError):
            continue  # damaged: the loader names the file (loading_weights)
        for name, shape in shapes.items():
            want = expected.get(name, expected.get(name.removeprefix(prefix)) if prefix else None)
            if want is not None and want != shape:
                raise DataError(
                    f"{file} does not fit {config_file}: {name} is {list(shape)}, the config makes it {list(want)} "
                    "(the config edited, or the weights of another model?)"
                )
    _CHECKED.add(key)


_CHECKED: set[tuple] = set()  # folders check_config_and_weights passed, with the size and time of their files


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _reason(err: BaseException) -> str:
    """An exception's message on one line (its first two lines: huggingface_hub puts the cause on the second)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()][:2]
    text = " ".join(lines) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


PICKLED_WEIGHTS = "pytorch_model.bin"
"""Weights a Hugging Face model directory may hold instead of safetensors: transformers reads them with torch's
weights-only loader (``weights_only=True``: tensors and plain containers, never an arbitrary object)."""


@contextmanager
def loading_weights(directory: str | Path, weights: str = "model.safetensors") -> Iterator[None]:
    """Turn weights that do not load, in a model directory without a manifest to check them by (a truncated or
    damaged ``weights`` file, which safetensors reports as a ``SafetensorError``, or a read that fails), into one
    line: ``<directory>/model.safetensors does not load (truncated or damaged?): <reason>``. A directory with only
    ``pytorch_model.bin`` has it read by the weights-only loader, which refuses any pickled object: a damaged or
    foreign one (``UnpicklingError``, a truncated zip archive, an empty file) is the same line naming that file.
    A directory without any weights file is one line too; transformers' other errors (an unknown architecture)
    pass through."""
    try:
        yield
    except Exception as err:
        if isinstance(err, OSError) and err.errno is None:
            if "no file named" in str(err):  # an incomplete copy or download: no weights at all
                raise ConfigError(
                    f"{directory} holds no weights to load ({weights}, or a {PICKLED_WEIGHTS} of tensors): an "
                    "incomplete copy or download?"
                ) from None
            raise  # transformers' other errors: not a damaged file
        pickled = _only_pickled_weights(Path(directory), weights)
        refused = type(err).__name__ == "UnpicklingError"  # by name: densepass imports no pickle module
        if not isinstance(err, (SafetensorError, OSError)) and not (
            pickled and (refused or isinstance(err, (EOFError, RuntimeError, KeyError)))
        ):
            raise
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if pickled and not isinstance(err, OSError):  # torch's own message suggests weights_only=False: never
            said = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(err))
            detail = said.group(1) if said else reason.split(". ")[0] if str(err).strip() else ""
            if isinstance(err, (EOFError, KeyError)):
                detail = f"{type(err).__name__} {detail}"
            reason = f"not tensors that torch's weights-only loader reads ({detail.strip()})"
        name = PICKLED_WEIGHTS if pickled else weights
        raise DataError(f"{Path(directory) / name} does not load (truncated or damaged?): {reason}") from None


@contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' loading output silenced for the block: its "Loading weights" progress bar and its LOAD REPORT
    (a table of missing and unexpected weights, logged as a warning over many lines). For a load whose missing
    weights densepass reports itself, in one line (a cross-encoder's relevance head), or expects (a new head)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _only_pickled_weights(directory: Path, weights: str) -> bool:
    """Whether ``directory`` holds ``pytorch_model.bin`` and not ``weights`` (what transformers then reads)."""
    if weights != "model.safetensors":  # a head of its own (ColBERT's linear layer, a phrase tower's): no fallback
        return False
    try:
        return not (directory / weights).exists() and (directory / PICKLED_WEIGHTS).is_file()
    except OSError:
        return False
