"""What a sentence-transformers model directory says about its architecture, read as a ``BiEncoderConfig``.

A sentence-transformers model is a transformer followed by modules listed in ``modules.json``: Pooling (which
token vectors make the embedding), an optional Dense layer (a projection), an optional Normalize; its
``config_sentence_transformers.json`` may name prompts for queries and documents. Loading such a model as a plain
Hugging Face model with densepass's defaults (mean pooling, normalised, no projection, no prompts) would give
other embeddings than the model's authors' (a CLS-pooled BGE, a model with a Dense layer): ``BiEncoder``
starts from what these files say instead. A module densepass cannot reproduce (max pooling, a Dense layer with an
activation, a router, a custom module) is a one-line ConfigError, not a model that silently embeds otherwise.

densepass's own saved models carry these files too (``BiEncoder.save``), but their ``densepass.json`` is read first.
"""

from __future__ import annotations

from pathlib import Path

from densepass.config import BiEncoderConfig
from densepass.errors import ConfigError, DataError
from densepass.models.kinds import read_model_json

MODULES = "modules.json"
POOLING_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}  # sentence-transformers' names: densepass's
LEGACY_MODES = {
    "cls_token": "cls",
    "mean_tokens": "mean",
    "max_tokens": "max",
    "mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "weightedmean_tokens": "weightedmean",
    "lasttoken": "lasttoken",
}  # pooling_mode_<key>: true before v5
IDENTITY = ("torch.nn.modules.linear.Identity", "torch.nn.Identity")


def _modules(path: Path) -> list[dict] | None:
    """The module list of ``modules.json`` (None where there is none), each checked to have a type and a path."""
    file = path / MODULES
    if not file.is_file():
        return None
    modules = read_model_json(file)
    if not isinstance(modules, list) or not all(
        isinstance(m, dict) and isinstance(m.get("type"), str) and isinstance(m.get("path", ""), str) for m in modules
    ):
        raise DataError(f"{file} is not a sentence-transformers module list (entries with a type and a path)")
    return [{**m, "path": m.get("path", "")} for m in modules]  # no path: the model's root, as for the transformer


def _kind(module: dict) -> str:
    return module["type"].rsplit(".", 1)[-1]


def _lower_cases_alone(path: Path) -> bool:
    """Whether the transformer module's ``sentence_bert_config.json`` has sentence-transformers lower-case the
    texts (``do_lower_case``) where the model's tokenizer, as it loads, does not: it tokenises a capitalised text
    otherwise than the same text in lower case."""
    settings = path / "sentence_bert_config.json"
    values = read_model_json(settings) if settings.is_file() else {}
    if not isinstance(values, dict) or values.get("do_lower_case") is not True:
        return False
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))  # a tokenizer's files: no code of the model's runs
    sample = "Audio Editor For The Desktop"
    return tokenizer(sample)["input_ids"] != tokenizer(sample.lower())["input_ids"]


def dense_folder(path: str | Path) -> Path | None:
    """The folder of the Dense layer ``modules.json`` lists (None without one); ``2_Dense`` without a module list."""
    path = Path(path)
    modules = _modules(path)
    if modules is None:
        return path / "2_Dense" if (path / "2_Dense").is_dir() else None
    found = [m for m in modules if _kind(m) == "Dense"]
    return path / found[0]["path"] if found else None


def sentence_transformers_architecture(path: str | Path) -> BiEncoderConfig | None:
    """The architecture a sentence-transformers model directory describes (None without ``modules.json``): its
    pooling, its Dense layer's output size as ``projection_dim``, whether it normalises, and its query and document
    prompts. The other fields keep their defaults (its ``max_seq_length`` is not taken: a run's lengths are its own).
    A module densepass cannot reproduce is a one-line ConfigError naming it."""
    path = Path(path)
    modules = _modules(path)
    if modules is None:
        return None
    kinds = [_kind(m) for m in modules]
    where = f"{path} is a sentence-transformers model"
    if not kinds or kinds[0] != "Transformer" or modules[0].get("path", "") != "":
        raise ConfigError(f"{where} whose first module is not a transformer at its root: densepass cannot load it")
    expected = ["Transformer", "Pooling", "Dense", "Normalize"]
    order = [k for k in expected if k in kinds]
    if kinds != order or kinds.count("Pooling") != 1:
        unknown = sorted(set(kinds) - set(expected))
        what = f"modules densepass does not have ({', '.join(unknown)})" if unknown else f"modules {kinds}"
        raise ConfigError(f"{where} with {what}: densepass reads Transformer, Pooling, [Dense], [Normalize] in order")
    pooling_dir = path / modules[kinds.index("Pooling")]["path"]
    pooling_config = read_model_json(pooling_dir / "config.json") if (pooling_dir / "config.json").is_file() else {}
    if not isinstance(pooling_config, dict):
        raise DataError(f"{pooling_dir / 'config.json'} is not a JSON object")
    mode = pooling_config.get("pooling_mode")
    if isinstance(mode, str):
        modes = [mode]
    elif isinstance(mode, list) and all(isinstance(m, str) for m in mode):
        modes = list(mode)
    elif mode is not None:  # (a number was read as the default, mean)
        raise DataError(f"{pooling_dir / 'config.json'}: pooling_mode {mode!r} is not a pooling name")
    else:
        legacy = [
            k.removeprefix("pooling_mode_") for k, v in pooling_config.items() if k.startswith("pooling_mode_") and v
        ]
        modes = [LEGACY_MODES.get(k, k) for k in legacy] or ["mean"]  # sentence-transformers' default
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ConfigError(
            f"{where} pooled by {' + '.join(modes) or 'nothing'}: densepass pools by cls, mean tokens or last token"
        )
    if _lower_cases_alone(path):
        raise ConfigError(
            f"{where} whose sentence_bert_config.json lower-cases the texts (do_lower_case) where its tokenizer does"
            " not: densepass tokenises the texts as given"
        )
    if pooling_config.get("include_prompt", True) is False:
        raise ConfigError(f"{where} whose pooling leaves out the prompt's tokens: densepass pools over them too")
    projection_dim = None
    if "Dense" in kinds:
        dense_dir = path / modules[kinds.index("Dense")]["path"]
        dense = read_model_json(dense_dir / "config.json") if (dense_dir / "config.json").is_file() else None
        out_features = dense.get("out_features") if isinstance(dense, dict) else None
        if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features < 1:
            raise DataError(f"{dense_dir} has no readable Dense config (config.json with out_features)")
        # sentence-transformers' Dense applies tanh when no activation is named
        activation = dense.get("activation_function", "torch.nn.modules.activation.Tanh")
        if activation not in IDENTITY or dense.get("bias", True) is not True:
            raise ConfigError(
                f"{where} whose Dense layer has {'no bias' if dense.get('bias', True) is not True else activation}: "
                "densepass's projection is linear with a bias"
            )
        if not (dense_dir / "model.safetensors").is_file():
            raise ConfigError(f"{where} whose Dense layer's weights are not in {dense_dir}/model.safetensors")
        projection_dim = dense["out_features"]
    prompts = {}
    settings = path / "config_sentence_transformers.json"
    if settings.is_file():
        values = read_model_json(settings)
        prompts = (values.get("prompts") if isinstance(values, dict) else None) or {}
        if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
            raise DataError(f"{settings}: its prompts are not names with texts ({prompts!r:.80})")
    return BiEncoderConfig(
        pooling=POOLING_MODES[modes[0]],  # type: ignore[arg-type]
        projection_dim=projection_dim,
        normalize="Normalize" in kinds,
        query_prompt=prompts.get("query", ""),
        passage_prompt=prompts.get("document", prompts.get("passage", "")),
    )
