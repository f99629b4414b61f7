"""Mined pools kept by content: a pool mined once is read back by every later mining of the same content.

Mining a pool is minutes of work (BM25 and a model over every training query, then the filters) that a run does
again whenever it resumes, and that every run of a study with the same negatives does again. ``mine_negatives``
keeps each pool it mines with fixed models in ``<folder>/negative-pools/<key>/``, the folder being the cache
directory shared between runs (``cache_dir``), else the run's own ``negatives/`` folder (a resumed run reads its
pool back; ``--restart`` removes it with the run's other files): the pool (the hard-negatives JSONL of
``negatives.pool``) and what the filters removed. The key digests everything the pool depends on: the dataset's
content (corpus, queries, qrels in their order, answers, given negatives), the queries mined for, the negatives
settings (all of them but ``per_query`` and ``refresh_every``, which only say how training draws from the pool), the
strategy and the separator, what each strategy and filter reads besides (``negatives.mine.mining_inputs``: each
model's files or weights, tokenizer and architecture, the precision and device kind it encodes or scores in, BM25's
parameters and passages, the context strategy's split and seed), the versions of densepass and of the libraries that
rank, and ``MINING_VERSION``. Any change is another key, so a stale pool is never read; the split, seed, precision
and BM25 parameters are keyed only where a strategy reads them (a BM25 pool is the same whatever precision a run
encodes in). A pool mined with the model being trained (``training.refresh``) changes with every step and is never
kept.

Runs that ask for the same pool at once take turns (``io.exclusive_lock``): the first mines, the others read what it
wrote. An entry is complete once ``mining.json`` is written (after the pool); an entry that does not read back whole
(a crash between the two files, a damaged line) is mined again and overwritten. No entry is ever removed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from densepass import distributed
from densepass.config import NegativesConfig
from densepass.data.dataset import RetrievalDataset
from densepass.errors import DataError
from densepass.fingerprints import fingerprint_corpus, fingerprint_directory, fingerprint_json, library_versions
from densepass.io import atomic_write_text, exclusive_lock
from densepass.negatives.pool import MiningResult, load_pool, save_pool

CACHE_FOLDER = "negative-pools"
POOL_FILE = "pool.jsonl"
RESULT_FILE = "mining.json"  # written last: the entry is complete
MINING_VERSION = 3  # raise it when mining changes what a key's pool is (2: BM25 breaks ties by row; 3: DPR has_answer)
DRAW_ONLY = ("per_query", "refresh_every")  # settings of how training draws from a pool, not of the pool


def qrels_in_order(dataset: RetrievalDataset) -> dict[str, list]:
    """Every split's judgements as JSON-ready lists, in their order: a query's positives keep it among equal grades,
    and the context strategy reads the first."""
    return {split: [[q, list(rels.items())] for q, rels in qrels.items()] for split, qrels in dataset.qrels.items()}


def fingerprint_dataset(dataset: RetrievalDataset) -> str:
    """Digest of what mining reads of a dataset: its corpus, queries, qrels of every split, answers and (training
    rows) given negatives."""
    given = getattr(dataset, "negatives", None)
    return fingerprint_json(
        {
            "corpus": fingerprint_corpus(dataset.corpus),
            "queries": dataset.queries,
            "qrels": qrels_in_order(dataset),
            "answers": dataset.answers,
            "given": given if isinstance(given, dict) else None,
        }
    )


def model_files(name_or_path: str) -> str:
    """Digest of a saved model's files (a hub id: its downloaded snapshot's)."""
    from densepass.models.biencoder import resolve_model_path

    return fingerprint_directory(resolve_model_path(name_or_path))


def pool_key(
    dataset: RetrievalDataset,
    query_ids: Sequence[str],
    config: NegativesConfig,
    sep_token: str,
    strategy: str,
    inputs: dict,
) -> str:
    """The content key of the pool ``mine_negatives`` mines for ``query_ids`` with ``strategy``; ``inputs``: what
    its strategies and filters read besides (``negatives.mine.mining_inputs``: models, their precision, ...)."""
    return fingerprint_json(
        {
            "version": MINING_VERSION,
            "dataset": fingerprint_dataset(dataset),
            "queries": list(query_ids),
            "negatives": {k: v for k, v in dataclasses.asdict(config).items() if k not in DRAW_ONLY},
            "strategy": strategy,
            "sep": sep_token,
            "inputs": inputs,
            "libraries": library_versions(),
        }
    )


def read_entry(directory: Path, dataset: RetrievalDataset, query_ids: Sequence[str]):
    """The ``MiningResult`` an entry holds, or None when it is incomplete or does not read back whole."""
    try:
        result = json.loads((directory / RESULT_FILE).read_text())
        removed = {str(k): int(v) for k, v in result["removed"].items()}
        seconds = float(result["seconds"])
        pool = load_pool(directory / POOL_FILE, dataset)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, DataError):
        return None
    if len(pool) != len(query_ids) or set(pool) != set(query_ids):
        return None
    return MiningResult(pool, removed, seconds, read_from=directory)


def cached_mining(
    cache_dir: str | Path,
    key: str,
    dataset: RetrievalDataset,
    query_ids: Sequence[str],
    mine: Callable[[], MiningResult],
) -> MiningResult:
    """The pool of ``key`` read from ``cache_dir``, or ``mine()``'d and kept there (one process; runs asking for
    the same key at once take turns, the later ones read)."""
    directory = Path(cache_dir) / CACHE_FOLDER / key
    with exclusive_lock(directory, "mining", wait=True):
        started = time.perf_counter()
        found = read_entry(directory, dataset, query_ids)
        if found is not None:
            found.read_seconds = time.perf_counter() - started
            return found
        result = mine()
        if any(result.pool.values()):  # a pool without a negative is refused when read back: not kept
            save_pool(result.pool, directory / POOL_FILE)
            kept = {"removed": result.removed, "seconds": result.seconds}
            atomic_write_text(directory / RESULT_FILE, json.dumps(kept))  # last: the entry is complete
        return result


def pools_folder(ctx) -> str | Path | None:
    """Where mining in ``ctx`` keeps its pools: the cache directory shared between runs (``ctx.cache_dir``), else
    the run's own folder (``ctx.pools_dir``: a resumed run reads its pool back); None without either, or when
    processes mine together (under torchrun each mines a shard, and none may wait for a lock another holds)."""
    if distributed.world_size() > 1:
        return None
    return ctx.cache_dir if ctx.cache_dir is not None else ctx.pools_dir
