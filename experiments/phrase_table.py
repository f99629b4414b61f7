"""Phrase retrieval table (training-inference-gap Tables 1-2 and Figure 2, on the squad split's dev).

Reads the metrics of finished ``densepass phrase`` runs and adds, on the same questions and corpus, the
passage-level baselines: BM25 and a densepass bi-encoder (zero-shot all-MiniLM-L6-v2, or any saved
bi-encoder given with ``--biencoder``). Prints Markdown tables (Table 1 rows, the filter-threshold
sweep) and writes everything to ``--out`` as JSON. ``--thresholds`` sweeps the token filter again at other
thresholds on each filtered run's saved index (nothing is encoded again but the questions).

    python3 experiments/phrase_table.py --runs outputs/phrase-original outputs/phrase-unified \\
        outputs/phrase-unified-hn --out outputs/phrase-table.json [--thresholds -3.5 -3 -2.5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from densepass.cli import run_guarded
from densepass.config import load_config
from densepass.errors import DataError
from densepass.index import load_index
from densepass.index.bm25 import BM25Index
from densepass.index.dense import DenseIndex
from densepass.io import atomic_write_text
from densepass.models.biencoder import BiEncoder
from densepass.phrase.config import PhraseConfig
from densepass.phrase.experiment import load_data
from densepass.phrase.metrics import passage_metrics
from densepass.phrase.validation import evaluate_index, evaluation_set

KS = (1, 5, 20)
PHRASE = ("em@1", "f1@1", "accuracy@1", "accuracy@5", "accuracy@20")
PASSAGE = tuple(f"passage_recall@{k}" for k in KS) + tuple(f"passage_accuracy@{k}" for k in KS)


def baselines(config: PhraseConfig, biencoders: list[str]) -> dict[str, dict]:
    data = load_data(config)
    evalset = evaluation_set(data, config.data.eval_split, config.data.max_eval_questions, config.data.seed)
    corpus = data.dataset.corpus
    out = {}
    started = time.perf_counter()
    bm25 = BM25Index.build(corpus)
    out["BM25"] = passage_metrics(bm25.search(evalset.questions, max(KS)), evalset.gold, evalset.answers, KS)
    out["BM25"]["seconds"] = round(time.perf_counter() - started, 1)
    for name in biencoders:
        started = time.perf_counter()
        model = BiEncoder.from_pretrained(name)
        index = DenseIndex.build(model, corpus, show_progress=False, batch_size=32)
        label = f"bi-encoder {Path(name).name}"
        out[label] = passage_metrics(index.search(evalset.questions, max(KS)), evalset.gold, evalset.answers, KS)
        out[label]["seconds"] = round(time.perf_counter() - started, 1)
    return out


def sweep_again(run_dir: Path, thresholds: list[float]) -> list[dict]:
    """The run's dev metrics on its saved index with the token filter at each threshold."""
    config = load_config(run_dir / "config.yaml", [], PhraseConfig)
    data = load_data(config)
    evalset = evaluation_set(data, config.data.eval_split, config.data.max_eval_questions, config.data.seed)
    index = load_index(run_dir / "index")
    vectors = index.question_vectors(evalset.questions)
    return [{"threshold": t, **evaluate_index(index.filtered(t), evalset, config.eval.ks, vectors)} for t in thresholds]


def cells(values: dict, keys: tuple[str, ...]) -> str:
    return " | ".join(f"{values[k]:.1f}" if k in values else "-" for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="densepass phrase run directories")
    parser.add_argument("--biencoder", nargs="*", default=["all-MiniLM-L6-v2"], help="bi-encoders for the baseline")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument(
        "--baselines", default=None, help="JSON cache of the baselines' metrics (computed when missing)"
    )
    parser.add_argument("--thresholds", nargs="*", type=float, default=None, help="sweep the filter again at these")
    args = parser.parse_args()
    unfinished = [r for r in args.runs if not (Path(r) / "metrics.json").is_file()]
    if unfinished:
        raise DataError(f"{unfinished[0]} is not a finished densepass phrase run (no metrics.json)")
    runs = {Path(r).name: json.loads((Path(r) / "metrics.json").read_text()) for r in args.runs}
    config = load_config(Path(args.runs[0]) / "config.yaml", [], PhraseConfig)
    cache = Path(args.baselines) if args.baselines else None
    if cache is not None and cache.is_file():
        passage_rows = json.loads(cache.read_text())
    else:
        passage_rows = baselines(config, args.biencoder)
        if cache is not None:
            atomic_write_text(cache, json.dumps(passage_rows, indent=2))
    rows = {}
    for name, metrics in runs.items():
        rows[name] = {**metrics["evaluate"]["unfiltered"], "train_seconds": metrics["train"]["seconds"]}
        if "query_tuning" in metrics:
            rows[f"{name} + query-side fine-tuning"] = metrics["query_tuning"]["unfiltered"]
    print("| system | " + " | ".join(PHRASE + PASSAGE) + " | start+end vectors |")
    print("|---" * (len(PHRASE + PASSAGE) + 2) + "|")
    for name, values in rows.items():
        print(f"| {name} | {cells(values, PHRASE + PASSAGE)} | {values['start_vectors'] + values['end_vectors']:,} |")
    for name, values in passage_rows.items():
        print(f"| {name} | {cells(values, PHRASE + PASSAGE)} | - |")
    sweeps = {name: m["evaluate"]["sweep"] for name, m in runs.items() if m["evaluate"]["sweep"]}
    if args.thresholds:
        sweeps = {name: sweep_again(Path(r), args.thresholds) for name, r in zip(runs, args.runs) if name in sweeps}
        for name, sweep in sweeps.items():
            runs[name]["evaluate"]["sweep"] = sweep
    for name, sweep in sweeps.items():
        print(f"\nThreshold sweep of {name} (AUC-PR {runs[name]['filter']['best_auc_pr']:.3f}):\n")
        print("| threshold | kept vectors | kept % | MB (fp16) | " + " | ".join(PHRASE) + " | passage_recall@20 |")
        print("|---" * (len(PHRASE) + 5) + "|")
        unfiltered = runs[name]["evaluate"]["unfiltered"]
        for r in [{"threshold": None, **unfiltered}, *sweep]:
            kept = r["start_vectors"] + r["end_vectors"]
            label = "none" if r["threshold"] is None else f"{r['threshold']:g}"
            print(
                f"| {label} | {kept:,} | {100 * r['kept_fraction']:.1f} | {r['vector_bytes'] / 2**20:.1f} | "
                f"{cells(r, PHRASE)} | {r['passage_recall@20']:.1f} |"
            )
    atomic_write_text(args.out, json.dumps({"runs": runs, "rows": rows, "baselines": passage_rows}, indent=2))


if __name__ == "__main__":
    sys.exit(run_guarded(main, Path(__file__).name))
