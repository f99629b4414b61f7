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

As in ``pipelines.experiment``, each stage is a function of a :class:`PhraseRun` (what the stages share) and
``run_phrase`` calls them in order.

Under ``torchrun`` every process reads the data and trains (``phrase.train``: each encodes its share of every step);
rank 0 locks and claims the run directory, mines the hard negatives while the others wait, and writes every file.
After training rank 0 alone runs the later stages, which are one process's work (the filter, the index, query
tuning: ``distributed.rank_zero_alone``); the others return an empty result.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from densepass import distributed
from densepass.checkpoints import BOOKKEEPING, DATA_FILES, check_data_files, differences
from densepass.config import load_config, save_config
from densepass.data.dataset import Corpus
from densepass.data.paths import dataset_dir
from densepass.data.squad import SquadSpans, load_squad_spans
from densepass.device import resolve_device
from densepass.errors import ConfigError
from densepass.evaluation.subcorpus import Subcorpus, gold_subcorpus
from densepass.fingerprints import fingerprint_file
from densepass.io import atomic_write_text
from densepass.phrase.batches import PhraseExample
from densepass.phrase.config import PhraseConfig
from densepass.phrase.hard_negatives import mine_hard_negatives, read_negatives
from densepass.phrase.index import PhraseIndex
from densepass.phrase.model import CONFIG_NAME, PhraseEncoder
from densepass.phrase.query_tuning import gold_rows, tune_question_encoder
from densepass.phrase.token_filter import train_token_filter
from densepass.phrase.train import PhraseData, Validator, build_phrase_data, split_rows, train_phrases
from densepass.phrase.validation import (
    EvalSet,
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
SAVED = (
    "best-model",
    "model",
    "index",
    "qsft-model",
)  # what a run replaces: checked as densepass's own before --restart


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
    if not config.eval.ks:
        raise ConfigError("eval.ks is empty: give at least one k of answer accuracy, e.g. [1, 5, 20]")
    if not config.filter.enabled and config.filter.threshold is not None:
        raise ConfigError(
            "filter.threshold filters the index by the token filter's logits, which filter.enabled=false does not "
            "train: set filter.threshold: null, or filter.enabled: true"
        )
    if not config.train.init:  # a saved phrase model brings its own windows
        m = config.model
        check_window_settings(m.max_length, m.stride, m.title_max_tokens)
    return device


# ---- stage 1: data -------------------------------------------------------------------------------------


@dataclass
class PhraseRun:
    """What the stages share."""

    config: PhraseConfig
    device: torch.device
    main: bool  # rank 0 (or no torch.distributed): the process that writes
    data: SquadSpans
    data_files: dict[str, dict]  # {DATA_FILES: fingerprints}: part of what a checkpoint is of
    evalset: EvalSet  # the evaluation questions (``data.max_eval_questions`` of them)
    train_rows: list[int]  # corpus rows of the training split's passages
    train_qids: list[str]  # the training questions that have answer spans
    model: PhraseEncoder  # the starting model, trained in place
    stages: Stages
    show_progress: bool
    index: PhraseIndex | None = None  # the corpus index, built by the first stage that needs it

    @property
    def run_dir(self) -> Path:
        """Where this run writes: ``<output_dir>/<name>``."""
        return self.config.run_dir

    @property
    def corpus(self) -> Corpus:
        """The whole corpus."""
        return self.data.dataset.corpus


def prepare(
    config: PhraseConfig,
    device: torch.device,
    data: SquadSpans,
    restart: bool,
    claim: Callable[[], Path],
    show_progress: bool,
) -> PhraseRun:
    """Check that finished stages were computed from the same data files (not on ``restart``: what the directory
    holds is then to be removed), pick the evaluation questions and the training rows, and load the starting model;
    only then ``claim()`` the run directory (it is marked, and ``restart``'s removal done) and write
    ``config.yaml``."""
    run_dir = config.run_dir
    data_files = {DATA_FILES: data.dataset.file_fingerprints()}
    if not restart:  # finished stages are skipped: checked before any
        check_data_files(run_dir, data_files[DATA_FILES])
        check_same_settings(config)
    d = config.data
    evalset = evaluation_set(data, d.eval_split, d.max_eval_questions, d.seed)
    train_rows = split_rows(data, d.train_split)
    train_qids = [q for q in data.dataset.split(d.train_split) if q in data.spans]
    if config.train.hard_negatives and config.train.hard_negatives_file:  # a file given: read once before the claim
        training = {data.dataset.corpus.ids[row] for row in train_rows}
        read_negatives(config.train.hard_negatives_file, data.dataset.corpus, training)
    model = starting_model(config)
    claim()  # the checks above passed: only now is the directory marked and --restart's removal done
    main = distributed.rank() == 0
    if main:
        save_config(config, run_dir / "config.yaml")
    stages = Stages(run_dir)
    return PhraseRun(
        config, device, main, data, data_files, evalset, train_rows, train_qids, model, stages, show_progress
    )


# the config sections each stage's results follow (a stage finished under other values is refused, not skipped)
STAGE_SECTIONS = {
    "hard_negatives": ("data", "model", "train"),
    "train": ("data", "model", "train", "validation"),
    "filter": ("filter",),
    "evaluate": ("eval", "filter"),
    "query_tuning": ("query_tuning", "eval"),
}
# keys of those sections that change how the work is done, not its results: where the data is read from (its files
# are fingerprinted: check_data_files), how many windows an evaluation encodes at once, and the training sections'
# bookkeeping (checkpoints.BOOKKEEPING)
UNRESULTING = {"data": ("data_dir",), "eval": ("batch_size",)}


def settings_identity(config: PhraseConfig, stages: Collection[str] = tuple(STAGE_SECTIONS)) -> dict:
    """The settings the results of ``stages`` follow (``STAGE_SECTIONS``), as JSON values."""
    values = json.loads(json.dumps(asdict(config)))
    sections = sorted({section for stage in stages for section in STAGE_SECTIONS.get(stage, ())})
    kept = {}
    for section in sections:
        left_out = (*UNRESULTING.get(section, ()), *(BOOKKEEPING if section in ("train", "query_tuning") else ()))
        kept[section] = {k: v for k, v in values[section].items() if k not in left_out}
    return kept


def check_same_settings(config: PhraseConfig) -> None:
    """Refuse to go on with a run directory whose finished stages were computed with other settings: they would
    be skipped and their results reported as this config's (and its ``config.yaml`` replaced by this one). Settings
    of stages still to run may change."""
    saved, stages = config.run_dir / "config.yaml", config.run_dir / STAGES
    if not (saved.is_file() and stages.is_file()):
        return
    hint = "use another name or output_dir, or --restart to discard it"
    try:
        finished = list(Stages(config.run_dir).done)
        earlier = settings_identity(load_config(saved, None, PhraseConfig), finished)
    except (ConfigError, ValueError) as err:
        raise ConfigError(
            f"{config.run_dir} holds a config.yaml or {STAGES} that does not load ({err}); {hint}"
        ) from err
    changed = differences(earlier, settings_identity(config, finished))
    if changed:
        raise ConfigError(
            f"{config.run_dir} holds a phrase run whose finished stages ({', '.join(finished)}) had other settings "
            f"({changed} differ from its config.yaml); {hint}"
        )


# ---- stage 2: hard negatives ---------------------------------------------------------------------------


def hard_negatives(run: PhraseRun) -> tuple[dict[str, list[int]] | None, str | None]:
    """The training questions' hard negatives as corpus rows, and the fingerprint of their file (part of what a
    checkpoint is of); (None, None) without hard negatives. They are read from ``train.hard_negatives_file``, or
    mined once into ``hard_negatives.jsonl`` by rank 0 while the others wait (``mine_negatives``)."""
    train = run.config.train
    if not train.hard_negatives:
        return None, None
    path = Path(train.hard_negatives_file or run.run_dir / "hard_negatives.jsonl")
    if train.hard_negatives_file is None:  # rank 0 mines; the others wait, and share its errors
        distributed.on_rank_zero(lambda: run.stages.run("hard_negatives", lambda: mine_negatives(run, path)))
    training = {run.corpus.ids[row] for row in run.train_rows}
    return read_negatives(path, run.corpus, training).as_rows(run.corpus), fingerprint_file(path)


def mine_negatives(run: PhraseRun, path: Path) -> dict:
    """The ``hard_negatives`` stage: the starting model's top phrases for each training question, whose passages
    hold none of its answers (§4.3.1), saved to ``path``; returns what was retrieved and removed."""
    train = run.config.train
    mined = mine_hard_negatives(run.model, run.data, run.train_rows, run.train_qids, train.mine_depth, run.device)
    mined.save(path)
    with_none = sum(1 for n in mined.negatives.values() if not n)
    return {"retrieved": mined.retrieved, "removed": mined.removed, "questions_without": with_none}


# ---- stage 3: training ---------------------------------------------------------------------------------


@dataclass
class TrainingInputs:
    """What training reads; built on every run, since query tuning trains on the same examples."""

    phrase_data: PhraseData
    subcorpus: Subcorpus  # the validation subcorpus (saved to ``subcorpus.json``)
    validate: Validator | None  # None: validation is off and the last model is the best
    identity: dict  # what the checkpoints are of, besides the training settings


def training_inputs(run: PhraseRun, hard: dict[str, list[int]] | None, hard_key: str | None) -> TrainingInputs:
    """The validation subcorpus (written to ``subcorpus.json`` by rank 0) and its validator, the training examples
    with their ``hard`` negatives, and the checkpoints' identity."""
    config, d = run.config, run.config.data
    valset = evaluation_set(run.data, d.eval_split, config.validation.max_questions, d.seed)
    sub = validation_subcorpus(run.corpus, valset, config.validation, d.seed)
    if run.main:
        sub.save(run.run_dir / "subcorpus.json")
    phrase_data = build_phrase_data(run.model, run.data, d.train_split, d.max_train_questions, d.seed, hard)
    validate = (
        phrase_validator(run.corpus, valset, sub, config.eval.ks, run.device, config.eval.batch_size)
        if config.validation.enabled
        else None
    )
    identity = {
        "data": asdict(d),
        "model": asdict(run.model.config),
        "init": config.train.init,
        "hard": hard_key,
        **run.data_files,
    }
    return TrainingInputs(phrase_data, sub, validate, identity)


def train(run: PhraseRun, inputs: TrainingInputs) -> dict:
    """The ``train`` stage: both encoders (eq. 1 or eq. 2) with checkpoints, validated on the subcorpus; the best
    model goes to ``best-model/`` (the last one when validation is off)."""
    config = run.config
    result = train_phrases(
        run.model,
        inputs.phrase_data,
        config.train,
        run.run_dir,
        run.device,
        inputs.identity,
        inputs.validate,
        validate_every=config.validation.every_steps,
        show_progress=run.show_progress,
    )
    if inputs.validate is None and run.main:
        run.model.save(run.run_dir / "best-model")
    return {
        "steps": result.steps,
        "final_loss": result.final_loss,
        "best": result.best,
        "subcorpus": inputs.subcorpus.label,
        "subcorpus_passages": len(inputs.subcorpus),
        "examples": len(inputs.phrase_data.examples),
    }


# ---- stage 4: the token filter -------------------------------------------------------------------------


def token_filter(run: PhraseRun, best: PhraseEncoder) -> dict:
    """The ``filter`` stage: the token filter on the frozen ``best`` model (§5.2, when enabled), validated by AUC-PR
    on the evaluation questions' gold passages; the model is saved to ``model/``."""
    config = run.config
    log = []
    if config.filter.enabled:
        eval_rows = subcorpus_rows(run.corpus, gold_subcorpus(run.corpus, run.evalset.qrels))
        log = train_token_filter(
            best,
            run.data,
            run.train_rows,
            run.train_qids,
            eval_rows,
            run.evalset.qids,
            config.filter,
            run.device,
            config.eval.batch_size,
            config.data.seed,
        )
    best.save(run.run_dir / "model")
    return {"epochs": log, "best_auc_pr": max((r["auc_pr"] for r in log), default=None)}


# ---- stages 5 and 6: evaluation and query tuning -------------------------------------------------------


def corpus_index(run: PhraseRun, final: PhraseEncoder) -> PhraseIndex:
    """The phrase index of the whole corpus under the ``final`` model, built once per run (evaluation and query
    tuning search the same one)."""
    if run.index is None:
        run.index = PhraseIndex.build(
            final,
            run.corpus,
            device=run.device,
            batch_size=run.config.eval.batch_size,
            vector_dtype=run.config.eval.vector_dtype,
            show_progress=run.show_progress,
        )
    return run.index


def evaluate(run: PhraseRun, final: PhraseEncoder) -> dict:
    """The ``evaluate`` stage: the corpus index's metrics unfiltered, at every threshold of the filter sweep, and at
    ``filter.threshold``; the index (filtered at that threshold, if any) is saved to ``index/``."""
    config, evalset = run.config, run.evalset
    index = corpus_index(run, final)
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
    chosen.model_path = str(run.run_dir / "model")
    chosen.save(run.run_dir / "index")
    return out


def query_tuning(run: PhraseRun, final: PhraseEncoder, examples: list[PhraseExample]) -> dict:
    """The ``query_tuning`` stage: the question encoder of the saved model fine-tuned on the training ``examples``
    against an index of the training passages (``qsft/``) and saved to ``qsft-model/``, then evaluated on the corpus
    index."""
    config, run_dir, evalset = run.config, run.run_dir, run.evalset
    tuned = PhraseEncoder.from_pretrained(str(run_dir / "model")).to(run.device)
    train_index = PhraseIndex.build(
        tuned,
        run.corpus.subset(run.train_rows),
        device=run.device,
        batch_size=config.eval.batch_size,
        vector_dtype="float32",
    )
    gold = gold_rows(train_index, run.data, run.train_qids)
    facts = tune_question_encoder(
        tuned,
        train_index,
        examples,
        gold,
        config.query_tuning,
        run_dir / "qsft",
        run.device,
        run.show_progress,
        run.data_files,
    )
    tuned.save(run_dir / "qsft-model")
    index = corpus_index(run, final)
    vectors = tuned.encode_questions(evalset.questions, device=run.device)
    out = {**facts, "unfiltered": evaluate_index(index, evalset, config.eval.ks, vectors)}
    if config.filter.threshold is not None:
        out["filtered"] = evaluate_index(index.filtered(config.filter.threshold), evalset, config.eval.ks, vectors)
    return out


# ---- the run -------------------------------------------------------------------------------------------


def finish(run: PhraseRun) -> dict:
    """Every stage's results in ``metrics.json`` and ``report.md``; returns the metrics."""
    metrics = {"name": run.config.name, "questions": len(run.evalset), "corpus": len(run.corpus), **run.stages.done}
    atomic_write_text(run.run_dir / "metrics.json", json.dumps(metrics, indent=2))
    atomic_write_text(run.run_dir / "report.md", report(run.config, metrics))
    return metrics


def run_phrase(config: PhraseConfig, restart: bool = False, show_progress: bool = True) -> dict:
    """Run every stage of ``config`` (resuming a run that stopped); returns the metrics (under torchrun: rank 0's;
    the other processes return an empty dict)."""
    device = check(config)
    with distributed.process_group():
        data = load_data(config)
        with (
            distributed.rank_zero_run_directory(config.run_dir, "phrase run", RUN_ENTRIES, restart, SAVED) as claim,
            contextlib.ExitStack() as later,
        ):
            run = prepare(config, device, data, restart, claim, show_progress)
            training = training_inputs(run, *hard_negatives(run))
            run.stages.run("train", lambda: train(run, training))
            if not later.enter_context(distributed.rank_zero_alone()):  # the later stages are rank 0's alone
                return {}
            best = PhraseEncoder.from_pretrained(str(run.run_dir / "best-model")).to(device)
            run.stages.run("filter", lambda: token_filter(run, best))
            final = PhraseEncoder.from_pretrained(str(run.run_dir / "model")).to(device)
            run.stages.run("evaluate", lambda: evaluate(run, final))
            if config.query_tuning.enabled:
                run.stages.run("query_tuning", lambda: query_tuning(run, final, training.phrase_data.examples))
            return finish(run)


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
