"""Typed configuration of a pre-training run (``densepass pretrain CONFIG``), loaded like ExperimentConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from densepass.config import (
    DEFAULT_MODEL,
    SEED_MAX,
    AutocastOptimConfig,
    DatasetFormat,
    OptimConfig,
    RunConfig,
    option,
    with_default,
)

Mode = Literal["mlm", "condenser", "cocondenser", "contriever"]


@dataclass
class PretrainDataConfig:
    """The corpus whose passages are pre-trained on (any densepass dataset layout)."""

    name: str = option("debian-packages", "dataset: a folder under the data directory, or a path to one")
    data_dir: str | None = option(
        None, "data directory (null: $DENSEPASS_DATA, else shared/data beside or above the working directory)"
    )
    format: DatasetFormat = option("beir", "dataset layout: beir, msmarco, dpr or squad")
    max_passages: int | None = option(None, "a seeded subset of this many passages (null: the whole corpus)", min=1)
    seed: int = option(13, "seed of the subset", min=0, max=SEED_MAX)


@dataclass
class PretrainModelConfig:
    """Backbone, layer split and objective.

    ``mlm``: MLM on the late (last-layer) outputs only, i.e. BertForMaskedLM. ``condenser``: head MLM
    plus backbone MLM (condenser eq. 9-11). ``cocondenser``: those plus the span contrastive loss on
    the late CLS (abs-condenser-openqa eq. 10-11). ``contriever``: a bi-encoder matching two random crops of a
    document, negatives from a MoCo queue (neural-retrieval-lecture; settings in the ``contriever`` section).
    """

    name_or_path: str = option(DEFAULT_MODEL, "the BERT-family backbone to continue pre-training")
    mode: Mode = option("condenser", "objective: mlm, condenser, cocondenser or contriever")
    early_layers: int = option(3, "backbone layers whose output feeds the head (L^e); the rest are late", min=1)
    head_layers: int = option(2, "Condenser head layers (L^h), initialised at random", min=1, max=64)
    temperature: float = option(
        1.0,
        "temperature of the contrastive loss (coCondenser eq. 10: 1, plain dot products; Contriever: 0.05)",
        above=0,
    )
    save_pooling: Literal["cls", "mean"] = option(
        "cls", "pooling written into the saved backbone's ST files (contriever: also the pooling it trains)"
    )


@dataclass
class MaskingConfig:
    """BERT masking (bert): select ``probability`` of the tokens (or whole words)."""

    probability: float = option(0.15, "share of the tokens selected for prediction", above=0, max=1)
    mask_fraction: float = option(0.8, "of the selected tokens, the share replaced by [MASK]", min=0, max=1)
    random_fraction: float = option(0.1, "of the selected tokens, the share replaced by a random token", min=0, max=1)
    whole_word: bool = option(False, "select whole words rather than word pieces")


@dataclass
class PretrainTrainConfig(AutocastOptimConfig):
    """Optimisation (the training engine's ``OptimConfig``, bf16 autocast on GPU and on CPUs with fast bf16) and
    what a step reads: sequences, their length, spans, gradient accumulation."""

    learning_rate: float = with_default(OptimConfig, "learning_rate", 1e-4)

    max_steps: int = option(1000, "optimiser steps", min=1)
    batch_size: int = option(64, "sequences per step (coCondenser: 2 spans of each of batch_size / 2 documents)", min=1)
    grad_accumulation: int = option(1, "micro-batches per step (must divide batch_size)", min=1)
    max_length: int = option(128, "tokens per sequence", min=8)
    span_min_tokens: int = option(16, "coCondenser: shortest span, before capping to the document", min=1)
    span_max_tokens: int = option(126, "coCondenser: longest span", min=1)


@dataclass
class ContrieverConfig:
    """Contriever-style pre-training (model.mode=contriever; neural-retrieval-lecture): positive pairs and negatives."""

    crop_ratio_min: float = option(
        0.05, "shortest crop, as a share of the document window (Contriever: 5%)", above=0, max=1
    )
    crop_ratio_max: float = option(
        0.5, "longest crop, as a share of the document window (Contriever: 50%)", above=0, max=1
    )
    document_tokens: int = option(
        256, "crops come from a random window of this many document tokens (Contriever: 256)", min=2
    )
    token_deletion: float = option(
        0.1, "each token of a view is deleted with this probability (Contriever: 10%)", min=0, max=0.99
    )
    ict_probability: float = option(
        0.0,
        "share of the pairs made by the inverse cloze task (a sentence vs the rest) instead of two crops",
        min=0,
        max=1,
    )
    ict_keep_sentence: float = option(
        0.1, "ICT: the context keeps the query sentence with this probability", min=0, max=1
    )
    negatives: Literal["moco", "in-batch"] = option(
        "moco", "moco: keys from a momentum encoder, the batch's and a queue's; in-batch: both views trained"
    )
    queue_size: int = option(4096, "moco: K, keys in the queue", min=1, max=1_048_576)
    momentum: float = option(0.999, "moco: m of θ_k <- m θ_k + (1 - m) θ (Contriever: 0.9995)", min=0, max=1)
    normalize: bool = option(True, "L2-normalise the embeddings (similarities are cosines over the temperature)")


@dataclass
class PretrainConfig(RunConfig):
    """One pre-training run; everything is written under ``<output_dir>/<name>/``."""

    name: str = option("pretrain", "name of the run: everything goes to <output_dir>/<name>/")
    data: PretrainDataConfig = option(help="corpus", factory=PretrainDataConfig)
    model: PretrainModelConfig = option(help="backbone and objective", factory=PretrainModelConfig)
    masking: MaskingConfig = option(help="BERT masking", factory=MaskingConfig)
    train: PretrainTrainConfig = option(help="optimisation", factory=PretrainTrainConfig)
    contriever: ContrieverConfig = option(help="model.mode=contriever: pairs and negatives", factory=ContrieverConfig)
