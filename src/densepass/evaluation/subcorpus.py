"""Validation subcorpora (training-inference-gap paper §3): C0, random R_r and hard H_k.

- C0: the gold passages of the evaluated queries (the minimal corpus answering all of them).
- R_r: C0 plus random passages so that |R_r| = r |C| (§3.1), C0 ⊆ R_r ⊆ C.
- H_k: C0 plus the top-k passages of every query under a given retriever M (§3.2):
  H_k = C0 ∪ ⋃_q M_k(q | C).

A subcorpus is saved as JSON: its corpus ids, in corpus order, with how it was made.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from densepass.data.dataset import Corpus, Qrels
from densepass.errors import ConfigError, DataError
from densepass.io import atomic_write_text

Retriever = Callable[[Sequence[str], int], np.ndarray]  # (query texts, k) -> corpus rows [n, k]


@dataclass
class Subcorpus:
    """A validation subcorpus: its kind, its passage ids in corpus order, and how it was made."""

    kind: str  # "gold", "random", "hard" or "full"
    ids: list[str]
    provenance: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def label(self) -> str:
        """The paper's name: C0, R_r, H_k or C."""
        if self.kind == "random":
            return f"R_{self.provenance['r']:g}"
        if self.kind == "hard":
            return f"H_{self.provenance['k']}"
        return {"gold": "C0", "full": "C"}[self.kind]

    def save(self, path: str | Path) -> None:
        """Write the subcorpus as JSON, atomically."""
        atomic_write_text(path, json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: str | Path) -> Subcorpus:
        """Read a subcorpus saved by ``save``."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"subcorpus file not found: {path}")
        try:
            return cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as err:
            raise DataError(f"{path}: not a subcorpus file ({err})") from None


def _gold_rows(corpus: Corpus, qrels: Qrels) -> set[int]:
    rows = {corpus.position(p) for rels in qrels.values() for p, g in rels.items() if g > 0 and p in corpus}
    if not rows:
        raise DataError("no gold passage of the evaluated queries is in the corpus")
    return rows


def _ordered(corpus: Corpus, rows: set[int]) -> list[str]:
    return [corpus.ids[r] for r in sorted(rows)]


def gold_subcorpus(corpus: Corpus, qrels: Qrels) -> Subcorpus:
    """C0."""
    rows = _gold_rows(corpus, qrels)
    return Subcorpus("gold", _ordered(corpus, rows), {"queries": len(qrels)})


def random_subcorpus(corpus: Corpus, qrels: Qrels, r: float, seed: int = 13) -> Subcorpus:
    """R_r: C0 plus random passages up to r |C| in all (never fewer than C0)."""
    if not 0 < r <= 1:
        raise ConfigError(f"r must be in (0, 1], got {r}")
    rows = _gold_rows(corpus, qrels)
    target = max(len(rows), round(r * len(corpus)))
    rest = np.setdiff1d(np.arange(len(corpus)), np.fromiter(rows, dtype=np.int64))
    extra = np.random.default_rng(seed).choice(rest, size=target - len(rows), replace=False)
    rows.update(int(x) for x in extra)
    return Subcorpus("random", _ordered(corpus, rows), {"r": r, "seed": seed, "queries": len(qrels)})


def hard_subcorpus(
    corpus: Corpus, qrels: Qrels, query_texts: Sequence[str], k: int, retriever: Retriever, retriever_name: str
) -> Subcorpus:
    """H_k: C0 plus the retriever's top-k passages of every query (``query_texts`` in qrels order)."""
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    if len(query_texts) != len(qrels):
        raise ConfigError(f"{len(query_texts)} query texts for {len(qrels)} queries")
    rows = _gold_rows(corpus, qrels)
    top = retriever(list(query_texts), k)
    rows.update(int(r) for r in np.asarray(top).ravel() if r >= 0)
    return Subcorpus("hard", _ordered(corpus, rows), {"k": k, "retriever": retriever_name, "queries": len(qrels)})
