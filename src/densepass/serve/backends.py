"""What the embedding and reranking routes of the service compute with: the served bi-encoder (an
:class:`Embedder` over the model of a dense index) and the second stage of the pipeline (``--rerank``: a
cross-encoder, or ColBERT's MaxSim), both found in the searcher the service was started with.

Models are imported when a searcher has one (the service's other modules load without torch). Every call runs in
the micro-batcher's worker thread, one batch at a time (the model and its tokenizer are
never used by two threads at once).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from densepass.errors import DataError

if TYPE_CHECKING:
    from densepass.models.biencoder import BiEncoder
    from densepass.models.inputs import Side


class TooManyTokens(DataError):
    """A text longer than the model reads, sent with ``truncate`` off (TEI's 413)."""


@runtime_checkable
class PairScorer(Protocol):
    """A reranker: one score per (query, text) pair, higher is better (``pipelines.search.Reranker``)."""

    def score_pairs(self, queries: Sequence[str], passages: Sequence[str]) -> np.ndarray:
        """One score per pair ``(queries[i], passages[i])``."""
        ...

    def describe(self) -> dict:
        """JSON-able facts about the reranker."""
        ...


class Embedder:
    """Embeddings of texts, as ``BiEncoder.encode_queries`` / ``encode_passages`` give them (the side's prompt
    from the model's config, its token limit, the index's precision and device), with the number of tokens the
    model read for each text (for OpenAI's ``usage``).

    ``names``: the model names a request may give (the name the index recorded, its path, and ``extra_names``);
    ``public_names``: those shown to clients (``GET /v1/models``): all but the model's path on the server, for which
    ``name`` (its folder's name, or ``org/name``) stands.
    ``dim``: the dimension served, the index's where it holds a Matryoshka prefix (``densepass index --dim N``): the
    model's embeddings cut to it and normalised again as ``DenseIndex`` cuts them, so that a client stores vectors
    of the size the index holds beside them; None: the model's.
    """

    def __init__(
        self,
        model: BiEncoder,
        source: str | None = None,
        device: Any = None,
        precision: str = "auto",
        batch_size: int = 64,
        extra_names: Sequence[str] = (),
        dim: int | None = None,
    ) -> None:
        self.model, self.device, self.precision, self.batch_size = model, device, precision, batch_size
        self.cut = None if dim is None or dim == model.dim else dim
        # a served model is never trained: in eval mode once here, each call skips the two walks over its modules
        # that encoding a model in training mode costs (eval, then train again after)
        model.eval()
        from densepass.models.biencoder import model_name

        source = source or model.source or "densepass"
        self.name = short_name(source)
        self.names = tuple(dict.fromkeys([self.name, model_name(source), source, *extra_names]))
        self.public_names = tuple(n for n in self.names if n != source or n == self.name)

    @property
    def dim(self) -> int:
        """Embedding dimension served: the index's (a Matryoshka prefix), else the model's."""
        return self.cut or self.model.dim

    @property
    def prefix_dims(self) -> list[int]:
        """The prefix dimensions the model was trained at (Matryoshka, ``matryoshka_dims`` of its config), empty
        when it was not: only then are shorter embeddings (OpenAI's ``dimensions``) served. Those above the served
        dimension are left out."""
        return [d for d in getattr(self.model.config, "matryoshka_dims", None) or [] if d <= self.dim]

    @property
    def normalized(self) -> bool:
        """Whether the model L2-normalises its embeddings."""
        return bool(self.model.config.normalize)

    def max_tokens(self, side: Side) -> int:
        """Tokens the model reads of one side's text (longer ones are cut)."""
        return self.model.max_length(side)

    def token_counts(self, texts: Sequence[str], side: Side) -> list[int]:
        """Tokens of each text behind the side's prompt, special tokens included, before any cut."""
        ids = self.model.tokenizer(self.model.prompted(list(texts), side), add_special_tokens=True, verbose=False)[
            "input_ids"
        ]
        return [len(row) for row in ids]

    def embed(self, texts: Sequence[str], side: Side, truncate: bool = True) -> list[tuple[np.ndarray, int]]:
        """One ``(embedding float32 [dim], tokens read)`` per text; ``truncate`` False: a text longer than the
        side's token limit is a :class:`TooManyTokens` error instead of cut."""
        texts = list(texts)
        counts = self.token_counts(texts, side)
        limit = self.max_tokens(side)
        if not truncate:
            for i, count in enumerate(counts):
                if count > limit:
                    raise TooManyTokens(
                        f"input {i} has {count} tokens, more than the {limit} the model reads as a {side} "
                        "(send truncate: true to cut it)"
                    )
        encode = self.model.encode_queries if side == "query" else self.model.encode_passages
        vectors = encode(
            texts, batch_size=self.batch_size, show_progress=False, device=self.device, precision=self.precision
        )
        if self.cut is not None:
            from densepass.models.matryoshka import truncate

            vectors = truncate(np.asarray(vectors, dtype=np.float32), self.cut, self.normalized)
        return [(np.asarray(v, dtype=np.float32), min(c, limit)) for v, c in zip(vectors, counts)]

    def describe(self) -> dict:
        """What embeds (for ``/health`` and ``/v1/models``)."""
        names = list(self.public_names)  # not the model's path on the server
        return {"model": self.name, "dim": self.dim, "names": names, "matryoshka_dims": self.prefix_dims}


def short_name(source: str) -> str:
    """The name a client gives for the model saved at ``source``: the bundled model's name, ``org/name`` for a
    copy in the Hugging Face cache (``.../models--org--name/snapshots/REVISION``), else the folder's name."""
    from densepass.models.biencoder import model_name

    shown = model_name(source)
    if shown != source:
        return shown
    parts = Path(source).parts
    if "snapshots" in parts:
        repo = parts[parts.index("snapshots") - 1]
        if repo.startswith("models--"):
            return repo[len("models--") :].replace("--", "/")
    return Path(source).name or source


def bi_encoder_index(index: Any) -> Any:
    """The index among ``index`` (a hybrid's first part too) whose model is a :class:`BiEncoder`, or None."""
    if index is None:
        return None
    from densepass.models.biencoder import BiEncoder

    for candidate in (index, getattr(index, "first", None)):
        if candidate is not None and isinstance(getattr(candidate, "model", None), BiEncoder):
            return candidate
    return None


def find_embedder(searcher: Any) -> Embedder | None:
    """The :class:`Embedder` of a searcher that has one (``embedder`` attribute), or over the bi-encoder of a
    search pipeline's dense (or hybrid) index, encoding as that index encodes queries; None for other indexes
    (BM25, SPLADE, ColBERT, phrases), whose models give no single vector per text."""
    own = getattr(searcher, "embedder", None)
    if own is not None:
        return own
    index = bi_encoder_index(getattr(searcher, "index", None))
    if index is None:
        return None
    return Embedder(
        index.model,
        getattr(index, "model_path", None),
        getattr(index, "device", None),
        getattr(index, "precision", "auto") or "auto",
        getattr(index, "batch_size", 64) or 64,
        dim=getattr(index, "truncate_dim", None),  # a Matryoshka prefix index: its dimension
    )


def find_reranker(searcher: Any) -> PairScorer | None:
    """The second stage of a search pipeline (``--rerank``), or None."""
    reranker = getattr(searcher, "reranker", None)
    return reranker if reranker is not None and hasattr(reranker, "score_pairs") else None


class Current:
    """The embedder and the reranker of the searcher's current pipeline, found again when a reload
    (``serve.reload``) swapped its index or its reranker, so that the embedding and rerank routes compute with
    what ``/search`` searches with. ``embedder`` / ``reranker`` given: those, always."""

    def __init__(self, searcher: Any, embedder: Embedder | None = None, reranker: PairScorer | None = None) -> None:
        self.searcher, self.fixed_embedder, self.fixed_reranker = searcher, embedder, reranker
        self._embedder: tuple[Any, Embedder | None] | None = None  # (the index it was found in, it)

    def embedder(self) -> Embedder | None:
        """The embedder over the current index's bi-encoder (made once per index), or the one given."""
        if self.fixed_embedder is not None:
            return self.fixed_embedder
        index = getattr(self.searcher, "index", None)
        if self._embedder is None or self._embedder[0] is not index:  # (an id could be reused after a swap)
            self._embedder = (index, find_embedder(self.searcher))
        return self._embedder[1]

    def reranker(self) -> PairScorer | None:
        """The current pipeline's second stage, or the one given."""
        return self.fixed_reranker if self.fixed_reranker is not None else find_reranker(self.searcher)
