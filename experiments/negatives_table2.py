"""Reproduce the negative-contrast paper's Table 2 rows on one dataset under one training budget.

    python experiments/negatives_table2.py --quick --data-dir /work/shared/data      # CPU, a few minutes
    python experiments/negatives_table2.py --model .carry/minilm-l6-fp16 --data-dir .carry/data   # H100

1. Mines one top-``pool_depth`` pool per strategy for the training queries: BM25, coarse (a 25-d
   dual encoder trained on the pairs), fine (512-d), context (same document / half passage); each
   saved as a hard-negatives file under ``--out/pools``.
2. Fine-tunes the same model once per row: Rnd (in-batch negatives only), then +Coarse, +Fine,
   +BM25, +Context from their files and +Mixed (round-robin over the four files), drawing
   ``per_query`` negatives of the pool per query per step.
3. Ensembles the five hard-negative models: embedding fusion (weights tuned on dev) and RRF.

Writes ``table2.md`` and ``table2.json`` (metrics, pool summaries, fusion weights, timings) into --out.
``--subset TRAIN DEV RANDOM`` runs everything on a copy of the dataset with that many train and dev
queries, the whole documents of their positives and RANDOM random passages (written under
--out/subset-data); ``--quick`` is ``--subset 64 32 300`` with a tiny training budget.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from densepass.cli import run_guarded
from densepass.config import ExperimentConfig, load_config
from densepass.data import load_dataset, sample_queries
from densepass.data.dataset import RetrievalDataset
from densepass.device import default_device
from densepass.io import atomic_write_text
from densepass.negatives.mine import MiningContext, mine_negatives
from densepass.negatives.pool import save_pool
from densepass.pipelines.ensemble import EnsembleSettings, evaluate_ensemble
from densepass.pipelines.evalset import eval_qrels
from densepass.pipelines.experiment import run_experiment
from densepass.training.dense_miners import prepare_miners

POOLS = {"coarse": "dense:25", "fine": "dense:512", "bm25": "bm25", "context": "context"}
ROWS = {"Rnd": None, "+Coarse": "coarse", "+Fine": "fine", "+BM25": "bm25", "+Context": "context", "+Mixed": "mixed"}
QUICK = [
    "train.batch_size=16",
    "model.passage_max_length=48",
    "negatives.miner_steps=4",
    "negatives.pool_depth=20",
    "train.log_every=2",
    "eval.batch_size=64",
]


def write_subset_dataset(
    dataset: RetrievalDataset, root: Path, n_train: int, n_dev: int, n_random: int, seed: int
) -> Path:
    """A small BEIR copy: ``n_train``/``n_dev`` sampled queries, the whole documents of their
    positives (so context negatives exist) plus ``n_random`` random passages."""
    rng = random.Random(seed)
    corpus = dataset.corpus
    splits = {
        "train": sample_queries(dataset.split("train"), n_train, seed),
        "dev": sample_queries(dataset.split("dev"), n_dev, seed),
    }
    docs = {corpus.doc_ids[corpus.position(p)] for qrels in splits.values() for rels in qrels.values() for p in rels}
    keep = {r for r, d in enumerate(corpus.doc_ids) if d in docs}
    keep |= set(rng.sample(range(len(corpus)), n_random))
    lines = [
        json.dumps(
            {"_id": corpus.ids[r], "title": corpus.titles[r], "text": corpus.texts[r], "doc_id": corpus.doc_ids[r]}
        )
        for r in sorted(keep)
    ]
    atomic_write_text(root / "corpus.jsonl", "\n".join(lines) + "\n")
    qids = sorted({q for qrels in splits.values() for q in qrels})
    atomic_write_text(
        root / "queries.jsonl", "\n".join(json.dumps({"_id": q, "text": dataset.queries[q]}) for q in qids) + "\n"
    )
    for split, qrels in splits.items():
        rows = [f"{q}\t{p}\t{g}" for q, rels in sorted(qrels.items()) for p, g in rels.items()]
        atomic_write_text(root / "qrels" / f"{split}.tsv", "query-id\tcorpus-id\tscore\n" + "\n".join(rows) + "\n")
    return root


def train_query_ids(config: ExperimentConfig, dataset: RetrievalDataset) -> list[str]:
    """The training queries ``run_experiment`` uses for this config."""
    return sorted(dataset.sample(config.data.train_split, config.data.max_train_queries, config.data.seed))


def mine_pools(config: ExperimentConfig, dataset: RetrievalDataset, out: Path) -> dict[str, dict]:
    """One hard-negatives file per strategy; returns {name: {path, summary, seconds}}."""
    qids = train_query_ids(config, dataset)
    ctx = MiningContext(
        config.data.train_split,
        default_device(),
        work_dir=out / "miners",
        base_model=config.model.name_or_path,
        architecture=config.model.architecture(),
        train_config=config.train,
        seed=config.data.seed,
    )
    pools = {}
    for name, spec in POOLS.items():
        path = out / "pools" / f"{name}.jsonl"
        prepare_miners(dataset, qids, config.negatives, ctx, strategy=spec)
        result = mine_negatives(dataset, qids, config.negatives, ctx, strategy=spec)
        save_pool(result.pool, path)
        pools[name] = {"path": str(path), "summary": result.summary(), "seconds": result.seconds}
        print(f"{name}: {result.summary()}")
    return pools


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/negatives_table2.yaml")
    parser.add_argument("--model", default=None, help="base model (default: the config's)")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--quick", action="store_true", help="a tiny subset and budget, for a CPU check")
    parser.add_argument(
        "--subset",
        nargs=3,
        type=int,
        metavar=("TRAIN", "DEV", "RANDOM"),
        default=None,
        help="run on a copy with TRAIN / DEV sampled queries, the documents of their positives "
        "and RANDOM random passages (a CPU-sized run)",
    )
    parser.add_argument("--out", default=None, help="default: outputs/negatives-table2[-quick]")
    args = parser.parse_args()
    out = Path(args.out or ("outputs/negatives-table2-quick" if args.quick else "outputs/negatives-table2"))
    subset = (64, 32, 300) if args.quick and args.subset is None else args.subset
    overrides = list(args.set)
    if args.model:
        overrides.append(f"model.name_or_path={args.model}")
    if args.data_dir:
        overrides.append(f"data.data_dir={args.data_dir}")
    base = load_config(args.config, overrides)
    if subset is not None:
        full = load_dataset(base.data.name, base.data.data_dir, base.data.format)
        root = write_subset_dataset(
            full, out / "subset-data" / f"{base.data.name}-{'-'.join(map(str, subset))}", *subset, base.data.seed
        )
        overrides += [
            *(QUICK if args.quick else []),
            "data.max_train_queries=null",
            f"data.name={root.resolve()}",
            "data.data_dir=null",
        ]
    overrides.append(f"output_dir={out / 'runs'}")
    base = load_config(args.config, overrides)
    dataset = load_dataset(base.data.name, base.data.data_dir, base.data.format)
    timings = {}
    started = time.perf_counter()
    pools = mine_pools(base, dataset, out)
    timings["mining_s"] = time.perf_counter() - started

    results, model_dirs = {}, {}
    for label, pool in ROWS.items():
        slug = "rnd" if pool is None else pool
        if pool is None:
            row = ["negatives.source=none", "negatives.per_query=0"]
        elif pool == "mixed":
            files = [f"file:{p['path']}" for p in pools.values()]
            row = ["negatives.source=mixed", f"negatives.mix={json.dumps(files)}"]
        else:
            row = ["negatives.source=file", f"negatives.file={pools[pool]['path']}"]
        config = load_config(args.config, [*overrides, *row, f"name={slug}"])
        started = time.perf_counter()
        results[label] = run_experiment(config)["fine-tuned"]
        timings[f"{slug}_s"] = time.perf_counter() - started
        model_dirs[label] = str(config.run_dir / "model")

    members = [label for label in ROWS if label != "Rnd"]
    started = time.perf_counter()
    settings = EnsembleSettings(
        split=base.data.eval_split,
        metrics=base.eval.metrics,
        depth=base.eval.depth,
        max_queries=base.data.max_eval_queries,
        seed=base.data.seed,
        batch_size=base.eval.batch_size,
        precision=base.eval.precision,
    )
    qrels, _ = eval_qrels(dataset, base.data)  # the queries the rows were evaluated on (data.eval_part's)
    ensemble = evaluate_ensemble(dataset, [model_dirs[m] for m in members], settings, members, qrels)
    timings["ensemble_s"] = time.perf_counter() - started
    results["Ensemble (embedding)"] = ensemble["results"]["ensemble (embedding)"]
    results["Ensemble (rank)"] = ensemble["results"]["ensemble (rank)"]

    metrics = base.eval.metrics
    n_train = len(train_query_ids(base, dataset))
    lines = [
        f"negative-contrast Table 2 on `{base.data.name}`: {n_train} train queries, "
        f"{ensemble['queries']} {base.data.eval_split} queries over {len(dataset.corpus)} passages; "
        f"{base.train.epochs} epoch(s) of batch {base.train.batch_size}, {base.negatives.per_query} of the "
        f"top-{base.negatives.pool_depth} per query per step.",
        "",
        "| row | " + " | ".join(metrics) + " |",
        "|---|" + "---:|" * len(metrics),
    ]
    for label, values in results.items():
        lines.append(f"| {label} | " + " | ".join(f"{values[m]:.4f}" for m in metrics) + " |")
    lines += [
        "",
        f"Embedding-fusion weights (tuned on every {base.data.eval_split} query, "
        f"{ensemble.get('evaluations', 0)} evaluations with its folds'): "
        + ", ".join(f"{k} {v:g}" for k, v in ensemble["weights"].items())
        + f". Its row is cross-fitted: each of {settings.folds} seeded folds of the queries scored with the weights "
        "tuned on the others ("
        + "; ".join(", ".join(f"{k} {v:g}" for k, v in w.items()) for w in ensemble["fold_weights"])
        + ").",
        "",
        "Pools: " + "; ".join(f"{k}: {v['summary']}" for k, v in pools.items()),
        "",
        "Timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()),
    ]
    atomic_write_text(out / "table2.md", "\n".join(lines) + "\n")
    atomic_write_text(
        out / "table2.json",
        json.dumps(
            {"results": results, "ensemble": ensemble, "pools": pools, "timings": timings, "train_queries": n_train},
            indent=2,
        ),
    )
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(run_guarded(main, Path(__file__).name))
