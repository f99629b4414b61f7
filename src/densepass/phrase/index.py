"""The ``phrase`` index kind: every (filtered) start and end vector of a corpus, searched exactly.

``search(questions, k)`` returns the top-k phrases: for each, its passage, the answer text, its character
span in the passage text and its score (start score + end score, training-inference-gap §4.1), found by
maximum inner product over the start and end vectors under the span constraint (``phrase.span_search``).
``search_passages`` ranks passages by their best phrase. A token filter threshold (§5) keeps only the
start (end) vectors whose filter logit is above it; ``filtered(threshold)`` gives that smaller index
without encoding again (the index-size / accuracy sweep of Figure 2).

Saved with the passages: the token table (``bounds.npy``, ``offsets.npy``), the kept rows and their vectors
(``start_rows.npy``, ``start.npy``, ``end_rows.npy``, ``end.npy``; float16 by default), the filter logits
when the model has a filter, and a manifest recording the phrase model's path and the fingerprint of its
phrase side: loading with a model whose phrase side differs is refused, while a query-side fine-tuned model
(same phrase side, new question encoder) is accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from densepass.data.dataset import Corpus
from densepass.errors import ConfigError, DataError
from densepass.fingerprints import fingerprint_weights
from densepass.index.base import (
    Index,
    Passages,
    SearchResults,
    as_corpus,
    check_k,
    check_queries,
    concat_corpora,
    next_free_id,
    register,
)
from densepass.phrase.encode import encode_corpus
from densepass.phrase.model import PhraseEncoder
from densepass.phrase.span_search import span_limits, top_passages, top_spans

ROWS_PER_CHUNK = 1 << 15  # vectors turned into float32 at once when scoring
QuestionVectors = tuple[np.ndarray, np.ndarray]  # start and end vectors [n, dim] of n questions


def phrase_fingerprint(model: PhraseEncoder) -> str:
    """Digest of the modules that make the indexed vectors (phrase encoder and start/end heads)."""
    return fingerprint_weights(nn.ModuleList(model.phrase_modules()))


@dataclass
class PhraseSearchResults(SearchResults):
    """Top-k phrases: ``rows`` are their passages (repeated when a passage has several), ``starts`` / ``ends``
    their character spans [n, k] (-1 past the last), ``answers`` their texts."""

    starts: np.ndarray | None = None
    ends: np.ndarray | None = None
    answers: list[list[str]] | None = None

    def phrases(self, i: int) -> list[tuple[str, str, int, int, float]]:
        """(passage id, answer, start, end, score) of query ``i``, best first."""
        ids = self.passages.ids
        return [
            (ids[r], answer, int(s), int(e), float(score))
            for r, answer, s, e, score in zip(
                self.rows[i], self.answers[i], self.starts[i], self.ends[i], self.scores[i]
            )
            if r >= 0
        ]

    def as_run(self, query_ids: Sequence[str]) -> dict[str, dict[str, float]]:
        """``{query id: {passage id: score of its best phrase}}``."""
        if len(query_ids) != len(self):
            raise ConfigError(f"{len(query_ids)} query ids for {len(self)} result lists")
        run: dict[str, dict[str, float]] = {}
        for i, qid in enumerate(query_ids):
            ranked = run.setdefault(qid, {})
            for pid, score in self.hits(i):
                ranked.setdefault(pid, score)
        return run


@register
class PhraseIndex(Index):
    """Start/end vectors of every token of a corpus (see the module docstring)."""

    kind: ClassVar[str] = "phrase"
    load_options: ClassVar[tuple[str, ...]] = ("model", "batch_size", "device", "max_answer_tokens", "show_progress")
    updatable: ClassVar[bool] = False  # its phrase search knows no tombstones: build it again instead

    def __init__(
        self,
        model: PhraseEncoder,
        device: torch.device | None = None,
        batch_size: int = 32,
        vector_dtype: str = "float16",
        threshold: float | None = None,
        max_answer_tokens: int | None = None,
        model_path: str | None = None,
        show_progress: bool = False,
    ) -> None:
        if vector_dtype not in ("float16", "float32"):
            raise ConfigError(f"vector_dtype must be float16 or float32, got {vector_dtype!r}")
        self.model, self.device, self.batch_size = model, device, batch_size
        self.vector_dtype, self.threshold, self.show_progress = vector_dtype, threshold, show_progress
        self.max_answer_tokens = max_answer_tokens or model.config.max_answer_tokens
        self.model_path = model_path or model.source
        self.passages = Corpus([], [], [], [])
        self.bounds = np.zeros(1, dtype=np.int64)
        self.offsets = np.zeros((0, 2), dtype=np.int64)
        self.logits: tuple[np.ndarray, np.ndarray] | None = None  # filter logits of every row (start, end)
        empty = (np.zeros(0, dtype=np.int64), np.zeros((0, model.dim), dtype=vector_dtype))
        self.stored = {"start": empty, "end": empty}  # (rows, vectors) held: every row, or those a threshold kept
        self._keep()

    @classmethod
    def build(cls, model: PhraseEncoder, passages: Passages, **options: Any) -> PhraseIndex:
        """Encode ``passages`` (a Corpus, texts, or {id, title, text} records) with ``model`` and index them."""
        if options.get("threshold") is not None and getattr(model, "filter", None) is None:  # before any encoding
            raise ConfigError("a filter threshold needs a model with a trained token filter")
        index = cls(model, **options)
        index.add(passages)
        return index

    # ---- contents -------------------------------------------------------------------------------------

    def _keep(self) -> None:
        """The rows whose start / end vector the threshold keeps, their vectors, and the span limits."""
        if self.threshold is not None and self.logits is None and len(self.offsets):
            raise ConfigError("a filter threshold needs a model with a trained token filter")
        for side, logits in zip(("start", "end"), self.logits or (None, None)):
            rows, vectors = self.stored[side]
            if self.threshold is not None and logits is not None:
                keep = logits[rows] > self.threshold
                rows, vectors = rows[keep], vectors[keep]
            setattr(self, f"{side}_rows", rows)
            setattr(self, f"{side}_vectors", vectors)
        self.limit = span_limits(torch.from_numpy(self.bounds), self.max_answer_tokens)
        lengths = np.diff(self.bounds)
        self.passage_of_row = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths).astype(np.int64))

    def add(self, passages: Passages) -> None:
        """Encode and index more passages (their ids must be new); an empty passage gets no phrase."""
        new = as_corpus(passages, first_id=next_free_id(self.passages))
        corpus = concat_corpora(self.passages, new) if len(self.passages) else new
        added = encode_corpus(
            self.model, new, self.batch_size, self.device, self.vector_dtype, show_progress=self.show_progress
        )
        if (added.start_logits is None) != (self.logits is None) and len(self.offsets):
            raise ConfigError("the model's token filter was added or removed since the index was built")
        first = len(self.offsets)
        rows = first + np.arange(len(added), dtype=np.int64)
        for side, vectors in (("start", added.start), ("end", added.end)):
            old_rows, old_vectors = self.stored[side]
            self.stored[side] = (np.concatenate([old_rows, rows]), np.concatenate([old_vectors, vectors]))
        if added.start_logits is not None:
            old = self.logits or (np.zeros(0, np.float32), np.zeros(0, np.float32))
            self.logits = (np.concatenate([old[0], added.start_logits]), np.concatenate([old[1], added.end_logits]))
        self.bounds = np.concatenate([self.bounds, first + added.bounds[1:]])
        self.offsets = np.concatenate([self.offsets, added.offsets])
        self.passages = corpus
        self._keep()

    def filtered(self, threshold: float | None) -> PhraseIndex:
        """This index keeping only the vectors whose filter logit is above ``threshold`` (None: every stored one);
        the vectors are shared, nothing is encoded again."""
        if threshold is not None and self.logits is None:
            raise ConfigError("this index has no filter logits (its model had no token filter)")
        other = object.__new__(PhraseIndex)
        other.__dict__.update(self.__dict__)
        other.threshold = threshold
        other._keep()
        return other

    def stats(self) -> dict:
        """Tokens, kept start and end vectors, and the kept vectors' size in bytes."""
        kept = len(self.start_rows) + len(self.end_rows)
        return {
            "tokens": len(self.offsets),
            "start_vectors": len(self.start_rows),
            "end_vectors": len(self.end_rows),
            "vector_bytes": kept * np.dtype(self.vector_dtype).itemsize * self.model.dim,
            "kept_fraction": kept / max(1, 2 * len(self.offsets)),
        }

    # ---- search ---------------------------------------------------------------------------------------

    def question_vectors(self, queries: Sequence[str] | QuestionVectors) -> QuestionVectors:
        """Start and end vectors of question texts (or the vectors themselves, passed through)."""
        if isinstance(queries, tuple) and len(queries) == 2 and isinstance(queries[0], np.ndarray):
            return queries
        texts = check_queries(queries)
        return self.model.encode_questions(texts, device=self.device)

    def token_scores(self, queries: Sequence[str] | QuestionVectors) -> tuple[torch.Tensor, torch.Tensor]:
        """Start and end scores [Q, N] of every token (-inf where the filter dropped the vector)."""
        q_start, q_end = (
            torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for v in self.question_vectors(queries)
        )
        return self._scores(q_start, self.start_vectors, self.start_rows), self._scores(
            q_end, self.end_vectors, self.end_rows
        )

    def _scores(self, questions: torch.Tensor, vectors: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        out = torch.full((len(questions), len(self.offsets)), float("-inf"))
        for lo in range(0, len(rows), ROWS_PER_CHUNK):
            chunk = torch.from_numpy(np.asarray(vectors[lo : lo + ROWS_PER_CHUNK], dtype=np.float32))
            out[:, torch.from_numpy(rows[lo : lo + ROWS_PER_CHUNK])] = questions @ chunk.T
        return out

    def search_rows(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, passage rows) [n, k] of the top-k phrases of each query (a passage may repeat)."""
        results = self.search(queries, k)
        return results.scores, results.rows

    def search(self, queries: Sequence[str] | QuestionVectors, k: int = 10) -> PhraseSearchResults:
        """The top-``k`` phrases of each question, with passages, answer texts and character spans."""
        if len(self) == 0:
            raise ConfigError("the index is empty: add passages before searching")
        k = check_k(k)
        a, b = self.token_scores(queries)
        scores, starts, ends = top_spans(a, b, self.limit, k)
        found = starts >= 0
        rows = torch.where(found, self.passage_of_row[starts.clamp_min(0)], -1).numpy()
        offsets = self.offsets
        char_start = np.where(found, offsets[starts.clamp_min(0).numpy(), 0], -1)
        char_end = np.where(found, offsets[ends.clamp_min(0).numpy(), 1], -1)
        texts = self.passages.texts
        answers = [
            [texts[r][s:e] if r >= 0 else "" for r, s, e in zip(rr, ss, ee)]
            for rr, ss, ee in zip(rows.tolist(), char_start.tolist(), char_end.tolist())
        ]
        scores_np = np.where(found.numpy(), scores.numpy(), 0.0).astype(np.float32)
        return PhraseSearchResults(scores_np, rows, self.passages, char_start, char_end, answers)

    def search_passages(self, queries: Sequence[str] | QuestionVectors, k: int = 10) -> SearchResults:
        """The top-``k`` passages of each question, scored by their best phrase."""
        k = check_k(k)
        if len(self) == 0:
            raise ConfigError("the index is empty: add passages before searching")
        a, b = self.token_scores(queries)
        scores, rows = top_passages(a, b, self.limit, self.passage_of_row, len(self.passages), k)
        rows_np = rows.numpy()
        return SearchResults(np.where(rows_np >= 0, scores.numpy(), 0.0).astype(np.float32), rows_np, self.passages)

    # ---- persistence ----------------------------------------------------------------------------------

    def facts(self) -> dict:
        """Model, dimension, span constraint, filter and sizes, for the manifest."""
        return {
            "model": {"path": self.model_path, "phrase_fingerprint": phrase_fingerprint(self.model)},
            "dim": self.model.dim,
            "options": {
                "vector_dtype": self.vector_dtype,
                "threshold": self.threshold,
                "max_answer_tokens": self.max_answer_tokens,
            },
            "stats": self.stats(),
        }

    def _write(self, directory: Path) -> None:
        arrays = {
            "bounds": self.bounds,
            "offsets": self.offsets,
            "start_rows": self.start_rows,
            "end_rows": self.end_rows,
            "start": np.ascontiguousarray(self.start_vectors),
            "end": np.ascontiguousarray(self.end_vectors),
        }
        if self.logits is not None:
            arrays.update(start_logits=self.logits[0], end_logits=self.logits[1])
        for name, array in arrays.items():
            np.save(directory / f"{name}.npy", array, allow_pickle=False)

    @classmethod
    def _read(
        cls,
        directory: Path,
        manifest: dict,
        passages: Corpus,
        model: PhraseEncoder | str | None = None,
        device: torch.device | None = None,
        **options: Any,
    ) -> PhraseIndex:
        recorded = manifest["model"]
        if not isinstance(model, PhraseEncoder):
            path = model or recorded["path"]
            if not path or not Path(path).exists():
                raise DataError(f"{directory}: its model {path!r} is not there any more; pass the phrase model")
            model = PhraseEncoder.from_pretrained(path)
        if phrase_fingerprint(model) != recorded["phrase_fingerprint"]:
            raise ConfigError(
                f"{directory} was built with another phrase encoder (from {recorded['path']}): "
                "search it with that model (a query-side fine-tuned copy is fine) or index again"
            )
        model.to(device or torch.device("cpu"))
        index = cls(model, device=device, model_path=recorded["path"], **{**manifest["options"], **options})
        names = ["bounds", "offsets", "start_rows", "end_rows", "start", "end", "start_logits", "end_logits"]
        arrays = {
            n: np.load(directory / f"{n}.npy", allow_pickle=False) for n in names if (directory / f"{n}.npy").is_file()
        }
        n_rows, dim = int(arrays["bounds"][-1]), manifest["dim"]
        if len(arrays["bounds"]) != len(passages) + 1 or len(arrays["offsets"]) != n_rows:
            raise DataError(f"{directory}: its token table does not fit its {len(passages)} passages")
        for side in ("start", "end"):
            rows, vectors = arrays[f"{side}_rows"], arrays[side]
            if vectors.shape != (len(rows), dim) or (len(rows) and not 0 <= rows.min() <= rows.max() < n_rows):
                raise DataError(f"{directory}: its {side} vectors do not fit its kept rows")
            index.stored[side] = (rows, vectors)
        if "start_logits" in arrays:
            index.logits = (arrays["start_logits"], arrays["end_logits"])
        index.passages, index.bounds, index.offsets = passages, arrays["bounds"], arrays["offsets"]
        index._keep()
        return index
