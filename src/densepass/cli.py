"""Command line: ``densepass run CONFIG``, ``mine``, ``ensemble``, ``pretrain CONFIG``, ``index``,
``evaluate``, ``analyze-attention``, ``validate-study``, ``download``."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from densepass.errors import DensepassError


def _run(args: argparse.Namespace) -> None:
    from densepass.config import load_config
    from densepass.runs.experiment import run_experiment

    config = load_config(args.config, args.set)
    run_experiment(config)
    print(f"report: {config.run_dir / 'report.md'}")


def _pretrain(args: argparse.Namespace) -> None:
    from densepass.config import load_config
    from densepass.pretraining.config import PretrainConfig
    from densepass.pretraining.trainer import pretrain

    config = load_config(args.config, args.set, PretrainConfig)
    result = pretrain(config)
    print(f"backbone: {result.backbone_path}\nreport: {config.run_dir / 'report.md'}")


def _analyze_attention(args: argparse.Namespace) -> None:
    from densepass.analysis.attention import attention_entropy, entropy_table, plot_entropy, sample_passages
    from densepass.data import load_dataset
    from densepass.errors import ConfigError
    from densepass.index.encode import default_device
    from densepass.io import atomic_write_text

    labels = args.labels or args.models
    if len(labels) != len(args.models):
        raise ConfigError(f"--labels gives {len(labels)} names for {len(args.models)} models")
    dataset = load_dataset(args.dataset, args.data_dir, args.format)
    texts = sample_passages(dataset.corpus, args.samples, args.seed, "[SEP]")
    device = default_device()
    results = {label: attention_entropy(model, texts, args.max_length, device=device)
               for label, model in zip(labels, args.models)}
    plot_entropy(results, args.out, f"CLS attention entropy, {len(texts)} {dataset.name} passages")
    atomic_write_text(Path(args.out).with_suffix(".json"), json.dumps(results, indent=2))
    print(entropy_table(results))
    print(f"plot: {args.out}")


def _index(args: argparse.Namespace) -> None:
    from densepass.data import load_dataset
    from densepass.index.encode import encode_to_memmap
    from densepass.index.faiss_index import build_faiss_index, save_faiss_index
    from densepass.models.biencoder import BiEncoder

    dataset = load_dataset(args.dataset, args.data_dir, args.format)
    model = BiEncoder.from_pretrained(args.model)
    out = Path(args.output)
    emb = encode_to_memmap(model, dataset.corpus.passage_inputs(model.tokenizer.sep_token or " "), "passage",
                           out / "embeddings.npy", batch_size=args.batch_size)
    (out / "ids.json").write_text(json.dumps(dataset.corpus.ids))
    if args.kind != "exact":
        save_faiss_index(build_faiss_index(emb, args.kind), out / f"{args.kind}.index")
    print(f"indexed {len(emb)} passages into {out}")


def _evaluate(args: argparse.Namespace) -> None:
    from densepass.data import load_dataset
    from densepass.evaluation.metrics import (
        answered_queries,
        check_metrics,
        evaluate_run,
        paired_significance,
        read_trec_run,
        split_metrics,
    )

    check_metrics(args.metrics)
    ranx_metrics, accuracy_ks = split_metrics(args.metrics)
    dataset = load_dataset(args.dataset, args.data_dir, args.format)
    qrels = dataset.split(args.split)
    answered_queries(qrels, dataset.answers, args.metrics)  # accuracy@k without answers fails before reading runs
    run = read_trec_run(args.run, dataset.corpus)
    # a bad baseline file fails before evaluating
    baseline = read_trec_run(args.compare_to, dataset.corpus) if args.compare_to else None
    passages = dict(zip(dataset.corpus.ids, dataset.corpus.texts)) if accuracy_ks else None
    result = evaluate_run(qrels, run, args.metrics, dataset.answers, passages)
    if baseline is not None:
        runs = {"run": run, "baseline": baseline}
        result = {"run": result, "baseline": evaluate_run(qrels, baseline, args.metrics, dataset.answers, passages),
                  "paired_fisher": {m: paired_significance(qrels, runs, "baseline", m)["run"] for m in ranx_metrics}}
    print(json.dumps(result, indent=2))


def _validate_study(args: argparse.Namespace) -> None:
    from densepass.data import load_dataset
    from densepass.runs.study import expand_checkpoints, run_study

    dataset = load_dataset(args.dataset, args.data_dir, args.format)
    run_study(dataset, expand_checkpoints(args.checkpoints), args.split, args.r, args.k, args.retriever,
              args.metric, args.max_queries, args.seed, Path(args.output), args.corpus_fraction)


def _mine(args: argparse.Namespace) -> None:
    from densepass.config import load_config
    from densepass.data import load_dataset, sample_queries
    from densepass.index.encode import default_device
    from densepass.models.biencoder import BiEncoderConfig
    from densepass.negatives.mine import MiningContext, mine_negatives
    from densepass.negatives.pool import save_pool

    options = {"negatives.source": args.strategy, "negatives.pool_depth": args.depth, "negatives.model": args.model,
               "negatives.file": args.file, "negatives.filters": args.filters, "negatives.mix": args.mix,
               "negatives.dense_dim": args.dense_dim, "negatives.miner_steps": args.miner_steps,
               "negatives.cross_encoder": args.cross_encoder,
               "negatives.cross_encoder_threshold": args.cross_encoder_threshold,
               "data.name": args.dataset, "data.data_dir": args.data_dir, "data.max_train_queries": args.max_queries}
    overrides = [f"{key}={json.dumps(value)}" for key, value in options.items() if value is not None]
    config = load_config(args.config, [*overrides, *args.set])
    data = config.data
    dataset = load_dataset(data.name, data.data_dir, data.format)
    positives = dataset.positives(data.train_split)
    query_ids = sorted(q for q in sample_queries(dataset.split(data.train_split), data.max_train_queries, data.seed)
                       if q in positives)
    device = default_device()
    arch = BiEncoderConfig(**{k: getattr(config.model, k) for k in BiEncoderConfig.__dataclass_fields__})
    output = Path(args.output)
    ctx = MiningContext(data.train_split, device, work_dir=output.with_name(output.name + ".miners"),
                        base_model=config.model.name_or_path, architecture=arch, train_config=config.train,
                        seed=data.seed)
    print(f"mining {config.negatives.source} negatives for {len(query_ids)} {data.train_split} queries of "
          f"{data.name} on {device.type}", file=sys.stderr)
    result = mine_negatives(dataset, query_ids, config.negatives, ctx)
    save_pool(result.pool, output)
    _print_mining_summary(result, output)


def _print_mining_summary(result, output: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"hard negatives -> {output}")
    table.add_column("")
    table.add_column("count", justify="right")
    for source, count in result.source_counts.items():
        table.add_row(f"source {source}", str(count))
    for name, count in result.removed.items():
        table.add_row(f"removed by {name}", str(count))
    Console().print(table)
    print(result.summary())


def _ensemble(args: argparse.Namespace) -> None:
    from densepass.data import load_dataset
    from densepass.io import atomic_write_text
    from densepass.runs.ensemble import evaluate_ensemble
    from densepass.runs.report import print_table

    dataset = load_dataset(args.dataset, args.data_dir, args.format)
    methods = ["embedding", "rrf"] if args.method == "both" else [args.method]
    out = evaluate_ensemble(dataset, args.models, methods, args.split, metrics=args.metrics, depth=args.depth,
                            max_queries=args.max_queries, tune_metric=args.tune_metric, rrf_k=args.rrf_k)
    print_table(out["results"], args.metrics, f"{args.dataset} {args.split}: {out['queries']} queries")
    if "weights" in out:
        print("embedding-fusion weights:", json.dumps(out["weights"]))
    if args.out:
        atomic_write_text(args.out, json.dumps(out, indent=2))


def _download(args: argparse.Namespace) -> None:
    from densepass.data.download import download_dataset
    from densepass.data.paths import default_data_dir

    print(download_dataset(args.name, args.data_dir or default_data_dir()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="densepass", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment (train, index, evaluate, report) from a YAML/JSON config")
    run.add_argument("config", nargs="?", help="config file (default: built-in defaults)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set train.batch_size=32")
    run.set_defaults(func=_run)

    pretrain = sub.add_parser("pretrain", help="MLM / Condenser / coCondenser pre-training from a YAML/JSON config")
    pretrain.add_argument("config", nargs="?", help="config file (default: built-in defaults)")
    pretrain.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                          help="override a config value, e.g. --set model.mode=cocondenser")
    pretrain.set_defaults(func=_pretrain)

    def data_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("dataset", help="dataset name under the data dir, or a path")
        p.add_argument("--data-dir", default=None, help="data directory (default: $DENSEPASS_DATA or ../shared/data)")
        p.add_argument("--format", default="beir", choices=["beir", "msmarco", "dpr", "squad"])

    index = sub.add_parser("index", help="encode a corpus (sharded, resumable) and build an index")
    data_args(index)
    index.add_argument("--model", default="all-MiniLM-L6-v2")
    index.add_argument("--output", required=True)
    index.add_argument("--kind", default="exact", choices=["exact", "faiss-flat", "faiss-hnsw", "faiss-ivfpq"])
    index.add_argument("--batch-size", type=int, default=256)
    index.set_defaults(func=_index)

    evaluate = sub.add_parser("evaluate", help="evaluate a TREC run file against a split's qrels")
    data_args(evaluate)
    evaluate.add_argument("run", help="TREC run file")
    evaluate.add_argument("--split", default="dev")
    evaluate.add_argument("--metrics", nargs="+", default=["mrr@10", "ndcg@10", "recall@100"])
    evaluate.add_argument("--compare-to", metavar="BASELINE_RUN",
                          help="also evaluate this run and test the difference (paired Fisher randomization test)")
    evaluate.set_defaults(func=_evaluate)

    attention = sub.add_parser("analyze-attention", help="CLS attention entropy per layer of saved models (one plot)")
    attention.add_argument("models", nargs="+", help="saved models (any AutoModel directory or name)")
    attention.add_argument("--out", required=True, help="PNG path (the numbers go to the same path with .json)")
    attention.add_argument("--labels", nargs="*", default=None, help="legend names, one per model")
    attention.add_argument("--dataset", default="debian-packages", help="corpus to sample passages from")
    attention.add_argument("--data-dir", default=None)
    attention.add_argument("--format", default="beir", choices=["beir", "msmarco", "dpr", "squad"])
    attention.add_argument("--samples", type=int, default=1000, help="passages averaged over")
    attention.add_argument("--max-length", type=int, default=128)
    attention.add_argument("--seed", type=int, default=13)
    attention.set_defaults(func=_analyze_attention)

    study = sub.add_parser("validate-study", help="compare validation subcorpora (C0, R_r, H_k) with the full corpus")
    data_args(study)
    study.add_argument("--checkpoints", nargs="+", required=True, help="saved models or run directories")
    study.add_argument("--split", default="dev")
    study.add_argument("--r", type=float, nargs="*", default=[0.01, 0.1, 0.3], help="random subcorpus fractions")
    study.add_argument("--k", type=int, nargs="*", default=[10, 50], help="hard subcorpus depths")
    study.add_argument("--retriever", default="bm25", help="'bm25' or a saved model for H_k")
    study.add_argument("--metric", default="mrr@10")
    study.add_argument("--max-queries", type=int, default=None)
    study.add_argument("--corpus-fraction", type=float, default=None,
                       help="stand in for the full corpus with C0 + this random fraction of it (for a CPU)")
    study.add_argument("--seed", type=int, default=13)
    study.add_argument("--output", required=True)
    study.set_defaults(func=_validate_study)

    mine = sub.add_parser("mine", help="mine a hard-negatives file for the training queries")
    mine.add_argument("config", nargs="?", help="experiment config (its data, model, negatives, train sections)")
    mine.add_argument("--output", required=True, help="hard-negatives file to write (JSONL)")
    mine.add_argument("--dataset", default=None, help="dataset name under the data dir, or a path")
    mine.add_argument("--data-dir", default=None)
    mine.add_argument("--strategy", default=None, choices=["bm25", "dense", "model", "context", "mixed", "file"])
    mine.add_argument("--depth", type=int, default=None, help="candidates kept per query (pool depth)")
    mine.add_argument("--model", default=None, help="saved model for --strategy model")
    mine.add_argument("--file", default=None, help="hard-negatives file for --strategy file (re-filter it)")
    mine.add_argument("--dense-dim", type=int, default=None, help="projection of the dense miner (25 coarse, 512 fine)")
    mine.add_argument("--miner-steps", type=int, default=None, help="training steps of the dense miner")
    mine.add_argument("--mix", nargs="+", default=None, help="strategies for --strategy mixed, e.g. bm25 context dense:25")
    mine.add_argument("--filters", nargs="+", default=None, help="qrels answers duplicates cross-encoder")
    mine.add_argument("--cross-encoder", default=None, help="sentence-transformers CrossEncoder for that filter")
    mine.add_argument("--cross-encoder-threshold", type=float, default=None)
    mine.add_argument("--max-queries", type=int, default=None, help="a seeded subset of the training queries")
    mine.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    mine.set_defaults(func=_mine)

    ensemble = sub.add_parser("ensemble", help="evaluate embedding fusion and/or RRF of saved models")
    data_args(ensemble)
    ensemble.add_argument("--models", nargs="+", required=True, help="saved models (at least two)")
    ensemble.add_argument("--method", default="both", choices=["embedding", "rrf", "both"])
    ensemble.add_argument("--split", default="dev")
    ensemble.add_argument("--metrics", nargs="+",
                          default=["mrr@10", "ndcg@10", "recall@1", "recall@5", "recall@20", "recall@100"])
    ensemble.add_argument("--depth", type=int, default=100)
    ensemble.add_argument("--max-queries", type=int, default=None)
    ensemble.add_argument("--tune-metric", default="mrr@10", help="metric the fusion weights maximise")
    ensemble.add_argument("--rrf-k", type=int, default=60)
    ensemble.add_argument("--out", default=None, help="write the results as JSON here")
    ensemble.set_defaults(func=_ensemble)

    download = sub.add_parser("download", help="download a public BEIR dataset or SQuAD (needs internet)")
    download.add_argument("name")
    download.add_argument("--data-dir", default=None)
    download.set_defaults(func=_download)
    return parser


def run_guarded(func: Callable[[], object], prog: str = "densepass") -> int:
    """Run ``func`` and turn densepass errors and Ctrl-C into a one-line message and an exit code."""
    try:
        func()
    except DensepassError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (re-run the same command to resume)", file=sys.stderr)
        return 130
    return 0


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    """``warnings.showwarning`` for the command line: one line, ``densepass: warning: ...``, no source line."""
    print(f"densepass: warning: {message}", file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():  # restores the usual warning display when main returns
        warnings.showwarning = _show_warning
        return run_guarded(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
