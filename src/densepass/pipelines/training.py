"""Fine-tuning a retriever from Python: ``densepass.train(model, dataset, loss=..., negatives=..., args=...)``.

The same stages as ``densepass run``'s training, which goes through these functions too: sample the training
queries (seeded), mine their hard-negative pool (``negatives``: BM25, a dense miner, a saved model, ...; the
false-negative filters), draw negatives per step from it (``training.batches``), order the batches
(``schedule``: random, clustered, ABS) and run the training engine on the bi-encoder task with the given loss
object (``densepass.losses``: ``InfoNCE() + FLOPS(...)`` for SPLADE, ``Distillation``, ...). Everything is written
under ``output_dir`` (checkpoints, the log, the mined pool, the trained model in ``model/``), which is locked and
owned like a run directory: a run resumes there exactly after an interruption, and refuses a folder of
someone else's.

>>> import densepass as dp
>>> dp.TrainConfig(epochs=1, batch_size=32).learning_rate
2e-05
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from densepass import distributed
from densepass.checkpoints import DATA_FILES, without_later_defaults
from densepass.config import DEFAULT_MODEL, MixConfig, NegativesConfig, ScheduleConfig, TrainConfig, from_dict
from densepass.data import load_dataset
from densepass.data.dataset import Corpus, RetrievalDataset
from densepass.data.pairs import PairsDataset, is_pairs_source, load_pairs
from densepass.device import resolve_device
from densepass.errors import ConfigError
from densepass.index.bm25 import BM25Index
from densepass.losses.matryoshka import Matryoshka, trained_dims
from densepass.losses.objectives import Distillation, InfoNCE, Objective
from densepass.models.biencoder import BiEncoder, model_name
from densepass.models.freeze import check_freeze
from densepass.models.matryoshka import check_dims, principal_rotation
from densepass.negatives.filters import check_denoising
from densepass.negatives.mine import (
    MiningContext,
    MiningResult,
    check_draws,
    check_strategies,
    given_candidates,
    mine_negatives,
    strategy_specs,
)
from densepass.negatives.pool import passage_ids
from densepass.plots import read_log
from densepass.training.adapters import check_adapters
from densepass.training.batches import TrainingData
from densepass.training.dense_miners import prepare_miners
from densepass.training.engine import check_fsdp_combinations
from densepass.training.planner import EpochPlanner, check_schedule
from densepass.training.trainer import TrainResult
from densepass.training.trainer import train as run_training

# What ``train`` writes in ``output_dir``: all that ``restart`` removes; anything else there is kept.
OUTPUT_ENTRIES = (
    "train_log.jsonl",
    "schedule_log.jsonl",
    "checkpoints",
    "model",
    "schedule/epoch-*",
    # the dense miners' logs (their model/ and checkpoints/ list their own files), the mined pools
    # (negatives.pool_cache; another file under them is a user's and stays)
    "negatives/miner-*/train_log.jsonl|negative-pools/*/pool.jsonl|negative-pools/*/mining.json",
)


# How many corpus passages (a seeded sample) give train.matryoshka_init=pca its principal axes: plenty for the
# covariance of a few hundred dimensions, and a minute of encoding on a small CPU.
PCA_PASSAGES = 4096


def data_fingerprints(datasets: Sequence[RetrievalDataset]) -> dict[str, str]:
    """The content fingerprint of every data file ``datasets`` were read from (the training dataset and the
    ``data.mix`` ones), for a run's identity: resuming after any of them changed is refused. Two datasets of the
    same name (``x/tiny`` and ``y/tiny``) keep a key each: the later one's under its position in ``datasets``."""
    fingerprints: dict[str, str] = {}
    for i, dataset in enumerate(datasets):
        for key, value in dataset.file_fingerprints().items():
            fingerprints[key if key not in fingerprints else f"{i}:{key}"] = value
    return fingerprints


def check_principal_axes(corpus: Corpus) -> None:
    """``matryoshka_init=pca`` needs at least two passages to find axes in: refused before any work."""
    if len(corpus) < 2:
        raise ConfigError(
            f"matryoshka_init=pca finds the principal axes of the corpus' embeddings: it needs at least 2 passages, "
            f"the corpus has {len(corpus)}"
        )


def start_at_principal_axes(model: BiEncoder, corpus: Corpus, seed: int, device: torch.device | None) -> str:
    """``train.matryoshka_init=pca``: rotate ``model``'s embedding (``BiEncoder.rotate_output``) to the principal
    axes of its own float32 embeddings of ``PCA_PASSAGES`` passages of ``corpus`` drawn with ``seed``
    (``models.matryoshka.principal_rotation``), before training. The full embedding ranks as before; each prefix
    starts as PCA's. Under torch.distributed every process takes rank 0's rotation: its own could differ (embeddings
    that differ in the last bits, as on another GPU, turn the axes of near-equal variances), and processes that
    start from other weights never meet again. Returns a line for the run's notes."""
    size = min(PCA_PASSAGES, len(corpus))

    def rotation() -> np.ndarray:
        rows = np.sort(np.random.default_rng(seed).choice(len(corpus), size=size, replace=False))
        was_training = model.training
        embeddings = model.encode_passages(corpus.subset(rows.tolist()), device=device, precision="fp32")
        model.train(was_training)
        return principal_rotation(embeddings)

    model.rotate_output(torch.from_numpy(distributed.on_rank_zero(rotation)))
    return (
        f"Matryoshka start: the embedding rotated to its principal axes (PCA of {size} corpus passages' embeddings, "
        "seeded), a projection layer that changes no cosine."
    )


@dataclass
class TrainOutput:
    """What ``train`` returns: the trained model (the one passed in, trained in place), where it was saved, the
    steps, the last loss and the training log (one record per ``args.log_every`` steps)."""

    model: BiEncoder
    model_dir: Path
    steps: int
    final_loss: float
    log: list[dict]


def training_queries(dataset: RetrievalDataset, split: str, max_queries: int | None, seed: int) -> list[str]:
    """The queries a run trains on: ``split``'s, or a seeded sample of ``max_queries`` of them."""
    return sorted(dataset.sample(split, max_queries, seed))


def needs_mining(negatives: NegativesConfig) -> bool:
    """Whether the bi-encoder's training draws hard negatives from a mined pool."""
    return negatives.source not in ("none", "given") and negatives.per_query > 0


def given_pool(dataset: RetrievalDataset, query_ids: list[str]) -> MiningResult:
    """``negatives.source: given``: the pool is the negatives the training rows give (``data.pairs``), in the order
    given, nothing mined or filtered (what is relevant to a query is still never drawn as its negative); its
    checks are ``negatives.mine.given_candidates``'s, as ``densepass mine --strategy given`` makes them."""
    return MiningResult(given_candidates(dataset, query_ids), {}, 0.0)


def as_dataset(
    dataset: RetrievalDataset | str | Path | Any,
    columns: Mapping[str, Any] | None = None,
    subset: str | None = None,
    split: str = "train",
) -> RetrievalDataset:
    """``dataset`` itself, or read: training rows (a JSONL, CSV or Parquet file, a ``save_to_disk`` folder, a
    ``datasets`` dataset, or a Hugging Face dataset ``hf://datasets/org/name[@revision]`` (its ``subset`` and
    ``split``): ``data.pairs``, its ``columns`` mapped), else a dataset name or path in any layout
    (``densepass.load_dataset``)."""
    if isinstance(dataset, RetrievalDataset):
        return dataset
    if isinstance(dataset, str) and dataset.startswith("hf://"):
        return load_dataset(dataset, format="pairs", columns=columns, subset=subset, split=split)
    if subset is not None:
        raise ConfigError(f"subset names a subset of a Hugging Face dataset (hf://datasets/...); {dataset} is not one")
    if is_pairs_source(dataset):
        return load_pairs(dataset, columns, split=split)
    if columns:
        raise ConfigError(f"columns map the columns of training rows; {dataset} is not a file of them")
    return load_dataset(str(dataset))


def mine_pool(
    dataset: RetrievalDataset, query_ids: list[str], negatives: NegativesConfig, context: MiningContext, sep: str
) -> MiningResult:
    """The hard-negative pool of ``query_ids`` (the miners a strategy trains first, in ``context.work_dir``)."""
    prepare_miners(dataset, query_ids, negatives, context)
    return mine_negatives(dataset, query_ids, negatives, context, sep)


MIX_SCHEDULES = ("random", "sequential")  # batch orders that plan the main queries alone, whatever joins them


def mixed_counts(mix: list[MixConfig], batch_size: int) -> list[int]:
    """Queries of each ``data.mix`` entry in every batch: round(fraction x batch size), at least one."""
    return [max(1, round(entry.fraction * batch_size)) for entry in mix]


def check_crop(crop: int | None, longest: int | None, key: str, limit: str) -> None:
    """A one-line error where training would crop passages (``key``: ``crop`` tokens) longer than the model reads
    them (``limit``: ``longest``); None: nothing to compare."""
    if crop is not None and longest is not None and crop > longest:
        raise ConfigError(
            f"{key}={crop} is longer than {limit}={longest}: training crops passages, it cannot read more than the "
            "model"
        )


def check_mix(mix: list[MixConfig], args: TrainConfig, schedule: ScheduleConfig, distils: bool) -> None:
    """``data.mix``'s one-line errors before any work: the main data keeps at least one query of every batch, the
    batch order is one that plans the main queries alone (ABS and clustered batches group queries by similarity:
    appended pairs of another domain would undo what they choose), and no distillation (the mixed pairs have no
    teacher scores)."""
    if not mix:
        return
    counts = mixed_counts(mix, args.batch_size)
    if sum(counts) >= args.batch_size:
        raise ConfigError(
            f"data.mix takes {sum(counts)} of every batch's {args.batch_size} queries: lower the fractions (or raise "
            "train.batch_size) so that the main data keeps some"
        )
    if schedule.method not in MIX_SCHEDULES:
        raise ConfigError(
            f"data.mix does not combine with schedule.method {schedule.method}: its batches are chosen by similarity"
            f" among the main queries; use {' or '.join(MIX_SCHEDULES)}"
        )
    if distils:
        raise ConfigError("data.mix does not combine with distillation: the mixed-in pairs have no teacher scores")


def load_mix(mix: list[MixConfig], data_dir: str | None) -> list[RetrievalDataset]:
    """The ``data.mix`` datasets, each with queries in its split (a missing one: one line, before any work)."""
    datasets = []
    for entry in mix:
        dataset = load_dataset(entry.name, data_dir, entry.format)
        if not dataset.positives(entry.split):
            raise ConfigError(f"data.mix: {entry.name} has no queries with a positive in its {entry.split!r} split")
        datasets.append(dataset)
    return datasets


def add_mix(
    data: TrainingData, datasets: list[RetrievalDataset], mix: list[MixConfig], batch_size: int, seed: int
) -> None:
    """Mix ``datasets``' pairs into every batch of ``data`` (``TrainingData.add_mix``), seeded by ``seed``."""
    for dataset, entry, count in zip(datasets, mix, mixed_counts(mix, batch_size)):
        data.add_mix(dataset, entry.split, count, seed)


def mix_summary(data: TrainingData, batch_size: int, steps: int) -> str:
    """What ``data.mix`` put into a run's ``steps`` batches, for its notes ("" without it)."""
    if not data.mix:
        return ""
    parts = [
        f"{s.per_batch} from {s.name} ({steps * s.per_batch} pairs over the run, "
        f"{min(len(s.query_texts), steps * s.per_batch)} of its {len(s.query_texts)} queries)"
        for s in data.mix
    ]
    return (
        f"Mixed into each batch of {batch_size} queries: {'; '.join(parts)}; in-batch and random mixed-positive "
        "negatives only, nothing mined or filtered for them."
    )


def batch_planner(
    model: BiEncoder, data: TrainingData, args: TrainConfig, schedule: ScheduleConfig, run_dir: Path, device
) -> EpochPlanner:
    """The batch order of ``schedule`` (``training.planner``: random, clustered, ABS), its state under ``run_dir``;
    it plans the main queries' share of each batch (the rest: ``data.mixed_per_batch`` mixed-in pairs)."""
    log = run_dir / "schedule_log.jsonl"
    size = args.batch_size - data.mixed_per_batch
    return EpochPlanner(schedule, size, args.seed, data, model, device, log, state_dir=run_dir / "schedule")


def fine_tune_model(
    model: BiEncoder,
    data: TrainingData,
    args: TrainConfig,
    planner: EpochPlanner,
    run_dir: Path,
    device: torch.device,
    identity: dict,
    objective: Objective,
    on_epoch_end: Callable[[int], None] | None = None,
    on_step_end: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train ``model`` in place on ``data`` in ``planner``'s batch order (closed at the end); resumes from
    ``run_dir``'s checkpoints of the same ``identity``."""
    try:
        return run_training(
            model,
            data,
            args,
            run_dir,
            device,
            planner,
            identity=identity,
            objective=objective,
            on_epoch_end=on_epoch_end,
            on_step_end=on_step_end,
        )
    finally:
        planner.close()


def model_source(model: Any) -> str | None:
    """Where ``model``'s starting weights come from, as a run's identity records it: the bundled model's name, a
    local folder's absolute path (so ``m``, ``./m`` and ``/abs/m`` are one source), or a Hub id as given."""
    source = getattr(model, "source", None)
    if not isinstance(source, str):
        return None
    path = Path(source)
    return model_name(str(path.resolve())) if path.exists() else source


def train(
    model: BiEncoder,
    dataset: RetrievalDataset | str | Path | Any,
    *,
    output_dir: str | Path,
    columns: Mapping[str, Any] | None = None,
    subset: str | None = None,
    loss: Objective | None = None,
    negatives: NegativesConfig | None = None,
    args: TrainConfig | None = None,
    schedule: ScheduleConfig | None = None,
    split: str = "train",
    max_queries: int | None = None,
    seed: int = 13,
    device: str | None = None,
    on_step_end: Callable[[int], None] | None = None,
    restart: bool = False,
    mix: Sequence[MixConfig] = (),
    data_dir: str | Path | None = None,
) -> TrainOutput:
    """Fine-tune ``model`` (a ``BiEncoder``, ``SpladeEncoder`` or ``ColBERT``) in place on ``dataset``'s ``split``
    (a dataset or its name / path, see ``densepass.load_dataset``; or training rows: a JSONL, CSV or Parquet file
    of (anchor, positive[, negatives...]) rows, a folder written by ``datasets``' ``save_to_disk``, or a
    ``datasets.Dataset``, or a Hugging Face dataset ``hf://datasets/org/name[@revision]`` with its ``subset`` and
    ``split``, with ``columns`` mapping their columns as ``densepass.data.pairs`` says) and save it to
    ``output_dir/model``.

    ``loss``: a loss object of ``densepass.losses`` (default ``InfoNCE(args.bidirectional)``; SPLADE wants
    ``+ FLOPS(...)``); ``negatives``: how the hard-negative pool is mined and how many negatives each query draws
    per step (default: BM25's top 30, one per step; ``NegativesConfig(source="none")`` for in-batch negatives
    only; training rows default to the negatives they give, ``source="given"``, or to in-batch negatives when they
    give none; rows with teacher scores give them to a ``Distillation`` loss); ``args``: the optimisation
    (``TrainConfig``: epochs, batch size, learning rate, bf16, ...); ``schedule``: the batch order (default
    random); ``max_queries`` / ``seed``: a seeded sample of the training queries; ``device``: cpu, cuda or cuda:N
    (None: cuda when available). ``on_step_end(step)`` runs after every step. With ``restart``, what an earlier call
    wrote in ``output_dir`` is removed first; otherwise an interrupted call resumes from its checkpoints. ``mix``:
    other datasets' pairs mixed into every batch (``MixConfig``: name, format, split, fraction; ``data.mix`` of a
    run, a forgetting guard), their names read under ``data_dir`` like ``densepass.load_dataset``'s.

    Under torchrun (``torchrun --nproc_per_node N script.py``) every process calls it: it joins torchrun's process
    group for the call (unless the caller has), each process encodes its share of every batch, and rank 0 claims
    ``output_dir`` and saves the model (docs/guide/scale-out.md)."""
    for name, given, kind, shown in [
        ("args", args, TrainConfig, "dp.TrainConfig"),
        ("negatives", negatives, NegativesConfig, "dp.NegativesConfig"),
        ("schedule", schedule, ScheduleConfig, "dp.ScheduleConfig"),
        ("loss", loss, Objective, "loss object of dp.losses"),
    ]:
        if given is not None and not isinstance(given, kind):
            raise ConfigError(f"{name}: a {shown}, not a {type(given).__name__}")
    for name, number, least in (("max_queries", max_queries, 1), ("seed", seed, 0)):
        if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < least):
            raise ConfigError(f"{name}: an integer >= {least}, got {number!r}")
    dataset = as_dataset(dataset, columns, subset, split)
    if negatives is None and isinstance(dataset, PairsDataset):
        negatives = NegativesConfig(source="given" if any(dataset.negatives.values()) else "none")
    args, negatives, schedule = args or TrainConfig(), negatives or NegativesConfig(), schedule or ScheduleConfig()
    for name, given in (("args", args), ("negatives", negatives), ("schedule", schedule)):
        as_json = json.loads(json.dumps(asdict(given)))  # tuples as lists, as a YAML file gives them
        from_dict(type(given), as_json, name)  # the ranges a YAML config is held to: before any work
    if negatives.refresh_every is not None:
        raise ConfigError("negatives.refresh_every re-mines during training: use `densepass run` for it")
    ignored = [
        f"args.{key}" for key, on in (("wise_ft", args.wise_ft is not None), ("enabled", not args.enabled)) if on
    ]
    if ignored:  # options of a run's stages around training
        raise ConfigError(f"{', '.join(ignored)}: an option of `densepass run`, which dp.train does not apply")
    if args.matryoshka_weights and not args.matryoshka_dims:
        raise ConfigError("args.matryoshka_weights weigh args.matryoshka_dims: give the dimensions too")
    check_draws(negatives)
    if (
        args.matryoshka_dims
        and loss is not None
        and trained_dims(loss)
        and (list(trained_dims(loss, weighted=False)) != list(args.matryoshka_dims))
    ):
        raise ConfigError(
            f"args.matryoshka_dims {args.matryoshka_dims} and the loss's {list(trained_dims(loss, weighted=False))}: "
            "give them once"
        )
    longest = getattr(getattr(model, "config", None), "passage_max_length", None)
    check_crop(args.passage_max_length, longest, "args.passage_max_length", "the model's passage_max_length")
    if args.freeze_layers is not None:  # the layers the model has, and lora_targets it has: before any mining
        check_freeze(model, args.freeze_layers)
    if args.lora_rank:
        check_adapters(model, args)
    objective = loss or InfoNCE(args.bidirectional)
    if args.matryoshka_dims and not trained_dims(objective):  # args' Matryoshka dimensions wrap the loss
        objective = Matryoshka(objective, args.matryoshka_dims, args.matryoshka_weights)
    if trained_dims(objective):  # the saved model records them (checked against its size before any work)
        if not isinstance(model, BiEncoder):
            raise ConfigError(
                f"{objective.describe()} trains prefixes of one embedding: a {type(model).__name__} has none"
            )
        check_dims(trained_dims(objective, weighted=False), model.dim, "the Matryoshka dimensions")
    elif args.matryoshka_init != "none":
        raise ConfigError("args.matryoshka_init starts Matryoshka training: give args.matryoshka_dims too")
    if args.matryoshka_init == "pca":
        check_principal_axes(dataset.corpus)
    mix = list(mix)
    check_mix(mix, args, schedule, distils(objective))
    check_schedule(schedule)
    check_processes(args, on_step_end is not None)
    mixed = load_mix(mix, None if data_dir is None else str(data_dir))
    torch_device = resolve_device(device)
    query_ids = training_queries(dataset, split, max_queries, seed)
    planned = args.batch_size - sum(mixed_counts(mix, args.batch_size))
    if planned > len(query_ids):  # (the planner's check, after the pool was mined)
        raise ConfigError(f"batch size {args.batch_size} is larger than the {len(query_ids)} training queries")
    given = None
    if negatives.source == "given" and negatives.per_query > 0:  # its errors before anything is written
        given = passage_ids(given_pool(dataset, query_ids).pool)
    if needs_mining(negatives):  # a malformed strategy, a model or file it reads, a filter's model: before the claim
        check_strategies(negatives, inputs=True, pairs=isinstance(dataset, PairsDataset))
        if "given" in strategy_specs(negatives):  # (mixed) rows that give no negatives
            given_candidates(dataset, query_ids)
        check_denoising(negatives, getattr(model, "source", None) or DEFAULT_MODEL)  # as the context's base_model
    if distils(objective) and given is None:  # dp.train has no cross-encoder: the scores come with the rows
        raise ConfigError(
            f"{objective.describe()}: train distils the teacher scores of training rows over their given negatives "
            "(rows with a scores column, negatives.source given)"
        )
    if distils(objective) and dataset.teacher_scores is None:
        raise ConfigError(
            f"{objective.describe()}: the rows of {dataset.name} carry no teacher scores (a column named scores, or "
            "columns={'scores': ...})"
        )
    if trained_dims(objective):  # the saved model records them: set once every check has passed
        model.config = replace(model.config, matryoshka_dims=list(trained_dims(objective)))
    run_dir = Path(output_dir)
    identity = {
        "data": {"dataset": dataset.name, "split": split, "max_queries": max_queries, "seed": seed},
        "model": asdict(model.config),
        # where its weights come from: another model of the same settings would resume this run's checkpoints
        "model_source": model_source(model),
        "negatives": without_later_defaults(asdict(negatives)),
        "schedule": {k: v for k, v in asdict(schedule).items() if k != "background"},
        "loss": objective.describe(),
        "objective": objective.identity(),  # the exact settings (describe rounds numbers)
        DATA_FILES: data_fingerprints([dataset, *mixed]),
        **({"mix": [asdict(entry) for entry in mix]} if mix else {}),
    }
    with distributed.process_group():  # under torchrun: joined for the call, unless the caller has joined
        main = distributed.rank() == 0
        with distributed.rank_zero_run_directory(run_dir, "training", OUTPUT_ENTRIES, restart, ("model",)) as claim:
            claim()  # under torchrun: every process goes on once rank 0 has claimed the directory
            if args.matryoshka_init == "pca":
                start_at_principal_axes(model, dataset.corpus, args.seed, torch_device)  # as a run: train.seed
            sep = model.tokenizer.sep_token or " "
            data = TrainingData(dataset, split, sep, query_ids=query_ids)
            if needs_mining(negatives):
                context = MiningContext(
                    split,
                    torch_device,
                    BM25Index.build(dataset.corpus.passage_inputs(" ")) if uses_bm25(negatives) else None,
                    run_dir / "negatives",
                    base_model=getattr(model, "source", None) or DEFAULT_MODEL,  # where dense miners start from
                    architecture=model.config,
                    train_config=args,
                    seed=seed,
                    pools_dir=run_dir / "negatives",  # a resumed run reads its pool back
                )
                mined = mine_pool(dataset, query_ids, negatives, context, sep)
                data = TrainingData(
                    dataset, split, sep, passage_ids(mined.pool), negatives.per_query, query_ids=query_ids
                )
            elif given is not None:
                teacher = getattr(dataset, "teacher_scores", None)
                data = TrainingData(
                    dataset, split, sep, given, negatives.per_query, query_ids=query_ids, teacher_scores=teacher
                )
            add_mix(data, mixed, mix, args.batch_size, args.seed)
            planner = batch_planner(model, data, args, schedule, run_dir, torch_device)
            result = fine_tune_model(
                model, data, args, planner, run_dir, torch_device, identity, objective, None, on_step_end
            )
            if main:
                model.save(run_dir / "model")
            distributed.barrier()
    log = read_log(result.log_path)  # a damaged line is left out (trim_log dropped those it found already)
    return TrainOutput(model, run_dir / "model", result.steps, result.final_loss, log)


def check_processes(args: TrainConfig, hooked: bool) -> None:
    """``dp.train`` under torchrun, before any work: the batch splits evenly over the processes, and FSDP has
    torchrun's processes and nothing it does not combine with (``on_step_end`` uses the model mid-training)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if distributed.launched_by_torchrun() else 1
    if args.batch_size % world:
        raise ConfigError(
            f"args.batch_size {args.batch_size} must split evenly over the {world} processes (each encodes a share)"
        )
    if not args.fsdp:
        return
    if world < 2:
        raise ConfigError("args.fsdp shards the model over torchrun's processes: run under torchrun --nproc_per_node N")
    check_fsdp_combinations(args, "args.fsdp")
    if hooked:
        raise ConfigError("args.fsdp does not combine yet with on_step_end (it would use the model mid-training)")


def distils(objective: Objective) -> bool:
    """Whether ``objective`` has a ``Distillation`` term (alone, in a sum, or wrapped: ``Matryoshka``)."""
    if isinstance(objective, Distillation):
        return True
    return any(distils(part) for part in getattr(objective, "terms", ())) or (
        isinstance(getattr(objective, "base", None), Objective) and distils(objective.base)
    )


def uses_bm25(negatives: NegativesConfig) -> bool:
    """Whether mining ``negatives`` reads BM25's ranking (its source, or one of a mixed source's strategies)."""
    return negatives.source == "bm25" or negatives.source == "mixed" and "bm25" in negatives.mix
