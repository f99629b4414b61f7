"""An IVF-PQ index whose inverted lists stay on disk, memory-mapped: approximate inner-product search
(the neural-retrieval-lecture's "compress the index, search a few clusters") over corpora whose embeddings
do not fit in RAM. Kind ``faiss-ivfpq-disk``.

It is built from the sharded encoder's output (``index.sharded``) with FAISS's own machinery, in three steps:

1. **train** (rank 0): the coarse quantiser (``lists`` centroids) and the product quantiser (``pq_m``
   sub-vectors of ``pq_bits`` bits) are trained once on a seeded sample of ``train_size`` corpus rows,
   read from the shards' memory maps (default 64 rows per list, at least 10,000: FAISS wants 39 to 256
   per list), and saved as an empty index;
2. **fill** (every process): each process adds its shard, block by block from its memory map, to an empty
   copy of the trained index with ids = corpus rows, and writes it as its own IVF file (its codes are held in
   memory, never its float embeddings);
3. **merge** (rank 0, when the index is saved): the shards' inverted lists are merged into one on-disk file
   (``faiss.contrib.ondisk.merge_ondisk``: ``OnDiskInvertedLists``), beside the quantisers' file.

A list's entries are merged shard after shard, and each shard's in row order, so the merged index holds
exactly what the same trained index filled in memory in one go holds: the same ids and scores, whatever the
number of processes. Loading reads the quantisers and the lists' offsets and memory-maps the lists' file
read-only: search memory is the quantisers plus the pages of the ``nprobe`` lists each query probes
(``nprobe``: a search-time option).

The saved index (atomic, with a manifest) records the model (path and weights fingerprint), the encoder's
and the corpus's fingerprints; loading it with another model is refused, and so is building it from shards
of another model or corpus.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from densepass import distributed
from densepass.config import ONDISK_INDEX_KIND
from densepass.data.dataset import Corpus
from densepass.device import default_device, resolve_precision
from densepass.errors import ConfigError, DataError
from densepass.fingerprints import fingerprint_corpus, fingerprint_weights
from densepass.index.base import Index, Passages, check_positive, concat_corpora, register
from densepass.index.checks import model_for_index, model_settings
from densepass.index.dense import query_embeddings, require_model_path
from densepass.index.faiss_index import default_pq_m, faiss_search, load_faiss_index, new_ivfpq, save_faiss_index
from densepass.index.sharded import ShardedEmbeddings, ShardPlan, encoder_fingerprint, shard_path
from densepass.io import reserve_space
from densepass.models.biencoder import BiEncoder
from densepass.numerics import nonfinite_row

INDEX_FILE = "faiss.index"  # the quantisers and every list's offset and size
LISTS_FILE = "lists.ivfdata"  # every list's codes and ids, memory-mapped
TRAINED_FILE = "ivf-trained.index"  # in the build's work directory: the trained, empty index
POINTS_PER_LIST = 64  # default training sample per list (FAISS wants 39 to 256)
MIN_SAMPLE = 10_000  # and at least this many rows: about 39 per product-quantiser centroid at 8 bits
MIN_POINTS_PER_LIST = 39  # default lists are capped so that each gets this many training rows
MAX_LISTS = 65_536


@dataclasses.dataclass(frozen=True)
class IVFPQOptions:
    """How an on-disk IVF-PQ index is trained, coded and searched; a ``None`` is chosen from the corpus's size
    and the embedding dimension by ``resolve``."""

    lists: int | None = None  # inverted lists; default about 4 sqrt(passages), at most 65,536
    pq_m: int | None = None  # product-quantiser sub-vectors (bytes per passage at 8 bits); default dim / 4
    pq_bits: int = 8  # bits of each sub-vector's code
    train_size: int | None = None  # corpus rows sampled to train on; default 64 per list, at least 10,000
    nprobe: int = 32  # lists probed per query (also a search-time option)
    seed: int = 13  # of the training sample and of the k-means

    def __post_init__(self) -> None:
        for name in ("lists", "pq_m", "train_size"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        check_positive("nprobe", self.nprobe)
        if not 1 <= check_positive("pq_bits", self.pq_bits) <= 16:
            raise ConfigError(f"pq_bits must be between 1 and 16, got {self.pq_bits}")

    def resolve(self, rows: int, dim: int) -> IVFPQOptions:
        """These options for ``rows`` passages of ``dim`` dimensions, every ``None`` chosen; a one-line error
        when they cannot be trained (more lists or product-quantiser centroids than training rows)."""
        if rows < 1:
            raise ConfigError("no passages to index")
        available = min(rows, self.train_size or rows)
        lists = self.lists or max(1, min(MAX_LISTS, int(4 * math.sqrt(rows)), available // MIN_POINTS_PER_LIST))
        train_size = min(rows, self.train_size or max(POINTS_PER_LIST * lists, MIN_SAMPLE))
        if lists > train_size:
            raise ConfigError(
                f"{lists} inverted lists need at least as many training rows, but the sample has {train_size} "
                f"({rows} passages): use fewer lists or a larger train_size"
            )
        if 2**self.pq_bits > train_size:
            raise ConfigError(
                f"{self.pq_bits}-bit product quantisation trains {2**self.pq_bits} centroids, more than the "
                f"{train_size} training rows: use fewer pq_bits or a larger train_size"
            )
        pq_m = self.pq_m or default_pq_m(dim)
        if dim % pq_m:
            raise ConfigError(f"pq_m={pq_m} must divide the embedding dimension {dim}")
        return dataclasses.replace(self, lists=lists, pq_m=pq_m, train_size=train_size)


def sample_rows(rows: int, size: int, seed: int) -> np.ndarray:
    """``size`` distinct corpus rows out of ``rows``, drawn with ``seed``, in increasing order."""
    return np.sort(np.random.default_rng(seed).choice(rows, size=size, replace=False))


def train_ivfpq(sample: np.ndarray, options: IVFPQOptions):
    """An empty IVF-PQ index (inner product) whose coarse and product quantisers are trained on ``sample``
    (``options`` resolved)."""
    if nonfinite_row(sample) is not None:
        raise DataError("the training sample of the IVF-PQ index holds a NaN or infinite embedding: encode again")
    index = new_ivfpq(sample.shape[1], options.lists, options.pq_m, options.pq_bits)
    index.cp.seed = options.seed
    index.pq.cp.seed = options.seed
    index.train(np.ascontiguousarray(sample, dtype=np.float32))
    return index


def fill_part(trained: Path, embeddings: np.ndarray, first_row: int, path: Path, block: int) -> None:
    """Add ``embeddings`` (corpus rows ``first_row``...; a memory map is read ``block`` rows at a time) to an
    empty copy of the ``trained`` index, with their rows as ids, and write it to ``path`` atomically."""
    index = load_faiss_index(trained)
    for start in range(0, len(embeddings), block):
        chunk = np.ascontiguousarray(embeddings[start : start + block], dtype=np.float32)
        bad = nonfinite_row(chunk)
        if bad is not None:  # its codes would be garbage, its scores NaN
            raise DataError(
                f"the embedding of corpus row {first_row + start + bad} holds NaN or infinity: encode again"
            )
        ids = np.arange(first_row + start, first_row + start + len(chunk), dtype=np.int64)
        index.add_with_ids(chunk, ids)
    save_faiss_index(index, path)


def merge_parts(trained: Path, parts: list[Path], directory: Path) -> None:
    """Merge the inverted lists of the filled ``parts`` (in order) into ``directory``'s on-disk lists file and
    write the index that points at it (``INDEX_FILE``)."""
    from faiss.contrib.ondisk import merge_ondisk

    index = load_faiss_index(trained)
    # FAISS fills the lists file through a memory map: its blocks are reserved first (the parts' size, more than the
    # lists need; FAISS truncates it to theirs), so that a full disk is a one-line error, never SIGBUS
    reserve_space(directory / LISTS_FILE, sum(part.stat().st_size for part in parts))
    merge_ondisk(index, [str(part) for part in parts], str(directory / LISTS_FILE))
    save_faiss_index(index, directory / INDEX_FILE)


def open_ondisk(directory: Path):
    """The saved index of ``directory`` with its inverted lists memory-mapped read-only from ``LISTS_FILE``
    there (wherever the directory was when the index was written)."""
    import faiss

    index = load_faiss_index(directory / INDEX_FILE, flags=faiss.IO_FLAG_SKIP_IVF_DATA | faiss.IO_FLAG_READ_ONLY)
    try:
        lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(index).invlists)
    except RuntimeError:  # not an IVF index at all
        lists = None
    if not isinstance(lists, faiss.OnDiskInvertedLists):
        raise DataError(f"{directory}: {INDEX_FILE} does not keep its inverted lists on disk")
    lists.filename = str(directory / LISTS_FILE)
    try:
        lists.do_mmap()
    except RuntimeError as err:  # a lists file shorter than the index says
        said = (str(err).strip().splitlines() or [type(err).__name__])[0].split("Error: ", 1)[-1]
        raise DataError(f"{directory / LISTS_FILE} does not load (damaged?): {said[:300]}") from None
    if _quantisers_nonfinite(index):
        raise DataError(f"{directory} is not a usable index: its quantisers hold NaN or infinity; build it again")
    return index


def _quantisers_nonfinite(index) -> bool:
    """Whether the coarse or the product quantiser's centroids of an IVF-PQ index hold NaN or infinity (the
    stored codes are integers: the centroids are all its floats)."""
    import faiss

    ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
    coarse = ivf.quantizer.reconstruct_n(0, ivf.quantizer.ntotal)
    return nonfinite_row(coarse) is not None or not np.isfinite(faiss.vector_to_array(ivf.pq.centroids)).all()


def part_path(directory: Path, plan: ShardPlan, rank: int) -> Path:
    """The IVF file that process ``rank`` fills with its shard."""
    return directory / f"ivf-{shard_path(directory, plan, rank).stem}.index"


@register
class OnDiskIVFPQIndex(Index):
    """A bi-encoder's passages in an IVF-PQ index whose inverted lists are memory-mapped from disk; built by
    ``build_ondisk_ivfpq`` (its lists are merged on disk when it is first saved), then loaded by ``load_index``."""

    kind: ClassVar[str] = ONDISK_INDEX_KIND
    load_options: ClassVar[tuple[str, ...]] = ("model", "batch_size", "device", "precision", "nprobe")

    def __init__(
        self,
        model: BiEncoder,
        passages: Corpus,
        options: IVFPQOptions,
        model_path: str | None = None,
        batch_size: int = 256,
        device: torch.device | None = None,
        precision: str = "auto",
    ) -> None:
        resolve_precision(precision, device or default_device())  # a bad name fails before any work
        self.batch_size = check_positive("batch size", batch_size)
        self.model, self.passages, self.options = model, passages, options
        self.model_path = model_path or model.source
        self.device, self.precision = device, precision
        self.faiss = None  # the saved index, its lists memory-mapped (None until the index is saved)
        self.directory: Path | None = None  # where those lists are
        self.pending: tuple[Path, list[Path]] | None = None  # before the first save: trained index, filled parts
        self.model_fingerprint: str | None = None  # weights of the model that encoded the passages
        self.encoder_fingerprint: str | None = None  # and its architecture and precision (index.sharded)
        self.delta = None  # upserted passages since the last save: an in-memory IVF-PQ with the same quantisers
        self._compact_pending = False  # compact(): the lists are written without the deleted rows at the next save
        self._lists_written = False
        self._compacted: Corpus | None = None  # the passages a compacting save wrote, taken on by reopen

    @property
    def dim(self) -> int:
        """Embedding dimension of the model."""
        return self.model.dim

    @property
    def nprobe(self) -> int:
        """Inverted lists probed per query."""
        return self.options.nprobe

    @nprobe.setter
    def nprobe(self, value: int) -> None:
        self.options = dataclasses.replace(self.options, nprobe=value)

    def add(self, passages: Passages) -> None:
        """Not supported: the index is built from a whole corpus's shards (``upsert`` adds to a saved one)."""
        raise ConfigError(
            f"a {self.kind} index takes no more passages through add: upsert them into the saved index "
            f"(densepass index-update) or build it again over the whole corpus (densepass index --kind {self.kind})"
        )

    # ---- a living index (index.base, index.living) ------------------------------------------------------------

    def encode_new(self, corpus: Corpus) -> np.ndarray:
        """The passage embeddings of ``corpus`` (for ``upsert``), by the index's model."""
        return self.model.encode_passages(
            corpus, batch_size=self.batch_size, show_progress=False, device=self.device, precision=self.precision
        )

    def append_encoded(self, corpus: Corpus, prepared: np.ndarray) -> None:
        """Add ``corpus`` with its embeddings to an in-memory IVF-PQ with the saved index's trained quantisers (ids:
        their rows), searched beside the lists on disk; the next save writes both into one lists file."""
        import faiss

        if self.faiss is None:
            raise ConfigError("save the index first: passages are upserted into a saved index")
        embeddings = np.ascontiguousarray(prepared, dtype=np.float32)
        if embeddings.shape != (len(corpus), self.dim):
            raise ConfigError(f"embeddings of shape {embeddings.shape} for {len(corpus)} passages of dim {self.dim}")
        bad = nonfinite_row(embeddings)
        if bad is not None:
            raise DataError(f"the embedding of passage {corpus.ids[bad]!r} holds NaN or infinity: encode again")
        if self.delta is None:
            self.delta = faiss.read_index(str(self.directory / INDEX_FILE), faiss.IO_FLAG_SKIP_IVF_DATA)
            ivf = faiss.extract_index_ivf(self.delta)
            lists = faiss.ArrayInvertedLists(ivf.nlist, ivf.code_size)
            lists.this.disown()  # the index owns and frees it (else Python would free it under the index)
            ivf.replace_invlists(lists, True)
            self.delta.ntotal = 0
        rows = np.arange(len(self.passages), len(self.passages) + len(corpus), dtype=np.int64)
        self.delta.add_with_ids(embeddings, rows)
        self.passages = concat_corpora(self.passages, corpus)

    def compact(self) -> None:
        """Remove the deleted rows when the index is next saved (its lists are rewritten on disk then, without
        them; until then the tombstones keep them out of searches)."""
        if self._deleted is not None and self._deleted.any():
            if self._deleted.all():
                raise ConfigError("every passage of the index is deleted: compacting would leave an empty index")
            if self.faiss is None:  # its first save merges the shards' lists as they are, deleted rows and all
                raise ConfigError("save the index first (its shards' lists are merged on disk then), then compact it")
            self._compact_pending = True

    def write_into(self, directory: Path) -> None:
        """``Index.write_into``, the lists file written anew where passages were upserted or compaction is due:
        the saved lists then the upserted ones, list by list, rows renumbered without the deleted ones. The index in
        memory is left as it was (its passages and tombstones match the lists it searches) until ``reopen`` reads
        the written version: a save that fails midway (a full disk) leaves it answering as before."""
        self._compacted = None
        passages, deleted = self.passages, self._deleted
        if self.faiss is not None and (self.delta is not None or self._compact_pending):
            keep = ~self.deleted if self._compact_pending else np.ones(len(self.passages), dtype=bool)
            remap = np.where(keep, np.cumsum(keep) - 1, -1)
            self._write_lists(directory, remap)
            if self._compact_pending:  # written without the deleted rows; taken on in memory by reopen
                self.passages = self.passages.subset(np.flatnonzero(keep).tolist())
                self._deleted = None
            self._lists_written = True
        try:
            super().write_into(directory)
            if self._compact_pending and self._lists_written:
                self._compacted = self.passages
        finally:
            self._lists_written = False
            self.passages, self._deleted = passages, deleted

    def _write_lists(self, directory: Path, remap: np.ndarray) -> None:
        """Write ``directory``'s lists file and index file: every list's entries of the saved lists and of the
        upserted passages, ids mapped through ``remap`` (old row -> new row, -1: left out). FAISS writes the file
        through a memory map, growing it as lists are added; its final size is known beforehand (each list takes
        a slot of the power of two at or above its length), so the file is sized once and its blocks reserved
        first: a full disk is a one-line error here, never SIGBUS halfway through the lists."""
        import faiss

        index = faiss.read_index(str(self.directory / INDEX_FILE), faiss.IO_FLAG_SKIP_IVF_DATA)
        ivf = faiss.extract_index_ivf(index)
        sources = [faiss.extract_index_ivf(self.faiss).invlists]
        if self.delta is not None:
            sources.append(faiss.extract_index_ivf(self.delta).invlists)

        def stored_ids(source, number: int) -> np.ndarray:
            size = source.list_size(number)
            return faiss.rev_swig_ptr(source.get_ids(number), size).copy() if size else np.zeros(0, dtype=np.int64)

        lengths = [sum(int((remap[stored_ids(s, number)] >= 0).sum()) for s in sources) for number in range(ivf.nlist)]
        size = sum((1 << (length - 1).bit_length()) * (ivf.code_size + 8) for length in lengths if length)
        lists = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, str(directory / LISTS_FILE))
        if size:
            lists.update_totsize(size)  # one free slot the lists are cut from: the file grows no further
            reserve_space(directory / LISTS_FILE, size)
        for number, length in enumerate(lengths):
            if not length:
                continue
            new_ids, new_codes = [], []
            for source in sources:
                ids = stored_ids(source, number)
                if not len(ids):
                    continue
                codes = faiss.rev_swig_ptr(source.get_codes(number), len(ids) * ivf.code_size)
                kept = remap[ids] >= 0
                new_ids.append(remap[ids][kept])
                new_codes.append(codes.reshape(len(ids), ivf.code_size)[kept])
            ids_out = np.ascontiguousarray(np.concatenate(new_ids), dtype=np.int64)
            codes_out = np.ascontiguousarray(np.concatenate(new_codes))
            lists.add_entries(number, length, faiss.swig_ptr(ids_out), faiss.swig_ptr(codes_out))  # one slot each
        lists.this.disown()  # the index owns and frees it
        ivf.replace_invlists(lists, True)
        index.ntotal = sum(lengths)
        save_faiss_index(index, directory / INDEX_FILE)

    def reopen(self, directory: Path) -> None:
        """Search from ``directory`` (where the index was just saved, e.g. a new version): its lists hold the upserted
        passages, and compaction is done."""
        if self._compacted is not None:  # the passages that version holds (write_into)
            self.passages, self._deleted, self._compacted = self._compacted, None, None
        self._open(directory)
        self.delta, self._compact_pending = None, False

    def search_rows(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` (scores, rows) of each query (texts, or query embeddings) among the passages of its
        ``nprobe`` closest lists (rows -1 where those hold fewer than ``k``)."""
        if self.faiss is None:
            raise ConfigError("save the index first: its shards' inverted lists are merged on disk when it is saved")
        query_emb = self.encode_queries(queries)
        self.faiss.nprobe = min(self.nprobe, self.options.lists)
        scores, rows = faiss_search(self.faiss, query_emb, k)
        if self.delta is None or self.delta.ntotal == 0:
            return scores, rows
        self.delta.nprobe = self.faiss.nprobe  # the upserted passages: merged by score (ties: the saved ones first)
        more_scores, more_rows = faiss_search(self.delta, query_emb, k)
        scores, rows = np.concatenate([scores, more_scores], 1), np.concatenate([rows, more_rows], 1)
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)

    def encode_queries(self, queries: Any) -> np.ndarray:
        """Query embeddings: texts are encoded by the model, an array of embeddings is used as it is."""
        return query_embeddings(self.model, queries, self.batch_size, self.device, self.precision)

    # ---- persistence ----------------------------------------------------------------------------

    def facts(self) -> dict:
        """Model path and fingerprints, dimension and options, for the manifest."""
        if self.model_fingerprint is None:
            self.model_fingerprint = fingerprint_weights(self.model)
        return {
            "model": {
                "path": self.model_path,
                "fingerprint": self.model_fingerprint,
                "settings": model_settings(self.model),  # what else shapes its embeddings (index.checks)
            },
            "encoder_fingerprint": self.encoder_fingerprint,
            "dim": self.dim,
            "options": dataclasses.asdict(self.options),
        }

    def _write(self, directory: Path) -> None:
        if self._lists_written:  # write_into wrote them (upserts, compaction)
            return
        if self.pending is not None:
            merge_parts(*self.pending, directory)
        elif self.directory is not None:
            for name in (INDEX_FILE, LISTS_FILE):
                shutil.copyfile(self.directory / name, directory / name)
        else:
            raise ConfigError(f"nothing to save: build a {self.kind} index with build_ondisk_ivfpq")

    def save(self, directory: str | Path) -> Path:
        """Write the index atomically (merging the shards' lists on the first save), then search from there."""
        require_model_path(self.model_path)
        directory = super().save(directory)
        self.reopen(directory)
        self.pending = None
        return directory

    def _open(self, directory: Path) -> None:
        index = open_ondisk(directory)
        if index.ntotal != len(self.passages) or index.d != self.dim:
            raise DataError(
                f"{directory}: its IVF-PQ index holds {index.ntotal} vectors of dimension {index.d} for "
                f"{len(self.passages)} passages of a {self.dim}-dimensional model"
            )
        self.faiss, self.directory = index, directory

    @classmethod
    def _read(
        cls,
        directory: Path,
        manifest: dict,
        passages: Corpus,
        model: BiEncoder | None = None,
        nprobe: int | None = None,
        **options: Any,
    ) -> OnDiskIVFPQIndex:
        saved = IVFPQOptions(**manifest["options"])
        saved = saved if nprobe is None else dataclasses.replace(saved, nprobe=nprobe)
        recorded = manifest["model"]
        model = model_for_index(directory, manifest["kind"], recorded, model, BiEncoder)
        index = cls(model, passages, saved, model_path=recorded["path"], **options)
        index.model_fingerprint, index.encoder_fingerprint = recorded["fingerprint"], manifest["encoder_fingerprint"]
        index._open(directory)
        return index


def build_ondisk_ivfpq(
    model: BiEncoder,
    shards: ShardedEmbeddings,
    corpus: Corpus | None,
    work_dir: str | Path,
    options: IVFPQOptions | None = None,
    corpus_fingerprint: str | None = None,
    precision: str = "auto",
    device: torch.device | None = None,
    batch_size: int = 256,
) -> OnDiskIVFPQIndex | None:
    """The on-disk IVF-PQ index of a corpus whose passage embeddings ``model`` encoded into ``shards``:
    trained by rank 0, each shard filled by its process into ``work_dir`` (shared by every process), returned on
    rank 0 (None elsewhere), where ``corpus`` (its passages) is needed; its lists are merged when it is saved.
    Shards of another model (``precision``) or corpus (``corpus_fingerprint``, computed when not given) are
    refused. Collective: every process of the group must call it."""
    options = options or IVFPQOptions()
    work_dir = Path(work_dir)
    trained = work_dir / TRAINED_FILE

    def train() -> IVFPQOptions:
        resolved = options.resolve(shards.plan.rows, model.dim)
        if corpus is None:
            raise DataError("rank 0 needs the corpus's passages to build the index")
        if len(corpus) != shards.plan.rows:
            raise DataError(f"a corpus of {len(corpus)} passages for {shards.plan.rows} encoded ones")
        if shards.content is not None:
            mine = {
                "model": encoder_fingerprint(model, resolve_precision(precision, device or default_device())),
                "corpus": corpus_fingerprint or fingerprint_corpus(corpus),
            }
            for what, fingerprint in mine.items():
                if shards.content[what] != fingerprint:
                    raise DataError(
                        f"{shards.directory} holds passages encoded with another {what} (fingerprint "
                        f"{shards.content[what][:12]}, this one {fingerprint[:12]}): encode them again"
                    )
        sample = shards.read_rows(sample_rows(shards.plan.rows, resolved.train_size, resolved.seed))
        work_dir.mkdir(parents=True, exist_ok=True)
        save_faiss_index(train_ivfpq(sample, resolved), trained)
        return resolved

    resolved = distributed.on_rank_zero(train)  # every process waits for the trained index
    start, end = shards.plan.shard(shards.rank)
    if end > start:
        fill_part(trained, shards.local, start, part_path(work_dir, shards.plan, shards.rank), shards.plan.block)
    distributed.barrier()  # every shard is filled before rank 0 merges them
    if shards.rank != 0:
        return None
    index = OnDiskIVFPQIndex(model, corpus, resolved, batch_size=batch_size, device=device, precision=precision)
    filled = [r for r in range(shards.plan.world) if shards.plan.shard(r)[1] > shards.plan.shard(r)[0]]
    index.pending = (trained, [part_path(work_dir, shards.plan, r) for r in filled])
    index.model_fingerprint = fingerprint_weights(model)
    index.encoder_fingerprint = shards.content["model"] if shards.content is not None else None
    return index
