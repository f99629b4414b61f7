"""Typed configuration of a pre-training run (``densepass pretrain CONFIG``), loaded like ExperimentConfig."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Mode = Literal["mlm", "condenser", "cocondenser"]


@dataclass
class PretrainDataConfig:
    """The corpus whose passages are pre-trained on (any densepass dataset layout)."""

    name: str = "debian-packages"
    data_dir: str | None = None
    format: Literal["beir", "msmarco", "dpr", "squad"] = "beir"
    max_passages: int | None = None  # seeded subset of the corpus for quick runs
    seed: int = 13


@dataclass
class PretrainModelConfig:
    """Backbone, layer split and objective.

    ``mlm``: MLM on the late (last-layer) outputs only, i.e. BertForMaskedLM. ``condenser``: head MLM
    plus backbone MLM (condenser eq. 9-11). ``cocondenser``: those plus the span contrastive loss on
    the late CLS (abs-condenser-openqa eq. 10-11).
    """

    name_or_path: str = "all-MiniLM-L6-v2"
    mode: Mode = "condenser"
    early_layers: int = 3  # L^e; the remaining backbone layers are late (L^l)
    head_layers: int = 2  # L^h, initialised at random
    temperature: float = 1.0  # of the span contrastive loss; eq. 10 uses plain dot products (1.0)
    save_pooling: Literal["cls", "mean"] = "cls"  # pooling written into the saved backbone's ST files


@dataclass
class MaskingConfig:
    """BERT masking (Devlin et al. 2019): select ``probability`` of the tokens (or whole words)."""

    probability: float = 0.15
    mask_fraction: float = 0.8  # of the selected tokens -> [MASK]
    random_fraction: float = 0.1  # -> a random token; the rest stay unchanged
    whole_word: bool = False


@dataclass
class PretrainTrainConfig:
    """Optimisation: AdamW with linear warm-up/decay, bf16 autocast (GPU; CPU on request), gradient accumulation."""

    max_steps: int = 1000
    batch_size: int = 64  # sequences per optimiser step (coCondenser: 2 spans each of batch_size / 2 documents)
    grad_accumulation: int = 1  # micro-batches per step (batch_size must be divisible by it)
    max_length: int = 128
    span_min_tokens: int = 16  # coCondenser span lengths, before capping to the document length
    span_max_tokens: int = 126
    learning_rate: float = 1e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0
    bf16: bool = True  # bf16 autocast on GPU
    cpu_bf16: bool = False  # bf16 autocast on CPU too (fast where the CPU has AVX512-BF16/AMX)
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 13


@dataclass
class PretrainConfig:
    """One pre-training run; everything is written under ``<output_dir>/<name>/``."""

    name: str = "pretrain"
    output_dir: str = "outputs"
    device: str | None = None  # None = cuda when available
    data: PretrainDataConfig = field(default_factory=PretrainDataConfig)
    model: PretrainModelConfig = field(default_factory=PretrainModelConfig)
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    train: PretrainTrainConfig = field(default_factory=PretrainTrainConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name
