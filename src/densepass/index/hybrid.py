"""Hybrid retrieval: two indexes over the same passages (typically dense + BM25), fused per query.

Each index returns its top ``depth``; the fused score of a passage is

- ``rrf``: reciprocal rank fusion (rrf), sum over the indexes of 1 / (rrf_k + rank);
- ``linear``: normalised score combination, w * s1 + (1 - w) * s2, each system's scores min-max
  normalised over its top ``depth`` for that query (a passage missing from a list counts 0 there, and so does the
  lowest-scored one: a list whose scores are all equal adds nothing), the same fusion as
  ``evaluation.fusion.linear_fusion`` (ranx ``wsum`` with ``min-max``), so weights tuned there carry over.

>>> from densepass.index import BM25Index
>>> texts = ["audio editor for linux", "kernel driver", "audio player"]
>>> hybrid = HybridIndex(BM25Index.build(texts), BM25Index.build(texts), method="rrf")
>>> hybrid.search(["audio editor"], k=2).ids(0)
['0', '2']
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from densepass.config import DENSE_INDEX_KINDS
from densepass.data.dataset import Corpus
from densepass.errors import ConfigError, DataError
from densepass.index.base import (
    KINDS,
    Index,
    Passages,
    as_corpus,
    check_new_ids,
    check_queries,
    next_free_id,
    read_index_manifest,
    records_corpus,
    register,
)
from densepass.models.splade import SpladeEncoder

Fusion = Literal["rrf", "linear"]


def rrf_scores(ranked: list[list[int]], rrf_k: int) -> dict[int, float]:
    """Reciprocal rank fusion of ranked row lists (best first)."""
    fused: dict[int, float] = {}
    for rows in ranked:
        for rank, row in enumerate(rows, 1):
            fused[row] = fused.get(row, 0.0) + 1.0 / (rrf_k + rank)
    return fused


def linear_scores(lists: list[tuple[list[int], list[float]]], weights: list[float]) -> dict[int, float]:
    """Weighted sum of min-max normalised scores (each list over its own entries; missing or all equal = 0, as ranx)."""
    fused: dict[int, float] = {}
    for (rows, scores), weight in zip(lists, weights):
        if not rows:
            continue
        low, high = min(scores), max(scores)
        for row, score in zip(rows, scores):
            normalised = (score - low) / (high - low) if high > low else 0.0
            fused[row] = fused.get(row, 0.0) + weight * normalised
    return fused


def part_precision(kind: str, precision: str) -> str:
    """The encoding precision of a hybrid's ``kind`` part where the hybrid is built or loaded in ``precision``: a
    SPLADE part runs no int8 (``models.copies.float_precision``), so next to an int8 dense part it encodes in
    ``auto``."""
    return "auto" if kind not in DENSE_INDEX_KINDS and precision == "int8" else precision


@register
class HybridIndex(Index):
    """Fusion of two indexes over the same passages; searched with query texts."""

    kind: ClassVar[str] = "hybrid"
    load_options: ClassVar[None] = None  # each part takes its own (``_read``)

    def __init__(
        self,
        first: Index,
        second: Index,
        method: Fusion = "rrf",
        weight: float = 0.5,
        depth: int = 100,
        rrf_k: int = 60,
    ) -> None:
        if method not in ("rrf", "linear"):
            raise ConfigError(f"unknown fusion {method!r} (use 'rrf' or 'linear')")
        if not 0 <= weight <= 1:
            raise ConfigError(f"the fusion weight must be in [0, 1], got {weight}")
        if depth < 1 or rrf_k < 1:
            raise ConfigError(f"depth and rrf_k must be >= 1, got {depth} and {rrf_k}")
        if first.passages.ids != second.passages.ids:
            raise ConfigError("the two indexes of a hybrid must hold the same passages in the same order")
        self.first, self.second = first, second
        self.method, self.weight, self.depth, self.rrf_k = method, weight, depth, rrf_k

    @property
    def passages(self) -> Corpus:  # type: ignore[override]
        """The passages both parts index."""
        return self.first.passages

    def add(self, passages: Passages) -> None:
        """Index more passages in both parts, as ``upsert`` does: the ids checked and both parts' encodings made
        (``encode_new``) before either part takes the passages, so that a failure in either changes nothing (the
        parts would otherwise hold different passages, and their rows be fused across two corpora)."""
        corpus = as_corpus(passages, first_id=next_free_id(self.passages))
        check_new_ids(self.passages, corpus)
        prepared = [self.first.encode_new(corpus), self.second.encode_new(corpus)]
        self.first.append_encoded(corpus, prepared[0])
        self.second.append_encoded(corpus, prepared[1])

    def __len__(self) -> int:
        """Passages searchable (both parts hold the same)."""
        return len(self.first)

    @property
    def deleted(self) -> np.ndarray:
        """The deleted rows (both parts delete the same)."""
        return self.first.deleted

    def delete(self, ids: Sequence[str]) -> None:
        """Delete ``ids`` from both parts (checked against the first: unknown or repeated ids change nothing)."""
        self.first.delete(ids)
        self.second.delete(ids)

    def upsert(self, passages: Passages) -> None:
        """Upsert ``passages`` into both parts, each encoded first: a failure in either changes nothing."""
        corpus = records_corpus(passages)
        prepared = [self.first.encode_new(corpus), self.second.encode_new(corpus)]
        self.first.upsert_encoded(corpus, prepared[0])
        self.second.upsert_encoded(corpus, prepared[1])

    def compact(self) -> None:
        """Compact both parts (they delete the same rows, so they stay aligned): a BM25 part first, wherever it is,
        since BM25 may refuse (no live passage has a word left), and a refusal then leaves both parts as they were."""
        for part in sorted((self.first, self.second), key=lambda part: part.kind != "bm25"):
            part.compact()

    def search_rows(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` of each query after fusing the two parts' top ``depth``."""
        queries = check_queries(queries)
        depth = max(k, self.depth)
        results = [self.first.search(queries, depth), self.second.search(queries, depth)]
        k = min(k, len(self.passages))
        scores = np.zeros((len(queries), k), dtype=np.float32)
        rows = np.full((len(queries), k), -1, dtype=np.int64)
        for i in range(len(queries)):
            lists = [
                (
                    [int(r) for r in res.rows[i] if r >= 0],
                    [float(s) for r, s in zip(res.rows[i], res.scores[i]) if r >= 0],
                )
                for res in results
            ]
            if self.method == "rrf":
                fused = rrf_scores([rows_ for rows_, _ in lists], self.rrf_k)
            else:
                fused = linear_scores(lists, [self.weight, 1 - self.weight])
            best = sorted(fused.items(), key=lambda item: (-item[1], item[0]))[:k]
            for j, (row, score) in enumerate(best):
                rows[i, j], scores[i, j] = row, score
        return scores, rows

    def facts(self) -> dict:
        """Fusion method and parameters, and the kinds of the two parts, for the manifest."""
        return {
            "options": {"method": self.method, "weight": self.weight, "depth": self.depth, "rrf_k": self.rrf_k},
            "parts": [self.first.kind, self.second.kind],
        }

    def _write(self, directory: Path) -> None:
        self.first.save(directory / "first")
        self.second.save(directory / "second")

    @classmethod
    def _read(cls, directory: Path, manifest: dict, passages: Corpus, model: Any = None, **options: Any) -> HybridIndex:
        """The two parts, each with the ``options`` its kind takes (an option neither takes is a one-line error);
        ``model`` (if given) replaces the recorded model of the part of its kind: the SPLADE part's for a
        ``SpladeEncoder``, else the dense part's (which refuses another kind in one line)."""
        names = ("first", "second")
        kinds = [read_index_manifest(directory / name)["kind"] for name in names]
        taken = [KINDS[kind].load_options or () for kind in kinds]
        unknown = sorted(name for name in options if not any(name in t for t in taken))
        if unknown:
            raise ConfigError(f"neither part of a {' + '.join(kinds)} hybrid takes {', '.join(unknown)} on load")
        owner = 1 if isinstance(model, SpladeEncoder) and kinds[1] == "splade" else 0
        parts = []
        for i, (name, kind) in enumerate(zip(names, kinds)):
            takes = {option: value for option, value in options.items() if option in taken[i]}
            if "precision" in takes:
                takes["precision"] = part_precision(kind, takes["precision"])
            if model is not None and i == owner:
                takes["model"] = model
            parts.append(KINDS[kind].load(directory / name, **takes))
        if parts[0].passages.ids != passages.ids:
            raise DataError(f"{directory}: its parts hold other passages than the hybrid index")
        return cls(*parts, **manifest["options"])
