"""Mining a hard-negatives pool from a ``NegativesConfig``: strategy -> filters -> top ``pool_depth``.

Every strategy first ranks more candidates than needed; the filters (``qrels`` always, first) then
drop false negatives, and each query keeps its best ``pool_depth`` survivors. Training samples
``per_query`` of them per step (``training.batches.TrainingData``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from densepass.config import DEFAULT_MODEL, NegativesConfig, TrainConfig
from densepass.data.dataset import RetrievalDataset
from densepass.device import default_device, release_freed_memory, resolve_precision
from densepass.errors import ConfigError
from densepass.fingerprints import fingerprint_file, fingerprint_strings, fingerprint_tokenizer, fingerprint_weights
from densepass.index.base import as_corpus
from densepass.index.bm25 import BM25Index, bm25_texts
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.models.cross_encoder import PASSAGE_SEP
from densepass.negatives.filters import Scorer, apply_filters, bi_encoder_scorer, build_filters
from densepass.negatives.pool import Candidate, MiningResult, NegativePool, load_pool, truncate
from densepass.negatives.pool_cache import cached_mining, model_files, pool_key, pools_folder


@dataclass
class MiningContext:
    """What strategies may need besides the config: set the fields a strategy uses."""

    split: str = "train"
    device: torch.device | None = None
    bm25_index: BM25Index | None = None  # over dataset.corpus.passage_inputs(" "); built when missing
    work_dir: Path | None = None  # where source=dense trains and keeps its miners
    base_model: str = DEFAULT_MODEL
    architecture: BiEncoderConfig | None = None
    train_config: TrainConfig | None = None
    seed: int = 13
    show_progress: bool = True
    model: BiEncoder | None = None  # for source=model: a model in memory (the one being trained) instead of a path
    miners: dict[int, BiEncoder] = field(default_factory=dict)  # dense:DIM -> its trained miner (training.dense_miners)
    precision: str = "auto"  # encoding precision of the model and dense strategies (models.encode)
    # content-keyed cache: fixed models' corpus encodings (index.sharded.encode_cached), pools (negatives.pool_cache)
    cache_dir: Path | str | None = None
    pools_dir: Path | str | None = None  # where pools are kept without a cache_dir: a run's own, read back on resume


def fetch_depth(depth: int) -> int:
    """Candidates a strategy ranks for a pool of ``depth``: room for those the filters remove."""
    return depth + max(16, depth // 4)  # room for the candidates the filters remove


def dense_dim(spec: str, config: NegativesConfig) -> int:
    """The projection size of a ``dense`` or ``dense:DIM`` strategy."""
    _, _, arg = spec.partition(":")
    if arg and not arg.isdigit():
        raise ConfigError(f"negatives strategy {spec!r}: the dimension after 'dense:' must be a number")
    if not arg:
        return config.dense_dim
    bounds = next(f.metadata for f in dataclasses.fields(NegativesConfig) if f.name == "dense_dim")
    if not bounds["min"] <= int(arg) <= bounds["max"]:  # the range of negatives.dense_dim
        raise ConfigError(
            f"negatives strategy {spec!r}: the dimension after 'dense:' must be in [{bounds['min']}, {bounds['max']}]"
        )
    return int(arg)


def strategy_specs(config: NegativesConfig, strategy: str | None = None) -> list[str]:
    """The strategies that mining ``strategy`` (default: ``config.source``) runs: ``config.mix`` for ``mixed``."""
    strategy = strategy or config.source
    return config.mix if strategy == "mixed" else [strategy]


KNOWN = ("bm25", "dense", "model", "context", "mixed", "file", "given")


def check_draws(config: NegativesConfig) -> None:
    """A one-line ConfigError where a step would draw more negatives per query than a mined pool holds."""
    if config.source not in ("none", "given") and config.per_query > config.pool_depth:
        raise ConfigError(
            f"negatives.per_query {config.per_query} is more than negatives.pool_depth {config.pool_depth}: a pool "
            "holds at most pool_depth distinct negatives, so every draw would repeat some"
        )


def check_strategies(
    config: NegativesConfig, strategy: str | None = None, *, inputs: bool = False, pairs: bool | None = None
) -> None:
    """A one-line ConfigError for an unknown strategy, a ``dense:DIM`` out of range, an empty ``mix`` or one that
    holds ``mixed``: called by ``raw_pool`` and, before any work (a BM25 index built, a dense miner trained), by
    the run's and ``densepass mine``'s checks. ``inputs``: also what the strategies read, before a run claims its
    directory (a ``model``'s negatives.model, a ``file``'s pool: given, and found); ``pairs`` False: the data are no
    training rows, which ``given`` needs."""
    strategy = strategy or config.source
    if strategy == "mixed" and (not config.mix or "mixed" in config.mix):
        raise ConfigError("negatives.mix must list the strategies to mix (and not 'mixed')")
    for spec in strategy_specs(config, strategy):
        name, _, arg = spec.partition(":")
        if name not in KNOWN or name in ("given", "context", "bm25", "model") and ":" in spec:
            raise ConfigError(
                f"unknown negatives strategy {spec!r} (known: bm25, dense[:DIM], model, context, mixed, file[:PATH], "
                "given)"
            )
        where = f"negatives.source={spec}" if strategy != "mixed" else f"negatives.mix's {spec!r}"
        if name == "dense":
            dense_dim(spec, config)
        if name == "given" and pairs is False:
            raise ConfigError(f"{where} takes the negatives of training rows: it needs data.format: pairs")
        if inputs and name == "model":
            if not config.model:
                raise ConfigError(f"{where} needs negatives.model (a saved model)")
            from densepass.models.biencoder import resolve_model_path

            resolve_model_path(config.model)  # a missing folder or Hub model: one line
        if inputs and name == "file":
            if not (arg or config.file):
                raise ConfigError(f"{where} needs negatives.file (a hard-negatives file) or file:PATH")
            load_pool(arg or config.file)  # missing, not UTF-8, not JSON, no negatives: one line


def dense_specs(config: NegativesConfig, strategy: str | None = None) -> list[str]:
    """The ``dense[:DIM]`` strategies that mining ``strategy`` (default: ``config.source``) will run."""
    return [s for s in strategy_specs(config, strategy) if s.partition(":")[0] == "dense"]


def mines_with_a_model(config: NegativesConfig) -> bool:
    """Whether mining ``config.source`` encodes with a model (a ``model`` or ``dense[:DIM]`` strategy)."""
    return any(s.partition(":")[0] in ("model", "dense") for s in strategy_specs(config))


def given_candidates(dataset: RetrievalDataset, query_ids: Sequence[str], skip_top: int = 0) -> NegativePool:
    """The ``given`` strategy's candidates (``negatives.source: given``, ``densepass mine --strategy given``): the
    negatives training rows give each query (``data.pairs``), in the order given, score 0; a one-line ConfigError
    for a dataset that is not training rows, or rows that give the queries no negatives (cheap: ``densepass mine``
    calls it before any work). Training's pool of given negatives is this too (``pipelines.training.given_pool``)."""
    from densepass.data.pairs import PairsDataset

    if not isinstance(dataset, PairsDataset):
        raise ConfigError(
            f"negatives.source: given takes the negatives of training rows (data.format: pairs); {dataset.name} "
            "gives none: mine them (bm25, dense, ...)"
        )
    if not any(dataset.negatives.get(q) for q in query_ids):
        raise ConfigError(
            f"negatives.source: given, but the rows of {dataset.name} give no negatives: set negatives.source: "
            "none (in-batch negatives only)"
        )
    return {q: [Candidate(p, "given", 0.0) for p in dataset.negatives.get(q, ())][skip_top:] for q in query_ids}


def raw_pool(
    spec: str, dataset: RetrievalDataset, query_ids: Sequence[str], config: NegativesConfig, ctx: MiningContext
) -> NegativePool:
    """Unfiltered candidates of one strategy: ``bm25``, ``context``, ``model``, ``dense[:DIM]``,
    ``file:PATH``, ``file`` (config.file), ``given`` (the negatives training rows give: ``data.pairs``, in the
    order given, score 0; nothing ranked, so the filters and ``pool_depth`` are all that changes them) or
    ``mixed`` (config.mix)."""
    check_strategies(config, spec)  # an unknown or malformed spec, an empty mix: refused here, one line
    depth = fetch_depth(config.pool_depth)
    name, _, arg = spec.partition(":")
    if name == "bm25":
        from densepass.negatives.bm25 import mine_bm25_negatives

        if ctx.bm25_index is None:
            ctx.bm25_index = BM25Index.build(bm25_corpus(dataset), show_progress=ctx.show_progress)
        return mine_bm25_negatives(dataset, ctx.bm25_index, query_ids, depth, config.skip_top)
    if name == "context":
        from densepass.negatives.context import mine_context_negatives

        return mine_context_negatives(dataset, query_ids, depth, ctx.split, ctx.seed, config.skip_top)
    if name in ("model", "dense"):
        from densepass.negatives.dense import mine_dense_negatives

        if name == "model" and ctx.model is not None:
            model, source = ctx.model, "model"
        elif name == "model":
            if not config.model:
                raise ConfigError("negatives.source=model needs negatives.model (a saved model)")
            model, source = BiEncoder.from_pretrained(config.model), "model"
        else:
            dim = dense_dim(spec, config)
            if dim not in ctx.miners:
                raise ConfigError(
                    f"{spec} mining needs a trained {dim}-d miner in the mining context "
                    "(densepass.training.dense_miners.prepare_miners trains it)"
                )
            model, source = ctx.miners[dim], f"dense-{dim}d"
        return mine_dense_negatives(
            model,
            dataset,
            query_ids,
            depth,
            config.skip_top,
            source,
            config.batch_size,
            ctx.device,
            show_progress=ctx.show_progress,
            block=config.shard_block,
            precision=ctx.precision,
            cache_dir=None if model is ctx.model else ctx.cache_dir,  # not the model being trained: it changes
        )
    if name == "file":
        path = arg or config.file
        if not path:
            raise ConfigError("negatives.source=file needs negatives.file (a hard-negatives file)")
        pool = load_pool(path, dataset)
        if query_ids and not any(q in pool for q in query_ids):  # mined for other queries: training had no pool
            raise ConfigError(
                f"hard-negatives file {path} has negatives for none of the {len(query_ids)} queries trained on (its "
                f"queries: {next(iter(pool))!r}, ...): was it mined for another split or dataset?"
            )
        return {q: pool.get(q, [])[config.skip_top :] for q in query_ids}
    if name == "given":
        return given_candidates(dataset, query_ids, config.skip_top)
    if name == "mixed":
        from densepass.negatives.mixed import mix_pools

        return mix_pools([raw_pool(s, dataset, query_ids, config, ctx) for s in config.mix], depth)
    raise AssertionError(f"check_strategies let through {spec!r}")  # every name it accepts has a branch above


def bm25_corpus(dataset: RetrievalDataset) -> list[str]:
    """What the ``bm25`` strategy indexes when the mining context has no index: each passage's title and text."""
    return dataset.corpus.passage_inputs(" ")


def mining_inputs(dataset: RetrievalDataset, config: NegativesConfig, ctx: MiningContext, strategy: str) -> dict | None:
    """What mining ``strategy`` and its filters read besides the dataset, the queries and the negatives settings,
    for ``pool_cache``'s key: each model's files or weights, the settings each strategy reads (BM25's parameters and
    passages, the context strategy's split and seed, the encoders' precision and device); None when a strategy
    mines with the model being trained (a refresh's pool is never kept)."""
    device = ctx.device or default_device()
    encoding = {"precision": resolve_precision(ctx.precision, device), "device": device.type}
    inputs: dict = {}
    for spec in strategy_specs(config, strategy):
        name, _, arg = spec.partition(":")
        if name == "model" and ctx.model is not None:
            return None
        if name == "model" and config.model:
            inputs[spec] = {"model": model_files(config.model), **encoding}
        elif name == "dense" and dense_dim(spec, config) in ctx.miners:
            miner = ctx.miners[dense_dim(spec, config)]
            inputs[spec] = {
                "weights": fingerprint_weights(miner),
                "tokenizer": fingerprint_tokenizer(miner.tokenizer),
                "architecture": dataclasses.asdict(miner.config),
                **encoding,
            }
        elif name == "file" and Path(arg or config.file or "").is_file():
            inputs[spec] = fingerprint_file(arg or config.file)
        elif name == "bm25":  # without an index, raw_pool builds one with the defaults over the whole corpus
            index = ctx.bm25_index or BM25Index()
            texts = bm25_texts(index.passages if ctx.bm25_index is not None else as_corpus(bm25_corpus(dataset)))
            inputs[spec] = {"k1": index.k1, "b": index.b, "passages": fingerprint_strings(texts)}
        elif name == "context":  # a skip_top keyed again: pools mined before the strategy applied it skipped none
            skipped = {"skip_top": config.skip_top} if config.skip_top else {}
            inputs[spec] = {"split": ctx.split, "seed": ctx.seed, **skipped}
    # a filter's cross-encoder scores on the default device, in negatives.filter_precision, passages read as it reads
    # them (filters.build_filters)
    scorer = default_device()
    cross_scoring = {
        "precision": resolve_precision(config.filter_precision, scorer),
        "device": scorer.type,
        "passage sep": PASSAGE_SEP,
    }
    if "cross-encoder" in config.filters and config.cross_encoder:
        inputs["cross-encoder filter"] = {"model": model_files(config.cross_encoder), **cross_scoring}
    if "relative-margin" in config.filters:
        if config.relative_teacher == "cross-encoder":
            scored, teacher = cross_scoring, config.cross_encoder
        else:
            scored, teacher = encoding, config.model or ctx.base_model
        # its bar is the query's positive in the split mined for
        inputs["relative-margin teacher"] = {
            "model": model_files(teacher) if teacher else "",
            "split": ctx.split,
            **scored,
        }
    if "duplicates" in config.filters:  # queries matched by text with case and spaces folded (not answer-normalised)
        inputs["duplicates filter"] = {"split": ctx.split, "query text": "case and spaces folded"}
    return inputs


def relative_teacher(config: NegativesConfig, ctx: MiningContext) -> str | Scorer | None:
    """The relative-margin filter's teacher: the cross-encoder's path (``negatives.cross_encoder``), or a bi-encoder's
    scorer (``negatives.model``, else the run's starting model ``ctx.base_model``; fixed: never the model being
    trained, so a refresh denoises by the same teacher)."""
    if config.relative_teacher == "cross-encoder":
        return config.cross_encoder
    return bi_encoder_scorer(config.model or ctx.base_model, config.batch_size, ctx.device, ctx.precision)


def mine_negatives(
    dataset: RetrievalDataset,
    query_ids: Sequence[str],
    config: NegativesConfig,
    ctx: MiningContext | None = None,
    sep_token: str = "[SEP]",
    strategy: str | None = None,
) -> MiningResult:
    """The filtered pool of ``config.source`` (or of ``strategy``, any ``raw_pool`` spec such as
    ``dense:25``) for ``query_ids``, ``config.pool_depth`` per query; with ``ctx.cache_dir`` (else
    ``ctx.pools_dir``), a pool of fixed models is read from (or kept in) its content-keyed cache
    (``negatives.pool_cache``)."""
    ctx = ctx or MiningContext()
    strategy = strategy or config.source
    if config.pool_depth < 1:
        raise ConfigError("negatives.pool_depth must be >= 1")
    if strategy == "none":
        raise ConfigError("negatives.source is 'none': nothing to mine")
    started = time.perf_counter()
    names = ["qrels", *(f for f in config.filters if f != "qrels")]
    # the filters first: a cross-encoder that does not load is one line before the mining, not after it
    filters = build_filters(
        names,
        dataset,
        ctx.split,
        sep_token,
        config.cross_encoder,
        config.cross_encoder_threshold,
        config.relative_margin,
        relative_teacher(config, ctx) if "relative-margin" in names else None,
        config.filter_precision,
        config.relative_activation,
        ctx.cache_dir,
    )

    def mine() -> MiningResult:
        raw = raw_pool(strategy, dataset, query_ids, config, ctx)
        pool, removed = apply_filters(raw, filters, show_progress=ctx.show_progress)
        return MiningResult(truncate(pool, config.pool_depth), removed, time.perf_counter() - started)

    folder = pools_folder(ctx)
    inputs = mining_inputs(dataset, config, ctx, strategy) if folder is not None else None
    key = None if inputs is None else pool_key(dataset, query_ids, config, sep_token, strategy, inputs)
    result = mine() if key is None else cached_mining(folder, key, dataset, query_ids, mine)
    release_freed_memory()  # mining's peak (encodings, rankings) is freed by now: give it back before training
    return result
