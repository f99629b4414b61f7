"""The distillation stage of ``densepass run`` (neural-retrieval-lecture: Margin-MSE; training-inference-gap
§2: distillation from a cross encoder): the teacher's scores of every training query's positives and
pool candidates, computed once into a file (``training.teacher_scores``) and checked against the
teacher, the queries and the pool, then the bi-encoder's objective (``losses.objectives.Distillation``).

An existing scores file is checked as soon as the pool is known, before the run writes anything: a
file of other queries or another pool (or of another teacher, when the teacher is a fixed model) is a
one-line error. With ``reranker.distill.source: rows`` the scores are those the training rows carry
(``data.pairs``: a scores column), for their given negatives: no cross-encoder and no scores file.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from densepass.checkpoints import teacher_training_identity
from densepass.config import ExperimentConfig
from densepass.data.dataset import RetrievalDataset
from densepass.errors import ConfigError
from densepass.losses.objectives import Distillation, InfoNCE, Objective
from densepass.models.cross_encoder import CrossEncoder
from densepass.models.load import Retriever
from densepass.pipelines.reranking import automatic_precision
from densepass.pipelines.retrievers import objective_for
from densepass.training.more_negatives import objective_from_config
from densepass.training.teacher_scores import (
    Pairs,
    Scores,
    compute_teacher_scores,
    load_teacher_scores,
    scoring_settings,
    teacher_identity,
)


def distilling(config: ExperimentConfig) -> bool:
    """Whether the run distils a teacher into the retriever."""
    return config.train.enabled and config.reranker.distill.loss != "none"


def from_rows(config: ExperimentConfig) -> bool:
    """Whether the distilled scores are those the training rows carry (``reranker.distill.source: rows``)."""
    return distilling(config) and config.reranker.distill.source == "rows"


def row_scores(dataset: RetrievalDataset, pairs: Pairs) -> Scores:
    """The training rows' teacher scores of ``pairs`` (``data.pairs``: one per positive and given negative of
    every row); a one-line ConfigError when the rows carry none."""
    scores = getattr(dataset, "teacher_scores", None)
    if scores is None:
        raise ConfigError(
            f"reranker.distill.source: rows, but the rows of {dataset.name} carry no teacher scores (a column named "
            "scores, or data.columns.scores)"
        )
    return {q: {p: scores[q][p] for p in pids if p in scores.get(q, {})} for q, pids in pairs.items()}


def objective_of(config: ExperimentConfig, model: Retriever) -> Objective:
    """The run's objective: the ``loss`` section's (``training.more_negatives``), or distillation (alone or + the
    contrastive loss) when configured; SPLADE adds its FLOPS regulariser to either (``objective_for``)."""
    distill = config.reranker.distill
    if distill.loss == "none":
        base = objective_from_config(config.loss, config.train, model)
    else:
        contrastive = InfoNCE(config.train.bidirectional) if distill.contrastive else None
        base = Distillation(distill.loss, distill.weight, distill.temperature, contrastive)
    return objective_for(config, base)


def distillation_identity(config: ExperimentConfig) -> dict:
    """What the distillation adds to the fine-tuned model's identity (empty when not distilling)."""
    if not distilling(config):
        return {}
    distill = {k: v for k, v in asdict(config.reranker.distill).items() if k != "scores_file"}
    if distill.pop("source") == "rows":  # the rows' scores: the data's fingerprint covers them
        return {"distill": {**distill, "teacher": "rows"}}
    teacher = distill["teacher"] or {
        "reranker": config.reranker.name_or_path,
        "max_length": config.reranker.max_length,
        "train": teacher_training_identity(asdict(config.reranker.train)) if config.reranker.train.enabled else None,
    }
    return {"distill": {**distill, "teacher": teacher}}


def scores_path(config: ExperimentConfig) -> Path:
    """Where the teacher scores are (to be) written."""
    file = config.reranker.distill.scores_file
    return Path(file) if file else config.run_dir / "teacher_scores.jsonl"


def fixed_teacher(
    config: ExperimentConfig, reranker: CrossEncoder | None, options: dict, dataset: RetrievalDataset | None = None
) -> CrossEncoder | None:
    """The teacher when it is known before training: ``distill.teacher``, or the run's reranker used as it is
    (None when the run's reranker is still to be trained, or the scores are the rows': then rows of ``dataset``
    without scores are a one-line ConfigError, before any work)."""
    teacher = config.reranker.distill.teacher
    if from_rows(config):
        if dataset is not None:
            row_scores(dataset, {})
        return None
    if teacher is not None:
        return CrossEncoder.from_pretrained(teacher, **options)
    return reranker


def check_existing_scores(
    config: ExperimentConfig, pairs: Pairs, teacher: CrossEncoder | None, dataset: RetrievalDataset | None = None
) -> None:
    """A one-line DataError when a scores file exists and does not cover ``pairs`` (or, with a known teacher,
    was scored by another one or in other settings; with the ``dataset``, of other texts); nothing to check when
    there is no file yet (nor with the rows' scores)."""
    if from_rows(config):
        return
    path = scores_path(config)
    if path.is_file():
        identity = teacher_identity(teacher) if teacher is not None else None
        scoring = scoring_settings(teacher, automatic_precision(config, teacher.device)) if teacher else None
        load_teacher_scores(path, pairs, identity, dataset, scoring)


def teacher_scores(
    config: ExperimentConfig, dataset: RetrievalDataset, pairs: Pairs, teacher: CrossEncoder | None, show_progress: bool
) -> Scores:
    """The teacher's scores of ``pairs``: read from the scores file (checked), or computed into it (resumable)
    in the run's automatic precision whatever ``reranker.precision`` says: they are the students' targets,
    computed once (int8 would put its quantisation error into every distilled model). With
    ``reranker.distill.source: rows``, the rows' scores (``teacher`` unused: None)."""
    if from_rows(config):
        return row_scores(dataset, pairs)
    precision = automatic_precision(config, teacher.device)
    return compute_teacher_scores(
        teacher,
        dataset,
        pairs,
        scores_path(config),
        show_progress=show_progress,
        precision=precision,
        cache_dir=config.cache_dir or None,
    )
