"""Phrase retrieval accuracy on a corpus or a validation subcorpus (training-inference-gap §3).

An evaluation set is a split's questions with their answers and gold passages. ``evaluate_index`` searches
a phrase index with them: EM / F1 of the top phrase, top-k answer accuracy, passage recall and passage
answer accuracy (``phrase.metrics``), and the index's size. ``phrase_validator`` builds the subcorpus once
(C0, R_r, or H_k from BM25's top-k passages of every question, ``evaluation.subcorpus``) and returns the
callback the trainer calls to pick its best checkpoint: a phrase index of the subcorpus with the current
model, searched with the validation questions.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from densepass.data.dataset import Corpus, sample_queries
from densepass.data.squad import SquadSpans
from densepass.evaluation.subcorpus import Subcorpus, gold_subcorpus, hard_subcorpus, random_subcorpus
from densepass.index.bm25 import BM25Index
from densepass.phrase.config import PhraseValidationConfig
from densepass.phrase.index import PhraseIndex
from densepass.phrase.metrics import passage_metrics, phrase_metrics
from densepass.phrase.model import PhraseEncoder


@dataclass
class EvalSet:
    """Questions with their answers and gold passage ids."""

    qids: list[str]
    questions: list[str]
    answers: list[list[str]]
    gold: list[str]

    def __len__(self) -> int:
        return len(self.qids)

    @property
    def qrels(self) -> dict[str, dict[str, int]]:
        """The gold passages as qrels (what the subcorpus builders read)."""
        return {q: {p: 1} for q, p in zip(self.qids, self.gold)}


def evaluation_set(data: SquadSpans, split: str, limit: int | None = None, seed: int = 13) -> EvalSet:
    """The questions of ``split`` that have answer spans (a seeded sample of ``limit`` of them)."""
    qrels = {q: r for q, r in sample_queries(data.dataset.split(split), limit, seed).items() if q in data.spans}
    qids = list(qrels)
    answers = [list(dict.fromkeys(s.text for s in data.spans[q])) for q in qids]
    return EvalSet(qids, [data.dataset.queries[q] for q in qids], answers, [data.passage[q] for q in qids])


def bm25_top_rows(corpus: Corpus):
    """BM25 over ``corpus`` as an H_k retriever: (questions, k) -> corpus rows [n, k]."""
    index = BM25Index.build(corpus)
    return lambda queries, k: index.search_rows(queries, k)[1]


def validation_subcorpus(corpus: Corpus, evalset: EvalSet, config: PhraseValidationConfig, seed: int) -> Subcorpus:
    """C0, R_r, H_k (BM25) or the whole corpus, as ``config.subcorpus`` says."""
    if config.subcorpus == "gold":
        return gold_subcorpus(corpus, evalset.qrels)
    if config.subcorpus == "random":
        return random_subcorpus(corpus, evalset.qrels, config.r, seed)
    if config.subcorpus == "hard":
        return hard_subcorpus(corpus, evalset.qrels, evalset.questions, config.k, bm25_top_rows(corpus), "bm25")
    return Subcorpus("full", list(corpus.ids), {})


def evaluate_index(index: PhraseIndex, evalset: EvalSet, ks: Sequence[int], question_vectors=None) -> dict:
    """Phrase and passage metrics of ``evalset`` on ``index`` (in %), with the index's size."""
    depth = max(ks)
    vectors = question_vectors or index.question_vectors(evalset.questions)
    phrases = index.search(vectors, depth)
    predictions = [[p[1] for p in phrases.phrases(i)] for i in range(len(evalset))]
    out = phrase_metrics(predictions, evalset.answers, ks)
    out.update(passage_metrics(index.search_passages(vectors, depth), evalset.gold, evalset.answers, ks))
    out.update(index.stats())
    return out


def subcorpus_rows(corpus: Corpus, sub: Subcorpus) -> list[int]:
    """Corpus rows of a subcorpus's passages."""
    return [corpus.position(pid) for pid in sub.ids]


def phrase_validator(
    corpus: Corpus, evalset: EvalSet, sub: Subcorpus, ks: Sequence[int], device: torch.device, batch_size: int = 32
):
    """The trainer's validation callback: metrics of the current model on subcorpus ``sub``."""
    passages = corpus.subset(subcorpus_rows(corpus, sub))

    def validate(model: PhraseEncoder) -> dict[str, float]:
        started = time.perf_counter()
        index = PhraseIndex.build(model, passages, device=device, batch_size=batch_size, vector_dtype="float32")
        metrics = evaluate_index(index, evalset, ks)
        return {
            "subcorpus": sub.label,
            "passages": len(passages),
            **{k: float(np.round(v, 4)) for k, v in metrics.items()},
            "seconds": round(time.perf_counter() - started, 1),
        }

    return validate
