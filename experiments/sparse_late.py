"""SPLADE and ColBERT against BM25, the densepass bi-encoder and a dense + SPLADE hybrid, at one training budget.

    nice -n 10 python experiments/sparse_late.py --datasets debian      # CPU: about 1.5 hours on 2 shared cores
    nice -n 10 python experiments/sparse_late.py --datasets squad --set data.max_train_queries=512
    python experiments/sparse_late.py --summary-only                    # summary.md of both

For each dataset, three runs of configs/sparse_late.yaml (model.kind = bi-encoder, splade, colbert) train
with the same data, hard negatives, batches and steps (the run stages of ``densepass run``; a finished run
resumes from its checkpoint and does not train again). Each fine-tuned model then indexes the run's
evaluation corpus (exact dense, SPLADE inverted index, ColBERT fp16 with centroid pruning, and ColBERT
exhaustive MaxSim as its exact reference), and a dense + SPLADE hybrid fuses the two by RRF. Reported per
system: the metrics (debian-packages: MRR@10 and recall; SQuAD: top-k answer accuracy), a paired
randomization test against BM25 and against the bi-encoder, index size (the saved kind's files, passages
excluded), query latency (one query at a time, query encoding included; median over ``--latency-queries``)
and the training step time. Results: <out>/<dataset>/results.json and <out>/summary.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from densepass.cli import run_guarded
from densepass.config import load_config
from densepass.evaluation.answers import has_answer
from densepass.evaluation.metrics import paired_significance, randomization_p
from densepass.index.base import PASSAGES, Index
from densepass.index.bm25 import BM25Index
from densepass.index.colbert import ColbertIndex
from densepass.index.hybrid import HybridIndex
from densepass.index.splade import SpladeIndex
from densepass.io import atomic_write_text
from densepass.pipelines.distillation import objective_of
from densepass.pipelines.experiment import (
    Experiment,
    check,
    evaluate_baselines,
    fine_tune,
    mine_training_pool,
    model_from_config,
    prepare,
    run_directory,
    score_run,
)
from densepass.pipelines.retrievers import index_for_model

DATASETS = {
    "debian": [],
    "squad": [
        "data.name=squad-v1.1-dev-split",
        "data.format=squad",
        "data.max_eval_queries=null",
        "data.eval_subcorpus=false",
        "model.passage_max_length=192",
        "eval.metrics=[mrr@10, recall@20, accuracy@1, accuracy@5, accuracy@20]",
    ],
}
KINDS = {
    "bi-encoder": ["model.kind=bi-encoder"],
    "splade": ["model.kind=splade", "model.temperature=1.0", "eval.baselines=[]"],
    "colbert": ["model.kind=colbert", "model.temperature=1.0", "eval.baselines=[]"],
}
NAMES = {"bi-encoder": "bi-encoder", "splade": "SPLADE", "colbert": "ColBERT"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/sparse_late.yaml")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--out", default="outputs/sparse-late")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--latency-queries", type=int, default=50)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    parser.add_argument(
        "--summary-only", action="store_true", help="rewrite summary.md from the datasets' results.json files"
    )
    return parser.parse_args()


def index_bytes(index: Index, directory: Path) -> int:
    """Bytes of a saved index's own files (the passages file excluded: every kind stores the same one)."""
    index.save(directory)
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file() and f.name != PASSAGES)


def latency_ms(index: Index, queries: list[str], n: int, **options) -> float:
    """Median milliseconds of one query's search (encoding included), over the first ``n`` queries."""
    times = []
    for query in queries[:n]:
        started = time.perf_counter()
        index.search([query], 10, **options)
        times.append(1000 * (time.perf_counter() - started))
    return float(np.median(times))


def step_seconds(run_dir: Path, batch_size: int) -> float:
    """Mean seconds per training step (batch / examples per second of the last log record)."""
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return batch_size / records[-1]["examples_per_s"]


def answer_hits(exp: Experiment, run: dict, k: int) -> np.ndarray:
    """Per evaluated query, 1 when one of its top-``k`` passages holds an answer string."""
    texts = dict(zip(exp.evalset.corpus.ids, exp.evalset.corpus.texts))
    hits = []
    for qid in exp.evalset.query_ids:
        ranked = sorted(run.get(qid, {}).items(), key=lambda item: -item[1])[:k]
        hits.append(float(any(has_answer(texts[p], exp.evalset.answers.get(qid, [])) for p, _ in ranked)))
    return np.array(hits)


def evaluate_system(exp: Experiment, name: str, index: Index, out: Path, n_latency: int, **options) -> dict:
    """Search the evaluation queries with ``index``; metrics, index bytes, latency and the run itself."""
    started = time.perf_counter()
    results = index.search(exp.evalset.query_texts, exp.config.eval.depth, **options)
    search_s = time.perf_counter() - started
    run = results.as_run(exp.evalset.query_ids)
    metrics = score_run(exp, run, name)
    entry = {
        "metrics": metrics,
        "search_s_all_queries": search_s,
        "latency_ms": latency_ms(index, exp.evalset.query_texts, n_latency, **options),
        "run": run,
    }
    if not options:
        entry["index_bytes"] = index_bytes(index, out / "indexes" / name)
    if isinstance(index, SpladeIndex):
        entry["splade"] = index.stats(index.model.encode_queries(exp.evalset.query_texts, device=exp.device))
    if isinstance(index, ColbertIndex):
        entry["colbert"] = index.stats()
    print(name, json.dumps({k: round(v, 4) for k, v in metrics.items()}), flush=True)
    return entry


def run_dataset(args: argparse.Namespace, dataset: str) -> dict:
    """Train the three kinds on one dataset, then evaluate every system over one evaluation set."""
    out = Path(args.out) / dataset
    data_dir = [f"data.data_dir={args.data_dir}"] if args.data_dir else []
    systems: dict[str, dict] = {}
    indexes: dict[str, Index] = {}
    exp = None
    for kind, extra in KINDS.items():
        overrides = [*DATASETS[dataset], *extra, f"output_dir={out}", f"name={kind}", *data_dir, *args.set]
        config = load_config(args.config, overrides)
        device = check(config)
        with run_directory(config, True, restart=False) as claim:
            exp = prepare(config, device, True)
            run_dir = claim()  # the checks passed: the directory is the run's
            model = model_from_config(config)
            evaluate_baselines(exp, model)  # BM25 and zero-shot with the bi-encoder run
            for baseline, metrics in exp.results.items():
                systems[baseline] = {"metrics": metrics}
            fine_tune(exp, model, mine_training_pool(exp, model), objective_of(config, model))
            label = NAMES[kind]
            started = time.perf_counter()
            index = index_for_model(model, exp.evalset.corpus, config.model, device=exp.device)
            index_s = time.perf_counter() - started
            systems[label] = evaluate_system(exp, label, index, out, args.latency_queries)
            systems[label]["index_build_s"] = index_s
            systems[label]["train_step_s"] = step_seconds(run_dir, config.train.batch_size)
            indexes[label] = index
            if kind == "colbert":
                systems["ColBERT exhaustive"] = evaluate_system(
                    exp, "ColBERT exhaustive", index, out, args.latency_queries, exhaustive=True
                )
    bm25 = BM25Index.build(exp.evalset.corpus)
    systems["BM25"].update(evaluate_system(exp, "BM25", bm25, out, args.latency_queries))
    hybrid = HybridIndex(indexes["bi-encoder"], indexes["SPLADE"], "rrf", depth=100)
    systems["dense + SPLADE (RRF)"] = evaluate_system(exp, "dense + SPLADE (RRF)", hybrid, out, args.latency_queries)
    systems["dense + SPLADE (RRF)"].pop("index_bytes", None)  # the two parts' sizes
    tests = paired_tests(exp, systems, dataset)
    for entry in systems.values():
        entry.pop("run", None)
    result = {"dataset": dataset, "eval": exp.evalset.description, "systems": systems, "paired": tests}
    atomic_write_text(out / "results.json", json.dumps(result, indent=2))
    return result


def paired_tests(exp: Experiment, systems: dict, dataset: str) -> dict:
    """Every system against BM25 and against the bi-encoder: MRR@10 (debian) or accuracy@20 (SQuAD)."""
    runs = {name: entry["run"] for name, entry in systems.items() if "run" in entry}
    tests = {}
    for baseline in ("BM25", "bi-encoder"):
        if dataset == "squad":
            base = answer_hits(exp, runs[baseline], 20)
            tests[baseline] = {}
            for name, run in runs.items():
                if name != baseline:
                    hits = answer_hits(exp, run, 20)
                    delta = float(hits.mean() - base.mean())
                    tests[baseline][name] = {"metric": "accuracy@20", "delta": delta, "p": randomization_p(hits, base)}
        else:
            found = paired_significance(exp.evalset.qrels, runs, baseline, "mrr@10")
            tests[baseline] = {name: {"metric": "mrr@10", **value} for name, value in found.items()}
    return tests


def summary(results: list[dict]) -> str:
    """The markdown tables of every dataset."""
    lines = []
    for result in results:
        squad = result["dataset"] == "squad"
        metrics = (
            ["accuracy@1", "accuracy@5", "accuracy@20", "mrr@10"]
            if squad
            else ["mrr@10", "ndcg@10", "recall@20", "recall@100"]
        )
        key = "accuracy@20" if squad else "mrr@10"
        lines += [f"### {result['dataset']}: {result['eval']}", ""]
        header = [
            "system",
            *metrics,
            f"Δ{key} vs BM25 (p)",
            f"Δ{key} vs bi-encoder (p)",
            "index MB",
            "latency ms",
            "step s",
        ]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for name, entry in result["systems"].items():
            cells = [name, *(f"{entry['metrics'].get(m, float('nan')):.4f}" for m in metrics)]
            for baseline in ("BM25", "bi-encoder"):
                test = result["paired"].get(baseline, {}).get(name)
                cells.append(f"{test['delta']:+.4f} ({test['p']:.3g})" if test else "")
            cells.append(f"{entry['index_bytes'] / 1e6:.2f}" if "index_bytes" in entry else "")
            cells.append(f"{entry['latency_ms']:.1f}" if "latency_ms" in entry else "")
            cells.append(f"{entry['train_step_s']:.2f}" if "train_step_s" in entry else "")
            lines.append("| " + " | ".join(cells) + " |")
        stats = result["systems"]["SPLADE"].get("splade", {})
        lines += [
            "",
            f"SPLADE: {stats.get('avg_nnz_per_passage', 0):.1f} non-zeros per passage, "
            f"{stats.get('avg_nnz_per_query', 0):.1f} per query, FLOPS {stats.get('flops', 0):.2f}; "
            f"ColBERT: {result['systems']['ColBERT'].get('colbert', {}).get('avg_tokens_per_passage', 0):.1f} "
            "token vectors per passage.",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.summary_only:
        results = [json.loads((Path(args.out) / d / "results.json").read_text()) for d in args.datasets]
    else:
        results = [run_dataset(args, dataset) for dataset in args.datasets]
    text = summary(results)
    atomic_write_text(Path(args.out) / "summary.md", text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(run_guarded(main))
