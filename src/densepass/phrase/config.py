"""Typed configuration of phrase retrieval (``densepass phrase CONFIG``), loaded like ExperimentConfig.

Defaults follow training-inference-gap §6 where the paper gives them (λ_inp = λ_hard = 1, λ_inb = 256,
k = 10 and h = 1 for hard negatives) and are otherwise sized for a CPU and SQuAD-sized data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from densepass.config import (
    DEFAULT_MODEL,
    SEED_MAX,
    AutocastOptimConfig,
    DatasetFormat,
    OptimConfig,
    check_run_name,
    option,
    with_default,
)


@dataclass
class PhraseDataConfig:
    """Questions with answer spans (SQuAD layout) and which of them to use."""

    name: str = option("squad-v1.1-dev-split", "dataset: a folder under the data directory, or a path to one")
    data_dir: str | None = option(
        None, "data directory (null: $DENSEPASS_DATA, else shared/data beside or above the working directory)"
    )
    format: DatasetFormat = option("squad", "dataset layout (phrase retrieval needs answer offsets: squad)")
    train_split: str = option("train", "split whose questions are trained on (its passages are the training corpus)")
    eval_split: str = option("dev", "split whose questions validate and are evaluated")
    max_train_questions: int | None = option(None, "a seeded sample of this many training questions", min=1)
    max_eval_questions: int | None = option(None, "a seeded sample of this many evaluation questions", min=1)
    seed: int = option(13, "seed of the samples", min=0, max=SEED_MAX)


@dataclass
class PhraseModelConfig:
    """The phrase and question encoders (saved with the model: changing them changes the model)."""

    base: str = option(DEFAULT_MODEL, "encoder both towers start from (a saved phrase model continues training)")
    max_length: int = option(256, "tokens per passage window (title + text + special tokens)", min=32)
    stride: int = option(64, "tokens shared by consecutive windows of a passage longer than max_length", min=0)
    title_max_tokens: int = option(24, "title tokens kept in front of every window (0: no title)", min=0)
    question_max_length: int = option(64, "tokens per question", min=8)
    max_answer_tokens: int = option(16, "longest phrase: end - start + 1 tokens (the span constraint)", min=1)
    pooling: Literal["mean", "cls"] = option("mean", "question vector: mean of the tokens or the CLS token")


@dataclass
class PhraseTrainConfig(AutocastOptimConfig):
    """Training of both encoders (training-inference-gap §4): eq. 1 or eq. 2 over token columns."""

    learning_rate: float = with_default(OptimConfig, "learning_rate", 3e-5)
    checkpoint_every: int = with_default(OptimConfig, "checkpoint_every", 100)
    keep_checkpoints: int = with_default(OptimConfig, "keep_checkpoints", 1)

    init: str | None = option(None, "start from this saved phrase model (null: model.base)")
    loss: Literal["unified", "separate"] = option("unified", "unified: eq. 2; separate: eq. 1 (original DensePhrases)")
    lambda_inp: float = option(1.0, "eq. 2: weight of in-passage negatives", above=0)
    lambda_inb: float = option(256.0, "eq. 2: weight of in-batch and pre-batch negatives", above=0)
    lambda_hard: float = option(1.0, "eq. 2: weight of hard negatives", above=0)
    separate_weight: float = option(1.0, "eq. 1: weight λ of the in-batch/pre-batch term", min=0)
    in_batch: bool = option(True, "contrast with the other passages of the batch (eq. 1: their gold tokens only)")
    prebatch: int = option(2, "T: earlier batches kept as negatives (0: none)", min=0)
    prebatch_warmup: int = option(0, "steps before pre-batch negatives are used", min=0)
    hard_negatives: int = option(0, "h: hard-negative passages per passage group and step (0: none)", min=0)
    hard_negatives_file: str | None = option(None, "JSONL of mined hard negatives (null: mine with `init`)")
    mine_depth: int = option(10, "k: top phrases per training question whose passages become hard negatives", min=1)
    passages_per_batch: int = option(8, "passages (each with some of its questions) per step", min=1)
    questions_per_passage: int = option(4, "most questions of one passage in one step", min=1)
    epochs: int = option(2, "passes over the training questions", min=1)
    max_steps: int | None = option(None, "stop after this many steps (null: every epoch)", min=1)


@dataclass
class PhraseValidationConfig:
    """Checkpoint selection by phrase retrieval accuracy on a validation subcorpus (training-inference-gap §3)."""

    enabled: bool = option(True, "validate during training and keep the best model in best-model/")
    subcorpus: Literal["gold", "random", "hard", "full"] = option("hard", "C0 (gold), R_r (random), H_k (hard) or C")
    r: float = option(0.5, "random subcorpus: |R_r| = r |C|", above=0, max=1)
    k: int = option(2, "hard subcorpus: top-k passages of every question under BM25", min=1)
    every_steps: int | None = option(None, "validate every N steps (null: at the end of every epoch)", min=1)
    max_questions: int | None = option(None, "a seeded sample of this many validation questions", min=1)


@dataclass
class FilterConfig:
    """The token filter (training-inference-gap §5): a linear classifier over frozen token vectors."""

    enabled: bool = option(True, "train the filter after the encoder and sweep its threshold")
    epochs: int = option(3, "passes over the training tokens", min=1)
    batch_size: int = option(4096, "tokens per step", min=1)
    learning_rate: float = option(1e-3, "Adam learning rate", above=0)
    thresholds: list[float] = option(
        help="thresholds of the index-size / accuracy sweep (logits; Figure 2)",
        factory=lambda: [-6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0],
    )
    threshold: float | None = option(None, "threshold of the final index (null: no filtering)")


@dataclass
class QueryTuningConfig(AutocastOptimConfig):
    """Query-side fine-tuning: the question encoder only, against a fixed index of the training passages."""

    learning_rate: float = with_default(OptimConfig, "learning_rate", 1e-5)
    checkpoint_every: int = with_default(OptimConfig, "checkpoint_every", 100)
    keep_checkpoints: int = with_default(OptimConfig, "keep_checkpoints", 1)
    log_every: int = with_default(OptimConfig, "log_every", 1)

    enabled: bool = option(False, "fine-tune the question encoder after training")
    epochs: int = option(1, "passes over the training questions", min=1)
    batch_size: int = option(16, "questions per step", min=1)
    top_k: int = option(50, "phrases retrieved per question: those without an answer are its hard negatives", min=1)


@dataclass
class PhraseEvalConfig:
    """Final evaluation on the whole corpus (every split's passages)."""

    ks: list[int] = option(help="k of answer accuracy and passage recall", factory=lambda: [1, 5, 20], min=1)
    batch_size: int = option(32, "windows per encoding batch", min=1)
    vector_dtype: Literal["float16", "float32"] = option("float16", "precision of the indexed start/end vectors")


@dataclass
class PhraseConfig:
    """One phrase-retrieval run; everything is written under ``<output_dir>/<name>/``."""

    name: str = option("phrase", "name of the run: everything goes to <output_dir>/<name>/")
    output_dir: str = option("outputs", "folder of the runs' directories")
    device: str | None = option(None, "cpu, cuda or cuda:N (null: cuda when available)")
    data: PhraseDataConfig = option(help="dataset", factory=PhraseDataConfig)
    model: PhraseModelConfig = option(help="encoders", factory=PhraseModelConfig)
    train: PhraseTrainConfig = option(help="training", factory=PhraseTrainConfig)
    validation: PhraseValidationConfig = option(help="checkpoint selection", factory=PhraseValidationConfig)
    filter: FilterConfig = option(help="token filter", factory=FilterConfig)
    query_tuning: QueryTuningConfig = option(help="query-side fine-tuning", factory=QueryTuningConfig)
    eval: PhraseEvalConfig = option(help="evaluation", factory=PhraseEvalConfig)

    def __post_init__(self) -> None:
        check_run_name(self.name)

    @property
    def run_dir(self) -> Path:
        """Where this run writes: ``<output_dir>/<name>``."""
        return Path(self.output_dir) / self.name
