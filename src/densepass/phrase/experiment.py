"""``densepass phrase CONFIG``: one phrase-retrieval run, in stages (each skipped when its output is there).

1. ``data``: SQuAD with answer spans; the evaluation questions; the validation subcorpus (§3);
2. ``hard negatives`` (when ``train.hard_negatives`` > 0): mined with the starting model (§4.3.1), or read;
3. ``train``: both encoders, eq. 1 or eq. 2, checkpoints, the best model by phrase accuracy on the subcorpus;
4. ``filter``: the token filter on the frozen best model (§5.2), validated by AUC-PR -> ``model/``;
5. ``evaluate``: a phrase index of the whole corpus; EM / F1 / answer accuracy / passage recall, and the
   filter-threshold sweep of index size against accuracy (Figure 2); the index is saved to ``index/``;
6. ``query tuning`` (when enabled): the question encoder against an index of the training passages ->
   ``qsft-model/``, evaluated on the same corpus index.

Everything lands in ``<output_dir>/<name>/``: ``config.yaml``, ``checkpoints/``, ``best-model/``, ``model/``,
``index/``, ``train_log.jsonl``, ``eval_log.jsonl`` (validation), ``metrics.json`` and ``report.md``.

Under ``torchrun`` every process reads the data and trains (``phrase.train``: each encodes its share of every step);
rank 0 locks and claims the run directory, mines the hard negatives while the others wait, and writes every file.
After training rank 0 alone runs the later stages, which are one process's work (the filter, the index, query
tuning: ``distributed.rank_zero_alone``); the others return an empty result.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from densepass import distributed
from densepass.checkpoints import DATA_FILES, check_data_files
from densepass.config import save_config
from densepass.data.paths import dataset_dir
from densepass.data.squad import SquadSpans, load_squad_spans
from densepass.device import resolve_device
from densepass.errors import ConfigError
from densepass.evaluation.subcorpus import gold_subcorpus
from densepass.fingerprints import fingerprint_file
from densepass.io import atomic_write_text
from densepass.phrase.config import PhraseConfig
from densepass.phrase.hard_negatives import mine_hard_negatives, read_negatives
from densepass.phrase.index import PhraseIndex
from densepass.phrase.model import CONFIG_NAME, PhraseEncoder
from densepass.phrase.query_tuning import gold_rows, tune_question_encoder
from densepass.phrase.token_filter import train_token_filter
from densepass.phrase.train import build_phrase_data, split_rows, train_phrases
from densepass.phrase.validation import (
    evaluate_index,
    evaluation_set,
    phrase_validator,
    subcorpus_rows,
    validation_subcorpus,
)
from densepass.phrase.windows import check_window_settings

STAGES = "stages.json"
# What a phrase run writes in its directory: all that --restart removes; anything else there is kept.
RUN_ENTRIES = (
    STAGES,
    "config.yaml",
    "metrics.json",
    "report.md",
    "train_log.jsonl",
    "eval_log.jsonl",
    "hard_negatives.jsonl",
    "subcorpus.json",
    "checkpoints",
    "best-model",
    "best.json",
    "model",
    "index",
    "qsft/train_log.jsonl",  # query tuning's run: its log and checkpoints
    "qsft-model",
)


class Stages:
    """Results of finished stages, kept in ``stages.json`` so that a re-run skips them (written by rank 0)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / STAGES
        self.done = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def run(self, name: str, work) -> dict:
        """``work()``'s result, computed once (with its wall-clock seconds)."""
        if name not in self.done:
            started = time.perf_counter()
            result = work()
            self.done[name] = {**result, "seconds": round(time.perf_counter() - started, 1)}
            if distributed.rank() == 0:
                atomic_write_text(self.path, json.dumps(self.done, indent=2))
        return self.done[name]


def starting_model(config: PhraseConfig) -> PhraseEncoder:
    """The model training starts from: a saved phrase model (``train.init``, keeping its window settings) or
    two towers of ``model.base`` with ``model``'s settings."""
    torch.manual_seed(config.train.seed)
    if config.train.init:
        if not (Path(config.train.init) / CONFIG_NAME).is_file():
            raise ConfigError(f"train.init {config.train.init} is not a saved phrase model (no {CONFIG_NAME})")
        return PhraseEncoder.from_pretrained(config.train.init)
    return PhraseEncoder.from_pretrained(config.model.base, config.model)


def load_data(config: PhraseConfig) -> SquadSpans:
    """The dataset with its answer spans (SQuAD layout only)."""
    if config.data.format != "squad":
        raise ConfigError(f"phrase retrieval needs answer offsets: data.format must be squad, not {config.data.format}")
    return load_squad_spans(dataset_dir(config.data.name, config.data.data_dir), config.data.name)


def check(config: PhraseConfig) -> torch.device:
    """Everything about ``config`` that can be checked without data or a model; returns the device to run on."""
    device = resolve_device(config.device)
    if config.train.loss == "separate" and config.train.hard_negatives:
        raise ConfigError("hard negatives need train.loss=unified (eq. 1 has no term for them)")
    if config.data.format != "squad":
        raise ConfigError(f"phrase retrieval needs answer offsets: data.format must be squad, not {config.data.format}")
    if not config.train.init:  # a saved phrase model brings its own windows
        m = config.model
        check_window_settings(m.max_length, m.stride, m.title_max_tokens)
    return device


def run_phrase(config: PhraseConfig, restart: bool = False, show_progress: bool = True) -> dict:
    """Run every stage of ``config`` (resuming a run that stopped); returns the metrics (under torchrun: rank 0's;
    the other processes return an empty dict)."""
    device = check(config)
    with distributed.process_group():
        return _run_phrase(config, device, restart, show_progress)


def _run_phrase(config: PhraseConfig, device: torch.device, restart: bool, show_progress: bool) -> dict:
    run_dir = config.run_dir
    main = distributed.rank() == 0
    data = load_data(config)
    with (
        distributed.rank_zero_run_directory(run_dir, "phrase run", RUN_ENTRIES, restart) as claim,
        contextlib.ExitStack() as later,
    ):
        data_files = {DATA_FILES: data.dataset.file_fingerprints()}
        if not restart:  # finished stages are skipped: checked before any
            check_data_files(run_dir, data_files[DATA_FILES])
        corpus = data.dataset.corpus
        d = config.data
        evalset = evaluation_set(data, d.eval_split, d.max_eval_questions, d.seed)
        train_rows = split_rows(data, d.train_split)
        train_qids = [q for q in data.dataset.split(d.train_split) if q in data.spans]
        model = starting_model(config)
        claim()  # the checks above passed: only now is the directory marked and --restart's removal done
        if main:
            save_config(config, run_dir / "config.yaml")
        stages = Stages(run_dir)

        hard, hard_key = None, None
        if config.train.hard_negatives:
            path = Path(config.train.hard_negatives_file or run_dir / "hard_negatives.jsonl")

            def mine() -> dict:
                mined = mine_hard_negatives(model, data, train_rows, train_qids, config.train.mine_depth, device)
                mined.save(path)
                with_none = sum(1 for n in mined.negatives.values() if not n)
                return {"retrieved": mined.retrieved, "removed": mined.removed, "questions_without": with_none}

            if config.train.hard_negatives_file is None:  # rank 0 mines; the others wait, and share its errors
                distributed.on_rank_zero(lambda: stages.run("hard_negatives", mine))
            hard, hard_key = read_negatives(path, corpus).as_rows(corpus), fingerprint_file(path)

        valset = evaluation_set(data, d.eval_split, config.validation.max_questions, d.seed)
        sub = validation_subcorpus(corpus, valset, config.validation, d.seed)
        if main:
            sub.save(run_dir / "subcorpus.json")
        phrase_data = build_phrase_data(model, data, d.train_split, d.max_train_questions, d.seed, hard)
        validate = (
            phrase_validator(corpus, valset, sub, config.eval.ks, device, config.eval.batch_size)
            if config.validation.enabled
            else None
        )
        identity = {
            "data": asdict(d),
            "model": asdict(model.config),
            "init": config.train.init,
            "hard": hard_key,
            **data_files,
        }

        def train() -> dict:
            result = train_phrases(
                model,
                phrase_data,
                config.train,
                run_dir,
                device,
                identity,
                validate,
                validate_every=config.validation.every_steps,
                show_progress=show_progress,
            )
            if validate is None and main:
                model.save(run_dir / "best-model")
            return {
                "steps": result.steps,
                "final_loss": result.final_loss,
                "best": result.best,
                "subcorpus": sub.label,
                "subcorpus_passages": len(sub),
                "examples": len(phrase_data.examples),
            }

        stages.run("train", train)
        if not later.enter_context(distributed.rank_zero_alone()):  # the later stages are rank 0's alone
            return {}
        best = PhraseEncoder.from_pretrained(str(run_dir / "best-model")).to(device)

        def token_filter() -> dict:
            log = []
            if config.filter.enabled:
                eval_rows = subcorpus_rows(corpus, gold_subcorpus(corpus, evalset.qrels))
                log = train_token_filter(
                    best,
                    data,
                    train_rows,
                    train_qids,
                    eval_rows,
                    evalset.qids,
                    config.filter,
                    device,
                    config.eval.batch_size,
                    d.seed,
                )
            best.save(run_dir / "model")
            return {"epochs": log, "best_auc_pr": max((r["auc_pr"] for r in log), default=None)}

        stages.run("filter", token_filter)
        final = PhraseEncoder.from_pretrained(str(run_dir / "model")).to(device)
        index_holder: dict[str, PhraseIndex] = {}

        def corpus_index() -> PhraseIndex:
            if "index" not in index_holder:
                index_holder["index"] = PhraseIndex.build(
                    final,
                    corpus,
                    device=device,
                    batch_size=config.eval.batch_size,
                    vector_dtype=config.eval.vector_dtype,
                    show_progress=show_progress,
                )
            return index_holder["index"]

        def evaluate() -> dict:
            index = corpus_index()
            vectors = index.question_vectors(evalset.questions)
            out = {"unfiltered": evaluate_index(index, evalset, config.eval.ks, vectors), "sweep": []}
            if final.filter is not None:
                for threshold in config.filter.thresholds:
                    metrics = evaluate_index(index.filtered(threshold), evalset, config.eval.ks, vectors)
                    out["sweep"].append({"threshold": threshold, **metrics})
            chosen = index.filtered(config.filter.threshold) if config.filter.threshold is not None else index
            if config.filter.threshold is not None:
                out["filtered"] = {
                    "threshold": config.filter.threshold,
                    **evaluate_index(chosen, evalset, config.eval.ks, vectors),
                }
            chosen.model_path = str(run_dir / "model")
            chosen.save(run_dir / "index")
            return out

        results = {"evaluate": stages.run("evaluate", evaluate)}

        if config.query_tuning.enabled:

            def query_tuning() -> dict:
                tuned = PhraseEncoder.from_pretrained(str(run_dir / "model")).to(device)
                train_index = PhraseIndex.build(
                    tuned,
                    corpus.subset(train_rows),
                    device=device,
                    batch_size=config.eval.batch_size,
                    vector_dtype="float32",
                )
                gold = gold_rows(train_index, data, train_qids)
                facts = tune_question_encoder(
                    tuned,
                    train_index,
                    phrase_data.examples,
                    gold,
                    config.query_tuning,
                    run_dir / "qsft",
                    device,
                    show_progress,
                    data_files,
                )
                tuned.save(run_dir / "qsft-model")
                index = corpus_index()
                vectors = tuned.encode_questions(evalset.questions, device=device)
                out = {**facts, "unfiltered": evaluate_index(index, evalset, config.eval.ks, vectors)}
                if config.filter.threshold is not None:
                    out["filtered"] = evaluate_index(
                        index.filtered(config.filter.threshold), evalset, config.eval.ks, vectors
                    )
                return out

            results["query_tuning"] = stages.run("query_tuning", query_tuning)
        metrics = {"name": config.name, "questions": len(evalset), "corpus": len(corpus), **stages.done}
        atomic_write_text(run_dir / "metrics.json", json.dumps(metrics, indent=2))
        atomic_write_text(run_dir / "report.md", report(config, metrics))
    return metrics


def row_metrics(ks: list[int]) -> list[str]:
    """The metrics of a report row: EM / F1 of the top phrase, answer accuracy, passage recall, index size."""
    return [
        "em@1",
        "f1@1",
        *(f"accuracy@{k}" for k in ks),
        *(f"passage_recall@{k}" for k in ks),
        f"passage_accuracy@{max(ks)}",
        "start_vectors",
        "end_vectors",
    ]


def report(config: PhraseConfig, metrics: dict) -> str:
    """A Markdown summary of a run."""
    lines = [
        f"# Phrase retrieval run `{config.name}`",
        "",
        f"{metrics['questions']} {config.data.eval_split} questions over {metrics['corpus']} passages; "
        f"loss {config.train.loss}, hard negatives {config.train.hard_negatives}.",
        "",
    ]
    train = metrics.get("train", {})
    if train.get("best"):
        lines += [
            f"Best checkpoint: step {train['best']['step']} by em@1 on {train['subcorpus']} "
            f"({train['subcorpus_passages']} passages); training took {train['seconds']} s.",
            "",
        ]
    rows = [("unfiltered", metrics["evaluate"]["unfiltered"])]
    rows += [(f"threshold {r['threshold']:g}", r) for r in metrics["evaluate"]["sweep"]]
    if "query_tuning" in metrics:
        rows.append(("query-side fine-tuned", metrics["query_tuning"]["unfiltered"]))
    columns = row_metrics(config.eval.ks)
    lines += ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for label, values in rows:
        cells = [f"{values[m]:.1f}" if isinstance(values[m], float) else f"{values[m]:,}" for m in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    auc = metrics.get("filter", {}).get("best_auc_pr")
    if auc is not None:
        lines += ["", f"Token filter AUC-PR (start/end mean, evaluation passages): {auc:.3f}"]
    return "\n".join(lines) + "\n"
