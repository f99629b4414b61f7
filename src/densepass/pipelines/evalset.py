"""The evaluation set of a run: queries of the eval split (optionally a seeded sample) and the corpus
they are searched in (the full corpus, or a subcorpus: their gold passages + BM25 top-k + random)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from densepass.config import DataConfig
from densepass.data.dataset import Corpus, Qrels, RetrievalDataset
from densepass.data.parts import QueryParts, split_query_parts
from densepass.errors import ConfigError
from densepass.evaluation.subcorpus import gold_subcorpus, hard_subcorpus
from densepass.index.bm25 import BM25Index


@dataclass
class EvalSet:
    """The evaluated queries, their qrels and answers, and the corpus they are searched in."""

    query_ids: list[str]
    query_texts: list[str]
    qrels: Qrels
    corpus: Corpus
    description: str
    answers: dict[str, list[str]] = field(default_factory=dict)
    candidates: dict[str, list[str]] | None = None  # per query, for re-ranking evaluation
    part: dict | None = None  # data.eval_part other than all: which part, its size and how it was made


def query_parts(dataset: RetrievalDataset, config: DataConfig) -> QueryParts | None:
    """The tuning and reporting parts of the eval split's queries (``data.parts``) when ``data.eval_part`` is
    not ``all``; None otherwise."""
    if config.eval_part == "all":
        return None
    where = f"{dataset.name}: qrels/{config.eval_split}"
    return split_query_parts(
        dataset.split(config.eval_split), dataset.corpus, config.eval_part_fraction, config.eval_part_seed, where
    )


def eval_qrels(dataset: RetrievalDataset, config: DataConfig) -> tuple[Qrels, dict | None]:
    """The evaluated queries' qrels: the ``data.eval_part`` of the eval split (all of it by default), then a
    seeded sample of ``data.max_eval_queries`` of those; and what the run records of the part (None for all)."""
    parts = query_parts(dataset, config)
    if parts is None:
        return dataset.sample(config.eval_split, config.max_eval_queries, config.seed), None
    other = set(dataset.split(config.eval_split)) - set(parts.part(config.eval_part))
    qrels = dataset.sample(config.eval_split, config.max_eval_queries, config.seed, exclude=other)
    return qrels, {**parts.describe(config.eval_part), "queries": len(qrels)}


def add_rerank_candidates(evalset: EvalSet, bm25: BM25Index, size: int) -> EvalSet:
    """Give each query its positives plus BM25 candidates (from ``evalset.corpus``) up to ``size``."""
    if size < 2:
        raise ConfigError(f"eval.rerank_candidates must be >= 2, got {size}")
    _, rows = bm25.search_rows(evalset.query_texts, size)
    candidates = {}
    for qid, row in zip(evalset.query_ids, rows):
        chosen = [p for p, g in evalset.qrels[qid].items() if g > 0]
        for r in row.tolist():
            if len(chosen) >= size:
                break
            if evalset.corpus.ids[r] not in chosen:
                chosen.append(evalset.corpus.ids[r])
        # in corpus order, not positives first: a tie between a positive and another candidate (a duplicate
        # passage) is ranked in the candidates' order, which would otherwise favour the positive
        candidates[qid] = sorted(chosen, key=evalset.corpus.position)
    evalset.candidates = candidates
    evalset.description += f"; re-ranking {size} candidates per query (positives + BM25)"
    return evalset


def build_eval_set(dataset: RetrievalDataset, config: DataConfig, bm25: BM25Index | None) -> EvalSet:
    """The evaluation set a ``DataConfig`` describes: a sample of the eval split, in the full corpus or a subcorpus."""
    qrels, part = eval_qrels(dataset, config)
    query_ids = sorted(qrels)
    texts = [dataset.queries[q] for q in query_ids]
    answers = {q: dataset.answers[q] for q in query_ids if q in dataset.answers}
    corpus = dataset.corpus
    of = (
        f" of the {part['part']} part ({part['part_queries']} of {part['split_queries']} queries, split by"
        f" {part['by']}, seed {part['seed']})"
        if part
        else ""
    )
    if not config.eval_subcorpus:
        description = f"{len(query_ids)} queries{of}, full corpus ({len(corpus)} passages)"
        return EvalSet(query_ids, texts, qrels, corpus, description, answers, part=part)
    if config.eval_hard_k < 0 or config.eval_random < 0:
        raise ConfigError("data.eval_hard_k and data.eval_random must be >= 0")
    n_gold = len(gold_subcorpus(corpus, qrels))
    if config.eval_hard_k:
        if bm25 is None:
            raise ConfigError("data.eval_hard_k needs a BM25 index of the corpus")
        base = hard_subcorpus(corpus, qrels, texts, config.eval_hard_k, lambda q, k: bm25.search_rows(q, k)[1], "bm25")
    else:
        base = gold_subcorpus(corpus, qrels)
    keep = {corpus.position(p) for p in base.ids}
    n_hard = len(keep) - n_gold
    if config.eval_random:
        rest = np.setdiff1d(np.arange(len(corpus)), np.fromiter(keep, dtype=np.int64))
        rng = np.random.default_rng(config.seed)
        keep.update(int(r) for r in rng.choice(rest, size=min(config.eval_random, len(rest)), replace=False))
    positions = sorted(keep)
    description = (
        f"{len(query_ids)} {config.eval_split} queries{of}; subcorpus of {len(positions)} passages "
        f"({n_gold} gold + {n_hard} more from BM25 top-{config.eval_hard_k} + "
        f"{len(positions) - n_gold - n_hard} random)"
    )
    return EvalSet(query_ids, texts, qrels, corpus.subset(positions), description, answers, part=part)
