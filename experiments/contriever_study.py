"""Contriever-style pre-training against no pre-training and against coCondenser, on debian-packages.

    python experiments/contriever_study.py --out outputs/contriever-study          # every stage, then the report
    python experiments/contriever_study.py --stage report --out ...                 # the tables from finished runs
    python experiments/contriever_study.py --quick --out outputs/contriever-quick   # a few steps: proves the pipeline

Two initialisers: all-MiniLM-L6-v2 and a small BERT initialised at random (``--random-layers`` x
``--random-hidden``, MiniLM's tokenizer). From each: no pre-training; Contriever (two independent random crops of
one document, a MoCo queue; configs/pretrain_contriever.yaml); coCondenser (MLM + Condenser head + span
contrastive pairs; configs/pretrain_cocondenser.yaml), the same steps, batch and learning rate for both objectives.
Every model is evaluated zero-shot and after low-data fine-tuning (configs/contriever_finetune.yaml: 1,000 train
queries, in-batch negatives), with the pooling its objective trains (mean for MiniLM, the random BERT and
Contriever; CLS for coCondenser, whose contrastive loss is on the CLS vector). Paired randomization tests against
no pre-training. Results: <out>/study.md and study.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from densepass.config import ExperimentConfig, load_config
from densepass.data import load_dataset
from densepass.evaluation.metrics import check_runs_cover, paired_significance, read_trec_run
from densepass.models.load import save_random_bert
from densepass.pipelines.evalset import eval_qrels
from densepass.pipelines.experiment import run_experiment
from densepass.pretraining.config import PretrainConfig
from densepass.pretraining.trainer import pretrain

METHODS = {"none": "no pre-training", "contriever": "Contriever", "cocondenser": "coCondenser"}
POOLING = {"none": "mean", "contriever": "mean", "cocondenser": "cls"}
METRICS = ["mrr@10", "ndcg@10", "recall@100"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/contriever-study")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--stage", choices=["all", "pretrain", "evaluate", "report"], default="all")
    parser.add_argument("--only", nargs="*", default=None, choices=["minilm", "random"], help="initialisers")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--minilm-steps", type=int, default=200, help="pre-training steps from MiniLM")
    parser.add_argument("--random-steps", type=int, default=400, help="pre-training steps from the random BERT")
    parser.add_argument("--batch", type=int, default=64, help="pre-training sequences per step (2 views x documents)")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--minilm-lr", type=float, default=5e-5, help="pre-training and fine-tuning lr, MiniLM")
    parser.add_argument("--random-lr", type=float, default=3e-4, help="pre-training and fine-tuning lr, random BERT")
    parser.add_argument("--random-layers", type=int, default=4)
    parser.add_argument("--random-hidden", type=int, default=256)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--set", action="append", default=[], help="extra fine-tuning config overrides")
    args = parser.parse_args()
    if args.quick:
        args.minilm_steps, args.random_steps, args.batch, args.max_length = 3, 3, 8, 64
        args.set = ["data.max_train_queries=64", "data.max_eval_queries=40", "data.eval_hard_k=2", *args.set]
        args.set += ["data.eval_random=200", "train.epochs=1"]
    return args


def random_bert(args: argparse.Namespace) -> str:
    """A small BERT with random weights (seed 13) and MiniLM's tokenizer, saved under <out>/random-bert."""
    return save_random_bert(Path(args.out) / "random-bert", args.random_layers, args.random_hidden)


def initialisers(args: argparse.Namespace) -> dict[str, str]:
    """Initialiser label -> its starting weights."""
    found = {"minilm": "all-MiniLM-L6-v2", "random": random_bert(args)}
    return {k: v for k, v in found.items() if args.only is None or k in args.only}


def start_of(args: argparse.Namespace, init: str) -> str:
    """The starting weights of initialiser ``init``."""
    return "all-MiniLM-L6-v2" if init == "minilm" else random_bert(args)


def data_dir(args: argparse.Namespace) -> list[str]:
    return [f"data.data_dir={args.data_dir}"] if args.data_dir else []


def pretrain_config(args: argparse.Namespace, init: str, method: str) -> PretrainConfig:
    steps, lr = (args.minilm_steps, args.minilm_lr) if init == "minilm" else (args.random_steps, args.random_lr)
    overrides = [
        f"name={init}-{method}",
        f"output_dir={Path(args.out) / 'pretrain'}",
        f"model.name_or_path={start_of(args, init)}",
        f"train.max_steps={steps}",
        f"train.batch_size={args.batch}",
        f"train.max_length={args.max_length}",
        f"train.learning_rate={lr}",
        f"train.checkpoint_every={max(steps // 4, 1)}",
        *data_dir(args),
    ]
    if method == "contriever":
        overrides += ["contriever.momentum=0.99"]  # short runs: a key encoder that follows within ~100 steps
    if method == "cocondenser" and init == "random":
        overrides += [f"model.early_layers={args.random_layers // 2}"]
    if args.quick:
        overrides += ["data.max_passages=2000"]
    return load_config(f"configs/pretrain_{method}.yaml", overrides, PretrainConfig)


def starting_weights(args: argparse.Namespace, init: str, method: str) -> str:
    """The model a fine-tuning run starts from."""
    if method == "none":
        return start_of(args, init)
    return str(pretrain_config(args, init, method).run_dir / "backbone")


def finetune_config(args: argparse.Namespace, init: str, method: str) -> ExperimentConfig:
    overrides = [
        f"name={init}-{method}",
        f"output_dir={Path(args.out) / 'finetune'}",
        f"model.name_or_path={starting_weights(args, init, method)}",
        f"model.pooling={POOLING[method]}",
        f"train.learning_rate={args.minilm_lr if init == 'minilm' else args.random_lr}",
        *data_dir(args),
        *args.set,
    ]
    return load_config("configs/contriever_finetune.yaml", overrides)


def run_pretraining(args: argparse.Namespace) -> None:
    for init in initialisers(args):
        for method in [m for m in args.methods if m != "none"]:
            config = pretrain_config(args, init, method)
            if (config.run_dir / "report.md").is_file():
                print(f"{init} / {method}: pre-trained ({config.run_dir})")
                continue
            print(f"== pre-training {init} / {method}", flush=True)
            result = pretrain(config)
            print(f"{init} / {method}: {result.steps} steps, loss {result.final_loss:.3f}", flush=True)


def run_evaluation(args: argparse.Namespace) -> None:
    for init in initialisers(args):
        for method in args.methods:
            config = finetune_config(args, init, method)
            if (config.run_dir / "metrics.json").is_file():
                print(f"{init} / {method}: done ({config.run_dir})")
                continue
            print(f"== zero-shot and fine-tuning {init} / {method}", flush=True)
            run_experiment(config)


def report(args: argparse.Namespace) -> None:
    rows, runs, evals, pretraining = {}, {}, set(), {}
    for init in initialisers(args):
        for method in args.methods:
            config = finetune_config(args, init, method)
            path = config.run_dir / "metrics.json"
            if not path.is_file():
                continue
            stored = json.loads(path.read_text())
            rows[(init, method)] = stored["results"]
            evals.add(stored["eval"])
            for system in ("zero-shot", "fine-tuned"):
                runs[(init, method, system)] = read_trec_run(config.run_dir / "runs" / f"{system}.trec")
            if method != "none":
                log_path = pretrain_config(args, init, method).run_dir / "train_log.jsonl"
                log = [json.loads(line) for line in log_path.read_text().splitlines()]
                pretraining[(init, method)] = log[-1]
    config = finetune_config(args, next(iter(initialisers(args))), "none")
    dataset = load_dataset(config.data.name, config.data.data_dir)
    qrels, _ = eval_qrels(dataset, config.data)  # the queries the runs evaluated (data.eval_part's)
    names = {"minilm": "all-MiniLM-L6-v2", "random": f"random BERT ({args.random_layers} x {args.random_hidden})"}
    header = "| initialiser | pre-training | pooling | " + " | ".join(f"{m} zero-shot" for m in METRICS)
    header += " | " + " | ".join(f"{m} fine-tuned" for m in METRICS) + " |"
    lines = [header, "|---|---|---|" + "---:|" * (2 * len(METRICS))]
    for (init, method), results in rows.items():
        cells = [f"{results[s][m]:.4f}" for s in ("zero-shot", "fine-tuned") for m in METRICS]
        lines.append(f"| {names[init]} | {METHODS[method]} | {POOLING[method]} | " + " | ".join(cells) + " |")
    tests = [
        "| initialiser | system | pre-training | Δ MRR@10 vs none | wins / ties / losses | p |",
        "|---|---|---|---:|---|---:|",
    ]
    for init in initialisers(args):
        for system in ("zero-shot", "fine-tuned"):
            group = {m: runs[(init, m, system)] for m in args.methods if (init, m, system) in runs}
            if "none" not in group or len(group) < 2:
                continue
            check_runs_cover(qrels, group)
            for method, test in paired_significance(qrels, group, "none").items():
                tests.append(
                    f"| {names[init]} | {system} | {METHODS[method]} | {test['delta']:+.4f} | "
                    f"{test['wins']} / {test['ties']} / {test['losses']} | {test['p']:.3f} |"
                )
    pre_lines = [
        "| initialiser | pre-training | steps | final loss terms | tokens/s (shared CPU) |",
        "|---|---|---:|---|---:|",
    ]
    for (init, method), last in pretraining.items():
        terms = ", ".join(f"{k} {last[k]:.3f}" for k in ("late_mlm", "head_mlm", "contrastive") if k in last)
        pre_lines.append(
            f"| {names[init]} | {METHODS[method]} | {last['step']} | {terms} | {last['tokens_per_s']:.0f} |"
        )
    text = "\n".join(
        [
            f"Pre-training: {args.minilm_steps} steps from MiniLM (lr {args.minilm_lr}), {args.random_steps} from the "
            f"random BERT (lr {args.random_lr}); {args.batch} sequences x {args.max_length} tokens per step.",
            f"Evaluation: {'; '.join(sorted(evals))}.",
            "",
            *lines,
            "",
            *pre_lines,
            "",
            "Paired Fisher randomization tests on MRR@10 against no pre-training (10,000 permutations, same queries):",
            "",
            *tests,
            "",
        ]
    )
    out = Path(args.out)
    (out / "study.md").write_text(text)
    payload = {"results": {f"{i}/{m}": r for (i, m), r in rows.items()}, "args": vars(args)}
    (out / "study.json").write_text(json.dumps(payload, indent=2))
    print(text)


def main() -> None:
    args = parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.stage in ("all", "pretrain"):
        run_pretraining(args)
    if args.stage in ("all", "evaluate"):
        run_evaluation(args)
    if args.stage in ("all", "report"):
        report(args)


if __name__ == "__main__":
    main()
