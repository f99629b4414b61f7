"""``densepass index``: a dataset's corpus into a saved index, resumably (a phrase index is encoded in one go).

Dense kinds encode the corpus block by block into memory-mapped shards (``index.sharded``) kept beside
the output while it is being built, with a manifest of the model's and corpus's fingerprints: an
interrupted run resumes at the first unfinished block, and a run with another model or corpus never reuses
those rows (this private directory is cleared for it, where ``encode_sharded`` itself would refuse).
Under torchrun (``torchrun --nproc_per_node N -m densepass index ...``) each process encodes its shard;
rank 0 loads the corpus and writes the index, the others read only their shard's passages (streamed from a
BEIR ``corpus.jsonl``; other layouts are loaded whole). A BEIR ``corpus.jsonl`` is loaded as ids only, its
titles and texts read from the file when needed (``data.beir.PassageFile``), in one process or several.
``faiss-ivfpq-disk`` (``index.ondisk``) is then trained by rank 0 on a sample of the shards and filled by each
process from its shard, and its inverted lists are merged on disk by rank 0 (only the encoding resumes). SPLADE
and ColBERT kinds (``pipelines.retrievers``) encode the corpus in one go (not resumable). The index is then
saved atomically; the encoding files are removed. Two processes building the same output are refused.
``hybrid`` fuses a dense index with BM25, or with a SPLADE index when ``sparse_model`` is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import math
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from densepass import distributed
from densepass.config import DEFAULT_MODEL, DENSE_INDEX_KINDS, ONDISK_INDEX_KIND, ModelConfig
from densepass.data import load_corpus, stream_passage_inputs
from densepass.data.dataset import Corpus, LazyTexts
from densepass.data.paths import check_output_apart
from densepass.device import default_device, resolve_precision
from densepass.errors import ConfigError, DensepassError
from densepass.fingerprints import fingerprint_corpus
from densepass.index.base import Index, check_index_target
from densepass.index.binary import CompactIndex, compact_kind
from densepass.index.bm25 import BM25Index
from densepass.index.dense import DenseIndex
from densepass.index.faiss_index import check_trainable
from densepass.index.hybrid import HybridIndex, part_precision
from densepass.index.ondisk import IVFPQOptions, build_ondisk_ivfpq
from densepass.index.sharded import DEFAULT_BLOCK, SHARDS_FILE, ShardedEmbeddings, encode_sharded
from densepass.io import check_replaceable, move_aside
from densepass.models.biencoder import BiEncoder
from densepass.models.colbert import ColBERT
from densepass.models.copies import float_precision
from densepass.models.kinds import refuse_cross_encoder
from densepass.models.matryoshka import check_index_dim
from densepass.models.splade import SpladeEncoder
from densepass.phrase.index import PhraseIndex
from densepass.phrase.model import PhraseEncoder
from densepass.pipelines.retrievers import index_for_model

SHARDED_KINDS = (*DENSE_INDEX_KINDS, ONDISK_INDEX_KIND)  # built from the sharded encoder's output
INDEX_KINDS = (*SHARDED_KINDS, "bm25", "hybrid", "splade", "colbert", "phrase")


@dataclasses.dataclass
class IndexSettings:
    """How ``build_index`` indexes a corpus."""

    kind: str = "exact"  # one of INDEX_KINDS
    model: str | None = None  # the model of every kind but bm25, which takes none (None: DEFAULT_MODEL)
    dense_kind: str = "exact"  # hybrid: the dense part's kind
    fusion: str = "rrf"  # hybrid: rrf or linear
    fusion_weight: float = 0.5  # hybrid, linear: weight of the dense scores
    batch_size: int = 256
    shard_size: int = DEFAULT_BLOCK  # passages encoded between resumable save points (a block of the shards)
    device: torch.device | None = None
    show_progress: bool = True
    sparse_model: str | None = None  # hybrid: a SPLADE model for the second part instead of BM25
    retriever: ModelConfig = dataclasses.field(default_factory=ModelConfig)  # splade pruning, colbert storage
    threshold: float | None = None  # phrase: the token filter's threshold (None: keep every vector)
    precision: str = "auto"  # encoding precision: auto, fp32, bf16, int8 (bi-encoders only; models.encode)
    ivf: IVFPQOptions = dataclasses.field(default_factory=IVFPQOptions)  # faiss-ivfpq-disk: training, codes, nprobe
    dim: int | None = None  # dense kinds: index the embeddings' first dim numbers (Matryoshka), normalised again
    embedding_precision: str = "fp32"  # dense kinds: fp32, int8 or binary codes in memory (index.binary)
    rescore_with: str = "float"  # int8 / binary: candidates re-scored with float32 or int8 embeddings, or none
    rescore_multiplier: int = 4  # int8 / binary: candidates re-scored per query, x k

    @property
    def encoded_kind(self) -> str:
        """The kind of index the bi-encoder's passage embeddings go into: a hybrid's dense part, else ``kind``."""
        return self.dense_kind if self.kind == "hybrid" else self.kind

    def __post_init__(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise ConfigError(f"unknown index kind {self.kind!r} (known: {', '.join(INDEX_KINDS)})")
        if self.dense_kind not in DENSE_INDEX_KINDS:
            raise ConfigError(f"unknown dense index kind {self.dense_kind!r} (known: {', '.join(DENSE_INDEX_KINDS)})")
        if self.batch_size < 1 or self.shard_size < 1:
            raise ConfigError("batch size and shard size must be >= 1")
        if self.kind == "bm25" and self.model is not None:
            raise ConfigError("--kind bm25 indexes words, not a model's vectors: drop --model")
        if self.kind != "bm25" and self.model is None:
            self.model = DEFAULT_MODEL
        if self.kind != "bm25" and not self.model:
            raise ConfigError(f"a {self.kind} index needs a model")
        if self.sparse_model and self.kind != "hybrid":
            raise ConfigError(f"--sparse-model is the SPLADE part of a hybrid index; a {self.kind} index has none")
        if self.threshold is not None and self.kind != "phrase":
            raise ConfigError(f"--filter-threshold is the phrase index's token filter; a {self.kind} index has none")
        if self.threshold is not None and not math.isfinite(self.threshold):
            raise ConfigError(f"--filter-threshold must be a finite number, got {self.threshold}")
        device = self.device or default_device()
        if self.kind in ("splade", "colbert"):
            float_precision(self.precision, device, self.kind)
        else:
            resolve_precision(self.precision, device)
        if self.precision not in ("auto", "fp32") and self.kind in ("bm25", "phrase"):
            raise ConfigError(f"precision {self.precision} applies to model indexes, not to a {self.kind} index")
        if self.embedding_precision != "fp32" and self.kind not in DENSE_INDEX_KINDS:
            raise ConfigError(
                f"--embedding-precision {self.embedding_precision} stores a bi-encoder's embeddings: a {self.kind} "
                "index has none"
            )
        compact_kind(self.embedding_precision, self.encoded_kind)  # a kind the precision has no index of: refused
        if self.embedding_precision != "fp32":  # the search options, checked before any work
            CompactIndex.check_search_options(self.rescore_with, self.rescore_multiplier)
        elif (self.rescore_with, self.rescore_multiplier) != ("float", 4):
            raise ConfigError("--rescore-with and --rescore-multiplier re-score an int8 or binary index's candidates")
        if self.dim is not None and self.encoded_kind not in DENSE_INDEX_KINDS:
            raise ConfigError(f"--dim cuts a bi-encoder's embeddings: a {self.kind} index has none to cut")
        if self.dim is not None and (isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1):
            raise ConfigError(f"--dim must be a positive integer, got {self.dim!r}")
        # a local cross-encoder's folder (a Hub id is not fetched here, ahead of the checks above)
        if self.kind not in ("bm25", "phrase") and isinstance(self.model, str | Path):
            with contextlib.suppress(OSError):  # a name too long to look up: its loader says so
                if Path(self.model).is_dir():
                    refuse_cross_encoder(Path(self.model), f"a {self.kind} index")


def encode_corpus(
    model: BiEncoder, texts: LazyTexts, corpus_fingerprint: str, work_dir: Path, settings: IndexSettings
) -> ShardedEmbeddings:
    """This process's shard of the corpus's passage embeddings (``texts``: its encoder inputs), encoded
    resumably into ``work_dir``. Shards there of another model or corpus are removed (the directory belongs
    to this output's build). Options of the on-disk IVF-PQ that cannot be trained on this corpus fail first.
    Collective under torchrun."""
    if settings.kind == ONDISK_INDEX_KIND:
        settings.ivf.resolve(len(texts), model.dim)
    if settings.dim is not None:  # above the model's size: refused before any passage is encoded
        check_index_dim(settings.dim, model.dim, model.config.matryoshka_dims, settings.model)
    dim = settings.dim or model.dim
    if settings.embedding_precision == "binary" and dim % 8:  # CompactIndex's own check, before the encoding
        raise ConfigError(f"binary codes pack 8 dimensions to a byte: {dim} is not a multiple of 8 (--dim)")
    if settings.embedding_precision == "fp32":  # binary-ivf has no product quantiser to train
        check_trainable(settings.encoded_kind, len(texts))
    return encode_sharded(
        model,
        texts,
        work_dir,
        corpus_fingerprint,
        block=settings.shard_size,
        batch_size=settings.batch_size,
        device=settings.device,
        show_progress=settings.show_progress,
        precision=settings.precision,
        replace_other=True,
    )


def dense_index(model: BiEncoder, corpus: Corpus, kind: str, work_dir: Path, settings: IndexSettings) -> Index:
    """A dense index of ``corpus``, its embeddings encoded resumably under ``work_dir`` (one process)."""
    sep = model.tokenizer.sep_token or " "
    fingerprint = fingerprint_corpus(corpus)
    shards = encode_corpus(model, corpus.lazy_inputs(sep), fingerprint, work_dir, settings)
    return _index_of_shards(model, corpus, fingerprint, kind, shards, work_dir, settings)


def _index_of_shards(
    model: BiEncoder,
    corpus: Corpus | None,
    corpus_fingerprint: str,
    kind: str,
    shards: ShardedEmbeddings,
    work_dir: Path,
    settings: IndexSettings,
) -> Index | None:
    """The index of the encoded shards on rank 0 (which has ``corpus``), None elsewhere: the on-disk IVF-PQ,
    each shard filled by its process (collective), or a dense index over every shard's embeddings."""
    if kind == ONDISK_INDEX_KIND:
        options = dict(precision=settings.precision, device=settings.device, batch_size=settings.batch_size)
        return build_ondisk_ivfpq(model, shards, corpus, work_dir, settings.ivf, corpus_fingerprint, **options)
    if distributed.rank() != 0:
        return None
    return _assembled_index(model, corpus, kind, shards, work_dir, settings)


def _assembled_index(
    model: BiEncoder, corpus: Corpus, kind: str, shards: ShardedEmbeddings, work_dir: Path, settings: IndexSettings
) -> DenseIndex:
    """A dense index of ``corpus`` over every shard's embeddings (on rank 0)."""
    with warnings.catch_warnings():  # a --dim the model was not trained at: warned before encoding (encode_corpus)
        warnings.simplefilter("ignore")
        options = dict(
            batch_size=settings.batch_size,
            device=settings.device,
            show_progress=False,
            precision=settings.precision,
            dim=settings.dim,
        )
        if settings.embedding_precision == "fp32":
            index: DenseIndex = DenseIndex(model, kind, **options)
        else:  # binary or int8 codes in memory, re-scored from the embeddings on disk (index.binary)
            compact = compact_kind(settings.embedding_precision, kind)
            rescore = {"rescore_with": settings.rescore_with, "rescore_multiplier": settings.rescore_multiplier}
            index = CompactIndex(model, compact, **rescore, **options)
    index.add_embeddings(corpus, shards.assemble(work_dir / "assembled.npy"))  # cut to settings.dim there
    return index


# What an index build writes in its work directory (``.<output>.encoding``): the shards of the encoding, their
# manifest, the assembled embeddings, the on-disk IVF-PQ's parts, the lock, and densepass's temporaries.
WORK_FILES = (".lock", "shards.json", "rows-*", "assembled.npy*", "ivf-*", ".*.tmp", ".*.partial*")


def check_private_work_dir(work_dir: Path, role: str) -> None:
    """Refuse a work directory beside an output (``role``: what it is for) that is a link, not a directory, another
    user's or writable by anyone: its name is predictable, so in a folder others can write to, someone else's
    would steer densepass's writes. A missing one is fine (densepass makes it)."""
    if (
        work_dir.is_symlink()
        or work_dir.exists()
        and (not work_dir.is_dir() or work_dir.stat().st_uid != os.getuid() or work_dir.stat().st_mode & 0o002)
    ):
        raise ConfigError(
            f"{work_dir}, {role}, is not a private directory of this user "
            "(a link, another user's, or writable by anyone); remove it or choose another --output"
        )


def _work_dir(output: str | Path, force: bool = False) -> tuple[Path, Path]:
    """The output directory (checked, unless ``force`` moves it aside at the save: missing, empty, or an index
    densepass wrote with nothing added since, ``io.check_replaceable``) and the private directory its encoding is
    built in."""
    output = Path(output)
    if output.exists() and not output.is_dir() and not force:
        raise ConfigError(f"--output {output} exists and is not a directory")
    if not force or not _foreign(output):  # (--force moves foreign files aside at the save, and nothing else)
        check_index_target(output)  # densepass's own index alone, before any work
    work_dir = output.with_name(f".{output.name}.encoding")
    check_private_work_dir(work_dir, f"where the encoding of {output} resumes")
    if work_dir.is_dir():  # it is removed whole once the index is saved: it must hold nothing but densepass's work
        foreign = [p.name for p in work_dir.iterdir() if not any(fnmatch.fnmatchcase(p.name, w) for w in WORK_FILES)]
        if foreign:
            raise ConfigError(
                f"{work_dir}, where the encoding of {output} resumes, holds files densepass did not write "
                f"({', '.join(sorted(foreign)[:3])}); move them away or choose another --output"
            )
    return output, work_dir


def _foreign(output: Path) -> bool:
    """Whether ``output`` holds what densepass did not write (``io.check_replaceable``): what ``--force`` moves."""
    try:
        check_replaceable(output)
    except DensepassError:
        return True
    return False


@contextlib.contextmanager
def _locked(work_dir: Path) -> Iterator[None]:
    """``work_dir`` locked for an index build; where the build fails before any passage was encoded there (a
    refusal, a BM25 or model index, which keep nothing to resume), the directory is removed, lock and all."""
    with distributed.rank_zero_lock(work_dir, "index build"):
        try:
            yield
        except BaseException:
            if distributed.rank() == 0 and work_dir.is_dir():
                if all(p.name in (".lock", SHARDS_FILE) for p in work_dir.iterdir()):
                    shutil.rmtree(work_dir, ignore_errors=True)
            raise


def check_not_the_working_directory(output: str | Path) -> Path:
    """``output`` as a path with a name of its own (``.`` or ``x/..`` made absolute); a one-line ConfigError where
    it is the working directory or a folder holding it: replacing it (``--force`` moves it aside) would pull the
    folder the user works in from under them, and its name cannot make the work directory's."""
    output = Path(output)
    if output.name in ("", ".", ".."):
        output = Path(os.path.abspath(output))  # lexically: a link at the end stays a link, as move_aside needs
    try:
        target, here = output.resolve(), Path.cwd().resolve()
    except OSError:  # the working directory was removed: nothing of it to protect
        return output
    if target == here or target in here.parents:
        where = "the working directory" if target == here else "a folder holding the working directory"
        raise ConfigError(
            f"--output {output} is {where} ({target}): densepass never replaces it; name a new folder for the index, "
            "e.g. --output ./index"
        )
    return output


def index_dataset(
    name: str,
    data_dir: str | Path | None,
    format: str,
    output: str | Path,
    settings: IndexSettings,
    force: bool = False,
) -> tuple[Index | None, str]:
    """Index the passages of dataset ``name`` (a corpus file will do: ``data.load_corpus`` reads the passages alone,
    without queries or judgements) into ``output``: ``build_index`` in one process; under torchrun,
    dense kinds only, each process encoding its shard. Returns (the index, on rank 0 (else None); the
    dataset's name). An ``output`` that is, holds or lies in the dataset's or a model's folder is refused
    (``data.paths.check_output_apart``); ``force``: what is at ``output`` that densepass may not replace is moved
    aside (``io.move_aside``, with a warning naming where) instead of refused. The working directory, or a folder
    holding it, is never an output (``check_not_the_working_directory``)."""
    output = check_not_the_working_directory(output)
    check_output_apart(output, name, data_dir, [settings.model, settings.sparse_model])
    if distributed.world_size() == 1:
        corpus, dataset_name = load_corpus(name, data_dir, format, passages_on_disk=True)
        return build_index(corpus, output, settings, force), dataset_name
    if settings.kind not in SHARDED_KINDS:
        raise ConfigError(
            f"under torchrun only dense kinds ({', '.join(SHARDED_KINDS)}) are indexed in shards; "
            f"build a {settings.kind} index in one process"
        )
    output, work_dir = _work_dir(output, force)
    model = BiEncoder.from_pretrained(settings.model)
    sep = model.tokenizer.sep_token or " "
    loaded: dict = {}

    def load() -> tuple[int, str, str]:
        loaded["corpus"], dataset_name = load_corpus(name, data_dir, format, passages_on_disk=True)
        return len(loaded["corpus"]), fingerprint_corpus(loaded["corpus"]), dataset_name

    with _locked(work_dir):
        rows, corpus_fingerprint, dataset_name = distributed.on_rank_zero(load)
        if "corpus" in loaded:
            texts = loaded["corpus"].lazy_inputs(sep)
        else:
            texts = stream_passage_inputs(name, data_dir, format, sep, rows)
            texts = texts if texts is not None else load_corpus(name, data_dir, format)[0].lazy_inputs(sep)
        shards = encode_corpus(model, texts, corpus_fingerprint, work_dir, settings)
        corpus = loaded.get("corpus")
        index = _index_of_shards(model, corpus, corpus_fingerprint, settings.kind, shards, work_dir, settings)
        if index is None:
            return None, dataset_name
        _save(index, output, force)
        shutil.rmtree(work_dir, ignore_errors=True)  # while locked: a process waiting for it starts afresh
    return index, dataset_name


def _save(index: Index, output: Path, force: bool) -> None:
    """Save the built ``index`` to ``output``; ``force``: what is there that densepass may not replace is moved
    aside first (``io.move_aside``, with a warning naming where), now that the index is ready: a command that fails
    on its input or model before that moves nothing."""
    if force:
        moved = move_aside(output)
        if moved is not None:
            warnings.warn(f"moved what was at {output} to {moved}", stacklevel=3)
    index.save(output)


def build_index(corpus: Corpus, output: str | Path, settings: IndexSettings, force: bool = False) -> Index:
    """Index ``corpus`` as ``settings`` say and save it atomically to ``output`` (``force``: as ``index_dataset``
    has it)."""
    output, work_dir = _work_dir(output, force)
    with _locked(work_dir):
        if settings.kind == "bm25":
            index: Index = BM25Index.build(corpus, show_progress=settings.show_progress)
        elif settings.kind in ("splade", "colbert"):
            model = (SpladeEncoder if settings.kind == "splade" else ColBERT).from_pretrained(settings.model)
            if isinstance(model, ColBERT):  # before the corpus is encoded
                model.check_projection_saved()
            index = index_for_model(
                model, corpus, settings.retriever, settings.batch_size, settings.device, precision=settings.precision
            )
        elif settings.kind == "phrase":
            model = PhraseEncoder.from_pretrained(settings.model)
            index = PhraseIndex.build(
                model,
                corpus,
                device=settings.device,
                threshold=settings.threshold,
                show_progress=settings.show_progress,
            )
        else:
            # a hybrid's SPLADE model loads first: a wrong one fails before the corpus is encoded
            sparse = SpladeEncoder.from_pretrained(settings.sparse_model) if settings.sparse_model else None
            model = BiEncoder.from_pretrained(settings.model)
            index = dense_index(model, corpus, settings.encoded_kind, work_dir, settings)
            if settings.kind == "hybrid":
                second: Index = (
                    index_for_model(
                        sparse,
                        corpus,
                        settings.retriever,
                        settings.batch_size,
                        settings.device,
                        precision=part_precision("splade", settings.precision),
                    )
                    if sparse is not None
                    else BM25Index.build(corpus, show_progress=settings.show_progress)
                )
                index = HybridIndex(index, second, settings.fusion, settings.fusion_weight)
        _save(index, output, force)
        shutil.rmtree(work_dir, ignore_errors=True)  # while locked: a process waiting for it starts afresh
    return index
