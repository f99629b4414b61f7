"""Training the phrase and question encoders (training-inference-gap §4), resumable bit for bit.

Each step encodes the windows of its passage groups (``phrase.batches``) and of its hard negatives, takes
every text token as a column, adds the pre-batch memory (``phrase.memory``) and minimises eq. 1 or eq. 2
(``phrase.loss``) with AdamW and a linear warm-up. Checkpoints (``densepass.checkpoints``: safetensors and
JSON) hold the model, the optimiser, scheduler and random states, the memory and the validation state, so
an interrupted run resumes to the same weights. With a ``validate`` callback (``phrase.validation``: phrase
accuracy on a subcorpus, §3) the best model so far is kept in ``best-model/``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from densepass.checkpoints import Checkpoints, Resumed, restore_rng, training_identity, trim_log
from densepass.data.dataset import Corpus, sample_queries
from densepass.data.squad import SquadSpans
from densepass.errors import ConfigError
from densepass.io import atomic_write_text
from densepass.models.dropout import use_cpu_dropout
from densepass.numerics import DivergenceGuard
from densepass.phrase.batches import PhraseExample, plan_epoch, sample_hard_negatives, training_examples
from densepass.phrase.config import PhraseTrainConfig
from densepass.phrase.loss import Columns, phrase_loss
from densepass.phrase.memory import PrebatchMemory
from densepass.phrase.model import PhraseEncoder
from densepass.phrase.windows import TokenizedPassage
from densepass.training.trainer import seed_everything

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


def step_columns(
    model: PhraseEncoder, data: PhraseData, step: Step, device: torch.device
) -> tuple[Columns, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's token columns, each question's window id, and its gold start / end columns."""
    windows = [data.tokenized[p].windows[w] for p, w in step.windows]
    batch = {k: v.to(device) for k, v in model.collate_windows(windows).items()}
    start, end = model.phrase_vectors(batch)
    window_of, position = [], []
    for w, window in enumerate(windows):
        window_of += [w] * window.length
        position += range(window.first, window.first + window.length)
    window_t = torch.tensor(window_of, dtype=torch.long, device=device)
    position_t = torch.tensor(position, dtype=torch.long, device=device)
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
    columns = Columns(
        start[window_t, position_t],
        end[window_t, position_t],
        passages[window_t],
        window_t,
        origin,
        gold_start,
        gold_end,
    )

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
) -> tuple[torch.Tensor, Columns]:
    """The step's loss (eq. 1 or 2) and its batch columns (for the memory)."""
    columns, row_window, positive_start, positive_end = step_columns(model, data, step, device)
    questions = {k: v.to(device) for k, v in model.tokenize_questions([e.question for e in step.examples]).items()}
    q_start, q_end = model.question_vectors(questions)
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


def restore_training(resumed: Resumed, model: PhraseEncoder, optimizer, scheduler, device: torch.device) -> None:
    """Load a checkpoint's phrase model, optimizer, learning-rate schedule and random states in place."""
    saved = PhraseEncoder.from_pretrained(str(resumed.path / "model"), model.config)
    model.load_state_dict(saved.state_dict())
    model.to(device)
    optimizer.load_state_dict(resumed.optimizer)
    scheduler.load_state_dict(resumed.scheduler)
    restore_rng(resumed.rng)


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
    model with the highest ``select_metric`` so far is saved to ``run_dir / "best-model"``."""
    if config.loss == "separate" and config.hard_negatives:
        raise ConfigError("hard negatives need train.loss=unified (eq. 1 has no term for them)")
    seed_everything(config.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    model.filter = None  # the token filter is trained on the final vectors (§5.2)
    use_cpu_dropout(model.to(device).train(), device)  # on the CPU, faster dropout masks (models.dropout)
    steps_per_epoch = len(plan_epoch(data.examples, config.passages_per_batch, config.questions_per_passage, 0, 0))
    total = (
        steps_per_epoch * config.epochs
        if config.max_steps is None
        else min(steps_per_epoch * config.epochs, config.max_steps)
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay, fused=True
    )
    scheduler = get_linear_schedule_with_warmup(optimizer, int(config.warmup_ratio * total), total)
    memory = PrebatchMemory(config.prebatch)
    checkpoints = Checkpoints(
        run_dir, config.keep_checkpoints, {"train": training_identity(config), **(identity or {})}
    )
    log_path, eval_path = run_dir / "train_log.jsonl", run_dir / "eval_log.jsonl"
    step, interval, best = 0, [0.0, 0], None
    guard = DivergenceGuard(config.skip_nonfinite)
    resumed = checkpoints.latest()
    if resumed is not None:
        restore_training(resumed, model, optimizer, scheduler, device)
        memory.load_state_dict(resumed.extra["memory"])
        guard.load_state_dict(resumed.extra.get("nonfinite"))
        step, interval, best = resumed.step, list(resumed.extra["interval"]), resumed.extra["best"]
    trim_log(log_path, step)
    trim_log(eval_path, step)
    started, loss_value = time.perf_counter(), float("nan")

    def run_validation() -> None:
        nonlocal best
        metrics = validate(model)
        model.train()
        with open(eval_path, "a") as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")
        if best is None or metrics[select_metric] > best[select_metric]:
            best = {"step": step, **metrics}
            model.save(run_dir / "best-model")
            atomic_write_text(run_dir / "best.json", json.dumps(best, indent=2))

    progress = tqdm(total=total, initial=step, desc="train phrases", disable=not show_progress, dynamic_ncols=True)
    for epoch in range(step // steps_per_epoch, config.epochs):
        plan = plan_epoch(data.examples, config.passages_per_batch, config.questions_per_passage, config.seed, epoch)
        for index, groups in enumerate(plan):
            if epoch * steps_per_epoch + index < step:
                continue  # trained on before the resume
            if step >= total:
                break
            batch = data.step(config, epoch, index, groups)
            loss, columns = step_loss(model, data, batch, config, memory, step >= config.prebatch_warmup, device)
            loss.backward()
            taken, _ = guard.step(step + 1, loss, model.parameters(), optimizer, scheduler)
            if taken:  # a skipped batch's columns may hold NaN: kept out of the pre-batch memory
                memory.push(columns)
                interval = [interval[0] + float(loss.detach()), interval[1] + 1]
            step += 1
            progress.update(1)
            if (step % config.log_every == 0 or step == total) and interval[1]:
                loss_value = interval[0] / interval[1]
                progress.set_postfix(loss=f"{loss_value:.4f}")
                record = {"step": step, "epoch": epoch, "loss": loss_value, "lr": scheduler.get_last_lr()[0]}
                if guard.skipped:
                    record["skipped"] = guard.skipped
                with open(log_path, "a") as handle:
                    handle.write(json.dumps(record) + "\n")
                interval = [0.0, 0]
            epoch_end = index == len(plan) - 1 or step == total
            if validate is not None and (epoch_end or (validate_every and step % validate_every == 0)):
                guard.check_weights(step, model.named_parameters())
                run_validation()
            if step % config.checkpoint_every == 0 or step == total:
                guard.check_weights(step, model.named_parameters())
                checkpoints.save(
                    step,
                    lambda directory: model.save(directory / "model"),
                    optimizer,
                    scheduler,
                    {
                        "memory": memory.state_dict(),
                        "interval": interval,
                        "best": best,
                        "nonfinite": guard.state_dict(),
                    },
                )
    progress.close()
    return PhraseTrainResult(step, loss_value, best, time.perf_counter() - started)
