"""The cross-encoder stages of ``densepass run`` (neural-retrieval-lecture: cross-encoder re-ranking): the
reranker is trained on the run's hard-negative pool (or loaded, trained elsewhere), then every evaluated
first stage named in ``reranker.first_stages`` gets a second row, its top ``reranker.depth`` candidates
re-scored by the cross-encoder (``pipelines.search.rerank``: nothing the first stage found is lost), with
the reranking's cost per query.

The trained cross-encoder is saved in ``<run>/reranker/model`` (loadable by ``transformers`` and
``sentence_transformers.CrossEncoder``), its checkpoints and log in ``<run>/reranker/``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from densepass import distributed
from densepass.checkpoints import DATA_FILES, without_later_defaults
from densepass.config import DataConfig, ExperimentConfig, LossConfig
from densepass.data.dataset import RetrievalDataset
from densepass.device import uses_bf16
from densepass.errors import ConfigError
from densepass.evaluation.metrics import Run
from densepass.models.cross_encoder import PASSAGE_SEP, CrossEncoder
from densepass.negatives.pool import NegativePool, passage_ids
from densepass.pipelines.evalset import EvalSet
from densepass.pipelines.search import CachedScores, rerank, results_from_run
from densepass.training.batches import TrainingData
from densepass.training.cross_encoder import train_cross_encoder
from densepass.training.trainer import resumed_note

SYSTEMS = {"bm25": "BM25", "zero-shot": "zero-shot", "fine-tuned": "fine-tuned"}  # first stage -> its row


def reranked_row(stage: str, depth: int) -> str:
    """The name of a reranked row: ``BM25 → cross-encoder@100``."""
    return f"{SYSTEMS[stage]} → cross-encoder@{depth}"


def check_reranker_config(config: ExperimentConfig) -> None:
    """What can be checked about ``config.reranker`` without data (one-line ConfigErrors)."""
    cfg, neg = config.reranker, config.negatives
    distill = cfg.distill
    if distill.loss != "none":
        if not config.train.enabled:
            raise ConfigError("reranker.distill trains the bi-encoder: it needs train.enabled")
        if distill.source == "rows":
            if neg.refresh_every is not None:
                raise ConfigError(
                    "reranker.distill.source: rows scores the rows' own negatives: it cannot follow "
                    "negatives.refresh_every"
                )
            check_rows_distillation(config)
        elif not cfg.enabled and distill.teacher is None:
            raise ConfigError(
                "reranker.distill needs a teacher: reranker.enabled, or reranker.distill.teacher (or the scores of "
                "training rows: reranker.distill.source: rows)"
            )
        if neg.source == "none" or neg.per_query < 1:
            raise ConfigError("reranker.distill scores each query's hard negatives: set negatives.source and per_query")
        if config.loss != LossConfig():
            raise ConfigError("reranker.distill adds to the plain contrastive loss: leave the loss section out")
    if not cfg.enabled:
        return
    if cfg.max_length is not None:  # the model's own limit, before any mining or training
        from transformers import AutoConfig

        from densepass.models.biencoder import resolve_model_path
        from densepass.models.inputs import check_position_limit

        model_config = AutoConfig.from_pretrained(resolve_model_path(cfg.name_or_path))
        check_position_limit(model_config, {"reranker.max_length": cfg.max_length}, cfg.name_or_path)
    if cfg.train.enabled and cfg.train.packing:  # the model's kind, before any mining or training
        from transformers import AutoConfig

        from densepass.models.biencoder import resolve_model_path

        kind = AutoConfig.from_pretrained(resolve_model_path(cfg.name_or_path)).model_type
        if kind not in ("bert", "roberta", "xlm-roberta"):  # models.cross_encoder.packing_refusal, by its config
            raise ConfigError(
                f"reranker.train.packing: the cross-encoder is a {kind} model; padding-free training runs BERT, "
                "RoBERTa and XLM-R classifiers (set reranker.train.packing: false)"
            )
    if cfg.train.enabled and cfg.train.lora_rank:  # lora_targets that match no layer: before any mining or training
        from densepass.models.biencoder import resolve_model_path
        from densepass.training.adapters import check_adapters_of

        check_adapters_of(resolve_model_path(cfg.name_or_path), cfg.train)
    if cfg.train.enabled and neg.source == "none":
        raise ConfigError("reranker.train draws hard negatives from the run's pool: set negatives.source")
    if cfg.train.enabled and cfg.train.negatives_per_query > neg.pool_depth:
        raise ConfigError(
            f"reranker.train.negatives_per_query {cfg.train.negatives_per_query} is more than negatives.pool_depth "
            f"{neg.pool_depth}: a pool holds at most pool_depth distinct negatives, so every draw would repeat some"
        )
    evaluated = {"bm25": "bm25" in config.eval.baselines, "zero-shot": "zero-shot" in config.eval.baselines}
    evaluated["fine-tuned"] = config.train.enabled
    missing = [s for s in cfg.first_stages if not evaluated[s]]
    if missing:
        raise ConfigError(f"reranker.first_stages names {missing[0]!r}, which this run does not evaluate")
    limit = config.eval.rerank_candidates if config.eval.mode == "rerank" else config.eval.depth
    if cfg.first_stages and cfg.depth > limit:
        what = "eval.rerank_candidates" if config.eval.mode == "rerank" else "eval.depth"
        raise ConfigError(f"reranker.depth {cfg.depth} is larger than the {limit} candidates per query of {what}")


def check_rows_distillation(config: ExperimentConfig) -> None:
    """``reranker.distill.source: rows`` (one-line ConfigErrors): the scores are those of training rows
    (``data.format: pairs``), for their given negatives (``negatives.source: given``), with no teacher to name."""
    distill = config.reranker.distill
    if config.data.format != "pairs":
        raise ConfigError(
            "reranker.distill.source: rows takes the teacher scores of training rows: set data.format: pairs"
        )
    if config.negatives.source != "given":
        raise ConfigError(
            "reranker.distill.source: rows: the rows score their own negatives only; set negatives.source: given"
        )
    if distill.teacher is not None or distill.scores_file is not None:
        what = "teacher" if distill.teacher is not None else "scores_file"
        raise ConfigError(f"reranker.distill.source: rows takes the rows' scores: leave reranker.distill.{what} out")


def load_fixed_reranker(config: ExperimentConfig, device: torch.device) -> CrossEncoder | None:
    """The run's cross-encoder when it is used as it is (``reranker.train.enabled: false``), loaded now so a
    model without a usable head fails before any work; None when the run trains it or has none."""
    cfg = config.reranker
    if not cfg.enabled or cfg.train.enabled:
        return None
    return CrossEncoder.from_pretrained(cfg.name_or_path, **scoring_options(config, device))


def automatic_precision(config: ExperimentConfig, device: torch.device) -> str:
    """What ``reranker.precision: auto`` scores in: the precision the run trains in (bf16 where ``train.bf16`` on
    a GPU, or ``train.cpu_bf16`` on the CPU, say so: by default where the CPU has bf16 instructions), else fp32.
    Teacher scores for distillation are always computed in it (``pipelines.distillation.teacher_scores``)."""
    return "bf16" if uses_bf16(device, config.train.bf16, config.train.cpu_bf16) else "fp32"


def scoring_options(config: ExperimentConfig, device: torch.device) -> dict:
    """CrossEncoder options of the run: truncation, batch size, device and ``reranker.precision`` (``auto``:
    ``automatic_precision``)."""
    cfg = config.reranker
    precision = automatic_precision(config, device) if cfg.precision == "auto" else cfg.precision
    return {"max_length": cfg.max_length, "batch_size": cfg.batch_size, "device": device, "precision": precision}


# data keys a reranker's checkpoints never held (its identity held every other data key in full): ``mix`` (the
# bi-encoder's batches only) and the evaluation part (``data.eval_part*``: which dev queries are evaluated, never the
# cross-encoder's weights), at any value, so runs written before them resume, and a run resumed with another
# evaluation part trains to the same weights. A data key added later that changes training joins them at its default.
RERANKER_LATER_DATA_KEYS = {"mix": None, "eval_part": None, "eval_part_fraction": None, "eval_part_seed": None}


def reranker_data_identity(data: DataConfig) -> dict:
    """The ``data`` section as the reranker's checkpoint identity: without ``RERANKER_LATER_DATA_KEYS`` (those
    mapped to None at any value, the others at their default)."""
    later = RERANKER_LATER_DATA_KEYS
    return {k: v for k, v in asdict(data).items() if k not in later or (later[k] is not None and later[k] != v)}


def train_reranker(
    config: ExperimentConfig,
    dataset: RetrievalDataset,
    query_ids: Sequence[str],
    pool: NegativePool,
    device: torch.device,
    run_dir: Path,
    notes: list[str],
) -> CrossEncoder:
    """Fine-tune the run's cross-encoder on ``pool`` (resuming from ``<run>/reranker/checkpoints``) and save
    it to ``<run>/reranker/model``. Under torch.distributed every process trains (each scores its share of every
    step) and rank 0 saves."""
    cfg = config.reranker
    bf16 = uses_bf16(device, config.train.bf16, config.train.cpu_bf16)  # training's autocast
    model = CrossEncoder.new(cfg.name_or_path, seed=cfg.train.seed, **scoring_options(config, device))
    data = TrainingData(
        dataset,
        config.data.train_split,
        PASSAGE_SEP,
        passage_ids(pool),
        cfg.train.negatives_per_query,
        query_ids=query_ids,
    )
    identity = {
        "data": reranker_data_identity(config.data),
        "negatives": without_later_defaults(asdict(config.negatives)),
        "cross_encoder": {"name_or_path": cfg.name_or_path, "max_length": cfg.max_length, "bf16": bf16},
        DATA_FILES: dataset.file_fingerprints(),  # a changed data file: the checkpoints are refused
    }
    started = time.perf_counter()
    result = train_cross_encoder(model, data, cfg.train, run_dir / "reranker", device, bf16, identity)
    if distributed.rank() == 0:  # every process holds the same weights
        model.save(run_dir / "reranker" / "model")
    head = "a new one-logit head" if model.new_parameters else "its own trained head, continued"
    notes.append(
        f"Cross-encoder ({cfg.name_or_path} + {head}) trained {cfg.train.loss} on {len(data)} queries: "
        f"{result.steps} steps of {cfg.train.batch_size} queries x (1 + {cfg.train.negatives_per_query}) pairs, "
        f"final loss {result.final_loss:.4f}, {time.perf_counter() - started + result.earlier_seconds:.0f} s"
        f"{resumed_note(result.earlier_seconds)}; saved in reranker/model."
    )
    notes.append(f"Cross-encoder negatives: {data.pool_sizes.summary()}")
    return model


def rerank_rows(
    evalset: EvalSet,
    runs: Mapping[str, Run],
    reranker: CrossEncoder,
    stages: Sequence[str],
    depth: int,
    score: Callable[[Run, str], dict[str, float]],
    timings: dict[str, float],
) -> dict[str, dict[str, float]]:
    """``{row: metrics}`` of each first stage's run with its top ``depth`` reranked; ``score(run, name)``
    evaluates (and writes) a run. The stages share a score cache (``CachedScores``: a pair found by two
    first stages is scored once); ``timings`` gets, per stage, the seconds spent, the pairs it scored, and
    the reranking cost per query: the measured time per scored pair times the pairs each query reranks."""
    rows, cached = {}, CachedScores(reranker)
    n = len(evalset.query_ids)
    for stage in stages:
        first = results_from_run(runs[stage], evalset.query_ids, evalset.corpus, width=depth)
        scored_before, started = cached.scored, time.perf_counter()
        reranked = rerank(first, evalset.query_texts, cached, depth)
        seconds, scored = time.perf_counter() - started, cached.scored - scored_before
        pairs = int((first.rows[:, :depth] >= 0).sum())
        timings[f"rerank_{stage}_s"] = seconds
        timings[f"rerank_{stage}_pairs"] = pairs
        timings[f"rerank_{stage}_pairs_scored"] = scored
        if scored:
            timings[f"rerank_{stage}_ms_per_query"] = 1000 * seconds / scored * pairs / n
        rows[reranked_row(stage, depth)] = score(reranked.as_run(evalset.query_ids), f"{stage}-rerank{depth}")
    return rows
