"""Compact dense indexes: passages held in memory as sign bits (binary) or as int8 codes, searched in that form for
``rescore_multiplier x k`` candidates, then re-scored with int8 or float32 embeddings kept on disk.

Kinds (``densepass index --embedding-precision binary|int8``):

- ``binary-flat`` / ``binary-hnsw`` / ``binary-ivf``: one bit per dimension (x > 0), packed 8 to a byte
  (sentence-transformers' ``quantize_embeddings(..., "ubinary")``), in FAISS ``IndexBinaryFlat`` (exact Hamming),
  ``IndexBinaryHNSW`` (graph) or ``IndexBinaryIVF`` (inverted lists over a Hamming k-means), chosen by ``--kind``
  (exact / faiss-flat, faiss-hnsw, faiss-ivfpq: inverted lists of the bits themselves). The first pass ranks by
  Hamming distance between the query's sign bits and each passage's, that is by the dot product of the ±1 sign
  vectors (``dim - 2 x hamming``, the score shown when nothing re-scores). The dimension must be a multiple of 8.
- ``int8-flat``: int8 codes with calibrated per-dimension ranges (sentence-transformers' ``quantize_embeddings(...,
  "int8", ranges=...)``: 256 buckets between each dimension's minimum and maximum over the passages first added,
  stored with the index in ``int8_ranges.npy``), scored exactly against the float query (the codes dequantised to
  their bucket's middle).

Re-scoring (``rescore_with``): ``float`` scores each candidate with the float query against its float32 embedding
(the exact score); ``int8`` against its dequantised int8 codes (for ``int8-flat``, its first pass already); ``none``
keeps the first pass. The query stays in float32 throughout, as in sentence-transformers' rescoring recipe (which
re-scores a binary first pass with the float query against the unpacked bits; densepass re-scores with int8 or
float32 embeddings instead, the two compared side by side in ``benchmarks/bench_compact.py``). The re-scoring
embeddings (``embeddings.npy``, float32; ``int8.npy``) are read from disk through memory maps
(``np.load(mmap_mode="r")``), a few queries' candidates at a time: what a loaded index holds in RAM is its codes
(``memory_bytes``). When the multiplier covers the corpus, float re-scoring gives exact search's top k.

Memory: binary-flat holds dim / 8 bytes a passage (32x less than float32); an HNSW graph adds its links
(``hnsw_m`` = 32: about 256 bytes a passage at the base level, more than 384 dimensions' bits), an IVF index an
8-byte id a passage.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from densepass.data.dataset import Corpus
from densepass.errors import ConfigError, DataError
from densepass.index.base import Passages, as_corpus, concat_corpora, register
from densepass.index.dense import EMBEDDINGS, DenseIndex, weights_version
from densepass.index.exact import sort_by_score_then_row, top_k_by_score_then_row
from densepass.io import atomic_file
from densepass.models.biencoder import BiEncoder
from densepass.numerics import refuse_nonfinite_rows

BINARY_KINDS = ("binary-flat", "binary-hnsw", "binary-ivf")
COMPACT_KINDS = (*BINARY_KINDS, "int8-flat")
EMBEDDING_PRECISIONS = ("fp32", "int8", "binary")
RESCORES = ("float", "int8", "none")
CODES, RANGES, BITS = "int8.npy", "int8_ranges.npy", "binary.index"
BINARY_KIND_OF = {"exact": "binary-flat", "faiss-flat": "binary-flat", "faiss-hnsw": "binary-hnsw"}
BINARY_KIND_OF["faiss-ivfpq"] = "binary-ivf"  # inverted lists; the codes are the bits themselves (no PQ)


def compact_kind(precision: str, kind: str) -> str:
    """The index kind of ``densepass index --embedding-precision precision --kind kind`` (fp32: ``kind`` itself)."""
    if precision not in EMBEDDING_PRECISIONS:
        raise ConfigError(f"unknown embedding precision {precision!r} (known: {', '.join(EMBEDDING_PRECISIONS)})")
    if precision == "fp32":
        return kind
    if precision == "int8":
        if kind != "exact":
            raise ConfigError(f"--embedding-precision int8 is scored exactly: use --kind exact, not {kind}")
        return "int8-flat"
    if kind not in BINARY_KIND_OF:
        raise ConfigError(
            f"--embedding-precision binary takes --kind exact, faiss-flat, faiss-hnsw or faiss-ivfpq, not {kind}"
        )
    return BINARY_KIND_OF[kind]


def _quantize(embeddings: np.ndarray, precision: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """sentence-transformers' ``quantize_embeddings`` (int8 with ``ranges``; ubinary: packed sign bits)."""
    try:
        from sentence_transformers.util.quantization import quantize_embeddings
    except ImportError:  # sentence-transformers before 5
        from sentence_transformers.quantization import quantize_embeddings
    if len(embeddings) == 0:
        width = embeddings.shape[1] // 8 if precision == "ubinary" else embeddings.shape[1]
        return np.zeros((0, width), dtype=np.uint8 if precision == "ubinary" else np.int8)
    return quantize_embeddings(np.ascontiguousarray(embeddings, dtype=np.float32), precision, ranges=ranges)


def int8_ranges(embeddings: np.ndarray) -> np.ndarray:
    """Per-dimension [minimum; maximum] of ``embeddings`` ([2, dim], float32): the int8 calibration."""
    if len(embeddings) < 2:
        raise ConfigError("int8 codes calibrate each dimension's range on the passages: index at least 2")
    return np.stack([embeddings.min(axis=0), embeddings.max(axis=0)]).astype(np.float32)


def dequantize(codes: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """int8 codes back to floats: the middle of each code's bucket, ``min + (code + 128.5) x (max - min) / 255``
    (sentence-transformers' dequantisation takes the bucket's lower edge: the same ranking, half a step lower)."""
    start, steps = _affine(ranges)
    return (codes.astype(np.float32) + 128.5) * steps + start


def _affine(ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    steps = (ranges[1] - ranges[0]) / 255
    return ranges[0].astype(np.float32), np.where(steps == 0, 1, steps).astype(np.float32)


def build_binary_index(
    bits: np.ndarray, kind: str, hnsw_m: int = 32, ivf_lists: int | None = None, nprobe: int | None = None, seed=13
):
    """A FAISS binary index of packed sign bits ``bits`` ([n, dim / 8] uint8): flat, HNSW or IVF (trained on a
    sample; ``ivf_lists`` default 4 sqrt(n), at least 39 passages per list)."""
    import faiss

    n, width = bits.shape
    dim = width * 8
    if kind == "binary-flat":
        index = faiss.IndexBinaryFlat(dim)
    elif kind == "binary-hnsw":
        index = faiss.IndexBinaryHNSW(dim, hnsw_m)
        index.hnsw.efSearch = 128
    elif kind == "binary-ivf":
        lists = ivf_lists or max(1, min(4096, int(4 * math.sqrt(n))))
        lists = max(1, min(lists, n // 39))
        quantizer = faiss.IndexBinaryFlat(dim)
        index = faiss.IndexBinaryIVF(quantizer, dim, lists)
        index.own_fields = True  # the index frees its quantiser
        quantizer.this.disown()
        sample = bits[np.random.default_rng(seed).choice(n, size=min(n, 256 * lists), replace=False)]
        index.train(np.ascontiguousarray(sample))
        index.nprobe = min(lists, nprobe or 32)
    else:
        raise ConfigError(f"unknown binary index kind {kind!r} (known: {', '.join(BINARY_KINDS)})")
    index.add(np.ascontiguousarray(bits))
    return index


@register
class CompactIndex(DenseIndex):
    """Binary or int8 codes of one bi-encoder's passage embeddings in memory, re-scored from disk (module docstring).

    >>> from densepass.models import BiEncoder
    >>> model = BiEncoder.from_pretrained("all-MiniLM-L6-v2")
    >>> texts = ["tar archiving utility", "X11 window manager", "audio editor"]
    >>> index = CompactIndex.build(model, texts, "binary-flat", show_progress=False)
    >>> index.search(["window manager"], k=1).ids(0), index.memory_bytes() // len(index)
    (['1'], 48)
    """

    kinds: ClassVar[tuple[str, ...]] = COMPACT_KINDS
    load_options: ClassVar[tuple[str, ...]] = (
        "model",
        "batch_size",
        "device",
        "precision",
        "rescore_with",
        "rescore_multiplier",
    )
    kind = "binary-flat"

    def __init__(
        self,
        model: BiEncoder,
        kind: str = "binary-flat",
        rescore_with: str = "float",
        rescore_multiplier: int = 4,
        batch_size: int = 256,
        device: torch.device | None = None,
        show_progress: bool = True,
        model_path: str | None = None,
        precision: str = "auto",
        dim: int | None = None,
        **binary_options: Any,
    ) -> None:
        if kind not in COMPACT_KINDS:
            raise ConfigError(f"unknown compact index kind {kind!r} (known: {', '.join(COMPACT_KINDS)})")
        self.check_search_options(rescore_with, rescore_multiplier)
        unknown = sorted(set(binary_options) - {"hnsw_m", "ivf_lists", "nprobe"})
        if unknown:
            raise ConfigError(f"a {kind} index takes no option {', '.join(unknown)}")
        super().__init__(
            model, "exact", batch_size, device, show_progress, model_path, precision, dim=dim, **binary_options
        )
        if kind in BINARY_KINDS and self.dim % 8:
            raise ConfigError(f"binary codes pack 8 dimensions to a byte: {self.dim} is not a multiple of 8 (--dim)")
        self.kind, self.rescore_with, self.rescore_multiplier = kind, rescore_with, rescore_multiplier
        self.ranges: np.ndarray | None = None  # int8 calibration [2, dim], from the first passages added
        self.codes = np.zeros((0, self.dim), dtype=np.int8)  # on disk (memory-mapped) once saved and loaded
        self.bits = None  # the FAISS binary index (binary kinds)

    @staticmethod
    def check_search_options(rescore_with: str, rescore_multiplier: int) -> None:
        """A one-line ConfigError for an unknown re-scoring or a multiplier that is not an integer >= 1."""
        if rescore_with not in RESCORES:
            raise ConfigError(f"unknown re-scoring {rescore_with!r} (known: {', '.join(RESCORES)})")
        if isinstance(rescore_multiplier, bool) or not isinstance(rescore_multiplier, int) or rescore_multiplier < 1:
            raise ConfigError(f"the re-scoring multiplier must be an integer >= 1, got {rescore_multiplier!r}")

    def memory_bytes(self) -> int:
        """Bytes the index holds in RAM for its passages' vectors once loaded: the FAISS binary index (codes, and the
        HNSW graph or the IVF lists' ids), or the int8 codes; the re-scoring embeddings are memory-mapped files
        (page cache the system may drop), not counted. Passage ids and texts are not counted either."""
        if self.kind == "int8-flat":
            return int(self.codes.nbytes)
        if self.bits is None:
            return 0
        if self.kind == "binary-flat":
            return int(self.bits.ntotal * self.bits.code_size)
        import faiss

        return int(faiss.serialize_index_binary(self.bits).nbytes)  # codes, graph or lists (and a small header)

    def add_embeddings(self, passages: Passages, embeddings: np.ndarray) -> None:
        """Index passages whose embeddings were computed already (by this index's model; full size or cut)."""
        corpus = as_corpus(passages, first_id=len(self.passages))
        embeddings = self.cut(embeddings)
        if embeddings.shape != (len(corpus), self.dim):
            raise ConfigError(
                f"embeddings of shape {embeddings.shape} for {len(corpus)} passages of a {self.dim}-dimensional index"
            )
        if self._weights_version is None:
            self._weights_version = weights_version(self.model)
        if self.ranges is None:
            self.ranges = int8_ranges(embeddings)
        codes = _quantize(embeddings, "int8", self.ranges)
        if self.kind in BINARY_KINDS:
            bits = _quantize(embeddings, "ubinary")
            if self.bits is None:
                self.bits = build_binary_index(bits, self.kind, **self.faiss_options)
            else:
                self.bits.add(np.ascontiguousarray(bits))
        self.passages = concat_corpora(self.passages, corpus) if len(self.passages) else corpus
        self.embeddings = np.concatenate([self.embeddings, embeddings]) if len(self.embeddings) else embeddings
        self.codes = np.concatenate([self.codes, codes]) if len(self.codes) else codes

    def _compact(self, live: np.ndarray) -> None:
        """Keep the ``live`` rows: embeddings and codes copied, the binary index built again (the int8 ranges kept)."""
        self.passages = self.passages.subset(live.tolist())
        self.embeddings = np.ascontiguousarray(self.embeddings[live], dtype=np.float32)
        self.codes = np.ascontiguousarray(self.codes[live])
        if self.kind in BINARY_KINDS:
            self.bits = build_binary_index(_quantize(self.embeddings, "ubinary"), self.kind, **self.faiss_options)

    def search_rows(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` (scores, rows): the first pass over the codes, then the re-scoring (module docstring)."""
        q = np.ascontiguousarray(self.encode_queries(queries), dtype=np.float32)
        n = len(self.passages)
        rescoring = self.rescore_with != "none" and not (self.kind == "int8-flat" and self.rescore_with == "int8")
        depth = min(n, k * self.rescore_multiplier if rescoring else k)
        if self.kind == "int8-flat":
            first, rows = self._int8_scan(q, depth)
        else:
            if self.kind == "binary-hnsw":
                self.bits.hnsw.efSearch = max(128, depth)
            distances, rows = self.bits.search(_quantize(q, "ubinary"), depth)
            first = (self.dim - 2 * distances).astype(np.float32)  # the ±1 sign vectors' dot product
            first[rows < 0] = -np.inf
        if rescoring:
            first = self._rescored(q, rows)
        scores, order = sort_by_score_then_row(torch.from_numpy(first), torch.from_numpy(rows.astype(np.int64)))
        scores, order = scores[:, :k].numpy(), order[:, :k].numpy()
        missing = ~np.isfinite(scores)
        return np.where(missing, 0, scores).astype(np.float32), np.where(missing, -1, order)

    def _int8_scan(self, q: np.ndarray, depth: int, chunk: int = 65_536) -> tuple[np.ndarray, np.ndarray]:
        """The top ``depth`` rows of every query by its float dot product with the dequantised int8 codes: with
        ``x = start + (code + 128.5) step``, ``q . x = (q * step) . (code + 128.5) + q . start``."""
        start, steps = _affine(self.ranges)
        scaled = torch.from_numpy(q * steps)
        offset = torch.from_numpy(q @ start)[:, None]
        best_scores, best_rows = None, None
        for s in range(0, len(self.codes), chunk):
            codes = torch.from_numpy(np.asarray(self.codes[s : s + chunk], dtype=np.float32)) + 128.5
            scores, rows = top_k_by_score_then_row(scaled @ codes.T + offset, depth)
            rows = rows + s
            if best_scores is not None:
                scores, rows = sort_by_score_then_row(
                    torch.cat([best_scores, scores], 1), torch.cat([best_rows, rows], 1)
                )
            best_scores, best_rows = scores[:, :depth], rows[:, :depth]
        return best_scores.numpy(), best_rows.numpy()

    def _rescored(self, q: np.ndarray, rows: np.ndarray, budget: int = 1 << 24) -> np.ndarray:
        """Each candidate's score: the float query against its float32 embedding or dequantised int8 codes, read
        from the memory maps in row order (each row once), a few queries at a time (at most ``budget`` gathered
        numbers); -inf for the padding rows (-1)."""
        out = np.empty(rows.shape, dtype=np.float32)
        step = max(1, budget // max(1, rows.shape[1] * q.shape[1]))
        source = self.embeddings if self.rescore_with == "float" else self.codes
        for start in range(0, len(q), step):
            block = rows[start : start + step]
            valid = block >= 0
            unique, inverse = np.unique(np.where(valid, block, 0), return_inverse=True)
            vectors = np.asarray(source[unique])
            if self.rescore_with == "int8":
                vectors = dequantize(vectors, self.ranges)
            vectors = vectors.astype(np.float32)[inverse.reshape(block.shape)]  # [queries, candidates, dim]
            scores = np.einsum("qd,qcd->qc", q[start : start + step], vectors)
            out[start : start + step] = np.where(valid, scores, -np.inf)
        return out

    # ---- persistence ----------------------------------------------------------------------------

    def facts(self) -> dict:
        """The dense index's facts, with the re-scoring defaults among the options."""
        facts = super().facts()
        options = {**self.faiss_options, "rescore_with": self.rescore_with}
        return {**facts, "options": {**options, "rescore_multiplier": self.rescore_multiplier}}

    def _write(self, directory: Path) -> None:
        np.save(directory / EMBEDDINGS, self.embeddings)
        np.save(directory / CODES, np.asarray(self.codes))
        np.save(directory / RANGES, self.ranges)
        if self.bits is not None:
            import faiss

            with atomic_file(directory / BITS, "wb") as handle:
                handle.write(faiss.serialize_index_binary(self.bits).tobytes())

    @classmethod
    def _read(
        cls, directory: Path, manifest: dict, passages: Corpus, model: BiEncoder | None = None, **options: Any
    ) -> CompactIndex:
        index = cls._from_manifest(directory, manifest, model, {**manifest["options"], **options})
        rows, dim = len(passages), manifest["dim"]
        embeddings = np.load(directory / EMBEDDINGS, mmap_mode="r", allow_pickle=False)
        codes = np.load(directory / CODES, mmap_mode="r", allow_pickle=False)
        ranges = np.load(directory / RANGES, allow_pickle=False)
        for name, array, dtype, shape in [
            (EMBEDDINGS, embeddings, np.float32, (rows, dim)),
            (CODES, codes, np.int8, (rows, dim)),
            (RANGES, ranges, np.float32, (2, dim)),
        ]:
            if array.shape != shape or array.dtype != dtype:
                raise DataError(f"{directory}: {name} holds {array.dtype} {list(array.shape)}, not {shape} (damaged?)")
        refuse_nonfinite_rows(embeddings, passages.ids, str(directory), saving=False)
        index.passages, index.embeddings, index.ranges = passages, embeddings, ranges
        index.codes = np.array(codes) if manifest["kind"] == "int8-flat" else codes  # int8-flat scans them: in RAM
        index._weights_version = weights_version(index.model)
        if manifest["kind"] in BINARY_KINDS:
            import faiss

            try:  # FAISS's reader checks sizes and raises RuntimeError: a file changed under a rewritten manifest
                index.bits = faiss.deserialize_index_binary(np.fromfile(directory / BITS, dtype=np.uint8))
            except (RuntimeError, MemoryError) as err:  # MemoryError: a size in the header past the memory
                said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                said = said.split("Error: ", 1)[-1]  # drop FAISS's "Error in <function> at <file>:<line>:" prefix
                raise DataError(
                    f"{directory / BITS} does not load as a FAISS binary index (damaged?): {said[:300]}"
                ) from None
            if index.bits.ntotal != rows or index.bits.d != dim:
                raise DataError(f"{directory}: {BITS} holds {index.bits.ntotal} codes of {index.bits.d} bits")
        return index
