"""The three retriever kinds in runs: which model a config starts from, what it is trained with, how it is
indexed and searched, and which run options it cannot take.

``model.kind`` picks the kind: ``bi-encoder`` (``models.biencoder``), ``splade`` (``models.splade``, the
contrastive loss + FLOPS, searched in an inverted index) or ``colbert`` (``models.colbert``, MaxSim,
searched by centroid pruning + exact MaxSim). Everything else a run does (hard negatives, batches, BM25 or
random schedules, gradient caching, checkpoints, validation) is shared: the trainer only needs
``forward`` / ``similarity`` / ``tokenize`` / ``save`` of the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from densepass.config import BiEncoderConfig, ColbertConfig, ExperimentConfig, LossConfig, ModelConfig, given_keys
from densepass.data.dataset import Corpus
from densepass.errors import ConfigError
from densepass.index.base import Index
from densepass.index.colbert import ColbertIndex
from densepass.index.dense import DenseIndex
from densepass.index.splade import SpladeIndex
from densepass.losses.matryoshka import Matryoshka
from densepass.losses.objectives import FLOPS, InfoNCE, Objective
from densepass.models.biencoder import BiEncoder, resolve_model_path, stored_architecture
from densepass.models.colbert import ColBERT, ColbertArchitecture, ColbertReranker
from densepass.models.kinds import saved_architecture
from densepass.models.load import Retriever
from densepass.models.matryoshka import check_dims
from densepass.models.splade import SpladeArchitecture, SpladeEncoder


def architecture(model: ModelConfig) -> SpladeArchitecture | ColbertArchitecture:
    """The saved architecture of a SPLADE or ColBERT ``model`` section."""
    shared = {
        "query_max_length": model.query_max_length,
        "passage_max_length": model.passage_max_length,
        "temperature": model.temperature,
    }
    if model.kind == "splade":
        return SpladeArchitecture(**shared)
    colbert = model.colbert
    return ColbertArchitecture(dim=colbert.dim, skiplist=colbert.skiplist, markers=colbert.markers, **shared)


def _default(cls: type, name: str) -> object:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def with_saved_architecture(config: ExperimentConfig) -> ExperimentConfig:
    """``config`` with its model section completed from the model it starts from: every architecture field the
    config does not set (in its file or overrides: ``config.given_keys``; for a config built in Python, a field left
    at its default) takes the value saved with the model (``densepass.json`` and the SPLADE / ColBERT
    files; for a sentence-transformers model, its pooling, Dense, Normalize and prompts: ``models.st_layout``), so a
    run from ``outputs/x/model`` runs the model saved there and records its settings in its ``config.yaml``. A value
    the config sets that would replace saved weights with new ones (another projection size) is a one-line
    ConfigError; other set values (lengths, prompts, the temperature, a pooling) are the user's choice and kept."""
    model = config.model
    path = resolve_model_path(model.name_or_path)
    if model.kind == "bi-encoder":
        stored = stored_architecture(path)
        if stored is None:
            return config
        saved = {f.name: getattr(stored, f.name) for f in dataclasses.fields(BiEncoderConfig)}
        top, section = saved, {}
    else:
        cls = SpladeArchitecture if model.kind == "splade" else ColbertArchitecture
        stored = saved_architecture(path, model.kind, cls, f"a {model.kind} model")
        if stored is None:
            return config
        saved = dataclasses.asdict(stored)
        top = {k: v for k, v in saved.items() if k in ("query_max_length", "passage_max_length", "temperature")}
        section = {k: v for k, v in saved.items() if k not in top}
    where = f"{model.name_or_path} was saved with"

    def unset(section: object, cls: type, key: str) -> bool:  # not in the file or overrides (else: left at default)
        given = given_keys(section)
        return key not in given if given is not None else getattr(section, key) == _default(cls, key)

    if not unset(model, ModelConfig, "projection_dim") and saved.get("projection_dim") not in (
        None,
        model.projection_dim,
    ):
        # (a projection_dim the config sets, null included: a saved projection is never dropped or replaced)
        raise ConfigError(
            f"{where} projection_dim {saved['projection_dim']}, not the {model.projection_dim} the config sets: its "
            "trained projection would be replaced by a new one (leave model.projection_dim unset)"
        )
    if section and not unset(model.colbert, ColbertConfig, "dim") and model.colbert.dim != section["dim"]:
        raise ConfigError(
            f"{where} colbert.dim {section['dim']}, not the {model.colbert.dim} the config sets: its trained "
            "projection would be replaced by a new one (leave model.colbert.dim unset)"
        )
    filled = {k: v for k, v in top.items() if unset(model, ModelConfig, k)}
    if section:
        colbert = {k: v for k, v in section.items() if unset(model.colbert, ColbertConfig, k)}
        filled["colbert"] = dataclasses.replace(model.colbert, **colbert)
    return dataclasses.replace(config, model=dataclasses.replace(model, **filled))


def model_from_config(config: ExperimentConfig) -> Retriever:
    """The model a run starts from (new weights, if any, seeded by ``train.seed``)."""
    torch.manual_seed(config.train.seed)
    model = config.model
    if model.kind == "splade":
        return SpladeEncoder.from_pretrained(
            model.name_or_path, config=architecture(model), head_bias=model.splade.head_bias
        )
    if model.kind == "colbert":
        return ColBERT.from_pretrained(model.name_or_path, config=architecture(model))
    shape = model.architecture()
    dims = config.train.matryoshka_dims if config.train.enabled else None
    if dims:  # the saved model records the dimensions it is trained at (densepass.json, sentence-transformers')
        weights = config.train.matryoshka_weights or [1.0] * len(dims)
        trained = [d for d, w in zip(dims, weights) if w > 0] or list(dims)  # (all 0: Matryoshka refuses it)
        shape = dataclasses.replace(shape, matryoshka_dims=list(check_dims(trained)))
    encoder = BiEncoder.from_pretrained(model.name_or_path, config=shape)
    if dims:
        check_dims(dims, encoder.dim)  # before any work: prefixes longer than the embedding
    return encoder


def objective_for(config: ExperimentConfig, base: Objective) -> Objective:
    """What a run minimises, given its ``base`` objective (contrastive or distillation): with
    ``train.matryoshka_dims``, ``base`` at each prefix dimension (``losses.matryoshka``); SPLADE adds the FLOPS
    regulariser to it; the other kinds minimise ``base`` itself."""
    if config.train.matryoshka_dims:
        base = Matryoshka(base, config.train.matryoshka_dims, config.train.matryoshka_weights)
    if config.model.kind != "splade":
        return base
    splade = config.model.splade
    return base + FLOPS(splade.lambda_q, splade.lambda_d, splade.warmup_steps)


def check_kind(config: ExperimentConfig) -> None:
    """Run options that need a one-vector bi-encoder, refused for SPLADE and ColBERT before any work."""
    kind = config.model.kind
    check_matryoshka(config)
    if kind == "bi-encoder":
        return
    model, schedule, neg = config.model, config.schedule, config.negatives
    if config.train.matryoshka_dims:
        raise ConfigError(f"train.matryoshka_dims trains prefixes of one embedding: model.kind={kind} has none")
    if config.loss != LossConfig():
        raise ConfigError(
            f"model.kind={kind} trains with the contrastive loss or reranker.distill: leave the loss section out"
        )
    if model.projection_dim is not None or not model.shared or model.pooling != "mean" or not model.normalize:
        raise ConfigError(
            f"model.kind={kind} has one shared encoder and its own output: leave model.projection_dim, shared, "
            "pooling and normalize at their defaults (colbert's size is model.colbert.dim)"
        )
    if schedule.method == "clustered" or schedule.method.startswith("abs") and schedule.similarity != "bm25":
        raise ConfigError(
            f"model.kind={kind}: batch schedules by encoder similarity need a bi-encoder; "
            "use schedule.similarity=bm25 (ABS) or a random / sequential order"
        )
    if config.eval.precision == "int8":
        raise ConfigError(f"model.kind={kind}: eval.precision=int8 applies to bi-encoders; use auto, fp32 or bf16")
    if neg.refresh_every is not None:
        raise ConfigError(f"model.kind={kind}: negatives.refresh_every mines with a bi-encoder; leave it null")
    if neg.source == "model" and model.name_or_path == neg.model:
        raise ConfigError(f"model.kind={kind}: negatives.model must be a bi-encoder, not the model being trained")


def check_matryoshka(config: ExperimentConfig) -> None:
    """``train.matryoshka_dims`` / ``_weights`` that ``Matryoshka`` would refuse, refused before any work: bad
    dimensions or weights, weights without dimensions, and a loss that keeps full-size vectors across steps."""
    train = config.train
    if not train.matryoshka_dims:
        if train.matryoshka_weights is not None:
            raise ConfigError("train.matryoshka_weights without train.matryoshka_dims: give the dimensions too")
        if train.matryoshka_init != "none":
            raise ConfigError("train.matryoshka_init without train.matryoshka_dims: give the dimensions too")
        return
    if config.loss.memory != "none" or config.loss.kind == "ltr":
        raise ConfigError(
            "train.matryoshka_dims needs a loss that scores the batch's embeddings alone: loss.memory=none and "
            "loss.kind=contrastive (a memory, a queue or an LTR head holds full-size vectors)"
        )
    Matryoshka(InfoNCE(), train.matryoshka_dims, train.matryoshka_weights)  # the dimensions' and weights' checks


def index_for_model(
    model: Retriever,
    corpus: Corpus,
    config: ModelConfig | None = None,
    batch_size: int = 64,
    device: torch.device | None = None,
    dense_kind: str = "exact",
    precision: str = "auto",
) -> Index:
    """An index of ``corpus`` for any kind of model, encoded in ``precision`` (auto, fp32, bf16; int8 for
    bi-encoders); ``config`` gives SPLADE pruning and ColBERT storage and search options (defaults without it)."""
    config = config or ModelConfig()
    if isinstance(model, SpladeEncoder):
        return SpladeIndex.build(
            model,
            corpus,
            top_terms=config.splade.index_top_terms,
            batch_size=batch_size,
            device=device,
            precision=precision,
        )
    if isinstance(model, ColBERT):
        colbert = config.colbert
        return ColbertIndex.build(
            model,
            corpus,
            compression=colbert.compression,
            residual_bits=colbert.residual_bits,
            centroids=colbert.centroids,
            nprobe=colbert.nprobe,
            candidates=colbert.candidates,
            batch_size=batch_size,
            device=device,
            precision=precision,
        )
    return DenseIndex.build(
        model, corpus, dense_kind, batch_size=batch_size, device=device, show_progress=False, precision=precision
    )


def score_pairs(
    model: Retriever,
    queries: Sequence[str],
    passages: Sequence[str],
    device: torch.device | None = None,
    precision: str = "auto",
) -> np.ndarray:
    """The model's score of each pair ``(queries[i], passages[i])`` (re-ranking evaluation), encoded in
    ``precision``."""
    if isinstance(model, ColBERT):
        return ColbertReranker(model, device=device, precision=precision).score_pairs(queries, passages)
    q = model.encode_queries(list(queries), device=device, precision=precision)
    p = model.encode_passages(list(passages), device=device, precision=precision)
    if isinstance(model, SpladeEncoder):
        return np.asarray(q.multiply(p).sum(axis=1)).ravel().astype(np.float32)
    return np.einsum("ij,ij->i", q, p).astype(np.float32)


def describe_index(index: Index, queries: Sequence[str]) -> str | None:
    """One line on a SPLADE or ColBERT index for reports: sizes, non-zeros and FLOPS (None for other kinds)."""
    if isinstance(index, SpladeIndex):
        stats = index.stats(index.model.encode_queries(list(queries), device=index.device))
        return (
            f"SPLADE index: {stats['avg_nnz_per_passage']:.1f} non-zeros per passage, "
            f"{stats['avg_nnz_per_query']:.1f} per query, FLOPS {stats['flops']:.2f}, "
            f"{stats['bytes'] / 1e6:.1f} MB of postings."
        )
    if isinstance(index, ColbertIndex):
        stats = index.stats()
        return (
            f"ColBERT index ({index.compression}): {stats['avg_tokens_per_passage']:.1f} token vectors per passage, "
            f"{stats['centroids']} centroids, {stats['bytes'] / 1e6:.1f} MB."
        )
    return None
