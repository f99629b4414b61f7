r"""Condenser study (condenser Tables 3 and 5, Figure 2) on debian-packages.

    python experiments/condenser_study.py --quick --data-dir /work/shared/data          # CPU, end to end
    # GPU, in stages (each resumable; a finished stage is skipped when re-run):
    python experiments/condenser_study.py --stage pretrain --only mlm --model .carry/minilm-l6-fp16 \
        --data-dir .carry/data
    python experiments/condenser_study.py --stage finetune --setting low ...
    python experiments/condenser_study.py --stage report ...

(a) plain MLM, (b) Condenser and (c) coCondenser continue pre-training the MiniLM backbone for the same
number of steps (configs/pretrain_*.yaml); then each of them and the original MiniLM is fine-tuned with
one recipe (configs/condenser_finetune.yaml: CLS pooling, 1 BM25 negative, in-batch negatives) with 1k
train queries (low data) and with --full-queries (full data), and evaluated on dev (MRR@10, Recall@100).
The CLS attention entropy of every pre-trained and fine-tuned model is plotted on one PNG.
Results: <out>/study.md, study.json, attention.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from densepass.analysis.attention import attention_entropy, entropy_shift, entropy_table, plot_entropy, sample_passages
from densepass.cli import run_guarded
from densepass.config import ExperimentConfig, load_config
from densepass.data import load_dataset
from densepass.device import default_device
from densepass.evaluation.metrics import check_runs_cover, paired_significance, read_trec_run
from densepass.pipelines.evalset import eval_qrels
from densepass.pipelines.experiment import run_experiment
from densepass.pretraining.config import PretrainConfig
from densepass.pretraining.trainer import pretrain

MODES = {"mlm": "MLM", "condenser": "Condenser", "cocondenser": "coCondenser"}
METRICS = ["mrr@10", "recall@100"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", default="outputs/condenser-study")
    parser.add_argument("--stage", choices=["all", "pretrain", "finetune", "report"], default="all")
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        choices=["minilm", *MODES],
        help="initialisers to run (pre-training skips minilm)",
    )
    parser.add_argument("--setting", choices=["both", "low", "full"], default="both")
    parser.add_argument("--quick", action="store_true", help="tiny CPU-sized run of every stage")
    parser.add_argument("--pretrain-steps", type=int, default=1000)
    parser.add_argument("--pretrain-batch", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--low-queries", type=int, default=1000)
    parser.add_argument("--low-epochs", type=int, default=10)
    parser.add_argument("--full-queries", type=int, default=20000)
    parser.add_argument("--full-epochs", type=int, default=1)
    parser.add_argument("--eval-queries", type=int, default=2000)
    parser.add_argument("--pooling", choices=["cls", "mean"], default="cls")
    parser.add_argument("--attention-samples", type=int, default=1000)
    parser.add_argument("--set", action="append", default=[], help="extra fine-tuning config overrides")
    parser.add_argument(
        "--cpu-bf16",
        action="store_true",
        help="bf16 autocast on CPU too, pre-training and fine-tuning (~2x faster with AVX512-BF16)",
    )
    args = parser.parse_args()
    if args.quick:
        args.pretrain_steps, args.pretrain_batch, args.max_length = 3, 8, 64
        args.low_queries, args.low_epochs, args.full_queries, args.full_epochs = 48, 1, 96, 1
        args.eval_queries, args.attention_samples = 60, 32
    return args


def data_dir(args: argparse.Namespace) -> list[str]:
    return [f"data.data_dir={args.data_dir}"] if args.data_dir else []


def pretrain_config(args: argparse.Namespace, mode: str) -> PretrainConfig:
    overrides = [
        f"output_dir={Path(args.out) / 'pretrain'}",
        f"model.name_or_path={args.model}",
        f"train.max_steps={args.pretrain_steps}",
        f"train.batch_size={args.pretrain_batch}",
        f"train.max_length={args.max_length}",
        f"train.cpu_bf16={args.cpu_bf16}",
        *data_dir(args),
    ]
    if args.quick:
        overrides += ["data.max_passages=2000", "train.checkpoint_every=1000"]
    return load_config(f"configs/pretrain_{mode}.yaml", overrides, PretrainConfig)


def finetune_config(args: argparse.Namespace, label: str, model: str, setting: str) -> ExperimentConfig:
    queries, epochs = (args.low_queries, args.low_epochs) if setting == "low" else (args.full_queries, args.full_epochs)
    overrides = [
        f"name={label.lower()}-{setting}",
        f"output_dir={Path(args.out) / 'finetune'}",
        f"model.name_or_path={model}",
        f"model.pooling={args.pooling}",
        *data_dir(args),
        f"data.max_train_queries={queries}",
        f"train.epochs={epochs}",
        f"data.max_eval_queries={args.eval_queries}",
        f"train.cpu_bf16={args.cpu_bf16}",
    ]
    if args.quick:  # no 60k-passage BM25 per run on 2 CPU cores: in-batch negatives, a small eval subcorpus
        overrides += [
            "negatives.source=none",
            "train.batch_size=16",
            "data.eval_subcorpus=true",
            "data.eval_random=1000",
            "model.passage_max_length=64",
        ]
    return load_config("configs/condenser_finetune.yaml", [*overrides, *args.set])


def initialisers(args: argparse.Namespace) -> dict[str, str]:
    models = {"MiniLM": args.model}
    for mode, label in MODES.items():
        models[label] = str(pretrain_config(args, mode).run_dir / "backbone")
    return models


def run_pretraining(args: argparse.Namespace) -> None:
    for mode in [m for m in args.only or MODES if m in MODES]:
        config = pretrain_config(args, mode)
        if (config.run_dir / "backbone" / "config.json").is_file() and (config.run_dir / "report.md").is_file():
            print(f"{mode}: already pre-trained ({config.run_dir})")
            continue
        result = pretrain(config)
        print(
            f"{mode}: {result.steps} steps, final loss {result.final_loss:.3f}, {result.tokens_per_second:.0f} tokens/s"
        )


def run_finetuning(args: argparse.Namespace) -> None:
    settings = ["low", "full"] if args.setting == "both" else [args.setting]
    wanted = {({"minilm": "MiniLM"} | MODES)[m] for m in args.only} if args.only else None
    for setting in settings:
        for label, model in initialisers(args).items():
            if wanted is not None and label not in wanted:
                continue
            config = finetune_config(args, label, model, setting)
            if (config.run_dir / "metrics.json").is_file():
                print(f"{label} / {setting}: done ({config.run_dir})")
                continue
            run_experiment(config)


def significance_lines(args: argparse.Namespace, dataset) -> list[str]:
    """Paired Fisher randomization tests on MRR@10 of every fine-tuned initialiser against MiniLM and MLM."""
    lines = ["| setting | initialiser | vs | delta mrr@10 | wins / ties / losses | p |", "|---|---|---|---:|---|---:|"]
    for setting in ("low", "full"):
        runs = {}
        for label, model in initialisers(args).items():
            config = finetune_config(args, label, model, setting)  # evaluation settings are the same for all
            trec = config.run_dir / "runs" / "fine-tuned.trec"
            if trec.is_file():
                runs[label] = read_trec_run(trec)
        qrels, _ = eval_qrels(dataset, config.data)  # the queries the runs evaluated (data.eval_part's)
        if runs:
            check_runs_cover(qrels, runs)
        for baseline in ("MiniLM", "MLM"):
            if baseline not in runs or len(runs) < 2:
                continue
            others = {label: run for label, run in runs.items() if label not in ("MiniLM", baseline)}
            for label, test in paired_significance(qrels, {baseline: runs[baseline], **others}, baseline).items():
                lines.append(
                    f"| {setting} | {label} | {baseline} | {test['delta']:+.4f} | "
                    f"{test['wins']} / {test['ties']} / {test['losses']} | {test['p']:.3f} |"
                )
    return lines


def report(args: argparse.Namespace) -> None:
    out = Path(args.out)
    rows, finetuned = {}, {}
    for setting in ("low", "full"):
        for label, model in initialisers(args).items():
            run_dir = finetune_config(args, label, model, setting).run_dir
            if (run_dir / "metrics.json").is_file():
                metrics = json.loads((run_dir / "metrics.json").read_text())
                rows.setdefault(label, {})[setting] = metrics["results"]["fine-tuned"]
                rows[label]["eval"] = metrics["eval"]
                finetuned[f"{label} fine-tuned ({setting})"] = str(run_dir / "model")
    pretrained = {
        f"{label} pre-trained": m
        for label, m in initialisers(args).items()
        if label == "MiniLM" or (Path(m) / "config.json").is_file()
    }
    d = load_dataset("debian-packages", args.data_dir)
    texts = sample_passages(d.corpus, args.attention_samples, 13, "[SEP]")
    device = default_device()
    entropies = {
        name: attention_entropy(path, texts, args.max_length, device=device)
        for name, path in {**pretrained, **finetuned}.items()
    }
    panels = {label: [name for name in entropies if name.startswith(f"{label} ")] for label in initialisers(args)}
    plot_entropy(
        entropies,
        out / "attention.png",
        f"CLS attention entropy, {len(texts)} debian-packages passages",
        panels={label: names for label, names in panels.items() if names},
    )
    shift_lines = ["| initialiser | low | full |", "|---|---:|---:|"]
    for label in initialisers(args):
        shifts = [
            f"{entropy_shift(entropies[before], entropies[after]):.3f}"
            if before in entropies and after in entropies
            else "-"
            for before, after in ((f"{label} pre-trained", f"{label} fine-tuned ({s})") for s in ("low", "full"))
        ]
        shift_lines.append(f"| {label} | " + " | ".join(shifts) + " |")
    lines = [
        "| initialiser | " + " | ".join(f"{m} ({s})" for s in ("low", "full") for m in METRICS) + " |",
        "|---|" + "---:|" * (2 * len(METRICS)),
    ]
    for label, values in rows.items():
        cells = [f"{values[s][m]:.4f}" if s in values else "-" for s in ("low", "full") for m in METRICS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    evals = {v["eval"] for v in rows.values()}
    text = "\n".join(
        [
            f"Pre-training: {args.pretrain_steps} steps of {args.pretrain_batch} x {args.max_length} tokens "
            "per objective. "
            f"Fine-tuning: {args.pooling} pooling; low = {args.low_queries} train queries x {args.low_epochs} epochs, "
            f"full = {args.full_queries} queries x {args.full_epochs} epoch(s).{' (--quick)' if args.quick else ''}"
            f"{' bf16 autocast on CPU.' if args.cpu_bf16 else ''}",
            f"Evaluation: {'; '.join(sorted(evals))}.",
            "",
            *lines,
            "",
            "Paired Fisher randomization tests on MRR@10 (10,000 permutations, ranx), same dev queries:",
            "",
            *significance_lines(args, d),
            "",
            "CLS attention entropy (nats) per layer:",
            "",
            entropy_table(entropies),
            "",
            "How far fine-tuning moved the CLS attention (mean over layers of |entropy change|, condenser §5):",
            "",
            *shift_lines,
            "",
            "![attention entropy](attention.png)",
            "",
        ]
    )
    (out / "study.md").write_text(text)
    (out / "study.json").write_text(json.dumps({"results": rows, "entropy": entropies, "args": vars(args)}, indent=2))
    print(text)


def main() -> None:
    args = parse_args()
    if args.stage in ("all", "pretrain"):
        run_pretraining(args)
    if args.stage in ("all", "finetune"):
        run_finetuning(args)
    if args.stage in ("all", "report"):
        report(args)


if __name__ == "__main__":
    sys.exit(run_guarded(main, Path(__file__).name))
