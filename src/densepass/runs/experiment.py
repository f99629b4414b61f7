"""Run an experiment from its config: baselines, training, indexing, evaluation and the report.

Everything lands in ``<output_dir>/<name>/``: ``config.yaml`` (resolved), ``checkpoints/``,
``model/`` (final fine-tuned model), ``runs/*.trec``, ``train_log.jsonl``, ``metrics.json`` and
``report.md`` with PNG plots. Re-running the same command resumes an interrupted run.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from densepass.config import ExperimentConfig, save_config
from densepass.data import load_dataset, sample_queries
from densepass.errors import ConfigError
from densepass.evaluation.metrics import evaluate_run, make_run, write_trec_run
from densepass.index.bm25 import BM25Index
from densepass.index.encode import default_device
from densepass.index.retrieve import dense_retrieve
from densepass.io import atomic_write_text
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.negatives.bm25 import mine_bm25_negatives
from densepass.runs.evalset import EvalSet, build_eval_set
from densepass.runs.report import print_table, write_report
from densepass.scheduling.planner import EpochPlanner
from densepass.training.batches import TrainingData
from densepass.training.trainer import train


def model_from_config(config: ExperimentConfig) -> BiEncoder:
    m = config.model
    arch = BiEncoderConfig(
        shared=m.shared, pooling=m.pooling, projection_dim=m.projection_dim, normalize=m.normalize,
        temperature=m.temperature, query_max_length=m.query_max_length, passage_max_length=m.passage_max_length,
    )
    return BiEncoder.from_pretrained(m.name_or_path, config=arch)


def evaluate_dense(model: BiEncoder, evalset: EvalSet, config: ExperimentConfig, device, name: str) -> dict[str, float]:
    sep = model.tokenizer.sep_token or " "
    scores, rows = dense_retrieve(
        model, evalset.query_texts, evalset.corpus.passage_inputs(sep), config.eval.depth, config.eval.index,
        config.eval.batch_size, device,
    )
    run = make_run(evalset.query_ids, evalset.corpus.ids, scores, rows)
    write_trec_run(run, config.run_dir / "runs" / f"{name}.trec", tag=name)
    return evaluate_run(evalset.qrels, run, config.eval.metrics)


def evaluate_bm25(evalset: EvalSet, config: ExperimentConfig) -> dict[str, float]:
    index = BM25Index.build(evalset.corpus.passage_inputs(" "))
    scores, rows = index.search(evalset.query_texts, config.eval.depth)
    run = make_run(evalset.query_ids, evalset.corpus.ids, scores, rows, drop_nonpositive=True)
    write_trec_run(run, config.run_dir / "runs" / "bm25.trec", tag="bm25")
    return evaluate_run(evalset.qrels, run, config.eval.metrics)


def run_experiment(config: ExperimentConfig) -> dict[str, dict[str, float]]:
    """Run every stage of ``config`` and return {system: {metric: value}}."""
    for baseline in config.eval.baselines:
        if baseline not in ("bm25", "zero-shot"):
            raise ConfigError(f"eval.baselines: unknown baseline {baseline!r} (known: bm25, zero-shot)")
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml")
    device = torch.device(config.device) if config.device else default_device()
    timings: dict[str, float] = {}

    started = time.perf_counter()
    dataset = load_dataset(config.data.name, config.data.data_dir, config.data.format)
    need_full_bm25 = config.negatives.source == "bm25" and config.train.enabled or config.data.eval_hard_k > 0
    full_bm25 = BM25Index.build(dataset.corpus.passage_inputs(" ")) if need_full_bm25 else None
    evalset = build_eval_set(dataset, config.data, full_bm25)
    timings["data_and_bm25_s"] = time.perf_counter() - started

    results: dict[str, dict[str, float]] = {}
    if "bm25" in config.eval.baselines:
        results["BM25"] = evaluate_bm25(evalset, config)
    model = model_from_config(config)
    if "zero-shot" in config.eval.baselines:
        started = time.perf_counter()
        results["zero-shot"] = evaluate_dense(model, evalset, config, device, "zero-shot")
        timings["zero_shot_eval_s"] = time.perf_counter() - started

    notes = []
    if config.train.enabled:
        started = time.perf_counter()
        train_qids = sorted(sample_queries(dataset.split(config.data.train_split), config.data.max_train_queries,
                                           config.data.seed))
        train_qids = [q for q in train_qids if q in dataset.positives(config.data.train_split)]
        negatives = None
        if config.negatives.source == "bm25" and config.negatives.per_query > 0:
            negatives = mine_bm25_negatives(dataset, full_bm25, train_qids, config.negatives.pool_depth,
                                            config.negatives.skip_top)
        data = TrainingData(
            dataset, config.data.train_split, model.tokenizer.sep_token or " ", negatives,
            config.negatives.per_query if negatives else 0, query_ids=train_qids,
        )
        planner = EpochPlanner(config.schedule, config.train.batch_size, config.train.seed, data, model, device,
                               run_dir / "schedule_log.jsonl")
        try:
            result = train(model, data, config.train, run_dir, device, planner)
        finally:
            planner.close()
        model.save(run_dir / "model")
        timings["train_s"] = time.perf_counter() - started
        notes.append(
            f"Fine-tuned on {len(data)} {config.data.train_split} queries: {result.steps} steps of batch "
            f"{config.train.batch_size} with {config.negatives.per_query if negatives else 0} "
            f"{config.negatives.source} hard negative(s) per query, batches by {config.schedule.method}; "
            f"final loss {result.final_loss:.4f}; "
            f"{result.examples_per_second:.1f} examples/s on {device.type}."
        )
        started = time.perf_counter()
        results["fine-tuned"] = evaluate_dense(model, evalset, config, device, "fine-tuned")
        timings["fine_tuned_eval_s"] = time.perf_counter() - started

    metrics = config.eval.metrics
    payload = {"dataset": config.data.name, "eval": evalset.description, "device": str(device),
               "results": results, "timings": timings, "config": asdict(config)}
    atomic_write_text(run_dir / "metrics.json", json.dumps(payload, indent=2))
    write_report(run_dir, f"densepass run: {config.name}", f"Dataset `{config.data.name}`: {evalset.description}.",
                 results, metrics, notes)
    print_table(results, metrics, f"{config.data.name}: {evalset.description}")
    return results
