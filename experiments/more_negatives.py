"""More negatives per step on debian-packages: pre-batch negatives, a MoCo queue, λ per source, LTR.

    python experiments/more_negatives.py --steps 192 --out outputs/more-negatives     # every variant, then report
    python experiments/more_negatives.py --only in-batch pre-batch-4 ...             # some variants
    python experiments/more_negatives.py --stage report ...                          # the tables from finished runs

Every variant trains all-MiniLM-L6-v2 for the same number of steps of batch 32 with in-batch negatives
(configs/more_negatives.yaml) and adds one thing: the passages of the previous T batches (training-inference-gap
§4.1), a MoCo queue of K keys from a momentum encoder (neural-retrieval-lecture, Contriever), the unified loss
with λ on the in-batch and pre-batch negatives (training-inference-gap eq. 2; λ(p-) = λ_inb for N_inb ∪ N_prb as
in the paper), the separate terms (eq. 1), or the LTR loss (abs-condenser-openqa eq. 14). Each run is an ordinary
``densepass run`` directory (resumable); the report has MRR@10 / nDCG@10 / Recall@100 on dev, the step time the
run measured, the objective's extra memory, and paired randomization tests against in-batch only.
Results: <out>/report.md and report.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from densepass.config import ExperimentConfig, load_config
from densepass.data import load_dataset
from densepass.evaluation.metrics import check_runs_cover, paired_significance, read_trec_run
from densepass.pipelines.evalset import eval_qrels
from densepass.pipelines.experiment import run_experiment

BASELINE = "in-batch"
VARIANTS: dict[str, list[str]] = {
    BASELINE: [],
    "pre-batch T=1": ["loss.memory=pre-batch", "loss.pre_batches=1"],
    "pre-batch T=4": ["loss.memory=pre-batch", "loss.pre_batches=4"],
    "pre-batch T=16": ["loss.memory=pre-batch", "loss.pre_batches=16"],
    "MoCo K=4096": ["loss.memory=moco", "loss.queue_size=4096"],
    "MoCo K=16384": ["loss.memory=moco", "loss.queue_size=16384"],
    "pre-batch T=4, λ=16": [
        "loss.memory=pre-batch",
        "loss.pre_batches=4",
        "loss.lambda_in_batch=16",
        "loss.lambda_memory=16",
    ],
    "pre-batch T=4, λ=256": [
        "loss.memory=pre-batch",
        "loss.pre_batches=4",
        "loss.lambda_in_batch=256",
        "loss.lambda_memory=256",
    ],
    "pre-batch T=4, eq. 1": ["loss.memory=pre-batch", "loss.pre_batches=4", "loss.combine=separate"],
    "LTR": ["loss.kind=ltr"],
}
METRICS = ["mrr@10", "ndcg@10", "recall@100"]


def slug(name: str) -> str:
    """A run directory name for a variant."""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).replace("--", "-").strip("-")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/more-negatives")
    parser.add_argument("--config", default="configs/more_negatives.yaml")
    parser.add_argument("--stage", choices=["all", "train", "report"], default="all")
    parser.add_argument("--only", nargs="*", default=None, choices=list(VARIANTS), metavar="VARIANT")
    parser.add_argument("--steps", type=int, default=192, help="training steps of every variant (one epoch)")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--quick", action="store_true", help="a few steps and queries: proves the pipeline")
    parser.add_argument("--set", action="append", default=[], help="extra config overrides for every variant")
    args = parser.parse_args()
    if args.quick:
        args.steps = 4
        args.set = ["data.max_eval_queries=40", "data.eval_hard_k=2", "data.eval_random=200", *args.set]
    return args


def variant_config(args: argparse.Namespace, name: str) -> ExperimentConfig:
    """The config of one variant: the shared recipe, the variant's loss keys, the command line's overrides."""
    batch = load_config(args.config, args.set).train.batch_size
    overrides = [
        f"name={slug(name)}",
        f"output_dir={Path(args.out) / 'runs'}",
        f"data.max_train_queries={args.steps * batch}",
        *([f"data.data_dir={args.data_dir}"] if args.data_dir else []),
        *(["eval.baselines=[bm25, zero-shot]"] if name == BASELINE else []),
        *VARIANTS[name],
        *args.set,
    ]
    return load_config(args.config, overrides)


def extra_memory_mb(config: ExperimentConfig, dim: int, passage_params: int) -> float:
    """What the objective keeps besides the model, in MB of float32: the pre-batch memory (T global batches of
    passages) or the queue (K keys) plus the momentum encoder's weights."""
    loss, batch = config.loss, config.train.batch_size * (1 + config.negatives.per_query)
    if loss.memory == "pre-batch":
        return loss.pre_batches * batch * dim * 4 / 1e6
    if loss.memory == "moco":
        return (loss.queue_size * dim + passage_params) * 4 / 1e6
    return 2 * dim * 4 / 1e6 if loss.kind == "ltr" else 0.0


def run_all(args: argparse.Namespace) -> None:
    for name in args.only or VARIANTS:
        config = variant_config(args, name)
        if (config.run_dir / "metrics.json").is_file():
            print(f"{name}: done ({config.run_dir})")
            continue
        print(f"== {name}: {' '.join(VARIANTS[name]) or 'the shared recipe'}", flush=True)
        run_experiment(config)


def report(args: argparse.Namespace) -> None:
    from densepass.models.biencoder import BiEncoder
    from densepass.models.momentum import passage_parameters

    model = BiEncoder.from_pretrained(load_config(args.config, args.set).model.name_or_path)
    dim, passage_params = model.dim, sum(p.numel() for p in passage_parameters(model))
    rows, runs, baselines, eval_text = {}, {}, {}, set()
    for name in VARIANTS:
        config = variant_config(args, name)
        metrics_path = config.run_dir / "metrics.json"
        if not metrics_path.is_file():
            continue
        stored = json.loads(metrics_path.read_text())
        log = [json.loads(line) for line in (config.run_dir / "train_log.jsonl").read_text().splitlines()]
        examples_per_s = log[-1]["examples_per_s"]
        rows[name] = {
            **stored["results"]["fine-tuned"],
            "steps": log[-1]["step"],
            "final_loss": log[-1]["loss"],
            "step_s": config.train.batch_size / examples_per_s,
            "train_s": stored["timings"].get("train_s"),
            "extra_memory_mb": extra_memory_mb(config, dim, passage_params),
        }
        eval_text.add(stored["eval"])
        runs[name] = read_trec_run(config.run_dir / "runs" / "fine-tuned.trec")
        if name == BASELINE:
            baselines = {k: v for k, v in stored["results"].items() if k != "fine-tuned"}
    config = variant_config(args, BASELINE)
    dataset = load_dataset(config.data.name, config.data.data_dir)
    qrels, _ = eval_qrels(dataset, config.data)  # the queries the runs evaluated (data.eval_part's)
    tests = {}
    if BASELINE in runs and len(runs) > 1:
        check_runs_cover(qrels, runs)
        for metric in ("mrr@10", "recall@100"):
            for name, test in paired_significance(qrels, runs, BASELINE, metric).items():
                tests.setdefault(name, {})[metric] = test
    header = "| variant | " + " | ".join(METRICS) + " | final loss | step s (shared CPU) | extra MB |"
    lines = [header, "|---|" + "---:|" * (len(METRICS) + 3)]
    for name, values in baselines.items():
        lines.append(f"| {name} (no training) | " + " | ".join(f"{values[m]:.4f}" for m in METRICS) + " | | | |")
    for name, row in rows.items():
        lines.append(
            f"| {name} | "
            + " | ".join(f"{row[m]:.4f}" for m in METRICS)
            + f" | {row['final_loss']:.4f} | {row['step_s']:.2f} | {row['extra_memory_mb']:.1f} |"
        )
    test_lines = [
        "| variant | Δ MRR@10 | wins / ties / losses | p | Δ Recall@100 | p |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for name, by_metric in tests.items():
        mrr, recall = by_metric["mrr@10"], by_metric["recall@100"]
        test_lines.append(
            f"| {name} | {mrr['delta']:+.4f} | {mrr['wins']} / {mrr['ties']} / {mrr['losses']} | {mrr['p']:.3f} | "
            f"{recall['delta']:+.4f} | {recall['p']:.3f} |"
        )
    steps = {row["steps"] for row in rows.values()}
    text = "\n".join(
        [
            f"Every variant: {', '.join(map(str, sorted(steps)))} steps of batch {config.train.batch_size}, "
            f"in-batch negatives, {config.model.name_or_path}. Evaluation: {'; '.join(sorted(eval_text))}.",
            "",
            *lines,
            "",
            f"Paired Fisher randomization tests against {BASELINE} only (10,000 permutations, the same queries):",
            "",
            *test_lines,
            "",
        ]
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps({"rows": rows, "baselines": baselines, "tests": tests}, indent=2))
    print(text)


def main() -> None:
    args = parse_args()
    if args.stage in ("all", "train"):
        run_all(args)
    if args.stage in ("all", "report"):
        report(args)


if __name__ == "__main__":
    main()
