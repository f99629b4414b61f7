"""``densepass run``: an experiment from its config, in stages.

1. ``check``: everything that can be checked without data (device, metric names, option combinations);
2. ``prepare``: the dataset, the evaluation set, BM25 where needed, and whether the run directory's
   checkpoints belong to this config (a different run is refused before anything is written);
3. ``evaluate_baselines``: BM25 and the zero-shot model;
4. ``mine_training_pool``: the training queries' hard-negative pool (shared by the bi-encoder and the
   cross-encoder), and an existing teacher-scores file checked against it, before anything is written;
5. the cross-encoder (``pipelines.reranking``): trained on the pool, or loaded; the teacher's scores
   (``pipelines.distillation``) when the bi-encoder is distilled;
6. ``fine_tune``: batches, validation and refresh callbacks, the training loop with the run's objective;
7. ``finish``: the fine-tuned model's evaluation, the reranked rows, ``metrics.json`` and ``report.md``.

Everything lands in ``<output_dir>/<name>/``: ``config.yaml`` (written once the run is known to be
valid), ``checkpoints/``, ``model/`` (final fine-tuned model), ``runs/*.trec``, ``train_log.jsonl``,
``metrics.json`` and ``report.md`` with PNG plots. The directory is locked while a run uses it;
re-running the same command resumes an interrupted run exactly, ``restart=True`` starts it over.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from densepass import distributed
from densepass.checkpoints import (
    DATA_FILES,
    differences,
    packing_hint,
    training_identity,
    trim_log,
    without_later_defaults,
)
from densepass.config import ColumnsConfig, DataConfig, ExperimentConfig, LossConfig, load_config, save_config
from densepass.data import dataset_dir, hub_options, load_dataset
from densepass.data.dataset import RetrievalDataset
from densepass.device import device_named, resolve_device, resolve_precision, resolved_packing, uses_bf16
from densepass.errors import ConfigError, DataError
from densepass.evaluation.metrics import (
    Run,
    check_metrics,
    evaluate_run,
    refuse_answer_metrics,
    warn_if_shallow,
    write_trec_run,
)
from densepass.evaluation.tables import print_table
from densepass.index.bm25 import BM25Index
from densepass.index.dense import DenseIndex
from densepass.index.faiss_index import check_trainable
from densepass.index.sharded import encode_cached
from densepass.io import atomic_write_text, check_cache_dir, locked_run_directory, written_by_densepass
from densepass.losses.objectives import Objective
from densepass.models.biencoder import BiEncoder
from densepass.models.cross_encoder import CrossEncoder
from densepass.models.freeze import freeze_bottom
from densepass.models.interpolate import interpolate_weights, snapshot
from densepass.models.packing import enable_packing
from densepass.negatives.filters import check_denoising
from densepass.negatives.mine import (
    MiningContext,
    MiningResult,
    check_draws,
    check_strategies,
    given_candidates,
    strategy_specs,
)
from densepass.negatives.pool import passage_ids, save_pool
from densepass.pipelines import retrievers
from densepass.pipelines.distillation import (
    check_existing_scores,
    distillation_identity,
    distilling,
    fixed_teacher,
    from_rows,
    objective_of,
    teacher_scores,
)
from densepass.pipelines.evalset import EvalSet, add_rerank_candidates, build_eval_set, query_parts
from densepass.pipelines.report import write_report
from densepass.pipelines.reranking import (
    automatic_precision,
    check_reranker_config,
    load_fixed_reranker,
    rerank_rows,
    scoring_options,
    train_reranker,
)
from densepass.pipelines.training import (
    add_mix,
    batch_planner,
    check_crop,
    check_mix,
    check_principal_axes,
    data_fingerprints,
    fine_tune_model,
    given_pool,
    load_mix,
    mine_pool,
    mix_summary,
    start_at_principal_axes,
    training_queries,
    uses_bm25,
)
from densepass.pipelines.validation import Validator, check_retriever
from densepass.training.adapters import check_adapters
from densepass.training.batches import TrainingData
from densepass.training.engine import check_fsdp_combinations, seed_everything
from densepass.training.l2sp import check_l2sp
from densepass.training.more_negatives import check_loss
from densepass.training.planner import check_schedule
from densepass.training.refresh import NegativeRefresher
from densepass.training.teacher_scores import Pairs, PairScorer, Scores, distillation_pairs
from densepass.training.trainer import planned_steps, resume_step, resumed_note


def model_from_config(config: ExperimentConfig) -> BiEncoder:
    """The model a run starts from, of ``model.kind`` (new weights, if any, are seeded by ``train.seed``)."""
    return retrievers.model_from_config(config)


def run_identity(
    config: ExperimentConfig, dataset: RetrievalDataset | None = None, mix: Sequence[RetrievalDataset] = ()
) -> dict:
    """The settings besides ``train`` that change the fine-tuned model, and (given the ``dataset``, and the ``mix``
    datasets of ``data.mix``) the content fingerprint of every data file they were read from: resuming across a
    change is refused."""
    schedule = {k: v for k, v in asdict(config.schedule).items() if k != "background"}
    loss = {"loss": asdict(config.loss)} if config.loss != LossConfig() else {}  # the default: earlier runs resume
    data_files = {DATA_FILES: data_fingerprints([dataset, *mix])} if dataset is not None else {}
    # validation that selects the saved model decides what the run gives: its settings too (its query sample, its
    # subcorpus, when it validates); validation that only logs does not
    selects = config.validation.enabled and config.validation.select
    return {
        "data": data_identity(config.data),
        "model": without_later_defaults(asdict(config.model)),
        "negatives": without_later_defaults(asdict(config.negatives)),
        "schedule": schedule,
        **distillation_identity(config),
        **loss,
        **data_files,
        **({"validation": asdict(config.validation)} if selects else {}),
    }


# data keys added after runs were made: at their default they stay out of a run's identity (earlier runs resume)
LATER_DATA_KEYS = {
    "columns": asdict(ColumnsConfig()),
    "eval_name": None,
    "eval_format": "beir",
    "subset": None,
    "revision": None,
    "eval_part": "all",
    "eval_part_fraction": 0.5,
    "eval_part_seed": 13,
    "mix": [],
}


def data_identity(data: DataConfig) -> dict:
    """The ``data`` section as a run's identity: without the ``LATER_DATA_KEYS`` at their default."""
    return {k: v for k, v in asdict(data).items() if k not in LATER_DATA_KEYS or LATER_DATA_KEYS[k] != v}


def packing_of(config: ExperimentConfig, device: torch.device) -> bool:
    """What ``train.packing`` resolves to in a run's identity on ``device`` (``device.resolved_packing``: ``auto``
    packs a dense bi-encoder's CPU steps; the trainer then packs them where its encoders can pack)."""
    return resolved_packing(config.train, device, config.model.kind == "bi-encoder")


def results_identity(config: ExperimentConfig) -> dict:
    """What a run directory's results are of: ``run_identity`` and, for a run that trains, its training settings
    (those that change what is trained), as JSON values."""
    train = {"enabled": False}
    if config.train.enabled:
        train = training_identity(config.train, packing_of(config, device_named(config.device)))
    return json.loads(json.dumps({**run_identity(config), "train": train}))


# ---- stage 1: checks before any work -------------------------------------------------------------------


def check_not_trained_on_the_evaluated_queries(config: ExperimentConfig) -> None:
    """A one-line ConfigError where a run would train on the split it evaluates (``data.train_split`` of the
    evaluated dataset, or a ``data.mix`` entry of it): its numbers would measure memory, not retrieval. Datasets are
    compared by name, and by folder where both names are found."""
    evaluated = (config.data.eval_name or config.data.name, config.data.eval_split)
    trained = [] if config.data.format == "pairs" else [(config.data.name, config.data.train_split, "data.train_split")]
    trained += [(mix.name, mix.split, f"data.mix[{i}]") for i, mix in enumerate(config.data.mix)]
    for name, split, where in trained:
        if split == evaluated[1] and _same_dataset(name, evaluated[0], config.data.data_dir):
            raise ConfigError(
                f"{where} trains on the {split!r} queries of {name}, the split evaluated (data.eval_split): the "
                "scores would be of queries the model was trained on; evaluate another split"
            )


def _same_dataset(a: str, b: str, data_dir: str | None) -> bool:
    if a == b:
        return True
    try:
        return dataset_dir(a, data_dir).resolve() == dataset_dir(b, data_dir).resolve()
    except DataError:
        return False


def check(config: ExperimentConfig) -> torch.device:
    """Everything about ``config`` that can be checked without data; returns the device to run on."""
    device = resolve_device(config.device)
    resolve_precision(config.eval.precision, device)  # int8 on a GPU fails here
    resolve_precision(config.reranker.precision, device)  # the reranker's too
    retrievers.check_kind(config)
    check_eval_index(config)
    check_metrics(config.eval.metrics)
    warn_if_shallow(config.eval.metrics, config.eval.depth, "eval.depth", "eval.metrics")
    check_metrics([config.validation.metric])
    if config.data.format == "pairs" and config.data.eval_name is None:
        raise ConfigError(
            "data.format: pairs gives training rows only: name the dataset to evaluate on in data.eval_name "
            "(e.g. a BEIR-layout folder)"
        )
    check_eval_part(config)
    if config.train.enabled:
        check_not_trained_on_the_evaluated_queries(config)
    check_cache_dir(config.cache_dir)
    if config.negatives.source == "given" and config.data.format != "pairs":
        raise ConfigError("negatives.source: given takes the negatives of training rows: it needs data.format: pairs")
    neg = config.negatives
    mines = neg.source != "none" and (config.train.enabled or needs_pool(config))  # (a pool for the reranker too)
    if mines:  # a malformed strategy, a model or pool file it reads: before --restart removes anything, before mining
        check_strategies(neg, inputs=True, pairs=config.data.format == "pairs")
    if mines and neg.source != "given":
        check_denoising(neg, config.model.name_or_path)  # its models' files, before any work
    if config.train.enabled:
        check_schedule(config.schedule)
        check_loss(config.loss, config.train)
        if neg.refresh_every is not None and (neg.source == "none" or neg.per_query == 0):
            raise ConfigError("negatives.refresh_every needs hard negatives (a negatives.source and per_query > 0)")
        if neg.refresh_every is not None and neg.source == "given":
            raise ConfigError(
                "negatives.refresh_every re-mines the pool with the model being trained; negatives.source: given mines"
                " nothing (the rows' own negatives): leave refresh_every null"
            )
        check_draws(neg)
        check_crop(
            config.train.passage_max_length,
            config.model.passage_max_length,
            "train.passage_max_length",
            "model.passage_max_length",
        )
        if config.validation.enabled:
            refuse_answer_metrics([config.validation.metric], "validation")
            check_retriever(config.validation)  # its model, before mining and training
        if config.validation.select and not config.validation.enabled:
            raise ConfigError("validation.select needs validation.enabled: true (nothing is validated otherwise)")
        check_fsdp(config)
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)  # under torchrun, before any mining or scoring
        if world > 1 and config.train.batch_size % world:
            raise ConfigError(
                f"train.batch_size {config.train.batch_size} does not split over the {world} processes: make it a "
                f"multiple of {world}"
            )
        check_l2sp(config.train)
        check_mix(config.data.mix, config.train, config.schedule, distilling(config))
    elif config.train.wise_ft is not None:
        raise ConfigError("train.wise_ft interpolates fine-tuned weights: it needs train.enabled: true")
    if config.data.mix and not config.train.enabled:
        raise ConfigError("data.mix mixes pairs into the training batches: it needs train.enabled: true")
    check_reranker_config(config)
    if config.reranker.enabled and config.reranker.train.enabled:
        check_l2sp(config.reranker.train, "reranker.train")
    return device


def check_eval_index(config: ExperimentConfig) -> None:
    """``eval.index`` other than exact where no dense index is searched (it was ignored): SPLADE and ColBERT search
    their own index, and rerank mode scores each query's candidates."""
    index = config.eval.index
    if index == "exact":
        return
    if config.model.kind != "bi-encoder":
        raise ConfigError(
            f"eval.index={index} indexes a bi-encoder's vectors: model.kind={config.model.kind} searches its own index "
            f"(model.{config.model.kind}); leave eval.index at exact"
        )
    if config.eval.mode == "rerank":
        raise ConfigError(
            f"eval.index={index}: eval.mode=rerank scores each query's candidates and searches no index; leave "
            "eval.index at exact"
        )


def check_eval_part(config: ExperimentConfig) -> None:
    """``data.eval_part``'s settings: a tuning fraction below 1 (both parts hold queries), and no fraction or seed
    of a split that is not made (``eval_part: all``), which would change nothing."""
    data = config.data
    if data.eval_part == "all":
        if data.eval_part_fraction != 0.5 or data.eval_part_seed != 13:
            raise ConfigError(
                "data.eval_part_fraction and data.eval_part_seed shape the split into tuning and reporting parts: "
                "they need data.eval_part: tune or report (all evaluates every query)"
            )
    elif data.eval_part_fraction >= 1:
        raise ConfigError(
            "data.eval_part_fraction must be below 1 (the reporting part holds the rest), got "
            f"{data.eval_part_fraction:g}"
        )


def check_fsdp(config: ExperimentConfig) -> None:
    """``train.fsdp`` and ``reranker.train.fsdp``: their one-line errors before any work (``training.sharding``; the
    engine checks them again). FSDP shards a dense bi-encoder or a cross-encoder over torchrun's processes, every
    process scoring an equal share of every step, and nothing may run the model on one process mid-training."""
    t, r = config.train, config.reranker.train
    reranker = config.reranker.enabled and r.enabled and r.fsdp
    for section, optim in [("train", t)] * t.fsdp + [("reranker.train", r)] * reranker:
        if not distributed.launched_by_torchrun():
            raise ConfigError(
                f"{section}.fsdp shards the model over torchrun's processes: run under torchrun --nproc_per_node N"
            )
        check_fsdp_combinations(optim, f"{section}.fsdp")
    if reranker:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if r.batch_size % world:
            raise ConfigError(
                f"reranker.train.fsdp: reranker.train.batch_size {r.batch_size} must split evenly over the {world} "
                "processes (each scores a share of every step)"
            )
    if not t.fsdp:
        return
    if config.model.kind != "bi-encoder":
        raise ConfigError(
            f"train.fsdp trains dense bi-encoders (model.kind=bi-encoder), not model.kind={config.model.kind}"
        )
    if config.eval.each_epoch or config.negatives.refresh_every is not None or config.validation.enabled:
        raise ConfigError(
            "train.fsdp does not combine yet with what uses the model during training (eval.each_epoch, "
            "negatives.refresh_every, validation.enabled)"
        )


def check_run_directory(config: ExperimentConfig) -> None:
    """Refuse a run directory that holds another run: a second run with the same ``name`` and ``output_dir``
    would replace the first one's metrics and report (resuming the same run, or evaluating it again, is fine)."""
    saved = config.run_dir / "config.yaml"
    if not saved.is_file():
        return
    hint = "use another name or output_dir, or --restart to discard it"
    try:
        earlier = results_identity(load_config(saved))
    except ConfigError as err:
        raise ConfigError(f"{config.run_dir} holds a config.yaml that does not load ({err}); {hint}") from err
    current = results_identity(config)
    changed = differences(earlier, current)
    if changed:
        resumes = packing_hint(earlier, current)  # steps packed otherwise: the setting that resumes the run
        said = f"{config.run_dir} holds another run ({changed} differ from its config.yaml)"
        raise ConfigError(f"{said}; {resumes}{hint}")


# What a run writes in its directory (glob patterns; "runs/*.trec": the folder and what it may hold): all that
# --restart removes. Folders densepass saves atomically list their own files (io.OWNED); any other file is kept.
RUN_ENTRIES = (
    "config.yaml",
    "metrics.json",
    "report.md",
    "train_log.jsonl",
    "eval_log.jsonl",
    "validation_log.jsonl",
    "schedule_log.jsonl",
    "loss.png",
    "epochs.png",
    "validation.png",
    "hardness.png",
    "metrics.png",
    "runs/*.trec",
    "model",
    "model-fine-tuned",
    "best-model",
    "best.json",
    "checkpoints",
    "schedule/epoch-*",
    # the dense miners' logs (their model/ and checkpoints/ list their own files), the refreshed pools, the mined
    # ones (negatives.pool_cache)
    "negatives/miner-*/train_log.jsonl|refresh_log.jsonl|refresh-step-*.jsonl|refresh-teacher-step-*.jsonl"
    "|refresh-teacher-step-*.jsonl.partial|negative-pools/*/pool.jsonl|negative-pools/*/mining.json",
    "negatives.jsonl",
    "teacher_scores.jsonl",
    "teacher_scores.jsonl.partial",
    "token_cache",
    "reranker/train_log.jsonl",  # the cross-encoder's own training (its model/ and checkpoints/ list their files)
    "subcorpus.json",
    "subcorpus-*.json",
)


@contextmanager
def run_directory(config: ExperimentConfig, main: bool, restart: bool) -> Iterator[Callable[[], Path]]:
    """The run directory, locked against a second process for the run's duration; yields ``claim()``, which the
    run calls once its checks have passed: the directory is then marked as a run's (``io.locked_run_directory``: a
    directory densepass did not make is refused) and, on ``restart``, what an earlier run wrote there is removed,
    any other file kept with a warning. The other processes of a torchrun run wait in ``claim()`` for rank 0's."""
    run_dir = config.run_dir

    def claimed(claim: Callable[[], Path]) -> Callable[[], Path]:
        return lambda: (claim(), distributed.barrier(), run_dir)[-1]

    if not main:
        yield claimed(lambda: run_dir)
        return
    saved = ("model", "best-model", "model-fine-tuned")  # what the run will replace: checked before anything goes
    with locked_run_directory(run_dir, "run", RUN_ENTRIES, restart, saved) as claim:
        yield claimed(claim)


# ---- stage 2: data -------------------------------------------------------------------------------------


@dataclass
class Experiment:
    """What the stages share."""

    config: ExperimentConfig
    device: torch.device
    main: bool
    dataset: RetrievalDataset
    evalset: EvalSet
    full_bm25: BM25Index | None
    eval_bm25: BM25Index | None
    eval_data: RetrievalDataset | None = None  # what is evaluated and validated (data.eval_name; None: dataset)
    reranker: CrossEncoder | None = None  # the cross-encoder (loaded in prepare, or trained)
    teacher: CrossEncoder | None = None  # the distillation teacher when known before training
    mix: list[RetrievalDataset] = field(default_factory=list)  # data.mix's datasets
    results: dict[str, dict[str, float]] = field(default_factory=dict)
    runs: dict[str, Run] = field(default_factory=dict)  # every scored run by name (first stages for reranking)
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        """Where this run writes: ``<output_dir>/<name>``."""
        return self.config.run_dir


def prepare(config: ExperimentConfig, device: torch.device, main: bool, restart: bool = False) -> Experiment:
    """Load the data, check that the run directory holds no other run (``check_run_directory``), build the
    evaluation set and the BM25 indexes the run needs, and check that its checkpoints (if any) belong to this
    config (not on ``restart``: what the directory holds is then to be removed)."""
    started = time.perf_counter()
    data = config.data
    # a missing dataset, or a bad row: its one-line error
    dataset = load_dataset(data.name, data.data_dir, data.format, columns=asdict(data.columns), **hub_options(data))
    eval_data = dataset if data.eval_name is None else load_dataset(data.eval_name, data.data_dir, data.eval_format)
    needs_answers = [m for m in config.eval.metrics if m.startswith("accuracy@")]
    if needs_answers and not eval_data.answers:
        raise ConfigError(f"eval.metrics {needs_answers} need answer strings, which {eval_data.name} does not have")
    mix = load_mix(data.mix, data.data_dir) if config.train.enabled else []
    if config.train.enabled and config.train.matryoshka_init == "pca":
        check_principal_axes(dataset.corpus)
    if not restart:  # with --restart, what the directory holds is to be removed: nothing of it to check
        check_run_directory(config)
        if config.train.enabled:  # before any work: a changed data file (or data.mix file) is refused here
            identity = run_identity(config, dataset, mix)  # refuses another run's checkpoints:
            resume_step(config.run_dir, config.train, identity, packing_of(config, device))
    neg = config.negatives
    if needs_pool(config) and "given" in strategy_specs(neg):  # rows that give no negatives: before the claim
        given_candidates(dataset, training_queries(dataset, data.train_split, data.max_train_queries, data.seed))
    subcorpus_bm25 = config.data.eval_subcorpus and config.data.eval_hard_k > 0  # (eval_hard_k is of the subcorpus)
    need_full_bm25 = (
        uses_bm25(neg) and neg.per_query > 0 and config.train.enabled or subcorpus_bm25 and eval_data is dataset
    )
    full_bm25 = BM25Index.build(dataset.corpus.passage_inputs(" ")) if need_full_bm25 else None
    if eval_data is not dataset and subcorpus_bm25:  # the hard subcorpus of another dataset: its own BM25
        evalset = build_eval_set(eval_data, config.data, BM25Index.build(eval_data.corpus.passage_inputs(" ")))
    else:
        evalset = build_eval_set(eval_data, config.data, full_bm25)
    if config.eval.mode == "full":  # an index too small to train (faiss-ivfpq): before any training
        check_trainable(config.eval.index, len(evalset.corpus))
    eval_bm25 = None
    if "bm25" in config.eval.baselines or config.eval.mode == "rerank":
        eval_bm25 = BM25Index.build(evalset.corpus)  # the passages with their ids: its runs name them
    if config.eval.mode == "rerank":
        add_rerank_candidates(evalset, eval_bm25, config.eval.rerank_candidates)
    experiment = Experiment(config, device, main, dataset, evalset, full_bm25, eval_bm25, eval_data)
    experiment.mix = mix
    experiment.reranker = load_fixed_reranker(config, device)  # a model without a usable head fails here
    if distilling(config):
        experiment.teacher = fixed_teacher(config, experiment.reranker, scoring_options(config, device), dataset)
    experiment.timings["data_and_bm25_s"] = time.perf_counter() - started
    return experiment


# ---- evaluation ----------------------------------------------------------------------------------------


def search_depth(exp: Experiment) -> int:
    """Passages searched per query: ``eval.depth``, and one more where the query's own id is dropped
    (``without_identical_ids``), so that every query still keeps ``eval.depth``."""
    return exp.config.eval.depth + exp.config.eval.ignore_identical_ids


def without_identical_ids(run: Run, depth: int) -> Run:
    """``run`` without any passage whose id is its query's (BEIR's ``ignore_identical_ids``: on ArguAna every
    query is a corpus document, which would otherwise be its own best hit), each query cut to its ``depth`` best."""
    out = {}
    for qid, ranking in run.items():
        kept = sorted(((pid, score) for pid, score in ranking.items() if pid != qid), key=lambda item: -item[1])
        out[qid] = dict(kept[:depth])
    return out


def score_run(exp: Experiment, run: Run, name: str) -> dict[str, float]:
    """Write the run as TREC and compute its metrics (plus top-k answer accuracy when answers exist); with
    ``eval.ignore_identical_ids``, of the run without the queries' own ids (what is written is what is scored)."""
    if exp.config.eval.ignore_identical_ids:
        run = without_identical_ids(run, exp.config.eval.depth)
    tag = "-".join(name.split())  # a TREC tag is one word: "ColBERT exhaustive" is written ColBERT-exhaustive
    path = exp.run_dir / "runs" / f"{tag}.trec"
    if path.exists() and not written_by_densepass(path):  # a user's file bearing the name of one of the run's own
        raise ConfigError(f"{path} is not a run densepass wrote (its lines are not tagged {tag}): move it away")
    write_trec_run(run, path, tag=tag)
    exp.runs[name] = run
    evalset = exp.evalset
    metrics = list(exp.config.eval.metrics)
    passages = None
    if evalset.answers:
        metrics += [f"accuracy@{k}" for k in (1, 5, 20, 100) if f"accuracy@{k}" not in metrics]
        passages = dict(zip(evalset.corpus.ids, evalset.corpus.texts))
    return evaluate_run(evalset.qrels, run, metrics, evalset.answers, passages)


def _candidate_run(evalset: EvalSet, scores_of: Callable[[int, list[str]], np.ndarray]) -> Run:
    """A run scoring each query's own candidates with ``scores_of(query index, candidate ids)``."""
    return {
        qid: dict(zip(evalset.candidates[qid], map(float, scores_of(i, evalset.candidates[qid]))))
        for i, qid in enumerate(evalset.query_ids)
    }


def evaluate_dense(exp: Experiment, model: BiEncoder, name: str, cached: bool = False) -> dict[str, float]:
    """The model over the evaluation set: searched through a ``DenseIndex`` of the evaluation corpus (what
    ``densepass index`` + ``densepass search`` do), or scoring each query's candidates in rerank mode. ``cached``:
    the corpus's embeddings come from ``cache_dir`` when the run has one (``index.sharded.encode_cached``; a model
    evaluated once, not one that is still training)."""
    evalset, settings = exp.evalset, exp.config.eval
    if not isinstance(model, BiEncoder):
        return evaluate_retriever(exp, model, name)
    if evalset.candidates is None:
        options = dict(batch_size=settings.batch_size, device=exp.device, precision=settings.precision)
        if cached and exp.config.cache_dir and distributed.world_size() == 1:
            index = DenseIndex(model, settings.index, **options)
            block = max(1, len(evalset.corpus))  # one encode_texts call, as DenseIndex.build makes
            cache = exp.config.cache_dir
            shards = encode_cached(model, evalset.corpus, cache, block, show_progress=exp.main, **options)
            index.add_embeddings(evalset.corpus, np.asarray(shards.local))
        else:
            index = DenseIndex.build(model, evalset.corpus, settings.index, **options)
        results = index.search(evalset.query_texts, search_depth(exp))
        return score_run(exp, results.as_run(evalset.query_ids), name)
    corpus = evalset.corpus
    flat = [pid for q in evalset.query_ids for pid in evalset.candidates[q]]
    texts = corpus.passage_inputs(model.tokenizer.sep_token or " ", [corpus.position(p) for p in flat])
    options = {"show_progress": False, "device": exp.device, "precision": settings.precision}
    passages = model.encode_passages(texts, settings.batch_size, **options)
    queries = model.encode_queries(evalset.query_texts, settings.batch_size, **options)
    starts = np.cumsum([0] + [len(evalset.candidates[q]) for q in evalset.query_ids])
    return score_run(exp, _candidate_run(evalset, lambda i, _: passages[starts[i] : starts[i + 1]] @ queries[i]), name)


def evaluate_retriever(exp: Experiment, model, name: str) -> dict[str, float]:
    """A SPLADE or ColBERT model over the evaluation set: its own index of the evaluation corpus, or its
    scores of each query's candidates in rerank mode."""
    evalset, settings = exp.evalset, exp.config.eval
    if evalset.candidates is None:
        index = retrievers.index_for_model(
            model, evalset.corpus, exp.config.model, settings.batch_size, exp.device, precision=settings.precision
        )
        results = index.search(evalset.query_texts, search_depth(exp))
        exp.notes.append(f"{name}: {retrievers.describe_index(index, evalset.query_texts)}")
        return score_run(exp, results.as_run(evalset.query_ids), name)
    corpus = evalset.corpus
    pairs = [(i, pid) for i, q in enumerate(evalset.query_ids) for pid in evalset.candidates[q]]
    texts = corpus.passage_inputs(model.tokenizer.sep_token or " ", [corpus.position(p) for _, p in pairs])
    queries = [evalset.query_texts[i] for i, _ in pairs]
    scores = retrievers.score_pairs(model, queries, texts, exp.device, settings.precision)
    starts = np.cumsum([0] + [len(evalset.candidates[q]) for q in evalset.query_ids])
    return score_run(exp, _candidate_run(evalset, lambda i, _: scores[starts[i] : starts[i + 1]]), name)


def evaluate_bm25(exp: Experiment) -> dict[str, float]:
    """BM25 over the evaluation corpus (passages sharing no term with a query are not retrieved)."""
    evalset, index = exp.evalset, exp.eval_bm25
    if evalset.candidates is not None:
        corpus = evalset.corpus
        return score_run(
            exp,
            _candidate_run(
                evalset, lambda i, cands: index.score_all(evalset.query_texts[i])[[corpus.position(p) for p in cands]]
            ),
            "bm25",
        )
    results = index.search(evalset.query_texts, search_depth(exp))
    return score_run(exp, results.as_run(evalset.query_ids), "bm25")


# ---- stage 3: baselines --------------------------------------------------------------------------------


def evaluate_baselines(exp: Experiment, model: BiEncoder) -> None:
    """BM25 and the starting model, as configured in ``eval.baselines``."""
    if not exp.main:
        return
    if "bm25" in exp.config.eval.baselines:
        exp.results["BM25"] = evaluate_bm25(exp)
    if "zero-shot" in exp.config.eval.baselines:
        started = time.perf_counter()
        exp.results["zero-shot"] = evaluate_dense(exp, model, "zero-shot", cached=True)
        exp.timings["zero_shot_eval_s"] = time.perf_counter() - started


# ---- stage 4: fine-tuning ------------------------------------------------------------------------------


@dataclass
class TrainingPool:
    """The training queries and their mined hard-negative pool (None without hard negatives)."""

    query_ids: list[str]
    mined: MiningResult | None = None
    context: MiningContext | None = None


def needs_pool(config: ExperimentConfig) -> bool:
    """Whether the run mines a hard-negative pool (for the bi-encoder's negatives or the cross-encoder)."""
    neg, reranker = config.negatives, config.reranker
    trains_reranker = reranker.enabled and reranker.train.enabled
    return neg.source != "none" and (config.train.enabled and neg.per_query > 0 or trains_reranker)


def mine_training_pool(exp: Experiment, model: BiEncoder) -> TrainingPool:
    """The training queries and, when the run needs them, their hard negatives (not yet written)."""
    config, dataset = exp.config, exp.dataset
    neg = config.negatives
    started = time.perf_counter()
    if not (config.train.enabled or needs_pool(config)):  # evaluation only: a dataset with no train split will do
        return TrainingPool([])
    train_qids = training_queries(dataset, config.data.train_split, config.data.max_train_queries, config.data.seed)
    if not needs_pool(config):
        return TrainingPool(train_qids)
    if neg.source == "given":
        given = given_pool(dataset, train_qids)
        total, empty = sum(map(len, given.pool.values())), sum(1 for c in given.pool.values() if not c)
        exp.notes.append(
            f"Hard negatives given by the training rows: {total} for {len(given.pool)} queries ({empty} with none); "
            "nothing mined or filtered."
        )
        return TrainingPool(train_qids, given)
    context = MiningContext(
        config.data.train_split,
        exp.device,
        exp.full_bm25,
        exp.run_dir / "negatives",
        config.model.name_or_path,
        config.model.architecture(),  # of the dense miners (whatever kind is trained)
        config.train,
        config.data.seed,
        show_progress=exp.main,
        precision=config.eval.precision,
        cache_dir=config.cache_dir or None,
        pools_dir=exp.run_dir / "negatives",  # without a cache_dir: a resumed run reads its pool back
    )
    mined = mine_pool(dataset, train_qids, neg, context, model.tokenizer.sep_token or " ")
    exp.notes.append(f"Hard negatives ({neg.source}): {mined.summary()}.")
    exp.timings["mining_s"] = time.perf_counter() - started
    return TrainingPool(train_qids, mined, context)


def distillation_inputs(exp: Experiment, pool: TrainingPool) -> Pairs | None:
    """The (query, passages) pairs the teacher scores; an existing scores file is checked against them now."""
    if not distilling(exp.config):
        return None
    pairs = distillation_pairs(exp.dataset, exp.config.data.train_split, pool.query_ids, pool.mined.pool)
    check_existing_scores(exp.config, pairs, exp.teacher, exp.dataset)
    return pairs


def training_data(exp: Experiment, model: BiEncoder, pool: TrainingPool, teacher: Scores | None = None) -> TrainingData:
    """The bi-encoder's training instances: the pool's hard negatives, and the teacher's scores when distilling."""
    config = exp.config
    neg = config.negatives
    sep = model.tokenizer.sep_token or " "
    if neg.source == "none" or neg.per_query == 0:
        return TrainingData(exp.dataset, config.data.train_split, sep, query_ids=pool.query_ids)
    if neg.refresh_every:
        exp.notes.append(
            f"Refreshed with the model being trained every {neg.refresh_every} steps (negatives/refresh_log.jsonl)."
        )
    data = TrainingData(
        exp.dataset,
        config.data.train_split,
        sep,
        passage_ids(pool.mined.pool),
        neg.per_query,
        query_ids=pool.query_ids,
        teacher_scores=teacher,
    )
    exp.notes.append(f"Training negatives: {data.pool_sizes.summary()}")  # short pools repeat negatives: said here
    return data


def refresh_scorer(exp: Experiment) -> PairScorer | None:
    """The distilled run's teacher scoring each refreshed pool's new candidates, in the precision of the first
    pool's scores (``pipelines.distillation.teacher_scores``); None when the scores are the training rows'."""
    if from_rows(exp.config):
        return None
    teacher = exp.teacher or exp.reranker
    precision = automatic_precision(exp.config, teacher.device)
    return PairScorer(teacher, exp.dataset, precision, show_progress=exp.main, cache_dir=exp.config.cache_dir or None)


def fine_tune(
    exp: Experiment,
    model: BiEncoder,
    pool: TrainingPool,
    objective: Objective,
    teacher: Scores | None = None,
    start: dict[str, torch.Tensor] | None = None,
) -> None:
    """Train ``model`` in place on ``objective`` (resuming from the run's checkpoints) and save it to ``model/``;
    with ``start`` (the weights before training) and ``train.wise_ft``, the saved model is their interpolation."""
    config, run_dir = exp.config, exp.run_dir
    started = time.perf_counter()
    data = training_data(exp, model, pool, teacher)
    add_mix(data, exp.mix, config.data.mix, config.train.batch_size, config.train.seed)
    planner = batch_planner(model, data, config.train, config.schedule, run_dir, exp.device)
    identity = run_identity(config, exp.dataset, exp.mix)
    resumed_at = resume_step(run_dir, config.train, identity, packing_of(config, exp.device))
    eval_log = run_dir / "eval_log.jsonl"
    trim_log(eval_log, resumed_at)
    trim_log(run_dir / "validation_log.jsonl", resumed_at)  # the steps trained again are validated again

    def evaluate_epoch(epoch: int) -> None:
        metrics = evaluate_dense(exp, model, f"epoch-{epoch + 1}")
        step = min(planned_steps(planner.steps_per_epoch, config.train), (epoch + 1) * planner.steps_per_epoch)
        with open(eval_log, "a") as handle:
            handle.write(json.dumps({"epoch": epoch + 1, "step": step, **metrics}) + "\n")
        model.train()

    callbacks: list[Callable[[int], None]] = []
    if config.negatives.refresh_every is not None:
        refresher = NegativeRefresher(
            config.negatives.refresh_every,
            model,
            data,
            exp.dataset,
            pool.query_ids,
            config.negatives,
            pool.context,
            run_dir / "negatives",
            planned_steps(planner.steps_per_epoch, config.train),
            refresh_scorer(exp) if teacher is not None else None,
        )
        refresher.restore(resumed_at)
        callbacks.append(refresher)
    validator = None
    if config.validation.enabled and exp.main:
        # validating on the training split leaves out the queries trained on
        validated = exp.eval_data or exp.dataset
        same = validated is exp.dataset and config.validation.split == config.data.train_split
        held_out = pool.query_ids if same else ()
        if config.data.eval_part == "report" and config.validation.split == config.data.eval_split:
            parts = query_parts(validated, config.data)  # choosing a checkpoint is tuning: on the tuning part only
            held_out = parts.report if parts else ()
        validator = Validator(
            config.validation,
            validated,
            model,
            exp.device,
            run_dir,
            config.eval.metrics,
            held_out,
            model_config=config.model,
            precision=config.eval.precision,
            batch_size=config.eval.batch_size,
        )
        callbacks.append(validator)
    result = fine_tune_model(
        model,
        data,
        config.train,
        planner,
        run_dir,
        exp.device,
        identity,
        objective,
        on_epoch_end=evaluate_epoch if config.eval.each_epoch else None,
        on_step_end=(lambda step: [callback(step) for callback in callbacks]) if callbacks else None,
    )
    if not exp.main:
        return
    if validator is not None and config.validation.select:
        best = validator.best_after(result.steps)
        model.load_state_dict(type(model).from_pretrained(str(run_dir / "best-model")).state_dict())
        exp.notes.append(
            f"validation.select: the model is the step-{best['step']} weights, the best {best['metric']} "
            f"({best['score']:.4f}) on the {validator.subcorpus.label} validation subcorpus."
        )
    if start is not None:
        model.save(run_dir / "model-fine-tuned")
        interpolate_weights(model, start, config.train.wise_ft)
        exp.notes.append(
            f"wise-ft: the saved and evaluated model is {1 - config.train.wise_ft:g} x the starting weights + "
            f"{config.train.wise_ft:g} x the fine-tuned ones (those alone: model-fine-tuned/)."
        )
    model.save(run_dir / "model")
    for saved in (run_dir / "schedule").glob("epoch-*.npz"):  # the epochs' scheduling embeddings: done with
        saved.unlink()
    with contextlib.suppress(OSError):
        (run_dir / "schedule").rmdir()  # only where nothing else (a user's file) is in it
    # a resumed run's time is its whole: the pieces before this one trained up to its checkpoint
    exp.timings["train_s"] = time.perf_counter() - started + result.earlier_seconds
    exp.notes.append(
        f"Fine-tuned on {len(data)} {config.data.train_split} queries: {result.steps} steps of batch "
        f"{config.train.batch_size} with {data.negatives_per_query} {config.negatives.source} hard negative(s) "
        f"per query, batches by {config.schedule.method}, loss: {objective.describe()}; "
        f"final loss {result.final_loss:.4f}; "
        f"{result.examples_per_second:.1f} examples/s on {exp.device.type} ({step_kind(model, config, exp.device)})"
        f"{resumed_note(result.earlier_seconds)}."
    )
    if data.mix:
        exp.notes.append(mix_summary(data, config.train.batch_size, result.steps))


# ---- stage 5: results ----------------------------------------------------------------------------------


def finish(exp: Experiment) -> None:
    """``metrics.json``, ``report.md`` and the table on the terminal."""
    config, metrics = exp.config, exp.config.eval.metrics
    payload = {
        "dataset": config.data.name,
        "eval_dataset": config.data.eval_name or config.data.name,
        "eval": exp.evalset.description,
        **({"eval_part": exp.evalset.part} if exp.evalset.part else {}),
        "device": str(exp.device),
        "results": exp.results,
        "timings": exp.timings,
        "notes": exp.notes,
        "config": asdict(config),
    }
    atomic_write_text(exp.run_dir / "metrics.json", json.dumps(payload, indent=2))
    evaluated = config.data.eval_name or config.data.name
    trained = f"Trained on `{config.data.name}`, evaluated on " if config.data.eval_name else ""
    write_report(
        exp.run_dir,
        f"densepass run: {config.name}",
        f"{trained or 'Dataset '}`{evaluated}`: {exp.evalset.description}.",
        exp.results,
        metrics,
        exp.notes,
    )
    print_table(exp.results, metrics, f"{evaluated}: {exp.evalset.description}")


def prepare_cross_encoder(exp: Experiment, pool: TrainingPool, pairs: Pairs | None) -> Scores | None:
    """Train the run's cross-encoder when configured (its pool: the run's), then the teacher's scores of
    ``pairs`` when the bi-encoder is distilled (rank 0 computes them, every rank reads them)."""
    config = exp.config
    if config.reranker.enabled and config.reranker.train.enabled:  # every process trains; rank 0 saves
        exp.reranker = train_reranker(
            config, exp.dataset, pool.query_ids, pool.mined.pool, exp.device, exp.run_dir, exp.notes
        )
        distributed.barrier()
    if pairs is None:
        return None
    teacher = exp.teacher or exp.reranker
    scores = teacher_scores(config, exp.dataset, pairs, teacher, exp.main) if exp.main else None
    distributed.barrier()
    return scores if exp.main else teacher_scores(config, exp.dataset, pairs, teacher, False)


def evaluate_reranked(exp: Experiment) -> None:
    """The rows of ``reranker.first_stages``, each first stage's run with its top ``reranker.depth`` reranked."""
    cfg = exp.config.reranker
    if exp.reranker is None or not cfg.first_stages:
        return
    exp.results.update(
        rerank_rows(
            exp.evalset,
            exp.runs,
            exp.reranker,
            cfg.first_stages,
            cfg.depth,
            lambda run, name: score_run(exp, run, name),
            exp.timings,
        )
    )
    per_query = ", ".join(
        f"{s}: {exp.timings.get(f'rerank_{s}_ms_per_query', 0):.0f} ms ({exp.timings[f'rerank_{s}_pairs_scored']} "
        f"new pairs scored)"
        for s in cfg.first_stages
    )
    exp.notes.append(
        f"Reranking the top {cfg.depth} on {exp.device.type}, per query: {per_query}; pairs two first stages share "
        "are scored once, and a stage's cost per query is its time per scored pair times its pairs per query."
    )


def step_kind(model, config: ExperimentConfig, device: torch.device) -> str:
    """How the training steps ran, for the report: their precision and whether they were packed
    (``train.packing``)."""
    t = config.train
    precision = "bf16 autocast" if uses_bf16(device, t.bf16, t.cpu_bf16) else "float32"
    return f"{precision}, {'packed' if getattr(model, 'packing', False) else 'padded'} steps"


def run_experiment(config: ExperimentConfig, restart: bool = False) -> dict[str, dict[str, float]]:
    """Run every stage of ``config`` and return {system: {metric: value}} (empty on ranks other than 0)."""
    config = retrievers.with_saved_architecture(config)  # a saved model's settings where the config sets none
    device = check(config)  # (the model's checks see the settings it runs with)
    distributed.init_from_environment()  # under torchrun: one process per GPU, global in-batch negatives
    main = distributed.rank() == 0
    with run_directory(config, main, restart) as claim:
        exp = prepare(config, device, main, restart)
        seed_everything(config.train.seed)
        model = model_from_config(config)
        if config.train.enabled and config.train.freeze_layers is not None:  # its error before any mining
            freeze_bottom(model, config.train.freeze_layers)
        if config.train.enabled and config.train.lora_rank:  # targets no layer: one line before any mining too
            check_adapters(model, config.train)
        if config.train.enabled and config.train.packing is True:  # an encoder it cannot pack: one line first
            enable_packing(model)
        run_dir = claim()  # the checks above passed: only now is the directory marked and --restart's removal done
        pool = mine_training_pool(exp, model)
        pairs = distillation_inputs(exp, pool)  # an existing teacher-scores file is checked before any write
        if main:
            save_config(config, run_dir / "config.yaml")  # only once the run is known to be valid
            if pool.mined is not None:
                save_pool(pool.mined.pool, run_dir / "negatives.jsonl")
        evaluate_baselines(exp, model)
        teacher = prepare_cross_encoder(exp, pool, pairs)
        if config.train.enabled:
            if config.train.matryoshka_init == "pca":  # after the zero-shot row, before wise-ft's start
                exp.notes.append(start_at_principal_axes(model, exp.dataset.corpus, config.train.seed, device))
            start = snapshot(model) if config.train.wise_ft is not None else None
            fine_tune(exp, model, pool, objective_of(config, model), teacher, start)
            if main:
                started = time.perf_counter()
                exp.results["fine-tuned"] = evaluate_dense(exp, model, "fine-tuned", cached=True)
                exp.timings["fine_tuned_eval_s"] = time.perf_counter() - started
        if not main:
            return {}
        evaluate_reranked(exp)
        finish(exp)
        return exp.results
