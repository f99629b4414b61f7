"""Run an experiment from its config: baselines, training, indexing, evaluation and the report.

Everything lands in ``<output_dir>/<name>/``: ``config.yaml`` (resolved), ``checkpoints/``,
``model/`` (final fine-tuned model), ``runs/*.trec``, ``train_log.jsonl``, ``metrics.json`` and
``report.md`` with PNG plots. Re-running the same command resumes an interrupted run.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import torch

from densepass.config import ExperimentConfig, save_config
from densepass.data import load_dataset, sample_queries
from densepass.device import default_device
from densepass.errors import ConfigError
from densepass.evaluation.answers import top_k_accuracy
from densepass.evaluation.metrics import Run, evaluate_run, make_run, write_trec_run
from densepass.evaluation.tables import print_table
from densepass.index.bm25 import BM25Index
from densepass.index.retrieve import dense_retrieve, rerank_candidates
from densepass.io import atomic_write_text
from densepass.models.biencoder import BiEncoder
from densepass.negatives.mine import MiningContext, mine_negatives
from densepass.negatives.pool import passage_ids, save_pool
from densepass.pipelines.evalset import EvalSet, add_rerank_candidates, build_eval_set
from densepass.pipelines.report import write_report
from densepass.pipelines.validation import Validator
from densepass.training import distributed
from densepass.training.batches import TrainingData
from densepass.training.miner import prepare_miners
from densepass.training.planner import EpochPlanner
from densepass.training.refresh import NegativeRefresher
from densepass.training.trainer import planned_steps, resume_step, train


def model_from_config(config: ExperimentConfig) -> BiEncoder:
    return BiEncoder.from_pretrained(config.model.name_or_path, config=config.model.architecture())


def score_run(evalset: EvalSet, run: Run, config: ExperimentConfig, name: str) -> dict[str, float]:
    """Write the run as TREC and compute its metrics (plus top-k answer accuracy when answers exist)."""
    write_trec_run(run, config.run_dir / "runs" / f"{name}.trec", tag=name)
    results = evaluate_run(evalset.qrels, run, config.eval.metrics)
    if evalset.answers:
        rankings = {q: sorted(r, key=r.get, reverse=True) for q, r in run.items()}
        texts = dict(zip(evalset.corpus.ids, evalset.corpus.texts))
        results.update(top_k_accuracy(rankings, texts, evalset.answers, [1, 5, 20, 100]))
    return results


def _candidate_run(evalset: EvalSet, scores_of) -> Run:
    """A run scoring each query's own candidates with ``scores_of(query index, candidate ids)``."""
    return {qid: dict(zip(evalset.candidates[qid], map(float, scores_of(i, evalset.candidates[qid]))))
            for i, qid in enumerate(evalset.query_ids)}


def evaluate_dense(model: BiEncoder, evalset: EvalSet, config: ExperimentConfig, device, name: str) -> dict[str, float]:
    sep = model.tokenizer.sep_token or " "
    if evalset.candidates is not None:
        corpus = evalset.corpus
        texts = [corpus.passage_inputs(sep, [corpus.position(p) for p in evalset.candidates[q]]) for q in evalset.query_ids]
        scores = rerank_candidates(model, evalset.query_texts, texts, config.eval.batch_size, device)
        return score_run(evalset, _candidate_run(evalset, lambda i, _: scores[i]), config, name)
    scores, rows = dense_retrieve(
        model, evalset.query_texts, evalset.corpus.passage_inputs(sep), config.eval.depth, config.eval.index,
        config.eval.batch_size, device,
    )
    return score_run(evalset, make_run(evalset.query_ids, evalset.corpus.ids, scores, rows), config, name)


def evaluate_bm25(evalset: EvalSet, index: BM25Index, config: ExperimentConfig) -> dict[str, float]:
    """BM25 over the evaluation corpus (``index`` must cover ``evalset.corpus``)."""
    if evalset.candidates is not None:
        corpus = evalset.corpus
        return score_run(evalset, _candidate_run(evalset, lambda i, cands: index.score_all(evalset.query_texts[i])[
            [corpus.position(p) for p in cands]]), config, "bm25")
    scores, rows = index.search(evalset.query_texts, config.eval.depth)
    run = make_run(evalset.query_ids, evalset.corpus.ids, scores, rows, drop_nonpositive=True)
    return score_run(evalset, run, config, "bm25")


def run_identity(config: ExperimentConfig) -> dict:
    """The settings besides ``train`` that change the fine-tuned model: resuming across a change is refused."""
    schedule = {k: v for k, v in asdict(config.schedule).items() if k != "background"}
    return {"data": asdict(config.data), "model": asdict(config.model), "negatives": asdict(config.negatives),
            "schedule": schedule}


def run_experiment(config: ExperimentConfig) -> dict[str, dict[str, float]]:
    """Run every stage of ``config`` and return {system: {metric: value}}."""
    for baseline in config.eval.baselines:
        if baseline not in ("bm25", "zero-shot"):
            raise ConfigError(f"eval.baselines: unknown baseline {baseline!r} (known: bm25, zero-shot)")
    distributed.init_from_environment()  # under torchrun: one process per GPU, global in-batch negatives
    main = distributed.rank() == 0
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if main:
        save_config(config, run_dir / "config.yaml")
    device = torch.device(config.device) if config.device else default_device()
    timings: dict[str, float] = {}

    started = time.perf_counter()
    dataset = load_dataset(config.data.name, config.data.data_dir, config.data.format)
    neg = config.negatives
    uses_bm25 = neg.source == "bm25" or neg.source == "mixed" and "bm25" in neg.mix
    need_full_bm25 = uses_bm25 and neg.per_query > 0 and config.train.enabled or config.data.eval_hard_k > 0
    full_bm25 = BM25Index.build(dataset.corpus.passage_inputs(" ")) if need_full_bm25 else None
    evalset = build_eval_set(dataset, config.data, full_bm25)
    eval_bm25 = None
    if "bm25" in config.eval.baselines or config.eval.mode == "rerank":
        eval_bm25 = BM25Index.build(evalset.corpus.passage_inputs(" "))
    if config.eval.mode == "rerank":
        add_rerank_candidates(evalset, eval_bm25, config.eval.rerank_candidates)
    timings["data_and_bm25_s"] = time.perf_counter() - started

    results: dict[str, dict[str, float]] = {}
    if "bm25" in config.eval.baselines and main:
        results["BM25"] = evaluate_bm25(evalset, eval_bm25, config)
    model = model_from_config(config)
    if "zero-shot" in config.eval.baselines and main:
        started = time.perf_counter()
        results["zero-shot"] = evaluate_dense(model, evalset, config, device, "zero-shot")
        timings["zero_shot_eval_s"] = time.perf_counter() - started

    notes = []
    if config.train.enabled:
        started = time.perf_counter()
        train_qids = sorted(sample_queries(dataset.split(config.data.train_split), config.data.max_train_queries,
                                           config.data.seed))
        with_positives = dataset.positives(config.data.train_split)
        train_qids = [q for q in train_qids if q in with_positives]
        negatives, context = None, None
        sep = model.tokenizer.sep_token or " "
        if neg.source != "none" and neg.per_query > 0:
            context = MiningContext(config.data.train_split, device, full_bm25, run_dir / "negatives",
                                    config.model.name_or_path, model.config, config.train, config.data.seed,
                                    show_progress=main)
            prepare_miners(dataset, train_qids, neg, context)
            mined = mine_negatives(dataset, train_qids, neg, context, sep)
            if main:
                save_pool(mined.pool, run_dir / "negatives.jsonl")
            notes.append(f"Hard negatives ({neg.source}): {mined.summary()}.")
            if neg.refresh_every:
                notes.append(f"Refreshed with the model being trained every {neg.refresh_every} steps "
                             "(negatives/refresh_log.jsonl).")
            negatives = passage_ids(mined.pool)
        data = TrainingData(dataset, config.data.train_split, sep, negatives,
                            neg.per_query if negatives else 0, query_ids=train_qids)
        planner = EpochPlanner(config.schedule, config.train.batch_size, config.train.seed, data, model, device,
                               run_dir / "schedule_log.jsonl")
        eval_log = run_dir / "eval_log.jsonl"
        eval_log.unlink(missing_ok=True)

        def evaluate_epoch(epoch: int) -> None:
            metrics = evaluate_dense(model, evalset, config, device, f"epoch-{epoch + 1}")
            with open(eval_log, "a") as handle:
                handle.write(json.dumps({"epoch": epoch + 1, **metrics}) + "\n")
            model.train()

        refresher = None
        if neg.refresh_every is not None:
            if context is None:
                raise ConfigError("negatives.refresh_every needs hard negatives (a negatives.source and per_query > 0)")
            if distributed.world_size() > 1:
                raise ConfigError("negatives.refresh_every runs in a single process only (for now)")
            refresher = NegativeRefresher(neg.refresh_every, model, data, dataset, train_qids, neg, context,
                                          run_dir / "negatives", planned_steps(planner.steps_per_epoch, config.train))
            refresher.restore(resume_step(run_dir, config.train, run_identity(config)))
        try:
            validator = (Validator(config.validation, dataset, model, device, run_dir, config.eval.metrics)
                         if config.validation.enabled and main else None)
            callbacks = [c for c in (validator, refresher) if c is not None]

            def on_step_end(step: int) -> None:
                for callback in callbacks:
                    callback(step)

            result = train(model, data, config.train, run_dir, device, planner, identity=run_identity(config),
                           on_epoch_end=evaluate_epoch if config.eval.each_epoch else None,
                           on_step_end=on_step_end if callbacks else None)
        finally:
            planner.close()
        if not main:
            return {}
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

    if not main:
        return {}
    metrics = config.eval.metrics
    payload = {"dataset": config.data.name, "eval": evalset.description, "device": str(device),
               "results": results, "timings": timings, "config": asdict(config)}
    atomic_write_text(run_dir / "metrics.json", json.dumps(payload, indent=2))
    write_report(run_dir, f"densepass run: {config.name}", f"Dataset `{config.data.name}`: {evalset.description}.",
                 results, metrics, notes)
    print_table(results, metrics, f"{config.data.name}: {evalset.description}")
    return results
