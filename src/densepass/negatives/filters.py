"""False-negative filters over a candidate pool; each reports how many candidates it removed.

- ``qrels``: passages judged relevant to the query in any split.
- ``answers``: passages containing one of the query's answer strings (DPR/SQuAD normalisation,
  ``evaluation.answers``); queries without answers keep everything.
- ``duplicates``: passages with the same content as one of the query's positives
  (``data.keys.content_key``), and positives of other queries with the same text
  (debian-packages: two packages with the same synopsis).
- ``cross-encoder``: RocketQA-style denoising; candidates a cross-encoder scores above a threshold
  are likely unlabeled positives. The scorer is any ``(query, [passage, ...]) -> scores`` callable,
  e.g. ``cross_encoder_scorer(path)`` for a sentence-transformers CrossEncoder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from densepass.data.dataset import RetrievalDataset
from densepass.data.keys import content_key, passage_input, passage_text
from densepass.errors import ConfigError
from densepass.evaluation.answers import has_answer, normalize_answer
from densepass.negatives.pool import Candidate, NegativePool

Scorer = Callable[[str, list[str]], Sequence[float]]
FILTERS = ("qrels", "answers", "duplicates", "cross-encoder")


@dataclass
class QrelsFilter:
    """Drops passages judged relevant to the query in any split."""

    dataset: RetrievalDataset
    name: str = "qrels"

    def __post_init__(self) -> None:
        self.relevant = self.dataset.relevant_sets()

    def keep(self, qid: str, cands: list[Candidate]) -> list[bool]:
        """For each candidate, whether it stays."""
        relevant = self.relevant.get(qid, set())
        return [c.passage_id not in relevant for c in cands]


@dataclass
class AnswerFilter:
    """Drops passages that contain one of the query's answer strings."""

    dataset: RetrievalDataset
    name: str = "answers"

    def keep(self, qid: str, cands: list[Candidate]) -> list[bool]:
        """For each candidate, whether it stays."""
        answers = self.dataset.answers.get(qid)
        if not answers:
            return [True] * len(cands)
        return [not has_answer(passage_text(self.dataset.corpus, c.passage_id), answers) for c in cands]


@dataclass
class DuplicateFilter:
    """Drops passages with a positive's content, and other queries' positives with the same text."""

    dataset: RetrievalDataset
    split: str = "train"
    name: str = "duplicates"
    sep_token: str = "[SEP]"

    def __post_init__(self) -> None:
        by_text: dict[str, set[str]] = {}
        self.positives = self.dataset.positives(self.split)
        for qid, pos in self.positives.items():
            by_text.setdefault(normalize_answer(self.dataset.queries[qid]), set()).update(pos)
        self._by_text = by_text
        self._keys: dict[str, int] = {}

    def _key(self, pid: str) -> int:
        if pid not in self._keys:
            self._keys[pid] = content_key(passage_input(self.dataset.corpus, pid, self.sep_token))
        return self._keys[pid]

    def keep(self, qid: str, cands: list[Candidate]) -> list[bool]:
        """For each candidate, whether it stays."""
        pos = self.positives.get(qid, [])
        pos_keys = {self._key(p) for p in pos}
        same_text = self._by_text.get(normalize_answer(self.dataset.queries[qid]), set()) - set(pos)
        return [c.passage_id not in same_text and self._key(c.passage_id) not in pos_keys for c in cands]


@dataclass
class CrossEncoderFilter:
    """Drops candidates a cross-encoder scores above a threshold (likely unlabeled positives)."""

    dataset: RetrievalDataset
    scorer: Scorer
    threshold: float
    name: str = "cross-encoder"
    sep_token: str = "[SEP]"

    def keep(self, qid: str, cands: list[Candidate]) -> list[bool]:
        """For each candidate, whether it stays."""
        if not cands:
            return []
        texts = [passage_input(self.dataset.corpus, c.passage_id, self.sep_token) for c in cands]
        scores = np.asarray(self.scorer(self.dataset.queries[qid], texts), dtype=np.float64)
        return (scores <= self.threshold).tolist()


def check_cross_encoder_filter(filters: Sequence[str], cross_encoder: str | None) -> None:
    """Before any work: where ``filters`` name the cross-encoder filter, its model must be given and its files
    pass ``check_model_files`` (no code of its own, a config that builds a model its weights fit), so that a model
    that cannot load is one line before the dataset is read and mined, not after."""
    if "cross-encoder" not in filters:
        return
    if cross_encoder is None:
        raise ConfigError("the cross-encoder filter needs a cross-encoder (negatives.cross_encoder)")
    from densepass.models.biencoder import resolve_model_path

    resolve_model_path(cross_encoder)


def cross_encoder_scorer(path: str, batch_size: int = 64) -> Scorer:
    """A scorer from a saved sentence-transformers ``CrossEncoder`` (raw logits)."""
    from sentence_transformers import CrossEncoder

    from densepass.models.biencoder import resolve_model_path

    resolved = resolve_model_path(path)  # a missing model, one asking for code of its own: one line, before loading
    try:
        model = CrossEncoder(resolved, trust_remote_code=False)
    except Exception as err:  # transformers' and torch's loading errors (weights that are not plain tensors)
        if not isinstance(err, (OSError, ValueError)) and type(err).__name__ != "UnpicklingError":
            raise
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"cannot load cross-encoder {path!r}: {first}") from None
    return lambda query, passages: model.predict(
        [(query, p) for p in passages], batch_size=batch_size, show_progress_bar=False
    )


def build_filters(
    names: Sequence[str],
    dataset: RetrievalDataset,
    split: str = "train",
    sep_token: str = "[SEP]",
    cross_encoder: str | Scorer | None = None,
    threshold: float = 0.0,
) -> list:
    """Filters by name, in the given order."""
    out = []
    for name in names:
        if name == "qrels":
            out.append(QrelsFilter(dataset))
        elif name == "answers":
            out.append(AnswerFilter(dataset))
        elif name == "duplicates":
            out.append(DuplicateFilter(dataset, split, sep_token=sep_token))
        elif name == "cross-encoder":
            if cross_encoder is None:
                raise ConfigError("the cross-encoder filter needs a cross-encoder (negatives.cross_encoder)")
            scorer = cross_encoder_scorer(cross_encoder) if isinstance(cross_encoder, str) else cross_encoder
            out.append(CrossEncoderFilter(dataset, scorer, threshold, sep_token=sep_token))
        else:
            raise ConfigError(f"unknown negatives filter {name!r} (known: {', '.join(FILTERS)})")
    return out


def apply_filters(
    pool: NegativePool, filters: Sequence, show_progress: bool = False
) -> tuple[NegativePool, dict[str, int]]:
    """Run the filters in order; returns the filtered pool and {filter name: candidates removed}."""
    from tqdm.auto import tqdm

    removed = {f.name: 0 for f in filters}
    out: NegativePool = {}
    for qid, cands in tqdm(pool.items(), total=len(pool), desc="filter", disable=not show_progress, dynamic_ncols=True):
        for f in filters:
            flags = f.keep(qid, cands)
            kept = [c for c, ok in zip(cands, flags) if ok]
            removed[f.name] += len(cands) - len(kept)
            cands = kept
        out[qid] = cands
    return out, removed
