"""False-negative filters over a candidate pool; each reports how many candidates it removed.

- ``qrels``: passages judged relevant to the query in any split.
- ``answers``: passages containing one of the query's answer strings (DPR/SQuAD normalisation,
  ``evaluation.answers``); queries without answers keep everything.
- ``duplicates``: passages with the same content as one of the query's positives
  (``data.keys.content_key``), and positives of other queries with the same text, case and whitespace aside
  (debian-packages: two packages with the same synopsis).
- ``cross-encoder``: RocketQA-style denoising; candidates a cross-encoder scores above a threshold
  are likely unlabeled positives. The scorer is any ``(query, [passage, ...]) -> scores`` callable,
  e.g. ``cross_encoder_scorer(path)``: a saved cross-encoder's raw logits (rocketqa thresholds logits).
- ``relative-margin``: NV-Retriever's denoising (nv-retriever §3, "TopK-PercPos"); a candidate stays only if a
  teacher scores it below ``margin`` times the query's positive (0.95: within 5% of the positive is taken for an
  unlabelled positive). The teacher is a cross-encoder, its logits through a sigmoid so that scores are
  positive probabilities a ratio is meaningful for (raw logits may be negative), or a bi-encoder (its
  similarity: cosine for a normalised model, NV-Retriever's own setting). With several positives the weakest
  judged one sets the bar: a candidate scored near any passage judged relevant is dropped.

``apply_filters`` counts what each filter drops, by name, so the absolute threshold (``cross-encoder``) and the
relative rule (``relative-margin``) are counted apart when both run (the second counts only what the first kept).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from densepass.data.dataset import RetrievalDataset
from densepass.data.keys import content_key, passage_input, passage_text
from densepass.errors import ConfigError
from densepass.evaluation.answers import has_answer
from densepass.negatives.pool import Candidate, NegativePool

if TYPE_CHECKING:
    from densepass.models.score_cache import CachedPairScores

Scorer = Callable[[str, list[str]], Sequence[float]]
FILTERS = ("qrels", "answers", "duplicates", "cross-encoder", "relative-margin")
TEACHERS = ("cross-encoder", "bi-encoder")  # the relative-margin filter's teacher kinds


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


def query_text_key(text: str) -> str:
    """What the duplicates filter compares queries by: the text with case and runs of whitespace folded, nothing
    else (punctuation and articles stay: "C++ compiler" is not "C compiler")."""
    return " ".join(text.split()).casefold()


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
            text = query_text_key(self.dataset.queries[qid])
            if text:  # an empty query repeats no other
                by_text.setdefault(text, set()).update(pos)
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
        same_text = self._by_text.get(query_text_key(self.dataset.queries[qid]), set()) - set(pos)
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
        return self.keep_all({qid: cands})[qid]

    def keep_all(self, pool: NegativePool, show_progress: bool = False) -> dict[str, list[bool]]:
        """``keep`` of every query of ``pool``, its pairs scored together (``scored_in_batches``)."""
        pairs = {qid: [c.passage_id for c in cands] for qid, cands in pool.items() if cands}
        scored = scored_in_batches(self.scorer, self.dataset, pairs, self.sep_token, show_progress)
        return {qid: (scored[qid] <= self.threshold).tolist() if qid in scored else [] for qid in pool}


def relative_margin_keep(
    candidate_scores: Sequence[float], positive_scores: Sequence[float], margin: float
) -> list[bool]:
    """NV-Retriever's rule: for each candidate, whether its teacher score is below ``margin`` x the weakest
    positive's (no positive scored: every candidate stays). The bar is ``weakest - (1 - margin) x |weakest|``, that
    product where the score is positive (as the rule's teachers' are) and as far below a negative one (a bi-encoder
    teacher's cosine: ``margin x`` a negative score lies above it, and kept candidates scored above the positive)."""
    if len(positive_scores) == 0:
        return [True] * len(candidate_scores)
    weakest = float(np.min(np.asarray(positive_scores, dtype=np.float64)))
    bar = weakest - (1 - margin) * abs(weakest)
    return (np.asarray(candidate_scores, dtype=np.float64) < bar).tolist()


@dataclass
class RelativeMarginFilter:
    """Drops candidates a teacher scores at or above ``margin`` x the query's positive (nv-retriever)."""

    dataset: RetrievalDataset
    scorer: Scorer
    margin: float
    split: str = "train"
    name: str = "relative-margin"
    sep_token: str = "[SEP]"

    def __post_init__(self) -> None:
        self.positives = self.dataset.positives(self.split)

    def keep(self, qid: str, cands: list[Candidate]) -> list[bool]:
        """For each candidate, whether it stays (one teacher call scores the positives and the candidates)."""
        return self.keep_all({qid: cands})[qid]

    def keep_all(self, pool: NegativePool, show_progress: bool = False) -> dict[str, list[bool]]:
        """``keep`` of every query of ``pool``: each query's positives and candidates scored together with every other
        query's (``scored_in_batches``)."""
        positives = {qid: [p for p in self.positives.get(qid, ()) if p in self.dataset.corpus] for qid in pool}
        pairs = {qid: [*positives[qid], *(c.passage_id for c in cands)] for qid, cands in pool.items() if cands}
        scored = scored_in_batches(self.scorer, self.dataset, pairs, self.sep_token, show_progress)
        out = {}
        for qid in pool:
            n = len(positives[qid])
            out[qid] = relative_margin_keep(scored[qid][n:], scored[qid][:n], self.margin) if qid in scored else []
        return out


BATCH_PAIRS = 16_384  # pairs a batched scorer scores per call (a progress step, and a bound on its memory)


def scored_in_batches(
    scorer: Scorer, dataset: RetrievalDataset, pairs: dict[str, list[str]], sep_token: str, show_progress: bool
) -> dict[str, np.ndarray]:
    """Query id -> the scores of its passages ``pairs[qid]``: through the scorer's ``score_pairs`` (a cross-encoder's:
    many queries' pairs per call, sorted by length there, so little padding) where it has one, else a query at a
    time."""
    from tqdm.auto import tqdm

    if not hasattr(scorer, "score_pairs"):
        return {
            qid: np.asarray(
                scorer(dataset.queries[qid], [passage_input(dataset.corpus, p, sep_token) for p in pids]),
                dtype=np.float64,
            )
            for qid, pids in pairs.items()
        }
    flat = [(qid, pid) for qid, pids in pairs.items() for pid in pids]
    scores = np.empty(len(flat), dtype=np.float64)
    with tqdm(total=len(flat), desc="teacher scores (filter)", disable=not show_progress, dynamic_ncols=True) as bar:
        for start in range(0, len(flat), BATCH_PAIRS):
            chunk = flat[start : start + BATCH_PAIRS]
            queries = [dataset.queries[qid] for qid, _ in chunk]
            texts = [passage_input(dataset.corpus, pid, sep_token) for _, pid in chunk]
            scores[start : start + len(chunk)] = scorer.score_pairs(queries, texts)
            bar.update(len(chunk))
    out, start = {}, 0
    for qid, pids in pairs.items():
        out[qid] = scores[start : start + len(pids)]
        start += len(pids)
    return out


def bi_encoder_teacher(config) -> bool:
    """Whether ``config`` (a ``NegativesConfig``) runs the relative-margin filter with a bi-encoder teacher: a model
    that encodes, in the mining's precision, passages read with the mining's separator."""
    return "relative-margin" in config.filters and config.relative_teacher == "bi-encoder"


def check_denoising(config, base_model: str) -> None:
    """Before any work: the cross-encoder filter's model, and the relative-margin filter's teacher (a cross-encoder:
    ``negatives.cross_encoder``; a bi-encoder: ``negatives.model``, else ``base_model``, the starting model)."""
    check_cross_encoder_filter(config.filters, config.cross_encoder)
    if "relative-margin" not in config.filters:
        return
    if config.relative_teacher == "cross-encoder":
        check_cross_encoder_filter(["cross-encoder"], config.cross_encoder, "the relative-margin filter")
    else:
        from densepass.models.biencoder import resolve_model_path

        resolve_model_path(config.model or base_model)


def check_cross_encoder_filter(
    filters: Sequence[str], cross_encoder: str | None, what: str = "the cross-encoder filter"
) -> None:
    """Before any work: where ``filters`` name the cross-encoder filter, its model must be given and its files
    pass ``check_model_files`` (no code of its own, a config that builds a model its weights fit), so that a model
    that cannot load is one line before the dataset is read and mined, not after."""
    if "cross-encoder" not in filters:
        return
    if cross_encoder is None:
        raise ConfigError(f"{what} needs a cross-encoder (negatives.cross_encoder)")
    from densepass.models.biencoder import resolve_model_path

    resolve_model_path(cross_encoder)


def cross_encoder_scorer(
    path: str,
    batch_size: int = 64,
    activation: str | None = None,
    precision: str = "fp32",
    cache_dir: str | Path | None = None,
) -> Scorer:
    """A scorer from a saved cross-encoder (``models.cross_encoder.CrossEncoder``, scored in ``precision``): its raw
    logits, whatever activation the model's config names for sentence-transformers (whose ``CrossEncoder.predict``
    puts a one-label model's logits through a sigmoid unless the config says otherwise, so that the cross-encoder
    filter's threshold, a logit as in rocketqa, would mean another thing per model); ``activation``: positive scores
    for the relative-margin filter's ratios, ``sigmoid`` (a pointwise-trained cross-encoder's probabilities) or
    ``exp`` (a listwise-trained one's: its softmax over a query's passages ignores any offset shared by their logits,
    so it never learned one; a ratio of exponents does not depend on it); ``cache_dir``: logits of pairs it scored
    before in that precision (for distillation, another run's filter) are read from its content-keyed cache
    (``models.score_cache``), the others kept there."""
    from densepass.models.cross_encoder import CrossEncoder
    from densepass.models.score_cache import CachedPairScores

    applied = score_activation(activation)
    # a missing model, one asking for code of its own, weights that are not plain tensors: one line, before scoring
    model = CrossEncoder.from_pretrained(path, batch_size=batch_size, precision=precision)
    cached = CachedPairScores(model, cache_dir) if cache_dir is not None else None
    return CrossEncoderScorer(model, applied, cached)


def score_activation(name: str | None) -> Callable[[np.ndarray], np.ndarray] | None:
    """The function a cross-encoder's logits go through for a filter (``cross_encoder_scorer``): none, ``sigmoid``
    or ``exp``."""
    from scipy.special import expit

    activations = {None: None, "sigmoid": expit, "exp": np.exp}
    if name not in activations:
        raise ConfigError(f"unknown activation {name!r} of a cross-encoder's scores (known: sigmoid, exp)")
    return activations[name]


@dataclass
class CrossEncoderScorer:
    """A cross-encoder as a filter's scorer: one query's passages (``Scorer``), or many queries' pairs at once
    (``score_pairs``: what ``apply_filters`` calls, so batches gather pairs of similar length across queries);
    ``activation``: applied to the logits (None: the logits); ``cached``: the model through a score cache."""

    model: Any
    activation: Callable[[np.ndarray], np.ndarray] | None = None
    cached: CachedPairScores | None = None

    def score_pairs(self, queries: list[str], passages: list[str]) -> np.ndarray:
        """The score of each pair ``(queries[i], passages[i])``, float64."""
        logits = (self.cached or self.model).score_pairs(queries, passages).astype(np.float64)
        return self.activation(logits) if self.activation is not None else logits

    def __call__(self, query: str, passages: list[str]) -> np.ndarray:
        """The scores of one query's passages."""
        return self.score_pairs([query] * len(passages), passages)


@dataclass
class BiEncoderScorer:
    """A bi-encoder as a filter's teacher: the similarity of a query's embedding and each passage's (cosine for a
    normalised model), encoded at ``precision`` (``models.encode``). ``score_pairs`` (what ``apply_filters`` calls)
    encodes each distinct text once, in length-sorted batches across queries, and keeps the embeddings for the
    scorer's later calls: a pool's passages recur across its queries. Each mining (the first pool, each re-mining)
    builds its own scorer (``negatives.mine.relative_teacher``), so nothing is kept from one pool to the next."""

    model: Any
    batch_size: int = 64
    device: Any = None
    precision: str = "auto"

    def __post_init__(self) -> None:
        self._passages: dict[str, np.ndarray] = {}
        self._queries: dict[str, np.ndarray] = {}

    def _embed(self, texts: list[str], memo: dict[str, np.ndarray], side: str) -> np.ndarray:
        new = list(dict.fromkeys(t for t in texts if t not in memo))
        if new:
            encode = self.model.encode_queries if side == "query" else self.model.encode_passages
            options = {"show_progress": False, "device": self.device, "precision": self.precision}
            memo.update(zip(new, encode(new, self.batch_size, **options)))
        return np.stack([memo[t] for t in texts])

    def score_pairs(self, queries: list[str], passages: list[str]) -> np.ndarray:
        """The similarity of each pair ``(queries[i], passages[i])``, float64."""
        if not queries:
            return np.zeros(0, dtype=np.float64)
        q = self._embed(queries, self._queries, "query")
        p = self._embed(passages, self._passages, "passage")
        return np.einsum("ij,ij->i", q.astype(np.float64), p.astype(np.float64))

    def __call__(self, query: str, passages: list[str]) -> np.ndarray:
        """The similarities of one query's passages."""
        return self.score_pairs([query] * len(passages), passages)


def bi_encoder_scorer(path: str, batch_size: int = 64, device=None, precision: str = "auto") -> BiEncoderScorer:
    """The saved bi-encoder at ``path`` as a filter's teacher (``BiEncoderScorer``)."""
    from densepass.models.biencoder import BiEncoder

    return BiEncoderScorer(BiEncoder.from_pretrained(path), batch_size, device, precision)


def passage_sep(scorer: Scorer, sep_token: str) -> str:
    """What a filter's scorer reads between a passage's title and text: a cross-encoder's own ``PASSAGE_SEP`` (as
    it trained and reranks), else ``sep_token`` (a bi-encoder's, as the pool was mined)."""
    from densepass.models.cross_encoder import PASSAGE_SEP

    return PASSAGE_SEP if isinstance(scorer, CrossEncoderScorer) else sep_token


def build_filters(
    names: Sequence[str],
    dataset: RetrievalDataset,
    split: str = "train",
    sep_token: str = "[SEP]",
    cross_encoder: str | Scorer | None = None,
    threshold: float = 0.0,
    relative_margin: float = 0.95,
    relative_teacher: str | Scorer | None = None,
    precision: str = "fp32",
    relative_activation: str = "sigmoid",
    cache_dir: str | Path | None = None,
) -> list:
    """Filters by name, in the given order; ``relative_teacher``: the relative-margin filter's scorer, or the path of
    a cross-encoder (its logits through ``relative_activation``); ``precision``: what a cross-encoder given by its
    path scores in (through the score cache in ``cache_dir``, when given); ``sep_token``: what the duplicates filter
    and a bi-encoder scorer read between a passage's title and text (a cross-encoder reads its own, ``passage_sep``)."""
    out = []
    loaded: dict[str, CrossEncoderScorer] = {}  # a path's scorer: both filters of one cross-encoder load it once

    def from_path(path: str, activation: str | None) -> CrossEncoderScorer:
        applied = score_activation(activation)
        if path not in loaded:
            loaded[path] = cross_encoder_scorer(path, precision=precision, cache_dir=cache_dir)
        return replace(loaded[path], activation=applied)

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
            scorer = from_path(cross_encoder, None) if isinstance(cross_encoder, str) else cross_encoder
            out.append(CrossEncoderFilter(dataset, scorer, threshold, sep_token=passage_sep(scorer, sep_token)))
        elif name == "relative-margin":
            if relative_teacher is None:
                raise ConfigError("the relative-margin filter needs a teacher (negatives.relative_teacher)")
            if isinstance(relative_teacher, str):
                relative_teacher = from_path(relative_teacher, relative_activation)
            sep = passage_sep(relative_teacher, sep_token)
            out.append(RelativeMarginFilter(dataset, relative_teacher, relative_margin, split, sep_token=sep))
        else:
            raise ConfigError(f"unknown negatives filter {name!r} (known: {', '.join(FILTERS)})")
    return out


def apply_filters(
    pool: NegativePool, filters: Sequence, show_progress: bool = False
) -> tuple[NegativePool, dict[str, int]]:
    """Run the filters in order; returns the filtered pool and {filter name: candidates removed}."""
    from tqdm.auto import tqdm

    removed = {f.name: 0 for f in filters}
    out: NegativePool = dict(pool)
    for f in filters:  # each filter over every query's survivors of the filters before it
        if hasattr(f, "keep_all"):  # a teacher's: every query's pairs scored together
            flags = f.keep_all(out, show_progress)
        else:
            items = tqdm(out.items(), total=len(out), desc=f"filter ({f.name})", disable=not show_progress,
                         dynamic_ncols=True)  # fmt: skip
            flags = {qid: f.keep(qid, cands) for qid, cands in items}
        for qid, cands in out.items():
            kept = [c for c, ok in zip(cands, flags[qid]) if ok]
            removed[f.name] += len(cands) - len(kept)
            out[qid] = kept
    return out, removed
