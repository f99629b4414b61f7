"""Training the phrase and question encoders (training-inference-gap §4), resumable bit for bit.

Each step encodes the windows of its passage groups (``phrase.batches``) and of its hard negatives (under bf16
autocast where the run trains in bf16), takes every text token as a column, adds the pre-batch memory
(``phrase.memory``) and minimises eq. 1 or eq. 2 (``phrase.loss``, in float32). The training engine
(``training.engine``) runs it; its checkpoints also hold the memory and the validation state, so an
interrupted run resumes to the same weights. With a ``validate`` callback (``phrase.validation``: phrase
accuracy on a subcorpus, §3) the best model so far is kept in ``best-model/``.

Under torch.distributed every process prepares the whole step (rank 0's plan), encodes its share of the step's
windows and of its questions (``training.distributed.shares``), and gathers the token columns and question vectors of
every process (only its own carry gradient): each computes the loss of the global step, and the engine sums the
gradients, so the update is that of one process on the whole step. The memory is pushed the gathered columns, the
same on every process. Validation and its files are rank 0's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from typing_extensions import override

from densepass import distributed
from densepass.checkpoints import training_identity, trim_log
from densepass.data.dataset import Corpus, sample_queries
from densepass.data.squad import SquadSpans
from densepass.device import autocast_context
from densepass.errors import ConfigError
from densepass.io import atomic_write_text
from densepass.models.dropout import use_cpu_dropout
from densepass.phrase.batches import PhraseExample, plan_epoch, sample_hard_negatives, training_examples
from densepass.phrase.config import PhraseTrainConfig
from densepass.phrase.loss import Columns, phrase_loss
from densepass.phrase.memory import PrebatchMemory
from densepass.phrase.model import PhraseEncoder
from densepass.phrase.windows import TokenizedPassage
from densepass.training import engine
from densepass.training.distributed import gather_rows, shares

Validator = Callable[[PhraseEncoder], dict[str, float]]


@dataclass
class Step:
    """One step's questions, its windows ((passage row, window index): the groups' own windows first, then
    the hard negatives') and how many of them are the groups' own."""

    examples: list[PhraseExample]
    windows: list[tuple[int, int]]
    own_windows: int


@dataclass
class PhraseTrainResult:
    """What a training run ends with."""

    steps: int
    final_loss: float
    best: dict | None
    seconds: float


class PhraseData:
    """Training examples, their passages' windows, the training corpus rows and the mined hard negatives."""

    def __init__(
        self,
        examples: list[PhraseExample],
        tokenized: dict[int, TokenizedPassage],
        corpus: Corpus,
        train_rows: Sequence[int],
        hard: dict[str, list[int]] | None = None,
    ) -> None:
        self.examples, self.tokenized, self.corpus = examples, tokenized, corpus
        self.train_rows, self.hard = list(train_rows), hard or {}

    def step(self, config: PhraseTrainConfig, epoch: int, index: int, groups: list[list[int]]) -> Step:
        """The step ``index`` of ``epoch`` made of ``groups`` (hard negatives drawn from (seed, epoch, index))."""
        rng = np.random.default_rng([config.seed, epoch, index, 1])
        examples = [self.examples[i] for group in groups for i in group]
        windows = list(dict.fromkeys((e.passage, e.window) for e in examples))
        own = len(windows)
        if config.hard_negatives:
            rows = sample_hard_negatives(
                groups, self.examples, self.hard, config.hard_negatives, self.train_rows, self.corpus, rng
            )
            windows += [(row, int(rng.integers(len(self.tokenized[row].windows)))) for row in rows]
        return Step(examples, windows, own)


def split_rows(data: SquadSpans, split: str) -> list[int]:
    """Corpus rows of the passages of ``split``'s questions, in corpus order."""
    corpus = data.dataset.corpus
    return sorted({corpus.position(p) for rels in data.dataset.split(split).values() for p in rels})


def build_phrase_data(
    model: PhraseEncoder,
    data: SquadSpans,
    split: str,
    limit: int | None = None,
    seed: int = 13,
    hard: dict[str, list[int]] | None = None,
) -> PhraseData:
    """The training examples of ``split`` (a seeded sample of ``limit`` questions), their passages tokenised
    with ``model``'s window settings; the split's passages are the pool of random negatives."""
    corpus = data.dataset.corpus
    qids = [q for q in sample_queries(data.dataset.split(split), limit, seed) if q in data.spans]
    rows = split_rows(data, split)
    tokenized = dict(
        zip(rows, model.tokenize_passages([corpus.titles[r] for r in rows], [corpus.texts[r] for r in rows]))
    )
    examples = training_examples(data.dataset.queries, data.spans, data.passage, corpus, tokenized, qids)
    return PhraseData(examples, tokenized, corpus, rows, hard)


def _share_of(batch: dict[str, torch.Tensor], rows: range, device: torch.device) -> dict[str, torch.Tensor]:
    """This process's rows of a batch padded as a whole (so each row is padded as in one process)."""
    return {k: v[rows.start : rows.stop].to(device) for k, v in batch.items()}


def step_columns(
    model: PhraseEncoder, data: PhraseData, step: Step, device: torch.device, bf16: bool = False
) -> tuple[Columns, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's token columns (float32; the encoder runs in bf16 when ``bf16``), each question's window id,
    and its gold start / end columns. Under torch.distributed this process encodes its share of the windows and
    the columns of every process are gathered (only its own carry gradient)."""
    windows = [data.tokenized[p].windows[w] for p, w in step.windows]
    window_of, position = [], []
    for w, window in enumerate(windows):
        window_of += [w] * window.length
        position += range(window.first, window.first + window.length)
    window_t = torch.tensor(window_of, dtype=torch.long, device=device)
    position_t = torch.tensor(position, dtype=torch.long, device=device)
    parts = shares(len(windows))
    mine, first_column = parts[distributed.rank()], np.cumsum([0] + [window.length for window in windows])
    if len(mine):
        with autocast_context(device, bf16):
            start, end = model.phrase_vectors(_share_of(model.collate_windows(windows), mine, device))
        start, end = start.float(), end.float()
        columns_of_mine = slice(int(first_column[mine.start]), int(first_column[mine.stop]))
        rows, positions = window_t[columns_of_mine] - mine.start, position_t[columns_of_mine]
        start, end = start[rows, positions], end[rows, positions]
    else:  # more processes than windows: this one encodes none
        start = end = torch.zeros(0, model.dim, device=device)
    counts = [int(first_column[part.stop] - first_column[part.start]) for part in parts]
    start, end = gather_rows(start, counts), gather_rows(end, counts)
    column_of = {(w, p): c for c, (w, p) in enumerate(zip(window_of, position))}
    index_of = {key: w for w, key in enumerate(step.windows)}
    row_window = [index_of[(e.passage, e.window)] for e in step.examples]
    positive_start = [column_of[(w, e.start)] for w, e in zip(row_window, step.examples)]
    positive_end = [column_of[(w, e.end)] for w, e in zip(row_window, step.examples)]
    gold_start = torch.zeros(len(window_of), dtype=torch.bool, device=device)
    gold_end = torch.zeros_like(gold_start)
    gold_start[positive_start] = True
    gold_end[positive_end] = True
    passages = torch.tensor([p for p, _ in step.windows], dtype=torch.long, device=device)
    origin = torch.where(window_t < step.own_windows, 0, 2)
    columns = Columns(start, end, passages[window_t], window_t, origin, gold_start, gold_end)

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return columns, as_tensor(row_window), as_tensor(positive_start), as_tensor(positive_end)


def step_loss(
    model: PhraseEncoder,
    data: PhraseData,
    step: Step,
    config: PhraseTrainConfig,
    memory: PrebatchMemory,
    use_memory: bool,
    device: torch.device,
    bf16: bool = False,
) -> tuple[torch.Tensor, Columns]:
    """The step's loss (eq. 1 or 2) and its batch columns (for the memory): of the global step under
    torch.distributed, this process encoding its share of the questions (``step_columns``: of the windows)."""
    columns, row_window, positive_start, positive_end = step_columns(model, data, step, device, bf16)
    parts = shares(len(step.examples))
    mine = parts[distributed.rank()]
    if len(mine):
        questions = model.tokenize_questions([e.question for e in step.examples])
        with autocast_context(device, bf16):
            q_start, q_end = model.question_vectors(_share_of(questions, mine, device))
        q_start, q_end = q_start.float(), q_end.float()
    else:  # more processes than questions: this one encodes none
        q_start = q_end = torch.zeros(0, model.dim, device=device)
    counts = [len(part) for part in parts]
    q_start, q_end = gather_rows(q_start, counts), gather_rows(q_end, counts)
    remembered = memory.columns(device) if use_memory else None
    all_columns = Columns.cat([columns, remembered]) if remembered is not None else columns
    row_passage = torch.tensor([e.passage for e in step.examples], dtype=torch.long, device=device)
    loss = phrase_loss(
        q_start,
        q_end,
        all_columns,
        row_passage,
        row_window,
        positive_start,
        positive_end,
        config.loss,
        (config.lambda_inp, config.lambda_inb, config.lambda_hard),
        config.separate_weight,
        config.in_batch,
    )
    return loss, columns


class PhraseModelTask(engine.Task):
    """What every task training a phrase model shares: its weights, and how a checkpoint holds them (``model/``)."""

    model: PhraseEncoder

    @override
    def named_weights(self):
        return self.model.named_parameters()

    @override
    def save(self, checkpoint: Path) -> None:
        self.model.save(checkpoint / "model")

    @override
    def load(self, checkpoint: Path, device: torch.device) -> None:
        saved = PhraseEncoder.from_pretrained(str(checkpoint / "model"), self.model.config)
        self.model.load_state_dict(saved.state_dict())
        self.model.to(device)


class PhraseTask(PhraseModelTask):
    """Both encoders of a phrase model trained on ``data`` (eq. 1 or 2), with the pre-batch memory."""

    description = "train phrases"
    throughput = None  # the log is the same, byte for byte, after a resume
    distributed = True

    def __init__(self, model: PhraseEncoder, data: PhraseData, config: PhraseTrainConfig) -> None:
        if config.loss == "separate" and config.hard_negatives:
            raise ConfigError("hard negatives need train.loss=unified (eq. 1 has no term for them)")
        self.model, self.data, self.config = model, data, config
        self.memory = PrebatchMemory(config.prebatch)
        self.steps_per_epoch = len(
            plan_epoch(data.examples, config.passages_per_batch, config.questions_per_passage, 0, 0)
        )
        self.epochs = config.epochs

    @override
    def setup(self, device: torch.device) -> None:
        self.model.filter = None  # the token filter is trained on the final vectors (§5.2)
        use_cpu_dropout(self.model.to(device).train(), device)  # on the CPU, faster dropout masks (models.dropout)

    @override
    def parameter_groups(self) -> list[dict]:
        return [{"params": list(self.model.parameters())}]

    @override
    def plan(self, epoch: int) -> list[list[list[int]]]:
        c = self.config
        return plan_epoch(self.data.examples, c.passages_per_batch, c.questions_per_passage, c.seed, epoch)

    @override
    def prepare(self, epoch: int, index: int, groups: list[list[int]]) -> Step:
        return self.data.step(self.config, epoch, index, groups)

    @override
    def step(self, batch: Step, context: engine.StepContext) -> engine.StepOutput:
        use_memory = context.step >= self.config.prebatch_warmup
        loss, columns = step_loss(
            self.model, self.data, batch, self.config, self.memory, use_memory, context.device, context.bf16
        )
        if loss.requires_grad:  # not when this process's shares of the windows and the questions were both empty
            loss.backward()
        return engine.StepOutput(loss, size=len(batch.examples), outputs=columns)

    @override
    def after_step(self, output: engine.StepOutput, batch: Step) -> None:
        self.memory.push(output.outputs)  # a skipped batch's columns may hold NaN: never pushed

    @override
    def state_dict(self) -> dict:
        return {"memory": self.memory.state_dict()}

    @override
    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state["memory"])


class KeepBest(engine.Callback):
    """Validation every ``every`` steps and at the end of every epoch (``eval_log.jsonl``); the model with the
    highest ``metric`` so far is saved to ``best-model/`` and its metrics to ``best.json``. Under torch.distributed
    rank 0 validates and writes (the others hold the same weights; they wait for it in the next step)."""

    def __init__(self, model: PhraseEncoder, validate: Validator, metric: str, every: int | None) -> None:
        self.model, self.validate, self.metric, self.every = model, validate, metric, every
        self.best: dict | None = None

    @override
    def on_train_begin(self, engine: engine.Engine) -> None:
        if distributed.rank() == 0:
            trim_log(engine.run_dir / "eval_log.jsonl", engine.step)

    @override
    def on_step_end(self, engine: engine.Engine) -> None:
        if not (engine.epoch_end or (self.every and engine.step % self.every == 0)):
            return
        engine.check_weights()
        if distributed.rank() != 0:
            return
        metrics = self.validate(self.model)
        self.model.train()
        with open(engine.run_dir / "eval_log.jsonl", "a") as handle:
            handle.write(json.dumps({"step": engine.step, **metrics}) + "\n")
        if self.best is None or metrics[self.metric] > self.best[self.metric]:
            self.best = {"step": engine.step, **metrics}
            self.model.save(engine.run_dir / "best-model")
            atomic_write_text(engine.run_dir / "best.json", json.dumps(self.best, indent=2))

    @override
    def state_dict(self) -> dict:
        return {"best": self.best}

    @override
    def load_state_dict(self, state: dict) -> None:
        self.best = state["best"]


def train_phrases(
    model: PhraseEncoder,
    data: PhraseData,
    config: PhraseTrainConfig,
    run_dir: Path,
    device: torch.device,
    identity: dict | None = None,
    validate: Validator | None = None,
    select_metric: str = "em@1",
    validate_every: int | None = None,
    show_progress: bool = True,
) -> PhraseTrainResult:
    """Train ``model`` in place; resumes from the newest intact checkpoint in ``run_dir``.

    ``validate(model)`` (when given) runs every ``validate_every`` steps and at the end of every epoch; the
    model with the highest ``select_metric`` so far is saved to ``run_dir / "best-model"``. Under torch.distributed
    every process calls it with its own copy of the model and data; rank 0 validates and writes, and its result
    alone holds ``best``."""
    task = PhraseTask(model, data, config)
    keep_best = KeepBest(model, validate, select_metric, validate_every) if validate is not None else None
    result = engine.fit(
        task,
        config,
        run_dir,
        device,
        total=engine.planned_steps(task.steps_per_epoch, config.epochs, config.max_steps),
        identity={"train": training_identity(config), **(identity or {})},
        callbacks=[keep_best] if keep_best is not None else [],
        show_progress=show_progress,
    )
    best = keep_best.best if keep_best is not None else None
    return PhraseTrainResult(result.steps, result.final_loss, best, result.seconds)
