"""Command line: ``densepass run CONFIG``, ``config``, ``index``, ``search``, ``serve``, ``evaluate``, ``mine``,
``ensemble``, ``pretrain CONFIG``, ``phrase CONFIG``, ``analyze-attention``, ``validate-study``, ``download``.

Flags mean the same everywhere: a dataset is the first positional argument, ``--output`` is what a
command writes, ``--data-dir`` / ``--format`` say where and how the dataset is stored, ``--device`` where
models run. Every command validates its arguments before it starts working.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from densepass.config import DEFAULT_METRICS, DEFAULT_MODEL, DENSE_INDEX_KINDS, FORMATS, ONDISK_INDEX_KIND, PRECISIONS
from densepass.errors import ConfigError, DensepassError

INDEX_KINDS = (*DENSE_INDEX_KINDS, ONDISK_INDEX_KIND, "bm25", "hybrid", "splade", "colbert", "phrase")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


RERANK_PRECISION_HELP = (
    "reranker precision: fp32, bf16, int8 (cross-encoders, CPU only: BERT-style encoders on int8 products with a "
    "scale per token where AVX512-BF16 and -VNNI run densepass's kernels, dynamic quantisation otherwise) or auto "
    "(bf16 where the device computes it natively, else fp32)"
)


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


# ---- commands ------------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> None:
    from densepass.config import load_config
    from densepass.pipelines.experiment import run_experiment

    config = load_config(args.config, args.set)
    run_experiment(config, restart=args.restart)
    print(f"report: {config.run_dir / 'report.md'}")


def _config(args: argparse.Namespace) -> None:
    import yaml

    from densepass.config import ExperimentConfig, explain, export_config, load_config, to_dict
    from densepass.phrase.config import PhraseConfig
    from densepass.pretraining.config import PretrainConfig

    if args.pretrain and args.phrase:
        raise ConfigError("--pretrain and --phrase name two kinds of config: give one")
    cls = PretrainConfig if args.pretrain else PhraseConfig if args.phrase else ExperimentConfig
    given = [flag for flag, value in (("CONFIG", args.config), ("--set", args.set), ("--output", args.output)) if value]
    if args.explain and given:  # --explain lists every key of the kind: it reads and writes nothing
        raise ConfigError(f"--explain lists the keys of a kind of config; drop {', '.join(given)}")
    if args.explain:
        for key, kind, default, meaning in explain(cls):
            print(f"{key}  ({kind}; default {default})\n    {meaning}")
        return
    config = load_config(args.config, args.set, cls)
    if cls is ExperimentConfig:  # what `densepass run` runs: the starting model's saved architecture filled in
        from densepass.pipelines.retrievers import with_saved_architecture

        config = with_saved_architecture(config)
    if args.output:
        export_config(config, args.output)
    else:
        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")


def _pretrain(args: argparse.Namespace) -> None:
    from densepass import distributed
    from densepass.config import load_config
    from densepass.pretraining.config import PretrainConfig
    from densepass.pretraining.trainer import pretrain

    config = load_config(args.config, args.set, PretrainConfig)
    with distributed.process_group():  # under torchrun: every process trains, rank 0 writes
        main = distributed.rank() == 0
        result = pretrain(config, restart=args.restart)
    if main:
        print(f"backbone: {result.backbone_path}\nreport: {config.run_dir / 'report.md'}")


def _phrase(args: argparse.Namespace) -> None:
    from densepass import distributed
    from densepass.config import load_config
    from densepass.phrase.config import PhraseConfig
    from densepass.phrase.experiment import run_phrase

    config = load_config(args.config, args.set, PhraseConfig)
    with distributed.process_group():  # under torchrun: every process trains, rank 0 writes and runs the rest
        main = distributed.rank() == 0
        run_phrase(config, restart=args.restart)
    if main:
        print(f"report: {config.run_dir / 'report.md'}\nindex: {config.run_dir / 'index'}")


def _index(args: argparse.Namespace) -> None:
    from densepass import distributed
    from densepass.device import resolve_device
    from densepass.index.ondisk import IVFPQOptions
    from densepass.pipelines.indexing import IndexSettings, index_dataset

    nprobe = {} if args.nprobe is None else {"nprobe": args.nprobe}  # else each kind's own default
    hybrid_flags = {"--dense-kind": args.dense_kind, "--fusion": args.fusion, "--fusion-weight": args.fusion_weight}
    given = [flag for flag, value in hybrid_flags.items() if value is not None]
    if given and args.kind != "hybrid":  # (they were ignored)
        raise ConfigError(f"{', '.join(given)}: options of --kind hybrid, not of --kind {args.kind}")
    if args.fusion_weight is not None and (args.fusion or "rrf") == "rrf":
        raise ConfigError("--fusion-weight weighs --fusion linear; rrf fuses ranks, without a weight")
    check_kind_options(args)
    if args.rescore_multiplier is not None and args.embedding_precision != "fp32":
        from densepass.index.binary import CompactIndex, compact_kind

        compact = compact_kind(
            args.embedding_precision, args.dense_kind or "exact" if args.kind == "hybrid" else args.kind
        )
        if not CompactIndex.rescores(compact, args.rescore_with or "float"):
            raise ConfigError(
                f"--rescore-multiplier: the {compact} index built with --rescore-with {args.rescore_with}"
                " re-scores none"
            )
    settings = IndexSettings(
        args.kind,
        args.model,
        args.dense_kind or "exact",
        args.fusion or "rrf",
        0.5 if args.fusion_weight is None else args.fusion_weight,
        args.batch_size,
        args.shard_size,
        resolve_device(args.device),
        sparse_model=args.sparse_model,
        retriever=_retriever_options(args),
        threshold=args.filter_threshold,
        precision=args.precision,
        ivf=IVFPQOptions(args.ivf_lists, args.pq_m, args.pq_bits or 8, args.train_size, **nprobe),
        dim=args.dim,
        embedding_precision=args.embedding_precision,
        rescore_with=args.rescore_with or "float",
        rescore_multiplier=args.rescore_multiplier or 4,
    )
    with distributed.process_group():  # under torchrun: one shard per process, rank 0 writes the index
        index, name = index_dataset(args.dataset, args.data_dir, args.format, args.output, settings, args.force)
    if index is not None:
        memory = getattr(index, "memory_bytes", None)  # int8 / binary: what a loaded index holds in RAM
        held = f"; {memory() / len(index):.1f} bytes per passage in RAM" if memory is not None and len(index) else ""
        print(f"indexed {len(index):,} passages of {name} into {args.output} ({index.kind}{held})")


def _index_update(args: argparse.Namespace) -> None:
    from densepass.device import resolve_device
    from densepass.index.living import update_saved_index

    options = {"batch_size": args.batch_size, "precision": args.precision, "device": resolve_device(args.device)}
    index = update_saved_index(args.index, args.delete, args.upsert, args.compact, model=args.model, **options)
    if index is None:
        print(f"nothing to compact in {args.index}: it holds no deleted passages (no new version written)")
        return
    tombstones = len(index.passages) - len(index)
    waiting = f", {tombstones:,} deleted awaiting --compact" if tombstones else ""
    print(f"updated {args.index} to version {index.version}: {len(index):,} passages{waiting}")


def check_kind_options(args: argparse.Namespace) -> None:
    """``densepass index``'s options of one kind, refused for another (they were ignored in silence): SPLADE's
    pruning, ColBERT's storage and search, the inverted lists of the on-disk IVF-PQ (a hybrid's dense part too)."""
    encoded = (args.dense_kind or "exact") if args.kind == "hybrid" else args.kind
    ivf = {"--ivf-lists": args.ivf_lists, "--pq-m": args.pq_m, "--pq-bits": args.pq_bits}
    ivf["--train-size"] = args.train_size
    owners = {
        "--top-terms": (args.top_terms, args.kind in ("splade", "hybrid"), "--kind splade"),
        "--compression": (args.compression, args.kind == "colbert", "--kind colbert"),
        "--residual-bits": (args.residual_bits, args.kind == "colbert", "--kind colbert"),
        "--candidates": (args.candidates, args.kind == "colbert", "--kind colbert"),
        **{flag: (value, encoded == ONDISK_INDEX_KIND, f"--kind {ONDISK_INDEX_KIND}") for flag, value in ivf.items()},
        "--nprobe": (
            args.nprobe,
            args.kind == "colbert" or encoded == ONDISK_INDEX_KIND,
            f"--kind colbert and --kind {ONDISK_INDEX_KIND}",
        ),
    }
    for flag, (value, applies, whose) in owners.items():
        if value is not None and not applies:
            raise ConfigError(f"{flag}: an option of {whose}, not of --kind {args.kind}")
    if args.residual_bits is not None and args.compression != "residual":
        raise ConfigError("--residual-bits sets --compression residual's bits; give --compression residual")


def _retriever_options(args: argparse.Namespace):
    """SPLADE pruning and ColBERT storage / search options of ``densepass index``, as a model section."""
    from densepass.config import ColbertConfig, ModelConfig, SpladeConfig

    nprobe = {} if args.nprobe is None else {"nprobe": args.nprobe}
    colbert = ColbertConfig(
        compression=args.compression or "fp16",
        residual_bits=args.residual_bits or 2,
        candidates=args.candidates or 256,
        **nprobe,
    )
    return ModelConfig(splade=SpladeConfig(index_top_terms=args.top_terms), colbert=colbert)


def _load_pipeline(args: argparse.Namespace):
    from densepass.pipelines.search import SearchPipeline

    return SearchPipeline.load(
        args.index,
        args.rerank,
        args.rerank_depth,
        model=args.model,
        device=args.device,
        precision=args.precision,
        search_precision=args.search_precision,
        rescore=args.rescore,
        nprobe=args.nprobe,
        hybrid=args.hybrid,
        fusion_weight=args.fusion_weight,
        rerank_batch_size=args.rerank_batch_size,
        rerank_precision=args.rerank_precision,
        rerank_fuse_weight=args.rerank_fuse_weight,
        **{k: getattr(args, k) for k in ("rescore_with", "rescore_multiplier") if getattr(args, k) is not None},
    )


def _rerank(args: argparse.Namespace) -> None:
    from densepass.pipelines.search import rerank_run_file

    summary = rerank_run_file(
        args.dataset,
        args.run,
        args.model,
        args.output,
        data_dir=args.data_dir,
        format=args.format,
        depth=args.depth,
        k=args.k,
        fuse_weight=args.fuse_weight,
        device=args.device,
        batch_size=args.batch_size,
        precision=args.precision,
        tag=args.tag,
        cache_dir=args.cache_dir,
        queries=args.queries,
    )
    print(json.dumps(summary))


def _search(args: argparse.Namespace) -> None:
    from densepass.errors import ConfigError

    if (args.query is None) == (args.queries is None):
        raise ConfigError("give either one QUERY or --queries FILE")
    if args.queries is not None and not args.output:
        raise ConfigError("--queries needs --output (a TREC run file)")
    if args.query is not None and args.output:
        raise ConfigError("--output writes the TREC run of --queries FILE; one QUERY's hits are printed")
    from densepass.evaluation.metrics import check_run_file, write_trec_run
    from densepass.pipelines.search import check_query, read_queries

    if args.query is not None:  # before the index and model load
        check_query(args.query, "the query")
    else:
        check_run_file(args.output, args.tag)
        ids, texts = read_queries(args.queries)
    pipeline = _load_pipeline(args)
    if args.query is not None:
        _print_hits(args.query, pipeline.search(args.query, args.k))
        return
    run = pipeline.results(texts, args.k).as_run(ids)
    write_trec_run(run, args.output, tag=args.tag)
    deepest = max((len(hits) for hits in run.values()), default=0)  # the index may hold fewer than --k
    print(f"{len(ids):,} queries searched, top {min(args.k, deepest) if run else args.k} each -> {args.output}")


def _print_hits(query: str, hits) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{query!r}: {len(hits)} hits")
    answers = any(hit.answer is not None for hit in hits)  # a phrase index: the answer and its character span
    columns = [("rank", "right"), ("score", "right"), *([("answer", "left"), ("span", "right")] if answers else [])]
    for column, justify in (*columns, ("id", "left"), ("title", "left"), ("text", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    for rank, hit in enumerate(hits, 1):
        text = hit.text if len(hit.text) <= 160 else hit.text[:157] + "..."
        span = [hit.answer, f"{hit.start}-{hit.end}"] if answers else []
        table.add_row(str(rank), f"{hit.score:.4f}", *span, hit.id, hit.title, text)
    Console().print(table)


def _serve(args: argparse.Namespace) -> None:
    from densepass.serve import run_server, settings_from_args
    from densepass.serve.reload import check_reload_arguments
    from densepass.serve.settings import (
        check_access_log,
        check_address,
        check_can_listen,
        exposure_warning,
        serve_api_key,
    )

    settings = settings_from_args(args)  # checked before the index is loaded, and so are the address and port
    check_address(args.host, args.port)
    check_access_log(args.access_log)
    exposed = exposure_warning(args.host, args.port)
    if exposed and serve_api_key(args.api_key) is None:
        print(f"densepass: warning: {exposed}", file=sys.stderr)
    check_can_listen(args.host, args.port)
    key = serve_api_key(args.api_key)
    token = check_reload_arguments(args)
    access_log = None if args.access_log == "off" else args.access_log
    if args.workers > 1:  # each worker loads the index; here only its manifest is checked (without torch)
        from densepass.io import read_manifest
        from densepass.serve.app import run_workers

        read_manifest(Path(args.index), "densepass index")
        where = f"http://{args.host}:{args.port}"
        print(f"densepass: serving {args.index} with {args.workers} worker processes on {where}", file=sys.stderr)
        run_workers(
            "densepass.cli:serve_worker_app", args.argv, args.workers, args.host, args.port, settings, api_key=key
        )
        return
    pipeline = _serving_pipeline(args, reloads=token is not None or args.watch_index is not None)
    print(f"densepass: serving {json.dumps(pipeline.describe())} on http://{args.host}:{args.port}", file=sys.stderr)
    run_server(pipeline, args.host, args.port, settings, api_key=key, access_log=access_log, admin_token=token)


def _serving_pipeline(args: argparse.Namespace, reloads: bool):
    """The pipeline ``serve`` answers with: reloadable (``serve.reload``) with an admin token or ``--watch-index``."""
    if not reloads:
        return _load_pipeline(args)
    from densepass.serve.reload import ReloadableSearcher

    searcher = ReloadableSearcher(lambda: _load_pipeline(args), args.index)
    if args.watch_index is not None:
        searcher.watch(args.watch_index)
    return searcher


def serve_worker_app():
    """The app of one worker process of ``serve --workers N`` (uvicorn calls it in each process it starts): the
    index and models loaded from the command's own arguments."""
    from densepass.errors import DensepassError
    from densepass.serve import settings_from_args
    from densepass.serve.app import worker_app, worker_argv, worker_failed

    args = build_parser().parse_args(worker_argv())
    access_log = None if args.access_log == "off" else args.access_log
    try:  # a model or index that does not load stops the service in one line (not a worker restarted forever)
        pipeline = _serving_pipeline(args, reloads=args.watch_index is not None)
    except DensepassError as err:
        worker_failed(err)
    return worker_app(pipeline, settings_from_args(args), args.host, access_log)


def _evaluate(args: argparse.Namespace) -> None:
    from densepass.data import load_dataset
    from densepass.evaluation.metrics import (
        answered_qrels,
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
    qrels = answered_qrels(qrels, [run] + ([baseline] if baseline else []), args.all_queries)
    passages = dict(zip(dataset.corpus.ids, dataset.corpus.texts)) if accuracy_ks else None
    result = evaluate_run(qrels, run, args.metrics, dataset.answers, passages)
    if baseline is not None:
        runs = {"run": run, "baseline": baseline}
        result = {
            "run": result,
            "baseline": evaluate_run(qrels, baseline, args.metrics, dataset.answers, passages),
            "paired_fisher": {m: paired_significance(qrels, runs, "baseline", m)["run"] for m in ranx_metrics},
        }
    print(json.dumps(result, indent=2))


def _analyze_attention(args: argparse.Namespace) -> None:
    from densepass.analysis.attention import analyze_attention, entropy_table

    results = analyze_attention(
        args.models,
        args.output,
        args.dataset,
        labels=args.labels,
        data_dir=args.data_dir,
        format=args.format,
        samples=args.samples,
        max_length=args.max_length,
        seed=args.seed,
        device=args.device,
    )
    print(entropy_table(results))
    print(f"plot: {args.output}")


def _validate_study(args: argparse.Namespace) -> None:
    from densepass.pipelines.study import StudySettings, validate_study

    settings = StudySettings(
        args.split, args.r, args.k, args.retriever, args.metric, args.max_queries, args.seed, args.corpus_fraction
    )
    validate_study(args.dataset, args.checkpoints, args.output, settings, args.data_dir, args.format)


def check_mine_options(args: argparse.Namespace, negatives) -> None:
    """``densepass mine``'s options of one strategy or filter, refused where the strategy mined (``--strategy``,
    else the config's ``negatives.source``) or the filters run do not use them: they were ignored in silence."""
    from densepass.negatives.mine import dense_specs, strategy_specs

    specs = {s.partition(":")[0] for s in strategy_specs(negatives)}
    filters = set(negatives.filters)
    margin = "relative-margin" in filters
    bi_encoder_teacher = margin and negatives.relative_teacher == "bi-encoder"
    owners = {
        "--model": (args.model, "model" in specs or bi_encoder_teacher, "--strategy model (or mixed with model)"),
        "--file": (args.file, "file" in strategy_specs(negatives), "--strategy file (or mixed with file)"),
        "--mix": (args.mix, negatives.source == "mixed", "--strategy mixed"),
        "--dense-dim": (args.dense_dim, "dense" in dense_specs(negatives), "--strategy dense (or mixed with dense)"),
        "--miner-steps": (args.miner_steps, bool(dense_specs(negatives)), "--strategy dense (or mixed with dense)"),
        "--cross-encoder": (
            args.cross_encoder,
            "cross-encoder" in filters or (margin and not bi_encoder_teacher),
            "--filters cross-encoder (or relative-margin)",
        ),
        "--cross-encoder-threshold": (
            args.cross_encoder_threshold,
            "cross-encoder" in filters,
            "--filters cross-encoder",
        ),
    }
    for flag, (value, applies, whose) in owners.items():
        if value is not None and not applies:
            used = f"--strategy {negatives.source}, --filters {' '.join(negatives.filters) or '(none)'}"
            raise ConfigError(f"{flag}: an option of {whose}, unused by this mining ({used})")


def _mine(args: argparse.Namespace) -> None:
    from densepass import distributed
    from densepass.config import load_config
    from densepass.pipelines.mine_command import mine_training_negatives

    options = {
        "negatives.source": args.strategy,
        "negatives.pool_depth": args.depth,
        "negatives.model": args.model,
        "negatives.file": args.file,
        "negatives.filters": args.filters,
        "negatives.mix": args.mix,
        "negatives.dense_dim": args.dense_dim,
        "negatives.miner_steps": args.miner_steps,
        "negatives.cross_encoder": args.cross_encoder,
        "negatives.cross_encoder_threshold": args.cross_encoder_threshold,
        "data.name": args.dataset,
        "data.data_dir": args.data_dir,
        "data.format": args.format,
        "data.max_train_queries": args.max_queries,
        "device": args.device,
    }
    overrides = [f"{key}={json.dumps(value)}" for key, value in options.items() if value is not None]
    config = load_config(args.config, [*overrides, *args.set])
    check_mine_options(args, config.negatives)
    output = Path(args.output)
    with distributed.process_group():  # under torchrun: dense mining in shards, rank 0 writes the file
        result = mine_training_negatives(config, output, args.precision)
        main = distributed.rank() == 0
    if main:
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
    from densepass.evaluation.tables import print_table
    from densepass.pipelines.ensemble import (
        EnsembleSettings,
        check_report_output,
        evaluate_ensemble,
        save_ensemble_report,
    )

    for flag, value, method in [
        ("--tune-metric", args.tune_metric, "embedding"),
        ("--folds", args.folds, "embedding"),
        ("--rrf-k", args.rrf_k, "rrf"),
    ]:
        if value is not None and args.method not in (method, "both"):  # (it was ignored)
            raise ConfigError(f"{flag}: an option of --method {method} (or both), not of --method {args.method}")
    if args.output:  # before the work: densepass overwrites only its own report
        check_report_output(args.output)

    settings = EnsembleSettings(
        ["embedding", "rrf"] if args.method == "both" else [args.method],
        args.split,
        args.metrics,
        args.depth,
        args.max_queries,
        tune_metric=args.tune_metric or "mrr@10",
        rrf_k=args.rrf_k or 60,
        precision=args.precision,
        folds=args.folds or 2,
    )
    dataset = load_dataset(args.dataset, args.data_dir, args.format)
    out = evaluate_ensemble(dataset, args.models, settings)
    print_table(out["results"], args.metrics, f"{args.dataset} {args.split}: {out['queries']} queries")
    if "weights" in out:
        print("embedding-fusion weights (tuned on every query):", json.dumps(out["weights"]))
        if settings.folds > 1:
            crossed = f"its row: each of {settings.folds} folds scored with the weights tuned on the others:"
            print(crossed, json.dumps(out["fold_weights"]))
    if args.output:
        save_ensemble_report(out, args.output)


def _export(args: argparse.Namespace) -> None:
    qdrant = {"--collection": args.collection, "--api-key": args.api_key, "--force": args.force,
              "--batch-size": args.batch_size, "--no-text": args.no_text}  # fmt: skip
    given = [flag for flag, value in qdrant.items() if value not in (None, False)]
    if args.to != "qdrant" and given:  # they would be ignored in silence
        raise ConfigError(f"{', '.join(given)}: options of --to qdrant, not of --to {args.to}")
    if args.private and args.to != "hub":
        raise ConfigError(f"--private: an option of --to hub (a repo's visibility), not of --to {args.to}")
    if args.to == "qdrant":
        from densepass.pipelines.vector_export import export_to_qdrant

        done = export_to_qdrant(
            args.model, args.target, args.collection, args.api_key, args.force, args.batch_size or 256, not args.no_text
        )
        print(f"exported {done.points} points ({done.dim}-d, {done.distance}) of {args.model} to collection "
              f"{done.collection!r} at {done.target}")  # fmt: skip
        return
    from densepass.pipelines.export import export_model

    result = export_model(args.model, args.to, args.target, private=args.private)
    check = f" (ONNX Runtime vs PyTorch: max abs diff {result.max_abs_diff:.2e})" if args.to == "onnx" else ""
    print(f"exported {args.model} to {result.target}{check}")


def _download(args: argparse.Namespace) -> None:
    from densepass.data.download import download_dataset
    from densepass.data.paths import default_data_dir

    print(download_dataset(args.name, args.data_dir or default_data_dir()))


# ---- the parser ----------------------------------------------------------------------------------


def _dataset_args(p: argparse.ArgumentParser, positional: bool = True, formats: tuple[str, ...] = FORMATS) -> None:
    if positional:
        p.add_argument("dataset", help="dataset name under the data dir, or a path")
    p.add_argument("--data-dir", default=None, help="data directory (default: $DENSEPASS_DATA or ../shared/data)")
    p.add_argument("--format", default="beir", choices=formats, help="dataset layout")


def _device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")


def _precision_arg(p: argparse.ArgumentParser, default: str | None = "auto") -> None:
    p.add_argument(
        "--precision",
        default=default,
        choices=PRECISIONS,
        help="encoding precision: fp32, bf16, int8 (CPU only, bi-encoders only: BERT-style towers on int8 products "
        "with a scale per token where AVX512-BF16 and -VNNI run densepass's kernels, dynamic quantisation "
        "otherwise) or auto (bf16 on "
        "GPU and on a CPU with fast bf16, else fp32; searching a saved index: the precision its passages were "
        "encoded in, where this device runs it fast)" + ("" if default else "; default: the config's eval.precision"),
    )


def _config_args(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument("config", nargs="?", help="config file (default: built-in defaults)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config value, e.g. --set {example} (densepass config --explain lists them)",
    )


def _pipeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="the index's model (any kind; a hybrid's: of either part), if it moved since indexing",
    )
    p.add_argument(
        "--hybrid",
        choices=["rrf", "linear"],
        default=None,
        help="fuse a dense index with BM25 over its passages (reciprocal rank or normalised scores)",
    )
    p.add_argument(
        "--fusion-weight", type=fraction, default=None, help="--hybrid linear: weight of the dense scores (default 0.5)"
    )
    p.add_argument(
        "--rerank", default=None, metavar="MODEL", help="re-score the top candidates with a cross-encoder or ColBERT"
    )
    p.add_argument(
        "--rerank-depth",
        type=positive_int,
        default=None,
        help="candidates re-scored per query (default: 100, or every passage of a smaller index)",
    )
    p.add_argument(
        "--rerank-batch-size", type=positive_int, default=None, help="texts or pairs per reranker pass (default 64)"
    )
    p.add_argument("--rerank-precision", default="auto", choices=PRECISIONS, help=RERANK_PRECISION_HELP)
    p.add_argument(
        "--rerank-fuse-weight",
        type=fraction,
        default=None,
        metavar="W",
        help="order the top --rerank-depth by W x the reranker's + (1 - W) x the first stage's scores, each min-max "
        "normalised per query (default: the reranker's alone)",
    )
    _precision_arg(p)
    p.add_argument(
        "--search-precision",
        default="fp32",
        choices=["fp32", "bf16", "int8"],
        help="exact index: score every passage in bf16 or int8, then re-score the best --rescore x k in fp32",
    )
    p.add_argument(
        "--rescore", type=positive_int, default=None, help="--search-precision: candidates re-scored, x k (default 4)"
    )
    _rescore_args(p, "default: the index's", "default: the index's")
    p.add_argument(
        "--nprobe",
        type=positive_int,
        default=None,
        help=f"{ONDISK_INDEX_KIND} index: inverted lists probed per query (default: the one it was built with)",
    )
    _device_arg(p)


def _rescore_args(p: argparse.ArgumentParser, default: str, multiplier_default: str) -> None:
    p.add_argument(
        "--rescore-with",
        choices=["float", "int8", "none"],
        default=None,
        help="int8 / binary index: re-score the candidates with the float32 or int8 embeddings on disk, or not"
        f" ({default})",
    )
    p.add_argument(
        "--rescore-multiplier",
        type=positive_int,
        default=None,
        help=f"int8 / binary index: candidates re-scored per query, x k ({multiplier_default})",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``densepass`` argument parser with every subcommand."""
    from densepass.serve.reload import add_reload_arguments
    from densepass.serve.settings import add_operation_arguments, add_settings_arguments

    parser = argparse.ArgumentParser(
        prog="densepass", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment (train, index, evaluate, report) from a YAML/JSON config")
    _config_args(run, "train.batch_size=32")
    run.add_argument("--restart", action="store_true", help="discard the run directory's checkpoints and start over")
    run.set_defaults(func=_run)

    config = sub.add_parser("config", help="print the resolved configuration, or --explain every key")
    _config_args(config, "train.batch_size=32")
    config.add_argument("--explain", action="store_true", help="list every key with its type, default and meaning")
    config.add_argument("--pretrain", action="store_true", help="the keys of `densepass pretrain` configs")
    config.add_argument("--phrase", action="store_true", help="the keys of `densepass phrase` configs")
    config.add_argument("--output", default=None, help="write the resolved config here instead of printing it")
    config.set_defaults(func=_config)

    pretrain = sub.add_parser("pretrain", help="MLM / Condenser / coCondenser pre-training from a YAML/JSON config")
    _config_args(pretrain, "model.mode=cocondenser")
    pretrain.add_argument("--restart", action="store_true", help="discard the run's checkpoints and start over")
    pretrain.set_defaults(func=_pretrain)

    phrase = sub.add_parser("phrase", help="phrase retrieval: train, filter, index, evaluate (DensePhrases-style)")
    _config_args(phrase, "train.loss=separate")
    phrase.add_argument("--restart", action="store_true", help="discard the run's outputs and start over")
    phrase.set_defaults(func=_phrase)

    index = sub.add_parser("index", help="index a dataset's corpus (resumable encoding) into a saved index")
    index.add_argument(
        "dataset", help="dataset name under the data dir, a path, or a corpus file (BEIR .jsonl, MS MARCO .tsv)"
    )
    _dataset_args(index, positional=False)
    index.add_argument("--output", required=True, help="index directory to write")
    index.add_argument("--kind", default="exact", choices=INDEX_KINDS, help="index kind")
    index.add_argument(
        "--model",
        default=None,
        help=f"the model (dense, hybrid, splade, colbert, phrase kinds; default {DEFAULT_MODEL}); bm25 takes none",
    )
    index.add_argument(
        "--force",
        action="store_true",
        help="where --output holds files densepass did not write, move them aside to OUTPUT.replaced-TIME "
        "(nothing is deleted) instead of stopping",
    )
    index.add_argument(
        "--filter-threshold", type=float, default=None, help="phrase: keep tokens above this filter logit"
    )
    index.add_argument(
        "--dense-kind", default=None, choices=DENSE_INDEX_KINDS, help="hybrid: the dense part (default exact)"
    )
    index.add_argument(
        "--fusion", default=None, choices=["rrf", "linear"], help="hybrid: how scores are fused (default rrf)"
    )
    index.add_argument(
        "--fusion-weight", type=fraction, default=None, help="hybrid linear: weight of the dense scores (default 0.5)"
    )
    index.add_argument("--sparse-model", default=None, help="hybrid: fuse with this SPLADE model instead of BM25")
    index.add_argument("--top-terms", type=positive_int, default=None, help="splade: keep each passage's top N terms")
    index.add_argument(
        "--compression", default=None, choices=["fp16", "residual"], help="colbert: vector storage (fp16)"
    )
    index.add_argument(
        "--residual-bits", type=int, default=None, choices=[1, 2, 4, 8], help="colbert residual: bits/dim (2)"
    )
    index.add_argument(
        "--nprobe",
        type=positive_int,
        default=None,
        help=f"colbert: centroids probed per query token (default 4); {ONDISK_INDEX_KIND}: lists per query (32)",
    )
    index.add_argument(
        "--ivf-lists", type=positive_int, default=None, help=f"{ONDISK_INDEX_KIND}: inverted lists (default 4 sqrt(n))"
    )
    index.add_argument(
        "--pq-m",
        type=positive_int,
        default=None,
        help=f"{ONDISK_INDEX_KIND}: sub-vectors per passage code (default dim/4)",
    )
    index.add_argument(
        "--pq-bits", type=positive_int, default=None, help=f"{ONDISK_INDEX_KIND}: bits per sub-vector (8)"
    )
    index.add_argument(
        "--train-size",
        type=positive_int,
        default=None,
        help=f"{ONDISK_INDEX_KIND}: passages sampled to train on (default 64 per list, at least 10,000)",
    )
    index.add_argument("--candidates", type=positive_int, default=None, help="colbert: candidates scored exactly (256)")
    index.add_argument("--batch-size", type=positive_int, default=256, help="encoding batch size")
    index.add_argument(
        "--embedding-precision",
        choices=["fp32", "int8", "binary"],
        default="fp32",
        help="dense kinds: what the index holds in memory: float32 embeddings, int8 codes (calibrated ranges) or sign"
        " bits (FAISS binary flat, HNSW or IVF by --kind), the candidates re-scored from embeddings on disk",
    )
    _rescore_args(index, "default: float", "default: 4")
    index.add_argument(
        "--dim",
        type=positive_int,
        default=None,
        help="dense kinds: index the embeddings' first N dimensions, normalised again (a Matryoshka-trained model's;"
        " searches cut queries alike)",
    )
    index.add_argument(
        "--shard-size", type=positive_int, default=65_536, help="passages encoded between resumable save points"
    )
    _precision_arg(index)
    _device_arg(index)
    index.set_defaults(func=_index)

    update = sub.add_parser(
        "index-update", help="delete, upsert or compact passages of a saved index in place (atomic: a new version)"
    )
    update.add_argument("index", help="index directory (from densepass index)")
    update.add_argument("--delete", default=None, help="file of passage ids to delete, one a line")
    update.add_argument("--upsert", default=None, help="corpus.jsonl of passages to add or replace (by _id)")
    update.add_argument("--compact", action="store_true", help="rewrite the index without its deleted passages")
    update.add_argument("--batch-size", type=positive_int, default=256, help="encoding batch size")
    update.add_argument(
        "--model", default=None, help="the index's model, where it moved since indexing (as search --model)"
    )
    _precision_arg(update)
    _device_arg(update)
    update.set_defaults(func=_index_update)

    search = sub.add_parser("search", help="search a saved index: one query (a table) or a file of queries (a run)")
    search.add_argument("index", help="index directory (from densepass index)")
    search.add_argument("query", nargs="?", help="one query")
    search.add_argument("--queries", default=None, help="queries file: BEIR queries.jsonl or id<TAB>text lines")
    search.add_argument("--output", default=None, help="TREC run file to write (with --queries)")
    search.add_argument("--k", type=positive_int, default=10, help="hits per query")
    search.add_argument("--tag", default="densepass", help="run tag (last column of the TREC file)")
    _pipeline_args(search)
    search.set_defaults(func=_search)

    serve = sub.add_parser("serve", help="serve a saved index over HTTP: POST /search, GET /health, a search page at /")
    serve.add_argument("index", help="index directory (from densepass index)")
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: loopback only; any other is warned about: the service has no "
        "authentication)",
    )
    serve.add_argument("--port", type=int, default=8000, help="port to listen on, 0 to 65535 (0: any free port)")
    _pipeline_args(serve)
    add_settings_arguments(serve)
    add_operation_arguments(serve)
    add_reload_arguments(serve)
    serve.set_defaults(func=_serve)

    rerank = sub.add_parser(
        "rerank", help="re-score the top candidates of a TREC run (any first stage) with a cross-encoder or ColBERT"
    )
    rerank.add_argument(
        "dataset", help="dataset name under the data dir, or a path; with --queries, a corpus file will do"
    )
    _dataset_args(rerank, positional=False)
    rerank.add_argument("run", help="first-stage TREC run file (.gz too) over the dataset's corpus and queries")
    rerank.add_argument(
        "--queries",
        default=None,
        metavar="FILE",
        help="the queries' texts from FILE (BEIR queries.jsonl or id<TAB>text lines) instead of the dataset's, "
        "which then needs its passages alone",
    )
    rerank.add_argument("--model", required=True, help="saved cross-encoder or ColBERT model")
    rerank.add_argument("--output", required=True, help="TREC run file to write")
    rerank.add_argument("--depth", type=positive_int, default=100, help="candidates re-scored per query")
    rerank.add_argument("--k", type=positive_int, default=None, help="passages written per query (default: all)")
    rerank.add_argument(
        "--fuse-weight",
        type=fraction,
        default=None,
        metavar="W",
        help="order the top --depth by W x the reranker's + (1 - W) x the run's scores, each min-max normalised "
        "per query (default: the reranker's alone)",
    )
    rerank.add_argument("--batch-size", type=positive_int, default=64, help="texts or pairs per reranker pass")
    rerank.add_argument("--precision", default="auto", choices=PRECISIONS, help=RERANK_PRECISION_HELP)
    rerank.add_argument("--tag", default="densepass-rerank", help="run tag (last column of the TREC file)")
    rerank.add_argument(
        "--cache-dir",
        default=None,
        help="keep a cross-encoder's scores in this folder, by content (the model, its precision, each pair's "
        "texts): reranking other first stages of the same queries scores only the pairs not met before",
    )
    _device_arg(rerank)
    rerank.set_defaults(func=_rerank)

    evaluate = sub.add_parser("evaluate", help="evaluate a TREC run file against a split's qrels")
    _dataset_args(evaluate)
    evaluate.add_argument("run", help="TREC run file")
    evaluate.add_argument("--split", default="dev")
    evaluate.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS))
    evaluate.add_argument(
        "--compare-to",
        metavar="BASELINE_RUN",
        help="also evaluate this run and test the difference (paired Fisher randomization test)",
    )
    evaluate.add_argument(
        "--all-queries",
        action="store_true",
        help="evaluate every query of the split, one missing from the runs scoring zero (trec_eval -c); default: "
        "the queries the runs answer, as trec_eval",
    )
    evaluate.set_defaults(func=_evaluate)

    mine = sub.add_parser("mine", help="mine a hard-negatives file for the training queries")
    _dataset_args(mine, formats=(*FORMATS, "pairs"))  # pairs: training rows (their given negatives: --strategy given)
    mine.add_argument("--output", required=True, help="hard-negatives file to write (JSONL)")
    mine.add_argument("--config", default=None, help="experiment config (its data, model, negatives, train sections)")
    mine.add_argument(
        "--strategy",
        default=None,
        choices=["bm25", "dense", "model", "context", "mixed", "file", "given"],
        help="given: the negatives a pairs file gives (--format pairs), through --filters",
    )
    mine.add_argument("--depth", type=positive_int, default=None, help="candidates kept per query (pool depth)")
    mine.add_argument("--model", default=None, help="saved model for --strategy model")
    mine.add_argument("--file", default=None, help="hard-negatives file for --strategy file (re-filter it)")
    mine.add_argument(
        "--dense-dim", type=positive_int, default=None, help="projection of the dense miner (25 coarse, 512 fine)"
    )
    mine.add_argument("--miner-steps", type=positive_int, default=None, help="training steps of the dense miner")
    mine.add_argument(
        "--mix", nargs="+", default=None, help="strategies for --strategy mixed, e.g. bm25 context dense:25"
    )
    mine.add_argument(
        "--filters", nargs="+", default=None, help="qrels answers duplicates cross-encoder relative-margin"
    )
    mine.add_argument("--cross-encoder", default=None, help="sentence-transformers CrossEncoder for that filter")
    mine.add_argument("--cross-encoder-threshold", type=float, default=None)
    mine.add_argument("--max-queries", type=positive_int, default=None, help="a seeded subset of the training queries")
    mine.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    _precision_arg(mine, default=None)
    _device_arg(mine)
    mine.set_defaults(func=_mine)

    ensemble = sub.add_parser("ensemble", help="evaluate embedding fusion and/or RRF of saved models")
    _dataset_args(ensemble)
    ensemble.add_argument("--models", nargs="+", required=True, help="saved models (at least two)")
    ensemble.add_argument("--method", default="both", choices=["embedding", "rrf", "both"])
    ensemble.add_argument("--split", default="dev")
    ensemble.add_argument(
        "--metrics", nargs="+", default=["mrr@10", "ndcg@10", "recall@1", "recall@5", "recall@20", "recall@100"]
    )
    ensemble.add_argument("--depth", type=positive_int, default=100)
    ensemble.add_argument("--max-queries", type=positive_int, default=None)
    ensemble.add_argument(
        "--tune-metric", default=None, help="metric the embedding fusion's weights maximise (default: mrr@10)"
    )
    ensemble.add_argument("--rrf-k", type=positive_int, default=None, help="RRF's k (default: 60)")
    ensemble.add_argument(
        "--folds",
        type=positive_int,
        default=None,
        help="the embedding fusion's row: each of this many seeded folds of the queries scored with the weights "
        "tuned on the others (default: 2; 1: tuned on the reported queries themselves)",
    )
    _precision_arg(ensemble)
    ensemble.add_argument("--output", default=None, help="write the results as JSON here")
    ensemble.set_defaults(func=_ensemble)

    pretrain_dataset = "debian-packages"
    attention = sub.add_parser("analyze-attention", help="CLS attention entropy per layer of saved models (one plot)")
    attention.add_argument("models", nargs="+", help="saved models (any AutoModel directory or name)")
    attention.add_argument("--output", required=True, help="PNG path (the numbers go to the same path with .json)")
    attention.add_argument("--labels", nargs="*", default=None, help="legend names, one per model")
    attention.add_argument("--dataset", default=pretrain_dataset, help="corpus to sample passages from")
    _dataset_args(attention, positional=False)
    attention.add_argument("--samples", type=positive_int, default=1000, help="passages averaged over")
    attention.add_argument("--max-length", type=positive_int, default=128)
    attention.add_argument("--seed", type=int, default=13)
    _device_arg(attention)
    attention.set_defaults(func=_analyze_attention)

    study = sub.add_parser("validate-study", help="compare validation subcorpora (C0, R_r, H_k) with the full corpus")
    _dataset_args(study)
    study.add_argument("--checkpoints", nargs="+", required=True, help="saved models or run directories")
    study.add_argument("--split", default="dev")
    study.add_argument("--r", type=float, nargs="*", default=[0.01, 0.1, 0.3], help="random subcorpus fractions")
    study.add_argument("--k", type=positive_int, nargs="*", default=[10, 50], help="hard subcorpus depths")
    study.add_argument("--retriever", default="bm25", help="'bm25' or a saved model for H_k")
    study.add_argument("--metric", default="mrr@10")
    study.add_argument("--max-queries", type=positive_int, default=None)
    study.add_argument(
        "--corpus-fraction",
        type=float,
        default=None,
        help="stand in for the full corpus with C0 + this random fraction of it (for a CPU)",
    )
    study.add_argument("--seed", type=int, default=13)
    study.add_argument("--output", required=True)
    study.set_defaults(func=_validate_study)

    export = sub.add_parser(
        "export", help="publish a saved model with a model card (a folder, ONNX, the Hub), or an index to Qdrant"
    )
    export.add_argument("model", help="a saved model directory (e.g. a run's model/); qdrant: a dense index directory")
    export.add_argument("--to", required=True, choices=["dir", "onnx", "hub", "qdrant"], help="what to write")
    export.add_argument(
        "target",
        help="dir / onnx: a new folder (or one densepass wrote); hub: a repo id; qdrant: a server's http(s) URL, or a"
        " folder for Qdrant's embedded mode",
    )
    export.add_argument("--private", action="store_true", help="hub: create the repo private")
    export.add_argument("--collection", default=None, help="qdrant: the collection (default: the index folder's name)")
    export.add_argument("--api-key", default=None, help="qdrant: the server's API key (default: $QDRANT_API_KEY)")
    export.add_argument("--force", action="store_true", help="qdrant: replace a collection of that name")
    export.add_argument("--batch-size", type=positive_int, default=None, help="qdrant: points per upsert (256)")
    export.add_argument("--no-text", action="store_true", help="qdrant: payloads without titles and texts")
    export.set_defaults(func=_export)

    download = sub.add_parser("download", help="download a public BEIR dataset or SQuAD (needs internet)")
    download.add_argument("name")
    download.add_argument("--data-dir", default=None)
    download.set_defaults(func=_download)
    return parser


def run_guarded(func: Callable[[], object], prog: str = "densepass") -> int:
    """Run ``func`` and turn densepass errors and Ctrl-C into a one-line message and an exit code;
    warnings print as one line each."""

    def one_line(message, category, filename, lineno, file=None, line=None) -> None:
        import re

        text = re.sub(r"\x1b\[[0-?]*[ -/]*[@-~]", "", str(message))  # a library's terminal escapes (colours)
        print(f"{prog}: warning: {text}", file=sys.stderr)

    previous = warnings.showwarning
    warnings.showwarning = one_line
    try:
        func()
    except DensepassError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        message = disk_failure(err)
        if message is None:
            raise
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (re-run the same command to resume)", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = previous
    return 0


def disk_failure(err: Exception) -> str | None:
    """One line for a write that failed for want of space or permission where no ``io.disk_errors`` named what it
    wrote (a log line, a lock file, a model saved by a library): the file where the error names it; for any other
    ``OSError`` naming a path (a name too long, a file where a folder should be, a place nobody may write to such as
    ``/proc``) ``cannot write <path>: <reason>``; None for any other error."""
    import errno

    from densepass.io import DISK_ERRORS, disk_errno, disk_error_message

    code = disk_errno(err, wrapped=type(err).__name__ == "SafetensorError")
    if code is None:
        return path_failure(err) if isinstance(err, OSError) and err.filename is not None else None
    filename = getattr(err, "filename", None)
    if filename is not None:  # a read may fail for want of permission too: "writing" only for a lack of space
        return (
            disk_error_message(code, filename)
            if code in (errno.ENOSPC, errno.EDQUOT)
            else f"{err.strerror}: {filename}"
        )
    return f"{DISK_ERRORS[code]} ({err}); free some space or choose another --output, and run the command again"


def path_failure(err: OSError) -> str:
    """``cannot write <path>: <reason>`` for an ``OSError`` about a path, saying which part is at fault where that is
    cheap to find: a name longer than the file system takes, or a file where a folder is needed."""
    import errno
    import os
    import re

    path = os.fsdecode(err.filename) if isinstance(err.filename, (str, bytes)) else str(err.filename)
    temporary = re.fullmatch(r"\.(.+)\.[a-z0-9_]{8}\.tmp", Path(path).name)  # what io's atomic writes name
    path = str(Path(path).with_name(temporary.group(1))) if temporary else path
    message = f"cannot write {path}: {err.strerror or err}"
    if err.errno == errno.ENAMETOOLONG:
        longest = max(Path(path).parts or [path], key=lambda part: len(os.fsencode(part)))
        if len(os.fsencode(longest)) > 255:
            message += f" (a name of {len(os.fsencode(longest))} bytes; a file or folder name is at most 255)"
    elif err.errno in (errno.EEXIST, errno.ENOTDIR):
        try:
            blocking = next((p for p in (Path(path), *Path(path).parents) if p.exists() and not p.is_dir()), None)
        except OSError:
            blocking = None
        if blocking is not None:
            message += f" ({blocking} is a file, not a folder)"
    return message


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what serve --workers hands its workers
    return run_guarded(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
