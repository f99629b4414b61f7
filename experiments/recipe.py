"""The recipe study: which ingredients make the best MiniLM retriever on debian-packages, beside
sentence-transformers' own recipe, and what each costs out of domain.

    python experiments/recipe.py --out outputs/recipe                          # every row, then the report
    python experiments/recipe.py --only "README recipe" "+ 3 hard negatives"  # some rows
    PYTHONPATH=src venv-bench/bin/python experiments/recipe.py --stage st    # sentence-transformers' recipe
    python experiments/recipe.py --stage wise-ft --wise-ft-row "README recipe" --alphas 0.25 0.5 0.75
    python experiments/recipe.py --stage wise-ft --variant-row ROW --wise-ft-variant VARIANT --alphas 0.7 1.0
    python experiments/recipe.py --stage variant --variant-row "+ 3 hard negatives" --variants "lr 2e-5"
    python experiments/recipe.py --stage report
    python experiments/recipe.py --out outputs/recipe --eval-part report --stage report   # chosen on one half of dev

**Rows are cumulative**: each keeps every ingredient of the row above and adds one (``ROWS``), and is
compared with the row above by a paired randomization test (fisher-test) on the same dev queries. Every row
fine-tunes all-MiniLM-L6-v2 on the same seeded sample of ``--train-queries`` debian-packages train queries
(configs/recipe.yaml: batch 32, lr 5e-5, one BM25 hard negative in the first row) and is evaluated on a
seeded sample of dev queries over the **full corpus** (60,240 passages), then zero-shot **out of domain** on
the squad split's 760 dev questions (configs/recipe_ood.yaml: nDCG@10 and top-k answer accuracy) and on ArguAna's
1,401 judged test queries (configs/recipe_ood_arguana.yaml: nDCG@10 and R@100, the query's own argument dropped from its
hits) next to the zero-shot MiniLM it started from.

**Honest model selection** (``--eval-part report``): the dev queries are split once, seeded and by source package
(``data.eval_part``, ``densepass.data.parts``), into a tuning and a reporting part. Every model (row, variant,
wise-ft point, sentence-transformers' recipe; BM25 and the zero-shot MiniLM) is then also evaluated on each part
(``<out>/parts/{tune,report}/<row>``, evaluation only: the training runs are the same as without the option, so
rows trained before are reused), every choice is made on the tuning part (the best row, each row's and variant's
wise-ft α among its interpolations and its own, the dense weight of the linear BM25 fusions), and every number and
paired test of the report is on the reporting part. Without it (the default) the report is what it always was:
choices and numbers on the same seeded dev sample.

Beside the rows:

- ``--stage st``: **sentence-transformers' recipe** at the same model, training queries, steps, batch,
  learning rate, warm-up, lengths and precision: ``mine_hard_negatives`` with the starting model (the
  settings of its documented hard-negative datasets: skip the top 10, sample among the top 50 below the
  positive's score) and ``SentenceTransformerTrainer`` with ``MultipleNegativesRankingLoss`` (scale 20 =
  temperature 0.05) and its no-duplicates batch sampler; the model it saves is evaluated by the same code.
  Needs the ``datasets`` package (the benchmarks' environment).
- ``--stage wise-ft``: wise-ft interpolations of one row's model with the starting weights
  (``densepass.models.interpolate``), each evaluated in and out of domain like a row; with ``--wise-ft-variant``,
  of a variant's fine-tuned weights (``model-fine-tuned/`` where the variant saved a wise-ft model of its own, whose
  α then joins the choice on the tuning part).
- ``--stage variant``: changes to one row (``VARIANTS``), each its own run, tested against that row (issue 55's
  ``LEVERS``, each one change to the recommended variant: against it, when it is on disk): the
  training ingredients after the negatives (re-mining with the model being trained, ABS batches, the best
  checkpoint on H_10, MoCo and pre-batch negatives, batch 128, two epochs), one change each to the dense row
  (``DENSE``; docs/experiments.md runs them on its pool with ``--set negatives.source=file``), the
  forgetting study's (freezing the embeddings and the lowest layers, a lower learning rate, half the steps)
  and the recommended recipe's (``RECOMMENDED``, configs/recommended.yaml until 2026-11-30: twice the queries,
  passages read at 256 tokens but cut to 128 in training batches, one epoch with the pool re-mined half-way,
  wise-ft 0.85; its earlier forms: ``TWO_EPOCHS_07``, two epochs kept at 0.7, ``ONE_EPOCH`` without re-mining,
  and ``CROPS_96``, passages cut to 96 and kept at 0.75), and issue 55's levers, one change each to the
  recommended recipe (``MIX_SQUAD``, ``L2SP``, ``ALL_QUERIES``, configs/recommended.yaml since, and
  ``ALL_QUERIES_TWO_EPOCHS``; ``DISTILL_KL`` and
  ``DISTILL_MARGIN_MSE`` distil the teacher that ``configs/recipe_teacher.yaml`` trains into
  ``<out>/runs/recipe-teacher``, which must exist first, and ``DENOISED`` drops the mined candidates it takes for
  unlabelled positives, ``DENOISED_BI`` those the starting MiniLM takes for them; ``PRETRAINED`` starts from the
  MiniLM that ``configs/pretrain_recipe.yaml`` continues on the corpus into ``<out>/runs/recipe-pretrain``: see
  ``MADE_FIRST``).

Every run is an ordinary ``densepass run`` directory under ``<out>/runs`` (resumable; a finished one is
skipped); ``--stage report`` first runs whatever evaluation of a finished model is missing (out of domain, e.g. the
ArguAna one added after the model was trained, and the parts of dev), never training again. Corpus encodings are
kept in ``<out>/cache`` (``cache_dir``, keyed by content): the zero-shot MiniLM's, which every row mines with, is made
once, and each model's full-corpus encoding serves its own evaluation and both parts of dev. The report
(<out>/report.md, report.json) gives each row's metrics, the paired tests, the
out-of-domain numbers and each row's cost: mining + training seconds as the run measured them; the README
row, the best row and the best model of all are also fused with BM25 (RRF and 2-fold cross-validated linear).

**Reranking** (neural-retrieval-lecture: cross-encoder re-ranking): the report writes the top 100 of BM25, of the
best model and of its linear fusion with BM25 to ``<out>/first-stages/{bm25,dense,pipeline}.trec``; a cross-encoder
(configs/recipe_reranker.yaml trains one) reranks them with ``densepass rerank ... --cache-dir <out>/cache --output
<out>/reranked/<stage>.trec`` (the stages share most candidates: each is scored once), and the next report adds,
for each reranked file, rows at depth 100 and 10: the cross-encoder's order alone, and fused with the first
stage's scores (``cv_linear_fusion``), each tested against the first stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import NamedTuple

from densepass.cli import run_guarded
from densepass.config import ExperimentConfig, from_dict, load_config
from densepass.data import load_dataset
from densepass.errors import ConfigError
from densepass.evaluation.fusion import linear_fusion, reciprocal_rank_fusion
from densepass.evaluation.metrics import Run, evaluate_run, paired_significance, read_trec_run, write_trec_run
from densepass.io import atomic_write_text
from densepass.pipelines.evalset import eval_qrels
from densepass.pipelines.experiment import run_experiment

README = "README recipe"
ST = "sentence-transformers recipe"
DENSE = "+ MiniLM dense negatives (mixed)"  # the last cumulative row: the training ingredients below change it
ROWS: dict[str, list[str]] = {
    README: [],
    "+ 3 hard negatives": ["negatives.per_query=3"],
    "+ context negatives (mixed with BM25)": ["negatives.source=mixed", "negatives.mix=[bm25, context]"],
    DENSE: ["negatives.mix=[bm25, context, model]", "negatives.model=all-MiniLM-L6-v2"],
}
# Changes to a row (--stage variant), each compared with that row in and out of domain: the training ingredients
# beyond the negatives (one change each to DENSE), the forgetting study's one-change runs, and the recommended
# recipe (configs/recommended.yaml until 2026-11-30): twice the queries, passages read at 256 tokens by mining and
# evaluation but cut to 128 in training batches, one epoch, the pool re-mined half-way with the model being
# trained, wise-ft 0.85 (and its earlier forms: two epochs at wise-ft 0.7, one epoch at wise-ft 0.85 without
# re-mining, and 96-token crops at wise-ft 0.75; and tries with five hard negatives per query instead of three, and
# two epochs at wise-ft 0.85).
CROPS_96 = "16,384 queries, 96-token crops of 256, wise-ft 0.75"
ONE_EPOCH = "recommended: 16,384 queries, 128-token crops of 256, wise-ft 0.85"  # recommended until 2026-11-26
FIVE_NEGATIVES = "recommended, 5 hard negatives per query"
TWO_EPOCHS = "recommended, 2 epochs"
TWO_EPOCHS_07 = "recommended: 2 epochs, wise-ft 0.7"  # recommended until 2026-11-27
RECOMMENDED = "recommended: 1 epoch, re-mined half-way, wise-ft 0.85"
# issue 55's levers, one change each to the recommended recipe: a forgetting guard that mixes general-domain pairs
# (the squad split's train questions, 3 of each batch of 32: its dev questions are then no longer zero-shot, ArguAna
# still is), one that pulls toward the starting weights (L2-SP), and all the training queries
MIX_SQUAD = "recommended + squad train questions, 3 of each batch of 32"
L2SP = "recommended + L2-SP, alpha 0.5"  # its pull a fifth of the loss gradient at the end (docs/experiments.md)
ALL_QUERIES = "recommended on all 47,732 train queries, re-mined every half epoch"  # configs/recommended.yaml
ALL_QUERIES_TWO_EPOCHS = "recommended on all 47,732 train queries, 2 epochs, re-mined every half epoch"
# distillation from the teacher configs/recipe_teacher.yaml trains (<out>/runs/recipe-teacher/reranker/model): its
# scores of each query's positives and pool candidates (and of each refreshed pool's new ones) as KL (listwise, plus
# the contrastive loss) or Margin-MSE targets
DISTILL_KL = "recommended + distilled from the teacher, listwise KL + contrastive"
DISTILL_MARGIN_MSE = "recommended + distilled from the teacher, Margin-MSE"
# denoising (NV-Retriever's relative margin, RocketQA's idea): mined candidates the teacher scores at 0.95 x the
# positive or above (its logits' exponents: within 0.05 of the positive's logit) are taken for unlabelled positives
# and dropped, in the first pool and at the re-mining
DENOISED = "recommended + negatives denoised by the teacher (relative margin 0.95)"
# the same rule with NV-Retriever's own kind of teacher, a bi-encoder: the starting MiniLM, which mines the pool's
# dense third (its cosine; fixed, so the re-mining is denoised by it too). It needs no teacher trained first.
DENOISED_BI = "recommended + negatives denoised by MiniLM (relative margin 0.95)"
# corpus-adapted pre-training: the recommended recipe from all-MiniLM-L6-v2 continued on the debian corpus with
# Contriever's crops (configs/pretrain_recipe.yaml); its wise-ft interpolates toward that start, it mines with MiniLM
PRETRAINED = "recommended from MiniLM pre-trained on the corpus (Contriever crops, 2,000 steps)"
# issue 55's levers: each one change to the recommended recipe, so each is tested against it (the report)
LEVERS = (
    MIX_SQUAD,
    L2SP,
    ALL_QUERIES,
    ALL_QUERIES_TWO_EPOCHS,
    DISTILL_KL,
    DISTILL_MARGIN_MSE,
    DENOISED,
    DENOISED_BI,
    PRETRAINED,
)


class MadeFirst(NamedTuple):
    """A model some variants need that another run makes first: the run's name under ``<out>/runs``, the model's
    folder inside it, and the command that makes it."""

    run: str
    folder: str
    command: str


# a placeholder value in VARIANTS ("=TEACHER") -> the model it stands for, resolved under --out
MADE_FIRST = {
    "TEACHER": MadeFirst("recipe-teacher", "reranker/model", "python3 -m densepass run configs/recipe_teacher.yaml"),
    "PRETRAINED": MadeFirst(
        "recipe-pretrain", "backbone", "python3 -m densepass pretrain configs/pretrain_recipe.yaml"
    ),
}
TEACHER_KEYS = [
    "reranker.enabled=true",
    "reranker.name_or_path=TEACHER",
    "reranker.train.enabled=false",
    "reranker.first_stages=[]",
]
LONGER = ["data.max_train_queries=16384", "model.passage_max_length=256"]  # the 16,384-query variants
CROPS_128 = [*LONGER, "train.passage_max_length=128"]  # the recommended recipe's data and crops, in every form
ONE_EPOCH_KEYS = [*CROPS_128, "train.wise_ft=0.85"]
VARIANTS: dict[str, list[str]] = {
    # the training ingredients, one change each to DENSE
    "re-mining every half epoch with the model being trained": ["negatives.refresh_every=HALF_EPOCH"],
    "ABS batches (greedy)": ["schedule.method=abs-greedy"],
    "best checkpoint on H_10 of held-out train queries": [
        "validation.enabled=true",
        "validation.split=train",
        "validation.max_queries=500",
        "validation.subcorpus=hard",
        "validation.k=10",
        "validation.every_steps=HALF_EPOCH",
        "validation.select=true",
    ],
    "MoCo queue K=4096": ["loss.memory=moco", "loss.queue_size=4096"],
    "pre-batch negatives T=4": ["loss.memory=pre-batch", "loss.pre_batches=4"],
    "batch 128 (GradCache)": ["train.batch_size=128", "train.grad_cache_chunk=32"],
    "2 epochs": ["train.epochs=2"],
    # the forgetting study and the recommended recipe
    "freeze embeddings + 3 layers": ["train.freeze_layers=3"],
    "lr 2e-5": ["train.learning_rate=2e-5"],
    "half the steps": ["train.max_steps=HALF_EPOCH"],
    CROPS_96: [*LONGER, "train.passage_max_length=96", "train.wise_ft=0.75"],
    ONE_EPOCH: ONE_EPOCH_KEYS,
    FIVE_NEGATIVES: [*ONE_EPOCH_KEYS, "negatives.per_query=5"],
    TWO_EPOCHS: [*ONE_EPOCH_KEYS, "train.epochs=2"],
    TWO_EPOCHS_07: [*CROPS_128, "train.epochs=2", "train.wise_ft=0.7"],
    RECOMMENDED: [*ONE_EPOCH_KEYS, "negatives.refresh_every=HALF_EPOCH"],
    MIX_SQUAD: [
        *ONE_EPOCH_KEYS,
        "negatives.refresh_every=HALF_EPOCH",
        "data.mix=[{name: squad-v1.1-dev-split, format: squad, split: train, fraction: 0.1}]",
    ],
    L2SP: [*ONE_EPOCH_KEYS, "negatives.refresh_every=HALF_EPOCH", "train.l2sp=0.5"],
    # started before HALF_EPOCH rounded up (745 is in its run's identity); after step 1,490 no batch is left to draw
    # from a new pool, so it re-mines once
    ALL_QUERIES: [*ONE_EPOCH_KEYS, "data.max_train_queries=47732", "negatives.refresh_every=745"],
    ALL_QUERIES_TWO_EPOCHS: [
        *ONE_EPOCH_KEYS,
        "data.max_train_queries=47732",
        "train.epochs=2",
        "negatives.refresh_every=HALF_EPOCH",
    ],
    DISTILL_KL: [
        *ONE_EPOCH_KEYS,
        "negatives.refresh_every=HALF_EPOCH",
        *TEACHER_KEYS,
        "reranker.distill.loss=kl",
        "reranker.distill.contrastive=true",
    ],
    DISTILL_MARGIN_MSE: [
        *ONE_EPOCH_KEYS,
        "negatives.refresh_every=HALF_EPOCH",
        *TEACHER_KEYS,
        "reranker.distill.loss=margin-mse",
    ],
    DENOISED: [
        *ONE_EPOCH_KEYS,
        "negatives.refresh_every=HALF_EPOCH",
        "negatives.filters=[qrels, answers, relative-margin]",
        "negatives.cross_encoder=TEACHER",
        "negatives.filter_precision=auto",
        "negatives.relative_activation=exp",  # the teacher trains listwise: its logits' offset means nothing
    ],
    DENOISED_BI: [
        *ONE_EPOCH_KEYS,
        "negatives.refresh_every=HALF_EPOCH",
        "negatives.filters=[qrels, answers, relative-margin]",
        "negatives.relative_teacher=bi-encoder",  # negatives.model: the starting MiniLM
    ],
    PRETRAINED: [*ONE_EPOCH_KEYS, "negatives.refresh_every=HALF_EPOCH", "model.name_or_path=PRETRAINED"],
}
IN_DOMAIN = ["mrr@10", "ndcg@10", "recall@100"]
RERANK_DEPTH = 100  # candidates of the best model (alone, + BM25) that the cross-encoder re-scores
OUT_OF_DOMAIN = ["ndcg@10", "accuracy@1", "accuracy@5", "accuracy@20"]
ARGUANA = ["ndcg@10", "recall@100"]  # the second out-of-domain set (configs/recipe_ood_arguana.yaml)
BASELINES = "baselines"  # --eval-part report: BM25 and the zero-shot MiniLM on each part (<out>/parts/<part>/baselines)


def slug(name: str) -> str:
    """A run directory name for a row."""
    text = "".join(c if c.isascii() and c.isalnum() else "-" for c in name.lower())
    while "--" in text:
        text = text.replace("--", "-")
    return text.strip("-")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/recipe")
    parser.add_argument("--config", default="configs/recipe.yaml")
    parser.add_argument("--ood-config", default="configs/recipe_ood.yaml")
    parser.add_argument("--stage", choices=["all", "train", "st", "wise-ft", "variant", "report"], default="all")
    parser.add_argument("--only", nargs="*", default=None, choices=list(ROWS), metavar="ROW")
    parser.add_argument("--train-queries", type=int, default=8192, help="training queries of every row")
    parser.add_argument("--eval-queries", type=int, default=2000, help="dev queries (seeded sample), full corpus")
    parser.add_argument("--wise-ft-row", default=README, choices=list(ROWS), metavar="ROW")
    parser.add_argument(
        "--wise-ft-variant",
        default=None,
        choices=list(VARIANTS),
        metavar="VARIANT",
        help="--stage wise-ft: interpolate this variant of --variant-row (its fine-tuned weights) instead of a row",
    )
    parser.add_argument("--alphas", nargs="*", type=float, default=[0.5])
    parser.add_argument("--variant-row", default=README, choices=list(ROWS), metavar="ROW")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--set", action="append", default=[], help="extra config overrides for every row")
    parser.add_argument("--ood-set", action="append", default=[], help="overrides of the out-of-domain config")
    parser.add_argument("--arguana-config", default="configs/recipe_ood_arguana.yaml")
    parser.add_argument("--arguana-set", action="append", default=[], help="overrides of the ArguAna config")
    parser.add_argument(
        "--eval-part",
        choices=["all", "report"],
        default="all",
        help="report: every model is also evaluated on the tuning and the reporting part of the dev queries "
        "(data.eval_part); the choices (best row, wise-ft α, fusion weights) are made on the tuning part and "
        "every number and test of the report is on the reporting part",
    )
    parser.add_argument("--eval-part-seed", type=int, default=13, help="seed of the split into the two parts")
    parser.add_argument("--eval-part-fraction", type=float, default=0.5, help="share of the tuning part")
    args = parser.parse_args()
    for name, value in (("--train-queries", args.train_queries), ("--eval-queries", args.eval_queries)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    if any(not 0 < a <= 1 for a in args.alphas):
        parser.error(f"--alphas must lie in (0, 1], got {args.alphas}")
    if not 0 < args.eval_part_fraction < 1:
        parser.error(f"--eval-part-fraction must lie strictly between 0 and 1, got {args.eval_part_fraction}")
    if args.wise_ft_variant is not None and args.eval_part != "report":
        parser.error(
            "--wise-ft-variant's points are evaluated as the variant is, on the parts of dev: add --eval-part report"
        )
    if args.eval_part == "all" and (args.eval_part_seed != 13 or args.eval_part_fraction != 0.5):
        parser.error("--eval-part-seed and --eval-part-fraction shape the parts of --eval-part report")
    return args


def common_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"output_dir={Path(args.out) / 'runs'}",
        f"cache_dir={Path(args.out) / 'cache'}",  # MiniLM's and each model's corpus encodings, made once
        f"data.max_train_queries={args.train_queries}",
        f"data.max_eval_queries={args.eval_queries}",
        *([f"data.data_dir={args.data_dir}"] if args.data_dir else []),
    ]


def variant_name(row: str, variant: str) -> str:
    return f"{row}, {variant}"


def base_config(args: argparse.Namespace, name: str) -> ExperimentConfig:
    """The config of the run that trained model ``name``: a row, or a variant of one (``variant_name``)."""
    if name in ROWS:
        return row_config(args, name)
    for row in ROWS:
        for variant in VARIANTS:
            if variant_name(row, variant) == name:
                return row_config(args, row, variant)
    raise ConfigError(f"{name!r} is neither a row nor a variant of the study")


def tested_against(row: str, variant: str) -> str:
    """The model a variant is tested against: issue 55's levers, the recommended recipe each changes once; any other
    variant, its row."""
    return variant_name(row, RECOMMENDED) if variant in LEVERS else row


def row_config(args: argparse.Namespace, name: str, variant: str | None = None) -> ExperimentConfig:
    """A row's config: the shared recipe, every ingredient up to and including the row's, then ``variant``'s
    change (its own run), then the overrides."""
    ingredients = []
    for row, keys in ROWS.items():
        ingredients += keys
        if row == name:
            break
    first = ["eval.baselines=[bm25, zero-shot]"] if name == README and variant is None else []
    run = slug(variant_name(name, variant) if variant else name)
    changes = VARIANTS[variant] if variant else []
    overrides = [f"name={run}", *common_overrides(args), *ingredients, *changes, *first, *args.set]
    shape = load_config(
        args.config, [key.split("=")[0] + "=1" if key.endswith("=HALF_EPOCH") else key for key in overrides]
    )
    # re-mining every half epoch: rounded up, so that no refresh falls on an epoch's last steps (two epochs of 1,491
    # steps re-mine at 746, 1,492 and 2,238, where 745 would also re-mine the whole corpus at 2,980 for the last step)
    half_epoch = str(max(1, -(-(shape.data.max_train_queries // shape.train.batch_size) // 2)))
    resolved = [key.replace("HALF_EPOCH", half_epoch) for key in overrides]
    for placeholder in MADE_FIRST:
        model = str(made_first(args, placeholder))
        resolved = [key.replace(f"={placeholder}", f"={model}") for key in resolved]
    return load_config(args.config, resolved)


def made_first(args: argparse.Namespace, placeholder: str) -> Path:
    """Where the model that ``MADE_FIRST[placeholder]`` names is (or will be) under ``--out``."""
    made = MADE_FIRST[placeholder]
    return Path(args.out) / "runs" / made.run / made.folder


def evaluation_config(args: argparse.Namespace, name: str, model_path: Path) -> ExperimentConfig:
    """A saved model evaluated in domain with a row's settings and no training (its result: "zero-shot")."""
    return load_config(
        args.config,
        [
            f"name={slug(name)}",
            *common_overrides(args),
            f"model.name_or_path={model_path}",
            "train.enabled=false",
            "negatives.source=none",
            "eval.baselines=[zero-shot]",
            *args.set,
        ],
    )


class ZeroShot(NamedTuple):
    """An out-of-domain collection every model is evaluated on zero-shot: the arguments that name its config file
    and its overrides, and the folder under ``--out`` that holds its runs (where the report reads them)."""

    config: str
    overrides: str
    folder: str


ZERO_SHOT = {
    "squad": ZeroShot("ood_config", "ood_set", "ood"),  # --ood-config, --ood-set
    "arguana": ZeroShot("arguana_config", "arguana_set", "ood-arguana"),  # --arguana-config, --arguana-set
}


def zero_shot_config(args: argparse.Namespace, which: str, name: str, model_path: str) -> ExperimentConfig:
    """A saved model (or MiniLM) evaluated zero-shot on the ``ZERO_SHOT`` collection ``which``: the squad split, or
    ArguAna (its config drops each query's own argument from its hits)."""
    collection = ZERO_SHOT[which]
    return load_config(
        getattr(args, collection.config),
        [
            f"name={slug(name)}",
            f"output_dir={Path(args.out) / collection.folder}",
            f"cache_dir={Path(args.out) / 'cache'}",
            f"model.name_or_path={model_path}",
            *([f"data.data_dir={args.data_dir}"] if args.data_dir else []),
            *getattr(args, collection.overrides),
        ],
    )


def part_config(args: argparse.Namespace, trained: ExperimentConfig, name: str, model_path: str, part: str):
    """A saved model evaluated in domain on one part (``tune`` or ``report``) of the dev queries, read as the run
    that trained it reads (``trained``: its model settings, the passage length among them), no training; the
    starting model of the README row, with BM25 beside it, under the name ``BASELINES``."""
    values = dataclasses.asdict(trained)
    values.update(name=slug(name), output_dir=str(Path(args.out) / "parts" / part))
    values["model"]["name_or_path"] = model_path
    values["train"].update(enabled=False, wise_ft=None)
    values["negatives"]["source"] = "none"
    values["data"]["mix"] = []  # training batches only
    values["reranker"].update(enabled=False, first_stages=[])  # the teacher of a distilled model: not reranking
    values["reranker"]["distill"]["loss"] = "none"
    values["eval"]["baselines"] = ["bm25", "zero-shot"] if name == BASELINES else ["zero-shot"]
    values["data"].update(
        eval_part=part, eval_part_seed=args.eval_part_seed, eval_part_fraction=args.eval_part_fraction
    )
    return from_dict(ExperimentConfig, values)


def run_once(config: ExperimentConfig) -> None:
    """``run_experiment`` unless the run directory already holds its metrics."""
    if (config.run_dir / "metrics.json").is_file():
        print(f"done: {config.run_dir}", flush=True)
        return
    run_experiment(config)


def evaluate_out_of_domain(args: argparse.Namespace, name: str, model_path: str) -> None:
    """The model zero-shot on the squad split and on ArguAna (each run once)."""
    for which in ZERO_SHOT:
        run_once(zero_shot_config(args, which, name, model_path))


def evaluate_parts(args: argparse.Namespace, trained: ExperimentConfig, name: str, model_path: str) -> None:
    """With ``--eval-part report``: the model on the tuning and on the reporting part of the dev queries."""
    if args.eval_part == "report":
        for part in ("tune", "report"):
            run_once(part_config(args, trained, name, model_path, part))


def evaluate_model(args: argparse.Namespace, trained: ExperimentConfig, name: str, model_path: Path | str) -> None:
    """Everything the report reads of a saved model besides its training run: out of domain, and the parts of the
    dev queries; each evaluation that is already on disk is not run again."""
    evaluate_out_of_domain(args, name, str(model_path))
    evaluate_parts(args, trained, name, str(model_path))


def run_variants(args: argparse.Namespace) -> None:
    """``--variants`` of ``--variant-row``, each trained and evaluated like a row; a variant that needs a model made
    first (``MADE_FIRST``: the teacher, the pre-trained MiniLM) before it is made is a one-line error before any of
    them runs."""
    configs = {variant: row_config(args, args.variant_row, variant) for variant in args.variants}
    for variant in args.variants:
        for placeholder, made in MADE_FIRST.items():
            model = made_first(args, placeholder)
            needed = any(key.endswith(f"={placeholder}") for key in VARIANTS[variant])
            if needed and not (model / "config.json").is_file():
                raise ConfigError(
                    f"{variant!r} needs the {placeholder.lower()} model in {model}: make it first ({made.command} "
                    f"--set output_dir={Path(args.out) / 'runs'})"
                )
    for variant in args.variants:
        config = configs[variant]
        print(f"== {variant_name(args.variant_row, variant)}: {' '.join(VARIANTS[variant])}", flush=True)
        run_once(config)
        evaluate_model(args, config, variant_name(args.variant_row, variant), config.run_dir / "model")


def evaluate_start(args: argparse.Namespace) -> None:
    """The zero-shot MiniLM out of domain, and (``--eval-part report``) BM25 and it on each part of the dev queries."""
    readme = row_config(args, README)
    evaluate_out_of_domain(args, "zero-shot MiniLM", readme.model.name_or_path)
    evaluate_parts(args, readme, BASELINES, readme.model.name_or_path)


def run_rows(args: argparse.Namespace) -> None:
    evaluate_start(args)
    for name in args.only or ROWS:
        config = row_config(args, name)
        print(f"== {name}: {' '.join(ROWS[name]) or 'configs/recipe.yaml'}", flush=True)
        run_once(config)
        evaluate_model(args, config, name, config.run_dir / "model")


def train_sentence_transformers(args: argparse.Namespace) -> None:
    """sentence-transformers' recipe on the README row's queries and budget, saved to <out>/st-model, then
    evaluated like a row."""
    try:
        from datasets import Dataset
        from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
        from sentence_transformers.losses import MultipleNegativesRankingLoss
        from sentence_transformers.training_args import BatchSamplers, SentenceTransformerTrainingArguments
    except ImportError as err:
        extras = f"sentence-transformers' training extras ({err})"
        raise ConfigError(f"--stage st needs {extras}: run it with venv-bench") from err

    from densepass.models.biencoder import resolve_model_path

    config = row_config(args, README)
    model_dir = Path(args.out) / "st-model"
    timings_path = Path(args.out) / "st-timings.json"  # written last: the recipe's model is complete
    if not timings_path.is_file():
        data, train = config.data, config.train
        dataset = load_dataset(data.name, data.data_dir, data.format)
        query_ids = sorted(dataset.sample(data.train_split, data.max_train_queries, data.seed))
        positives = dataset.positives(data.train_split)
        model = SentenceTransformer(resolve_model_path(config.model.name_or_path), device="cpu")
        model.max_seq_length = config.model.passage_max_length
        texts = dataset.corpus.passage_inputs(model.tokenizer.sep_token)
        pairs = Dataset.from_dict(
            {
                "query": [dataset.queries[q] for q in query_ids],
                "positive": [texts[dataset.corpus.position(positives[q][0])] for q in query_ids],
            }
        )
        started = time.perf_counter()
        triplets = mine_hard_negatives_st(pairs, model, texts, config.negatives.per_query, config.eval.batch_size)
        mining_s = time.perf_counter() - started
        steps = len(query_ids) // train.batch_size * train.epochs
        training_args = SentenceTransformerTrainingArguments(
            output_dir=str(Path(args.out) / "st-checkpoints"),
            per_device_train_batch_size=train.batch_size,
            num_train_epochs=train.epochs,
            learning_rate=train.learning_rate,
            warmup_ratio=train.warmup_ratio,
            weight_decay=train.weight_decay,
            batch_sampler=BatchSamplers.NO_DUPLICATES,
            use_cpu=True,
            bf16=False,
            save_strategy="no",
            report_to="none",
            logging_steps=max(1, steps // 16),
            seed=train.seed,
            dataloader_drop_last=True,
        )
        trainer = SentenceTransformerTrainer(
            model=model,
            args=training_args,
            train_dataset=triplets,
            loss=MultipleNegativesRankingLoss(model, scale=1 / config.model.temperature),
        )
        started = time.perf_counter()
        trainer.train()
        training_s = time.perf_counter() - started
        model.save(str(model_dir))
        atomic_write_text(
            timings_path,
            json.dumps({"mining_s": mining_s, "train_s": training_s, "steps": trainer.state.global_step}, indent=2),
        )
    run_once(evaluation_config(args, ST, model_dir))
    evaluate_model(args, config, ST, model_dir)


def mine_hard_negatives_st(pairs, model, corpus: list[str], per_query: int, batch_size: int):
    """sentence-transformers' ``mine_hard_negatives`` with the settings of its published hard-negative datasets
    (e.g. natural-questions-hard-negatives): skip the top 10, sample at random among ranks 10-50 below the
    positive's score."""
    from sentence_transformers.util import mine_hard_negatives

    return mine_hard_negatives(
        pairs,
        model,
        corpus=corpus,
        range_min=10,
        range_max=50,
        absolute_margin=0.0,
        num_negatives=per_query,
        sampling_strategy="random",
        batch_size=batch_size,
        output_format="triplet" if per_query == 1 else "n-tuple",
        verbose=False,
    )


WISE_FT_MARK = "wise-ft.json"


def wise_ft_runs(out: Path) -> list[tuple[str, float]]:
    """The (row or variant, alpha) of every wise-ft model under <out>/wise-ft, ordered by rows, then variants, then
    alpha."""
    found = [json.loads(p.read_text()) for p in (out / "wise-ft").glob(f"*/{WISE_FT_MARK}")]
    order = [*ROWS, *(variant_name(row, variant) for row in ROWS for variant in VARIANTS)]
    return sorted(((f["row"], f["alpha"]) for f in found if f["row"] in order), key=lambda r: (order.index(r[0]), r[1]))


def wise_ft_name(row: str, alpha: float) -> str:
    return f"{row}, wise-ft α={alpha:g}"


def wise_ft_source(args: argparse.Namespace) -> tuple[str, ExperimentConfig, Path]:
    """What ``--stage wise-ft`` interpolates: its name, the config of the run that trained it, and its fine-tuned
    weights (a variant that saved a wise-ft model of its own: the weights before it, ``model-fine-tuned/``)."""
    if args.wise_ft_variant is None:
        config = row_config(args, args.wise_ft_row)
        return args.wise_ft_row, config, config.run_dir / "model"
    config = row_config(args, args.variant_row, args.wise_ft_variant)
    tuned = "model-fine-tuned" if config.train.wise_ft is not None else "model"
    return variant_name(args.variant_row, args.wise_ft_variant), config, config.run_dir / tuned


def run_wise_ft(args: argparse.Namespace) -> None:
    """Interpolations of ``--wise-ft-row``'s model (or ``--wise-ft-variant``'s) with the weights it started from,
    evaluated like rows."""
    from densepass.models.biencoder import BiEncoder
    from densepass.models.interpolate import interpolate_weights, snapshot

    base, config, tuned = wise_ft_source(args)
    if not (config.run_dir / "metrics.json").is_file() or not tuned.is_dir():
        stage = "--stage train --only" if args.wise_ft_variant is None else "--stage variant --variants"
        kind = "row" if args.wise_ft_variant is None else "variant"
        raise ConfigError(f"{kind} {base!r} has no model yet: run {stage} it first")
    start = snapshot(BiEncoder.from_pretrained(config.model.name_or_path))
    for alpha in args.alphas:
        name = wise_ft_name(base, alpha)
        model_dir = Path(args.out) / "wise-ft" / slug(name)
        if not (model_dir / "densepass.json").is_file():
            model = BiEncoder.from_pretrained(str(tuned))
            interpolate_weights(model, start, alpha).save(model_dir)
        if not (model_dir / WISE_FT_MARK).is_file():  # what the report reads back
            atomic_write_text(model_dir / WISE_FT_MARK, json.dumps({"row": base, "alpha": alpha}))
        evaluate_model(args, config, name, model_dir)
        if args.eval_part != "report":  # (a row's) the report's numbers: the parts' (evaluate_model), else these
            run_once(evaluation_config(args, name, model_dir))


def load_result(run_dir: Path, system: str) -> tuple[dict, dict] | None:
    """(metrics of ``system``, the run's timings) from a finished run directory, or None."""
    path = run_dir / "metrics.json"
    if not path.is_file():
        return None
    stored = json.loads(path.read_text())
    return stored["results"][system], stored["timings"]


def models_on_disk(args: argparse.Namespace) -> list[tuple[str, ExperimentConfig, Path]]:
    """(name, the config of the run that trained it, its directory) of every finished model of the study: the rows
    and variants whose run wrote its metrics, sentence-transformers' recipe, the wise-ft interpolations."""
    out = Path(args.out)
    found = []
    for row in ROWS:
        configs = [(row, row_config(args, row))]
        configs += [(variant_name(row, variant), row_config(args, row, variant)) for variant in VARIANTS]
        found += [(name, c, c.run_dir / "model") for name, c in configs if (c.run_dir / "metrics.json").is_file()]
    if (out / "st-timings.json").is_file():
        found.append((ST, row_config(args, README), out / "st-model"))
    for base, alpha in wise_ft_runs(out):
        name = wise_ft_name(base, alpha)
        found.append((name, base_config(args, base), out / "wise-ft" / slug(name)))
    return found


def part_dir(args: argparse.Namespace, name: str, part: str) -> Path:
    """Where ``part_config`` evaluates model ``name`` on ``part``."""
    return Path(args.out) / "parts" / part / slug(name)


def report(args: argparse.Namespace) -> None:
    """The report of every finished model on disk; evaluations it needs that are missing (out of domain; with
    ``--eval-part report``, on each part of the dev queries) are run first, none is trained again."""
    out = Path(args.out)
    models = models_on_disk(args)
    if models:
        evaluate_start(args)
    for name, trained, model_dir in models:
        evaluate_model(args, trained, name, model_dir)
    honest = args.eval_part == "report"
    rows: dict[str, dict] = {}  # name -> {"in": metrics, "ood", "arguana", "tune"?, "cost_s", "steps", "trec"}

    def zero_shot(name: str, where: str) -> dict | None:
        found = load_result(out / where / slug(name), "zero-shot")
        return found[0] if found else None

    def add(name: str, run_dir: Path, system: str, cost_s: float | None, steps: int | None = None) -> None:
        source = (part_dir(args, name, "report"), "zero-shot") if honest else (run_dir, system)
        found = load_result(*source)
        if found is None:
            return
        rows[name] = {
            "in": found[0],
            "ood": zero_shot(name, ZERO_SHOT["squad"].folder),
            "arguana": zero_shot(name, ZERO_SHOT["arguana"].folder),
            "cost_s": cost_s,
            "steps": steps,
            "trec": str(source[0] / "runs" / f"{source[1]}.trec"),
        }
        if honest:
            tuned = load_result(part_dir(args, name, "tune"), "zero-shot")
            rows[name]["tune"] = tuned[0] if tuned else None

    readme = row_config(args, README)
    start = readme.model.name_or_path
    baseline_dir = part_dir(args, BASELINES, "report") if honest else readme.run_dir
    baselines = load_result(baseline_dir, "BM25"), load_result(baseline_dir, "zero-shot")
    if honest:  # their MRR@10 on the tuning part, beside the models'
        for found, system in zip(baselines, ("BM25", "zero-shot")):
            tuned = load_result(part_dir(args, BASELINES, "tune"), system)
            if found is not None and tuned is not None:
                found[0]["tune mrr@10"] = tuned[0]["mrr@10"]
    baseline_ood = tuple(zero_shot("zero-shot MiniLM", ZERO_SHOT[which].folder) for which in ("squad", "arguana"))

    def add_trained(name: str, config: ExperimentConfig) -> bool:
        """A finished training run as a row, costed by its mining + training seconds."""
        found = load_result(config.run_dir, "fine-tuned")
        if found is not None:
            cost = found[1].get("train_s", 0) + found[1].get("mining_s", 0)
            add(name, config.run_dir, "fine-tuned", cost, steps_of(config))
        return found is not None

    saved_alpha = {}  # a model's own wise-ft α
    for name in ROWS:
        config = row_config(args, name)
        add_trained(name, config)
        saved_alpha[name] = config.train.wise_ft or 1.0
    variants = {}  # a variant's name -> its row
    against = {}  # a variant's name -> what it is tested against: the recommended recipe (a lever), else its row
    for row in ROWS:
        for variant in VARIANTS:
            name = variant_name(row, variant)
            config = row_config(args, row, variant)
            if add_trained(name, config):
                variants[name], against[name] = row, tested_against(row, variant)
                saved_alpha[name] = config.train.wise_ft or 1.0
    st_timings = out / "st-timings.json"
    if st_timings.is_file():
        stored = json.loads(st_timings.read_text())
        cost = stored["mining_s"] + stored["train_s"]
        add(ST, evaluation_config(args, ST, out).run_dir, "zero-shot", cost, stored["steps"])
    alphas = {wise_ft_name(row, alpha): (row, alpha) for row, alpha in wise_ft_runs(out)}
    wise_ft = {name: row for name, (row, _) in alphas.items()}
    for name in wise_ft:
        add(name, evaluation_config(args, name, out).run_dir, "zero-shot", None)
    dataset = load_dataset(readme.data.name, readme.data.data_dir, readme.data.format)
    part = None
    if honest:
        qrels, part = eval_qrels(dataset, part_config(args, readme, BASELINES, start, "report").data)
        tune_qrels = eval_qrels(dataset, part_config(args, readme, BASELINES, start, "tune").data)[0]
    else:
        qrels = dataset.sample(readme.data.eval_split, readme.data.max_eval_queries, readme.data.seed)
    runs = {name: read_trec_run(row["trec"]) for name, row in rows.items()}
    tests = {}

    def chooser(name: str) -> float:
        """What every choice maximises: MRR@10 on the tuning part (--eval-part report), else on the dev queries."""
        if not honest:
            return rows[name]["in"]["mrr@10"]
        return rows[name]["tune"]["mrr@10"] if rows[name].get("tune") else float("-inf")

    def tuning_runs(name: str) -> Run | None:
        path = part_dir(args, name, "tune") / "runs" / ("bm25.trec" if name == BASELINES else "zero-shot.trec")
        return read_trec_run(path) if honest and path.is_file() else None

    def add_run(name: str, against: str, run: Run) -> None:
        """A row that is a run built here (fused or reranked), tested against the row it came from."""
        rows[name] = {"in": evaluate_run(qrels, run, IN_DOMAIN), "ood": None, "cost_s": None, "steps": None}
        runs[name] = run
        tests[name] = {"against": against, **_test(qrels, runs, against, name)}

    order = [n for n in ROWS if n in rows]
    best = max(order, key=chooser) if order else None
    for above, name in zip(order, order[1:]):
        tests[name] = {"against": above, **_test(qrels, runs, above, name)}
    if ST in rows and README in rows:
        best_variants = [name for name, row in {**variants, **wise_ft}.items() if row == best and name in rows]
        for rival in dict.fromkeys([README, best, *best_variants]):
            tests[f"{rival} vs {ST}"] = {"against": ST, **_test(qrels, runs, ST, rival)}
    for name, row in {**variants, **wise_ft}.items():
        target = against.get(name, row)
        if target not in rows:  # a lever whose recommended run is not on disk: against its row
            target = row
        if name in rows and target in rows:
            tests[name] = {"against": target, **_test(qrels, runs, target, name)}
    choices = {}  # --eval-part report: each row's (and variant's) wise-ft α, chosen on the tuning part
    for row in [*order, *(v for v in variants if v in rows)] if honest else ():
        points = {name: alpha for name, (of, alpha) in alphas.items() if of == row and name in rows}
        points = {row: saved_alpha[row], **points}
        if len(points) > 1:
            chosen = max(points, key=chooser)
            choices[f"wise-ft α of {row}"] = {"chosen": chosen, "alpha": points[chosen], "tune mrr@10": chooser(chosen)}
    best_model = max((n for n in rows if n != ST), key=chooser, default=None)
    bm25_path = baseline_dir / "runs" / "bm25.trec"
    first_stages = {}  # what a cross-encoder reranks: BM25, the best model alone and fused with BM25 (linear)
    if bm25_path.is_file():
        runs["BM25"] = read_trec_run(bm25_path)
        first_stages["bm25"] = "BM25"
    tune_bm25 = tuning_runs(BASELINES)
    bases = [base for base in dict.fromkeys([README, best, best_model]) if base in runs]  # those on disk
    for base in bases if bm25_path.is_file() else []:
        tune_base = tuning_runs(base)
        tuning = (tune_qrels, tune_base, tune_bm25) if tune_base is not None and tune_bm25 is not None else None
        for label, run in hybrid_runs(qrels, runs[base], runs["BM25"], readme.data.seed, tuning).items():
            name = f"{base} + BM25 ({label})"
            add_run(name, base, run)
            if base == best_model and label != "RRF":
                first_stages.update(dense=base, pipeline=name)
    for stage, base in first_stages.items():
        write_trec_run(top(runs[base], RERANK_DEPTH), out / "first-stages" / f"{stage}.trec")
        reranked = out / "reranked" / f"{stage}.trec"  # `densepass rerank` of that file (docs/experiments.md)
        for depth in (RERANK_DEPTH, 10) if reranked.is_file() else ():
            alone, fused, weights = reranked_runs(qrels, runs[base], read_trec_run(reranked), depth, readme.data.seed)
            add_run(f"{base} → cross-encoder@{depth}", base, alone)
            add_run(
                f"{base} → cross-encoder@{depth}, fused with its first stage (weight {weights} by 2-fold CV)",
                base,
                fused,
            )
    text = render(args, readme.train.batch_size, rows, tests, baselines, baseline_ood, choices, part)
    atomic_write_text(out / "report.md", text)
    summary = {"rows": rows, "tests": tests, **({"eval_part": part, "choices": choices} if honest else {})}
    atomic_write_text(out / "report.json", json.dumps(summary, indent=2))
    print(text)


def steps_of(config: ExperimentConfig) -> int:
    """The training steps a finished run logged."""
    log = (config.run_dir / "train_log.jsonl").read_text().splitlines()
    return json.loads(log[-1])["step"]


def hybrid_runs(
    qrels: dict, dense: Run, bm25: Run, seed: int, tuning: tuple[dict, Run, Run] | None = None
) -> dict[str, Run]:
    """The dense run fused with BM25's: RRF (k = 60), and ``cv_linear_fusion`` (its weight chosen on the
    ``tuning`` part's qrels and runs when given)."""
    linear, weights = cv_linear_fusion(qrels, dense, bm25, seed, tuning)
    how = "chosen on the tuning part" if tuning else "by 2-fold CV"
    return {"RRF": reciprocal_rank_fusion([dense, bm25]), f"linear, dense weight {weights} {how}": linear}


def fused_mrr(qrels: dict, a: Run, b: Run, weight: float) -> float:
    """MRR@10 on ``qrels`` of the linear fusion of ``a`` (weight ``weight``) and ``b``."""
    fused = linear_fusion([_subset(a, list(qrels)), _subset(b, list(qrels))], [weight, 1 - weight])
    return evaluate_run(qrels, fused, ["mrr@10"])["mrr@10"]


def best_weight(qrels: dict, a: Run, b: Run) -> float:
    """The weight of ``a`` (grid 0.05 ... 0.95) whose linear fusion with ``b`` has the best MRR@10 on ``qrels``."""
    return max((i / 20 for i in range(1, 20)), key=lambda weight: fused_mrr(qrels, a, b, weight))


def cv_linear_fusion(
    qrels: dict, a: Run, b: Run, seed: int, tuning: tuple[dict, Run, Run] | None = None
) -> tuple[Run, str]:
    """A linear fusion of min-max normalised scores whose weight of ``a`` is tuned by two-fold
    cross-validation (chosen on one half of the queries for the other half, grid 0.05 ... 0.95 on MRR@10), so
    that no query is scored with a weight tuned on it; and the two weights chosen ("0.65 / 0.60"). Given a
    ``tuning`` part (its qrels and its runs of ``a`` and ``b``: other queries), the weight is chosen there once
    and applied to every query of ``qrels`` ("0.65")."""
    if tuning is not None:
        weight = best_weight(*tuning)
        return linear_fusion(
            [_subset(a, sorted(qrels)), _subset(b, sorted(qrels))], [weight, 1 - weight]
        ), f"{weight:.2f}"
    queries = sorted(qrels)
    random.Random(seed).shuffle(queries)
    folds = [queries[::2], queries[1::2]]
    linear: Run = {}
    weights = []
    for held_out, tuning_queries in (folds, folds[::-1]):
        weight = best_weight({q: qrels[q] for q in tuning_queries}, a, b)
        weights.append(f"{weight:.2f}")
        linear.update(linear_fusion([_subset(a, held_out), _subset(b, held_out)], [weight, 1 - weight]))
    return linear, " / ".join(weights)


def reranked_runs(
    qrels: dict, first: Run, scores: Run, depth: int, seed: int, tuning: tuple[dict, Run, Run] | None = None
) -> tuple[Run, Run, str]:
    """The first stage's top ``depth`` ordered by the cross-encoder's ``scores`` (of its top RERANK_DEPTH), and
    ordered by their linear fusion with the first stage's scores (``cv_linear_fusion``, over the top ``depth``),
    each followed by the rest of the first stage's top RERANK_DEPTH in its order; and the fusion's weights.
    ``tuning``: other queries' qrels, first stage and cross-encoder scores, where the fusion's weight is chosen
    once for every query here (else 2-fold cross-validation on these)."""
    head, alone = reranked_heads(first, scores, depth)
    tuned = None
    if tuning is not None:
        tuning_qrels, tuning_first, tuning_scores = tuning
        tuning_head, tuning_alone = reranked_heads(tuning_first, tuning_scores, depth)
        tuned = (tuning_qrels, tuning_alone, tuning_head)
    fused, weights = cv_linear_fusion(qrels, alone, head, seed, tuned)
    ranked = {q: sorted(first[q], key=lambda p: -first[q][p])[:RERANK_DEPTH] for q in first}

    def then_the_rest(run: Run) -> Run:
        out = {}
        for q, pids in ranked.items():
            floor = min(run[q].values(), default=0.0)
            out[q] = {**run[q], **{p: floor - 1.0 - i for i, p in enumerate(pids[depth:])}}
        return out

    return then_the_rest(alone), then_the_rest({q: fused.get(q, {}) for q in ranked}), weights


def reranked_heads(first: Run, scores: Run, depth: int) -> tuple[Run, Run]:
    """The first stage's top ``depth`` of each query with its scores, and with the cross-encoder's ``scores``."""
    ranked = {q: sorted(first[q], key=lambda p: -first[q][p])[:depth] for q in first}
    head = {q: {p: first[q][p] for p in pids} for q, pids in ranked.items()}
    missing = next(((q, p) for q, pids in head.items() for p in pids if p not in scores.get(q, {})), None)
    if missing:
        raise ConfigError(f"the reranked run has no score for {missing[1]!r} of query {missing[0]!r} (its top {depth})")
    return head, {q: {p: scores[q][p] for p in pids} for q, pids in head.items()}


def top(run: Run, k: int) -> Run:
    """Each query's ``k`` best passages."""
    return {q: dict(sorted(ranked.items(), key=lambda item: -item[1])[:k]) for q, ranked in run.items()}


def _subset(run: Run, queries: list[str]) -> Run:
    return {q: run[q] for q in queries if q in run}


def _test(qrels, runs, baseline: str, name: str) -> dict:
    return paired_significance(qrels, {baseline: runs[baseline], name: runs[name]}, baseline, "mrr@10")[name]


def render(
    args, batch_size: int, rows: dict, tests: dict, baselines, baseline_ood, choices: dict, part: dict | None
) -> str:
    honest = part is not None
    head = (
        "| row | "
        + " | ".join(IN_DOMAIN)
        + " | Δ MRR@10 (vs) | p | squad "
        + " | squad ".join(OUT_OF_DOMAIN)
        + " | ArguAna "
        + " | ArguAna ".join(ARGUANA)
        + (" | tuning MRR@10" if honest else "")
    )
    columns = len(IN_DOMAIN) + len(OUT_OF_DOMAIN) + len(ARGUANA) + honest + 4
    lines = [head + " | steps | mining + training s |", "|---|" + "---:|" * columns]

    def cells(values: dict | None, names: list[str]) -> str:
        return " | ".join(f"{values[m]:.4f}" if values else "" for m in names)

    def tuned(values: dict | None) -> str:
        return (f" {values['mrr@10']:.4f} |" if values else " |") if honest else ""

    empty_ood = f"{cells(None, OUT_OF_DOMAIN)} | {cells(None, ARGUANA)}"
    for label, found, ood in (("BM25", baselines[0], (None, None)), ("zero-shot MiniLM", baselines[1], baseline_ood)):
        if found:
            tune = {"mrr@10": found[0]["tune mrr@10"]} if "tune mrr@10" in found[0] else None
            lines.append(
                f"| {label} | {cells(found[0], IN_DOMAIN)} | | | {cells(ood[0], OUT_OF_DOMAIN)} | "
                f"{cells(ood[1], ARGUANA)} |{tuned(tune)} | |"
            )
    for name, row in rows.items():
        test = tests.get(name)
        delta = f"{test['delta']:+.4f} ({test['against']})" if test else ""
        p = f"{test['p']:.4f}" if test else ""
        cost = f"{row['cost_s']:.0f}" if row["cost_s"] is not None else ""
        steps = row["steps"] if row["steps"] is not None else ""
        ood = (
            f"{cells(row['ood'], OUT_OF_DOMAIN)} | {cells(row.get('arguana'), ARGUANA)}"
            if "arguana" in row
            else empty_ood
        )
        lines.append(
            f"| {name} | {cells(row['in'], IN_DOMAIN)} | {delta} | {p} | {ood} |{tuned(row.get('tune'))} {steps} "
            f"| {cost} |"
        )
    extra = [
        f"| {n} | {t['delta']:+.4f} | {t['wins']} / {t['ties']} / {t['losses']} | {t['p']:.4f} |"
        for n, t in tests.items()
        if " vs " in n
    ]
    if honest:
        dev = (
            f"dev: {args.eval_queries} seeded queries of the **reporting part** ({part['part_queries']} of the "
            f"{part['split_queries']} dev queries, split by {part['by']}, seed {part['seed']}) over the full corpus; "
            "every choice (the best row, each row's and variant's wise-ft α, the weights of the BM25 fusions) was "
            "made on the tuning part (its MRR@10 in the column before steps), every number and paired test here is "
            "on the reporting part"
        )
    else:
        dev = f"dev: {args.eval_queries} seeded queries over the full corpus"
    parts = [
        f"{args.train_queries} training queries per row, batch {batch_size}; {dev}; out of domain, zero-shot: the "
        "squad split's dev questions and ArguAna's test queries (a hit that is the query itself dropped).",
        "",
        *lines,
    ]
    if extra:
        parts += ["", "| comparison | Δ MRR@10 | wins / ties / losses | p |", "|---|---:|---|---:|", *extra]
    if choices:
        parts += ["", "| choice on the tuning part | chosen | α | tuning MRR@10 |", "|---|---|---:|---:|"]
        parts += [
            f"| {what} | {c['chosen']} | {c['alpha']:g} | {c['tune mrr@10']:.4f} |" for what, c in choices.items()
        ]
    return "\n".join(parts) + "\n"


def main() -> None:
    args = parse_args()
    if args.stage in ("all", "train"):
        run_rows(args)
    if args.stage == "st":
        train_sentence_transformers(args)
    if args.stage == "wise-ft":
        run_wise_ft(args)
    if args.stage == "variant":
        run_variants(args)
    if args.stage in ("all", "report"):
        report(args)


if __name__ == "__main__":
    sys.exit(run_guarded(main, Path(__file__).name))
