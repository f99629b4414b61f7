"""Dense indexes: a bi-encoder's passage embeddings searched by inner product, exactly or with FAISS.

Kinds: ``exact`` (chunked matrix products with a running top-k, ``index.exact``), ``faiss-flat``
(exact, FAISS ``IndexFlatIP``), ``faiss-hnsw`` (graph search) and ``faiss-ivfpq`` (inverted lists of
product-quantised codes, trained on the first passages added). Queries are encoded by the same model
that encoded the passages, in the index's encoding ``precision`` (``models.encode``: auto, fp32, bf16,
int8; a runtime option, not saved). The exact kind can search a bf16 / int8 copy of the passages and
re-score the best ``rescore x k`` of each query in float32 (``search_precision``, ``index.exact``; also a
runtime option). The saved index records that model's path and weights fingerprint,
and loading it with another model is refused.

>>> from densepass.models import BiEncoder
>>> model = BiEncoder.from_pretrained("all-MiniLM-L6-v2")
>>> index = DenseIndex.build(model, ["tar archiving utility", "X11 window manager"], show_progress=False)
>>> index.search(["window manager"], k=1).ids(0)
['1']
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from densepass.config import DENSE_INDEX_KINDS
from densepass.data.dataset import Corpus
from densepass.device import default_device, resolve_precision
from densepass.errors import ConfigError, DataError
from densepass.fingerprints import fingerprint_weights
from densepass.index.base import (
    Index,
    Passages,
    as_corpus,
    check_new_ids,
    check_queries,
    concat_corpora,
    is_vectors,
    next_free_id,
    records_corpus,
    register,
)
from densepass.index.checks import encoded_precision, model_for_index, model_settings, precision_as_built
from densepass.index.exact import SEARCH_PRECISIONS, ReducedPassages, exact_search, passages_on
from densepass.index.faiss_index import (
    build_faiss_index,
    check_trainable,
    faiss_search,
    load_faiss_index,
    save_faiss_index,
)
from densepass.models.biencoder import BiEncoder
from densepass.models.matryoshka import check_index_dim, truncate
from densepass.numerics import nonfinite_row, refuse_nonfinite_rows

EMBEDDINGS = "embeddings.npy"
FAISS_FILE = "faiss.index"
FAISS_OPTIONS = {"exact": (), "faiss-flat": (), "faiss-hnsw": ("hnsw_m",), "faiss-ivfpq": ("ivf_lists", "pq_m", "seed")}
"""The options each dense kind takes (``faiss_index.build_faiss_index``'s); any other would be saved unused."""


def check_faiss_options(kind: str, options: dict, dim: int) -> None:
    """A one-line ConfigError, before any passage is encoded, for an option the ``kind`` does not take (a typo, or
    another kind's) or a value FAISS cannot use: an HNSW graph links each node to ``hnsw_m`` >= 2 others; inverted
    lists and sub-vectors are positive integers (None: the default), ``pq_m`` dividing the dimension; the seed an
    integer >= 0."""
    takes = FAISS_OPTIONS[kind]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        article = "an" if kind == "exact" else "a"
        raise ConfigError(
            f"{article} {kind} index takes no option {', '.join(unknown)} (it takes: {', '.join(takes) or 'none'})"
        )
    for name, value in options.items():
        if value is None and name in ("ivf_lists", "pq_m"):
            continue
        least = {"hnsw_m": 2, "seed": 0}.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            wanted = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise ConfigError(f"{name} must be {wanted}, got {value!r}")
    if options.get("pq_m") is not None and dim % options["pq_m"]:
        raise ConfigError(f"pq_m={options['pq_m']} must divide the embedding dimension {dim}")


def finite_rows(embeddings: np.ndarray, ids: Any, what: str) -> np.ndarray:
    """``embeddings``, or a one-line DataError naming the first row (``what`` and its id, or its number without
    ``ids``) that holds NaN or infinity: torch's top-k ranks NaN first, so such a passage would come back first for
    every query, and such a query would get arbitrary passages, all scored NaN."""
    row = nonfinite_row(embeddings)
    if row is not None:
        name = repr(ids[row]) if ids is not None else row
        raise DataError(f"the embedding of {what} {name} holds NaN or infinity: encode it again")
    return embeddings


def weights_version(model: BiEncoder) -> int:
    """How many in-place changes the model's weights have seen (optimiser steps, loads): a cheap way to tell
    that the model is no longer the one that encoded an index."""
    return sum(p._version for p in model.parameters())


def query_embeddings(
    model: BiEncoder, queries: Any, batch_size: int, device: torch.device | None, precision: str
) -> np.ndarray:
    """Query embeddings for a dense index: texts are encoded by ``model``, an array of embeddings is used as it is;
    one holding NaN or infinity is a one-line error (``finite_rows``)."""
    if is_vectors(queries):
        queries = np.asarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != model.dim:
            raise ConfigError(f"query embeddings must be [n, {model.dim}], got {list(queries.shape)}")
        return finite_rows(queries, None, "query")
    encoded = model.encode_queries(
        check_queries(queries), batch_size=batch_size, show_progress=False, device=device, precision=precision
    )
    return finite_rows(encoded, None, "query")


def require_model_path(model_path: str | None) -> None:
    """A one-line error unless a dense index about to be saved knows where its model is."""
    if model_path is None:
        raise ConfigError(
            "save the model first (BiEncoder.save) or give model_path: the index records "
            "which model encodes its queries"
        )


@register
class DenseIndex(Index):
    """Passage embeddings of one bi-encoder, searched exactly or with a FAISS index."""

    kinds: ClassVar[tuple[str, ...]] = DENSE_INDEX_KINDS
    load_options: ClassVar[tuple[str, ...]] = (
        "model",
        "batch_size",
        "device",
        "precision",
        "mmap",
        "search_precision",
        "rescore",
    )
    kind = "exact"

    def __init__(
        self,
        model: BiEncoder,
        kind: str = "exact",
        batch_size: int = 256,
        device: torch.device | None = None,
        show_progress: bool = True,
        model_path: str | None = None,
        precision: str = "auto",
        search_precision: str = "fp32",
        rescore: int = 4,
        dim: int | None = None,
        **faiss_options: Any,
    ) -> None:
        resolve_precision(precision, device or default_device())  # a bad name fails before any work
        if dim is not None:  # Matryoshka prefixes (models.matryoshka): above the model's size is refused
            dim = check_index_dim(dim, model.dim, model.config.matryoshka_dims, model.source)
        self.truncate_dim = None if dim == model.dim else dim
        if kind not in DENSE_INDEX_KINDS:
            raise ConfigError(f"unknown dense index kind {kind!r} (known: {', '.join(DENSE_INDEX_KINDS)})")
        if search_precision not in SEARCH_PRECISIONS:
            raise ConfigError(f"unknown search precision {search_precision!r} (known: {', '.join(SEARCH_PRECISIONS)})")
        if search_precision != "fp32" and kind != "exact":
            raise ConfigError(f"search precision {search_precision} is an option of the exact index, not of {kind}")
        if rescore < 1:
            raise ConfigError(f"rescore must be >= 1, got {rescore}")
        if batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {batch_size}")
        check_faiss_options(kind, faiss_options, self.truncate_dim or model.dim)
        self.model, self.kind, self.batch_size, self.device = model, kind, batch_size, device
        self.show_progress, self.faiss_options, self.precision = show_progress, faiss_options, precision
        self.search_precision, self.rescore = search_precision, rescore
        self._reduced: ReducedPassages | None = None  # the bf16 / int8 copy, made at the first search
        self._resident: torch.Tensor | None = None  # fp32 search: the passages on the device, from the first search
        self.model_path = model_path or model.source
        self.passages = Corpus([], [], [], [])
        self.embeddings = np.zeros((0, self.dim), dtype=np.float32)
        self.faiss = None
        self.model_fingerprint: str | None = None  # of the model that encoded the passages (set when saved/loaded)
        self._weights_version: int | None = None  # the model's in-place update count when it encoded them

    @classmethod
    def build(cls, model: BiEncoder, passages: Passages, kind: str = "exact", **options: Any) -> DenseIndex:
        """Encode ``passages`` (a Corpus, texts, or {id, title, text} records) with ``model`` and index them."""
        index = cls(model, kind, **options)
        index.add(passages)
        return index

    @property
    def dim(self) -> int:
        """Embedding dimension: the model's, or the prefix the index was built at (``dim=``)."""
        return self.truncate_dim or self.model.dim

    def cut(self, embeddings: np.ndarray) -> np.ndarray:
        """The model's embeddings ``[n, model dim]`` cut to the index's dimension (normalised again where the model
        normalises: ``models.matryoshka.truncate``); embeddings of the index's dimension as they are."""
        embeddings = np.asarray(embeddings, dtype=np.float32)
        if self.truncate_dim is None or embeddings.ndim != 2 or embeddings.shape[1] != self.model.dim:
            return embeddings
        return truncate(embeddings, self.truncate_dim, self.model.config.normalize)

    def to_numpy(self) -> tuple[list[str], np.ndarray]:
        """(passage ids, float32 embeddings [n, dim]) of the passages it searches, for another store
        (``index.vectors``)."""
        from densepass.index.vectors import live_embeddings

        return live_embeddings(self)

    def to_arrow(self, texts: bool = True):
        """The passages it searches as a ``pyarrow.Table``: id, title, text and embedding (``index.vectors``)."""
        from densepass.index.vectors import embeddings_table

        return embeddings_table(self, texts)

    def add(self, passages: Passages) -> None:
        """Encode ``passages`` with the model and index them (their ids checked first: new, each once)."""
        corpus = as_corpus(passages, first_id=next_free_id(self.passages))
        check_new_ids(self.passages, corpus)
        if self.faiss is None:  # trained on the first passages added
            check_trainable(self.kind, len(self.passages) + len(corpus))
        embeddings = self.model.encode_passages(
            corpus,
            batch_size=self.batch_size,
            show_progress=self.show_progress,
            device=self.device,
            precision=self.precision,
        )
        self.add_embeddings(corpus, embeddings)

    def add_embeddings(self, passages: Passages, embeddings: np.ndarray) -> None:
        """Index passages whose embeddings were computed already (by this index's model). Everything that can fail
        (the shape, NaN or infinity, a repeated id, the FAISS index's training) comes before the index changes."""
        corpus = as_corpus(passages, first_id=next_free_id(self.passages))
        embeddings = self.cut(embeddings)  # the model's full embeddings, cut to a prefix index's dimension
        if embeddings.shape != (len(corpus), self.dim):
            raise ConfigError(
                f"embeddings of shape {embeddings.shape} for {len(corpus)} passages of a {self.dim}-dimensional model"
            )
        finite_rows(embeddings, corpus.ids, "passage")
        merged = concat_corpora(self.passages, corpus) if len(self.passages) else corpus
        every = np.concatenate([self.embeddings, embeddings]) if len(self.embeddings) else embeddings
        built = None
        if self.kind != "exact" and self.faiss is None:
            built = build_faiss_index(every, self.kind, **self.faiss_options)
        if self._weights_version is None:
            self._weights_version = weights_version(self.model)
        self.passages, self.embeddings = merged, every
        self._reduced = self._resident = None
        if built is not None:
            self.faiss = built
        elif self.kind != "exact":
            self.faiss.add(np.ascontiguousarray(embeddings))

    def encode_queries(self, queries: Any) -> np.ndarray:
        """Query embeddings: texts are encoded by the model, an array of embeddings is used as it is; an index built
        at a prefix dimension cuts them to it (an array already of that dimension is used as it is)."""
        if self.truncate_dim is not None and is_vectors(queries):
            if queries.ndim == 2 and queries.shape[1] == self.dim:
                return finite_rows(np.asarray(queries, dtype=np.float32), None, "query")
        return self.cut(query_embeddings(self.model, queries, self.batch_size, self.device, self.precision))

    # ---- a living index (index.base: tombstones, upsert, compaction) ----------------------------------------

    def encode_new(self, corpus: Corpus) -> np.ndarray:
        """The passage embeddings of ``corpus`` (for ``upsert``, and a hybrid's ``add``), by the index's model: one
        holding NaN or infinity is refused here, before any part of a hybrid takes the passages (as is a first fill
        too small to train the FAISS index on)."""
        if self.faiss is None:
            check_trainable(self.kind, len(self.passages) + len(corpus))
        embeddings = self.model.encode_passages(
            corpus,
            batch_size=self.batch_size,
            show_progress=self.show_progress,
            device=self.device,
            precision=self.precision,
        )
        return finite_rows(embeddings, corpus.ids, "passage")

    def append_encoded(self, corpus: Corpus, prepared: np.ndarray) -> None:
        """Index ``corpus`` with its embeddings ``prepared``."""
        self.add_embeddings(corpus, prepared)

    def upsert_embeddings(self, passages: Passages, embeddings: np.ndarray) -> None:
        """``upsert`` of passages whose embeddings were computed already (by this index's model; full size or cut,
        as ``add_embeddings`` takes them)."""
        corpus = records_corpus(passages)
        embeddings = self.cut(embeddings)  # the model's full embeddings, cut to a prefix index's dimension
        if embeddings.shape != (len(corpus), self.dim):
            raise ConfigError(
                f"embeddings of shape {embeddings.shape} for {len(corpus)} passages of a {self.dim}-dimensional index"
            )
        self.upsert_encoded(corpus, finite_rows(embeddings, corpus.ids, "passage"))  # before the old rows go

    def _compact(self, live: np.ndarray) -> None:
        """Keep the ``live`` rows' passages and embeddings; the FAISS index is made again from those: flat and HNSW
        built anew (HNSW removes nothing from its graph), IVF-PQ refilled with its trained quantisers kept."""
        self.passages = self.passages.subset(live.tolist())
        self.embeddings = np.ascontiguousarray(self.embeddings[live], dtype=np.float32)
        self._reduced = self._resident = None
        if self.faiss is None:
            return
        if self.kind == "faiss-ivfpq":
            self.faiss.reset()  # the lists emptied, the coarse and product quantisers kept
            self.faiss.add(self.embeddings)
        else:
            self.faiss = build_faiss_index(self.embeddings, self.kind, **self.faiss_options)

    def search_rows(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` (scores, rows) of each query (texts, or query embeddings)."""
        query_emb = self.encode_queries(queries)
        if self.faiss is not None:
            return faiss_search(self.faiss, query_emb, k)
        device = self.device or default_device()
        if self.search_precision != "fp32":  # the reduced copy on the device; fp32 re-scoring reads the array
            if self._reduced is None:
                self._reduced = ReducedPassages(self.embeddings, self.search_precision, device)
            return exact_search(query_emb, self.embeddings, k, reduced=self._reduced, rescore=self.rescore)
        if self._resident is None:  # on a GPU, one copy for every search (a copy per search costs more than the search)
            self._resident = passages_on(self.embeddings, device)  # on the CPU a view of the array: no copy
        return exact_search(query_emb, self._resident, k, device=device)

    # ---- persistence ----------------------------------------------------------------------------

    def facts(self) -> dict:
        """Model path and weights fingerprint, dimension and FAISS options, for the manifest."""
        if self._weights_version is not None and weights_version(self.model) != self._weights_version:
            raise ConfigError("the model changed after it encoded the indexed passages: build the index again")
        if self.model_fingerprint is None:
            self.model_fingerprint = fingerprint_weights(self.model)
        return {
            "model": {
                "path": self.model_path,
                "fingerprint": self.model_fingerprint,
                "settings": model_settings(self.model),  # what else shapes its embeddings (index.checks)
            },
            "dim": self.dim,
            "precision": encoded_precision(self.precision, self.device),  # reloaded, queries encode the same way
            "options": self.faiss_options,
            # an index of Matryoshka prefixes: queries are cut to the same dimension when it is searched
            **({"truncate_dim": self.truncate_dim} if self.truncate_dim is not None else {}),
        }

    def _write(self, directory: Path) -> None:
        np.save(directory / EMBEDDINGS, self.embeddings)
        if self.faiss is not None:
            save_faiss_index(self.faiss, directory / FAISS_FILE)

    def save(self, directory: str | Path) -> Path:
        """Write the index atomically (the model must be saved somewhere: the manifest records where)."""
        require_model_path(self.model_path)
        refuse_nonfinite_rows(self.embeddings, self.passages.ids, str(directory), saving=True)  # NaN scores
        return super().save(directory)

    @classmethod
    def _from_manifest(cls, directory: Path, manifest: dict, model: BiEncoder | None, settings: dict) -> DenseIndex:
        """An empty index of the kind, model (the recorded one loaded and checked, or ``model``), prefix dimension
        and ``settings`` a saved manifest describes, for ``_read`` to fill with the saved rows."""
        recorded = manifest["model"]
        model = model_for_index(directory, manifest["kind"], recorded, model, BiEncoder)
        with warnings.catch_warnings():  # the prefix dimension was warned about when the index was built
            warnings.simplefilter("ignore")
            index = cls(
                model,
                manifest["kind"],
                model_path=recorded["path"],
                show_progress=False,
                dim=manifest.get("truncate_dim"),
                **settings,
            )
        index.model_fingerprint = recorded["fingerprint"]
        return index

    @classmethod
    def _read(
        cls,
        directory: Path,
        manifest: dict,
        passages: Corpus,
        model: BiEncoder | None = None,
        mmap: bool = True,
        **options: Any,
    ) -> DenseIndex:
        saved = {name: value for name, value in manifest["options"].items() if name in FAISS_OPTIONS[manifest["kind"]]}
        options = precision_as_built(manifest, options)
        index = cls._from_manifest(directory, manifest, model, dict(**options, **saved))  # (others: saved unused)
        embeddings = np.load(directory / EMBEDDINGS, mmap_mode="r" if mmap else None, allow_pickle=False)
        if embeddings.shape != (len(passages), manifest["dim"]):
            raise DataError(f"{directory}: embeddings of shape {embeddings.shape} for {len(passages)} passages")
        if embeddings.dtype != np.float32:
            raise DataError(f"{directory}: {EMBEDDINGS} holds {embeddings.dtype} numbers, not float32 (damaged?)")
        refuse_nonfinite_rows(embeddings, passages.ids, str(directory), saving=False)  # a memory map: in blocks
        index.passages, index.embeddings = passages, embeddings
        index._weights_version = weights_version(index.model)
        if manifest["kind"] != "exact":
            index.faiss = load_faiss_index(directory / FAISS_FILE, *embeddings.shape)  # its rows and dimension
        return index
