"""Cross-encoder reranking and distillation into the bi-encoder (neural-retrieval-lecture:
cross-encoder re-ranking and Margin-MSE distillation; training-inference-gap §2: distillation from a
cross encoder), every row with a paired test against the contrastive bi-encoder.

    python3 experiments/distillation.py --config configs/distillation.yaml          # debian-packages
    python3 experiments/distillation.py --config configs/distillation_squad.yaml    # SQuAD, + answer accuracy

Four ``densepass run``s of the config, under ``<output_dir>/<name>-<row>/``:

1. ``contrastive``: BM25; the bi-encoder trained contrastively on the config's BM25 hard negatives; the
   cross-encoder trained (listwise) on the same pool; both first stages with their top ``reranker.depth``
   reranked (``BM25 → cross-encoder@depth``, ``bi-encoder → cross-encoder@depth``);
2. ``margin-mse``, ``kl``, ``contrastive+kl``: the same bi-encoder training with the cross-encoder of run 1
   as the teacher: Margin-MSE alone, KL alone, InfoNCE + KL. The teacher's scores of every training query's
   positive and pool are computed once, by the first of them, into ``<output_dir>/<name>-teacher_scores.jsonl``
   and checked (teacher, queries, pool) by the others.

Every row is tested against the contrastive bi-encoder on the same queries: Fisher's paired randomization
test on MRR@10 (``evaluation.metrics.paired_significance``), and on top-k answer accuracy where the dataset
has answers. The reranking cost per query is the wall-clock time of reranking over the number of queries,
on the machine the run used. Writes ``<output_dir>/<name>-table.md`` and ``.json``; runs that finished are
read back, so re-running the command only does what is missing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from densepass.cli import run_guarded
from densepass.config import ExperimentConfig, load_config
from densepass.data import load_dataset
from densepass.evaluation.answers import has_answer
from densepass.evaluation.metrics import (
    Run,
    check_runs_cover,
    evaluate_run,
    paired_significance,
    randomization_p,
    read_trec_run,
)
from densepass.io import atomic_write_text
from densepass.pipelines.evalset import eval_qrels
from densepass.pipelines.experiment import run_experiment

BASELINE = "bi-encoder (contrastive, BM25 negatives)"
RUNS = {
    "contrastive": [],
    "margin-mse": ["reranker.distill.loss=margin-mse"],
    "kl": ["reranker.distill.loss=kl"],
    "contrastive+kl": ["reranker.distill.loss=kl", "reranker.distill.contrastive=true"],
}


def run_config(base: list[str], config_path: str, row: str, name: str, teacher: Path, scores: Path) -> ExperimentConfig:
    """The config of one run: the contrastive run as configured, the distilled ones without baselines or
    reranked rows, the contrastive run's cross-encoder as their (fixed) teacher."""
    overrides = [*base, f"name={name}-{row}", *RUNS[row]]
    if row != "contrastive":
        overrides += [
            "eval.baselines=[]",
            "reranker.first_stages=[]",
            "reranker.train.enabled=false",
            f"reranker.name_or_path={teacher}",
            f"reranker.distill.scores_file={scores}",
        ]
    return load_config(config_path, overrides)


def finished(config: ExperimentConfig) -> dict | None:
    """The stored ``metrics.json`` of a run that finished with this very config, else None."""
    path = config.run_dir / "metrics.json"
    if not path.is_file():
        return None
    stored = json.loads(path.read_text())
    from dataclasses import asdict

    return stored if stored.get("config") == json.loads(json.dumps(asdict(config))) else None


def answer_hits(run: Run, qids: list[str], answers: dict, texts: dict, k: int) -> np.ndarray:
    """Per query: 1 when one of its top-``k`` passages contains an answer (DPR top-k accuracy), else 0."""
    out = []
    for q in qids:
        ranked = sorted(run.get(q, {}), key=run.get(q, {}).get, reverse=True)[:k]
        out.append(float(any(has_answer(texts[p], answers[q]) for p in ranked)))
    return np.asarray(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/distillation.yaml")
    parser.add_argument("--set", action="append", default=[], help="override a config value (every run)")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    base = list(args.set) + ([f"data.data_dir={args.data_dir}"] if args.data_dir else [])
    config = load_config(args.config, base)
    out, name = Path(config.output_dir), config.name
    teacher = out / f"{name}-contrastive" / "reranker" / "model"
    scores_file = out / f"{name}-teacher_scores.jsonl"

    stored, wall = {}, {}
    for row in RUNS:
        cfg = run_config(base, args.config, row, name, teacher, scores_file)
        stored[row] = finished(cfg)
        if stored[row] is None:
            started = time.perf_counter()
            run_experiment(cfg)
            wall[row] = time.perf_counter() - started
            stored[row] = finished(cfg)
        print(f"{row}: done")

    dataset = load_dataset(config.data.name, config.data.data_dir, config.data.format)
    qrels, _ = eval_qrels(dataset, config.data)  # the queries the runs evaluated (data.eval_part's)
    qids = sorted(qrels)
    depth = config.reranker.depth
    run_files = {
        "BM25": ("contrastive", "bm25"),
        BASELINE: ("contrastive", "fine-tuned"),
        f"BM25 → cross-encoder@{depth}": ("contrastive", f"bm25-rerank{depth}"),
        f"bi-encoder → cross-encoder@{depth}": ("contrastive", f"fine-tuned-rerank{depth}"),
        "bi-encoder distilled, Margin-MSE": ("margin-mse", "fine-tuned"),
        "bi-encoder distilled, KL": ("kl", "fine-tuned"),
        "bi-encoder, contrastive + KL": ("contrastive+kl", "fine-tuned"),
    }
    runs = {
        label: read_trec_run(out / f"{name}-{row}" / "runs" / f"{file}.trec", dataset.corpus)
        for label, (row, file) in run_files.items()
    }
    check_runs_cover(qrels, runs)
    metrics = list(config.eval.metrics)
    answers = {q: dataset.answers[q] for q in qids if dataset.answers.get(q)}
    texts = dict(zip(dataset.corpus.ids, dataset.corpus.texts))
    results = {label: evaluate_run(qrels, run, metrics, answers or None, texts) for label, run in runs.items()}
    paired = {m: paired_significance(qrels, runs, BASELINE, m) for m in metrics if not m.startswith("accuracy@")}
    accuracy_ks = [int(m.split("@")[1]) for m in metrics if m.startswith("accuracy@")]
    answered = sorted(answers)
    for k in accuracy_ks:
        base_hits = answer_hits(runs[BASELINE], answered, answers, texts, k)
        paired[f"accuracy@{k}"] = {}
        for label, run in runs.items():
            if label != BASELINE:
                hits = answer_hits(run, answered, answers, texts, k)
                paired[f"accuracy@{k}"][label] = {
                    "delta": float(hits.mean() - base_hits.mean()),
                    "wins": int((hits > base_hits).sum()),
                    "losses": int((hits < base_hits).sum()),
                    "p": randomization_p(hits, base_hits),
                }
    timings = stored["contrastive"]["timings"]
    cost = {
        f"BM25 → cross-encoder@{depth}": timings.get("rerank_bm25_ms_per_query"),
        f"bi-encoder → cross-encoder@{depth}": timings.get("rerank_fine-tuned_ms_per_query"),
    }
    tested = "mrr@10" if "mrr@10" in paired else next(iter(paired))
    tests = [tested] + [f"accuracy@{k}" for k in accuracy_ks if k == max(accuracy_ks)]
    header = ["row", *metrics, *(f"Δ {m} (p)" for m in tests), "rerank ms/query"]
    lines = [
        f"`{config.data.name}`: {stored['contrastive']['eval']}; {len(runs)} rows; paired randomization tests "
        f"against `{BASELINE}`.",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    for label, values in results.items():
        cells = [f"{values[m]:.4f}" for m in metrics]
        for m in tests:
            if label == BASELINE:
                cells.append("—")
            else:
                test = paired[m][label]
                cells.append(f"{test['delta']:+.4f} ({test['p']:.3f})")
        cells.append(f"{cost[label]:,.0f}" if cost.get(label) is not None else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    atomic_write_text(out / f"{name}-table.md", table + "\n")
    payload = {
        "results": results,
        "paired": paired,
        "rerank_ms_per_query": cost,
        "timings": {row: stored[row]["timings"] for row in RUNS},
        "wall_s_this_invocation": wall,
        "notes": {row: stored[row].get("notes") for row in RUNS},
    }
    atomic_write_text(out / f"{name}-table.json", json.dumps(payload, indent=2))


if __name__ == "__main__":
    raise SystemExit(run_guarded(main, prog="distillation"))
