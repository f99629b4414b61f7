"""Compact dense indexes: passages held in memory as sign bits (binary) or as int8 codes, searched in that form for
``rescore_multiplier x k`` candidates, then re-scored with int8 or float32 embeddings kept on disk.

Kinds (``densepass index --embedding-precision binary|int8``):

- ``binary-flat`` / ``binary-hnsw`` / ``binary-ivf``: one bit per dimension (x > 0), packed 8 to a byte
  (sentence-transformers' ``quantize_embeddings(..., "ubinary")``), in FAISS ``IndexBinaryFlat`` (exact Hamming),
  ``IndexBinaryHNSW`` (graph) or ``IndexBinaryIVF`` (inverted lists over a Hamming k-means), chosen by ``--kind``
  (exact / faiss-flat, faiss-hnsw, faiss-ivfpq: inverted lists of the bits themselves). The first pass ranks by
  Hamming distance between the query's sign bits and each passage's, that is by the dot product of the ±1 sign
  vectors (``dim - 2 x hamming``, the score shown when nothing re-scores). The dimension must be a multiple of 8.
- ``int8-flat``: int8 codes with calibrated per-dimension ranges (the codes of sentence-transformers'
  ``quantize_embeddings(..., "int8", ranges=...)``, computed by densepass: 256 buckets between each dimension's
  minimum and maximum over the passages first added, stored with the index in ``int8_ranges.npy``), scored exactly
  against the float query (the codes dequantised to their bucket's middle). The scan is FAISS's
  ``IndexScalarQuantizer`` with ``QT_8bit``, whose decoding of a uint8 code ``c``, ``vmin + (c + 0.5) / 255 x
  vdiff``, is ``dequantize`` of the int8 code ``c - 128`` with ``vmin`` the range's minimum and ``vdiff`` 255 steps
  (``int8_flat_index``): the stored codes go in as they are (+ 128), never re-encoded, and FAISS decodes and scores
  them in SIMD registers instead of a float32 copy per search.

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
8-byte id a passage; int8-flat dim bytes a passage, held once, by its FAISS index (``int8.npy`` stays on disk).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from densepass.data.dataset import Corpus
from densepass.errors import ConfigError, DataError
from densepass.index.base import Passages, as_corpus, concat_corpora, next_free_id, register
from densepass.index.dense import EMBEDDINGS, DenseIndex, finite_rows, weights_version
from densepass.index.exact import sort_by_score_then_row
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
    """The codes of sentence-transformers' ``quantize_embeddings`` (its current rule, computed here so that codes
    never depend on the installed version: releases before it neither floored nor clipped, and values outside the
    calibrated range, which passages added later can have, wrapped around int8). int8 with ``ranges``: each value's
    bucket of 256 between its dimension's minimum and maximum, ``clip(floor((x - min) / step), 0, 255) - 128``;
    ubinary: the sign bits, packed eight to a byte."""
    embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
    if precision == "ubinary":
        return np.packbits(embeddings > 0, axis=-1)
    start, steps = _affine(ranges)
    return (np.clip(np.floor((embeddings - start) / steps), 0, 255) - 128).astype(np.int8)


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


def int8_flat_index(ranges: np.ndarray):
    """An empty FAISS ``IndexScalarQuantizer`` (``QT_8bit``, inner product) whose decoding is ``dequantize`` with
    ``ranges``: trained with ``vmin`` = each dimension's minimum and ``vdiff`` = 255 steps (``_affine``), so that a
    code ``c + 128`` decodes to ``min + (c + 128.5) x step``. Fill it with ``add_int8_codes``."""
    import faiss

    start, steps = _affine(ranges)
    index = faiss.IndexScalarQuantizer(len(start), faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    faiss.copy_array_to_vector(np.concatenate([start, steps * np.float32(255)]).astype(np.float32), index.sq.trained)
    index.is_trained = True
    return index


def add_int8_codes(index, codes: np.ndarray, chunk: int = 65_536) -> None:
    """Append int8 ``codes`` (an array or a memory map) to ``int8_flat_index``'s FAISS index as its uint8 codes
    ``code + 128`` (the sign bit flipped), ``chunk`` rows at a time: no second full copy in memory."""
    for start in range(0, len(codes), chunk):
        part = np.ascontiguousarray(codes[start : start + chunk], dtype=np.int8)
        index.add_sa_codes(part.view(np.uint8) ^ np.uint8(0x80))


def int8_codes_of(index, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows ``start:stop`` of ``int8_flat_index``'s codes back as the int8 codes (a copy: ``code + 128`` with the
    sign bit flipped again)."""
    import faiss

    stop = index.ntotal if stop is None else min(stop, index.ntotal)
    if stop <= start:
        return np.zeros((0, index.d), dtype=np.int8)
    held = faiss.rev_swig_ptr(index.codes.data(), index.ntotal * index.code_size)  # a view, read at once
    return (held[start * index.code_size : stop * index.code_size] ^ np.uint8(0x80)).view(np.int8).reshape(-1, index.d)


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
        super().__init__(model, "exact", batch_size, device, show_progress, model_path, precision, dim=dim)
        self.faiss_options = binary_options  # checked above: the binary index's, not the dense kinds' (FAISS_OPTIONS)
        if kind in BINARY_KINDS and self.dim % 8:
            raise ConfigError(f"binary codes pack 8 dimensions to a byte: {self.dim} is not a multiple of 8 (--dim)")
        self.kind, self.rescore_with, self.rescore_multiplier = kind, rescore_with, rescore_multiplier
        self.ranges: np.ndarray | None = None  # int8 calibration [2, dim], from the first passages added
        self._codes = np.zeros((0, self.dim), dtype=np.int8)  # binary kinds: on disk (memory-mapped) once loaded
        self.bits = None  # the FAISS binary index (binary kinds)
        self.int8_index = None  # int8-flat: the FAISS scalar quantiser index holding the codes (int8_flat_index)

    @property
    def codes(self) -> np.ndarray:
        """The passages' int8 codes [rows, dim]: for int8-flat a copy out of its FAISS index (which holds the only
        one in memory), for the binary kinds the array (memory-mapped from disk once saved and loaded)."""
        if self.kind == "int8-flat":
            return int8_codes_of(self.int8_index) if self.int8_index is not None else self._codes
        return self._codes

    @staticmethod
    def check_search_options(rescore_with: str, rescore_multiplier: int) -> None:
        """A one-line ConfigError for an unknown re-scoring or a multiplier that is not an integer >= 1."""
        if rescore_with not in RESCORES:
            raise ConfigError(f"unknown re-scoring {rescore_with!r} (known: {', '.join(RESCORES)})")
        if isinstance(rescore_multiplier, bool) or not isinstance(rescore_multiplier, int) or rescore_multiplier < 1:
            raise ConfigError(f"the re-scoring multiplier must be an integer >= 1, got {rescore_multiplier!r}")

    @staticmethod
    def rescores(kind: str, rescore_with: str) -> bool:
        """Whether a ``kind`` index re-scores its first pass's candidates with ``rescore_with`` (an int8-flat index's
        first pass is its int8 scores already: re-scoring with int8 is none)."""
        return rescore_with != "none" and not (kind == "int8-flat" and rescore_with == "int8")

    def memory_bytes(self) -> int:
        """Bytes the index holds in RAM for its passages' vectors once loaded: the FAISS binary index (codes, and the
        HNSW graph or the IVF lists' ids), or the int8 codes; the re-scoring embeddings are memory-mapped files
        (page cache the system may drop), not counted. Passage ids and texts are not counted either."""
        if self.kind == "int8-flat":
            return int(self.int8_index.ntotal * self.int8_index.code_size) if self.int8_index is not None else 0
        if self.bits is None:
            return 0
        if self.kind == "binary-flat":
            return int(self.bits.ntotal * self.bits.code_size)
        import faiss

        return int(faiss.serialize_index_binary(self.bits).nbytes)  # codes, graph or lists (and a small header)

    def add_embeddings(self, passages: Passages, embeddings: np.ndarray) -> None:
        """Index passages whose embeddings were computed already (by this index's model; full size or cut). The new
        passages, codes and bits are all made (a repeated id, NaN or infinity refused) before the index changes: the
        binary index, the codes and the passages keep one row per passage."""
        corpus = as_corpus(passages, first_id=next_free_id(self.passages))
        embeddings = self.cut(embeddings)
        if embeddings.shape != (len(corpus), self.dim):
            raise ConfigError(
                f"embeddings of shape {embeddings.shape} for {len(corpus)} passages of a {self.dim}-dimensional index"
            )
        finite_rows(embeddings, corpus.ids, "passage")
        merged = concat_corpora(self.passages, corpus) if len(self.passages) else corpus
        ranges = self.ranges if self.ranges is not None else int8_ranges(embeddings)
        codes = _quantize(embeddings, "int8", ranges)
        bits = _quantize(embeddings, "ubinary") if self.kind in BINARY_KINDS else None
        built = None
        if bits is not None and self.bits is None:
            built = build_binary_index(bits, self.kind, **self.faiss_options)
        if self._weights_version is None:
            self._weights_version = weights_version(self.model)
        self.ranges = ranges
        if built is not None:
            self.bits = built
        elif bits is not None:
            self.bits.add(np.ascontiguousarray(bits))
        self.passages = merged
        self.embeddings = np.concatenate([self.embeddings, embeddings]) if len(self.embeddings) else embeddings
        if self.kind == "int8-flat":
            if self.int8_index is None:
                self.int8_index = int8_flat_index(self.ranges)
            add_int8_codes(self.int8_index, codes)
        else:
            self._codes = np.concatenate([self._codes, codes]) if len(self._codes) else codes

    def _compact(self, live: np.ndarray) -> None:
        """Keep the ``live`` rows: embeddings and codes copied (int8-flat: the other rows removed from its FAISS index
        in place, order kept), the binary index built again (the int8 ranges kept)."""
        self.passages = self.passages.subset(live.tolist())
        self.embeddings = np.ascontiguousarray(self.embeddings[live], dtype=np.float32)
        if self.kind == "int8-flat":
            self.int8_index.remove_ids(np.setdiff1d(np.arange(self.int8_index.ntotal), live).astype(np.int64))
        else:
            self._codes = np.ascontiguousarray(self._codes[live])
        if self.kind in BINARY_KINDS:
            self.bits = build_binary_index(_quantize(self.embeddings, "ubinary"), self.kind, **self.faiss_options)

    def search_rows(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` (scores, rows): the first pass over the codes, then the re-scoring (module docstring)."""
        q = np.ascontiguousarray(self.encode_queries(queries), dtype=np.float32)
        n = len(self.passages)
        rescoring = self.rescores(self.kind, self.rescore_with)
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

    def _int8_scan(self, q: np.ndarray, depth: int, margin: int = 8) -> tuple[np.ndarray, np.ndarray]:
        """The top ``depth`` rows of every query by its float dot product with the dequantised int8 codes, equal
        scores by row: FAISS's scalar quantiser scan (module docstring) for ``depth + margin`` rows, sorted by
        (score, row). FAISS keeps any of the rows tied at its last score: where that score is also the
        ``depth``-th's, the tie may reach past what came back, and the scan is redone twice as deep (to every row
        at most), so that ties at the boundary go to the lowest rows, as ``top_k_by_score_then_row`` has them."""
        rows_total = self.int8_index.ntotal if self.int8_index is not None else 0
        if rows_total == 0 or depth == 0:
            return np.zeros((len(q), 0), dtype=np.float32), np.zeros((len(q), 0), dtype=np.int64)
        fetch = min(rows_total, depth + margin)
        while True:
            scores, rows = self.int8_index.search(q, fetch)
            scores, rows = sort_by_score_then_row(torch.from_numpy(scores), torch.from_numpy(rows))
            if fetch == rows_total or not (scores[:, fetch - 1] == scores[:, depth - 1]).any():
                return scores[:, :depth].numpy(), rows[:, :depth].numpy()
            fetch = min(rows_total, 2 * fetch)

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
        if self.kind == "int8-flat" and self.int8_index is not None:
            self._write_int8_codes(directory / CODES)
        else:
            np.save(directory / CODES, np.asarray(self._codes))
        np.save(directory / RANGES, self.ranges)
        if self.bits is not None:
            import faiss

            with atomic_file(directory / BITS, "wb") as handle:
                handle.write(faiss.serialize_index_binary(self.bits).tobytes())

    def _write_int8_codes(self, path: Path, chunk: int = 65_536) -> None:
        """``int8.npy`` (what ``np.save`` writes) from int8-flat's FAISS index, ``chunk`` rows at a time: no second
        full copy of the codes in memory."""
        rows = self.int8_index.ntotal
        with open(path, "wb") as handle:
            header = {"descr": np.dtype(np.int8).str, "fortran_order": False, "shape": (rows, self.dim)}
            np.lib.format.write_array_header_1_0(handle, header)
            for start in range(0, rows, chunk):
                handle.write(int8_codes_of(self.int8_index, start, start + chunk).tobytes())

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
        if manifest["kind"] == "int8-flat":  # scanned in RAM: copied into the FAISS index, from the map in chunks
            index.int8_index = int8_flat_index(ranges)
            add_int8_codes(index.int8_index, codes)
        else:
            index._codes = codes
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
